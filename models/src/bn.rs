//! Client-specific BatchNorm: the hook every model's BN layer goes through, and the two
//! re-estimation modes of BN statistics.
//!
//! Every model routes each BatchNorm layer through [`norm`] with a [`BnPass`] that says how the
//! layer normalises:
//! - [`BnPass::standard`]: burn's own behaviour (batch statistics and a running-statistics update
//!   in training, stored statistics otherwise);
//! - [`BnPass::batch_only`]: batch statistics, running statistics untouched;
//! - `stream` ([`StreamEstimator`], UniFed Algorithm 1, "federated testing"): test batches arrive
//!   in sequence; during each batch's forward pass every BN layer updates
//!   `mu <- tau*mu + (1-tau)*mean(batch)`, `var <- tau*var + (1-tau)*var(batch)` (biased batch
//!   variance) and normalises *that* batch with the updated estimate;
//! - `calibrate` ([`crate::calibrate::calibrate`], FedBN appendix G, onboarding a site): each layer's population
//!   mean and biased variance over all the site's images, layer by layer in forward order,
//!   pooled exactly (default) or as the tau-EMA over batches; the result is stored in the model.
//!
//! Neither mode changes a non-BN tensor or a BN affine parameter (gamma, beta).
//!
//! `tau` is the weight on history (UniFed's notation); burn's and PyTorch's BN `momentum` is
//! the weight on the new batch, i.e. `1 - tau`.

use crate::error::BnError;
use burn::module::ParamId;
use burn::nn::BatchNorm;
use burn::tensor::Tensor;
use std::collections::HashMap;

/// Where an estimate starts before the first batch is seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BnStart {
    /// Start from the statistics stored in the model (the global model's own).
    Stored,
    /// Start from the first batch's statistics (the first batch is normalised by itself).
    FirstBatch,
}

/// Options of `stream` re-estimation (UniFed Algorithm 1).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StreamConfig {
    /// Weight on history in `[0, 1]`; 0 normalises each batch by its own statistics. Default 0.9.
    pub tau: f64,
    /// Test batch size. Default 32 (UniFed's setting).
    pub batch_size: usize,
    /// Starting statistics. Default [`BnStart::Stored`]: Algorithm 1 starts from the
    /// deployed global model's statistics.
    pub start: BnStart,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            tau: 0.9,
            batch_size: 32,
            start: BnStart::Stored,
        }
    }
}

/// How `calibrate` pools statistics over batches.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Estimator {
    /// The exact population mean and biased variance over all images (one pass per BN layer).
    Exact,
    /// The tau-EMA over batches, one pass, as `stream` does.
    Ema {
        /// Weight on history in `[0, 1]`.
        tau: f64,
    },
}

/// Options of `calibrate` re-estimation (onboarding a site).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CalibrateConfig {
    /// Exact pooling (default) or an EMA.
    pub estimator: Estimator,
    /// Images per forward pass. Default 64; it does not change an exact estimate.
    pub batch_size: usize,
    /// Starting statistics of the EMA (ignored by `Exact`). Default [`BnStart::FirstBatch`],
    /// since calibration estimates the site's population, not a blend with the global model.
    pub start: BnStart,
}

impl Default for CalibrateConfig {
    fn default() -> Self {
        CalibrateConfig {
            estimator: Estimator::Exact,
            batch_size: 64,
            start: BnStart::FirstBatch,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Mode {
    Standard,
    Batch,
    Stream { tau: f64, start: BnStart },
    Collect { target: usize },
}

/// Per-channel moments accumulated in f64 (Chan's parallel update), exact over batches.
#[derive(Debug, Clone, Default)]
pub(crate) struct Moments {
    n: f64,
    mean: Vec<f64>,
    m2: Vec<f64>,
}

impl Moments {
    fn add(&mut self, n_b: usize, mean_b: &[f32], var_b: &[f32]) {
        let n_b = n_b as f64;
        if self.mean.is_empty() {
            self.mean = vec![0.0; mean_b.len()];
            self.m2 = vec![0.0; mean_b.len()];
        }
        let total = self.n + n_b;
        for c in 0..mean_b.len() {
            let delta = mean_b[c] as f64 - self.mean[c];
            self.mean[c] += delta * n_b / total;
            self.m2[c] += var_b[c] as f64 * n_b + delta * delta * self.n * n_b / total;
        }
        self.n = total;
    }

    pub(crate) fn finish(&self) -> (Vec<f32>, Vec<f32>) {
        let mean = self.mean.iter().map(|&m| m as f32).collect();
        let var = self.m2.iter().map(|&m| (m / self.n) as f32).collect();
        (mean, var)
    }
}

/// The container type burn gives a BatchNorm layer's module (how a visitor tells BN tensors
/// apart).
pub const BN_CONTAINER: &str = "Struct:BatchNorm";

/// The state of one forward pass through a model's BN layers: how they normalise and the
/// statistics they carry between batches. Layers are keyed by their gamma's parameter id, so
/// the order of fields in a struct never matters.
#[derive(Debug, Clone)]
pub struct BnPass {
    mode: Mode,
    cursor: usize,
    pub(crate) order: Vec<ParamId>,
    pub(crate) stats: HashMap<ParamId, (Tensor<1>, Tensor<1>)>,
    pub(crate) collected: Moments,
}

impl BnPass {
    /// burn's own BN behaviour: batch statistics while training, stored statistics otherwise.
    pub fn standard() -> Self {
        Self::with_mode(Mode::Standard)
    }

    /// Batch statistics and nothing stored: each layer normalises the batch by its own mean
    /// and biased variance, as training does, and leaves the running statistics as they are
    /// (FedImpro's synthetic features train the head without entering the site's BN
    /// statistics).
    pub fn batch_only() -> Self {
        Self::with_mode(Mode::Batch)
    }

    pub(crate) fn with_mode(mode: Mode) -> Self {
        BnPass {
            mode,
            cursor: 0,
            order: Vec::new(),
            stats: HashMap::new(),
            collected: Moments::default(),
        }
    }

    /// Number of BN layers the last forward pass went through.
    pub fn layers_seen(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn begin(&mut self) {
        self.cursor = 0;
    }

    fn next_layer(&mut self, id: ParamId) -> usize {
        let i = self.cursor;
        if i == self.order.len() {
            self.order.push(id);
        }
        self.cursor += 1;
        i
    }
}

/// Biased per-channel mean and variance of `x` over every axis but 1, and the count n
/// (N for `[N, C]`, N*H*W for `[N, C, H, W]`).
pub fn batch_moments<const D: usize>(x: &Tensor<D>) -> (Tensor<1>, Tensor<1>, usize) {
    let dims = x.dims();
    let c = dims[1];
    let n = dims.iter().product::<usize>() / c;
    let flat: Tensor<2> = x.clone().swap_dims(0, 1).reshape([c, n]);
    let mean = flat.clone().mean_dim(1);
    let var = (flat - mean.clone()).powi_scalar(2).mean_dim(1);
    (mean.reshape([c]), var.reshape([c]), n)
}

fn normalise<const D: usize>(
    bn: &BatchNorm,
    x: Tensor<D>,
    mean: Tensor<1>,
    var: Tensor<1>,
) -> Tensor<D> {
    burn::tensor::module::batch_norm(x, bn.gamma.val(), bn.beta.val(), mean, var, bn.epsilon)
}

/// Applies a BatchNorm layer as the pass directs. Every model calls this for every BN layer.
pub fn norm<const D: usize>(bn: &BatchNorm, x: Tensor<D>, pass: &mut BnPass) -> Tensor<D> {
    let id = bn.gamma.id;
    let i = pass.next_layer(id);
    match pass.mode.clone() {
        Mode::Standard => bn.forward(x),
        Mode::Batch => {
            let (bm, bv, _) = batch_moments(&x);
            normalise(bn, x, bm, bv)
        }
        Mode::Stream { tau, start } => {
            let (bm, bv, _) = batch_moments(&x);
            let (pm, pv) = match pass.stats.get(&id) {
                Some((m, v)) => (m.clone(), v.clone()),
                None => match start {
                    BnStart::Stored => {
                        let dev = x.device();
                        (
                            bn.running_mean.value_sync().to_device(&dev),
                            bn.running_var.value_sync().to_device(&dev),
                        )
                    }
                    BnStart::FirstBatch => (bm.clone(), bv.clone()),
                },
            };
            let m = pm.mul_scalar(tau) + bm.mul_scalar(1.0 - tau);
            let v = pv.mul_scalar(tau) + bv.mul_scalar(1.0 - tau);
            pass.stats.insert(id, (m.clone(), v.clone()));
            normalise(bn, x, m, v)
        }
        Mode::Collect { target } => {
            if i < target {
                let (m, v) = pass
                    .stats
                    .get(&id)
                    .cloned()
                    .expect("earlier layers are calibrated first");
                normalise(bn, x, m, v)
            } else if i == target {
                let (bm, bv, n) = batch_moments(&x);
                let mean = to_vec(bm.clone());
                let var = to_vec(bv.clone());
                pass.collected.add(n, &mean, &var);
                normalise(bn, x, bm, bv)
            } else {
                // Later layers' outputs are not used in this pass.
                let dev = x.device();
                normalise(
                    bn,
                    x,
                    bn.running_mean.value_sync().to_device(&dev),
                    bn.running_var.value_sync().to_device(&dev),
                )
            }
        }
    }
}

fn to_vec(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .try_into_vec_as::<f32>()
        .expect("float tensor")
}

/// Splits `n` samples into batches of `batch_size`; a trailing batch of one sample merges into
/// the one before it, since one sample has no batch variance at a BatchNorm1d layer.
pub fn bn_batches(n: usize, batch_size: usize) -> Result<Vec<std::ops::Range<usize>>, BnError> {
    if batch_size < 2 {
        return Err(BnError::BatchTooSmall(batch_size));
    }
    match n {
        0 => return Err(BnError::NoImages),
        1 => return Err(BnError::SingleImage),
        _ => {}
    }
    let mut out: Vec<std::ops::Range<usize>> = (0..n)
        .step_by(batch_size)
        .map(|s| s..(s + batch_size).min(n))
        .collect();
    if out.len() > 1 && out.last().map(|r| r.len()) == Some(1) {
        let last = out.pop().expect("non-empty");
        out.last_mut().expect("non-empty").end = last.end;
    }
    Ok(out)
}

fn check_tau(tau: f64) -> Result<(), BnError> {
    if (0.0..=1.0).contains(&tau) {
        Ok(())
    } else {
        Err(BnError::BadTau(tau))
    }
}

/// `stream` re-estimation (UniFed Algorithm 1): feed test batches in order with [`Self::forward`];
/// each returns that batch's logits, normalised with the statistics updated by that batch.
#[derive(Debug, Clone)]
pub struct StreamEstimator {
    pub(crate) pass: BnPass,
}

impl StreamEstimator {
    /// A stream starting as `start` says, with weight `tau` on history.
    pub fn new(tau: f64, start: BnStart) -> Result<Self, BnError> {
        check_tau(tau)?;
        Ok(StreamEstimator {
            pass: BnPass::with_mode(Mode::Stream { tau, start }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_batch_of_one_merges_into_the_previous() {
        assert_eq!(bn_batches(65, 32).unwrap(), vec![0..32, 32..65]);
        assert_eq!(bn_batches(66, 32).unwrap(), vec![0..32, 32..64, 64..66]);
        assert_eq!(bn_batches(5, 8).unwrap(), vec![0..5]);
        assert_eq!(bn_batches(1, 8), Err(BnError::SingleImage));
        assert_eq!(bn_batches(0, 8), Err(BnError::NoImages));
        assert_eq!(bn_batches(10, 1), Err(BnError::BatchTooSmall(1)));
    }

    #[test]
    fn chan_pooling_equals_the_moments_of_the_concatenation() {
        let a = [1.0f32, 2.0, 4.0];
        let b = [7.0f32, 9.0];
        let mom = |x: &[f32]| {
            let m = x.iter().sum::<f32>() / x.len() as f32;
            let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / x.len() as f32;
            (m, v)
        };
        let mut acc = Moments::default();
        let (ma, va) = mom(&a);
        let (mb, vb) = mom(&b);
        acc.add(3, &[ma], &[va]);
        acc.add(2, &[mb], &[vb]);
        let (m, v) = acc.finish();
        let (mt, vt) = mom(&[1.0, 2.0, 4.0, 7.0, 9.0]);
        assert!(
            (m[0] - mt).abs() < 1e-6 && (v[0] - vt).abs() < 1e-5,
            "{m:?} {v:?} vs {mt} {vt}"
        );
    }
}
