//! A bound on log lines: each place in the code that logs may write a burst of lines per
//! window, and past it its lines are counted instead of written, with one line saying how
//! many were dropped. A flood of junk from the network then costs a few lines a window, not
//! one line per message, whatever topics or site names the junk carries (the count is kept
//! per place in the code, of which there is a fixed number).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// Lines one place may write per [`WINDOW`] before the rest are counted instead.
pub const BURST: u32 = 20;

/// The window [`BURST`] is counted over.
pub const WINDOW: Duration = Duration::from_secs(10);

/// What [`Limiter::admit`] decides for one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it; `dropped` lines of the same place were dropped in the window before.
    Write {
        /// Lines dropped since the last one written.
        dropped: u64,
    },
    /// Drop it; `first` for the first line dropped in its window.
    Drop {
        /// Whether it is the first dropped in its window.
        first: bool,
    },
}

/// One place's window.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    written: u32,
    dropped: u64,
}

/// Counts lines per key over windows of `window`, at most `burst` written in each.
#[derive(Debug)]
pub struct Limiter<K> {
    burst: u32,
    window: Duration,
    windows: HashMap<K, Window>,
}

impl<K: Hash + Eq> Limiter<K> {
    /// At most `burst` lines per key in each `window`.
    pub fn new(burst: u32, window: Duration) -> Self {
        Limiter {
            burst,
            window,
            windows: HashMap::new(),
        }
    }

    /// Whether a line of `key` at `now` is written or dropped.
    pub fn admit(&mut self, key: K, now: Instant) -> Verdict {
        let w = self.windows.entry(key).or_insert(Window {
            start: now,
            written: 0,
            dropped: 0,
        });
        let mut dropped = 0;
        if now.duration_since(w.start) >= self.window {
            dropped = w.dropped;
            *w = Window {
                start: now,
                written: 0,
                dropped: 0,
            };
        }
        if w.written < self.burst {
            w.written += 1;
            return Verdict::Write { dropped };
        }
        w.dropped += 1;
        Verdict::Drop {
            first: w.dropped == 1,
        }
    }
}

/// The log subscriber's filter that applies a [`Limiter`] per callsite ([`BURST`] lines per
/// [`WINDOW`]); what it drops it says on stderr, a line when it starts dropping and one with
/// the count when the place writes again.
#[derive(Debug)]
pub struct Throttle {
    limiter: Mutex<Limiter<tracing::callsite::Identifier>>,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle {
            limiter: Mutex::new(Limiter::new(BURST, WINDOW)),
        }
    }
}

impl<S> Filter<S> for Throttle {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn callsite_enabled(&self, _meta: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn event_enabled(&self, event: &Event<'_>, _cx: &Context<'_, S>) -> bool {
        let meta = event.metadata();
        let verdict = self
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(meta.callsite(), Instant::now());
        let place = format!(
            "{}:{}",
            meta.file().unwrap_or(meta.target()),
            meta.line().unwrap_or(0)
        );
        match verdict {
            Verdict::Write { dropped: 0 } => true,
            Verdict::Write { dropped } => {
                eprintln!("  WARN log: {dropped} more lines from {place} were dropped");
                true
            }
            Verdict::Drop { first: true } => {
                eprintln!(
                    "  WARN log: {place} wrote {BURST} lines in {} s; more are counted, not written",
                    WINDOW.as_secs()
                );
                false
            }
            Verdict::Drop { first: false } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_written_then_counted_and_the_count_comes_with_the_next_window() {
        let mut l = Limiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let verdicts: Vec<Verdict> = (0..6).map(|_| l.admit("junk", at(1))).collect();
        assert_eq!(
            verdicts,
            [
                Verdict::Write { dropped: 0 },
                Verdict::Write { dropped: 0 },
                Verdict::Write { dropped: 0 },
                Verdict::Drop { first: true },
                Verdict::Drop { first: false },
                Verdict::Drop { first: false },
            ]
        );
        // Another place has a window of its own.
        assert_eq!(l.admit("other", at(2)), Verdict::Write { dropped: 0 });
        // Still in the window (it started at the first line): dropped.
        assert_eq!(l.admit("junk", at(10)), Verdict::Drop { first: false });
        // The next window writes again and says how many were dropped.
        assert_eq!(l.admit("junk", at(11)), Verdict::Write { dropped: 4 });
        assert_eq!(l.admit("junk", at(12)), Verdict::Write { dropped: 0 });
    }
}
