//! Server strategies: typed policy that plans each round and combines its contributions. The
//! round loop, validation, spooling and commits stay in [`crate::core`]; a strategy only
//! decides.
//!
//! - [`Strategy::plan`]: the typed [`RoundPlan`] every sampled site follows (its local
//!   objective).
//! - [`Strategy::check`]: the algorithm's own checks of an update (its extras), after the core's
//!   checks of names, shapes, encodings and finiteness.
//! - [`Strategy::aggregate`]: the new averaged tensors from a [`RoundReader`] over the round's
//!   spooled contributions, which can be read as many times as a rule needs.
//! - [`Strategy::state`]: serialisable state, committed in `state.json` together with the
//!   model version it belongs to, so a crash never splits them.
//!
//! # Adding an algorithm
//! Server side: a module here implementing [`Strategy`], a variant of [`Algorithm`] (its
//! config) and, if it keeps state, of [`StrategyState`]; [`from_config`] builds it. Site side: a
//! variant of [`unifed_protocol::Objective`] and its term in `unifed_models::objective`. Tensors
//! that travel beside the model or the delta get a variant of
//! [`unifed_protocol::ServerExtras`] / [`unifed_protocol::SiteExtras`].
//!
//! The BN policy is orthogonal to the algorithm: the core hands a strategy only the tensors the
//! federation averages (non-BN under `local`, everything under `global`).

mod fedavg;

pub use fedavg::FedAvg;

use crate::config::Weighting;
use crate::store::{Store, StoreError};
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{
    LocalReport, Objective, RejectReason, RoundPlan, SiteExtras, SiteUpdate,
};

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
}

impl Algorithm {
    /// Checks the parameters, naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            Algorithm::FedAvg => Ok(()),
            Algorithm::FedProx { mu } => Objective::Proximal { mu }.validate(),
        }
    }

    /// The algorithm's name in results and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::FedAvg => "fedavg",
            Algorithm::FedProx { .. } => "fedprox",
        }
    }
}

/// A strategy's persisted state, one variant per stateful algorithm (FedOpt's moments and
/// SCAFFOLD's server control variate join here).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum StrategyState {
    /// The strategy keeps nothing between rounds (FedAvg, FedProx).
    #[default]
    Stateless,
}

/// One site's accepted contribution to a round, as spooled.
#[derive(Debug, Clone, PartialEq)]
pub struct Contribution {
    /// Training samples behind it (bounded by the federation's `max_samples`).
    pub samples: u64,
    /// The site's report of its local training.
    pub report: LocalReport,
    /// Its algorithm tensors.
    pub extras: SiteExtras,
    /// Dense deltas of the averaged tensors, in the order the core hands to
    /// [`Strategy::aggregate`].
    pub delta: Vec<Vec<f32>>,
    /// The BN tensors the sharing policy lets leave the site (values), for the onboarding
    /// package.
    pub bn: Vec<Vec<f32>>,
}

/// Reads a round's spooled contributions in site order, as often as a rule needs.
#[derive(Debug)]
pub struct RoundReader<'a> {
    store: &'a Store,
    round: u64,
    sites: Vec<String>,
    weighting: Weighting,
}

impl<'a> RoundReader<'a> {
    /// A reader over `sites` (sorted) of `round` in `store`.
    pub fn new(store: &'a Store, round: u64, sites: Vec<String>, weighting: Weighting) -> Self {
        RoundReader {
            store,
            round,
            sites,
            weighting,
        }
    }

    /// The round.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The sites with a contribution, in site order.
    pub fn sites(&self) -> &[String] {
        &self.sites
    }

    /// The weight of a contribution in a mean: its sample count, or 1 under uniform weighting.
    pub fn weight(&self, c: &Contribution) -> f64 {
        match self.weighting {
            Weighting::Samples => c.samples as f64,
            Weighting::Uniform => 1.0,
        }
    }

    /// Every contribution in site order, read from the spool one at a time (O(model) memory).
    pub fn iter(&self) -> impl Iterator<Item = Result<(&str, Contribution), StoreError>> + '_ {
        self.sites
            .iter()
            .map(move |s| self.store.spool_get(self.round, s).map(|c| (s.as_str(), c)))
    }
}

/// A server strategy: pure policy over the core's round loop.
pub trait Strategy: std::fmt::Debug + Send {
    /// The plan every site sampled in `round` follows.
    fn plan(&self, round: u64) -> RoundPlan;

    /// The algorithm's checks of an update the core has validated (names, shapes, encodings,
    /// finite values); a failure rejects this update alone.
    fn check(&self, update: &SiteUpdate) -> Result<(), RejectReason>;

    /// Combines the round's contributions into `model`: the averaged tensors, in the order of
    /// each contribution's `delta`.
    fn aggregate(
        &mut self,
        round: &RoundReader<'_>,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), StoreError>;

    /// The state to commit with the new model version.
    fn state(&self) -> StrategyState;
}

/// Builds the strategy of `algorithm`, resuming from `state` (the committed state of the
/// current model version).
pub fn from_config(
    algorithm: &Algorithm,
    state: &StrategyState,
) -> Result<Box<dyn Strategy>, String> {
    match (algorithm, state) {
        (Algorithm::FedAvg, StrategyState::Stateless) => {
            Ok(Box::new(FedAvg::new(Objective::CrossEntropy)))
        }
        (Algorithm::FedProx { mu }, StrategyState::Stateless) => {
            Ok(Box::new(FedAvg::new(Objective::Proximal { mu: *mu })))
        }
    }
}

/// The extras of an update whose algorithm sends none: anything else is refused.
pub(crate) fn no_extras(update: &SiteUpdate) -> Result<(), RejectReason> {
    match update.extras {
        SiteExtras::None => Ok(()),
    }
}
