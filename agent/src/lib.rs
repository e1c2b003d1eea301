//! The library side of `unifed-agent`: the MQTT trainer and the initial model, shared with the
//! one-command demo (`unifed-demo`), which runs agents as processes of its own binary.

pub mod config;
pub mod doctor;
mod files;
mod host;
pub mod model;
pub mod profile;
pub mod progress;
pub mod registry;
pub mod train;
pub mod warmup;
