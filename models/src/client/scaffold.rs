//! SCAFFOLD (Karimireddy et al., option II), site side: each step is corrected by `c - c_i`
//! (the objective's term), the update carries `c_i+ - c_i` as the server will decode it, and
//! `c_i` advances by that decoded delta once the update is accepted, so site and server agree
//! under lossy encodings and re-sends. The state is `c_i` and the server's `c` of the model
//! version applied last (it comes beside the model).

use super::{After, Before, ClientAlgorithm, ClientState, Controls, Inputs, Received, Tensors};
use crate::error::SiteError;
use crate::state::{NamedTensor, Select, StateDict};
use crate::update::encoding_for;
use crate::zoo::Net;
use unifed_protocol::ModelSpec;
use unifed_protocol::encoding::{EncodedTensor, decode};
use unifed_protocol::messages::{RoundManifest, ServerExtras, SiteExtras};

/// SCAFFOLD's client.
#[derive(Debug, Clone, Copy)]
pub struct Scaffold;

impl<N: Net> ClientAlgorithm<N> for Scaffold {
    fn adopt(&self, held: ClientState) -> ClientState {
        match held {
            ClientState::Scaffold(c) | ClientState::FedDc { controls: c, .. } => {
                ClientState::Scaffold(c)
            }
            _ => ClientState::Scaffold(Controls::default()),
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
        received(spec, select, m, version, extras)
    }

    fn inputs(&self, before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        Ok(Inputs {
            correction: Some(correction(before)?),
            ..Inputs::default()
        })
    }

    fn streams_update(&self) -> bool {
        false
    }

    fn after_delta(&self, after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        let (extras, controls) = advance(after)?;
        Ok((extras, ClientState::Scaffold(controls)))
    }
}

/// The server control variate beside model `version`, checked: it must come, and cover the
/// averaged trainable tensors of `spec` in spec order.
pub(crate) fn received(
    spec: &ModelSpec,
    select: Select,
    m: &RoundManifest,
    version: u64,
    extras: &ServerExtras,
) -> Result<Option<Received>, SiteError> {
    let plan = |message: &str| SiteError::Plan {
        round: m.round,
        message: message.into(),
    };
    let ServerExtras::Control(tensors) = extras else {
        return Err(plan("no server control variate beside the model"));
    };
    let c = crate::state::from_encoded(spec, tensors)?;
    let got: Vec<&str> = c.tensors.iter().map(|t| t.name.as_str()).collect();
    if covered(spec, select) != got {
        return Err(plan(
            "the server control variate does not cover the averaged trainable tensors in spec \
             order",
        ));
    }
    Ok(Some(Received::Tensors((
        version,
        c.tensors.into_iter().map(|t| (t.name, t.data)).collect(),
    ))))
}

/// The server control variate `c` of the manifest's model version, from `controls`.
pub(crate) fn server_control<'a>(
    controls: Option<&'a Controls>,
    m: &RoundManifest,
) -> Result<&'a Tensors, SiteError> {
    match controls.and_then(|c| c.server.as_ref()) {
        Some((v, c)) if *v == m.model_version => Ok(c),
        _ => Err(SiteError::Plan {
            round: m.round,
            message: format!(
                "no server control variate of model v{} was applied",
                m.model_version
            ),
        }),
    }
}

/// The correction `c - c_i` for the trainable tensors of the spec the round averages.
pub(crate) fn correction<N: Net>(before: &Before<'_, N>) -> Result<StateDict, SiteError> {
    let controls = before.state.controls();
    let c = server_control(controls, before.manifest)?;
    let own = controls.map(|c| &c.control);
    let spec = before.spec;
    let tensors = spec
        .tensors
        .iter()
        .filter(|t| before.select.keeps(t.kind) && !t.kind.is_bn_stat())
        .filter_map(|t| {
            let c = c.get(&t.name)?;
            let ci = own.and_then(|o| o.get(&t.name));
            let data = c
                .iter()
                .enumerate()
                .map(|(k, &c)| c - ci.and_then(|ci| ci.get(k)).copied().unwrap_or(0.0))
                .collect();
            Some(NamedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                kind: t.kind,
                data,
            })
        })
        .collect();
    Ok(StateDict {
        spec_hash: spec.hash(),
        tensors,
    })
}

/// The update's control-variate delta, encoded as the round says, and the variates an accepted
/// update leaves: `c_i` moved by what the server will add, the decoded delta.
pub(crate) fn advance<N: Net>(after: &After<'_, N>) -> Result<(SiteExtras, Controls), SiteError> {
    let controls = after.state.controls();
    let c = server_control(controls, after.manifest)?;
    let mut next = Controls {
        control: controls.map(|c| c.control.clone()).unwrap_or_default(),
        server: None,
    };
    let dc = control_delta(after.delta, c, after.steps, after.lr);
    let mut sent: Vec<EncodedTensor> = Vec::with_capacity(dc.len());
    for t in &dc {
        let e = t.encode(encoding_for(t.kind, after.manifest.encoding), None);
        let back = decode(&e).map_err(|e| SiteError::NonFinite(e.to_string()))?;
        let ci = next
            .control
            .entry(t.name.clone())
            .or_insert_with(|| vec![0.0; back.len()]);
        ci.iter_mut().zip(&back).for_each(|(c, d)| *c += d);
        sent.push(e);
    }
    Ok((SiteExtras::Control(sent), next))
}

/// SCAFFOLD option II: the change of a site's control variate after `steps` local steps of
/// learning rate `lr` that moved its trainable tensors by `delta` (`y_i - x`):
/// `c_i+ - c_i = -c + (x - y_i) / (K lr) = -c - delta / (K lr)`, for every trainable tensor of
/// `delta` that `c` covers (BN running statistics never). Option II assumes plain SGD; a site
/// training with heavy-ball momentum `beta` passes its effective step `lr / (1 - beta)` (our
/// extension: the paper's experiments use plain SGD).
pub fn control_delta(delta: &StateDict, c: &Tensors, steps: usize, lr: f64) -> Vec<NamedTensor> {
    let k_lr = steps.max(1) as f64 * lr;
    delta
        .tensors
        .iter()
        .filter(|t| !t.kind.is_bn_stat())
        .filter_map(|t| {
            let c = c.get(&t.name)?;
            let data = t
                .data
                .iter()
                .zip(c)
                .map(|(&d, &c)| (-(c as f64) - d as f64 / k_lr) as f32)
                .collect();
            Some(NamedTensor { data, ..t.clone() })
        })
        .collect()
}

/// The tensors of `spec` a control variate covers under `select`, in spec order.
pub(crate) fn covered(spec: &ModelSpec, select: Select) -> Vec<&str> {
    spec.tensors
        .iter()
        .filter(|t| select.keeps(t.kind) && !t.kind.is_bn_stat())
        .map(|t| t.name.as_str())
        .collect()
}
