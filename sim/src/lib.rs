//! In-process federation: the aggregator core and one site engine per site (the MQTT agent's
//! engine, so one client round and one seed rule), each site with its own model and BN state,
//! exchanging the same encoded messages the network carries (envelopes, manifests, model chunks
//! on request, postcard updates, answers) over an in-memory transport. The experiment runner of
//! the algorithm suite grows from here.

pub mod chart;
pub mod experiment;
pub mod heap;
pub mod ingest;
pub mod memory;

use anyhow::{Context, Result, anyhow, bail};
use std::collections::VecDeque;
use std::time::Instant;
use unifed_aggregator::serving::{Route, Serving, To};
use unifed_aggregator::{
    Action, Aggregator, Arrival, EnrolledSite, Event, FederationConfig, GlobalModel, Incoming,
};
use unifed_models::backend::Device;
pub use unifed_models::site::{Site, select_for};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::Net;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::messages::{Answer, ChunkRequest, Payload, RoundManifest, UpdateAnswer};
use unifed_protocol::topics::Topics;
use unifed_protocol::{Cut, max_broadcast_bytes};
use unifed_site::{Action as SiteAction, EngineConfig, Event as SiteEvent, SiteEngine};

/// What a federation run did in one round.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundRecord {
    /// The round.
    pub round: u64,
    /// Each site's test accuracy after the round (its model = new global + its BN under `local`).
    pub accuracy: Vec<f64>,
    /// Each site's mean test cross-entropy after the round.
    #[serde(default)]
    pub test_loss: Vec<f64>,
    /// Each site's training loss (its last local epoch's mean cross-entropy) in the round, for
    /// the sites that trained in it.
    #[serde(default)]
    pub train_loss: Vec<Option<f64>>,
    /// Bytes of each site's update message.
    pub update_bytes: Vec<usize>,
    /// Bytes of the broadcast model payload.
    pub model_bytes: usize,
    /// Bytes each site fetched to apply the round's model (the delta's under a lossy
    /// encoding, the whole model's otherwise).
    #[serde(default)]
    pub download_bytes: Vec<usize>,
    /// Wall seconds of the round (training, aggregation, evaluation).
    pub seconds: f64,
    /// The plan of the rounds the new model was announced for (how sites deploy it: Per-FedAvg
    /// personalises before it evaluates).
    #[serde(default)]
    pub plan: unifed_protocol::messages::RoundPlan,
}

/// Messages a run passed, lent to the observer, for tests that check what crossed the transport.
#[derive(Debug, Clone, Copy)]
pub enum Observed<'a> {
    /// A site's encoded update.
    Update {
        /// The site.
        site: &'a str,
        /// The envelope bytes.
        bytes: &'a [u8],
    },
    /// The reassembled broadcast payload of a model version.
    Model {
        /// The model version.
        version: u64,
        /// The payload bytes.
        payload: &'a [u8],
    },
}

/// The full-size digits CNN (FedBN's), seeded as every site's, on the CPU, and its spec: the
/// model the aggregator benchmarks measure.
pub fn full_size_digits()
-> anyhow::Result<(unifed_models::zoo::DigitsCnn, unifed_protocol::ModelSpec)> {
    use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, seeded, spec_of};
    let device = unifed_models::backend::Backend::Flex
        .device()
        .map_err(anyhow::Error::msg)?;
    let mc = ModelConfig::fedbn_digits();
    let net = seeded(&device, 0, |d| DigitsCnnConfig::default().init(d));
    let spec = spec_of(&net, &mc.classes, &mc.input);
    Ok((net, spec))
}

/// The global model of version 0 taken from `net`: every tensor of `spec`, in spec order.
pub fn initial_model<N: Net>(net: &N, spec: &unifed_protocol::ModelSpec) -> GlobalModel {
    GlobalModel {
        spec: spec.clone(),
        tensors: unifed_models::state::export(net, spec, unifed_models::state::Select::All)
            .tensors
            .into_iter()
            .map(|t| t.data)
            .collect(),
    }
}

/// The signing key of `who` in an in-process run, derived from its id: every message crosses
/// the in-memory transport signed and is checked as on the network, but nothing leaves the
/// process, so the keys need no secrecy.
pub fn sim_key(who: &str) -> SigningKey {
    use sha2::Digest;
    SigningKey::from_seed(sha2::Sha256::digest(format!("unifed-sim key of {who}")).into())
}

/// Runs a federation of `sites` under `cfg` from `initial` in a fresh data directory, and calls
/// `observe` with every message it passes, and `on_round` after each new model with the round's
/// record and the sites (each holding the new model). Returns one record per model version
/// after the initial one.
///
/// Each site is driven by the same [`SiteEngine`] as the MQTT agent, over an in-memory
/// transport that plays the aggregator service's part: it serves model chunks on request and
/// carries manifests, updates and answers as the encoded envelopes the broker would, signed.
/// `cfg`'s enrolment is replaced by `sites`, each with its [`sim_key`].
pub fn run_federation<N: Net>(
    mut cfg: FederationConfig,
    initial: GlobalModel,
    sites: &mut [Site<N>],
    tc: &TrainConfig,
    device: &Device,
    mut observe: impl FnMut(Observed<'_>),
    mut on_round: impl FnMut(&RoundRecord, &[Site<N>]),
) -> Result<Vec<RoundRecord>> {
    let dir = tempfile::tempdir()?;
    let spec = initial.spec.clone();
    let federation = Id::new(&cfg.federation).map_err(|e| anyhow!("{e}"))?;
    let me = Id::new(AGGREGATOR_ID).map_err(|e| anyhow!("{e}"))?;
    let topics = Topics::new(&federation);
    let hash = spec.hash();
    cfg.sites = sites
        .iter()
        .map(|s| EnrolledSite::new(s.id.as_str(), sim_key(s.id.as_str()).public()))
        .collect();
    let keyring = cfg.keyring();
    let ids: Vec<Id> = sites.iter().map(|s| s.id.clone()).collect();
    let wire = Wire {
        federation: federation.clone(),
        me,
        hash,
        key: sim_key(AGGREGATOR_ID),
    };
    let mut agg = Aggregator::open(dir.path(), cfg, initial, 256 << 10)?;
    let mut engines: Vec<SiteEngine> = sites
        .iter()
        .map(|s| {
            SiteEngine::new(
                EngineConfig {
                    site: s.id.clone(),
                    federation: federation.clone(),
                    spec_hash: hash,
                    // In memory every update goes whole, and nothing is re-sent.
                    max_packet: usize::MAX >> 8,
                    resend_ms: u64::MAX >> 8,
                    max_model_bytes: max_broadcast_bytes(&spec),
                    key: sim_key(s.id.as_str()),
                    aggregator: wire.key.public(),
                },
                None,
            )
        })
        .collect();
    let mut served: Option<ServedModel> = None;
    // Chunks go the ways the MQTT service sends them: once for every site, or to one alone;
    // first requests are gathered until every site asked or nothing else moves.
    let mut serving = Serving::new(sites.len(), u64::MAX);
    let mut agg_actions = agg.handle(Event::Start, 0)?;
    let mut inbox: VecDeque<(usize, SiteEvent)> = VecDeque::new();
    let mut records = Vec::new();
    let mut t0 = Instant::now();
    let mut update_bytes = vec![0; sites.len()];
    let mut download_bytes = vec![0; sites.len()];
    let mut model_bytes = 0;
    let mut applied: Vec<Option<u64>> = vec![None; sites.len()];
    let mut recorded = 0u64;
    let mut done = vec![false; sites.len()];
    let mut now = 0u64;
    loop {
        let mut close = false;
        for action in agg_actions.drain(..) {
            match action {
                // The answers before it are in the sites' inboxes: now the fold.
                Action::Close => close = true,
                Action::Answer {
                    site,
                    round,
                    update_hash,
                    answer,
                } => {
                    let k = sites
                        .iter()
                        .position(|s| s.id == site)
                        .context("an answer for an unknown site")?;
                    let bytes = wire.envelope(
                        MessageKind::UpdateAnswer,
                        round,
                        agg.model_version(),
                        &UpdateAnswer {
                            round,
                            update_hash,
                            answer,
                        },
                    );
                    inbox.push_back((
                        k,
                        SiteEvent::Message {
                            topic: topics.ack(&site),
                            payload: bytes.into(),
                        },
                    ));
                }
                Action::Publish {
                    manifest,
                    model,
                    delta,
                } => {
                    // Chunks are served one at a time over the round: the payload is held.
                    let model = model.into_held();
                    observe(Observed::Model {
                        version: manifest.model_version,
                        payload: &model.bytes(),
                    });
                    model_bytes = model.len();
                    let bytes = wire.envelope(
                        MessageKind::RoundManifest,
                        manifest.round,
                        manifest.model_version,
                        &manifest,
                    );
                    for k in 0..sites.len() {
                        inbox.push_back((
                            k,
                            SiteEvent::Message {
                                topic: topics.manifest(),
                                payload: bytes.clone().into(),
                            },
                        ));
                    }
                    served = Some((manifest, model, delta.map(|d| *d)));
                    serving.clear();
                }
                Action::RoundClosed { .. } | Action::Finished { .. } => {}
            }
        }
        if close {
            agg_actions = agg.handle(Event::Close, now)?;
            continue;
        }
        if inbox.is_empty() {
            // Nothing else moves: first requests gathered from fewer than every site go now.
            let due = serving.due(u64::MAX);
            share_due(&mut inbox, &wire, (&topics, &ids), served.as_ref(), due)?;
        }
        let Some((k, event)) = inbox.pop_front() else {
            if done.iter().all(|&d| d) {
                return Ok(records);
            }
            bail!("the federation stalled: no message in flight and not every site finished");
        };
        for action in engines[k].handle(event, now) {
            match action {
                SiteAction::Publish { topic, payload } => {
                    let site = &sites[k].id;
                    if topic == topics.chunk_request(site) {
                        let req: ChunkRequest = keyring.open(&payload, usize::MAX)?.payload_as()?;
                        let Some((m, model, delta)) = &served else {
                            continue;
                        };
                        if m.model_version != req.model_version {
                            continue;
                        }
                        let cut = match req.payload {
                            Payload::Model => model,
                            Payload::Delta => delta.as_ref().context("no delta was published")?,
                            Payload::Package => bail!("the in-process run serves no packages"),
                        };
                        for i in req.indices {
                            cut.chunk(i).context("a chunk out of range")?;
                            let to: Vec<(usize, String)> = match serving.route(
                                site,
                                (req.model_version, req.payload),
                                (i as usize, cut.count() as usize),
                                req.alone,
                                now,
                            ) {
                                Route::Shared => (0..sites.len())
                                    .map(|j| (j, topics.model_chunks()))
                                    .collect(),
                                Route::Site => vec![(k, topics.chunk_reply(site))],
                                Route::OnItsWay | Route::Gathered | Route::Refused => Vec::new(),
                            };
                            deliver(&mut inbox, &wire, m, cut, &[i], &to);
                        }
                        let due = serving.due(now);
                        share_due(&mut inbox, &wire, (&topics, &ids), served.as_ref(), due)?;
                    } else if topic == topics.update(site) {
                        observe(Observed::Update {
                            site: site.as_str(),
                            bytes: &payload,
                        });
                        update_bytes[k] = payload.len();
                        now += 1;
                        agg_actions.extend(agg.handle(
                            Event::Update(Incoming {
                                site: site.to_string(),
                                bytes: payload.into(),
                                arrival: Arrival::Message,
                                staged: None,
                            }),
                            now,
                        )?);
                    } else {
                        bail!("a site published on an unexpected topic `{topic}`");
                    }
                }
                SiteAction::Apply {
                    manifest,
                    download,
                    bytes,
                    ..
                } => {
                    sites[k].receive(&spec, &manifest, &download.read()?)?;
                    drop(download);
                    download_bytes[k] = bytes as usize;
                    applied[k] = Some(manifest.model_version);
                    inbox.push_back((
                        k,
                        SiteEvent::Applied {
                            version: manifest.model_version,
                        },
                    ));
                    // Every site holds the new model: evaluate the round.
                    let v = manifest.model_version;
                    if v > recorded && applied.iter().all(|a| *a == Some(v)) {
                        recorded = v;
                        let evals = sites
                            .iter()
                            .map(|s| s.evaluate(&spec, &manifest.plan, tc, device))
                            .collect::<Result<Vec<_>, _>>()?;
                        let rec = RoundRecord {
                            round: v,
                            accuracy: evals.iter().map(|e| e.accuracy()).collect(),
                            test_loss: evals.iter().map(|e| e.loss).collect(),
                            train_loss: sites
                                .iter()
                                .map(|s| match s.last_report() {
                                    Some((r, rep)) if r == v => Some(rep.train_loss),
                                    _ => None,
                                })
                                .collect(),
                            update_bytes: update_bytes.clone(),
                            model_bytes,
                            download_bytes: download_bytes.clone(),
                            seconds: t0.elapsed().as_secs_f64(),
                            plan: manifest.plan,
                        };
                        on_round(&rec, sites);
                        records.push(rec);
                        t0 = Instant::now();
                    }
                }
                SiteAction::Train { manifest } => {
                    let update =
                        sites[k].train_round(&spec, &federation, &manifest, tc, device, |_| {})?;
                    inbox.push_back((
                        k,
                        SiteEvent::Trained {
                            round: manifest.round,
                            update,
                        },
                    ));
                }
                SiteAction::Answered { round, answer } => {
                    let accepted = answer == Answer::Accepted;
                    sites[k].answered(round, accepted);
                    if let Answer::Rejected(r) = answer {
                        bail!("update of {} in round {round} rejected: {r:?}", sites[k].id);
                    }
                }
                SiteAction::Finished { .. } => done[k] = true,
                SiteAction::Uploading { .. } | SiteAction::Checkpoint => {}
            }
        }
    }
}

/// A model version as served: its manifest, and its payload and delta cut into chunks.
type ServedModel = (RoundManifest, Cut, Option<Cut>);

/// Puts chunks `indices` of `cut`, a payload `m` announces, into the inboxes `to` names.
fn deliver(
    inbox: &mut VecDeque<(usize, SiteEvent)>,
    wire: &Wire,
    m: &RoundManifest,
    cut: &Cut,
    indices: &[u32],
    to: &[(usize, String)],
) {
    for c in indices.iter().filter_map(|&i| cut.chunk(i)) {
        let payload: bytes::Bytes = wire
            .envelope(MessageKind::ModelChunk, m.round, m.model_version, &c)
            .into();
        for (j, topic) in to {
            inbox.push_back((
                *j,
                SiteEvent::Message {
                    topic: topic.clone(),
                    payload: payload.clone(),
                },
            ));
        }
    }
}

/// Delivers what [`Serving::due`] sends: to every site (in `ids`' order), or to one alone.
fn share_due(
    inbox: &mut VecDeque<(usize, SiteEvent)>,
    wire: &Wire,
    (topics, ids): (&Topics, &[Id]),
    served: Option<&ServedModel>,
    due: Vec<((u64, Payload), To, Vec<u32>)>,
) -> Result<()> {
    for ((version, payload), to, indices) in due {
        let Some((m, model, delta)) = served.filter(|s| s.0.model_version == version) else {
            continue;
        };
        let cut = match payload {
            Payload::Model => model,
            Payload::Delta => delta.as_ref().context("no delta was published")?,
            Payload::Package => continue,
        };
        let to: Vec<(usize, String)> = match to {
            To::All => (0..ids.len()).map(|j| (j, topics.model_chunks())).collect(),
            To::Site(site) => ids
                .iter()
                .position(|s| *s == site)
                .map(|k| (k, topics.chunk_reply(&site)))
                .into_iter()
                .collect(),
        };
        deliver(inbox, wire, m, cut, &indices, &to);
    }
    Ok(())
}

/// The aggregator's side of the in-memory transport: its envelopes.
struct Wire {
    federation: Id,
    me: Id,
    hash: unifed_protocol::SpecHash,
    key: SigningKey,
}

impl Wire {
    fn envelope<T: serde::Serialize>(
        &self,
        kind: MessageKind,
        round: u64,
        version: u64,
        payload: &T,
    ) -> Vec<u8> {
        self.key.sign(&Envelope::new(
            kind,
            self.federation.clone(),
            self.me.clone(),
            round,
            version,
            self.hash,
            payload,
        ))
    }
}
