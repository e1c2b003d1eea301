//! The agent's configuration file (`[federation]`, `[broker]`, `[data]`, training and
//! evaluation settings) and the site data it names.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use unifed_models::backend::{Backend, Device};
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes, load_labelled};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{AnyNet, Arch, DigitsCnnConfig, ModelConfig, seeded, spec_of};
use unifed_net::BrokerConfig;
use unifed_protocol::ModelSpec;
use unifed_protocol::ids::Id;

/// Where a site's labelled data comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A built-in domain (e.g. `grey`), or none when `folder` is given.
    #[serde(default)]
    pub builtin: Option<String>,
    /// A dataset folder (`train/`, `val/`, `test/`, each `label/file`, or a manifest.csv).
    #[serde(default)]
    pub folder: Option<PathBuf>,
    /// Training images taken from a built-in domain.
    #[serde(default = "default_samples")]
    pub train_samples: usize,
}

fn default_samples() -> usize {
    743
}

/// The agent's configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// This site's id (safe in topics).
    pub site: String,
    /// Federation id.
    pub federation: String,
    /// Folder for the local checkpoint (the site's full model, BN included).
    pub state_dir: PathBuf,
    /// Where a GPU backend keeps its tuned kernels (default: `<state_dir>/kernels`).
    #[serde(default)]
    pub kernel_cache: Option<PathBuf>,
    /// A device profile (`firmware-targets/profiles/`: `x86-cpu`, `arm-cpu`, `jetson-orin`,
    /// `desktop-gpu`): the backend, threads, batch size and memory budget this file leaves
    /// unset.
    #[serde(default)]
    pub profile: Option<String>,
    /// The most memory the agent should take, MiB (`doctor` checks it against the machine).
    #[serde(default)]
    pub memory_budget_mib: Option<u64>,
    /// Compute backend.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// The federation's model spec (`<initial model>.spec.json`, written by `unifed-agent
    /// init`): it decides the architecture, input and class names. Without it the site runs the
    /// digits CNN of `[model]`.
    #[serde(default)]
    pub spec: Option<PathBuf>,
    /// The digits CNN's widths, when no `spec` is given.
    #[serde(default)]
    pub model: DigitsCnnConfig,
    /// Local training (lr, momentum, weight decay, batch size, epochs, seed).
    #[serde(default)]
    pub train: TrainConfig,
    /// Seconds between re-sends of an unanswered update.
    #[serde(default = "default_resend")]
    pub resend_secs: u64,
    /// Cap on the CPU backend's worker threads (default: all cores; `--threads` overrides).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Evaluate on the local test split after every model applied (for convergence curves),
    /// not only at the end.
    #[serde(default)]
    pub evaluate_each_model: bool,
    /// When a site evaluates a model it trains from (with `evaluate_each_model`):
    /// `before-training`, or `while-uploading`, on a copy frozen before training, while the
    /// update goes up and the aggregator folds (the same accuracy, off the round's critical
    /// path, for the memory of a second model). Default: `while-uploading` on a GPU backend,
    /// whose copy lives on the device and whose host is idle during the upload;
    /// `before-training` on the CPU, which is busy until the round ends anyway.
    #[serde(default)]
    pub evaluate_at: Option<EvaluateAt>,
    /// BN of a site joining a running federation (its first model is past version 0) under
    /// `local` BN: `calibrate` (default) re-estimates the statistics on its own training images
    /// before it trains; `fresh` keeps the never-trained statistics.
    #[serde(default)]
    pub join_bn: JoinBn,
    /// File holding the site's registry key (64 hex digits, from `unifed-agent keygen`): seals
    /// the calibrated BN this site registers with the aggregator. Only the site's devices hold it.
    #[serde(default)]
    pub site_key: Option<PathBuf>,
    /// The site's private ed25519 key file (made on this machine by `unifed-agent identity
    /// --key`, owner-readable only; `$CREDENTIALS_DIRECTORY/...` for systemd's
    /// `LoadCredential=`). Every message the site sends is signed with it.
    pub identity: PathBuf,
    /// The aggregator's public key (`ed25519:` and 64 hex digits, from `unifed-aggregator
    /// identity`): the site follows only manifests, models and answers it signed.
    pub aggregator_key: unifed_protocol::PublicKey,
    /// The broker.
    pub broker: BrokerConfig,
    /// The data.
    pub data: DataConfig,
}

impl AgentConfig {
    /// Makes the config's relative paths relative to the folder of the file it came from
    /// (`config`), so an agent started from anywhere (a service manager starts it in `/`)
    /// finds the same files.
    pub fn resolve_paths(&mut self, config: &std::path::Path) {
        use unifed_net::service::{resolve_opt, resolve_path};
        self.state_dir = resolve_path(config, &self.state_dir);
        self.identity = resolve_path(config, &self.identity);
        for p in [
            &mut self.kernel_cache,
            &mut self.spec,
            &mut self.site_key,
            &mut self.data.folder,
        ] {
            resolve_opt(config, p);
        }
        self.broker.resolve_paths(config);
    }

    /// The site's and the federation's ids, checked.
    pub fn ids(&self) -> Result<(Id, Id)> {
        let site = Id::new(&self.site).map_err(|e| anyhow::anyhow!("site `{}`: {e}", self.site))?;
        let fed = Id::new(&self.federation)
            .map_err(|e| anyhow::anyhow!("federation `{}`: {e}", self.federation))?;
        Ok((site, fed))
    }

    /// The site's signing key (read from `identity`) and the pinned aggregator key.
    pub fn identity(&self) -> Result<crate::registry::Identity> {
        Ok(crate::registry::Identity {
            key: unifed_protocol::SigningKey::load(&self.identity)
                .context("the site's identity key")?,
            aggregator: self.aggregator_key,
        })
    }

    /// The site's model (seeded, as every site and the initial model are) and its spec: the
    /// spec file's model, or the digits CNN of `[model]`.
    pub fn model_and_spec(&self, device: &Device) -> Result<(AnyNet, ModelSpec)> {
        if let Some(path) = &self.spec {
            let spec = crate::model::read_spec(path)?;
            let net = crate::model::net_for(&spec, device)
                .with_context(|| format!("{}", path.display()))?;
            return Ok((net, spec));
        }
        self.model.validate().map_err(anyhow::Error::msg)?;
        let mc = ModelConfig::fedbn_digits();
        let net = seeded(device, 0, |d| Arch::DigitsCnn(self.model.clone()).init(d));
        let spec = spec_of(&net, &mc.classes, &mc.input);
        Ok((net, spec))
    }

    /// Where a GPU backend keeps this site's autotune results and compiled kernels:
    /// `kernel_cache`, or `<state_dir>/kernels`.
    pub fn kernel_cache(&self) -> PathBuf {
        self.kernel_cache
            .clone()
            .unwrap_or_else(|| self.state_dir.join("kernels"))
    }

    /// The device of `backend`; a GPU backend first gets the site's kernel cache
    /// ([`kernel_cache`](Self::kernel_cache)). A cache that cannot be set (an unwritable folder,
    /// settings already read in this process) costs tuning time, not the site: it is logged.
    pub fn device(&self, backend: Backend) -> Result<Device, unifed_models::backend::BackendError> {
        if backend.is_gpu()
            && let Err(e) = unifed_models::backend::use_kernel_cache(&self.kernel_cache())
        {
            tracing::warn!("{e}; kernels are tuned without the site's cache");
        }
        backend.device()
    }
}

/// Reads and parses an agent config file, naming the file in errors.
pub fn load_config(path: &std::path::Path) -> Result<AgentConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: AgentConfig =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut cfg = with_profile(&text, cfg).with_context(|| format!("{}", path.display()))?;
    cfg.resolve_paths(path);
    Ok(cfg)
}

/// `cfg` (read from `text`) with its device profile's values where the file sets none.
pub fn with_profile(text: &str, cfg: AgentConfig) -> Result<AgentConfig> {
    let Some(name) = &cfg.profile else {
        return Ok(cfg);
    };
    let profile = crate::profile::get(name)?;
    let mut table: toml::Table = toml::from_str(text)?;
    profile.fill(&mut table);
    Ok(toml::Value::Table(table).try_into()?)
}

/// How a late joiner's BN starts (FedBN appendix G gives no rule; this is ours). Under a BN
/// sharing policy other than `none` its BN layers first come from the onboarding package.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JoinBn {
    /// Re-estimated on the site's own training images (exact `calibrate`).
    #[default]
    Calibrate,
    /// The model's never-trained statistics.
    Fresh,
}

/// When a site evaluates a model it trains from ([`AgentConfig::evaluate_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum EvaluateAt {
    /// Before training, on the model itself.
    BeforeTraining,
    /// While the update uploads, on a copy frozen before training.
    WhileUploading,
}

impl EvaluateAt {
    /// `configured`, or the default of `backend`: while uploading on a GPU.
    pub fn resolve(configured: Option<EvaluateAt>, backend: Backend) -> EvaluateAt {
        configured.unwrap_or(if backend.is_gpu() {
            EvaluateAt::WhileUploading
        } else {
            EvaluateAt::BeforeTraining
        })
    }
}

fn default_backend() -> String {
    "flex".into()
}

fn default_resend() -> u64 {
    10
}

/// The site's training and test splits, as `[data]` names them, in `spec`'s input shape.
pub fn load_data(cfg: &AgentConfig, spec: &ModelSpec) -> Result<(Dataset, Dataset)> {
    match (&cfg.data.builtin, &cfg.data.folder) {
        (Some(d), None) => {
            let domain = Domain::parse(d).map_err(anyhow::Error::msg)?;
            let data = BuiltinData::load().context("loading the built-in data")?;
            let dd = data.domain(
                domain,
                &SplitSizes {
                    train: cfg.data.train_samples,
                    ..SplitSizes::default()
                },
                0,
            )?;
            Ok((
                dd.train.dataset(&format!("{d}/train"), spec)?,
                dd.test.dataset(&format!("{d}/test"), spec)?,
            ))
        }
        (None, Some(f)) => {
            let [train, _, test] = load_labelled(f, spec)?;
            Ok((train, test))
        }
        _ => bail!("[data] needs exactly one of `builtin` or `folder`"),
    }
}
