//! The demo's results: the per-site table of every run side by side, `federation.json` and the
//! convergence chart `federation.svg`.

use crate::run::{Options, RoundTimeline, RunResult};
use anyhow::{Context, Result};
use serde::Serialize;
use unifed_agent::progress::Phase;
use unifed_sim::chart::{Series, line_chart};

#[derive(Serialize)]
struct Results<'a> {
    command: String,
    rounds: u64,
    train_samples: usize,
    epochs: usize,
    encoding: &'a str,
    seed: u64,
    cores: usize,
    runs: &'a [RunResult],
}

fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
}

/// The mean of `f` over a run's rounds after the first (all of them for a one-round run).
fn steady(r: &RunResult, f: impl Fn(&RoundTimeline) -> f64) -> f64 {
    let skip = usize::from(r.timeline.len() > 1);
    mean(r.timeline.iter().skip(skip).map(f))
}

/// Mean bytes one site sends per round.
pub fn upload_per_site_round(r: &RunResult) -> f64 {
    mean(
        r.sites
            .iter()
            .flat_map(|s| s.upload_bytes.iter().map(|&b| b as f64)),
    )
}

/// Mean bytes of a model one site fetches (the versions after the initial one).
pub fn download_per_site_round(r: &RunResult) -> f64 {
    mean(
        r.sites
            .iter()
            .flat_map(|s| s.download_bytes.iter().skip(1).map(|&b| b as f64)),
    )
}

/// Prints the table and writes the JSON and the chart.
pub fn finish(opts: &Options, runs: &[RunResult]) -> Result<()> {
    if runs.is_empty() {
        return Ok(());
    }
    let mut table = String::new();
    let head: Vec<String> = runs.iter().map(|r| format!("{:>12}", r.name)).collect();
    table += &format!("\n{:<26}{}\n", "test accuracy (%)", head.join(""));
    for (k, s) in runs[0].sites.iter().enumerate() {
        let cells: Vec<String> = runs
            .iter()
            .map(|r| format!("{:>12.2}", 100.0 * r.sites[k].final_accuracy))
            .collect();
        table += &format!("{:<26}{}\n", s.site, cells.join(""));
    }
    let row = |label: &str, f: &dyn Fn(&RunResult) -> String| {
        let cells: Vec<String> = runs.iter().map(|r| format!("{:>12}", f(r))).collect();
        format!("{label:<26}{}\n", cells.join(""))
    };
    table += &row("mean", &|r| {
        format!(
            "{:.2}",
            100.0 * mean(r.sites.iter().map(|s| s.final_accuracy))
        )
    });
    table += &row("MB sent /site/round", &|r| {
        format!("{:.2}", upload_per_site_round(r) / 1e6)
    });
    table += &row("MB fetched /site/round", &|r| {
        format!("{:.2}", download_per_site_round(r) / 1e6)
    });
    table += &row("seconds/round", &|r| {
        format!("{:.1}", mean(r.round_seconds.iter().copied()))
    });
    table += &row("peak RSS, all processes", &|r| mib(r.peak_rss_total_bytes));
    table += &row("peak RSS, aggregator", &|r| {
        mib(r.peak_rss_bytes.get("aggregator").copied().unwrap_or(0))
    });
    table += &row("peak RSS, largest agent", &|r| {
        mib(r
            .peak_rss_bytes
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "aggregator" | "broker" | "demo"))
            .map(|(_, v)| *v)
            .max()
            .unwrap_or(0))
    });
    table += &row("peak RSS, broker", &|r| {
        mib(r.peak_rss_bytes.get("broker").copied().unwrap_or(0))
    });
    table += &row("wall seconds", &|r| format!("{:.0}", r.wall_seconds));
    // Where a round's time goes (rounds after the first, whose time includes the start-up):
    // per site for the sites' phases, per round for the aggregator's.
    table += &format!("\n{:<26}\n", "seconds per round (2..R)");
    for p in Phase::ALL {
        let aggregator = matches!(p, Phase::Spool | Phase::Fold | Phase::Publish);
        table += &row(
            &format!(
                "  {}{}",
                p.name(),
                if aggregator { " (aggregator)" } else { "" }
            ),
            &|r| {
                format!(
                    "{:.3}",
                    steady(r, |t| t.phases.get(&p).map_or(0.0, |s| if aggregator {
                        s.total
                    } else {
                        s.mean()
                    }))
                )
            },
        );
    }
    table += &row("  slowest site's training", &|r| {
        format!("{:.3}", steady(r, |t| t.training_seconds))
    });
    table += &row("  no phase running", &|r| {
        format!("{:.3}", steady(r, |t| t.idle_seconds))
    });
    table += &row("  overhead share", &|r| {
        format!("{:.1}%", 100.0 * steady(r, |t| t.overhead_share))
    });
    table += &row("  ... without evaluation", &|r| {
        format!(
            "{:.1}%",
            100.0 * steady(r, |t| t.overhead_share_without_evaluation)
        )
    });
    // Which phase sets each process's peak: the highest peak a process reported for the phase,
    // over the whole run, the final model's phases included (the largest agent for the sites'
    // phases, the aggregator for its own).
    table += &format!("\n{:<26}\n", "peak RSS by phase");
    for p in Phase::ALL {
        table += &row(&format!("  {}", p.name()), &|r| match r
            .phase_peak_bytes
            .get(&p)
            .copied()
            .unwrap_or(0)
        {
            0 => "-".into(),
            peak => mib(peak),
        });
    }
    // CPU seconds per round of each kind of process: with more processes than cores, the round
    // is as long as all of it over the cores.
    table += &format!("\n{:<26}\n", "CPU seconds per round");
    // The mean over steady rounds of the CPU of the processes `pick` names.
    let cpu = |r: &RunResult, pick: &dyn Fn(&str) -> bool| {
        let s = steady(r, |t| {
            t.cpu_seconds
                .iter()
                .filter(|(k, _)| pick(k))
                .map(|(_, v)| v)
                .sum()
        });
        format!("{s:.2}")
    };
    table += &row("  agents (all)", &|r| {
        cpu(r, &|k| r.sites.iter().any(|s| s.site == k))
    });
    for who in ["broker", "aggregator", "demo"] {
        table += &row(&format!("  {who}"), &|r| cpu(r, &|k| k == who));
    }
    table += &row("  all processes", &|r| {
        format!("{:.2}", steady(r, |t| t.cpu_total))
    });
    println!("{table}");

    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    let json = opts.out.join("federation.json");
    let results = Results {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        rounds: opts.rounds,
        train_samples: opts.train_samples,
        epochs: opts.epochs,
        encoding: &opts.encoding,
        seed: opts.seed,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        runs,
    };
    std::fs::write(&json, serde_json::to_vec_pretty(&results)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let series: Vec<Series> = runs
        .iter()
        .zip(colours.iter().cycle())
        .map(|(r, c)| Series {
            name: format!("{} (mean of {} sites)", r.name, r.sites.len()),
            colour: c.to_string(),
            // Rounds 1..=R: the accuracy after each round's model (index 0 is the initial one).
            values: (1..=r.rounds as usize)
                .map(|v| mean(r.sites.iter().filter_map(|s| s.accuracy.get(v).copied())))
                .collect(),
            band: Vec::new(),
        })
        .collect();
    let svg = opts.out.join("federation.svg");
    std::fs::write(
        &svg,
        line_chart(
            "Federation over MQTT: mean site test accuracy per round",
            "test accuracy",
            &series,
        ),
    )
    .with_context(|| format!("writing {}", svg.display()))?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(())
}
