//! One federation of the demo: broker, aggregator and agents started as processes, their
//! reports followed with progress bars until the last round, and what they measured collected.

use crate::supervise::{Children, Line, Memory};
use anyhow::{Context, Result, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};
use unifed_agent::progress::{Phase, Report};
use unifed_agent::train::{AgentConfig, DataConfig, EvaluateAt};
use unifed_aggregator::config::{EnrolledSite, FederationConfig};
use unifed_aggregator::service::ServiceConfig;
use unifed_models::backend::Backend;
use unifed_models::data::Domain;
use unifed_net::BrokerConfig;
use unifed_protocol::SigningKey;
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::BnPolicy;

/// The demo's options.
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// Federated rounds of each run (12: about 14 minutes for both runs on 2 cores).
    #[arg(long, default_value_t = 12)]
    pub rounds: u64,
    /// Sites, one built-in training domain each (a domain named twice makes a second site,
    /// `<domain>-2`, with the same data).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "grey,texture,lowres,fonts,noisy"
    )]
    pub sites: Vec<String>,
    /// BN policies to run, in order: local (FedBN), global (FedAvg).
    #[arg(long, value_delimiter = ',', default_value = "local,global")]
    pub policies: Vec<String>,
    /// Training images per site (FedBN's 10% setting: 743).
    #[arg(long, default_value_t = 743)]
    pub train_samples: usize,
    /// Local epochs per round.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Encoding of updates and model deltas: f32, f16, q8, ternary[b<block>],
    /// ternaryq8[b<block>] (e.g. ternaryq8b64), topk<per-mille> or topkq8<per-mille>.
    #[arg(long, default_value = "f32")]
    pub encoding: String,
    /// Compute backend of the agents: flex (CPU), or wgpu, vulkan or cuda where the demo was
    /// built with that feature (`cargo build --release -p unifed-demo --features vulkan`).
    #[arg(long, default_value = "flex")]
    pub backend: String,
    /// When agents evaluate each model they train from: before-training, or while-uploading
    /// (on a copy frozen before training). Default: the agents' own, while uploading on a GPU.
    #[arg(long)]
    pub evaluate_at: Option<EvaluateAt>,
    /// CPU threads per agent process (default: cores / sites, at least 1).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Initialisation and training seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Working folder (configs, logs, checkpoints, the aggregator's data); wiped per run.
    #[arg(long, default_value = "run/demo")]
    pub work: PathBuf,
    /// Results folder (federation.json, federation.svg).
    #[arg(long, default_value = "results")]
    pub out: PathBuf,
}

/// One site's figures from one run.
#[derive(Debug, Clone, Serialize)]
pub struct SiteResult {
    /// Site id.
    pub site: String,
    /// Its built-in domain.
    pub domain: String,
    /// Test accuracy of the site's model after each version (index = version; v0 = initial).
    pub accuracy: Vec<f64>,
    /// Test accuracy at the end.
    pub final_accuracy: f64,
    /// Bytes of each round's update (envelope), by round.
    pub upload_bytes: Vec<u64>,
    /// MQTT messages of each round's update.
    pub upload_messages: Vec<u64>,
    /// Bytes of each model fetched, by version.
    pub download_bytes: Vec<u64>,
}

/// The moment the demo's processes together held the most memory.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PeakMoment {
    /// Seconds since the run started.
    pub seconds: f64,
    /// Each process's resident memory then, bytes.
    pub rss_bytes: BTreeMap<String, u64>,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// `FedBN` or `FedAvg`.
    pub name: String,
    /// `local` or `global`.
    pub bn_policy: String,
    /// Rounds run.
    pub rounds: u64,
    /// Per site.
    pub sites: Vec<SiteResult>,
    /// Seconds each round took (round 1 from the aggregator's start, so it includes the
    /// agents' start-up and first model fetch).
    pub round_seconds: Vec<f64>,
    /// Whole run, seconds.
    pub wall_seconds: f64,
    /// Peak of the summed resident memory of all the demo's processes, bytes.
    pub peak_rss_total_bytes: u64,
    /// Each process's peak resident memory, bytes: the higher of its `VmHWM` sampled every
    /// 100 ms and the peaks it reported for its phases (see [`highest_peaks`]).
    pub peak_rss_bytes: BTreeMap<String, u64>,
    /// When the summed peak happened (seconds since the start, as `spans` count) and each
    /// process's resident memory then, bytes: what the peak is made of.
    pub peak_rss_total_at: PeakMoment,
    /// CPU threads per agent.
    pub threads_per_agent: usize,
    /// Where each round's time went.
    pub timeline: Vec<RoundTimeline>,
    /// The highest peak resident memory any process reported for each phase over the whole
    /// run, bytes: the rounds' and the final model's (its apply, checkpoint and evaluation,
    /// reported for round `rounds + 1`).
    pub phase_peak_bytes: BTreeMap<Phase, u64>,
    /// Every phase every process reported, in the order the demo read them: the run as a
    /// Gantt chart, from which the critical path of a round can be read.
    pub spans: Vec<Span>,
}

/// One phase of one process, when it ran.
#[derive(Debug, Clone, Serialize)]
pub struct Span {
    /// The process: a site's id, or `aggregator`.
    pub who: String,
    /// The round the phase is of (`rounds + 1` for the final model's).
    pub round: u64,
    /// The phase.
    pub phase: Phase,
    /// When it started and ended, seconds since the run started.
    pub start: f64,
    /// See `start`.
    pub end: f64,
}

/// One phase of one round: over the sites for site phases, over the round's updates or calls
/// for the aggregator's.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseStat {
    /// Sum of the reported durations, seconds.
    pub total: f64,
    /// The longest one, seconds.
    pub max: f64,
    /// How many were reported.
    pub count: usize,
    /// The highest peak resident memory a process reported for the phase, bytes (0 when
    /// none was reported): which phase sets a process's peak.
    pub peak_bytes: u64,
}

impl PhaseStat {
    /// The mean duration (0 when none was reported).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total / self.count as f64
        }
    }
}

/// Where one round's time went: every phase the agents and the aggregator reported for it.
#[derive(Debug, Clone, Serialize)]
pub struct RoundTimeline {
    /// The round.
    pub round: u64,
    /// Seconds from the previous round's close (or the start) to this one's.
    pub wall_seconds: f64,
    /// Each phase's durations.
    pub phases: BTreeMap<Phase, PhaseStat>,
    /// The slowest site's training, seconds: what the round cannot be shorter than.
    pub training_seconds: f64,
    /// `wall - training`: everything that is not training on the critical path.
    pub overhead_seconds: f64,
    /// `overhead / wall`.
    pub overhead_share: f64,
    /// Seconds of the round in which neither a site nor the aggregator was in any phase: the
    /// time messages spend between processes, and whatever work no phase names.
    pub idle_seconds: f64,
    /// CPU seconds each process used in the round (user and system, every thread), by name.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// CPU seconds all processes used in the round: on a machine with fewer cores than
    /// processes, what the round's length follows.
    pub cpu_total: f64,
    /// The overhead without the longest evaluation a site's training waited for (the demo's
    /// own measurement, which a deployed agent can turn off; one made while the update uploads
    /// holds no training up), as a share of the wall time.
    pub overhead_share_without_evaluation: f64,
}

/// A reported phase: its round, phase, seconds, peak resident memory, and when it ended (ms
/// since the Unix epoch).
type PhaseReport = (u64, Phase, f64, Option<u64>, Option<u64>);

/// Each process's peak: the higher of its sampled `VmHWM` (`sampled`) and the highest peak it
/// reported for a phase (`reported`). A process that reports phases resets its `VmHWM` as each
/// phase ends, so a peak inside a phase that ended between two samples shows in its report
/// alone.
fn highest_peaks(
    mut sampled: BTreeMap<String, u64>,
    reported: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    for (who, &peak) in reported {
        let e = sampled.entry(who.clone()).or_default();
        *e = (*e).max(peak);
    }
    sampled
}

/// Seconds of the window `[from, to]` (seconds) that none of `busy` (start and end, seconds)
/// covers.
fn uncovered(from: f64, to: f64, busy: &[(f64, f64)]) -> f64 {
    let mut spans: Vec<(f64, f64)> = busy
        .iter()
        .map(|&(a, b)| (a.max(from), b.min(to)))
        .filter(|(a, b)| a < b)
        .collect();
    spans.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (mut covered, mut reach) = (0.0, from);
    for (a, b) in spans {
        if b > reach {
            covered += b - a.max(reach);
            reach = b;
        }
    }
    (to - from) - covered
}

/// Builds the timelines of rounds `1..=rounds` from the reported phases and the times rounds
/// closed (seconds since `start_ms`, ms since the Unix epoch).
/// `cpu` holds each process's CPU seconds at the start and at each close.
fn timelines(
    rounds: u64,
    start_ms: u64,
    closed: &[f64],
    cpu: &[BTreeMap<String, f64>],
    phases: &[PhaseReport],
    spans: &[Span],
) -> Vec<RoundTimeline> {
    // Every phase as seconds since the start, whatever round it is of.
    let busy: Vec<(f64, f64)> = phases
        .iter()
        .filter_map(|&(_, _, secs, _, ended)| {
            let end = (ended? as f64 - start_ms as f64) / 1000.0;
            Some((end - secs, end))
        })
        .collect();
    let mut prev = 0.0;
    (1..=rounds)
        .zip(closed)
        .zip(cpu.windows(2))
        .map(|((round, &t), cpu)| {
            let wall = t - prev;
            let idle = uncovered(prev, t, &busy);
            prev = t;
            let cpu_seconds: BTreeMap<String, f64> = cpu[1]
                .iter()
                .map(|(who, &s)| (who.clone(), s - cpu[0].get(who).copied().unwrap_or(0.0)))
                .collect();
            let mut by: BTreeMap<Phase, PhaseStat> = BTreeMap::new();
            for &(_, p, secs, peak, _) in phases.iter().filter(|(r, ..)| *r == round) {
                let e = by.entry(p).or_default();
                e.total += secs;
                e.max = e.max.max(secs);
                e.count += 1;
                e.peak_bytes = e.peak_bytes.max(peak.unwrap_or(0));
            }
            let max = |p: Phase| by.get(&p).map_or(0.0, |s| s.max);
            let training = max(Phase::Train);
            let overhead = wall - training;
            // An evaluation holds the round up when it ended before its site's training began.
            let trains_after = |e: &Span| {
                spans.iter().any(|t| {
                    t.round == round
                        && t.phase == Phase::Train
                        && t.who == e.who
                        && e.end <= t.start + 0.001
                })
            };
            let waited = spans
                .iter()
                .filter(|e| e.round == round && e.phase == Phase::Evaluate && trains_after(e))
                .map(|e| e.end - e.start)
                .fold(0.0, f64::max);
            RoundTimeline {
                round,
                wall_seconds: wall,
                training_seconds: training,
                overhead_seconds: overhead,
                overhead_share: overhead / wall,
                idle_seconds: idle,
                overhead_share_without_evaluation: (overhead - waited) / wall,
                cpu_total: cpu_seconds.values().sum(),
                cpu_seconds,
                phases: by,
            }
        })
        .collect()
}

/// Site ids and domains of the options (`grey`, `grey-2`, ... for repeats).
pub fn sites(opts: &Options) -> Result<Vec<(String, Domain)>> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for s in &opts.sites {
        let d = Domain::parse(s).map_err(anyhow::Error::msg)?;
        let n = seen.entry(s.clone()).or_default();
        *n += 1;
        let id = if *n == 1 {
            s.clone()
        } else {
            format!("{s}-{n}")
        };
        out.push((id, d));
    }
    if out.is_empty() {
        bail!("--sites names no site");
    }
    Ok(out)
}

/// The BN policy a `--policies` entry names: `local` (or `fedbn`), `global` (or `fedavg`).
pub fn bn_policy(name: &str) -> Result<BnPolicy> {
    Ok(match name {
        "local" | "fedbn" => BnPolicy::Local,
        "global" | "fedavg" => BnPolicy::Global,
        other => bail!("unknown BN policy `{other}`: local (FedBN) or global (FedAvg)"),
    })
}

/// The agents' backend of the options, checked to be compiled into this binary (the agents
/// are this binary in another role) before anything starts.
pub fn agent_backend(opts: &Options) -> Result<Backend> {
    let backend: Backend = opts.backend.parse().map_err(anyhow::Error::msg)?;
    backend.ensure_compiled().map_err(anyhow::Error::msg)?;
    Ok(backend)
}

fn style(t: &str) -> ProgressStyle {
    ProgressStyle::with_template(t)
        .expect("static template")
        .progress_chars("=> ")
}

/// Runs one federation with `bn` and returns its figures.
pub fn federation(opts: &Options, bn: BnPolicy) -> Result<RunResult> {
    federation_with(opts, bn, Setup::default())
}

/// What [`Setup::started`] calls: the broker's port, the run's folder.
pub type Started<'a> = dyn FnMut(u16, &Path) -> Result<()> + 'a;

/// What [`Setup::configure`] calls on the federation's config.
pub type Configure<'a> = dyn Fn(&mut FederationConfig) + 'a;

/// What a run of [`federation_with`] changes of the plain demo federation (the hostile-site
/// benchmark runs it clean, then attacked, with the same keys).
#[derive(Default)]
pub struct Setup<'a> {
    /// The run's working folder, wiped first (default: `<work>/<policy>`).
    pub work: Option<PathBuf>,
    /// Where the aggregator's and the sites' keys are made, or kept from an earlier run
    /// (default: the run's folder).
    pub keys: Option<PathBuf>,
    /// Sites enrolled beside the demo's own that run no agent of the demo's; the rounds wait
    /// for them too.
    pub enrol: Vec<EnrolledSite>,
    /// Called with the broker's port and the run's folder once every process started.
    pub started: Option<&'a mut Started<'a>>,
    /// Changes the federation's config from the demo's.
    pub configure: Option<&'a Configure<'a>>,
}

/// [`federation`], changed as `setup` says.
pub fn federation_with(opts: &Options, bn: BnPolicy, mut setup: Setup<'_>) -> Result<RunResult> {
    let (name, policy) = match bn {
        BnPolicy::Local => ("FedBN", "local"),
        BnPolicy::Global => ("FedAvg", "global"),
    };
    let sites = sites(opts)?;
    let backend = agent_backend(opts)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = opts.threads.unwrap_or((cores / sites.len()).max(1));
    // Absolute: a config's relative paths are relative to the config file's folder.
    let work = std::path::absolute(setup.work.take().unwrap_or_else(|| opts.work.join(policy)))?;
    fresh_dir(&work)?;
    let keys = std::path::absolute(setup.keys.take().unwrap_or_else(|| work.clone()))?;
    let t0 = Instant::now();
    let start_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut kids = Children::new();

    let port = start_broker(&mut kids, &work)?;

    launch(
        &mut kids,
        (&work, &keys),
        opts,
        (&sites, std::mem::take(&mut setup.enrol)),
        (bn, policy, setup.configure),
        (port, &backend.to_string(), threads),
    )?;
    if let Some(started) = setup.started.take() {
        started(port, &work)?;
    }

    // Progress: one bar for the rounds, one per site.
    let mp = MultiProgress::new();
    let hidden = mp.is_hidden();
    let say = |s: String| {
        if hidden {
            println!("{s}");
        } else {
            let _ = mp.println(s);
        }
    };
    say(format!(
        "{name} ({policy} BN): broker on 127.0.0.1:{port}, aggregator, {} agents x {threads} thread(s) on {backend}, {} rounds; logs in {}",
        sites.len(),
        opts.rounds,
        work.display()
    ));
    let (rounds_bar, bars) = progress_bars(&mp, name, opts.rounds, &sites);
    let mut results = site_results(&sites);
    let mut rec = Recorded {
        start_ms,
        cpu_closed: vec![kids.cpu_seconds()],
        ..Recorded::default()
    };
    let mut done: BTreeMap<String, bool> = BTreeMap::new();
    // The aggregator stops by itself once every site holds the final model, which may be
    // before the last agent's end is read here.
    let mut stopped = false;
    while done.len() < sites.len() {
        let Some(line) = next_line(&mut kids, &work, stopped)? else {
            continue;
        };
        match line {
            Line::Closed { who } if results.contains_key(&who) => {
                agent_ended(&mut kids, &work, &who)?;
                bars[&who].finish_with_message(format!(
                    "finished: {:.2}% test accuracy",
                    100.0 * results[&who].final_accuracy
                ));
                done.insert(who, true);
            }
            Line::Closed { who } if who == "aggregator" && stopped => {}
            Line::Closed { who } => {
                bail!(
                    "the {who} stopped; see {}",
                    work.join(format!("{who}.log")).display()
                )
            }
            Line::Out { who, text } if who == "aggregator" => {
                let closed = |round, model_version, n: usize| {
                    rounds_bar.inc(1);
                    say(format!(
                        "{name}: round {round} closed with {n} update(s) -> model v{model_version}"
                    ));
                };
                stopped |= aggregator_line(&text, &mut rec, &kids, t0, closed);
            }
            Line::Out { who, text } => {
                let (Some(r), Some(bar)) = (Report::parse(&text), bars.get(&who)) else {
                    continue;
                };
                let site = results.get_mut(&who).expect("known site");
                if let Some(p) = site_report(&who, r, site, bar)? {
                    rec.phase(&who, p);
                }
            }
        }
    }
    rounds_bar.finish();
    let memory = kids.memory();
    drop(kids);
    let sites = sites
        .iter()
        .filter_map(|(id, _)| results.remove(id))
        .collect();
    let mut run = rec.run_result(opts.rounds, memory, sites);
    run.name = name.into();
    run.bn_policy = policy.into();
    run.wall_seconds = t0.elapsed().as_secs_f64();
    run.threads_per_agent = threads;
    Ok(run)
}

/// Records what the aggregator's report line `text` says: a closed round (when, every
/// process's CPU seconds, and `closed(round, model version, updates)`) or a phase; true once it
/// says it stopped.
fn aggregator_line(
    text: &str,
    rec: &mut Recorded,
    kids: &Children,
    t0: Instant,
    closed: impl Fn(u64, u64, usize),
) -> bool {
    match Report::parse(text) {
        Some(Report::Stopped { .. }) => return true,
        Some(Report::RoundClosed {
            round,
            model_version,
            sites,
        }) => {
            rec.round_closed.push(t0.elapsed().as_secs_f64());
            rec.cpu_closed.push(kids.cpu_seconds());
            closed(round, model_version, sites.len());
        }
        Some(Report::Phase {
            round,
            phase,
            seconds,
            peak_bytes,
            ended_ms,
        }) => rec.phase("aggregator", (round, phase, seconds, peak_bytes, ended_ms)),
        _ => {}
    }
    false
}

/// Empties the folder `dir` (made when missing): each run starts from nothing.
fn fresh_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// What a run's processes reported about time and memory, gathered as they report it.
#[derive(Default)]
struct Recorded {
    /// When the run started, ms since the Unix epoch.
    start_ms: u64,
    /// Seconds since the start when each round closed.
    round_closed: Vec<f64>,
    /// Every process's CPU seconds when the first round starts, then at each close.
    cpu_closed: Vec<BTreeMap<String, f64>>,
    /// Every phase report.
    phases: Vec<PhaseReport>,
    /// The phases that said when they ended, on the run's clock.
    spans: Vec<Span>,
    /// The highest peak each process reported for a phase.
    reported_peaks: BTreeMap<String, u64>,
}

impl Recorded {
    /// A phase report of `who`: it counts in its round's timeline and, when it says when it
    /// ended, as a span.
    fn phase(&mut self, who: &str, p: PhaseReport) {
        self.phases.push(p);
        let (round, phase, seconds, peak, ended) = p;
        let e = self.reported_peaks.entry(who.to_string()).or_default();
        *e = (*e).max(peak.unwrap_or(0));
        if let Some(ended) = ended {
            let end = (ended as f64 - self.start_ms as f64) / 1000.0;
            self.spans.push(Span {
                who: who.to_string(),
                round,
                phase,
                start: end - seconds,
                end,
            });
        }
    }

    /// The run's result from what was recorded, the processes' `memory` and the `sites`'
    /// results (name, policy, wall time and threads left for the caller to fill in).
    fn run_result(self, rounds: u64, memory: Memory, sites: Vec<SiteResult>) -> RunResult {
        let timeline = timelines(
            rounds,
            self.start_ms,
            &self.round_closed,
            &self.cpu_closed,
            &self.phases,
            &self.spans,
        );
        let mut phase_peak_bytes: BTreeMap<Phase, u64> = BTreeMap::new();
        for &(_, p, _, peak, _) in &self.phases {
            let e = phase_peak_bytes.entry(p).or_default();
            *e = (*e).max(peak.unwrap_or(0));
        }
        RunResult {
            name: String::new(),
            bn_policy: String::new(),
            rounds,
            sites,
            round_seconds: timeline.iter().map(|t| t.wall_seconds).collect(),
            wall_seconds: 0.0,
            peak_rss_total_bytes: memory.peak_total,
            peak_rss_bytes: highest_peaks(memory.peak_each, &self.reported_peaks),
            peak_rss_total_at: PeakMoment {
                seconds: memory.peak_total_at.0.saturating_sub(self.start_ms) as f64 / 1000.0,
                rss_bytes: memory.peak_total_at.1,
            },
            threads_per_agent: 0,
            timeline,
            phase_peak_bytes,
            spans: self.spans,
        }
    }
}

/// Writes the initial model, every party's identity and config, and starts the aggregator and
/// one agent per site (`threads` each, on `backend`) against the broker on `port`.
fn launch(
    kids: &mut Children,
    (work, keys): (&Path, &Path),
    opts: &Options,
    (sites, extra): (&[(String, Domain)], Vec<EnrolledSite>),
    (bn, policy, configure): (BnPolicy, &str, Option<&Configure<'_>>),
    (port, backend, threads): (u16, &str, usize),
) -> Result<()> {
    let broker = BrokerConfig::new("127.0.0.1", port);
    let encoding: Encoding = opts.encoding.parse().map_err(anyhow::Error::msg)?;
    // The initial model: the same seed for both runs.
    let device = unifed_models::backend::Backend::Flex
        .device()
        .map_err(anyhow::Error::msg)?;
    let model = work.join("init.safetensors");
    unifed_agent::model::write_initial("digits", &Default::default(), opts.seed, &device, &model)?;
    // The supervisor holds nothing of the model from here on.
    unifed_net::release_free_memory();

    // Identities as a real deployment makes them: each party's key on its own disk, only the
    // public keys exchanged (sites enrolled with the aggregator, the aggregator pinned by sites).
    std::fs::create_dir_all(keys)?;
    let agg_key_path = keys.join("aggregator.key");
    let agg_key = SigningKey::load_or_create(&agg_key_path)?;
    let mut enrolled = Vec::new();
    for (id, _) in sites {
        std::fs::create_dir_all(work.join(id))?;
        std::fs::create_dir_all(keys.join(id))?;
        let key = SigningKey::load_or_create(&keys.join(id).join("identity.key"))?;
        enrolled.push(EnrolledSite::new(id, key.public()));
    }
    enrolled.extend(extra);
    // Every round waits for every enrolled site.
    let mut fc = FederationConfig::new(
        &format!("demo-{policy}"),
        opts.rounds,
        enrolled.len(),
        enrolled,
    );
    fc.deadline_secs = 3600;
    fc.encoding = encoding;
    fc.bn_policy = bn;
    if let Some(configure) = configure {
        configure(&mut fc);
    }
    let agg = ServiceConfig {
        data_dir: work.join("aggregator"),
        model: model.clone(),
        key: agg_key_path,
        chunk_bytes: unifed_protocol::chunking::CHUNK_BYTES,
        linger_secs: 3600,
        manifest_every_secs: 30,
        // Spooled on disk as chunks arrive: room for every site's largest update.
        max_upload_bytes: 4 << 30,
        broker: broker.clone(),
        federation: fc.clone(),
    };
    let agg_toml = work.join("aggregator.toml");
    std::fs::write(&agg_toml, toml::to_string(&agg)?)?;
    kids.spawn(
        "aggregator",
        &["aggregator", "--config", &agg_toml.to_string_lossy()],
        &work.join("aggregator.log"),
        &[("UNIFED_REPORT", "1")],
    )?;
    for (id, domain) in sites {
        let cfg = AgentConfig {
            site: id.clone(),
            federation: fc.federation.clone(),
            state_dir: work.join(id),
            // Outside the run's folder, which each run wipes: a GPU tunes once per site.
            kernel_cache: Some(std::path::absolute(opts.work.join("kernels").join(id))?),
            profile: None,
            memory_budget_mib: None,
            backend: backend.to_string(),
            // The spec written beside the initial model decides every site's model.
            spec: Some(unifed_protocol::spec_path(&model)),
            model: Default::default(),
            train: unifed_models::train::TrainConfig {
                epochs: opts.epochs,
                seed: opts.seed,
                ..Default::default()
            },
            resend_secs: 120,
            threads: Some(threads),
            evaluate_each_model: true,
            evaluate_at: opts.evaluate_at,
            join_bn: Default::default(),
            site_key: None,
            identity: keys.join(id).join("identity.key"),
            aggregator_key: agg_key.public(),
            broker: broker.clone(),
            data: DataConfig {
                builtin: Some(domain.name().into()),
                folder: None,
                train_samples: opts.train_samples,
            },
        };
        let path = work.join(format!("{id}.toml"));
        std::fs::write(&path, toml::to_string(&cfg)?)?;
        kids.spawn(
            id,
            &["agent", "--config", &path.to_string_lossy()],
            &work.join(format!("{id}.log")),
            &[("UNIFED_REPORT", "1")],
        )?;
    }
    Ok(())
}

/// The next line a process wrote, `None` after half a second of silence; an error once the
/// broker or the aggregator stopped (but for the aggregator's own stop once it `stopped`), or
/// every process.
fn next_line(kids: &mut Children, work: &Path, stopped: bool) -> Result<Option<Line>> {
    match kids.rx.recv_timeout(Duration::from_millis(500)) {
        Ok(l) => Ok(Some(l)),
        Err(RecvTimeoutError::Timeout) => {
            for who in ["broker", "aggregator"] {
                if let Some(st) = kids.exited(who)
                    && !(who == "aggregator" && stopped && st.success())
                {
                    bail!(
                        "the {who} stopped ({st}); see {}",
                        work.join(format!("{who}.log")).display()
                    );
                }
            }
            Ok(None)
        }
        Err(RecvTimeoutError::Disconnected) => bail!("every process stopped"),
    }
}

/// The agent `who` closed its output: an error unless it exited successfully.
fn agent_ended(kids: &mut Children, work: &Path, who: &str) -> Result<()> {
    let st = loop {
        if let Some(s) = kids.exited(who) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !st.success() {
        bail!(
            "agent {who} failed ({st}); see {}",
            work.join(format!("{who}.log")).display()
        );
    }
    Ok(())
}

/// The progress bars of a run: one for the rounds, one per site.
fn progress_bars(
    mp: &MultiProgress,
    name: &str,
    rounds: u64,
    sites: &[(String, Domain)],
) -> (ProgressBar, BTreeMap<String, ProgressBar>) {
    let rounds_bar = mp.add(ProgressBar::new(rounds).with_style(style(
        "{prefix:>10} [{bar:30}] round {pos}/{len} {elapsed_precise} {msg}",
    )));
    rounds_bar.set_prefix(name.to_string());
    let bars = sites
        .iter()
        .map(|(id, _)| {
            let b = mp.add(ProgressBar::new(1).with_style(style("{prefix:>10} [{bar:30}] {msg}")));
            b.set_prefix(id.clone());
            b.set_message("starting");
            (id.clone(), b)
        })
        .collect();
    (rounds_bar, bars)
}

/// Every site's results before its agent reports anything.
fn site_results(sites: &[(String, Domain)]) -> BTreeMap<String, SiteResult> {
    sites
        .iter()
        .map(|(id, d)| {
            (
                id.clone(),
                SiteResult {
                    site: id.clone(),
                    domain: d.name().into(),
                    accuracy: Vec::new(),
                    final_accuracy: f64::NAN,
                    upload_bytes: Vec::new(),
                    upload_messages: Vec::new(),
                    download_bytes: Vec::new(),
                },
            )
        })
        .collect()
}

/// Starts the broker on a free loopback port and gives the port its first line names.
fn start_broker(kids: &mut Children, work: &Path) -> Result<u16> {
    // The broker on a free loopback port; its first line names the port.
    kids.spawn(
        "broker",
        &["broker", "--listen", "127.0.0.1:0"],
        &work.join("broker.log"),
        &[],
    )?;
    loop {
        match kids.rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Line::Out { who, text }) if who == "broker" => {
                if let Some(p) = text.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()) {
                    return Ok(p);
                }
            }
            Ok(_) => {}
            Err(_) => bail!(
                "the broker did not start (see {})",
                work.join("broker.log").display()
            ),
        }
    }
}

/// Takes one typed report of the agent `who` into its results and progress bar; gives a phase
/// report back for the timeline. A rejected update ends the demo.
fn site_report(
    who: &str,
    r: Report,
    site: &mut SiteResult,
    bar: &ProgressBar,
) -> Result<Option<PhaseReport>> {
    match r {
        Report::Training {
            round,
            epoch,
            done,
            steps,
        } => {
            bar.set_length(steps as u64);
            bar.set_position(done as u64);
            bar.set_message(format!("round {round}: training, epoch {}", epoch + 1));
        }
        Report::Uploaded {
            round,
            bytes,
            messages,
        } => {
            site.upload_bytes.push(bytes);
            site.upload_messages.push(messages);
            bar.set_message(format!(
                "round {round}: sent {:.1} MB in {messages} messages",
                bytes as f64 / 1e6
            ));
        }
        Report::Answered { round, accepted } => {
            if !accepted {
                bail!("the aggregator rejected {who}'s round-{round} update");
            }
            bar.set_message(format!("round {round}: accepted, waiting for the others"));
        }
        Report::Applied {
            version,
            bytes,
            seconds,
        } => {
            site.download_bytes.push(bytes);
            bar.set_message(format!(
                "model v{version}: fetched {:.1} MB in {seconds:.1} s",
                bytes as f64 / 1e6
            ));
        }
        Report::Evaluated { version, accuracy } => {
            if site.accuracy.len() as u64 == version {
                site.accuracy.push(accuracy);
            }
            site.final_accuracy = accuracy;
            bar.set_message(format!(
                "model v{version}: {:.2}% test accuracy",
                100.0 * accuracy
            ));
        }
        Report::Phase {
            round,
            phase,
            seconds,
            peak_bytes,
            ended_ms,
        } => return Ok(Some((round, phase, seconds, peak_bytes, ended_ms))),
        // The aggregator's.
        Report::RoundClosed { .. }
        | Report::Connection { .. }
        | Report::Revocations { .. }
        | Report::Stopped { .. } => {}
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use unifed_aggregator::config::default_broker_update_log_bytes;

    #[test]
    fn a_process_peak_is_the_higher_of_its_samples_and_its_phase_reports() {
        let sampled = BTreeMap::from([
            ("aggregator".to_string(), 199 << 20),
            ("broker".to_string(), 170 << 20),
            ("grey".to_string(), 190 << 20),
        ]);
        // The aggregator's spool peaked between two samples; grey's phases stayed below its
        // sampled peak; a process only its reports name still gets a peak.
        let reported = BTreeMap::from([
            ("aggregator".to_string(), 233 << 20),
            ("grey".to_string(), 185 << 20),
            ("texture".to_string(), 187 << 20),
        ]);
        let peaks = super::highest_peaks(sampled, &reported);
        assert_eq!(
            peaks,
            BTreeMap::from([
                ("aggregator".to_string(), 233 << 20),
                ("broker".to_string(), 170 << 20),
                ("grey".to_string(), 190 << 20),
                ("texture".to_string(), 187 << 20),
            ])
        );
    }

    #[test]
    fn idle_time_is_what_no_phase_covers_within_the_round() {
        // Overlapping, nested, touching and outside spans; one straddles each edge.
        let busy = [
            (-1.0, 0.5),
            (1.0, 2.0),
            (1.5, 1.8),
            (2.0, 3.0),
            (2.5, 3.5),
            (6.0, 7.0),
            (9.5, 12.0),
            (20.0, 21.0),
        ];
        let idle = super::uncovered(0.0, 10.0, &busy);
        // Covered: [0, 0.5], [1, 3.5], [6, 7], [9.5, 10] = 0.5 + 2.5 + 1 + 0.5.
        assert!((idle - 5.5).abs() < 1e-12, "{idle}");
        assert_eq!(super::uncovered(0.0, 4.0, &[]), 4.0);
        assert_eq!(super::uncovered(0.0, 4.0, &[(-1.0, 5.0)]), 0.0);
    }

    #[test]
    fn only_an_evaluation_a_training_waited_for_counts_as_evaluation_overhead() {
        use super::{Phase, Span};
        // Site a evaluates (1 s) before it trains (5 s); site b trains (4 s) and then
        // evaluates (3 s) while its update uploads. The round closes at 10 s.
        let reports = [
            ("a", Phase::Evaluate, 1.0, 2.0),
            ("a", Phase::Train, 5.0, 7.0),
            ("b", Phase::Train, 4.0, 6.0),
            ("b", Phase::Evaluate, 3.0, 9.5),
        ];
        let phases: Vec<super::PhaseReport> = reports
            .iter()
            .map(|&(_, p, secs, end)| (1, p, secs, None, Some((end * 1000.0) as u64)))
            .collect();
        let spans: Vec<Span> = reports
            .iter()
            .map(|&(who, phase, secs, end)| Span {
                who: who.into(),
                round: 1,
                phase,
                start: end - secs,
                end,
            })
            .collect();
        let cpu = vec![Default::default(), Default::default()];
        let t = &super::timelines(1, 0, &[10.0], &cpu, &phases, &spans)[0];
        assert_eq!((t.wall_seconds, t.training_seconds), (10.0, 5.0));
        assert!(
            (t.overhead_share - 0.5).abs() < 1e-12,
            "{}",
            t.overhead_share
        );
        // Site a's evaluation held the round up; site b's, longer, did not.
        assert!(
            (t.overhead_share_without_evaluation - 0.4).abs() < 1e-12,
            "{}",
            t.overhead_share_without_evaluation
        );
    }

    #[test]
    fn a_backend_this_binary_lacks_stops_the_demo_before_anything_starts() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            opts: super::Options,
        }
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        let opts = |backend: &str| {
            Cli::parse_from([
                "demo",
                "--backend",
                backend,
                "--work",
                work.to_str().unwrap(),
            ])
            .opts
        };
        assert_eq!(
            super::agent_backend(&opts("flex")).unwrap(),
            unifed_models::backend::Backend::Flex
        );
        let err = super::federation(&opts("cuda"), unifed_protocol::messages::BnPolicy::Local)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::agent_backend(&opts("tpu")).unwrap_err().to_string();
        assert!(err.contains("unknown backend `tpu`"), "{err}");
        // Nothing was set up: no work folder, no broker, no processes.
        assert!(!work.exists());
    }

    #[test]
    fn the_aggregator_assumes_the_update_log_the_embedded_broker_keeps() {
        // Upload windows are shares of this log: a larger assumption would overrun the broker.
        assert_eq!(
            default_broker_update_log_bytes(),
            unifed_broker::SHARED_LOG_BYTES as u64
        );
    }
}
