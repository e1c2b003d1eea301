//! The MLP with BatchNorm1d of FedBN's ABIDE experiment: in -> 16 -> 16 -> classes.

use crate::bn::{BnPass, norm};
use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// Sizes of the MLP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    /// Input features.
    pub inputs: usize,
    /// Hidden widths (paper: 16, 16).
    pub hidden: [usize; 2],
    /// Number of classes.
    pub classes: usize,
}

impl MlpConfig {
    /// The ABIDE classifier shape: `inputs` -> 16 -> 16 -> `classes`.
    pub fn abide(inputs: usize, classes: usize) -> Self {
        MlpConfig {
            inputs,
            hidden: [16, 16],
            classes,
        }
    }

    /// Builds the model on `device`.
    pub fn init(&self, device: &Device) -> Mlp {
        let [h1, h2] = self.hidden;
        Mlp {
            fc1: LinearConfig::new(self.inputs, h1).init(device),
            bn1: BatchNormConfig::new(h1).init(device),
            fc2: LinearConfig::new(h1, h2).init(device),
            bn2: BatchNormConfig::new(h2).init(device),
            fc3: LinearConfig::new(h2, self.classes).init(device),
            sizes: [self.inputs, h1, h2, self.classes],
        }
    }
}

/// fc -> BN1d -> ReLU twice, then a linear classifier.
#[derive(Module, Debug)]
pub struct Mlp {
    fc1: Linear,
    bn1: BatchNorm,
    fc2: Linear,
    bn2: BatchNorm,
    fc3: Linear,
    sizes: [usize; 4],
}

impl crate::zoo::Net for Mlp {
    fn architecture(&self) -> String {
        let [i, a, b, k] = self.sizes;
        format!("mlp-bn(in={i},hidden={a}-{b},classes={k})")
    }

    fn input_numel(&self) -> usize {
        self.sizes[0]
    }

    fn features(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2> {
        self.low(x, 2, bn)
    }

    fn head(&self, h: Tensor<2>) -> Tensor<2> {
        self.fc3.forward(h)
    }

    /// After fc1 and after fc2 (each with its BN and ReLU).
    fn split_points(&self) -> Vec<usize> {
        vec![1, 2]
    }

    fn low(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let x = relu(norm(&self.bn1, self.fc1.forward(x), bn));
        if split <= 1 {
            return x;
        }
        relu(norm(&self.bn2, self.fc2.forward(x), bn))
    }

    fn high(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2> {
        let x = if split <= 1 {
            relu(norm(&self.bn2, self.fc2.forward(x), bn))
        } else {
            x
        };
        self.fc3.forward(x)
    }
}
