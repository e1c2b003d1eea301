//! Backend selection: which burn device runs the model, and a thread cap for the CPU backend.

pub use burn::tensor::Device;
use std::fmt;
use std::str::FromStr;

/// A compute backend compiled into this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// burn-flex, the portable CPU backend.
    Flex,
    /// wgpu on whichever graphics API the platform offers (Vulkan, Metal, DX12, WebGPU).
    Wgpu,
    /// wgpu pinned to Vulkan.
    Vulkan,
    /// CUDA device 0.
    Cuda,
}

impl Backend {
    /// Every backend compiled into this build, CPU first.
    pub fn compiled() -> Vec<Backend> {
        let mut v = Vec::new();
        if cfg!(feature = "flex") {
            v.push(Backend::Flex);
        }
        if cfg!(feature = "wgpu") {
            v.push(Backend::Wgpu);
        }
        if cfg!(feature = "vulkan") {
            v.push(Backend::Vulkan);
        }
        if cfg!(feature = "cuda") {
            v.push(Backend::Cuda);
        }
        v
    }

    /// The plain (non-autodiff) device of this backend, or an error naming the cargo feature
    /// that would compile it in.
    pub fn device(self) -> Result<Device, BackendError> {
        match self {
            #[cfg(feature = "flex")]
            Backend::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => wgpu_device(self, burn::tensor::wgpu::WgpuBackend::Auto),
            #[cfg(feature = "vulkan")]
            Backend::Vulkan => wgpu_device(self, burn::tensor::wgpu::WgpuBackend::Vulkan),
            #[cfg(feature = "cuda")]
            Backend::Cuda => Ok(Device::cuda(0usize)),
            #[allow(unreachable_patterns)]
            other => other
                .ensure_compiled()
                .and_then(|()| Err(BackendError::NoDevice(other))),
        }
    }

    /// Whether this backend runs on a GPU through cubecl (wgpu, Vulkan, CUDA).
    pub fn is_gpu(self) -> bool {
        !matches!(self, Backend::Flex)
    }

    /// `Ok` if this backend is compiled into this build, else an error naming the cargo
    /// feature that would compile it in.
    pub fn ensure_compiled(self) -> Result<(), BackendError> {
        if Backend::compiled().contains(&self) {
            return Ok(());
        }
        Err(BackendError::NotCompiled(self))
    }
}

/// Why a backend cannot be named or used: an unknown name, a backend not compiled into this
/// build, or a GPU backend without a usable GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The name is none of `flex` (or `cpu`), `wgpu`, `vulkan` and `cuda`.
    #[error("unknown backend `{0}`: expected flex, wgpu, vulkan or cuda")]
    Unknown(String),
    /// The backend's cargo feature is not compiled into this build.
    #[error(
        "backend `{0}` is not compiled in; rebuild with `--features {0}` (compiled: {compiled})",
        compiled = compiled_names()
    )]
    NotCompiled(Backend),
    /// The backend is compiled in but this build makes no device of it.
    #[error("backend `{0}` has no device in this build")]
    NoDevice(Backend),
    /// A GPU backend found no usable GPU (no adapter, or no driver).
    #[error(
        "backend `{backend}`: no usable GPU ({reason}); is a GPU driver and its Vulkan loader \
         (libvulkan1) installed?"
    )]
    NoGpu {
        /// The backend.
        backend: Backend,
        /// What the GPU runtime reported.
        reason: String,
    },
}

impl From<BackendError> for String {
    fn from(e: BackendError) -> String {
        e.to_string()
    }
}

/// The names of the backends compiled into this build, separated by commas.
fn compiled_names() -> String {
    Backend::compiled()
        .iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The wgpu device of `backend` on graphics API `api`, acquired now rather than at the first
/// tensor operation (where burn panics on a machine without a usable GPU): a missing adapter or
/// driver is an error naming the backend. The outcome is kept, so the runtime is set up once.
#[cfg(any(feature = "wgpu", feature = "vulkan"))]
fn wgpu_device(
    backend: Backend,
    api: burn::tensor::wgpu::WgpuBackend,
) -> Result<Device, BackendError> {
    use std::sync::OnceLock;
    static AUTO: OnceLock<Result<Device, BackendError>> = OnceLock::new();
    static PINNED: OnceLock<Result<Device, BackendError>> = OnceLock::new();
    let once = match api {
        burn::tensor::wgpu::WgpuBackend::Auto => &AUTO,
        _ => &PINNED,
    };
    once.get_or_init(|| {
        Device::wgpu_options()
            .graphics_api(api)
            .init()
            .map_err(|e| BackendError::NoGpu {
                backend,
                reason: e.to_string(),
            })
    })
    .clone()
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Flex => "flex",
            Backend::Wgpu => "wgpu",
            Backend::Vulkan => "vulkan",
            Backend::Cuda => "cuda",
        })
    }
}

impl FromStr for Backend {
    type Err = BackendError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "flex" | "cpu" => Ok(Backend::Flex),
            "wgpu" => Ok(Backend::Wgpu),
            "vulkan" => Ok(Backend::Vulkan),
            "cuda" => Ok(Backend::Cuda),
            _ => Err(BackendError::Unknown(s.into())),
        }
    }
}

/// Caps the CPU backend's worker threads (the rayon global pool burn-flex runs on).
///
/// Call it once, before the first tensor operation; a later call cannot shrink a pool that
/// already runs and returns an error saying so.
pub fn cap_cpu_threads(threads: usize) -> Result<(), ThreadCapError> {
    if threads == 0 {
        return Err(ThreadCapError::Zero);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|error| ThreadCapError::Build { threads, error })
}

/// Why [`cap_cpu_threads`] cannot cap the CPU backend's threads.
#[derive(Debug, thiserror::Error)]
pub enum ThreadCapError {
    /// A cap of zero threads was asked for.
    #[error("thread cap must be at least 1")]
    Zero,
    /// rayon refused to build the capped pool (most often: the global pool already runs).
    #[error("cannot cap CPU threads at {threads}: {error}")]
    Build {
        /// The cap asked for.
        threads: usize,
        /// rayon's reason.
        error: rayon::ThreadPoolBuildError,
    },
}

impl From<ThreadCapError> for String {
    fn from(e: ThreadCapError) -> String {
        e.to_string()
    }
}

/// Writes the wgpu backend's compiled pipelines into the kernel cache now, where it holds
/// pipelines not yet there (it also writes them by itself a few seconds after it compiles). A
/// program calls it once it has run what it needs, as `warmup` does before it exits; nothing
/// happens in other builds.
pub fn save_compiled_kernels() {
    #[cfg(any(feature = "wgpu", feature = "vulkan"))]
    cubecl_wgpu::save_pipeline_caches();
}

/// Whether a GPU backend keeps its compiled kernels, from `UNIFED_KERNEL_COMPILE_CACHE` (unset:
/// on).
#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
fn compile_cache_on(var: Option<&str>) -> Result<bool, KernelCacheError> {
    match var {
        None | Some("on") => Ok(true),
        Some("off") => Ok(false),
        Some(other) => Err(KernelCacheError::CompileCacheSwitch(other.into())),
    }
}

/// Why [`use_kernel_cache`] cannot keep the GPU kernels in the folder asked for.
#[derive(Debug, thiserror::Error)]
pub enum KernelCacheError {
    /// `UNIFED_KERNEL_COMPILE_CACHE` is neither `on` nor `off`.
    #[error("UNIFED_KERNEL_COMPILE_CACHE is `{0}`: it takes `on` or `off`")]
    CompileCacheSwitch(String),
    /// The cache folder cannot be created.
    #[error("kernel cache {}: {error}", dir.display())]
    CreateDir {
        /// The folder.
        dir: std::path::PathBuf,
        /// Why it cannot be created.
        error: std::io::Error,
    },
    /// This process already keeps its kernels in another folder.
    #[error(
        "kernel cache {}: this process already keeps its kernels in {}",
        dir.display(),
        set.display()
    )]
    OtherDir {
        /// The folder asked for.
        dir: std::path::PathBuf,
        /// The folder already in use.
        set: std::path::PathBuf,
    },
    /// The GPU runtime read its settings before the cache was set.
    #[error(
        "kernel cache {}: the GPU runtime's settings were already read; set the cache before \
         the first GPU operation",
        dir.display()
    )]
    SettingsRead {
        /// The folder asked for.
        dir: std::path::PathBuf,
    },
}

impl From<KernelCacheError> for String {
    fn from(e: KernelCacheError) -> String {
        e.to_string()
    }
}

/// Whether the CPU backend's f32 matrix products run on AVX-512 kernels in this process: on an
/// Intel CPU with AVX-512F, unless `UNIFED_CPU_AVX512=off` (`on` takes them on any CPU that has
/// the instructions).
pub fn cpu_avx512() -> bool {
    #[cfg(feature = "flex")]
    {
        gemm_common::avx512_kernels()
    }
    #[cfg(not(feature = "flex"))]
    {
        false
    }
}

/// Number of worker threads the CPU backend uses now.
pub fn cpu_threads() -> usize {
    rayon::current_num_threads()
}

/// Keeps the GPU backends' autotune results and compiled kernels in `dir` (created if missing),
/// so that only the first start of a device pays for tuning and compiling; a site passes a
/// folder of its state directory. Call it before the first GPU tensor operation. Returns
/// `Ok(false)` in a build without a GPU backend, where there is nothing to cache.
///
/// Settings a `cubecl.toml` or `CUBECL_*` variables give are kept; only the cache's place is
/// set here (cubecl's default is the user cache directory, or a temporary folder for a service
/// without a home).
pub fn use_kernel_cache(dir: &std::path::Path) -> Result<bool, KernelCacheError> {
    #[cfg(feature = "gpu")]
    {
        use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
        std::fs::create_dir_all(dir).map_err(|error| KernelCacheError::CreateDir {
            dir: dir.into(),
            error,
        })?;
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        config.environment.path = CacheConfig::Directory(dir.to_path_buf());
        // Compiled kernels too: the SPIR-V cubecl makes of each kernel, and (a patch of ours,
        // `third_party/cubecl-wgpu`) the driver's pipelines, which a driver without a disk cache
        // of its own otherwise compiles again at every start. Off in cubecl by default;
        // `UNIFED_KERNEL_COMPILE_CACHE=off` keeps it off (tuning results are kept either way).
        config.compilation.cache =
            compile_cache_on(std::env::var("UNIFED_KERNEL_COMPILE_CACHE").ok().as_deref())?;
        if CubeClRuntimeConfig::try_set(config) {
            return Ok(true);
        }
        match &CubeClRuntimeConfig::get().environment.path {
            CacheConfig::Directory(set) if set == dir => Ok(true),
            CacheConfig::Directory(set) => Err(KernelCacheError::OtherDir {
                dir: dir.into(),
                set: set.clone(),
            }),
            _ => Err(KernelCacheError::SettingsRead { dir: dir.into() }),
        }
    }
    #[cfg(not(feature = "gpu"))]
    {
        let _ = dir;
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compile_cache_switch_takes_on_or_off_and_names_anything_else() {
        assert!(matches!(compile_cache_on(None), Ok(true)));
        assert!(matches!(compile_cache_on(Some("on")), Ok(true)));
        assert!(matches!(compile_cache_on(Some("off")), Ok(false)));
        let e = compile_cache_on(Some("0")).unwrap_err();
        assert!(
            matches!(&e, KernelCacheError::CompileCacheSwitch(v) if v == "0"),
            "{e}"
        );
        let e = String::from(e);
        assert!(
            e.contains("UNIFED_KERNEL_COMPILE_CACHE") && e.contains("`0`"),
            "{e}"
        );
    }

    #[test]
    fn backends_parse_by_name_and_an_unknown_one_is_named() {
        assert_eq!("CPU".parse::<Backend>(), Ok(Backend::Flex));
        assert_eq!("vulkan".parse::<Backend>(), Ok(Backend::Vulkan));
        let e = "tpu".parse::<Backend>().unwrap_err();
        assert!(matches!(&e, BackendError::Unknown(n) if n == "tpu"));
        assert_eq!(
            e.to_string(),
            "unknown backend `tpu`: expected flex, wgpu, vulkan or cuda"
        );
    }

    #[test]
    fn a_backend_not_compiled_in_says_which_feature_compiles_it() {
        let Some(missing) = [Backend::Wgpu, Backend::Vulkan, Backend::Cuda]
            .into_iter()
            .find(|b| !Backend::compiled().contains(b))
        else {
            return;
        };
        assert_eq!(
            missing.ensure_compiled(),
            Err(BackendError::NotCompiled(missing))
        );
        let e = missing.device().unwrap_err();
        assert!(matches!(e, BackendError::NotCompiled(b) if b == missing));
        assert!(
            e.to_string()
                .contains(&format!("rebuild with `--features {missing}`")),
            "{e}"
        );
    }

    #[test]
    fn a_cap_of_zero_threads_is_refused() {
        assert!(matches!(cap_cpu_threads(0), Err(ThreadCapError::Zero)));
    }
}
