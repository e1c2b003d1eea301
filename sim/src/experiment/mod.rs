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

use crate::{RoundRecord, Site, initial_model, run_federation};
use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;
use unifed_aggregator::{Algorithm, FederationConfig};
use unifed_models::backend::Backend;
use unifed_models::bn::{CalibrateConfig, StreamConfig, calibrate};
use unifed_models::checkpoint::write_atomic;
use unifed_models::data::{BuiltinData, SplitSizes};
use unifed_models::state::{Select, export, import};
use unifed_models::train::{TrainConfig, evaluate, evaluate_stream};
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, seeded};
use unifed_protocol::messages::BnPolicy;

mod data;
mod tables;

pub use data::{DataSource, LabelSkew, SiteData, load_sites};
pub use tables::{mean_std, method_name};
use tables::{write_external, write_tables};
use unifed_protocol::ModelSpec;

/// An experiment: what to run and on which data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    /// The experiment's name (its results go to `results/experiments/<name>` by default).
    pub name: String,
    /// The algorithms, each as in the aggregator's config (`{ name = "fedprox", mu = 0.01 }`).
    pub algorithms: Vec<Algorithm>,
    /// The BN policies each algorithm runs under.
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
    /// Test accuracy of the global model as deployed: under `global` BN the averaged model;
    /// under `local` the global non-BN weights with the global model's own, never-trained BN.
    pub deployed: f64,
    /// Test accuracy under `stream` re-estimation from the deployed model.
    pub stream: f64,
    /// Test accuracy after `calibrate` on the domain's training images, labels unused.
    pub calibrate: f64,
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
        serde_json::json!({
            "rounds": self.rounds,
            "epochs": self.epochs,
            "sizes": self.sizes,
            "model": self.model,
            "data": self.data,
            "stream": self.external.as_ref().map(|e| e.stream),
            "fraction": self.fraction,
        })
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
    /// Wall seconds each round's validation took (the round's own `seconds` cover training,
    /// aggregation and the test evaluation).
    #[serde(default)]
    pub val_seconds: Vec<f64>,
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
    let stem = format!("{}-{policy}-seed{seed}", a.name());
    match held {
        None => out.join("runs").join(format!("{stem}.json")),
        Some(d) => out.join("runs/external").join(format!("{stem}-{d}.json")),
    }
}

/// What [`run`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Runs trained now (internal and external).
    pub trained: usize,
    /// Runs found finished in `<out>/runs` and reused.
    pub reused: usize,
}

/// Reads a finished run's file if there is one, refusing a run of other settings.
fn finished<T: serde::de::DeserializeOwned>(
    file: &Path,
    same: impl Fn(&T) -> bool,
) -> Result<Option<T>> {
    match std::fs::read(file) {
        Ok(bytes) => {
            let r: T = serde_json::from_slice(&bytes)
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

/// Runs every combination of `preset` that `out` does not already hold on the built-in `data`,
/// then writes the tables and the chart. `progress` gets one line per round, with an estimate
/// of the time left.
pub fn run(
    preset: &Preset,
    data: &BuiltinData,
    out: &Path,
    mut progress: impl FnMut(&str),
) -> Result<Outcome> {
    preset.validate()?;
    std::fs::create_dir_all(out.join("runs/external"))
        .with_context(|| format!("creating {}", out.join("runs/external").display()))?;
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
    let reused = results.len() + externals.len();
    if loaded.is_none() && !todo.is_empty() {
        loaded = Some(load_sites(preset, data)?);
    }
    let total_rounds = todo.len() as u64 * preset.rounds;
    let (started, mut done) = (Instant::now(), 0u64);
    for ((k, t), (spec, site_data)) in todo.iter().enumerate().zip(loaded.iter().cycle()) {
        let held = t.held_out.map(|h| &site_data[h]);
        let label = format!(
            "[{}/{}] {} seed {}{}",
            k + 1,
            todo.len(),
            method_name(&t.algorithm, t.bn),
            t.seed,
            held.map_or(String::new(), |d| format!(", {} held out", d.name))
        );
        let training: Vec<&SiteData> = site_data
            .iter()
            .enumerate()
            .filter(|(i, _)| t.held_out != Some(*i))
            .map(|(_, d)| d)
            .collect();
        let (r, sites) = run_one(
            preset,
            spec,
            &training,
            t.algorithm,
            t.bn,
            t.seed,
            |round, mean| {
                done += 1;
                let per = started.elapsed().as_secs_f64() / done as f64;
                let left = per * (total_rounds - done) as f64;
                progress(&format!(
                    "{label} round {round}/{}: mean test accuracy {:.2}%, about {} left",
                    preset.rounds,
                    100.0 * mean,
                    clock(left)
                ));
            },
        )?;
        match held {
            None => {
                write_atomic(&t.file, &serde_json::to_vec_pretty(&r)?)?;
                results.push(r);
            }
            Some(d) => {
                let ext = preset
                    .external
                    .as_ref()
                    .map(|e| e.stream)
                    .unwrap_or_default();
                let e = score_held_out(preset, spec, &sites, d, &t.algorithm, t.bn, t.seed, &ext)?;
                write_atomic(&t.file, &serde_json::to_vec_pretty(&e)?)?;
                externals.push(e);
            }
        }
    }
    write_tables(preset, out, &results)?;
    if preset.external.is_some() {
        write_external(preset, out, &externals)?;
    }
    Ok(Outcome {
        trained: todo.len(),
        reused,
    })
}

/// Scores held-out domain `d` with the federation's final model, from the `sites` that trained
/// it: as deployed, under `stream`, and after `calibrate` on `d`'s training images.
#[allow(clippy::too_many_arguments)]
fn score_held_out(
    preset: &Preset,
    spec: &ModelSpec,
    sites: &[Site<DigitsCnn>],
    d: &SiteData,
    algorithm: &Algorithm,
    bn: BnPolicy,
    seed: u64,
    stream: &StreamConfig,
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
    let mut order: Vec<usize> = (0..d.test.len()).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let calibrated = calibrate(
        &deployed,
        &d.train.x,
        &device,
        &CalibrateConfig::default(),
        |_, _| {},
    )?;
    Ok(ExternalResult {
        algorithm: *algorithm,
        bn_policy: bn,
        seed,
        held_out: d.name.clone(),
        settings: preset.settings(),
        deployed: evaluate(&deployed, &d.test, classes, 256, &device)?.accuracy(),
        stream: evaluate_stream(&deployed, &d.test, classes, stream, &order, &device)?.accuracy(),
        calibrate: evaluate(&calibrated, &d.test, classes, 256, &device)?.accuracy(),
    })
}

/// `seconds` as `1h02m`, `3m20s` or `45s`.
fn clock(seconds: f64) -> String {
    let s = seconds.round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// One run over `data`'s sites, each evaluated on its validation and test splits after every
/// round; returns the sites as they end (each holding the final model).
fn run_one(
    preset: &Preset,
    spec: &ModelSpec,
    data: &[&SiteData],
    algorithm: Algorithm,
    bn: BnPolicy,
    seed: u64,
    mut on_round: impl FnMut(u64, f64),
) -> Result<(RunResult, Vec<Site<DigitsCnn>>)> {
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
        fraction: preset.fraction,
        seed,
        ..FederationConfig::new("experiment", preset.rounds, sampled, Vec::new())
    };
    let tc = TrainConfig {
        epochs: preset.epochs,
        seed,
        ..TrainConfig::default()
    };
    let mut val = Vec::new();
    let mut val_seconds = Vec::new();
    let mut failed = None;
    let rounds = run_federation(
        cfg,
        initial_model(&net0, spec),
        &mut sites,
        &tc,
        &device,
        |_| {},
        |rec, sites| {
            let started = Instant::now();
            let v: Result<Vec<f64>, _> = sites
                .iter()
                .zip(data)
                .map(|(s, d)| {
                    s.evaluate_on(&d.val, spec, &rec.plan, &tc, &device)
                        .map(|e| e.accuracy())
                })
                .collect();
            match v {
                Ok(v) => val.push(v),
                Err(e) => failed = Some(e),
            }
            val_seconds.push(started.elapsed().as_secs_f64());
            let mean = rec.accuracy.iter().sum::<f64>() / rec.accuracy.len() as f64;
            on_round(rec.round, mean);
        },
    )?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    let r = RunResult {
        algorithm,
        bn_policy: bn,
        seed,
        settings: preset.settings(),
        sites: sites.iter().map(|s| s.id.to_string()).collect(),
        rounds,
        val,
        val_seconds,
    };
    Ok((r, sites))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(round: u64, accuracy: Vec<f64>) -> RoundRecord {
        RoundRecord {
            round,
            accuracy,
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
        };
        assert_eq!(r.best_on_val(), vec![0.30, 0.10]);
        assert_eq!(r.last(), vec![0.90, 0.30]);
    }
}
