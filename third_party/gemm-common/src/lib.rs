#![cfg_attr(not(feature = "std"), no_std)]

use core::sync::atomic::{AtomicBool, Ordering::Relaxed};

#[cfg(feature = "wasm-simd128-enable")]
pub const DEFAULT_WASM_SIMD128: bool = true;

#[cfg(not(feature = "wasm-simd128-enable"))]
pub const DEFAULT_WASM_SIMD128: bool = false;

static WASM_SIMD128: AtomicBool = AtomicBool::new(DEFAULT_WASM_SIMD128);

#[inline]
pub fn get_wasm_simd128() -> bool {
    WASM_SIMD128.load(Relaxed)
}
#[inline]
pub fn set_wasm_simd128(enable: bool) {
    WASM_SIMD128.store(enable, Relaxed)
}

// UniFed Edge patch: which CPUs take the AVX-512 kernels (see `avx512_kernels`).
#[cfg(all(feature = "std", feature = "x86-v4", any(target_arch = "x86", target_arch = "x86_64")))]
static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// UniFed Edge patch: whether GEMMs run on the AVX-512 kernels (compiled in with `x86-v4`),
/// decided once per process: on an Intel CPU with AVX-512F, unless `UNIFED_CPU_AVX512=on` or
/// `off` says otherwise (measured in `third_party/README.md` of UniFed Edge).
#[cfg(all(feature = "std", feature = "x86-v4", any(target_arch = "x86", target_arch = "x86_64")))]
pub fn avx512_kernels() -> bool {
    *AVX512.get_or_init(|| {
        let wanted = match std::env::var("UNIFED_CPU_AVX512") {
            Ok(v) if v == "on" => true,
            Ok(v) if v == "off" => false,
            Ok(v) if !v.is_empty() => {
                std::eprintln!(
                    "UNIFED_CPU_AVX512 is `{v}`: it takes `on` or `off`; deciding by the CPU"
                );
                intel()
            }
            _ => intel(),
        };
        wanted && std::arch::is_x86_feature_detected!("avx512f")
    })
}

/// UniFed Edge patch: without `std`, without the `x86-v4` kernels compiled in, or off x86,
/// never.
#[cfg(not(all(feature = "std", feature = "x86-v4", any(target_arch = "x86", target_arch = "x86_64"))))]
pub fn avx512_kernels() -> bool {
    false
}

/// UniFed Edge patch: whether the CPU's vendor string (CPUID leaf 0) is `GenuineIntel`.
#[cfg(all(feature = "std", feature = "x86-v4", any(target_arch = "x86", target_arch = "x86_64")))]
#[allow(unused_unsafe)]
fn intel() -> bool {
    #[cfg(target_arch = "x86")]
    use core::arch::x86::__cpuid;
    #[cfg(target_arch = "x86_64")]
    use core::arch::x86_64::__cpuid;
    // SAFETY: CPUID leaf 0 (the vendor string) exists on every x86-64 CPU.
    let leaf = unsafe { __cpuid(0) };
    let mut vendor = [0u8; 12];
    vendor[..4].copy_from_slice(&leaf.ebx.to_le_bytes());
    vendor[4..8].copy_from_slice(&leaf.edx.to_le_bytes());
    vendor[8..].copy_from_slice(&leaf.ecx.to_le_bytes());
    &vendor == b"GenuineIntel"
}

extern crate alloc;

pub mod cache;

pub mod gemm;
pub mod gemv;
pub mod gevv;

pub mod horizontal_microkernel;
pub mod microkernel;

pub mod pack_operands;
pub mod simd;

pub use pulp;

#[derive(Copy, Clone, Debug)]
pub enum Parallelism {
    None,
    #[cfg(feature = "rayon")]
    Rayon(usize),
}

pub struct Ptr<T: ?Sized>(pub *mut T);

impl<T: ?Sized> Clone for Ptr<T> {
    #[inline]
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for Ptr<T> {}

unsafe impl<T: ?Sized> Send for Ptr<T> {}
unsafe impl<T: ?Sized> Sync for Ptr<T> {}

impl<T> Ptr<T> {
    #[inline(always)]
    pub fn wrapping_offset(self, offset: isize) -> Self {
        Ptr::<T>(self.0.wrapping_offset(offset))
    }
    #[inline(always)]
    pub fn wrapping_add(self, offset: usize) -> Self {
        Ptr::<T>(self.0.wrapping_add(offset))
    }
}

#[cfg(not(feature = "std"))]
#[macro_export]
macro_rules! feature_detected {
    ($tt: tt) => {
        cfg!(feature = $tt)
    };
}

#[cfg(all(feature = "std", any(target_arch = "x86", target_arch = "x86_64")))]
#[macro_export]
macro_rules! feature_detected {
    ($tt: tt) => {
        ::std::arch::is_x86_feature_detected!($tt)
    };
}
#[cfg(all(feature = "std", target_arch = "aarch64"))]
#[macro_export]
macro_rules! feature_detected {
    ($tt: tt) => {
        ::std::arch::is_aarch64_feature_detected!($tt)
    };
}
#[cfg(all(feature = "std", target_family = "wasm"))]
#[macro_export]
macro_rules! feature_detected {
    ("simd128") => {
        $crate::get_wasm_simd128()
    };
}
