//! The hostile enrolled site: the real site engine and driver (so it fetches every model and
//! uploads through the same windows as an honest agent) around a worker that trains nothing and
//! answers every round with minus the model it was sent, claiming the most samples the default
//! config allows (the item 1).

use super::Shared;
use anyhow::{Context, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unifed_net::{BrokerConfig, Client, NetEvent, Qos};
use unifed_protocol::encoding::{decode, encode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnPolicy, Chunk, Download, Downloaded, LocalReport, RoundManifest, SiteExtras, SiteUpdate,
};
use unifed_protocol::{ModelSpec, PublicKey, SigningKey, TensorKind};
use unifed_site::driver::BoxError;
use unifed_site::{
    DriverConfig, Evaluate, Evaluation, Event, Note, Outbox, Progress, SiteDriver, SiteEngine,
    WorkError, Worker,
};

/// A worker that keeps the model it is sent as plain vectors and answers each round with
/// minus it (running statistics left alone), claiming `claim` samples.
pub struct Forger {
    spec: ModelSpec,
    federation: Id,
    site: Id,
    claim: u64,
    /// The model, tensor by tensor in spec order, once one was applied.
    model: Vec<Vec<f32>>,
}

impl Forger {
    fn index(&self, name: &str) -> Result<usize, WorkError> {
        self.spec
            .tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| WorkError::Refused(format!("no tensor {name} in the spec")))
    }
}

impl Worker for Forger {
    fn apply(&mut self, _m: &RoundManifest, download: Downloaded) -> Result<(), WorkError> {
        let refused = |e: &dyn std::fmt::Display| WorkError::Refused(e.to_string());
        match download.read().map_err(|e| refused(&e))? {
            Download::Model(b) => {
                self.model = self
                    .spec
                    .tensors
                    .iter()
                    .map(|t| vec![0.0; t.numel()])
                    .collect();
                for t in &b.weights {
                    let i = self.index(&t.name)?;
                    self.model[i] = decode(t).map_err(|e| refused(&e))?;
                }
            }
            Download::Delta(d) => {
                for t in &d.delta {
                    let i = self.index(&t.name)?;
                    let add = decode(t).map_err(|e| refused(&e))?;
                    for (v, a) in self.model[i].iter_mut().zip(add) {
                        *v += a;
                    }
                }
                for t in &d.values {
                    let i = self.index(&t.name)?;
                    self.model[i] = decode(t).map_err(|e| refused(&e))?;
                }
            }
        }
        Ok(())
    }

    fn join(&mut self, _m: &RoundManifest) -> Result<usize, WorkError> {
        Ok(0)
    }

    fn evaluate(&mut self, m: &RoundManifest) -> Result<Evaluation, WorkError> {
        Ok(Evaluation {
            version: m.model_version,
            accuracy: 0.0,
            loss: 0.0,
            validation: None,
            train_loss: None,
            seconds: 0.0,
        })
    }

    fn train(&mut self, m: &RoundManifest, _after: bool) -> Result<Vec<u8>, WorkError> {
        // Every tensor an update carries under the round's policy: minus the model, but for
        // the running statistics (a negative variance is refused outright).
        let delta = self
            .spec
            .tensors
            .iter()
            .zip(&self.model)
            .filter(|(t, _)| m.bn_policy == BnPolicy::Global || !t.kind.is_bn())
            .map(|(t, v)| {
                let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
                let stat = matches!(t.kind, TensorKind::BnRunningMean | TensorKind::BnRunningVar);
                let minus: Vec<f32> = v.iter().map(|x| if stat { 0.0 } else { -x }).collect();
                encode(&t.name, &shape, &minus, m.encoding, None)
            })
            .collect();
        let update = SiteUpdate {
            round: m.round,
            base_version: m.model_version,
            samples: self.claim,
            delta,
            bn: vec![],
            report: LocalReport::default(),
            extras: SiteExtras::None,
        };
        Ok(Envelope::new(
            MessageKind::SiteUpdate,
            self.federation.clone(),
            self.site.clone(),
            m.round,
            m.model_version,
            self.spec.hash(),
            &update,
        )
        .in_run(m.run)
        .encode())
    }

    fn answered(&mut self, _round: u64, _accepted: bool) -> Result<(), WorkError> {
        Ok(())
    }

    fn checkpoint(&mut self, _progress: &Progress) -> Result<(), WorkError> {
        Ok(())
    }
}

/// Sends the driver's messages on the site's connection, and tells the other attacks what it
/// uploaded and what was answered.
struct Sender {
    client: Client,
    runtime: tokio::runtime::Handle,
    shared: Arc<Mutex<Shared>>,
}

impl Outbox for Sender {
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError> {
        // The first chunk of each upload is kept for the replays of item 4.
        if let Ok(e) = Envelope::decode(&payload)
            && e.kind == MessageKind::UpdateChunk
            && e.payload_as::<Chunk>().is_ok_and(|c| c.index == 0)
        {
            let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            s.first_chunks.push(payload.clone());
        }
        self.runtime
            .block_on(self.client.publish(topic, Qos::AtLeastOnce, false, payload))?;
        Ok(())
    }

    fn note(&mut self, note: Note) {
        let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        match note {
            Note::Uploading { .. } => s.tally.forged_updates += 1,
            Note::Answered { round, answer } => s.answers.push((round, format!("{answer:?}"))),
            _ => {}
        }
    }
}

/// What the hostile site needs to join the federation.
pub struct Identity {
    /// Its id (enrolled).
    pub site: Id,
    /// The federation's id.
    pub federation: Id,
    /// Its enrolled key.
    pub key: SigningKey,
    /// The aggregator's key, pinned.
    pub aggregator: PublicKey,
}

/// Runs the hostile site against the broker `broker` until the federation finishes or `stop`
/// turns true: connects, follows every manifest, sends its update each round.
pub async fn run(
    broker: BrokerConfig,
    who: Identity,
    (spec, claim): (ModelSpec, u64),
    shared: Arc<Mutex<Shared>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let engine = SiteEngine::new(
        unifed_site::EngineConfig {
            site: who.site.clone(),
            federation: who.federation.clone(),
            spec_hash: spec.hash(),
            max_packet: broker.max_packet_bytes,
            resend_ms: 30_000,
            max_model_bytes: unifed_protocol::max_broadcast_bytes(&spec),
            key: who.key,
            aggregator: who.aggregator,
        },
        None,
    );
    let options = broker
        .options(&format!("unifed-agent-{}", who.site), None)
        .map_err(anyhow::Error::msg)?;
    let (client, mut rx) = unifed_net::spawn_event_loop(options, engine.subscriptions());
    let worker = Forger {
        spec,
        federation: who.federation,
        site: who.site,
        claim,
        model: Vec::new(),
    };
    let cfg = DriverConfig {
        evaluate: Evaluate::Final,
        calibrate_joiners: false,
    };
    let mut driver = SiteDriver::new(engine, worker, cfg);
    let mut out = Sender {
        client: client.clone(),
        runtime: tokio::runtime::Handle::current(),
        shared,
    };
    // The driver blocks on its sends: it runs on a thread of its own, fed by this task.
    let (tx, events) = std::sync::mpsc::channel::<Event>();
    let driving = std::thread::Builder::new()
        .name("hostile site".into())
        .spawn(move || -> Result<()> {
            let t0 = Instant::now();
            loop {
                let event = match events.recv_timeout(Duration::from_millis(500)) {
                    Ok(e) => e,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Event::Tick,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                };
                let now = t0.elapsed().as_millis() as u64;
                if driver.handle(event, now, &mut out)?.is_some() {
                    return Ok(());
                }
            }
        })
        .context("starting the hostile site's driver")?;
    loop {
        let ev = tokio::select! {
            _ = stop.changed() => break,
            ev = rx.recv() => ev,
        };
        let event = match ev {
            None => break,
            Some(NetEvent::Connected) => Event::Connected,
            Some(NetEvent::Message { topic, payload }) => Event::Message { topic, payload },
            Some(_) => continue,
        };
        if tx.send(event).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = client.disconnect().await;
    tokio::task::spawn_blocking(move || driving.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the hostile site's driver panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::encoding::Encoding;
    use unifed_protocol::messages::{
        BnSharing, ModelDelta, RoundPlan, ServerBroadcast, ServerExtras,
    };
    use unifed_protocol::{Input, Scaling, TensorSpec};

    fn spec() -> ModelSpec {
        let t = |name: &str, n: usize, kind| TensorSpec {
            name: name.into(),
            shape: vec![n],
            kind,
        };
        ModelSpec {
            architecture: "test".into(),
            tensors: vec![
                t("conv.weight", 3, TensorKind::NonBn),
                t("bn.weight", 2, TensorKind::BnWeight),
                t("bn.running_var", 2, TensorKind::BnRunningVar),
            ],
            classes: vec!["a".into(), "b".into()],
            input: Input::Image {
                channels: 1,
                height: 2,
                width: 2,
                scaling: Scaling::MinusOneToOne,
            },
        }
    }

    fn manifest(round: u64, bn_policy: BnPolicy) -> RoundManifest {
        RoundManifest {
            run: Default::default(),
            round,
            model_version: round - 1,
            spec_hash: spec().hash(),
            chunk_count: 1,
            payload_len: 0,
            payload_hash: [0; 32],
            delta: None,
            encoding: unifed_protocol::encoding::Encoding::F32,
            bn_policy,
            bn_sharing: BnSharing::None,
            sampled: vec![],
            upload_window_bytes: 1 << 20,
            plan: RoundPlan::default(),
            deadline_ms: 0,
            finished: false,
        }
    }

    fn f32s(name: &str, v: &[f32]) -> unifed_protocol::EncodedTensor {
        encode(name, &[v.len() as u32], v, Encoding::F32, None)
    }

    /// The forger follows the model it is sent (whole, then a delta with new running
    /// statistics) and answers with minus it at the claim it was given: the non-BN tensors
    /// under local BN, every tensor but the running statistics (left at 0) under global BN.
    #[test]
    fn the_forger_answers_each_round_with_minus_the_model_it_holds_at_its_claim() {
        let mut f = Forger {
            spec: spec(),
            federation: Id::new("fed").unwrap(),
            site: Id::new("mallory").unwrap(),
            claim: 10_000_000,
            model: Vec::new(),
        };
        let whole = ServerBroadcast {
            model_version: 0,
            weights: vec![
                f32s("conv.weight", &[1.0, -2.0, 3.0]),
                f32s("bn.weight", &[1.0, 1.0]),
                f32s("bn.running_var", &[1.0, 1.0]),
            ],
            extras: ServerExtras::None,
        };
        let bytes = postcard::to_allocvec(&whole).unwrap();
        f.apply(
            &manifest(1, BnPolicy::Local),
            Downloaded::new(bytes, false).unwrap(),
        )
        .unwrap();
        let delta = ModelDelta {
            from_version: 0,
            model_version: 1,
            delta: vec![
                f32s("conv.weight", &[0.5, 0.5, 0.5]),
                f32s("bn.weight", &[0.25, 0.0]),
            ],
            values: vec![f32s("bn.running_var", &[2.0, 3.0])],
            extras: ServerExtras::None,
        };
        let bytes = postcard::to_allocvec(&delta).unwrap();
        f.apply(
            &manifest(2, BnPolicy::Global),
            Downloaded::new(bytes, true).unwrap(),
        )
        .unwrap();
        assert_eq!(
            f.model,
            [vec![1.5, -1.5, 3.5], vec![1.25, 1.0], vec![2.0, 3.0]]
        );
        let mut update = |bn| {
            let bytes = f.train(&manifest(2, bn), false).unwrap();
            let e = Envelope::decode(&bytes).unwrap();
            assert_eq!(
                (e.kind, e.round, e.model_version),
                (MessageKind::SiteUpdate, 2, 1)
            );
            let u: SiteUpdate = e.payload_as().unwrap();
            assert_eq!((u.samples, u.base_version), (10_000_000, 1));
            u.delta
                .iter()
                .map(|t| (t.name.clone(), decode(t).unwrap()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            update(BnPolicy::Local),
            [("conv.weight".to_string(), vec![-1.5, 1.5, -3.5])]
        );
        assert_eq!(
            update(BnPolicy::Global),
            [
                ("conv.weight".to_string(), vec![-1.5, 1.5, -3.5]),
                ("bn.weight".to_string(), vec![-1.25, -1.0]),
                ("bn.running_var".to_string(), vec![0.0, 0.0]),
            ]
        );
    }
}
