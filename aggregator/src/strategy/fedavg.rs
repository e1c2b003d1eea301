//! FedAvg's server rule, which FedBN (BN policy `local`) and FedProx (a proximal local
//! objective; its server is FedAvg's, Li et al. Algorithm 2) share: the weighted mean of the
//! sites' deltas, folded in site order in f64.

use super::{Extras, RoundReader, Strategy, StrategyState, no_extras, step_by};
use crate::store::StoreError;
use unifed_protocol::messages::{Objective, RejectReason, RoundPlan, SiteUpdate};

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

    fn check(&self, update: &SiteUpdate) -> Result<Extras, RejectReason> {
        no_extras(update)
    }

    fn aggregate(
        &mut self,
        round: &RoundReader<'_>,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), StoreError> {
        let Some(mean) = round.mean_delta(model)? else {
            return Ok(());
        };
        for (x, d) in model.iter_mut().zip(&mean) {
            step_by(x, d, 1.0);
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        StrategyState::Stateless
    }
}
