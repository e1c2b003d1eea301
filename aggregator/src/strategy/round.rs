//! What a strategy reads of a closed round: its accepted contributions, through
//! [`Contributions`]. The aggregator's spool implements it (`crate::spoolround::SpoolRound`,
//! streaming each update from its file); [`InMemory`] holds a round's contributions as values,
//! so a strategy is tested, or run by a tool, without files. A read that fails is a typed
//! [`ReadError`] the strategy hands back untouched.

use crate::fold::Fold;
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::LocalReport;

/// How updates are weighted in the mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Weighting {
    /// By each update's sample count (FedAvg).
    Samples,
    /// Every update counts the same.
    Uniform,
}

impl Weighting {
    /// The weight in a mean of an update of `samples` training samples: the count, or 1.
    pub fn weight(self, samples: u64) -> f64 {
        match self {
            Weighting::Samples => samples as f64,
            Weighting::Uniform => 1.0,
        }
    }
}

/// A contribution's algorithm tensors, decoded and checked by the strategy (what the spool
/// keeps of [`unifed_protocol::SiteExtras`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum Extras {
    /// None.
    #[default]
    None,
    /// SCAFFOLD's change of the site's control variate, in [`super::Setup::trainable`] order.
    Control(Vec<Vec<f32>>),
    /// FedCD's round-mean mask gradient and training risk.
    MaskGradient {
        /// The mask gradient `g_e`.
        gradient: Vec<f32>,
        /// The training risk `R_e`.
        risk: f64,
    },
    /// FedImpro's per-class feature statistics.
    FeatureStats(unifed_protocol::FeatureStats),
}

/// One site's accepted contribution to a round.
#[derive(Debug, Clone, PartialEq)]
pub struct Contribution {
    /// Training samples behind it (bounded by the federation's `max_samples`).
    pub samples: u64,
    /// The site's report of its local training.
    pub report: LocalReport,
    /// Its algorithm tensors, decoded.
    pub extras: Extras,
    /// Dense deltas of the averaged tensors, in the order the core hands to
    /// [`super::Strategy::aggregate`].
    pub delta: Vec<Vec<f32>>,
    /// The BN tensors the sharing policy lets leave the site (values), for the onboarding
    /// package.
    pub bn: Vec<Vec<f32>>,
}

/// Why a round's contribution could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReadError {
    /// Its stored form is damaged (checksum, format, or a value that is not finite): it is
    /// never used, and the aggregator sets it aside and asks its site to send it again.
    #[error("{what} is damaged: {message}")]
    Damaged {
        /// What was read (a file, a site's contribution).
        what: String,
        /// What is wrong with it.
        message: String,
    },
    /// It could not be read for a local reason (an OS error): the aggregator stops.
    #[error("{what}: {message}")]
    Unreadable {
        /// What was read.
        what: String,
        /// The reason.
        message: String,
    },
}

/// A closed round's accepted contributions, in site order, read as often as a rule needs.
pub trait Contributions: Sync {
    /// The round.
    fn round(&self) -> u64;

    /// The sites with a contribution, in site order.
    fn sites(&self) -> &[String];

    /// How contributions are weighted in a mean.
    fn weighting(&self) -> Weighting;

    /// The contribution of `site` (one of [`Contributions::sites`]).
    fn get(&self, site: &str) -> Result<Contribution, ReadError>;

    /// The contribution of `site` without its delta (`delta` empty), checked as
    /// [`Contributions::get`] checks it: what a rule that weighs sites by their reports or
    /// extras reads first, without holding a model-sized delta.
    fn summary(&self, site: &str) -> Result<Contribution, ReadError> {
        let mut c = self.get(site)?;
        c.delta = Vec::new();
        Ok(c)
    }

    /// The weighted mean of the contributions' deltas handed to `each(target, mean)` a block of
    /// values at a time, with the part of `targets` (one slice per delta tensor, as long as it)
    /// the block is of, every value exactly once and perhaps from several threads at once; false
    /// when nothing carries weight (nothing is handed on). The values are those of [`Fold`]
    /// over [`Contributions::get`]'s deltas in site order, bit for bit. On an error, what `each`
    /// made of the values must be dropped.
    fn mean_delta_into(
        &self,
        targets: &mut [&mut [f32]],
        each: &(dyn Fn(&mut [f32], &[f64]) + Sync),
    ) -> Result<bool, ReadError>;

    /// The weighted mean of the contributions' deltas in f64, tensors of `lens` values (`None`
    /// when nothing carries weight): [`Contributions::mean_delta_into`]'s values, kept.
    fn mean_delta(&self, lens: &[usize]) -> Result<Option<Vec<Vec<f64>>>, ReadError>;
}

impl dyn Contributions + '_ {
    /// Every contribution in site order, read one at a time (O(model) memory).
    pub fn iter(&self) -> impl Iterator<Item = Result<(&str, Contribution), ReadError>> + '_ {
        self.sites()
            .iter()
            .map(move |s| self.get(s).map(|c| (s.as_str(), c)))
    }

    /// The weight of a contribution in a mean: its sample count, or 1 under uniform weighting.
    pub fn weight(&self, c: &Contribution) -> f64 {
        self.weighting().weight(c.samples)
    }
}

/// A round's contributions held as values, in site order: what a strategy reads in tests and
/// tools that have no spool. Its mean is [`Fold`]'s, as the spool's is.
#[derive(Debug, Clone, PartialEq)]
pub struct InMemory {
    round: u64,
    weighting: Weighting,
    sites: Vec<String>,
    contributions: Vec<Contribution>,
}

impl InMemory {
    /// A round of `contributions` by site, put in site order (a site named twice keeps its
    /// last contribution).
    pub fn new(
        round: u64,
        weighting: Weighting,
        contributions: impl IntoIterator<Item = (String, Contribution)>,
    ) -> Self {
        let by_site: std::collections::BTreeMap<String, Contribution> =
            contributions.into_iter().collect();
        let (sites, contributions) = by_site.into_iter().unzip();
        InMemory {
            round,
            weighting,
            sites,
            contributions,
        }
    }

    /// The weighted mean of the deltas, tensors of `lens` values.
    fn fold(&self, lens: &[usize]) -> Option<Vec<Vec<f64>>> {
        let mut fold = Fold::new(lens);
        for c in &self.contributions {
            fold.add(self.weighting.weight(c.samples), &c.delta);
        }
        fold.mean()
    }
}

impl Contributions for InMemory {
    fn round(&self) -> u64 {
        self.round
    }

    fn sites(&self) -> &[String] {
        &self.sites
    }

    fn weighting(&self) -> Weighting {
        self.weighting
    }

    fn get(&self, site: &str) -> Result<Contribution, ReadError> {
        match self.sites.binary_search_by(|s| s.as_str().cmp(site)) {
            Ok(i) => Ok(self.contributions[i].clone()),
            Err(_) => Err(ReadError::Unreadable {
                what: format!("round {}'s contribution of `{site}`", self.round),
                message: "the round holds none".into(),
            }),
        }
    }

    fn mean_delta_into(
        &self,
        targets: &mut [&mut [f32]],
        each: &(dyn Fn(&mut [f32], &[f64]) + Sync),
    ) -> Result<bool, ReadError> {
        let lens: Vec<usize> = targets.iter().map(|t| t.len()).collect();
        let Some(mean) = self.fold(&lens) else {
            return Ok(false);
        };
        for (t, m) in targets.iter_mut().zip(&mean) {
            each(t, m);
        }
        Ok(true)
    }

    fn mean_delta(&self, lens: &[usize]) -> Result<Option<Vec<Vec<f64>>>, ReadError> {
        Ok(self.fold(lens))
    }
}
