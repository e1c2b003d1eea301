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
    /// Puts the federation's state aside (`<data_dir>/runs/<run>/`) so the next `serve` starts
    /// a new run from the initial model; sites put their state of the old run aside when they
    /// hear of the new one. Refused while the service runs. (To go on from a finished
    /// federation instead, raise `rounds` in the config and `serve` again.)
    NewRun {
        /// Service config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Approves a site's enrolment request (`unifed-agent enrol`): checks its signatures and
    /// federation (and `--fingerprint`, read out by the site over another channel), then adds
    /// the site to `[federation] sites` in the config, or for a rotation replaces its key and
    /// revokes the old one. Restart the aggregator to admit a new key.
    Approve {
        /// Service config (TOML), edited in place (comments kept).
        #[arg(long)]
        config: PathBuf,
        /// The site's request (JSON).
        #[arg(long)]
        request: PathBuf,
        /// The key fingerprint the site read out; the request must match it.
        #[arg(long)]
        fingerprint: Option<String>,
    },
    /// Revokes a site's key (`[federation] revoked`): a running aggregator refuses it from its
    /// next look at the config, within a second.
    Revoke {
        /// Service config (TOML), edited in place (comments kept).
        #[arg(long)]
        config: PathBuf,
        /// The site whose key is revoked.
        #[arg(long)]
        site: String,
    },
    /// The service's config file: a commented example, or a check of one.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Writes a Mosquitto config for the federation of `--config` with mutual TLS and a
    /// per-site ACL (`mosquitto.conf` and `acl` in `--out`): clients are known by their
    /// certificate's common name (the site id, or `aggregator`).
    MosquittoConfig {
        /// Service config (TOML) of the federation.
        #[arg(long)]
        config: PathBuf,
        /// CA (PEM) that signs every client certificate.
        #[arg(long)]
        ca: PathBuf,
        /// The broker's certificate (PEM).
        #[arg(long)]
        cert: PathBuf,
        /// The broker's private key (PEM).
        #[arg(long)]
        key: PathBuf,
        /// Address and port to listen on.
        #[arg(long, default_value = "0.0.0.0:8883")]
        listen: std::net::SocketAddr,
        /// Folder to write `mosquitto.conf` and `acl` into.
        #[arg(long)]
        out: PathBuf,
    },
    /// Makes the aggregator's ed25519 key at `--key` if there is none (never overwriting one)
    /// and prints its public key and fingerprint, for the sites to pin.
    Identity {
        /// The private key file (created owner-readable only).
        #[arg(long)]
        key: PathBuf,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Writes the commented example config (relative paths are relative to the file).
    Init {
        /// The file to write (never overwritten).
        #[arg(long)]
        out: PathBuf,
    },
    /// Names every unknown key, wrong type, missing field, invalid federation setting and
    /// missing file of a config with its line and column; exits 2 when there is any.
    Check {
        /// Service config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
}

/// Large blocks in transparent huge pages (see `unifed_net::memory::HugeBlocks`).
#[global_allocator]
static ALLOCATOR: unifed_net::memory::HugeBlocks = unifed_net::memory::HugeBlocks;

fn main() -> Result<()> {
    // One malloc arena for all threads: a smaller, steadier peak (see unifed_net::memory).
    unifed_net::memory::use_one_arena();
    unifed_net::init_logging("warn");
    match Cli::parse().cmd {
        Cmd::Serve { config } => {
            let v = serve_from_file(&config)?;
            println!("final model version {v}");
            Ok(())
        }
        Cmd::Approve {
            config,
            request,
            fingerprint,
        } => approve_cmd(&config, &request, fingerprint.as_deref()),
        Cmd::Revoke { config, site } => {
            let text = std::fs::read_to_string(&config)?;
            let (text, key) = unifed_aggregator::enrol::revoke(&text, &site)?;
            replace_file(&config, &text)?;
            unifed_net::service::print_out(format_args!(
                "revoked {site}'s key {} in {}",
                key.fingerprint(),
                config.display()
            ))?;
            Ok(())
        }
        Cmd::Config(cmd) => config_cmd(cmd),
        Cmd::NewRun { config } => new_run_cmd(&config),
        Cmd::MosquittoConfig {
            config,
            ca,
            cert,
            key,
            listen,
            out,
        } => {
            let cfg = unifed_aggregator::service::read_config(&config)?;
            let fed = unifed_protocol::Id::new(&cfg.federation.federation)
                .map_err(|e| anyhow::anyhow!("federation: {e}"))?;
            std::fs::create_dir_all(&out)?;
            let abs = |p: &PathBuf| {
                std::fs::canonicalize(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
            };
            let (ca, cert, key) = (abs(&ca)?, abs(&cert)?, abs(&key)?);
            let acl_file = abs(&out)?.join("acl");
            let host = listen.ip().to_string();
            let listener = unifed_aggregator::mosquitto::Listener {
                host: &host,
                port: listen.port(),
                ca: &ca,
                cert: &cert,
                key: &key,
            };
            let sites: Vec<String> = cfg.federation.sites.iter().map(|s| s.id.clone()).collect();
            std::fs::write(&acl_file, unifed_aggregator::mosquitto::acl(&fed, &sites))?;
            let conf = out.join("mosquitto.conf");
            std::fs::write(
                &conf,
                unifed_aggregator::mosquitto::conf(
                    &listener,
                    &acl_file,
                    cfg.broker.max_packet_bytes,
                ),
            )?;
            println!("wrote {} and {}", conf.display(), acl_file.display());
            Ok(())
        }
        Cmd::Identity { key } => {
            let k = unifed_protocol::SigningKey::load_or_create(&key)?;
            // `identity --key K | head -1` is how scripts take the public key: a pipe closed
            // after the first line ends the command quietly.
            unifed_net::service::print_out(format_args!(
                "{}\nfingerprint {}",
                k.public(),
                k.public().fingerprint()
            ))?;
            Ok(())
        }
    }
}

/// `approve`: the request checked and the config edited.
fn approve_cmd(
    config: &std::path::Path,
    request: &std::path::Path,
    fingerprint: Option<&str>,
) -> Result<()> {
    use anyhow::Context;
    use unifed_aggregator::enrol::Approved;
    let req: unifed_protocol::enrolment::EnrolmentRequest = serde_json::from_slice(
        &std::fs::read(request).with_context(|| format!("reading {}", request.display()))?,
    )
    .with_context(|| format!("{} is not an enrolment request", request.display()))?;
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let (text, what) = unifed_aggregator::enrol::approve(&text, &req, fingerprint)
        .with_context(|| format!("{}: not approved", request.display()))?;
    replace_file(config, &text)?;
    let said = match what {
        Approved::Enrolled => format!("enrolled `{}`", req.site),
        Approved::Rotated { old } => format!(
            "rotated `{}`'s key (the old one, {}, is revoked)",
            req.site,
            old.fingerprint()
        ),
        Approved::AlreadyEnrolled => format!("`{}` is enrolled with this key already", req.site),
    };
    unifed_net::service::print_out(format_args!(
        "{said}: key {} in {}; restart the aggregator to admit it",
        req.key.fingerprint(),
        config.display()
    ))?;
    Ok(())
}

/// Replaces `path` with `text` atomically, keeping its permissions.
fn replace_file(path: &std::path::Path, text: &str) -> Result<()> {
    use anyhow::Context;
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    if let Ok(m) = std::fs::metadata(path) {
        std::fs::set_permissions(&tmp, m.permissions())?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

/// `config init` and `config check`.
fn config_cmd(cmd: ConfigCmd) -> Result<()> {
    use unifed_net::config_check::{init_file, report};
    match cmd {
        ConfigCmd::Init { out } => {
            let next = format!(
                "enrol the sites, then `unifed-aggregator config check --config {}`",
                out.display()
            );
            let text = unifed_aggregator::service::example_config();
            Ok(init_file(&out, &text, &next)?)
        }
        ConfigCmd::Check { config } => {
            let code = report(&config, &unifed_aggregator::service::check_config(&config))?;
            std::process::exit(code);
        }
    }
}

/// `new-run`: the federation's state put aside.
fn new_run_cmd(config: &std::path::Path) -> Result<()> {
    let cfg = unifed_aggregator::service::read_config(config)?;
    match unifed_aggregator::service::new_run(&cfg)? {
        Some(to) => unifed_net::service::print_out(format_args!(
            "the federation's state is now in {}; the next `serve` starts a new run",
            to.display()
        ))?,
        None => unifed_net::service::print_out(format_args!(
            "{} holds no federation; the next `serve` starts one",
            cfg.data_dir.display()
        ))?,
    }
    Ok(())
}
