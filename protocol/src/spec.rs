//! The model spec: every tensor of a model with its kind, the class names and the input
//! preprocessing, plus a stable SHA-256 hash over a canonical byte encoding.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a tensor is, decided by the type of the layer that owns it (never by its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TensorKind {
    /// Any tensor outside a BatchNorm layer: conv and linear weights and biases.
    NonBn,
    /// BatchNorm scale (PyTorch `weight`, burn `gamma`).
    BnWeight,
    /// BatchNorm shift (PyTorch `bias`, burn `beta`).
    BnBias,
    /// BatchNorm running mean.
    BnRunningMean,
    /// BatchNorm running variance (biased estimate in burn).
    BnRunningVar,
}

impl TensorKind {
    /// True for every BatchNorm tensor (affine parameters and running statistics).
    pub fn is_bn(self) -> bool {
        !matches!(self, TensorKind::NonBn)
    }

    /// True for the BatchNorm affine parameters (weight and bias).
    pub fn is_bn_affine(self) -> bool {
        matches!(self, TensorKind::BnWeight | TensorKind::BnBias)
    }

    /// True for the BatchNorm running statistics (mean and variance).
    pub fn is_bn_stat(self) -> bool {
        matches!(self, TensorKind::BnRunningMean | TensorKind::BnRunningVar)
    }

    fn tag(self) -> u8 {
        match self {
            TensorKind::NonBn => 0,
            TensorKind::BnWeight => 1,
            TensorKind::BnBias => 2,
            TensorKind::BnRunningMean => 3,
            TensorKind::BnRunningVar => 4,
        }
    }
}

/// One tensor of a model, named and laid out as in PyTorch's `state_dict`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// PyTorch state_dict name, e.g. `fc1.weight` or `layer2.0.downsample.1.running_var`.
    pub name: String,
    /// Shape in PyTorch layout (a linear weight is `[out, in]`).
    pub shape: Vec<usize>,
    /// BN or not, and which BN tensor.
    pub kind: TensorKind,
}

impl TensorSpec {
    /// `values` of this tensor in wire form (see [`crate::encoding::encode`]).
    pub fn encode(
        &self,
        values: &[f32],
        encoding: crate::encoding::Encoding,
        residual: Option<&mut Vec<f32>>,
    ) -> crate::encoding::EncodedTensor {
        let shape: Vec<u32> = self.shape.iter().map(|&d| d as u32).collect();
        crate::encoding::encode(&self.name, &shape, values, encoding, residual)
    }

    /// Number of elements (product of the shape).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// How raw pixel values are mapped to model inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scaling {
    /// `x / 127.5 - 1`: pixels in [0, 255] become [-1, 1] (FedBN's recipe).
    MinusOneToOne,
    /// `x / 255`: pixels become [0, 1].
    ZeroToOne,
}

/// The model's input and the preprocessing every loader applies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    /// An image, resized to `height` x `width`; grey images are repeated to 3 channels when
    /// `channels` is 3, colour images averaged to grey when it is 1.
    Image {
        /// Channels the model expects (1 or 3).
        channels: u32,
        /// Height in pixels.
        height: u32,
        /// Width in pixels.
        width: u32,
        /// Pixel scaling.
        scaling: Scaling,
    },
    /// A plain feature vector of fixed length (e.g. the ABIDE MLP), used as given.
    Features {
        /// Number of features.
        len: u32,
    },
}

impl Input {
    /// Number of input values per sample.
    pub fn numel(&self) -> usize {
        match *self {
            Input::Image {
                channels,
                height,
                width,
                ..
            } => channels as usize * height as usize * width as usize,
            Input::Features { len } => len as usize,
        }
    }
}

/// The full description of a model that travels with every update, checkpoint and registry entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Architecture identifier with its configuration, e.g. `fedbn-digits-cnn(64,64,128,2048,512)`.
    pub architecture: String,
    /// Every tensor in state_dict order.
    pub tensors: Vec<TensorSpec>,
    /// Class names; a class index is a position in this list.
    pub classes: Vec<String>,
    /// Input and preprocessing.
    pub input: Input,
}

/// SHA-256 of a spec's canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SpecHash(pub [u8; 32]);

impl fmt::Display for SpecHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SpecHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SpecHash(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// A spec that is inconsistent in itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// Two tensors share a name.
    #[error("tensor name `{0}` appears twice in the model spec")]
    DuplicateTensor(String),
    /// The spec lists no classes.
    #[error("the model spec has no class names")]
    NoClasses,
    /// Two classes share a name.
    #[error("class name `{0}` appears twice in the model spec")]
    DuplicateClass(String),
}

/// The width of the representation the linear classifier reads: the input dimension of the
/// last linear weight among `tensors` (PyTorch layout `[classes, width]`; every model of the
/// zoo ends in one linear layer). `None` when there is none.
pub fn head_width(tensors: &[TensorSpec]) -> Option<usize> {
    tensors
        .iter()
        .rev()
        .find(|t| t.kind == TensorKind::NonBn && t.shape.len() == 2)
        .map(|t| t.shape[1])
}

/// The values per sample a model of the zoo (FedBN's digits CNN, the BN MLP, ResNet-18) passes
/// from its low-level part to its head when it splits after `split` weight layers (FedImpro),
/// read from its spec alone; `None` for a split the model does not have, or an architecture
/// this does not know. The models crate checks it against each model's own forward pass.
pub fn feature_width(spec: &ModelSpec, split: usize) -> Option<usize> {
    let out = |name: &str| {
        spec.tensors
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| t.shape.first().copied())
    };
    let (h, w) = match spec.input {
        Input::Image { height, width, .. } => (height as usize, width as usize),
        Input::Features { .. } => (0, 0),
    };
    let a = spec.architecture.as_str();
    if a.starts_with("fedbn-digits-cnn(") {
        return match split {
            1 => Some(out("conv1.weight")? * (h / 2) * (w / 2)),
            2 => Some(out("conv2.weight")? * (h / 4) * (w / 4)),
            3 => Some(out("conv3.weight")? * (h / 4) * (w / 4)),
            4 => out("fc1.weight"),
            5 => out("fc2.weight"),
            _ => None,
        };
    }
    if a.starts_with("mlp-bn(") {
        return match split {
            1 => out("fc1.weight"),
            2 => out("fc2.weight"),
            _ => None,
        };
    }
    if a.starts_with("resnet18(") && split % 2 == 1 && split <= 17 {
        // The stem's conv, then two weight layers a basic block; stages 2-4 halve the map.
        let half = |x: usize| x.div_ceil(2);
        let (mut h, mut w) = (h, w);
        if a.contains("stem=imagenet") {
            (h, w) = (half(half(h)), half(half(w)));
        }
        let stage = ((split - 1) / 2).saturating_sub(1) / 2;
        for _ in 0..stage.min(3) {
            (h, w) = (half(h), half(w));
        }
        return Some((out("conv1.weight")? << stage.min(3)) * h * w);
    }
    None
}

impl ModelSpec {
    /// The width of the representation the linear classifier reads ([`head_width`]).
    pub fn head_width(&self) -> Option<usize> {
        head_width(&self.tensors)
    }

    /// The stable hash: SHA-256 over a length-prefixed canonical encoding of every field, so
    /// it does not depend on serde or on the Rust version.
    pub fn hash(&self) -> SpecHash {
        let mut h = Sha256::new();
        h.update(b"unifed-model-spec/v1\0");
        put_str(&mut h, &self.architecture);
        h.update((self.tensors.len() as u64).to_le_bytes());
        for t in &self.tensors {
            put_str(&mut h, &t.name);
            h.update((t.shape.len() as u64).to_le_bytes());
            for d in &t.shape {
                h.update((*d as u64).to_le_bytes());
            }
            h.update([t.kind.tag()]);
        }
        h.update((self.classes.len() as u64).to_le_bytes());
        for c in &self.classes {
            put_str(&mut h, c);
        }
        match self.input {
            Input::Image {
                channels,
                height,
                width,
                scaling,
            } => {
                h.update([1u8]);
                h.update(channels.to_le_bytes());
                h.update(height.to_le_bytes());
                h.update(width.to_le_bytes());
                h.update([match scaling {
                    Scaling::MinusOneToOne => 0u8,
                    Scaling::ZeroToOne => 1u8,
                }]);
            }
            Input::Features { len } => {
                h.update([2u8]);
                h.update(len.to_le_bytes());
            }
        }
        SpecHash(h.finalize().into())
    }

    /// Checks that names and classes are unique and that there is at least one class.
    pub fn validate(&self) -> Result<(), SpecError> {
        let mut names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(SpecError::DuplicateTensor(w[0].into()));
        }
        if self.classes.is_empty() {
            return Err(SpecError::NoClasses);
        }
        let mut classes: Vec<&str> = self.classes.iter().map(|c| c.as_str()).collect();
        classes.sort_unstable();
        if let Some(w) = classes.windows(2).find(|w| w[0] == w[1]) {
            return Err(SpecError::DuplicateClass(w[0].into()));
        }
        Ok(())
    }

    /// The tensor called `name`, if any.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Index of the class called `name`, if any.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c == name)
    }

    /// Total number of elements over tensors of the kinds `keep` accepts.
    pub fn numel_where(&self, keep: impl Fn(TensorKind) -> bool) -> usize {
        self.tensors
            .iter()
            .filter(|t| keep(t.kind))
            .map(TensorSpec::numel)
            .sum()
    }

    /// Number of non-BN parameters (what FedBN averages).
    pub fn non_bn_params(&self) -> usize {
        self.numel_where(|k| !k.is_bn())
    }
}

fn put_str(h: &mut Sha256, s: &str) {
    h.update((s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

/// `<model>.spec.json`: where a model file's spec is kept, beside it.
#[cfg(feature = "std")]
pub fn spec_path(model: &std::path::Path) -> std::path::PathBuf {
    let mut p = model.as_os_str().to_owned();
    p.push(".spec.json");
    p.into()
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_resnets_feature_width_and_the_broadcast_bound_that_holds_its_gaussians() {
        let t = |name: &str, shape: &[usize]| TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            kind: TensorKind::NonBn,
        };
        let spec = ModelSpec {
            architecture: "resnet18(in=3x224x224,width=64,stem=imagenet,split=2,classes=100)"
                .into(),
            tensors: vec![
                t("conv1.weight", &[64, 3, 7, 7]),
                t("fc.weight", &[100, 512]),
            ],
            classes: (0..100).map(|k| format!("c{k}")).collect(),
            input: Input::Image {
                channels: 3,
                height: 224,
                width: 224,
                scaling: Scaling::ZeroToOne,
            },
        };
        // After the stem: 64 x 56 x 56; after layer2 (split 9): 128 x 28 x 28; layer4: 512 x 7 x 7.
        assert_eq!(feature_width(&spec, 1), Some(64 * 56 * 56));
        assert_eq!(feature_width(&spec, 9), Some(128 * 28 * 28));
        assert_eq!(feature_width(&spec, 17), Some(512 * 7 * 7));
        assert_eq!(feature_width(&spec, 2), None);
        assert_eq!(feature_width(&spec, 19), None);
        // The Gaussians of 100 classes at split 1 (160 MB) dwarf the two tensors: the bound
        // on a broadcast holds them.
        let gaussians = 100 * 8 * 64 * 56 * 56;
        assert!(crate::max_broadcast_bytes(&spec) > gaussians);
    }

    use super::*;
    use alloc::string::ToString;
    use alloc::vec;

    fn spec() -> ModelSpec {
        ModelSpec {
            architecture: "test".into(),
            tensors: vec![
                TensorSpec {
                    name: "fc.weight".into(),
                    shape: vec![2, 3],
                    kind: TensorKind::NonBn,
                },
                TensorSpec {
                    name: "bn.weight".into(),
                    shape: vec![2],
                    kind: TensorKind::BnWeight,
                },
            ],
            classes: vec!["a".into(), "b".into()],
            input: Input::Features { len: 3 },
        }
    }

    #[test]
    fn hash_is_stable_and_sensitive_to_every_field() {
        let s = spec();
        assert_eq!(s.hash(), spec().hash());
        let mut t = spec();
        t.tensors[1].kind = TensorKind::BnBias;
        assert_ne!(s.hash(), t.hash());
        let mut t = spec();
        t.tensors[0].shape = vec![3, 2];
        assert_ne!(s.hash(), t.hash());
        let mut t = spec();
        t.classes[1] = "c".into();
        assert_ne!(s.hash(), t.hash());
        let mut t = spec();
        t.input = Input::Features { len: 4 };
        assert_ne!(s.hash(), t.hash());
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        let mut t = spec();
        t.classes = vec!["ab".into(), "c".into()];
        let mut u = spec();
        u.classes = vec!["a".into(), "bc".into()];
        assert_ne!(t.hash(), u.hash());
    }

    #[test]
    fn hash_survives_a_postcard_round_trip() {
        let s = spec();
        let bytes = postcard::to_allocvec(&s).unwrap();
        let back: ModelSpec = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.hash(), s.hash());
        assert_eq!(s.hash().to_string().len(), 64);
    }

    #[test]
    fn validate_names_the_duplicate() {
        let mut s = spec();
        s.tensors[1].name = "fc.weight".into();
        assert_eq!(
            s.validate(),
            Err(SpecError::DuplicateTensor("fc.weight".into()))
        );
        let mut s = spec();
        s.classes.clear();
        assert_eq!(s.validate(), Err(SpecError::NoClasses));
    }

    #[test]
    fn counts_split_bn_from_non_bn() {
        let s = spec();
        assert_eq!(s.non_bn_params(), 6);
        assert_eq!(s.numel_where(TensorKind::is_bn), 2);
    }
}
