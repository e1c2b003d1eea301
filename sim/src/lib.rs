//! In-process federation: the aggregator core and one site engine per site (the MQTT agent's
//! engine, so one client round and one seed rule), each site with its own model and BN state,
//! exchanging the same encoded messages the network carries (envelopes, manifests, model chunks
//! on request, postcard updates, answers) over an in-memory transport. The experiment runner of
//! the algorithm suite grows from here.

pub mod chart;
pub mod experiment;
pub mod heap;
pub mod ingest;
pub mod memory;

use anyhow::{Context, Result, anyhow, bail};
use std::collections::VecDeque;
use std::time::Instant;
use unifed_aggregator::serving::{Route, Serving, To};
use unifed_aggregator::{
    Action, Aggregator, Arrival, EnrolledSite, Event, FederationConfig, GlobalModel, Incoming,
};
use unifed_models::backend::Device;
use unifed_models::data::Dataset;
pub use unifed_models::site::{Site, select_for};
use unifed_models::train::TrainConfig;
use unifed_models::worker::{Host, ModelWorker, WorkerConfig};
use unifed_models::zoo::Net;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::messages::{Answer, ChunkRequest, Payload, RoundManifest, UpdateAnswer};
use unifed_protocol::topics::Topics;
use unifed_protocol::{Cut, max_broadcast_bytes};
pub use unifed_site::Evaluation;
use unifed_site::driver::BoxError;
use unifed_site::{
    DriverConfig, EngineConfig, Evaluate, Event as SiteEvent, Note, Outbox, SiteDriver, SiteEngine,
};

/// What a federation run did in one round.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundRecord {
    /// The round.
    pub round: u64,
    /// Each site's test accuracy after the round (its model = new global + its BN under `local`).
    pub accuracy: Vec<f64>,
    /// Each site's validation accuracy after the round, when the sites have validation splits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub validation: Vec<f64>,
    /// Each site's mean test cross-entropy after the round.
    #[serde(default)]
    pub test_loss: Vec<f64>,
    /// Each site's training loss (its last local epoch's mean cross-entropy) in the round, for
    /// the sites that trained in it.
    #[serde(default)]
    pub train_loss: Vec<Option<f64>>,
    /// Bytes of each site's update message.
    pub update_bytes: Vec<usize>,
    /// Bytes of the broadcast model payload.
    pub model_bytes: usize,
    /// Bytes each site fetched to apply the round's model (the delta's under a lossy
    /// encoding, the whole model's otherwise).
    #[serde(default)]
    pub download_bytes: Vec<usize>,
    /// Wall seconds of the round (training, aggregation, evaluation).
    pub seconds: f64,
    /// The plan of the rounds the new model was announced for (how sites deploy it: Per-FedAvg
    /// personalises before it evaluates).
    #[serde(default)]
    pub plan: unifed_protocol::messages::RoundPlan,
}

/// Messages a run passed, lent to the observer, for tests that check what crossed the transport.
#[derive(Debug, Clone, Copy)]
pub enum Observed<'a> {
    /// A site's encoded update.
    Update {
        /// The site.
        site: &'a str,
        /// The envelope bytes.
        bytes: &'a [u8],
    },
    /// The reassembled broadcast payload of a model version.
    Model {
        /// The model version.
        version: u64,
        /// The payload bytes.
        payload: &'a [u8],
    },
}

/// The full-size digits CNN (FedBN's), seeded as every site's, on the CPU, and its spec: the
/// model the aggregator benchmarks measure.
pub fn full_size_digits()
-> anyhow::Result<(unifed_models::zoo::DigitsCnn, unifed_protocol::ModelSpec)> {
    use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, seeded, spec_of};
    let device = unifed_models::backend::Backend::Flex
        .device()
        .map_err(anyhow::Error::msg)?;
    let mc = ModelConfig::fedbn_digits();
    let net = seeded(&device, 0, |d| DigitsCnnConfig::default().init(d));
    let spec = spec_of(&net, &mc.classes, &mc.input);
    Ok((net, spec))
}

/// The global model of version 0 taken from `net`: every tensor of `spec`, in spec order.
pub fn initial_model<N: Net>(net: &N, spec: &unifed_protocol::ModelSpec) -> GlobalModel {
    GlobalModel {
        spec: spec.clone(),
        tensors: unifed_models::state::export(net, spec, unifed_models::state::Select::All)
            .tensors
            .into_iter()
            .map(|t| t.data)
            .collect(),
    }
}

/// The signing key of `who` in an in-process run, derived from its id: every message crosses
/// the in-memory transport signed and is checked as on the network, but nothing leaves the
/// process, so the keys need no secrecy.
pub fn sim_key(who: &str) -> SigningKey {
    use sha2::Digest;
    SigningKey::from_seed(sha2::Sha256::digest(format!("unifed-sim key of {who}")).into())
}

/// What a caller of [`run_federation`] hears while it runs. Every method does nothing by
/// default.
pub trait Observer<N: Net> {
    /// A message the run passed.
    fn message(&mut self, _o: Observed<'_>) {}
    /// A site evaluated the model it applied (`e.version`), which `site` holds now.
    fn evaluated(&mut self, _site: &Site<N>, _e: &Evaluation) {}
    /// Every site evaluated a new model: the round's record.
    fn round(&mut self, _record: &RoundRecord) {}
}

/// An observer that hears nothing.
impl<N: Net> Observer<N> for () {}

/// An observer that hears only each round's record.
pub struct OnRound<F>(pub F);

impl<N: Net, F: FnMut(&RoundRecord)> Observer<N> for OnRound<F> {
    fn round(&mut self, record: &RoundRecord) {
        (self.0)(record)
    }
}

/// The observer every site's host shares with the run.
type Shared<'o, N> = std::rc::Rc<std::cell::RefCell<&'o mut dyn Observer<N>>>;

/// An in-process site's host: it hands each evaluated model to the run's observer.
struct SimHost<'o, N: Net> {
    observer: Shared<'o, N>,
}

impl<N: Net> Host<N> for SimHost<'_, N> {
    fn evaluated(&mut self, site: &Site<N>, e: &Evaluation) {
        self.observer.borrow_mut().evaluated(site, e);
    }
}

/// One in-process site: its driver over its model.
type SimDriver<'o, N> = SiteDriver<ModelWorker<N, SimHost<'o, N>>>;

/// The sites of an in-process run, with their drivers' settings.
pub struct Sites<'a, N: Net> {
    /// The sites (each given back holding the final model).
    pub sites: &'a mut Vec<Site<N>>,
    /// One validation split per site, evaluated with every model beside its test split, or
    /// none.
    pub validation: Vec<Dataset>,
    /// Local training settings.
    pub train: &'a TrainConfig,
    /// The device the sites compute on.
    pub device: &'a Device,
}

/// Runs a federation of `sites` under `cfg` from `initial` in a fresh data directory, telling
/// `observer` what it passes. Returns one record per model version after the initial one.
///
/// Each site is the MQTT agent's: the same [`SiteDriver`] and [`ModelWorker`] over an in-memory
/// transport that plays the aggregator service's part: it serves model chunks on request and
/// carries manifests, updates and answers as the encoded envelopes the broker would, signed.
/// A site whose training diverges sends nothing for the round, as an agent does; a round that
/// waits for it closes at its deadline (the run's clock jumps there when nothing else moves).
/// `cfg`'s enrolment is replaced by `sites`, each with its [`sim_key`].
pub fn run_federation<N: Net>(
    mut cfg: FederationConfig,
    initial: GlobalModel,
    mut sites: Sites<'_, N>,
    observer: &mut dyn Observer<N>,
) -> Result<Vec<RoundRecord>> {
    let dir = tempfile::tempdir()?;
    let spec = initial.spec.clone();
    let federation = Id::new(&cfg.federation).map_err(|e| anyhow!("{e}"))?;
    cfg.sites = sites
        .sites
        .iter()
        .map(|s| EnrolledSite::new(s.id.as_str(), sim_key(s.id.as_str()).public()))
        .collect();
    let deadline_ms = cfg.deadline_secs.saturating_mul(1000);
    let mut bus = Bus::new(&federation, &spec, &cfg, sites.sites)?;
    let mut agg = Aggregator::open(dir.path(), cfg, initial, 256 << 10)?;
    let observer: Shared<'_, N> = std::rc::Rc::new(std::cell::RefCell::new(observer));
    let mut drivers = drivers(&federation, &spec, &bus, &mut sites, &observer)?;
    let mut records = Records::new(drivers.len());
    let mut agg_actions = agg.handle(Event::Start, 0)?;
    loop {
        bus.take_actions(&mut agg, &mut agg_actions, &mut records, &observer)?;
        if !agg_actions.is_empty() {
            continue;
        }
        if let Some(up) = bus.updates.pop_front() {
            bus.now += 1;
            agg_actions = agg.handle(Event::Update(up), bus.now)?;
            continue;
        }
        if bus.inbox.is_empty() {
            // Nothing else moves: first requests gathered from fewer than every site go now.
            let due = bus.serving.due(u64::MAX);
            bus.share_due(due)?;
        }
        let Some((k, event)) = bus.inbox.pop_front() else {
            if drivers.iter().all(|d| d.finished().is_some()) {
                break;
            }
            // A round waits for an update that will not come: its deadline passes.
            bus.now = bus.now.saturating_add(deadline_ms + 1);
            agg_actions = agg.handle(Event::Tick, bus.now)?;
            if agg_actions.is_empty() {
                bail!("the federation stalled: no message in flight and not every site finished");
            }
            continue;
        };
        let now = bus.now;
        let mut out = SimOutbox {
            k,
            bus: &mut bus,
            records: &mut records,
            observer: &observer,
        };
        drivers[k]
            .handle(event, now, &mut out)
            .with_context(|| format!("site {}", bus.ids[k]))?;
        records.complete(&observer);
    }
    for d in drivers {
        sites.sites.push(d.into_worker().into_site()?);
    }
    Ok(records.done)
}

/// Every site's driver, taking the sites out of `sites` (they come back when the run ends).
fn drivers<'o, N: Net>(
    federation: &Id,
    spec: &unifed_protocol::ModelSpec,
    bus: &Bus,
    sites: &mut Sites<'_, N>,
    observer: &Shared<'o, N>,
) -> Result<Vec<SimDriver<'o, N>>> {
    let taken = std::mem::take(sites.sites);
    if !sites.validation.is_empty() && sites.validation.len() != taken.len() {
        bail!(
            "{} validation splits for {} sites",
            sites.validation.len(),
            taken.len()
        );
    }
    Ok(taken
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let engine = SiteEngine::new(
                EngineConfig {
                    site: s.id.clone(),
                    federation: federation.clone(),
                    spec_hash: spec.hash(),
                    // In memory every update goes whole, and nothing is re-sent.
                    max_packet: usize::MAX >> 8,
                    resend_ms: u64::MAX >> 8,
                    max_model_bytes: max_broadcast_bytes(spec),
                    key: sim_key(s.id.as_str()),
                    aggregator: bus.wire.key.public(),
                },
                None,
            );
            let worker = ModelWorker::new(
                s,
                WorkerConfig {
                    federation: federation.clone(),
                    spec: spec.clone(),
                    train: sites.train.clone(),
                    device: sites.device.clone(),
                    validation: sites.validation.get(k).cloned(),
                },
                SimHost {
                    observer: observer.clone(),
                },
            );
            SiteDriver::new(
                engine,
                worker,
                DriverConfig {
                    evaluate: Evaluate::EveryTrainedModel,
                    calibrate_joiners: true,
                },
            )
        })
        .collect())
}

/// The round records of a run: each site's evaluation of each model version, and what its
/// sites sent and fetched, until every site evaluated a version.
struct Records {
    done: Vec<RoundRecord>,
    /// Each version's evaluations, one slot per site, and its plan once published.
    evaluated: std::collections::BTreeMap<u64, Vec<Option<Evaluation>>>,
    plans: std::collections::BTreeMap<u64, unifed_protocol::messages::RoundPlan>,
    update_bytes: Vec<usize>,
    download_bytes: Vec<usize>,
    model_bytes: usize,
    recorded: u64,
    t0: Instant,
}

impl Records {
    fn new(sites: usize) -> Self {
        Records {
            done: Vec::new(),
            evaluated: Default::default(),
            plans: Default::default(),
            update_bytes: vec![0; sites],
            download_bytes: vec![0; sites],
            model_bytes: 0,
            recorded: 0,
            t0: Instant::now(),
        }
    }

    /// Records every version past the last recorded one that every site has evaluated.
    fn complete<N: Net>(&mut self, observer: &Shared<'_, N>) {
        while let Some(evals) = self
            .evaluated
            .get(&(self.recorded + 1))
            .filter(|e| e.iter().all(Option::is_some))
        {
            let v = self.recorded + 1;
            let evals: Vec<&Evaluation> = evals.iter().flatten().collect();
            let rec = RoundRecord {
                round: v,
                accuracy: evals.iter().map(|e| e.accuracy).collect(),
                test_loss: evals.iter().map(|e| e.loss).collect(),
                train_loss: evals.iter().map(|e| e.train_loss).collect(),
                validation: evals.iter().filter_map(|e| e.validation).collect(),
                update_bytes: self.update_bytes.clone(),
                model_bytes: self.model_bytes,
                download_bytes: self.download_bytes.clone(),
                seconds: self.t0.elapsed().as_secs_f64(),
                plan: self.plans.get(&v).cloned().unwrap_or_default(),
            };
            self.evaluated.remove(&v);
            self.recorded = v;
            observer.borrow_mut().round(&rec);
            self.done.push(rec);
            self.t0 = Instant::now();
        }
    }
}

/// A site's side of the in-memory transport.
struct SimOutbox<'a, 'o, N: Net> {
    k: usize,
    bus: &'a mut Bus,
    records: &'a mut Records,
    observer: &'a Shared<'o, N>,
}

impl<N: Net> Outbox for SimOutbox<'_, '_, N> {
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError> {
        let site = self.bus.ids[self.k].clone();
        if topic == self.bus.topics.chunk_request(&site) {
            Ok(self.bus.serve(self.k, &payload)?)
        } else if topic == self.bus.topics.update(&site) {
            self.observer.borrow_mut().message(Observed::Update {
                site: site.as_str(),
                bytes: &payload,
            });
            self.bus.updates.push_back(Incoming {
                site: site.to_string(),
                bytes: payload.into(),
                arrival: Arrival::Message,
                staged: None,
            });
            Ok(())
        } else {
            Err(format!("a site published on an unexpected topic `{topic}`").into())
        }
    }

    fn note(&mut self, note: Note) {
        let k = self.k;
        match note {
            Note::Uploading { bytes, .. } => self.records.update_bytes[k] = bytes as usize,
            Note::Applied { bytes, .. } => self.records.download_bytes[k] = bytes as usize,
            Note::Evaluated(e) => {
                let n = self.records.update_bytes.len();
                let slots = self.records.evaluated.entry(e.version).or_default();
                slots.resize(n, None);
                slots[k] = Some(e);
            }
            Note::Answered {
                round,
                answer: Answer::Rejected(r),
            } => tracing::warn!(site = %self.bus.ids[k], round, "update rejected: {r:?}"),
            _ => {}
        }
    }
}

/// The in-memory transport: what is on its way to the sites and to the aggregator, and what
/// the aggregator serves.
struct Bus {
    /// Messages and events on their way to each site (by index), in order.
    inbox: VecDeque<(usize, SiteEvent)>,
    /// Updates on their way to the aggregator.
    updates: VecDeque<Incoming>,
    wire: Wire,
    topics: Topics,
    ids: Vec<Id>,
    keyring: unifed_protocol::auth::Keyring,
    served: Option<ServedModel>,
    /// Chunks go the ways the MQTT service sends them: once for every site, or to one alone;
    /// first requests are gathered until every site asked or nothing else moves.
    serving: Serving,
    /// The run's clock: one tick per update, a deadline's jump when nothing moves.
    now: u64,
}

impl Bus {
    fn new<N: Net>(
        federation: &Id,
        spec: &unifed_protocol::ModelSpec,
        cfg: &FederationConfig,
        sites: &[Site<N>],
    ) -> Result<Self> {
        Ok(Bus {
            inbox: VecDeque::new(),
            updates: VecDeque::new(),
            wire: Wire {
                federation: federation.clone(),
                me: Id::new(AGGREGATOR_ID).map_err(|e| anyhow!("{e}"))?,
                hash: spec.hash(),
                key: sim_key(AGGREGATOR_ID),
            },
            topics: Topics::new(federation),
            ids: sites.iter().map(|s| s.id.clone()).collect(),
            keyring: cfg.keyring(),
            served: None,
            serving: Serving::new(sites.len(), u64::MAX),
            now: 0,
        })
    }

    /// Does the aggregator's actions: manifests and answers to the sites' inboxes, and the
    /// fold once the answers before it are out (its actions go back in `actions`).
    fn take_actions<N: Net>(
        &mut self,
        agg: &mut Aggregator,
        actions: &mut Vec<Action>,
        records: &mut Records,
        observer: &Shared<'_, N>,
    ) -> Result<()> {
        let mut close = false;
        for action in std::mem::take(actions) {
            match action {
                // The answers before it are in the sites' inboxes: now the fold.
                Action::Close => close = true,
                Action::Answer {
                    site,
                    round,
                    update_hash,
                    answer,
                } => {
                    let k = self
                        .ids
                        .iter()
                        .position(|s| *s == site)
                        .context("an answer for an unknown site")?;
                    let bytes = self.wire.envelope(
                        MessageKind::UpdateAnswer,
                        round,
                        agg.model_version(),
                        &UpdateAnswer {
                            round,
                            update_hash,
                            answer,
                        },
                    );
                    let topic = self.topics.ack(&site);
                    self.send_to(k, topic, bytes.into());
                }
                Action::Publish {
                    manifest,
                    model,
                    delta,
                } => {
                    // Chunks are served one at a time over the round: the payload is held.
                    let model = model.into_held();
                    observer.borrow_mut().message(Observed::Model {
                        version: manifest.model_version,
                        payload: &model.bytes(),
                    });
                    records.model_bytes = model.len();
                    records.plans.insert(manifest.model_version, manifest.plan);
                    let bytes: bytes::Bytes = self
                        .wire
                        .envelope(
                            MessageKind::RoundManifest,
                            manifest.round,
                            manifest.model_version,
                            &manifest,
                        )
                        .into();
                    for k in 0..self.ids.len() {
                        self.send_to(k, self.topics.manifest(), bytes.clone());
                    }
                    self.served = Some((manifest, model, delta.map(|d| *d)));
                    self.serving.clear();
                }
                Action::RoundClosed { .. } | Action::Finished { .. } => {}
            }
        }
        if close {
            *actions = agg.handle(Event::Close, self.now)?;
        }
        Ok(())
    }

    fn send_to(&mut self, k: usize, topic: String, payload: bytes::Bytes) {
        self.inbox
            .push_back((k, SiteEvent::Message { topic, payload }));
    }

    /// Serves site `k`'s chunk request `payload` as the service would.
    fn serve(&mut self, k: usize, payload: &[u8]) -> Result<()> {
        let site = self.ids[k].clone();
        let req: ChunkRequest = self.keyring.open(payload, usize::MAX)?.payload_as()?;
        let Some((m, model, delta)) = &self.served else {
            return Ok(());
        };
        if m.model_version != req.model_version {
            return Ok(());
        }
        let cut = match req.payload {
            Payload::Model => model,
            Payload::Delta => delta.as_ref().context("no delta was published")?,
            Payload::Package => bail!("the in-process run serves no packages"),
        };
        for i in req.indices {
            cut.chunk(i).context("a chunk out of range")?;
            let to: Vec<(usize, String)> = match self.serving.route(
                &site,
                (req.model_version, req.payload),
                (i as usize, cut.count() as usize),
                req.alone,
                self.now,
            ) {
                Route::Shared => (0..self.ids.len())
                    .map(|j| (j, self.topics.model_chunks()))
                    .collect(),
                Route::Site => vec![(k, self.topics.chunk_reply(&site))],
                Route::OnItsWay | Route::Gathered | Route::Refused => Vec::new(),
            };
            deliver(&mut self.inbox, &self.wire, m, cut, &[i], &to);
        }
        let due = self.serving.due(self.now);
        self.share_due(due)
    }

    /// Delivers what [`Serving::due`] sends: to every site (in `ids`' order), or to one alone.
    fn share_due(&mut self, due: Vec<((u64, Payload), To, Vec<u32>)>) -> Result<()> {
        share_due(
            &mut self.inbox,
            &self.wire,
            (&self.topics, &self.ids),
            self.served.as_ref(),
            due,
        )
    }
}

/// A model version as served: its manifest, and its payload and delta cut into chunks.
type ServedModel = (RoundManifest, Cut, Option<Cut>);

/// Puts chunks `indices` of `cut`, a payload `m` announces, into the inboxes `to` names.
fn deliver(
    inbox: &mut VecDeque<(usize, SiteEvent)>,
    wire: &Wire,
    m: &RoundManifest,
    cut: &Cut,
    indices: &[u32],
    to: &[(usize, String)],
) {
    for c in indices.iter().filter_map(|&i| cut.chunk(i)) {
        let payload: bytes::Bytes = wire
            .envelope(MessageKind::ModelChunk, m.round, m.model_version, &c)
            .into();
        for (j, topic) in to {
            inbox.push_back((
                *j,
                SiteEvent::Message {
                    topic: topic.clone(),
                    payload: payload.clone(),
                },
            ));
        }
    }
}

/// Delivers what [`Serving::due`] sends: to every site (in `ids`' order), or to one alone.
fn share_due(
    inbox: &mut VecDeque<(usize, SiteEvent)>,
    wire: &Wire,
    (topics, ids): (&Topics, &[Id]),
    served: Option<&ServedModel>,
    due: Vec<((u64, Payload), To, Vec<u32>)>,
) -> Result<()> {
    for ((version, payload), to, indices) in due {
        let Some((m, model, delta)) = served.filter(|s| s.0.model_version == version) else {
            continue;
        };
        let cut = match payload {
            Payload::Model => model,
            Payload::Delta => delta.as_ref().context("no delta was published")?,
            Payload::Package => continue,
        };
        let to: Vec<(usize, String)> = match to {
            To::All => (0..ids.len()).map(|j| (j, topics.model_chunks())).collect(),
            To::Site(site) => ids
                .iter()
                .position(|s| *s == site)
                .map(|k| (k, topics.chunk_reply(&site)))
                .into_iter()
                .collect(),
        };
        deliver(inbox, wire, m, cut, &indices, &to);
    }
    Ok(())
}

/// The aggregator's side of the in-memory transport: its envelopes.
struct Wire {
    federation: Id,
    me: Id,
    hash: unifed_protocol::SpecHash,
    key: SigningKey,
}

impl Wire {
    fn envelope<T: serde::Serialize>(
        &self,
        kind: MessageKind,
        round: u64,
        version: u64,
        payload: &T,
    ) -> Vec<u8> {
        self.key.sign(&Envelope::new(
            kind,
            self.federation.clone(),
            self.me.clone(),
            round,
            version,
            self.hash,
            payload,
        ))
    }
}
