//! `unifed-demo`: the main job. A complete federation on the embedded broker with the built-in
//! data: the broker, the aggregator and one agent per built-in training domain, each a process
//! of its own (this binary re-run in a role), once with `local` BN (FedBN) and once with
//! `global` BN (FedAvg). It shows progress, prints a per-site accuracy table of both runs with
//! bytes, seconds per round and peak memory, and writes `results/federation.json` and a
//! convergence chart `results/federation.svg`.

mod hostile;
mod onboard;
mod report;
mod run;
mod supervise;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "unifed-demo",
    version,
    about = "UniFed Edge: a complete federation (FedBN, then FedAvg) on an embedded broker with the built-in data"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Command>,
    #[command(flatten)]
    opts: run::Options,
}

#[derive(Subcommand)]
enum Command {
    /// Internal: run one process of the demo (broker, aggregator or agent).
    #[command(hide = true)]
    Role {
        #[command(subcommand)]
        role: Process,
    },
    /// Evaluates the never-seen domains again from a finished demo's work folder (both runs),
    /// and with --sweep the full stream grid (results/onboarding.json); then each training
    /// domain as a late joiner with fresh or calibrated BN (results/late-joiner.json).
    Onboarding {
        #[command(flatten)]
        opts: run::Options,
        /// Also sweep stream's tau {0, 0.5, 0.9} x batch {2, 8, 32, 128, 512} x 3 orders.
        #[arg(long)]
        sweep: bool,
    },
    /// The hostile-site benchmark: each BN policy's federation run clean, then again with the
    /// same keys while an enrolled site and a stranger with a broker login attack it all run
    /// long; the honest sites' final accuracies compared (results/hostile.json).
    Hostile {
        #[command(flatten)]
        opts: run::Options,
        #[command(flatten)]
        args: hostile::Args,
    },
}

#[derive(Subcommand)]
enum Process {
    /// The embedded broker.
    Broker(unifed_broker::BrokerArgs),
    /// The aggregator service.
    Aggregator {
        #[arg(long)]
        config: PathBuf,
    },
    /// A site's agent.
    Agent {
        #[arg(long)]
        config: PathBuf,
    },
}

/// Large blocks in transparent huge pages (see `unifed_net::memory::HugeBlocks`).
#[global_allocator]
static ALLOCATOR: unifed_net::memory::HugeBlocks = unifed_net::memory::HugeBlocks;

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.role {
        Some(Command::Role {
            role: Process::Broker(args),
        }) => {
            unifed_net::init_logging(unifed_broker::LOG_FILTER);
            unifed_broker::run(&args)
        }
        Some(Command::Role {
            role: Process::Aggregator { config },
        }) => {
            // As the aggregator binary: one malloc arena (see unifed_net::memory).
            unifed_net::memory::use_one_arena();
            unifed_net::init_logging("warn");
            unifed_aggregator::service::serve_from_file(&config).map(|_| ())
        }
        Some(Command::Role {
            role: Process::Agent { config },
        }) => {
            // As the agent binary: one malloc arena (see unifed_net::memory).
            unifed_net::memory::use_one_arena();
            unifed_net::init_logging("warn");
            unifed_agent::train::run_from_file(&config, false, unifed_agent::train::Mode::Once)
                .map(|_| ())
        }
        Some(Command::Onboarding { opts, sweep }) => {
            let fedbn = fedbn_run(&opts)?;
            never_seen(&opts, &fedbn, sweep)?;
            let rows = onboard::late_joiners(&fedbn, opts.train_samples, |s| println!("{s}"))?;
            let path = opts.out.join("late-joiner.json");
            std::fs::write(&path, serde_json::to_vec_pretty(&rows)?)?;
            println!("wrote {}", path.display());
            Ok(())
        }
        Some(Command::Hostile { opts, args }) => hostile::benchmark(&opts, &args).map(|_| ()),
        None => {
            let opts = cli.opts;
            let mut runs = Vec::new();
            for p in &opts.policies {
                runs.push(run::federation(&opts, run::bn_policy(p)?)?);
            }
            report::finish(&opts, &runs)?;
            if runs.len() == 2 && runs[0].bn_policy != runs[1].bn_policy {
                never_seen(&opts, &fedbn_run(&opts)?, false)?;
            }
            Ok(())
        }
    }
}

/// The finished FedBN run in the work folder, its sites named as the options name them.
fn fedbn_run(opts: &run::Options) -> Result<onboard::FedBnRun> {
    let sites: Vec<String> = run::sites(opts)?.into_iter().map(|(id, _)| id).collect();
    onboard::FedBnRun::load(&opts.work, &sites)
}

/// The never-seen domains' table from the runs in the work folder, printed and written.
fn never_seen(opts: &run::Options, fedbn: &onboard::FedBnRun, sweep: bool) -> Result<()> {
    let rows = onboard::table(fedbn, sweep, |s| println!("{s}"))?;
    println!("{}", onboard::render(&rows));
    std::fs::create_dir_all(&opts.out)?;
    let path = opts.out.join("onboarding.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&rows)?)?;
    println!("wrote {}", path.display());
    Ok(())
}
