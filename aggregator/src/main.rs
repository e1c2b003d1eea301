//! `unifed-aggregator`: the federation service.

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use unifed_aggregator::service::serve_from_file;

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
    /// Makes the aggregator's ed25519 key at `--key` if there is none (never overwriting one)
    /// and prints its public key and fingerprint, for the sites to pin.
    Identity {
        /// The private key file (created owner-readable only).
        #[arg(long)]
        key: PathBuf,
    },
}

fn main() -> Result<()> {
    unifed_net::init_logging("warn");
    match Cli::parse().cmd {
        Cmd::Serve { config } => {
            let v = serve_from_file(&config)?;
            println!("final model version {v}");
            Ok(())
        }
        Cmd::Identity { key } => {
            let k = unifed_protocol::SigningKey::load_or_create(&key)?;
            println!("{}\nfingerprint {}", k.public(), k.public().fingerprint());
            Ok(())
        }
    }
}
