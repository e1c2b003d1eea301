//! The model zoo: FedBN's digits CNN, an MLP with BatchNorm1d, and a configurable ResNet-18.
//!
//! Every model takes a batch of flattened inputs `[n, features]` (images are reshaped inside),
//! routes every BatchNorm layer through [`crate::bn::norm`], and exposes its representation:
//! [`Net::features`] (input -> the vector before the classifier) and [`Net::head`]
//! (representation -> logits).

mod any;
mod digits;
mod mlp;
mod resnet;

pub use any::{AnyNet, ArchError, SpecNetError, net_from_spec};
pub use digits::{DigitsCnn, DigitsCnnConfig, DigitsCnnError};
pub use mlp::{Mlp, MlpConfig};
pub use resnet::{BasicBlock, Downsample, ResNet, ResNetConfig, ResNetConfigError, Stem};

pub use crate::net::Net;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use unifed_protocol::{Input, ModelSpec, Scaling};

/// Which architecture, with its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Arch {
    /// FedBN's digits CNN.
    DigitsCnn(DigitsCnnConfig),
    /// MLP with BatchNorm1d.
    Mlp(MlpConfig),
    /// ResNet-18 with BN.
    Resnet18(ResNetConfig),
}

/// A model's full configuration: architecture, classes and input, from which the net and its
/// spec are built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Architecture and its configuration.
    pub arch: Arch,
    /// Class names; index i is class i.
    pub classes: Vec<String>,
    /// Input and preprocessing.
    pub input: Input,
}

impl ModelConfig {
    /// FedBN's digits CNN on 3x28x28 images in [-1, 1] with classes "0".."9".
    pub fn fedbn_digits() -> Self {
        ModelConfig {
            arch: Arch::DigitsCnn(DigitsCnnConfig::default()),
            classes: (0..10).map(|d| d.to_string()).collect(),
            input: Input::Image {
                channels: 3,
                height: 28,
                width: 28,
                scaling: Scaling::MinusOneToOne,
            },
        }
    }
}

/// Builds the spec of `net`: every tensor by visiting the model (BN told apart by layer type),
/// plus `classes` and `input`.
pub fn spec_of<N: Net>(net: &N, classes: &[String], input: &Input) -> ModelSpec {
    ModelSpec {
        architecture: net.architecture(),
        tensors: crate::state::tensor_specs(net),
        classes: classes.to_vec(),
        input: input.clone(),
    }
}

/// Builds a net with `init` and gives every non-BN tensor PyTorch's default initialisation
/// (`U(-1/sqrt(fan_in), 1/sqrt(fan_in))` for weights and biases) drawn from a ChaCha8 stream of
/// `seed` and the tensor's name. Unlike burn's device RNG, which is global and shared by
/// concurrent users, this is reproducible whatever else runs; BN starts at weight 1, bias 0,
/// mean 0, variance 1.
pub fn seeded<N: Net, F: FnOnce(&Device) -> N>(device: &Device, seed: u64, init: F) -> N {
    use crate::state::{Select, export, import};
    use rand::{Rng, SeedableRng};
    let net = init(device);
    let spec = spec_of(
        &net,
        &["0".to_string()],
        &Input::Features {
            len: net.input_numel() as u32,
        },
    );
    let mut state = export(&net, &spec, Select::All);
    let mut fan_in = 1usize;
    for t in &mut state.tensors {
        if t.kind.is_bn() {
            continue;
        }
        if t.shape.len() >= 2 {
            fan_in = t.shape[1..].iter().product();
        }
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        let name_hash = t.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ name_hash);
        t.data
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-bound..bound));
    }
    import(&net, &spec, &state, Select::All).expect("a net's own tensors fit it")
}
