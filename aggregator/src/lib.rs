//! The UniFed Edge aggregator's federation core: a state machine without network I/O
//! (`handle(event) -> actions`) that runs rounds, validates every update (spec hash, round,
//! model version, tensor names and shapes, finite values, optional norm bound), answers each
//! with an accept or a reject naming the reason, deduplicates re-sends on (round, site), spools
//! accepted updates to disk (fsync before the accept), and at round close folds the spool in site
//! order by the federation's strategy (FedAvg's weighted mean for FedAvg, FedBN and FedProx),
//! with BatchNorm tensors excluded under the `local` BN
//! policy (FedBN). It also serves new sites: each model version's onboarding package (with BN
//! layers chosen by the BN sharing policy) and a registry of sites' sealed, calibrated BN.
//!
//! # Layout
//! - [`config`]: [`FederationConfig`] and its validation; [`spelling`]: how a config spells
//!   the wire's enums (lower-case words; the old spellings read with a warning).
//! - [`core`]: [`Aggregator`], [`Event`], [`Action`].
//! - [`federation`]: [`federation::Federation`], the driver both the service and the
//!   in-process runner run around the core: signed answers, manifests and model chunks, chunk
//!   requests served and routed, onboarding packages.
//! - [`store`]: the data directory: state, model versions, spool, audit log (all versioned,
//!   written atomically).
//! - [`strategy`]: server strategies as typed policy ([`strategy::Strategy`]: plan, check,
//!   aggregate from a reader over the spool, state committed with the model); FedAvg/FedBN and
//!   FedProx.
//! - [`fold`]: the weighted mean over spooled deltas.
//! - [`bnshare`]: the sites' shared BN tensors pooled for the onboarding package.
//! - [`onboard`]: onboarding packages and the registry of sites' sealed, calibrated BN.
//! - [`uploads`]: sites' chunked uploads, spooled to disk as they arrive.
//! - [`ingest`]: the task that takes in update chunks beside the core's loop.
//! - [`service`]: the core on MQTT (`unifed-aggregator serve`).
//!
//! The core never needs burn or a network; the service adds MQTT.

pub mod bnshare;
mod broadcast;
mod clock;
pub mod config;
pub mod core;
mod disk;
pub mod enrol;
pub mod federation;
pub mod fold;
pub mod ingest;
pub mod mosquitto;
pub mod onboard;
mod sealed;
pub mod service;
pub mod serving;
pub mod spelling;
mod spoolfile;
pub mod spoolround;
pub mod store;
pub mod strategy;
pub mod uploads;

pub use crate::config::{ConfigProblem, ConfigProblems, EnrolledSite, FederationConfig, Weighting};
pub use crate::core::{Action, Aggregator, Arrival, CoreError, Event, GlobalModel, Incoming};
pub use crate::disk::free_bytes;
pub use crate::strategy::{Algorithm, Strategy};

/// Threads for work spread over the cores: one per core, at least one and at most `cap`.
pub fn threads_up_to(cap: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, cap.max(1))
}
