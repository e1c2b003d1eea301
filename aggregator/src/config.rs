//! Federation configuration, validated as one.

use crate::strategy::Algorithm;
pub use crate::strategy::Weighting;
use serde::{Deserialize, Serialize};
use unifed_protocol::auth::{Keyring, PublicKey};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{BnPolicy, BnSharing};

/// The default bound on an update's norm relative to the model's: as large as the model itself.
pub fn default_max_relative_norm() -> f64 {
    1.0
}

/// The default free-space floor of the data disk: 256 MiB.
pub fn default_min_free_disk() -> u64 {
    256 << 20
}

/// The default bound on an update's claimed sample count: ten million images.
pub fn default_max_samples() -> u64 {
    10_000_000
}

/// What `unifed-broker` keeps of the update filter every site publishes to (its
/// `SHARED_LOG_BYTES`): 32 MiB.
pub fn default_broker_update_log_bytes() -> u64 {
    32 << 20
}

/// A site enrolled in the federation: its id, the public key it signs with (printed by
/// `unifed-agent identity` on the site's own machine) and, optionally, the most samples its
/// updates may claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrolledSite {
    /// The site's id (safe in topics).
    pub id: String,
    /// The site's ed25519 public key, `ed25519:` and 64 hex digits.
    pub key: PublicKey,
    /// The most samples an update of this site may claim (default: the federation's
    /// `max_samples`): the count is the update's weight in the mean.
    #[serde(default)]
    pub max_samples: Option<u64>,
}

impl EnrolledSite {
    /// The site `id` signing with `key`, bounded by the federation's sample cap.
    pub fn new(id: &str, key: PublicKey) -> Self {
        EnrolledSite {
            id: id.into(),
            key,
            max_samples: None,
        }
    }
}

/// Everything the aggregator needs to run a federation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FederationConfig {
    /// Federation id (safe in topics).
    pub federation: String,
    /// Rounds to run.
    pub rounds: u64,
    /// The algorithm: `{ name = "fedavg" }` (default; FedBN under `bn_policy = "local"`) or
    /// `{ name = "fedprox", mu = 0.01 }`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// A round closes as soon as this many sampled sites have reported.
    pub min_sites: usize,
    /// A round closes this long after it opened with the sites that reported by then.
    pub deadline_secs: u64,
    /// Fraction of the registered sites sampled per round (1.0: all).
    pub fraction: f64,
    /// The enrolled sites with their public keys: only their signed messages are taken, and
    /// rounds sample from them.
    pub sites: Vec<EnrolledSite>,
    /// Revoked public keys: every message signed by one is refused, whichever site claims it
    /// (a lost or stolen device). `unifed-aggregator serve` re-reads it when its config file
    /// changes; nothing restarts.
    #[serde(default)]
    pub revoked: Vec<PublicKey>,
    /// Encoding sites use for their updates: `f32`, `f16`, `q8`, `ternary[b<block>]`,
    /// `ternaryq8[b<block>]`, `topk<per-mille>` or `topkq8<per-mille>` (the old spellings,
    /// `"F32"` or `{ Ternary = { block = 256 } }`, still read, with a warning).
    #[serde(
        deserialize_with = "crate::spelling::read_encoding",
        serialize_with = "crate::spelling::write_encoding"
    )]
    pub encoding: Encoding,
    /// `local` (FedBN: BN stays on the sites) or `global` (FedAvg: BN averaged too); `Local`
    /// and `Global` still read, with a warning.
    #[serde(
        deserialize_with = "crate::spelling::read_bn_policy",
        serialize_with = "crate::spelling::write_bn_policy"
    )]
    pub bn_policy: BnPolicy,
    /// Under `local` BN, which of the sites' BN tensors they send for the onboarding package:
    /// `none` (default), `affine` or `affine+stats`.
    #[serde(default)]
    pub bn_sharing: BnSharing,
    /// Weighting of updates.
    pub weighting: Weighting,
    /// Optional bound on an update's L2 norm, absolute.
    #[serde(default)]
    pub norm_bound: Option<f64>,
    /// Bound on an update's L2 norm relative to the current model's (over the tensors the
    /// update carries): `||delta|| <= max_relative_norm * ||model||`. On by default; honest
    /// updates of one local epoch stay far below it, a poisoned one that would swamp the mean
    /// does not.
    #[serde(default = "default_max_relative_norm")]
    pub max_relative_norm: f64,
    /// Largest sample count an update may claim: the count is its weight in the mean, so one
    /// site cannot take all of it by claiming 2^64 - 1.
    #[serde(default = "default_max_samples")]
    pub max_samples: u64,
    /// Model versions kept on disk (at least 1).
    pub keep_versions: usize,
    /// Free bytes the data disk must keep: below it the aggregator refuses new updates
    /// (`StorageFull`) and writes no audit lines, but keeps running and serving, and says so.
    #[serde(default = "default_min_free_disk")]
    pub min_free_disk_bytes: u64,
    /// Largest update message accepted, in bytes.
    pub max_update_bytes: usize,
    /// Bytes of update messages the broker keeps for the aggregator's subscription before it
    /// skips the oldest (32 MiB, `unifed-broker`'s log; Mosquitto bounds by
    /// `max_queued_messages` instead). Each round's manifest gives every sampled site an equal
    /// share of it as its upload window.
    #[serde(default = "default_broker_update_log_bytes")]
    pub broker_update_log_bytes: u64,
    /// Seed of the per-round site sampling.
    pub seed: u64,
}

impl FederationConfig {
    /// A config for `federation` of the enrolled `sites` with FedBN's defaults: all sites every
    /// round, f32 updates, `local` BN, weighted by samples.
    pub fn new(federation: &str, rounds: u64, min_sites: usize, sites: Vec<EnrolledSite>) -> Self {
        FederationConfig {
            federation: federation.into(),
            rounds,
            algorithm: Algorithm::FedAvg,
            min_sites,
            deadline_secs: 600,
            fraction: 1.0,
            sites,
            revoked: Vec::new(),
            encoding: Encoding::F32,
            bn_policy: BnPolicy::Local,
            bn_sharing: BnSharing::None,
            weighting: Weighting::Samples,
            norm_bound: None,
            max_relative_norm: default_max_relative_norm(),
            max_samples: default_max_samples(),
            keep_versions: 3,
            min_free_disk_bytes: default_min_free_disk(),
            max_update_bytes: 256 << 20,
            broker_update_log_bytes: default_broker_update_log_bytes(),
            seed: 0,
        }
    }

    /// Checks every field and reports every problem found.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        if let Err(e) = Id::new(&self.federation) {
            errs.push(format!("federation: {e}"));
        }
        if self.sites.is_empty() {
            errs.push(
                "sites: enrol at least one site (`{ id = \"...\", key = \"ed25519:...\" }`, the \
                 key from `unifed-agent identity` on the site)"
                    .into(),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.sites {
            if let Err(e) = Id::new(&s.id) {
                errs.push(format!("site `{}`: {e}", s.id));
            }
            if s.id == unifed_protocol::AGGREGATOR_ID {
                errs.push(format!(
                    "site `{}`: the id is the aggregator's own; sites need another",
                    s.id
                ));
            }
            if !seen.insert(&s.id) {
                errs.push(format!("site `{}` is enrolled twice", s.id));
            }
            if s.max_samples == Some(0) {
                errs.push(format!("site `{}`: max_samples must be at least 1", s.id));
            }
        }
        if !(self.max_relative_norm.is_finite() && self.max_relative_norm > 0.0) {
            errs.push(format!(
                "max_relative_norm must be positive and finite, got {}",
                self.max_relative_norm
            ));
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
        if self.broker_update_log_bytes < 1 << 20 {
            errs.push(format!(
                "broker_update_log_bytes must be at least 1 MiB (1048576), got {}",
                self.broker_update_log_bytes
            ));
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

    /// The keyring every message from a site is opened with: the enrolled sites' keys, less
    /// the revoked ones. Sites whose id is invalid are left out (validation names them).
    pub fn keyring(&self) -> Keyring {
        let mut k = Keyring::default();
        for s in &self.sites {
            if let Ok(id) = Id::new(&s.id) {
                k.enrol(id, s.key);
            }
        }
        for r in &self.revoked {
            k.revoke(*r);
        }
        k
    }

    /// The most samples an update of `site` may claim.
    pub fn max_samples_of(&self, site: &str) -> u64 {
        self.sites
            .iter()
            .find(|s| s.id == site)
            .and_then(|s| s.max_samples)
            .unwrap_or(self.max_samples)
            .min(self.max_samples)
    }

    /// The upload window of a round that samples `sampled` sites (0: not known, taken as 16):
    /// an equal share of the broker's update log for each, with one share spare for re-sends
    /// and late sites.
    pub fn upload_window_bytes(&self, sampled: usize) -> u32 {
        let sites = if sampled == 0 { 16 } else { sampled as u64 };
        u32::try_from(self.broker_update_log_bytes / (sites + 1)).unwrap_or(u32::MAX)
    }

    /// Number of sites sampled per round.
    pub fn sampled_per_round(&self) -> usize {
        ((self.sites.len() as f64 * self.fraction).ceil() as usize)
            .clamp(usize::from(!self.sites.is_empty()), self.sites.len())
    }
}
