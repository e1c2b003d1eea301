//! FedCD (SCI and REA), site side. The site scales the representation in front of its linear
//! classifier by a mask of its own, initialised to ones and trained with the model, and adds
//! `lambda ||g_e - g_g||^2` to its loss (the objective's term, `crate::invariant`). The mask
//! is never sent and never aggregated: it is this client's state, with the federation's mask
//! gradient `g_g` that came beside the model applied last. The update carries the site's
//! round-mean mask gradient and its training risk (`SiteExtras::MaskGradient`), from which the
//! server makes the next `g_g` and, under REA, the round's weights.
//!
//! What the paper leaves open, and what this module does:
//! - **`g_g` before the first round closes**: there is none; the first round trains on
//!   cross-entropy alone (a zero `g_g` would instead penalise the gradient's norm), and its sites
//!   still send `g_e`.
//! - **which `g_e` a site sends**: the mean over every sample of the round of each batch's
//!   closed-form gradient (weighted by batch size), not the last batch's: `g_g` is then the
//!   federation's mean gradient over its samples, not the noise of 32 of them.
//! - **a never-seen site's mask**: all ones, the paper's start: a site that never trained has
//!   no mask, and the masks of others never leave them. A site evaluates with its own mask.

use super::{After, Before, ClientAlgorithm, ClientState, Inputs, Received};
use crate::error::SiteError;
use crate::invariant::Intervener;
use crate::state::Select;
use crate::zoo::Net;
use unifed_protocol::ModelSpec;
use unifed_protocol::messages::{RoundManifest, ServerExtras, SiteExtras};

/// The name FedCD's federation mask gradient is kept under in the client state.
pub const MASK_GRADIENT: &str = "mask_gradient";

/// FedCD's client, with the penalty weight of the round's plan.
#[derive(Debug, Clone, Copy)]
pub struct FedCd {
    /// The weight `lambda` of the gradient-matching penalty.
    pub lambda: f64,
}

impl<N: Net> ClientAlgorithm<N> for FedCd {
    fn adopt(&self, held: ClientState) -> ClientState {
        match held {
            held @ ClientState::FedCd { .. } => held,
            _ => ClientState::FedCd {
                mask: None,
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
        let width = width(spec, m)?;
        match extras {
            ServerExtras::None => Ok(Some(Received::Tensors((version, Default::default())))),
            ServerExtras::MaskGradient(g)
                if g.len() == width && g.iter().all(|v| v.is_finite()) =>
            {
                Ok(Some(Received::Tensors((
                    version,
                    [(MASK_GRADIENT.to_string(), g.clone())].into(),
                ))))
            }
            ServerExtras::MaskGradient(g) => Err(plan(format!(
                "the federation's mask gradient has {} values, not all finite or not the \
                 classifier's width {width}",
                g.len()
            ))),
            ServerExtras::Control(_) => Err(plan(
                "a control variate beside the model, which FedCD does not use".into(),
            )),
            ServerExtras::FeatureStats(_) => Err(plan(
                "feature statistics beside the model, which FedCD does not use".into(),
            )),
        }
    }

    fn inputs(&self, before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        let m = before.manifest;
        let width = width(before.spec, m)?;
        let ClientState::FedCd { mask, server } = before.state else {
            return Err(SiteError::Plan {
                round: m.round,
                message: "the site holds no FedCD state".into(),
            });
        };
        let global = match server {
            Some((v, g)) if *v == m.model_version => g.get(MASK_GRADIENT).cloned(),
            _ => {
                return Err(SiteError::Plan {
                    round: m.round,
                    message: format!(
                        "nothing that came beside model v{} was applied",
                        m.model_version
                    ),
                });
            }
        };
        let mask = mask.clone().unwrap_or_else(|| vec![1.0; width]);
        Ok(Inputs {
            intervener: Some(Intervener::new(self.lambda, global, mask)),
            ..Inputs::default()
        })
    }

    fn streams_update(&self) -> bool {
        false
    }

    fn after_delta(&self, after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        let Some(outcome) = after.report.mask.clone() else {
            return Err(SiteError::Plan {
                round: after.manifest.round,
                message: "training under FedCD left no mask".into(),
            });
        };
        let extras = SiteExtras::MaskGradient {
            gradient: outcome.gradient,
            risk: outcome.risk,
        };
        let next = ClientState::FedCd {
            mask: Some(outcome.mask),
            server: None,
        };
        Ok((extras, next))
    }

    fn representation_mask(&self, state: &ClientState) -> Option<Vec<f32>> {
        match state {
            ClientState::FedCd { mask, .. } => mask.clone(),
            _ => None,
        }
    }
}

/// The classifier's width (the mask's), or an error when the model has no linear head.
fn width(spec: &ModelSpec, m: &RoundManifest) -> Result<usize, SiteError> {
    spec.head_width().ok_or_else(|| SiteError::Plan {
        round: m.round,
        message: "FedCD needs a model that ends in a linear classifier".into(),
    })
}

/// Checks a FedCD state read from a checkpoint against `spec`: its mask and the federation's
/// mask gradient must have the classifier's width.
pub(crate) fn check(state: &ClientState, spec: &ModelSpec) -> Result<(), SiteError> {
    let ClientState::FedCd { mask, server } = state else {
        return Ok(());
    };
    let width = spec.head_width();
    let vectors = mask.iter().map(|m| ("mask", m)).chain(
        server
            .iter()
            .flat_map(|(_, s)| s.values().map(|g| ("mask gradient", g))),
    );
    for (what, v) in vectors {
        if Some(v.len()) != width {
            return Err(SiteError::Memory(format!(
                "the FedCD {what} has {} values, not the classifier's width {width:?}",
                v.len()
            )));
        }
    }
    Ok(())
}
