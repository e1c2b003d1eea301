//! `unifed-agent train`: the on-device trainer on MQTT. The site's round is the shared site
//! driver's ([`unifed_site::SiteDriver`]: the engine, which follows the manifest, fetches,
//! uploads, takes answers and drops bad network input, and the burn model worker, which applies
//! models (the non-BN weights under `local` BN, so the site's BN layers and statistics stay on
//! the device), trains under the round's plan and checkpoints when the engine asks), the same as
//! the in-process runner's. This module adds the process: the config, the MQTT connection with
//! its Last Will, the driver's thread, and a clean stop on SIGINT/SIGTERM.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unifed_models::backend::{Backend, Device};
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes, load_labelled};
use unifed_models::site::Site;
use unifed_models::train::TrainConfig;
use unifed_models::worker::{ModelWorker, WorkerConfig};
use unifed_models::zoo::{AnyNet, Arch, DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_net::{BrokerConfig, Client, NetEvent, Qos, Will, spawn_event_loop};
use unifed_protocol::ModelSpec;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::SiteState;
use unifed_protocol::topics::Topics;
use unifed_site::{DriverConfig, EngineConfig, Evaluate, Event, SiteDriver, SiteEngine};

use crate::files::SiteFiles;
use crate::host::{AgentHost, AgentOutbox, Shared, Who};

/// Where a site's labelled data comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A built-in domain (e.g. `grey`), or none when `folder` is given.
    #[serde(default)]
    pub builtin: Option<String>,
    /// A dataset folder (`train/`, `val/`, `test/`, each `label/file`, or a manifest.csv).
    #[serde(default)]
    pub folder: Option<PathBuf>,
    /// Training images taken from a built-in domain.
    #[serde(default = "default_samples")]
    pub train_samples: usize,
}

fn default_samples() -> usize {
    743
}

/// The agent's configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// This site's id (safe in topics).
    pub site: String,
    /// Federation id.
    pub federation: String,
    /// Folder for the local checkpoint (the site's full model, BN included).
    pub state_dir: PathBuf,
    /// Where a GPU backend keeps its tuned kernels (default: `<state_dir>/kernels`).
    #[serde(default)]
    pub kernel_cache: Option<PathBuf>,
    /// Compute backend.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// The federation's model spec (`<initial model>.spec.json`, written by `unifed-agent
    /// init`): it decides the architecture, input and class names. Without it the site runs the
    /// digits CNN of `[model]`.
    #[serde(default)]
    pub spec: Option<PathBuf>,
    /// The digits CNN's widths, when no `spec` is given.
    #[serde(default)]
    pub model: DigitsCnnConfig,
    /// Local training (lr, momentum, weight decay, batch size, epochs, seed).
    #[serde(default)]
    pub train: TrainConfig,
    /// Seconds between re-sends of an unanswered update.
    #[serde(default = "default_resend")]
    pub resend_secs: u64,
    /// Cap on the CPU backend's worker threads (default: all cores; `--threads` overrides).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Evaluate on the local test split after every model applied (for convergence curves),
    /// not only at the end.
    #[serde(default)]
    pub evaluate_each_model: bool,
    /// When a site evaluates a model it trains from (with `evaluate_each_model`):
    /// `before-training`, or `while-uploading`, on a copy frozen before training, while the
    /// update goes up and the aggregator folds (the same accuracy, off the round's critical
    /// path, for the memory of a second model). Default: `while-uploading` on a GPU backend,
    /// whose copy lives on the device and whose host is idle during the upload;
    /// `before-training` on the CPU, which is busy until the round ends anyway.
    #[serde(default)]
    pub evaluate_at: Option<EvaluateAt>,
    /// BN of a site joining a running federation (its first model is past version 0) under
    /// `local` BN: `calibrate` (default) re-estimates the statistics on its own training images
    /// before it trains; `fresh` keeps the never-trained statistics.
    #[serde(default)]
    pub join_bn: JoinBn,
    /// File holding the site's registry key (64 hex digits, from `unifed-agent keygen`): seals
    /// the calibrated BN this site registers with the aggregator. Only the site's devices hold it.
    #[serde(default)]
    pub site_key: Option<PathBuf>,
    /// The site's private ed25519 key file (made on this machine by `unifed-agent identity
    /// --key`, owner-readable only; `$CREDENTIALS_DIRECTORY/...` for systemd's
    /// `LoadCredential=`). Every message the site sends is signed with it.
    pub identity: PathBuf,
    /// The aggregator's public key (`ed25519:` and 64 hex digits, from `unifed-aggregator
    /// identity`): the site follows only manifests, models and answers it signed.
    pub aggregator_key: unifed_protocol::PublicKey,
    /// The broker.
    pub broker: BrokerConfig,
    /// The data.
    pub data: DataConfig,
}

impl AgentConfig {
    /// The site's and the federation's ids, checked.
    pub fn ids(&self) -> Result<(Id, Id)> {
        let site = Id::new(&self.site).map_err(|e| anyhow::anyhow!("site `{}`: {e}", self.site))?;
        let fed = Id::new(&self.federation)
            .map_err(|e| anyhow::anyhow!("federation `{}`: {e}", self.federation))?;
        Ok((site, fed))
    }

    /// The site's signing key (read from `identity`) and the pinned aggregator key.
    pub fn identity(&self) -> Result<crate::registry::Identity> {
        Ok(crate::registry::Identity {
            key: unifed_protocol::SigningKey::load(&self.identity)
                .context("the site's identity key")?,
            aggregator: self.aggregator_key,
        })
    }

    /// The site's model (seeded, as every site and the initial model are) and its spec: the
    /// spec file's model, or the digits CNN of `[model]`.
    pub fn model_and_spec(&self, device: &Device) -> Result<(AnyNet, ModelSpec)> {
        if let Some(path) = &self.spec {
            let spec = crate::model::read_spec(path)?;
            let net = crate::model::net_for(&spec, device)
                .with_context(|| format!("{}", path.display()))?;
            return Ok((net, spec));
        }
        self.model.validate().map_err(anyhow::Error::msg)?;
        let mc = ModelConfig::fedbn_digits();
        let net = seeded(device, 0, |d| Arch::DigitsCnn(self.model.clone()).init(d));
        let spec = spec_of(&net, &mc.classes, &mc.input);
        Ok((net, spec))
    }

    /// Where a GPU backend keeps this site's autotune results and compiled kernels:
    /// `kernel_cache`, or `<state_dir>/kernels`.
    pub fn kernel_cache(&self) -> PathBuf {
        self.kernel_cache
            .clone()
            .unwrap_or_else(|| self.state_dir.join("kernels"))
    }

    /// The device of `backend`; a GPU backend first gets the site's kernel cache
    /// ([`kernel_cache`](Self::kernel_cache)). A cache that cannot be set (an unwritable folder,
    /// settings already read in this process) costs tuning time, not the site: it is logged.
    pub fn device(&self, backend: Backend) -> Result<Device, unifed_models::backend::BackendError> {
        if backend.is_gpu()
            && let Err(e) = unifed_models::backend::use_kernel_cache(&self.kernel_cache())
        {
            tracing::warn!("{e}; kernels are tuned without the site's cache");
        }
        backend.device()
    }
}

/// Reads and parses an agent config file, naming the file in errors.
pub fn load_config(path: &std::path::Path) -> Result<AgentConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// How a late joiner's BN starts (FedBN appendix G gives no rule; this is ours). Under a BN
/// sharing policy other than `none` its BN layers first come from the onboarding package.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JoinBn {
    /// Re-estimated on the site's own training images (exact `calibrate`).
    #[default]
    Calibrate,
    /// The model's never-trained statistics.
    Fresh,
}

/// When a site evaluates a model it trains from ([`AgentConfig::evaluate_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum EvaluateAt {
    /// Before training, on the model itself.
    BeforeTraining,
    /// While the update uploads, on a copy frozen before training.
    WhileUploading,
}

impl EvaluateAt {
    /// `configured`, or the default of `backend`: while uploading on a GPU.
    pub fn resolve(configured: Option<EvaluateAt>, backend: Backend) -> EvaluateAt {
        configured.unwrap_or(if backend.is_gpu() {
            EvaluateAt::WhileUploading
        } else {
            EvaluateAt::BeforeTraining
        })
    }
}

fn default_backend() -> String {
    "flex".into()
}

fn default_resend() -> u64 {
    10
}

/// The site's training and test splits, as `[data]` names them, in `spec`'s input shape.
pub fn load_data(cfg: &AgentConfig, spec: &ModelSpec) -> Result<(Dataset, Dataset)> {
    match (&cfg.data.builtin, &cfg.data.folder) {
        (Some(d), None) => {
            let domain = Domain::parse(d).map_err(anyhow::Error::msg)?;
            let data = BuiltinData::load().context("loading the built-in data")?;
            let dd = data.domain(
                domain,
                &SplitSizes {
                    train: cfg.data.train_samples,
                    ..SplitSizes::default()
                },
                0,
            )?;
            Ok((
                dd.train.dataset(&format!("{d}/train"), spec)?,
                dd.test.dataset(&format!("{d}/test"), spec)?,
            ))
        }
        (None, Some(f)) => {
            let [train, _, test] = load_labelled(f, spec)?;
            Ok((train, test))
        }
        _ => bail!("[data] needs exactly one of `builtin` or `folder`"),
    }
}

/// Reads the agent config at `path`, caps the CPU threads at the config's `threads` unless the
/// caller already capped them (`capped`), and runs the agent on its own runtime until the
/// federation finishes (returns the final test accuracy) or SIGINT/SIGTERM stops it (`None`).
pub fn run_from_file(path: &std::path::Path, capped: bool) -> Result<Option<f64>> {
    let cfg = load_config(path)?;
    if let (false, Some(t)) = (capped, cfg.threads) {
        unifed_models::backend::cap_cpu_threads(t)
            .map_err(|e| anyhow::anyhow!("{}: threads: {e}", path.display()))?;
    }
    // Lean between phases, fast only while training and evaluating (see unifed_net::memory).
    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Lean);
    unifed_net::block_on(run(cfg, unifed_net::stop_signal()))?
}

/// Runs the agent until the federation finishes (returns the site's final test accuracy) or
/// `shutdown` resolves (returns `None`). On shutdown, even mid-training, the agent stops at
/// once: its files hold the last checkpoint (model, memory and progress in one atomically
/// replaced file), from which a restart resumes and trains the interrupted round again.
///
/// The site's driver ([`SiteDriver`]: engine, model worker and the round between them) runs on
/// a thread of its own; this task owns the MQTT connection, hands it the messages, and stops it.
pub async fn run(
    cfg: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Option<f64>> {
    let (driver, who) = driver(&cfg)?;
    let will = Will::new(
        who.topics.status(&who.site),
        who.status(SiteState::Offline, "connection lost"),
        Qos::AtLeastOnce,
        true,
    );
    let (client, rx) = spawn_event_loop(
        cfg.broker
            .options(&format!("unifed-agent-{}", who.site), Some(will))
            .map_err(anyhow::Error::msg)?,
        driver.engine().subscriptions(),
    );
    let shared = Arc::new(Mutex::new(Shared {
        saved: driver.engine().progress().applied_version,
        ..Shared::default()
    }));
    let out = AgentOutbox {
        who: who.clone(),
        client: client.clone(),
        runtime: tokio::runtime::Handle::current(),
        shared: shared.clone(),
        relaying: false,
        upload_started: None,
    };
    let (tx, events) = std::sync::mpsc::channel();
    let (done_tx, done) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("site {}", who.site))
        .spawn(move || {
            let _ = done_tx.send(drive(driver, events, out));
        })
        .context("starting the site's driver")?;
    let finished = listen(&who, &client, rx, tx, &shared, done, shutdown).await;
    let detail = match &finished {
        Ok(Some(_)) => "finished",
        _ => "stopped",
    };
    goodbye(&who, &client, detail).await;
    finished
}

/// The site's engine, its model worker and the driver over them, resumed from the state
/// folder's checkpoint; and who the site is.
fn driver(cfg: &AgentConfig) -> Result<(SiteDriver<ModelWorker<AnyNet, AgentHost>>, Who)> {
    let (site_id, fed) = cfg.ids()?;
    let identity = cfg.identity()?;
    let backend: Backend = cfg.backend.parse().map_err(anyhow::Error::msg)?;
    let device: Device = cfg.device(backend).map_err(anyhow::Error::msg)?;
    let (net, spec) = cfg.model_and_spec(&device)?;
    let (train, test) = load_data(cfg, &spec)?;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    let files = SiteFiles::new(&cfg.state_dir);
    let mut site = Site::new(&cfg.site, net, train, test)?;
    // Training holds one copy of the model: the starting one waits in this file (and under a
    // lossy encoding the residual and the held broadcast wait beside it).
    site.park_base_in(files.parked.clone())
        .with_context(|| format!("parking in {}", cfg.state_dir.display()))?;
    // The model, the residuals and control variates of the last accepted update, and the
    // server's c.
    let progress = files.restore(&spec, &mut site)?;
    let engine = SiteEngine::new(
        EngineConfig {
            site: site_id.clone(),
            federation: fed.clone(),
            spec_hash: spec.hash(),
            max_packet: cfg.broker.max_packet_bytes,
            resend_ms: cfg.resend_secs.saturating_mul(1000),
            max_model_bytes: unifed_protocol::max_broadcast_bytes(&spec),
            key: identity.key.clone(),
            aggregator: identity.aggregator,
        },
        progress,
    );
    let who = Who {
        topics: Topics::new(&fed),
        site: site_id,
        federation: fed.clone(),
        spec: spec.clone(),
        identity,
    };
    let host = AgentHost {
        who: who.clone(),
        files,
        cfg: cfg.clone(),
        runtime: tokio::runtime::Handle::current(),
        train_peak: Arc::default(),
    };
    let worker = ModelWorker::new(
        site,
        WorkerConfig {
            federation: fed,
            spec,
            train: cfg.train.clone(),
            device,
            validation: None,
        },
        host,
    );
    let evaluate = match (
        cfg.evaluate_each_model,
        EvaluateAt::resolve(cfg.evaluate_at, backend),
    ) {
        (false, _) => Evaluate::Final,
        (true, EvaluateAt::BeforeTraining) => Evaluate::EveryModel,
        (true, EvaluateAt::WhileUploading) => Evaluate::EveryModelWhileUploading,
    };
    let dc = DriverConfig {
        evaluate,
        calibrate_joiners: cfg.join_bn == JoinBn::Calibrate,
    };
    Ok((SiteDriver::new(engine, worker, dc), who))
}

/// The driver's thread: hands each event to the driver (a tick when none came for 500 ms)
/// until the federation finishes, the driver fails, or the events' sender is gone.
fn drive(
    mut driver: SiteDriver<ModelWorker<AnyNet, AgentHost>>,
    events: std::sync::mpsc::Receiver<Event>,
    mut out: AgentOutbox,
) -> Result<Option<f64>> {
    let t0 = Instant::now();
    loop {
        let event = match events.recv_timeout(Duration::from_millis(500)) {
            Ok(e) => e,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Event::Tick,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(None),
        };
        let now = t0.elapsed().as_millis() as u64;
        if let Some(accuracy) = driver.handle(event, now, &mut out)? {
            return Ok(Some(accuracy));
        }
    }
}

/// Hands the network's events to the driver's thread until the driver ends or `shutdown`
/// resolves. While the site trains, the chunks other sites fetch (a site that fetched first
/// hears the others' on the shared topic) are dropped as they come, by the filter the driver
/// left: held until training ended, 57 MB of them kept an agent 50 MiB larger through its
/// training. The first message the engine wants ends the dropping: it and all after it wait.
async fn listen(
    who: &Who,
    client: &Client,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<NetEvent>,
    tx: std::sync::mpsc::Sender<Event>,
    shared: &Mutex<Shared>,
    mut done: tokio::sync::oneshot::Receiver<Result<Option<f64>>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Option<f64>> {
    let site = &who.site;
    tokio::pin!(shutdown);
    loop {
        let ev = tokio::select! {
            _ = &mut shutdown => {
                let s = shared.lock().unwrap_or_else(|p| p.into_inner());
                match s.training {
                    // The checkpoint holds the last round's outcome, and the model is fetched
                    // and the round trained again after a restart.
                    Some(round) => println!("{site}: stopping on request during round {round}; it is trained again after a restart"),
                    None => println!("{site}: stopping on request; the checkpoint holds model v{}", s.saved.map_or("-".to_string(), |v| v.to_string())),
                }
                return Ok(None);
            }
            r = &mut done => return r.unwrap_or_else(|_| bail!("the site's driver ended without an outcome")),
            ev = rx.recv() => ev,
        };
        let event = match ev {
            None => bail!("the MQTT event loop stopped"),
            Some(NetEvent::Connected) => {
                let status = who.status(SiteState::Online, "");
                client
                    .publish(who.topics.status(site), Qos::AtLeastOnce, true, status)
                    .await?;
                Event::Connected
            }
            Some(NetEvent::Disconnected(_)) => continue,
            Some(NetEvent::Message { topic, payload }) => {
                let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = &s.filter {
                    if f.ignores(&topic, &payload) {
                        continue;
                    }
                    s.filter = None;
                }
                Event::Message { topic, payload }
            }
        };
        // A driver that ended reports why through `done`, on the next turn.
        let _ = tx.send(event);
    }
}

/// Says the site is offline (`detail`: finished or stopped), then disconnects cleanly.
async fn goodbye(who: &Who, client: &Client, detail: &str) {
    let msg = who.status(SiteState::Offline, detail);
    let _ = client
        .publish(who.topics.status(&who.site), Qos::AtLeastOnce, true, msg)
        .await;
    // A clean DISCONNECT (after the status is out) instead of a reset connection.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = client.disconnect().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_agent_config_parses_with_its_defaults() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/agent.toml"
        ))
        .unwrap();
        let cfg: AgentConfig = toml::from_str(&text).unwrap();
        assert_eq!(
            (cfg.site.as_str(), cfg.threads, cfg.join_bn),
            ("grey", Some(2), JoinBn::Calibrate)
        );
        assert_eq!(cfg.broker.max_packet_bytes, 1 << 20);
        assert!(cfg.broker.ca_file.is_none());
        assert_eq!(
            cfg.spec.as_deref(),
            Some(std::path::Path::new("run/init.safetensors.spec.json"))
        );
        let bad = text.replace("resend_secs", "resend_seconds");
        let err = toml::from_str::<AgentConfig>(&bad).unwrap_err().to_string();
        assert!(err.contains("resend_seconds"), "{err}");
    }
}
