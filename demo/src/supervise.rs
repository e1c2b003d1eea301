//! The demo's child processes: started from this binary in a role, their stdout read line by
//! line into one channel, their memory sampled together, and killed when dropped.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A line from a child's stdout, or its end.
#[derive(Debug)]
pub enum Line {
    /// One line of output from the child named `who`.
    Out {
        /// The child's name.
        who: String,
        /// The line.
        text: String,
    },
    /// The child's stdout closed (it exited).
    Closed {
        /// The child's name.
        who: String,
    },
}

/// The running children and the channel their lines arrive on.
pub struct Children {
    children: Vec<(String, Child)>,
    tx: Sender<Line>,
    /// Lines of every child.
    pub rx: Receiver<Line>,
    pids: Arc<Mutex<Vec<(String, u32)>>>,
    stop: Arc<AtomicBool>,
    memory: Arc<Mutex<Memory>>,
}

/// Peak memory of the demo's processes, sampled every 100 ms from /proc.
#[derive(Debug, Default, Clone)]
pub struct Memory {
    /// Peak of the summed resident set of all children and the demo itself, in bytes.
    pub peak_total: u64,
    /// Each process's own peak resident set (VmHWM), in bytes, by name.
    pub peak_each: BTreeMap<String, u64>,
    /// When the summed peak was sampled (ms since the Unix epoch), and each process's resident
    /// set then: which processes and phases the peak is made of.
    pub peak_total_at: (u64, BTreeMap<String, u64>),
}

/// `VmRSS` and `VmHWM` of `pid` in KiB, from one read of `/proc/<pid>/status`.
fn rss_and_peak_kib(pid: u32) -> Option<(Option<u64>, Option<u64>)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((field("VmRSS:"), field("VmHWM:")))
}

/// User plus system CPU seconds of every thread of `pid`, from `/proc/<pid>/stat` (fields 14
/// and 15, in the kernel's user-visible clock ticks, 100 per second on Linux).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after it follow its `)`.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace().skip(11);
    let user: u64 = f.next()?.parse().ok()?;
    let system: u64 = f.next()?.parse().ok()?;
    Some((user + system) as f64 / 100.0)
}

impl Children {
    /// No children yet; starts the memory sampler (which includes this process).
    pub fn new() -> Children {
        let (tx, rx) = channel();
        let pids: Arc<Mutex<Vec<(String, u32)>>> =
            Arc::new(Mutex::new(vec![("demo".into(), std::process::id())]));
        let stop = Arc::new(AtomicBool::new(false));
        let memory = Arc::new(Mutex::new(Memory::default()));
        let (p, s, m) = (pids.clone(), stop.clone(), memory.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let list = p.lock().map(|l| l.clone()).unwrap_or_default();
                let mut total = 0;
                let mut each = BTreeMap::new();
                let mut mem = m.lock().unwrap_or_else(|e| e.into_inner());
                for (name, pid) in &list {
                    let (rss, hwm) = rss_and_peak_kib(*pid).unwrap_or((None, None));
                    total += rss.unwrap_or(0) * 1024;
                    each.insert(name.clone(), rss.unwrap_or(0) * 1024);
                    if let Some(hwm) = hwm {
                        let e = mem.peak_each.entry(name.clone()).or_default();
                        *e = (*e).max(hwm * 1024);
                    }
                }
                if total > mem.peak_total {
                    mem.peak_total = total;
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    mem.peak_total_at = (now, each);
                }
                drop(mem);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Children {
            children: Vec::new(),
            tx,
            rx,
            pids,
            stop,
            memory,
        }
    }

    /// Starts this binary as `role args...` named `who`; stderr goes to `log`, stdout to the
    /// channel; `env` is added to its environment.
    pub fn spawn(
        &mut self,
        who: &str,
        args: &[&str],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<()> {
        let exe = std::env::current_exe().context("finding this executable")?;
        let err =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = unifed_net::end_with_parent(&mut Command::new(exe))
            .arg("role")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .with_context(|| format!("starting the {who} process"))?;
        let out = child.stdout.take().expect("piped stdout");
        let (tx, name) = (self.tx.clone(), who.to_string());
        std::thread::spawn(move || {
            for text in BufReader::new(out).lines().map_while(|l| l.ok()) {
                if tx
                    .send(Line::Out {
                        who: name.clone(),
                        text,
                    })
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(Line::Closed { who: name });
        });
        if let Ok(mut p) = self.pids.lock() {
            p.push((who.to_string(), child.id()));
        }
        self.children.push((who.to_string(), child));
        Ok(())
    }

    /// Whether `who` has exited, and how.
    pub fn exited(&mut self, who: &str) -> Option<std::process::ExitStatus> {
        self.children
            .iter_mut()
            .find(|(n, _)| n == who)
            .and_then(|(_, c)| c.try_wait().ok().flatten())
    }

    /// CPU seconds (user and system, every thread) each live process has used so far, by name:
    /// the demo itself, the broker, the aggregator and each agent.
    pub fn cpu_seconds(&self) -> BTreeMap<String, f64> {
        let list = self.pids.lock().map(|l| l.clone()).unwrap_or_default();
        list.iter()
            .filter_map(|(name, pid)| Some((name.clone(), cpu_seconds(*pid)?)))
            .collect()
    }

    /// The memory figures so far.
    pub fn memory(&self) -> Memory {
        self.memory.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Last started first: agents and aggregator go before the broker they talk to.
        for (_, c) in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
