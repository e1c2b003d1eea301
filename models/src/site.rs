//! One federated site: its own model (and so its own BatchNorm layers), data and
//! error-feedback residuals, speaking the wire protocol: it applies a server broadcast, trains
//! locally and encodes its update envelope. The agent service and the in-process runner share it.

use crate::backend::Device;
use crate::client::{After, Before, ClientState, for_plan};
use crate::data::Dataset;
pub use crate::error::SiteError;
use crate::error::StateError;
pub use crate::memory::{Memory, MemoryLayout};
use crate::objective::Term;
use crate::park::{Kept, KeptWriter, Parked, Spilled, Stash};
use crate::state::{
    NamedTensor, Select, StateDict, export, export_layout, import, import_into, stand_in, subtract,
};
use crate::train::{
    EVAL_BATCH, EvalReport, TrainConfig, TrainEvent, evaluate_masked, train_objective, train_owned,
};
use crate::update::UpdateError;
pub use crate::update::encoding_for;
use crate::zoo::Net;
use serde::Serialize;
use std::collections::BTreeMap;
use unifed_protocol::ModelSpec;
use unifed_protocol::encoding::{EncodedTensor, EncodedTensorRef, Encoding, Values, decode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnPolicy, Download, LocalReport, ModelDelta, RoundManifest, RoundPlan, SiteExtras, SiteUpdate,
};

/// What a round's training reports to the aggregator: its local steps and last epoch's loss.
fn local_report(rep: &crate::train::TrainReport) -> LocalReport {
    LocalReport {
        local_steps: rep.steps as u64,
        train_loss: *rep.epoch_losses.last().unwrap_or(&f64::NAN),
    }
}

/// Which tensors travel under a BN policy.
pub fn select_for(bn: BnPolicy) -> Select {
    match bn {
        BnPolicy::Local => Select::NonBn,
        BnPolicy::Global => Select::All,
    }
}

/// The seed of site `site`'s local training in `round`: the one rule the agent and the
/// in-process runner share (`seed` is the site's configured training seed). Seed, round and
/// site are each folded in through SplitMix64's finaliser, so no two of (seed, round, site)
/// share a shuffle by arithmetic accident (`seed ^ round` gave seed 0's round 3 the shuffle of
/// seed 1's round 2, and every site of a run the same one).
pub fn round_seed(seed: u64, round: u64, site: &str) -> u64 {
    let name = site.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    });
    splitmix(splitmix(splitmix(seed) ^ round) ^ name)
}

/// SplitMix64's step: a bijection of `z` whose output bits each depend on every input bit.
fn splitmix(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The error of a parked model's file at `path`.
fn park_error(path: &std::path::Path, source: std::io::Error) -> SiteError {
    SiteError::Park {
        path: path.to_path_buf(),
        source,
    }
}

/// The error of kept vectors `k` (their file's, when they wait in one).
fn kept_error(k: &Kept, source: std::io::Error) -> SiteError {
    match k {
        Kept::Filed(s) => park_error(s.path(), source),
        Kept::Here(_) => SiteError::Memory(source.to_string()),
    }
}

/// A writer of a part of the memory: into a new stash file at `path`, or into memory without
/// one.
fn kept_writer(path: Option<std::path::PathBuf>) -> Result<KeptWriter, SiteError> {
    match path {
        Some(p) => Stash::create(&p)
            .map(KeptWriter::Filed)
            .map_err(|e| park_error(&p, e)),
        None => Ok(KeptWriter::Here(BTreeMap::new())),
    }
}

/// The vectors `w` kept, or the error writing their file.
fn finish_kept(w: KeptWriter) -> Result<Kept, SiteError> {
    match w {
        KeptWriter::Here(m) => Ok(Kept::Here(m)),
        KeptWriter::Filed(w) => {
            let path = w.path().to_path_buf();
            w.finish()
                .map(Kept::Filed)
                .map_err(|e| park_error(&path, e))
        }
    }
}

/// Moves `k` into a stash file at `path`, if given (see [`Kept::file_at`]).
fn file_kept(k: &mut Kept, path: Option<std::path::PathBuf>) -> Result<(), SiteError> {
    match path {
        Some(p) => k.file_at(&p).map_err(|e| park_error(&p, e)),
        None => Ok(()),
    }
}

/// Refuses a memory with a tensor whose name or length the spec does not know, naming it (a
/// residual may be empty: nothing left behind).
fn check_memory(m: &Memory<Kept>, spec: &ModelSpec) -> Result<(), SiteError> {
    crate::client::fedcd::check(&m.algorithm, spec)?;
    crate::client::fedimpro::check(&m.algorithm, spec)?;
    let fits = |name: &str, len: usize, may_be_empty: bool| {
        spec.tensors
            .iter()
            .any(|t| t.name == name && ((may_be_empty && len == 0) || t.numel() == len))
    };
    let lens = |k: &Kept| -> Vec<(String, usize)> {
        k.names()
            .map(|n| (n.to_string(), k.len_of(n).unwrap_or(0)))
            .collect()
    };
    let mut others: Vec<(String, usize)> = m
        .algorithm
        .tensors()
        .map(|(n, v)| (n.clone(), v.len()))
        .collect();
    others.extend(m.held.iter().flat_map(|(_, h)| lens(h)));
    let bad = lens(&m.residual)
        .into_iter()
        .find(|(n, len)| !fits(n, *len, true))
        .or_else(|| others.into_iter().find(|(n, len)| !fits(n, *len, false)));
    match bad {
        Some((name, len)) => Err(SiteError::Memory(format!(
            "tensor `{name}` ({len} values) does not fit the model spec"
        ))),
        None => Ok(()),
    }
}

/// Removes the stash files beside the parked model at `park` that an earlier process left
/// behind (they are scratch: the checkpoint holds the memory).
fn remove_stale_stashes(park: &std::path::Path) {
    let (Some(dir), Some(stem)) = (park.parent(), park.file_stem().and_then(|s| s.to_str())) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    }) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(stem)) else {
            continue;
        };
        let stale = ["residual", "held"].iter().any(|part| {
            rest.strip_prefix('.')
                .and_then(|r| r.strip_prefix(part))
                .and_then(|r| r.strip_prefix('.'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        });
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// One site: its own model (and so its own BN layers), data and error-feedback residuals.
#[derive(Debug)]
pub struct Site<N: Net> {
    /// Site id.
    pub id: Id,
    /// The site's model.
    pub net: N,
    /// Training split.
    pub train: Dataset,
    /// Test split.
    pub test: Dataset,
    /// Residuals and control variates, as of the last accepted update.
    memory: Memory<Kept>,
    /// The residuals and control variate the update of a round leaves behind, kept until the
    /// aggregator answers: only an accepted update advances them.
    pending: Option<(u64, Memory<Kept>)>,
    /// Stash files made so far (each gets a name of its own).
    stashes: u64,
    /// Seconds the last [`Site::train_round`] spent encoding its update after training.
    encode_seconds: f64,
    /// Where training parks the starting model ([`Site::park_base_in`]).
    park: Option<std::path::PathBuf>,
    /// The round and report of the last update [`Site::train_round`] made.
    report: Option<(u64, LocalReport)>,
}

impl<N: Net> Site<N> {
    /// A site with its own copy of the initial model.
    pub fn new(id: &str, net: N, train: Dataset, test: Dataset) -> Result<Self, SiteError> {
        Ok(Site {
            id: Id::new(id).map_err(|e| SiteError::Id(id.to_string(), e.to_string()))?,
            net,
            train,
            test,
            memory: Memory::default(),
            pending: None,
            stashes: 0,
            encode_seconds: 0.0,
            park: None,
            report: None,
        })
    }

    /// Makes [`Site::train_round`] park the starting model in the file at `path` while it
    /// trains, so that training holds one copy of the model instead of two (the delta reads it
    /// back a block at a time). Objectives that train against the starting weights (FedProx)
    /// keep them in memory regardless. The two model-sized parts of the site's memory that a
    /// lossy encoding keeps, the error-feedback residual and the held broadcast, then wait in
    /// files beside it between uses (`path` with the extensions `residual.N` and `held.N`);
    /// the rest of the memory (control variates, MOON's previous model) waits in `path` with
    /// the extension `memory` while the site trains. Files of those names that an earlier
    /// process left behind are removed; parts the site holds already go to files now.
    pub fn park_base_in(&mut self, path: std::path::PathBuf) -> Result<(), SiteError> {
        remove_stale_stashes(&path);
        self.park = Some(path);
        let (residual, held) = (self.stash_path("residual"), self.stash_path("held"));
        file_kept(&mut self.memory.residual, residual)?;
        match &mut self.memory.held {
            Some((_, h)) => file_kept(h, held),
            None => Ok(()),
        }
    }

    /// A new stash file's path beside the parked model, for a part of the memory (`residual`,
    /// `held`); none when the site does not park.
    fn stash_path(&mut self, part: &str) -> Option<std::path::PathBuf> {
        let park = self.park.as_ref()?;
        self.stashes += 1;
        Some(park.with_extension(format!("{part}.{}", self.stashes)))
    }

    /// Writes the memory held in memory but the held broadcast (control variates, MOON's
    /// previous model, a residual not in a file) beside the parked model and frees it, when the
    /// site parks and it holds anything.
    fn spill(&mut self) -> Result<Option<Spilled>, SiteError> {
        let Some(p) = &self.park else {
            return Ok(None);
        };
        let path = p.with_extension("memory");
        if self.memory.values_mut().all(|v| v.is_empty()) {
            return Ok(None);
        }
        Spilled::write(&path, self.memory.values_mut())
            .map(Some)
            .map_err(|e| park_error(&path, e))
    }

    /// Reads back what [`Site::spill`] wrote.
    fn unspill(&mut self, spilled: Option<Spilled>) -> Result<(), SiteError> {
        let Some(s) = spilled else {
            return Ok(());
        };
        let path = s.path().to_path_buf();
        s.read(self.memory.values_mut())
            .map_err(|e| park_error(&path, e))
    }

    /// Applies the model of the round `m` announces, whole or as a delta from the version the
    /// site applied last: the non-BN weights under `local` BN (the site keeps its BN), every
    /// tensor under `global`, and the server's control variate when the plan uses one (SCAFFOLD,
    /// FedDC).
    /// Under a lossy encoding the applied weights are kept for the next delta. A model that does
    /// not fit the spec or the plan, or a delta from a version the site does not hold, changes
    /// nothing.
    pub fn receive<B: AsRef<[u8]>>(
        &mut self,
        spec: &ModelSpec,
        m: &RoundManifest,
        download: &Download<B>,
    ) -> Result<(), SiteError> {
        let select = select_for(m.bn_policy);
        let client = for_plan::<N>(&m.plan.objective);
        let received =
            client.received(spec, select, m, download.model_version(), download.extras())?;
        // Under a lossy encoding the site keeps what it applied for the next delta (in a file
        // when it parks, written as the model is).
        let lossy = !m.encoding.is_exact();
        match download {
            Download::Model(b) => {
                // Nothing can fail after this check but the held model's file. The old held
                // model goes before the new one is made, and each tensor is decoded from the
                // payload once the model's old one has gone: the site holds the payload beside
                // its model, no decoded copy of it.
                let checked = crate::state::CheckedImport::new(spec, &b.weights, select)?;
                self.memory.held = None;
                let mut held = match lossy {
                    true => Some(kept_writer(self.stash_path("held"))?),
                    false => None,
                };
                checked.import_into(
                    &mut self.net,
                    held.as_mut().map(|h| h as &mut dyn crate::state::Keep),
                )?;
                self.memory.held = held
                    .map(finish_kept)
                    .transpose()?
                    .map(|h| (download.model_version(), h));
            }
            Download::Delta(d) => {
                let sd = self.add_to_held(spec, select, m, d)?;
                // Nothing can fail after this check (the import's own) but the held model's
                // file. The old held model goes before the new one is copied: a site holds
                // one beside its model.
                crate::state::validate(&sd, spec, select)?;
                self.memory.held = None;
                let mut held = match lossy {
                    true => Some(kept_writer(self.stash_path("held"))?),
                    false => None,
                };
                if let Some(h) = &mut held {
                    for t in &sd.tensors {
                        crate::state::Keep::keep(h, &t.name, &t.data);
                    }
                }
                // The tensors move into the model and the old ones are freed as they go.
                import_into(&mut self.net, spec, sd, select)?;
                self.memory.held = held
                    .map(finish_kept)
                    .transpose()?
                    .map(|h| (download.model_version(), h));
            }
        }
        let algorithm = std::mem::take(&mut self.memory.algorithm);
        self.memory.algorithm = client.adopt(algorithm);
        self.memory.algorithm.set_server(received);
        Ok(())
    }

    /// The held broadcast tensors plus delta `d`, in spec order: the trainable tensors add the
    /// decoded delta (in f32, exactly as the aggregator did), BN running statistics take the
    /// delta's values.
    fn add_to_held<B: AsRef<[u8]>>(
        &self,
        spec: &ModelSpec,
        select: Select,
        m: &RoundManifest,
        d: &ModelDelta<B>,
    ) -> Result<StateDict, SiteError> {
        let plan = |message: String| SiteError::Plan {
            round: m.round,
            message,
        };
        let held = match &self.memory.held {
            Some((v, h)) if *v == d.from_version => h,
            other => {
                return Err(plan(format!(
                    "a delta from model v{} to a site that holds {}",
                    d.from_version,
                    other
                        .as_ref()
                        .map_or("no model".into(), |(v, _)| format!("v{v}"))
                )));
            }
        };
        let mut sd = StateDict {
            spec_hash: spec.hash(),
            tensors: spec
                .tensors
                .iter()
                .filter(|t| select.keeps(t.kind))
                .map(|t| match held.get(&t.name) {
                    Ok(Some(data)) if data.len() == t.numel() => Ok(NamedTensor {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        kind: t.kind,
                        data,
                    }),
                    Ok(_) => Err(plan(format!("the held model lacks `{}`", t.name))),
                    Err(e) => Err(kept_error(held, e)),
                })
                .collect::<Result<_, _>>()?,
        };
        // Deltas are decoded into the new model's own buffers: no decoded tensor is ever held
        // beside the held model and the new one.
        let pieces = d
            .delta
            .iter()
            .map(|e| (e, false))
            .chain(d.values.iter().map(|e| (e, true)));
        for (t, is_value) in pieces {
            let kind = crate::state::spec_of_encoded(spec, t)?.kind;
            if kind.is_bn_stat() != is_value {
                return Err(plan(format!(
                    "`{}` comes as a {} (statistics come as values, the rest as deltas)",
                    t.name,
                    if is_value { "value" } else { "delta" }
                )));
            }
            let h = sd
                .tensors
                .iter_mut()
                .find(|h| h.name == t.name)
                .ok_or_else(|| {
                    plan(format!(
                        "`{}` is not broadcast under this BN policy",
                        t.name
                    ))
                })?;
            let undecodable = |e| StateError::Mismatch(format!("tensor `{}`: {e}", t.name));
            if is_value {
                h.data = decode(t).map_err(undecodable)?;
            } else {
                unifed_protocol::decode_add(t, &mut h.data).map_err(undecodable)?;
            }
        }
        Ok(sd)
    }

    /// Trains locally for the round that `m` announces, from the current model, with the
    /// round's plan and the federation's policies, and returns the encoded update envelope.
    /// `tc.seed` is the site's seed; the round's is [`round_seed`]. Under `local` BN the update
    /// carries the trained BN tensors the sharing policy lets leave the site, as exact f32.
    /// The error-feedback residual it leaves behind takes effect when [`Site::answered`] reports
    /// the update accepted.
    pub fn train_round(
        &mut self,
        spec: &ModelSpec,
        federation: &Id,
        m: &RoundManifest,
        tc: &TrainConfig,
        device: &Device,
        mut progress: impl FnMut(TrainEvent),
    ) -> Result<Vec<u8>, SiteError> {
        let select = select_for(m.bn_policy);
        let tc = TrainConfig {
            seed: round_seed(tc.seed, m.round, self.id.as_str()),
            ..tc.clone()
        };
        // The round's algorithm, with its state (a restored site may hold another's).
        let client = for_plan::<N>(&m.plan.objective);
        let held = std::mem::take(&mut self.memory.algorithm);
        self.memory.algorithm = client.adopt(held);
        let mut inputs = client.inputs(&Before {
            net: &self.net,
            spec,
            select,
            manifest: m,
            state: &self.memory.algorithm,
        })?;
        let term = Term::new(&m.plan.objective, &self.net, select, inputs.site_state())?;
        drop(inputs);
        let (net, rep, parked) = self.train_parked(spec, &tc, &term, device, &mut progress)?;
        drop(term);
        let encoding = std::time::Instant::now();
        let plain = client.streams_update();
        let (mut d, streamed) = self.delta(net, parked, spec, federation, m, &rep, plain)?;
        // What an accepted update advances: the residuals and the algorithm's state.
        let (extras, mut algorithm) = client.after_delta(&After {
            net: &self.net,
            spec,
            delta: &d,
            steps: rep.steps,
            lr: tc.lr / (1.0 - tc.momentum),
            report: &rep,
            manifest: m,
            state: &self.memory.algorithm,
        })?;
        let (owned, residual) = self.encode_fed(&mut d, m)?;
        let encoded: Vec<EncodedTensorRef> = d
            .tensors
            .iter()
            .zip(&owned)
            .map(|(t, e)| match e {
                Some(e) => e.as_ref(),
                None => t
                    .exact_le()
                    .expect("borrowed only on a little-endian machine"),
            })
            .collect();
        client.after_encoding(spec, &encoded, &mut algorithm)?;
        let next = Memory {
            residual,
            held: None,
            algorithm,
        };
        self.pending = Some((m.round, next));
        let report = local_report(&rep);
        self.report = Some((m.round, report));
        if let Some(bytes) = streamed {
            self.encode_seconds = encoding.elapsed().as_secs_f64();
            return Ok(bytes);
        }
        let shared = self.shared_bn(&self.net, spec, m);
        let upd = SiteUpdate {
            round: m.round,
            base_version: m.model_version,
            samples: self.train.len() as u64,
            delta: encoded,
            bn: shared.iter().map(EncodedTensor::as_ref).collect(),
            report,
            extras,
        };
        let bytes = Envelope::encode_new(
            MessageKind::SiteUpdate,
            federation,
            &self.id,
            (m.run, m.round, m.model_version),
            spec.hash(),
            &upd,
        );
        self.encode_seconds = encoding.elapsed().as_secs_f64();
        Ok(bytes)
    }

    /// Trains the site's model under `term`: the trained model, its report, and the file the
    /// starting model waits in when the site parks it. Everything training does not read waits
    /// in a file until it ends; on an error the site holds its starting model again.
    fn train_parked(
        &mut self,
        spec: &ModelSpec,
        tc: &TrainConfig,
        term: &Term<N>,
        device: &Device,
        progress: &mut impl FnMut(TrainEvent),
    ) -> Result<(N, crate::train::TrainReport, Option<Parked>), SiteError> {
        // Written first, so that the model's export below is not made beside it.
        let spilled = self.spill()?;
        // A term that holds the starting weights itself (FedProx, MOON) gains nothing from
        // parking them.
        let parked = match self.park.clone() {
            Some(p) if !term.holds_start() => match Parked::write_net(&p, &self.net, spec) {
                Ok(parked) => Some(parked),
                Err(e) => {
                    self.unspill(spilled)?;
                    return Err(park_error(&p, e));
                }
            },
            _ => None,
        };
        let classes = spec.classes.len();
        let trained = match &parked {
            None => train_objective(
                &self.net,
                &self.train,
                classes,
                tc,
                term,
                device,
                &mut *progress,
            )
            .map_err(SiteError::from),
            Some(parked) => {
                // Until training ends the site holds a stand-in, and the file the weights.
                let placeholder = stand_in(&self.net);
                let base = std::mem::replace(&mut self.net, placeholder);
                let (net, rep) =
                    train_owned(base, &self.train, classes, tc, term, device, &mut *progress);
                match rep {
                    Ok(rep) => Ok((net, rep)),
                    Err(e) => self.unpark(parked, net, spec).and(Err(e.into())),
                }
            }
        };
        // Training's freed buffers may go back to the system first (see `TrainEvent::Trained`).
        if trained.is_ok() {
            progress(TrainEvent::Trained);
        }
        self.unspill(spilled)?;
        let (net, rep) = trained?;
        Ok((net, rep, parked))
    }

    /// The update's delta of `net`, trained from the site's model (or the model `parked`
    /// holds), and the site then holds `net`. An update whose every tensor goes as exact f32
    /// with no residual to add, from a parked base, and `plain` (nothing else is made of its
    /// delta), is written into its envelope from the trained model and the parked file a block
    /// at a time (`update::exact_update`): the envelope comes back too, and the delta only
    /// lists the tensors, with no values. A non-finite delta leaves the starting model.
    #[allow(clippy::too_many_arguments)]
    fn delta(
        &mut self,
        net: N,
        parked: Option<Parked>,
        spec: &ModelSpec,
        federation: &Id,
        m: &RoundManifest,
        rep: &crate::train::TrainReport,
        plain: bool,
    ) -> Result<(StateDict, Option<Vec<u8>>), SiteError> {
        let select = select_for(m.bn_policy);
        let layout = export_layout(&net, spec, select);
        let exact = plain && self.sends_exact(&layout, m);
        let streamed = match parked.as_ref().filter(|_| exact) {
            Some(p) => match self.exact_envelope(&net, &layout, p, spec, federation, m, rep) {
                Ok(bytes) => Some(bytes),
                Err(e) => {
                    self.unpark(p, net, spec)?;
                    return Err(match e {
                        UpdateError::NonFinite(name) => SiteError::NonFinite(name),
                        UpdateError::Park(e) => park_error(p.path(), e),
                    });
                }
            },
            None => None,
        };
        // Otherwise the delta is made in the trained tensors' own buffers, and the base exported
        // (or read back from its file) only now and dropped as soon as it is subtracted:
        // training never has a copy of the base beside the optimiser's state.
        let d = match (&streamed, &parked) {
            (Some(_), _) => layout,
            (None, None) => {
                let mut d = export(&net, spec, select);
                subtract(&mut d, &export(&self.net, spec, select))?;
                d
            }
            (None, Some(p)) => {
                let mut d = export(&net, spec, select);
                if let Err(e) = p.subtract_from(&mut d) {
                    self.unpark(p, net, spec)?;
                    return Err(park_error(p.path(), e));
                }
                d
            }
        };
        if let Some(t) = d
            .tensors
            .iter()
            .find(|t| t.data.iter().any(|v| !v.is_finite()))
        {
            let name = t.name.clone();
            if let Some(p) = &parked {
                self.unpark(p, net, spec)?;
            }
            return Err(SiteError::NonFinite(name));
        }
        self.net = net;
        if let Some(p) = parked {
            // A file left behind is replaced by the next round's; it never holds state.
            let _ = p.remove();
        }
        Ok((d, streamed))
    }

    /// Encodes the delta `d` under `m`'s encoding with error feedback: each tensor encoded
    /// (`None`: an exact tensor with no residual to add, which goes into the update as its own
    /// values' little-endian bytes, borrowed from the delta by `NamedTensor::exact_le`, so the
    /// envelope is written with no model-sized copy of the update beside it), and the residual
    /// it leaves (in a file of its own as each tensor's is made, when the site parks; the last
    /// accepted update's stays as it is until this update is answered).
    fn encode_fed(
        &mut self,
        d: &mut StateDict,
        m: &RoundManifest,
    ) -> Result<(Vec<Option<EncodedTensor>>, Kept), SiteError> {
        let lossy = d
            .tensors
            .iter()
            .any(|t| encoding_for(t.kind, m.encoding) != Encoding::F32);
        let mut residual = match lossy {
            true => kept_writer(self.stash_path("residual"))?,
            false => kept_writer(None)?,
        };
        let old = &self.memory.residual;
        let owned: Vec<Option<EncodedTensor>> = d
            .tensors
            .iter_mut()
            .map(|t| {
                let encoding = encoding_for(t.kind, m.encoding);
                let carried = old.len_of(&t.name).unwrap_or(0);
                if encoding == Encoding::F32 && carried == 0 && cfg!(target_endian = "little") {
                    // What the encoding leaves behind: nothing.
                    if !t.kind.is_bn_stat() {
                        residual.put_owned(t.name.clone(), Vec::new());
                    }
                    return Ok(None);
                }
                // Statistics carry no error feedback; everything else keeps its residual.
                if t.kind.is_bn_stat() {
                    return Ok(Some(t.encode(encoding, None)));
                }
                // The last residual is added in the delta's own buffer (from its file a block
                // at a time, when it waits in one), which then holds the next.
                old.add_into(&t.name, &mut t.data)
                    .map_err(|e| kept_error(old, e))?;
                let (e, next) = t.encode_fed(encoding, &[]);
                residual.put_owned(t.name.clone(), next);
                Ok(Some(e))
            })
            .collect::<Result<_, SiteError>>()?;
        // A residual of a tensor this update does not carry is kept as it was.
        for name in old.names() {
            if !residual.has(name) {
                residual.copy(name, old).map_err(|e| kept_error(old, e))?;
            }
        }
        Ok((owned, finish_kept(residual)?))
    }

    /// Whether every tensor of the update's `layout` goes as exact f32 under `m` with no
    /// residual of an earlier update to add (on a little-endian machine, whose `f32` bytes are
    /// the wire's).
    fn sends_exact(&self, layout: &StateDict, m: &RoundManifest) -> bool {
        cfg!(target_endian = "little")
            && layout.tensors.iter().all(|t| {
                encoding_for(t.kind, m.encoding) == Encoding::F32
                    && self.memory.residual.len_of(&t.name).unwrap_or(0) == 0
            })
    }

    /// The unsigned envelope of the exact update of round `m` (its tensors: `layout`) trained
    /// into `net` from the model parked in `base`, written from both a block at a time
    /// ([`crate::update::exact_update`]).
    #[allow(clippy::too_many_arguments)]
    fn exact_envelope(
        &self,
        net: &N,
        layout: &StateDict,
        base: &Parked,
        spec: &ModelSpec,
        federation: &Id,
        m: &RoundManifest,
        rep: &crate::train::TrainReport,
    ) -> Result<Vec<u8>, UpdateError> {
        let delta: Vec<EncodedTensorRef> = layout
            .tensors
            .iter()
            .map(|t| EncodedTensorRef {
                name: t.name.clone(),
                shape: t.shape.iter().map(|&d| d as u32).collect(),
                values: Values::F32(&[][..]),
            })
            .collect();
        let shared = self.shared_bn(net, spec, m);
        let upd = SiteUpdate {
            round: m.round,
            base_version: m.model_version,
            samples: self.train.len() as u64,
            delta,
            bn: shared.iter().map(EncodedTensor::as_ref).collect(),
            report: local_report(rep),
            extras: SiteExtras::None,
        };
        let select = select_for(m.bn_policy);
        let who = (federation, &self.id, spec.hash());
        crate::update::exact_update(net, select, base, who, m.run, &upd)
    }

    /// The BN tensors of `net` the manifest's policy shares, as exact f32 values (none unless BN
    /// is local).
    fn shared_bn(&self, net: &N, spec: &ModelSpec, m: &RoundManifest) -> Vec<EncodedTensor> {
        if m.bn_policy != BnPolicy::Local {
            return Vec::new();
        }
        export(net, spec, Select::Bn)
            .tensors
            .into_iter()
            .filter(|t| m.bn_sharing.shares(t.kind))
            .map(|t| t.encode(Encoding::F32, None))
            .collect()
    }

    /// Puts the parked starting model back after a round that sends nothing, written into
    /// `net` (the model training returned); if the file cannot be read, the site keeps `net`.
    fn unpark(&mut self, parked: &Parked, net: N, spec: &ModelSpec) -> Result<(), SiteError> {
        let base = parked.read().map_err(|e| park_error(parked.path(), e));
        let base = base.and_then(|sd| Ok(import(&net, spec, &sd, Select::All)?));
        match base {
            Ok(base) => {
                self.net = base;
                Ok(())
            }
            Err(e) => {
                self.net = net;
                Err(e)
            }
        }
    }

    /// The round and report (local steps, last epoch's training loss) of the last update
    /// [`Site::train_round`] made.
    pub fn last_report(&self) -> Option<(u64, LocalReport)> {
        self.report
    }

    /// Seconds the last [`Site::train_round`] spent after training: the delta, its encoding with
    /// error feedback, and the envelope.
    pub fn encode_seconds(&self) -> f64 {
        self.encode_seconds
    }

    /// The aggregator answered the update of `round`: an accepted update advances the
    /// error-feedback residual and the control variate, a rejected one leaves them as they
    /// were.
    pub fn answered(&mut self, round: u64, accepted: bool) {
        if let Some((r, next)) = self.pending.take() {
            if r == round && accepted {
                // The server's c stays whatever was applied last (a newer model may have come).
                self.memory.residual = next.residual;
                self.memory.algorithm.accept(next.algorithm);
            } else if r != round {
                self.pending = Some((r, next));
            }
        }
    }

    /// The error-feedback residual of tensor `name` as of the last accepted update (empty when
    /// nothing is left behind), read from its file when it waits in one.
    pub fn residual(&self, name: &str) -> Result<Vec<f32>, SiteError> {
        let r = &self.memory.residual;
        Ok(r.get(name)
            .map_err(|e| kept_error(r, e))?
            .unwrap_or_default())
    }

    /// The site's control variate `c_i` of tensor `name` as of the last accepted update (empty
    /// before the first).
    pub fn control(&self, name: &str) -> &[f32] {
        let controls = self.memory.algorithm.controls();
        controls
            .and_then(|c| c.control.get(name))
            .map_or(&[], Vec::as_slice)
    }

    /// A copy of the site's memory (residuals and control variates) as of the last accepted
    /// update, and the server's control variate applied last, with the parts that wait in
    /// files read back: what its checkpoint keeps.
    pub fn memory(&self) -> Result<Memory, SiteError> {
        self.memory.load().map_err(|e| {
            let path = self.park.clone().unwrap_or_default();
            park_error(&path, e)
        })
    }

    /// The algorithm's state the site holds now (its residuals and held broadcast aside, which
    /// [`Site::memory`] reads back from their files).
    pub fn client_state(&self) -> &ClientState {
        &self.memory.algorithm
    }

    /// The site's memory as [`Memory`] serialises (a checkpoint's), with the parts that wait in
    /// files read from them as it is serialised rather than copied into memory first; a file
    /// that cannot be read fails the serialisation, naming it.
    pub fn stored_memory(&self) -> impl Serialize + '_ {
        &self.memory
    }

    /// Restores a memory read back from the site's checkpoint (its residual and held broadcast
    /// then go to files when the site parks). Tensors whose name or length the spec does not
    /// know are refused, naming the tensor.
    pub fn restore_memory(&mut self, m: Memory, spec: &ModelSpec) -> Result<(), SiteError> {
        let mut m = Memory {
            residual: Kept::Here(m.residual),
            held: m.held.map(|(v, h)| (v, Kept::Here(h))),
            algorithm: m.algorithm,
        };
        check_memory(&m, spec)?;
        file_kept(&mut m.residual, self.stash_path("residual"))?;
        if let Some((_, h)) = &mut m.held {
            file_kept(h, self.stash_path("held"))?;
        }
        self.memory = m;
        self.pending = None;
        Ok(())
    }

    /// [`Site::restore_memory`] of a memory read from `r` in its serialised (postcard) form, as
    /// a checkpoint holds it: when the site parks, the residual and the held broadcast go from
    /// `r` to their files a block at a time, never whole in memory. Gives `r` back, positioned
    /// after the memory. Nothing changes on an error.
    pub fn restore_memory_from<R: std::io::Read>(
        &mut self,
        r: R,
        spec: &ModelSpec,
        layout: MemoryLayout,
    ) -> Result<R, SiteError> {
        use serde::de::DeserializeSeed;
        let seed = crate::memory::MemorySeed {
            residual: self.stash_path("residual"),
            held: self.stash_path("held"),
            layout,
        };
        // Room for the longest tensor name.
        let mut scratch = vec![0u8; 1 << 12];
        let flavor = postcard::de_flavors::io::io::IOReader::new(r, &mut scratch);
        let mut d = postcard::Deserializer::from_flavor(flavor);
        let unreadable = |e: postcard::Error| SiteError::Memory(format!("unreadable: {e}"));
        let m = seed.deserialize(&mut d).map_err(unreadable)?;
        let (r, _) = d.finalize().map_err(unreadable)?;
        check_memory(&m, spec)?;
        self.memory = m;
        self.pending = None;
        Ok(r)
    }

    /// Test accuracy with the site's own model and BN statistics, as the federation's plan
    /// deploys it: under Per-FedAvg after one personalisation step of `alpha` on a batch of the
    /// site's training data ([`personalise`], batch size and seed from `tc`), on a copy.
    pub fn evaluate(
        &self,
        spec: &ModelSpec,
        plan: &RoundPlan,
        tc: &TrainConfig,
        device: &Device,
    ) -> Result<EvalReport, SiteError> {
        self.evaluate_on(&self.test, spec, plan, tc, device)
    }

    /// [`Site::evaluate`] on `data` instead of the site's test split (a validation split, for
    /// selecting a round).
    pub fn evaluate_on(
        &self,
        data: &Dataset,
        spec: &ModelSpec,
        plan: &RoundPlan,
        tc: &TrainConfig,
        device: &Device,
    ) -> Result<EvalReport, SiteError> {
        self.evaluate_net(&self.net, data, spec, plan, tc, device)
    }

    /// A copy of the site's model as it is now, to evaluate while the site trains on or after
    /// ([`Site::evaluate_frozen`]): its BN running statistics are its own, which training the
    /// site's model leaves alone (clones of a model share them). Its tensors are the model's
    /// until training replaces them, so it holds memory of its own only from then on.
    pub fn freeze(&self) -> N {
        self.net.valid()
    }

    /// [`Site::evaluate`] of `frozen`, a model [`Site::freeze`] copied, instead of the site's
    /// model: the same report as evaluating the site's model when it was frozen.
    pub fn evaluate_frozen(
        &self,
        frozen: &N,
        spec: &ModelSpec,
        plan: &RoundPlan,
        tc: &TrainConfig,
        device: &Device,
    ) -> Result<EvalReport, SiteError> {
        self.evaluate_net(frozen, &self.test, spec, plan, tc, device)
    }

    /// Evaluates `net` on `data` as the site's model (the model itself, or a copy
    /// [`Site::freeze`] made): personalised first under Per-FedAvg.
    pub fn evaluate_net(
        &self,
        net: &N,
        data: &Dataset,
        spec: &ModelSpec,
        plan: &RoundPlan,
        tc: &TrainConfig,
        device: &Device,
    ) -> Result<EvalReport, SiteError> {
        let classes = spec.classes.len();
        let client = for_plan::<N>(&plan.objective);
        let personal = client.personalise(net, &self.train, classes, tc, device)?;
        let net = personal.as_ref().unwrap_or(net);
        let mask = client.representation_mask(&self.memory.algorithm);
        Ok(evaluate_masked(
            net,
            data,
            classes,
            EVAL_BATCH,
            device,
            mask.as_deref(),
        )?)
    }
}
