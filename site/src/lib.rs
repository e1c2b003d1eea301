//! The site side of UniFed Edge without I/O: the engine every driver of a site runs (the MQTT
//! agent, the in-process runner), so there is one client round and one seed rule.
//!
//! # Layout
//! - [`engine`]: [`SiteEngine`], `handle(event, now) -> actions`: manifest, windowed model
//!   fetch, apply, train, upload, answers, checkpoints; bad network input dropped at its
//!   boundary.
//! - [`upload`]: an update on its way (whole, or chunks through a window of receipts).
//! - [`driver`]: [`SiteDriver`], the one loop around the engine that the agent and the
//!   in-process runner share: it does the engine's actions with a [`Worker`] (the model side,
//!   `unifed_models::worker::ModelWorker` on burn) and an [`Outbox`] (the transport side), and
//!   owns the round state between them.

pub mod driver;
pub mod engine;
pub mod upload;

pub use driver::{
    DriverConfig, DriverError, Evaluate, Evaluation, Note, Outbox, SiteDriver, WorkError, Worker,
};
pub use engine::{Action, ChunkFilter, EngineConfig, Event, Progress, SiteEngine};
pub use upload::Upload;
