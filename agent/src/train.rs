//! `unifed-agent train`: the on-device trainer on MQTT, a driver of the site engine
//! ([`unifed_site::SiteEngine`], which owns the round: manifest, windowed fetch, upload window,
//! answers, and drops bad network input). This module does the I/O and the work the engine asks
//! for: MQTT, applying models (the non-BN weights under `local` BN, so the site's BN layers and
//! statistics stay on the device), training under the round's plan, checkpoints when the engine
//! asks (after every answer, and after every model the site does not train from at once), so a
//! restarted agent resumes, and a clean stop on SIGINT/SIGTERM.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use unifed_models::backend::{Backend, Device};
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes, load_labelled};
use unifed_models::error::TrainError;
use unifed_models::site::{Site, SiteError};
use unifed_models::state::{Select, import};
use unifed_models::train::{TrainConfig, TrainEvent};
use unifed_models::zoo::{AnyNet, Arch, DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_net::{BrokerConfig, NetEvent, Qos, Will, spawn_event_loop};
use unifed_protocol::ModelSpec;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    Answer, BnPolicy, BnSharing, RoundManifest, SiteState, SiteStatus,
};
use unifed_protocol::topics::Topics;
use unifed_site::{Action as SiteAction, EngineConfig, Event, Progress, SiteEngine};

use crate::files::SiteFiles;
use crate::progress::{Phase, Report, training_bar};
use crate::registry::Owner;
use unifed_net::report;

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
    pub fn device(&self, backend: Backend) -> Result<Device, String> {
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

/// The BN layers of model `version`'s onboarding package, fetched in a short session of its own,
/// and a description (policy, sites) for the log.
async fn package_bn(
    cfg: &AgentConfig,
    identity: &crate::registry::Identity,
    fed: &Id,
    site: &Id,
    spec: &ModelSpec,
    version: u64,
) -> Result<(unifed_models::state::StateDict, String)> {
    let owner = Owner {
        federation: fed.clone(),
        site: site.clone(),
        spec: spec.hash(),
    };
    let (info, state) = crate::registry::fetch_package(
        &cfg.broker,
        owner,
        identity,
        spec,
        Some(version),
        |_, _| {},
    )
    .await?;
    let sd = state.filter(Select::Bn);
    let sites: Vec<&str> = info.bn_sites.iter().map(|x| x.as_str()).collect();
    Ok((
        sd,
        format!("{} of {}", info.bn_sharing.name(), sites.join(", ")),
    ))
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
pub async fn run(
    cfg: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Option<f64>> {
    let (site_id, fed) = cfg.ids()?;
    let identity = cfg.identity()?;
    let backend: Backend = cfg.backend.parse().map_err(anyhow::Error::msg)?;
    let evaluate_at = EvaluateAt::resolve(cfg.evaluate_at, backend);
    let device: Device = cfg.device(backend).map_err(anyhow::Error::msg)?;
    let (net, spec) = cfg.model_and_spec(&device)?;
    let (train, test) = load_data(&cfg, &spec)?;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    let files = SiteFiles::new(&cfg.state_dir);
    let mut s = Site::new(&cfg.site, net, train, test)?;
    // Training holds one copy of the model: the starting one waits in this file (and under a
    // lossy encoding the residual and the held broadcast wait beside it).
    s.park_base_in(files.parked.clone())
        .with_context(|| format!("parking in {}", cfg.state_dir.display()))?;
    // The model, the residuals and control variates of the last accepted update, and the
    // server's c.
    let progress = files.restore(&spec, &mut s)?;
    let mut site: Option<Site<AnyNet>> = Some(s);
    let mut engine = SiteEngine::new(
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
    let topics = Topics::new(&fed);
    let status = |state: SiteState, detail: &str| {
        identity.key.sign(&Envelope::new(
            MessageKind::SiteStatus,
            fed.clone(),
            site_id.clone(),
            0,
            0,
            spec.hash(),
            &SiteStatus {
                state,
                detail: detail.into(),
            },
        ))
    };
    let will = Will::new(
        topics.status(&site_id),
        status(SiteState::Offline, "connection lost"),
        Qos::AtLeastOnce,
        true,
    );
    let (client, mut rx) = spawn_event_loop(
        cfg.broker
            .options(&format!("unifed-agent-{site_id}"), Some(will))
            .map_err(anyhow::Error::msg)?,
        engine.subscriptions(),
    );
    let goodbye = |detail: &'static str| {
        let (client, topic, msg) = (
            client.clone(),
            topics.status(&site_id),
            status(SiteState::Offline, detail),
        );
        async move {
            let _ = client.publish(topic, Qos::AtLeastOnce, true, msg).await;
            // A clean DISCONNECT (after the status is out) instead of a reset connection.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = client.disconnect().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let save = |site: &Site<AnyNet>, progress: &Progress| -> Result<()> {
        files.write(&spec, site, progress)
    };
    // The model version the checkpoint on disk holds.
    let mut saved = engine.progress().applied_version;
    let t0 = Instant::now();
    let now = || t0.elapsed().as_millis() as u64;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tokio::pin!(shutdown);
    // Events the driver itself produced (applied, trained), handled before new input.
    let mut queue: std::collections::VecDeque<Event> = std::collections::VecDeque::new();
    // What to announce of an applied model once it is checkpointed or, when the site trains
    // from it at once, before training.
    let mut announce: Option<(RoundManifest, u64, u64)> = None;
    // The round the next checkpoint belongs to in the timeline, and when each upload started.
    let mut checkpoint_round = 0u64;
    let mut upload_started: Option<(u64, Instant)> = None;
    // While a model comes in the agent allocates as a relay (see `Allocation::Relay`): each
    // chunk's packet reuses the heap instead of faulting in fresh pages. The payload itself is
    // one block, written in place, so the heap grows by a few packets only.
    let chunk_requests = topics.chunk_request(&site_id);
    let mut relaying = false;
    // A training job that handed its update over and still holds the site while it evaluates
    // the model the round trained from (`EvaluateAt::WhileUploading`).
    let mut evaluating: Option<tokio::task::JoinHandle<(Site<AnyNet>, Result<()>)>> = None;
    // The first network event that arrived during training and was not dropped then: it and
    // every one after it (still in `rx`) are handled once training is over.
    let mut held: Option<NetEvent> = None;
    loop {
        let event = match queue.pop_front() {
            Some(e) => e,
            None => {
                let net = match held.take() {
                    Some(ev) => Some(ev),
                    None => tokio::select! {
                        _ = &mut shutdown => {
                            println!("{site_id}: stopping on request; the checkpoint holds model v{}", saved.map_or("-".to_string(), |v| v.to_string()));
                            goodbye("stopped").await;
                            return Ok(None);
                        }
                        _ = tick.tick() => None,
                        ev = rx.recv() => match ev {
                            None => bail!("the MQTT event loop stopped"),
                            ev => ev,
                        },
                    },
                };
                match net {
                    None => Event::Tick,
                    Some(NetEvent::Connected) => {
                        client
                            .publish(
                                topics.status(&site_id),
                                Qos::AtLeastOnce,
                                true,
                                status(SiteState::Online, ""),
                            )
                            .await?;
                        Event::Connected
                    }
                    Some(NetEvent::Disconnected(_)) => continue,
                    Some(NetEvent::Message { topic, payload }) => Event::Message { topic, payload },
                }
            }
        };
        for action in engine.handle(event, now()) {
            // When the action came: an answer ends the upload then, however long the
            // evaluation below still takes.
            let came = Instant::now();
            // Sending needs no site; anything else waits for the evaluation to give it back.
            if !matches!(
                action,
                SiteAction::Publish { .. } | SiteAction::Uploading { .. }
            ) && let Some(job) = evaluating.take()
            {
                let (s, evaluated) = job.await?;
                site = Some(s);
                evaluated?;
            }
            match action {
                SiteAction::Publish { topic, payload } => {
                    if !relaying && topic == chunk_requests {
                        unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Relay);
                        relaying = true;
                    }
                    client
                        .publish(topic, Qos::AtLeastOnce, false, payload)
                        .await?;
                }
                SiteAction::Apply {
                    manifest: m,
                    download,
                    joining,
                    fetch_ms,
                    bytes,
                } => {
                    if std::mem::take(&mut relaying) {
                        unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Lean);
                    }
                    // The model of version v is what round v + 1 trains from.
                    let for_round = m.model_version + 1;
                    report::phase_seconds(for_round, Phase::Download, fetch_ms as f64 / 1000.0);
                    let applying = Instant::now();
                    let s = site.as_mut().expect("site present");
                    let applied = download
                        .read()
                        .map_err(|e| e.to_string())
                        .and_then(|d| s.receive(&spec, &m, &d).map_err(|e| e.to_string()));
                    // The payload goes before anything else grows (calibration, evaluation).
                    drop(download);
                    if let Err(error) = applied {
                        queue.push_back(Event::ApplyFailed {
                            version: m.model_version,
                            error,
                        });
                        continue;
                    }
                    if joining && m.bn_policy == BnPolicy::Local && cfg.join_bn == JoinBn::Calibrate
                    {
                        // A late joiner: BN from the onboarding package (the sites' shared BN,
                        // if the policy shares any), statistics then re-estimated on its own
                        // images.
                        if m.bn_sharing != BnSharing::None {
                            match package_bn(
                                &cfg,
                                &identity,
                                &fed,
                                &site_id,
                                &spec,
                                m.model_version,
                            )
                            .await
                            {
                                Ok((sd, detail)) => {
                                    s.net = import(&s.net, &spec, &sd, Select::Bn)?;
                                    println!(
                                        "{site_id}: BN from the onboarding package of model v{} ({detail})",
                                        m.model_version
                                    );
                                }
                                // Not fatal: the joiner calibrates its own BN instead.
                                Err(e) => eprintln!(
                                    "{site_id}: onboarding package unavailable ({e:#}); calibrating the model's own BN"
                                ),
                            }
                        }
                        s.net = tokio::task::block_in_place(|| {
                            unifed_models::bn::calibrate(
                                &s.net,
                                &s.train.x,
                                &device,
                                &Default::default(),
                                |_, _| {},
                            )
                        })?;
                        println!(
                            "{site_id}: joined at model v{}; calibrated BN on {} own images",
                            m.model_version,
                            s.train.len()
                        );
                    }
                    report::phase(for_round, Phase::Apply, applying);
                    checkpoint_round = for_round;
                    queue.push_back(Event::Applied {
                        version: m.model_version,
                    });
                    announce = Some((m, fetch_ms, bytes));
                }
                SiteAction::Train { manifest: m } => {
                    // A model trained from at once is checkpointed with its training's outcome
                    // (see `SiteAction::Checkpoint`): it is announced here, and evaluated here
                    // or, frozen, while the update uploads.
                    let mut frozen = None;
                    if let Some(a) = announce.take() {
                        let s = site.as_ref().expect("site present");
                        if evaluate_at == EvaluateAt::WhileUploading {
                            if evaluates(&cfg, &a.0) {
                                frozen = Some((a.0.clone(), s.freeze()));
                            }
                            applied(&cfg, &a);
                        } else {
                            announced(&cfg, &spec, &device, s, a)?;
                        }
                    }
                    println!(
                        "{site_id}: training round {} from model v{}",
                        m.round, m.model_version
                    );
                    client
                        .publish(
                            topics.status(&site_id),
                            Qos::AtLeastOnce,
                            true,
                            status(SiteState::Training { round: m.round }, ""),
                        )
                        .await?;
                    let mut s = site.take().expect("site present");
                    let (spec2, fed2, dev2, tc, m2) = (
                        spec.clone(),
                        fed.clone(),
                        device.clone(),
                        cfg.train.clone(),
                        m.clone(),
                    );
                    let mut bar = training_bar(site_id.as_str(), m.round);
                    let (trained_tx, trained_rx) = tokio::sync::oneshot::channel();
                    let job = tokio::task::spawn_blocking(move || {
                        let started = Instant::now();
                        // Training's peak memory, apart from encoding's.
                        let mut train_peak = None;
                        let progress = |ev| {
                            if ev == TrainEvent::Trained {
                                train_peak = report::take_peak();
                                // Training's freed buffers go back before the update is
                                // encoded: encoding holds the model, the delta and the
                                // update's bytes at once.
                                unifed_net::memory::set_allocation(
                                    unifed_net::memory::Allocation::Lean,
                                );
                                unifed_net::release_free_memory();
                            }
                            bar(ev)
                        };
                        let r = unifed_net::memory::with_fast_allocation(|| {
                            s.train_round(&spec2, &fed2, &m2, &tc, &dev2, progress)
                        });
                        if r.is_ok() {
                            let encode = s.encode_seconds();
                            let train = started.elapsed().as_secs_f64() - encode;
                            // Training ended before the update was encoded.
                            report::phase_ended(
                                m2.round,
                                Phase::Train,
                                train,
                                train_peak,
                                std::time::Duration::from_secs_f64(encode),
                            );
                            report::phase_seconds(m2.round, Phase::Encode, encode);
                        }
                        // The update goes up now; the site stays here while it evaluates.
                        let _ = trained_tx.send(r);
                        // Under lean allocation: the upload goes on beside it.
                        let evaluated = frozen.map_or(Ok(()), |(fm, net)| {
                            evaluate_report(&tc, &spec2, &dev2, &s, &net, &fm)
                        });
                        // Training's buffers and the update's pieces are freed now.
                        unifed_net::release_free_memory();
                        // A GPU's pipelines compiled for this round (its first, mostly) are kept
                        // for the next start.
                        unifed_models::backend::save_compiled_kernels();
                        (s, evaluated)
                    });
                    // While it trains, the chunks other sites fetch (a site that fetched first
                    // hears the others' on the shared topic) are dropped as they come: held
                    // until training ended, 57 MB of them kept an agent 50 MiB larger through
                    // its training. Anything the engine wants waits, with all after it.
                    let mut trained_rx = trained_rx;
                    let mut listening = held.is_none();
                    let update = loop {
                        tokio::select! {
                            // Stop now: the checkpoint holds the last round's outcome, and the
                            // model is fetched and the round trained again after a restart.
                            _ = &mut shutdown => {
                                println!("{site_id}: stopping on request during round {}; it is trained again after a restart", m.round);
                                goodbye("stopped").await;
                                return Ok(None);
                            }
                            r = &mut trained_rx => break r,
                            ev = rx.recv(), if listening => match ev {
                                Some(NetEvent::Message { topic, payload })
                                    if engine.ignores(&topic, &payload) => {}
                                // The loop reports a closed channel after training.
                                None => listening = false,
                                ev => {
                                    held = ev;
                                    listening = false;
                                }
                            },
                        }
                    };
                    let Ok(update) = update else {
                        // The job dropped the sender without an update: it panicked, and
                        // awaiting it returns that panic as the error.
                        drop(job.await?);
                        bail!("training round {} ended without an outcome", m.round);
                    };
                    evaluating = Some(job);
                    match update {
                        Ok(update) => queue.push_back(Event::Trained {
                            round: m.round,
                            update,
                        }),
                        // What the federation's model made of training: no update this round,
                        // the next model may train (a failure of the site itself ends the agent).
                        Err(
                            e @ (SiteError::NonFinite(_)
                            | SiteError::Plan { .. }
                            | SiteError::Train(TrainError::Diverged(..))),
                        ) => {
                            eprintln!(
                                "{site_id}: round {}: {e}; no update sent this round",
                                m.round
                            );
                            queue.push_back(Event::TrainFailed {
                                round: m.round,
                                error: e.to_string(),
                            });
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                SiteAction::Uploading {
                    round,
                    bytes,
                    messages,
                } => {
                    upload_started = Some((round, Instant::now()));
                    Report::Uploaded {
                        round,
                        bytes,
                        messages,
                    }
                    .emit()
                }
                SiteAction::Answered { round, answer } => {
                    let accepted = answer == Answer::Accepted;
                    site.as_mut()
                        .expect("site present")
                        .answered(round, accepted);
                    if let Some((_, t)) = upload_started.take_if(|(r, _)| *r == round) {
                        let took = came.duration_since(t).as_secs_f64();
                        report::phase_ended(
                            round,
                            Phase::Upload,
                            took,
                            report::take_peak(),
                            came.elapsed(),
                        );
                    }
                    checkpoint_round = round;
                    Report::Answered { round, accepted }.emit();
                    match answer {
                        Answer::Accepted => {
                            println!("{site_id}: update for round {round} accepted")
                        }
                        Answer::Rejected(r) => {
                            eprintln!("{site_id}: update for round {round} rejected: {r:?}")
                        }
                        // The engine re-sends by itself; it never reports this answer.
                        Answer::Resend => {}
                    }
                }
                SiteAction::Checkpoint => {
                    let s = site.as_ref().expect("site present");
                    let saving = Instant::now();
                    save(s, engine.progress())?;
                    saved = engine.progress().applied_version;
                    // The download's or the upload's buffers and the checkpoint's are freed
                    // now (every answer, and every apply not followed by training, is followed
                    // by a checkpoint; `announced` frees them before training otherwise).
                    unifed_net::release_free_memory();
                    report::phase(checkpoint_round, Phase::Checkpoint, saving);
                    if let Some(a) = announce.take() {
                        announced(&cfg, &spec, &device, s, a)?;
                    }
                }
                SiteAction::Finished { manifest: m } => {
                    let s = site.as_ref().expect("site present");
                    // The download's and the apply's buffers go back before evaluation grows
                    // the heap, as before every evaluation in a round (`announced`).
                    unifed_net::release_free_memory();
                    let evaluating = Instant::now();
                    let acc = tokio::task::block_in_place(|| {
                        unifed_net::memory::with_fast_allocation(|| {
                            s.evaluate(&spec, &m.plan, &cfg.train, &device)
                        })
                    })?
                    .accuracy();
                    report::phase(m.model_version + 1, Phase::Evaluate, evaluating);
                    Report::Evaluated {
                        version: m.model_version,
                        accuracy: acc,
                    }
                    .emit();
                    println!(
                        "{site_id}: federation finished at model v{}; test accuracy {:.2}%",
                        m.model_version,
                        100.0 * acc
                    );
                    goodbye("finished").await;
                    return Ok(Some(acc));
                }
            }
        }
    }
}

/// Reports a model applied (`a`: its manifest, fetch milliseconds and bytes) and, when the
/// config asks for it, the site's test accuracy with it, before the site trains from it.
fn announced(
    cfg: &AgentConfig,
    spec: &ModelSpec,
    device: &Device,
    s: &Site<AnyNet>,
    a: (RoundManifest, u64, u64),
) -> Result<()> {
    applied(cfg, &a);
    if evaluates(cfg, &a.0) {
        tokio::task::block_in_place(|| {
            unifed_net::memory::with_fast_allocation(|| {
                evaluate_report(&cfg.train, spec, device, s, &s.net, &a.0)
            })
        })?;
    }
    Ok(())
}

/// Reports a model applied (its manifest, fetch milliseconds and bytes).
fn applied(cfg: &AgentConfig, (m, fetch_ms, bytes): &(RoundManifest, u64, u64)) {
    println!("{}: applied model v{}", cfg.site, m.model_version);
    Report::Applied {
        version: m.model_version,
        bytes: *bytes,
        seconds: *fetch_ms as f64 / 1000.0,
    }
    .emit();
    // The download's buffers go back before evaluation and training take their memory.
    unifed_net::release_free_memory();
}

/// Whether the site evaluates the model of manifest `m` before it trains from it (the final
/// model is evaluated when the federation finishes).
fn evaluates(cfg: &AgentConfig, m: &RoundManifest) -> bool {
    cfg.evaluate_each_model && !m.finished
}

/// Evaluates `net`, the site's model as it applied the model of manifest `m` (the model
/// itself, or a copy [`Site::freeze`] made), and reports the phase and the accuracy.
fn evaluate_report(
    tc: &TrainConfig,
    spec: &ModelSpec,
    device: &Device,
    s: &Site<AnyNet>,
    net: &AnyNet,
    m: &RoundManifest,
) -> Result<()> {
    let evaluating = Instant::now();
    let acc = s
        .evaluate_frozen(net, spec, &m.plan, tc, device)?
        .accuracy();
    unifed_net::release_free_memory();
    report::phase(m.model_version + 1, Phase::Evaluate, evaluating);
    Report::Evaluated {
        version: m.model_version,
        accuracy: acc,
    }
    .emit();
    Ok(())
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
