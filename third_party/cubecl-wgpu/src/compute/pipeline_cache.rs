//! UniFed Edge patch: the driver's compiled pipelines, kept on disk beside the SPIR-V store.
//!
//! The SPIR-V store spares a restart cubecl's own compilation, but every pipeline is still
//! compiled again by the driver unless the driver keeps a disk cache of its own, which not every
//! driver or service account has (the NVIDIA driver on a lent H200 kept none: a process's first
//! pass took 31 s with every kernel tuned and stored, against 6.6 s where the driver's cache
//! held them). A `wgpu::PipelineCache` hands the driver's results back to it: it is loaded from
//! `<environment root>/pipelines/<adapter key>.bin` when the server starts, given to every
//! pipeline the server creates, and written back (whole, to a temporary file renamed over the
//! old one) when [`save_pipeline_caches`] is called, and at host syncs once pipelines were
//! created (see [`DiskPipelineCache::at_sync`]).
//!
//! The file is the cache's data after a header of our own: [`MAGIC`] and the xxh3-128 of the
//! data. A file that is torn, truncated or altered fails that check and is not handed to the
//! driver (the data is passed to `create_pipeline_cache`, which is unsafe for malformed data);
//! wgpu's own header then refuses data of another adapter, driver or wgpu version, and the
//! cache starts empty.

use cubecl_common::hash::StableHasher;
use std::hash::Hasher;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The first bytes of a pipeline-cache file.
const MAGIC: &[u8; 8] = b"UNIFEDPC";
/// Header: magic, then the xxh3-128 of the data, little-endian.
const HEADER: usize = 8 + 16;
/// At a host sync, unsaved pipelines are written once no pipeline was created since the
/// previous sync and the last write is this old (a write is the whole cache).
const SAVE_QUIET: Duration = Duration::from_secs(5);
/// ... or once the oldest of them is this old, even while pipelines are still being created
/// (autotuning compiles for minutes).
const SAVE_AFTER: Duration = Duration::from_secs(60);

/// Every pipeline cache this process opened, for [`save_pipeline_caches`].
static OPENED: Mutex<Vec<Arc<Shared>>> = Mutex::new(Vec::new());

/// What a server and [`save_pipeline_caches`] share of one cache.
#[derive(Debug)]
struct Shared {
    cache: wgpu::PipelineCache,
    path: PathBuf,
    /// Pipelines created with the cache, ever.
    created: AtomicU64,
    /// `created` when the cache was last written; held while writing.
    saved: Mutex<u64>,
}

impl Shared {
    /// Writes the cache if pipelines were created since it was last written. A failed write is
    /// logged; the pipelines are compiled again by the next process.
    fn save(&self) {
        let mut saved = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        let created = self.created.load(Ordering::Relaxed);
        if created == *saved {
            return;
        }
        *saved = created;
        let Some(data) = self.cache.get_data() else {
            return;
        };
        match write_checked(&self.path, &data) {
            Ok(()) => log::info!(
                "pipeline cache {}: {} bytes saved ({created} pipelines created)",
                self.path.display(),
                data.len()
            ),
            Err(e) => log::warn!("pipeline cache {}: not saved: {e}", self.path.display()),
        }
    }
}

/// Writes every pipeline cache this process opened that holds pipelines not yet on disk (a
/// program calls it when it has compiled what it needs, e.g. at the end of a warm-up).
pub fn save_pipeline_caches() {
    let opened: Vec<Arc<Shared>> = OPENED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for c in opened {
        c.save();
    }
}

/// A `wgpu::PipelineCache` loaded from and saved to a file, as one server uses it.
#[derive(Debug)]
pub(crate) struct DiskPipelineCache {
    shared: Arc<Shared>,
    /// `created` at the previous host sync.
    at_last_sync: u64,
    /// When the first pipeline not yet written was seen at a sync.
    unsaved_since: Option<Instant>,
    /// When the cache was last written by a sync.
    last_save: Option<Instant>,
}

impl DiskPipelineCache {
    /// Opens the cache of `device`'s adapter in `root`, or `None` where the device has no
    /// pipeline cache (every backend but Vulkan).
    pub(crate) fn open(device: &wgpu::Device, root: PathBuf) -> Option<Self> {
        if !device.features().contains(wgpu::Features::PIPELINE_CACHE) {
            return None;
        }
        let key = wgpu::util::pipeline_cache_key(&device.adapter_info())?;
        let path = root.join("pipelines").join(format!("{key}.bin"));
        let stored = read_checked(&path);
        // SAFETY: the data is what `get_data` returned to `save` (its checksum matched), and
        // wgpu checks its own header (adapter, driver cache UUID, wgpu version) before handing
        // it to the driver; `fallback` gives an empty cache for data it refuses.
        let cache = unsafe {
            device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                label: Some("unifed pipelines"),
                data: stored.as_deref(),
                fallback: true,
            })
        };
        log::info!(
            "pipeline cache {}: {}",
            path.display(),
            match &stored {
                Some(d) => format!("{} bytes loaded", d.len()),
                None => "empty".to_string(),
            }
        );
        let shared = Arc::new(Shared {
            cache,
            path,
            created: AtomicU64::new(0),
            saved: Mutex::new(0),
        });
        OPENED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(shared.clone());
        Some(DiskPipelineCache {
            shared,
            at_last_sync: 0,
            unsaved_since: None,
            last_save: None,
        })
    }

    /// The cache every pipeline is created with.
    pub(crate) fn cache(&self) -> &wgpu::PipelineCache {
        &self.shared.cache
    }

    /// Counts a pipeline created with the cache.
    pub(crate) fn created(&self) {
        self.shared.created.fetch_add(1, Ordering::Relaxed);
    }

    /// At a host sync: writes the cache when pipelines were created since it was last written,
    /// and either none since the previous sync and the last write is [`SAVE_QUIET`] old, or the
    /// oldest unsaved one is [`SAVE_AFTER`] old.
    pub(crate) fn at_sync(&mut self) {
        let created = self.shared.created.load(Ordering::Relaxed);
        let quiet = created == self.at_last_sync;
        self.at_last_sync = created;
        if created == *self.shared.saved.lock().unwrap_or_else(|e| e.into_inner()) {
            self.unsaved_since = None;
            return;
        }
        let since = *self.unsaved_since.get_or_insert_with(Instant::now);
        let settled = quiet && self.last_save.is_none_or(|t| t.elapsed() >= SAVE_QUIET);
        if settled || since.elapsed() >= SAVE_AFTER {
            self.shared.save();
            self.unsaved_since = None;
            self.last_save = Some(Instant::now());
        }
    }
}

fn checksum(data: &[u8]) -> [u8; 16] {
    let mut h = StableHasher::new();
    h.write(data);
    h.finalize().to_le_bytes()
}

/// The data of the file at `path` if it is one [`write_checked`] wrote whole; `None` (logged)
/// otherwise.
fn read_checked(path: &std::path::Path) -> Option<Vec<u8>> {
    let mut bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!("pipeline cache {}: not read: {e}", path.display());
            return None;
        }
    };
    let sound = bytes.len() >= HEADER
        && &bytes[..8] == MAGIC
        && bytes[8..HEADER] == checksum(&bytes[HEADER..]);
    if !sound {
        log::warn!(
            "pipeline cache {}: not a whole cache file ({} bytes); starting empty",
            path.display(),
            bytes.len()
        );
        return None;
    }
    bytes.drain(..HEADER);
    Some(bytes)
}

/// Writes `data` with its header to a temporary file beside `path`, then renames it over `path`.
fn write_checked(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut bytes = Vec::with_capacity(HEADER + data.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&checksum(data));
    bytes.extend_from_slice(data);
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_file_is_read_back_only_when_whole() {
        let dir = std::env::temp_dir().join(format!("unifed-pc-{}", std::process::id()));
        let path = dir.join("pipelines").join("k.bin");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        write_checked(&path, &data).unwrap();
        assert_eq!(read_checked(&path).as_deref(), Some(&data[..]));
        // Torn, altered, empty or foreign files are not handed on.
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 1]).unwrap();
        assert_eq!(read_checked(&path), None);
        let mut altered = whole.clone();
        altered[HEADER + 10] ^= 1;
        std::fs::write(&path, &altered).unwrap();
        assert_eq!(read_checked(&path), None);
        std::fs::write(&path, b"").unwrap();
        assert_eq!(read_checked(&path), None);
        std::fs::write(&path, &whole[HEADER..]).unwrap();
        assert_eq!(read_checked(&path), None);
        assert_eq!(read_checked(&dir.join("missing.bin")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
