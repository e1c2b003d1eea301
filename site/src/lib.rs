//! The site side of UniFed Edge without I/O: the engine every driver of a site runs (the MQTT
//! agent, the in-process runner), so there is one client round and one seed rule.
//!
//! # Layout
//! - [`engine`]: [`SiteEngine`], `handle(event, now) -> actions`: manifest, windowed model
//!   fetch, apply, train, upload, answers, checkpoints; bad network input dropped at its
//!   boundary.
//! - [`upload`]: an update on its way (whole, or chunks through a window of receipts).
//!
//! Training itself is the driver's: it answers [`engine::Action::Train`] with
//! `unifed_models::site::Site::train_round` and reports [`engine::Event::Trained`].

pub mod engine;
pub mod upload;

pub use engine::{Action, EngineConfig, Event, Progress, SiteEngine};
pub use upload::Upload;
