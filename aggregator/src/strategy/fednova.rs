//! FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
//! Federated Optimization", 2020): sites that take different numbers of local steps pull the
//! plain mean towards the objectives of the busiest ones. FedNova normalises each site's delta
//! by the size of its local update `a_i` before averaging, then steps by the effective count
//! `tau_eff`:
//!
//! ```text
//! a_i      = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)   (||a_i||_1 of momentum SGD;
//!                                                                     tau_i for plain SGD)
//! tau_eff  = sum_i p_i a_i                                            (p_i = w_i / sum w)
//! x       <- x + tau_eff sum_i p_i Δ_i / a_i
//! ```
//!
//! `tau_i` is the step count the site reports with its update; `rho` the momentum the sites
//! train with (the federation's config says it, as the sites' configs must). The rule is
//! computed on `b_i = a_i / a_1` (the first site in site order), which gives the same model and
//! makes equal step counts give exactly FedAvg's bits: every `b_i` is then 1. BN running
//! statistics (under `global` BN) are not trained by steps and take the plain weighted mean.
//!
//! The step counts are the sites' word, as in the paper: a site that reports fewer steps than
//! it took weighs its delta up by `tau_eff / a_i`. The core's bounds (`max_relative_norm` on the
//! delta, `max_samples` on the weight) still hold for each update as sent; a count of 0 is
//! refused.

use super::{
    Contributions, Extras, ReadError, Setup, Strategy, StrategyError, StrategyState, no_extras,
    parameter, step_by,
};
use crate::fold::Fold;
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{RejectReason, SiteUpdateRef};

/// FedNova's parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FedNovaConfig {
    /// The momentum `rho` of the sites' local SGD, in [0, 1) (0: plain SGD, as in FedBN's
    /// setting and the demo).
    pub momentum: f64,
}

impl FedNovaConfig {
    /// Checks the momentum, naming it when it is out of range.
    pub fn validate(&self) -> Result<(), StrategyError> {
        let rho = self.momentum;
        parameter((0.0..1.0).contains(&rho), "momentum", "lie in [0, 1)", rho)
    }

    /// `||a_i||_1` of a site that took `steps` local steps.
    pub fn update_size(&self, steps: u64) -> f64 {
        let (tau, rho) = (steps as f64, self.momentum);
        if rho == 0.0 {
            return tau;
        }
        (tau - rho * (1.0 - rho.powf(tau)) / (1.0 - rho)) / (1.0 - rho)
    }
}

/// The normalised average of the sites' deltas.
#[derive(Debug, Clone, PartialEq)]
pub struct FedNova {
    cfg: FedNovaConfig,
    /// Per averaged tensor, whether steps train it (false for BN running statistics).
    trained: Vec<bool>,
}

impl FedNova {
    /// FedNova over the averaged tensors of `setup`.
    pub fn new(cfg: FedNovaConfig, setup: &Setup) -> Self {
        FedNova {
            cfg,
            trained: setup.trained(),
        }
    }
}

impl Strategy for FedNova {
    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        if update.report.local_steps == 0 {
            return Err(RejectReason::Malformed(
                "FedNova normalises by the local step count, and the report says 0 steps".into(),
            ));
        }
        no_extras(update)
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        let lens: Vec<usize> = model.iter().map(|t| t.len()).collect();
        let mut fold = Fold::new(&lens);
        let mut first: Option<f64> = None;
        // sum_j w_j b_j, in site order like the fold's sum_j w_j.
        let mut weighted_size = 0.0;
        for c in round.iter() {
            let (_, c) = c?;
            let w = round.weight(&c);
            let a = self.cfg.update_size(c.report.local_steps);
            let b = a / *first.get_or_insert(a);
            weighted_size += w * b;
            let coefs: Vec<f64> = self
                .trained
                .iter()
                .map(|&t| if t { w / b } else { w })
                .collect();
            fold.add_scaled(w, &coefs, &c.delta);
        }
        let total = fold.weight();
        let Some(mean) = fold.mean() else {
            return Ok(());
        };
        // tau_eff / a_1: exactly 1 when every site took as many steps as the first.
        let tau_eff = weighted_size / total;
        for ((x, d), &t) in model.iter_mut().zip(&mean).zip(&self.trained) {
            step_by(x, d, if t { tau_eff } else { 1.0 });
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::Stateless
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_update_size_is_the_step_count_without_momentum_and_the_papers_sum_with_it() {
        let plain = FedNovaConfig::default();
        assert_eq!(plain.update_size(24), 24.0);
        // rho = 0.5, tau = 3: a = [1, 1.5, 1.75] (1 + rho + ... per step), ||a||_1 = 4.25.
        let m = FedNovaConfig { momentum: 0.5 };
        assert!((m.update_size(3) - 4.25).abs() < 1e-12);
        assert!(m.validate().is_ok());
        assert!(matches!(
            FedNovaConfig { momentum: 1.0 }.validate(),
            Err(StrategyError::Parameter {
                name: "momentum",
                value: 1.0,
                ..
            })
        ));
    }
}
