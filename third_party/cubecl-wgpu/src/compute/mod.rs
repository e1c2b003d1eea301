pub(crate) mod controller;
pub(crate) mod copies;
pub(crate) mod device_poison;

mod graph;
// UniFed Edge patch: the driver's pipelines kept on disk.
#[cfg(disk_pipelines)]
pub(crate) mod pipeline_cache;
mod storage;

pub(super) mod mem_manager;
pub(super) mod poll;
pub(super) mod schedule;
mod server;
pub(super) mod stream;
pub(super) mod timings;

pub use server::*;
// UniFed Edge patch: the driver's pipelines kept on disk.
#[cfg(disk_pipelines)]
pub use pipeline_cache::save_pipeline_caches;
/// UniFed Edge patch: writes the pipeline caches this process opened (none in this build).
#[cfg(not(disk_pipelines))]
pub fn save_pipeline_caches() {}
pub use storage::*;
