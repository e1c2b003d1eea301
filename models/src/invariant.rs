//! FedCD's SCI term (Chen et al., "FedCD", sections 3.2-3.3): a site scales the representation
//! in front of its linear classifier by a mask `m` of its own and adds
//! `lambda ||g_e - g_g||^2` to its loss, where `g_e` is the gradient of the batch's
//! cross-entropy with respect to `m` and `g_g` the federation's mean of the sites' mask
//! gradients.
//!
//! burn has no double backward, and the penalty is a function of a gradient. Since the mask sits
//! right before the linear head `logits = (m ⊙ h) W + b`, that gradient has a closed form in
//! the features, the head and the softmax ([`mask_gradient`]):
//!
//! ```text
//! g_e = (1/n) sum_i h_i ⊙ ((p_i - y_i) W^T)        p_i = softmax(logits_i), y_i one-hot
//! ```
//!
//! written with tensor operations inside the graph, so first-order autodiff trains the penalty
//! through `h` (the backbone), `W`, `b` and `m` alike. `W` is read through the head itself,
//! `head(I) - head(0)`, so any affine head qualifies (every model of the zoo ends in one
//! linear layer).
//!
//! The mask trains by plain SGD at the site's learning rate, on the gradient of the whole local
//! loss (penalty included), as the paper's "intervener optimiser" beside the model's.

use crate::zoo::Net;
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};

/// The gradient of the mean cross-entropy of `head(m ⊙ h)` with respect to the mask `m`, in
/// closed form, `[1, d]`, from the batch's features `h` (`[n, d]`, before the mask), its
/// masked `logits` (`[n, classes]`) and labels `y`. Differentiable in `h`, the head and `m`
/// through the logits.
pub fn mask_gradient<N: Net>(
    net: &N,
    h: Tensor<2>,
    logits: Tensor<2>,
    y: Tensor<1, Int>,
) -> Tensor<2> {
    let [n, d] = h.dims();
    let [_, classes] = logits.dims();
    let device = h.device();
    // The head's weight, [d, classes], as a function of its parameters.
    let w = net.head(Tensor::eye(d, &device)) - net.head(Tensor::zeros([1, d], &device));
    let residual = softmax(logits, 1) - y.one_hot::<2>(classes).float();
    let upstream = residual.matmul(w.transpose()).div_scalar(n as f64);
    (upstream * h).sum_dim(0)
}

/// What a site trained under SCI leaves: its trained mask, its round-mean mask gradient and its
/// training risk.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MaskOutcome {
    /// The mask after training.
    pub mask: Vec<f32>,
    /// The gradient of the cross-entropy with respect to the mask, averaged over every sample
    /// of the run (each batch's closed-form gradient weighted by its size).
    pub gradient: Vec<f32>,
    /// The mean over those samples of the whole local loss, penalty included (FedCD's `R_e`).
    pub risk: f64,
}

/// SCI prepared for one local training run: its weight, the federation's mask gradient and the
/// mask the site starts from.
#[derive(Debug, Clone)]
pub struct Intervener {
    lambda: f64,
    global: Option<Vec<f32>>,
    mask: Vec<f32>,
}

impl Intervener {
    /// SCI of weight `lambda` against the federation's mask gradient `global` (`None` before
    /// the first round closes: the penalty is left out), from the site's `mask`.
    pub fn new(lambda: f64, global: Option<Vec<f32>>, mask: Vec<f32>) -> Self {
        Intervener {
            lambda,
            global,
            mask,
        }
    }

    /// The mask's width.
    pub fn width(&self) -> usize {
        self.mask.len()
    }

    /// A run of training under this term, on the autodiff `device`.
    pub fn start(&self, device: &Device) -> MaskRun {
        let d = self.mask.len();
        let row = |v: &[f32]| Tensor::<2>::from_data(TensorData::new(v.to_vec(), [1, d]), device);
        MaskRun {
            lambda: self.lambda,
            global: self.global.as_deref().map(|g| row(g).inner()),
            mask: row(&self.mask).inner(),
            gradients: None,
            risks: Vec::new(),
            sizes: Vec::new(),
        }
    }
}

/// The mask being trained, and what the run has seen of its gradient and risk (kept on the
/// device and read once at the end, as training's losses are).
pub struct MaskRun {
    lambda: f64,
    global: Option<Tensor<2>>,
    mask: Tensor<2>,
    gradients: Option<Tensor<2>>,
    risks: Vec<Tensor<1>>,
    sizes: Vec<usize>,
}

impl MaskRun {
    /// The mask as a leaf of this step's graph (autodiff, requiring its gradient).
    pub fn leaf(&self) -> Tensor<2> {
        self.mask.clone().autodiff().require_grad()
    }

    /// The step's whole local loss from its cross-entropy `ce` over `logits = head(leaf ⊙ h)`:
    /// `ce + lambda ||g_e - g_g||^2` (`ce` alone before a federation mean exists). Keeps the
    /// batch's mask gradient and loss for the run's outcome.
    pub fn loss<N: Net>(
        &mut self,
        net: &N,
        h: Tensor<2>,
        logits: Tensor<2>,
        y: Tensor<1, Int>,
        ce: Tensor<1>,
    ) -> Tensor<1> {
        let n = h.dims()[0];
        let g = mask_gradient(net, h, logits, y);
        let weighted = g.clone().inner().mul_scalar(n as f64);
        self.gradients = Some(match self.gradients.take() {
            Some(sum) => sum + weighted,
            None => weighted,
        });
        let total = match &self.global {
            // The federation's mean enters as a constant.
            Some(gg) => {
                ce + (g - gg.clone())
                    .powi_scalar(2)
                    .sum()
                    .mul_scalar(self.lambda)
            }
            None => ce,
        };
        self.risks.push(total.clone().inner());
        self.sizes.push(n);
        total
    }

    /// One plain SGD step of the mask, `m <- m - lr dL/dm`, from the step's gradients of
    /// `leaf` (no step when the loss did not reach it).
    pub fn step(&mut self, leaf: &Tensor<2>, grads: &Gradients, lr: f64) {
        if let Some(g) = leaf.grad(grads) {
            self.mask = self.mask.clone() - g.inner().mul_scalar(lr);
        }
    }

    /// The run's outcome, read from the device in one go.
    pub fn finish(self) -> MaskOutcome {
        let samples: usize = self.sizes.iter().sum();
        let read = |t: Tensor<2>| -> Vec<f32> { t.into_data().iter::<f32>().collect() };
        let d = self.mask.dims()[1];
        let gradient = match self.gradients {
            Some(sum) => read(sum.div_scalar(samples.max(1) as f64)),
            None => vec![0.0; d],
        };
        let risk = match self.risks.is_empty() {
            true => 0.0,
            false => {
                let values = Tensor::cat(self.risks, 0).into_data();
                let sum: f64 = values
                    .iter::<f32>()
                    .zip(&self.sizes)
                    .map(|(l, &n)| l as f64 * n as f64)
                    .sum();
                sum / samples.max(1) as f64
            }
        };
        MaskOutcome {
            mask: read(self.mask),
            gradient,
            risk,
        }
    }
}
