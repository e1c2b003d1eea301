//! FedDC (Gao et al.), site side: SCAFFOLD's variates plus the local drift `h_i`. Each step
//! follows `g - c_i + c + alpha (w - (w_global - h_i))` (the objective's term, from SCAFFOLD's
//! correction and the anchor `w - h_i` built here); the drift advances by the update's delta
//! as the server decodes it, once the update is accepted.

use super::{After, Before, ClientAlgorithm, ClientState, Controls, Inputs, Received, scaffold};
use crate::error::SiteError;
use crate::state::{Select, StateDict, export};
use crate::zoo::Net;
use unifed_protocol::ModelSpec;
use unifed_protocol::encoding::{EncodedTensorRef, decode};
use unifed_protocol::messages::{RoundManifest, ServerExtras, SiteExtras};

/// FedDC's client.
#[derive(Debug, Clone, Copy)]
pub struct FedDc;

impl<N: Net> ClientAlgorithm<N> for FedDc {
    fn adopt(&self, held: ClientState) -> ClientState {
        match held {
            held @ ClientState::FedDc { .. } => held,
            ClientState::Scaffold(controls) => ClientState::FedDc {
                controls,
                drift: Default::default(),
            },
            _ => ClientState::FedDc {
                controls: Controls::default(),
                drift: Default::default(),
            },
        }
    }

    fn received(
        &self,
        spec: &ModelSpec,
        select: Select,
        m: &RoundManifest,
        version: u64,
        extras: &ServerExtras,
    ) -> Result<Option<Received>, SiteError> {
        scaffold::received(spec, select, m, version, extras)
    }

    fn inputs(&self, before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        Ok(Inputs {
            correction: Some(scaffold::correction(before)?),
            anchor: Some(anchor(before)),
            ..Inputs::default()
        })
    }

    fn streams_update(&self) -> bool {
        false
    }

    fn after_delta(&self, after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        let (extras, controls) = scaffold::advance(after)?;
        let drift = after.state.drift().cloned().unwrap_or_default();
        Ok((extras, ClientState::FedDc { controls, drift }))
    }

    fn after_encoding(
        &self,
        spec: &ModelSpec,
        encoded: &[EncodedTensorRef<'_>],
        next: &mut ClientState,
    ) -> Result<(), SiteError> {
        let ClientState::FedDc { drift, .. } = next else {
            return Ok(());
        };
        // The drift moves by what the server adds to its sum: the decoded delta of every
        // trainable tensor.
        for e in encoded {
            if spec.tensor(&e.name).is_none_or(|t| t.kind.is_bn_stat()) {
                continue;
            }
            let back = decode(e).map_err(|e| SiteError::NonFinite(e.to_string()))?;
            let h = drift
                .entry(e.name.clone())
                .or_insert_with(|| vec![0.0; back.len()]);
            h.iter_mut().zip(&back).for_each(|(h, d)| *h += d);
        }
        Ok(())
    }
}

/// FedDC's anchor `w - h_i`: the site's current tensors the round averages (the round's model,
/// before training) less its drift, for the trainable ones.
fn anchor<N: Net>(before: &Before<'_, N>) -> StateDict {
    let mut sd = export(before.net, before.spec, before.select);
    sd.tensors.retain(|t| !t.kind.is_bn_stat());
    let drift = before.state.drift();
    for t in &mut sd.tensors {
        if let Some(h) = drift.and_then(|d| d.get(&t.name)) {
            t.data.iter_mut().zip(h).for_each(|(w, h)| *w -= h);
        }
    }
    sd
}
