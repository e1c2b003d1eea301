//! `unifed-aggregator`: the federation service.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use unifed_aggregator::service::{ServiceConfig, serve};

#[derive(Parser)]
#[command(name = "unifed-aggregator", version, about = "UniFed Edge aggregator")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the federation described by a config file over MQTT.
    Serve {
        /// Service config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    unifed_net::init_logging("warn");
    match Cli::parse().cmd {
        Cmd::Serve { config } => {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let cfg: ServiceConfig =
                toml::from_str(&text).with_context(|| format!("parsing {}", config.display()))?;
            cfg.federation
                .validate()
                .map_err(|e| anyhow::anyhow!("{}: {}", config.display(), e.join("; ")))?;
            let v = serve(cfg, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
            println!("final model version {v}");
            Ok(())
        }
    }
}
