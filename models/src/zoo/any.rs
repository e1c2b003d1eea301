//! Any model of the zoo behind one type, built from its model spec: what a federation's sites
//! run when the spec written by `unifed-agent init` decides the architecture, input and classes.

use super::{Arch, DigitsCnn, DigitsCnnConfig, Mlp, MlpConfig, Net, ResNet, ResNetConfig, Stem};
use super::{DigitsCnnError, ResNetConfigError};
use super::{seeded, spec_of};
use crate::bn::BnPass;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use unifed_protocol::{ModelSpec, SpecError};

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

    fn split_points(&self) -> Vec<usize> {
        match self {
            AnyNet::Digits(n) => n.split_points(),
            AnyNet::Mlp(n) => n.split_points(),
            AnyNet::Resnet18(n) => n.split_points(),
        }
    }

    fn low(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        match self {
            AnyNet::Digits(n) => n.low(x, split, bn),
            AnyNet::Mlp(n) => n.low(x, split, bn),
            AnyNet::Resnet18(n) => Net::low(n, x, split, bn),
        }
    }

    fn high(&self, h: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        match self {
            AnyNet::Digits(n) => n.high(h, split, bn),
            AnyNet::Mlp(n) => n.high(h, split, bn),
            AnyNet::Resnet18(n) => Net::high(n, h, split, bn),
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
    pub fn from_spec(spec: &ModelSpec) -> Result<Arch, ArchError> {
        let a = spec.architecture.as_str();
        if a.starts_with("fedbn-digits-cnn(") {
            return Ok(DigitsCnnConfig::from_spec(spec).map(Arch::DigitsCnn)?);
        }
        let dim = |name: &str, i: usize| {
            spec.tensors
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(i).copied())
                .ok_or_else(|| ArchError::MissingTensor {
                    arch: a.into(),
                    tensor: name.into(),
                })
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
            let field = |key: &str| {
                args.split(',')
                    .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                    .ok_or_else(|| ArchError::MissingField {
                        arch: a.into(),
                        key: key.into(),
                    })
            };
            let num = |key: &str| -> Result<usize, ArchError> {
                field(key)?.parse().map_err(|_| ArchError::NotANumber {
                    arch: a.into(),
                    key: key.into(),
                })
            };
            let dims: Vec<usize> = field("in")?
                .split('x')
                .map(|d| d.parse().map_err(|_| ArchError::InputShape(a.into())))
                .collect::<Result<_, _>>()?;
            let [c, h, w] = dims[..] else {
                return Err(ArchError::InputRank(a.into()));
            };
            let cfg = ResNetConfig {
                in_channels: c,
                size: [h, w],
                classes: num("classes")?,
                width: num("width")?,
                stem: match field("stem")? {
                    "imagenet" => Stem::Imagenet,
                    "cifar" => Stem::Cifar,
                    s => {
                        return Err(ArchError::UnknownStem {
                            arch: a.into(),
                            stem: s.into(),
                        });
                    }
                },
                split: num("split")?,
            };
            cfg.validate()?;
            return Ok(Arch::Resnet18(cfg));
        }
        Err(ArchError::Unknown(a.into()))
    }
}

/// Why [`Arch::from_spec`] cannot read an architecture from a model spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArchError {
    /// A digits-CNN spec that does not describe a valid digits CNN.
    #[error(transparent)]
    Digits(#[from] DigitsCnnError),
    /// The spec lacks a tensor its architecture has (or the tensor has too few dimensions).
    #[error("spec of `{arch}` has no tensor `{tensor}`")]
    MissingTensor {
        /// The spec's architecture string.
        arch: String,
        /// The tensor looked for.
        tensor: String,
    },
    /// A ResNet architecture string lacks a `key=value` field.
    #[error("`{arch}` has no `{key}`")]
    MissingField {
        /// The spec's architecture string.
        arch: String,
        /// The missing field's key.
        key: String,
    },
    /// A ResNet architecture string's field is not a number.
    #[error("`{arch}`: `{key}` is not a number")]
    NotANumber {
        /// The spec's architecture string.
        arch: String,
        /// The field's key.
        key: String,
    },
    /// A ResNet architecture string's input shape has a dimension that is not a number.
    #[error("`{0}`: bad input shape")]
    InputShape(String),
    /// A ResNet architecture string's input shape does not have 3 dimensions.
    #[error("`{0}`: the input shape needs 3 dimensions")]
    InputRank(String),
    /// A ResNet architecture string names a stem other than `imagenet` and `cifar`.
    #[error("`{arch}`: unknown stem `{stem}`")]
    UnknownStem {
        /// The spec's architecture string.
        arch: String,
        /// The stem it names.
        stem: String,
    },
    /// A ResNet architecture string whose configuration is invalid.
    #[error(transparent)]
    ResNet(#[from] ResNetConfigError),
    /// The architecture is none of the zoo's.
    #[error("unknown architecture `{0}`")]
    Unknown(String),
}

impl From<ArchError> for String {
    fn from(e: ArchError) -> String {
        e.to_string()
    }
}

/// The model a spec describes, seeded like every site's and the initial model (see
/// [`seeded`]); its spec must hash like `spec`, so the spec decides the model exactly.
pub fn net_from_spec(spec: &ModelSpec, device: &Device, seed: u64) -> Result<AnyNet, SpecNetError> {
    spec.validate()?;
    let arch = Arch::from_spec(spec)?;
    let net = seeded(device, seed, |d| arch.init(d));
    let built = spec_of(&net, &spec.classes, &spec.input);
    if built.hash() != spec.hash() {
        return Err(SpecNetError::Mismatch(spec.architecture.clone()));
    }
    Ok(net)
}

/// Why [`net_from_spec`] cannot build the model a spec describes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecNetError {
    /// The spec is inconsistent in itself.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The spec's architecture is none the zoo can build.
    #[error(transparent)]
    Arch(#[from] ArchError),
    /// The model built from the spec's architecture has other tensors or input than the spec.
    #[error("the model built from `{0}` does not match its spec (tensors or input differ)")]
    Mismatch(String),
}

impl From<SpecNetError> for String {
    fn from(e: SpecNetError) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::{Input, TensorKind, TensorSpec};

    fn spec(architecture: &str, tensors: &[(&str, &[usize])]) -> ModelSpec {
        ModelSpec {
            architecture: architecture.into(),
            tensors: tensors
                .iter()
                .map(|(name, shape)| TensorSpec {
                    name: (*name).into(),
                    shape: shape.to_vec(),
                    kind: TensorKind::NonBn,
                })
                .collect(),
            classes: vec!["a".into(), "b".into()],
            input: Input::Features { len: 12 },
        }
    }

    #[test]
    fn an_architecture_that_does_not_fit_is_refused_naming_what_is_wrong() {
        let arch = |a: &str| Arch::from_spec(&spec(a, &[])).unwrap_err();
        assert!(
            matches!(arch("vgg16(in=3x32x32)"), ArchError::Unknown(a) if a.starts_with("vgg16"))
        );
        assert!(matches!(
            arch("mlp-bn(in=12,hidden=16-16,classes=2)"),
            ArchError::MissingTensor { tensor, .. } if tensor == "fc1.weight"
        ));
        assert!(matches!(
            arch("fedbn-digits-cnn(64,64,128,2048,512)"),
            ArchError::Digits(DigitsCnnError::NotImage)
        ));
        let resnet = "resnet18(in=3x32x32,classes=10,width=8,stem=cifar,split=2)";
        assert!(matches!(
            arch(&resnet.replace("classes=10,", "")),
            ArchError::MissingField { key, .. } if key == "classes"
        ));
        assert!(matches!(
            arch(&resnet.replace("width=8", "width=w")),
            ArchError::NotANumber { key, .. } if key == "width"
        ));
        assert!(matches!(
            arch(&resnet.replace("3x32x32", "3xAx32")),
            ArchError::InputShape(_)
        ));
        assert!(matches!(
            arch(&resnet.replace("3x32x32", "3x32")),
            ArchError::InputRank(_)
        ));
        assert!(matches!(
            arch(&resnet.replace("cifar", "tiny")),
            ArchError::UnknownStem { stem, .. } if stem == "tiny"
        ));
        let err = arch(&resnet.replace("split=2", "split=5"));
        assert_eq!(err, ArchError::ResNet(ResNetConfigError::Split(5)));
        assert_eq!(String::from(err), "ResNet split stage 5 must be 0..=4");
    }

    #[test]
    fn net_from_spec_names_an_inconsistent_or_unbuildable_spec() {
        let d = Device::flex();
        let mut bad = spec("mlp-bn(in=12,hidden=16-16,classes=2)", &[]);
        bad.classes.clear();
        assert!(matches!(
            net_from_spec(&bad, &d, 0),
            Err(SpecNetError::Spec(SpecError::NoClasses))
        ));
        assert!(matches!(
            net_from_spec(&spec("vgg16", &[]), &d, 0),
            Err(SpecNetError::Arch(ArchError::Unknown(_)))
        ));
        // The MLP's dimensions are read from these tensors, but the spec lacks the rest of its
        // tensors: the model built from it does not hash like the spec.
        let partial = spec(
            "mlp-bn(in=12,hidden=16-16,classes=2)",
            &[
                ("fc1.weight", &[16, 12]),
                ("fc2.weight", &[16, 16]),
                ("fc3.weight", &[2, 16]),
            ],
        );
        let err = net_from_spec(&partial, &d, 0).unwrap_err();
        assert!(matches!(&err, SpecNetError::Mismatch(a) if a.starts_with("mlp-bn(")));
        assert!(err.to_string().contains("does not match its spec"), "{err}");
    }
}
