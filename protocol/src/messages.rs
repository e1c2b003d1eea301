//! Payloads carried inside an [`crate::Envelope`]. Each is postcard-encoded; the envelope's
//! [`crate::MessageKind`] says which one a payload is.

use crate::encoding::{EncodedTensor, Encoding};
use crate::ids::SiteId;
use crate::spec::{SpecHash, TensorKind};
use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// How BatchNorm layers are treated by the federation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BnPolicy {
    /// Client-specific BN (FedBN / UniFed): BN tensors never leave the site and are not averaged.
    Local,
    /// FedAvg-style: BN affine parameters and running statistics are averaged like any tensor.
    Global,
}

/// Which of a site's BatchNorm tensors leave it under `local` BN: the federation's BN sharing
/// policy. BN statistics help gradient-inversion attacks (UniFed section 5), so the default
/// shares nothing. What a site shares feeds the onboarding package new sites calibrate from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BnSharing {
    /// Nothing of any site's BN leaves the site; the onboarding package carries the global
    /// model's own, never-trained BN layers (UniFed's global model under client-specific BN).
    #[default]
    #[serde(rename = "none")]
    None,
    /// Sites also send their BN weight and bias with each update; the package carries their
    /// sample-weighted mean (FedBN appendix G).
    #[serde(rename = "affine")]
    Affine,
    /// Running statistics too: means averaged, variances pooled as the variance of the sites'
    /// mixture, `sum w_i (var_i + (mean_i - mean)^2) / sum w_i`.
    #[serde(rename = "affine+stats")]
    AffineStats,
}

impl BnSharing {
    /// True if a site's tensor of `kind` leaves it under this policy.
    pub fn shares(self, kind: TensorKind) -> bool {
        match self {
            BnSharing::None => false,
            BnSharing::Affine => kind.is_bn_affine(),
            BnSharing::AffineStats => kind.is_bn(),
        }
    }

    /// The policy's name in configs: `none`, `affine` or `affine+stats`.
    pub fn name(self) -> &'static str {
        match self {
            BnSharing::None => "none",
            BnSharing::Affine => "affine",
            BnSharing::AffineStats => "affine+stats",
        }
    }
}

impl core::str::FromStr for BnSharing {
    type Err = BnSharingError;

    fn from_str(s: &str) -> Result<Self, BnSharingError> {
        match s {
            "none" => Ok(BnSharing::None),
            "affine" => Ok(BnSharing::Affine),
            "affine+stats" => Ok(BnSharing::AffineStats),
            o => Err(BnSharingError::Unknown(o.into())),
        }
    }
}

/// Why a BN sharing policy's name cannot be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BnSharingError {
    /// The name is none of `none`, `affine` and `affine+stats`.
    #[error("unknown BN sharing policy `{0}`: expected none, affine or affine+stats")]
    Unknown(String),
}

impl From<BnSharingError> for String {
    fn from(e: BnSharingError) -> String {
        alloc::format!("{e}")
    }
}

/// The local objective a sampled site optimises in a round, chosen by the server's strategy.
/// One variant per family of local terms; the algorithms of UniFed's suite add theirs here
/// (FedCD's mask-gradient matching and FedImpro's synthetic features join SCAFFOLD's
/// correction, MOON's contrastive term, FedDC's drift and Per-FedAvg's meta-steps).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub enum Objective {
    /// Cross-entropy alone (FedAvg, FedBN, and the FedOpt family, whose difference is on the
    /// server).
    #[default]
    CrossEntropy,
    /// Cross-entropy plus the FedProx term `mu/2 ||w - w_global||^2` over the tensors the
    /// federation averages (non-BN under `local` BN; BN affine included under `global`),
    /// applied as the gradient term `mu (w - w_global)`.
    Proximal {
        /// The proximal weight `mu` (FedBN's digits setting: 0.01).
        mu: f64,
    },
    /// SCAFFOLD (Karimireddy et al., option II): every local step uses the corrected gradient
    /// `g - c_i + c` over the trainable tensors the federation averages, where `c` is the
    /// server's control variate (in the round's [`ServerExtras::Control`]) and `c_i` the site's;
    /// the update carries `c_i+ - c_i` in [`SiteExtras::Control`], with
    /// `c_i+ = c_i - c + (x - y_i) / (K lr)`.
    Scaffold,
    /// MOON (Li, He and Song, CVPR 2021): cross-entropy plus `mu` times the model-contrastive
    /// loss on the representation `z` of each sample, which pulls it towards the round's
    /// starting model's representation and away from the site's previous local model's:
    /// `-log(e^(cos(z, z_glob)/t) / (e^(cos(z, z_glob)/t) + e^(cos(z, z_prev)/t)))`, averaged
    /// over the batch. Both other models run in inference mode and are not trained; a site
    /// with no previous local model (its first round) trains on cross-entropy alone, as the
    /// paper's code does.
    Contrastive {
        /// The weight `mu` of the contrastive loss (MOON: 5 on CIFAR-10, 1 on CIFAR-100).
        mu: f64,
        /// The temperature `t` (MOON: 0.5).
        temperature: f64,
    },
    /// FedDC (Gao et al., CVPR 2022): SCAFFOLD's corrected gradient `g - c_i + c` plus the
    /// drift penalty `alpha/2 ||w + h_i - w_global||^2`, where `h_i`, the site's local drift,
    /// is the sum of its accepted (decoded) deltas. Control variates travel as under
    /// [`Objective::Scaffold`]; the server adds the mean drift of all sites to the new model.
    Drift {
        /// The weight `alpha` of the drift penalty (FedDC's code: 0.01).
        alpha: f64,
    },
    /// Per-FedAvg (Fallah, Mokhtari and Ozdaglar 2020), first-order: each local step takes two
    /// batches, a step of `alpha` on the first to a temporary model, then the gradient of the
    /// second batch at the temporary model applied with step `beta` to the model as it was.
    /// A site evaluates the model after one personalisation step of `alpha` on a batch of its
    /// own training data (UniFed personalises on labelled test data, which a deployed site does
    /// not have).
    Meta {
        /// The inner (personalisation) step size.
        alpha: f64,
        /// The outer (meta) step size.
        beta: f64,
    },
    /// FedCD's SCI (Spurious Correlation Intervener): the site scales the representation in
    /// front of its linear classifier by a mask of its own (initialised to ones, trained with
    /// the model, never sent), and adds `lambda ||g_e - g_g||^2`, where `g_e` is the gradient of
    /// the batch's cross-entropy with respect to the mask (in closed form, inside the graph) and
    /// `g_g` the federation's mean of the sites' mask gradients (in the round's
    /// [`ServerExtras::MaskGradient`]; none before the first round closes, when the site trains
    /// on cross-entropy alone). The update carries the site's round-mean `g_e` and its training
    /// risk in [`SiteExtras::MaskGradient`].
    Invariant {
        /// The weight `lambda` of the gradient-matching penalty (FedCD's grid: 0.5 to 1.0).
        lambda: f64,
    },
    /// FedImpro (Chen et al., ICLR 2024), Eq. 6: the model splits after its `split`-th weight
    /// layer into a low-level part and a high-level head. Each step adds to the cross-entropy of
    /// the real batch the cross-entropy of one synthetic feature per real sample, drawn from the
    /// federation's Gaussian of the sample's class (in the round's
    /// [`ServerExtras::FeatureStats`]; none before the first round closes, when the site trains
    /// on cross-entropy alone), which trains the head only. The site keeps per class a running
    /// mean and variance of its low-level features (momentum `beta`, Eq. 7) and sends them in
    /// [`SiteExtras::FeatureStats`], with Gaussian noise of standard deviation `noise` added
    /// (App. D.3; 0: none).
    Decoupled {
        /// Weight layers in the low-level part (FedImpro's best on ResNet-18: 9, the middle).
        split: u32,
        /// The momentum `beta` of the site's running feature statistics, in [0, 1).
        beta: f64,
        /// The standard deviation of the noise added to the statistics a site sends.
        noise: f64,
    },
}

impl Objective {
    /// Checks the objective's parameters, naming the bad one.
    pub fn validate(&self) -> Result<(), ObjectiveError> {
        match *self {
            Objective::CrossEntropy | Objective::Scaffold => Ok(()),
            Objective::Proximal { mu } if mu.is_finite() && mu >= 0.0 => Ok(()),
            Objective::Proximal { mu } => Err(ObjectiveError::ProximalMu(mu)),
            Objective::Contrastive { mu, .. } if !(mu.is_finite() && mu >= 0.0) => {
                Err(ObjectiveError::ContrastiveMu(mu))
            }
            Objective::Contrastive { temperature, .. }
                if !(temperature.is_finite() && temperature > 0.0) =>
            {
                Err(ObjectiveError::Temperature(temperature))
            }
            Objective::Contrastive { .. } => Ok(()),
            Objective::Drift { alpha } if alpha.is_finite() && alpha >= 0.0 => Ok(()),
            Objective::Drift { alpha } => Err(ObjectiveError::DriftAlpha(alpha)),
            Objective::Meta { alpha, .. } if !(alpha.is_finite() && alpha > 0.0) => {
                Err(ObjectiveError::MetaAlpha(alpha))
            }
            Objective::Meta { beta, .. } if !(beta.is_finite() && beta > 0.0) => {
                Err(ObjectiveError::MetaBeta(beta))
            }
            Objective::Meta { .. } => Ok(()),
            Objective::Invariant { lambda } if lambda.is_finite() && lambda >= 0.0 => Ok(()),
            Objective::Invariant { lambda } => Err(ObjectiveError::InvariantLambda(lambda)),
            Objective::Decoupled { split: 0, .. } => Err(ObjectiveError::DecoupledSplit),
            Objective::Decoupled { beta, .. } if !(0.0..1.0).contains(&beta) => {
                Err(ObjectiveError::DecoupledBeta(beta))
            }
            Objective::Decoupled { noise, .. } if !(noise.is_finite() && noise >= 0.0) => {
                Err(ObjectiveError::DecoupledNoise(noise))
            }
            Objective::Decoupled { .. } => Ok(()),
        }
    }

    /// True when sites train against the server's control variate (SCAFFOLD, FedDC): the
    /// model comes with it in [`ServerExtras::Control`] and each update carries the change of
    /// the site's variate in [`SiteExtras::Control`].
    pub fn uses_control(&self) -> bool {
        matches!(self, Objective::Scaffold | Objective::Drift { .. })
    }
}

/// Why an [`Objective`]'s parameters are refused by [`Objective::validate`]. Each variant
/// carries the value that was given.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum ObjectiveError {
    /// FedProx's `mu` is negative or not finite.
    #[error("FedProx mu must be finite and non-negative, got {0}")]
    ProximalMu(f64),
    /// MOON's `mu` is negative or not finite.
    #[error("MOON mu must be finite and non-negative, got {0}")]
    ContrastiveMu(f64),
    /// MOON's temperature is not positive or not finite.
    #[error("MOON temperature must be finite and positive, got {0}")]
    Temperature(f64),
    /// FedDC's `alpha` is negative or not finite.
    #[error("FedDC alpha must be finite and non-negative, got {0}")]
    DriftAlpha(f64),
    /// Per-FedAvg's inner step `alpha` is not positive or not finite.
    #[error("Per-FedAvg alpha must be positive and finite, got {0}")]
    MetaAlpha(f64),
    /// Per-FedAvg's outer step `beta` is not positive or not finite.
    #[error("Per-FedAvg beta must be positive and finite, got {0}")]
    MetaBeta(f64),
    /// FedCD's `lambda` is negative or not finite.
    #[error("FedCD lambda must be finite and non-negative, got {0}")]
    InvariantLambda(f64),
    /// FedImpro's split leaves no low-level part.
    #[error("FedImpro split must be at least 1 (weight layers in the low-level part)")]
    DecoupledSplit,
    /// FedImpro's momentum `beta` is outside [0, 1).
    #[error("FedImpro beta must lie in [0, 1), got {0}")]
    DecoupledBeta(f64),
    /// FedImpro's noise is negative or not finite.
    #[error("FedImpro noise must be finite and non-negative, got {0}")]
    DecoupledNoise(f64),
}

impl From<ObjectiveError> for String {
    fn from(e: ObjectiveError) -> String {
        alloc::format!("{e}")
    }
}

/// What every sampled site does in a round: the typed plan of the server's strategy, carried
/// in the round manifest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundPlan {
    /// The local objective.
    pub objective: Objective,
}

/// Typed facts about a site's local training that every algorithm may use (FedNova normalises
/// by the local step count; FedCD weights sites by their loss).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalReport {
    /// Optimiser steps taken.
    pub local_steps: u64,
    /// Mean training loss of the last local epoch.
    pub train_loss: f64,
}

/// Algorithm tensors a site sends beside its weight delta. One variant per algorithm that
/// needs them, validated by the server's strategy: SCAFFOLD's control-variate delta, FedCD's
/// mask gradient, FedImpro's per-class feature statistics join here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum SiteExtras {
    /// Nothing beyond the delta (FedAvg, FedBN, FedProx, FedOpt).
    #[default]
    None,
    /// SCAFFOLD: the change of the site's control variate, `c_i+ - c_i`, one tensor per
    /// trainable averaged tensor (BN running statistics never), in the federation's encoding.
    Control(Vec<EncodedTensor>),
    /// FedCD: the gradient of the site's cross-entropy with respect to its mask (one value per
    /// input of the linear classifier), averaged over the round's samples, and its training
    /// risk `R_e`, the mean over those samples of its whole local loss (penalty included).
    MaskGradient {
        /// The round-mean mask gradient `g_e`, exact.
        gradient: Vec<f32>,
        /// The training risk `R_e`.
        risk: f64,
    },
    /// FedImpro: the site's running per-class mean and variance of its low-level features
    /// (Eq. 7), with the round's noise added.
    FeatureStats(FeatureStats),
}

/// Per-class Gaussians of a model's low-level features (FedImpro): for each class of the
/// spec, in its order, the mean and the variance of every feature, or nothing for a class the
/// sender has no estimate of (a site that never saw it; a federation no site sent it to).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FeatureStats {
    /// Values per feature vector (the low-level part's output per sample).
    pub width: u32,
    /// One entry per class.
    pub classes: Vec<Option<ClassStats>>,
}

/// One class's Gaussian of features: `width` means and `width` variances, exact f32.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassStats {
    /// The mean of each feature.
    pub mean: Vec<f32>,
    /// The variance of each feature.
    pub var: Vec<f32>,
}

impl FeatureStats {
    /// Checks the shape against `classes` classes of `width` features (if given) and every
    /// value: finite, variances non-negative. Names the first problem.
    pub fn check(&self, classes: usize, width: Option<usize>) -> Result<(), FeatureStatsError> {
        let w = self.width as usize;
        if w == 0 || width.is_some_and(|want| want != w) {
            return Err(FeatureStatsError::Width {
                width: w,
                want: width,
            });
        }
        if self.classes.len() != classes {
            return Err(FeatureStatsError::Classes {
                classes: self.classes.len(),
                want: classes,
            });
        }
        for (class, c) in self.classes.iter().enumerate() {
            let Some(c) = c else { continue };
            if c.mean.len() != w || c.var.len() != w {
                return Err(FeatureStatsError::Length {
                    class,
                    means: c.mean.len(),
                    vars: c.var.len(),
                    width: w,
                });
            }
            if c.mean.iter().chain(&c.var).any(|v| !v.is_finite()) {
                return Err(FeatureStatsError::NotFinite { class });
            }
            if c.var.iter().any(|v| *v < 0.0) {
                return Err(FeatureStatsError::NegativeVariance { class });
            }
        }
        Ok(())
    }
}

/// Why [`FeatureStats::check`] refuses statistics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeatureStatsError {
    /// The width is zero or not the one expected.
    #[error(
        "feature statistics of width {width}, not {}",
        want.map_or("a positive width".into(), |w| alloc::format!("{w}"))
    )]
    Width {
        /// The width sent.
        width: usize,
        /// The width expected, if known.
        want: Option<usize>,
    },
    /// Not one entry per class.
    #[error("feature statistics of {classes} classes, not {want}")]
    Classes {
        /// Entries sent.
        classes: usize,
        /// The model's classes.
        want: usize,
    },
    /// A class's vectors are not of the width.
    #[error("class {class}'s statistics hold {means} means and {vars} variances, not {width}")]
    Length {
        /// The class.
        class: usize,
        /// Its means.
        means: usize,
        /// Its variances.
        vars: usize,
        /// The width.
        width: usize,
    },
    /// A value is NaN or infinite.
    #[error("class {class}'s statistics hold a value that is not finite")]
    NotFinite {
        /// The class.
        class: usize,
    },
    /// A variance is negative.
    #[error("class {class}'s statistics hold a negative variance")]
    NegativeVariance {
        /// The class.
        class: usize,
    },
}

/// Algorithm tensors the server sends beside the model. One variant per algorithm that needs
/// them: SCAFFOLD's server control variate, FedCD's averaged mask gradient, FedImpro's global
/// per-class feature statistics join here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum ServerExtras {
    /// Nothing beyond the model.
    #[default]
    None,
    /// SCAFFOLD: the server control variate `c` of the model version, one tensor per trainable
    /// averaged tensor (BN running statistics never), in exact f32.
    Control(Vec<EncodedTensor>),
    /// FedCD: the mean of the sites' mask gradients of the round that made the model,
    /// `g_g = sum_e p_e g_e`, one value per input of the linear classifier, exact.
    MaskGradient(Vec<f32>),
    /// FedImpro: the federation's per-class Gaussians of low-level features, the unweighted
    /// mean over the sites that sent each class (Eq. 8).
    FeatureStats(FeatureStats),
}

/// The small retained message that announces the current round and model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundManifest {
    /// The run of the federation (its envelope's): what the site signs its messages with.
    pub run: crate::ids::RunId,
    /// Current round (0 before the first round opens).
    pub round: u64,
    /// Version of the model the round trains from.
    pub model_version: u64,
    /// Spec hash of the model.
    pub spec_hash: SpecHash,
    /// Number of chunks of the model payload.
    pub chunk_count: u32,
    /// Length of the whole model payload in bytes.
    pub payload_len: u64,
    /// Hash ([`crate::payload_hash`]) of the whole model payload.
    pub payload_hash: [u8; 32],
    /// The same model as a [`ModelDelta`] from the previous version in the federation's
    /// encoding, for a site that holds that version (absent under `f32`, where the whole model
    /// costs no more, and at version 0).
    pub delta: Option<DeltaInfo>,
    /// Encoding sites must use for their updates (and the aggregator for its deltas).
    pub encoding: Encoding,
    /// BN policy of the federation.
    pub bn_policy: BnPolicy,
    /// Which BN tensors sites send with their updates (under `local` BN).
    pub bn_sharing: BnSharing,
    /// Sites sampled for this round (empty: every site may report).
    pub sampled: Vec<SiteId>,
    /// Bytes of update chunks a site may have in flight without a receipt: the aggregator's
    /// share for each sampled site of what the broker keeps for it, so that every site's window
    /// fits at once (a site keeps at least one chunk in flight).
    pub upload_window_bytes: u32,
    /// What the sampled sites do this round (the strategy's typed plan).
    pub plan: RoundPlan,
    /// Round deadline, milliseconds since the Unix epoch.
    pub deadline_ms: u64,
    /// True once the federation has run all its rounds.
    pub finished: bool,
}

/// Where to fetch a model version as a delta from the version before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaInfo {
    /// The version the delta applies to.
    pub from_version: u64,
    /// Number of chunks of the delta payload.
    pub chunk_count: u32,
    /// Length of the whole delta payload in bytes.
    pub payload_len: u64,
    /// Hash ([`crate::payload_hash`]) of the whole delta payload.
    pub payload_hash: [u8; 32],
}

/// One piece of a payload larger than the packet limit. Its bytes are owned (`Vec<u8>`, the
/// default) or borrowed from the received message ([`ChunkRef`]): both encode alike.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub struct Chunk<B = Vec<u8>> {
    /// Hash ([`crate::payload_hash`]) of the whole payload; identifies the set.
    pub payload_hash: [u8; 32],
    /// Index of this chunk, `0..count`.
    pub index: u32,
    /// Number of chunks in the set.
    pub count: u32,
    /// Length of the whole payload.
    pub total_len: u64,
    /// This chunk's bytes.
    #[serde(with = "serde_bytes")]
    pub data: B,
}

/// A [`Chunk`] read in place: its bytes are a slice of the message it came in, so a receiver
/// writes them where they belong without copying them first.
pub type ChunkRef<'a> = Chunk<&'a [u8]>;

impl Chunk {
    /// This chunk with its bytes borrowed.
    pub fn as_ref(&self) -> ChunkRef<'_> {
        Chunk {
            payload_hash: self.payload_hash,
            index: self.index,
            count: self.count,
            total_len: self.total_len,
            data: &self.data,
        }
    }
}

/// Which payload of a model version a [`ChunkRequest`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Payload {
    /// The whole round model (a [`ServerBroadcast`]).
    Model,
    /// The round model as a [`ModelDelta`] from the previous version.
    Delta,
    /// The version's onboarding package.
    Package,
}

/// A site asks for chunks of a model version (all of them when `indices` is empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRequest {
    /// Model version wanted.
    pub model_version: u64,
    /// Chunk indices wanted; empty means all. The aggregator serves at most 64 per request.
    pub indices: Vec<u32>,
    /// Which of the version's payloads.
    pub payload: Payload,
    /// The site may have missed chunks sent for every site (it reconnected, or its window went
    /// stale): the aggregator sends what was already sent for all to it alone.
    pub alone: bool,
}

/// The server's model for a round: weights (non-BN only under `local` BN) and extras. Its
/// tensors' bytes are owned or read in place from the payload (as [`EncodedTensor`]'s are).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub struct ServerBroadcast<B = Vec<u8>> {
    /// Model version.
    pub model_version: u64,
    /// The global weights.
    pub weights: Vec<EncodedTensor<B>>,
    /// Algorithm tensors beside the model (e.g. a server control variate).
    pub extras: ServerExtras,
}

/// A model version as the change from the version before it: what a site that holds
/// `from_version` fetches instead of the whole model. The aggregator encodes
/// `target - held` in the federation's encoding, where `held` is the model every site
/// following the deltas holds; what the encoding drops stays in the next delta (error
/// feedback on the server), and sites that follow the deltas all hold the same weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub struct ModelDelta<B = Vec<u8>> {
    /// The version the delta applies to.
    pub from_version: u64,
    /// The version it gives.
    pub model_version: u64,
    /// Additions to the trainable tensors of the broadcast, in the federation's encoding.
    pub delta: Vec<EncodedTensor<B>>,
    /// BN running statistics of the broadcast (under `global` BN) as exact f32 values, not
    /// deltas: a lossy variance could turn negative.
    pub values: Vec<EncodedTensor<B>>,
    /// Algorithm tensors beside the model, whole (as in [`ServerBroadcast`]).
    pub extras: ServerExtras,
}

/// A model as a site receives it: whole, or as a delta from the version it holds; its tensors'
/// bytes owned or read in place from the payload ([`Downloaded::read`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Download<B = Vec<u8>> {
    /// The whole model.
    Model(ServerBroadcast<B>),
    /// The change from the version before.
    Delta(ModelDelta<B>),
}

impl<B> Download<B> {
    /// The model version it gives.
    pub fn model_version(&self) -> u64 {
        match self {
            Download::Model(b) => b.model_version,
            Download::Delta(d) => d.model_version,
        }
    }

    /// The algorithm tensors beside the model.
    pub fn extras(&self) -> &ServerExtras {
        match self {
            Download::Model(b) => &b.extras,
            Download::Delta(d) => &d.extras,
        }
    }
}

/// A complete model payload a site fetched: its bytes, checked once to decode as the payload
/// they are (a [`ServerBroadcast`], or a [`ModelDelta`]), then read in place by
/// [`Downloaded::read`], so that applying the model holds the payload and no decoded copy of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Downloaded {
    bytes: Vec<u8>,
    delta: bool,
    model_version: u64,
    from_version: Option<u64>,
}

impl Downloaded {
    /// `bytes` as a whole model, or as a delta when `delta`: an error when they do not decode as
    /// that payload.
    pub fn new(bytes: Vec<u8>, delta: bool) -> Result<Downloaded, postcard::Error> {
        let (model_version, from_version) = match read_download(&bytes, delta)? {
            Download::Model(b) => (b.model_version, None),
            Download::Delta(d) => (d.model_version, Some(d.from_version)),
        };
        Ok(Downloaded {
            bytes,
            delta,
            model_version,
            from_version,
        })
    }

    /// The model, its tensors' bytes read in place from the payload. Only names, shapes and
    /// small fields are decoded; the error cannot happen for bytes [`Downloaded::new`] took.
    pub fn read(&self) -> Result<Download<&[u8]>, postcard::Error> {
        read_download(&self.bytes, self.delta)
    }

    /// The model version it gives.
    pub fn model_version(&self) -> u64 {
        self.model_version
    }

    /// The version a delta applies to; `None` for a whole model.
    pub fn from_version(&self) -> Option<u64> {
        self.from_version
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// `bytes` read in place as a whole model, or as a delta when `delta`.
fn read_download(bytes: &[u8], delta: bool) -> Result<Download<&[u8]>, postcard::Error> {
    Ok(if delta {
        Download::Delta(postcard::from_bytes(bytes)?)
    } else {
        Download::Model(postcard::from_bytes(bytes)?)
    })
}

/// A site's contribution to a round: the delta of its trained weights against the round's
/// model (non-BN only under `local` BN), its sample count and extras. Its tensors' bytes are
/// owned or read in place from the message ([`SiteUpdateRef`]); the extras are always owned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub struct SiteUpdate<B = Vec<u8>> {
    /// Round the update is for.
    pub round: u64,
    /// Model version the site trained from.
    pub base_version: u64,
    /// Training samples behind the update (the FedAvg weight), at most the federation's
    /// `max_samples`.
    pub samples: u64,
    /// `trained - base`, tensor by tensor.
    pub delta: Vec<EncodedTensor<B>>,
    /// The site's BN tensors after training, as values (not deltas) in exact f32: exactly
    /// those the federation's [`BnSharing`] policy shares, none under `none`.
    pub bn: Vec<EncodedTensor<B>>,
    /// Facts about the local training (steps, loss).
    pub report: LocalReport,
    /// Algorithm tensors beside the delta, as the round's plan asks.
    pub extras: SiteExtras,
}

/// A [`SiteUpdate`] read in place: its tensors' bytes are slices of the message it came in.
pub type SiteUpdateRef<'a> = SiteUpdate<&'a [u8]>;

/// Why an update was rejected. Every reject names one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RejectReason {
    /// The message could not be decoded.
    Malformed(String),
    /// The update is for another round.
    WrongRound {
        /// The round open now.
        expected: u64,
        /// The round the update names.
        got: u64,
    },
    /// The round the update is for has already closed.
    RoundClosed(u64),
    /// The update was trained from another model version.
    WrongModelVersion {
        /// The version the round trains from.
        expected: u64,
        /// The version the update names.
        got: u64,
    },
    /// The spec hash differs from the federation's.
    SpecHashMismatch,
    /// The sending site is not sampled in this round.
    NotSampled,
    /// A tensor the model has no place for (or a BN tensor under `local` BN).
    UnexpectedTensor(String),
    /// A tensor the update must carry is absent.
    MissingTensor(String),
    /// A tensor appears twice.
    DuplicateTensor(String),
    /// A tensor's shape differs from the spec.
    WrongShape(String),
    /// A tensor holds NaN or infinity.
    NonFinite(String),
    /// The update's L2 norm exceeds the configured bound.
    NormTooLarge {
        /// The update's norm.
        norm: f64,
        /// The bound.
        bound: f64,
    },
    /// Zero samples.
    NoSamples,
    /// More samples claimed than the federation allows (a sample count is a weight in the mean).
    TooManySamples {
        /// The count claimed.
        samples: u64,
        /// The federation's bound.
        bound: u64,
    },
    /// A BN running variance would become negative (`base + delta < 0`).
    NegativeVariance(String),
    /// Algorithm tensors the round's plan does not ask for.
    UnexpectedExtras(String),
    /// The update is not in the federation's encoding.
    WrongEncoding,
    /// The aggregator's disk is below its free-space floor: it takes no new work until an
    /// operator makes room (send the update again later).
    StorageFull {
        /// Free bytes on the aggregator's data disk.
        free_bytes: u64,
        /// The floor.
        floor_bytes: u64,
    },
}

/// The aggregator's answer to an update: accepted or rejected with a reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Answer {
    /// Stored durably; it will be folded into the round's aggregate.
    Accepted,
    /// Not used; the reason says why.
    Rejected(RejectReason),
    /// The update was accepted, but its stored copy was found damaged before it was used:
    /// send the same update of the round again. Answered by round, not by bytes.
    Resend,
}

/// The aggregator's reply to an update, sent to the site.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateAnswer {
    /// Round of the answered update.
    pub round: u64,
    /// Hash ([`crate::payload_hash`]) of the answered message (the whole update envelope,
    /// reassembled if it came in chunks): a site takes only the answer to its own bytes as its
    /// update's.
    pub update_hash: [u8; 32],
    /// Outcome.
    pub answer: Answer,
}

/// The aggregator holds chunk `index` of the update whose payload hash is `payload_hash`: the
/// site's upload window moves on. Chunked uploads are windowed because a broker such as
/// rumqttd keeps only a bounded log per subscription and skips what a slow subscriber missed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateReceipt {
    /// Round of the update.
    pub round: u64,
    /// Hash ([`crate::payload_hash`]) of the whole update envelope (the chunk set's id).
    pub payload_hash: [u8; 32],
    /// The chunk received.
    pub index: u32,
}

/// What a site is doing (the Last Will publishes `Offline`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SiteState {
    /// Connected and idle.
    Online,
    /// Training for a round.
    Training {
        /// The round.
        round: u64,
    },
    /// Disconnected.
    Offline,
    /// Holds the federation's final model, of this version, and has stopped: the aggregator
    /// need not keep serving it.
    Finished {
        /// The final model's version.
        model_version: u64,
    },
}

/// A site's status message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteStatus {
    /// State.
    pub state: SiteState,
    /// Free-form detail for operators.
    pub detail: String,
}

/// A request on a site's onboarding topic (`onboard/request/{site}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnboardRequest {
    /// Describe the onboarding package of `model_version` (the newest when `None`); its chunks
    /// are then fetched with [`ChunkRequest`]s whose `package` is set.
    Package {
        /// The model version, or `None` for the newest.
        model_version: Option<u64>,
    },
    /// Send this site's registry entry for `model_version` (the newest registered when `None`).
    RegistryGet {
        /// The model version, or `None` for the newest registered.
        model_version: Option<u64>,
    },
}

/// The onboarding package of one model version: what a new site fetches and calibrates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageInfo {
    /// The model version.
    pub model_version: u64,
    /// The sharing policy that chose its BN layers.
    pub bn_sharing: BnSharing,
    /// Sites whose BN tensors were averaged into it (empty under `none`).
    pub bn_sites: Vec<SiteId>,
    /// Number of chunks of the payload (a postcard [`ServerBroadcast`] with every tensor).
    pub chunk_count: u32,
    /// Length of the payload in bytes.
    pub payload_len: u64,
    /// Hash ([`crate::payload_hash`]) of the payload.
    pub payload_hash: [u8; 32],
}

/// How a registry entry's data is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sealing {
    /// Plaintext (allowed only when the sharing policy is `affine+stats`).
    Plain,
    /// ChaCha20-Poly1305 with a key only the site's devices hold; the associated data binds
    /// the federation, site, model version and spec hash.
    ChaCha20Poly1305 {
        /// The 96-bit nonce.
        nonce: [u8; 12],
    },
}

/// The largest registry entry of a model of `spec`: its BN tensors in f32 with room for names,
/// shapes, framing and an AEAD tag. The aggregator refuses larger entries and the agent
/// accepts no larger ones.
pub fn max_registry_entry_bytes(spec: &crate::ModelSpec) -> usize {
    let bn: usize = spec
        .tensors
        .iter()
        .filter(|t| t.kind.is_bn())
        .map(|t| 4 * t.numel() + 256)
        .sum();
    bn + (1 << 16)
}

/// The largest model payload (a postcard [`ServerBroadcast`] of every tensor in exact f32, and
/// as much again for the extras: a control variate is one more copy of the trainable tensors;
/// FedImpro's per-class Gaussians, a mean and a variance per class at the model's widest split,
/// may be larger still) of a model of `spec`, with room for names, shapes and framing. Sites
/// accept no larger manifest.
pub fn max_broadcast_bytes(spec: &crate::ModelSpec) -> u64 {
    let model = spec
        .tensors
        .iter()
        .map(|t| 4 * t.numel() as u64 + 256)
        .sum::<u64>();
    let widest = (1..=64)
        .filter_map(|p| crate::spec::feature_width(spec, p))
        .max()
        .unwrap_or(0) as u64;
    let gaussians = spec.classes.len() as u64 * (8 * widest + 32);
    model + model.max(gaussians) + (1 << 16)
}

/// A site's calibrated BN state for one model version, as stored in the aggregator's registry.
/// Sent in [`Chunk`]s (kinds `RegistryPut` and `RegistryEntry`) because it can exceed a packet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryEntry {
    /// The model version the BN state was calibrated for.
    pub model_version: u64,
    /// How `data` is protected.
    pub sealing: Sealing,
    /// The postcard list of the site's BN [`EncodedTensor`]s, sealed or plain.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// Why an onboarding request was refused. Every refusal names one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnboardError {
    /// The aggregator holds no package of the version asked for.
    UnknownVersion {
        /// The version asked for.
        requested: u64,
        /// The versions it holds.
        available: Vec<u64>,
    },
    /// The site has no registry entry of the version asked for.
    NotRegistered {
        /// The version asked for (`None`: any).
        requested: Option<u64>,
        /// The versions registered for the site.
        available: Vec<u64>,
    },
    /// A registry entry was refused (malformed, too large, plaintext not allowed, ...).
    Refused(String),
    /// The aggregator's kept copy of what was asked for (a model version's package, a registry
    /// entry) could not be read: a damaged one is set aside, and the request refused.
    Unreadable {
        /// The model version asked for.
        requested: u64,
    },
}

/// The aggregator's answer on a site's onboarding reply topic (`onboard/reply/{site}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnboardReply {
    /// The package asked for.
    Package(PackageInfo),
    /// A registry entry was stored durably.
    Registered {
        /// Its model version.
        model_version: u64,
        /// Hash ([`crate::payload_hash`]) of the stored entry.
        entry_hash: [u8; 32],
    },
    /// The request was refused.
    Error(OnboardError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn an_unknown_bn_sharing_policy_is_named_in_the_error() {
        let err = "stats".parse::<BnSharing>().unwrap_err();
        assert!(matches!(&err, BnSharingError::Unknown(name) if name == "stats"));
        assert_eq!(
            String::from(err),
            "unknown BN sharing policy `stats`: expected none, affine or affine+stats"
        );
    }

    #[test]
    fn objective_validation_names_the_bad_parameter() {
        assert_eq!(Objective::Scaffold.validate(), Ok(()));
        assert_eq!(Objective::Proximal { mu: 0.01 }.validate(), Ok(()));
        assert!(matches!(
            Objective::Proximal { mu: -1.0 }.validate(),
            Err(ObjectiveError::ProximalMu(_))
        ));
        let moon = |mu, temperature| Objective::Contrastive { mu, temperature }.validate();
        assert_eq!(moon(5.0, 0.5), Ok(()));
        assert!(matches!(
            moon(f64::NAN, 0.5),
            Err(ObjectiveError::ContrastiveMu(_))
        ));
        assert!(matches!(
            moon(1.0, 0.0),
            Err(ObjectiveError::Temperature(_))
        ));
        assert!(matches!(
            Objective::Drift {
                alpha: f64::INFINITY
            }
            .validate(),
            Err(ObjectiveError::DriftAlpha(_))
        ));
        let meta = |alpha, beta| Objective::Meta { alpha, beta }.validate();
        assert_eq!(meta(0.01, 0.001), Ok(()));
        assert!(matches!(meta(0.0, 0.0), Err(ObjectiveError::MetaAlpha(_))));
        let err = meta(0.01, -1.0).unwrap_err();
        assert!(matches!(err, ObjectiveError::MetaBeta(b) if b == -1.0));
        assert_eq!(
            err.to_string(),
            "Per-FedAvg beta must be positive and finite, got -1"
        );
        let sci = |lambda| Objective::Invariant { lambda }.validate();
        assert_eq!(sci(0.7), Ok(()));
        assert_eq!(sci(0.0), Ok(()));
        assert!(matches!(sci(-0.5), Err(ObjectiveError::InvariantLambda(l)) if l == -0.5));
        assert!(matches!(
            sci(f64::NAN),
            Err(ObjectiveError::InvariantLambda(_))
        ));
    }
}
