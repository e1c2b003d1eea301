//! The model zoo as the agent's commands name it (`--arch`), and the initial model of a
//! federation: a seeded, PyTorch-compatible safetensors file with its spec beside it. The spec
//! decides the model: every command that loads a model or joins a federation rebuilds it from
//! the spec ([`unifed_models::zoo::net_from_spec`]).

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use unifed_models::zoo::{
    AnyNet, Arch, DigitsCnnConfig, MlpConfig, ModelConfig, ResNetConfig, net_from_spec, seeded,
    spec_of,
};
use unifed_protocol::{Input, ModelSpec, Scaling};

/// What `unifed-agent init` may change of an architecture's defaults.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct InitOptions {
    /// Digits CNN conv widths (e.g. 64,64,128).
    #[arg(long, value_delimiter = ',')]
    pub conv: Vec<usize>,
    /// Digits CNN fc widths (e.g. 2048,512).
    #[arg(long, value_delimiter = ',')]
    pub fc: Vec<usize>,
    /// Image height and width in pixels (digits: 28, a multiple of 4; resnet18: 64), or the
    /// MLP's input features (100).
    #[arg(long)]
    pub size: Option<usize>,
    /// Image channels (digits: 3; resnet18: 3).
    #[arg(long)]
    pub channels: Option<usize>,
    /// Class names in index order, e.g. benign,malignant,normal (digits: 0..9).
    #[arg(long, value_delimiter = ',')]
    pub classes: Vec<String>,
    /// Read the class names from a dataset folder instead: the sorted sub-folders of its
    /// `train/`.
    #[arg(long, conflicts_with = "classes")]
    pub classes_from: Option<PathBuf>,
    /// ResNet-18 width of the first stage (64; stages are w, 2w, 4w, 8w).
    #[arg(long)]
    pub width: Option<usize>,
}

/// The class names of a dataset folder: the sorted sub-folders of `<root>/train`.
pub fn classes_in(root: &Path) -> Result<Vec<String>> {
    let train = root.join("train");
    let mut v: Vec<String> = std::fs::read_dir(&train)
        .with_context(|| format!("reading the classes of {}", train.display()))?
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    if v.is_empty() {
        bail!("{} has no class folders", train.display());
    }
    Ok(v)
}

/// The model configuration of `arch` (digits, mlp, resnet18) with `o`'s changes.
pub fn model_config(arch: &str, o: &InitOptions) -> Result<ModelConfig> {
    let classes = match (&o.classes_from, o.classes.is_empty()) {
        (Some(root), _) => Some(classes_in(root)?),
        (None, false) => Some(o.classes.clone()),
        (None, true) => None,
    };
    let image = |channels: usize, size: usize| Input::Image {
        channels: channels as u32,
        height: size as u32,
        width: size as u32,
        scaling: Scaling::MinusOneToOne,
    };
    let mc = match arch {
        "digits" => {
            let mut mc = ModelConfig::fedbn_digits();
            let mut cfg = DigitsCnnConfig::default();
            if !o.conv.is_empty() {
                cfg.conv =
                    o.conv.as_slice().try_into().map_err(|_| {
                        anyhow::anyhow!("--conv takes 3 widths, got {}", o.conv.len())
                    })?;
            }
            if !o.fc.is_empty() {
                cfg.fc =
                    o.fc.as_slice()
                        .try_into()
                        .map_err(|_| anyhow::anyhow!("--fc takes 2 widths, got {}", o.fc.len()))?;
            }
            cfg.in_channels = o.channels.unwrap_or(cfg.in_channels);
            cfg.size = o.size.map_or(cfg.size, |s| [s, s]);
            if let Some(c) = classes {
                mc.classes = c;
            }
            cfg.classes = mc.classes.len();
            cfg.validate().map_err(anyhow::Error::msg)?;
            mc.input = image(cfg.in_channels, cfg.size[0]);
            mc.arch = Arch::DigitsCnn(cfg);
            mc
        }
        "mlp" => {
            let classes = classes.unwrap_or_else(|| vec!["control".into(), "autism".into()]);
            let inputs = o.size.unwrap_or(100);
            ModelConfig {
                arch: Arch::Mlp(MlpConfig::abide(inputs, classes.len())),
                input: Input::Features { len: inputs as u32 },
                classes,
            }
        }
        "resnet18" => {
            let classes =
                classes.unwrap_or_else(|| (0..10).map(|d| d.to_string()).collect::<Vec<_>>());
            let (channels, size) = (o.channels.unwrap_or(3), o.size.unwrap_or(64));
            let mut cfg = ResNetConfig::new(channels, [size, size], classes.len());
            cfg.width = o.width.unwrap_or(cfg.width);
            cfg.validate().map_err(anyhow::Error::msg)?;
            ModelConfig {
                arch: Arch::Resnet18(cfg),
                input: image(channels, size),
                classes,
            }
        }
        other => bail!("unknown architecture `{other}`: expected digits, mlp or resnet18"),
    };
    if mc.classes.len() < 2 {
        bail!(
            "a classifier needs at least 2 classes, got {:?}",
            mc.classes
        );
    }
    Ok(mc)
}

/// The model spec for `arch` (digits, mlp, resnet18) with default sizes.
pub fn spec_for(arch: &str, device: &unifed_models::backend::Device) -> Result<ModelSpec> {
    let mc = model_config(arch, &InitOptions::default())?;
    Ok(spec_of(&mc.arch.init(device), &mc.classes, &mc.input))
}

/// A seeded initial model of `arch` with `o`'s changes, and its spec.
pub fn init_state(
    arch: &str,
    o: &InitOptions,
    seed: u64,
    device: &unifed_models::backend::Device,
) -> Result<(ModelSpec, unifed_models::state::StateDict)> {
    use unifed_models::state::{Select, export};
    let mc = model_config(arch, o)?;
    let net = seeded(device, seed, |d| mc.arch.init(d));
    let spec = spec_of(&net, &mc.classes, &mc.input);
    let state = export(&net, &spec, Select::All);
    Ok((spec, state))
}

/// Writes a seeded initial model to `out` and its spec to `<out>.spec.json`; returns the spec.
pub fn write_initial(
    arch: &str,
    o: &InitOptions,
    seed: u64,
    device: &unifed_models::backend::Device,
    out: &Path,
) -> Result<ModelSpec> {
    let (spec, state) = init_state(arch, o, seed, device)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    unifed_models::checkpoint::save(out, &state, &spec)
        .with_context(|| format!("writing {}", out.display()))?;
    let sp = spec_path(out);
    std::fs::write(&sp, serde_json::to_vec_pretty(&spec)?)
        .with_context(|| format!("writing {}", sp.display()))?;
    Ok(spec)
}

/// Reads a model spec file (`<model>.spec.json`, as `init` writes it).
pub fn read_spec(path: &Path) -> Result<ModelSpec> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let spec: ModelSpec =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    Ok(spec)
}

/// The model a spec describes, seeded (seed 0, as every site's model starts).
pub fn net_for(spec: &ModelSpec, device: &unifed_models::backend::Device) -> Result<AnyNet> {
    net_from_spec(spec, device, 0).map_err(|e| anyhow::anyhow!("model spec: {e}"))
}

pub use unifed_protocol::spec_path;
