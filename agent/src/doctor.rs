//! `unifed-agent config check`, `config init` and `doctor`: what a site's staff run before
//! (and whenever) the agent does not do what they expect. `config check` names every problem
//! of the file with its line and column; `doctor` goes on to the things the file names (keys,
//! model, data, state folder, disk, broker) and prints one line per check.

use crate::config::{AgentConfig, load_data};
use std::path::Path;
use std::time::Duration;
use unifed_net::config_check::{Finding, check, missing_files, position};

/// What a failed check is about; `doctor` exits with the code of the first that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// The config file: syntax, unknown keys, wrong types, missing files (exit 2).
    Config = 2,
    /// The site's identity key (exit 3).
    Keys = 3,
    /// The model spec and the model it builds (exit 4).
    Model = 4,
    /// The compute backend (exit 5).
    Backend = 5,
    /// The site's images (exit 6).
    Data = 6,
    /// The state folder: writable, not in use (exit 7).
    State = 7,
    /// Disk headroom (exit 8).
    Disk = 8,
    /// The broker: TLS files and reachability (exit 9).
    Network = 9,
}

/// One check's outcome.
#[derive(Debug, Clone)]
pub struct Check {
    /// Its name, e.g. `identity`.
    pub name: &'static str,
    /// `None` when it passed, else its class.
    pub failed: Option<Class>,
    /// What was found.
    pub detail: String,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = if self.failed.is_some() {
            "FAIL"
        } else {
            "ok  "
        };
        write!(f, "{mark} {:<10} {}", self.name, self.detail)
    }
}

/// Images of each class a site needs in its training split for `doctor` to pass.
pub const MIN_PER_CLASS: usize = 5;

/// The commented example config, its paths made relative to the file `config init` writes.
pub fn example_config() -> String {
    unifed_net::config_check::example(include_str!("../../configs/agent.toml"))
}

/// Every problem of the config file at `path`: serde's (unknown keys, wrong types, missing
/// fields) and files it names that are not there, each with its line and column; or the
/// config, read as `train` reads it (paths resolved against the file's folder).
pub fn check_config(path: &Path) -> Result<AgentConfig, Vec<Finding>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![Finding {
            line: 1,
            column: 1,
            message: format!("cannot read {}: {e}", path.display()),
        }]
    })?;
    let cfg: AgentConfig = check(&text)?;
    let mut cfg = crate::config::with_profile(&text, cfg).map_err(|e| {
        let (line, column) = position(&text, &["profile"]).unwrap_or((1, 1));
        vec![Finding {
            line,
            column,
            message: format!("{e:#}"),
        }]
    })?;
    cfg.resolve_paths(path);
    let mut entries: Vec<(&[&str], Option<&Path>, bool)> = vec![
        (&["identity"], Some(&cfg.identity), false),
        (&["spec"], cfg.spec.as_deref(), false),
        (&["site_key"], cfg.site_key.as_deref(), false),
        (&["data", "folder"], cfg.data.folder.as_deref(), true),
    ];
    let tls = cfg.broker.tls_files().map(|(k, p)| (["broker", k], p));
    entries.extend(tls.iter().map(|(k, p)| (k.as_slice(), *p, false)));
    let found = missing_files(&text, &entries, |p| {
        unifed_protocol::auth::credential_path(p).unwrap_or_else(|_| p.into())
    });
    if found.is_empty() {
        Ok(cfg)
    } else {
        Err(found)
    }
}

/// Runs every check of the site configured at `path`, in order; a check that needs what an
/// earlier one found missing is left out.
pub fn doctor(path: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    let cfg = match check_config(path) {
        Ok(c) => {
            out.push(pass("config", format!("{} reads", path.display())));
            c
        }
        Err(found) => {
            for f in found {
                out.push(fail(
                    "config",
                    Class::Config,
                    format!("{}:{f}", path.display()),
                ));
            }
            return out;
        }
    };
    out.push(match cfg.identity() {
        Ok(id) => pass("identity", id.key.public().fingerprint().to_string()),
        Err(e) => fail("identity", Class::Keys, format!("{e:#}")),
    });
    if let Some(c) = profile_check(&cfg) {
        out.push(c);
    }
    let backend = cfg.backend.parse::<unifed_models::backend::Backend>();
    let device = match backend
        .map_err(|e| e.to_string())
        .and_then(|b| cfg.device(b).map_err(|e| e.to_string()))
    {
        Ok(d) => {
            out.push(pass("backend", cfg.backend.clone()));
            d
        }
        Err(e) => {
            out.push(fail("backend", Class::Backend, e));
            return out;
        }
    };
    let spec = match cfg.model_and_spec(&device) {
        Ok((_, spec)) => {
            let detail = format!("{} ({} classes)", spec.architecture, spec.classes.len());
            out.push(pass("model", detail));
            spec
        }
        Err(e) => {
            out.push(fail("model", Class::Model, format!("{e:#}")));
            return out;
        }
    };
    out.push(data_check(&cfg, &spec));
    out.push(state_check(&cfg.state_dir));
    out.push(disk_check(&cfg.state_dir, &spec));
    out.push(broker_check(&cfg));
    if let Some(t) = cfg.threads {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if t > cores {
            out.push(pass(
                "threads",
                format!("warning: threads = {t}, but this machine has {cores} cores"),
            ));
        }
    }
    out
}

/// The exit code of a doctor's checks: the first failure's class, 0 when all passed.
pub fn exit_code(checks: &[Check]) -> i32 {
    checks
        .iter()
        .find_map(|c| c.failed)
        .map_or(0, |class| class as i32)
}

fn pass(name: &'static str, detail: String) -> Check {
    Check {
        name,
        failed: None,
        detail,
    }
}

fn fail(name: &'static str, class: Class, detail: String) -> Check {
    Check {
        name,
        failed: Some(class),
        detail,
    }
}

/// The device profile's GPU device nodes are there, and its memory budget (or the config's)
/// fits the machine; `None` without a profile or budget.
fn profile_check(cfg: &AgentConfig) -> Option<Check> {
    let budget = cfg.memory_budget_mib;
    let profile = cfg.profile.as_deref();
    if profile.is_none() && budget.is_none() {
        return None;
    }
    let name = profile.unwrap_or("-");
    if let Some(p) = profile.and_then(|n| crate::profile::get(n).ok()) {
        let missing: Vec<&str> = p
            .gpu_devices
            .iter()
            .filter(|d| !Path::new(d.as_str()).exists())
            .map(String::as_str)
            .collect();
        if !missing.is_empty() && cfg.backend == p.backend {
            let detail = format!("{name}: no {} (the GPU is not visible)", missing.join(", "));
            return Some(fail("profile", Class::Backend, detail));
        }
    }
    let (Some(budget), Some(machine)) = (budget, crate::profile::machine_mib()) else {
        return Some(pass("profile", name.to_string()));
    };
    let detail = format!("{name}: memory budget {budget} MiB of the machine's {machine} MiB");
    Some(if budget <= machine {
        pass("profile", detail)
    } else {
        fail("profile", Class::Backend, detail)
    })
}

/// The site's images load for the spec (a few unreadable ones skipped) and every class of the
/// spec has [`MIN_PER_CLASS`] training images.
fn data_check(cfg: &AgentConfig, spec: &unifed_protocol::ModelSpec) -> Check {
    let (train, test) = match load_data(cfg, spec) {
        Ok(d) => d,
        Err(e) => return fail("data", Class::Data, format!("{e:#}")),
    };
    let mut per_class = vec![0usize; spec.classes.len()];
    for &y in &train.y {
        if let Some(n) = per_class.get_mut(y) {
            *n += 1;
        }
    }
    let short: Vec<String> = spec
        .classes
        .iter()
        .zip(&per_class)
        .filter(|(_, n)| **n < MIN_PER_CLASS)
        .map(|(c, n)| format!("`{c}` {n}"))
        .collect();
    if !short.is_empty() {
        return fail(
            "data",
            Class::Data,
            format!(
                "training images per class under {MIN_PER_CLASS}: {}",
                short.join(", ")
            ),
        );
    }
    pass(
        "data",
        format!(
            "{} training and {} test images",
            train.y.len(),
            test.y.len()
        ),
    )
}

/// The state folder can be made and written, and no agent holds it.
fn state_check(dir: &Path) -> Check {
    match unifed_net::service::StateLock::acquire(dir, "unifed-agent") {
        Ok(_) => {
            let probe = dir.join(".doctor-probe");
            match std::fs::write(&probe, b"ok").and_then(|()| std::fs::remove_file(&probe)) {
                Ok(()) => pass("state", format!("{} is writable", dir.display())),
                Err(e) => fail("state", Class::State, format!("{}: {e}", dir.display())),
            }
        }
        Err(unifed_net::service::LockError::InUse { holder, .. }) => pass(
            "state",
            format!(
                "{} is in use by a running agent (pid {holder})",
                dir.display()
            ),
        ),
        Err(e) => fail("state", Class::State, e.to_string()),
    }
}

/// Free space where the state folder is: room for a round's model files (four models: the
/// checkpoint's, the next, the parked base and a download) and 64 MiB more.
fn disk_check(dir: &Path, spec: &unifed_protocol::ModelSpec) -> Check {
    let model = unifed_protocol::max_broadcast_bytes(spec);
    let need = model.saturating_mul(4).saturating_add(64 << 20);
    match rustix::fs::statvfs(dir) {
        Ok(st) => {
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            let detail = format!("{} MiB free, {} MiB needed", free >> 20, need >> 20);
            if free >= need {
                pass("disk", detail)
            } else {
                fail("disk", Class::Disk, detail)
            }
        }
        Err(e) => fail("disk", Class::Disk, format!("{}: {e}", dir.display())),
    }
}

/// The broker's TLS files read, and its address takes a TCP connection within 3 s.
fn broker_check(cfg: &AgentConfig) -> Check {
    let b = &cfg.broker;
    if let Err(e) = b.options("unifed-agent-doctor", None) {
        return fail("broker", Class::Network, e.to_string());
    }
    let addr = format!("{}:{}", b.host, b.port);
    let addrs: Vec<std::net::SocketAddr> = match std::net::ToSocketAddrs::to_socket_addrs(&addr) {
        Ok(a) => a.collect(),
        Err(e) => return fail("broker", Class::Network, format!("{addr}: {e}")),
    };
    let mut last = String::from("no address");
    for a in &addrs {
        match std::net::TcpStream::connect_timeout(a, Duration::from_secs(3)) {
            Ok(_) => {
                let tls = if b.ca_file.is_some() {
                    "TLS"
                } else {
                    "plain TCP"
                };
                return pass("broker", format!("{addr} takes connections ({tls})"));
            }
            Err(e) => last = e.to_string(),
        }
    }
    fail("broker", Class::Network, format!("{addr}: {last}"))
}
