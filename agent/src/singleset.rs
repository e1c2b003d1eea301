//! The no-federation baselines on the built-in domains. SingleSet: each training domain trained
//! alone, evaluated on its own fixed test split every epoch. Centralised (`--pooled`): one model
//! trained on every domain's training images together, as if the sites pooled their data,
//! evaluated on each domain's test split every epoch.

use anyhow::{Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use std::borrow::Cow;
use std::path::PathBuf;
use std::time::Instant;
use unifed_models::backend::{Backend, cpu_threads};
use unifed_models::data::{BuiltinData, Dataset, Domain, DomainSplit, SplitSizes, preview_grid};
use unifed_models::train::{EVAL_BATCH, TrainConfig, TrainEvent, evaluate, train_local};
use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, seeded, spec_of};

/// Options of the SingleSet demo.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Training epochs per domain.
    #[arg(long, default_value_t = 12)]
    epochs: usize,
    /// Domains to train (comma-separated; default: the five training domains).
    #[arg(long, value_delimiter = ',')]
    domains: Vec<String>,
    /// Training images per domain (FedBN's 10% setting: 743).
    #[arg(long, default_value_t = 743)]
    train_samples: usize,
    /// Seed of data generation, initialisation and sample order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Learning rate (FedBN: 0.01).
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Batch size (FedBN: 32).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Train one model on all the domains' training images together (the centralised
    /// baseline; writes centralised.json) instead of one model per domain.
    #[arg(long)]
    pooled: bool,
    /// Folder for results (JSON, preview grid).
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

/// One domain's data: its training and test sets, and the test images for the preview grid.
struct Split {
    domain: Domain,
    train: Dataset,
    test: Dataset,
    preview: DomainSplit,
}

#[derive(Serialize)]
struct DomainResult {
    domain: String,
    train_samples: usize,
    test_samples: usize,
    epoch_loss: Vec<f64>,
    epoch_test_accuracy: Vec<f64>,
    final_test_accuracy: f64,
    seconds: f64,
}

pub fn run(backend: Backend, args: &Args) -> Result<()> {
    let device = backend.device().map_err(anyhow::Error::msg)?;
    let domains: Vec<Domain> = if args.domains.is_empty() {
        Domain::TRAINING.to_vec()
    } else {
        args.domains
            .iter()
            .map(|d| Domain::parse(d))
            .collect::<Result<_, _>>()
            .map_err(anyhow::Error::msg)?
    };
    let cfg = ModelConfig::fedbn_digits();
    let data = BuiltinData::load().context("loading the built-in data (assets/)")?;
    let sizes = SplitSizes {
        train: args.train_samples,
        ..SplitSizes::default()
    };
    let method = if args.pooled {
        "Centralised"
    } else {
        "SingleSet"
    };
    println!(
        "{method} on the built-in digits: {} domain(s), {} train images each, {} epochs, backend {backend}, {} CPU threads",
        domains.len(),
        sizes.train,
        args.epochs,
        cpu_threads()
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mp = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    let spec = spec_of(
        &seeded(&device, args.seed, |d| DigitsCnnConfig::default().init(d)),
        &cfg.classes,
        &cfg.input,
    );
    let mut splits = Vec::new();
    for &domain in &domains {
        let dd = data.domain(domain, &sizes, args.seed)?;
        splits.push(Split {
            domain,
            train: dd
                .train
                .dataset(&format!("{}/train", domain.name()), &spec)?,
            test: dd.test.dataset(&format!("{}/test", domain.name()), &spec)?,
            preview: dd.test,
        });
    }
    // What each model trains on, and the domains it is tested on.
    let jobs: Vec<(String, Cow<Dataset>, Vec<&Split>)> = if args.pooled {
        let parts: Vec<&Dataset> = splits.iter().map(|s| &s.train).collect();
        vec![(
            "pooled".into(),
            Cow::Owned(Dataset::pooled("pooled/train", &parts)?),
            splits.iter().collect(),
        )]
    } else {
        splits
            .iter()
            .map(|s| {
                (
                    s.domain.name().to_string(),
                    Cow::Borrowed(&s.train),
                    vec![s],
                )
            })
            .collect()
    };
    let mut results = Vec::new();
    for (name, train, tests) in &jobs {
        let bar = mp.add(ProgressBar::new(
            (args.epochs * train.len().div_ceil(args.batch_size)) as u64,
        ));
        bar.set_style(style.clone());
        bar.set_prefix(name.clone());
        results.extend(train_job(args, &spec, &device, (train, tests), &bar)?);
    }
    let json = write_results(args, backend, method, &results)?;
    let rows: Vec<_> = splits.iter().map(|s| (s.domain, &s.preview)).collect();
    let png = args.out.join("singleset-domains.png");
    preview_grid(&rows, 16, 2).save(&png)?;
    println!("wrote {} and {}", json.display(), png.display());
    Ok(())
}

/// Trains one model on `train` for the configured epochs, testing it on each of `tests` after
/// every epoch: one result per tested domain.
fn train_job(
    args: &Args,
    spec: &unifed_protocol::ModelSpec,
    device: &unifed_models::backend::Device,
    (train, tests): (&Dataset, &[&Split]),
    bar: &ProgressBar,
) -> Result<Vec<DomainResult>> {
    let t0 = Instant::now();
    // A fresh model per job (clones of one would share its BN running statistics).
    let mut net = seeded(device, args.seed, |d| DigitsCnnConfig::default().init(d));
    let mut losses = Vec::new();
    let mut accs = vec![Vec::new(); tests.len()];
    for epoch in 0..args.epochs {
        let tc = TrainConfig {
            lr: args.lr,
            batch_size: args.batch_size,
            epochs: 1,
            seed: args.seed.wrapping_add(epoch as u64),
            ..Default::default()
        };
        let (trained, rep) = train_local(&net, train, spec.classes.len(), &tc, device, |e| {
            if let TrainEvent::Step { .. } = e {
                bar.inc(1);
            }
        })?;
        net = trained;
        for (acc, t) in accs.iter_mut().zip(tests) {
            let ev = evaluate(&net, &t.test, spec.classes.len(), EVAL_BATCH, device)?;
            acc.push(ev.accuracy());
        }
        losses.push(rep.epoch_losses[0]);
        let mean = accs.iter().filter_map(|a| a.last()).sum::<f64>() / tests.len() as f64;
        bar.set_message(format!(
            "epoch {} loss {:.3} test acc {:.1}%",
            epoch + 1,
            rep.epoch_losses[0],
            100.0 * mean
        ));
    }
    bar.finish();
    let seconds = t0.elapsed().as_secs_f64();
    Ok(accs
        .into_iter()
        .zip(tests)
        .map(|(acc, t)| DomainResult {
            domain: t.domain.name().into(),
            train_samples: train.len(),
            test_samples: t.test.len(),
            final_test_accuracy: *acc.last().unwrap_or(&0.0),
            epoch_loss: losses.clone(),
            epoch_test_accuracy: acc,
            seconds,
        })
        .collect())
}

/// Prints the results' table and writes them as JSON to the output folder; returns the file.
fn write_results(
    args: &Args,
    backend: Backend,
    method: &str,
    results: &[DomainResult],
) -> Result<std::path::PathBuf> {
    println!("\n| domain | train | test | {method} test accuracy | seconds |");
    println!("|---|---:|---:|---:|---:|");
    for r in results {
        println!(
            "| {} | {} | {} | {:.2}% | {:.0} |",
            r.domain,
            r.train_samples,
            r.test_samples,
            100.0 * r.final_test_accuracy,
            r.seconds
        );
    }
    let mean =
        results.iter().map(|r| r.final_test_accuracy).sum::<f64>() / results.len().max(1) as f64;
    println!("| mean | | | {:.2}% | |", 100.0 * mean);
    let json = args.out.join(if args.pooled {
        "centralised.json"
    } else {
        "singleset.json"
    });
    std::fs::write(
        &json,
        serde_json::to_string_pretty(&serde_json::json!({
            "method": method,
            "backend": backend.to_string(),
            "threads": cpu_threads(),
            "epochs": args.epochs,
            "seed": args.seed,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "domains": results,
            "mean_accuracy": mean,
        }))?,
    )?;
    Ok(json)
}
