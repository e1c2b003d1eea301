//! A counting allocator: the bytes the process has allocated and not freed, and their peak
//! since the last [`reset_peak`]. It wraps the project's allocator
//! ([`unifed_net::memory::HugeBlocks`], what `unifed-sim` installs as its global allocator), so heap use can be measured exactly where resident memory cannot
//! tell one part of a process from another. (A global allocator is unsafe code by nature; this
//! module allows it for measurement, as `unifed_net::memory` does for `mallopt`.)
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use unifed_net::memory::HugeBlocks;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The project's allocator, counting.
pub struct Counting;

fn grew(n: usize) {
    let live = LIVE.fetch_add(n, Relaxed) + n;
    PEAK.fetch_max(live, Relaxed);
}

// SAFETY: every call is forwarded to `HugeBlocks` unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `HugeBlocks::alloc`'s.
        let p = unsafe { HugeBlocks.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `HugeBlocks::alloc_zeroed`'s.
        let p = unsafe { HugeBlocks.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `HugeBlocks::dealloc`'s.
        unsafe { HugeBlocks.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is `HugeBlocks::realloc`'s.
        let p = unsafe { HugeBlocks.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

/// Bytes allocated and not yet freed (0 where [`Counting`] is not the global allocator).
pub fn live() -> usize {
    LIVE.load(Relaxed)
}

/// The most bytes live at once since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Relaxed)
}

/// Starts a new peak from what is live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary's global allocator is the system's: only the calls made here count.
    #[test]
    fn live_and_peak_follow_allocations_growth_and_frees() {
        let layout = |n| Layout::from_size_align(n, 8).unwrap();
        reset_peak();
        let before = live();
        // SAFETY: sizes are non-zero; each pointer is freed once with the layout it has.
        unsafe {
            let a = Counting.alloc(layout(1000));
            let b = Counting.alloc_zeroed(layout(500));
            assert_eq!(live() - before, 1500);
            let a = Counting.realloc(a, layout(1000), 4000);
            assert_eq!(live() - before, 4500);
            let a = Counting.realloc(a, layout(4000), 100);
            assert_eq!(live() - before, 600);
            assert_eq!(peak() - before, 4500);
            Counting.dealloc(a, layout(100));
            Counting.dealloc(b, layout(500));
        }
        assert_eq!(live(), before);
        reset_peak();
        assert_eq!(peak(), before);
    }
}
