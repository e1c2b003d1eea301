//! Server strategies: typed policy that plans each round and combines its contributions. The
//! round loop, validation, spooling and commits stay in [`crate::core`]; a strategy only
//! decides.
//!
//! - [`Strategy::plan`]: the typed [`RoundPlan`] every sampled site follows (its local
//!   objective).
//! - [`Strategy::extras`]: the tensors that travel beside the model of the current version
//!   (SCAFFOLD's server control variate).
//! - [`Strategy::check`]: the algorithm's own checks of an update (its extras), after the core's
//!   checks of names, shapes, encodings and finiteness; returns the extras decoded for the spool.
//! - [`Strategy::aggregate`]: the new averaged tensors from the round's [`Contributions`]
//!   (the spool's, streamed from its files; or [`InMemory`] ones in tests), which can be read
//!   as many times as a rule needs.
//! - [`Strategy::state`]: serialisable state (FedOpt's moments, SCAFFOLD's control variate,
//!   FedDC's drift sum), written beside the model version it belongs to
//!   (`models/v{N}.strategy`) before the state that names the version is committed, so a crash
//!   never splits them.
//!
//! # Adding an algorithm
//! Server side: a module here implementing [`Strategy`], a variant of [`Algorithm`] (its
//! config) and, if it keeps state, of [`StrategyState`]; [`from_config`] builds it. Site side: a
//! variant of [`unifed_protocol::Objective`] and its term in `unifed_models::objective`. Tensors
//! that travel beside the model or the delta get a variant of
//! [`unifed_protocol::ServerExtras`] / [`unifed_protocol::SiteExtras`].
//!
//! The BN policy is orthogonal to the algorithm: the core hands a strategy only the tensors the
//! federation averages (non-BN under `local`, everything under `global`), described by
//! [`Setup::tensors`]. BN running statistics among them are never fed to a server optimiser or a
//! control variate: they are averaged (FedOpt's NaN in peers came from Adam on variances).

mod fedavg;
mod fedcd;
mod feddc;
mod fedimpro;
mod fednova;
mod fedopt;
mod round;
mod scaffold;

pub use fedavg::{FedAvg, MoonConfig, PerFedAvgConfig};
pub use fedcd::{FedCd, FedCdConfig, rea_weights};
pub use feddc::{FedDc, FedDcConfig};
pub use fedimpro::{FedImpro, FedImproConfig, merge, weight_layers};
pub use fednova::{FedNova, FedNovaConfig};
pub use fedopt::{FedOpt, FedOptConfig, Rule};
pub use round::{Contribution, Contributions, Extras, InMemory, ReadError, Weighting};
pub use scaffold::{Scaffold, ScaffoldConfig};

use serde::{Deserialize, Serialize};
use unifed_protocol::TensorSpec;
use unifed_protocol::encoding::{EncodedTensor, Encoding, decode, exact_le_bytes};
use unifed_protocol::messages::{
    Objective, ObjectiveError, RejectReason, RoundPlan, ServerExtras, SiteExtras, SiteUpdateRef,
};

/// Why an algorithm's parameters, its name or a strategy's stored state were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    /// A server parameter lies outside its range.
    #[error("{name} must {must}, got {value}")]
    Parameter {
        /// The parameter's name in configs.
        name: &'static str,
        /// Its range, in words (`be positive and finite`, `lie in [0, 1)`).
        must: &'static str,
        /// The value given.
        value: f64,
    },
    /// A parameter of the sites' local objective is invalid.
    #[error(transparent)]
    Objective(#[from] ObjectiveError),
    /// No algorithm has this name.
    #[error("unknown algorithm `{name}`: {known}")]
    Unknown {
        /// The name given.
        name: String,
        /// Every algorithm's name, comma-separated.
        known: String,
    },
    /// The stored state is another algorithm's.
    #[error(
        "the stored strategy state ({stored}) is not that of the configured algorithm \
         `{algorithm}`"
    )]
    StateOfAnother {
        /// The stored state's name ([`StrategyState::name`]).
        stored: &'static str,
        /// The configured algorithm's name.
        algorithm: &'static str,
    },
    /// A stored state's tensors do not fit the model's trainable tensors.
    #[error(
        "the stored {what} does not fit the model's trainable tensors ({tensors} tensors, \
         {values} values; the model has {want_tensors}, {want_values})"
    )]
    StateShape {
        /// Which part of the state.
        what: &'static str,
        /// Its tensors.
        tensors: usize,
        /// Its values.
        values: usize,
        /// The model's trainable tensors.
        want_tensors: usize,
        /// Their values.
        want_values: usize,
    },
    /// A state about to be committed holds a value that is not finite.
    #[error("the {what} holds {value}")]
    NotFinite {
        /// Which part of the state.
        what: &'static str,
        /// The value.
        value: f32,
    },
    /// FedOpt's second moment holds a negative value.
    #[error("the second moment holds {0} < 0")]
    NegativeMoment(f32),
    /// A stored state is malformed in a way no other variant names (FedImpro's statistics).
    #[error("the stored {what}: {message}")]
    BadState {
        /// Which part of the state.
        what: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

/// `Err(StrategyError::Parameter)` unless `ok`.
pub(crate) fn parameter(
    ok: bool,
    name: &'static str,
    must: &'static str,
    value: f64,
) -> Result<(), StrategyError> {
    match ok {
        true => Ok(()),
        false => Err(StrategyError::Parameter { name, must, value }),
    }
}

/// The federation's algorithm and its server-side parameters, as configured. FedBN is
/// [`Algorithm::FedAvg`] with BN policy `local`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "lowercase", deny_unknown_fields)]
pub enum Algorithm {
    /// The sample-weighted mean of the sites' deltas (McMahan et al.).
    #[default]
    FedAvg,
    /// FedAvg's mean with the proximal local objective `mu/2 ||w - w_global||^2` (Li et al.).
    FedProx {
        /// The proximal weight (FedBN's digits setting: 0.01).
        mu: f64,
    },
    /// Adam on the server over the averaged pseudo-gradient (Reddi et al., FedOpt).
    FedAdam(FedOptConfig),
    /// Yogi on the server over the averaged pseudo-gradient (Reddi et al., FedOpt).
    FedYogi(FedOptConfig),
    /// Adagrad on the server over the averaged pseudo-gradient (Reddi et al., FedOpt; `beta2`
    /// is unused).
    FedAdagrad(FedOptConfig),
    /// SCAFFOLD with option II control variates (Karimireddy et al.).
    Scaffold(ScaffoldConfig),
    /// FedNova: each site's delta normalised by its local step count before the mean (Wang
    /// et al.); with equal step counts exactly FedAvg.
    FedNova(FedNovaConfig),
    /// MOON: FedAvg's mean, with sites adding a model-contrastive loss on their representation
    /// against the round's model and their previous local model (Li, He and Song).
    Moon(MoonConfig),
    /// FedDC: SCAFFOLD's control variates plus each site's local drift, penalised on the site
    /// and added back on the server (Gao et al.).
    FedDc(FedDcConfig),
    /// Per-FedAvg, first order: FedAvg's mean of sites trained by meta-steps, each site
    /// personalising the model by one step before it evaluates (Fallah et al.).
    PerFedAvg(PerFedAvgConfig),
    /// FedCD: sites mask their representation and match their mask gradient to the
    /// federation's (SCI); the server weighs sites by their risks (REA) (Chen et al.).
    FedCd(FedCdConfig),
    /// FedImpro: sites split the model, train its head also on synthetic features drawn from
    /// the federation's per-class Gaussians of low-level features, and send theirs (Chen et
    /// al., ICLR 2024).
    FedImpro(FedImproConfig),
}

impl Algorithm {
    /// Checks the parameters, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        match self {
            Algorithm::FedAvg => Ok(()),
            Algorithm::FedProx { mu } => Ok(Objective::Proximal { mu: *mu }.validate()?),
            Algorithm::FedAdam(c) | Algorithm::FedYogi(c) | Algorithm::FedAdagrad(c) => {
                c.validate()
            }
            Algorithm::Scaffold(c) => c.validate(),
            Algorithm::FedNova(c) => c.validate(),
            Algorithm::Moon(c) => Ok(c.objective().validate()?),
            Algorithm::FedDc(c) => c.validate(),
            Algorithm::PerFedAvg(c) => Ok(c.objective().validate()?),
            Algorithm::FedCd(c) => c.validate(),
            Algorithm::FedImpro(c) => c.validate(),
        }
    }

    /// The algorithm's name in configs, results and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::FedAvg => "fedavg",
            Algorithm::FedProx { .. } => "fedprox",
            Algorithm::FedAdam(_) => "fedadam",
            Algorithm::FedYogi(_) => "fedyogi",
            Algorithm::FedAdagrad(_) => "fedadagrad",
            Algorithm::Scaffold(_) => "scaffold",
            Algorithm::FedNova(_) => "fednova",
            Algorithm::Moon(_) => "moon",
            Algorithm::FedDc(_) => "feddc",
            Algorithm::PerFedAvg(_) => "perfedavg",
            Algorithm::FedCd(_) => "fedcd",
            Algorithm::FedImpro(_) => "fedimpro",
        }
    }

    /// Every algorithm with its default parameters (FedProx's `mu` at FedBN's digits setting,
    /// 0.01), in the order tables list them: the one list of algorithms names, config
    /// spellings and labels come from.
    pub fn all() -> [Algorithm; 12] {
        [
            Algorithm::FedAvg,
            Algorithm::FedProx { mu: 0.01 },
            Algorithm::FedAdam(FedOptConfig::default()),
            Algorithm::FedYogi(FedOptConfig::default()),
            Algorithm::FedAdagrad(FedOptConfig::default()),
            Algorithm::Scaffold(ScaffoldConfig::default()),
            Algorithm::FedNova(FedNovaConfig::default()),
            Algorithm::Moon(MoonConfig::default()),
            Algorithm::FedDc(FedDcConfig::default()),
            Algorithm::PerFedAvg(PerFedAvgConfig::default()),
            Algorithm::FedCd(FedCdConfig::default()),
            Algorithm::FedImpro(FedImproConfig::default()),
        ]
    }

    /// The algorithm called `name` in configs ([`Algorithm::name`]), with its default
    /// parameters; an error listing every name otherwise.
    pub fn named(name: &str) -> Result<Algorithm, StrategyError> {
        Self::all()
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::all().iter().map(Algorithm::name).collect();
                StrategyError::Unknown {
                    name: name.to_string(),
                    known: names.join(", "),
                }
            })
    }

    /// The algorithm's name in papers and tables (`FedAvg`, `SCAFFOLD`, `Per-FedAvg`), with
    /// the variant where a config makes one (`FedCD-SCI`, `FedImpro (split 2)`).
    pub fn label(&self) -> String {
        let plain = match self {
            Algorithm::FedAvg => "FedAvg",
            Algorithm::FedProx { .. } => "FedProx",
            Algorithm::FedAdam(_) => "FedAdam",
            Algorithm::FedYogi(_) => "FedYogi",
            Algorithm::FedAdagrad(_) => "FedAdagrad",
            Algorithm::Scaffold(_) => "SCAFFOLD",
            Algorithm::FedNova(_) => "FedNova",
            Algorithm::Moon(_) => "MOON",
            Algorithm::FedDc(_) => "FedDC",
            Algorithm::PerFedAvg(_) => "Per-FedAvg",
            Algorithm::FedCd(c) if c.rea => "FedCD-SCI+REA",
            Algorithm::FedCd(_) => "FedCD-SCI",
            Algorithm::FedImpro(FedImproConfig { split: Some(k), .. }) => {
                return format!("FedImpro (split {k})");
            }
            Algorithm::FedImpro(_) => "FedImpro",
        };
        plain.to_string()
    }

    /// True when the server keeps state between rounds that a restart must find.
    pub fn is_stateful(&self) -> bool {
        !matches!(
            self,
            Algorithm::FedAvg
                | Algorithm::FedProx { .. }
                | Algorithm::FedNova(_)
                | Algorithm::Moon(_)
                | Algorithm::PerFedAvg(_)
        )
    }
}

/// A strategy's persisted state, one variant per stateful algorithm. Tensors are those of
/// [`Setup::tensors`] that a gradient trains (BN running statistics left out), in order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum StrategyState {
    /// The strategy keeps nothing between rounds (FedAvg, FedProx, FedNova, MOON, Per-FedAvg).
    #[default]
    Stateless,
    /// FedOpt's first and second moments.
    FedOpt {
        /// First moments `m`.
        m: Vec<Vec<f32>>,
        /// Second moments `v`.
        v: Vec<Vec<f32>>,
    },
    /// SCAFFOLD's server control variate.
    Scaffold {
        /// The server control variate `c`, the mean of every site's `c_i`.
        c: Vec<Vec<f32>>,
        /// Sites that have reported a control variate, in order (an open federation averages
        /// over them; empty when the sites are registered).
        known: Vec<String>,
        /// The number of sites `c` is the mean over.
        n: u64,
    },
    /// FedDC's: SCAFFOLD's control variate and the sum of every site's drift.
    FedDc {
        /// The server control variate `c`.
        c: Vec<Vec<f32>>,
        /// Sites that have reported, in order (empty when the sites are registered).
        known: Vec<String>,
        /// The number of sites `c` is the mean over and `H` is divided by.
        n: u64,
        /// `H`, the sum of every site's drift `h_i`.
        drift: Vec<Vec<f32>>,
    },
    /// FedCD's: the federation's mask gradient of the model version, one value per input of
    /// the classifier (none before a round closed).
    FedCd {
        /// `g_g`, the sample-weighted mean of the round's mask gradients.
        gradient: Option<Vec<f32>>,
    },
    /// FedImpro's: the federation's per-class Gaussians of low-level features (none before a
    /// round closed).
    FedImpro {
        /// The unweighted mean of the sites' statistics, class by class (Eq. 8).
        stats: Option<unifed_protocol::FeatureStats>,
    },
}

impl StrategyState {
    /// Checks the state before it is committed: every value finite, second moments
    /// non-negative. Names the first problem.
    pub fn check(&self) -> Result<(), StrategyError> {
        let finite = |what, t: &[Vec<f32>]| match t.iter().flatten().find(|v| !v.is_finite()) {
            Some(&value) => Err(StrategyError::NotFinite { what, value }),
            None => Ok(()),
        };
        match self {
            StrategyState::Stateless => Ok(()),
            StrategyState::FedOpt { m, v } => {
                finite("first moment", m)?;
                finite("second moment", v)?;
                match v.iter().flatten().find(|x| **x < 0.0) {
                    Some(&x) => Err(StrategyError::NegativeMoment(x)),
                    None => Ok(()),
                }
            }
            StrategyState::Scaffold { c, .. } => finite("server control variate", c),
            StrategyState::FedDc { c, drift, .. } => {
                finite("server control variate", c)?;
                finite("drift sum", drift)
            }
            StrategyState::FedCd { gradient } => finite("mask gradient", gradient.as_slice()),
            StrategyState::FedImpro { stats: None } => Ok(()),
            StrategyState::FedImpro { stats: Some(s) } => {
                s.check(s.classes.len(), None)
                    .map_err(|e| StrategyError::BadState {
                        what: "FedImpro feature statistics",
                        message: e.to_string(),
                    })
            }
        }
    }

    /// The state's name in errors.
    pub fn name(&self) -> &'static str {
        match self {
            StrategyState::Stateless => "stateless",
            StrategyState::FedOpt { .. } => "FedOpt moments",
            StrategyState::Scaffold { .. } => "SCAFFOLD control variate",
            StrategyState::FedDc { .. } => "FedDC control variate and drift",
            StrategyState::FedCd { .. } => "FedCD mask gradient",
            StrategyState::FedImpro { .. } => "FedImpro feature statistics",
        }
    }
}

/// What a strategy is built for.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// The tensors the federation averages (non-BN under `local` BN, all under `global`), in
    /// the order of [`Strategy::aggregate`]'s model and of each contribution's delta.
    pub tensors: Vec<TensorSpec>,
    /// The federation's update encoding (extras that sites send use it too).
    pub encoding: Encoding,
    /// Registered sites (0: an open federation, where any site may report).
    pub sites: usize,
    /// The model's whole spec, where the strategy is built for a federation (FedImpro reads
    /// its feature width at the split from it); `None` in tests of the rules alone.
    pub spec: Option<unifed_protocol::ModelSpec>,
}

impl Setup {
    /// The tensors a gradient trains: all averaged tensors but BN running statistics.
    pub fn trainable(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().filter(|t| !t.kind.is_bn_stat())
    }

    /// Per averaged tensor, whether a gradient trains it (false for BN running statistics,
    /// which only ever take the plain mean).
    pub fn trained(&self) -> Vec<bool> {
        self.tensors.iter().map(|t| !t.kind.is_bn_stat()).collect()
    }

    /// Zero tensors shaped like [`Setup::trainable`].
    pub fn zeros(&self) -> Vec<Vec<f32>> {
        self.trainable().map(|t| vec![0.0; t.numel()]).collect()
    }

    /// Checks that `tensors` are shaped like [`Setup::trainable`], naming `what` on a mismatch.
    fn check_shapes(&self, what: &'static str, tensors: &[Vec<f32>]) -> Result<(), StrategyError> {
        let want: Vec<usize> = self.trainable().map(|t| t.numel()).collect();
        let got: Vec<usize> = tensors.iter().map(Vec::len).collect();
        if want == got {
            Ok(())
        } else {
            Err(StrategyError::StateShape {
                what,
                tensors: got.len(),
                values: got.iter().sum(),
                want_tensors: want.len(),
                want_values: want.iter().sum(),
            })
        }
    }
}

/// A server strategy: pure policy over the core's round loop.
pub trait Strategy: std::fmt::Debug + Send + Sync {
    /// The plan every site sampled in `round` follows: plain cross-entropy unless the
    /// algorithm's sites train under another objective.
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: Objective::CrossEntropy,
        }
    }

    /// The tensors that travel beside the current model in its broadcast.
    fn extras(&self) -> ServerExtras {
        ServerExtras::None
    }

    /// The algorithm's checks of an update the core has validated (names, shapes, encodings,
    /// finite values); returns its extras decoded. A failure rejects this update alone.
    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason>;

    /// Combines the round's contributions into `model`: the averaged tensors, in the order of
    /// each contribution's `delta`.
    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError>;

    /// The state to commit with the new model version.
    fn state(&self) -> StrategyState;
}

/// Builds the strategy of `algorithm` for `setup`, resuming from `state` (the committed state
/// of the current model version; `None`: a fresh start). A state of another algorithm, or one
/// that does not fit the model, is refused with a message naming both.
pub fn from_config(
    algorithm: &Algorithm,
    setup: &Setup,
    state: Option<StrategyState>,
) -> Result<Box<dyn Strategy>, StrategyError> {
    let mismatch = |s: &StrategyState| {
        Err(StrategyError::StateOfAnother {
            stored: s.name(),
            algorithm: algorithm.name(),
        })
    };
    match (algorithm, state) {
        (Algorithm::FedAvg, None | Some(StrategyState::Stateless)) => {
            Ok(Box::new(FedAvg::new(Objective::CrossEntropy)))
        }
        (Algorithm::FedProx { mu }, None | Some(StrategyState::Stateless)) => {
            Ok(Box::new(FedAvg::new(Objective::Proximal { mu: *mu })))
        }
        (Algorithm::FedAdam(c), s @ (None | Some(StrategyState::FedOpt { .. }))) => {
            Ok(Box::new(FedOpt::new(Rule::Adam, *c, setup, s)?))
        }
        (Algorithm::FedYogi(c), s @ (None | Some(StrategyState::FedOpt { .. }))) => {
            Ok(Box::new(FedOpt::new(Rule::Yogi, *c, setup, s)?))
        }
        (Algorithm::FedAdagrad(c), s @ (None | Some(StrategyState::FedOpt { .. }))) => {
            Ok(Box::new(FedOpt::new(Rule::Adagrad, *c, setup, s)?))
        }
        (Algorithm::Scaffold(c), s @ (None | Some(StrategyState::Scaffold { .. }))) => {
            Ok(Box::new(Scaffold::new(*c, setup, s)?))
        }
        (Algorithm::FedNova(c), None | Some(StrategyState::Stateless)) => {
            Ok(Box::new(FedNova::new(*c, setup)))
        }
        (Algorithm::Moon(c), None | Some(StrategyState::Stateless)) => {
            Ok(Box::new(FedAvg::new(c.objective())))
        }
        (Algorithm::PerFedAvg(c), None | Some(StrategyState::Stateless)) => {
            Ok(Box::new(FedAvg::new(c.objective())))
        }
        (Algorithm::FedDc(c), s @ (None | Some(StrategyState::FedDc { .. }))) => {
            Ok(Box::new(FedDc::new(*c, setup, s)?))
        }
        (Algorithm::FedCd(c), s @ (None | Some(StrategyState::FedCd { .. }))) => {
            Ok(Box::new(FedCd::new(*c, setup, s)?))
        }
        (Algorithm::FedImpro(c), s @ (None | Some(StrategyState::FedImpro { .. }))) => {
            Ok(Box::new(FedImpro::new(*c, setup, s)?))
        }
        (_, Some(s)) => mismatch(&s),
    }
}

/// The extras of an update whose algorithm sends none: anything else is refused.
pub(crate) fn no_extras(update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
    match update.extras {
        SiteExtras::None => Ok(Extras::None),
        SiteExtras::Control(_) => Err(RejectReason::UnexpectedExtras(
            "a control variate, which this federation's algorithm does not use".into(),
        )),
        SiteExtras::MaskGradient { .. } => Err(RejectReason::UnexpectedExtras(
            "a mask gradient, which this federation's algorithm does not use".into(),
        )),
        SiteExtras::FeatureStats(_) => Err(RejectReason::UnexpectedExtras(
            "feature statistics, which this federation's algorithm does not use".into(),
        )),
    }
}

/// Decodes `tensors` into dense values in the order of `specs`: each must appear once, with
/// its spec's shape, in `encoding` (BN running statistics always in exact f32: they never go
/// through a lossy encoding), and finite.
pub fn dense(
    specs: &[&TensorSpec],
    tensors: &[EncodedTensor],
    encoding: Encoding,
) -> Result<Vec<Vec<f32>>, RejectReason> {
    Ok(checked(specs, tensors, encoding)?
        .into_iter()
        .map(Checked::into_vec)
        .collect())
}

/// [`dense`] without copying exact tensors: each is checked where it lies, in the update's
/// bytes, and only lossy ones are decoded. The aggregator validates and spools a 57 MB f32
/// update so with one copy of it in memory, not two.
pub fn checked<'a, B: AsRef<[u8]>>(
    specs: &[&TensorSpec],
    tensors: &'a [EncodedTensor<B>],
    encoding: Encoding,
) -> Result<Vec<Checked<'a>>, RejectReason> {
    let mut out: Vec<Option<Checked<'a>>> = specs.iter().map(|_| None).collect();
    for t in tensors {
        let Some(pos) = specs.iter().position(|s| s.name == t.name) else {
            return Err(RejectReason::UnexpectedTensor(t.name.clone()));
        };
        if out[pos].is_some() {
            return Err(RejectReason::DuplicateTensor(t.name.clone()));
        }
        let spec = specs[pos];
        if t.shape.len() != spec.shape.len()
            || t.shape
                .iter()
                .zip(&spec.shape)
                .any(|(a, &b)| *a as usize != b)
        {
            return Err(RejectReason::WrongShape(t.name.clone()));
        }
        let expected = if spec.kind.is_bn_stat() {
            Encoding::F32
        } else {
            encoding
        };
        if !expected.holds(t) {
            return Err(RejectReason::WrongEncoding);
        }
        let malformed = |e: unifed_protocol::TensorError| RejectReason::Malformed(e.to_string());
        let c = match exact_le_bytes(t).map_err(malformed)? {
            Some(bytes) => Checked::Exact(bytes),
            None => Checked::Decoded(decode(t).map_err(malformed)?),
        };
        let finite = match &c {
            Checked::Exact(b) => all_finite_le(b),
            Checked::Decoded(v) => v.iter().all(|x| x.is_finite()),
        };
        if !finite {
            return Err(RejectReason::NonFinite(t.name.clone()));
        }
        out[pos] = Some(c);
    }
    if let Some(pos) = out.iter().position(Option::is_none) {
        return Err(RejectReason::MissingTensor(specs[pos].name.clone()));
    }
    Ok(out.into_iter().map(|o| o.expect("checked")).collect())
}

/// A tensor of an update once [`checked`]: an exact one as the little-endian bytes it arrived
/// in, a lossy one decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum Checked<'a> {
    /// An exact tensor's little-endian `f32` values, in the update's bytes.
    Exact(&'a [u8]),
    /// A lossy tensor's decoded values.
    Decoded(Vec<f32>),
}

impl Checked<'_> {
    /// The values in order.
    pub fn values(&self) -> CheckedValues<'_> {
        match self {
            Checked::Exact(b) => CheckedValues::Exact(b.chunks_exact(4)),
            Checked::Decoded(v) => CheckedValues::Decoded(v.iter()),
        }
    }

    /// The sum of the values' squares in f64 ([`sum_squares`]).
    pub fn sum_squares(&self) -> f64 {
        match self {
            Checked::Exact(b) => sum_squares(b.chunks_exact(4).map(le_f32)),
            Checked::Decoded(v) => sum_squares(v.iter().copied()),
        }
    }

    /// The values as a vector (a copy for an exact tensor).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Checked::Exact(_) => self.values().collect(),
            Checked::Decoded(v) => v,
        }
    }
}

/// The values of a [`Checked`] tensor.
#[derive(Debug, Clone)]
pub enum CheckedValues<'a> {
    /// Read from little-endian bytes.
    Exact(std::slice::ChunksExact<'a, u8>),
    /// Decoded values.
    Decoded(std::slice::Iter<'a, f32>),
}

impl Iterator for CheckedValues<'_> {
    type Item = f32;

    fn next(&mut self) -> Option<f32> {
        match self {
            CheckedValues::Exact(c) => c.next().map(le_f32),
            CheckedValues::Decoded(v) => v.next().copied(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            CheckedValues::Exact(c) => c.size_hint(),
            CheckedValues::Decoded(v) => v.size_hint(),
        }
    }

    // One dispatch per tensor rather than per value, in the same order (collecting an exact
    // tensor's values goes through here).
    fn fold<B, F: FnMut(B, f32) -> B>(self, init: B, mut f: F) -> B {
        match self {
            CheckedValues::Exact(c) => c.fold(init, |acc, b| f(acc, le_f32(b))),
            CheckedValues::Decoded(v) => v.fold(init, |acc, &x| f(acc, x)),
        }
    }
}

/// The sum of squares of `values` in f64, in eight interleaved sums: one chain of additions
/// took a value per addition's latency (about 14 ms for a 57 MB update, on the aggregator's
/// path to answering it); eight run side by side in vector registers.
pub(crate) fn sum_squares(values: impl Iterator<Item = f32>) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut values = values.peekable();
    while values.peek().is_some() {
        for lane in &mut lanes {
            let Some(x) = values.next() else { break };
            *lane += f64::from(x) * f64::from(x);
        }
    }
    lanes.iter().sum()
}

fn le_f32(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Whether every little-endian `f32` in `bytes` is finite: its exponent bits not all set. A
/// block at a time without stopping at each value, which the compiler turns into vector code
/// (a 57 MB update took 18 ms value by value, on the aggregator's path to answering it).
fn all_finite_le(bytes: &[u8]) -> bool {
    const EXPONENT: u32 = 0x7f80_0000;
    bytes.chunks(16 << 10).all(|block| {
        block.chunks_exact(4).fold(0u32, |bad, b| {
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            bad | u32::from(bits & EXPONENT == EXPONENT)
        }) == 0
    })
}

/// The length of each of `model`'s tensors.
pub(crate) fn lens(model: &[&mut Vec<f32>]) -> Vec<usize> {
    model.iter().map(|t| t.len()).collect()
}

/// `x <- x + eta d` in f64, rounded once to f32 (with `eta = 1` exactly FedAvg's step).
pub(crate) fn step_by(x: &mut [f32], d: &[f64], eta: f64) {
    for (x, d) in x.iter_mut().zip(d) {
        *x = (*x as f64 + eta * d) as f32;
    }
}

/// Encodes tensors (spec, values) in exact f32: what the server sends, model or extras.
pub(crate) fn exact<'a>(
    tensors: impl Iterator<Item = (&'a TensorSpec, &'a [f32])>,
) -> Vec<EncodedTensor> {
    tensors
        .map(|(t, v)| t.encode(v, Encoding::F32, None))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_is_spelled_in_configs_by_its_name_and_found_by_it_with_valid_defaults() {
        let all = Algorithm::all();
        for a in all {
            let v = serde_json::to_value(a).unwrap();
            assert_eq!(v["name"], a.name());
            assert_eq!(Algorithm::named(a.name()), Ok(a));
            assert_eq!(a.validate(), Ok(()));
        }
        let names: std::collections::BTreeSet<_> = all.iter().map(Algorithm::name).collect();
        let labels: std::collections::BTreeSet<_> = all.iter().map(Algorithm::label).collect();
        assert_eq!((names.len(), labels.len()), (all.len(), all.len()));
        let err = Algorithm::named("fedsgd").unwrap_err();
        assert!(
            matches!(&err, StrategyError::Unknown { name, known }
                if name == "fedsgd" && known.ends_with("perfedavg, fedcd, fedimpro")),
            "{err}"
        );
    }

    #[test]
    fn all_finite_le_agrees_with_is_finite_on_every_kind_of_value() {
        let specials = [
            0.0f32,
            -0.0,
            1.5,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0000 | 12345),
        ];
        for &x in &specials {
            // At the start, inside the first block, and past it.
            for at in [0usize, 17, (16 << 10) / 4 + 3] {
                let mut v = vec![1.0f32; at + 5];
                v[at] = x;
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                assert_eq!(all_finite_le(&bytes), x.is_finite(), "{x:?} at {at}");
            }
        }
        assert!(all_finite_le(&[]));
    }
}
