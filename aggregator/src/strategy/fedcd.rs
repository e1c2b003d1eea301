//! FedCD (Chen et al., "FedCD", sections 3.3-3.4), server side. Sites train under SCI (a mask
//! of their own on the representation before the classifier, and a penalty pulling their mask
//! gradient `g_e` towards the federation's `g_g`; see `unifed_models::invariant`) and send
//! `g_e` with their training risk `R_e`. The server
//!
//! ```text
//! g_g <- sum_e p_e g_e                         p_e = n_e / n over the round's sites
//! x   <- x + sum_e c_e Δ_e                     SCI alone: c_e = p_e (FedAvg's mean)
//! w_e  = (1 / R_e) / sum_k (1 / R_k)           REA: the weights that equalise w_e R_e
//! c_e  = exp(eta w_e + p_e) / sum_k exp(eta w_k + p_k)
//! ```
//!
//! `w_e` is the closed-form minimiser of Eq. 17, `Var(w_e R_e)` over the simplex: every
//! `w_e R_e` equal. Since `w_e` and `p_e` both lie in [0, 1], REA's weights differ by at most a
//! factor `e^(eta + 1)` and sit close to uniform: a site that claims a tiny risk gains at most
//! that factor. Under uniform weighting `p_e = 1 / sites`.
//!
//! A mask gradient whose L2 norm exceeds `max_gradient_norm` is refused (one absurd `g_e`
//! would enter `g_g` and every site's penalty), as is a risk that is not positive and finite.
//! Within the bound a site still moves `g_g` by its share: a robust mean of the gradients
//! belongs with the robust rules of the aggregator.

use super::{
    Contributions, Extras, ReadError, Setup, Strategy, StrategyError, StrategyState, parameter,
    step_by,
};
use crate::fold::Fold;
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{
    Objective, RejectReason, RoundPlan, ServerExtras, SiteExtras, SiteUpdateRef,
};

/// FedCD's parameters. The defaults are inside the paper's grids (`lambda` in {0.5, 0.7, 0.8,
/// 0.9, 1.0}, `eta` in {0.3, 0.5, 0.8}); it reports only the best per domain.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FedCdConfig {
    /// The weight `lambda` of the sites' gradient-matching penalty.
    pub lambda: f64,
    /// REA's weight `eta` of the risk-equalising weights against the sample shares.
    pub eta: f64,
    /// Whether the server weighs sites by REA (false: SCI alone, FedAvg's mean).
    pub rea: bool,
    /// The largest L2 norm of a site's mask gradient that is accepted (default 1: honest sites
    /// of the digits CNN sent 0.008 to 0.031 over 12 rounds, and a site that sent 1000 would
    /// pull `g_g` to a penalty that makes every honest site diverge).
    pub max_gradient_norm: f64,
}

impl Default for FedCdConfig {
    fn default() -> Self {
        FedCdConfig {
            lambda: 0.7,
            eta: 0.5,
            rea: true,
            max_gradient_norm: 1.0,
        }
    }
}

impl FedCdConfig {
    /// Checks every value, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        Objective::Invariant {
            lambda: self.lambda,
        }
        .validate()?;
        parameter(
            self.eta.is_finite() && self.eta >= 0.0,
            "eta",
            "be finite and non-negative",
            self.eta,
        )?;
        let n = self.max_gradient_norm;
        parameter(
            n.is_finite() && n > 0.0,
            "max_gradient_norm",
            "be positive and finite",
            n,
        )
    }
}

/// REA's aggregation weights for sites of sample shares `p` and risks `r` (each positive):
/// `softmax(eta w + p)` with `w_e = (1 / R_e) / sum_k (1 / R_k)`.
pub fn rea_weights(p: &[f64], r: &[f64], eta: f64) -> Vec<f64> {
    let inverse: f64 = r.iter().map(|r| 1.0 / r).sum();
    let logits: Vec<f64> = p
        .iter()
        .zip(r)
        .map(|(p, r)| eta * (1.0 / r) / inverse + p)
        .collect();
    let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|e| e / z).collect()
}

/// The FedCD server.
#[derive(Debug, Clone, PartialEq)]
pub struct FedCd {
    cfg: FedCdConfig,
    /// The classifier's width (the mask's).
    width: usize,
    /// The federation's mask gradient of the current model (none before a round closed).
    gradient: Option<Vec<f32>>,
}

impl FedCd {
    /// A FedCD server for `setup`, resuming from `state`. A model without a linear classifier,
    /// or a stored gradient of another width, is refused.
    pub fn new(
        cfg: FedCdConfig,
        setup: &Setup,
        state: Option<StrategyState>,
    ) -> Result<Self, StrategyError> {
        cfg.validate()?;
        let width =
            unifed_protocol::spec::head_width(&setup.tensors).ok_or(StrategyError::StateShape {
                what: "model's classifier (FedCD needs a linear one)",
                tensors: 0,
                values: 0,
                want_tensors: 1,
                want_values: 0,
            })?;
        let gradient = match state {
            None | Some(StrategyState::FedCd { gradient: None }) => None,
            Some(StrategyState::FedCd { gradient: Some(g) }) if g.len() == width => Some(g),
            Some(StrategyState::FedCd { gradient: Some(g) }) => {
                return Err(StrategyError::StateShape {
                    what: "mask gradient",
                    tensors: 1,
                    values: g.len(),
                    want_tensors: 1,
                    want_values: width,
                });
            }
            Some(other) => {
                return Err(StrategyError::StateOfAnother {
                    stored: other.name(),
                    algorithm: "fedcd",
                });
            }
        };
        Ok(FedCd {
            cfg,
            width,
            gradient,
        })
    }

    /// The federation's mask gradient `g_g` of the current model.
    pub fn gradient(&self) -> Option<&[f32]> {
        self.gradient.as_deref()
    }
}

impl Strategy for FedCd {
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: Objective::Invariant {
                lambda: self.cfg.lambda,
            },
        }
    }

    fn extras(&self) -> ServerExtras {
        match &self.gradient {
            Some(g) => ServerExtras::MaskGradient(g.clone()),
            None => ServerExtras::None,
        }
    }

    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        let SiteExtras::MaskGradient { gradient, risk } = &update.extras else {
            return Err(RejectReason::UnexpectedExtras(
                "no mask gradient, which FedCD needs from every site".into(),
            ));
        };
        let malformed = |m: String| Err(RejectReason::Malformed(m));
        if gradient.len() != self.width {
            return malformed(format!(
                "a mask gradient of {} values for a classifier of width {}",
                gradient.len(),
                self.width
            ));
        }
        if gradient.iter().any(|g| !g.is_finite()) {
            return Err(RejectReason::NonFinite("mask gradient".into()));
        }
        let norm = super::sum_squares(gradient.iter().copied()).sqrt();
        if norm > self.cfg.max_gradient_norm {
            return Err(RejectReason::NormTooLarge {
                norm,
                bound: self.cfg.max_gradient_norm,
            });
        }
        if !(risk.is_finite() && *risk > 0.0) {
            return malformed(format!(
                "a training risk of {risk}, not positive and finite"
            ));
        }
        Ok(Extras::MaskGradient {
            gradient: gradient.clone(),
            risk: *risk,
        })
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        // First the reports: each site's share, risk and mask gradient (no delta is kept).
        let mut shares = Vec::new();
        let mut risks = Vec::new();
        let mut gradient = vec![0.0f64; self.width];
        for site in round.sites() {
            let c = round.summary(site)?;
            let Extras::MaskGradient { gradient: g, risk } = &c.extras else {
                return Err(ReadError::Damaged {
                    what: format!("round {}'s contribution of `{site}`", round.round()),
                    message: "it holds no mask gradient".into(),
                });
            };
            let w = round.weight(&c);
            gradient
                .iter_mut()
                .zip(g)
                .for_each(|(s, g)| *s += w * *g as f64);
            shares.push(w);
            risks.push(*risk);
        }
        let total: f64 = shares.iter().sum();
        if total <= 0.0 {
            return Ok(());
        }
        shares.iter_mut().for_each(|p| *p /= total);
        self.gradient = Some(gradient.iter().map(|g| (g / total) as f32).collect());
        if !self.cfg.rea {
            let mut targets: Vec<&mut [f32]> = model.iter_mut().map(|t| &mut t[..]).collect();
            round.mean_delta_into(&mut targets, &|x, mean| step_by(x, mean, 1.0))?;
            return Ok(());
        }
        let weights = rea_weights(&shares, &risks, self.cfg.eta);
        let lens = super::lens(model);
        let mut fold = Fold::new(&lens);
        for (site, &c) in round.sites().iter().zip(&weights) {
            fold.add(c, &round.get(site)?.delta);
        }
        if let Some(mean) = fold.mean() {
            for (x, d) in model.iter_mut().zip(&mean) {
                step_by(x, d, 1.0);
            }
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::FedCd {
            gradient: self.gradient.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rea_weights_equalise_weighted_risks_and_stay_near_uniform() {
        // Risks 1, 2 and 4: w = (4, 2, 1) / 7, and w_e R_e = 4/7 for every site.
        let (r, p) = ([1.0, 2.0, 4.0], [0.5, 0.25, 0.25]);
        let inverse: f64 = r.iter().map(|r| 1.0 / r).sum();
        let w: Vec<f64> = r.iter().map(|r| (1.0 / r) / inverse).collect();
        for (w, r) in w.iter().zip(&r) {
            assert!((w * r - 4.0 / 7.0).abs() < 1e-12);
        }
        let c = rea_weights(&p, &r, 0.5);
        let logits = [
            0.5 * 4.0 / 7.0 + 0.5,
            0.5 * 2.0 / 7.0 + 0.25,
            0.5 / 7.0 + 0.25,
        ];
        let z: f64 = logits.iter().map(|l: &f64| l.exp()).sum();
        for (c, l) in c.iter().zip(&logits) {
            assert!((c - l.exp() / z).abs() < 1e-12, "{c}");
        }
        assert!((c.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // A site that claims a vanishing risk gains at most e^(eta + 1) over another.
        let c = rea_weights(&[0.5, 0.5], &[1e-30, 10.0], 0.8);
        assert!(c[0] / c[1] <= 0.8f64.exp() + 1e-9, "{c:?}");
    }
}
