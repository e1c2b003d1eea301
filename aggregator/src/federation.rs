//! The aggregator's driver without I/O: the core ([`Aggregator`]) with everything the service
//! and the in-process runner both do around it. It turns the core's actions into signed
//! messages (answers, the retained manifest, the round model's chunks sealed once per version),
//! serves chunk requests the ways [`crate::serving`] routes them, and builds onboarding packages
//! once per version. The caller only carries the [`Outgoing`] messages and reports the
//! [`Done`] events: `unifed-aggregator serve` on MQTT, `unifed-sim` over an in-memory bus.
//!
//! One sequence matters for speed and is kept here once: a step that asks for the fold
//! ([`Step::close`]) returns the answers before it, the caller sends them, and only then hands
//! [`Federation::close`]: the last update's site checkpoints while the aggregator folds.

use crate::core::{Action, Aggregator, CoreError, Event};
use crate::serving::{Route, Serving, To};
use bytes::Bytes;
use serde::Serialize;
use std::time::Instant;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::messages::{
    ChunkRequest, OnboardError, PackageInfo, Payload, RoundManifest, UpdateAnswer,
};
use unifed_protocol::topics::Topics;
use unifed_protocol::{Cut, SpecHash};

/// A chunk request names at most this many chunks: a request cannot make the aggregator flood
/// the broker.
pub const MAX_CHUNKS_PER_REQUEST: usize = 64;

/// A message to send: QoS 1, retained when `retain`.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    /// The topic.
    pub topic: String,
    /// The signed envelope.
    pub payload: Bytes,
    /// Whether the broker keeps it for later subscribers (the manifest).
    pub retain: bool,
}

/// Something the federation did, for the caller to report.
#[derive(Debug, Clone, PartialEq)]
pub enum Done {
    /// A new model version was published: its manifest is out and its chunks sealed.
    Published {
        /// Its manifest.
        manifest: Box<RoundManifest>,
        /// Chunks of the whole model.
        chunks: u32,
        /// Bytes of the whole model's payload.
        bytes: u64,
        /// Seconds sealing its chunks took.
        seconds: f64,
        /// The payload itself, when the federation keeps payloads ([`Federation::keep_payloads`]).
        payload: Option<Bytes>,
    },
    /// A round closed with the updates of `sites`, giving model `model_version`.
    RoundClosed {
        /// The round.
        round: u64,
        /// Sites folded in, in site order.
        sites: Vec<String>,
        /// The new model version.
        model_version: u64,
    },
    /// Every round has run.
    Finished {
        /// The final model version.
        model_version: u64,
    },
}

/// What one turn of the federation gives: messages to send in order, what it did, and whether
/// the core asks for the fold once they are sent ([`Federation::close`]).
#[derive(Debug, Default)]
pub struct Step {
    /// Messages to send, in order.
    pub send: Vec<Outgoing>,
    /// What the federation did.
    pub done: Vec<Done>,
    /// Send `send`, then call [`Federation::close`].
    pub close: bool,
}

/// The aggregator's key and identity: every message it sends is signed with it.
#[derive(Clone)]
pub struct Sealer {
    federation: Id,
    me: Id,
    hash: SpecHash,
    key: SigningKey,
    /// The run its envelopes name ([`Federation::new`] sets its core's).
    run: unifed_protocol::RunId,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("federation", &self.federation)
            .finish()
    }
}

impl Sealer {
    /// The sealer of the aggregator of `federation`, for models of spec `hash`.
    pub fn new(federation: Id, hash: SpecHash, key: SigningKey) -> Self {
        Sealer {
            federation,
            me: Id::new(AGGREGATOR_ID).expect("the aggregator's id is valid"),
            hash,
            key,
            run: unifed_protocol::RunId::default(),
        }
    }

    /// `payload` of `kind` in a signed envelope naming `(round, version)`.
    pub fn seal(
        &self,
        kind: MessageKind,
        (round, version): (u64, u64),
        payload: &impl Serialize,
    ) -> Vec<u8> {
        let unsigned = Envelope::encode_new(
            kind,
            &self.federation,
            &self.me,
            (self.run, round, version),
            self.hash,
            payload,
        );
        self.key
            .sign_encoded(unsigned)
            .expect("encode_new writes an unsigned envelope")
    }

    /// Every chunk of `cut` in its signed envelope, sealed into one shared buffer.
    pub fn seal_chunks(&self, (round, version): (u64, u64), cut: &Cut) -> Vec<Bytes> {
        let mut buf = Vec::with_capacity(cut.len() + cut.count() as usize * 1024);
        let mut ends = Vec::with_capacity(cut.count() as usize);
        cut.for_each_chunk(|c| {
            let start = buf.len();
            Envelope::append_new(
                &mut buf,
                MessageKind::ModelChunk,
                &self.federation,
                &self.me,
                (self.run, round, version),
                self.hash,
                &c,
            );
            self.key
                .sign_tail(&mut buf, start)
                .expect("append_new writes an unsigned envelope");
            ends.push(buf.len());
        });
        let all = Bytes::from(buf);
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let b = all.slice(start..end);
                start = end;
                b
            })
            .collect()
    }
}

/// The round model as served: its manifest, and its chunks and its delta's sealed.
struct Served {
    manifest: RoundManifest,
    chunks: Vec<Bytes>,
    delta_chunks: Vec<Bytes>,
}

impl Served {
    fn chunks_of(&self, (version, payload): (u64, Payload)) -> Option<&[Bytes]> {
        match payload {
            _ if version != self.manifest.model_version => None,
            Payload::Model => Some(&self.chunks),
            Payload::Delta => Some(&self.delta_chunks),
            Payload::Package => None,
        }
    }
}

/// An onboarding package built for a version, kept until another is asked for.
struct Package {
    info: PackageInfo,
    chunks: Vec<Bytes>,
}

/// The aggregator's driver: the core, the served model and the routing of its chunks.
pub struct Federation {
    core: Aggregator,
    sealer: Sealer,
    topics: Topics,
    served: Option<Served>,
    serving: Serving,
    package: Option<Package>,
    keep_payloads: bool,
}

impl std::fmt::Debug for Federation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Federation")
            .field("version", &self.core.model_version())
            .finish()
    }
}

impl Federation {
    /// The driver of `core`, signing with `sealer`; chunk requests are gathered for
    /// `gather_ms` (see [`Serving::new`]).
    pub fn new(core: Aggregator, mut sealer: Sealer, gather_ms: u64) -> Self {
        sealer.run = core.run();
        let sites = core.config().sites.len();
        let mut serving = Serving::new(sites, gather_ms);
        // A revoked site may still be connected to the broker and read the shared topic
        // (brokers' ACLs do not follow the revocation list): while any key is revoked, each
        // site is sent its chunks alone, and a revoked one none.
        serving.set_sharing(core.config().revoked.is_empty());
        Federation {
            topics: Topics::new(&sealer.federation),
            core,
            sealer,
            served: None,
            serving,
            package: None,
            keep_payloads: false,
        }
    }

    /// Keeps each published model's payload in [`Done::Published`] (for a caller that looks at
    /// what crossed the transport).
    pub fn keep_payloads(mut self) -> Self {
        self.keep_payloads = true;
        self
    }

    /// The core.
    pub fn core(&self) -> &Aggregator {
        &self.core
    }

    /// The core, to change (the revocation list).
    pub fn core_mut(&mut self) -> &mut Aggregator {
        &mut self.core
    }

    /// The sealer.
    pub fn sealer(&self) -> &Sealer {
        &self.sealer
    }

    /// The topics of the federation.
    pub fn topics(&self) -> &Topics {
        &self.topics
    }

    /// Shares chunks on the topic every site reads, or sends each site its own (while a key
    /// is revoked).
    pub fn set_sharing(&mut self, share: bool) {
        self.serving.set_sharing(share);
    }

    /// Hands the core `event` at `now_ms` and does its actions.
    pub fn handle(&mut self, event: Event, now_ms: u64) -> Result<Step, CoreError> {
        let actions = self.core.handle(event, now_ms)?;
        Ok(self.act(actions))
    }

    /// Folds the round a [`Step::close`] asked for, once its answers are sent.
    pub fn close(&mut self, now_ms: u64) -> Result<Step, CoreError> {
        self.handle(Event::Close, now_ms)
    }

    /// The retained manifest again (after a reconnect, or now and then for late subscribers).
    pub fn manifest(&self) -> Option<Outgoing> {
        let m = &self.served.as_ref()?.manifest;
        Some(self.manifest_message(m))
    }

    /// When gathered chunk requests fall due ([`Serving::deadline`]).
    pub fn deadline(&self) -> Option<u64> {
        self.serving.deadline()
    }

    fn manifest_message(&self, m: &RoundManifest) -> Outgoing {
        Outgoing {
            topic: self.topics.manifest(),
            payload: self
                .sealer
                .seal(MessageKind::RoundManifest, (m.round, m.model_version), m)
                .into(),
            retain: true,
        }
    }

    fn act(&mut self, actions: Vec<Action>) -> Step {
        let mut step = Step::default();
        for action in actions {
            match action {
                // After the answers before it: see the module's documentation.
                Action::Close => step.close = true,
                Action::Answer {
                    site,
                    round,
                    update_hash,
                    answer,
                } => {
                    let answer = UpdateAnswer {
                        round,
                        update_hash,
                        answer,
                    };
                    let at = (round, self.core.model_version());
                    step.send.push(Outgoing {
                        topic: self.topics.ack(&site),
                        payload: self
                            .sealer
                            .seal(MessageKind::UpdateAnswer, at, &answer)
                            .into(),
                        retain: false,
                    });
                }
                Action::Publish {
                    manifest,
                    model,
                    delta,
                } => self.publish(manifest, *model, delta.map(|d| *d), &mut step),
                Action::RoundClosed {
                    round,
                    sites,
                    model_version,
                } => step.done.push(Done::RoundClosed {
                    round,
                    sites,
                    model_version,
                }),
                Action::Finished { model_version } => {
                    step.done.push(Done::Finished { model_version })
                }
            }
        }
        step
    }

    /// Publishes a new model version: its manifest out, its chunks sealed for requests.
    fn publish(
        &mut self,
        manifest: RoundManifest,
        model: Cut,
        delta: Option<Cut>,
        step: &mut Step,
    ) {
        let sealing = Instant::now();
        step.send.push(self.manifest_message(&manifest));
        let at = (manifest.round, manifest.model_version);
        // The old version's chunks go before the new ones are sealed, each payload as soon as
        // its chunks are: the payload and its envelopes at most at once.
        self.served = None;
        let chunks = self.sealer.seal_chunks(at, &model);
        let (count, bytes) = (model.count(), model.len() as u64);
        let payload = self
            .keep_payloads
            .then(|| Bytes::copy_from_slice(&model.into_held().bytes()));
        let delta_chunks = delta.map(|d| self.sealer.seal_chunks(at, &d));
        step.done.push(Done::Published {
            manifest: Box::new(manifest.clone()),
            chunks: count,
            bytes,
            seconds: sealing.elapsed().as_secs_f64(),
            payload,
        });
        self.served = Some(Served {
            manifest,
            chunks,
            delta_chunks: delta_chunks.unwrap_or_default(),
        });
        // A new version: what was served of the old one is of no more use.
        self.serving.clear();
    }

    /// Serves the chunks site `site` asks for in `payload` (a signed [`ChunkRequest`]): of the
    /// round model, on the topic every site reads the first time anyone asks and to the site
    /// alone after that (see [`crate::serving`]), or of an onboarding package, to the site
    /// alone; then whatever gathered requests fell due. A request that does not open, or asks
    /// for what is not served, is logged and dropped.
    pub fn chunk_request(
        &mut self,
        site: &str,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<Vec<Outgoing>, CoreError> {
        let Ok(site) = Id::new(site) else {
            return Ok(Vec::new());
        };
        let req: ChunkRequest = match self
            .core
            .admission()
            .admit(&site, payload, 1 << 20)
            .map_err(|e| e.to_string())
            .and_then(|e| e.payload_as().map_err(|e| e.to_string()))
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(site = %site, error = %e, "chunk request refused");
                return Ok(Vec::new());
            }
        };
        let mut out = Vec::new();
        if req.payload == Payload::Package {
            if self.package(Some(req.model_version))?.is_ok()
                && let Some(p) = &self.package
            {
                let topic = self.topics.chunk_reply(&site);
                out.extend(
                    requested(&req, p.chunks.len())
                        .filter_map(|i| p.chunks.get(i as usize))
                        .map(|c| message(&topic, c)),
                );
            }
            return Ok(out);
        }
        let at = (req.model_version, req.payload);
        if let Some(chunks) = self.served.as_ref().and_then(|s| s.chunks_of(at)) {
            let mut refused = 0;
            for i in requested(&req, chunks.len()) {
                let Some(c) = chunks.get(i as usize) else {
                    continue;
                };
                let route = (i as usize, chunks.len());
                let topic = match self.serving.route(&site, at, route, req.alone, now_ms) {
                    Route::Shared => self.topics.model_chunks(),
                    Route::Site => self.topics.chunk_reply(&site),
                    Route::OnItsWay | Route::Gathered => continue,
                    Route::Refused => {
                        refused += 1;
                        continue;
                    }
                };
                out.push(message(&topic, c));
            }
            if refused > 0 {
                tracing::warn!(site = %site, version = req.model_version, refused, "chunks asked for too often were not served again");
            }
        }
        out.extend(self.due(now_ms));
        Ok(out)
    }

    /// The round model's chunks whose first requests were gathered and fell due by `now_ms`
    /// (see [`crate::serving`]): on the topic every site reads, or to each site that asked
    /// alone.
    pub fn due(&mut self, now_ms: u64) -> Vec<Outgoing> {
        let mut out = Vec::new();
        for (at, to, indices) in self.serving.due(now_ms) {
            let Some(chunks) = self.served.as_ref().and_then(|s| s.chunks_of(at)) else {
                continue;
            };
            let topic = match &to {
                To::All => self.topics.model_chunks(),
                To::Site(site) => self.topics.chunk_reply(site),
            };
            out.extend(
                indices
                    .iter()
                    .filter_map(|&i| chunks.get(i as usize))
                    .map(|c| message(&topic, c)),
            );
        }
        out
    }

    /// The onboarding package of `version` (the newest when `None`), built once and kept until
    /// another version is asked for.
    pub fn package(
        &mut self,
        version: Option<u64>,
    ) -> Result<Result<PackageInfo, OnboardError>, CoreError> {
        let v = version.unwrap_or(self.core.model_version());
        if let Some(p) = self.package.as_ref()
            && p.info.model_version == v
        {
            return Ok(Ok(p.info.clone()));
        }
        Ok(match self.core.package(Some(v))? {
            Ok((info, chunks)) => {
                let chunks = chunks
                    .iter()
                    .map(|c| self.sealer.seal(MessageKind::ModelChunk, (0, v), c).into())
                    .collect();
                self.package = Some(Package {
                    info: info.clone(),
                    chunks,
                });
                Ok(info)
            }
            Err(e) => Err(e),
        })
    }
}

/// The chunk indices `req` asks for, at most [`MAX_CHUNKS_PER_REQUEST`], each once (all of a
/// payload of `count` chunks when it names none).
fn requested(req: &ChunkRequest, count: usize) -> impl Iterator<Item = u32> {
    let indices: std::collections::BTreeSet<u32> = if req.indices.is_empty() {
        (0..count as u32).take(MAX_CHUNKS_PER_REQUEST).collect()
    } else {
        req.indices
            .iter()
            .copied()
            .take(MAX_CHUNKS_PER_REQUEST)
            .collect()
    };
    indices.into_iter()
}

fn message(topic: &str, chunk: &Bytes) -> Outgoing {
    Outgoing {
        topic: topic.to_string(),
        payload: chunk.clone(),
        retain: false,
    }
}
