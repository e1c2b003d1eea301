//! `unifed-agent`: the on-device trainer of UniFed Edge.
//!
//! `train` runs a site of a federation over MQTT, `run` a site as a service across federations; `init` writes a federation's initial model;
//! `singleset` trains the built-in domains alone (the no-federation baseline); `data` previews
//! and exports the built-in data; `spec` prints a model spec; `bench` measures speed.
//! `warmup` tunes a GPU's kernels for a site at install time.
//! `calibrate` onboards a site (from a model file, or from the federation's onboarding
//! package with `--config`), `fetch-calibrated` brings its registered model to another device,
//! `keygen` makes the site's registry sealing key, `identity` its signing key, and `evaluate` and `predict` use a model.

mod bench;
mod onboard;
mod onboard_net;
mod singleset;

use unifed_agent::{model, train};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use unifed_models::backend::{Backend, cap_cpu_threads};
use unifed_models::data::{
    BaseDigits, BuiltinData, Domain, SplitSizes, preview_grid, read_idx_digits,
};

#[derive(Parser)]
#[command(
    name = "unifed-agent",
    version,
    about = "UniFed Edge on-device trainer"
)]
struct Cli {
    /// Compute backend: flex (CPU), wgpu, vulkan or cuda (if compiled in).
    #[arg(long, global = true, default_value = "flex")]
    backend: String,
    /// Cap on CPU worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Folder where a GPU backend keeps its autotune results and compiled kernels (default:
    /// `train` and `warmup` use `<state_dir>/kernels`, other commands the user cache folder).
    #[arg(long, global = true)]
    kernel_cache: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// SingleSet (each training domain trained alone, no federation) on the built-in data;
    /// prints a per-domain accuracy table and writes results/singleset.json.
    Singleset(singleset::Args),
    /// Built-in dataset tools.
    #[command(subcommand)]
    Data(DataCmd),
    /// Prints the model spec (every tensor, its kind, classes, input) as JSON.
    Spec {
        /// Model architecture: digits, mlp or resnet18.
        #[arg(long, default_value = "digits")]
        arch: String,
    },
    /// Trains as a site of a federation over MQTT (config file: broker, site, data, model).
    Train {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Runs the site as a service: it trains every federation its aggregator runs, holds the
    /// final model between them, joins each later run as a new site (the earlier run's state
    /// put aside in `<state_dir>/runs/`), and stops only when asked (SIGTERM, SIGINT, SIGHUP).
    Run {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Resets the site to a new one: its checkpoint, model and progress move to
    /// `<state_dir>/runs/<run>/`, and its next start joins the federation afresh (its key and
    /// config stay). Refused while the agent runs.
    Reset {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Makes the site's enrolment request for its coordinator (`unifed-aggregator approve`):
    /// the identity key of the config (made here if there is none; it never leaves this
    /// machine) signs a request naming the site and federation; read its fingerprint out to the
    /// coordinator over another channel. With `--rotate`, a new key replaces the current one
    /// (kept as `<identity>.old` until the rotation is approved) and the request is signed by
    /// both.
    Enrol {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Where to write the request (default `<site>-enrolment.json`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace the enrolled key with a new one.
        #[arg(long)]
        rotate: bool,
    },
    /// Checks the site: its config file, identity key, backend, model spec, images, state
    /// folder, disk headroom and broker, one line per check. Exits 0 when all pass, else with
    /// the code of the first failure's class: 2 config, 3 keys, 4 model, 5 backend, 6 data,
    /// 7 state folder, 8 disk, 9 broker.
    Doctor {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// The agent's config file: a commented example, or a check of one.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Runs the site's local training and evaluation on a throwaway copy of its model, so a
    /// GPU backend tunes its kernels into `<state_dir>/kernels` (run it once at install time);
    /// prints the seconds of each pass as JSON. The site's checkpoint is not touched.
    Warmup {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Passes (the first tunes, the next show the tuned speed).
        #[arg(long, default_value_t = 2)]
        passes: usize,
    },
    /// Writes a freshly initialised model (seeded) as a PyTorch-compatible safetensors file,
    /// and its spec beside it (`<out>.spec.json`): the initial global model of a federation.
    Init {
        /// Model architecture: digits, mlp or resnet18.
        #[arg(long, default_value = "digits")]
        arch: String,
        #[command(flatten)]
        options: model::InitOptions,
        /// Initialisation seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Re-estimates every BN layer's statistics of a model on the site's own unlabelled images
    /// and writes the calibrated model; with labels, reports accuracy before and after.
    Calibrate(onboard::CalibrateArgs),
    /// Fetches this site's calibrated model from the aggregator's registry (another device of
    /// the site: same site, federation and site key) and writes it.
    FetchCalibrated(onboard::FetchArgs),
    /// Writes a new random site key (64 hex digits, owner-only) for sealing registry entries.
    Keygen {
        /// Key file to create (never overwritten).
        #[arg(long)]
        out: PathBuf,
    },
    /// Makes the site's ed25519 identity key at `--key` if there is none (never overwriting
    /// one) and prints its public key and fingerprint: what the coordinator enrols.
    Identity {
        /// The private key file (created owner-readable only).
        #[arg(long)]
        key: PathBuf,
    },
    /// Test accuracy of a model on labelled images, with BN statistics stored, re-estimated as
    /// the images stream in (`stream`), or freshly calibrated.
    Evaluate(onboard::EvaluateArgs),
    /// Classifies a folder of images with a model (BN stored, stream or calibrate); prints
    /// `file,class,probability` lines.
    Predict(onboard::PredictArgs),
    /// Training and inference samples/s of the digits CNN per compiled backend, peak RSS, and
    /// PyTorch's figures on the same threads when a Python with torch is found.
    Bench(bench::Args),
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Writes the commented example config (relative paths are relative to the file).
    Init {
        /// The file to write (never overwritten).
        #[arg(long)]
        out: PathBuf,
    },
    /// Names every unknown key, wrong type, missing field and missing file of a config with
    /// its line and column; exits 2 when there is any.
    Check {
        /// Agent config (TOML).
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum DataCmd {
    /// Writes a PNG grid with sample test images of every domain.
    Preview {
        /// Output PNG.
        #[arg(long, default_value = "results/domains.png")]
        out: PathBuf,
        /// Generation seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Renders a domain from a base digit set (IDX files or a `digit/image` folder) into a
    /// `digit/image.png` folder.
    Export {
        /// Domain name.
        #[arg(long)]
        domain: String,
        /// Base images IDX file (with --base-labels).
        #[arg(long)]
        base_images: Option<PathBuf>,
        /// Base labels IDX file.
        #[arg(long)]
        base_labels: Option<PathBuf>,
        /// Base folder `digit/image` (instead of IDX).
        #[arg(long)]
        base_folder: Option<PathBuf>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Generation seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

/// Large blocks in transparent huge pages (see `unifed_net::memory::HugeBlocks`).
#[global_allocator]
static ALLOCATOR: unifed_net::memory::HugeBlocks = unifed_net::memory::HugeBlocks;

fn main() -> Result<()> {
    // One malloc arena for all threads: a smaller, steadier peak (see unifed_net::memory).
    unifed_net::memory::use_one_arena();
    unifed_net::init_logging("warn");
    // Training's allocation pattern from the first step (a federation run goes lean between
    // its phases).
    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Fast);
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        cap_cpu_threads(t).map_err(anyhow::Error::msg)?;
    }
    let backend: Backend = cli.backend.parse().map_err(anyhow::Error::msg)?;
    if let Some(dir) = &cli.kernel_cache {
        unifed_models::backend::use_kernel_cache(dir).map_err(anyhow::Error::msg)?;
    }
    match cli.cmd {
        Cmd::Singleset(args) => singleset::run(backend, &args),
        Cmd::Calibrate(args) => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            onboard_net::calibrate_cmd(&args, &device)
        }
        Cmd::FetchCalibrated(args) => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            onboard_net::fetch_calibrated_cmd(&args, &device)
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
        Cmd::Keygen { out } => {
            unifed_agent::registry::SiteKey::generate().save(&out)?;
            println!(
                "wrote a new site key to {}; copy it to this site's devices only",
                out.display()
            );
            Ok(())
        }
        Cmd::Predict(args) => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            onboard::predict_cmd(&args, &device)
        }
        Cmd::Evaluate(args) => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            onboard::evaluate_cmd(&args, &device).map(|_| ())
        }
        Cmd::Bench(args) => bench::run(&args),
        Cmd::Spec { arch } => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            let spec = model::spec_for(&arch, &device)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "hash": spec.hash().to_string(),
                    "non_bn_params": spec.non_bn_params(),
                    "spec": spec,
                }))?
            );
            Ok(())
        }
        Cmd::Train { config } => {
            // `--threads`, applied above, overrides the config's cap.
            train::run_from_file(&config, cli.threads.is_some(), train::Mode::Once)?;
            Ok(())
        }
        Cmd::Doctor { config } => doctor_cmd(&config),
        Cmd::Reset { config } => reset_cmd(&config),
        Cmd::Enrol {
            config,
            out,
            rotate,
        } => enrol_cmd(&config, out, rotate),
        Cmd::Config(cmd) => config_cmd(cmd),
        Cmd::Run { config } => {
            train::run_from_file(&config, cli.threads.is_some(), train::Mode::Service)?;
            Ok(())
        }
        Cmd::Warmup { config, passes } => {
            let w = unifed_agent::warmup::run(&config, passes)?;
            println!("{}", serde_json::to_string(&w)?);
            Ok(())
        }
        Cmd::Init {
            arch,
            options,
            seed,
            out,
        } => {
            let device = backend.device().map_err(anyhow::Error::msg)?;
            let spec = model::write_initial(&arch, &options, seed, &device, &out)?;
            println!(
                "wrote {} ({} tensors, spec {})",
                out.display(),
                spec.tensors.len(),
                spec.hash()
            );
            Ok(())
        }
        Cmd::Data(DataCmd::Preview { out, seed }) => data_preview(&out, seed),
        Cmd::Data(DataCmd::Export {
            domain,
            base_images,
            base_labels,
            base_folder,
            out,
            seed,
        }) => data_export(&domain, (base_images, base_labels, base_folder), &out, seed),
    }
}

/// `enrol`: the site's key (made, or rotated) and its signed request, written to `out`.
fn enrol_cmd(config: &std::path::Path, out: Option<PathBuf>, rotate: bool) -> Result<()> {
    use unifed_protocol::SigningKey;
    let cfg = unifed_agent::train::load_config(config)?;
    let path = unifed_protocol::auth::credential_path(&cfg.identity)?;
    let (key, previous) = if rotate {
        let old = SigningKey::load(&path).context("the key to rotate")?;
        let kept = path.with_extension("key.old");
        if kept.exists() {
            bail!(
                "{} exists: a rotation is waiting for approval (or finish the last one by removing it)",
                kept.display()
            );
        }
        std::fs::rename(&path, &kept)
            .with_context(|| format!("keeping the old key as {}", kept.display()))?;
        (SigningKey::create(&path)?, Some(old))
    } else {
        (SigningKey::load_or_create(&path)?, None)
    };
    let req = unifed_protocol::enrolment::EnrolmentRequest::new(
        &cfg.federation,
        &cfg.site,
        &key,
        previous.as_ref(),
    );
    let out = out.unwrap_or_else(|| PathBuf::from(format!("{}-enrolment.json", cfg.site)));
    std::fs::write(&out, serde_json::to_vec_pretty(&req)?)
        .with_context(|| format!("writing {}", out.display()))?;
    unifed_net::service::print_out(format_args!(
        "wrote {}: give it to the coordinator (`unifed-aggregator approve --request`) and read \
         out this key's fingerprint {} to them over another channel",
        out.display(),
        key.public().fingerprint()
    ))?;
    Ok(())
}

/// `doctor`: one line per check, and the first failure's class as the exit code.
fn doctor_cmd(config: &std::path::Path) -> Result<()> {
    let checks = unifed_agent::doctor::doctor(config);
    let text: Vec<String> = checks.iter().map(|c| c.to_string()).collect();
    unifed_net::service::print_out(text.join("\n"))?;
    std::process::exit(unifed_agent::doctor::exit_code(&checks));
}

/// `config init` and `config check`.
fn config_cmd(cmd: ConfigCmd) -> Result<()> {
    use unifed_net::config_check::{init_file, report};
    match cmd {
        ConfigCmd::Init { out } => {
            let next = format!(
                "set site, federation, aggregator_key and [data], then `unifed-agent config check --config {}`",
                out.display()
            );
            Ok(init_file(
                &out,
                &unifed_agent::doctor::example_config(),
                &next,
            )?)
        }
        ConfigCmd::Check { config } => {
            let code = report(&config, &unifed_agent::doctor::check_config(&config))?;
            std::process::exit(code);
        }
    }
}

/// `reset`: the site's state put aside.
fn reset_cmd(config: &std::path::Path) -> Result<()> {
    let cfg = train::load_config(config)?;
    match train::reset(&cfg)? {
        Some(to) => unifed_net::service::print_out(format_args!(
            "the site's state is now in {}; its next start joins the federation afresh",
            to.display()
        ))?,
        None => unifed_net::service::print_out(format_args!(
            "{} holds no site state",
            cfg.state_dir.display()
        ))?,
    }
    Ok(())
}

/// `data preview`: a grid of every built-in domain's test images, written to `out`.
fn data_preview(out: &std::path::Path, seed: u64) -> Result<()> {
    let data = BuiltinData::load().context("loading the built-in data")?;
    let sizes = SplitSizes::default();
    let domains: Vec<_> = Domain::all()
        .into_iter()
        .map(|d| data.domain(d, &sizes, seed).map(|dd| (d, dd)))
        .collect::<Result<_, _>>()?;
    let rows: Vec<_> = domains.iter().map(|(d, dd)| (*d, &dd.test)).collect();
    let grid = preview_grid(&rows, 16, 2);
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    grid.save(out)
        .with_context(|| format!("writing {}", out.display()))?;
    println!(
        "rows: {}",
        rows.iter()
            .map(|(d, _)| d.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("wrote {}", out.display());
    Ok(())
}

/// `data export`: base digits (IDX files or a folder) rendered in a built-in domain's style,
/// written to the folder `out`.
fn data_export(
    domain: &str,
    (images, labels, folder): (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>),
    out: &std::path::Path,
    seed: u64,
) -> Result<()> {
    let domain = Domain::parse(domain).map_err(anyhow::Error::msg)?;
    let base: BaseDigits = match (images, labels, folder) {
        (Some(i), Some(l), None) => read_idx_digits(&i, &l)?,
        (None, None, Some(f)) => BaseDigits::from_folder(&f)?,
        _ => bail!("give either --base-images with --base-labels, or --base-folder"),
    };
    let data = BuiltinData::load().context("loading the built-in assets")?;
    let split = data.render_base(domain, &base, seed);
    split.write_folder(out)?;
    println!(
        "wrote {} images of domain {} to {}",
        split.images.len(),
        domain.name(),
        out.display()
    );
    Ok(())
}
