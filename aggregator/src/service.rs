//! The aggregator service: the federation core on MQTT. One task owns the MQTT event loop
//! (`unifed_net`); this task feeds the core with updates and ticks, publishes the retained
//! manifest, serves model chunks on request and answers every update on the site's ack topic.

use crate::clock::now_ms;
use crate::config::FederationConfig;
use crate::core::{Aggregator, Arrival, Event, GlobalModel, Incoming, VET_WIDTH};
use crate::federation::{Done, Federation, Outgoing, Sealer, Step};
use crate::uploads::SpooledUploads;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};
use unifed_net::config_check::Finding;
use unifed_net::report::{self, Phase, Report};
use unifed_net::{BrokerConfig, NetEvent, Qos, spawn_event_loop_with_side};
use unifed_protocol::auth::SigningKey;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{ChunkRef, OnboardReply, OnboardRequest, SiteState, SiteStatus};
use unifed_protocol::topics::Topics;
use unifed_protocol::{ModelSpec, SpecHash};

/// The service's configuration file (`unifed-aggregator serve --config`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// Data directory (state, model versions, spool, audit log).
    pub data_dir: PathBuf,
    /// Initial global model (safetensors written by `unifed-agent init`; its spec beside it as
    /// `<file>.spec.json`).
    pub model: PathBuf,
    /// The aggregator's private ed25519 key (made by `unifed-aggregator identity --key`, owner
    /// readable only; `$CREDENTIALS_DIRECTORY/...` for systemd's `LoadCredential=`). Every
    /// message it sends is signed with it; sites pin its public key.
    pub key: PathBuf,
    /// Model chunk size in bytes (below the broker's packet limit).
    #[serde(default = "default_chunk")]
    pub chunk_bytes: usize,
    /// Seconds to keep serving the final model after the last round, at most: the service
    /// stops sooner, once every enrolled and unrevoked site has said it holds that model.
    #[serde(default = "default_linger")]
    pub linger_secs: u64,
    /// Seconds between re-publications of the retained manifest: anything else retained on the
    /// manifest topic (a broker restart's loss, or junk from another client) is replaced within
    /// this long, so a site that connects then still finds the round.
    #[serde(default = "default_manifest_every")]
    pub manifest_every_secs: u64,
    /// Bytes all sites' incomplete chunked uploads may take together, spooled in the data
    /// folder's `incoming/` as they arrive (memory holds only which chunks came). Each site also
    /// takes at most one update's worth (`max_update_bytes`) and two uploads at a time, so one
    /// site cannot crowd out another. (`max_upload_memory_bytes` is its former name.)
    #[serde(default = "default_upload_bytes", alias = "max_upload_memory_bytes")]
    pub max_upload_bytes: usize,
    /// The broker.
    pub broker: BrokerConfig,
    /// The federation.
    pub federation: FederationConfig,
}

impl ServiceConfig {
    /// Makes the config's relative paths relative to the folder of the file it came from
    /// (`config`), so a service started from anywhere finds the same files.
    pub fn resolve_paths(&mut self, config: &Path) {
        use unifed_net::service::resolve_path;
        for p in [&mut self.data_dir, &mut self.model, &mut self.key] {
            *p = resolve_path(config, p);
        }
        self.broker.resolve_paths(config);
    }
}

fn default_upload_bytes() -> usize {
    1 << 30
}

fn default_chunk() -> usize {
    256 << 10
}

fn default_linger() -> u64 {
    30
}

fn default_manifest_every() -> u64 {
    30
}

pub use unifed_protocol::spec_path;

/// Reads a model file and its spec into a [`GlobalModel`] (no burn: safetensors and JSON).
pub fn load_model(model: &Path) -> Result<GlobalModel> {
    let sp = spec_path(model);
    let spec: ModelSpec = serde_json::from_slice(
        &std::fs::read(&sp).with_context(|| format!("reading {}", sp.display()))?,
    )
    .with_context(|| format!("parsing {}", sp.display()))?;
    let bytes = std::fs::read(model).with_context(|| format!("reading {}", model.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", model.display()))?;
    let mut tensors = Vec::with_capacity(spec.tensors.len());
    for t in &spec.tensors {
        let v = st.tensor(&t.name).with_context(|| {
            format!(
                "{}: tensor `{}` of the spec is missing",
                model.display(),
                t.name
            )
        })?;
        if v.dtype() != safetensors::Dtype::F32 || v.shape() != t.shape.as_slice() {
            bail!(
                "{}: tensor `{}` is {:?} {:?}, the spec says F32 {:?}",
                model.display(),
                t.name,
                v.dtype(),
                v.shape(),
                t.shape
            );
        }
        tensors.push(
            v.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
    }
    Ok(GlobalModel { spec, tensors })
}

/// How long the first requests for a new model are gathered before its chunks are shared,
/// unless every enrolled site asked sooner (see [`crate::serving`]).
const GATHER_MS: u64 = 20;
/// Disk each enrolled site's incomplete upload may take: one update's bytes, the slack of its
/// chunks and a MiB, but at most an equal share of `total`.
fn upload_share(max_update_bytes: usize, total: usize, sites: usize) -> u64 {
    let per_site = (max_update_bytes + max_update_bytes / 16 + (1 << 20)).min(total / sites.max(1));
    if per_site < max_update_bytes {
        tracing::warn!(
            per_site,
            max_update_bytes,
            "max_upload_bytes shared by the enrolled sites leaves less than max_update_bytes \
             per site: larger chunked updates cannot be uploaded"
        );
    }
    per_site as u64
}

/// What every message the aggregator publishes goes through: the client, and the federation's
/// topics and sealer (the key that signs it).
#[derive(Clone)]
struct Wire {
    client: unifed_net::Client,
    topics: Topics,
    sealer: Sealer,
}

impl Wire {
    /// Seals `payload` and publishes it on `topic`.
    async fn send(
        &self,
        topic: String,
        kind: MessageKind,
        at: (u64, u64),
        payload: &impl Serialize,
        retain: bool,
    ) -> Result<()> {
        let bytes = self.sealer.seal(kind, at, payload);
        self.client
            .publish(topic, Qos::AtLeastOnce, retain, bytes)
            .await?;
        Ok(())
    }

    /// Publishes what the federation gives, in order.
    async fn send_all(&self, messages: Vec<Outgoing>) -> Result<()> {
        for m in messages {
            self.client
                .publish_bytes(m.topic, Qos::AtLeastOnce, m.retain, m.payload)
                .await?;
        }
        Ok(())
    }
}

/// Reads and validates the service config at `path`.
pub fn read_config(path: &Path) -> Result<ServiceConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut cfg: ServiceConfig =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    cfg.resolve_paths(path);
    cfg.federation
        .validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(cfg)
}

/// Every problem of the service config at `path`, each with its line and column: serde's
/// (unknown keys, wrong types, missing fields), the federation's validation, and files it names
/// that are not there (the model, its spec beside it, the key, the broker's TLS files); or the
/// config, read as `serve` reads it.
pub fn check_config(path: &Path) -> std::result::Result<ServiceConfig, Vec<Finding>> {
    use unifed_net::config_check::{at_entry, check, missing_files};
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![at_entry(
            "",
            &[],
            format!("cannot read {}: {e}", path.display()),
        )]
    })?;
    let mut cfg: ServiceConfig = check(&text)?;
    cfg.resolve_paths(path);
    let mut found = Vec::new();
    if let Err(e) = cfg.federation.validate() {
        found.push(at_entry(
            &text,
            &["federation"],
            format!("[federation]: {e}"),
        ));
    }
    let spec = spec_path(&cfg.model);
    let mut entries: Vec<(&[&str], Option<&Path>, bool)> = vec![
        (&["model"], Some(&cfg.model), false),
        (&["model"], Some(&spec), false),
        (&["key"], Some(&cfg.key), false),
    ];
    let tls = cfg.broker.tls_files().map(|(k, p)| (["broker", k], p));
    entries.extend(tls.iter().map(|(k, p)| (k.as_slice(), *p, false)));
    found.extend(missing_files(&text, &entries, |p| {
        unifed_protocol::auth::credential_path(p).unwrap_or_else(|_| p.into())
    }));
    if found.is_empty() {
        Ok(cfg)
    } else {
        Err(found)
    }
}

/// The commented example service config, its paths made relative to the file `config init`
/// writes.
pub fn example_config() -> String {
    unifed_net::config_check::example(include_str!("../../configs/aggregator.toml"))
}

/// Reads the service config at `path`, validates it, and serves on a runtime of its own until
/// the federation has finished and lingered, or Ctrl-C; returns the final model version.
/// While it serves, the file's `revoked` list is re-read whenever the file changes. The process
/// allocates as a relay (`unifed_net::memory::Allocation::Relay`): chunk buffers reuse malloc's
/// heap instead of being mapped, faulted in and unmapped one by one; larger blocks are mapped
/// per use (see ARCHITECTURE.md).
pub fn serve_from_file(path: &Path) -> Result<u64> {
    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Relay);
    let cfg = read_config(path)?;
    unifed_net::block_on(serve(cfg, Some(path), async {
        unifed_net::service::stop_signal("unifed-aggregator").await;
    }))?
}

/// Puts the federation's state in the data folder of `cfg` aside, in `runs/<run>/` there, so
/// the next `serve` starts a new run (a later [`unifed_protocol::RunId`]: sites put their own
/// state of the earlier run aside when they hear of it). Refused while a service holds the
/// folder. Returns where the state went, or `None` when there was none.
pub fn new_run(cfg: &ServiceConfig) -> Result<Option<PathBuf>> {
    let dir = &cfg.data_dir;
    let _lock = unifed_net::service::StateLock::acquire(dir, "unifed-aggregator")?;
    let state = crate::store::Store::open(dir)?.load_state()?;
    let Some(state) = state else {
        return Ok(None);
    };
    let name = match state.run {
        Some(run) => run.to_string(),
        None => format!("before-{}", unifed_protocol::RunId::fresh()),
    };
    let to = dir.join("runs").join(name);
    std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let name = e.file_name();
        if name == unifed_net::service::StateLock::FILE || name == "runs" {
            continue;
        }
        std::fs::rename(e.path(), to.join(&name))
            .with_context(|| format!("moving {} to {}", e.path().display(), to.display()))?;
    }
    Ok(Some(to))
}

/// Follows the service's config file for changes to its revocation list.
struct Revocations {
    path: PathBuf,
    modified: Option<SystemTime>,
    checked: Instant,
}

impl Revocations {
    /// How often the file's modification time is looked at.
    const EVERY: Duration = Duration::from_secs(1);

    fn new(path: &Path) -> Self {
        Revocations {
            path: path.into(),
            modified: std::fs::metadata(path).and_then(|m| m.modified()).ok(),
            checked: Instant::now(),
        }
    }

    /// The new revocation list, when the file changed and still reads as a valid config.
    fn changed(&mut self) -> Option<Vec<unifed_protocol::PublicKey>> {
        if self.checked.elapsed() < Self::EVERY {
            return None;
        }
        self.checked = Instant::now();
        let m = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        if m == self.modified {
            return None;
        }
        self.modified = m;
        match read_config(&self.path) {
            Ok(c) => Some(c.federation.revoked),
            Err(e) => {
                tracing::warn!(error = %e, "the changed config does not read; the revocation list stays as it was");
                None
            }
        }
    }
}

/// Runs the federation until it has finished and lingered, or `shutdown` resolves; re-reads
/// the revocation list of `config` (the file `cfg` came from) when it changes. Returns the final
/// model version.
pub async fn serve(
    cfg: ServiceConfig,
    config: Option<&Path>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<u64> {
    // One aggregator per data folder, held until this returns.
    let _lock = unifed_net::service::StateLock::acquire(&cfg.data_dir, "unifed-aggregator")?;
    let key = SigningKey::load(&cfg.key).context("the aggregator's key")?;
    let initial = load_model(&cfg.model)?;
    let hash: SpecHash = initial.spec.hash();
    let core = Aggregator::open(
        &cfg.data_dir,
        cfg.federation.clone(),
        initial,
        cfg.chunk_bytes,
    )?;
    if core.finished() && cfg.federation.rounds <= core.round() {
        eprintln!(
            "unifed-aggregator: the federation in {} finished at round {} (run {}); it serves the \
             final model for linger_secs. Raise `rounds` above {} to go on from it, or run \
             `unifed-aggregator new-run --config` to start a new run.",
            cfg.data_dir.display(),
            core.round(),
            core.run(),
            core.round()
        );
    }
    let fed =
        Id::new(&cfg.federation.federation).map_err(|e| anyhow::anyhow!("federation: {e}"))?;
    let federation = Federation::new(core, Sealer::new(fed.clone(), hash, key), GATHER_MS);
    let topics = federation.topics().clone();
    let prefixes = Prefixes::new(&fed);
    // Update chunks go to threads of their own (`ingest`), the rest to this loop.
    let chunk_prefix = prefixes.update.clone();
    let (client, rx, chunks_rx) = spawn_event_loop_with_side(
        cfg.broker
            .options(&format!("unifed-aggregator-{fed}"), None)
            .map_err(anyhow::Error::msg)?,
        vec![
            topics.updates_filter(),
            format!("{}+", prefixes.request),
            topics.onboard_requests_filter(),
            topics.status_filter(),
        ],
        move |topic, payload| {
            topic.starts_with(&chunk_prefix)
                && Envelope::peek_kind(payload) == Some(MessageKind::UpdateChunk)
        },
    );
    let wire = Wire {
        client,
        topics,
        sealer: federation.sealer().clone(),
    };
    let ingest = start_ingest(&cfg, federation.core(), &wire, &prefixes, chunks_rx)?;
    let mut service = Service {
        entries: Default::default(),
        revocations: config.map(Revocations::new),
        federation,
        wire,
        prefixes,
        admission: ingest.admission,
        open: ingest.open,
        clock: Instant::now(),
        finished_at: None,
        holding: BTreeSet::new(),
        manifest_at: Instant::now(),
        connected_before: false,
        cfg,
    };
    let start = step(&mut service.federation, Event::Start, Instant::now())?;
    let from_ingest = (ingest.completed, ingest.resent);
    service.run(start, rx, from_ingest, shutdown).await
}

/// The topic prefixes the service tells sites' messages apart by.
struct Prefixes {
    update: String,
    request: String,
    onboard: String,
    status: String,
}

impl Prefixes {
    fn new(fed: &Id) -> Self {
        Prefixes {
            update: format!("unifed/v1/{fed}/update/"),
            request: format!("unifed/v1/{fed}/chunks/request/"),
            onboard: format!("unifed/v1/{fed}/onboard/request/"),
            status: format!("unifed/v1/{fed}/status/"),
        }
    }
}

/// What the ingest threads are told, and what they hand back.
struct Ingest {
    /// How sites' messages are opened (changes with the revocation list).
    admission: tokio::sync::watch::Sender<crate::core::Admission>,
    /// The round chunk sets may be of (its model version is what receipts name).
    open: tokio::sync::watch::Sender<crate::ingest::Rounds>,
    /// Complete uploads.
    completed: tokio::sync::mpsc::Receiver<crate::ingest::Complete>,
    /// First chunks of uploads of closed rounds.
    resent: tokio::sync::mpsc::Receiver<crate::ingest::Resent>,
}

/// `core`'s round, the model version it trains from, and whether it is open (not before the
/// first round, nor once the federation finished).
fn open_round(core: &Aggregator) -> crate::ingest::Rounds {
    let round = core.round();
    crate::ingest::Rounds {
        round,
        version: core.model_version(),
        open: round > 0 && !core.finished(),
    }
}

/// Starts the threads that take sites' update chunks: spooled to disk as they arrive, bounded
/// per site and in all, incomplete sets dropped after 10 minutes, each chunk receipted; the
/// model version their receipts name and their keys follow the service's loop.
fn start_ingest(
    cfg: &ServiceConfig,
    core: &Aggregator,
    wire: &Wire,
    prefixes: &Prefixes,
    chunks_rx: tokio::sync::mpsc::UnboundedReceiver<NetEvent>,
) -> Result<Ingest> {
    let incoming = cfg.data_dir.join("incoming");
    match std::fs::remove_dir_all(&incoming) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(anyhow::Error::new(e).context(format!("emptying {}", incoming.display())));
        }
        _ => {}
    }
    let per_site = upload_share(
        cfg.federation.max_update_bytes,
        cfg.max_upload_bytes,
        cfg.federation.sites.len(),
    );
    let (admission_tx, admission) = tokio::sync::watch::channel(core.admission().clone());
    let (open_tx, open) = tokio::sync::watch::channel(open_round(core));
    // Two complete updates per enrolled site may wait for the core (an honest site has one
    // per round).
    let (complete, completed) = tokio::sync::mpsc::channel(2 * cfg.federation.sites.len().max(1));
    // Re-sent first chunks past this many waiting are dropped (their sites send them again).
    let (resent, resents) = tokio::sync::mpsc::channel(64);
    // Each ingest thread spools its sites' uploads in a folder of its own.
    let enrolled: Vec<String> = cfg.federation.sites.iter().map(|s| s.id.clone()).collect();
    let shards = crate::ingest::Shards::for_sites(&enrolled);
    let mut ingests = Vec::with_capacity(shards.count());
    for k in 0..shards.count() {
        ingests.push(crate::ingest::Ingest {
            uploads: SpooledUploads::open(&incoming.join(k.to_string()), per_site, 600_000)?
                .with_disk_floor(cfg.federation.min_free_disk_bytes),
            admission: admission.clone(),
            open: open.clone(),
            limit: cfg.broker.max_packet_bytes + 4096,
            prefix: prefixes.update.clone(),
            complete: complete.clone(),
            resent: crate::ingest::ResentQueue::new(resent.clone()),
        });
    }
    drop((complete, resent));
    let receipts = std::sync::Arc::new(wire.clone());
    crate::ingest::spawn_sharded(
        ingests,
        shards,
        chunks_rx,
        move |(site, r): crate::ingest::Receipt| {
            // A chunk is taken only of the open round, from its model version.
            let (wire, version) = (receipts.clone(), open.borrow().version);
            async move {
                wire.send(
                    wire.topics.ack(&site),
                    MessageKind::UpdateReceipt,
                    (r.round, version),
                    &r,
                    false,
                )
                .await
            }
        },
    )
    .context("starting the ingest threads")?;
    Ok(Ingest {
        admission: admission_tx,
        open: open_tx,
        completed,
        resent: resents,
    })
}

/// The service's loop and what it keeps between events.
struct Service {
    cfg: ServiceConfig,
    federation: Federation,
    wire: Wire,
    prefixes: Prefixes,
    /// Registry entries arriving in chunks (small: one model's BN layers), reassembled per
    /// site: each enrolled site has room for two entries at once, whatever the others send.
    entries: std::collections::BTreeMap<String, unifed_protocol::chunking::Reassembler>,
    revocations: Option<Revocations>,
    admission: tokio::sync::watch::Sender<crate::core::Admission>,
    /// The round the ingest threads take chunk sets of.
    open: tokio::sync::watch::Sender<crate::ingest::Rounds>,
    /// The serving's clock starts here.
    clock: Instant,
    finished_at: Option<Instant>,
    /// The sites that said, after the federation finished, that they hold its final model.
    holding: BTreeSet<String>,
    manifest_at: Instant,
    connected_before: bool,
}

impl Service {
    fn ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// Handles events until the federation has finished and lingered, or `shutdown`.
    async fn run(
        &mut self,
        first: Step,
        mut rx: tokio::sync::mpsc::UnboundedReceiver<NetEvent>,
        (mut completed, mut resent): (
            tokio::sync::mpsc::Receiver<crate::ingest::Complete>,
            tokio::sync::mpsc::Receiver<crate::ingest::Resent>,
        ),
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<u64> {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tokio::pin!(shutdown);
        let mut pending = Some(first);
        loop {
            if let Some(step) = pending.take() {
                self.finish(step).await?;
            }
            let version = self.federation.core().model_version();
            if let Some(t) = self.finished_at {
                let every_site = self.every_site_holds_the_final_model();
                if every_site || t.elapsed() > Duration::from_secs(self.cfg.linger_secs) {
                    println!(
                        "stopping: {} of the sites hold the final model v{version}",
                        if every_site { "all" } else { "not all" }
                    );
                    Report::Stopped {
                        model_version: version,
                        every_site,
                        holding: self.holding.iter().cloned().collect(),
                    }
                    .emit();
                    return Ok(version);
                }
            }
            let gathering = self
                .federation
                .deadline()
                .map(|d| Duration::from_millis(d.saturating_sub(self.ms())));
            pending = tokio::select! {
                _ = &mut shutdown => return Ok(version),
                _ = tokio::time::sleep(gathering.unwrap_or_default()), if gathering.is_some() => {
                    let due = self.federation.due(self.ms());
                    self.wire.send_all(due).await?;
                    None
                }
                _ = tick.tick() => Some(self.tick().await?),
                done = completed.recv() => match done {
                    None => bail!("the threads taking update chunks stopped"),
                    Some(c) => self.uploads(c, &mut completed)?,
                },
                Some(r) = resent.recv() => {
                    let crate::ingest::Resent { site, round, hash } = r;
                    let event = Event::Resent { site, round, hash };
                    Some(step(&mut self.federation, event, Instant::now())?)
                }
                ev = rx.recv() => match ev {
                    None => bail!("the MQTT event loop stopped"),
                    Some(ev) => self.net(ev).await?,
                }
            };
        }
    }

    /// Sends a step's messages and reports what it did; folds the round it asks to fold once
    /// its answers are out (the last update's site is told at once and checkpoints while the
    /// round folds), and so on until a step asks for nothing more.
    async fn finish(&mut self, mut step: Step) -> Result<()> {
        loop {
            self.open.send_replace(open_round(self.federation.core()));
            self.wire.send_all(std::mem::take(&mut step.send)).await?;
            for done in std::mem::take(&mut step.done) {
                self.report(done);
            }
            if !step.close {
                return Ok(());
            }
            step = self::step(&mut self.federation, Event::Close, Instant::now())?;
        }
    }

    fn report(&mut self, done: Done) {
        match done {
            Done::Published {
                manifest,
                chunks,
                seconds,
                ..
            } => {
                let (round, version) = (manifest.round, manifest.model_version);
                tracing::info!(round, version, chunks, "published manifest");
                unifed_net::release_free_memory();
                // Model v closes round v: its publication is that round's last phase.
                report::phase_seconds(version, Phase::Publish, seconds);
                self.manifest_at = Instant::now();
            }
            Done::RoundClosed {
                round,
                sites,
                model_version,
            } => {
                println!(
                    "round {round} closed with {} update(s) -> model v{model_version}",
                    sites.len()
                );
                Report::RoundClosed {
                    round,
                    model_version,
                    sites,
                }
                .emit();
            }
            Done::Finished { model_version } => {
                println!("federation finished: model v{model_version}");
                self.finished_at = Some(Instant::now());
            }
        }
    }

    /// Every half second: the retained manifest again now and then, the revocation list
    /// re-read when its file changed, and the core's deadlines.
    async fn tick(&mut self) -> Result<Step> {
        let every = Duration::from_secs(self.cfg.manifest_every_secs.max(1));
        if self.manifest_at.elapsed() >= every
            && let Some(m) = self.federation.manifest()
        {
            self.wire.send_all(vec![m]).await?;
            self.manifest_at = Instant::now();
        }
        if let Some(revoked) = self.revocations.as_mut().and_then(Revocations::changed) {
            tracing::warn!(
                revoked = revoked.len(),
                "revocation list reloaded; other changes take effect at the next start"
            );
            unifed_net::report::Report::Revocations {
                revoked: revoked.len(),
            }
            .emit();
            self.federation.set_sharing(revoked.is_empty());
            self.federation.core_mut().set_revoked(revoked);
            self.admission
                .send_replace(self.federation.core().admission().clone());
        }
        step(&mut self.federation, Event::Tick, Instant::now())
    }

    /// Hands the core the complete uploads waiting with `first`, up to the number it checks
    /// side by side: their value checks and spool files run together (sites that finish
    /// training together upload together), and the memory they map is bounded whatever the
    /// number of sites.
    fn uploads(
        &mut self,
        first: crate::ingest::Complete,
        completed: &mut tokio::sync::mpsc::Receiver<crate::ingest::Complete>,
    ) -> Result<Option<Step>> {
        let t = Instant::now();
        let mut sets = vec![first];
        while sets.len() < VET_WIDTH
            && let Ok(c) = completed.try_recv()
        {
            sets.push(c);
        }
        // Each file becomes its spool file if the core accepts it; dropping the set removes
        // it otherwise. Mapping faults every page in (a millisecond or two for 57 MB), so off
        // the event loop.
        let batch: Vec<Incoming> = tokio::task::block_in_place(|| {
            sets.iter()
                .filter_map(|c| match c.set.read() {
                    Ok(bytes) => Some(Incoming {
                        site: c.site.clone(),
                        bytes,
                        arrival: Arrival::SignedChunks { hash: c.set.hash() },
                        staged: Some(c.set.path().to_path_buf()),
                    }),
                    Err(e) => {
                        tracing::warn!(site = c.site, error = %e, "update dropped");
                        None
                    }
                })
                .collect()
        });
        if batch.is_empty() {
            return Ok(None);
        }
        Ok(Some(step(&mut self.federation, Event::Updates(batch), t)?))
    }

    /// A network event: a reconnect, a whole update, a chunk request or an onboarding message.
    async fn net(&mut self, ev: NetEvent) -> Result<Option<Step>> {
        match ev {
            NetEvent::Connected => {
                // Re-publish the retained manifest after every reconnect: a restarted broker
                // keeps retained messages only in RAM. (The first connection sends the one
                // queued at start.)
                let again = std::mem::replace(&mut self.connected_before, true);
                if let (true, Some(m)) = (again, self.federation.manifest()) {
                    self.wire.send_all(vec![m]).await?;
                }
            }
            NetEvent::Disconnected(_) | NetEvent::Subscribed => {}
            NetEvent::Message { topic, payload } => {
                if let Some(site) = topic.strip_prefix(&self.prefixes.update) {
                    // Whole updates (chunks go to the ingest threads): the core opens them
                    // (once) and refuses what is not an update.
                    let update = Event::Update(Incoming {
                        site: site.to_string(),
                        bytes: payload,
                        arrival: Arrival::Message,
                        staged: None,
                    });
                    return Ok(Some(step(&mut self.federation, update, Instant::now())?));
                } else if let Some(site) = topic.strip_prefix(&self.prefixes.request) {
                    let now = self.ms();
                    let out = tokio::task::block_in_place(|| {
                        self.federation.chunk_request(site, &payload, now)
                    })?;
                    self.wire.send_all(out).await?;
                } else if let Some(site) = topic.strip_prefix(&self.prefixes.onboard) {
                    let site = site.to_string();
                    onboard(self, &site, &payload).await?;
                } else if let Some(site) = topic.strip_prefix(&self.prefixes.status) {
                    let site = site.to_string();
                    self.site_status(&site, &payload);
                }
            }
        }
        Ok(None)
    }

    /// Notes a site that says it holds the final model. Only a status sent after the federation
    /// finished counts (a retained one of an earlier run with the same id came before); one
    /// that is not the site's own signed status is logged and dropped.
    fn site_status(&mut self, site: &str, payload: &[u8]) {
        if self.finished_at.is_none() {
            return;
        }
        let Ok(id) = Id::new(site) else {
            return;
        };
        let admitted = self
            .federation
            .core()
            .admission()
            .admit(&id, payload, STATUS_LIMIT);
        // A site says `online` or `offline` before it follows a run: not for this one.
        if matches!(admitted, Err(crate::core::AdmitError::OtherRun { .. })) {
            return;
        }
        let status = admitted
            .map_err(|e| e.to_string())
            .and_then(|env| match env.kind {
                MessageKind::SiteStatus => {
                    env.payload_as::<SiteStatus>().map_err(|e| e.to_string())
                }
                other => Err(format!("a {other:?} on the status topic")),
            });
        match status {
            Ok(SiteStatus {
                state: SiteState::Finished { model_version },
                ..
            }) if model_version == self.federation.core().model_version() => {
                self.holding.insert(site.to_string());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(site = %id, error = %e, "site status refused"),
        }
    }

    /// Whether every enrolled site whose key is not revoked said it holds the final model.
    fn every_site_holds_the_final_model(&self) -> bool {
        self.federation
            .core()
            .config()
            .unrevoked_sites()
            .all(|s| self.holding.contains(&s.id))
    }
}

/// The largest site status taken (a status is a few hundred bytes).
const STATUS_LIMIT: usize = 4096;

/// Hands the federation `event`; reports its updates' spool (from `t`, which may be before
/// they were read; updates taken together are one spool), and the fold of a round it closes.
fn step(federation: &mut Federation, event: Event, t: Instant) -> Result<Step> {
    let update = matches!(event, Event::Update(_) | Event::Updates(_));
    let round = federation.core().round();
    let step = tokio::task::block_in_place(|| federation.handle(event, now_ms()))?;
    let closed = step
        .done
        .iter()
        .any(|d| matches!(d, Done::RoundClosed { .. }));
    if closed || update {
        unifed_net::release_free_memory();
        report::phase(round, if closed { Phase::Fold } else { Phase::Spool }, t);
    }
    Ok(step)
}

/// Handles a message on a site's onboarding topic: a package description or registry entry
/// asked for, or a chunk of a registry entry to store. Bad input is logged and answered where
/// it can be, never fatal.
async fn onboard(service: &mut Service, site: &str, payload: &[u8]) -> Result<()> {
    let Service {
        cfg,
        federation,
        wire,
        entries,
        ..
    } = service;
    let Ok(site) = Id::new(site) else {
        return Ok(());
    };
    let env = match federation.core().admission().admit(
        &site,
        payload,
        cfg.broker.max_packet_bytes + 4096,
    ) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(site = %site, error = %e, "onboarding message refused");
            return Ok(());
        }
    };
    let at = (0, federation.core().model_version());
    let reply = wire.topics.onboard_reply(&site);
    match env.kind {
        MessageKind::OnboardRequest => match env.payload_as::<OnboardRequest>() {
            Ok(OnboardRequest::Package { model_version }) => {
                let r = match tokio::task::block_in_place(|| federation.package(model_version))? {
                    Ok(info) => OnboardReply::Package(info),
                    Err(e) => OnboardReply::Error(e),
                };
                wire.send(reply, MessageKind::OnboardReply, at, &r, false)
                    .await?;
            }
            Ok(OnboardRequest::RegistryGet { model_version }) => {
                match federation.core().registry_get(&site, model_version)? {
                    Ok(bytes) => {
                        for c in unifed_protocol::chunking::split(&bytes, cfg.chunk_bytes) {
                            wire.send(reply.clone(), MessageKind::RegistryEntry, at, &c, false)
                                .await?;
                        }
                    }
                    Err(e) => {
                        let r = OnboardReply::Error(e);
                        wire.send(reply, MessageKind::OnboardReply, at, &r, false)
                            .await?;
                    }
                }
            }
            Err(e) => tracing::warn!(site = %site, error = %e, "bad onboarding request ignored"),
        },
        MessageKind::RegistryPut => {
            let max_entry = federation.core().max_entry_bytes();
            let entries = entries.entry(site.to_string()).or_insert_with(|| {
                unifed_protocol::chunking::Reassembler::new(120_000, 2 * max_entry)
                    .with_max_payload(max_entry)
            });
            let done = env
                .payload_as::<ChunkRef>()
                .map_err(|e| e.to_string())
                .and_then(|c| entries.insert(c, now_ms()).map_err(|e| e.to_string()));
            entries.expire(now_ms());
            match done {
                Ok(Some(bytes)) => {
                    let r = federation.core().registry_put(&site, &bytes, now_ms())?;
                    tracing::info!(site = %site, reply = ?r, "registry entry");
                    wire.send(reply, MessageKind::OnboardReply, at, &r, false)
                        .await?;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(site = %site, error = %e, "registry chunk dropped"),
            }
        }
        k => {
            tracing::warn!(site = %site, kind = ?k, "unexpected message on an onboarding topic ignored")
        }
    }
    Ok(())
}
