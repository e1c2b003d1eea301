//! FedDC (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
//! and Correction", CVPR 2022), server side, as the paper's code does it. Each site keeps a
//! local drift `h_i`, the sum of its accepted deltas, and trains with SCAFFOLD's corrected
//! gradient plus the penalty `alpha/2 ||w + h_i - x||^2`; the server keeps SCAFFOLD's control
//! variate and the sum of every site's drift, `H = sum_i h_i`, which it can follow without any
//! extra traffic because the drift moves by exactly the deltas it receives:
//!
//! ```text
//! H <- H + sum_{i in S} Δy_i                       (S: the sites that reported, decoded deltas)
//! x <- x + sum w_i Δy_i / sum w_i + H / N          (the paper's mean of y_i + h_i; N: all sites)
//! c <- c + (1 / N) sum_{i in S} Δc_i               (SCAFFOLD's, see `scaffold`)
//! ```
//!
//! The paper's code averages `y_i` without weights and scales `alpha` and `c` per site by
//! `n_i / mean(n)`; we use the federation's weighting and the same `alpha` and `c` for every
//! site, which is the same when sites hold equal numbers of samples. `N` is counted as in
//! SCAFFOLD: registered sites, or those that have reported in an open federation. The drift
//! covers the trainable averaged tensors (non-BN under `local` BN, BN affine too under
//! `global`); BN running statistics take the plain mean.

use super::{
    Contributions, Extras, ReadError, Scaffold, ScaffoldConfig, Setup, Strategy, StrategyError,
    StrategyState,
};
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{Objective, RejectReason, RoundPlan, ServerExtras, SiteUpdateRef};

/// FedDC's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FedDcConfig {
    /// The weight `alpha` of the sites' drift penalty (the paper's code: 0.01).
    pub alpha: f64,
    /// The largest L2 norm of a site's control-variate delta that is accepted (as SCAFFOLD's).
    pub max_control_norm: f64,
}

impl Default for FedDcConfig {
    fn default() -> Self {
        FedDcConfig {
            alpha: 0.01,
            max_control_norm: ScaffoldConfig::default().max_control_norm,
        }
    }
}

impl FedDcConfig {
    /// The local objective the sites train under.
    pub fn objective(&self) -> Objective {
        Objective::Drift { alpha: self.alpha }
    }

    /// Checks every value, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        self.objective().validate()?;
        self.scaffold().validate()
    }

    fn scaffold(&self) -> ScaffoldConfig {
        ScaffoldConfig {
            server_lr: 1.0,
            max_control_norm: self.max_control_norm,
        }
    }
}

/// The FedDC server: SCAFFOLD's model step and control variate, plus the sites' drift sum.
#[derive(Debug, Clone, PartialEq)]
pub struct FedDc {
    cfg: FedDcConfig,
    scaffold: Scaffold,
    /// Per averaged tensor: trainable (drifts) or a running statistic.
    trained: Vec<bool>,
    /// `H`, the sum of every site's drift, in trainable-tensor order.
    drift: Vec<Vec<f32>>,
}

impl FedDc {
    /// A FedDC server for `setup`, resuming from `state` (`c = 0`, `H = 0` when `None`).
    pub fn new(
        cfg: FedDcConfig,
        setup: &Setup,
        state: Option<StrategyState>,
    ) -> Result<Self, StrategyError> {
        cfg.validate()?;
        let (scaffold, drift) = match state {
            Some(StrategyState::FedDc { c, known, n, drift }) => {
                setup.check_shapes("drift sum", &drift)?;
                let s = Scaffold::new(
                    cfg.scaffold(),
                    setup,
                    Some(StrategyState::Scaffold { c, known, n }),
                )?;
                (s, drift)
            }
            None => (Scaffold::new(cfg.scaffold(), setup, None)?, setup.zeros()),
            Some(other) => {
                return Err(StrategyError::StateOfAnother {
                    stored: other.name(),
                    algorithm: "feddc",
                });
            }
        };
        Ok(FedDc {
            cfg,
            scaffold,
            trained: setup.trained(),
            drift,
        })
    }

    /// The sum of every site's drift, in trainable-tensor order.
    pub fn drift(&self) -> &[Vec<f32>] {
        &self.drift
    }
}

impl Strategy for FedDc {
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: self.cfg.objective(),
        }
    }

    fn extras(&self) -> ServerExtras {
        self.scaffold.extras()
    }

    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        self.scaffold.check(update)
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        if !self.scaffold.step_mean(round, model)? {
            return Ok(());
        }
        // H moves by every reporting site's decoded delta (trainable tensors, in site order),
        // summed in the same read of the spool as SCAFFOLD's variate.
        let mut sum: Vec<Vec<f64>> = self.drift.iter().map(|h| vec![0.0; h.len()]).collect();
        let mut reported = false;
        let trained = &self.trained;
        self.scaffold.fold_controls(round, |site, c| {
            let deltas: Vec<&Vec<f32>> = c
                .delta
                .iter()
                .zip(trained)
                .filter(|(_, t)| **t)
                .map(|(d, _)| d)
                .collect();
            if !deltas.iter().map(|d| d.len()).eq(sum.iter().map(Vec::len)) {
                tracing::warn!(
                    site,
                    "a contribution whose delta does not fit the drift sum"
                );
                return;
            }
            for (acc, d) in sum.iter_mut().zip(deltas) {
                acc.iter_mut().zip(d).for_each(|(a, d)| *a += *d as f64);
            }
            reported = true;
        })?;
        let n = self.scaffold.sites();
        if !reported || n == 0 {
            return Ok(());
        }
        for (h, s) in self.drift.iter_mut().zip(&sum) {
            h.iter_mut()
                .zip(s)
                .for_each(|(h, s)| *h = (*h as f64 + s) as f32);
        }
        let trainable = model
            .iter_mut()
            .zip(&self.trained)
            .filter(|(_, t)| **t)
            .map(|(x, _)| x);
        for (x, h) in trainable.zip(&self.drift) {
            x.iter_mut()
                .zip(h)
                .for_each(|(x, h)| *x = (*x as f64 + *h as f64 / n as f64) as f32);
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        let (c, known, n) = self.scaffold.parts();
        StrategyState::FedDc {
            c,
            known,
            n,
            drift: self.drift.clone(),
        }
    }
}
