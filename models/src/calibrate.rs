//! BN re-estimation over a whole model ([`Net`]): a [`StreamEstimator`]'s batches through the
//! model, and [`calibrate`], which stores a site's own statistics in a copy of the model
//! (FedBN appendix G, onboarding a site). The per-layer hook they drive is [`crate::bn`].

use crate::bn::{
    BN_CONTAINER, BnPass, CalibrateConfig, Estimator, Mode, StreamEstimator, bn_batches,
};
use crate::error::BnError;
use crate::net::Net;
use burn::module::{ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};
use std::collections::HashMap;

impl StreamEstimator {
    /// Runs one batch `[n, features]` (n >= 2) through `net` in inference mode, updating every
    /// BN layer's estimate on the way, and returns its logits.
    pub fn forward<N: Net>(&mut self, net: &N, x: Tensor<2>) -> Result<Tensor<2>, BnError> {
        let [n, f] = x.dims();
        if n < 2 {
            return Err(BnError::SingleImage);
        }
        let expected = net.input_numel();
        if f != expected {
            return Err(BnError::WrongInput { expected, found: f });
        }
        self.pass.begin();
        Ok(net.forward(x, &mut self.pass))
    }

    /// Writes the current estimates into a copy of `net` as its stored running statistics.
    pub fn store_into<N: Net>(&self, net: &N) -> N {
        write_stats(net, &self.pass.stats)
    }
}

/// `calibrate` re-estimation: returns a copy of `net` (inference mode) whose every BN layer
/// stores the statistics of the site's `images` (`[n, features]` rows of the model's input),
/// estimated layer by layer in forward order. Non-BN tensors and BN affine parameters are
/// left bit-identical.
pub fn calibrate<N: Net>(
    net: &N,
    images: &[f32],
    device: &Device,
    cfg: &CalibrateConfig,
    mut progress: impl FnMut(usize, usize),
) -> Result<N, BnError> {
    let f = net.input_numel();
    if images.is_empty() {
        return Err(BnError::NoImages);
    }
    if !images.len().is_multiple_of(f) {
        return Err(BnError::WrongInput {
            expected: f,
            found: images.len(),
        });
    }
    let n = images.len() / f;
    let batches = bn_batches(n, cfg.batch_size)?;
    let net = net.valid();
    let device = device.clone().without_autodiff();
    let batch = |r: &std::ops::Range<usize>| {
        Tensor::<2>::from_data(
            TensorData::new(images[r.start * f..r.end * f].to_vec(), [r.len(), f]),
            &device,
        )
    };
    match cfg.estimator {
        Estimator::Ema { tau } => {
            let mut est = StreamEstimator::new(tau, cfg.start)?;
            for (b, r) in batches.iter().enumerate() {
                est.forward(&net, batch(r))?;
                progress(b + 1, batches.len());
            }
            Ok(est.store_into(&net))
        }
        Estimator::Exact => {
            // Discover the number of BN layers with one small pass.
            let mut probe = BnPass::standard();
            probe.begin();
            let _ = net.forward(batch(&batches[0]), &mut probe);
            let layers = probe.layers_seen();
            let total = layers * batches.len();
            let mut stats: HashMap<ParamId, (Tensor<1>, Tensor<1>)> = HashMap::new();
            for target in 0..layers {
                let mut pass = BnPass::with_mode(Mode::Collect { target });
                pass.stats = stats.clone();
                for (b, r) in batches.iter().enumerate() {
                    pass.begin();
                    let _ = net.forward(batch(r), &mut pass);
                    progress(target * batches.len() + b + 1, total);
                }
                let (mean, var) = pass.collected.finish();
                let c = mean.len();
                let id = pass.order[target];
                stats.insert(
                    id,
                    (
                        Tensor::from_data(TensorData::new(mean, [c]), &device),
                        Tensor::from_data(TensorData::new(var, [c]), &device),
                    ),
                );
            }
            Ok(write_stats(&net, &stats))
        }
    }
}

/// Returns an independent copy of `net` whose BN layers (keyed by gamma id) store `stats` as
/// running mean and variance.
fn write_stats<N: Net>(net: &N, stats: &HashMap<ParamId, (Tensor<1>, Tensor<1>)>) -> N {
    // `valid()` syncs pending running-state updates and gives fresh, unshared running states,
    // so the in-place write below cannot reach the caller's model.
    let copy = net.valid();
    let mut w = StatsWriter {
        stats,
        current: None,
        field: String::new(),
    };
    copy.map(&mut w)
}

struct StatsWriter<'a> {
    stats: &'a HashMap<ParamId, (Tensor<1>, Tensor<1>)>,
    current: Option<ParamId>,
    field: String,
}

impl ModuleMapper for StatsWriter<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == BN_CONTAINER {
            self.field = name.to_string();
        } else {
            self.field.clear();
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.field.as_str() {
            "gamma" => {
                self.current = Some(param.id);
                param
            }
            "running_mean" | "running_var" => {
                let Some((m, v)) = self.current.and_then(|id| self.stats.get(&id)) else {
                    return param;
                };
                let src = if self.field == "running_mean" { m } else { v };
                param.map(|t| {
                    let dims = t.dims();
                    src.clone().to_device(&t.device()).reshape(dims)
                })
            }
            _ => param,
        }
    }
}
