//! The hostile-site benchmark (`unifed-demo hostile`): the demo's federation with its default
//! aggregator settings, run clean while a stranger records everything on the broker, then again
//! with the same federation id and keys while an enrolled site (`mallory`) and the stranger
//! attack it for the whole run:
//!
//! - mallory, each round: minus the model it was sent, claiming the most samples the default
//!   config allows (item 1 of the hostile-sites issue); a flood of small signed updates the
//!   aggregator refuses and audits (item 5); two chunk sets of the open round begun and never
//!   finished (item 7) and the first chunks of its earlier uploads replayed (item 4);
//! - the stranger (a broker login, no key): the clean run's last manifest re-published
//!   retained every ten seconds and all the clean run's messages replayed (item 3); everything
//!   it hears replayed again 20 s later, manifests retained (items 3 and 4); silent TCP
//!   connections held open (item 7).
//!
//! The honest sites' final accuracies of both runs are compared, site by site, and written to
//! `results/hostile.json` with what each attacker sent and what the aggregator's audit says.

mod flood;
mod site;
mod stranger;

use crate::run::{self, Options, RunResult, Setup};
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use unifed_aggregator::config::{EnrolledSite, FederationConfig};
use unifed_net::BrokerConfig;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::BnPolicy;
use unifed_protocol::{ModelSpec, PublicKey, SigningKey};

/// The hostile enrolled site's id.
const MALLORY: &str = "mallory";

/// How hard the attackers push.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Messages a second the stranger replays.
    #[arg(long, default_value_t = 100)]
    pub replay_messages: u32,
    /// Bytes a second the stranger replays (MiB).
    #[arg(long, default_value_t = 4)]
    pub replay_mib: u64,
    /// Small signed updates a second the hostile site floods.
    #[arg(long, default_value_t = 50)]
    pub flood: u32,
    /// Silent TCP connections the stranger holds open.
    #[arg(long, default_value_t = 64)]
    pub silent: usize,
    /// The aggregator's `max_weight_of_median` in both runs (default: its default).
    #[arg(long)]
    pub max_weight_of_median: Option<f64>,
    /// The aggregator's `max_norm_of_median` in both runs (default: its default).
    #[arg(long)]
    pub max_norm_of_median: Option<f64>,
}

/// What the attackers sent during the attacked run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Tally {
    /// Mallory's minus-the-model updates uploaded (one a round).
    pub forged_updates: u64,
    /// Small signed updates of wrong or closed rounds (item 5).
    pub refused_floods: u64,
    /// Chunks of never-finished sets of the open round (item 7).
    pub junk_chunks: u64,
    /// First chunks of mallory's earlier uploads sent again (item 4).
    pub own_first_chunk_replays: u64,
    /// The clean run's last manifest, re-published retained (item 3).
    pub earlier_run_manifests: u64,
    /// The clean run's messages replayed (item 3).
    pub earlier_run_replays: u64,
    /// Messages of this run replayed 20 s after they were heard (items 3 and 4).
    pub this_run_replays: u64,
    /// Silent TCP connections opened (item 7).
    pub silent_connections: u64,
}

/// What the attack tasks share.
#[derive(Debug, Default)]
pub struct Shared {
    tally: Tally,
    /// The aggregator's answers to mallory's updates: round and answer.
    answers: Vec<(u64, String)>,
    /// The first chunk of each of mallory's uploads, signed.
    first_chunks: Vec<Vec<u8>>,
}

fn tally(shared: &Mutex<Shared>, f: impl FnOnce(&mut Tally)) {
    f(&mut shared.lock().unwrap_or_else(|p| p.into_inner()).tally);
}

/// A runtime for the attackers' tasks and the signal that stops them.
struct Tasks {
    runtime: tokio::runtime::Runtime,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Tasks {
    fn new() -> Result<Tasks> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        Ok(Tasks {
            runtime,
            stop: tokio::sync::watch::channel(false).0,
        })
    }

    /// Stops the tasks and waits for `handles` (30 s at most).
    fn stop<T>(self, handles: Vec<tokio::task::JoinHandle<Result<T>>>) -> Result<Vec<T>> {
        let _ = self.stop.send(true);
        self.runtime.block_on(async {
            let mut out = Vec::new();
            for h in handles {
                let r = tokio::time::timeout(Duration::from_secs(30), h)
                    .await
                    .context("an attack task did not stop")?;
                out.push(r??);
            }
            Ok(out)
        })
    }
}

/// The stranger recording the clean run.
struct Recorder {
    tasks: Tasks,
    handle: tokio::task::JoinHandle<Result<stranger::Heard>>,
}

impl Recorder {
    fn start(broker: BrokerConfig) -> Result<Recorder> {
        let tasks = Tasks::new()?;
        let stop = tasks.stop.subscribe();
        let handle = tasks.runtime.spawn(stranger::record(broker, stop));
        Ok(Recorder { tasks, handle })
    }

    fn stop(self) -> Result<stranger::Heard> {
        let mut heard = self.tasks.stop(vec![self.handle])?;
        heard.pop().context("the recorder gave nothing back")
    }
}

/// What the attackers of one run need.
struct Plan {
    broker: BrokerConfig,
    federation: Id,
    spec: ModelSpec,
    aggregator: PublicKey,
    mallory: SigningKey,
    earlier: stranger::Heard,
    args: Args,
}

/// The attackers of one run, running.
struct Attack {
    tasks: Tasks,
    handles: Vec<tokio::task::JoinHandle<Result<()>>>,
    shared: Arc<Mutex<Shared>>,
}

impl Attack {
    fn start(plan: Plan) -> Result<Attack> {
        let tasks = Tasks::new()?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let claim = unifed_aggregator::config::default_max_samples();
        let who = || site::Identity {
            site: Id::new(MALLORY).expect("a valid id"),
            federation: plan.federation.clone(),
            key: plan.mallory.clone(),
            aggregator: plan.aggregator,
        };
        let rate = stranger::Rate {
            messages: plan.args.replay_messages,
            bytes: plan.args.replay_mib << 20,
        };
        let spec_hash = plan.spec.hash();
        let handles = vec![
            tasks.runtime.spawn(site::run(
                plan.broker.clone(),
                who(),
                (plan.spec, claim),
                shared.clone(),
                tasks.stop.subscribe(),
            )),
            tasks.runtime.spawn(flood::run(
                plan.broker.clone(),
                who(),
                (spec_hash, claim, plan.args.flood),
                shared.clone(),
                tasks.stop.subscribe(),
            )),
            tasks.runtime.spawn(stranger::replay(
                plan.broker,
                (plan.federation, plan.earlier, rate, plan.args.silent),
                shared.clone(),
                tasks.stop.subscribe(),
            )),
        ];
        Ok(Attack {
            tasks,
            handles,
            shared,
        })
    }

    /// Stops the attackers: what they sent, and the answers mallory's updates got.
    fn stop(self) -> Result<(Tally, Vec<(u64, String)>)> {
        self.tasks.stop(self.handles)?;
        let s = std::mem::take(&mut *self.shared.lock().unwrap_or_else(|p| p.into_inner()));
        Ok((s.tally, s.answers))
    }
}

/// One honest site's final accuracy in both runs.
#[derive(Debug, Clone, Serialize)]
pub struct SiteRow {
    /// The site.
    pub site: String,
    /// Final test accuracy of the clean run.
    pub clean: f64,
    /// Final test accuracy of the attacked run.
    pub attacked: f64,
}

/// One BN policy's clean and attacked runs.
#[derive(Debug, Clone, Serialize)]
pub struct HostileResult {
    /// `local` (FedBN) or `global` (FedAvg).
    pub bn_policy: String,
    /// Rounds of each run.
    pub rounds: u64,
    /// The honest sites' final accuracies.
    pub sites: Vec<SiteRow>,
    /// Mean final accuracy over the honest sites, clean.
    pub clean_mean: f64,
    /// Mean final accuracy over the honest sites, attacked.
    pub attacked_mean: f64,
    /// `attacked_mean - clean_mean`, in percentage points.
    pub difference_points: f64,
    /// What the attackers sent.
    pub attack: Tally,
    /// Mallory's updates' answers, counted by answer.
    pub mallory_answers: BTreeMap<String, u64>,
    /// The attacked run's audit, counted by event.
    pub audit: BTreeMap<String, u64>,
    /// Wall seconds of the clean run.
    pub clean_seconds: f64,
    /// Wall seconds of the attacked run.
    pub attacked_seconds: f64,
}

/// Runs the benchmark for every BN policy of `opts`, prints its table and writes
/// `results/hostile.json`.
pub fn benchmark(opts: &Options, args: &Args) -> Result<Vec<HostileResult>> {
    let mut results = Vec::new();
    for p in &opts.policies {
        let r = one_policy(opts, args, run::bn_policy(p)?)?;
        println!("{}", render(&r));
        results.push(r);
    }
    std::fs::create_dir_all(&opts.out)?;
    let path = opts.out.join("hostile.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&results)?)?;
    println!("wrote {}", path.display());
    Ok(results)
}

/// The clean and the attacked run of one BN policy.
fn one_policy(opts: &Options, args: &Args, bn: BnPolicy) -> Result<HostileResult> {
    let policy = match bn {
        BnPolicy::Local => "local",
        BnPolicy::Global => "global",
    };
    let base = opts.work.join("hostile").join(policy);
    if base.exists() {
        std::fs::remove_dir_all(&base).with_context(|| format!("clearing {}", base.display()))?;
    }
    let keys = base.join("keys");
    let broker = |port| BrokerConfig::new("127.0.0.1", port);
    let configure = |fc: &mut FederationConfig| {
        if let Some(w) = args.max_weight_of_median {
            fc.max_weight_of_median = w;
        }
        if let Some(n) = args.max_norm_of_median {
            fc.max_norm_of_median = n;
        }
    };

    let mut recorder = None;
    let mut record = |port: u16, _: &Path| -> Result<()> {
        recorder = Some(Recorder::start(broker(port))?);
        Ok(())
    };
    let clean = run::federation_with(
        opts,
        bn,
        Setup {
            work: Some(base.join("clean")),
            keys: Some(keys.clone()),
            enrol: Vec::new(),
            started: Some(&mut record),
            configure: Some(&configure),
        },
    )?;
    let heard = recorder
        .take()
        .context("the recorder never started")?
        .stop()?;
    println!(
        "the stranger heard {} messages ({} MiB) of the clean run",
        heard.messages.len(),
        heard.bytes >> 20
    );

    std::fs::create_dir_all(keys.join(MALLORY))?;
    let mallory = SigningKey::load_or_create(&keys.join(MALLORY).join("identity.key"))?;
    let aggregator = SigningKey::load(&keys.join("aggregator.key"))?.public();
    let federation = Id::new(&format!("demo-{policy}")).map_err(anyhow::Error::msg)?;
    let mut earlier = Some(heard);
    let mut attack = None;
    let mut start = |port: u16, work: &Path| -> Result<()> {
        let model = work.join("init.safetensors");
        let spec = unifed_agent::model::read_spec(&unifed_protocol::spec_path(&model))?;
        attack = Some(Attack::start(Plan {
            broker: broker(port),
            federation: federation.clone(),
            spec,
            aggregator,
            mallory: mallory.clone(),
            earlier: earlier.take().unwrap_or_default(),
            args: args.clone(),
        })?);
        Ok(())
    };
    let attacked = run::federation_with(
        opts,
        bn,
        Setup {
            work: Some(base.join("attacked")),
            keys: Some(keys.clone()),
            enrol: vec![EnrolledSite::new(MALLORY, mallory.public())],
            started: Some(&mut start),
            configure: Some(&configure),
        },
    )?;
    let (tally, answers) = attack.take().context("the attack never started")?.stop()?;
    let audit = audit_counts(&base.join("attacked").join("aggregator"))?;
    Ok(compare(policy, (&clean, &attacked), tally, answers, audit))
}

/// The attacked run's audit events, counted.
fn audit_counts(dir: &Path) -> Result<BTreeMap<String, u64>> {
    let store = unifed_aggregator::store::Store::open(dir)?;
    let mut counts = BTreeMap::new();
    for e in store.audit_entries()? {
        *counts.entry(e.event).or_default() += 1;
    }
    Ok(counts)
}

fn compare(
    policy: &str,
    (clean, attacked): (&RunResult, &RunResult),
    attack: Tally,
    answers: Vec<(u64, String)>,
    audit: BTreeMap<String, u64>,
) -> HostileResult {
    let sites: Vec<SiteRow> = clean
        .sites
        .iter()
        .filter_map(|c| {
            let a = attacked.sites.iter().find(|a| a.site == c.site)?;
            Some(SiteRow {
                site: c.site.clone(),
                clean: c.final_accuracy,
                attacked: a.final_accuracy,
            })
        })
        .collect();
    let mean =
        |f: fn(&SiteRow) -> f64| sites.iter().map(f).sum::<f64>() / sites.len().max(1) as f64;
    let (clean_mean, attacked_mean) = (mean(|s| s.clean), mean(|s| s.attacked));
    let mut mallory_answers = BTreeMap::new();
    for (_, a) in answers {
        *mallory_answers.entry(a).or_default() += 1;
    }
    HostileResult {
        bn_policy: policy.into(),
        rounds: clean.rounds,
        clean_mean,
        attacked_mean,
        difference_points: 100.0 * (attacked_mean - clean_mean),
        sites,
        attack,
        mallory_answers,
        audit,
        clean_seconds: clean.wall_seconds,
        attacked_seconds: attacked.wall_seconds,
    }
}

/// The benchmark's table of one policy.
fn render(r: &HostileResult) -> String {
    let mut s = format!(
        "hostile-site benchmark, {} BN, {} rounds: final test accuracy of the honest sites\n{:<10} {:>8} {:>9} {:>7}\n",
        r.bn_policy, r.rounds, "site", "clean", "attacked", "points"
    );
    for row in &r.sites {
        s += &format!(
            "{:<10} {:>7.2}% {:>8.2}% {:>+7.2}\n",
            row.site,
            100.0 * row.clean,
            100.0 * row.attacked,
            100.0 * (row.attacked - row.clean)
        );
    }
    s += &format!(
        "{:<10} {:>7.2}% {:>8.2}% {:>+7.2}\nattack: {:?}\nmallory's answers: {:?}\naudit: {:?}",
        "mean",
        100.0 * r.clean_mean,
        100.0 * r.attacked_mean,
        r.difference_points,
        r.attack,
        r.mallory_answers,
        r.audit
    );
    s
}
