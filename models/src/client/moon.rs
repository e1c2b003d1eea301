//! MOON (Li, He and Song): sites add a model-contrastive loss against the round's starting
//! model and their previous local model (the objective's term); the previous local model, every
//! tensor of the model trained in the last accepted round, is this client's state.

use super::{After, Before, ClientAlgorithm, ClientState, Inputs, Tensors};
use crate::error::SiteError;
use crate::state::{NamedTensor, Select, StateDict, export, import};
use crate::zoo::Net;
use unifed_protocol::ModelSpec;
use unifed_protocol::messages::SiteExtras;

/// MOON's client.
#[derive(Debug, Clone, Copy)]
pub struct Moon;

impl<N: Net> ClientAlgorithm<N> for Moon {
    fn adopt(&self, held: ClientState) -> ClientState {
        match held {
            held @ ClientState::Moon { .. } => held,
            _ => ClientState::Moon { previous: None },
        }
    }

    fn inputs(&self, before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        let previous = match before.state.previous() {
            Some(p) => Some(previous_net(before.net, before.spec, p)?),
            None => None,
        };
        Ok(Inputs {
            previous,
            ..Inputs::default()
        })
    }

    fn streams_update(&self) -> bool {
        false
    }

    fn after_delta(&self, after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        let previous = export(after.net, after.spec, Select::All)
            .tensors
            .into_iter()
            .map(|t| (t.name, t.data))
            .collect();
        Ok((
            SiteExtras::None,
            ClientState::Moon {
                previous: Some(previous),
            },
        ))
    }
}

/// The previous local model built from its tensors, on `net`'s device. A tensor of the spec
/// it lacks is an error naming it.
fn previous_net<N: Net>(net: &N, spec: &ModelSpec, previous: &Tensors) -> Result<N, SiteError> {
    let tensors = spec
        .tensors
        .iter()
        .map(|t| match previous.get(&t.name) {
            Some(data) if data.len() == t.numel() => Ok(NamedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                kind: t.kind,
                data: data.clone(),
            }),
            _ => Err(SiteError::Memory(format!(
                "the previous local model lacks `{}`",
                t.name
            ))),
        })
        .collect::<Result<_, _>>()?;
    let sd = StateDict {
        spec_hash: spec.hash(),
        tensors,
    };
    Ok(import(net, spec, &sd, Select::All)?)
}
