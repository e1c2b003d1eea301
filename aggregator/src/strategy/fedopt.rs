//! FedOpt (Reddi et al., "Adaptive Federated Optimization", Algorithm 2): the server treats the
//! averaged delta `Δ = sum w_i Δ_i / sum w_i` as a pseudo-gradient and steps an adaptive
//! optimiser with it, sites training plain SGD on cross-entropy:
//!
//! ```text
//! m <- beta1 m + (1 - beta1) Δ
//! v <- v + Δ²                                  (FedAdagrad)
//! v <- v - (1 - beta2) Δ² sign(v - Δ²)         (FedYogi)
//! v <- beta2 v + (1 - beta2) Δ²                (FedAdam)
//! x <- x + eta m / (sqrt(v) + tau)
//! ```
//!
//! with `m` starting at 0 and `v` at `tau²` (the paper's `v_{-1} >= tau²`), and no bias
//! correction, as in the paper. Only trainable tensors are optimised: BN running statistics
//! (under `global` BN) take the plain weighted mean, because an optimiser step on a variance can
//! make it negative. Moments are kept in f32 and stepped in f64, so a restart from the stored
//! state continues with the same bits.

use super::{
    Contributions, Extras, ReadError, Setup, Strategy, StrategyError, StrategyState, lens,
    no_extras, parameter, step_by,
};
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{RejectReason, SiteUpdateRef};

/// The server optimiser's parameters. Defaults are the FedOpt paper's: `beta1 = 0.9`,
/// `beta2 = 0.99`, `tau = 1e-3`, and server learning rate `eta = 0.01` (the paper tunes `eta`
/// per task over a grid around it; so should a federation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FedOptConfig {
    /// The server learning rate `eta`.
    pub server_lr: f64,
    /// First-moment decay `beta1`, in [0, 1).
    pub beta1: f64,
    /// Second-moment decay `beta2`, in [0, 1) (unused by FedAdagrad).
    pub beta2: f64,
    /// The adaptivity `tau` (> 0): it bounds the step and starts `v` at `tau²`.
    pub tau: f64,
}

impl Default for FedOptConfig {
    fn default() -> Self {
        FedOptConfig {
            server_lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3,
        }
    }
}

impl FedOptConfig {
    /// Checks every value, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        let positive = "be positive and finite";
        let lr = self.server_lr;
        parameter(lr.is_finite() && lr > 0.0, "server_lr", positive, lr)?;
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            parameter((0.0..1.0).contains(&b), name, "lie in [0, 1)", b)?;
        }
        parameter(
            self.tau.is_finite() && self.tau > 0.0,
            "tau",
            positive,
            self.tau,
        )
    }
}

/// Which adaptive rule updates the second moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// `v <- beta2 v + (1 - beta2) Δ²`.
    Adam,
    /// `v <- v - (1 - beta2) Δ² sign(v - Δ²)`.
    Yogi,
    /// `v <- v + Δ²`.
    Adagrad,
}

/// One FedOpt server step on one tensor: updates `m`, `v` and `x` in place from the mean delta
/// `d` (all of one length).
pub fn step(
    rule: Rule,
    cfg: &FedOptConfig,
    x: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    d: &[f64],
) {
    for (((x, m), v), &d) in x.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(d) {
        let m1 = cfg.beta1 * *m as f64 + (1.0 - cfg.beta1) * d;
        let v0 = *v as f64;
        let d2 = d * d;
        let v1 = match rule {
            Rule::Adam => cfg.beta2 * v0 + (1.0 - cfg.beta2) * d2,
            Rule::Yogi => {
                let diff = v0 - d2;
                let sign = if diff > 0.0 {
                    1.0
                } else if diff < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                v0 - (1.0 - cfg.beta2) * d2 * sign
            }
            Rule::Adagrad => v0 + d2,
        };
        *m = m1 as f32;
        *v = v1 as f32;
        *x = (*x as f64 + cfg.server_lr * m1 / (v1.sqrt() + cfg.tau)) as f32;
    }
}

/// A FedOpt server: the weighted mean of the deltas stepped through an adaptive optimiser.
#[derive(Debug, Clone, PartialEq)]
pub struct FedOpt {
    rule: Rule,
    cfg: FedOptConfig,
    /// Per averaged tensor: is it optimised (trainable) or averaged (running statistic)?
    optimised: Vec<bool>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl FedOpt {
    /// A FedOpt server of `rule` for `setup`, resuming from `state` (fresh moments when `None`).
    pub fn new(
        rule: Rule,
        cfg: FedOptConfig,
        setup: &Setup,
        state: Option<StrategyState>,
    ) -> Result<Self, StrategyError> {
        cfg.validate()?;
        let (m, v) = match state {
            Some(StrategyState::FedOpt { m, v }) => {
                setup.check_shapes("first moment", &m)?;
                setup.check_shapes("second moment", &v)?;
                (m, v)
            }
            None => {
                let tau2 = (cfg.tau * cfg.tau) as f32;
                let v = setup.trainable().map(|t| vec![tau2; t.numel()]).collect();
                (setup.zeros(), v)
            }
            Some(other) => {
                return Err(StrategyError::StateOfAnother {
                    stored: other.name(),
                    algorithm: "fedopt",
                });
            }
        };
        Ok(FedOpt {
            rule,
            cfg,
            optimised: setup.trained(),
            m,
            v,
        })
    }
}

impl Strategy for FedOpt {
    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        no_extras(update)
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        let Some(mean) = round.mean_delta(&lens(model))? else {
            return Ok(());
        };
        let mut j = 0;
        for ((x, d), &opt) in model.iter_mut().zip(&mean).zip(&self.optimised) {
            if opt {
                step(self.rule, &self.cfg, x, &mut self.m[j], &mut self.v[j], d);
                j += 1;
            } else {
                step_by(x, d, 1.0);
            }
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::FedOpt {
            m: self.m.clone(),
            v: self.v.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step from known moments, worked by hand: beta1 0.9, beta2 0.99, tau 0.1, eta 0.5,
    /// x = 1, m = 0.2, v = 0.04, Δ = 0.5 (Δ² = 0.25).
    fn one(rule: Rule) -> (f32, f32, f32) {
        let cfg = FedOptConfig {
            server_lr: 0.5,
            beta1: 0.9,
            beta2: 0.99,
            tau: 0.1,
        };
        let (mut x, mut m, mut v) = ([1.0f32], [0.2f32], [0.04f32]);
        step(rule, &cfg, &mut x, &mut m, &mut v, &[0.5]);
        (x[0], m[0], v[0])
    }

    fn close(a: f32, b: f64) {
        assert!(((a as f64) - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn fedadam_step_matches_the_hand_computation() {
        // m = 0.9*0.2 + 0.1*0.5 = 0.23; v = 0.99*0.04 + 0.01*0.25 = 0.0421;
        // x = 1 + 0.5*0.23/(sqrt(0.0421) + 0.1) = 1 + 0.115/0.305182... = 1.376823...
        let (x, m, v) = one(Rule::Adam);
        close(m, 0.23);
        close(v, 0.0421);
        close(x, 1.0 + 0.115 / (0.0421f64.sqrt() + 0.1));
        close(x, 1.376_823);
    }

    #[test]
    fn fedyogi_step_matches_the_hand_computation() {
        // v - Δ² = 0.04 - 0.25 < 0, sign -1: v = 0.04 + 0.01*0.25 = 0.0425;
        // x = 1 + 0.115/(sqrt(0.0425) + 0.1) = 1.375626...
        let (x, m, v) = one(Rule::Yogi);
        close(m, 0.23);
        close(v, 0.0425);
        close(x, 1.0 + 0.115 / (0.0425f64.sqrt() + 0.1));
        close(x, 1.375_626);
    }

    #[test]
    fn fedadagrad_step_matches_the_hand_computation() {
        // v = 0.04 + 0.25 = 0.29; x = 1 + 0.115/(sqrt(0.29) + 0.1) = 1.180105...
        let (x, m, v) = one(Rule::Adagrad);
        close(m, 0.23);
        close(v, 0.29);
        close(x, 1.0 + 0.115 / (0.29f64.sqrt() + 0.1));
        close(x, 1.180_105);
    }

    #[test]
    fn yogi_shrinks_v_when_the_gradient_is_small() {
        let cfg = FedOptConfig::default();
        let (mut x, mut m, mut v) = ([0.0f32], [0.0f32], [1.0f32]);
        // v - Δ² = 1 - 0.01 > 0: v = 1 - 0.01*0.01 = 0.9999.
        step(Rule::Yogi, &cfg, &mut x, &mut m, &mut v, &[0.1]);
        close(v[0], 0.9999);
    }

    #[test]
    fn config_validation_names_the_bad_value() {
        let bad = FedOptConfig {
            beta1: 1.0,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(StrategyError::Parameter { name: "beta1", .. })
        ));
        let bad = FedOptConfig {
            tau: 0.0,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(StrategyError::Parameter { name: "tau", .. })
        ));
        let bad = FedOptConfig {
            server_lr: f64::NAN,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(StrategyError::Parameter {
                name: "server_lr",
                ..
            })
        ));
    }
}
