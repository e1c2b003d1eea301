//! The experiment runner: a TOML preset names algorithms x BN policies x seeds, and each
//! combination runs as an in-process federation over the real encoded messages (the site
//! engine of the agent). Every site is evaluated after every round on its validation split and
//! its test split, so a run can be read as UniFed reads it: the test accuracy of the round each
//! site's validation accuracy picks ("best on validation"), beside the final round's.
//!
//! Each finished run is written to `<out>/runs/` at once and found again by the next start with
//! the same preset, so a long experiment resumes where it stopped (a run cut off mid-way is run
//! again from its start). The tables (UniFed Table 2's shape: per site, mean over sites, mean
//! (std) over seeds, and the gain of `local` over `global` BN per algorithm) and a convergence
//! chart are written to `<out>/internal.{md,json,svg}`.
//!
//! The sites are the built-in training domains, or the domains of a user's folder
//! (`<root>/<domain>/{train,val,test}/<class>/<image>`, classes the union of the class folders),
//! loaded once per experiment. With `[external]`, each domain is also held out in turn and scored
//! after the others federate (UniFed Table 3's shape, `<out>/external.{md,json}`). Loss curves
//! (each site's reported training loss and its test loss per round) go to the JSON and to
//! `<out>/internal-loss.svg`, per-site accuracy and loss charts of each method to
//! `<out>/charts/`. Label skew (`data = { dirichlet = ... }`, with `fraction` of the sites
//! sampled per round) runs the same way.

use crate::{RoundRecord, Site, Sites, initial_model, run_federation};
use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;
use unifed_aggregator::{Algorithm, FederationConfig};
use unifed_models::backend::Backend;
use unifed_models::bn::{CalibrateConfig, StreamConfig};
use unifed_models::calibrate::calibrate;
use unifed_models::checkpoint::write_atomic;
use unifed_models::client::ClientState;
use unifed_models::data::{BuiltinData, SplitSizes};
use unifed_models::state::{CheckedImport, Select, export, import};
use unifed_models::train::{EVAL_BATCH, TrainConfig, evaluate, evaluate_stream};
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, seeded};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::{BnPolicy, BnSharing, ServerBroadcast};

mod data;
mod tables;
mod trace;

pub use data::{DataSource, LabelSkew, SiteData, load_sites};
pub use tables::{mean_std, method_name};
use tables::{write_external, write_tables};
pub use trace::FedImproRound;
use unifed_protocol::ModelSpec;

/// An experiment: what to run and on which data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    /// The experiment's name (its results go to `results/experiments/<name>` by default).
    pub name: String,
    /// The algorithms, each as in the aggregator's config (`{ name = "fedprox", mu = 0.01 }`).
    pub algorithms: Vec<Algorithm>,
    /// The BN policies each algorithm runs under (`local`, `global`; `Local` and `Global` still
    /// read, with a warning).
    #[serde(
        deserialize_with = "unifed_aggregator::spelling::read_bn_policies",
        serialize_with = "unifed_aggregator::spelling::write_bn_policies"
    )]
    pub policies: Vec<BnPolicy>,
    /// Seeds 0..seeds (initial model and local training).
    pub seeds: u64,
    /// Federated rounds of each run.
    pub rounds: u64,
    /// Local epochs per round.
    #[serde(default = "one")]
    pub epochs: usize,
    /// Images per built-in training domain in each split.
    #[serde(default)]
    pub sizes: SplitSizes,
    /// The digits CNN's widths and input size (FedBN's full size by default); its class count
    /// comes from the data.
    #[serde(default)]
    pub model: DigitsCnnConfig,
    /// Where the sites' data comes from.
    #[serde(default)]
    pub data: DataSource,
    /// The external table by leave-one-domain-out rotation; absent: none.
    #[serde(default)]
    pub external: Option<External>,
    /// The fraction of the sites sampled to train each round (FedImpro's label skew: 0.5,
    /// five of ten); every site evaluates every round's model.
    #[serde(default = "all")]
    pub fraction: f64,
    /// The encoding of the sites' updates and the model deltas (`f32` by default; as the
    /// aggregator's config spells it).
    #[serde(
        default = "f32",
        deserialize_with = "unifed_aggregator::spelling::read_encoding",
        serialize_with = "unifed_aggregator::spelling::write_encoding"
    )]
    pub encoding: Encoding,
}

fn f32() -> Encoding {
    Encoding::F32
}

fn all() -> f64 {
    1.0
}

/// UniFed's external evaluation (Table 3's shape): each domain in turn is held out, the others
/// federate, and the held-out domain's test split is scored with the global model as deployed,
/// with `stream` re-estimation on its test batches, and with `calibrate` re-estimation on its
/// own (unlabelled) training images.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct External {
    /// The algorithms to rotate (each under every policy and seed of the preset); empty: all
    /// of the preset's.
    #[serde(default)]
    pub algorithms: Vec<Algorithm>,
    /// `stream`'s options (UniFed: tau 0.9, test batch 32, from the deployed statistics).
    #[serde(default)]
    pub stream: StreamConfig,
    /// What the sites of a held-out run under `local` BN share of their BN for the onboarding
    /// package the aggregator would serve the held-out domain (default `affine+stats`: every
    /// site's affine and statistics pooled); the domain is also scored from that package.
    /// Training is the same whatever it says (under `local` BN shared BN goes only into the
    /// package).
    #[serde(default = "pool_everything")]
    pub bn_sharing: BnSharing,
}

fn pool_everything() -> BnSharing {
    BnSharing::AffineStats
}

/// A held-out domain's test accuracy from one start: as the start is, under `stream`
/// re-estimation from it, and after `calibrate` from it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimates {
    /// As the start is.
    pub deployed: f64,
    /// Under `stream` re-estimation on its test batches.
    pub stream: f64,
    /// After `calibrate` on its unlabelled training images.
    pub calibrate: f64,
}

/// One held-out domain scored after a federation of the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExternalResult {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The BN policy.
    pub bn_policy: BnPolicy,
    /// The seed.
    pub seed: u64,
    /// The held-out domain.
    pub held_out: String,
    /// The preset's settings it ran under.
    pub settings: serde_json::Value,
    /// Test accuracy of the global model as deployed (under `global` BN the averaged model;
    /// under `local` the global non-BN weights with the global model's own, never-trained BN),
    /// under `stream` re-estimation from it, and after `calibrate` on the domain's training
    /// images, labels unused (in the file as three fields of the result).
    #[serde(flatten)]
    pub own: Estimates,
    /// The same three from the onboarding package the aggregator would serve the domain (the
    /// final model with BN as `bn_sharing` pools it; under `global` BN the global model);
    /// absent in runs made before it was scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<Packaged>,
}

/// A held-out domain's [`Estimates`] from the onboarding package, and the sharing policy that
/// made the package (a table takes only those of its preset's policy).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Packaged {
    /// What the training sites shared of their BN for it.
    pub bn_sharing: BnSharing,
    /// The estimates.
    #[serde(flatten)]
    pub estimates: Estimates,
}

fn one() -> usize {
    1
}

impl Preset {
    /// Reads and checks a preset file, naming the file and what is wrong.
    pub fn load(path: &Path) -> Result<Preset> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let p: Preset = toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        p.validate()
            .with_context(|| format!("{}", path.display()))?;
        Ok(p)
    }

    /// Checks the preset, naming the first problem.
    pub fn validate(&self) -> Result<()> {
        if self.algorithms.is_empty() || self.policies.is_empty() {
            bail!("name at least one algorithm and one BN policy");
        }
        if self.seeds == 0 || self.rounds == 0 || self.epochs == 0 {
            bail!("seeds, rounds and epochs must be at least 1");
        }
        if !(self.fraction > 0.0 && self.fraction <= 1.0) {
            bail!("fraction must lie in (0, 1], got {}", self.fraction);
        }
        if self.sizes.val == 0 {
            bail!("sizes.val must be at least 1: rounds are selected on validation accuracy");
        }
        let external = self.external.iter().flat_map(|e| &e.algorithms);
        for a in self.algorithms.iter().chain(external) {
            a.validate()
                .map_err(|e| anyhow::anyhow!("algorithm `{}`: {e}", a.name()))?;
        }
        Ok(())
    }

    /// What a finished run must share with this preset to be reused: everything but the lists
    /// of algorithms, policies and seeds.
    fn settings(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "rounds": self.rounds,
            "epochs": self.epochs,
            "sizes": self.sizes,
            "model": self.model,
            "data": self.data,
            "stream": self.external.as_ref().map(|e| e.stream),
            "fraction": self.fraction,
            "shuffle": SHUFFLE_RULE,
        });
        // Only a lossy encoding is named, so that runs made before presets had one (all f32)
        // are still reused.
        if self.encoding != Encoding::F32 {
            v["encoding"] = serde_json::json!(self.encoding.to_string());
        }
        v
    }
}

/// One finished run: an algorithm under a BN policy with one seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The BN policy.
    pub bn_policy: BnPolicy,
    /// The seed.
    pub seed: u64,
    /// The preset's settings it ran under ([`Preset`] less its lists).
    pub settings: serde_json::Value,
    /// The sites, in the order of every per-site list.
    pub sites: Vec<String>,
    /// Each round's test accuracies (and bytes, seconds, plan).
    pub rounds: Vec<RoundRecord>,
    /// Each round's validation accuracies, per site.
    pub val: Vec<Vec<f64>>,
    /// Wall seconds each round's validation took, in runs made before the sites evaluated their
    /// validation split within the round; empty since (the round's `seconds` include it).
    #[serde(default)]
    pub val_seconds: Vec<f64>,
    /// Under FedCD, what each round did to its masks and what its sites sent; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fedcd: Vec<FedCdRound>,
    /// Under FedImpro, the head's gradient dissimilarity across sites at the middle and the
    /// last model version, with and without synthetic features; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fedimpro: Vec<FedImproRound>,
}

/// One FedCD round of a run, per site in the run's site order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FedCdRound {
    /// Each site's mean absolute mask value after the round (its L1 norm over its width; 1 at
    /// the start, and for a site that has not trained): FedCD Fig. 3 says it falls.
    pub mask_l1: Vec<f64>,
    /// The L2 norm of each site's mask gradient `g_e` in its update (`None`: not sampled).
    pub gradient_norm: Vec<Option<f64>>,
    /// Each site's training risk `R_e` in its update (`None`: not sampled).
    pub risk: Vec<Option<f64>>,
}

impl RunResult {
    /// Wall seconds of each round as the runner spends it: the round's record plus its
    /// validation.
    pub fn round_seconds(&self) -> Vec<f64> {
        self.rounds
            .iter()
            .zip(self.val_seconds.iter().chain(std::iter::repeat(&0.0)))
            .map(|(r, v)| r.seconds + v)
            .collect()
    }
}

impl RunResult {
    /// Per site: the test accuracy of the round whose validation accuracy is the site's
    /// highest (the earliest such round), UniFed's model selection applied site by site, as
    /// each site deploys its own model under client-specific BN.
    pub fn best_on_val(&self) -> Vec<f64> {
        (0..self.sites.len())
            .map(|k| {
                let mut best = 0;
                for (r, v) in self.val.iter().enumerate() {
                    if v[k] > self.val[best][k] {
                        best = r;
                    }
                }
                self.rounds[best].accuracy[k]
            })
            .collect()
    }

    /// Per site: the final round's test accuracy.
    pub fn last(&self) -> Vec<f64> {
        self.rounds
            .last()
            .map(|r| r.accuracy.clone())
            .unwrap_or_default()
    }
}

/// The file of a run in `out`: `runs/<algorithm>-<policy>-seed<k>.json`, or under
/// `runs/external/` with the held-out domain's name appended.
fn run_file(out: &Path, a: &Algorithm, bn: BnPolicy, seed: u64, held: Option<&str>) -> PathBuf {
    let policy = match bn {
        BnPolicy::Local => "local",
        BnPolicy::Global => "global",
    };
    let stem = format!("{}-{policy}-seed{seed}", algorithm_stem(a));
    match held {
        None => out.join("runs").join(format!("{stem}.json")),
        Some(d) => out.join("runs/external").join(format!("{stem}-{d}.json")),
    }
}

/// An algorithm's part of a run's file name: its name, or its label's when the label is not its
/// defaults' (FedCD-SCI beside FedCD-SCI+REA).
fn algorithm_stem(a: &Algorithm) -> String {
    match Algorithm::named(a.name()) {
        Ok(d) if d.label() == a.label() => a.name().to_string(),
        _ => {
            let dashed: String = a
                .label()
                .to_lowercase()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            dashed
                .split('-')
                .filter(|w| !w.is_empty())
                .collect::<Vec<_>>()
                .join("-")
        }
    }
}

/// What [`run`] did, or what [`report`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Runs trained now (internal and external).
    pub trained: usize,
    /// Runs found finished in `<out>/runs` and reused.
    pub reused: usize,
    /// Runs still missing (only [`report`] leaves any).
    pub missing: usize,
}

/// The rule a site's shuffle seeds follow ([`unifed_models::site::round_seed`]), part of a
/// run's settings: runs made before it (under `seed ^ round`, which gave different seeds and
/// sites the same shuffles) carry none and are run again.
const SHUFFLE_RULE: &str = "splitmix64(seed, round, site)";

/// Reads a finished run's file if there is one, refusing a run of other settings; a run made
/// under the old shuffle rule counts as not run.
fn finished<T: serde::de::DeserializeOwned>(
    file: &Path,
    same: impl Fn(&T) -> bool,
) -> Result<Option<T>> {
    match std::fs::read(file) {
        Ok(bytes) => {
            let raw: serde_json::Value = serde_json::from_slice(&bytes)
                .with_context(|| format!("reading {}", file.display()))?;
            if raw["settings"]["shuffle"] != SHUFFLE_RULE {
                println!(
                    "{} was run under the old shuffle rule (seed ^ round); running it again",
                    file.display()
                );
                return Ok(None);
            }
            let r: T = serde_json::from_value(raw)
                .with_context(|| format!("reading {}", file.display()))?;
            if !same(&r) {
                bail!(
                    "{} was run with other settings or parameters; remove it or choose another \
                     output folder",
                    file.display()
                );
            }
            Ok(Some(r))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", file.display())),
    }
}

/// A run still to do: internal (all sites) or external (one held out).
struct Todo {
    algorithm: Algorithm,
    bn: BnPolicy,
    seed: u64,
    held_out: Option<usize>,
    file: PathBuf,
}

/// What [`plan`] found in the output folder: the finished runs and the ones still to do.
struct Plan {
    results: Vec<RunResult>,
    externals: Vec<ExternalResult>,
    todo: Vec<Todo>,
    /// The model spec and the sites' data, loaded once when a run is to do or an external
    /// domain to name.
    loaded: Option<(ModelSpec, Vec<SiteData>)>,
}

/// Sorts every combination of `preset` into finished (its file in `out` holds it) and to do;
/// loads the sites' data when an external domain is to be named or, with `train`, a run is to
/// do.
fn plan(preset: &Preset, data: &BuiltinData, out: &Path, train: bool) -> Result<Plan> {
    preset.validate()?;
    let settings = preset.settings();
    let mut todo = Vec::new();
    let mut results = Vec::new();
    for a in &preset.algorithms {
        for &bn in &preset.policies {
            for seed in 0..preset.seeds {
                let file = run_file(out, a, bn, seed, None);
                let same = |r: &RunResult| r.settings == settings && r.algorithm == *a;
                match finished(&file, same)? {
                    Some(r) => results.push(r),
                    None => todo.push(Todo {
                        algorithm: *a,
                        bn,
                        seed,
                        held_out: None,
                        file,
                    }),
                }
            }
        }
    }
    // The external runs need the domains' names: the data is loaded (or rendered) once, and
    // only when there is a run to do or a domain to name.
    let mut loaded = None;
    let mut externals = Vec::new();
    if let Some(ext) = &preset.external {
        let (spec, sites) = load_sites(preset, data)?;
        let algorithms = match ext.algorithms.is_empty() {
            true => &preset.algorithms,
            false => &ext.algorithms,
        };
        for a in algorithms {
            for &bn in &preset.policies {
                for seed in 0..preset.seeds {
                    for (k, d) in sites.iter().enumerate() {
                        let file = run_file(out, a, bn, seed, Some(&d.name));
                        let same = |r: &ExternalResult| {
                            r.settings == settings && r.algorithm == *a && r.held_out == d.name
                        };
                        match finished(&file, same)? {
                            Some(r) => externals.push(r),
                            None => todo.push(Todo {
                                algorithm: *a,
                                bn,
                                seed,
                                held_out: Some(k),
                                file,
                            }),
                        }
                    }
                }
            }
        }
        loaded = Some((spec, sites));
    }
    if loaded.is_none() && train && !todo.is_empty() {
        loaded = Some(load_sites(preset, data)?);
    }
    // Every internal run before any held-out one, each seed by seed: an experiment stopped
    // part-way has its internal table (the one every method is compared in) whole first, and
    // every method with as many seeds as can be in each table.
    todo.sort_by_key(|t| (t.held_out.is_some(), t.seed));
    Ok(Plan {
        results,
        externals,
        todo,
        loaded,
    })
}

/// The finished internal runs of `preset` in `out`, in the preset's order: algorithm, then BN
/// policy, then seed.
pub fn results(preset: &Preset, out: &Path) -> Result<Vec<RunResult>> {
    let settings = preset.settings();
    let mut v = Vec::new();
    for a in &preset.algorithms {
        for &bn in &preset.policies {
            for seed in 0..preset.seeds {
                let file = run_file(out, a, bn, seed, None);
                let same = |r: &RunResult| r.settings == settings && r.algorithm == *a;
                v.extend(finished(&file, same)?);
            }
        }
    }
    Ok(v)
}

/// Writes the tables of whatever runs have finished in `out`, training nothing: the rows of
/// methods with missing runs say how many seeds they hold, and a method with none is listed as
/// not run. Returns the finished and missing counts as [`Outcome::reused`] and
/// [`Outcome::missing`].
pub fn report(preset: &Preset, data: &BuiltinData, out: &Path) -> Result<Outcome> {
    let p = plan(preset, data, out, false)?;
    if p.results.is_empty() && p.externals.is_empty() {
        bail!(
            "no run of {} has finished in {} yet",
            preset.name,
            out.display()
        );
    }
    write_all(preset, out, &p.results, &p.externals, p.loaded.as_ref())?;
    Ok(Outcome {
        trained: 0,
        reused: p.results.len() + p.externals.len(),
        missing: p.todo.len(),
    })
}

/// Runs every combination of `preset` that `out` does not already hold, `jobs` at a time
/// (each on its own share of the CPU threads), then writes the tables and the charts.
/// `progress` hears of every finished round, with an estimate of the time left. On a failed run the
/// others stop after their current run, every finished run is kept, and the error is returned.
pub fn run(
    preset: &Preset,
    data: &BuiltinData,
    out: &Path,
    jobs: usize,
    progress: impl FnMut(&Progress) + Send,
) -> Result<Outcome> {
    let Plan {
        results,
        externals,
        todo,
        loaded,
    } = plan(preset, data, out, true)?;
    std::fs::create_dir_all(out.join("runs/external"))
        .with_context(|| format!("creating {}", out.join("runs/external").display()))?;
    let reused = results.len() + externals.len();
    // No more jobs than runs (none when nothing is to do).
    let jobs = jobs.max(1).min(todo.len());
    // Each job gets its own pool: burn-flex's kernels run on the pool they are called from.
    let threads = (unifed_models::backend::cpu_threads() / jobs.max(1)).max(1);
    let total_rounds = todo.len() as u64 * preset.rounds;
    let started = Instant::now();
    struct Shared<P> {
        results: Vec<RunResult>,
        externals: Vec<ExternalResult>,
        rounds_done: u64,
        progress: P,
        failed: Option<anyhow::Error>,
    }
    let shared = std::sync::Mutex::new(Shared {
        results,
        externals,
        rounds_done: 0,
        progress,
        failed: None,
    });
    let next = std::sync::atomic::AtomicUsize::new(0);
    let lock = || shared.lock().unwrap_or_else(|e| e.into_inner());
    // One job: runs from the shared list until none is left or a job has failed.
    let job_loop = |job: usize| -> Result<()> {
        // Training ran on the main thread's 8 MiB stack before it ran in pools.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .stack_size(8 << 20)
            .build()
            .context("starting a job's worker threads")?;
        loop {
            let k = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if k >= todo.len() || lock().failed.is_some() {
                return Ok(());
            }
            let (spec, site_data) = loaded.as_ref().context("the sites' data was not loaded")?;
            let t = &todo[k];
            let label = run_label(k, todo.len(), t, t.held_out.map(|h| &site_data[h]));
            let on_round = |round: u64, mean: f64| {
                let mut s = lock();
                s.rounds_done += 1;
                let per = started.elapsed().as_secs_f64() / s.rounds_done as f64;
                let event = Progress {
                    job,
                    run: &label,
                    round,
                    rounds: preset.rounds,
                    mean_test_accuracy: mean,
                    done: s.rounds_done,
                    total: total_rounds,
                    seconds_left: per * total_rounds.saturating_sub(s.rounds_done) as f64,
                };
                (s.progress)(&event);
            };
            let done = pool
                .install(|| train(preset, spec, site_data, t, on_round))
                .with_context(|| format!("{label} failed"))?;
            match done {
                Finished::Internal(r) => lock().results.push(r),
                Finished::External(e) => lock().externals.push(e),
            }
        }
    };
    // A job's error or panic is recorded as it happens, so the other jobs stop after their
    // current run instead of working through the list.
    let worker = |job: usize| {
        if let Some(failure) = failure_of(|| job_loop(job)) {
            lock().failed.get_or_insert(failure);
        }
    };
    let worker = &worker;
    std::thread::scope(|s| {
        for job in 0..jobs {
            s.spawn(move || worker(job));
        }
    });
    let shared = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = shared.failed {
        return Err(e);
    }
    write_all(
        preset,
        out,
        &shared.results,
        &shared.externals,
        loaded.as_ref(),
    )?;
    Ok(Outcome {
        trained: todo.len(),
        reused,
        missing: 0,
    })
}

/// The progress label of run `k` of `n`: `[k/n] <method> seed <s>[, <domain> held out]`.
fn run_label(k: usize, n: usize, t: &Todo, held: Option<&SiteData>) -> String {
    format!(
        "[{}/{n}] {} seed {}{}",
        k + 1,
        method_name(&t.algorithm, t.bn),
        t.seed,
        held.map_or(String::new(), |d| format!(", {} held out", d.name))
    )
}

/// `f`'s error, or its panic as an error; `None` when it succeeded.
fn failure_of(f: impl FnOnce() -> Result<()>) -> Option<anyhow::Error> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Some(anyhow::anyhow!("a run panicked: {what}"))
        }
    }
}

/// Writes the internal tables and, when the preset has `[external]`, the external table over
/// the `loaded` sites' domains.
fn write_all(
    preset: &Preset,
    out: &Path,
    results: &[RunResult],
    externals: &[ExternalResult],
    loaded: Option<&(ModelSpec, Vec<SiteData>)>,
) -> Result<()> {
    write_tables(preset, out, results, loaded.map(|(_, sites)| &sites[..]))?;
    if let (Some(_), Some((_, sites))) = (&preset.external, loaded) {
        let names: Vec<String> = sites.iter().map(|d| d.name.clone()).collect();
        write_external(preset, out, &names, externals)?;
    }
    Ok(())
}

/// One round of one run finished, as [`run`] reports it: what a progress bar or a log line
/// shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress<'a> {
    /// The job (0..jobs) that trained it.
    pub job: usize,
    /// The run: `[k/n] <method> seed <s>[, <domain> held out]`.
    pub run: &'a str,
    /// The round just finished (1-based).
    pub round: u64,
    /// Rounds of each run.
    pub rounds: u64,
    /// The round's test accuracy, mean over the sites.
    pub mean_test_accuracy: f64,
    /// Rounds finished so far, over all runs that were still to do when the experiment started.
    pub done: u64,
    /// Rounds of all runs to do.
    pub total: u64,
    /// Estimated seconds left, from the rate so far.
    pub seconds_left: f64,
}

impl std::fmt::Display for Progress<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} round {}/{}: mean test accuracy {:.2}%, about {} left",
            self.run,
            self.round,
            self.rounds,
            100.0 * self.mean_test_accuracy,
            clock(self.seconds_left)
        )
    }
}

/// A run trained and written to its file.
enum Finished {
    Internal(RunResult),
    External(ExternalResult),
}

/// Trains run `t` on `site_data` (less its held-out domain) and writes its file.
fn train(
    preset: &Preset,
    spec: &ModelSpec,
    site_data: &[SiteData],
    t: &Todo,
    on_round: impl FnMut(u64, f64),
) -> Result<Finished> {
    let training: Vec<&SiteData> = site_data
        .iter()
        .enumerate()
        .filter(|(i, _)| t.held_out != Some(*i))
        .map(|(_, d)| d)
        .collect();
    // A held-out run's sites share BN for the package the held-out domain would be served.
    let package = t.held_out.map(|_| match (t.bn, &preset.external) {
        (BnPolicy::Local, Some(e)) => e.bn_sharing,
        _ => BnSharing::None,
    });
    let method = (t.algorithm, t.bn, package);
    let (r, sites, package) = run_one(preset, spec, &training, method, t.seed, on_round)?;
    match (t.held_out.map(|h| &site_data[h]), package) {
        (None, _) | (_, None) => {
            write_atomic(&t.file, &serde_json::to_vec_pretty(&r)?)?;
            Ok(Finished::Internal(r))
        }
        (Some(d), Some((sharing, package))) => {
            let ext = preset
                .external
                .as_ref()
                .map(|e| e.stream)
                .unwrap_or_default();
            let method = (&t.algorithm, t.bn, t.seed);
            let scoring = (&ext, sharing);
            let e = score_held_out(preset, spec, (&sites, &package), d, method, scoring)?;
            write_atomic(&t.file, &serde_json::to_vec_pretty(&e)?)?;
            Ok(Finished::External(e))
        }
    }
}

/// Scores held-out domain `d` with the federation's final model, from the `sites` that trained
/// it: as deployed, under `stream`, and after `calibrate` on `d`'s training images.
fn score_held_out(
    preset: &Preset,
    spec: &ModelSpec,
    (sites, package): (&[Site<DigitsCnn>], &ServerBroadcast),
    d: &SiteData,
    (algorithm, bn, seed): (&Algorithm, BnPolicy, u64),
    (stream, sharing): (&StreamConfig, BnSharing),
) -> Result<ExternalResult> {
    let device = Backend::Flex.device().map_err(anyhow::Error::msg)?;
    let classes = spec.classes.len();
    // Under global BN every site holds the global model; under local, the global non-BN
    // weights beside its own BN, and the deployed model takes the global model's own,
    // never-trained BN (that of the initial model, which is seeded with weight 1, bias 0,
    // mean 0, variance 1).
    let deployed = match bn {
        BnPolicy::Global => sites[0].net.clone(),
        BnPolicy::Local => {
            let model = DigitsCnnConfig {
                classes,
                ..preset.model.clone()
            };
            let fresh = seeded(&device, seed, |dv| model.init(dv));
            import(
                &sites[0].net,
                spec,
                &export(&fresh, spec, Select::Bn),
                Select::Bn,
            )?
        }
    };
    // The package's BN in place of the deployed model's (its other tensors are the model's).
    let mut packaged = deployed.clone();
    CheckedImport::new(spec, &package.weights, Select::Bn)?.import_into(&mut packaged, None)?;
    let mut order: Vec<usize> = (0..d.test.len()).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let estimates = |start: &DigitsCnn| -> Result<Estimates> {
        let calibrated = calibrate(
            start,
            &d.train.x,
            &device,
            &CalibrateConfig::default(),
            |_, _| {},
        )?;
        Ok(Estimates {
            deployed: evaluate(start, &d.test, classes, EVAL_BATCH, &device)?.accuracy(),
            stream: evaluate_stream(start, &d.test, classes, stream, &order, &device)?.accuracy(),
            calibrate: evaluate(&calibrated, &d.test, classes, EVAL_BATCH, &device)?.accuracy(),
        })
    };
    Ok(ExternalResult {
        algorithm: *algorithm,
        bn_policy: bn,
        seed,
        held_out: d.name.clone(),
        settings: preset.settings(),
        own: estimates(&deployed)?,
        package: Some(Packaged {
            bn_sharing: sharing,
            estimates: estimates(&packaged)?,
        }),
    })
}

/// `seconds` as `1h02m`, `3m20s` or `45s`.
pub fn clock(seconds: f64) -> String {
    let s = seconds.round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// The onboarding package a held-out run's final model is served with, and the sharing policy
/// that pooled its BN.
type Served = (BnSharing, ServerBroadcast);

/// One run over `data`'s sites, each evaluated on its validation and test splits after every
/// round; returns the sites as they end (each holding the final model), and with a sharing
/// policy in `package` the final model's onboarding package.
fn run_one(
    preset: &Preset,
    spec: &ModelSpec,
    data: &[&SiteData],
    (algorithm, bn, package): (Algorithm, BnPolicy, Option<BnSharing>),
    seed: u64,
    mut on_round: impl FnMut(u64, f64),
) -> Result<(RunResult, Vec<Site<DigitsCnn>>, Option<Served>)> {
    let device = Backend::Flex.device().map_err(anyhow::Error::msg)?;
    let model = DigitsCnnConfig {
        classes: spec.classes.len(),
        ..preset.model.clone()
    };
    let init = || seeded(&device, seed, |d| model.init(d));
    let net0 = init();
    let mut sites = data
        .iter()
        .map(|d| Site::new(&d.name, init(), d.train.clone(), d.test.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let sampled = ((sites.len() as f64 * preset.fraction).ceil() as usize).max(1);
    let cfg = FederationConfig {
        algorithm,
        bn_policy: bn,
        bn_sharing: package.unwrap_or(BnSharing::None),
        encoding: preset.encoding,
        fraction: preset.fraction,
        seed,
        ..FederationConfig::new("experiment", preset.rounds, sampled, Vec::new())
    };
    let tc = TrainConfig {
        epochs: preset.epochs,
        seed,
        ..TrainConfig::default()
    };
    let mut masks = Masks {
        fedcd: matches!(algorithm, Algorithm::FedCd(_)),
        trace: match algorithm {
            Algorithm::FedImpro(c) => Some(trace::Trace::new(
                c.split_for(&spec.tensors) as usize,
                preset.rounds,
                seed,
            )),
            _ => None,
        },
        by_version: Default::default(),
        sent: Default::default(),
        wants_package: package.is_some(),
        package: None,
        on_round: |rec: &RoundRecord| {
            let mean = rec.accuracy.iter().sum::<f64>() / rec.accuracy.len() as f64;
            on_round(rec.round, mean);
        },
    };
    let rounds = run_federation(
        cfg,
        initial_model(&net0, spec),
        Sites::new(&mut sites, &tc, &device)
            .validation(data.iter().map(|d| d.val.clone()).collect()),
        &mut masks,
    )?;
    let fedcd = match masks.fedcd {
        false => Vec::new(),
        true => rounds
            .iter()
            .map(|r| masks.round(r.round, &sites))
            .collect(),
    };
    // Every site evaluates its validation split with its test split, in the round's seconds.
    let val = rounds.iter().map(|r| r.validation.clone()).collect();
    let r = RunResult {
        algorithm,
        bn_policy: bn,
        seed,
        settings: preset.settings(),
        sites: sites.iter().map(|s| s.id.to_string()).collect(),
        rounds,
        val,
        val_seconds: Vec::new(),
        fedcd,
        fedimpro: masks.trace.as_ref().map(|t| t.rounds()).unwrap_or_default(),
    };
    let package = match package {
        None => None,
        Some(sharing) => {
            let p = masks.package.take();
            Some((
                sharing,
                p.context("the run ended without its onboarding package")?,
            ))
        }
    };
    Ok((r, sites, package))
}

/// The run's observer: each round's record to `on_round`; under FedCD, the mean absolute value
/// of each site's mask as it evaluates each model version, and the mask gradient's norm and the
/// risk of each update.
struct Masks<F> {
    fedcd: bool,
    /// Under FedImpro, the head's gradient dissimilarity being measured.
    trace: Option<trace::Trace>,
    by_version: std::collections::BTreeMap<u64, std::collections::BTreeMap<String, f64>>,
    sent: std::collections::BTreeMap<(u64, String), (f64, f64)>,
    /// Whether the run asks for the onboarding package of the final model (a held-out run).
    wants_package: bool,
    /// The onboarding package of the final model, when asked for.
    package: Option<ServerBroadcast>,
    on_round: F,
}

impl<F> Masks<F> {
    /// Round `round`'s trace, in the order of `sites`.
    fn round(&self, round: u64, sites: &[Site<DigitsCnn>]) -> FedCdRound {
        let masks = self.by_version.get(&round);
        let sent = |s: &Site<DigitsCnn>| self.sent.get(&(round, s.id.to_string()));
        FedCdRound {
            mask_l1: sites
                .iter()
                .map(|s| {
                    masks
                        .and_then(|m| m.get(s.id.as_str()).copied())
                        .unwrap_or(1.0)
                })
                .collect(),
            gradient_norm: sites.iter().map(|s| sent(s).map(|x| x.0)).collect(),
            risk: sites.iter().map(|s| sent(s).map(|x| x.1)).collect(),
        }
    }
}

impl<F: FnMut(&RoundRecord)> crate::Observer<DigitsCnn> for Masks<F> {
    fn evaluated(&mut self, site: &Site<DigitsCnn>, e: &crate::Evaluation) {
        if let Some(t) = &mut self.trace {
            t.evaluated(site, e.version);
        }
        if !self.fedcd {
            return;
        }
        // The state alone: the site's whole memory would be read back from its files.
        if let ClientState::FedCd { mask: Some(m), .. } = site.client_state() {
            let l1 = m.iter().map(|v| v.abs() as f64).sum::<f64>() / m.len().max(1) as f64;
            self.by_version
                .entry(e.version)
                .or_default()
                .insert(site.id.to_string(), l1);
        }
    }

    fn message(&mut self, o: crate::Observed<'_>) {
        use unifed_protocol::messages::{SiteExtras, SiteUpdateRef};
        if let (Some(t), crate::Observed::Model { version, payload }) = (&mut self.trace, &o) {
            t.model(*version, payload);
        }
        let crate::Observed::Update { site, bytes } = o else {
            return;
        };
        if !self.fedcd {
            return;
        }
        let Ok(envelope) = unifed_protocol::EnvelopeRef::read(bytes) else {
            return;
        };
        if let Ok(u) = envelope.payload_as::<SiteUpdateRef>()
            && let SiteExtras::MaskGradient { gradient, risk } = &u.extras
        {
            let norm = gradient
                .iter()
                .map(|g| (*g as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            self.sent.insert((u.round, site.to_string()), (norm, *risk));
        }
    }

    fn round(&mut self, record: &RoundRecord) {
        (self.on_round)(record)
    }

    fn wants_package(&self) -> bool {
        self.wants_package
    }

    fn package(&mut self, package: &ServerBroadcast) {
        self.package = Some(package.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_of_an_algorithm_runs_under_a_file_name_of_its_own() {
        use unifed_aggregator::strategy::{FedCdConfig, FedImproConfig};
        let stem = |a: Algorithm| algorithm_stem(&a);
        assert_eq!(stem(Algorithm::FedAvg), "fedavg");
        let sci = FedCdConfig {
            rea: false,
            ..FedCdConfig::default()
        };
        assert_eq!(stem(Algorithm::FedCd(sci)), "fedcd-sci");
        assert_eq!(
            stem(Algorithm::FedImpro(FedImproConfig::default())),
            "fedimpro"
        );
        let split = |k| {
            Algorithm::FedImpro(FedImproConfig {
                split: Some(k),
                ..FedImproConfig::default()
            })
        };
        assert_eq!(split(2).label(), "FedImpro (split 2)");
        assert_eq!(stem(split(2)), "fedimpro-split-2");
        assert_ne!(stem(split(2)), stem(split(4)));
    }

    fn record(round: u64, accuracy: Vec<f64>) -> RoundRecord {
        RoundRecord {
            round,
            accuracy,
            validation: vec![],
            test_loss: vec![],
            train_loss: vec![],
            update_bytes: vec![],
            model_bytes: 0,
            download_bytes: vec![],
            seconds: 0.0,
            plan: Default::default(),
        }
    }

    #[test]
    fn each_site_takes_the_test_accuracy_of_its_own_best_validation_round_the_earliest_on_ties() {
        let r = RunResult {
            algorithm: Algorithm::FedAvg,
            bn_policy: BnPolicy::Local,
            seed: 0,
            settings: serde_json::Value::Null,
            sites: vec!["a".into(), "b".into()],
            rounds: vec![
                record(1, vec![0.40, 0.10]),
                record(2, vec![0.30, 0.20]),
                record(3, vec![0.90, 0.30]),
            ],
            // a: best on validation in round 2; b: rounds 1 and 3 tie, the earliest wins.
            val: vec![vec![0.5, 0.8], vec![0.7, 0.6], vec![0.6, 0.8]],
            val_seconds: vec![],
            fedcd: vec![],
            fedimpro: vec![],
        };
        assert_eq!(r.best_on_val(), vec![0.30, 0.10]);
        assert_eq!(r.last(), vec![0.90, 0.30]);
    }
}
