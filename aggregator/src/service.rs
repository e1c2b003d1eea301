//! The aggregator service: the federation core on MQTT. One task owns the MQTT event loop
//! (`unifed_net`); this task feeds the core with updates and ticks, publishes the retained
//! manifest, serves model chunks on request and answers every update on the site's ack topic.

use crate::config::FederationConfig;
use crate::core::{Action, Aggregator, Arrival, Event, GlobalModel, Incoming, VET_WIDTH};
use crate::serving::{Route, Serving, To};
use crate::uploads::SpooledUploads;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unifed_net::report::{self, Phase, Report};
use unifed_net::{BrokerConfig, NetEvent, Qos, spawn_event_loop_with_side};
use unifed_protocol::auth::SigningKey;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    ChunkRef, ChunkRequest, OnboardReply, OnboardRequest, PackageInfo, Payload, RoundManifest,
    UpdateAnswer,
};
use unifed_protocol::topics::Topics;
use unifed_protocol::{Cut, ModelSpec, SpecHash};

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
    /// Seconds to keep serving the final model after the last round.
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

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Served {
    manifest: RoundManifest,
    /// The model's chunks as signed envelopes, signed once per version; shared with the MQTT
    /// client (`publish_bytes`), so serving a chunk copies it into no new buffer.
    chunks: Vec<bytes::Bytes>,
    /// The chunks of the model's delta from the previous version, signed likewise (empty when
    /// the manifest announces none).
    delta_chunks: Vec<bytes::Bytes>,
}

impl Served {
    /// The chunks of `payload` of model `version`, if this is that version's (packages are
    /// not served from here).
    fn chunks_of(&self, (version, payload): (u64, Payload)) -> Option<&[bytes::Bytes]> {
        match payload {
            _ if version != self.manifest.model_version => None,
            Payload::Model => Some(&self.chunks),
            Payload::Delta => Some(&self.delta_chunks),
            Payload::Package => None,
        }
    }
}

/// How long the first requests for a new model are gathered before its chunks are shared,
/// unless every enrolled site asked sooner (see [`crate::serving`]).
const GATHER_MS: u64 = 20;
/// Chunks served per request at most (sites ask for windows of 16).
const MAX_CHUNKS_PER_REQUEST: usize = 64;
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

/// The last onboarding package built (packages of a version never change).
struct Package {
    info: PackageInfo,
    /// Its chunks as signed envelopes.
    chunks: Vec<bytes::Bytes>,
}

/// What every message the aggregator publishes shares: client, topics, ids, spec hash, and
/// the key that signs it.
#[derive(Clone)]
struct Wire {
    client: unifed_net::Client,
    topics: Topics,
    fed: Id,
    me: Id,
    hash: SpecHash,
    key: SigningKey,
}

impl Wire {
    /// `payload` as a signed `kind` envelope.
    fn seal(
        &self,
        kind: MessageKind,
        (round, version): (u64, u64),
        payload: &impl Serialize,
    ) -> Vec<u8> {
        let unsigned = Envelope::encode_new(
            kind,
            &self.fed,
            &self.me,
            (round, version),
            self.hash,
            payload,
        );
        self.key
            .sign_encoded(unsigned)
            .expect("encode_new writes an unsigned envelope")
    }

    /// Every chunk of `cut` as a signed `ModelChunk` envelope, written one after another into
    /// one buffer that they share: no buffer per chunk, and a streamed model written straight
    /// from its tensors, through one chunk-sized buffer, into its envelopes.
    fn seal_chunks(&self, at: (u64, u64), cut: &Cut) -> Vec<bytes::Bytes> {
        // Room for every envelope around its chunk (a chunk's packet fits 256 KiB with its
        // data 1 KiB below it: see `CHUNK_BYTES`), so the buffer never moves.
        let mut buf = Vec::with_capacity(cut.len() + cut.count() as usize * 1024);
        let mut ends = Vec::with_capacity(cut.count() as usize);
        cut.for_each_chunk(|c| {
            let start = buf.len();
            Envelope::append_new(
                &mut buf,
                MessageKind::ModelChunk,
                &self.fed,
                &self.me,
                at,
                self.hash,
                &c,
            );
            self.key
                .sign_tail(&mut buf, start)
                .expect("append_new writes an unsigned envelope");
            ends.push(buf.len());
        });
        let all = bytes::Bytes::from(buf);
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let b = all.slice(start..end);
                start = end;
                b
            })
            .collect()
    }

    /// Publishes `payload` as a signed `kind` envelope on `topic` (QoS 1).
    async fn send(
        &self,
        topic: String,
        kind: MessageKind,
        at: (u64, u64),
        payload: &impl Serialize,
        retain: bool,
    ) -> Result<()> {
        let bytes = self.seal(kind, at, payload);
        self.client
            .publish(topic, Qos::AtLeastOnce, retain, bytes)
            .await?;
        Ok(())
    }
}

/// Reads and validates the service config at `path`.
pub fn read_config(path: &Path) -> Result<ServiceConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: ServiceConfig =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    cfg.federation
        .validate()
        .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.join("; ")))?;
    Ok(cfg)
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
        unifed_net::stop_signal().await;
    }))?
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
    let mut revocations = config.map(Revocations::new);
    let key = SigningKey::load(&cfg.key).context("the aggregator's key")?;
    let initial = load_model(&cfg.model)?;
    let hash: SpecHash = initial.spec.hash();
    let mut core = Aggregator::open(
        &cfg.data_dir,
        cfg.federation.clone(),
        initial,
        cfg.chunk_bytes,
    )?;
    let fed =
        Id::new(&cfg.federation.federation).map_err(|e| anyhow::anyhow!("federation: {e}"))?;
    let me = Id::new(unifed_protocol::AGGREGATOR_ID).expect("valid id");
    let topics = Topics::new(&fed);
    let update_prefix = format!("unifed/v1/{fed}/update/");
    let request_prefix = format!("unifed/v1/{fed}/chunks/request/");
    let onboard_prefix = format!("unifed/v1/{fed}/onboard/request/");
    // Update chunks go to a task of their own (`ingest`), the rest to this loop.
    let chunk_prefix = update_prefix.clone();
    let (client, mut rx, chunks_rx) = spawn_event_loop_with_side(
        cfg.broker
            .options(&format!("unifed-aggregator-{fed}"), None)
            .map_err(anyhow::Error::msg)?,
        vec![
            topics.updates_filter(),
            format!("{request_prefix}+"),
            topics.onboard_requests_filter(),
        ],
        move |topic, payload| {
            topic.starts_with(&chunk_prefix)
                && Envelope::peek_kind(payload) == Some(MessageKind::UpdateChunk)
        },
    );
    let wire = Wire {
        client,
        topics: topics.clone(),
        fed: fed.clone(),
        me,
        hash,
        key,
    };
    let mut served: Option<Served> = None;
    let mut package: Option<Package> = None;
    // Registry entries arrive in chunks too (small: one model's BN layers).
    let mut entries =
        unifed_protocol::chunking::Reassembler::new(120_000, 16 * core.max_entry_bytes())
            .with_max_payload(core.max_entry_bytes());
    // Chunked uploads spooled to disk as they arrive: bounded per site and in all, incomplete
    // sets dropped after 10 minutes. Their chunks are taken, and receipted, by threads of their
    // own; the model version their receipts name and their keys follow this loop's.
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
    let (version_tx, version) = tokio::sync::watch::channel(core.model_version());
    // Two complete updates per enrolled site may wait for the core (an honest site has one
    // per round).
    let (complete, mut completed) =
        tokio::sync::mpsc::channel(2 * cfg.federation.sites.len().max(1));
    // Each ingest thread spools its sites' uploads in a folder of its own.
    let enrolled: Vec<String> = cfg.federation.sites.iter().map(|s| s.id.clone()).collect();
    let shards = crate::ingest::Shards::for_sites(&enrolled);
    let mut ingests = Vec::with_capacity(shards.count());
    for k in 0..shards.count() {
        ingests.push(crate::ingest::Ingest {
            uploads: SpooledUploads::open(&incoming.join(k.to_string()), per_site, 600_000)?,
            admission: admission.clone(),
            limit: cfg.broker.max_packet_bytes + 4096,
            prefix: update_prefix.clone(),
            complete: complete.clone(),
        });
    }
    drop(complete);
    let receipts = std::sync::Arc::new(wire.clone());
    crate::ingest::spawn_sharded(
        ingests,
        shards,
        chunks_rx,
        move |(site, r): crate::ingest::Receipt| {
            let (wire, version) = (receipts.clone(), *version.borrow());
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
    let mut serving = Serving::new(cfg.federation.sites.len(), GATHER_MS);
    // A revoked site may still be connected to the broker and read the shared topic (brokers'
    // ACLs do not follow the revocation list): while any key is revoked, each site is sent
    // its chunks alone, and a revoked one none.
    serving.set_sharing(cfg.federation.revoked.is_empty());
    let clock = Instant::now();
    let ms = move || clock.elapsed().as_millis() as u64;
    let mut finished_at: Option<Instant> = None;
    let mut manifest_at = Instant::now();
    let mut connected_before = false;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tokio::pin!(shutdown);
    let mut pending = tokio::task::block_in_place(|| core.handle(Event::Start, now_ms()))?;
    loop {
        version_tx.send_replace(core.model_version());
        let mut close = false;
        for action in pending.drain(..) {
            match action {
                // After the answers before it: the last update's site is told at once and
                // checkpoints while the round folds.
                Action::Close => close = true,
                Action::Answer {
                    site,
                    round,
                    update_hash,
                    answer,
                } => {
                    wire.send(
                        topics.ack(&site),
                        MessageKind::UpdateAnswer,
                        (round, core.model_version()),
                        &UpdateAnswer {
                            round,
                            update_hash,
                            answer,
                        },
                        false,
                    )
                    .await?;
                }
                Action::Publish {
                    manifest,
                    model,
                    delta,
                } => {
                    let publishing = Instant::now();
                    wire.send(
                        topics.manifest(),
                        MessageKind::RoundManifest,
                        (manifest.round, manifest.model_version),
                        &manifest,
                        true,
                    )
                    .await?;
                    tracing::info!(
                        round = manifest.round,
                        version = manifest.model_version,
                        chunks = model.count(),
                        "published manifest"
                    );
                    let at = (manifest.round, manifest.model_version);
                    // The old version's chunks go before the new ones are sealed, each payload
                    // as soon as its chunks are: the payload and its envelopes at most at once.
                    drop(served.take());
                    let (chunks, delta_chunks) = tokio::task::block_in_place(|| {
                        let chunks = wire.seal_chunks(at, &model);
                        drop(model);
                        let delta = delta.map(|d| wire.seal_chunks(at, &d));
                        (chunks, delta.unwrap_or_default())
                    });
                    unifed_net::release_free_memory();
                    // Model v closes round v: its publication is that round's last phase.
                    report::phase(manifest.model_version, Phase::Publish, publishing);
                    served = Some(Served {
                        manifest,
                        chunks,
                        delta_chunks,
                    });
                    // A new version: what was served of the old one is of no more use.
                    serving.clear();
                    manifest_at = Instant::now();
                }
                Action::RoundClosed {
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
                Action::Finished { model_version } => {
                    println!("federation finished: model v{model_version}");
                    finished_at = Some(Instant::now());
                }
            }
        }
        if close {
            pending = step(&mut core, Event::Close, Instant::now())?;
            continue;
        }
        if finished_at.is_some_and(|t| t.elapsed() > Duration::from_secs(cfg.linger_secs)) {
            return Ok(core.model_version());
        }
        let gathering = serving
            .deadline()
            .map(|d| Duration::from_millis(d.saturating_sub(ms())));
        tokio::select! {
            _ = &mut shutdown => return Ok(core.model_version()),
            _ = tokio::time::sleep(gathering.unwrap_or_default()), if gathering.is_some() => {
                share_due(&wire, served.as_ref(), &mut serving, ms()).await?;
            }
            _ = tick.tick() => {
                if let Some(s) = &served
                    && manifest_at.elapsed() >= Duration::from_secs(cfg.manifest_every_secs.max(1))
                {
                    wire.send(topics.manifest(), MessageKind::RoundManifest, (s.manifest.round, s.manifest.model_version), &s.manifest, true).await?;
                    manifest_at = Instant::now();
                }
                if let Some(revoked) = revocations.as_mut().and_then(Revocations::changed) {
                    tracing::warn!(revoked = revoked.len(), "revocation list reloaded; other changes take effect at the next start");
                    serving.set_sharing(revoked.is_empty());
                    core.set_revoked(revoked);
                    admission_tx.send_replace(core.admission().clone());
                }
                pending = step(&mut core, Event::Tick, Instant::now())?;
            }
            done = completed.recv() => match done {
                None => bail!("the threads taking update chunks stopped"),
                Some(c) => {
                    let t = Instant::now();
                    // The core takes the updates waiting with this one at once, up to the
                    // number it checks side by side: their value checks and spool files run
                    // together (sites that finish training together upload together), and
                    // the memory they map is bounded whatever the number of sites.
                    let mut sets = vec![c];
                    while sets.len() < VET_WIDTH && let Ok(c) = completed.try_recv() {
                        sets.push(c);
                    }
                    // Each file becomes its spool file if the core accepts it; dropping the
                    // set removes it otherwise. Mapping faults every page in (a millisecond or
                    // two for 57 MB), so off the event loop.
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
                    if !batch.is_empty() {
                        pending = step(&mut core, Event::Updates(batch), t)?;
                    }
                }
            },
            ev = rx.recv() => match ev {
                None => bail!("the MQTT event loop stopped"),
                Some(NetEvent::Connected) => {
                    // Re-publish the retained manifest after every reconnect: a restarted broker
                    // keeps retained messages only in RAM. (The first connection sends the one
                    // queued at start.)
                    let again = std::mem::replace(&mut connected_before, true);
                    if let (true, Some(s)) = (again, &served) {
                        wire.send(topics.manifest(), MessageKind::RoundManifest, (s.manifest.round, s.manifest.model_version), &s.manifest, true).await?;
                    }
                }
                Some(NetEvent::Disconnected(_)) => {}
                Some(NetEvent::Message { topic, payload }) => {
                    if let Some(site) = topic.strip_prefix(&update_prefix) {
                        // Whole updates (chunks go to the ingest threads): the core opens them
                        // (once) and refuses what is not an update.
                        let update = Event::Update(Incoming { site: site.to_string(), bytes: payload, arrival: Arrival::Message, staged: None });
                        pending = step(&mut core, update, Instant::now())?;
                    } else if let Some(site) = topic.strip_prefix(&request_prefix) {
                        serve_chunks(&wire, site, &payload, served.as_ref(), &core, &mut package, (&mut serving, ms())).await?;
                        share_due(&wire, served.as_ref(), &mut serving, ms()).await?;
                    } else if let Some(site) = topic.strip_prefix(&onboard_prefix) {
                        onboard(&wire, &cfg, &core, &mut package, &mut entries, site, &payload).await?;
                    }
                }
            }
        }
    }
}

/// Hands the core `event`; reports its updates' spool (from `t`, which may be before they
/// were read; updates taken together are one spool), and the fold of a round it closes.
fn step(core: &mut Aggregator, event: Event, t: Instant) -> Result<Vec<Action>> {
    let update = matches!(event, Event::Update(_) | Event::Updates(_));
    let round = core.round();
    let pending = tokio::task::block_in_place(|| core.handle(event, now_ms()))?;
    let closed = pending
        .iter()
        .any(|a| matches!(a, Action::RoundClosed { .. }));
    if closed || update {
        unifed_net::release_free_memory();
        report::phase(round, if closed { Phase::Fold } else { Phase::Spool }, t);
    }
    Ok(pending)
}

/// Serves the chunks a site asked for: of the round model, on the topic every site reads the
/// first time anyone asks and to the site alone after that (see [`crate::serving`]), or of an
/// onboarding package, to the site alone.
async fn serve_chunks(
    wire: &Wire,
    site: &str,
    payload: &[u8],
    served: Option<&Served>,
    core: &Aggregator,
    package: &mut Option<Package>,
    (serving, now_ms): (&mut Serving, u64),
) -> Result<()> {
    let Ok(site) = Id::new(site) else {
        return Ok(());
    };
    let req: ChunkRequest = match core
        .admission()
        .admit(&site, payload, 1 << 20)
        .and_then(|e| e.payload_as().map_err(|e| e.to_string()))
    {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(site = %site, error = %e, "chunk request refused");
            return Ok(());
        }
    };
    let chunks = match req.payload {
        Payload::Package => {
            if tokio::task::block_in_place(|| {
                cached_package(wire, core, package, Some(req.model_version))
            })?
            .is_err()
            {
                return Ok(());
            }
            &package.as_ref().expect("just built").chunks
        }
        Payload::Model | Payload::Delta => {
            match served.and_then(|s| s.chunks_of((req.model_version, req.payload))) {
                Some(c) => c,
                None => return Ok(()),
            }
        }
    };
    // At most a window's worth per request, each chunk once: a request cannot make the service
    // flood the broker.
    let indices: std::collections::BTreeSet<u32> = if req.indices.is_empty() {
        (0..chunks.len() as u32)
            .take(MAX_CHUNKS_PER_REQUEST)
            .collect()
    } else {
        req.indices
            .into_iter()
            .take(MAX_CHUNKS_PER_REQUEST)
            .collect()
    };
    let mut refused = 0;
    for i in indices {
        let Some(c) = chunks.get(i as usize) else {
            continue;
        };
        let topic = match serving.route(
            &site,
            (req.model_version, req.payload),
            (i as usize, chunks.len()),
            req.alone,
            now_ms,
        ) {
            Route::Shared => wire.topics.model_chunks(),
            Route::Site => wire.topics.chunk_reply(&site),
            Route::OnItsWay | Route::Gathered => continue,
            Route::Refused => {
                refused += 1;
                continue;
            }
        };
        wire.client
            .publish_bytes(topic, Qos::AtLeastOnce, false, c.clone())
            .await?;
    }
    if refused > 0 {
        tracing::warn!(site = %site, version = req.model_version, refused, "chunks asked for too often were not served again");
    }
    Ok(())
}

/// Sends the round model's chunks whose first requests were gathered (see
/// [`crate::serving`]): on the topic every site reads, or to each site that asked alone.
async fn share_due(
    wire: &Wire,
    served: Option<&Served>,
    serving: &mut Serving,
    now_ms: u64,
) -> Result<()> {
    for (at, to, indices) in serving.due(now_ms) {
        let Some(chunks) = served.and_then(|s| s.chunks_of(at)) else {
            continue;
        };
        let topic = match &to {
            To::All => wire.topics.model_chunks(),
            To::Site(site) => wire.topics.chunk_reply(site),
        };
        for c in indices.iter().filter_map(|&i| chunks.get(i as usize)) {
            wire.client
                .publish_bytes(topic.clone(), Qos::AtLeastOnce, false, c.clone())
                .await?;
        }
    }
    Ok(())
}

/// Handles a message on a site's onboarding topic: a package description or registry entry
/// asked for, or a chunk of a registry entry to store. Bad input is logged and answered where
/// it can be, never fatal.
async fn onboard(
    wire: &Wire,
    cfg: &ServiceConfig,
    core: &Aggregator,
    package: &mut Option<Package>,
    entries: &mut unifed_protocol::chunking::Reassembler,
    site: &str,
    payload: &[u8],
) -> Result<()> {
    let Ok(site) = Id::new(site) else {
        return Ok(());
    };
    let env = match core
        .admission()
        .admit(&site, payload, cfg.broker.max_packet_bytes + 4096)
    {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(site = %site, error = %e, "onboarding message refused");
            return Ok(());
        }
    };
    let at = (0, core.model_version());
    let reply = wire.topics.onboard_reply(&site);
    match env.kind {
        MessageKind::OnboardRequest => match env.payload_as::<OnboardRequest>() {
            Ok(OnboardRequest::Package { model_version }) => {
                let r = match tokio::task::block_in_place(|| {
                    cached_package(wire, core, package, model_version)
                })? {
                    Ok(info) => OnboardReply::Package(info),
                    Err(e) => OnboardReply::Error(e),
                };
                wire.send(reply, MessageKind::OnboardReply, at, &r, false)
                    .await?;
            }
            Ok(OnboardRequest::RegistryGet { model_version }) => {
                match core.registry_get(&site, model_version)? {
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
            let done = env
                .payload_as::<ChunkRef>()
                .map_err(|e| e.to_string())
                .and_then(|c| entries.insert(c, now_ms()).map_err(|e| e.to_string()));
            entries.expire(now_ms());
            match done {
                Ok(Some(bytes)) => {
                    let r = core.registry_put(&site, &bytes, now_ms())?;
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

/// The onboarding package of `version` (the newest when `None`), built once and kept until
/// another version is asked for.
fn cached_package(
    wire: &Wire,
    core: &Aggregator,
    cache: &mut Option<Package>,
    version: Option<u64>,
) -> Result<Result<PackageInfo, unifed_protocol::messages::OnboardError>> {
    let v = version.unwrap_or(core.model_version());
    if let Some(p) = cache.as_ref()
        && p.info.model_version == v
    {
        return Ok(Ok(p.info.clone()));
    }
    Ok(match core.package(Some(v))? {
        Ok((info, chunks)) => {
            let chunks = chunks
                .iter()
                .map(|c| wire.seal(MessageKind::ModelChunk, (0, v), c).into())
                .collect();
            *cache = Some(Package {
                info: info.clone(),
                chunks,
            });
            Ok(info)
        }
        Err(e) => Err(e),
    })
}
