//! Local training (SGD, E epochs, seeded) and evaluation.
//!
//! The default recipe is FedBN's: lr 0.01, momentum 0, weight decay 0, batch 32, one local
//! epoch, cross-entropy; the optimiser state starts afresh on every call (every round).

use crate::bn::{BnPass, StreamConfig, StreamEstimator};
use crate::data::Dataset;
use crate::decoupled::{DecoupleOutcome, DecoupleRun};
use crate::error::{BnError, TrainError};
use crate::invariant::{MaskOutcome, MaskRun};
use crate::objective::Term;
use crate::zoo::Net;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Local training hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Learning rate. FedBN: 0.01.
    pub lr: f64,
    /// SGD momentum (PyTorch semantics, dampening 0). FedBN: 0.
    pub momentum: f64,
    /// Coupled L2 weight decay. FedBN: 0.
    pub weight_decay: f64,
    /// Mini-batch size. FedBN: 32.
    pub batch_size: usize,
    /// Local epochs E. FedBN: 1.
    pub epochs: usize,
    /// Seed of the sample order (epoch e uses a stream derived from it).
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            lr: 0.01,
            momentum: 0.0,
            weight_decay: 0.0,
            batch_size: 32,
            epochs: 1,
            seed: 0,
        }
    }
}

impl TrainConfig {
    /// Checks every value, naming the first bad one.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::BadConfig(m));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr must be positive and finite, got {}", self.lr));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!(
                "momentum must lie in [0, 1), got {}",
                self.momentum
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if self.batch_size < 2 {
            return bad(format!(
                "batch_size must be at least 2 (BatchNorm needs a batch variance), got {}",
                self.batch_size
            ));
        }
        if self.epochs == 0 {
            return bad("epochs must be at least 1".into());
        }
        Ok(())
    }
}

/// What happened during local training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReport {
    /// Mean training loss of each epoch.
    pub epoch_losses: Vec<f64>,
    /// Samples processed (over all epochs).
    pub samples: usize,
    /// Optimiser steps taken.
    pub steps: usize,
    /// FedCD's trained mask, mask gradient and risk, when the run trained under SCI.
    #[serde(default)]
    pub mask: Option<MaskOutcome>,
    /// FedImpro's running feature statistics, when the run trained under it.
    #[serde(default)]
    pub decoupled: Option<DecoupleOutcome>,
}

/// Progress events for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TrainEvent {
    /// Epoch `epoch` (0-based) starts with `steps` steps.
    EpochStart {
        /// Epoch index.
        epoch: usize,
        /// Steps in this epoch.
        steps: usize,
    },
    /// One step of `epoch` is done.
    Step {
        /// Epoch index.
        epoch: usize,
        /// Steps done in this epoch.
        done: usize,
    },
    /// Epoch finished with mean loss `loss`.
    EpochEnd {
        /// Epoch index.
        epoch: usize,
        /// Mean loss of the epoch.
        loss: f64,
    },
    /// Training is over and the model holds its result; a federated round encodes its update
    /// next (a process may hand training's buffers back to the system now).
    Trained,
}

/// Accuracy and loss of a model on a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// Samples evaluated.
    pub samples: usize,
    /// Correct predictions.
    pub correct: usize,
    /// Mean cross-entropy.
    pub loss: f64,
}

impl EvalReport {
    /// Fraction correct in [0, 1].
    pub fn accuracy(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.correct as f64 / self.samples as f64
        }
    }
}

fn check_data<N: Net>(net: &N, data: &Dataset, classes: usize) -> Result<(), TrainError> {
    if data.is_empty() {
        return Err(TrainError::EmptyDataset(data.name.clone()));
    }
    if data.features != net.input_numel() {
        return Err(TrainError::WrongInput {
            name: data.name.clone(),
            expected: net.input_numel(),
            found: data.features,
        });
    }
    if let Some(&label) = data.y.iter().find(|&&l| l >= classes) {
        return Err(TrainError::LabelOutOfRange {
            name: data.name.clone(),
            label,
            classes,
        });
    }
    Ok(())
}

/// Batches of a permutation; a trailing batch of one merges into the previous one (a single
/// sample has no batch variance, and BatchNorm1d cannot train on it).
fn batches(order: &[usize], batch_size: usize) -> Vec<&[usize]> {
    let mut out: Vec<&[usize]> = order.chunks(batch_size).collect();
    if out.len() > 1 && out.last().map(|b| b.len()) == Some(1) {
        out.pop();
        let start = (out.len() - 1) * batch_size;
        *out.last_mut().expect("non-empty") = &order[start..];
    }
    out
}

/// Builds input and target tensors of the samples `idx` of `data` on `device`.
pub fn batch_tensors(
    data: &Dataset,
    idx: &[usize],
    device: &Device,
) -> (Tensor<2>, Tensor<1, Int>) {
    let f = data.features;
    let mut x = Vec::with_capacity(idx.len() * f);
    for &i in idx {
        x.extend_from_slice(&data.x[i * f..(i + 1) * f]);
    }
    let y: Vec<i64> = idx.iter().map(|&i| data.y[i] as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [idx.len(), f]), device),
        Tensor::from_data(TensorData::new(y, [idx.len()]), device),
    )
}

/// Trains a copy of `net` on `data` for `cfg.epochs` epochs of SGD on `device` (the plain
/// device; gradients run on its autodiff form) and returns it in inference mode with a report.
/// BN layers train in batch-statistics mode and keep their own running statistics.
pub fn train_local<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    cfg: &TrainConfig,
    device: &Device,
    progress: impl FnMut(TrainEvent),
) -> Result<(N, TrainReport), TrainError> {
    train_objective(net, data, classes, cfg, &Term::None, device, progress)
}

/// [`train_local`] with the local objective a round's plan asks for, prepared from `net` as
/// `term` ([`Term::new`]): it adjusts the gradients at every step.
pub fn train_objective<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    cfg: &TrainConfig,
    term: &Term<N>,
    device: &Device,
    progress: impl FnMut(TrainEvent),
) -> Result<(N, TrainReport), TrainError> {
    let (net, report) = train_owned(net.clone(), data, classes, cfg, term, device, progress);
    report.map(|r| (net, r))
}

/// [`train_objective`] on a model it owns: with no other copy of the starting weights alive,
/// the optimiser's steps replace them and training holds one copy of the model. The model
/// always comes back: trained, as it stood when training diverged, or untouched after a config
/// or data error.
pub fn train_owned<N: Net>(
    net: N,
    data: &Dataset,
    classes: usize,
    cfg: &TrainConfig,
    term: &Term<N>,
    device: &Device,
    progress: impl FnMut(TrainEvent),
) -> (N, Result<TrainReport, TrainError>) {
    if let Err(e) = cfg
        .validate()
        .and_then(|()| check_data(&net, data, classes))
    {
        return (net, Err(e));
    }
    let model = net.valid().train();
    drop(net);
    let (model, report) = run_epochs(model, data, cfg, term, device, usize::MAX, progress);
    (model.valid(), report)
}

/// Per-FedAvg's personalisation: one SGD step of size `alpha` (no momentum, no weight decay) on
/// a copy of `net`, on the first batch of `batch_size` samples of `data` in the order a first
/// epoch of seed `seed` takes them. Returns the personalised copy in inference mode; `net`,
/// its BN statistics included, is untouched.
pub fn personalise<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    alpha: f64,
    batch_size: usize,
    seed: u64,
    device: &Device,
) -> Result<N, TrainError> {
    let cfg = TrainConfig {
        lr: alpha,
        batch_size,
        seed,
        ..TrainConfig::default()
    };
    cfg.validate()?;
    check_data(net, data, classes)?;
    // `valid()` gives the copy its own BN running statistics.
    let model = net.valid().train();
    let (model, report) = run_epochs(model, data, &cfg, &Term::None, device, 1, |_| {});
    report.map(|_| model.valid())
}

/// Shuffles `order` for epoch `epoch` of training with seed `seed`: each epoch shuffles the
/// previous epoch's order with a stream derived from the seed and the epoch.
pub fn shuffle_epoch(order: &mut [usize], seed: u64, epoch: usize) {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
}

/// Per-FedAvg's pairs of batches: the order in chunks of two batches, each split in halves
/// (the first for the inner step, the second for the outer one). A chunk too small to give
/// both halves two samples (BatchNorm needs a batch variance) serves as both.
pub fn meta_pairs(order: &[usize], batch_size: usize) -> Vec<(&[usize], &[usize])> {
    batches(order, 2 * batch_size)
        .into_iter()
        .map(|c| {
            let h = c.len() / 2;
            if h >= 2 && c.len() - h >= 2 {
                (&c[..h], &c[h..])
            } else {
                (c, c)
            }
        })
        .collect()
}

/// SGD with `cfg`'s momentum (PyTorch's: no dampening, which burn defaults to 0.1) and weight
/// decay.
fn sgd(cfg: &TrainConfig) -> SgdConfig {
    let mut sgd = SgdConfig::new();
    if cfg.momentum > 0.0 {
        sgd = sgd.with_momentum(Some(
            MomentumConfig::new()
                .with_momentum(cfg.momentum)
                .with_dampening(0.0),
        ));
    }
    if cfg.weight_decay > 0.0 {
        sgd = sgd.with_weight_decay(Some(WeightDecayConfig::new(cfg.weight_decay as f32)));
    }
    sgd
}

/// The epochs of [`train_owned`] on `model` in autodiff mode, stopping after `limit` steps;
/// returns it as it stands at the end or when the loss diverged.
fn run_epochs<N: Net>(
    mut model: N,
    data: &Dataset,
    cfg: &TrainConfig,
    term: &Term<N>,
    device: &Device,
    limit: usize,
    mut progress: impl FnMut(TrainEvent),
) -> (N, Result<TrainReport, TrainError>) {
    let ad = device.clone().autodiff();
    let mut optim = sgd(cfg).init();
    // Per-FedAvg's two steps are plain SGD, as in its paper.
    let mut meta_optim = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&ad);
    let mut report = TrainReport {
        epoch_losses: Vec::new(),
        samples: 0,
        steps: 0,
        mask: None,
        decoupled: None,
    };
    let mut sci = term.intervener().map(|i| i.start(&ad));
    let mut split = term.decoupler().map(|d| d.start(&ad, cfg.seed));
    let mut order: Vec<usize> = (0..data.len()).collect();
    for epoch in 0..cfg.epochs {
        shuffle_epoch(&mut order, cfg.seed, epoch);
        let steps: Vec<(&[usize], &[usize])> = match term.meta() {
            Some(_) => meta_pairs(&order, cfg.batch_size),
            None => batches(&order, cfg.batch_size)
                .into_iter()
                .map(|b| (b, &b[..0]))
                .collect(),
        };
        progress(TrainEvent::EpochStart {
            epoch,
            steps: steps.len(),
        });
        // Each step's loss and batch size, read once the epoch is done: a read is a host sync,
        // which on a GPU would stall every step between its forward and backward passes.
        let mut losses = Losses::default();
        for (k, (first, second)) in steps.iter().enumerate() {
            if report.steps == limit {
                break;
            }
            let (x, y) = batch_tensors(data, first, &ad);
            let labels: Vec<usize> = first.iter().map(|&i| data.y[i]).collect();
            // FedCD's mask, a leaf of this step's graph, scales the representation.
            let leaf = sci.as_ref().map(|s| s.leaf());
            let (z, logits) = forward_step(&model, x.clone(), (leaf.as_ref(), &mut split), &labels);
            let loss = loss_fn.forward(logits.clone(), y.clone());
            // The reported loss is the cross-entropy alone, comparable across objectives.
            losses.push(&loss, first.len());
            // FedImpro's synthetic features train the head beside the real batch.
            let loss = match split
                .as_mut()
                .and_then(|r| r.synthetic_loss(&model, &labels, &loss_fn))
            {
                Some(synthetic) => loss + synthetic,
                None => loss,
            };
            let loss = match term.contrast() {
                Some(c) => loss + c.loss(z.clone(), &x),
                None => loss,
            };
            let loss = match &mut sci {
                Some(s) => s.loss(&model, z, logits, y, loss),
                None => loss,
            };
            let raw = loss.backward();
            if let (Some(s), Some(leaf)) = (&mut sci, &leaf) {
                s.step(leaf, &raw, cfg.lr);
            }
            let mut grads = GradientsParams::from_grads(raw, &model);
            term.apply(&model, &mut grads);
            model = match term.meta() {
                None => optim.step(cfg.lr, model, grads),
                Some((alpha, beta)) => {
                    // First order: the gradient of the second batch at the model one step of
                    // alpha ahead, applied with step beta to the model as it was.
                    let start = model.clone();
                    let ahead = meta_optim.step(alpha, model, grads);
                    let (x, y) = batch_tensors(data, second, &ad);
                    let loss = loss_fn.forward(ahead.forward(x, &mut BnPass::standard()), y);
                    losses.push(&loss, second.len());
                    let grads = GradientsParams::from_grads(loss.backward(), &ahead);
                    drop(ahead);
                    meta_optim.step(beta, start, grads)
                }
            };
            report.steps += 1;
            report.samples += if std::ptr::eq(*first, *second) {
                first.len()
            } else {
                first.len() + second.len()
            };
            progress(TrainEvent::Step { epoch, done: k + 1 });
        }
        let loss = losses.mean();
        if !loss.is_finite() {
            return (model, Err(TrainError::Diverged(loss, epoch)));
        }
        report.epoch_losses.push(loss);
        progress(TrainEvent::EpochEnd { epoch, loss });
        if report.steps == limit {
            break;
        }
    }
    report.mask = sci.map(MaskRun::finish);
    report.decoupled = split.map(DecoupleRun::finish);
    (model, Ok(report))
}

/// One step's forward pass of `model` on `x` (training's BN behaviour): the representation
/// and the logits. FedCD's `mask` scales the representation before the head; under FedImpro's
/// `split` the representation is the low-level part's output, whose statistics the run takes
/// from the batch of `labels`.
fn forward_step<N: Net>(
    model: &N,
    x: Tensor<2>,
    (mask, split): (Option<&Tensor<2>>, &mut Option<DecoupleRun>),
    labels: &[usize],
) -> (Tensor<2>, Tensor<2>) {
    let mut pass = BnPass::standard();
    if let Some(run) = split {
        let h = model.low(x, run.split(), &mut pass);
        run.observe(&h, labels);
        let logits = model.high(h.clone(), run.split(), &mut pass);
        return (h, logits);
    }
    let z = model.features(x, &mut pass);
    let logits = match mask {
        Some(m) => model.head(z.clone() * m.clone()),
        None => model.head(z.clone()),
    };
    (z, logits)
}

/// The batch size a site evaluates in: its test split, validation, and onboarding checks.
/// Inference gives each sample the same logits in any batch; at 64 the digits CNN's largest
/// activations are about 13 MB, against 51 MB at 256 (an agent's evaluation peak went from 205
/// to 130 MiB, in the same time).
pub const EVAL_BATCH: usize = 64;

/// Evaluates `net` with its stored BN statistics (inference mode) in batches of `batch_size`.
pub fn evaluate<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    batch_size: usize,
    device: &Device,
) -> Result<EvalReport, TrainError> {
    evaluate_masked(net, data, classes, batch_size, device, None)
}

/// [`evaluate`] with the representation scaled by `mask` before the head (FedCD's), one value
/// per input of the classifier; `None`: unmasked. A mask of another width is an error.
pub fn evaluate_masked<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    batch_size: usize,
    device: &Device,
    mask: Option<&[f32]>,
) -> Result<EvalReport, TrainError> {
    check_data(net, data, classes)?;
    let net = net.valid();
    let device = device.clone().without_autodiff();
    let mask =
        mask.map(|m| Tensor::<2>::from_data(TensorData::new(m.to_vec(), [1, m.len()]), &device));
    let idx: Vec<usize> = (0..data.len()).collect();
    let mut scores = Scores::default();
    for chunk in idx.chunks(batch_size.max(1)) {
        let (x, y) = batch_tensors(data, chunk, &device);
        let logits = match &mask {
            None => net.forward(x, &mut BnPass::standard()),
            Some(m) => {
                let h = net.features(x, &mut BnPass::standard());
                if h.dims()[1] != m.dims()[1] {
                    return Err(TrainError::BadConfig(format!(
                        "a mask of {} values for a representation of {}",
                        m.dims()[1],
                        h.dims()[1]
                    )));
                }
                net.head(h * m.clone())
            }
        };
        scores.push(logits, y, chunk.len());
    }
    Ok(scores.report())
}

/// Steps' losses and batch sizes, kept on the device until read together: one host sync for
/// them all instead of one per step.
#[derive(Default)]
struct Losses {
    losses: Vec<Tensor<1>>,
    sizes: Vec<usize>,
}

impl Losses {
    /// Keeps `loss` (a mean over `n` samples), without its autodiff graph.
    fn push(&mut self, loss: &Tensor<1>, n: usize) {
        self.losses.push(loss.clone().without_autodiff());
        self.sizes.push(n);
    }

    /// The losses read back in one go: their sum over samples (each mean times its batch size,
    /// added in f64 in the order pushed) and the number of samples.
    fn total(self) -> (f64, usize) {
        if self.losses.is_empty() {
            return (0.0, 0);
        }
        let values = Tensor::cat(self.losses, 0).into_data();
        let mut sum = 0.0f64;
        for (l, &n) in values.iter::<f32>().zip(&self.sizes) {
            sum += l as f64 * n as f64;
        }
        (sum, self.sizes.iter().sum())
    }

    /// The mean loss over every sample (0 when nothing was pushed).
    fn mean(self) -> f64 {
        let (sum, samples) = self.total();
        sum / samples.max(1) as f64
    }
}

/// An evaluation's batches: their losses and counts of correct predictions, read together.
#[derive(Default)]
struct Scores {
    losses: Losses,
    correct: Vec<Tensor<1, Int>>,
}

impl Scores {
    /// Scores one batch of `n` samples.
    fn push(&mut self, logits: Tensor<2>, y: Tensor<1, Int>, n: usize) {
        let device = logits.device();
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.clone(), y.clone());
        let pred = logits.argmax(1).reshape([n]);
        self.correct.push(pred.equal(y).int().sum());
        self.losses.push(&loss, n);
    }

    /// The report: the mean loss over all samples and the number predicted right.
    fn report(self) -> EvalReport {
        let correct: usize = if self.correct.is_empty() {
            0
        } else {
            Tensor::cat(self.correct, 0)
                .into_data()
                .iter::<i64>()
                .map(|c| c as usize)
                .sum()
        };
        let (loss, samples) = self.losses.total();
        EvalReport {
            samples,
            correct,
            loss: loss / samples as f64,
        }
    }
}

/// Evaluates `net` under `stream` BN re-estimation (UniFed Algorithm 1): the test samples, in
/// the order given by `order` (all of them, each once), arrive in batches of `cfg.batch_size`;
/// each batch is normalised with statistics updated by that batch.
pub fn evaluate_stream<N: Net>(
    net: &N,
    data: &Dataset,
    classes: usize,
    cfg: &StreamConfig,
    order: &[usize],
    device: &Device,
) -> Result<EvalReport, crate::error::BnError> {
    check_data(net, data, classes).map_err(|_| BnError::WrongInput {
        expected: net.input_numel(),
        found: data.features,
    })?;
    let ranges = crate::bn::bn_batches(order.len(), cfg.batch_size)?;
    let net = net.valid();
    let device = device.clone().without_autodiff();
    let mut est = StreamEstimator::new(cfg.tau, cfg.start)?;
    let mut scores = Scores::default();
    for r in ranges {
        let chunk = &order[r];
        let (x, y) = batch_tensors(data, chunk, &device);
        let logits = est.forward(&net, x)?;
        scores.push(logits, y, chunk.len());
    }
    Ok(scores.report())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_merge_a_trailing_single_sample() {
        let order: Vec<usize> = (0..65).collect();
        let b = batches(&order, 32);
        assert_eq!(b.iter().map(|b| b.len()).collect::<Vec<_>>(), vec![32, 33]);
        let order: Vec<usize> = (0..743).collect();
        let b = batches(&order, 32);
        assert_eq!(b.len(), 24);
        assert_eq!(b[23].len(), 7);
    }

    #[test]
    fn config_validation_names_the_bad_value() {
        let cfg = TrainConfig {
            batch_size: 1,
            ..Default::default()
        };
        assert!(
            matches!(cfg.validate(), Err(TrainError::BadConfig(m)) if m.contains("batch_size"))
        );
        let cfg = TrainConfig {
            lr: f64::NAN,
            ..Default::default()
        };
        assert!(matches!(cfg.validate(), Err(TrainError::BadConfig(m)) if m.contains("lr")));
    }
}
