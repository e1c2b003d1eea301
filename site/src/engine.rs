//! The site engine: one client round as a state machine, `handle(event, now) -> actions`, with
//! no I/O. It follows the round manifest, fetches each new model by its chunks in windows,
//! asks its driver to apply it, to train when the site's round opens, sends the update through
//! an upload window until the aggregator answers, and says when to checkpoint.
//!
//! Bad input from the network stops here: an envelope that does not decode, is not signed by
//! the pinned aggregator key, of another federation, spec or protocol version, on the wrong
//! topic, a
//! manifest that contradicts itself, a chunk that contradicts its manifest or a payload that
//! does not decode is logged and dropped. The engine never fails; only the driver's own work
//! (training, files) can.

use crate::upload::Upload;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use unifed_protocol::auth::{AuthError, Keyring, PublicKey, SigningKey};
use unifed_protocol::chunking::{Reassembler, fetch_window};
use unifed_protocol::envelope::{Envelope, EnvelopeRef, MessageKind};
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::messages::{
    Answer, ChunkRef, ChunkRequest, Downloaded, Payload, RoundManifest, UpdateAnswer, UpdateReceipt,
};
use unifed_protocol::topics::Topics;
use unifed_protocol::{RunId, SpecHash};

/// A fetch window that completed nothing for this long (ms) is asked for again.
pub const FETCH_RETRY_MS: u64 = 5_000;
/// An incomplete model fetch is dropped after this long (ms) without a chunk.
const FETCH_TIMEOUT_MS: u64 = 120_000;

/// What the engine needs to know about its site.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This site.
    pub site: Id,
    /// The federation.
    pub federation: Id,
    /// The hash of the model spec the site runs.
    pub spec_hash: SpecHash,
    /// Largest MQTT packet the broker takes (updates above it go in chunks).
    pub max_packet: usize,
    /// Milliseconds between re-sends of an unanswered update.
    pub resend_ms: u64,
    /// Largest model payload the site accepts (from the spec: every tensor in f32 plus
    /// framing); a manifest announcing more is dropped before anything is allocated.
    pub max_model_bytes: u64,
    /// The site's private key: every message it sends is signed with it.
    pub key: SigningKey,
    /// The aggregator's public key, pinned in the site's config: only messages it signed are
    /// followed.
    pub aggregator: PublicKey,
}

/// What the site has done, persisted beside its checkpoint so a restart resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The model version the checkpoint holds, once one was applied.
    pub applied_version: Option<u64>,
    /// Rounds whose update the aggregator answered.
    pub answered_rounds: Vec<u64>,
    /// The federation's run this progress is of (`None`: a new site, or a checkpoint from
    /// before runs were kept, which follows the first run it hears of).
    #[serde(default)]
    pub run: Option<RunId>,
}

impl Progress {
    /// Whether the site did anything in its run: applied a model or had an update answered.
    pub fn started(&self) -> bool {
        self.applied_version.is_some() || !self.answered_rounds.is_empty()
    }
}

/// Something that happened to the site.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The connection to the broker is (re-)established.
    Connected,
    /// A message arrived.
    Message {
        /// Its topic.
        topic: String,
        /// Its bytes (shared with the transport's buffer: a `Vec<u8>` converts without a copy).
        payload: bytes::Bytes,
    },
    /// The driver applied the model of an [`Action::Apply`].
    Applied {
        /// Its version.
        version: u64,
    },
    /// The driver could not apply a model (it does not fit the site's spec): it is not fetched
    /// again until the manifest changes. A delta the driver could not apply (it does not hold
    /// the version the delta starts from) is followed by a fetch of the whole model.
    ApplyFailed {
        /// Its version.
        version: u64,
        /// Why.
        error: String,
    },
    /// The driver trained for an [`Action::Train`] and encoded the update envelope.
    Trained {
        /// The round.
        round: u64,
        /// The update envelope.
        update: Vec<u8>,
    },
    /// The driver could not train for an [`Action::Train`] from the model it was given (the
    /// training diverged, or the model does not fit the round's plan): the site sends nothing
    /// for that round and waits for the next one.
    TrainFailed {
        /// The round.
        round: u64,
        /// Why.
        error: String,
    },
    /// Time passed: re-requests and re-sends fall due.
    Tick,
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Publish `payload` on `topic` (QoS 1, not retained).
    Publish {
        /// The topic.
        topic: String,
        /// The message.
        payload: Vec<u8>,
    },
    /// Apply the model's weights (the non-BN ones under `local` BN), whole or as a delta from
    /// the version applied last, then report [`Event::Applied`] or [`Event::ApplyFailed`].
    Apply {
        /// The manifest that announced it.
        manifest: RoundManifest,
        /// The model's payload, whole or as a delta, checked to decode and read in place
        /// ([`Downloaded::read`]).
        download: Downloaded,
        /// True for a site whose first model is past version 0 and that has no checkpoint: a
        /// late joiner, whose BN may need calibrating first.
        joining: bool,
        /// Milliseconds from the first chunk request to the complete model.
        fetch_ms: u64,
        /// Bytes of the payload fetched: the whole model's or the delta's.
        bytes: u64,
    },
    /// Train for the manifest's round under its plan and report [`Event::Trained`].
    Train {
        /// The round's manifest.
        manifest: RoundManifest,
    },
    /// The first send of an update.
    Uploading {
        /// Its round.
        round: u64,
        /// Bytes of the update envelope.
        bytes: u64,
        /// MQTT messages one send takes.
        messages: u64,
    },
    /// The aggregator answered the update of `round` (the site's error feedback advances on an
    /// accept).
    Answered {
        /// The round.
        round: u64,
        /// Accepted, or rejected with the reason.
        answer: Answer,
    },
    /// Persist the model and [`SiteEngine::progress`] (they changed). Asked for after every
    /// answer, and after a model is applied unless the site trains from it at once: that
    /// model is then persisted with its training's outcome, on the answer, and a site stopped
    /// while it trains fetches it again (a write of the whole model per round saved, on the
    /// round's critical path).
    Checkpoint,
    /// The federation has finished and the site holds the final model.
    Finished {
        /// The final manifest.
        manifest: RoundManifest,
    },
    /// The aggregator announced a later run of the federation (a new federation on the same
    /// ids, or its state started afresh) while the site holds state of `from`. The engine does
    /// not follow it: the site's model, BN and algorithm state belong to `from`, so the driver's
    /// owner puts them aside and starts a fresh site on `to` ([`SiteEngine::following`]).
    NewRun {
        /// The run the site's state is of.
        from: RunId,
        /// The run the aggregator announced.
        to: RunId,
    },
}

/// The site engine.
#[derive(Debug)]
pub struct SiteEngine {
    cfg: EngineConfig,
    topics: Topics,
    /// The pinned aggregator, under its id.
    keyring: Keyring,
    progress: Progress,
    /// A checkpoint existed when the engine started (the site is not joining).
    resumed: bool,
    manifest: Option<RoundManifest>,
    reasm: Reassembler,
    outstanding: BTreeSet<u32>,
    last_request_ms: Option<u64>,
    /// The connection dropped since the last request: chunks sent for every site meanwhile
    /// were missed.
    reconnected: bool,
    fetch_started_ms: Option<u64>,
    /// Payloads (models or deltas) the driver could not apply: not fetched again.
    refused: BTreeSet<[u8; 32]>,
    /// The hash of the payload of an [`Action::Apply`] that is out and not yet reported.
    applying: Option<[u8; 32]>,
    /// An [`Action::Train`] is out and not yet reported.
    training: Option<u64>,
    pending: Option<Upload>,
    /// Since when the pending update's round has been closed without its answer
    /// ([`SiteEngine::settle`]).
    settling_since: Option<u64>,
    /// The last accepted update, kept until its round closes in case the aggregator asks for
    /// it again ([`Answer::Resend`]).
    delivered: Option<Upload>,
    /// A round whose training failed: not trained again.
    skipped: Option<u64>,
    finished: bool,
    /// The later run last reported in an [`Action::NewRun`] (reported once, not per manifest).
    new_run_seen: Option<RunId>,
}

impl SiteEngine {
    /// An engine for the site of `cfg`, resuming from `progress` when the site has a
    /// checkpoint (`None`: a new site).
    pub fn new(cfg: EngineConfig, progress: Option<Progress>) -> Self {
        let max = cfg.max_model_bytes.saturating_mul(2).max(1 << 20);
        SiteEngine {
            topics: Topics::new(&cfg.federation),
            keyring: Keyring::aggregator(cfg.aggregator),
            resumed: progress.is_some(),
            progress: progress.unwrap_or_default(),
            manifest: None,
            // Every chunk is opened with the pinned aggregator's key before it is handed in
            // (`on_message`), and its payload hash is the one its signed manifest names: the
            // complete model is not hashed a second time (13 ms of a 57 MB download).
            reasm: Reassembler::new(FETCH_TIMEOUT_MS, usize::try_from(max).unwrap_or(usize::MAX))
                .of_signed_chunks(),
            outstanding: BTreeSet::new(),
            last_request_ms: None,
            reconnected: false,
            fetch_started_ms: None,
            refused: BTreeSet::new(),
            applying: None,
            training: None,
            pending: None,
            settling_since: None,
            delivered: None,
            skipped: None,
            finished: false,
            new_run_seen: None,
            cfg,
        }
    }

    /// The engine of a fresh site that follows run `run` and nothing earlier: what a site
    /// starts as after it put aside its state of an earlier run ([`Action::NewRun`]).
    pub fn following(mut self, run: RunId) -> Self {
        self.progress.run = Some(run);
        self
    }

    /// The topics the driver subscribes to: the manifest, the model chunks sent to every site,
    /// the site's own chunk replies and its answers.
    pub fn subscriptions(&self) -> Vec<String> {
        vec![
            self.topics.manifest(),
            self.topics.model_chunks(),
            self.topics.chunk_reply(&self.cfg.site),
            self.topics.ack(&self.cfg.site),
        ]
    }

    /// The run the site follows: the manifest's, else its progress's.
    fn run(&self) -> Option<RunId> {
        self.manifest.as_ref().map(|m| m.run).or(self.progress.run)
    }

    /// What the site has done (persist it on [`Action::Checkpoint`]).
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The manifest the site follows.
    pub fn manifest(&self) -> Option<&RoundManifest> {
        self.manifest.as_ref()
    }

    /// Whether [`SiteEngine::handle`] would drop the message on `topic` without a change or an
    /// action because it is a model chunk the site does not want now: no model announced yet,
    /// a payload other than the one the site fetches, or a model it holds or applies already
    /// (the chunks other sites fetch, shared on the topic every site reads). A driver busy with
    /// training drops such messages instead of queueing them for later (up to a model's bytes)
    /// while nothing else waits before them. Anything else, a message that fails the
    /// envelope's checks included, is `false`: `handle` reports it.
    pub fn ignores(&self, topic: &str, payload: &[u8]) -> bool {
        self.chunk_filter().ignores(topic, payload)
    }

    /// A copy of the rule [`SiteEngine::ignores`] applies now, that lives apart from the engine:
    /// a driver busy training hands it to the task that receives messages, which drops the
    /// chunks the site does not want while the engine itself is out of reach.
    pub fn chunk_filter(&self) -> ChunkFilter {
        let wanted = self
            .manifest
            .as_ref()
            .filter(|m| !self.holds(m))
            .map(|m| self.target(m).hash);
        ChunkFilter {
            keyring: self.keyring.clone(),
            federation: self.cfg.federation.clone(),
            spec_hash: self.cfg.spec_hash,
            max_packet: self.cfg.max_packet,
            topics: [
                self.topics.model_chunks(),
                self.topics.chunk_reply(&self.cfg.site),
            ],
            wanted,
        }
    }

    /// Handles one event at `now_ms` (a monotonic clock in milliseconds) and returns what to do.
    pub fn handle(&mut self, event: Event, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let applied = matches!(event, Event::Applied { .. });
        match event {
            Event::Connected => {
                // Chunks in flight when the connection dropped are lost: send them again now.
                if let Some(p) = &mut self.pending {
                    p.reconnected();
                }
                self.last_request_ms = None;
                self.reconnected = true;
            }
            Event::Message { topic, payload } => {
                self.on_message(&topic, &payload, now_ms, &mut out)
            }
            Event::Applied { version } => {
                self.applying = None;
                self.progress.applied_version = Some(version);
                self.fetch_started_ms = None;
                self.last_request_ms = None;
            }
            Event::ApplyFailed { version, error } => {
                if let Some(h) = self.applying.take() {
                    // The next fetch is the whole model when a delta was refused (see `target`).
                    let payload = self.manifest.as_ref().map_or(Payload::Model, |m| {
                        if m.delta.is_some_and(|d| d.payload_hash == h) {
                            Payload::Delta
                        } else {
                            Payload::Model
                        }
                    });
                    tracing::warn!(version, error, ?payload, "payload refused by the site");
                    self.refused.insert(h);
                }
                self.outstanding.clear();
                self.last_request_ms = None;
            }
            Event::Trained { round, update } => {
                self.training = None;
                let version = self.manifest.as_ref().map_or(0, |m| m.model_version);
                let signed = match self.cfg.key.sign_encoded(update) {
                    Ok(b) => b,
                    Err(e) => {
                        // The driver's bytes are not an unsigned envelope: nothing to send.
                        tracing::error!(round, error = %e, "update not signable; round skipped");
                        self.skipped = Some(round);
                        return out;
                    }
                };
                // Only for the round and run the site follows (a new run may have begun).
                let run = EnvelopeRef::read(&signed).map(|e| e.run).ok();
                if let Some(m) = self
                    .manifest
                    .as_ref()
                    .filter(|m| m.round == round && run == Some(m.run))
                {
                    let up = Upload::new(
                        (&self.cfg.federation, &self.cfg.site, self.cfg.spec_hash),
                        &self.cfg.key,
                        (m.run, round, version),
                        signed,
                        self.cfg.max_packet,
                        m.upload_window_bytes as usize,
                    );
                    out.push(Action::Uploading {
                        round,
                        bytes: up.len() as u64,
                        messages: up.messages() as u64,
                    });
                    self.pending = Some(up);
                } else {
                    tracing::info!(round, "the round moved on while training; update dropped");
                }
            }
            Event::TrainFailed { round, error } => {
                self.training = None;
                self.skipped = Some(round);
                tracing::warn!(round, error, "training failed; no update for this round");
            }
            Event::Tick => {}
        }
        self.advance(now_ms, &mut out);
        if applied && !out.iter().any(|a| matches!(a, Action::Train { .. })) {
            // An applied model not trained from at once (not sampled, finished, its round
            // answered or skipped, or a newer model announced) is persisted now, before
            // anything else is done; one trained from is persisted with the round's outcome.
            out.insert(0, Action::Checkpoint);
        }
        out
    }

    /// The envelope of a message, signed by the pinned aggregator (checked before anything else
    /// is looked at) for this federation and model spec; why not, otherwise.
    fn open<'a>(&self, payload: &'a [u8]) -> Result<EnvelopeRef<'a>, Unopened> {
        open_from_aggregator(
            &self.keyring,
            (
                &self.cfg.federation,
                self.cfg.spec_hash,
                self.cfg.max_packet,
            ),
            payload,
        )
    }

    /// Checks a message's envelope and hands its payload on; anything else is dropped.
    fn on_message(&mut self, topic: &str, payload: &[u8], now_ms: u64, out: &mut Vec<Action>) {
        let env = match self.open(payload) {
            Ok(e) => e,
            Err(why) => return drop_msg(topic, &why.to_string()),
        };
        let expected = if topic == self.topics.manifest() {
            &[MessageKind::RoundManifest][..]
        } else if topic == self.topics.chunk_reply(&self.cfg.site)
            || topic == self.topics.model_chunks()
        {
            &[MessageKind::ModelChunk][..]
        } else if topic == self.topics.ack(&self.cfg.site) {
            &[MessageKind::UpdateAnswer, MessageKind::UpdateReceipt][..]
        } else {
            return drop_msg(topic, "not a topic the site follows");
        };
        if !expected.contains(&env.kind) {
            return drop_msg(topic, &format!("a {:?} on this topic", env.kind));
        }
        if env.kind != MessageKind::RoundManifest
            && self.manifest.as_ref().is_some_and(|m| m.run != env.run)
        {
            return drop_msg(topic, &format!("of run {}, not the site's", env.run));
        }
        match env.kind {
            MessageKind::RoundManifest => match env.payload_as::<RoundManifest>() {
                Ok(m) => self.on_manifest(m, &env, out),
                Err(e) => drop_msg(topic, &e.to_string()),
            },
            MessageKind::ModelChunk => match env.payload_as::<ChunkRef>() {
                Ok(c) => self.on_chunk(c, now_ms, out),
                Err(e) => drop_msg(topic, &e.to_string()),
            },
            MessageKind::UpdateAnswer => match env.payload_as::<UpdateAnswer>() {
                Ok(a) => self.on_answer(a, out),
                Err(e) => drop_msg(topic, &e.to_string()),
            },
            MessageKind::UpdateReceipt => match env.payload_as::<UpdateReceipt>() {
                Ok(r) => {
                    if let Some(p) = &mut self.pending {
                        p.receipt(&r, now_ms);
                    }
                }
                Err(e) => drop_msg(topic, &e.to_string()),
            },
            _ => {}
        }
    }

    fn on_manifest(&mut self, m: RoundManifest, env: &EnvelopeRef<'_>, out: &mut Vec<Action>) {
        let problem = if m.spec_hash != self.cfg.spec_hash {
            Some("it names another model spec".to_string())
        } else if m.round != env.round || m.model_version != env.model_version || m.run != env.run {
            Some("its run, round or version differ from its envelope's".into())
        } else if m.payload_len > self.cfg.max_model_bytes {
            Some(format!(
                "its model of {} bytes exceeds this site's {}",
                m.payload_len, self.cfg.max_model_bytes
            ))
        } else if m.chunk_count == 0 || u64::from(m.chunk_count) > m.payload_len.max(1) {
            Some(format!(
                "{} chunks for {} bytes",
                m.chunk_count, m.payload_len
            ))
        } else if let Some(d) = m.delta.filter(|d| {
            d.from_version >= m.model_version
                || d.chunk_count == 0
                || u64::from(d.chunk_count) > d.payload_len.max(1)
                || d.payload_len > self.cfg.max_model_bytes.saturating_mul(2)
        }) {
            Some(format!(
                "its delta from v{} ({} chunks for {} bytes) does not fit",
                d.from_version, d.chunk_count, d.payload_len
            ))
        } else if let Err(e) = m.plan.objective.validate() {
            Some(e.to_string())
        } else if self.run().is_some_and(|cur| m.run < cur) {
            Some("it is of an earlier run than the one the site follows".into())
        } else if self.manifest.as_ref().is_some_and(|cur| {
            m.run == cur.run && (m.round < cur.round || m.model_version < cur.model_version)
        }) {
            Some("it is older than the manifest the site follows".into())
        } else {
            None
        };
        if let Some(p) = problem {
            tracing::warn!(round = m.round, "manifest dropped: {p}");
            return;
        }
        match self.run() {
            Some(cur) if cur != m.run && self.progress.started() => {
                // The site's state is of another run: its owner starts a fresh site on this one.
                if self.new_run_seen != Some(m.run) {
                    self.new_run_seen = Some(m.run);
                    tracing::warn!(from = %cur, to = %m.run, "the aggregator started a new run of the federation");
                    out.push(Action::NewRun {
                        from: cur,
                        to: m.run,
                    });
                }
                return;
            }
            Some(cur) if cur != m.run => {
                // Nothing done in the run it followed: the site follows the later one as it is.
                tracing::info!(from = %cur, to = %m.run, "the federation moved to a later run before the site did anything in its run");
                self.new_run();
            }
            _ => {}
        }
        self.progress.run = Some(m.run);
        if !m.finished {
            // A finished federation extended (more rounds): it finishes again later.
            self.finished = false;
        }
        if self
            .manifest
            .as_ref()
            .is_none_or(|cur| cur.payload_hash != m.payload_hash)
        {
            self.refused.clear();
            self.outstanding.clear();
            self.last_request_ms = None;
        }
        self.manifest = Some(m);
    }

    fn on_chunk(&mut self, chunk: ChunkRef<'_>, now_ms: u64, out: &mut Vec<Action>) {
        let Some(m) = &self.manifest else { return };
        // Dropped: a chunk of an older model, of the payload the site does not fetch, or of an
        // onboarding package.
        let Some(t) = self.fetches(m, &chunk.payload_hash) else {
            return;
        };
        if chunk.count != t.count || chunk.total_len != t.len {
            return drop_msg("chunk", "its count or length contradict the manifest");
        }
        if self.holds(m) {
            return;
        }
        self.outstanding.remove(&chunk.index);
        // Every chunk of the set was signed by the aggregator with the manifest's hash (checked
        // above), so the payload is the one the manifest names without hashing its 57 MB.
        let bytes = match self.reasm.insert(chunk, now_ms) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => return drop_msg("chunk", &e.to_string()),
        };
        let delta = t.payload == Payload::Delta;
        let what = if delta { "delta" } else { "model" };
        // Checked to decode here, read in place when the driver applies it: the site holds the
        // payload and no decoded copy of it.
        let download = match Downloaded::new(bytes, delta) {
            Ok(d) => d,
            Err(e) => return drop_msg(what, &e.to_string()),
        };
        if delta && download.from_version() != m.delta.map(|i| i.from_version) {
            return drop_msg("delta", "its base version differs from the manifest's");
        }
        if download.model_version() != m.model_version {
            return drop_msg(what, "its version differs from the manifest's");
        }
        let joining =
            !self.resumed && self.progress.applied_version.is_none() && m.model_version > 0;
        self.applying = Some(t.hash);
        out.push(Action::Apply {
            manifest: m.clone(),
            download,
            joining,
            fetch_ms: self
                .fetch_started_ms
                .map_or(0, |t| now_ms.saturating_sub(t)),
            bytes: t.len,
        });
    }

    /// What the site fetches of the model `m` announces, if it is the payload of hash `hash`.
    fn fetches(&self, m: &RoundManifest, hash: &[u8; 32]) -> Option<Target> {
        let t = self.target(m);
        (t.hash == *hash).then_some(t)
    }

    /// Whether the site applies or has applied the model `m` announces already.
    fn holds(&self, m: &RoundManifest) -> bool {
        self.applying.is_some() || self.progress.applied_version == Some(m.model_version)
    }

    /// What to fetch of the model `m` announces: its delta when the site holds the version the
    /// delta starts from (and has not refused it), else the whole model.
    fn target(&self, m: &RoundManifest) -> Target {
        match m.delta {
            Some(d)
                if self.progress.applied_version == Some(d.from_version)
                    && !self.refused.contains(&d.payload_hash) =>
            {
                Target {
                    payload: Payload::Delta,
                    hash: d.payload_hash,
                    count: d.chunk_count,
                    len: d.payload_len,
                }
            }
            _ => Target {
                payload: Payload::Model,
                hash: m.payload_hash,
                count: m.chunk_count,
                len: m.payload_len,
            },
        }
    }

    /// Whether to keep asking for the answer to the pending update, whose round has closed (a
    /// later round's manifest, or the final one, came first): an aggregator that crashed after
    /// it spooled the update and before it answered folds it after its restart, and the
    /// answer is what settles the site's state (its error-feedback residual, SCAFFOLD's `c_i`,
    /// FedDC's drift). A re-send of a closed round is answered from the aggregator's record of
    /// it (accepted when it was folded, `RoundClosed` otherwise), so the site re-sends it at
    /// once, then as usual, for up to three re-send periods before it takes the update as
    /// moot; nothing is trained meanwhile. False (and the update dropped) once that has passed.
    fn settle(&mut self, now_ms: u64) -> bool {
        let since = match self.settling_since {
            Some(t) => t,
            None => {
                tracing::warn!("a round closed without this site's answer; asking for it");
                if let Some(p) = &mut self.pending {
                    p.restart();
                }
                *self.settling_since.insert(now_ms)
            }
        };
        if now_ms.saturating_sub(since) <= 3 * self.cfg.resend_ms {
            return true;
        }
        tracing::warn!("no answer to this site's update of a closed round; it is moot");
        self.pending = None;
        self.settling_since = None;
        false
    }

    fn on_answer(&mut self, a: UpdateAnswer, out: &mut Vec<Action>) {
        if a.answer == Answer::Resend {
            if let Some(mut up) = self.delivered.take_if(|d| d.round == a.round) {
                tracing::warn!(
                    round = a.round,
                    "the aggregator lost this site's update; re-sending it"
                );
                up.restart();
                self.pending = Some(up);
                self.progress.answered_rounds.retain(|&r| r != a.round);
            }
            return;
        }
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.round == a.round && p.hash() == a.update_hash)
        {
            let up = self.pending.take();
            self.settling_since = None;
            if a.answer == Answer::Accepted {
                self.delivered = up;
            }
            self.progress.answered_rounds.push(a.round);
            out.push(Action::Answered {
                round: a.round,
                answer: a.answer,
            });
            out.push(Action::Checkpoint);
        }
    }

    /// What is due now: fetch the current model, train, re-send, or finish.
    fn advance(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Some(m) = self.manifest.clone() else {
            return;
        };
        // A manifest of a later round, or the final one, means the delivered update's round
        // has closed: no re-send can be asked for, and its bytes are freed before the next
        // model arrives.
        if self
            .delivered
            .as_ref()
            .is_some_and(|d| d.round != m.round || m.finished)
        {
            self.delivered = None;
        }
        if self.applying.is_some() || self.training.is_some() {
            return;
        }
        if self.progress.applied_version != Some(m.model_version) {
            let t = self.target(&m);
            if self.refused.contains(&t.hash) {
                return;
            }
            self.fetch_started_ms.get_or_insert(now_ms);
            // Ask for what is missing: the next chunks once half the window has arrived (so the
            // pipe never runs dry, and at most one and a half windows are in flight), and
            // everything missing again if nothing was asked for within FETCH_RETRY_MS.
            let timed_out = self
                .last_request_ms
                .is_some_and(|t| now_ms.saturating_sub(t) > FETCH_RETRY_MS);
            let stale = timed_out || self.last_request_ms.is_none();
            let window = fetch_window(t.len, t.count);
            if self.outstanding.len() <= window / 2 || stale {
                self.reasm.expire(now_ms);
                if stale {
                    self.outstanding.clear();
                }
                let room = window - self.outstanding.len().min(window);
                let asked = &self.outstanding;
                let indices: Vec<u32> = match self.reasm.missing(&t.hash) {
                    Some(missing) => missing
                        .into_iter()
                        .filter(|i| !asked.contains(i))
                        .take(room)
                        .collect(),
                    None => (0..t.count)
                        .filter(|i| !asked.contains(i))
                        .take(room)
                        .collect(),
                };
                if indices.is_empty() {
                    return;
                }
                self.outstanding.extend(indices.iter().copied());
                // After a reconnect or a silence, chunks sent for every site may have been
                // missed: the aggregator sends those to this site alone.
                let req = ChunkRequest {
                    model_version: m.model_version,
                    indices,
                    payload: t.payload,
                    alone: timed_out || self.reconnected,
                };
                self.reconnected = false;
                out.push(Action::Publish {
                    topic: self.topics.chunk_request(&self.cfg.site),
                    payload: self.envelope(MessageKind::ChunkRequest, &m, &req),
                });
                self.last_request_ms = Some(now_ms);
            }
            return;
        }
        if self.pending.is_some() {
            let closed = self
                .pending
                .as_ref()
                .is_some_and(|p| p.round != m.round || m.finished);
            if !closed || self.settle(now_ms) {
                let topic = self.topics.update(&self.cfg.site);
                let p = self.pending.as_mut().expect("pending");
                for payload in p.pump(now_ms, self.cfg.resend_ms) {
                    out.push(Action::Publish {
                        topic: topic.clone(),
                        payload,
                    });
                }
                return;
            }
        }
        if m.finished {
            if !self.finished {
                self.finished = true;
                out.push(Action::Finished { manifest: m });
            }
            return;
        }
        let sampled = m.sampled.is_empty() || m.sampled.contains(&self.cfg.site);
        if sampled
            && !self.progress.answered_rounds.contains(&m.round)
            && self.skipped != Some(m.round)
        {
            self.training = Some(m.round);
            out.push(Action::Train { manifest: m });
        }
    }

    fn envelope(&self, kind: MessageKind, m: &RoundManifest, payload: &impl Serialize) -> Vec<u8> {
        self.cfg.key.sign(
            &Envelope::new(
                kind,
                self.cfg.federation.clone(),
                self.cfg.site.clone(),
                m.round,
                m.model_version,
                self.cfg.spec_hash,
                payload,
            )
            .in_run(m.run),
        )
    }

    /// Forgets what the site did in the run it followed (a later run of the federation was
    /// announced): its progress, fetches, uploads and skipped round. The model it holds stays
    /// until the new run's is applied; a training in progress is dropped when it ends.
    fn new_run(&mut self) {
        self.progress = Progress::default();
        self.new_run_seen = None;
        self.manifest = None;
        self.refused.clear();
        self.outstanding.clear();
        self.last_request_ms = None;
        self.fetch_started_ms = None;
        self.pending = None;
        self.settling_since = None;
        self.delivered = None;
        self.skipped = None;
        self.finished = false;
    }
}

/// The envelope of `payload`, signed by the aggregator `keyring` pins, for `federation` and
/// the model spec `spec_hash`, within `max_packet`; why not, otherwise.
fn open_from_aggregator<'a>(
    keyring: &Keyring,
    (federation, spec_hash, max_packet): (&Id, SpecHash, usize),
    payload: &'a [u8],
) -> Result<EnvelopeRef<'a>, Unopened> {
    let env = keyring.open(payload, max_packet + 4096)?;
    if env.federation != *federation {
        return Err(Unopened::Federation(env.federation));
    }
    if env.sender.as_str() != AGGREGATOR_ID {
        return Err(Unopened::Sender(env.sender));
    }
    if env.spec_hash != spec_hash {
        return Err(Unopened::Spec(env.spec_hash));
    }
    Ok(env)
}

/// Why a message was not taken as the aggregator's (it is dropped and logged).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unopened {
    /// It does not decode, or is not signed by the pinned aggregator key.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// It names another federation.
    #[error("federation `{0}`")]
    Federation(Id),
    /// Its sender is not the aggregator.
    #[error("sender `{0}` is not the aggregator")]
    Sender(Id),
    /// It is of another model spec.
    #[error("model spec {0} is not this site's")]
    Spec(SpecHash),
}

/// Which model chunks a site drops unread now ([`SiteEngine::chunk_filter`]): every chunk on
/// the shared or its own chunk topic, signed by its aggregator, of a payload other than the one
/// it fetches (all of them while it fetches none).
#[derive(Debug, Clone)]
pub struct ChunkFilter {
    keyring: Keyring,
    federation: Id,
    spec_hash: SpecHash,
    max_packet: usize,
    /// The shared chunk topic and the site's own.
    topics: [String; 2],
    /// The payload the site fetches, if any.
    wanted: Option<[u8; 32]>,
}

impl ChunkFilter {
    /// Whether the message on `topic` is a model chunk the site does not want now. Anything
    /// else, a message that fails the envelope's checks included, is `false`: the engine
    /// reports it.
    pub fn ignores(&self, topic: &str, payload: &[u8]) -> bool {
        if !self.topics.iter().any(|t| t == topic) {
            return false;
        }
        let checks = (&self.federation, self.spec_hash, self.max_packet);
        let Ok(env) = open_from_aggregator(&self.keyring, checks, payload) else {
            return false;
        };
        if env.kind != MessageKind::ModelChunk {
            return false;
        }
        env.payload_as::<ChunkRef>()
            .is_ok_and(|chunk| self.wanted != Some(chunk.payload_hash))
    }
}

/// The payload a site fetches of a manifest's model.
struct Target {
    payload: Payload,
    hash: [u8; 32],
    count: u32,
    len: u64,
}

fn drop_msg(topic: &str, why: &str) {
    tracing::warn!(topic, "message dropped: {why}");
}
