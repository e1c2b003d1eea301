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
use unifed_aggregator::federation::{Done, Federation, Outgoing, Sealer};
use unifed_aggregator::{
    Aggregator, Arrival, EnrolledSite, Event, FederationConfig, GlobalModel, Incoming,
};
use unifed_models::backend::Device;
use unifed_models::data::Dataset;
pub use unifed_models::site::{Site, select_for};
use unifed_models::train::TrainConfig;
use unifed_models::worker::{Host, ModelWorker, WorkerConfig};
use unifed_models::zoo::Net;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::max_broadcast_bytes;
use unifed_protocol::messages::Answer;
use unifed_protocol::topics::Topics;
pub use unifed_site::Evaluation;
use unifed_site::driver::BoxError;
use unifed_site::{
    DriverConfig, EngineConfig, Evaluate, Event as SiteEvent, Note, Outbox, SiteDriver, SiteEngine,
};

/// What a federation run did in one round.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundRecord {
    /// The round.
    pub round: u64,
    /// Each site's test accuracy after the round (its model = new global + its BN under `local`).
    pub accuracy: Vec<f64>,
    /// Each site's validation accuracy after the round, when the sites have validation splits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub validation: Vec<f64>,
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

/// What a caller of [`run_federation`] hears while it runs. Every method does nothing by
/// default.
pub trait Observer<N: Net> {
    /// A message the run passed.
    fn message(&mut self, _o: Observed<'_>) {}
    /// A site evaluated the model it applied (`e.version`), which `site` holds now.
    fn evaluated(&mut self, _site: &Site<N>, _e: &Evaluation) {}
    /// A round closed with the updates of `sites` (in site order).
    fn closed(&mut self, _round: u64, _sites: &[String]) {}
    /// Every site evaluated a new model: the round's record.
    fn round(&mut self, _record: &RoundRecord) {}
    /// Whether [`Observer::package`] is wanted (building the package costs a model's bytes).
    fn wants_package(&self) -> bool {
        false
    }
    /// The federation finished: the onboarding package the aggregator serves a new site now
    /// (the final model, its BN as the federation's sharing policy pooled it). Called only
    /// when [`Observer::wants_package`].
    fn package(&mut self, _package: &unifed_protocol::messages::ServerBroadcast) {}
}

/// An observer that hears nothing.
impl<N: Net> Observer<N> for () {}

/// An observer that hears only each round's record.
pub struct OnRound<F>(pub F);

impl<N: Net, F: FnMut(&RoundRecord)> Observer<N> for OnRound<F> {
    fn round(&mut self, record: &RoundRecord) {
        (self.0)(record)
    }
}

/// The observer every site's host shares with the run.
type Shared<'o, N> = std::rc::Rc<std::cell::RefCell<&'o mut dyn Observer<N>>>;

/// An in-process site's host: it hands each evaluated model to the run's observer.
struct SimHost<'o, N: Net> {
    observer: Shared<'o, N>,
}

impl<N: Net> Host<N> for SimHost<'_, N> {
    fn evaluated(&mut self, site: &Site<N>, e: &Evaluation) {
        self.observer.borrow_mut().evaluated(site, e);
    }
}

/// One in-process site: its driver over its model.
type SimDriver<'o, N> = SiteDriver<ModelWorker<N, SimHost<'o, N>>>;

/// The sites of an in-process run, with their drivers' settings.
pub struct Sites<'a, N: Net> {
    sites: &'a mut Vec<Site<N>>,
    validation: Vec<Dataset>,
    train: Vec<TrainConfig>,
    joins: Vec<u64>,
    device: &'a Device,
}

impl<'a, N: Net> Sites<'a, N> {
    /// `sites` (each given back holding the final model), all training with `train` on
    /// `device` and following the federation from its start.
    pub fn new(sites: &'a mut Vec<Site<N>>, train: &TrainConfig, device: &'a Device) -> Self {
        let n = sites.len();
        Sites {
            sites,
            validation: Vec::new(),
            train: vec![train.clone(); n],
            joins: vec![0; n],
            device,
        }
    }

    /// One validation split per site, evaluated with every model beside its test split.
    pub fn validation(mut self, splits: Vec<Dataset>) -> Self {
        self.validation = splits;
        self
    }

    /// Site `k` trains with `train` instead (a site of its own settings, or one that
    /// diverges).
    pub fn train_site(mut self, k: usize, train: TrainConfig) -> Self {
        if let Some(t) = self.train.get_mut(k) {
            *t = train;
        }
        self
    }

    /// Site `k` joins late: it hears nothing until model `version` is published, as an agent
    /// started then would (a late joiner, which calibrates its BN under `local` BN).
    pub fn join_at(mut self, k: usize, version: u64) -> Self {
        if let Some(j) = self.joins.get_mut(k) {
            *j = version;
        }
        self
    }
}

/// Runs a federation of `sites` under `cfg` from `initial` in a fresh data directory, telling
/// `observer` what it passes. Returns one record per model version after the initial one.
///
/// Each site is the MQTT agent's: the same [`SiteDriver`] and [`ModelWorker`] over an in-memory
/// transport that plays the aggregator service's part: it serves model chunks on request and
/// carries manifests, updates and answers as the encoded envelopes the broker would, signed.
/// A site whose training diverges sends nothing for the round, as an agent does; a round that
/// waits for it closes at its deadline (the run's clock jumps there when nothing else moves).
/// `cfg`'s enrolment is replaced by `sites`, each with its [`sim_key`] and vouched for with its
/// training set's size.
pub fn run_federation<N: Net>(
    mut cfg: FederationConfig,
    initial: GlobalModel,
    mut sites: Sites<'_, N>,
    observer: &mut dyn Observer<N>,
) -> Result<Vec<RoundRecord>> {
    let dir = tempfile::tempdir()?;
    let spec = initial.spec.clone();
    let federation = Id::new(&cfg.federation).map_err(|e| anyhow!("{e}"))?;
    cfg.sites = sites
        .sites
        .iter()
        .map(|s| EnrolledSite {
            // The runner's sites are its own: each is vouched for with its training set's
            // size, so every weight counts as claimed (FedAvg's, as the reference weighs).
            max_samples: Some(s.train.len() as u64),
            ..EnrolledSite::new(s.id.as_str(), sim_key(s.id.as_str()).public())
        })
        .collect();
    let deadline_ms = cfg.deadline_secs.saturating_mul(1000);
    let mut bus = Bus::new(&federation, sites.sites, sites.joins.clone());
    let core = Aggregator::open(dir.path(), cfg, initial, 256 << 10)?;
    // First chunk requests are gathered until every site asked or nothing else moves.
    let sealer = Sealer::new(federation.clone(), spec.hash(), sim_key(AGGREGATOR_ID));
    let mut agg = Federation::new(core, sealer, u64::MAX).keep_payloads();
    let observer: Shared<'_, N> = std::rc::Rc::new(std::cell::RefCell::new(observer));
    let aggregator = sim_key(AGGREGATOR_ID).public();
    let mut drivers = drivers(&federation, &spec, aggregator, &mut sites, &observer)?;
    let mut records = Records::new(drivers.len());
    let mut step = agg.handle(Event::Start, 0)?;
    loop {
        // The answers before a fold are in the sites' inboxes before it runs; a site that joins
        // with this version hears its manifest.
        bus.published(&step.done);
        bus.take(std::mem::take(&mut step.send));
        records.published(std::mem::take(&mut step.done), &observer);
        if step.close {
            step = agg.close(bus.now)?;
            continue;
        }
        if let Some(up) = bus.updates.pop_front() {
            bus.now += 1;
            step = agg.handle(Event::Update(up), bus.now)?;
            continue;
        }
        if bus.inbox.is_empty() {
            // Nothing else moves: first requests gathered from fewer than every site go now.
            bus.take(agg.due(u64::MAX));
        }
        let Some((k, event)) = bus.inbox.pop_front() else {
            if drivers.iter().all(|d| d.finished().is_some()) {
                break;
            }
            // A round waits for an update that will not come: its deadline passes.
            bus.now = bus.now.saturating_add(deadline_ms + 1);
            step = agg.handle(Event::Tick, bus.now)?;
            if step.send.is_empty() && step.done.is_empty() && !step.close {
                bail!("the federation stalled: no message in flight and not every site finished");
            }
            continue;
        };
        let now = bus.now;
        let mut out = SimOutbox {
            k,
            bus: &mut bus,
            agg: &mut agg,
            records: &mut records,
            observer: &observer,
        };
        drivers[k]
            .handle(event, now, &mut out)
            .with_context(|| format!("site {}", bus.ids[k]))?;
        records.complete(&observer);
    }
    for d in drivers {
        sites.sites.push(d.into_worker().into_site()?);
    }
    if observer.borrow().wants_package() {
        observer.borrow_mut().package(&final_package(agg.core())?);
    }
    Ok(records.done)
}

/// The onboarding package `core` serves for its current model, decoded.
fn final_package(core: &Aggregator) -> Result<unifed_protocol::messages::ServerBroadcast> {
    let (_, chunks) = core.package(None)?.map_err(|e| anyhow!("{e:?}"))?;
    let payload: Vec<u8> = chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
    Ok(postcard::from_bytes(&payload)?)
}

/// Every site's driver, taking the sites out of `sites` (they come back when the run ends).
fn drivers<'o, N: Net>(
    federation: &Id,
    spec: &unifed_protocol::ModelSpec,
    aggregator: unifed_protocol::PublicKey,
    sites: &mut Sites<'_, N>,
    observer: &Shared<'o, N>,
) -> Result<Vec<SimDriver<'o, N>>> {
    let taken = std::mem::take(sites.sites);
    if !sites.validation.is_empty() && sites.validation.len() != taken.len() {
        bail!(
            "{} validation splits for {} sites",
            sites.validation.len(),
            taken.len()
        );
    }
    Ok(taken
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let engine = SiteEngine::new(
                EngineConfig {
                    site: s.id.clone(),
                    federation: federation.clone(),
                    spec_hash: spec.hash(),
                    // In memory every update goes whole, and nothing is re-sent.
                    max_packet: usize::MAX >> 8,
                    resend_ms: u64::MAX >> 8,
                    max_model_bytes: max_broadcast_bytes(spec),
                    key: sim_key(s.id.as_str()),
                    aggregator,
                },
                None,
            );
            let worker = ModelWorker::new(
                s,
                WorkerConfig {
                    federation: federation.clone(),
                    spec: spec.clone(),
                    train: sites.train[k].clone(),
                    device: sites.device.clone(),
                    validation: sites.validation.get(k).cloned(),
                },
                SimHost {
                    observer: observer.clone(),
                },
            );
            SiteDriver::new(
                engine,
                worker,
                DriverConfig {
                    evaluate: Evaluate::EveryTrainedModel,
                    calibrate_joiners: true,
                },
            )
        })
        .collect())
}

/// The round records of a run: each site's evaluation of each model version, and what its
/// sites sent and fetched, until every site evaluated a version.
struct Records {
    done: Vec<RoundRecord>,
    /// Each version's evaluations, one slot per site, and its plan once published.
    evaluated: std::collections::BTreeMap<u64, Vec<Option<Evaluation>>>,
    plans: std::collections::BTreeMap<u64, unifed_protocol::messages::RoundPlan>,
    update_bytes: Vec<usize>,
    download_bytes: Vec<usize>,
    model_bytes: usize,
    recorded: u64,
    t0: Instant,
}

impl Records {
    fn new(sites: usize) -> Self {
        Records {
            done: Vec::new(),
            evaluated: Default::default(),
            plans: Default::default(),
            update_bytes: vec![0; sites],
            download_bytes: vec![0; sites],
            model_bytes: 0,
            recorded: 0,
            t0: Instant::now(),
        }
    }

    /// Takes what the aggregator did: each published model's payload (for the observer), size
    /// and plan.
    fn published<N: Net>(&mut self, done: Vec<Done>, observer: &Shared<'_, N>) {
        for d in done {
            if let Done::RoundClosed { round, sites, .. } = &d {
                observer.borrow_mut().closed(*round, sites);
            }
            if let Done::Published {
                manifest,
                bytes,
                payload,
                ..
            } = d
            {
                if let Some(payload) = &payload {
                    observer.borrow_mut().message(Observed::Model {
                        version: manifest.model_version,
                        payload,
                    });
                }
                self.model_bytes = bytes as usize;
                self.plans.insert(manifest.model_version, manifest.plan);
            }
        }
    }

    /// Records every version past the last recorded one that every site has evaluated.
    fn complete<N: Net>(&mut self, observer: &Shared<'_, N>) {
        while let Some(evals) = self
            .evaluated
            .get(&(self.recorded + 1))
            .filter(|e| e.iter().all(Option::is_some))
        {
            let v = self.recorded + 1;
            let evals: Vec<&Evaluation> = evals.iter().flatten().collect();
            let rec = RoundRecord {
                round: v,
                accuracy: evals.iter().map(|e| e.accuracy).collect(),
                test_loss: evals.iter().map(|e| e.loss).collect(),
                train_loss: evals.iter().map(|e| e.train_loss).collect(),
                validation: evals.iter().filter_map(|e| e.validation).collect(),
                update_bytes: self.update_bytes.clone(),
                model_bytes: self.model_bytes,
                download_bytes: self.download_bytes.clone(),
                seconds: self.t0.elapsed().as_secs_f64(),
                plan: self.plans.get(&v).cloned().unwrap_or_default(),
            };
            self.evaluated.remove(&v);
            self.recorded = v;
            observer.borrow_mut().round(&rec);
            self.done.push(rec);
            self.t0 = Instant::now();
        }
    }
}

/// A site's side of the in-memory transport.
struct SimOutbox<'a, 'o, N: Net> {
    k: usize,
    bus: &'a mut Bus,
    agg: &'a mut Federation,
    records: &'a mut Records,
    observer: &'a Shared<'o, N>,
}

impl<N: Net> Outbox for SimOutbox<'_, '_, N> {
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError> {
        let site = self.bus.ids[self.k].clone();
        if topic == self.bus.topics.chunk_request(&site) {
            let out = self
                .agg
                .chunk_request(site.as_str(), &payload, self.bus.now)?;
            self.bus.take(out);
            Ok(())
        } else if topic == self.bus.topics.update(&site) {
            self.observer.borrow_mut().message(Observed::Update {
                site: site.as_str(),
                bytes: &payload,
            });
            self.bus.updates.push_back(Incoming {
                site: site.to_string(),
                bytes: payload.into(),
                arrival: Arrival::Message,
                staged: None,
            });
            Ok(())
        } else {
            Err(format!("a site published on an unexpected topic `{topic}`").into())
        }
    }

    fn note(&mut self, note: Note) {
        let k = self.k;
        match note {
            Note::Uploading { bytes, .. } => self.records.update_bytes[k] = bytes as usize,
            Note::Applied { bytes, .. } => self.records.download_bytes[k] = bytes as usize,
            Note::Evaluated(e) => {
                let n = self.records.update_bytes.len();
                let slots = self.records.evaluated.entry(e.version).or_default();
                slots.resize(n, None);
                slots[k] = Some(e);
            }
            Note::Answered {
                round,
                answer: Answer::Rejected(r),
            } => tracing::warn!(site = %self.bus.ids[k], round, "update rejected: {r:?}"),
            _ => {}
        }
    }
}

/// The in-memory transport: what is on its way to the sites and to the aggregator.
struct Bus {
    /// Messages and events on their way to each site (by index), in order.
    inbox: VecDeque<(usize, SiteEvent)>,
    /// Updates on their way to the aggregator.
    updates: VecDeque<Incoming>,
    topics: Topics,
    ids: Vec<Id>,
    /// The site each site's own topic (answers, chunk replies) leads to.
    own: std::collections::HashMap<String, usize>,
    /// Each site's first model version: it hears nothing before that one is published.
    joins: Vec<u64>,
    /// The model version published last.
    version: u64,
    /// The run's clock: one tick per update, a deadline's jump when nothing moves.
    now: u64,
}

impl Bus {
    fn new<N: Net>(federation: &Id, sites: &[Site<N>], joins: Vec<u64>) -> Self {
        let topics = Topics::new(federation);
        let ids: Vec<Id> = sites.iter().map(|s| s.id.clone()).collect();
        let own = ids
            .iter()
            .enumerate()
            .flat_map(|(k, id)| [(topics.ack(id), k), (topics.chunk_reply(id), k)])
            .collect();
        Bus {
            inbox: VecDeque::new(),
            updates: VecDeque::new(),
            topics,
            ids,
            own,
            joins,
            version: 0,
            now: 0,
        }
    }

    /// Follows the model versions the aggregator publishes.
    fn published(&mut self, done: &[Done]) {
        for d in done {
            if let Done::Published { manifest, .. } = d {
                self.version = manifest.model_version;
            }
        }
    }

    /// Delivers the aggregator's messages as the broker would: the manifest and shared
    /// chunks to every site (in site order), a site's own topics to it alone.
    fn take(&mut self, out: Vec<Outgoing>) {
        for m in out {
            let to: Vec<usize> = match self.own.get(&m.topic) {
                Some(&k) => vec![k],
                None if m.topic == self.topics.manifest()
                    || m.topic == self.topics.model_chunks() =>
                {
                    (0..self.ids.len()).collect()
                }
                None => {
                    tracing::warn!(topic = m.topic, "a message on no site's topic dropped");
                    Vec::new()
                }
            };
            for k in to.into_iter().filter(|&k| self.joins[k] <= self.version) {
                self.inbox.push_back((
                    k,
                    SiteEvent::Message {
                        topic: m.topic.clone(),
                        payload: m.payload.clone(),
                    },
                ));
            }
        }
    }
}
