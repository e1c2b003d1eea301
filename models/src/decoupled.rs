//! FedImpro's local step (Chen et al., ICLR 2024, section 4, Eq. 6-7): the model splits into a
//! low-level part and a high-level head ([`Net::low`], [`Net::high`]); the site keeps per
//! class a running Gaussian of its low-level features, and each step adds to the real batch's
//! cross-entropy that of one synthetic feature per real sample, drawn from the federation's
//! Gaussian of the sample's class. The synthetic features are constants of the step's graph,
//! so their loss trains the head alone.
//!
//! What the paper leaves open, and what this module does:
//! - **the momentum `beta`** of Eq. 7 (not given): 0.9 by default (the plan carries it), the
//!   weight on history BN's running statistics use; the first batch of a class a run sees
//!   starts its estimate, so a class is never blended with zeros. The variance blended in is a
//!   batch's unbiased variance of the class, from batches holding two samples of it or more; a
//!   class is sent once it has one.
//! - **what a site sends**: its running estimate at the end of the round, carried over to its
//!   next round (the low-level part changes slowly, and Eq. 7 runs over iterations, not
//!   rounds), with Gaussian noise of the plan's `noise` added to every mean and variance
//!   (App. D.3; a variance pushed below zero is sent as zero), drawn from the run's own stream
//!   (seeded by site, round and seed), so the sites' noises are independent.
//! - **a class the federation has no Gaussian of** (no site has sent it yet, or before the
//!   first round closes): its samples get no synthetic twin; the rest of the batch does.
//! - **the head's BatchNorm layers**: a synthetic batch is normalised by its own statistics, as
//!   a real training batch is, and never enters the running statistics
//!   ([`BnPass::batch_only`]): under client-specific BN those describe the site's own data,
//!   which is what it evaluates on; under averaged BN the federation's mean of them should be
//!   of real data too. FedImpro's paper trained without client-specific BN.

use crate::bn::BnPass;
use crate::zoo::Net;
use burn::nn::loss::CrossEntropyLoss;
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use unifed_protocol::messages::{ClassStats, FeatureStats};

/// FedImpro prepared for one local training run: the split, the momentum, the federation's
/// Gaussians and the site's running statistics it starts from.
#[derive(Debug, Clone)]
pub struct Decoupler {
    split: usize,
    beta: f64,
    noise: f64,
    width: usize,
    classes: usize,
    global: Option<FeatureStats>,
    local: Option<FeatureStats>,
}

impl Decoupler {
    /// A run that splits after `split` weight layers, whose low-level features have `width`
    /// values, over `classes` classes, with momentum `beta` and `noise` on the statistics it
    /// sends; with the federation's Gaussians `global` (`None`: no synthetic features) and the
    /// site's running statistics `local` (`None`: none yet). Statistics of another shape are
    /// refused, naming what differs.
    pub fn new(
        (split, width, classes): (usize, usize, usize),
        (beta, noise): (f64, f64),
        global: Option<FeatureStats>,
        local: Option<FeatureStats>,
    ) -> Result<Self, String> {
        for (what, s) in [("the federation's", &global), ("the site's", &local)] {
            if let Some(s) = s {
                s.check(classes, Some(width))
                    .map_err(|e| format!("{what} feature statistics: {e}"))?;
            }
        }
        Ok(Decoupler {
            split,
            beta,
            noise,
            width,
            classes,
            global,
            local,
        })
    }

    /// The split point.
    pub fn split(&self) -> usize {
        self.split
    }

    /// A run of training under this term on the autodiff `device`, drawing its synthetic
    /// features from a stream of `seed`.
    pub fn start(&self, device: &Device, seed: u64) -> DecoupleRun {
        let (c, d) = (self.classes, self.width);
        let table = |s: &FeatureStats, f: &dyn Fn(&ClassStats) -> Vec<f32>| {
            let mut v = Vec::with_capacity(c * d);
            for k in &s.classes {
                match k {
                    Some(k) => v.extend(f(k)),
                    None => v.extend(std::iter::repeat_n(0.0, d)),
                }
            }
            Tensor::<2>::from_data(
                TensorData::new(v, [c, d]),
                &device.clone().without_autodiff(),
            )
        };
        let present = |s: &FeatureStats| s.classes.iter().map(Option::is_some).collect::<Vec<_>>();
        let global = self.global.as_ref().map(|g| Gaussians {
            mean: table(g, &|k| k.mean.clone()),
            std: table(g, &|k| k.var.iter().map(|v| v.max(0.0).sqrt()).collect()),
            present: present(g),
        });
        let running = self
            .local
            .as_ref()
            .map(|l| (table(l, &|k| k.mean.clone()), table(l, &|k| k.var.clone())));
        DecoupleRun {
            split: self.split,
            beta: self.beta,
            noise: self.noise,
            width: d,
            seen: self.local.as_ref().map_or_else(|| vec![false; c], present),
            spread: self.local.as_ref().map_or_else(|| vec![false; c], present),
            running,
            global,
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0xFED1_3470),
            device: device.clone(),
            synthetic: 0,
        }
    }
}

/// Per-class Gaussians on the device (`[classes, width]` each), and which classes have one.
struct Gaussians {
    mean: Tensor<2>,
    std: Tensor<2>,
    present: Vec<bool>,
}

/// The site's running statistics being updated and the federation's Gaussians being sampled,
/// over one local training run (kept on the device, read once at the end).
pub struct DecoupleRun {
    split: usize,
    beta: f64,
    noise: f64,
    width: usize,
    /// Classes with a running mean.
    seen: Vec<bool>,
    /// Classes with a running variance (two samples of them in one batch): the ones sent.
    spread: Vec<bool>,
    running: Option<(Tensor<2>, Tensor<2>)>,
    global: Option<Gaussians>,
    rng: ChaCha8Rng,
    device: Device,
    synthetic: usize,
}

impl DecoupleRun {
    /// The split point.
    pub fn split(&self) -> usize {
        self.split
    }

    /// One synthetic feature per sample of `labels` whose class has a federation Gaussian,
    /// `[m, width]` (constants, on the plain device), and their classes; `None` when fewer
    /// than two samples have one (BatchNorm needs a batch variance).
    pub fn draw(&mut self, labels: &[usize]) -> Option<(Tensor<2>, Vec<usize>)> {
        let g = self.global.as_ref()?;
        let rows: Vec<usize> = labels
            .iter()
            .copied()
            .filter(|&k| g.present.get(k).copied().unwrap_or(false))
            .collect();
        if rows.len() < 2 {
            return None;
        }
        let (m, d) = (rows.len(), self.width);
        let plain = self.device.clone().without_autodiff();
        let eps: Vec<f32> = (0..m * d)
            .map(|_| StandardNormal.sample(&mut self.rng))
            .collect();
        let eps = Tensor::<2>::from_data(TensorData::new(eps, [m, d]), &plain);
        let index = Tensor::<1, Int>::from_data(
            TensorData::new(rows.iter().map(|&k| k as i64).collect::<Vec<_>>(), [m]),
            &plain,
        );
        let h = g.mean.clone().select(0, index.clone()) + g.std.clone().select(0, index) * eps;
        Some((h, rows))
    }

    /// The cross-entropy of the head on [`DecoupleRun::draw`]'s synthetic features for
    /// `labels`, weighted by their share of the batch (`None` where it draws none). Its graph
    /// reaches the head's parameters only: the features are constants.
    pub fn synthetic_loss<N: Net>(
        &mut self,
        net: &N,
        labels: &[usize],
        loss_fn: &CrossEntropyLoss,
    ) -> Option<Tensor<1>> {
        let (h, rows) = self.draw(labels)?;
        let y = Tensor::<1, Int>::from_data(
            TensorData::new(
                rows.iter().map(|&k| k as i64).collect::<Vec<_>>(),
                [rows.len()],
            ),
            &self.device,
        );
        self.synthetic += rows.len();
        let logits = net.high(h.autodiff(), self.split, &mut BnPass::batch_only());
        // Eq. 6 sums a loss per real sample and one per synthetic twin: over the real batch's
        // mean, the twins' mean counts for their share of the batch.
        let share = rows.len() as f64 / labels.len() as f64;
        Some(loss_fn.forward(logits, y).mul_scalar(share))
    }

    /// Updates the running per-class statistics from a batch's low-level features `h`
    /// (`[n, width]`, read without their graph) of `labels` (Eq. 7): a class the batch holds
    /// moves its mean to `beta` times its estimate plus `1 - beta` times the batch's mean, or
    /// starts at it if the run has none yet; its variance likewise with the batch's unbiased
    /// variance about that mean, from batches holding two samples of it or more (one sample
    /// has no variance: blending a zero in would shrink a rare class's spread). A label past
    /// the class count is skipped.
    pub fn observe(&mut self, h: &Tensor<2>, labels: &[usize]) {
        let c = self.seen.len();
        let n = labels.len();
        let mut count = vec![0usize; c];
        labels
            .iter()
            .filter(|&&k| k < c)
            .for_each(|&k| count[k] += 1);
        // Row k of `avg` averages the batch's samples of class k; of `spread`, sums their
        // squared deviations over count - 1.
        let (mut avg, mut spread) = (vec![0.0f32; c * n], vec![0.0f32; c * n]);
        for (i, &k) in labels.iter().enumerate().filter(|(_, k)| **k < c) {
            avg[k * n + i] = 1.0 / count[k] as f32;
            if count[k] >= 2 {
                spread[k * n + i] = 1.0 / (count[k] - 1) as f32;
            }
        }
        let keep = |start: &[bool], min: usize| -> Vec<f32> {
            (0..c)
                .map(|k| match (count[k] >= min, start[k]) {
                    (false, _) => 1.0,
                    (true, true) => self.beta as f32,
                    (true, false) => 0.0,
                })
                .collect()
        };
        let (keep_mean, keep_var) = (keep(&self.seen, 1), keep(&self.spread, 2));
        let plain = self.device.clone().without_autodiff();
        let matrix = |v: Vec<f32>, rows: usize, cols: usize| {
            Tensor::<2>::from_data(TensorData::new(v, [rows, cols]), &plain)
        };
        let h = h.clone().inner();
        let mean = matrix(avg, c, n).matmul(h.clone());
        let rows: Vec<i64> = labels.iter().map(|&k| k.min(c - 1) as i64).collect();
        let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), &plain);
        let centred = h - mean.clone().select(0, rows);
        let var = matrix(spread, c, n).matmul(centred.clone() * centred);
        let blend = |old: Option<Tensor<2>>, new: Tensor<2>, keep: Vec<f32>| {
            let keep = matrix(keep, c, 1);
            let fresh = keep.clone().neg().add_scalar(1.0);
            match old {
                Some(old) => old * keep + new * fresh,
                None => new * fresh,
            }
        };
        let (m0, v0) = match self.running.take() {
            Some((m, v)) => (Some(m), Some(v)),
            None => (None, None),
        };
        self.running = Some((blend(m0, mean, keep_mean), blend(v0, var, keep_var)));
        for ((seen, spread), &n) in self.seen.iter_mut().zip(&mut self.spread).zip(&count) {
            *seen |= n > 0;
            *spread |= n >= 2;
        }
    }

    /// The run's outcome: the site's running statistics, read from the device in one go, what
    /// it sends of them (with the noise, drawn from the run's stream) and the number of
    /// synthetic features it trained on.
    pub fn finish(mut self) -> DecoupleOutcome {
        let (c, d) = (self.seen.len(), self.width);
        let stats = match self.running {
            None => FeatureStats {
                width: d as u32,
                classes: vec![None; c],
            },
            Some((mean, var)) => {
                let mean: Vec<f32> = mean.into_data().iter::<f32>().collect();
                let var: Vec<f32> = var.into_data().iter::<f32>().collect();
                FeatureStats {
                    width: d as u32,
                    classes: (0..c)
                        .map(|k| {
                            self.spread[k].then(|| ClassStats {
                                mean: mean[k * d..(k + 1) * d].to_vec(),
                                var: var[k * d..(k + 1) * d].to_vec(),
                            })
                        })
                        .collect(),
                }
            }
        };
        DecoupleOutcome {
            sent: with_noise(stats.clone(), self.noise, &mut self.rng),
            stats,
            synthetic: self.synthetic,
        }
    }
}

/// What a run trained under FedImpro leaves.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecoupleOutcome {
    /// The site's running per-class statistics of its low-level features.
    pub stats: FeatureStats,
    /// What the site sends of them: with the plan's noise added.
    pub sent: FeatureStats,
    /// Synthetic features trained on.
    pub synthetic: usize,
}

/// `stats` with Gaussian noise of standard deviation `std` added to every mean and variance
/// (FedImpro App. D.3), drawn from `rng`; a variance pushed below zero becomes zero. `std` 0
/// returns them unchanged.
pub fn with_noise(mut stats: FeatureStats, std: f64, rng: &mut impl rand::Rng) -> FeatureStats {
    if std == 0.0 {
        return stats;
    }
    for c in stats.classes.iter_mut().flatten() {
        for m in &mut c.mean {
            let z: f64 = StandardNormal.sample(rng);
            *m = (*m as f64 + std * z) as f32;
        }
        for v in &mut c.var {
            let z: f64 = StandardNormal.sample(rng);
            *v = (*v as f64 + std * z).max(0.0) as f32;
        }
    }
    stats
}

/// The width of `net`'s low-level features at `split`, from one forward pass of a zero input
/// in inference mode on `device` (nothing of the model changes).
pub fn feature_width<N: Net>(net: &N, split: usize, device: &Device) -> usize {
    let device = device.clone().without_autodiff();
    let x = Tensor::<2>::zeros([1, net.input_numel()], &device);
    net.valid().low(x, split, &mut BnPass::standard()).dims()[1]
}

/// Every float parameter's gradient in `grads`, in the module's visiting order (`None`: the
/// loss did not reach it).
struct Collect<'a> {
    grads: &'a burn::tensor::Gradients,
    out: Vec<Option<Vec<f32>>>,
}

impl burn::module::ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        let g = param
            .val()
            .grad(self.grads)
            .map(|g| g.into_data().iter::<f32>().collect());
        self.out.push(g);
    }
}

/// A site's head gradient of the real cross-entropy alone, and of FedImpro's objective.
pub type HeadGradients = (Vec<f32>, Vec<f32>);

/// The gradients of `net`'s head (the parameters after `split`) on the samples `idx` of
/// `data`, flattened: of the real batch's cross-entropy alone, and of FedImpro's objective
/// with one synthetic feature per sample drawn from `global` (Eq. 6, `N̂ = N`: the mean of the
/// two losses). BN normalises each batch by its own statistics and stores nothing: `net` is
/// untouched. `None` when fewer than two samples' classes have a Gaussian. For Theorem 4.2's
/// gradient dissimilarity across sites.
pub fn head_gradients<N: Net>(
    net: &N,
    data: &crate::data::Dataset,
    idx: &[usize],
    (split, global): (usize, &FeatureStats),
    seed: u64,
    device: &Device,
) -> Result<Option<HeadGradients>, String> {
    let ad = device.clone().autodiff();
    let model = net.valid().train();
    let loss_fn = burn::nn::loss::CrossEntropyLossConfig::new().init(&ad);
    let (x, y) = crate::train::batch_tensors(data, idx, &ad);
    let labels: Vec<usize> = idx.iter().map(|&i| data.y[i]).collect();
    let collect = |grads: &burn::tensor::Gradients| {
        let mut c = Collect {
            grads,
            out: Vec::new(),
        };
        model.visit(&mut c);
        c.out
    };
    let mut pass = BnPass::batch_only();
    let h = model.low(x, split, &mut pass);
    let width = h.dims()[1];
    let real = loss_fn.forward(model.high(h, split, &mut pass), y);
    let real = collect(&real.backward());
    let classes = global.classes.len();
    let mut run = Decoupler::new(
        (split, width, classes),
        (0.9, 0.0),
        Some(global.clone()),
        None,
    )?
    .start(&ad, seed);
    let Some(synthetic) = run.synthetic_loss(&model, &labels, &loss_fn) else {
        return Ok(None);
    };
    let synthetic = collect(&synthetic.backward());
    let (mut alone, mut mixed) = (Vec::new(), Vec::new());
    for (r, s) in real.into_iter().zip(synthetic) {
        let Some(s) = s else { continue };
        let r = r.unwrap_or_else(|| vec![0.0; s.len()]);
        mixed.extend(r.iter().zip(&s).map(|(a, b)| (a + b) / 2.0));
        alone.extend(r);
    }
    Ok(Some((alone, mixed)))
}

/// Gradient dissimilarity across sites, accumulated one site's gradient at a time without
/// keeping them: `(1/M) sum_m ||g_m - mean||^2 = (1/M) sum_m ||g_m||^2 - ||mean||^2`.
#[derive(Debug, Clone, Default)]
pub struct Dissimilarity {
    sum: Vec<f64>,
    squares: f64,
    sites: usize,
}

impl Dissimilarity {
    /// Adds one site's gradient (all of one length).
    pub fn add(&mut self, g: &[f32]) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; g.len()];
        }
        for (s, &x) in self.sum.iter_mut().zip(g) {
            *s += x as f64;
        }
        self.squares += g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
        self.sites += 1;
    }

    /// The number of sites added.
    pub fn sites(&self) -> usize {
        self.sites
    }

    /// The dissimilarity over the sites added (`None` before two).
    pub fn value(&self) -> Option<f64> {
        if self.sites < 2 {
            return None;
        }
        let m = self.sites as f64;
        let mean_sq = self.sum.iter().map(|s| (s / m).powi(2)).sum::<f64>();
        Some((self.squares / m - mean_sq).max(0.0))
    }
}
