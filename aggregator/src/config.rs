//! Federation configuration, validated as one.

pub use crate::strategy::Weighting;
use crate::strategy::{Algorithm, StrategyError};
use serde::{Deserialize, Serialize};
use unifed_protocol::auth::{Keyring, PublicKey};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::ids::{Id, IdError};
use unifed_protocol::messages::{BnPolicy, BnSharing};

/// The default bound on an update's norm relative to the model's: as large as the model itself.
pub fn default_max_relative_norm() -> f64 {
    1.0
}

/// The default cap on a site's weight in a round, as a multiple of the round's lower-median
/// claimed sample count: 1, so a site that claims more than the round's median counts as the
/// median (with 4, one hostile site of six cost 5.9 points in `unifed-demo hostile`; with 1,
/// 0.5). A site enrolled with its sample count is counted as it claims, up to that count.
pub fn default_max_weight_of_median() -> f64 {
    1.0
}

/// The default bound on an update's norm in a round, as a multiple of the round's lower-median
/// update norm: 2 (honest sites of the demo's federations stayed within 2.6 of it; the few
/// above 2 are scaled down, keeping their direction).
pub fn default_max_norm_of_median() -> f64 {
    2.0
}

/// The default disk budget of the audit log, its rotated files included: 256 MiB.
pub fn default_audit_budget() -> u64 {
    256 << 20
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
    /// `max_samples`): the count is the update's weight in the mean. Set, it is the operator
    /// vouching for the site's size: the site's weight counts as it claims, up to this count,
    /// whatever the round's median (`max_weight_of_median` does not cap it).
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
    /// A site's weight in a round's mean counts at most this multiple of the round's
    /// lower-median claimed sample count, whatever it claims (`inf`: no cap). Holds without an
    /// enrolled count; a site's `max_samples` bounds it further.
    #[serde(default = "default_max_weight_of_median")]
    pub max_weight_of_median: f64,
    /// An update whose norm exceeds this multiple of the round's lower-median update norm is
    /// scaled down to it before the fold (clipped, direction kept; `inf`: no clip).
    #[serde(default = "default_max_norm_of_median")]
    pub max_norm_of_median: f64,
    /// Model versions kept on disk (at least 1).
    pub keep_versions: usize,
    /// Free bytes the data disk must keep: below it the aggregator refuses new updates
    /// (`StorageFull`) and writes no audit lines, but keeps running and serving, and says so.
    #[serde(default = "default_min_free_disk")]
    pub min_free_disk_bytes: u64,
    /// Bytes the audit log may take on disk: it is rotated in four files (`audit.log`, then
    /// `audit.log.1` to `.3`), the oldest lines dropped past the budget.
    #[serde(default = "default_audit_budget")]
    pub audit_budget_bytes: u64,
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

/// One problem of a federation's config, naming the field it is in.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigProblem {
    /// The federation's id is not a valid id.
    #[error("federation: {0}")]
    Federation(IdError),
    /// No site is enrolled.
    #[error(
        "sites: enrol at least one site (`{{ id = \"...\", key = \"ed25519:...\" }}`, the key \
         from `unifed-agent identity` on the site)"
    )]
    NoSites,
    /// A site's id is not a valid id.
    #[error("site `{site}`: {error}")]
    SiteId {
        /// The id as written.
        site: String,
        /// What is wrong with it.
        error: IdError,
    },
    /// A site has the aggregator's own id.
    #[error("site `{0}`: the id is the aggregator's own; sites need another")]
    AggregatorsId(String),
    /// A site is enrolled twice.
    #[error("site `{0}` is enrolled twice")]
    EnrolledTwice(String),
    /// A site's `max_samples` is 0.
    #[error("site `{0}`: max_samples must be at least 1")]
    SiteMaxSamples(String),
    /// A number outside its range.
    #[error("{field} must {must}, got {value}")]
    OutOfRange {
        /// The field's name in configs.
        field: &'static str,
        /// Its range, in words.
        must: &'static str,
        /// The value given.
        value: f64,
    },
    /// More sites must report than a round samples.
    #[error("min_sites {min_sites} exceeds the {sampled} sites sampled per round")]
    MinSites {
        /// The configured `min_sites`.
        min_sites: usize,
        /// Sites sampled per round.
        sampled: usize,
    },
    /// A BN sharing policy other than `none` under global BN.
    #[error(
        "bn_sharing `{0}` needs bn_policy local (under global the model's BN is averaged \
         already)"
    )]
    SharingNeedsLocal(&'static str),
    /// The encoding's parameters are invalid.
    #[error("encoding: {0}")]
    Encoding(&'static str),
    /// The algorithm's parameters are invalid.
    #[error("algorithm: {0}")]
    Algorithm(StrategyError),
}

/// Every problem of a federation's config, in the order they are found (the federation's id
/// first); shown joined by `; `.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigProblems(pub Vec<ConfigProblem>);

impl std::fmt::Display for ConfigProblems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, p) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigProblems {}

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
            max_weight_of_median: default_max_weight_of_median(),
            max_norm_of_median: default_max_norm_of_median(),
            keep_versions: 3,
            min_free_disk_bytes: default_min_free_disk(),
            audit_budget_bytes: default_audit_budget(),
            max_update_bytes: 256 << 20,
            broker_update_log_bytes: default_broker_update_log_bytes(),
            seed: 0,
        }
    }

    /// Checks every field and reports every problem found.
    pub fn validate(&self) -> Result<(), ConfigProblems> {
        use ConfigProblem as P;
        let mut errs = Vec::new();
        let mut range = |ok: bool, field, must, value: f64| {
            if !ok {
                errs.push(P::OutOfRange { field, must, value });
            }
        };
        let n = self.max_relative_norm;
        range(
            n.is_finite() && n > 0.0,
            "max_relative_norm",
            "be positive and finite",
            n,
        );
        range(
            self.rounds > 0,
            "rounds",
            "be at least 1",
            self.rounds as f64,
        );
        range(
            self.min_sites > 0,
            "min_sites",
            "be at least 1",
            self.min_sites as f64,
        );
        let d = self.deadline_secs;
        range(d > 0, "deadline_secs", "be at least 1", d as f64);
        let log = self.broker_update_log_bytes;
        range(
            log >= 1 << 20,
            "broker_update_log_bytes",
            "be at least 1 MiB (1048576)",
            log as f64,
        );
        let f = self.fraction;
        range(f > 0.0 && f <= 1.0, "fraction", "lie in (0, 1]", f);
        if let Some(b) = self.norm_bound {
            range(
                b.is_finite() && b > 0.0,
                "norm_bound",
                "be positive and finite",
                b,
            );
        }
        for (field, r) in [
            ("max_weight_of_median", self.max_weight_of_median),
            ("max_norm_of_median", self.max_norm_of_median),
        ] {
            range(r >= 1.0, field, "be at least 1 (inf: off)", r);
        }
        let a = self.audit_budget_bytes;
        range(
            a >= 64 << 10,
            "audit_budget_bytes",
            "be at least 64 KiB (65536)",
            a as f64,
        );
        let m = self.max_samples;
        range(m > 0, "max_samples", "be at least 1", m as f64);
        let k = self.keep_versions;
        range(k > 0, "keep_versions", "be at least 1", k as f64);
        let u = self.max_update_bytes;
        range(u >= 64, "max_update_bytes", "be at least 64", u as f64);
        if let Err(e) = Id::new(&self.federation) {
            errs.insert(0, P::Federation(e));
        }
        errs.extend(self.site_problems());
        if !self.sites.is_empty() && self.min_sites > self.sampled_per_round() {
            errs.push(P::MinSites {
                min_sites: self.min_sites,
                sampled: self.sampled_per_round(),
            });
        }
        if self.bn_policy == BnPolicy::Global && self.bn_sharing != BnSharing::None {
            errs.push(P::SharingNeedsLocal(self.bn_sharing.name()));
        }
        if let Err(e) = self.encoding.validate() {
            errs.push(P::Encoding(e));
        }
        if let Err(e) = self.algorithm.validate() {
            errs.push(P::Algorithm(e));
        }
        match errs.is_empty() {
            true => Ok(()),
            false => Err(ConfigProblems(errs)),
        }
    }

    /// The problems of the enrolled sites: none enrolled, an invalid or reserved id, one
    /// enrolled twice, a bound of 0 samples.
    fn site_problems(&self) -> Vec<ConfigProblem> {
        use ConfigProblem as P;
        let mut errs = Vec::new();
        if self.sites.is_empty() {
            errs.push(P::NoSites);
        }
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.sites {
            if let Err(error) = Id::new(&s.id) {
                errs.push(P::SiteId {
                    site: s.id.clone(),
                    error,
                });
            }
            if s.id == unifed_protocol::AGGREGATOR_ID {
                errs.push(P::AggregatorsId(s.id.clone()));
            }
            if !seen.insert(&s.id) {
                errs.push(P::EnrolledTwice(s.id.clone()));
            }
            if s.max_samples == Some(0) {
                errs.push(P::SiteMaxSamples(s.id.clone()));
            }
        }
        errs
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

    /// The enrolled sites whose key is not revoked: those a round can still take anything from.
    pub fn unrevoked_sites(&self) -> impl Iterator<Item = &EnrolledSite> {
        self.sites.iter().filter(|s| !self.revoked.contains(&s.key))
    }

    /// How far a round trusts what each site says of its update, relative to its cohort.
    pub fn cohort_bounds(&self) -> crate::spoolround::CohortBounds {
        crate::spoolround::CohortBounds {
            weight_of_median: self.max_weight_of_median,
            norm_of_median: self.max_norm_of_median,
        }
    }

    /// The sample count `site` was enrolled with, when the operator set one: its weight
    /// counts as it claims up to it, outside the round's median cap.
    pub fn vouched_count(&self, site: &str) -> Option<u64> {
        self.sites
            .iter()
            .find(|s| s.id == site)
            .and_then(|s| s.max_samples)
            .map(|n| n.min(self.max_samples))
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
