//! Payloads carried inside an [`crate::Envelope`]. Each is postcard-encoded; the envelope's
//! [`crate::MessageKind`] says which one a payload is.

use crate::encoding::{EncodedTensor, Encoding};
use crate::ids::SiteId;
use crate::spec::SpecHash;
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

/// A named scalar an algorithm sends beside the weights (local steps, training loss, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scalar {
    /// Name, e.g. `local_steps`.
    pub name: String,
    /// Value.
    pub value: f64,
}

/// Typed algorithm extras: named auxiliary tensors (control variates, mask gradients, per-class
/// feature statistics) and named scalars.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Extras {
    /// Auxiliary tensors.
    pub tensors: Vec<EncodedTensor>,
    /// Scalars.
    pub scalars: Vec<Scalar>,
}

/// The small retained message that announces the current round and model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundManifest {
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
    /// SHA-256 of the whole model payload.
    pub payload_hash: [u8; 32],
    /// Encoding sites must use for their updates.
    pub encoding: Encoding,
    /// BN policy of the federation.
    pub bn_policy: BnPolicy,
    /// Sites sampled for this round (empty: every site may report).
    pub sampled: Vec<SiteId>,
    /// Round deadline, milliseconds since the Unix epoch.
    pub deadline_ms: u64,
    /// True once the federation has run all its rounds.
    pub finished: bool,
}

/// One piece of a payload larger than the packet limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// SHA-256 of the whole payload; identifies the set.
    pub payload_hash: [u8; 32],
    /// Index of this chunk, `0..count`.
    pub index: u32,
    /// Number of chunks in the set.
    pub count: u32,
    /// Length of the whole payload.
    pub total_len: u64,
    /// This chunk's bytes.
    pub data: Vec<u8>,
}

/// A site asks for chunks of a model version (all of them when `indices` is empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRequest {
    /// Model version wanted.
    pub model_version: u64,
    /// Chunk indices wanted; empty means all.
    pub indices: Vec<u32>,
}

/// The server's model for a round: weights (non-BN only under `local` BN) and extras.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerBroadcast {
    /// Model version.
    pub model_version: u64,
    /// The global weights.
    pub weights: Vec<EncodedTensor>,
    /// Algorithm extras (e.g. server control variate, global mask gradient).
    pub extras: Extras,
}

/// A site's contribution to a round: the delta of its trained weights against the round's
/// model (non-BN only under `local` BN), its sample count and extras.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteUpdate {
    /// Round the update is for.
    pub round: u64,
    /// Model version the site trained from.
    pub base_version: u64,
    /// Training samples behind the update (the FedAvg weight).
    pub samples: u64,
    /// `trained - base`, tensor by tensor.
    pub delta: Vec<EncodedTensor>,
    /// Algorithm extras.
    pub extras: Extras,
}

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
    /// The update is not in the federation's encoding.
    WrongEncoding,
}

/// The aggregator's answer to an update: accepted or rejected with a reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Answer {
    /// Stored durably; it will be folded into the round's aggregate.
    Accepted,
    /// Not used; the reason says why.
    Rejected(RejectReason),
}

/// The aggregator's reply to an update, sent to the site.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateAnswer {
    /// Round of the answered update.
    pub round: u64,
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
    /// SHA-256 of the whole update envelope (the chunk set's id).
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
}

/// A site's status message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteStatus {
    /// State.
    pub state: SiteState,
    /// Free-form detail for operators.
    pub detail: String,
}
