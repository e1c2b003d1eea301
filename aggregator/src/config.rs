//! Federation configuration, validated as one.

use crate::strategy::Algorithm;
use serde::{Deserialize, Serialize};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{BnPolicy, BnSharing};

/// How updates are weighted in the mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Weighting {
    /// By each update's sample count (FedAvg).
    Samples,
    /// Every update counts the same.
    Uniform,
}

/// The default bound on an update's claimed sample count: ten million images.
pub fn default_max_samples() -> u64 {
    10_000_000
}

/// Everything the aggregator needs to run a federation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FederationConfig {
    /// Federation id (safe in topics).
    pub federation: String,
    /// Rounds to run.
    pub rounds: u64,
    /// The algorithm: `{ name = "fedavg" }` (default; FedBN under `bn_policy = "Local"`) or
    /// `{ name = "fedprox", mu = 0.01 }`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// A round closes as soon as this many sampled sites have reported.
    pub min_sites: usize,
    /// A round closes this long after it opened with the sites that reported by then.
    pub deadline_secs: u64,
    /// Fraction of the registered sites sampled per round (1.0: all).
    pub fraction: f64,
    /// Registered sites; empty means any site may report every round (no sampling).
    pub sites: Vec<String>,
    /// Encoding sites use for their updates.
    pub encoding: Encoding,
    /// `local` (FedBN: BN stays on the sites) or `global` (FedAvg: BN averaged too).
    pub bn_policy: BnPolicy,
    /// Under `local` BN, which of the sites' BN tensors they send for the onboarding package:
    /// `none` (default), `affine` or `affine+stats`.
    #[serde(default)]
    pub bn_sharing: BnSharing,
    /// Weighting of updates.
    pub weighting: Weighting,
    /// Optional bound on an update's L2 norm.
    pub norm_bound: Option<f64>,
    /// Largest sample count an update may claim: the count is its weight in the mean, so one
    /// site cannot take all of it by claiming 2^64 - 1.
    #[serde(default = "default_max_samples")]
    pub max_samples: u64,
    /// Model versions kept on disk (at least 1).
    pub keep_versions: usize,
    /// Largest update message accepted, in bytes.
    pub max_update_bytes: usize,
    /// Seed of the per-round site sampling.
    pub seed: u64,
}

impl FederationConfig {
    /// A config for `federation` with FedBN's defaults: all sites every round, f32 updates,
    /// `local` BN, weighted by samples.
    pub fn new(federation: &str, rounds: u64, min_sites: usize) -> Self {
        FederationConfig {
            federation: federation.into(),
            rounds,
            algorithm: Algorithm::FedAvg,
            min_sites,
            deadline_secs: 600,
            fraction: 1.0,
            sites: Vec::new(),
            encoding: Encoding::F32,
            bn_policy: BnPolicy::Local,
            bn_sharing: BnSharing::None,
            weighting: Weighting::Samples,
            norm_bound: None,
            max_samples: default_max_samples(),
            keep_versions: 3,
            max_update_bytes: 256 << 20,
            seed: 0,
        }
    }

    /// Checks every field and reports every problem found.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        if let Err(e) = Id::new(&self.federation) {
            errs.push(format!("federation: {e}"));
        }
        for s in &self.sites {
            if let Err(e) = Id::new(s) {
                errs.push(format!("site `{s}`: {e}"));
            }
        }
        if self.rounds == 0 {
            errs.push("rounds must be at least 1".into());
        }
        if self.min_sites == 0 {
            errs.push("min_sites must be at least 1".into());
        }
        if !self.sites.is_empty() && self.min_sites > self.sampled_per_round() {
            errs.push(format!(
                "min_sites {} exceeds the {} sites sampled per round",
                self.min_sites,
                self.sampled_per_round()
            ));
        }
        if self.deadline_secs == 0 {
            errs.push("deadline_secs must be at least 1".into());
        }
        if !(self.fraction > 0.0 && self.fraction <= 1.0) {
            errs.push(format!(
                "fraction must lie in (0, 1], got {}",
                self.fraction
            ));
        }
        if self.bn_policy == BnPolicy::Global && self.bn_sharing != BnSharing::None {
            errs.push(format!(
                "bn_sharing `{}` needs bn_policy local (under global the model's BN is averaged \
                 already)",
                self.bn_sharing.name()
            ));
        }
        if let Err(e) = self.encoding.validate() {
            errs.push(format!("encoding: {e}"));
        }
        if let Some(b) = self.norm_bound
            && !(b.is_finite() && b > 0.0)
        {
            errs.push(format!("norm_bound must be positive and finite, got {b}"));
        }
        if let Err(e) = self.algorithm.validate() {
            errs.push(format!("algorithm: {e}"));
        }
        if self.max_samples == 0 {
            errs.push("max_samples must be at least 1".into());
        }
        if self.keep_versions == 0 {
            errs.push("keep_versions must be at least 1".into());
        }
        if self.max_update_bytes < 64 {
            errs.push("max_update_bytes must be at least 64".into());
        }
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }

    /// Number of sites sampled per round (0 when sites are not registered).
    pub fn sampled_per_round(&self) -> usize {
        ((self.sites.len() as f64 * self.fraction).ceil() as usize)
            .clamp(usize::from(!self.sites.is_empty()), self.sites.len())
    }
}
