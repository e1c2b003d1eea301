//! FedAvg's server rule, which FedBN (BN policy `local`), FedProx (a proximal local objective;
//! its server is FedAvg's, Li et al. Algorithm 2), MOON (a contrastive local objective; Li, He
//! and Song Algorithm 1) and Per-FedAvg (first-order meta-steps on the sites; Fallah et al.
//! Algorithm 1) share: the weighted mean of the sites' deltas, folded in site order in f64.

use super::{Contributions, Extras, ReadError, Strategy, StrategyState, no_extras, step_by};
use serde::{Deserialize, Serialize};
use unifed_protocol::messages::{Objective, RejectReason, RoundPlan, SiteUpdateRef};

/// MOON's parameters: the weight of the model-contrastive loss and its temperature. The
/// defaults are the MOON paper's: `mu = 1` (its CIFAR-100 and Tiny-ImageNet setting; 5 on
/// CIFAR-10) and `temperature = 0.5`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoonConfig {
    /// The weight `mu` of the contrastive loss, finite and >= 0 (0: FedAvg exactly).
    pub mu: f64,
    /// The temperature, finite and > 0.
    pub temperature: f64,
}

impl Default for MoonConfig {
    fn default() -> Self {
        MoonConfig {
            mu: 1.0,
            temperature: 0.5,
        }
    }
}

impl MoonConfig {
    /// The local objective the sites train under.
    pub fn objective(&self) -> Objective {
        Objective::Contrastive {
            mu: self.mu,
            temperature: self.temperature,
        }
    }
}

/// Per-FedAvg's parameters: the inner (personalisation) and outer (meta) step sizes of the
/// sites' first-order meta-steps. Both default to FedBN's learning rate, 0.01; each meta-step
/// takes two batches, so an epoch has half as many steps as plain training.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PerFedAvgConfig {
    /// The inner step size `alpha`, also the personalisation step before a site evaluates.
    pub alpha: f64,
    /// The outer step size `beta`.
    pub beta: f64,
}

impl Default for PerFedAvgConfig {
    fn default() -> Self {
        PerFedAvgConfig {
            alpha: 0.01,
            beta: 0.01,
        }
    }
}

impl PerFedAvgConfig {
    /// The local objective the sites train under.
    pub fn objective(&self) -> Objective {
        Objective::Meta {
            alpha: self.alpha,
            beta: self.beta,
        }
    }
}

/// The weighted mean of the sites' deltas, with the local objective sites train under.
#[derive(Debug, Clone, PartialEq)]
pub struct FedAvg {
    objective: Objective,
}

impl FedAvg {
    /// FedAvg whose sites train under `objective` (cross-entropy: FedAvg/FedBN; proximal:
    /// FedProx).
    pub fn new(objective: Objective) -> Self {
        FedAvg { objective }
    }
}

impl Strategy for FedAvg {
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: self.objective,
        }
    }

    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        no_extras(update)
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        // The mean is applied as it is folded, a block at a time: no model-sized sums.
        let mut targets: Vec<&mut [f32]> = model.iter_mut().map(|t| &mut t[..]).collect();
        round.mean_delta_into(&mut targets, &|x, mean| step_by(x, mean, 1.0))?;
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::Stateless
    }
}
