//! The federation core: a state machine driven by [`Event`]s that returns [`Action`]s and does
//! no network I/O. Its only side effects are durable writes to its data directory, made before
//! the actions that depend on them are returned (an accept is returned only after its update is
//! spooled and fsynced; a new model is published only after the state that names it is saved).

mod admission;
mod close;
mod intake;

use crate::bnshare;
use crate::broadcast::ModelBroadcast;
use crate::config::{ConfigProblem, ConfigProblems, FederationConfig};
use crate::sealed::Sealed;
use crate::spoolround::SpoolRound;
use crate::store::{
    AuditEntry, ClosedRound, FORMAT_VERSION, SpoolEntry, SpoolTensor, State, Store, StoreError,
};
use crate::strategy::{
    self, Checked, Contributions, ReadError, Setup, Strategy, StrategyError, sum_squares,
};
pub use admission::{Admission, AdmitError};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use unifed_protocol::auth::{AuthError, Keyring};
use unifed_protocol::chunking::{Cut, payload_hash};
use unifed_protocol::encoding::{
    EncodedTensor, EncodedTensorRef, Encoding, Values, decode_add, encode_leaving_error,
};
use unifed_protocol::envelope::{EnvelopeRef, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    Answer, BnPolicy, DeltaInfo, ModelDelta, RejectReason, RoundManifest, ServerBroadcast,
    ServerExtras, SiteUpdateRef,
};
use unifed_protocol::{ModelSpec, SpecHash};
use unifed_protocol::{TensorKind, TensorSpec};

/// How many closed rounds' accepted sites are remembered to answer late re-sends.
const RECENT_ROUNDS: usize = 8;

/// The global model: its spec and every tensor's values in spec order.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalModel {
    /// The model spec.
    pub spec: ModelSpec,
    /// Values of every tensor of the spec, in spec order.
    pub tensors: Vec<Vec<f32>>,
}

/// How an update's bytes reached the service, and so what of them was checked on the way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// In one message, unchecked: the core checks its signature and hashes it.
    Message,
    /// As the chunk set named `hash`, every chunk of which was opened with the topic site's
    /// key (signature, sender, federation) before it was kept. Each byte was signed by that
    /// site with its place in the payload, so the core neither checks the envelope's own
    /// signature nor hashes the bytes (two passes over a 57 MB update, 20 ms each): its
    /// answer names the set's hash, as a site's own reassembly takes the aggregator's chunks.
    SignedChunks {
        /// The set's payload hash, as its chunks named it.
        hash: [u8; 32],
    },
}

/// Something that happened to the aggregator.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Start (or resume) the federation: opens round 1, or re-publishes the current round.
    Start,
    /// A message arrived on a site's update topic.
    Update(Incoming),
    /// Messages that arrived on sites' update topics together (what the service found
    /// waiting): each is taken as an [`Event::Update`] would be, in order, but the slow part
    /// of taking several (checking every value, writing and syncing the spool files) runs side
    /// by side. Every message handed at once is in memory at once: the service hands at most
    /// [`VET_WIDTH`]. The one difference: updates past the number the round still needs are
    /// taken into it too, since the fold is asked for after the batch (one by one, the round
    /// would have closed before them and refused them as late).
    Updates(Vec<Incoming>),
    /// The first chunk of a site's upload of a round that has closed, admitted (signature,
    /// sender, federation, run) by the ingest: answered as a whole re-send would be, from the
    /// round's record (accepted when the site's update was folded, `RoundClosed` otherwise),
    /// so a site whose answer was lost settles its state. Nothing is answered for a round that
    /// has not closed.
    Resent {
        /// The site that signed it.
        site: Id,
        /// The round it names.
        round: u64,
        /// The hash of the update it begins.
        hash: [u8; 32],
    },
    /// Time passed: closes a round whose deadline has expired.
    Tick,
    /// Folds the open round if it has every update it needs: what an [`Action::Close`] asks
    /// for once the answers before it are sent. Does nothing otherwise.
    Close,
}

/// A message on a site's update topic ([`Event::Update`], [`Event::Updates`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Incoming {
    /// The site named by the topic.
    pub site: String,
    /// The raw message (a reassembled upload's is its file mapped).
    pub bytes: bytes::Bytes,
    /// How it came, which says what of it was checked already.
    pub arrival: Arrival,
    /// A file on the data directory's file system that holds `bytes` and nothing else (a
    /// reassembled upload): an accepted update's spool file is made of it instead of writing
    /// the bytes again, and it is renamed away then. The caller removes it otherwise.
    pub staged: Option<std::path::PathBuf>,
}

/// Whom an update's answer goes to: its site, the hash of the bytes it answers, and the round
/// it names.
struct To {
    site: Id,
    hash: [u8; 32],
    round: u64,
}

impl To {
    /// The answer action.
    fn answer(&self, answer: Answer) -> Action {
        Action::Answer {
            site: self.site.clone(),
            round: self.round,
            update_hash: self.hash,
            answer,
        }
    }
}

/// An update whose round, sender and model version the core takes ([`Aggregator::admit_update`]),
/// read in place from its message.
struct Admitted<'b> {
    to: To,
    message: &'b [u8],
    update: SiteUpdateRef<'b>,
}

/// Why [`Aggregator::admit_update`] did not take an update further.
enum Refused {
    /// Not a signed message of the topic's site: no answer.
    Dropped,
    /// Refused with a reason.
    Rejected(To, RejectReason),
    /// Taken before (a duplicate, audited with this detail): its first answer again.
    Duplicate(To, &'static str),
}

/// An admitted update that passed every value check, with its spool file sealed
/// ([`Aggregator::vet`]).
struct Vetted {
    sealed: Sealed,
    /// Its norm relative to the model's.
    ratio: f64,
}

/// Updates whose value checks and spool files run side by side, at most (fewer on fewer
/// cores), and the most the service hands the core at once: each holds its message's pages
/// (and a lossy update its decoded delta) while it is checked, so the aggregator's memory
/// grows by at most this many updates, whatever the number of sites.
pub const VET_WIDTH: usize = 4;

/// Something the transport must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The open round has every update it needs: send the answers before this one, then hand
    /// the core [`Event::Close`] to fold it. The last update's answer (it is spooled, durable)
    /// so goes out before the fold, and its site checkpoints while the aggregator folds.
    Close,
    /// Send `answer` for `round` to `site`.
    Answer {
        /// The site.
        site: Id,
        /// The round of the answered update.
        round: u64,
        /// Hash of the answered message.
        update_hash: [u8; 32],
        /// Accepted or rejected with a reason.
        answer: Answer,
    },
    /// Publish the manifest (retained) and serve the model's chunks on request.
    Publish {
        /// The round manifest.
        manifest: RoundManifest,
        /// The model payload (a postcard [`ServerBroadcast`]) and its chunks.
        model: Box<Cut>,
        /// The model as a delta from the previous version (a postcard [`ModelDelta`]) and its
        /// chunks, when the manifest announces one.
        delta: Option<Box<Cut>>,
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

/// Checks the initial model against its own spec: valid, and every tensor of the spec's length.
fn check_initial(initial: &GlobalModel) -> Result<(), CoreError> {
    let spec = &initial.spec;
    spec.validate()
        .map_err(|e| CoreError::Model(e.to_string()))?;
    if initial.tensors.len() != spec.tensors.len()
        || initial
            .tensors
            .iter()
            .zip(&spec.tensors)
            .any(|(t, s)| t.len() != s.numel())
    {
        return Err(CoreError::Model(
            "tensor count or lengths differ from the spec".into(),
        ));
    }
    Ok(())
}

/// Failures of the core itself (never caused by a site's input, which is answered instead).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The configuration is invalid.
    #[error("invalid federation config: {0}")]
    Config(ConfigProblems),
    /// The initial model does not fit its spec.
    #[error("initial model: {0}")]
    Model(String),
    /// The data directory belongs to another federation or model.
    #[error("data directory {dir}: {message}")]
    Mismatch {
        /// The directory.
        dir: String,
        /// What differs.
        message: String,
    },
    /// A storage failure.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A round's contribution could not be read while the strategy combined it.
    #[error("reading the round's contributions: {0}")]
    Read(#[from] ReadError),
}

/// Why the data directory does not fit the configuration or itself, as [`CoreError::Mismatch`]
/// reports it (a storage failure stays [`CoreError::Store`]).
#[derive(Debug, thiserror::Error)]
enum Disagreement {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The stored strategy state does not fit the configured algorithm or the model.
    #[error(transparent)]
    Strategy(#[from] StrategyError),
    /// Anything else, in words.
    #[error("{0}")]
    Message(String),
}

impl Disagreement {
    /// The core's error for this disagreement about the directory `dir`.
    fn at(self, dir: &std::path::Path) -> CoreError {
        match self {
            Disagreement::Store(e) => CoreError::Store(e),
            other => CoreError::Mismatch {
                dir: dir.display().to_string(),
                message: other.to_string(),
            },
        }
    }
}

/// The federation core.
#[derive(Debug)]
pub struct Aggregator {
    pub(crate) cfg: FederationConfig,
    pub(crate) spec: ModelSpec,
    pub(crate) hash: SpecHash,
    pub(crate) store: Store,
    pub(crate) state: State,
    /// The global model, every tensor in spec order; shared with the broadcast of it being
    /// sealed (see [`ModelBroadcast`]), and copied on write only if that is still held.
    pub(crate) model: Arc<Vec<Vec<f32>>>,
    /// Under a lossy encoding, the model the sites hold (every tensor in spec order): the
    /// previous one plus each decoded delta sent, so what the encoding dropped is still in
    /// `model - held` and goes out with the next delta. `None` under `f32`, where sites hold
    /// `model` itself.
    held: Option<Arc<Vec<Vec<f32>>>>,
    /// The postcard [`ModelDelta`] giving the current version from the previous one.
    delta: Option<Vec<u8>>,
    /// Spec indices of the tensors updates carry and the mean changes.
    update_idx: Vec<usize>,
    /// Spec indices of the BN tensors sites share (the BN sharing policy under `local` BN).
    pub(crate) share_idx: Vec<usize>,
    accepted: BTreeSet<String>,
    pub(crate) chunk_bytes: usize,
    /// The algorithm's policy: plans rounds, checks extras, aggregates.
    strategy: Box<dyn Strategy>,
    /// What the strategy was built for (to rebuild it from a committed state).
    setup: Setup,
    /// The enrolled sites' keys: every message from a site is opened with it.
    /// The keys and federation a site's message is opened against.
    admission: Admission,
    /// Refusals audited and only counted per site in the open round (see
    /// [`AUDITED_REJECTS`]).
    refusals: std::sync::Mutex<Refusals>,
    /// The L2 norm of the current model over the tensors updates carry, with the model version
    /// it is of: computed once per version, not once per update.
    model_norm: std::sync::Mutex<Option<(u64, f64)>>,
}

/// Refusals of one site's messages (rejected updates, duplicates, refused registry entries)
/// audited per round; the rest are only counted, and written as one `audit-suppressed` line
/// per site when the round closes, so a misbehaving site (or a stranger replaying its
/// messages) cannot fill the disk with audit lines, nor spend an fsync per message.
pub const AUDITED_REJECTS: u32 = 32;

/// A round's refusals by site: how many were audited, and how many of each event were only
/// counted past [`AUDITED_REJECTS`].
#[derive(Debug, Default)]
struct Refusals {
    audited: BTreeMap<String, u32>,
    suppressed: BTreeMap<String, BTreeMap<String, u64>>,
}

/// The L2 norm of tensors given as their sums of squares ([`sum_squares`],
/// [`Checked::sum_squares`]).
fn l2(sums: impl Iterator<Item = f64>) -> f64 {
    sums.sum::<f64>().sqrt()
}

fn hex(h: &SpecHash) -> String {
    h.to_string()
}

impl Aggregator {
    /// Opens the federation in `dir`: resumes from its state if there is one (the config's
    /// federation and the model's spec must match it), else starts from `initial` as version 0.
    /// Models are served in chunks of `chunk_bytes`.
    pub fn open(
        dir: &Path,
        cfg: FederationConfig,
        initial: GlobalModel,
        chunk_bytes: usize,
    ) -> Result<Self, CoreError> {
        cfg.validate().map_err(CoreError::Config)?;
        let federation = Id::new(&cfg.federation)
            .map_err(|e| CoreError::Config(ConfigProblems(vec![ConfigProblem::Federation(e)])))?;
        let spec = initial.spec.clone();
        check_initial(&initial)?;
        let hash = spec.hash();
        let store = Store::open(dir)?.with_audit_budget(cfg.audit_budget_bytes);
        let update_idx: Vec<usize> = spec
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| cfg.bn_policy == BnPolicy::Global || !t.kind.is_bn())
            .map(|(i, _)| i)
            .collect();
        let share_idx: Vec<usize> = spec
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| cfg.bn_policy == BnPolicy::Local && cfg.bn_sharing.shares(t.kind))
            .map(|(i, _)| i)
            .collect();
        let (state, model) = Self::resume_or_start(&store, dir, &cfg, initial, &hash)?;
        let setup = Setup {
            tensors: update_idx
                .iter()
                .map(|&i| spec.tensors[i].clone())
                .collect(),
            encoding: cfg.encoding,
            sites: cfg.sites.len(),
            spec: Some(spec.clone()),
        };
        let strategy =
            Self::committed_strategy(&store, &cfg, &setup, &state, &hash).map_err(|d| d.at(dir))?;
        let accepted = if state.round > 0 {
            store.spool_sites(state.round)?.into_iter().collect()
        } else {
            BTreeSet::new()
        };
        Self::audit_recovered(&store, &state, &accepted)?;
        let cfg_keyring = cfg.keyring();
        let run = state.run.unwrap_or_default();
        let (held, delta) = if cfg.encoding.is_exact() {
            (None, None)
        } else {
            Self::held(&store, dir, &state, &model, &hash)?
        };
        let agg = Aggregator {
            cfg,
            spec,
            hash,
            store,
            state,
            model: Arc::new(model),
            held: held.map(Arc::new),
            delta,
            update_idx,
            share_idx,
            accepted,
            chunk_bytes: chunk_bytes.max(1),
            strategy,
            setup,
            admission: Admission::new(cfg_keyring, federation).in_run(run),
            refusals: Default::default(),
            model_norm: Default::default(),
        };
        let damaged = agg.verify_kept()?;
        if damaged > 0 {
            tracing::error!(
                damaged,
                "kept files damaged on disk were set aside at start"
            );
        }
        Ok(agg)
    }

    /// Writes at start the audit lines a process stopped too early to write: the acceptance of
    /// each update of the open round found in the spool (its re-send is answered as a
    /// duplicate, so without this line the log would never say it was accepted), and the
    /// acceptances and the close of the last round the state records as folded (a stop between
    /// the commit of a round and its lines). So every update in a committed model has its
    /// `accepted` line, and every closed round its `round-closed`.
    fn audit_recovered(
        store: &Store,
        state: &State,
        spooled: &BTreeSet<String>,
    ) -> Result<(), CoreError> {
        let line = |round, site: &str, event: &str, detail: String| {
            store.audit(&AuditEntry {
                v: FORMAT_VERSION,
                at_ms: crate::clock::now_ms(),
                round,
                site: site.to_string(),
                event: event.into(),
                detail,
            })
        };
        let found = "found at start: written before the aggregator stopped, without its line";
        if !spooled.is_empty() {
            let audited = store.audited(state.round, "accepted")?;
            for site in spooled.difference(&audited) {
                line(
                    state.round,
                    site,
                    "accepted",
                    format!("in the spool; {found}"),
                )?;
            }
        }
        if let Some(last) = state.recent.last() {
            let audited = store.audited(last.round, "accepted")?;
            for site in last.accepted.iter().filter(|s| !audited.contains(*s)) {
                line(last.round, site, "accepted", format!("folded; {found}"))?;
            }
            if store.audited(last.round, "round-closed")?.is_empty() {
                let detail = format!(
                    "{} updates -> model v{}; {found}",
                    last.accepted.len(),
                    state.model_version
                );
                line(last.round, "-", "round-closed", detail)?;
            }
        }
        Ok(())
    }

    /// The state and model of the federation in `store` (the config's federation and the
    /// model's spec must match them), or version 0 of `initial`, saved, when it has none.
    fn resume_or_start(
        store: &Store,
        dir: &Path,
        cfg: &FederationConfig,
        initial: GlobalModel,
        hash: &SpecHash,
    ) -> Result<(State, Vec<Vec<f32>>), CoreError> {
        let hash = *hash;
        Ok(match store.load_state()? {
            Some(s) => {
                let mismatch = |m: String| CoreError::Mismatch {
                    dir: dir.display().to_string(),
                    message: m,
                };
                if s.federation != cfg.federation {
                    return Err(mismatch(format!(
                        "holds federation `{}`, not `{}`",
                        s.federation, cfg.federation
                    )));
                }
                if s.spec_hash != hex(&hash) {
                    return Err(mismatch(format!(
                        "holds a model of spec {}, not {}",
                        s.spec_hash,
                        hex(&hash)
                    )));
                }
                Self::check_spool_against(store, &s).map_err(|d| d.at(dir))?;
                let model = store.load_model(s.model_version, &hash.0)?;
                let mut s = s;
                if s.run.is_none() {
                    s.run = Some(unifed_protocol::RunId::fresh());
                    store.save_state(&s)?;
                }
                (s, model)
            }
            None => {
                store.save_model(0, &hash.0, &initial.tensors)?;
                let s = State {
                    format_version: FORMAT_VERSION,
                    federation: cfg.federation.clone(),
                    spec_hash: hex(&hash),
                    round: 0,
                    model_version: 0,
                    opened_ms: 0,
                    deadline_ms: 0,
                    sampled: Vec::new(),
                    finished: false,
                    recent: Vec::new(),
                    run: Some(unifed_protocol::RunId::fresh()),
                    checksum: String::new(),
                };
                store.save_state(&s)?;
                (s, initial.tensors)
            }
        })
    }

    /// Under a lossy encoding: the model the sites hold of `state`'s version and the delta
    /// that made it, as kept beside the model.
    #[allow(clippy::type_complexity)]
    fn held(
        store: &Store,
        dir: &Path,
        state: &State,
        model: &[Vec<f32>],
        hash: &SpecHash,
    ) -> Result<(Option<Vec<Vec<f32>>>, Option<Vec<u8>>), CoreError> {
        Ok(match store.load_held(state.model_version, &hash.0)? {
            Some((t, d)) if t.len() == model.len() => (Some(t), Some(d)),
            Some(_) => {
                return Err(CoreError::Mismatch {
                    dir: dir.display().to_string(),
                    message: format!(
                        "models/v{}.held does not hold the spec's tensors",
                        state.model_version
                    ),
                });
            }
            // Version 0, or a federation that was exact until now: sites fetch the whole
            // model once and follow deltas from there.
            None => (Some(model.to_vec()), None),
        })
    }

    /// Refuses a `state.json` that disagrees with the spool on disk (an older copy put back):
    /// updates of a round after the open one, or accepted updates of an earlier round that
    /// the state does not record as folded, would otherwise be dropped silently.
    fn check_spool_against(store: &Store, s: &State) -> Result<(), Disagreement> {
        for r in store.spool_rounds()? {
            let sites = store.spool_sites(r)?;
            if sites.is_empty() {
                continue;
            }
            if r > s.round {
                return Err(Disagreement::Message(format!(
                    "state.json names round {} but the spool holds accepted updates of round \
                     {r}: the state is older than the spool (restore the newer state.json)",
                    s.round
                )));
            }
            let folded = s
                .recent
                .iter()
                .find(|c| c.round == r)
                .is_some_and(|c| sites.iter().all(|x| c.accepted.contains(x)));
            if r < s.round && !folded {
                return Err(Disagreement::Message(format!(
                    "state.json names round {} but round {r}'s accepted updates ({}) were never \
                     folded into a model: the state does not belong with this spool",
                    s.round,
                    sites.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The strategy as committed with the current model version: resumed from its stored
    /// state, or fresh at version 0. A stateful algorithm whose state is missing past version 0
    /// (or a state of another algorithm) is an error, never a silent restart of its moments.
    fn committed_strategy(
        store: &Store,
        cfg: &FederationConfig,
        setup: &Setup,
        state: &State,
        hash: &SpecHash,
    ) -> Result<Box<dyn Strategy>, Disagreement> {
        let stored = store.load_strategy(state.model_version, &hash.0)?;
        if stored.is_none() && state.model_version > 0 && cfg.algorithm.is_stateful() {
            return Err(Disagreement::Message(format!(
                "models/v{}.strategy is missing: the state of `{}` cannot be resumed",
                state.model_version,
                cfg.algorithm.name()
            )));
        }
        Ok(strategy::from_config(&cfg.algorithm, setup, stored)?)
    }

    /// The current global model, every tensor in spec order.
    pub fn model(&self) -> &[Vec<f32>] {
        &self.model
    }

    /// The model the sites hold, every tensor in spec order: the global model under `f32`;
    /// under a lossy encoding, what the deltas sent so far add up to.
    pub fn held_model(&self) -> &[Vec<f32>] {
        self.held.as_deref().unwrap_or(&self.model)
    }

    /// The model spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The federation's run: every message it sends and takes is of it.
    pub fn run(&self) -> unifed_protocol::RunId {
        self.state.run.unwrap_or_default()
    }

    /// The open round (0 before the start).
    pub fn round(&self) -> u64 {
        self.state.round
    }

    /// The current model version.
    pub fn model_version(&self) -> u64 {
        self.state.model_version
    }

    /// True once every round has run.
    pub fn finished(&self) -> bool {
        self.state.finished
    }

    /// Sites accepted in the open round.
    pub fn accepted(&self) -> Vec<String> {
        self.accepted.iter().cloned().collect()
    }

    /// The data directory's store (for audits and tests).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Handles one event at time `now_ms` (ms since the epoch) and returns what to do.
    /// Errors are storage failures of the aggregator itself; bad input is answered, not an error.
    pub fn handle(&mut self, event: Event, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        match event {
            Event::Start => {
                if self.state.round == 0 {
                    self.state.round = 1;
                    self.open_round(now_ms)?;
                } else if self.state.finished && self.cfg.rounds > self.state.round {
                    // The config asks for more rounds than the finished federation ran: the
                    // same run goes on from its final model.
                    let last = self.state.round;
                    self.state.finished = false;
                    self.state.round = last + 1;
                    // The last round's updates (kept in the spool until now) are folded already.
                    self.accepted.clear();
                    self.store.spool_clear_before(last + 1)?;
                    self.open_round(now_ms)?;
                    self.audit(
                        now_ms,
                        last + 1,
                        "-",
                        "extended",
                        format!("rounds {last} -> {}", self.cfg.rounds),
                    )?;
                } else if self.round_complete() {
                    // A crash between the last accept and the round's commit: close it now.
                    return self.close_round(now_ms);
                }
                let mut actions = vec![self.publish()];
                if self.state.finished {
                    // Resumed after the last round: serve the final model, and say it is over.
                    actions.push(Action::Finished {
                        model_version: self.state.model_version,
                    });
                }
                Ok(actions)
            }
            Event::Tick => {
                if self.round_complete() {
                    // Complete without a new update: a revocation lowered what it needs.
                    return Ok(vec![Action::Close]);
                }
                if self.state.round == 0 || self.state.finished || now_ms < self.state.deadline_ms {
                    return Ok(Vec::new());
                }
                if self.accepted.is_empty() {
                    tracing::warn!(
                        round = self.state.round,
                        "deadline passed without updates; extending the round"
                    );
                    self.open_round(now_ms)?;
                    return Ok(vec![self.publish()]);
                }
                self.close_round(now_ms)
            }
            Event::Update(one) => self.on_updates(vec![one], now_ms),
            Event::Updates(batch) => self.on_updates(batch, now_ms),
            Event::Resent { site, round, hash } => self.on_resent(To { site, hash, round }, now_ms),
            Event::Close => {
                if !self.round_complete() {
                    return Ok(Vec::new());
                }
                self.close_round(now_ms)
            }
        }
    }

    fn open_round(&mut self, now_ms: u64) -> Result<(), CoreError> {
        let round = self.state.round;
        self.state.sampled = if self.cfg.sites.is_empty() {
            Vec::new()
        } else {
            // A site whose key is revoked cannot send anything the round would take.
            let mut sites: Vec<String> = self.cfg.unrevoked_sites().map(|s| s.id.clone()).collect();
            sites.sort();
            let mut rng = ChaCha8Rng::seed_from_u64(
                self.cfg.seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            sites.shuffle(&mut rng);
            sites.truncate(self.cfg.sampled_per_round().min(sites.len()));
            sites.sort();
            sites
        };
        self.state.opened_ms = now_ms;
        self.state.deadline_ms = now_ms.saturating_add(self.cfg.deadline_secs * 1000);
        self.store.save_state(&self.state)?;
        Ok(())
    }

    /// The postcard [`ServerBroadcast`] of the model the sites hold: every tensor under
    /// `global` BN, the non-BN ones under `local`, always as exact f32 (a site that fetches the
    /// whole model holds exactly what the sites following the deltas hold), in chunks of the
    /// federation's size. On a little-endian machine it is written from the model each time
    /// its bytes are needed ([`ModelBroadcast`]) rather than held.
    pub fn broadcast(&self) -> Cut {
        let held = self.held.as_ref().unwrap_or(&self.model);
        if cfg!(target_endian = "big") {
            let payload = self.exact_broadcast(
                self.state.model_version,
                self.update_idx
                    .iter()
                    .map(|&i| (&self.spec.tensors[i], held[i].as_slice())),
                self.strategy.extras(),
            );
            return Cut::new(payload, self.chunk_bytes);
        }
        let tensors = self
            .update_idx
            .iter()
            .map(|&i| {
                let t = &self.spec.tensors[i];
                (
                    t.name.clone(),
                    t.shape.iter().map(|&d| d as u32).collect(),
                    i,
                )
            })
            .collect();
        let source = ModelBroadcast::new(
            self.state.model_version,
            tensors,
            Arc::clone(held),
            self.strategy.extras(),
        );
        Cut::streamed(Arc::new(source), self.chunk_bytes)
    }

    /// Under a lossy encoding, sends the new model `version` as a delta from the held one:
    /// encodes `model - held` over the trainable tensors of the broadcast (BN running
    /// statistics go whole, as exact values), adds the decoded delta to `held`, and writes
    /// both before the state that names `version` is committed.
    fn advance_held(&mut self, version: u64) -> Result<(), CoreError> {
        let Some(held) = &mut self.held else {
            return Ok(());
        };
        let held = Arc::make_mut(held);
        let mut delta = Vec::new();
        for &i in &self.update_idx {
            let t = &self.spec.tensors[i];
            if t.kind.is_bn_stat() {
                held[i].copy_from_slice(&self.model[i]);
                continue;
            }
            // The delta is encoded in its own buffer (what the encoding drops is left there
            // and freed: it is still in `model - held`), and its decoded values are added to
            // `held` where it lies: one tensor-sized buffer a tensor.
            let mut d: Vec<f32> = self.model[i]
                .iter()
                .zip(&held[i])
                .map(|(x, h)| x - h)
                .collect();
            let shape: Vec<u32> = t.shape.iter().map(|&n| n as u32).collect();
            let e = encode_leaving_error(&t.name, &shape, &mut d, self.cfg.encoding);
            drop(d);
            decode_add(&e, &mut held[i]).map_err(|e| CoreError::Model(e.to_string()))?;
            delta.push(e);
        }
        let values = strategy::exact(
            self.update_idx
                .iter()
                .filter(|&&i| self.spec.tensors[i].kind.is_bn_stat())
                .map(|&i| (&self.spec.tensors[i], held[i].as_slice())),
        );
        let payload = postcard::to_allocvec(&ModelDelta {
            from_version: version.saturating_sub(1),
            model_version: version,
            delta,
            values,
            extras: self.strategy.extras(),
        })
        .expect("delta serialises");
        self.store
            .save_held(version, &self.hash.0, held, &payload)?;
        self.delta = Some(payload);
        Ok(())
    }

    /// The postcard [`ServerBroadcast`] of model `version` carrying `tensors` in exact f32 and
    /// `extras`: what round models and onboarding packages are made of.
    pub(crate) fn exact_broadcast<'a>(
        &self,
        version: u64,
        tensors: impl Iterator<Item = (&'a TensorSpec, &'a [f32])>,
        extras: ServerExtras,
    ) -> Vec<u8> {
        if cfg!(target_endian = "big") {
            let b = ServerBroadcast {
                model_version: version,
                weights: strategy::exact(tensors),
                extras,
            };
            return postcard::to_allocvec(&b).expect("broadcast serialises");
        }
        // On a little-endian machine the values are the wire's bytes: each tensor is borrowed
        // and written once, into a buffer of the payload's exact size (an owned encoding and a
        // buffer grown by doubling made three model-sized copies, all freshly faulted in).
        let b = ServerBroadcast {
            model_version: version,
            weights: tensors
                .map(|(t, v)| EncodedTensorRef {
                    name: t.name.clone(),
                    shape: t.shape.iter().map(|&d| d as u32).collect(),
                    values: Values::F32(bytemuck::cast_slice(v)),
                })
                .collect(),
            extras,
        };
        let len = postcard::experimental::serialized_size(&b).expect("broadcast serialises");
        postcard::to_extend(&b, Vec::with_capacity(len)).expect("broadcast serialises")
    }

    fn publish(&self) -> Action {
        // The model is written into its chunks as the service seals them; the delta (small,
        // under a lossy encoding) is held once and its chunks signed as slices of it.
        let model = Box::new(self.broadcast());
        let (delta, delta_cut) = match &self.delta {
            Some(d) if self.state.model_version > 0 => {
                let c = Cut::new(d.clone(), self.chunk_bytes);
                let info = DeltaInfo {
                    from_version: self.state.model_version - 1,
                    chunk_count: c.count(),
                    payload_len: c.len() as u64,
                    payload_hash: c.payload_hash(),
                };
                (Some(info), Some(Box::new(c)))
            }
            _ => (None, None),
        };
        let manifest = RoundManifest {
            run: self.run(),
            round: self.state.round,
            model_version: self.state.model_version,
            spec_hash: self.hash,
            chunk_count: model.count(),
            payload_len: model.len() as u64,
            payload_hash: model.payload_hash(),
            delta,
            encoding: self.cfg.encoding,
            bn_policy: self.cfg.bn_policy,
            bn_sharing: self.cfg.bn_sharing,
            sampled: self
                .state
                .sampled
                .iter()
                .filter_map(|s| Id::new(s).ok())
                .collect(),
            upload_window_bytes: self.cfg.upload_window_bytes(self.state.sampled.len()),
            plan: self.strategy.plan(self.state.round),
            deadline_ms: self.state.deadline_ms,
            finished: self.state.finished,
        };
        Action::Publish {
            manifest,
            model,
            delta: delta_cut,
        }
    }

    /// Audits a refusal of `site`'s message (`event`: `rejected`, `duplicate`,
    /// `registry-refused`): the site's first [`AUDITED_REJECTS`] of the round are written,
    /// the rest only counted for the round's `audit-suppressed` line.
    pub(crate) fn audit_refusal(
        &self,
        now_ms: u64,
        round: u64,
        site: &str,
        event: &str,
        detail: String,
    ) -> Result<(), CoreError> {
        {
            let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
            let n = r.audited.entry(site.to_string()).or_default();
            if *n >= AUDITED_REJECTS {
                *r.suppressed
                    .entry(site.to_string())
                    .or_default()
                    .entry(event.to_string())
                    .or_default() += 1;
                return Ok(());
            }
            *n += 1;
        }
        self.audit(now_ms, round, site, event, detail)
    }

    /// Writes one `audit-suppressed` line per site whose refusals in `round` went past
    /// [`AUDITED_REJECTS`], with their count by event, and starts counting afresh.
    pub(super) fn audit_suppressed(&self, now_ms: u64, round: u64) -> Result<(), CoreError> {
        let r = std::mem::take(&mut *self.refusals.lock().unwrap_or_else(|p| p.into_inner()));
        for (site, events) in r.suppressed {
            let counts: Vec<String> = events.iter().map(|(e, n)| format!("{n} {e}")).collect();
            let detail = format!(
                "past the first {AUDITED_REJECTS} refusals of the round, only counted: {}",
                counts.join(", ")
            );
            self.audit(now_ms, round, &site, "audit-suppressed", detail)?;
        }
        Ok(())
    }

    pub(crate) fn audit(
        &self,
        now_ms: u64,
        round: u64,
        site: &str,
        event: &str,
        detail: String,
    ) -> Result<(), CoreError> {
        if let Err((free, floor)) = self.disk_room() {
            tracing::error!(
                site,
                event,
                detail,
                free,
                floor,
                "audit line not written: the data disk is below its free-space floor"
            );
            return Ok(());
        }
        self.store.audit(&AuditEntry {
            v: FORMAT_VERSION,
            at_ms: now_ms,
            round,
            site: site.into(),
            event: event.into(),
            detail,
        })?;
        Ok(())
    }

    /// `Err((free, floor))` when the data disk is below its free-space floor.
    fn disk_room(&self) -> Result<(), (u64, u64)> {
        let floor = self.cfg.min_free_disk_bytes;
        match self.store.free_bytes() {
            Ok(free) if free < floor => Err((free, floor)),
            _ => Ok(()),
        }
    }

    /// Replaces the revocation list: messages signed by a key on it are refused from now on
    /// (and those of a key taken off it are taken again).
    pub fn set_revoked(&mut self, revoked: Vec<unifed_protocol::PublicKey>) {
        self.cfg.revoked = revoked;
        self.admission.keyring = self.cfg.keyring();
    }

    /// The federation's configuration (its revocation list as last set).
    pub fn config(&self) -> &FederationConfig {
        &self.cfg
    }

    /// How a site's message is opened ([`Admission::admit`]); a clone serves away from the
    /// core (the service's update-chunk threads), taken again after [`Aggregator::set_revoked`].
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Whether an open, unfinished round has every update it needs: what [`Event::Close`]
    /// folds.
    fn round_complete(&self) -> bool {
        self.state.round > 0
            && !self.state.finished
            && !self.accepted.is_empty()
            && self.accepted.len() >= self.needed()
    }

    /// Updates that close the open round: `min_sites`, or fewer when fewer sampled sites can
    /// still be taken: those accepted, and those whose key is not revoked (a round does not
    /// wait its deadline for a site it can no longer take anything from).
    fn needed(&self) -> usize {
        if self.state.sampled.is_empty() {
            return self.cfg.min_sites;
        }
        let unrevoked: BTreeSet<&str> = self.cfg.unrevoked_sites().map(|s| s.id.as_str()).collect();
        let able = self
            .state
            .sampled
            .iter()
            .filter(|id| self.accepted.contains(*id) || unrevoked.contains(id.as_str()))
            .count();
        self.cfg.min_sites.min(able.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_norm_in_eight_sums_is_the_norm_of_one_sum_to_rounding() {
        for n in [0usize, 1, 7, 8, 9, 63, 1000, 100_003] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 2_654_435_761) % 2001) as f32 * 1e-3 - 1.0)
                .collect();
            let le: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let one: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            let one = one.sqrt();
            for norm in [
                l2([Checked::Decoded(v.clone()).sum_squares()].into_iter()),
                l2([Checked::Exact(&le).sum_squares()].into_iter()),
            ] {
                assert!(
                    (norm - one).abs() <= 1e-12 * one.max(1.0),
                    "{n}: {norm} against {one}"
                );
            }
            // Split across tensors, the same norm.
            let (a, b) = v.split_at(n / 3);
            let split = l2([a, b].into_iter().map(|t| sum_squares(t.iter().copied())));
            assert!((split - one).abs() <= 1e-12 * one.max(1.0), "{n}");
        }
        // Values near f32's largest square without overflow in f64.
        let big = [3.0e38f32, 3.0e38];
        let x = f64::from(big[0]);
        assert_eq!(
            l2([sum_squares(big.into_iter())].into_iter()),
            (2.0 * x * x).sqrt()
        );
    }
}
