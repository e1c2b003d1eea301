//! ResNet-18 with BatchNorm, named as torchvision's so its checkpoints load: configurable input
//! channels, input size, class count, stem and width, with a split stage for methods that
//! separate a low-level feature extractor from a high-level head (FedImpro).

use crate::bn::{BnPass, norm};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// The first layers of the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stem {
    /// torchvision's: 7x7 conv stride 2 and a 3x3 stride-2 max-pool (inputs of ~224 px).
    Imagenet,
    /// 3x3 conv stride 1 and no pool, for small inputs (28-64 px).
    Cifar,
}

/// ResNet-18 configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResNetConfig {
    /// Input channels (1 for grey medical images, 3 for colour).
    pub in_channels: usize,
    /// Input height and width.
    pub size: [usize; 2],
    /// Number of classes.
    pub classes: usize,
    /// Width of the first stage (64 in ResNet-18; stages are w, 2w, 4w, 8w).
    pub width: usize,
    /// Stem variant.
    pub stem: Stem,
    /// A stage (0: after the stem, to 4: after layer4) named in the architecture string, kept so
    /// that models written with it load; FedImpro's plan chooses where a model splits
    /// ([`crate::zoo::Net::split_points`]; stage `s` is split point `1 + 4 s`).
    pub split: usize,
}

impl ResNetConfig {
    /// Standard ResNet-18 (width 64) for `in_channels` x `size` inputs and `classes` classes,
    /// with the stem chosen by the input size.
    pub fn new(in_channels: usize, size: [usize; 2], classes: usize) -> Self {
        let stem = if size[0].min(size[1]) >= 128 {
            Stem::Imagenet
        } else {
            Stem::Cifar
        };
        ResNetConfig {
            in_channels,
            size,
            classes,
            width: 64,
            stem,
            split: 2,
        }
    }

    /// Checks the values, returning an error naming the bad one.
    pub fn validate(&self) -> Result<(), ResNetConfigError> {
        if self.split > 4 {
            return Err(ResNetConfigError::Split(self.split));
        }
        if self.in_channels == 0 || self.classes == 0 || self.width == 0 || self.size.contains(&0) {
            return Err(ResNetConfigError::Zero);
        }
        Ok(())
    }

    /// Builds the model on `device`.
    pub fn init(&self, device: &Device) -> ResNet {
        let w = self.width;
        let (conv1, maxpool) = match self.stem {
            Stem::Imagenet => (
                conv(self.in_channels, w, 7, 2, 3, device),
                Some(
                    MaxPool2dConfig::new([3, 3])
                        .with_strides([2, 2])
                        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                        .init(),
                ),
            ),
            Stem::Cifar => (conv(self.in_channels, w, 3, 1, 1, device), None),
        };
        let stage = |i: usize, o: usize, stride: usize| {
            vec![
                BasicBlock::new(i, o, stride, device),
                BasicBlock::new(o, o, 1, device),
            ]
        };
        ResNet {
            conv1,
            bn1: BatchNormConfig::new(w).init(device),
            maxpool,
            layer1: stage(w, w, 1),
            layer2: stage(w, 2 * w, 2),
            layer3: stage(2 * w, 4 * w, 2),
            layer4: stage(4 * w, 8 * w, 2),
            fc: LinearConfig::new(8 * w, self.classes).init(device),
            shape: [self.in_channels, self.size[0], self.size[1]],
            meta: [
                self.width,
                self.classes,
                self.split,
                matches!(self.stem, Stem::Imagenet) as usize,
            ],
        }
    }
}

/// Why a [`ResNetConfig`] is refused by [`ResNetConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResNetConfigError {
    /// The split stage is past the last stage (4).
    #[error("ResNet split stage {0} must be 0..=4")]
    Split(usize),
    /// The input channels, classes, width or an input side is zero.
    #[error("ResNet channels, classes, width and size must be non-zero")]
    Zero,
}

impl From<ResNetConfigError> for String {
    fn from(e: ResNetConfigError) -> String {
        e.to_string()
    }
}

fn conv(i: usize, o: usize, k: usize, stride: usize, pad: usize, device: &Device) -> Conv2d {
    Conv2dConfig::new([i, o], [k, k])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .init(device)
}

/// The 1x1 conv + BN shortcut of a block that changes shape (torchvision's `downsample.0/1`).
#[derive(Module, Debug)]
pub struct Downsample {
    conv: Conv2d,
    bn: BatchNorm,
}

/// Two 3x3 convs with BN and a residual connection.
#[derive(Module, Debug)]
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    downsample: Option<Downsample>,
}

impl BasicBlock {
    fn new(i: usize, o: usize, stride: usize, device: &Device) -> Self {
        let downsample = (stride != 1 || i != o).then(|| Downsample {
            conv: conv(i, o, 1, stride, 0, device),
            bn: BatchNormConfig::new(o).init(device),
        });
        BasicBlock {
            conv1: conv(i, o, 3, stride, 1, device),
            bn1: BatchNormConfig::new(o).init(device),
            conv2: conv(o, o, 3, 1, 1, device),
            bn2: BatchNormConfig::new(o).init(device),
            downsample,
        }
    }

    fn forward(&self, x: Tensor<4>, bn: &mut BnPass) -> Tensor<4> {
        let out = relu(norm(&self.bn1, self.conv1.forward(x.clone()), bn));
        let out = norm(&self.bn2, self.conv2.forward(out), bn);
        let identity = match &self.downsample {
            Some(d) => norm(&d.bn, d.conv.forward(x), bn),
            None => x,
        };
        relu(out + identity)
    }
}

/// ResNet-18: stem, four stages of two basic blocks, global average pool, linear classifier.
#[derive(Module, Debug)]
pub struct ResNet {
    conv1: Conv2d,
    bn1: BatchNorm,
    maxpool: Option<MaxPool2d>,
    layer1: Vec<BasicBlock>,
    layer2: Vec<BasicBlock>,
    layer3: Vec<BasicBlock>,
    layer4: Vec<BasicBlock>,
    fc: Linear,
    shape: [usize; 3],
    meta: [usize; 4],
}

/// The global average pool: `[n, c, h, w]` -> `[n, c]`.
fn pool(x: Tensor<4>) -> Tensor<2> {
    let [n, c, _, _] = x.dims();
    x.mean_dim(2).mean_dim(3).reshape([n, c])
}

impl ResNet {
    /// The eight basic blocks in forward order.
    fn blocks(&self) -> impl Iterator<Item = &BasicBlock> {
        [&self.layer1, &self.layer2, &self.layer3, &self.layer4]
            .into_iter()
            .flatten()
    }

    /// The shape `[channels, height, width]` of one sample's feature map after the stem and
    /// `blocks` basic blocks (each stage after the first halves the map, rounding up).
    fn map_shape(&self, blocks: usize) -> [usize; 3] {
        let half = |x: usize| x.div_ceil(2);
        let [_, mut h, mut w] = self.shape;
        if self.meta[3] == 1 {
            // The 7x7 stride-2 conv and the 3x3 stride-2 max-pool.
            (h, w) = (half(half(h)), half(half(w)));
        }
        let stage = blocks.saturating_sub(1) / 2;
        for _ in 0..stage.min(3) {
            (h, w) = (half(h), half(w));
        }
        [self.meta[0] << stage.min(3), h, w]
    }
}

impl crate::zoo::Net for ResNet {
    fn architecture(&self) -> String {
        let [c, h, w] = self.shape;
        let [width, k, split, imagenet] = self.meta;
        let stem = if imagenet == 1 { "imagenet" } else { "cifar" };
        format!("resnet18(in={c}x{h}x{w},width={width},stem={stem},split={split},classes={k})")
    }

    fn input_numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn features(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2> {
        let [n, _] = x.dims();
        let h = crate::zoo::Net::low(self, x, 17, bn);
        let [c, mh, mw] = self.map_shape(8);
        pool(h.reshape([n, c, mh, mw]))
    }

    /// After the stem's conv (1) and after each basic block (3, 5, ..., 17: FedImpro counts
    /// two weight layers a block, the shortcut's 1x1 conv not among them, and its Table 3
    /// splits at 5, 9, 13 and 17, the ends of the four stages).
    fn split_points(&self) -> Vec<usize> {
        (0..=8).map(|b| 1 + 2 * b).collect()
    }

    fn low(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let [n, _] = x.dims();
        let [c, h, w] = self.shape;
        let x: Tensor<4> = x.reshape([n, c, h, w]);
        let mut x = relu(norm(&self.bn1, self.conv1.forward(x), bn));
        if let Some(p) = &self.maxpool {
            x = p.forward(x);
        }
        for block in self.blocks().take(split.saturating_sub(1) / 2) {
            x = block.forward(x, bn);
        }
        x.flatten(1, 3)
    }

    fn high(&self, h: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let [n, _] = h.dims();
        let done = (split.saturating_sub(1) / 2).min(8);
        let [c, mh, mw] = self.map_shape(done);
        let mut x: Tensor<4> = h.reshape([n, c, mh, mw]);
        for block in self.blocks().skip(done) {
            x = block.forward(x, bn);
        }
        self.fc.forward(pool(x))
    }

    fn head(&self, h: Tensor<2>) -> Tensor<2> {
        self.fc.forward(h)
    }

    fn torch_path(&self, burn_path: &str) -> String {
        burn_path
            .replace(".downsample.conv.", ".downsample.0.")
            .replace(".downsample.bn.", ".downsample.1.")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_resnet_configuration_is_refused_naming_the_value() {
        let ok = ResNetConfig::new(3, [32, 32], 10);
        assert_eq!(ok.validate(), Ok(()));
        let split = ResNetConfig {
            split: 5,
            ..ok.clone()
        };
        assert_eq!(split.validate(), Err(ResNetConfigError::Split(5)));
        let zero = ResNetConfig { classes: 0, ..ok };
        assert!(matches!(zero.validate(), Err(ResNetConfigError::Zero)));
        assert_eq!(
            String::from(ResNetConfigError::Zero),
            "ResNet channels, classes, width and size must be non-zero"
        );
    }
}
