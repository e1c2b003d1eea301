//! FedDC (Gao et al. 2022) on the site: the corrected, drift-penalised step on hand-computed
//! values, and the local drift, which only an accepted update advances, by exactly the delta the
//! server decodes, and which survives a restart.

use crate::common;

use common::*;
use unifed_models::client::ClientState;
use unifed_models::objective::{SiteState, Term, TermError};
use unifed_models::site::Site;
use unifed_models::state::{Select, export};
use unifed_models::train::{TrainConfig, train_objective};
use unifed_models::zoo::Mlp;
use unifed_protocol::messages::{
    BnPolicy, Download, Objective, ServerBroadcast, ServerExtras, SiteExtras,
};
use unifed_protocol::{Encoding, Envelope, Id, ModelSpec, SiteUpdate};

/// FedDC's drift in the site's memory (empty when it keeps none).
fn drift<N: unifed_models::zoo::Net>(
    site: &Site<N>,
) -> std::collections::BTreeMap<String, Vec<f32>> {
    let memory = site.memory().unwrap();
    memory.algorithm.drift().cloned().unwrap_or_default()
}

#[test]
fn a_feddc_step_adds_alpha_times_the_drift_and_the_correction_to_the_gradient() {
    let (net0, spec) = tiny_mlp(3);
    let d = tiny_data(8);
    // One step over the whole batch from w0: the penalty's gradient there is
    // alpha (w0 - (w0 - h)) = alpha h, so the step moves by -lr (alpha h + c - c_i) more than
    // the plain one.
    let tc = TrainConfig {
        lr: 0.1,
        batch_size: 8,
        seed: 5,
        ..TrainConfig::default()
    };
    let (alpha, h) = (0.2f32, 0.3f32);
    let mut correction = export(&net0, &spec, Select::NonBn);
    for t in &mut correction.tensors {
        t.data
            .iter_mut()
            .enumerate()
            .for_each(|(k, v)| *v = 0.5 - 0.01 * k as f32);
    }
    let mut anchor = export(&net0, &spec, Select::NonBn);
    anchor
        .tensors
        .iter_mut()
        .for_each(|t| t.data.iter_mut().for_each(|w| *w -= h));
    let run = |term: &Term<Mlp>| {
        let (n, rep) = train_objective(&net0, &d, 2, &tc, term, &device(), |_| {}).unwrap();
        assert_eq!(rep.steps, 1);
        export(&n, &spec, Select::All).tensors
    };
    let plain = run(&Term::None);
    let state = SiteState {
        correction: Some(&correction),
        previous: None,
        anchor: Some(&anchor),
        ..SiteState::default()
    };
    let objective = Objective::Drift {
        alpha: alpha as f64,
    };
    let drifted = run(&Term::new(&objective, &net0, Select::NonBn, state).unwrap());
    assert_moved_by(
        &drifted,
        &plain,
        |_, k| -0.1 * (alpha * h + 0.5 - 0.01 * k as f32),
        "FedDC's terms",
    );
    // Without the correction or the anchor the term cannot be prepared.
    let half = SiteState {
        correction: Some(&correction),
        ..SiteState::default()
    };
    let err = Term::new(&objective, &net0, Select::NonBn, half).unwrap_err();
    assert!(
        matches!(
            err,
            TermError::Missing {
                algorithm: "FedDC",
                ..
            }
        ),
        "{err}"
    );
}

fn update(bytes: &[u8]) -> SiteUpdate {
    Envelope::decode(bytes).unwrap().payload_as().unwrap()
}

/// The server's model of `version` (the non-BN tensors of `net`) with `c = 0.1` everywhere.
fn broadcast(net: &Mlp, spec: &ModelSpec, version: u64) -> Download {
    let sd = export(net, spec, Select::NonBn);
    let exact = |v: Option<f32>| {
        sd.tensors
            .iter()
            .map(|t| {
                let mut t = t.clone();
                if let Some(v) = v {
                    t.data.iter_mut().for_each(|x| *x = v);
                }
                t.encode(Encoding::F32, None)
            })
            .collect()
    };
    Download::Model(ServerBroadcast {
        model_version: version,
        weights: exact(None),
        extras: ServerExtras::Control(exact(Some(0.1))),
    })
}

#[test]
fn only_an_accepted_feddc_update_advances_the_drift_by_the_decoded_delta_and_it_survives_a_restart()
{
    let (net, spec) = tiny_mlp(3);
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    // A lossy encoding: the drift must follow what the server decodes, not the exact delta.
    let m = |round| {
        tiny_manifest(
            round,
            Encoding::Q8,
            BnPolicy::Local,
            Objective::Drift { alpha: 0.01 },
        )
    };
    let mut site = Site::new("a", net.clone(), tiny_data(16), tiny_data(8)).unwrap();
    // A FedDC round's model without the server's variate is refused.
    let Download::Model(b) = broadcast(&net, &spec, 0) else {
        unreachable!()
    };
    let bare = Download::Model(ServerBroadcast {
        extras: ServerExtras::None,
        ..b
    });
    assert!(site.receive(&spec, &m(1), &bare).is_err());
    site.receive(&spec, &m(1), &broadcast(&net, &spec, 0))
        .unwrap();
    let u = update(
        &site
            .train_round(&spec, &fed, &m(1), &tc, &device(), |_| {})
            .unwrap(),
    );
    assert!(matches!(u.extras, SiteExtras::Control(_)));
    assert!(drift(&site).is_empty(), "advanced before the answer");
    site.answered(1, false);
    assert!(drift(&site).is_empty(), "a rejected update advanced it");
    let u1 = update(
        &site
            .train_round(&spec, &fed, &m(1), &tc, &device(), |_| {})
            .unwrap(),
    );
    site.answered(1, true);
    let decoded = |u: &SiteUpdate, name: &str| {
        unifed_protocol::decode(u.delta.iter().find(|t| t.name == name).unwrap()).unwrap()
    };
    let names: Vec<String> = export(&net, &spec, Select::NonBn)
        .tensors
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(drift(&site).len(), names.len());
    for n in &names {
        assert_eq!(drift(&site)[n], decoded(&u1, n), "{n}");
    }

    // Round 2 from model v1, after what the agent's checkpoint keeps is restored into a new
    // process's site: both send the same bytes, and the drift sums both accepted deltas.
    site.receive(&spec, &m(2), &broadcast(&tiny_mlp(4).0, &spec, 1))
        .unwrap();
    let state = export(&site.net, &spec, Select::All);
    let restored =
        |memory| common::restored(&net, &spec, &state, memory, tiny_data(16), tiny_data(8));
    let kept = site.memory().unwrap();
    let mut again = restored(kept.clone());
    let bytes = same_round(&mut site, &mut again, &spec, &m(2), &tc);
    site.answered(2, true);
    let u2 = update(&bytes);
    for n in &names {
        let want: Vec<f32> = decoded(&u1, n)
            .iter()
            .zip(decoded(&u2, n))
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(drift(&site)[n], want, "{n}");
    }
    // The drift steers training: the same site with another drift sends other bytes.
    let mut other = kept;
    let ClientState::FedDc { drift, .. } = &mut other.algorithm else {
        panic!("FedDC's state is {:?}", other.algorithm);
    };
    drift
        .values_mut()
        .for_each(|h| h.iter_mut().for_each(|v| *v += 1.0));
    assert_ne!(
        bytes,
        restored(other)
            .train_round(&spec, &fed, &m(2), &tc, &device(), |_| {})
            .unwrap()
    );
    // A drift of the wrong length is refused, naming the tensor.
    let mut short = site.memory().unwrap();
    let ClientState::FedDc { drift, .. } = &mut short.algorithm else {
        panic!("FedDC's state is {:?}", short.algorithm);
    };
    drift.get_mut(&names[0]).unwrap().pop();
    let err = Site::new("a", net, tiny_data(16), tiny_data(8))
        .unwrap()
        .restore_memory(short, &spec)
        .unwrap_err();
    assert!(err.to_string().contains(&names[0]), "{err}");
}
