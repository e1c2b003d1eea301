//! FedImpro (Chen et al., "FedImpro", ICLR 2024, section 4.3 and Algorithm 1), server side.
//! Sites split the model after `split` weight layers, train the head also on synthetic
//! features drawn from the federation's per-class Gaussians, and send their running per-class
//! mean and variance of their low-level features (see `unifed_models::decoupled`). The server
//!
//! ```text
//! x        <- x + sum_e p_e Δ_e                  FedAvg's mean of the deltas
//! mu_g[k]  <- (1 / |S_k|) sum_{e in S_k} mu_e[k]  Eq. 8, unweighted, over the sites S_k of the
//! var_g[k] <- (1 / |S_k|) sum_{e in S_k} var_e[k] round that sent class k
//! ```
//!
//! - **A class no site of the round sent** keeps the federation's previous Gaussian (with
//!   partial participation under label skew a round's sampled sites often lack a class; a
//!   stale estimate beats none); a class never sent has none, and sites draw no synthetic
//!   feature for it.
//! - **The feature width** at the split comes from the model's spec
//!   (`unifed_protocol::spec::feature_width`, for every model of the zoo): statistics of
//!   another width are refused from the first round, and a configured split the model does not
//!   have refuses to start. For a model the spec does not describe, the first round whose sites
//!   agree on a width by strict majority sets it (a minority of another width is left out of the
//!   statistics, its delta still counts).
//! - **A hostile site**: per class, a site's mean vector and variance vector whose L2 norm
//!   exceeds `max_norm_of_median` times a reference is scaled down to it before the mean: the
//!   lower median of the class's vectors when three or more sites sent it, else the lower median
//!   of all the round's vectors (see [`merge`]; one site sending 10^9 would otherwise set every
//!   site's synthetic features). Values must be finite and variances non-negative, or the
//!   update is refused.

use super::{
    Contributions, Extras, ReadError, Setup, Strategy, StrategyError, StrategyState, parameter,
    step_by,
};
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{
    ClassStats, FeatureStats, FeatureStatsError, Objective, RejectReason, RoundPlan, ServerExtras,
    SiteExtras, SiteUpdateRef,
};
use unifed_protocol::{TensorKind, TensorSpec};

/// FedImpro's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FedImproConfig {
    /// Weight layers in the low-level part; `None` (the default): half the model's weight
    /// layers, rounded down (FedImpro's best split on ResNet-18 was its 9th of 18 layers, the
    /// middle; the digits CNN's is 3 of 6, after conv3).
    pub split: Option<u32>,
    /// The momentum `beta` of the sites' running statistics (Eq. 7; the paper gives none: 0.9,
    /// the weight on history BN's running statistics use).
    pub beta: f64,
    /// The standard deviation of the Gaussian noise sites add to the statistics they send
    /// (App. D.3; default 0).
    pub noise: f64,
    /// The largest L2 norm of a site's per-class mean or variance vector, as a multiple of the
    /// median over the round's sites that sent the class; longer ones are scaled down to it.
    pub max_norm_of_median: f64,
}

impl Default for FedImproConfig {
    fn default() -> Self {
        FedImproConfig {
            split: None,
            beta: 0.9,
            noise: 0.0,
            max_norm_of_median: 2.0,
        }
    }
}

impl FedImproConfig {
    /// The split of a model with `tensors`: the configured one, or half its weight layers.
    pub fn split_for(&self, tensors: &[TensorSpec]) -> u32 {
        self.split
            .unwrap_or((weight_layers(tensors) / 2).max(1) as u32)
    }

    /// Checks every value, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        Objective::Decoupled {
            split: self.split.unwrap_or(1),
            beta: self.beta,
            noise: self.noise,
        }
        .validate()?;
        let b = self.max_norm_of_median;
        parameter(
            b.is_finite() && b >= 1.0,
            "max_norm_of_median",
            "be finite and at least 1",
            b,
        )
    }
}

/// The number of weight layers of a model with `tensors` as FedImpro counts them: every
/// convolution's and linear layer's weight (BN's and a residual shortcut's left out).
pub fn weight_layers(tensors: &[TensorSpec]) -> usize {
    tensors
        .iter()
        .filter(|t| {
            t.kind == TensorKind::NonBn
                && t.shape.len() >= 2
                && t.name.ends_with("weight")
                && !t.name.contains("downsample")
        })
        .count()
}

/// The FedImpro server.
#[derive(Debug, Clone, PartialEq)]
pub struct FedImpro {
    cfg: FedImproConfig,
    split: u32,
    classes: usize,
    /// The feature width at the split, read from the model's spec (`None`: a model the spec
    /// does not describe, or no spec: the first round's strict majority sets it).
    width: Option<usize>,
    /// The federation's Gaussians of the current model (none before a round closed).
    stats: Option<FeatureStats>,
}

impl FedImpro {
    /// A FedImpro server for `setup`, resuming from `state`. A model without a linear
    /// classifier, or stored statistics of another class count, is refused.
    pub fn new(
        cfg: FedImproConfig,
        setup: &Setup,
        state: Option<StrategyState>,
    ) -> Result<Self, StrategyError> {
        cfg.validate()?;
        // The spec's class list, as sites count classes; without a spec, the classifier's rows.
        let rows = setup
            .tensors
            .iter()
            .rev()
            .find(|t| t.kind == TensorKind::NonBn && t.shape.len() == 2)
            .map(|t| t.shape[0]);
        let classes = setup
            .spec
            .as_ref()
            .map(|s| s.classes.len())
            .or(rows)
            .ok_or(StrategyError::StateShape {
                what: "model's classifier (FedImpro needs a linear one)",
                tensors: 0,
                values: 0,
                want_tensors: 1,
                want_values: 0,
            })?;
        let split = cfg.split_for(&setup.tensors);
        let width = match &setup.spec {
            Some(spec) => {
                let width = unifed_protocol::spec::feature_width(spec, split as usize);
                let known = ["fedbn-digits-cnn(", "mlp-bn(", "resnet18("]
                    .iter()
                    .any(|a| spec.architecture.starts_with(a));
                if known && width.is_none() {
                    return Err(StrategyError::Parameter {
                        name: "split",
                        must: "be a split point of the model (weight layers in its low part)",
                        value: split as f64,
                    });
                }
                width
            }
            None => None,
        };
        let stats = match state {
            None | Some(StrategyState::FedImpro { stats: None }) => None,
            Some(StrategyState::FedImpro { stats: Some(s) }) => {
                s.check(classes, None)
                    .map_err(|e| StrategyError::BadState {
                        what: "FedImpro feature statistics",
                        message: e.to_string(),
                    })?;
                Some(s)
            }
            Some(other) => {
                return Err(StrategyError::StateOfAnother {
                    stored: other.name(),
                    algorithm: "fedimpro",
                });
            }
        };
        if let (Some(w), Some(s)) = (width, &stats)
            && s.width as usize != w
        {
            return Err(StrategyError::BadState {
                what: "FedImpro feature statistics",
                message: format!("of width {}, not the model's {w} at split {split}", s.width),
            });
        }
        Ok(FedImpro {
            cfg,
            split,
            classes,
            width,
            stats,
        })
    }

    /// The federation's per-class Gaussians of the current model.
    pub fn stats(&self) -> Option<&FeatureStats> {
        self.stats.as_ref()
    }

    /// The split point every site trains at.
    pub fn split(&self) -> u32 {
        self.split
    }
}

/// The L2 norm of `v`.
fn norm(v: &[f32]) -> f64 {
    super::sum_squares(v.iter().copied()).sqrt()
}

/// The lower median of `norms` (of an even count, the smaller middle one: of two, the
/// smaller), `None` when empty.
fn lower_median(mut norms: Vec<f64>) -> Option<f64> {
    norms.sort_by(f64::total_cmp);
    norms.get(norms.len().saturating_sub(1) / 2).copied()
}

/// Scales each of `vectors` whose L2 norm exceeds `limit` down to it.
fn bound(vectors: &mut [Vec<f32>], limit: f64) {
    for v in vectors.iter_mut() {
        let n = norm(v);
        if n > limit && n > 0.0 {
            let s = (limit / n) as f32;
            v.iter_mut().for_each(|x| *x *= s);
        }
    }
}

/// The unweighted mean of `vectors`, each of `width` values.
fn mean(vectors: &[Vec<f32>], width: usize) -> Vec<f32> {
    let mut sum = vec![0.0f64; width];
    for v in vectors {
        sum.iter_mut().zip(v).for_each(|(s, x)| *s += *x as f64);
    }
    sum.iter()
        .map(|s| (s / vectors.len() as f64) as f32)
        .collect()
}

/// Eq. 8 over the statistics `sent` by a round's sites (all of `width`), class by class; a
/// class no site sent keeps `previous`'s Gaussian. Before the mean, a site's mean and variance
/// vectors longer than `factor` times a reference norm are scaled down to it: the lower median
/// of the class's vectors when three or more sites sent it, else the lower median of every
/// vector of the round (a class sent by one or two sites has no median of its own that an
/// honest majority sets, while the round's classes, post-ReLU features alike, have).
pub fn merge(
    sent: &[FeatureStats],
    previous: Option<&FeatureStats>,
    (classes, width): (usize, usize),
    factor: f64,
) -> FeatureStats {
    let of_class = |k: usize| -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        sent.iter()
            .filter_map(|s| s.classes.get(k).and_then(Option::as_ref))
            .map(|c| (c.mean.clone(), c.var.clone()))
            .unzip()
    };
    let all = |pick: fn(&ClassStats) -> &[f32]| {
        lower_median(
            sent.iter()
                .flat_map(|s| s.classes.iter().flatten())
                .map(|c| norm(pick(c)))
                .collect(),
        )
    };
    let round = (all(|c| &c.mean), all(|c| &c.var));
    let classes = (0..classes)
        .map(|k| {
            let (mut means, mut vars) = of_class(k);
            if means.is_empty() {
                return previous
                    .filter(|p| p.width as usize == width)
                    .and_then(|p| p.classes.get(k).cloned().flatten());
            }
            for (vectors, round) in [(&mut means, round.0), (&mut vars, round.1)] {
                let own = (vectors.len() >= 3)
                    .then(|| lower_median(vectors.iter().map(|v| norm(v)).collect()))
                    .flatten();
                if let Some(reference) = own.or(round) {
                    bound(vectors, factor * reference);
                }
            }
            Some(ClassStats {
                mean: mean(&means, width),
                var: mean(&vars, width),
            })
        })
        .collect();
    FeatureStats {
        width: width as u32,
        classes,
    }
}

/// The width more than half of `sent` have, if one does.
fn majority_width(sent: &[FeatureStats]) -> Option<u32> {
    let mut widths: Vec<u32> = sent.iter().map(|s| s.width).collect();
    widths.sort_unstable();
    widths
        .chunk_by(|a, b| a == b)
        .find(|c| 2 * c.len() > sent.len())
        .map(|c| c[0])
}

impl Strategy for FedImpro {
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: Objective::Decoupled {
                split: self.split,
                beta: self.cfg.beta,
                noise: self.cfg.noise,
            },
        }
    }

    fn extras(&self) -> ServerExtras {
        match &self.stats {
            Some(s) => ServerExtras::FeatureStats(s.clone()),
            None => ServerExtras::None,
        }
    }

    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        let SiteExtras::FeatureStats(s) = &update.extras else {
            return Err(RejectReason::UnexpectedExtras(
                "no feature statistics, which FedImpro needs from every site".into(),
            ));
        };
        let width = self
            .width
            .or_else(|| self.stats.as_ref().map(|g| g.width as usize));
        s.check(self.classes, width).map_err(|e| match e {
            FeatureStatsError::NotFinite { .. } => {
                RejectReason::NonFinite("feature statistics".into())
            }
            e => RejectReason::Malformed(e.to_string()),
        })?;
        Ok(Extras::FeatureStats(s.clone()))
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        let mut sent = Vec::new();
        for site in round.sites() {
            let c = round.summary(site)?;
            let Extras::FeatureStats(s) = c.extras else {
                return Err(ReadError::Damaged {
                    what: format!("round {}'s contribution of `{site}`", round.round()),
                    message: "it holds no feature statistics".into(),
                });
            };
            sent.push(s);
        }
        let width = match (self.width, &self.stats) {
            (Some(w), _) => Some(w as u32),
            (None, Some(g)) => Some(g.width),
            (None, None) => majority_width(&sent),
        };
        if let Some(w) = width {
            sent.retain(|s| s.width == w);
            self.stats = Some(merge(
                &sent,
                self.stats.as_ref(),
                (self.classes, w as usize),
                self.cfg.max_norm_of_median,
            ));
        }
        let mut targets: Vec<&mut [f32]> = model.iter_mut().map(|t| &mut t[..]).collect();
        round.mean_delta_into(&mut targets, &|x, mean| step_by(x, mean, 1.0))?;
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::FedImpro {
            stats: self.stats.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(mean: &[f32], var: &[f32]) -> Option<ClassStats> {
        Some(ClassStats {
            mean: mean.to_vec(),
            var: var.to_vec(),
        })
    }

    #[test]
    fn the_merge_is_the_unweighted_mean_over_the_sites_that_sent_each_class() {
        let a = FeatureStats {
            width: 2,
            classes: vec![one(&[1.0, 2.0], &[1.0, 1.0]), None, None],
        };
        let b = FeatureStats {
            width: 2,
            classes: vec![
                one(&[3.0, 4.0], &[3.0, 1.0]),
                one(&[5.0, 5.0], &[2.0, 2.0]),
                None,
            ],
        };
        let previous = FeatureStats {
            width: 2,
            classes: vec![None, None, one(&[9.0, 9.0], &[9.0, 9.0])],
        };
        let g = merge(&[a, b], Some(&previous), (3, 2), 2.0);
        // Class 0 from both sites, class 1 from b alone (not halved by a's absence), class 2
        // from the federation's previous Gaussian.
        assert_eq!(g.classes[0], one(&[2.0, 3.0], &[2.0, 1.0]));
        assert_eq!(g.classes[1], one(&[5.0, 5.0], &[2.0, 2.0]));
        assert_eq!(g.classes[2], one(&[9.0, 9.0], &[9.0, 9.0]));
        // Without a previous Gaussian a class no one sent has none.
        let b_alone = FeatureStats {
            width: 2,
            classes: vec![one(&[3.0, 4.0], &[3.0, 1.0]), None, None],
        };
        assert_eq!(merge(&[b_alone], None, (3, 2), 2.0).classes[2], None);
        let none = FeatureStats {
            width: 2,
            classes: vec![None; 3],
        };
        assert_eq!(merge(&[none], None, (3, 2), 2.0).classes, vec![None; 3]);
    }

    #[test]
    fn a_site_far_from_the_median_is_scaled_to_the_bound() {
        let honest = |m: f32| FeatureStats {
            width: 1,
            classes: vec![one(&[m], &[1.0])],
        };
        let hostile = FeatureStats {
            width: 1,
            classes: vec![one(&[1e9], &[1e9])],
        };
        let g = merge(
            &[honest(1.0), honest(1.0), hostile.clone()],
            None,
            (1, 1),
            2.0,
        );
        // The median norm is 1: the hostile vectors count as 2, not 1e9.
        assert_eq!(g.classes[0], one(&[4.0 / 3.0], &[4.0 / 3.0]));
        // Of two senders, the lower median is the honest one's.
        let g = merge(&[honest(1.0), hostile.clone()], None, (1, 1), 2.0);
        assert_eq!(g.classes[0], one(&[1.5], &[1.5]));
        // A class the hostile site alone sends is bounded by the round's other classes.
        let two = |a: Option<ClassStats>, b: Option<ClassStats>| FeatureStats {
            width: 1,
            classes: vec![a, b],
        };
        let sent = [
            two(one(&[1.0], &[1.0]), None),
            two(one(&[1.0], &[1.0]), None),
            two(one(&[1.0], &[1.0]), one(&[1e9], &[1e9])),
        ];
        let g = merge(&sent, None, (2, 1), 2.0);
        assert_eq!(g.classes[1], one(&[2.0], &[2.0]));
    }

    #[test]
    fn without_a_spec_the_width_is_the_one_more_than_half_the_sites_sent() {
        let w = |width| FeatureStats {
            width,
            classes: vec![],
        };
        assert_eq!(majority_width(&[w(8), w(3), w(8)]), Some(8));
        // No strict majority: a hostile site of two sets nothing.
        assert_eq!(majority_width(&[w(8), w(3)]), None);
        assert_eq!(majority_width(&[]), None);
    }

    #[test]
    fn the_default_split_is_the_middle_of_the_weight_layers() {
        let t = |name: &str, shape: &[usize]| TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            kind: TensorKind::NonBn,
        };
        let digits = [
            t("conv1.weight", &[64, 3, 5, 5]),
            t("conv1.bias", &[64]),
            t("conv2.weight", &[64, 64, 5, 5]),
            t("conv3.weight", &[128, 64, 5, 5]),
            t("fc1.weight", &[2048, 6272]),
            t("fc2.weight", &[512, 2048]),
            t("fc3.weight", &[10, 512]),
            t("layer2.0.downsample.0.weight", &[8, 4, 1, 1]),
        ];
        assert_eq!(weight_layers(&digits), 6);
        let setup = Setup {
            tensors: digits.to_vec(),
            encoding: unifed_protocol::Encoding::F32,
            sites: 0,
            spec: None,
        };
        let s = FedImpro::new(FedImproConfig::default(), &setup, None).unwrap();
        assert_eq!((s.split(), s.classes), (3, 10));
    }

    #[test]
    fn the_spec_sets_the_width_and_refuses_a_split_the_model_lacks() {
        let t = |name: &str, shape: &[usize]| TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            kind: TensorKind::NonBn,
        };
        let tensors = vec![
            t("fc1.weight", &[6, 4]),
            t("fc2.weight", &[5, 6]),
            t("fc3.weight", &[3, 5]),
        ];
        let spec = unifed_protocol::ModelSpec {
            architecture: "mlp-bn(in=4,hidden=6-5,classes=3)".into(),
            tensors: tensors.clone(),
            classes: vec!["a".into(), "b".into(), "c".into()],
            input: unifed_protocol::Input::Features { len: 4 },
        };
        let setup = Setup {
            tensors,
            encoding: unifed_protocol::Encoding::F32,
            sites: 0,
            spec: Some(spec),
        };
        // Three weight layers: the middle is split 1, whose features are fc1's 6.
        let s = FedImpro::new(FedImproConfig::default(), &setup, None).unwrap();
        assert_eq!((s.split(), s.width), (1, Some(6)));
        let at = |k| FedImproConfig {
            split: Some(k),
            ..FedImproConfig::default()
        };
        assert_eq!(FedImpro::new(at(2), &setup, None).unwrap().width, Some(5));
        let err = FedImpro::new(at(3), &setup, None).unwrap_err().to_string();
        assert!(err.contains("split"), "{err}");
        // A stored state of another width is refused.
        let stored = StrategyState::FedImpro {
            stats: Some(FeatureStats {
                width: 5,
                classes: vec![None; 3],
            }),
        };
        let err = FedImpro::new(at(1), &setup, Some(stored))
            .unwrap_err()
            .to_string();
        assert!(err.contains("width 5, not the model's 6"), "{err}");
    }
}
