//! `unifed-agent train`: the on-device trainer on MQTT. The site's round is the shared site
//! driver's ([`unifed_site::SiteDriver`]: the engine, which follows the manifest, fetches,
//! uploads, takes answers and drops bad network input, and the burn model worker, which applies
//! models (the non-BN weights under `local` BN, so the site's BN layers and statistics stay on
//! the device), trains under the round's plan and checkpoints when the engine asks), the same as
//! the in-process runner's. This module adds the process: the config, the MQTT connection with
//! its Last Will, the driver's thread, and a clean stop on SIGINT/SIGTERM.

use anyhow::{Context, Result, bail};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unifed_models::backend::{Backend, Device};
use unifed_models::site::Site;
use unifed_models::worker::{ModelWorker, WorkerConfig};
use unifed_models::zoo::AnyNet;
use unifed_net::{Client, NetEvent, Qos, Will, spawn_event_loop};
use unifed_protocol::messages::SiteState;
use unifed_protocol::topics::Topics;
use unifed_site::{DriverConfig, EngineConfig, Evaluate, Event, SiteDriver, SiteEngine};

pub use crate::config::{AgentConfig, DataConfig, EvaluateAt, JoinBn, load_config, load_data};
use crate::files::SiteFiles;
use crate::host::{AgentHost, AgentOutbox, Shared, Who};

/// How long the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Until its federation finishes (`unifed-agent train`).
    Once,
    /// As a service (`unifed-agent run`): after a federation finishes it holds the final model
    /// and waits for the aggregator's next run, until it is asked to stop.
    Service,
}

/// Reads the agent config at `path`, caps the CPU threads at the config's `threads` unless the
/// caller already capped them (`capped`), and runs the agent in `mode` on its own runtime until
/// the federation finishes (returns the final test accuracy) or SIGINT/SIGTERM/SIGHUP stops it
/// (`None`).
pub fn run_from_file(path: &std::path::Path, capped: bool, mode: Mode) -> Result<Option<f64>> {
    let cfg = load_config(path)?;
    if let (false, Some(t)) = (capped, cfg.threads) {
        unifed_models::backend::cap_cpu_threads(t)
            .map_err(|e| anyhow::anyhow!("{}: threads: {e}", path.display()))?;
    }
    // Lean between phases, fast only while training and evaluating (see unifed_net::memory).
    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Lean);
    unifed_net::block_on(run(
        cfg,
        unifed_net::service::stop_signal("unifed-agent"),
        mode,
    ))?
}

/// Runs the agent until the federation finishes (returns the site's final test accuracy; never
/// in [`Mode::Service`]) or `shutdown` resolves (returns `None`). On shutdown, even
/// mid-training, the agent stops at once: its files hold the last checkpoint (model, memory and
/// progress in one atomically replaced file), from which a restart resumes and trains the
/// interrupted round again.
///
/// When the aggregator starts a later run of the federation (a new federation on the same ids,
/// or its state started afresh), the site's state of the earlier run is put aside in
/// `<state_dir>/runs/<run>/` and the site joins the new run as a new site would.
pub async fn run(
    cfg: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
    mode: Mode,
) -> Result<Option<f64>> {
    // One agent per state folder, held until this returns.
    let _lock = unifed_net::service::StateLock::acquire(&cfg.state_dir, "unifed-agent")?;
    tokio::pin!(shutdown);
    let mut follow = None;
    loop {
        match session(&cfg, &mut shutdown, mode, follow).await? {
            Outcome::Finished(end) => return Ok(Some(end.accuracy)),
            Outcome::Stopped => return Ok(None),
            Outcome::NewRun { from, to } => {
                let dir = SiteFiles::new(&cfg.state_dir).put_aside(&from.to_string())?;
                println!(
                    "{}: the aggregator started run {to}; this site's state of run {from} is now in {}; joining the new run as a new site",
                    cfg.site,
                    dir.display()
                );
                follow = Some(to);
            }
        }
    }
}

/// Resets the site of `cfg` to a new site: its state (checkpoint, model, progress) moves to
/// `<state_dir>/runs/<run>/` (`reset-<ms>` when it names no run), so the next start joins its
/// federation afresh. Refused while an agent runs on the folder. Returns where the state went,
/// or `None` when there was none.
pub fn reset(cfg: &AgentConfig) -> Result<Option<std::path::PathBuf>> {
    let _lock = unifed_net::service::StateLock::acquire(&cfg.state_dir, "unifed-agent")?;
    let files = SiteFiles::new(&cfg.state_dir);
    if !cfg.state_dir.join("checkpoint.bin").exists() {
        return Ok(None);
    }
    let name = match files.saved_run() {
        Some(run) => run.to_string(),
        None => {
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            format!("reset-{ms}")
        }
    };
    files.put_aside(&name).map(Some)
}

/// How a session of the agent (one connection, one site driver) ended.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The federation finished ([`Mode::Once`]).
    Finished(End),
    /// The aggregator announced a later run than the site's state is of.
    NewRun {
        from: unifed_protocol::RunId,
        to: unifed_protocol::RunId,
    },
    /// Asked to stop, or the driver's events ended.
    Stopped,
}

/// One session: the site's driver, resumed from the state folder (a fresh site following
/// `follow` when given), on a connection of its own, until the federation finishes (in
/// [`Mode::Once`]), a later run is announced, or `shutdown` resolves.
///
/// The site's driver ([`SiteDriver`]: engine, model worker and the round between them) runs on
/// a thread of its own; this task owns the MQTT connection, hands it the messages, and stops it.
async fn session(
    cfg: &AgentConfig,
    shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
    mode: Mode,
    follow: Option<unifed_protocol::RunId>,
) -> Result<Outcome> {
    let (mut driver, who) = driver(cfg)?;
    if let Some(run) = follow {
        driver = driver.following(run);
    }
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
            let _ = done_tx.send(drive(driver, events, out, mode));
        })
        .context("starting the site's driver")?;
    let outcome = listen(&who, &client, rx, tx, &shared, done, shutdown).await;
    // A site that holds the final model says so, so the aggregator stops serving it as soon as
    // every site has it (in service mode the driver said so when it finished).
    let (state, run) = match &outcome {
        Ok(Outcome::Finished(end)) => (
            SiteState::Finished {
                model_version: end.model_version,
            },
            end.run,
        ),
        _ => (SiteState::Offline, Default::default()),
    };
    goodbye(&who, &client, state, run).await;
    outcome
}

/// How a site's federation ended: its final test accuracy and the final model's version.
#[derive(Debug, Clone, Copy)]
struct End {
    accuracy: f64,
    model_version: u64,
    /// The run of the federation that ended.
    run: unifed_protocol::RunId,
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
    files.write_spec(&spec)?;
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
/// until the federation finishes (in [`Mode::Service`] the site says so and goes on, holding the
/// final model, until a later run), a later run is announced, the driver fails, or the events'
/// sender is gone.
fn drive(
    mut driver: SiteDriver<ModelWorker<AnyNet, AgentHost>>,
    events: std::sync::mpsc::Receiver<Event>,
    mut out: AgentOutbox,
    mode: Mode,
) -> Result<Outcome> {
    let t0 = Instant::now();
    let mut said_finished = false;
    loop {
        let event = match events.recv_timeout(Duration::from_millis(500)) {
            Ok(e) => e,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Event::Tick,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(Outcome::Stopped),
        };
        let now = t0.elapsed().as_millis() as u64;
        let finished = driver.handle(event, now, &mut out)?;
        if let Some((from, to)) = driver.new_run() {
            return Ok(Outcome::NewRun { from, to });
        }
        let Some(accuracy) = finished else {
            // Extended by more rounds after it finished: it will finish again.
            said_finished = false;
            continue;
        };
        let end = End {
            accuracy,
            model_version: driver.engine().progress().applied_version.unwrap_or(0),
            run: driver
                .engine()
                .manifest()
                .map(|m| m.run)
                .unwrap_or_default(),
        };
        match mode {
            Mode::Once => return Ok(Outcome::Finished(end)),
            Mode::Service if !said_finished => {
                said_finished = true;
                out.say_finished(end.run, end.model_version);
                println!(
                    "{}: holding the final model v{}; waiting for the federation's next run",
                    out.who.site, end.model_version
                );
            }
            Mode::Service => {}
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
    mut done: tokio::sync::oneshot::Receiver<Result<Outcome>>,
    shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<Outcome> {
    let site = &who.site;
    loop {
        let ev = tokio::select! {
            _ = &mut *shutdown => {
                let s = shared.lock().unwrap_or_else(|p| p.into_inner());
                match s.training {
                    // The checkpoint holds the last round's outcome, and the model is fetched
                    // and the round trained again after a restart.
                    Some(round) => println!("{site}: stopping on request during round {round}; it is trained again after a restart"),
                    None => println!("{site}: stopping on request; the checkpoint holds model v{}", s.saved.map_or("-".to_string(), |v| v.to_string())),
                }
                return Ok(Outcome::Stopped);
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
            Some(NetEvent::Disconnected(_) | NetEvent::Subscribed) => continue,
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

/// Says the site finished (`Finished`) or stopped (`Offline`), then disconnects cleanly.
async fn goodbye(who: &Who, client: &Client, state: SiteState, run: unifed_protocol::RunId) {
    let detail = if matches!(state, SiteState::Offline) {
        "stopped"
    } else {
        "finished"
    };
    let msg = who.status_in(run, state, detail);
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
        // Read from its file, its paths are the repository's run/ wherever the agent starts.
        let path = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/agent.toml"
        ));
        let read = load_config(path).unwrap();
        let configs = path.parent().unwrap();
        assert_eq!(
            read.spec.as_deref(),
            Some(configs.join("../run/init.safetensors.spec.json").as_path())
        );
        assert_eq!(read.state_dir, configs.join("../run/grey"));
        assert_eq!(read.identity, configs.join("../run/grey/identity.key"));
        let bad = text.replace("resend_secs", "resend_seconds");
        let err = toml::from_str::<AgentConfig>(&bad).unwrap_err().to_string();
        assert!(err.contains("resend_seconds"), "{err}");
    }
}
