//! How the services' allocator holds memory. glibc's malloc keeps freed blocks of up to 32 MiB
//! for reuse (its threshold grows to the largest block it has freed), which makes training fast
//! and a process that just moved a 57 MB model around 70-100 MiB larger than what it holds.
//! The agent therefore runs [`Allocation::Lean`] and switches to [`Allocation::Fast`] only for
//! training and evaluation ([`with_fast_allocation`]). Everything here is a no-op elsewhere than
//! glibc.

/// How malloc serves large blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Blocks of 128 KiB and more are mapped for each use and unmapped when freed, so a
    /// model's chunks (just under 256 KiB) and tensors go back to the system at once instead
    /// of fragmenting the heap. Training this way is about 30 % slower.
    Lean,
    /// For a process that relays chunks (the broker): blocks below 1 MiB (a chunk of 255 KiB)
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
const LEAN_MMAP_THRESHOLD: i32 = 128 << 10;
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

/// Makes every thread allocate from malloc's main arena. glibc otherwise gives threads arenas of
/// their own (up to eight per core), each keeping its own free blocks and up to 64 MiB of free
/// top, so a process holds more than it uses: the demo's agents peaked at 191-202 MiB with an
/// arena per thread and at 182-196 with one (3-round runs), training as fast. Call it first in
/// `main`, before any thread starts (an arena made earlier stays).
#[allow(unsafe_code)]
pub fn use_one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: as in `set_allocation`: mallopt with a value in glibc's range.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
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
/// are untouched (their reuse within a round is what keeps training fast). The spare mapping
/// [`HugeBlocks`] keeps of its last freed block goes back too.
#[allow(unsafe_code)]
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of malloc's own arenas to the kernel; it
    // takes each arena's lock and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
    #[cfg(target_os = "linux")]
    huge::release_spare();
}

/// The global allocator of the project's binaries: glibc's malloc for every block but the
/// largest, which it maps itself with transparent huge pages. A block of 32 MiB and more (a
/// 57 MB model's bytes, the digits CNN's 51 MB `fc1` weight and its gradient in every training
/// step) is mapped per use by malloc in any mode; in 4 KiB pages each use faults in some 13,000
/// of them, and training and matrix products walk it through as many TLB entries. In 2 MiB
/// pages it is 26 faults, and training on the CPU is about 8 % faster. The last block freed
/// keeps its mapping as a spare for the next block it can hold, until [`release_free_memory`];
/// every other goes back to the system when freed. Elsewhere than Linux everything goes to the
/// system's allocator.
///
/// Install it with `#[global_allocator] static A: unifed_net::memory::HugeBlocks =
/// unifed_net::memory::HugeBlocks;`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HugeBlocks;

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod huge {
    use std::alloc::{GlobalAlloc, Layout, System};

    /// Blocks from this size up are mapped here (malloc maps them anyway: it is glibc's
    /// largest mmap threshold).
    const HUGE_BLOCK: usize = 32 << 20;
    /// The transparent huge page: a mapping's length is a multiple of it, so the kernel places
    /// it on a huge page boundary.
    const HUGE_PAGE: usize = 2 << 20;
    /// The alignment a mapping has at least.
    const PAGE: usize = 4096;

    /// Whether a block of `layout` is mapped here: decided by the layout alone, so `dealloc`
    /// and `realloc` know where a block came from.
    fn mapped(layout: Layout) -> bool {
        layout.size() >= HUGE_BLOCK && layout.align() <= PAGE
    }

    /// The length of the mapping that holds `size` bytes.
    fn mapping_len(size: usize) -> Option<usize> {
        size.checked_next_multiple_of(HUGE_PAGE)
    }

    /// The last mapping freed (address and length), kept whole for the next block it can hold
    /// instead of being unmapped, until [`release_spare`]: its pages are still the process's,
    /// touched moments ago. On a VM that hands free memory back to its host (`virtio_balloon`'s
    /// free page reporting), a fresh 57 MB block took 80-150 ms of page faults to fill, against
    /// 5 ms for pages freed moments before: the agent's downloaded model fills the mapping its
    /// delivered update just left, and its update the one training just left.
    static SPARE: std::sync::Mutex<Option<(usize, usize)>> = std::sync::Mutex::new(None);

    /// Unmaps the mapping at `addr` of `len` bytes.
    fn unmap(addr: usize, len: usize) {
        // SAFETY: `addr..addr+len` is a whole mapping from `map` (or the spare's), which nobody
        // uses any more.
        unsafe { libc::munmap(addr as *mut libc::c_void, len) };
    }

    /// The spare mapping cut to `len` bytes, if it holds that many; the spare is unmapped if it
    /// holds fewer.
    fn take_spare(len: usize) -> Option<*mut u8> {
        let (addr, have) = SPARE.lock().ok()?.take()?;
        if have < len {
            unmap(addr, have);
            return None;
        }
        if have > len {
            // The tail goes back: the block is the mapping `dealloc` unmaps.
            unmap(addr + len, have - len);
        }
        Some(addr as *mut u8)
    }

    /// Keeps the freed mapping at `addr` of `len` bytes as the spare (the older spare is
    /// unmapped: the newer one's pages are the more recently touched).
    fn keep_spare(addr: usize, len: usize) {
        let older = match SPARE.lock() {
            Ok(mut s) => s.replace((addr, len)),
            Err(_) => Some((addr, len)),
        };
        if let Some((a, l)) = older {
            unmap(a, l);
        }
    }

    /// Unmaps the spare mapping, if any ([`super::release_free_memory`]).
    pub(super) fn release_spare() {
        let spare = SPARE.lock().ok().and_then(|mut s| s.take());
        if let Some((a, l)) = spare {
            unmap(a, l);
        }
    }

    /// A block of `size` bytes: the spare mapping if it holds them, else a new mapping (zeroed,
    /// as every fresh mapping is; `zeroed` says whether a spare must be cleared). Null if the
    /// system refuses.
    fn block(size: usize, zeroed: bool) -> *mut u8 {
        let Some(len) = mapping_len(size) else {
            return std::ptr::null_mut();
        };
        match take_spare(len) {
            Some(p) => {
                if zeroed {
                    // SAFETY: `p` is a mapping of at least `size` bytes that nobody else uses.
                    unsafe { std::ptr::write_bytes(p, 0, size) };
                }
                p
            }
            None => map(len),
        }
    }

    /// A new mapping of `len` bytes (zeroed, as every fresh mapping is) that asks for huge
    /// pages; null if the system refuses.
    fn map(len: usize) -> *mut u8 {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no memory of ours.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        // SAFETY: `p..p+len` is the mapping just made. Huge pages are a hint: where the
        // kernel has them turned off the call fails or does nothing, and the block works in
        // small pages.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        p.cast()
    }

    // SAFETY: blocks the layout says are mapped come from `block` (a new mapping, or the spare
    // cut to length) and go back whole, as the spare or with `munmap`, at the same length
    // (`mapping_len` of the layout's size, which `GlobalAlloc`'s contract makes the size it was
    // allocated with); the spare is one mapping that no block uses, guarded by its mutex;
    // every other call is `System`'s, unchanged.
    unsafe impl GlobalAlloc for super::HugeBlocks {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if mapped(layout) {
                block(layout.size(), false)
            } else {
                // SAFETY: the caller's contract is `System::alloc`'s.
                unsafe { System.alloc(layout) }
            }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            if mapped(layout) {
                block(layout.size(), true)
            } else {
                // SAFETY: the caller's contract is `System::alloc_zeroed`'s.
                unsafe { System.alloc_zeroed(layout) }
            }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            if mapped(layout) {
                let len = mapping_len(layout.size()).expect("mapped with this length");
                // `ptr` is a mapping of `len` bytes from `block` (the layout it was allocated
                // with says so), which nothing uses after `dealloc`.
                keep_spare(ptr as usize, len);
            } else {
                // SAFETY: the caller's contract is `System::dealloc`'s.
                unsafe { System.dealloc(ptr, layout) }
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: `GlobalAlloc::realloc`'s contract: `new_size`, rounded to the alignment,
            // does not overflow.
            let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
            match (mapped(layout), mapped(new)) {
                // SAFETY: the caller's contract is `System::realloc`'s.
                (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
                (true, true) => {
                    let (Some(old_len), Some(new_len)) =
                        (mapping_len(layout.size()), mapping_len(new_size))
                    else {
                        return std::ptr::null_mut();
                    };
                    if old_len == new_len {
                        return ptr;
                    }
                    // SAFETY: `ptr` is a mapping of `old_len` bytes from `map`; the kernel
                    // moves or resizes it whole (keeping its huge page advice), and on failure
                    // leaves it as it was, which the caller keeps owning.
                    let p =
                        unsafe { libc::mremap(ptr.cast(), old_len, new_len, libc::MREMAP_MAYMOVE) };
                    if p == libc::MAP_FAILED {
                        std::ptr::null_mut()
                    } else {
                        p.cast()
                    }
                }
                _ => {
                    // From one side of the threshold to the other: a new block, the bytes
                    // both hold, and the old block freed.
                    // SAFETY: `new` is a valid non-zero layout (its size is the caller's
                    // non-zero `new_size`).
                    let p = unsafe { self.alloc(new) };
                    if !p.is_null() {
                        // SAFETY: both blocks are live and hold at least the smaller size;
                        // they are distinct allocations.
                        unsafe {
                            std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                            self.dealloc(ptr, layout);
                        }
                    }
                    p
                }
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
#[allow(unsafe_code)]
// SAFETY: every call is forwarded to `System` unchanged.
unsafe impl std::alloc::GlobalAlloc for HugeBlocks {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System::alloc`'s.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract is `System::dealloc`'s.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::{HugeBlocks, MappedFile};
    use std::alloc::{GlobalAlloc, Layout};

    const MIB: usize = 1 << 20;

    /// Tests that map blocks take turns: the spare mapping is the process's.
    static MAPPING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn mapping_turn() -> std::sync::MutexGuard<'static, ()> {
        MAPPING.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A mapped file reads as its bytes (a prefix when asked for one, nothing for 0), keeps
    /// them after the file is renamed and appended to, and a length past the file's end is
    /// refused rather than mapped.
    #[test]
    fn a_mapped_file_reads_as_its_bytes_and_a_length_past_its_end_is_refused() {
        let dir = std::env::temp_dir().join(format!("unifed-net-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a");
        let bytes: Vec<u8> = (0..3 * MIB + 5).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &bytes).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let m = MappedFile::map(&f, bytes.len()).unwrap();
        assert_eq!(&m[..], &bytes[..]);
        assert_eq!(&MappedFile::map(&f, 10).unwrap()[..], &bytes[..10]);
        assert!(MappedFile::map(&f, 0).unwrap().is_empty());
        let err = MappedFile::map(&f, bytes.len() + 1).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
        let q = dir.join("b");
        std::fs::rename(&p, &q).unwrap();
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(&q)
            .unwrap()
            .write_all(b"footer")
            .unwrap();
        assert_eq!(&m[..], &bytes[..]);
        drop(m);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Reads `n` bytes at `p`.
    ///
    /// # Safety
    /// `p` must be a live block of at least `n` bytes.
    unsafe fn bytes<'a>(p: *mut u8, n: usize) -> &'a mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p, n) }
    }

    /// Blocks on both sides of the mapping threshold keep their bytes through every kind of
    /// resize (small to small, small to mapped, mapped to mapped larger and smaller, mapped
    /// to small), and a zeroed block of either kind reads as zeros.
    #[test]
    fn blocks_keep_their_bytes_across_the_mapping_threshold() {
        let _turn = mapping_turn();
        let layout = |n| Layout::from_size_align(n, 16).unwrap();
        // SAFETY: sizes are non-zero; each pointer is used within its size and freed once
        // with the layout it has.
        unsafe {
            for n in [100, 40 * MIB] {
                let z = HugeBlocks.alloc_zeroed(layout(n));
                assert!(!z.is_null());
                assert!(bytes(z, n).iter().all(|&b| b == 0), "{n} bytes zeroed");
                HugeBlocks.dealloc(z, layout(n));
            }
            let mut p = HugeBlocks.alloc(layout(1000));
            let fill = |p: *mut u8, n: usize| {
                for (i, b) in bytes(p, n).iter_mut().enumerate() {
                    *b = (i % 251) as u8;
                }
            };
            fill(p, 1000);
            let mut kept = 1000;
            for (from, to) in [
                (1000, 4000),
                (4000, 33 * MIB),
                (33 * MIB, 70 * MIB),
                (70 * MIB, 35 * MIB),
                (35 * MIB, 5000),
            ] {
                p = HugeBlocks.realloc(p, layout(from), to);
                assert!(!p.is_null(), "{from} -> {to}");
                let b = bytes(p, kept.min(to));
                assert!(
                    b.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8),
                    "{from} -> {to}"
                );
                fill(p, to);
                kept = to;
            }
            HugeBlocks.dealloc(p, layout(5000));
        }
    }

    /// A freed mapped block is kept whole as the spare and is the next block it can hold, cut
    /// to its length, with its bytes as they were (cleared when asked for zeroed); a block it
    /// cannot hold, or one after `release_free_memory`, is a fresh mapping.
    #[test]
    fn a_freed_block_serves_the_next_that_fits_until_free_memory_is_released() {
        let _turn = mapping_turn();
        let layout = |n| Layout::from_size_align(n, 8).unwrap();
        super::release_free_memory();
        // SAFETY: sizes are non-zero; each pointer is used within its size and freed once
        // with the layout it has.
        unsafe {
            let a = HugeBlocks.alloc(layout(50 * MIB));
            bytes(a, 50 * MIB).fill(7);
            HugeBlocks.dealloc(a, layout(50 * MIB));
            let b = HugeBlocks.alloc(layout(40 * MIB));
            assert_eq!(b, a);
            assert!(bytes(b, 40 * MIB).iter().all(|&x| x == 7));
            HugeBlocks.dealloc(b, layout(40 * MIB));
            let z = HugeBlocks.alloc_zeroed(layout(40 * MIB));
            assert_eq!(z, a);
            assert!(bytes(z, 40 * MIB).iter().all(|&x| x == 0));
            bytes(z, 40 * MIB).fill(9);
            HugeBlocks.dealloc(z, layout(40 * MIB));
            // Too small for 60 MiB: a fresh mapping, which reads as zeros.
            let big = HugeBlocks.alloc(layout(60 * MIB));
            assert!(bytes(big, 60 * MIB).iter().all(|&x| x == 0));
            bytes(big, 60 * MIB).fill(5);
            HugeBlocks.dealloc(big, layout(60 * MIB));
            super::release_free_memory();
            let fresh = HugeBlocks.alloc(layout(40 * MIB));
            assert!(bytes(fresh, 40 * MIB).iter().all(|&x| x == 0));
            HugeBlocks.dealloc(fresh, layout(40 * MIB));
        }
        super::release_free_memory();
    }

    /// A block of 32 MiB and more over-aligned beyond a page goes to the system allocator,
    /// which honours its alignment.
    #[test]
    fn an_over_aligned_large_block_is_aligned() {
        let layout = Layout::from_size_align(32 * MIB, 1 << 16).unwrap();
        // SAFETY: the layout is non-zero; the block is freed once with it.
        unsafe {
            let p = HugeBlocks.alloc(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % (1 << 16), 0);
            bytes(p, 32 * MIB)[32 * MIB - 1] = 7;
            HugeBlocks.dealloc(p, layout);
        }
    }

    /// A mapped block is marked for transparent huge pages (`hg` in its mapping's flags), on a
    /// kernel that has them.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_block_asks_for_huge_pages() {
        let _turn = mapping_turn();
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("this kernel has no transparent huge pages: nothing to check");
            return;
        }
        let layout = Layout::from_size_align(40 * MIB, 8).unwrap();
        // SAFETY: the layout is non-zero; the block is freed once with it.
        let p = unsafe { HugeBlocks.alloc(layout) } as usize;
        assert_ne!(p, 0);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        // The mapping holding the block: its header line, then its fields up to `VmFlags`.
        let flags = smaps
            .lines()
            .skip_while(|l| {
                let range = l.split(' ').next().unwrap_or("");
                let Some((a, b)) = range.split_once('-') else {
                    return true;
                };
                let (a, b) = (
                    usize::from_str_radix(a, 16).unwrap_or(usize::MAX),
                    usize::from_str_radix(b, 16).unwrap_or(0),
                );
                !(a <= p && p < b)
            })
            .find(|l| l.starts_with("VmFlags:"))
            .expect("the block's mapping is in smaps")
            .to_string();
        // SAFETY: as above.
        unsafe { HugeBlocks.dealloc(p as *mut u8, layout) };
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
    }
}

/// A file's bytes mapped read-only into memory: the page cache's pages themselves, neither
/// copied nor zeroed first. Reading a 57 MB update this way instead of into a fresh buffer
/// saves faulting in and zeroing 57 MB of new memory and one copy of it.
///
/// Only for files of the process's own (its data directory), which no one truncates or writes
/// while they are mapped: a file cut short under a mapping makes reading past its new end
/// raise SIGBUS. Appending to the file is harmless (the mapping keeps its length).
#[derive(Debug)]
pub struct MappedFile {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value alone; nothing aliases it mutably.
#[allow(unsafe_code)]
unsafe impl Send for MappedFile {}
// SAFETY: as above: shared references only read.
#[allow(unsafe_code)]
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Maps the first `len` bytes of `file`, which must hold at least that many.
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    pub fn map(file: &std::fs::File, len: usize) -> std::io::Result<MappedFile> {
        use std::os::fd::AsRawFd;
        if (file.metadata()?.len() as u128) < len as u128 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file is shorter than the length to map",
            ));
        }
        if len == 0 {
            return Ok(MappedFile {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
            });
        }
        // SAFETY: a private read-only mapping of an open file at an address of the kernel's
        // choosing; the caller keeps the file from being cut short while it is mapped (see the
        // type's documentation). MAP_POPULATE maps the cached pages now, in one call, rather
        // than on a fault per page.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(MappedFile { ptr: p.cast(), len })
    }

    /// Reads the first `len` bytes of `file` into memory where files cannot be mapped here.
    #[cfg(not(target_os = "linux"))]
    pub fn map(file: &std::fs::File, len: usize) -> std::io::Result<MappedFile> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len].into_boxed_slice();
        file.read_exact_at(&mut b, 0)?;
        let b = Box::leak(b);
        Ok(MappedFile {
            ptr: b.as_ptr(),
            len,
        })
    }
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];

    #[allow(unsafe_code)]
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is mapped readable for as long as `self` lives (or is a
        // dangling, aligned pointer with `len` 0).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for MappedFile {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if self.len > 0 {
            // SAFETY: the mapping made in `map`, of this length, unmapped once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
        #[cfg(not(target_os = "linux"))]
        // SAFETY: the box leaked in `map`, of this length, taken back once.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr as *mut u8,
                self.len,
            ))
        });
    }
}
