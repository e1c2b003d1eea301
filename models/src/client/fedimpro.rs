//! FedImpro, site side (`crate::decoupled` holds the training step). The site splits its model
//! after the plan's `split` weight layers, keeps per class a running Gaussian of its low-level
//! features (carried from round to round, restarted when the split changes), trains the head
//! also on synthetic features drawn from the federation's Gaussians that came beside the model,
//! and sends its running statistics, with the plan's noise added, in
//! `SiteExtras::FeatureStats`.

use super::{After, Before, ClientAlgorithm, ClientState, Inputs, Received};
use crate::decoupled::{Decoupler, feature_width};
use crate::error::SiteError;
use crate::state::Select;
use crate::zoo::Net;
use unifed_protocol::ModelSpec;
use unifed_protocol::messages::{RoundManifest, ServerExtras, SiteExtras};

/// FedImpro's client, with the plan's split, momentum and noise.
#[derive(Debug, Clone, Copy)]
pub struct FedImpro {
    /// Weight layers in the low-level part.
    pub split: u32,
    /// The momentum of the running statistics.
    pub beta: f64,
    /// The standard deviation of the noise on the statistics sent.
    pub noise: f64,
}

impl<N: Net> ClientAlgorithm<N> for FedImpro {
    fn adopt(&self, held: ClientState) -> ClientState {
        match held {
            held @ ClientState::FedImpro { .. } => held,
            _ => ClientState::FedImpro {
                local: None,
                server: None,
            },
        }
    }

    fn received(
        &self,
        spec: &ModelSpec,
        _select: Select,
        m: &RoundManifest,
        version: u64,
        extras: &ServerExtras,
    ) -> Result<Option<Received>, SiteError> {
        let plan = |message: String| SiteError::Plan {
            round: m.round,
            message,
        };
        match extras {
            ServerExtras::None => Ok(Some(Received::FeatureStats(version, None))),
            ServerExtras::FeatureStats(s) => {
                s.check(spec.classes.len(), None)
                    .map_err(|e| plan(format!("the federation's {e}")))?;
                Ok(Some(Received::FeatureStats(version, Some(s.clone()))))
            }
            _ => Err(plan(
                "algorithm tensors beside the model that FedImpro does not use".into(),
            )),
        }
    }

    fn inputs(&self, before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        let m = before.manifest;
        let plan = |message: String| SiteError::Plan {
            round: m.round,
            message,
        };
        let split = self.split as usize;
        let points = before.net.split_points();
        if !points.contains(&split) {
            return Err(plan(format!(
                "FedImpro splits this model after one of {points:?} weight layers, not {split}"
            )));
        }
        let ClientState::FedImpro { local, server } = before.state else {
            return Err(plan("the site holds no FedImpro state".into()));
        };
        let global = match server {
            Some((v, g)) if *v == m.model_version => g.clone(),
            _ => {
                return Err(plan(format!(
                    "nothing that came beside model v{} was applied",
                    m.model_version
                )));
            }
        };
        // Statistics of another split describe other features: the run starts afresh.
        let local = local
            .as_ref()
            .filter(|(s, _)| *s == self.split)
            .map(|(_, l)| l.clone());
        let device = before
            .net
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| plan("the model is on no device".into()))?;
        let width = feature_width(before.net, split, &device);
        let decoupler = Decoupler::new(
            (split, width, before.spec.classes.len()),
            (self.beta, self.noise),
            global,
            local,
        )
        .map_err(plan)?;
        Ok(Inputs {
            decoupler: Some(decoupler),
            ..Inputs::default()
        })
    }

    fn streams_update(&self) -> bool {
        false
    }

    fn after_delta(&self, after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        let Some(outcome) = after.report.decoupled.clone() else {
            return Err(SiteError::Plan {
                round: after.manifest.round,
                message: "training under FedImpro left no feature statistics".into(),
            });
        };
        let next = ClientState::FedImpro {
            local: Some((self.split, outcome.stats)),
            server: None,
        };
        Ok((SiteExtras::FeatureStats(outcome.sent), next))
    }
}

/// Checks a FedImpro state read from a checkpoint against `spec`: its statistics must hold one
/// entry per class, with finite values and non-negative variances.
pub(crate) fn check(state: &ClientState, spec: &ModelSpec) -> Result<(), SiteError> {
    let ClientState::FedImpro { local, server } = state else {
        return Ok(());
    };
    let stats = local.iter().map(|(_, s)| ("site's", s)).chain(
        server
            .iter()
            .flat_map(|(_, s)| s.iter().map(|s| ("federation's", s))),
    );
    for (whose, s) in stats {
        s.check(spec.classes.len(), None)
            .map_err(|e| SiteError::Memory(format!("the FedImpro {whose} {e}")))?;
    }
    Ok(())
}
