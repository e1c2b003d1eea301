//! Onboarding through the aggregator: `calibrate --config` fetches the federation's onboarding
//! package, calibrates it on the site's images (the same path as `calibrate --model`), keeps
//! the model on the device and registers its BN sealed with the site key; `fetch-calibrated`
//! brings the registered model to another device of the site.

use crate::onboard::{CalibrateArgs, FetchArgs, bar, calibrate_to, write_model};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use unifed_agent::registry::{
    Identity, OnboardClient, Owner, SiteKey, fetch_package as fetch, must_seal, open, seal,
};
use unifed_agent::train::AgentConfig;
use unifed_models::backend::Device;
use unifed_models::state::{Select, StateDict, export, import};
use unifed_models::zoo::AnyNet;
use unifed_protocol::encoding::Encoding;
use unifed_protocol::{ModelSpec, PackageInfo};

/// Runs `unifed-agent calibrate`: from the federation with `--config`, on a model file
/// otherwise.
pub fn calibrate_cmd(a: &CalibrateArgs, device: &Device) -> Result<()> {
    match &a.config {
        Some(config) => calibrate_from_federation(a, config, device),
        None => crate::onboard::calibrate_local(a, device),
    }
}

/// A device of the site named by an agent config: its model, spec, identity and key.
struct SiteDevice {
    cfg: AgentConfig,
    net: AnyNet,
    spec: ModelSpec,
    owner: Owner,
    key: Option<SiteKey>,
    identity: Identity,
}

impl SiteDevice {
    fn load(path: &Path, device: &Device) -> Result<Self> {
        let cfg = unifed_agent::train::load_config(path)?;
        let (site, federation) = cfg.ids()?;
        let (net, spec) = cfg.model_and_spec(device)?;
        let key = cfg.site_key.as_deref().map(SiteKey::load).transpose()?;
        let identity = cfg.identity()?;
        Ok(SiteDevice {
            identity,
            owner: Owner {
                federation,
                site,
                spec: spec.hash(),
            },
            cfg,
            net,
            spec,
            key,
        })
    }

    fn default_out(&self, version: u64) -> PathBuf {
        self.cfg
            .state_dir
            .join("calibrated")
            .join(format!("v{version}.safetensors"))
    }

    fn runtime() -> Result<tokio::runtime::Runtime> {
        Ok(tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?)
    }

    async fn connect(&self) -> Result<OnboardClient> {
        OnboardClient::connect(
            &self.cfg.broker,
            self.owner.clone(),
            &self.identity,
            std::time::Duration::from_secs(30),
        )
        .await
    }
}

/// The onboarding package of `version` (the newest when `None`) fetched with a progress bar.
fn fetch_package(
    dev: &SiteDevice,
    rt: &tokio::runtime::Runtime,
    version: Option<u64>,
) -> Result<(PackageInfo, StateDict)> {
    let pb = bar("fetching package");
    let r = rt.block_on(fetch(
        &dev.cfg.broker,
        dev.owner.clone(),
        &dev.identity,
        &dev.spec,
        version,
        |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    ));
    pb.finish_and_clear();
    r
}

/// `calibrate --config`: package from the aggregator, calibration, local copy, registry.
pub fn calibrate_from_federation(a: &CalibrateArgs, config: &Path, device: &Device) -> Result<()> {
    let dev = SiteDevice::load(config, device)?;
    let rt = SiteDevice::runtime()?;
    let (info, state) = fetch_package(&dev, &rt, a.version)?;
    println!(
        "fetched the onboarding package of model v{} (BN sharing `{}`{}; {} bytes)",
        info.model_version,
        info.bn_sharing.name(),
        if info.bn_sites.is_empty() {
            String::new()
        } else {
            format!(
                ", BN of {}",
                info.bn_sites
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        },
        info.payload_len
    );
    let net = import(&dev.net, &dev.spec, &state, Select::All)?;
    // The images: the command line's, else the config's data.
    let mut source = a.source.clone();
    if source.builtin.is_none() && source.folder.is_none() && a.images.is_none() {
        source.builtin = dev.cfg.data.builtin.clone();
        source.folder = dev.cfg.data.folder.clone();
    }
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| dev.default_out(info.model_version));
    let cal = calibrate_to(&net, &dev.spec, a, &source, &out, device)?;
    if a.no_register {
        return Ok(());
    }
    let key = match (&dev.key, must_seal(info.bn_sharing)) {
        (Some(k), _) => Some(k),
        (None, false) => None,
        (None, true) => bail!(
            "{}: set `site_key` (generate one with `unifed-agent keygen --out site.key` and give \
             it to this site's devices only) to register the calibrated BN sealed, or pass \
             --no-register",
            config.display()
        ),
    };
    let bn: Vec<_> = export(&cal, &dev.spec, Select::Bn)
        .tensors
        .iter()
        .map(|t| t.encode(Encoding::F32, None))
        .collect();
    let entry = seal(key, &dev.owner, info.model_version, &bn);
    let hash = rt.block_on(async {
        let mut c = dev.connect().await?;
        let r = c.register(&entry, 256 << 10).await;
        c.close().await;
        r
    })?;
    println!(
        "registered the calibrated BN of model v{} with the aggregator ({}, entry hash {})",
        info.model_version,
        if key.is_some() {
            "sealed with the site key"
        } else {
            "plaintext: BN sharing affine+stats"
        },
        hash[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    Ok(())
}

/// Runs `unifed-agent fetch-calibrated`: the site's registered BN (opened with the site key)
/// on the package's non-BN weights of the same version, written as a full model.
pub fn fetch_calibrated_cmd(a: &FetchArgs, device: &Device) -> Result<()> {
    let dev = SiteDevice::load(&a.config, device)?;
    let rt = SiteDevice::runtime()?;
    let entry = rt.block_on(async {
        let mut c = dev.connect().await?;
        let r = c
            .registry_entry(
                a.version,
                unifed_protocol::max_registry_entry_bytes(&dev.spec),
            )
            .await;
        c.close().await;
        r
    })?;
    let bn = open(dev.key.as_ref(), &dev.owner, &entry)?;
    let bn = unifed_models::state::from_encoded(&dev.spec, &bn)
        .context("the registry entry does not fit this agent's model")?;
    let (_, mut state) = fetch_package(&dev, &rt, Some(entry.model_version))?;
    for t in state.tensors.iter_mut().filter(|t| t.kind.is_bn()) {
        let Some(b) = bn.tensors.iter().find(|b| b.name == t.name) else {
            bail!("the registry entry lacks BN tensor `{}`", t.name);
        };
        if b.data.len() != t.data.len() {
            bail!("the registry entry's `{}` has the wrong length", t.name);
        }
        t.data = b.data.clone();
    }
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| dev.default_out(entry.model_version));
    write_model(&out, &state, &dev.spec)?;
    println!(
        "fetched the calibrated model v{} of site {} from the registry; wrote {}",
        entry.model_version,
        dev.owner.site,
        out.display()
    );
    Ok(())
}
