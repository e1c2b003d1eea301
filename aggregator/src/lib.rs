//! The UniFed Edge aggregator's federation core: a state machine without network I/O
//! (`handle(event) -> actions`) that runs rounds, validates every update (spec hash, round,
//! model version, tensor names and shapes, finite values, optional norm bound), answers each
//! with an accept or a reject naming the reason, deduplicates re-sends on (round, site), spools
//! accepted updates to disk (fsync before the accept), and at round close folds the spool in site
//! order into the weighted mean: FedAvg, with BatchNorm tensors excluded under the `local` BN
//! policy (FedBN). It also serves new sites: each model version's onboarding package (with BN
//! layers chosen by the BN sharing policy) and a registry of sites' sealed, calibrated BN.
//!
//! # Layout
//! - [`config`]: [`FederationConfig`] and its validation.
//! - [`core`]: [`Aggregator`], [`Event`], [`Action`].
//! - [`store`]: the data directory: state, model versions, spool, audit log (all versioned,
//!   written atomically).
//! - [`fold`]: the weighted mean over spooled deltas.
//! - [`bnshare`]: the sites' shared BN tensors pooled for the onboarding package.
//! - [`onboard`]: onboarding packages and the registry of sites' sealed, calibrated BN.
//! - [`service`]: the core on MQTT (`unifed-aggregator serve`).
//!
//! The core never needs burn or a network; the service adds MQTT.

pub mod bnshare;
pub mod config;
pub mod core;
pub mod fold;
pub mod onboard;
pub mod service;
pub mod store;

pub use crate::config::{FederationConfig, Weighting};
pub use crate::core::{Action, Aggregator, CoreError, Event, GlobalModel};
