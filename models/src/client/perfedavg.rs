//! Per-FedAvg (first order, Fallah et al.): sites train by meta-steps (the objective's term)
//! and keep nothing between rounds; before a site evaluates, it personalises a copy of the
//! model by one step of `alpha` on a batch of its training data.

use super::{ClientAlgorithm, ClientState};
use crate::backend::Device;
use crate::data::Dataset;
use crate::error::SiteError;
use crate::train::{TrainConfig, personalise};
use crate::zoo::Net;

/// Per-FedAvg's client, with its inner step size.
#[derive(Debug, Clone, Copy)]
pub struct PerFedAvg {
    /// The inner (personalisation) step size `alpha`.
    pub alpha: f64,
}

impl<N: Net> ClientAlgorithm<N> for PerFedAvg {
    fn adopt(&self, _held: ClientState) -> ClientState {
        ClientState::Stateless
    }

    fn personalise(
        &self,
        net: &N,
        train: &Dataset,
        classes: usize,
        tc: &TrainConfig,
        device: &Device,
    ) -> Result<Option<N>, SiteError> {
        let personal = personalise(
            net,
            train,
            classes,
            self.alpha,
            tc.batch_size,
            tc.seed,
            device,
        )?;
        Ok(Some(personal))
    }
}
