//! The experiment's tables and chart: UniFed Table 2's shape (internal) and Table 3's
//! (external, leave one domain out), as markdown and JSON.

use super::data::{DataSource, SiteData};
use super::{ExternalResult, Preset, RunResult};
use crate::chart::{Scale, Series, chart, line_chart};
use anyhow::Result;
use std::path::Path;
use unifed_aggregator::Algorithm;
use unifed_models::checkpoint::write_atomic;
use unifed_protocol::messages::{BnPolicy, BnSharing};

/// A method's name in tables: FedAvg under local BN is FedBN.
pub fn method_name(a: &Algorithm, bn: BnPolicy) -> String {
    match (a, bn) {
        (Algorithm::FedAvg, BnPolicy::Local) => "FedBN".into(),
        (Algorithm::FedAvg, BnPolicy::Global) => "FedAvg".into(),
        (a, BnPolicy::Local) => format!("{} (local BN)", a.label()),
        (a, BnPolicy::Global) => format!("{} (global BN)", a.label()),
    }
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

/// The training, validation and test images of each site as the runs used them: the loaded
/// sites' own (one figure when every site has the same), or, not loaded, the preset's sizes
/// for the built-in domains (a folder's or a label skew's are the data's, not the preset's).
pub(super) fn split_sizes(preset: &Preset, sites: Option<&[SiteData]>) -> String {
    match sites {
        Some(sites) => {
            let each: Vec<(usize, usize, usize)> = sites
                .iter()
                .map(|d| (d.train.len(), d.val.len(), d.test.len()))
                .collect();
            match each.first() {
                Some(&(t, v, e)) if each.iter().all(|x| *x == (t, v, e)) => {
                    format!("{t} training, {v} validation and {e} test images per site")
                }
                _ => {
                    let list: Vec<String> = sites
                        .iter()
                        .zip(&each)
                        .map(|(d, (t, v, e))| format!("{} {t}/{v}/{e}", d.name))
                        .collect();
                    format!(
                        "training/validation/test images per site: {}",
                        list.join(", ")
                    )
                }
            }
        }
        None if preset.data == DataSource::Builtin => format!(
            "{} training, {} validation and {} test images per site",
            preset.sizes.train, preset.sizes.val, preset.sizes.test
        ),
        None => "each site's splits as its data holds them".into(),
    }
}

const COLOURS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// Writes `<out>/internal.{md,json,svg}` from the runs, in the preset's order of methods.
/// Methods with fewer runs than the preset's seeds say how many they hold; a method with none
/// is listed as not run, and nothing is written before the first run has finished.
pub(super) fn write_tables(
    preset: &Preset,
    out: &Path,
    results: &[RunResult],
    data: Option<&[SiteData]>,
) -> Result<()> {
    let Some(first) = results.first() else {
        return Ok(());
    };
    let sites = first.sites.clone();
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
    let mut md = format!(
        "# {}: internal accuracy\n\n{} rounds x {} local epoch(s), {} seeds; {}. Each cell: \
         test accuracy in %, mean (std) over seeds; **best on validation** takes, for each \
         site, the round of its highest validation accuracy (UniFed's selection), **final** \
         the last round.\n\n",
        preset.name,
        preset.rounds,
        preset.epochs,
        preset.seeds,
        split_sizes(preset, data),
    );
    let finished: usize = methods.iter().map(|m| m.2.len()).sum();
    let expected = methods.len() * preset.seeds as usize;
    if finished < expected {
        md.push_str(&format!(
            "**{finished} of {expected} runs have finished**; the seeds column says how many \
             each row holds.\n\n"
        ));
    }
    md.push_str("| method | selection | seeds | ");
    md.push_str(&sites.join(" | "));
    md.push_str(" | mean |\n|---|---|---:|");
    md.push_str(&"---:|".repeat(sites.len() + 1));
    md.push('\n');
    let mut json_methods = Vec::new();
    let mut series = Vec::new();
    let mut loss_series = Vec::new();
    std::fs::create_dir_all(out.join("charts"))?;
    for ((a, bn, runs), colour) in methods.iter().zip(COLOURS.iter().cycle()) {
        let name = method_name(a, *bn);
        let mut entry = serde_json::json!({
            "method": name, "algorithm": a, "bn_policy": bn,
            "seeds": runs.iter().map(|r| r.seed).collect::<Vec<_>>(),
        });
        if runs.is_empty() {
            md.push_str(&format!(
                "| {name} | not run yet | 0 |{}\n",
                " |".repeat(sites.len() + 1)
            ));
            json_methods.push(entry);
            continue;
        }
        accuracy_rows(&name, runs, sites.len(), &mut md, &mut entry);
        let curves: Vec<Vec<f64>> = runs
            .iter()
            .map(|r| r.rounds.iter().map(|x| mean(&x.accuracy)).collect())
            .collect();
        let stats: Vec<(f64, f64)> = (0..preset.rounds as usize)
            .map(|i| mean_std(&curves.iter().map(|c| c[i]).collect::<Vec<_>>()))
            .collect();
        entry["mean_test_accuracy_per_round"] = serde_json::json!(curves);
        let secs: Vec<f64> = runs.iter().flat_map(|r| r.round_seconds()).collect();
        entry["seconds_per_round_mean"] = serde_json::json!(mean(&secs));
        series.push(Series {
            name: name.clone(),
            colour: (*colour).into(),
            values: stats.iter().map(|x| x.0).collect(),
            band: stats.iter().map(|x| x.1).collect(),
        });
        let (train_sites, train_mean) =
            losses(preset.rounds as usize, sites.len(), runs, &mut entry);
        loss_series.push(Series {
            name: name.clone(),
            colour: (*colour).into(),
            values: train_mean,
            band: Vec::new(),
        });
        site_charts(out, &name, &sites, runs, &train_sites)?;
        json_methods.push(entry);
    }
    let gains = bn_gains(preset, &methods, &mut md);
    mask_rows(&methods, &mut md);
    dissimilarity_rows(&methods, &mut md);
    let json = serde_json::json!({
        "experiment": preset.name,
        "preset": preset,
        "sites": sites,
        "methods": json_methods,
        "local_minus_global": gains,
    });
    write_table(out, "internal", &md, &json)?;
    let svg = line_chart(
        &format!("{}: mean test accuracy over sites", preset.name),
        "mean test accuracy over sites",
        &series,
    );
    write_atomic(&out.join("internal.svg"), svg.as_bytes())?;
    let svg = chart(
        &format!("{}: mean training loss over sites", preset.name),
        "training loss",
        &loss_series,
        Scale::Plain,
    );
    write_atomic(&out.join("internal-loss.svg"), svg.as_bytes())?;
    Ok(())
}

/// Writes `<out>/external.{md,json}`: per method (algorithm x policy) and estimate (deployed,
/// stream, calibrate), each held-out domain's test accuracy, mean (std) over the seeds
/// finished, and the mean over domains of the seeds every domain has finished.
pub(super) fn write_external(
    preset: &Preset,
    out: &Path,
    domains: &[String],
    results: &[ExternalResult],
) -> Result<()> {
    let algorithms = match preset.external.as_ref() {
        Some(e) if !e.algorithms.is_empty() => &e.algorithms,
        _ => &preset.algorithms,
    };
    let mut md = format!(
        "# {}: external accuracy (leave one domain out)\n\nEach domain in turn is held out; \
         the others federate for {} rounds; the held-out test split is scored with the global \
         model as deployed (local BN: its own never-trained BN), with `stream` re-estimation \
         on its test batches, and after `calibrate` on its unlabelled training images; then \
         the same three from the onboarding package the aggregator would serve the domain \
         (local BN: the final model with the training sites' BN pooled as `bn_sharing` says; \
         global BN: the global model). UniFed's Algorithm 1 tests an external client with \
         the global model and `stream` re-estimation: the `stream` row. Test accuracy in %, \
         mean (std) over {} seeds.\n\n",
        preset.name, preset.rounds, preset.seeds,
    );
    let expected = algorithms.len() * preset.policies.len() * preset.seeds as usize * domains.len();
    if results.len() < expected {
        md.push_str(&format!(
            "**{} of {expected} held-out runs have finished**: a cell is the mean over the \
             seeds it holds; a mean over domains only takes the seeds every domain holds.\n\n",
            results.len()
        ));
    }
    md.push_str(&format!(
        "| method | estimate | {} | mean |\n|---|---|{}\n",
        domains.join(" | "),
        "---:|".repeat(domains.len() + 1)
    ));
    let mut methods = Vec::new();
    for a in algorithms {
        for &bn in &preset.policies {
            let name = method_name(a, bn);
            let mut entry = serde_json::json!({"method": name, "algorithm": a, "bn_policy": bn});
            // A package's estimates count when its sharing policy is the preset's (under
            // global BN, none is shared).
            let sharing = match bn {
                BnPolicy::Local => preset
                    .external
                    .as_ref()
                    .map_or(BnSharing::None, |e| e.bn_sharing),
                BnPolicy::Global => BnSharing::None,
            };
            let packaged = |r: &ExternalResult| r.package.filter(|p| p.bn_sharing == sharing);
            type Pick<'p> = Box<dyn Fn(&ExternalResult) -> Option<f64> + 'p>;
            let picks: [(&str, Pick); 6] = [
                ("deployed", Box::new(|r| Some(r.own.deployed))),
                ("stream", Box::new(|r| Some(r.own.stream))),
                ("calibrate", Box::new(|r| Some(r.own.calibrate))),
                (
                    "package",
                    Box::new(|r| packaged(r).map(|p| p.estimates.deployed)),
                ),
                (
                    "package + stream",
                    Box::new(|r| packaged(r).map(|p| p.estimates.stream)),
                ),
                (
                    "package + calibrate",
                    Box::new(|r| packaged(r).map(|p| p.estimates.calibrate)),
                ),
            ];
            // Per domain, the method's runs in seed order.
            let runs: Vec<Vec<&ExternalResult>> = domains
                .iter()
                .map(|d| {
                    let mut v: Vec<&ExternalResult> = results
                        .iter()
                        .filter(|r| r.algorithm == *a && r.bn_policy == bn && &r.held_out == d)
                        .collect();
                    v.sort_by_key(|r| r.seed);
                    v
                })
                .collect();
            for (key, pick) in picks {
                let (cells, json) = estimate_row(&runs, &*pick, preset.seeds);
                md.push_str(&format!("| {name} | {key} | {} |\n", cells.join(" | ")));
                entry[key] = json;
            }
            methods.push(entry);
        }
    }
    let json = serde_json::json!({
        "experiment": preset.name,
        "domains": domains,
        "methods": methods,
    });
    write_table(out, "external", &md, &json)
}

/// One estimate's row of the external table from `runs` (per domain, one method's runs in
/// seed order) and `pick` (the estimate of a run, if it has one): per domain the accuracies over
/// seeds, and the mean over domains for each of the first `seeds` seeds that every domain holds;
/// its markdown cells and its JSON.
fn estimate_row(
    runs: &[Vec<&ExternalResult>],
    pick: &dyn Fn(&ExternalResult) -> Option<f64>,
    seeds: u64,
) -> (Vec<String>, serde_json::Value) {
    let per_domain: Vec<Vec<f64>> = runs
        .iter()
        .map(|v| v.iter().filter_map(|r| pick(r)).collect())
        .collect();
    let (held, per_seed): (Vec<u64>, Vec<f64>) = (0..seeds)
        .filter_map(|seed| {
            let at: Option<Vec<f64>> = runs
                .iter()
                .map(|v| v.iter().find(|r| r.seed == seed).and_then(|r| pick(r)))
                .collect();
            at.map(|at| (seed, at.iter().sum::<f64>() / runs.len() as f64))
        })
        .unzip();
    // One seed has no spread to show: "(0.00)" would claim one.
    let cell = |v: &[f64]| match v {
        [] => "not run yet".to_string(),
        [one] => format!("{:.2} (1 seed)", 100.0 * one),
        _ => pct(mean_std(v)),
    };
    let mut cells: Vec<String> = per_domain.iter().map(|v| cell(v)).collect();
    cells.push(format!("**{}**", cell(&per_seed)));
    let seeds_per_domain: Vec<Vec<u64>> = runs
        .iter()
        .map(|v| {
            v.iter()
                .filter(|r| pick(r).is_some())
                .map(|r| r.seed)
                .collect()
        })
        .collect();
    let json = serde_json::json!({
        "per_domain_per_seed": per_domain,
        "seeds_per_domain": seeds_per_domain,
        "mean_over_domains_per_seed": per_seed,
        "seeds": held,
    });
    (cells, json)
}

/// The mean of the finite values (NaN when there is none).
/// A mean and a standard deviation as percentages: `12.34 (0.56)`.
fn pct((m, s): (f64, f64)) -> String {
    format!("{:.2} ({:.2})", 100.0 * m, 100.0 * s)
}

/// The mean of `v` (0 when empty).
fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn nan_mean(v: &[f64]) -> f64 {
    let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if finite.is_empty() {
        f64::NAN
    } else {
        finite.iter().sum::<f64>() / finite.len() as f64
    }
}

/// Writes a table as `<out>/<stem>.md` and `<out>/<stem>.json`.
fn write_table(out: &Path, stem: &str, md: &str, json: &serde_json::Value) -> Result<()> {
    write_atomic(&out.join(format!("{stem}.md")), md.as_bytes())?;
    write_atomic(
        &out.join(format!("{stem}.json")),
        &serde_json::to_vec_pretty(json)?,
    )?;
    Ok(())
}

/// The training loss the sites that trained reported and the test loss of every site, per
/// round: per site and as the mean over sites, each the mean over the seeds of `runs`; written
/// into `entry`. Gives the training loss per site and its mean over sites.
fn losses(
    rounds: usize,
    sites: usize,
    runs: &[&RunResult],
    entry: &mut serde_json::Value,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    // Losses per round: the training loss the sites that trained reported, the test loss
    // of every site; per site and as the mean over sites, each the mean over seeds.
    let train = |r: &RunResult, k: usize| -> Vec<f64> {
        r.rounds
            .iter()
            .map(|x| x.train_loss.get(k).copied().flatten().unwrap_or(f64::NAN))
            .collect()
    };
    let test = |r: &RunResult, k: usize| -> Vec<f64> {
        r.rounds
            .iter()
            .map(|x| x.test_loss.get(k).copied().unwrap_or(f64::NAN))
            .collect()
    };
    let over_seeds = |f: &dyn Fn(&RunResult, usize) -> Vec<f64>, k: usize| -> Vec<f64> {
        (0..rounds)
            .map(|i| nan_mean(&runs.iter().map(|r| f(r, k)[i]).collect::<Vec<_>>()))
            .collect()
    };
    let per_site = |f: &dyn Fn(&RunResult, usize) -> Vec<f64>| -> Vec<Vec<f64>> {
        (0..sites).map(|k| over_seeds(f, k)).collect()
    };
    let (train_sites, test_sites) = (per_site(&train), per_site(&test));
    let site_mean = |v: &[Vec<f64>]| -> Vec<f64> {
        (0..rounds)
            .map(|i| nan_mean(&v.iter().map(|s| s[i]).collect::<Vec<_>>()))
            .collect()
    };
    let train_mean = site_mean(&train_sites);
    entry["train_loss_per_round"] =
        serde_json::json!({"per_site": train_sites, "mean": train_mean});
    entry["test_loss_per_round"] =
        serde_json::json!({"per_site": test_sites, "mean": site_mean(&test_sites)});
    (train_sites, train_mean)
}

/// Writes method `name`'s per-site charts: test accuracy and training loss (`train_sites`) per
/// round, each the mean over the seeds of `runs`.
fn site_charts(
    out: &Path,
    name: &str,
    sites: &[String],
    runs: &[&RunResult],
    train_sites: &[Vec<f64>],
) -> Result<()> {
    let rounds = runs.first().map_or(0, |r| r.rounds.len());
    // Per site: accuracy and training loss, each the mean over seeds.
    let accuracy_sites: Vec<Vec<f64>> = (0..sites.len())
        .map(|k| {
            (0..rounds)
                .map(|i| {
                    mean(
                        &runs
                            .iter()
                            .map(|r| r.rounds[i].accuracy[k])
                            .collect::<Vec<_>>(),
                    )
                })
                .collect()
        })
        .collect();
    let slug: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    for (values, what, scale, file) in [
        (
            accuracy_sites.as_slice(),
            "test accuracy",
            Scale::Percent,
            format!("{slug}.svg"),
        ),
        (
            train_sites,
            "training loss",
            Scale::Plain,
            format!("{slug}-loss.svg"),
        ),
    ] {
        let lines: Vec<Series> = sites
            .iter()
            .zip(values)
            .zip(COLOURS.iter().cycle())
            .map(|((site, v), c)| Series {
                name: site.clone(),
                colour: (*c).into(),
                values: v.clone(),
                band: Vec::new(),
            })
            .collect();
        let svg = chart(&format!("{name}: {what} per site"), what, &lines, scale);
        write_atomic(&out.join("charts").join(file), svg.as_bytes())?;
    }
    Ok(())
}

/// The gain of client-specific BN per algorithm run under both policies, seed by seed (UniFed
/// Table 2's last rows), appended to `md` as a table; gives its JSON rows.
fn bn_gains(
    preset: &Preset,
    methods: &[(Algorithm, BnPolicy, Vec<&RunResult>)],
    md: &mut String,
) -> Vec<serde_json::Value> {
    // The gain of client-specific BN per algorithm, seed by seed (UniFed Table 2's last rows).
    let mut gains = Vec::new();
    md.push_str(
        "\n| algorithm | paired seeds | local - global, best on validation | local - global, \
         final |\n|---|---:|---:|---:|\n",
    );
    for a in &preset.algorithms {
        let find = |bn| methods.iter().find(|(b, p, _)| b == a && *p == bn);
        let (Some((_, _, local)), Some((_, _, global))) =
            (find(BnPolicy::Local), find(BnPolicy::Global))
        else {
            continue;
        };
        // Seed by seed, over the seeds both policies have finished.
        let pairs: Vec<(&RunResult, &RunResult)> = local
            .iter()
            .filter_map(|l| global.iter().find(|g| g.seed == l.seed).map(|g| (*l, *g)))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let diff = |pick: fn(&RunResult) -> Vec<f64>| -> Vec<f64> {
            pairs
                .iter()
                .map(|(l, g)| mean(&pick(l)) - mean(&pick(g)))
                .collect()
        };
        let (best, last) = (diff(RunResult::best_on_val), diff(RunResult::last));
        let signed = |(m, s): (f64, f64)| format!("{:+.2} ({:.2})", 100.0 * m, 100.0 * s);
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            a.label(),
            pairs.len(),
            signed(mean_std(&best)),
            signed(mean_std(&last))
        ));
        gains.push(serde_json::json!({
            "algorithm": a,
            "seeds": pairs.iter().map(|(l, _)| l.seed).collect::<Vec<_>>(),
            "best_on_val_per_seed": best,
            "final_per_seed": last,
        }));
    }
    gains
}

/// Appends method `name`'s rows to the internal table `md`, each site's test accuracy (mean
/// and std over the seeds of `runs`) with the best-on-validation and the final round, and
/// writes the same into the method's JSON `entry`.
fn accuracy_rows(
    name: &str,
    runs: &[&RunResult],
    sites: usize,
    md: &mut String,
    entry: &mut serde_json::Value,
) {
    for (key, pick) in [
        (
            "best_on_val",
            RunResult::best_on_val as fn(&RunResult) -> Vec<f64>,
        ),
        ("final", RunResult::last),
    ] {
        let per_run: Vec<Vec<f64>> = runs.iter().map(|r| pick(r)).collect();
        let mut cells = Vec::new();
        for k in 0..sites {
            cells.push(pct(mean_std(
                &per_run.iter().map(|v| v[k]).collect::<Vec<_>>(),
            )));
        }
        let means: Vec<f64> = per_run.iter().map(|v| mean(v)).collect();
        cells.push(format!("**{}**", pct(mean_std(&means))));
        md.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            key.replace('_', " "),
            runs.len(),
            cells.join(" | ")
        ));
        entry[key] = serde_json::json!({
            "per_seed_per_site": per_run,
            "mean_over_sites_per_seed": means,
        });
    }
}

/// FedCD's rounds (FedCD Fig. 3's mask): per method whose runs recorded them, the mean over
/// sites and seeds of each site's mean absolute mask value after each round, and of the norms
/// of the mask gradients and the risks the sites sent.
fn mask_rows(methods: &[(Algorithm, BnPolicy, Vec<&RunResult>)], md: &mut String) {
    type Pick = fn(&super::FedCdRound) -> Vec<f64>;
    let picks: [(&str, Pick); 3] = [
        ("mask mean abs", |r| r.mask_l1.clone()),
        ("mask gradient norm", |r| {
            r.gradient_norm.iter().flatten().copied().collect()
        }),
        ("risk R_e", |r| r.risk.iter().flatten().copied().collect()),
    ];
    let traced: Vec<_> = methods
        .iter()
        .filter(|(_, _, runs)| !runs.is_empty() && runs.iter().all(|r| !r.fedcd.is_empty()))
        .collect();
    let Some(rounds) = traced
        .iter()
        .map(|(_, _, runs)| runs.iter().map(|r| r.fedcd.len()).min().unwrap_or(0))
        .max()
    else {
        return;
    };
    md.push_str(
        "\n## FedCD's rounds\n\nPer round, mean over sites and seeds: each site's mean \
         absolute mask value after the round (its L1 norm over its width; 1 at the start), the L2 \
         norm of the mask gradient it sent and its risk.\n\n| method | value |",
    );
    md.push_str(&(1..=rounds).map(|r| format!(" r{r} |")).collect::<String>());
    md.push_str(&format!("\n|---|---|{}\n", "---:|".repeat(rounds)));
    for (a, bn, runs) in traced {
        for (what, pick) in picks {
            md.push_str(&format!("| {} | {what} |", method_name(a, *bn)));
            for i in 0..rounds {
                let v: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| r.fedcd.get(i))
                    .flat_map(pick)
                    .collect();
                md.push_str(&format!(" {:.4} |", mean(&v)));
            }
            md.push('\n');
        }
    }
}

/// FedImpro's head gradient dissimilarity (Theorem 4.2): per method whose runs measured it, at
/// each measured model version, the mean over seeds of the dissimilarity with the real
/// cross-entropy alone and with FedImpro's objective, and their ratio (the theorem's bound with
/// one synthetic feature per real sample is a quarter).
fn dissimilarity_rows(methods: &[(Algorithm, BnPolicy, Vec<&RunResult>)], md: &mut String) {
    let traced: Vec<_> = methods
        .iter()
        .filter(|(_, _, runs)| !runs.is_empty() && runs.iter().all(|r| !r.fedimpro.is_empty()))
        .collect();
    if traced.is_empty() {
        return;
    }
    md.push_str(
        "\n## FedImpro's head gradient dissimilarity\n\nAcross sites, `(1/M) sum_m ||g_m - \
         mean||^2` of the head's gradient at the model each site evaluates (128 of its training \
         images), of the real cross-entropy alone and of FedImpro's objective (one synthetic \
         feature per real sample from the federation's Gaussians); mean over seeds. Theorem 4.2 \
         bounds the ratio by a quarter when every site draws from one shared distribution; here \
         each site draws for its own labels.\n\n| method | round | sites | real alone | with \
         synthetic | ratio |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for (a, bn, runs) in traced {
        let rounds: std::collections::BTreeSet<u64> = runs
            .iter()
            .flat_map(|r| r.fedimpro.iter().map(|f| f.round))
            .collect();
        for round in rounds {
            let at: Vec<&super::FedImproRound> = runs
                .iter()
                .filter_map(|r| r.fedimpro.iter().find(|f| f.round == round))
                .collect();
            let real = mean(&at.iter().map(|f| f.real).collect::<Vec<_>>());
            let mixed = mean(&at.iter().map(|f| f.mixed).collect::<Vec<_>>());
            let sites = at.iter().map(|f| f.sites).max().unwrap_or(0);
            let ratio = match real > 0.0 {
                true => format!("{:.3}", mixed / real),
                false => "-".into(),
            };
            md.push_str(&format!(
                "| {} | {round} | {sites} | {real:.3e} | {mixed:.3e} | {ratio} |\n",
                method_name(a, *bn),
            ));
        }
    }
}
