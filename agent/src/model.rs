//! The model zoo as the agent's commands name it (`--arch`), and the initial model of a
//! federation: a seeded, PyTorch-compatible safetensors file with its spec beside it.

use anyhow::{Context, Result, bail};
use std::path::Path;
use unifed_models::zoo::{DigitsCnnConfig, MlpConfig, ModelConfig, ResNetConfig, seeded, spec_of};
use unifed_protocol::{Input, ModelSpec, Scaling};

/// The model spec for `arch` (digits, mlp, resnet18) with default sizes.
pub fn spec_for(arch: &str, device: &unifed_models::backend::Device) -> Result<ModelSpec> {
    let digits: Vec<String> = (0..10).map(|d| d.to_string()).collect();
    Ok(match arch {
        "digits" => {
            let cfg = ModelConfig::fedbn_digits();
            spec_of(
                &DigitsCnnConfig::default().init(device),
                &cfg.classes,
                &cfg.input,
            )
        }
        "mlp" => spec_of(
            &MlpConfig::abide(100, 2).init(device),
            &["control".into(), "autism".into()],
            &Input::Features { len: 100 },
        ),
        "resnet18" => spec_of(
            &ResNetConfig::new(1, [64, 64], 10).init(device),
            &digits,
            &Input::Image {
                channels: 1,
                height: 64,
                width: 64,
                scaling: Scaling::MinusOneToOne,
            },
        ),
        other => bail!("unknown architecture `{other}`: expected digits, mlp or resnet18"),
    })
}

/// A seeded initial model of `arch` and its spec; `conv`/`fc` override the digits CNN widths.
pub fn init_state(
    arch: &str,
    conv: &[usize],
    fc: &[usize],
    seed: u64,
    device: &unifed_models::backend::Device,
) -> Result<(ModelSpec, unifed_models::state::StateDict)> {
    use unifed_models::state::{Select, export};
    Ok(match arch {
        "digits" => {
            let mut cfg = DigitsCnnConfig::default();
            if !conv.is_empty() {
                cfg.conv = conv
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("--conv takes 3 widths, got {}", conv.len()))?;
            }
            if !fc.is_empty() {
                cfg.fc = fc
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("--fc takes 2 widths, got {}", fc.len()))?;
            }
            cfg.validate().map_err(anyhow::Error::msg)?;
            let mc = ModelConfig::fedbn_digits();
            let net = seeded(device, seed, |d| cfg.init(d));
            let spec = spec_of(&net, &mc.classes, &mc.input);
            let state = export(&net, &spec, Select::All);
            (spec, state)
        }
        "mlp" => {
            let spec = spec_for(arch, device)?;
            (
                spec.clone(),
                export(
                    &seeded(device, seed, |d| MlpConfig::abide(100, 2).init(d)),
                    &spec,
                    Select::All,
                ),
            )
        }
        _ => {
            let spec = spec_for(arch, device)?;
            (
                spec.clone(),
                export(
                    &seeded(device, seed, |d| ResNetConfig::new(1, [64, 64], 10).init(d)),
                    &spec,
                    Select::All,
                ),
            )
        }
    })
}

/// Writes a seeded initial model to `out` and its spec to `<out>.spec.json`; returns the spec.
pub fn write_initial(
    arch: &str,
    conv: &[usize],
    fc: &[usize],
    seed: u64,
    device: &unifed_models::backend::Device,
    out: &Path,
) -> Result<ModelSpec> {
    let (spec, state) = init_state(arch, conv, fc, seed, device)?;
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

pub use unifed_protocol::spec_path;
