//! How the services' allocator holds memory. glibc's malloc keeps freed blocks of up to 32 MiB
//! for reuse (its threshold grows to the largest block it has freed), which makes training fast
//! and a process that just moved a 57 MB model around 70-100 MiB larger than what it holds.
//! The agent therefore runs [`Allocation::Lean`] and switches to [`Allocation::Fast`] only for
//! training and evaluation ([`with_fast_allocation`]). Everything here is a no-op elsewhere than
//! glibc.

/// How malloc serves large blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Blocks of 256 KiB and more are mapped for each use and unmapped when freed, so a
    /// model's chunks and tensors go back to the system at once instead of fragmenting the
    /// heap. Training this way is about 30 % slower.
    Lean,
    /// For a process that relays chunks (the broker): blocks below 1 MiB (a chunk of 256 KiB)
    /// come from the heap and are reused, larger ones are mapped per use and unmapped when
    /// freed. Under [`Lean`] the broker's page faults on every chunk cost the demo's five-site
    /// round 0.3 s of download; this way they cost nothing, for about 10 MiB more.
    ///
    /// [`Lean`]: Allocation::Lean
    Relay,
    /// Blocks of up to 32 MiB come from the heap and up to 64 MiB of free heap top is kept, so
    /// training's per-step tensors reuse memory instead of faulting in fresh pages (from the
    /// first step on: faster than glibc's default, which grows into this).
    Fast,
}

/// Blocks from this size up are mapped per allocation under [`Allocation::Lean`].
const LEAN_MMAP_THRESHOLD: i32 = 256 << 10;
/// Blocks from this size up are mapped per allocation under [`Allocation::Relay`].
const RELAY_MMAP_THRESHOLD: i32 = 1 << 20;
/// glibc's largest dynamic mmap threshold on 64-bit, fixed from the start under
/// [`Allocation::Fast`].
const FAST_MMAP_THRESHOLD: i32 = 32 << 20;
/// Free heap top kept under [`Allocation::Fast`]: twice the mmap threshold, as glibc's dynamic
/// mode does.
const FAST_TRIM_THRESHOLD: i32 = 64 << 20;

/// Sets how malloc serves large blocks from now on, for the whole process.
#[allow(unsafe_code)]
pub fn set_allocation(mode: Allocation) {
    let (mmap, trim) = match mode {
        Allocation::Lean => (LEAN_MMAP_THRESHOLD, FAST_TRIM_THRESHOLD),
        Allocation::Relay => (RELAY_MMAP_THRESHOLD, FAST_TRIM_THRESHOLD),
        Allocation::Fast => (FAST_MMAP_THRESHOLD, FAST_TRIM_THRESHOLD),
    };
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets malloc's global tuning parameters under the main arena's lock; it
    // is safe to call from any thread at any time, and these values are within glibc's ranges.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (mmap, trim);
}

/// Runs `f` under [`Allocation::Fast`] and returns to [`Allocation::Lean`] afterwards (also when
/// `f` panics): for training and evaluation in a process that otherwise runs lean.
pub fn with_fast_allocation<T>(f: impl FnOnce() -> T) -> T {
    struct Lean;
    impl Drop for Lean {
        fn drop(&mut self) {
            set_allocation(Allocation::Lean);
        }
    }
    set_allocation(Allocation::Fast);
    let _lean = Lean;
    f()
}

/// Hands the pages of freed memory back to the system. glibc's malloc keeps what a process
/// freed (a downloaded model's chunks, a decoded update, a checkpoint's buffers) mapped for
/// reuse, so a process that just handled a 57 MB model stays 100-200 MB above what it holds;
/// the agent and the aggregator call this after each phase of a round. Training's own buffers
/// are untouched (their reuse within a round is what keeps training fast).
#[allow(unsafe_code)]
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of malloc's own arenas to the kernel; it
    // takes each arena's lock and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
