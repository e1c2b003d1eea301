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
//! loaded once per experiment. Not yet here: the leave-one-domain-out external table, Dirichlet
//! label skew and per-round loss curves.

use crate::chart::{Series, line_chart};
use crate::{RoundRecord, Site, initial_model, run_federation};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;
use unifed_aggregator::{Algorithm, FederationConfig};
use unifed_models::backend::Backend;
use unifed_models::checkpoint::write_atomic;
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes, load_labelled};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_protocol::messages::BnPolicy;
use unifed_protocol::{Input, ModelSpec, Scaling};

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
}

/// The data of an experiment's sites.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSource {
    /// The built-in training domains (`data = "builtin"`), split by `sizes`.
    #[default]
    Builtin,
    /// A folder of domains, one site each (`data = { folder = "..." }`):
    /// `<root>/<domain>/{train,val,test}/<class>/<image>`, PNG or JPEG, resized to the model's
    /// input; `sizes` does not apply.
    Folder(PathBuf),
}

/// One site's data: its name and splits.
#[derive(Debug, Clone)]
pub struct SiteData {
    /// The site (its domain's name).
    pub name: String,
    /// Training split.
    pub train: Dataset,
    /// Validation split (selects the round).
    pub val: Dataset,
    /// Test split.
    pub test: Dataset,
}

/// The model spec and every site's data of `preset`, loaded once.
pub fn load_sites(preset: &Preset, builtin: &BuiltinData) -> Result<(ModelSpec, Vec<SiteData>)> {
    let input = Input::Image {
        channels: preset.model.in_channels as u32,
        height: preset.model.size[0] as u32,
        width: preset.model.size[1] as u32,
        scaling: Scaling::MinusOneToOne,
    };
    let classes = match &preset.data {
        DataSource::Builtin => ModelConfig::fedbn_digits().classes,
        DataSource::Folder(root) => folder_classes(root)?,
    };
    let model = DigitsCnnConfig {
        classes: classes.len(),
        ..preset.model.clone()
    };
    let device = Backend::Flex.device().map_err(anyhow::Error::msg)?;
    let spec = spec_of(&model.init(&device), &classes, &input);
    let sites = match &preset.data {
        DataSource::Builtin => Domain::TRAINING
            .into_iter()
            .map(|d| {
                let dd = builtin.domain(d, &preset.sizes, 0)?;
                let split = |s: &unifed_models::data::DomainSplit, what: &str| {
                    s.dataset(&format!("{}/{what}", d.name()), &spec)
                };
                Ok(SiteData {
                    name: d.name().to_string(),
                    train: split(&dd.train, "train")?,
                    val: split(&dd.val, "val")?,
                    test: split(&dd.test, "test")?,
                })
            })
            .collect::<Result<Vec<_>>>()?,
        DataSource::Folder(root) => domains(root)?
            .into_iter()
            .map(|(name, dir)| {
                let [train, val, test] = load_labelled(&dir, &spec)
                    .with_context(|| format!("domain `{name}` ({})", dir.display()))?;
                if val.is_empty() {
                    bail!(
                        "domain `{name}` has no validation images ({}): rounds are selected on \
                         them",
                        dir.join("val").display()
                    );
                }
                Ok(SiteData {
                    name,
                    train,
                    val,
                    test,
                })
            })
            .collect::<Result<Vec<_>>>()?,
    };
    Ok((spec, sites))
}

/// The domains of a folder: its subfolders, sorted, as (name, path).
fn domains(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).with_context(|| format!("reading {}", root.display()))? {
        let p = e
            .with_context(|| format!("reading {}", root.display()))?
            .path();
        if p.is_dir() {
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("{}: not a UTF-8 name", p.display()))?;
            out.push((name.to_string(), p.clone()));
        }
    }
    out.sort();
    if out.len() < 2 {
        bail!(
            "{} holds {} domain folder(s); a federation needs at least two",
            root.display(),
            out.len()
        );
    }
    Ok(out)
}

/// The classes of a folder of domains: the union of the class folders of every split, sorted.
fn folder_classes(root: &Path) -> Result<Vec<String>> {
    let mut classes = std::collections::BTreeSet::new();
    for (_, dir) in domains(root)? {
        for split in ["train", "val", "test"] {
            let Ok(entries) = std::fs::read_dir(dir.join(split)) else {
                continue;
            };
            for e in entries.flatten() {
                if e.path().is_dir()
                    && let Some(n) = e.file_name().to_str()
                {
                    classes.insert(n.to_string());
                }
            }
        }
    }
    if classes.len() < 2 {
        bail!(
            "{}: found {} class folder(s) under <domain>/{{train,val,test}}; a classifier needs \
             at least two",
            root.display(),
            classes.len()
        );
    }
    Ok(classes.into_iter().collect())
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
        if self.sizes.val == 0 {
            bail!("sizes.val must be at least 1: rounds are selected on validation accuracy");
        }
        for a in &self.algorithms {
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

/// A method's name in tables: FedAvg under local BN is FedBN.
pub fn method_name(a: &Algorithm, bn: BnPolicy) -> String {
    let name = match a {
        Algorithm::FedAvg => {
            return match bn {
                BnPolicy::Local => "FedBN".into(),
                BnPolicy::Global => "FedAvg".into(),
            };
        }
        Algorithm::FedProx { .. } => "FedProx",
        Algorithm::FedAdam(_) => "FedAdam",
        Algorithm::FedYogi(_) => "FedYogi",
        Algorithm::FedAdagrad(_) => "FedAdagrad",
        Algorithm::Scaffold(_) => "SCAFFOLD",
        Algorithm::FedNova(_) => "FedNova",
        Algorithm::Moon(_) => "MOON",
        Algorithm::FedDc(_) => "FedDC",
        Algorithm::PerFedAvg(_) => "Per-FedAvg",
    };
    match bn {
        BnPolicy::Local => format!("{name} (local BN)"),
        BnPolicy::Global => format!("{name} (global BN)"),
    }
}

/// The file of a run in `out`.
fn run_file(out: &Path, a: &Algorithm, bn: BnPolicy, seed: u64) -> PathBuf {
    let policy = match bn {
        BnPolicy::Local => "local",
        BnPolicy::Global => "global",
    };
    out.join("runs")
        .join(format!("{}-{policy}-seed{seed}.json", a.name()))
}

/// What [`run`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Runs trained now.
    pub trained: usize,
    /// Runs found finished in `<out>/runs` and reused.
    pub reused: usize,
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
    std::fs::create_dir_all(out.join("runs"))
        .with_context(|| format!("creating {}", out.join("runs").display()))?;
    let settings = preset.settings();
    let mut todo = Vec::new();
    let mut results = Vec::new();
    for a in &preset.algorithms {
        for &bn in &preset.policies {
            for seed in 0..preset.seeds {
                let file = run_file(out, a, bn, seed);
                match std::fs::read(&file) {
                    Ok(bytes) => {
                        let r: RunResult = serde_json::from_slice(&bytes)
                            .with_context(|| format!("reading {}", file.display()))?;
                        if r.settings != settings || r.algorithm != *a {
                            bail!(
                                "{} was run with other settings or parameters; remove it or \
                                 choose another output folder",
                                file.display()
                            );
                        }
                        results.push(r);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        todo.push((*a, bn, seed, file))
                    }
                    Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
                }
            }
        }
    }
    let reused = results.len();
    // The data is loaded (or rendered) once, and only when there is a run to do.
    let loaded = match todo.is_empty() {
        true => None,
        false => Some(load_sites(preset, data)?),
    };
    let total_rounds = todo.len() as u64 * preset.rounds;
    let (started, mut done) = (Instant::now(), 0u64);
    for ((k, (a, bn, seed, file)), (spec, site_data)) in
        todo.iter().enumerate().zip(loaded.iter().cycle())
    {
        let label = format!(
            "[{}/{}] {} seed {seed}",
            k + 1,
            todo.len(),
            method_name(a, *bn)
        );
        let r = run_one(preset, spec, site_data, *a, *bn, *seed, |round, mean| {
            done += 1;
            let per = started.elapsed().as_secs_f64() / done as f64;
            let left = per * (total_rounds - done) as f64;
            progress(&format!(
                "{label} round {round}/{}: mean test accuracy {:.2}%, about {} left",
                preset.rounds,
                100.0 * mean,
                clock(left)
            ));
        })?;
        write_atomic(file, &serde_json::to_vec_pretty(&r)?)?;
        results.push(r);
    }
    write_tables(preset, out, &results)?;
    Ok(Outcome {
        trained: todo.len(),
        reused,
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
/// round.
fn run_one(
    preset: &Preset,
    spec: &ModelSpec,
    data: &[SiteData],
    algorithm: Algorithm,
    bn: BnPolicy,
    seed: u64,
    mut on_round: impl FnMut(u64, f64),
) -> Result<RunResult> {
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
    let cfg = FederationConfig {
        algorithm,
        bn_policy: bn,
        ..FederationConfig::new("experiment", preset.rounds, sites.len(), Vec::new())
    };
    let tc = TrainConfig {
        epochs: preset.epochs,
        seed,
        ..TrainConfig::default()
    };
    let mut val = Vec::new();
    let mut failed = None;
    let rounds = run_federation(
        cfg,
        initial_model(&net0, spec),
        &mut sites,
        &tc,
        &device,
        |_| {},
        |rec, sites| {
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
            let mean = rec.accuracy.iter().sum::<f64>() / rec.accuracy.len() as f64;
            on_round(rec.round, mean);
        },
    )?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    Ok(RunResult {
        algorithm,
        bn_policy: bn,
        seed,
        settings: preset.settings(),
        sites: sites.iter().map(|s| s.id.to_string()).collect(),
        rounds,
        val,
    })
}

/// Mean and sample standard deviation (0 for one value).
pub fn mean_std(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
    if v.len() < 2 {
        return (m, 0.0);
    }
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
    (m, var.sqrt())
}

const COLOURS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// Writes `<out>/internal.{md,json,svg}` from the runs, in the preset's order of methods.
fn write_tables(preset: &Preset, out: &Path, results: &[RunResult]) -> Result<()> {
    let sites = results[0].sites.clone();
    let mut methods = Vec::new();
    for a in &preset.algorithms {
        for &bn in &preset.policies {
            let mut runs: Vec<&RunResult> = results
                .iter()
                .filter(|r| r.algorithm == *a && r.bn_policy == bn && r.seed < preset.seeds)
                .collect();
            runs.sort_by_key(|r| r.seed);
            methods.push((*a, bn, runs));
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let pct = |(m, s): (f64, f64)| format!("{:.2} ({:.2})", 100.0 * m, 100.0 * s);
    let mut md = format!(
        "# {}: internal accuracy\n\n{} rounds x {} local epoch(s), {} seeds; {} training, {} \
         validation and {} test images per site. Each cell: test accuracy in %, mean (std) over \
         seeds; **best on validation** takes, for each site, the round of its highest \
         validation accuracy (UniFed's selection), **final** the last round.\n\n",
        preset.name,
        preset.rounds,
        preset.epochs,
        preset.seeds,
        preset.sizes.train,
        preset.sizes.val,
        preset.sizes.test
    );
    md.push_str("| method | selection | ");
    md.push_str(&sites.join(" | "));
    md.push_str(" | mean |\n|---|---|");
    md.push_str(&"---:|".repeat(sites.len() + 1));
    md.push('\n');
    let mut json_methods = Vec::new();
    let mut series = Vec::new();
    for ((a, bn, runs), colour) in methods.iter().zip(COLOURS.iter().cycle()) {
        let name = method_name(a, *bn);
        let mut entry = serde_json::json!({
            "method": name, "algorithm": a, "bn_policy": bn,
            "seeds": runs.iter().map(|r| r.seed).collect::<Vec<_>>(),
        });
        for (key, pick) in [
            (
                "best_on_val",
                RunResult::best_on_val as fn(&RunResult) -> Vec<f64>,
            ),
            ("final", RunResult::last),
        ] {
            let per_run: Vec<Vec<f64>> = runs.iter().map(|r| pick(r)).collect();
            let mut cells = Vec::new();
            for k in 0..sites.len() {
                cells.push(pct(mean_std(
                    &per_run.iter().map(|v| v[k]).collect::<Vec<_>>(),
                )));
            }
            let means: Vec<f64> = per_run.iter().map(|v| mean(v)).collect();
            cells.push(format!("**{}**", pct(mean_std(&means))));
            md.push_str(&format!(
                "| {name} | {} | {} |\n",
                key.replace('_', " "),
                cells.join(" | ")
            ));
            entry[key] = serde_json::json!({
                "per_seed_per_site": per_run,
                "mean_over_sites_per_seed": means,
            });
        }
        let curves: Vec<Vec<f64>> = runs
            .iter()
            .map(|r| r.rounds.iter().map(|x| mean(&x.accuracy)).collect())
            .collect();
        let stats: Vec<(f64, f64)> = (0..preset.rounds as usize)
            .map(|i| mean_std(&curves.iter().map(|c| c[i]).collect::<Vec<_>>()))
            .collect();
        entry["mean_test_accuracy_per_round"] = serde_json::json!(curves);
        let secs: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.rounds.iter().map(|x| x.seconds))
            .collect();
        entry["seconds_per_round_mean"] = serde_json::json!(mean(&secs));
        series.push(Series {
            name: name.clone(),
            colour: (*colour).into(),
            values: stats.iter().map(|x| x.0).collect(),
            band: stats.iter().map(|x| x.1).collect(),
        });
        json_methods.push(entry);
    }
    // The gain of client-specific BN per algorithm, seed by seed (UniFed Table 2's last rows).
    let mut gains = Vec::new();
    md.push_str("\n| algorithm | local - global, best on validation | local - global, final |\n|---|---:|---:|\n");
    for a in &preset.algorithms {
        let find = |bn| methods.iter().find(|(b, p, _)| b == a && *p == bn);
        let (Some((_, _, local)), Some((_, _, global))) =
            (find(BnPolicy::Local), find(BnPolicy::Global))
        else {
            continue;
        };
        let diff = |pick: fn(&RunResult) -> Vec<f64>| -> Vec<f64> {
            local
                .iter()
                .zip(global.iter())
                .map(|(l, g)| mean(&pick(l)) - mean(&pick(g)))
                .collect()
        };
        let (best, last) = (diff(RunResult::best_on_val), diff(RunResult::last));
        let signed = |(m, s): (f64, f64)| format!("{:+.2} ({:.2})", 100.0 * m, 100.0 * s);
        md.push_str(&format!(
            "| {} | {} | {} |\n",
            a.name(),
            signed(mean_std(&best)),
            signed(mean_std(&last))
        ));
        gains.push(serde_json::json!({
            "algorithm": a.name(),
            "best_on_val_per_seed": best,
            "final_per_seed": last,
        }));
    }
    let json = serde_json::json!({
        "experiment": preset.name,
        "preset": preset,
        "sites": sites,
        "methods": json_methods,
        "local_minus_global": gains,
    });
    write_atomic(&out.join("internal.md"), md.as_bytes())?;
    write_atomic(
        &out.join("internal.json"),
        &serde_json::to_vec_pretty(&json)?,
    )?;
    let svg = line_chart(
        &format!("{}: mean test accuracy over sites", preset.name),
        "mean test accuracy over sites",
        &series,
    );
    write_atomic(&out.join("internal.svg"), svg.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(round: u64, accuracy: Vec<f64>) -> RoundRecord {
        RoundRecord {
            round,
            accuracy,
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
        };
        assert_eq!(r.best_on_val(), vec![0.30, 0.10]);
        assert_eq!(r.last(), vec![0.90, 0.30]);
    }
}
