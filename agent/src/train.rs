//! `unifed-agent train`: the on-device trainer on MQTT. It follows the retained round manifest,
//! fetches each new model by its chunks (re-requesting missing ones), applies the non-BN weights
//! (every tensor under `global` BN) while its own BN layers and statistics stay on the device,
//! trains when its round opens, uploads its delta in the federation's encoding and re-sends it
//! until the aggregator answers. It checkpoints after every model and answer, so a restarted
//! agent resumes.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use unifed_models::backend::{Backend, Device};
use unifed_models::checkpoint;
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes, load_labelled};
use unifed_models::site::Site;
use unifed_models::state::{Select, export, import};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_net::{BrokerConfig, NetEvent, Qos, Will, spawn_event_loop};
use unifed_protocol::ModelSpec;
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    Answer, ChunkRequest, RoundManifest, ServerBroadcast, SiteState, SiteStatus, UpdateAnswer,
    UpdateReceipt,
};
use unifed_protocol::topics::Topics;

use crate::progress::{Report, training_bar};
use crate::registry::Owner;
use crate::uplink::{Uplink, Upload};
use unifed_protocol::BnSharing;

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
    /// Compute backend.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Model architecture (the digits CNN; widths configurable).
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
    /// BN of a site joining a running federation (its first model is past version 0) under
    /// `local` BN: `calibrate` (default) re-estimates the statistics on its own training images
    /// before it trains; `fresh` keeps the never-trained statistics.
    #[serde(default)]
    pub join_bn: JoinBn,
    /// File holding the site's registry key (64 hex digits, from `unifed-agent keygen`): seals
    /// the calibrated BN this site registers with the aggregator. Only the site's devices hold it.
    #[serde(default)]
    pub site_key: Option<PathBuf>,
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

    /// The site's model (seeded, as every site and the initial model are) and its spec.
    pub fn model_and_spec(&self, device: &Device) -> Result<(DigitsCnn, ModelSpec)> {
        self.model.validate().map_err(anyhow::Error::msg)?;
        let mc = ModelConfig::fedbn_digits();
        let net = seeded(device, 0, |d| self.model.init(d));
        let spec = spec_of(&net, &mc.classes, &mc.input);
        Ok((net, spec))
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

fn default_backend() -> String {
    "flex".into()
}

fn default_resend() -> u64 {
    10
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Progress {
    applied_version: Option<u64>,
    answered_rounds: Vec<u64>,
}

fn load_data(cfg: &AgentConfig, spec: &ModelSpec) -> Result<(Dataset, Dataset)> {
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
    let (info, state) =
        crate::registry::fetch_package(&cfg.broker, owner, spec, Some(version), |_, _| {}).await?;
    let sd = state.filter(Select::Bn);
    let sites: Vec<&str> = info.bn_sites.iter().map(|x| x.as_str()).collect();
    Ok((
        sd,
        format!("{} of {}", info.bn_sharing.name(), sites.join(", ")),
    ))
}

/// Reads the agent config at `path`, caps the CPU threads at the config's `threads` unless the
/// caller already capped them (`capped`), and runs the agent on its own runtime until the
/// federation finishes; returns the final test accuracy.
pub fn run_from_file(path: &std::path::Path, capped: bool) -> Result<f64> {
    let cfg = load_config(path)?;
    if let (false, Some(t)) = (capped, cfg.threads) {
        unifed_models::backend::cap_cpu_threads(t)
            .map_err(|e| anyhow::anyhow!("{}: threads: {e}", path.display()))?;
    }
    unifed_net::block_on(run(cfg))?
}

/// Runs the agent until the federation finishes; returns the site's final test accuracy.
pub async fn run(cfg: AgentConfig) -> Result<f64> {
    let (site_id, fed) = cfg.ids()?;
    let backend: Backend = cfg.backend.parse().map_err(anyhow::Error::msg)?;
    let device: Device = backend.device().map_err(anyhow::Error::msg)?;
    let (net, spec) = cfg.model_and_spec(&device)?;
    let (train, test) = load_data(&cfg, &spec)?;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    let ckpt = cfg.state_dir.join("model.safetensors");
    let residual_path = cfg.state_dir.join("residual.bin");
    let progress_path = cfg.state_dir.join("progress.json");
    let mut progress: Progress = match std::fs::read(&progress_path) {
        Ok(b) => serde_json::from_slice(&b)
            .with_context(|| format!("parsing {}", progress_path.display()))?,
        Err(_) => Progress::default(),
    };
    let resumed = ckpt.exists();
    let net = if resumed {
        let state = checkpoint::load(&ckpt, &spec)?;
        import(&net, &spec, &state, Select::All)?
    } else {
        progress = Progress::default();
        net
    };
    let mut site: Option<Site<DigitsCnn>> = Some(Site::new(&cfg.site, net, train, test)?);
    if resumed {
        // The error-feedback residual of the last accepted update (none under exact f32).
        site.as_mut()
            .expect("site present")
            .load_residual(&residual_path, &spec)?;
    }
    let topics = Topics::new(&fed);
    let status = |state: SiteState, detail: &str| {
        Envelope::new(
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
        )
        .encode()
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
        vec![
            topics.manifest(),
            topics.chunk_reply(&site_id),
            topics.ack(&site_id),
        ],
    );
    let uplink = Uplink {
        client: client.clone(),
        topic: topics.update(&site_id),
        fed: fed.clone(),
        site: site_id.clone(),
        hash: spec.hash(),
        max_packet: cfg.broker.max_packet_bytes,
    };
    let mut manifest: Option<RoundManifest> = None;
    let mut reasm = Reassembler::new(120_000, 1 << 31);
    let mut last_request: Option<Instant> = None;
    let mut outstanding: std::collections::BTreeSet<u32> = Default::default();
    // Chunks asked for at a time: the broker keeps only a few packets per topic in memory, so
    // a whole model requested at once would overrun a slow subscriber.
    const WINDOW: usize = 16;
    let mut pending: Option<Upload> = None;
    let resend = Duration::from_secs(cfg.resend_secs);
    let mut fetch_started: Option<Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let t0 = Instant::now();
    let save = |site: &Site<DigitsCnn>, progress: &Progress| -> Result<()> {
        checkpoint::save(&ckpt, &export(&site.net, &spec, Select::All), &spec)?;
        site.save_residual(&residual_path)?;
        std::fs::write(&progress_path, serde_json::to_vec_pretty(progress)?)?;
        Ok(())
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            ev = rx.recv() => match ev {
                None => bail!("the MQTT event loop stopped"),
                Some(NetEvent::Connected) => {
                    client.publish(topics.status(&site_id), Qos::AtLeastOnce, true, status(SiteState::Online, "")).await?;
                    // Chunks in flight when the connection dropped are lost: send them again now.
                    if let Some(p) = &mut pending {
                        p.reconnected();
                    }
                }
                Some(NetEvent::Disconnected(_)) => {}
                Some(NetEvent::Message { topic, payload }) => {
                    // Bad input from the network is logged and dropped here: only local
                    // failures end the agent.
                    let env = match Envelope::decode(&payload) {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(topic, error = %e, "undecodable message dropped");
                            continue;
                        }
                    };
                    if env.federation != fed || env.sender.as_str() != unifed_protocol::AGGREGATOR_ID {
                        tracing::warn!(topic, federation = %env.federation, sender = %env.sender, "message from another federation or sender dropped");
                        continue;
                    }
                    match env.kind {
                        MessageKind::RoundManifest => {
                            let m: RoundManifest = match env.payload_as() {
                                Ok(m) => m,
                                Err(e) => {
                                    tracing::warn!(topic, error = %e, "malformed manifest dropped");
                                    continue;
                                }
                            };
                            if m.spec_hash != spec.hash() || env.spec_hash != spec.hash() {
                                tracing::warn!(theirs = %m.spec_hash, ours = %spec.hash(), "a manifest for another model spec dropped (check [model] if the federation's spec differs)");
                                continue;
                            }
                            if let Err(e) = m.plan.objective.validate() {
                                tracing::warn!(error = %e, "a manifest with an invalid plan dropped");
                                continue;
                            }
                            manifest = Some(m);
                        }
                        MessageKind::ModelChunk => {
                            let chunk: unifed_protocol::messages::Chunk = match env.payload_as() {
                                Ok(c) => c,
                                Err(e) => {
                                    tracing::warn!(topic, error = %e, "malformed chunk dropped");
                                    continue;
                                }
                            };
                            let Some(m) = &manifest else { continue };
                            if chunk.payload_hash != m.payload_hash {
                                // An older model's, or an onboarding package's.
                                continue;
                            }
                            outstanding.remove(&chunk.index);
                            match reasm.insert(chunk, t0.elapsed().as_millis() as u64) {
                                Ok(Some(bytes)) if unifed_protocol::chunking::payload_hash(&bytes) == m.payload_hash => {
                                    let b: ServerBroadcast = match postcard::from_bytes(&bytes) {
                                        Ok(b) => b,
                                        Err(e) => {
                                            tracing::warn!(error = %e, "model payload that does not decode dropped");
                                            continue;
                                        }
                                    };
                                    let s = site.as_mut().expect("site present");
                                    if b.model_version != m.model_version {
                                        tracing::warn!(got = b.model_version, want = m.model_version, "model payload of another version dropped");
                                        continue;
                                    }
                                    if let Err(e) = s.receive(&spec, &b, m.bn_policy) {
                                        tracing::warn!(error = %e, "model payload that does not fit the spec dropped");
                                        continue;
                                    }
                                    if !resumed && progress.applied_version.is_none() && b.model_version > 0
                                        && m.bn_policy == unifed_protocol::messages::BnPolicy::Local
                                        && cfg.join_bn == JoinBn::Calibrate
                                    {
                                        // A late joiner: BN from the onboarding package (the sites'
                                        // shared BN, if the policy shares any), statistics then
                                        // re-estimated on its own images.
                                        if m.bn_sharing != BnSharing::None {
                                            match package_bn(&cfg, &fed, &site_id, &spec, b.model_version).await {
                                                Ok((sd, detail)) => {
                                                    s.net = import(&s.net, &spec, &sd, Select::Bn)?;
                                                    println!("{site_id}: BN from the onboarding package of model v{} ({detail})", b.model_version);
                                                }
                                                // Not fatal: the joiner calibrates its own BN instead.
                                                Err(e) => eprintln!("{site_id}: onboarding package unavailable ({e:#}); calibrating the model's own BN"),
                                            }
                                        }
                                        s.net = tokio::task::block_in_place(|| unifed_models::bn::calibrate(&s.net, &s.train.x, &device, &Default::default(), |_, _| {}))?;
                                        println!("{site_id}: joined at model v{}; calibrated BN on {} own images", b.model_version, s.train.len());
                                    }
                                    progress.applied_version = Some(b.model_version);
                                    save(s, &progress)?;
                                    println!("{site_id}: applied model v{}", b.model_version);
                                    Report::Applied {
                                        version: b.model_version,
                                        bytes: m.payload_len,
                                        seconds: fetch_started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
                                    }
                                    .emit();
                                    fetch_started = None;
                                    last_request = None;
                                    if cfg.evaluate_each_model && !m.finished {
                                        let acc = tokio::task::block_in_place(|| s.evaluate(&spec, &device))?.accuracy();
                                        Report::Evaluated { version: b.model_version, accuracy: acc }.emit();
                                    }
                                }
                                Ok(_) => {}
                                Err(e) => tracing::warn!(error = %e, "chunk dropped"),
                            }
                        }
                        MessageKind::UpdateAnswer => {
                            let a: UpdateAnswer = match env.payload_as() {
                                Ok(a) => a,
                                Err(e) => {
                                    tracing::warn!(topic, error = %e, "malformed answer dropped");
                                    continue;
                                }
                            };
                            if pending.as_ref().is_some_and(|p| p.round == a.round) {
                                let accepted = a.answer == Answer::Accepted;
                                site.as_mut().expect("site present").answered(a.round, accepted);
                                Report::Answered { round: a.round, accepted }.emit();
                                match a.answer {
                                    Answer::Accepted => println!("{site_id}: update for round {} accepted", a.round),
                                    Answer::Rejected(r) => eprintln!("{site_id}: update for round {} rejected: {r:?}", a.round),
                                }
                                pending = None;
                                progress.answered_rounds.push(a.round);
                                save(site.as_ref().expect("site present"), &progress)?;
                            }
                        }
                        MessageKind::UpdateReceipt => {
                            let r: UpdateReceipt = match env.payload_as() {
                                Ok(r) => r,
                                Err(e) => {
                                    tracing::warn!(topic, error = %e, "malformed receipt dropped");
                                    continue;
                                }
                            };
                            if let Some(p) = &mut pending {
                                p.receipt(&r);
                                uplink.pump(p, resend).await?;
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        let Some(m) = manifest.clone() else { continue };
        let applied = progress.applied_version == Some(m.model_version);
        if !applied {
            fetch_started.get_or_insert_with(Instant::now);
            // Fetch: ask for what is missing, again if nothing completed within 5 s.
            if outstanding.is_empty()
                || last_request.is_none_or(|t| t.elapsed() > Duration::from_secs(5))
            {
                let indices: Vec<u32> = match reasm.missing(&m.payload_hash) {
                    Some(missing) => missing.into_iter().take(WINDOW).collect(),
                    None => (0..m.chunk_count).take(WINDOW).collect(),
                };
                if indices.is_empty() {
                    continue;
                }
                outstanding = indices.iter().copied().collect();
                let req = ChunkRequest {
                    model_version: m.model_version,
                    indices,
                    package: false,
                };
                let env = Envelope::new(
                    MessageKind::ChunkRequest,
                    fed.clone(),
                    site_id.clone(),
                    m.round,
                    m.model_version,
                    spec.hash(),
                    &req,
                );
                client
                    .publish(
                        topics.chunk_request(&site_id),
                        Qos::AtLeastOnce,
                        false,
                        env.encode(),
                    )
                    .await?;
                last_request = Some(Instant::now());
            }
            continue;
        }
        if m.finished {
            let s = site.as_ref().expect("site present");
            let acc = tokio::task::block_in_place(|| s.evaluate(&spec, &device))?.accuracy();
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
            client
                .publish(
                    topics.status(&site_id),
                    Qos::AtLeastOnce,
                    true,
                    status(SiteState::Offline, "finished"),
                )
                .await?;
            // A clean DISCONNECT (after the status is out) instead of a reset connection.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = client.disconnect().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Ok(acc);
        }
        let sampled = m.sampled.is_empty() || m.sampled.contains(&site_id);
        if pending.is_none() && sampled && !progress.answered_rounds.contains(&m.round) {
            let mut s = site.take().expect("site present");
            let (spec2, fed2, dev2, tc, m2) = (
                spec.clone(),
                fed.clone(),
                device.clone(),
                cfg.train.clone(),
                m.clone(),
            );
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
            let bar = training_bar(site_id.as_str(), m.round);
            let (s, bytes) = tokio::task::spawn_blocking(move || {
                let r = s.train_round(&spec2, &fed2, &m2, &tc, &dev2, bar);
                (s, r)
            })
            .await?;
            site = Some(s);
            let bytes = bytes?;
            let mut up = uplink.start(&m, bytes);
            Report::Uploaded {
                round: m.round,
                bytes: up.len() as u64,
                messages: up.messages() as u64,
            }
            .emit();
            uplink.pump(&mut up, resend).await?;
            pending = Some(up);
        } else if let Some(p) = &mut pending {
            if p.round != m.round {
                pending = None;
            } else {
                uplink.pump(p, resend).await?;
            }
        }
    }
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
        let bad = text.replace("resend_secs", "resend_seconds");
        let err = toml::from_str::<AgentConfig>(&bad).unwrap_err().to_string();
        assert!(err.contains("resend_seconds"), "{err}");
    }
}
