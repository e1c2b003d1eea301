//! Wire-level types of UniFed Edge that need neither burn nor tokio.
//!
//! Everything two peers must agree on lives here: the **model spec** with its stable hash, the
//! identifiers, the message payloads, the envelope that frames them, the tensor encodings,
//! chunking of large payloads and the MQTT topic names.
//!
//! # Quick start
//! ```
//! use unifed_protocol::*;
//!
//! let update = SiteUpdate {
//!     round: 1,
//!     base_version: 1,
//!     samples: 10,
//!     delta: vec![encode("fc.weight", &[2], &[0.5, -0.25], Encoding::F16, None)],
//!     bn: vec![],
//!     report: LocalReport { local_steps: 24, train_loss: 0.7 },
//!     extras: SiteExtras::None,
//! };
//! let fed = Id::new("demo").unwrap();
//! let site = Id::new("site-a").unwrap();
//! let envelope = Envelope::new(
//!     MessageKind::SiteUpdate, fed.clone(), site.clone(), 1, 1, SpecHash([0; 32]), &update,
//! );
//! let bytes = envelope.encode();
//! let back: SiteUpdate = Envelope::decode(&bytes).unwrap().payload_as().unwrap();
//! assert_eq!(decode(&back.delta[0]).unwrap(), vec![0.5, -0.25]);
//! assert_eq!(Topics::new(&fed).update(&site), "unifed/v1/demo/update/site-a");
//! ```
//!
//! # Layout
//! - [`spec`]: [`ModelSpec`], [`TensorSpec`], [`TensorKind`], [`Input`], [`SpecHash`].
//! - [`ids`]: [`Id`] ([`SiteId`], [`FederationId`]), safe in topics and client ids.
//! - [`messages`]: the payloads ([`RoundManifest`], [`Chunk`], [`ChunkRequest`],
//!   [`ServerBroadcast`], [`SiteUpdate`], [`UpdateAnswer`], [`SiteStatus`], ...).
//! - [`envelope`]: the [`Envelope`] frame (magic, version, [`MessageKind`], ids, payload,
//!   signature) and [`DecodeError`].
//! - [`auth`] (`std`): ed25519 [`SigningKey`]s and [`PublicKey`]s, envelope signatures and the
//!   [`Keyring`] every received message is opened with.
//! - [`encoding`]: [`Encoding`] (`f32`, `f16`, `q8`, top-k), [`encode`] with error feedback,
//!   [`decode`] with shape checks.
//! - [`chunking`]: [`split`], [`payload_hash`] and the bounded, timed [`Reassembler`].
//! - [`topics`]: [`Topics`], the `unifed/v1/{federation}/...` names.
//!
//! # Feature flags
//! - `std` (default): implements `std::error::Error` for the error types. Without it the crate
//!   is `#![no_std]` + `alloc`.
#![cfg_attr(not(feature = "std"), no_std)]

extern crate alloc;

#[cfg(feature = "std")]
pub mod auth;
pub mod chunking;
pub mod encoding;
#[cfg(feature = "std")]
pub mod enrolment;
pub mod envelope;
pub mod ids;
pub mod messages;
pub mod spec;
pub mod topics;

#[cfg(feature = "std")]
pub use auth::{AuthError, KeyFileError, Keyring, PublicKey, PublicKeyError, SigningKey};
pub use chunking::{ChunkError, Cut, PayloadSource, Reassembler, payload_hash, split};
pub use encoding::{
    EncodedTensor, EncodedTensorRef, Encoding, EncodingParseError, TensorError, Values, check,
    decode, decode_add, encode, encode_leaving_error,
};
pub use envelope::{DecodeError, Envelope, EnvelopeRef, MAGIC, MessageKind, PROTOCOL_VERSION};
pub use ids::{AGGREGATOR_ID, FederationId, Id, IdError, MAX_ID_LEN, RunId, SiteId};
pub use messages::{
    Answer, BnPolicy, BnSharing, BnSharingError, Chunk, ChunkRef, ChunkRequest, ClassStats,
    DeltaInfo, Download, Downloaded, FeatureStats, LocalReport, ModelDelta, Objective,
    ObjectiveError, OnboardError, OnboardReply, OnboardRequest, PackageInfo, Payload,
    RegistryEntry, RejectReason, RoundManifest, RoundPlan, Sealing, ServerBroadcast, ServerExtras,
    SiteExtras, SiteState, SiteStatus, SiteUpdate, SiteUpdateRef, UpdateAnswer, UpdateReceipt,
    max_broadcast_bytes, max_registry_entry_bytes,
};
#[cfg(feature = "std")]
pub use spec::spec_path;
pub use spec::{Input, ModelSpec, Scaling, SpecError, SpecHash, TensorKind, TensorSpec};
pub use topics::Topics;
