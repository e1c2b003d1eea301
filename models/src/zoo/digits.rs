//! FedBN's digits CNN (appendix D.2, Table 3): 3 conv + 3 fc, BN after every conv and hidden fc.

use crate::bn::{BnPass, norm};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// Widths and input of the digits CNN; the default is the paper's (14,213,578 non-BN parameters).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DigitsCnnConfig {
    /// Input channels (3 in the paper; grey domains are repeated to 3 channels).
    pub in_channels: usize,
    /// Input height and width; both must be divisible by 4 (two 2x2 max-pools).
    pub size: [usize; 2],
    /// Output channels of conv1, conv2, conv3 (paper: 64, 64, 128).
    pub conv: [usize; 3],
    /// Widths of fc1 and fc2 (paper: 2048, 512).
    pub fc: [usize; 2],
    /// Number of classes (10 digits).
    pub classes: usize,
}

impl Default for DigitsCnnConfig {
    fn default() -> Self {
        DigitsCnnConfig {
            in_channels: 3,
            size: [28, 28],
            conv: [64, 64, 128],
            fc: [2048, 512],
            classes: 10,
        }
    }
}

/// The digits CNN. Field names follow the FedBN reference code, so its PyTorch checkpoints load.
#[derive(Module, Debug)]
pub struct DigitsCnn {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    conv3: Conv2d,
    bn3: BatchNorm,
    fc1: Linear,
    bn4: BatchNorm,
    fc2: Linear,
    bn5: BatchNorm,
    fc3: Linear,
    pool: MaxPool2d,
    shape: [usize; 3],
    widths: [usize; 6],
}

impl DigitsCnnConfig {
    /// The widths and input a digits-CNN spec describes (read from its tensor shapes), so a
    /// model file with its spec can be loaded without repeating its widths. The caller checks
    /// the rebuilt model's spec hash against the file's.
    pub fn from_spec(spec: &unifed_protocol::ModelSpec) -> Result<Self, DigitsCnnError> {
        let dim = |name: &str, i: usize| {
            spec.tensors
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape.get(i).copied())
                .ok_or_else(|| DigitsCnnError::MissingTensor(name.into()))
        };
        let unifed_protocol::Input::Image { height, width, .. } = spec.input else {
            return Err(DigitsCnnError::NotImage);
        };
        let cfg = DigitsCnnConfig {
            in_channels: dim("conv1.weight", 1)?,
            size: [height as usize, width as usize],
            conv: [
                dim("conv1.weight", 0)?,
                dim("conv2.weight", 0)?,
                dim("conv3.weight", 0)?,
            ],
            fc: [dim("fc1.weight", 0)?, dim("fc2.weight", 0)?],
            classes: dim("fc3.weight", 0)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the sizes, returning an error naming the bad value.
    pub fn validate(&self) -> Result<(), DigitsCnnError> {
        if !self.size[0].is_multiple_of(4)
            || !self.size[1].is_multiple_of(4)
            || self.size.contains(&0)
        {
            return Err(DigitsCnnError::Size(self.size));
        }
        if self.in_channels == 0
            || self.classes == 0
            || self.conv.contains(&0)
            || self.fc.contains(&0)
        {
            return Err(DigitsCnnError::Zero);
        }
        Ok(())
    }

    /// Builds the model on `device` (inference mode; `train()` moves it to autodiff).
    pub fn init(&self, device: &Device) -> DigitsCnn {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [5, 5])
                .with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2))
                .init(device)
        };
        let bn = |c| BatchNormConfig::new(c).init(device);
        let [c1, c2, c3] = self.conv;
        let [f1, f2] = self.fc;
        let flat = c3 * (self.size[0] / 4) * (self.size[1] / 4);
        DigitsCnn {
            conv1: conv(self.in_channels, c1),
            bn1: bn(c1),
            conv2: conv(c1, c2),
            bn2: bn(c2),
            conv3: conv(c2, c3),
            bn3: bn(c3),
            fc1: LinearConfig::new(flat, f1).init(device),
            bn4: bn(f1),
            fc2: LinearConfig::new(f1, f2).init(device),
            bn5: bn(f2),
            fc3: LinearConfig::new(f2, self.classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            shape: [self.in_channels, self.size[0], self.size[1]],
            widths: [c1, c2, c3, f1, f2, self.classes],
        }
    }
}

/// Why a digits-CNN configuration is refused, or cannot be read from a model spec
/// ([`DigitsCnnConfig::validate`], [`DigitsCnnConfig::from_spec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigitsCnnError {
    /// The input size is zero or not a multiple of 4 (the CNN has two 2x2 max-pools).
    #[error("digits CNN input size {0:?} must be non-zero multiples of 4")]
    Size([usize; 2]),
    /// A width, the input channels or the class count is zero.
    #[error("digits CNN widths, channels and classes must be non-zero")]
    Zero,
    /// The spec lacks a tensor of the digits CNN (or the tensor has too few dimensions).
    #[error("not a digits-CNN spec: no tensor `{0}`")]
    MissingTensor(String),
    /// The spec's input is not an image.
    #[error("not a digits-CNN spec: its input is not an image")]
    NotImage,
}

impl From<DigitsCnnError> for String {
    fn from(e: DigitsCnnError) -> String {
        e.to_string()
    }
}

impl crate::zoo::Net for DigitsCnn {
    fn architecture(&self) -> String {
        let [c, h, w] = self.shape;
        let [c1, c2, c3, f1, f2, k] = self.widths;
        format!("fedbn-digits-cnn(in={c}x{h}x{w},conv={c1}-{c2}-{c3},fc={f1}-{f2},classes={k})")
    }

    fn input_numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn features(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2> {
        self.low(x, 5, bn)
    }

    fn head(&self, h: Tensor<2>) -> Tensor<2> {
        self.fc3.forward(h)
    }

    /// After conv1, conv2 and conv3 (each with its BN, ReLU and pool), fc1 and fc2.
    fn split_points(&self) -> Vec<usize> {
        (1..=5).collect()
    }

    fn low(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let [n, _] = x.dims();
        let [c, h, w] = self.shape;
        let x: Tensor<4> = x.reshape([n, c, h, w]);
        let x = self
            .pool
            .forward(relu(norm(&self.bn1, self.conv1.forward(x), bn)));
        if split <= 1 {
            return x.flatten(1, 3);
        }
        let x = self
            .pool
            .forward(relu(norm(&self.bn2, self.conv2.forward(x), bn)));
        if split == 2 {
            return x.flatten(1, 3);
        }
        let x: Tensor<2> = relu(norm(&self.bn3, self.conv3.forward(x), bn)).flatten(1, 3);
        if split == 3 {
            return x;
        }
        let x = relu(norm(&self.bn4, self.fc1.forward(x), bn));
        if split == 4 {
            return x;
        }
        relu(norm(&self.bn5, self.fc2.forward(x), bn))
    }

    fn high(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let [n, _] = x.dims();
        let [_, h, w] = self.shape;
        let [c1, c2, ..] = self.widths;
        let mut x = x;
        if split <= 2 {
            let m: Tensor<4> = if split <= 1 {
                let m: Tensor<4> = x.reshape([n, c1, h / 2, w / 2]);
                self.pool
                    .forward(relu(norm(&self.bn2, self.conv2.forward(m), bn)))
            } else {
                x.reshape([n, c2, h / 4, w / 4])
            };
            x = relu(norm(&self.bn3, self.conv3.forward(m), bn)).flatten(1, 3);
        }
        if split <= 3 {
            x = relu(norm(&self.bn4, self.fc1.forward(x), bn));
        }
        if split <= 4 {
            x = relu(norm(&self.bn5, self.fc2.forward(x), bn));
        }
        self.fc3.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_digits_configuration_is_refused_naming_the_value() {
        assert_eq!(DigitsCnnConfig::default().validate(), Ok(()));
        let odd = DigitsCnnConfig {
            size: [30, 28],
            ..Default::default()
        };
        let err = odd.validate().unwrap_err();
        assert!(matches!(err, DigitsCnnError::Size([30, 28])));
        assert_eq!(
            String::from(err),
            "digits CNN input size [30, 28] must be non-zero multiples of 4"
        );
        let narrow = DigitsCnnConfig {
            fc: [0, 512],
            ..Default::default()
        };
        assert!(matches!(narrow.validate(), Err(DigitsCnnError::Zero)));
    }

    #[test]
    fn a_spec_without_the_digits_tensors_is_not_a_digits_spec() {
        let spec = unifed_protocol::ModelSpec {
            architecture: "fedbn-digits-cnn(64,64,128,2048,512)".into(),
            tensors: vec![],
            classes: vec!["0".into()],
            input: unifed_protocol::Input::Image {
                channels: 3,
                height: 28,
                width: 28,
                scaling: unifed_protocol::Scaling::ZeroToOne,
            },
        };
        assert!(matches!(
            DigitsCnnConfig::from_spec(&spec),
            Err(DigitsCnnError::MissingTensor(t)) if t == "conv1.weight"
        ));
    }
}
