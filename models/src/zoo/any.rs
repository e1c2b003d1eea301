//! Any model of the zoo behind one type, built from its model spec: what a federation's sites
//! run when the spec written by `unifed-agent init` decides the architecture, input and classes.

use super::{Arch, DigitsCnn, DigitsCnnConfig, Mlp, MlpConfig, Net, ResNet, ResNetConfig, Stem};
use super::{seeded, spec_of};
use crate::bn::BnPass;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use unifed_protocol::ModelSpec;

/// A model of the zoo. Its tensors carry the same names as the model's own (the variant adds
/// no level to a path), so specs and checkpoints are those of the wrapped model.
// One model per site: the size of the enum's variants does not matter, and burn's derive
// does not take boxed modules.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum AnyNet {
    /// FedBN's digits CNN.
    Digits(DigitsCnn),
    /// The MLP with BatchNorm1d.
    Mlp(Mlp),
    /// ResNet-18.
    Resnet18(ResNet),
}

impl Net for AnyNet {
    fn architecture(&self) -> String {
        match self {
            AnyNet::Digits(n) => n.architecture(),
            AnyNet::Mlp(n) => n.architecture(),
            AnyNet::Resnet18(n) => n.architecture(),
        }
    }

    fn input_numel(&self) -> usize {
        match self {
            AnyNet::Digits(n) => n.input_numel(),
            AnyNet::Mlp(n) => n.input_numel(),
            AnyNet::Resnet18(n) => n.input_numel(),
        }
    }

    fn features(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2> {
        match self {
            AnyNet::Digits(n) => n.features(x, bn),
            AnyNet::Mlp(n) => n.features(x, bn),
            AnyNet::Resnet18(n) => n.features(x, bn),
        }
    }

    fn head(&self, h: Tensor<2>) -> Tensor<2> {
        match self {
            AnyNet::Digits(n) => n.head(h),
            AnyNet::Mlp(n) => n.head(h),
            AnyNet::Resnet18(n) => n.head(h),
        }
    }

    fn torch_path(&self, burn_path: &str) -> String {
        match self {
            AnyNet::Digits(n) => n.torch_path(burn_path),
            AnyNet::Mlp(n) => n.torch_path(burn_path),
            AnyNet::Resnet18(n) => n.torch_path(burn_path),
        }
    }
}

impl Arch {
    /// Builds the model on `device` (burn's initialisation; see [`seeded`]).
    pub fn init(&self, device: &Device) -> AnyNet {
        match self {
            Arch::DigitsCnn(c) => AnyNet::Digits(c.init(device)),
            Arch::Mlp(c) => AnyNet::Mlp(c.init(device)),
            Arch::Resnet18(c) => AnyNet::Resnet18(c.init(device)),
        }
    }

    /// The architecture a model spec describes, read from its architecture string and tensor
    /// shapes; an error names what does not fit.
    pub fn from_spec(spec: &ModelSpec) -> Result<Arch, String> {
        let a = spec.architecture.as_str();
        if a.starts_with("fedbn-digits-cnn(") {
            return DigitsCnnConfig::from_spec(spec).map(Arch::DigitsCnn);
        }
        let dim = |name: &str, i: usize| -> Result<usize, String> {
            spec.tensors
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(i).copied())
                .ok_or_else(|| format!("spec of `{a}` has no tensor `{name}`"))
        };
        if a.starts_with("mlp-bn(") {
            return Ok(Arch::Mlp(MlpConfig {
                inputs: dim("fc1.weight", 1)?,
                hidden: [dim("fc1.weight", 0)?, dim("fc2.weight", 0)?],
                classes: dim("fc3.weight", 0)?,
            }));
        }
        if let Some(args) = a
            .strip_prefix("resnet18(")
            .and_then(|r| r.strip_suffix(')'))
        {
            let field = |key: &str| -> Result<&str, String> {
                args.split(',')
                    .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                    .ok_or_else(|| format!("`{a}` has no `{key}`"))
            };
            let num = |key: &str| -> Result<usize, String> {
                field(key)?
                    .parse()
                    .map_err(|_| format!("`{a}`: `{key}` is not a number"))
            };
            let dims: Vec<usize> = field("in")?
                .split('x')
                .map(|d| d.parse().map_err(|_| format!("`{a}`: bad input shape")))
                .collect::<Result<_, String>>()?;
            let [c, h, w] = dims[..] else {
                return Err(format!("`{a}`: the input shape needs 3 dimensions"));
            };
            let cfg = ResNetConfig {
                in_channels: c,
                size: [h, w],
                classes: num("classes")?,
                width: num("width")?,
                stem: match field("stem")? {
                    "imagenet" => Stem::Imagenet,
                    "cifar" => Stem::Cifar,
                    s => return Err(format!("`{a}`: unknown stem `{s}`")),
                },
                split: num("split")?,
            };
            cfg.validate()?;
            return Ok(Arch::Resnet18(cfg));
        }
        Err(format!("unknown architecture `{a}`"))
    }
}

/// The model a spec describes, seeded like every site's and the initial model (see
/// [`seeded`]); its spec must hash like `spec`, so the spec decides the model exactly.
pub fn net_from_spec(spec: &ModelSpec, device: &Device, seed: u64) -> Result<AnyNet, String> {
    spec.validate().map_err(|e| e.to_string())?;
    let arch = Arch::from_spec(spec)?;
    let net = seeded(device, seed, |d| arch.init(d));
    let built = spec_of(&net, &spec.classes, &spec.input);
    if built.hash() != spec.hash() {
        return Err(format!(
            "the model built from `{}` does not match its spec (tensors or input differ)",
            spec.architecture
        ));
    }
    Ok(net)
}
