//! `unifed-sim`: in-process federations on the built-in domains.
//!
//! - `compare`: FedBN (`local` BN) against FedAvg (`global` BN) for R rounds and S seeds; a
//!   per-site accuracy table (mean and std over seeds), JSON and a convergence chart (SVG).
//! - `encodings`: FedBN with each update encoding; bytes per site per round and accuracy.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use unifed_aggregator::{FederationConfig, GlobalModel};
use unifed_models::backend::{Backend, cap_cpu_threads};
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::state::{Select, export};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::BnPolicy;
use unifed_sim::chart::{Series, line_chart};
use unifed_sim::{RoundRecord, Site, run_federation};

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
    /// FedBN against FedAvg over several seeds.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Number of seeds (0..S).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Update encoding: f32, f16, q8 or topk<per-mille>.
        #[arg(long, default_value = "f32")]
        encoding: String,
    },
    /// FedBN with each encoding (one seed): bytes per site per round and accuracy.
    Encodings {
        #[command(flatten)]
        common: Common,
        /// Encodings to compare.
        #[arg(long, value_delimiter = ',', default_value = "f32,f16,q8,topk100")]
        encodings: Vec<String>,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn parse_encoding(s: &str) -> Result<Encoding> {
    s.parse().map_err(anyhow::Error::msg)
}

struct Run {
    records: Vec<RoundRecord>,
    sites: Vec<String>,
}

fn run_one(
    data: &BuiltinData,
    c: &Common,
    bn: BnPolicy,
    encoding: Encoding,
    seed: u64,
) -> Result<Run> {
    let device = Backend::Flex.device().map_err(anyhow::Error::msg)?;
    let mc = ModelConfig::fedbn_digits();
    let init = || seeded(&device, seed, |d| DigitsCnnConfig::default().init(d));
    let net0 = init();
    let spec = spec_of(&net0, &mc.classes, &mc.input);
    let sizes = SplitSizes {
        train: c.train_samples,
        ..SplitSizes::default()
    };
    let mut sites: Vec<Site<DigitsCnn>> = Vec::new();
    for d in Domain::TRAINING {
        let dd = data.domain(d, &sizes, 0)?;
        // Every site starts from its own copy of the same initial model.
        sites.push(Site::new(
            d.name(),
            init(),
            dd.train.dataset(&format!("{}/train", d.name()), &spec)?,
            dd.test.dataset(&format!("{}/test", d.name()), &spec)?,
        )?);
    }
    let initial = GlobalModel {
        spec: spec.clone(),
        tensors: export(&net0, &spec, Select::All)
            .tensors
            .into_iter()
            .map(|t| t.data)
            .collect(),
    };
    let cfg = FederationConfig {
        bn_policy: bn,
        encoding,
        ..FederationConfig::new("sim", c.rounds, sites.len())
    };
    let tc = TrainConfig {
        epochs: c.epochs,
        seed,
        ..TrainConfig::default()
    };
    let label = match bn {
        BnPolicy::Local => "FedBN",
        BnPolicy::Global => "FedAvg",
    };
    let records = run_federation(
        cfg,
        initial,
        &mut sites,
        &tc,
        &device,
        |_| {},
        |r, _| {
            let mean = r.accuracy.iter().sum::<f64>() / r.accuracy.len() as f64;
            eprintln!(
                "{label} seed {seed} round {:>3}: mean acc {:.2}% ({:.0} s)",
                r.round,
                100.0 * mean,
                r.seconds
            );
        },
    )?;
    Ok(Run {
        records,
        sites: sites.iter().map(|s| s.id.to_string()).collect(),
    })
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let s = (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len().max(2) - 1) as f64).sqrt();
    (m, if v.len() > 1 { s } else { 0.0 })
}

fn main() -> Result<()> {
    unifed_net::init_logging("warn");
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        cap_cpu_threads(t).map_err(anyhow::Error::msg)?;
    }
    let data = BuiltinData::load().context("loading the built-in data")?;
    match cli.cmd {
        Cmd::Compare {
            common,
            seeds,
            encoding,
        } => {
            let enc = parse_encoding(&encoding)?;
            std::fs::create_dir_all(&common.out)?;
            let mut runs: Vec<(BnPolicy, Vec<Run>)> = Vec::new();
            for bn in [BnPolicy::Local, BnPolicy::Global] {
                let mut rs = Vec::new();
                for seed in 0..seeds {
                    rs.push(run_one(&data, &common, bn, enc, seed)?);
                }
                runs.push((bn, rs));
            }
            let sites = runs[0].1[0].sites.clone();
            let last = |r: &Run| {
                r.records
                    .last()
                    .expect("at least one round")
                    .accuracy
                    .clone()
            };
            println!(
                "\nFedBN vs FedAvg, {} rounds x {} local epoch(s), {} seeds, encoding {encoding}: final test accuracy, mean (std) over seeds",
                common.rounds, common.epochs, seeds
            );
            println!("\n| site | FedBN | FedAvg | FedBN - FedAvg |\n|---|---:|---:|---:|");
            let mut table = Vec::new();
            for (k, s) in sites.iter().enumerate() {
                let a: Vec<f64> = runs[0].1.iter().map(|r| last(r)[k]).collect();
                let b: Vec<f64> = runs[1].1.iter().map(|r| last(r)[k]).collect();
                let ((ma, sa), (mb, sb)) = (mean_std(&a), mean_std(&b));
                let diff: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
                let (md, sd) = mean_std(&diff);
                println!(
                    "| {s} | {:.2} ({:.2}) | {:.2} ({:.2}) | {:+.2} ({:.2}) |",
                    100.0 * ma,
                    100.0 * sa,
                    100.0 * mb,
                    100.0 * sb,
                    100.0 * md,
                    100.0 * sd
                );
                table.push(json!({"site": s, "fedbn": a, "fedavg": b}));
            }
            let site_mean = |r: &Run| {
                r.records
                    .iter()
                    .map(|rec| rec.accuracy.iter().sum::<f64>() / rec.accuracy.len() as f64)
                    .collect::<Vec<_>>()
            };
            let mut series = Vec::new();
            let mut summary = Vec::new();
            for ((bn, rs), colour) in runs.iter().zip(["#1f77b4", "#d62728"]) {
                let per_seed: Vec<Vec<f64>> = rs.iter().map(site_mean).collect();
                let rounds = per_seed[0].len();
                let stats: Vec<(f64, f64)> = (0..rounds)
                    .map(|i| mean_std(&per_seed.iter().map(|v| v[i]).collect::<Vec<_>>()))
                    .collect();
                let name = if *bn == BnPolicy::Local {
                    "FedBN (local BN)"
                } else {
                    "FedAvg (global BN)"
                };
                let (m, s) = stats.last().copied().unwrap_or((0.0, 0.0));
                println!(
                    "| **mean** ({name}) | {:.2} ({:.2}) | | |",
                    100.0 * m,
                    100.0 * s
                );
                series.push(Series {
                    name: name.into(),
                    colour: colour.into(),
                    values: stats.iter().map(|x| x.0).collect(),
                    band: stats.iter().map(|x| x.1).collect(),
                });
                let bytes = rs[0].records[0].update_bytes.clone();
                let secs: Vec<f64> = rs
                    .iter()
                    .flat_map(|r| r.records.iter().map(|x| x.seconds))
                    .collect();
                summary.push(json!({
                    "policy": name,
                    "mean_accuracy_per_round": stats.iter().map(|x| x.0).collect::<Vec<_>>(),
                    "std_over_seeds_per_round": stats.iter().map(|x| x.1).collect::<Vec<_>>(),
                    "update_bytes_per_site": bytes,
                    "model_bytes": rs[0].records[0].model_bytes,
                    "seconds_per_round_mean": secs.iter().sum::<f64>() / secs.len() as f64,
                    "runs": rs.iter().map(|r| &r.records).collect::<Vec<_>>(),
                }));
            }
            let svg = line_chart(
                &format!("FedBN vs FedAvg on the built-in domains ({} seeds)", seeds),
                "mean test accuracy over sites",
                &series,
            );
            let (jp, sp) = (
                common.out.join("fedbn-vs-fedavg.json"),
                common.out.join("fedbn-vs-fedavg.svg"),
            );
            std::fs::write(
                &jp,
                serde_json::to_string_pretty(
                    &json!({"rounds": common.rounds, "epochs": common.epochs, "seeds": seeds, "encoding": encoding, "sites": sites, "final": table, "policies": summary}),
                )?,
            )?;
            std::fs::write(&sp, svg)?;
            println!("\nwrote {} and {}", jp.display(), sp.display());
        }
        Cmd::Encodings {
            common,
            encodings,
            seed,
        } => {
            std::fs::create_dir_all(&common.out)?;
            println!(
                "| encoding | bytes per site per round (mean) | vs f32 | final mean accuracy |\n|---|---:|---:|---:|"
            );
            let mut rows = Vec::new();
            let mut base_bytes = None;
            for e in &encodings {
                let run = run_one(&data, &common, BnPolicy::Local, parse_encoding(e)?, seed)?;
                let bytes: Vec<f64> = run
                    .records
                    .iter()
                    .flat_map(|r| r.update_bytes.iter().map(|&b| b as f64))
                    .collect();
                let mb = bytes.iter().sum::<f64>() / bytes.len() as f64;
                let base = *base_bytes.get_or_insert(mb);
                let acc = run
                    .records
                    .last()
                    .map(|r| r.accuracy.iter().sum::<f64>() / r.accuracy.len() as f64)
                    .unwrap_or(0.0);
                println!("| {e} | {mb:.0} | {:.3} | {:.2}% |", mb / base, 100.0 * acc);
                rows.push(json!({"encoding": e, "bytes_per_site_per_round": mb, "final_mean_accuracy": acc, "records": run.records}));
            }
            let p = common.out.join("encodings.json");
            std::fs::write(
                &p,
                serde_json::to_string_pretty(
                    &json!({"rounds": common.rounds, "seed": seed, "rows": rows}),
                )?,
            )?;
            println!("wrote {}", p.display());
        }
    }
    Ok(())
}
