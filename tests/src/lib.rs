//! Workspace-level end-to-end tests that start the real binaries (broker, aggregator, agents).
//! They live in `tests/`; this library only finds the binaries the workspace build produced.

use std::path::PathBuf;

/// Path of a workspace binary built beside the running test (`<target>/<profile>/<name>`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("<target>/<profile>");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is not built: run the workspace tests (`cargo test --release --workspace`)",
        p.display()
    );
    p
}

/// A child process that is killed and reaped when dropped, so a failing test leaves no broker,
/// aggregator or agent running.
#[derive(Debug)]
pub struct Guard(pub std::process::Child);

impl Guard {
    /// Waits up to `limit` for the process to exit; kills it and returns `None` on timeout.
    pub fn wait_for(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let t0 = std::time::Instant::now();
        loop {
            if let Ok(Some(s)) = self.0.try_wait() {
                return Some(s);
            }
            if t0.elapsed() > limit {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
