//! `unifed-sim`: in-process federations on the built-in domains.
//!
//! - `compare`: algorithms (FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, SCAFFOLD, FedNova,
//!   MOON, FedDC, Per-FedAvg) x BN policies (`local`: client-specific BN, so FedAvg is FedBN;
//!   `global`) for R rounds and S seeds; a per-site accuracy table (mean and std over seeds),
//!   the gain of `local` over `global` per algorithm, JSON and a convergence chart
//!   (results/algorithms.{json,svg}).
//! - `aggregator-memory`: the aggregator's peak memory for one round of 10, 30 and 100 sites,
//!   under f32 and under ternary-q8 (results/aggregator-memory.json).
//! - `encodings`: FedBN with each encoding over several seeds; bytes per site per round up and
//!   down, and accuracy against f32 (results/encodings.{json,md}).

mod progress;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::{Path, PathBuf};
use unifed_aggregator::Algorithm;
use unifed_aggregator::strategy::FedOptConfig;
use unifed_models::backend::cap_cpu_threads;
use unifed_models::data::{BuiltinData, SplitSizes};
use unifed_models::zoo::DigitsCnnConfig;
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::BnPolicy;
use unifed_sim::RoundRecord;
use unifed_sim::chart::{Series, line_chart};
use unifed_sim::experiment::{Preset, mean_std, method_name};

#[derive(Parser)]
#[command(
    name = "unifed-sim",
    about = "In-process UniFed Edge federations on the built-in domains"
)]
struct Cli {
    /// Cap on CPU worker threads.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Rounds (one local epoch each, FedBN's recipe).
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// Local epochs per round.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Training images per site.
    #[arg(long, default_value_t = 743)]
    train_samples: usize,
    /// Output folder.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum Cmd {
    /// Algorithms x BN policies over several seeds, each with client-specific (`local`; FedAvg
    /// is then FedBN) and averaged (`global`) BN.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Number of seeds (0..S).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Encoding of updates and model deltas: f32, f16, q8, ternary[b<block>],
        /// ternaryq8[b<block>] (e.g. ternaryq8b64), topk<per-mille> or topkq8<per-mille>.
        #[arg(long, default_value = "f32")]
        encoding: String,
        /// Algorithms: fedavg, fedprox, fedadam, fedyogi, fedadagrad, scaffold, fednova, moon,
        /// feddc, perfedavg.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "fedavg,fedprox,fedadam,scaffold"
        )]
        algorithms: Vec<String>,
        /// BN policies: local (client-specific BN), global (averaged BN).
        #[arg(long, value_delimiter = ',', default_value = "local,global")]
        policies: Vec<String>,
        /// FedProx's mu (FedBN's digits setting).
        #[arg(long, default_value_t = 0.01)]
        mu: f64,
        /// FedOpt's server learning rate (the paper's default 0.01; betas and tau at theirs).
        #[arg(long, default_value_t = 0.01)]
        fedopt_lr: f64,
        /// Keep the methods of an earlier `algorithms.json` in the output folder that this run
        /// does not repeat (same rounds, epochs, samples, seeds and encoding required).
        #[arg(long)]
        merge: bool,
        /// Run nothing: re-render the table, JSON and chart of the earlier `algorithms.json`.
        #[arg(long)]
        render_only: bool,
    },
    /// The aggregator's peak memory for one round of the full-size model with each number of
    /// sites (each measured in its own process).
    AggregatorMemory {
        /// Site counts.
        #[arg(long, value_delimiter = ',', default_value = "10,30,100")]
        sites: Vec<usize>,
        /// Encodings of the updates and model deltas, each measured at every site count (a
        /// lossy one keeps the model the sites hold and decodes every update in the fold).
        #[arg(long, value_delimiter = ',', default_value = "f32,ternaryq8")]
        encodings: Vec<String>,
        /// How the updates reach the core, each measured at every site count and encoding:
        /// `one-by-one`, or `together` (several an event, as the service hands it uploads that
        /// complete at once: their checks and spool files run side by side).
        #[arg(long, value_delimiter = ',', default_value = "one-by-one,together")]
        arrivals: Vec<HandOver>,
        /// Output folder.
        #[arg(long, default_value = "results")]
        out: PathBuf,
        /// Measure this one count here and print it as JSON (what each child does).
        #[arg(long, hide = true)]
        one: Option<usize>,
    },
    /// How fast the aggregator takes in uploads that arrive at once (the full-size model's f32
    /// update from each site, signed in chunks), on each number of ingest threads.
    IngestSpeed {
        /// Uploads arriving at once.
        #[arg(long, default_value_t = 5)]
        sites: usize,
        /// Ingest thread counts, each measured.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        shards: Vec<usize>,
        /// Measurements of each count (the table gives the fastest and the slowest).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Where the uploads are spooled (default: the system's temporary folder): the
        /// aggregator's data directory's file system is what counts.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Output folder.
        #[arg(long, default_value = "results")]
        out: PathBuf,
    },
    /// An experiment preset (TOML: algorithms x BN policies x seeds, rounds, split sizes,
    /// model): every run not already in the output folder, then the internal table (best on
    /// validation and final, local - global BN per algorithm) and a convergence chart.
    Experiment {
        /// The preset file (e.g. configs/experiments/unifed-digits.toml).
        preset: PathBuf,
        /// Output folder (default results/experiments/<name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Runs trained at once, each on its share of the CPU threads (on 2 cores, two jobs of
        /// one thread each train faster than one job of two).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        /// Train nothing: write the tables of the runs finished so far.
        #[arg(long)]
        report: bool,
    },
    /// FedBN with each encoding over several seeds: bytes per site per round up (updates) and
    /// down (model deltas), and final accuracy against the first encoding (f32).
    Encodings {
        #[command(flatten)]
        common: Common,
        /// Encodings to compare; the first is the reference.
        #[arg(long, value_delimiter = ',', default_value = "f32,topkq8100")]
        encodings: Vec<String>,
        /// Number of seeds (0..S).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Keep the rows of an earlier `encodings.json` in the output folder for encodings this
        /// run does not repeat (same rounds, epochs, samples and seeds required), in front.
        #[arg(long)]
        merge: bool,
        /// With `--merge`, also keep the rows of these `encodings.json` files (a later file's
        /// row for an encoding replaces an earlier one's): runs made side by side, joined.
        #[arg(long, requires = "merge")]
        merge_from: Vec<PathBuf>,
        /// Train nothing: write the tables of the rows `--merge` keeps.
        #[arg(long, requires = "merge")]
        report: bool,
    },
}

fn parse_encoding(s: &str) -> Result<Encoding> {
    s.parse().map_err(anyhow::Error::msg)
}

fn parse_algorithm(s: &str, mu: f64, fedopt_lr: f64) -> Result<Algorithm> {
    let opt = FedOptConfig {
        server_lr: fedopt_lr,
        ..FedOptConfig::default()
    };
    let mut a = Algorithm::named(s).map_err(anyhow::Error::msg)?;
    match &mut a {
        Algorithm::FedProx { mu: m } => *m = mu,
        Algorithm::FedAdam(c) | Algorithm::FedYogi(c) | Algorithm::FedAdagrad(c) => *c = opt,
        _ => {}
    }
    a.validate().map_err(anyhow::Error::msg)?;
    Ok(a)
}

fn parse_policy(s: &str) -> Result<BnPolicy> {
    match s {
        "local" => Ok(BnPolicy::Local),
        "global" => Ok(BnPolicy::Global),
        o => anyhow::bail!("unknown BN policy `{o}`: local or global"),
    }
}

struct Run {
    records: Vec<RoundRecord>,
    sites: Vec<String>,
}

type Method = (Algorithm, BnPolicy, Vec<Run>);

/// The methods of an earlier `algorithms.json` in `common.out` run under the same settings,
/// for `--merge`.
fn earlier_runs(common: &Common, seeds: u64, encoding: &str) -> Result<Vec<Method>> {
    let p = common.out.join("algorithms.json");
    let v: serde_json::Value = match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))?,
        Err(_) => return Ok(Vec::new()),
    };
    let same = v["rounds"] == json!(common.rounds)
        && v["epochs"] == json!(common.epochs)
        && v["train_samples"] == json!(common.train_samples)
        && v["seeds"] == json!(seeds)
        && v["encoding"] == json!(encoding);
    if !same {
        anyhow::bail!(
            "{} was run with other settings; --merge needs the same rounds, epochs, samples, seeds and encoding",
            p.display()
        );
    }
    let sites: Vec<String> = serde_json::from_value(v["sites"].clone())?;
    let mut out = Vec::new();
    for m in v["methods"].as_array().into_iter().flatten() {
        let a: Algorithm = serde_json::from_value(m["algorithm"].clone())?;
        let bn: BnPolicy = serde_json::from_value(m["bn_policy"].clone())?;
        let runs: Vec<Vec<RoundRecord>> = serde_json::from_value(m["runs"].clone())?;
        let runs = runs
            .into_iter()
            .map(|records| Run {
                records,
                sites: sites.clone(),
            })
            .collect();
        out.push((a, bn, runs));
    }
    Ok(out)
}

/// Runs every method of `methods` with seeds 0..`seeds` under `encoding` through the experiment
/// runner (the one in-process runner: its finished runs are kept in
/// `<out>/runs/<encoding>/runs`, so a stopped comparison resumes), on the built-in training
/// domains with FedBN's digits CNN.
fn compare(
    data: &BuiltinData,
    common: &Common,
    seeds: u64,
    encoding: Encoding,
    methods: &[(Algorithm, BnPolicy)],
) -> Result<Vec<Method>> {
    let mut out = Vec::new();
    for &(algorithm, bn) in methods {
        let preset = Preset {
            name: "compare".into(),
            algorithms: vec![algorithm],
            policies: vec![bn],
            seeds,
            rounds: common.rounds,
            epochs: common.epochs,
            sizes: SplitSizes {
                train: common.train_samples,
                ..SplitSizes::default()
            },
            model: DigitsCnnConfig::default(),
            data: Default::default(),
            external: None,
            fraction: 1.0,
            encoding,
        };
        let dir = common.out.join("runs").join(encoding.to_string());
        let mut bars = progress::Bars::for_stderr();
        let done = unifed_sim::experiment::run(&preset, data, &dir, 1, |e| bars.show(e));
        bars.finish();
        done?;
        let runs = unifed_sim::experiment::results(&preset, &dir)?
            .into_iter()
            .map(|r| Run {
                records: r.rounds,
                sites: r.sites,
            })
            .collect();
        out.push((algorithm, bn, runs));
    }
    Ok(out)
}

const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Final accuracy of each site in a run.
fn last(r: &Run) -> Vec<f64> {
    r.records
        .last()
        .map(|x| x.accuracy.clone())
        .unwrap_or_default()
}

/// Mean over sites of a run's final accuracies.
fn mean_last(r: &Run) -> f64 {
    let v = last(r);
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Prints the comparison of the methods run so far and writes results/algorithms.{json,svg}.
fn write_compare(
    common: &Common,
    seeds: u64,
    encoding: &str,
    mu: f64,
    runs: &[Method],
) -> Result<()> {
    let sites = runs[0].2[0].sites.clone();
    let names: Vec<String> = runs.iter().map(|(a, bn, _)| method_name(a, *bn)).collect();
    println!(
        "\n{} rounds x {} local epoch(s), {} seeds, encoding {encoding}, FedProx mu {mu}: final test accuracy per site, mean (std) over seeds\n",
        common.rounds, common.epochs, seeds
    );
    let table = final_table(&sites, &names, runs);
    let site_mean = |r: &Run| {
        r.records
            .iter()
            .map(|rec| rec.accuracy.iter().sum::<f64>() / rec.accuracy.len() as f64)
            .collect::<Vec<_>>()
    };
    let mut cells = Vec::new();
    let mut series = Vec::new();
    let mut summary = Vec::new();
    for (((a, bn, rs), name), colour) in runs.iter().zip(&names).zip(COLOURS.iter().cycle()) {
        let per_seed: Vec<Vec<f64>> = rs.iter().map(site_mean).collect();
        let rounds = per_seed[0].len();
        let stats: Vec<(f64, f64)> = (0..rounds)
            .map(|i| mean_std(&per_seed.iter().map(|v| v[i]).collect::<Vec<_>>()))
            .collect();
        let (m, s) = mean_std(&rs.iter().map(mean_last).collect::<Vec<_>>());
        cells.push(format!("**{:.2} ({:.2})**", 100.0 * m, 100.0 * s));
        series.push(Series {
            name: name.clone(),
            colour: (*colour).into(),
            values: stats.iter().map(|x| x.0).collect(),
            band: stats.iter().map(|x| x.1).collect(),
        });
        let secs: Vec<f64> = rs
            .iter()
            .flat_map(|r| r.records.iter().map(|x| x.seconds))
            .collect();
        summary.push(json!({
            "method": name,
            "algorithm": a,
            "bn_policy": bn,
            "mean_accuracy_per_round": stats.iter().map(|x| x.0).collect::<Vec<_>>(),
            "std_over_seeds_per_round": stats.iter().map(|x| x.1).collect::<Vec<_>>(),
            "update_bytes_per_site": rs[0].records[0].update_bytes,
            "model_bytes": rs[0].records[0].model_bytes,
            "seconds_per_round_mean": secs.iter().sum::<f64>() / secs.len() as f64,
            "runs": rs.iter().map(|r| &r.records).collect::<Vec<_>>(),
        }));
    }
    println!("| **mean over sites** | {} |", cells.join(" | "));
    let gains = local_minus_global(runs);
    let svg = line_chart(
        &format!("Algorithms x BN policy on the built-in domains ({seeds} seeds)"),
        "mean test accuracy over sites",
        &series,
    );
    let (jp, sp) = (
        common.out.join("algorithms.json"),
        common.out.join("algorithms.svg"),
    );
    std::fs::write(
        &jp,
        serde_json::to_string_pretty(&json!({
            "rounds": common.rounds,
            "epochs": common.epochs,
            "train_samples": common.train_samples,
            "seeds": seeds,
            "encoding": encoding,
            "fedprox_mu": mu,
            "sites": sites,
            "seed_rule": "SplitMix64 of (site seed, round, site id) (unifed_models::site::round_seed), as agents train",
            "final": table,
            "methods": summary,
            "local_minus_global": gains,
        }))?,
    )?;
    std::fs::write(&sp, svg)?;
    println!("\nwrote {} and {}", jp.display(), sp.display());
    Ok(())
}

/// Prints each site's final accuracy per method (mean and std over seeds) and gives the rows.
fn final_table(sites: &[String], names: &[String], runs: &[Method]) -> Vec<serde_json::Value> {
    println!("| site | {} |", names.join(" | "));
    println!("|---|{}", "---:|".repeat(names.len()));
    let mut table = Vec::new();
    for (k, s) in sites.iter().enumerate() {
        let mut cells = Vec::new();
        let mut row = serde_json::Map::new();
        row.insert("site".into(), json!(s));
        for ((_, _, rs), name) in runs.iter().zip(names) {
            let v: Vec<f64> = rs.iter().map(|r| last(r)[k]).collect();
            let (m, sd) = mean_std(&v);
            cells.push(format!("{:.2} ({:.2})", 100.0 * m, 100.0 * sd));
            row.insert(name.clone(), json!(v));
        }
        println!("| {s} | {} |", cells.join(" | "));
        table.push(serde_json::Value::Object(row));
    }
    table
}

/// Prints and gives the gain of client-specific BN per algorithm run under both policies
/// (UniFed Table 2's shape), seed by seed.
fn local_minus_global(runs: &[Method]) -> Vec<serde_json::Value> {
    let mut gains = Vec::new();
    for (a, bn, local) in runs {
        if *bn != BnPolicy::Local {
            continue;
        }
        let Some((_, _, global)) = runs
            .iter()
            .find(|(b, p, _)| b.name() == a.name() && *p == BnPolicy::Global)
        else {
            continue;
        };
        let d: Vec<f64> = local
            .iter()
            .zip(global)
            .map(|(l, g)| mean_last(l) - mean_last(g))
            .collect();
        let (m, s) = mean_std(&d);
        println!(
            "local - global BN, {}: {:+.2} ({:.2}) points",
            a.name(),
            100.0 * m,
            100.0 * s
        );
        gains.push(json!({"algorithm": a.name(), "local_minus_global_per_seed": d}));
    }
    gains
}

/// Counts heap bytes, so `aggregator-memory` can tell the aggregator's share of the process.
#[global_allocator]
static HEAP: unifed_sim::heap::Counting = unifed_sim::heap::Counting;

fn main() -> Result<()> {
    unifed_net::init_logging("warn");
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::AggregatorMemory { one: Some(_), .. }) {
        // Measured as the aggregator service allocates: from one malloc arena.
        unifed_net::memory::use_one_arena();
    }
    if let Some(t) = cli.threads {
        cap_cpu_threads(t).map_err(anyhow::Error::msg)?;
    }
    let data = BuiltinData::load().context("loading the built-in data")?;
    match cli.cmd {
        Cmd::Experiment {
            preset,
            out,
            jobs,
            report,
        } => experiment_cmd(&data, &preset, out, jobs, report),
        Cmd::Compare {
            common,
            seeds,
            encoding,
            algorithms,
            policies,
            mu,
            fedopt_lr,
            merge,
            render_only,
        } => {
            let c = CompareArgs {
                seeds,
                encoding,
                mu,
                merge,
                render_only,
            };
            let mut methods = Vec::new();
            for a in &algorithms {
                for p in &policies {
                    methods.push((parse_algorithm(a, mu, fedopt_lr)?, parse_policy(p)?));
                }
            }
            compare_cmd(&data, &common, &c, &methods)
        }
        Cmd::AggregatorMemory {
            one: Some(n),
            encodings,
            arrivals,
            ..
        } => {
            let ([e], [a]) = (encodings.as_slice(), arrivals.as_slice()) else {
                anyhow::bail!("--one measures one encoding and one arrival");
            };
            let together = *a == HandOver::Together;
            let row = unifed_sim::memory::measure(n, parse_encoding(e)?, together)?;
            println!("{}", serde_json::to_string(&row)?);
            Ok(())
        }
        Cmd::AggregatorMemory {
            sites,
            encodings,
            arrivals,
            out,
            one: None,
        } => aggregator_memory(&sites, &encodings, &arrivals, &out),
        Cmd::IngestSpeed {
            sites,
            shards,
            repeats,
            dir,
            out,
        } => ingest_speed(sites, &shards, repeats, dir, &out),
        Cmd::Encodings {
            common,
            encodings,
            seeds,
            merge,
            merge_from,
            report,
        } => encodings_cmd(
            &data,
            &common,
            &encodings,
            seeds,
            (merge, merge_from),
            report,
        ),
    }
}

/// Runs `unifed-sim experiment` (or, with `report`, writes the tables of what has finished).
fn experiment_cmd(
    data: &BuiltinData,
    preset: &Path,
    out: Option<PathBuf>,
    jobs: usize,
    report: bool,
) -> Result<()> {
    let p = Preset::load(preset)?;
    let out = out.unwrap_or_else(|| PathBuf::from("results/experiments").join(&p.name));
    let done = match report {
        true => unifed_sim::experiment::report(&p, data, &out)?,
        false => {
            let mut bars = progress::Bars::for_stderr();
            let done = unifed_sim::experiment::run(&p, data, &out, jobs, |e| bars.show(e));
            bars.finish();
            done?
        }
    };
    println!(
        "{}: {} run(s) trained, {} reused, {} still to run; tables in {}",
        p.name,
        done.trained,
        done.reused,
        done.missing,
        out.join("internal.md").display()
    );
    Ok(())
}

/// `unifed-sim compare`'s settings besides the common ones and the methods.
struct CompareArgs {
    seeds: u64,
    encoding: String,
    mu: f64,
    merge: bool,
    render_only: bool,
}

/// Runs `unifed-sim compare`: every method, then its table, JSON and chart.
fn compare_cmd(
    data: &BuiltinData,
    common: &Common,
    c: &CompareArgs,
    methods: &[(Algorithm, BnPolicy)],
) -> Result<()> {
    if c.render_only {
        let runs = earlier_runs(common, c.seeds, &c.encoding)?;
        anyhow::ensure!(!runs.is_empty(), "no earlier results to render");
        return write_compare(common, c.seeds, &c.encoding, c.mu, &runs);
    }
    let enc = parse_encoding(&c.encoding)?;
    std::fs::create_dir_all(&common.out)?;
    let mut runs: Vec<Method> = Vec::new();
    if c.merge {
        runs = earlier_runs(common, c.seeds, &c.encoding)?;
        runs.retain(|(a, bn, _)| !methods.iter().any(|(b, p)| b.name() == a.name() && p == bn));
        eprintln!("kept {} method(s) of the earlier results", runs.len());
    }
    runs.extend(compare(data, common, c.seeds, enc, methods)?);
    write_compare(common, c.seeds, &c.encoding, c.mu, &runs)
}

/// Runs `unifed-sim encodings`: FedBN under each encoding over the seeds, merged with earlier
/// results (`merge`: this folder's and `merge.1`'s files), then the table.
fn encodings_cmd(
    data: &BuiltinData,
    common: &Common,
    encodings: &[String],
    seeds: u64,
    (merge, merge_from): (bool, Vec<PathBuf>),
    report: bool,
) -> Result<()> {
    std::fs::create_dir_all(&common.out)?;
    let mut rows: Vec<EncodingRow> = Vec::new();
    if merge {
        let files = std::iter::once(common.out.join("encodings.json")).chain(merge_from);
        for file in files {
            for row in earlier_encodings(&file, common, seeds)? {
                match rows.iter_mut().find(|r| r.encoding == row.encoding) {
                    Some(r) => *r = row,
                    None => rows.push(row),
                }
            }
        }
        if !report {
            rows.retain(|r| !encodings.contains(&r.encoding));
        }
        eprintln!("kept {} encoding(s) of the earlier results", rows.len());
    }
    for e in encodings.iter().filter(|_| !report) {
        let enc = parse_encoding(e)?;
        let mut row = EncodingRow {
            encoding: e.clone(),
            ..Default::default()
        };
        let fedbn = [(Algorithm::FedAvg, BnPolicy::Local)];
        for (_, _, runs) in compare(data, common, seeds, enc, &fedbn)? {
            for run in runs {
                row.add(run.records);
            }
        }
        rows.push(row);
        // Written after every encoding, so a long run cut short keeps what it finished (its
        // runs stay in their folder too).
        write_encodings(common, seeds, &rows, None)?;
    }
    let md = write_encodings(common, seeds, &rows, None)?;
    print!("{md}");
    Ok(())
}

/// The rows of an earlier `encodings.json`, which must have been run under the same settings.
fn earlier_encodings(p: &Path, common: &Common, seeds: u64) -> Result<Vec<EncodingRow>> {
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(p).with_context(|| format!("--merge: reading {}", p.display()))?,
    )?;
    let same = v["rounds"] == json!(common.rounds)
        && v["epochs"] == json!(common.epochs)
        && v["train_samples"] == json!(common.train_samples)
        && v["seeds"] == json!(seeds);
    if !same {
        anyhow::bail!(
            "--merge: {} was run with other rounds, epochs, samples or seeds",
            p.display()
        );
    }
    v["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| Ok(serde_json::from_value(r["detail"].clone())?))
        .collect()
}

/// One encoding's runs over the seeds.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct EncodingRow {
    encoding: String,
    /// Per seed: the final mean accuracy over the sites.
    final_mean_accuracy: Vec<f64>,
    /// Per seed: mean bytes of one site's update per round.
    upload_bytes_per_site_per_round: Vec<f64>,
    /// Per seed: mean bytes one site fetched per round to apply the new model.
    download_bytes_per_site_per_round: Vec<f64>,
    /// Bytes of the whole model (what a new site fetches once).
    model_bytes: usize,
    /// Per seed: the round records.
    runs: Vec<Vec<RoundRecord>>,
}

impl EncodingRow {
    fn add(&mut self, records: Vec<RoundRecord>) {
        let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
        self.final_mean_accuracy
            .push(records.last().map_or(0.0, |r| mean(r.accuracy.clone())));
        self.upload_bytes_per_site_per_round.push(mean(
            records
                .iter()
                .flat_map(|r| r.update_bytes.iter().map(|&b| b as f64))
                .collect(),
        ));
        self.download_bytes_per_site_per_round.push(mean(
            records
                .iter()
                .flat_map(|r| r.download_bytes.iter().map(|&b| b as f64))
                .collect(),
        ));
        self.model_bytes = records.first().map_or(0, |r| r.model_bytes);
        self.runs.push(records);
    }
}

/// Writes results/encodings.{json,md} for the finished rows (and a partial one) and returns the
/// markdown table.
fn write_encodings(
    common: &Common,
    seeds: u64,
    rows: &[EncodingRow],
    partial: Option<&EncodingRow>,
) -> Result<String> {
    let all: Vec<&EncodingRow> = rows.iter().chain(partial).collect();
    let base = all.first().map(|r| {
        (
            mean_std(&r.upload_bytes_per_site_per_round).0,
            mean_std(&r.download_bytes_per_site_per_round).0,
            mean_std(&r.final_mean_accuracy).0,
        )
    });
    let mut md = format!(
        "FedBN, {} rounds of {} epoch(s), {} training images per site, seeds {} (`{}`)\n\n\
         | encoding | seeds | up bytes/site/round | down bytes/site/round | fewer bytes than f32 (up, down) | final mean accuracy | vs {reference} | per seed vs {reference} |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        common.rounds,
        common.epochs,
        common.train_samples,
        seeds,
        std::env::args().collect::<Vec<_>>().join(" "),
        reference = all.first().map_or("f32", |r| r.encoding.as_str()),
    );
    let mut json_rows = Vec::new();
    for r in &all {
        let (up, _) = mean_std(&r.upload_bytes_per_site_per_round);
        let (down, _) = mean_std(&r.download_bytes_per_site_per_round);
        let (acc, sd) = mean_std(&r.final_mean_accuracy);
        let (bu, bd, ba) = base.unwrap_or((up, down, acc));
        // Seed by seed against the reference's run of the same seed.
        let per_seed: Vec<String> = all
            .first()
            .map(|b| &b.final_mean_accuracy)
            .into_iter()
            .flat_map(|b| b.iter().zip(&r.final_mean_accuracy))
            .map(|(b, a)| format!("{:+.2}", 100.0 * (a - b)))
            .collect();
        md.push_str(&format!(
            "| {} | {} | {up:.0} | {down:.0} | {:.1}x, {:.1}x | {:.2}% ± {:.2} | {:+.2} pt | {} |\n",
            r.encoding,
            r.final_mean_accuracy.len(),
            bu / up,
            bd / down,
            100.0 * acc,
            100.0 * sd,
            100.0 * (acc - ba),
            per_seed.join(", ")
        ));
        json_rows.push(json!({
            "encoding": r.encoding,
            "seeds": r.final_mean_accuracy.len(),
            "upload_bytes_per_site_per_round": up,
            "download_bytes_per_site_per_round": down,
            "upload_reduction_vs_reference": bu / up,
            "download_reduction_vs_reference": bd / down,
            "final_mean_accuracy": acc,
            "final_mean_accuracy_std": sd,
            "accuracy_points_vs_reference": 100.0 * (acc - ba),
            "detail": r,
        }));
    }
    let json = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "rounds": common.rounds,
        "epochs": common.epochs,
        "train_samples": common.train_samples,
        "seeds": seeds,
        "algorithm": "fedavg",
        "bn_policy": "local",
        "note": "down bytes: what a site that holds the previous version fetches (the whole model under f32, the delta otherwise); a new site fetches the whole model once",
        "rows": json_rows,
    });
    std::fs::write(
        common.out.join("encodings.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    std::fs::write(common.out.join("encodings.md"), &md)?;
    Ok(md)
}

/// How `aggregator-memory` hands the round's updates to the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum HandOver {
    /// One event per update.
    OneByOne,
    /// Every update in one event.
    Together,
}

/// Measures each site count in a child process and writes results/aggregator-memory.{json,md}.
fn ingest_speed(
    sites: usize,
    shards: &[usize],
    repeats: usize,
    dir: Option<PathBuf>,
    out: &std::path::Path,
) -> Result<()> {
    use unifed_sim::ingest::{IngestRow, measure, sites_per_shard};
    let dir = dir.unwrap_or_else(std::env::temp_dir);
    // The full-size digits CNN's f32 update: its trainable tensors' values.
    let (_, spec) = unifed_sim::full_size_digits()?;
    let update_bytes: usize = spec.tensors.iter().map(|t| 4 * t.numel()).sum();
    std::fs::create_dir_all(out)?;
    let mut rows = Vec::new();
    for &n in shards {
        let mut seconds = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) {
            seconds.push(measure(sites, n, update_bytes, &dir)?);
        }
        eprintln!("{n} shard(s): {seconds:.3?} s");
        rows.push(IngestRow {
            shards: n,
            sites,
            sites_per_shard: sites_per_shard(sites, n),
            update_bytes,
            seconds,
        });
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "Uploads arriving at once through the aggregator's ingest (`{}`), spooled in {} on a \
         machine of {cores} cores: {sites} sites' f32 updates of {:.2} MB each, signed in \
         chunks of {} bytes.\n\n\
         | threads | sites per thread | seconds (fastest, slowest) | MB/s (fastest) |\n\
         |---:|---|---|---:|\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        dir.display(),
        update_bytes as f64 / 1e6,
        unifed_protocol::chunking::CHUNK_BYTES,
    );
    for r in &rows {
        let fast = r.seconds.iter().copied().fold(f64::INFINITY, f64::min);
        let slow = r.seconds.iter().copied().fold(0.0, f64::max);
        md.push_str(&format!(
            "| {} | {:?} | {fast:.3}, {slow:.3} | {:.0} |\n",
            r.shards,
            r.sites_per_shard,
            (r.sites * r.update_bytes) as f64 / 1e6 / fast
        ));
    }
    print!("{md}");
    std::fs::write(out.join("ingest-speed.md"), &md)?;
    std::fs::write(
        out.join("ingest-speed.json"),
        serde_json::to_string_pretty(&json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "cores": cores,
            "dir": dir,
            "rows": rows,
        }))?,
    )?;
    Ok(())
}

fn aggregator_memory(
    counts: &[usize],
    encodings: &[String],
    arrivals: &[HandOver],
    out: &std::path::Path,
) -> Result<()> {
    use unifed_sim::memory::MemoryRow;
    // Every name is checked before the first (long) measurement.
    for e in encodings {
        parse_encoding(e)?;
    }
    std::fs::create_dir_all(out)?;
    let exe = std::env::current_exe()?;
    let mut rows: Vec<MemoryRow> = Vec::new();
    for e in encodings {
        for (&n, &a) in counts
            .iter()
            .flat_map(|n| arrivals.iter().map(move |a| (n, a)))
        {
            let arrival = clap::ValueEnum::to_possible_value(&a)
                .expect("no arrival is skipped")
                .get_name()
                .to_string();
            let o = std::process::Command::new(&exe)
                .args([
                    "aggregator-memory",
                    "--encodings",
                    e,
                    "--arrivals",
                    &arrival,
                    "--one",
                    &n.to_string(),
                ])
                .stderr(std::process::Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", exe.display()))?;
            if !o.status.success() {
                anyhow::bail!("measuring {n} sites under {e} failed ({})", o.status);
            }
            let row: MemoryRow = serde_json::from_slice(&o.stdout)
                .with_context(|| format!("the measurement of {n} sites under {e}"))?;
            eprintln!(
                "{e}, {n} sites {arrival}: aggregator heap peak {:.0} MiB (process peak {:.0} MiB)",
                row.aggregator_heap_peak_bytes as f64 / (1 << 20) as f64,
                row.peak_bytes as f64 / (1 << 20) as f64
            );
            rows.push(row);
        }
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "One round of the full-size digits CNN through the aggregator core (`{}`)\n\n\
         The aggregator's heap peak counts every byte it has allocated and not freed at once \
         (the model, the update handed to it, the fold); the process peak is resident memory, \
         the measuring program's own buffers included.\n\n\
         Updates handed to the core one by one, or together ({} an event, as the service \
         hands it uploads that complete at once: checked and spooled side by side, {} at a \
         time on this machine).\n\n\
         | encoding | sites | updates | update MB | model MB | aggregator heap peak MiB | x model | process peak MiB | spool s/update | fold s |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        unifed_aggregator::core::VET_WIDTH,
        cores.min(unifed_aggregator::core::VET_WIDTH)
    );
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.1} | {:.0} | {:.2} | {:.0} | {:.3} | {:.2} |\n",
            r.encoding,
            r.sites,
            if r.together { "together" } else { "one by one" },
            r.update_bytes as f64 / 1e6,
            (r.model_values * 4) as f64 / 1e6,
            mib(r.aggregator_heap_peak_bytes),
            r.aggregator_heap_peak_bytes as f64 / (r.model_values * 4) as f64,
            mib(r.peak_bytes),
            r.spool_seconds_per_update,
            r.fold_seconds
        ));
    }
    print!("{md}");
    std::fs::write(out.join("aggregator-memory.md"), &md)?;
    std::fs::write(
        out.join("aggregator-memory.json"),
        serde_json::to_string_pretty(&json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "cores": cores,
            "vet_width": unifed_aggregator::core::VET_WIDTH,
            "rows": rows,
        }))?,
    )?;
    Ok(())
}
