//! MOON (Li, He and Song 2021): the model-contrastive loss and its gradient on hand-computed
//! values, its place in a training step, and the previous local model the site keeps (advanced
//! only by an accepted update, surviving a restart, refused when it does not fit the model).

use crate::common;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use common::*;
use unifed_models::bn::BnPass;
use unifed_models::client::ClientState;
use unifed_models::objective::{SiteState, Term, TermError, contrastive_loss, cosine_rows};
use unifed_models::site::Site;
use unifed_models::state::{Select, export, import};
use unifed_models::train::{TrainConfig, batch_tensors, train_objective};
use unifed_models::zoo::{Mlp, Net};
use unifed_protocol::ObjectiveError;
use unifed_protocol::messages::{
    BnPolicy, Download, Objective, RoundManifest, ServerBroadcast, ServerExtras,
};
use unifed_protocol::{Encoding, Id, ModelSpec};

fn rows(v: &[[f32; 2]], device: &burn::tensor::Device) -> Tensor<2> {
    let flat: Vec<f32> = v.iter().flatten().copied().collect();
    Tensor::from_data(TensorData::new(flat, [v.len(), 2]), device)
}

/// `cos(z, y)` and its gradient with respect to `z`: `y / (|z| |y|) - cos z / |z|^2`.
fn cos_and_grad(z: [f64; 2], y: [f64; 2]) -> (f64, [f64; 2]) {
    let nz = (z[0] * z[0] + z[1] * z[1]).sqrt();
    let ny = (y[0] * y[0] + y[1] * y[1]).sqrt();
    let c = (z[0] * y[0] + z[1] * y[1]) / (nz * ny);
    let g = |k: usize| y[k] / (nz * ny) - c * z[k] / (nz * nz);
    (c, [g(0), g(1)])
}

#[test]
fn the_contrastive_loss_and_its_gradient_match_hand_computed_values_on_a_two_sample_batch() {
    let t = 0.5;
    let z = [[1.0f32, 0.0], [3.0, 4.0]];
    let glob = [[1.0f32, 0.0], [0.0, 2.0]];
    let prev = [[0.0f32, 1.0], [1.0, 1.0]];
    // Sample 1 by hand: cos(z, glob) = 1, cos(z, prev) = 0, so the loss is
    // -log(e^2 / (e^2 + e^0)) = log(1 + e^-2) and its gradient sigma(-2) * (d cos(z, prev) / dz) / t
    // = 0.1192 * (0, 1) / 0.5 (d cos(z, glob) / dz = 0 where z and glob are parallel).
    let one = (1.0 + (-2.0f64).exp()).ln();
    assert!((one - 0.126_928).abs() < 1e-6);
    let mut want_loss = 0.0;
    let mut want_grad = [[0.0f64; 2]; 2];
    for i in 0..2 {
        let f = |v: [f32; 2]| [v[0] as f64, v[1] as f64];
        let (a, da) = cos_and_grad(f(z[i]), f(glob[i]));
        let (b, db) = cos_and_grad(f(z[i]), f(prev[i]));
        let s = (b - a) / t;
        want_loss += (1.0 + s.exp()).ln() / 2.0;
        let sigma = 1.0 / (1.0 + (-s).exp());
        for k in 0..2 {
            want_grad[i][k] = sigma * (db[k] - da[k]) / t / 2.0;
        }
    }
    assert!((want_grad[0][1] - 0.119_203 * 2.0 / 2.0).abs() < 1e-5);

    let ad = device().autodiff();
    let zt = rows(&z, &ad).require_grad();
    let loss = contrastive_loss(zt.clone(), rows(&glob, &ad), rows(&prev, &ad), t);
    let got_loss = loss.clone().into_scalar::<f32>() as f64;
    assert!(
        (got_loss - want_loss).abs() < 1e-6,
        "{got_loss} vs {want_loss}"
    );
    let grads = loss.backward();
    let g: Vec<f32> = zt
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    for i in 0..2 {
        for k in 0..2 {
            let got = g[i * 2 + k] as f64;
            assert!(
                (got - want_grad[i][k]).abs() < 1e-6,
                "d loss / d z[{i}][{k}]: {got} vs {}",
                want_grad[i][k]
            );
        }
    }
    // An all-zero representation (a ReLU output can be one) has similarity 0, not NaN.
    let zero = contrastive_loss(
        rows(&[[0.0, 0.0], [0.0, 0.0]], &ad),
        rows(&glob, &ad),
        rows(&prev, &ad),
        t,
    );
    assert!((zero.into_scalar::<f32>() as f64 - 2f64.ln()).abs() < 1e-6);
}

fn moon(mu: f64) -> Objective {
    Objective::Contrastive {
        mu,
        temperature: 0.5,
    }
}

fn tc() -> TrainConfig {
    TrainConfig {
        lr: 0.1,
        batch_size: 8,
        epochs: 2,
        seed: 5,
        ..TrainConfig::default()
    }
}

#[test]
fn a_moon_step_is_cross_entropy_until_there_is_a_previous_model_and_then_pulls_away_from_it() {
    let (net0, spec) = tiny_mlp(3);
    let (other, _) = tiny_mlp(9);
    let d = tiny_data(16);
    let run = |term: &Term<Mlp>| {
        let (n, rep) = train_objective(&net0, &d, 2, &tc(), term, &device(), |_| {}).unwrap();
        (export(&n, &spec, Select::All).tensors, rep.epoch_losses)
    };
    let prepare = |objective: &Objective, previous: Option<Mlp>| {
        let state = SiteState {
            previous,
            ..SiteState::default()
        };
        Term::new(objective, &net0, Select::NonBn, state).unwrap()
    };
    let plain = run(&Term::None);
    // No previous local model (a site's first round), or mu = 0: no term at all.
    assert!(matches!(prepare(&moon(1.0), None), Term::None));
    assert!(matches!(
        prepare(&moon(0.0), Some(other.clone())),
        Term::None
    ));
    // A previous model equal to the starting one: the positive and the negative pair are the
    // same, and the term's gradient vanishes.
    let same = run(&prepare(&moon(1.0), Some(net0.clone())));
    for (a, b) in same.0.iter().zip(&plain.0) {
        for (x, y) in a.data.iter().zip(&b.data) {
            assert!((x - y).abs() < 1e-6, "{}: {x} vs {y}", a.name);
        }
    }
    // Another previous model: the steps differ.
    let term = prepare(&moon(1.0), Some(other.clone()));
    assert!(term.contrast().is_some() && term.holds_start());
    let pulled = run(&term);
    let moved = pulled
        .0
        .iter()
        .zip(&plain.0)
        .filter(|(a, b)| !a.kind.is_bn_stat() && a.data != b.data)
        .count();
    assert!(moved >= 4, "only {moved} tensors felt the term");
    assert!(pulled.1.iter().all(|l| l.is_finite()));
    // With the contrastive loss weighted up, training moves the representation towards the
    // starting model's and away from the previous model's, more than cross-entropy alone does.
    let margin = |term: &Term<Mlp>| {
        let (n, _) = train_objective(&net0, &d, 2, &tc(), term, &device(), |_| {}).unwrap();
        let x = batch_tensors(&d, &(0..d.len()).collect::<Vec<_>>(), &device()).0;
        let z = |m: &Mlp| m.valid().features(x.clone(), &mut BnPass::standard());
        let (zn, zg, zp) = (z(&n), z(&net0), z(&other));
        let gap = cosine_rows(zn.clone(), zg) - cosine_rows(zn, zp);
        gap.mean().into_scalar::<f32>()
    };
    let (with, without) = (
        margin(&prepare(&moon(10.0), Some(other.clone()))),
        margin(&Term::None),
    );
    assert!(with > without + 0.01, "{with} vs {without}");
    // The frozen models are not trained: the starting model's weights are untouched.
    assert_eq!(
        export(&net0, &spec, Select::All).tensors,
        export(&tiny_mlp(3).0, &spec, Select::All).tensors
    );
    // A bad temperature is refused, naming it.
    let err = Term::new(
        &Objective::Contrastive {
            mu: 1.0,
            temperature: 0.0,
        },
        &net0,
        Select::NonBn,
        SiteState::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, TermError::Objective(ObjectiveError::Temperature(t)) if t == 0.0),
        "{err}"
    );
}

fn manifest(round: u64, objective: Objective) -> RoundManifest {
    tiny_manifest(round, Encoding::F32, BnPolicy::Local, objective)
}

/// The server's model of `version`: the non-BN tensors of `net`.
fn broadcast(net: &Mlp, spec: &ModelSpec, version: u64) -> Download {
    Download::Model(ServerBroadcast {
        model_version: version,
        weights: export(net, spec, Select::NonBn)
            .tensors
            .iter()
            .map(|t| t.encode(Encoding::F32, None))
            .collect(),
        extras: ServerExtras::None,
    })
}

#[test]
fn only_an_accepted_moon_update_makes_the_trained_model_the_previous_one_and_it_survives_a_restart()
{
    let (net, spec) = tiny_mlp(3);
    let (next, _) = tiny_mlp(4);
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let mut site = Site::new("a", net.clone(), tiny_data(16), tiny_data(8)).unwrap();
    let mut plain = Site::new("a", net.clone(), tiny_data(16), tiny_data(8)).unwrap();
    // Round 1: no previous model, so MOON's update is FedAvg's, byte for byte.
    let a = site
        .train_round(&spec, &fed, &manifest(1, moon(1.0)), &tc, &device(), |_| {})
        .unwrap();
    let b = plain
        .train_round(
            &spec,
            &fed,
            &manifest(1, Objective::CrossEntropy),
            &tc,
            &device(),
            |_| {},
        )
        .unwrap();
    assert_eq!(a, b);
    assert!(
        site.memory().unwrap().algorithm.previous().is_none(),
        "kept before the answer"
    );
    site.answered(1, false);
    assert!(
        site.memory().unwrap().algorithm.previous().is_none(),
        "a rejected update kept it"
    );
    site.train_round(&spec, &fed, &manifest(1, moon(1.0)), &tc, &device(), |_| {})
        .unwrap();
    site.answered(1, true);
    plain.answered(1, true);
    // The previous model is the trained one, every tensor (BN included).
    let trained = export(&site.net, &spec, Select::All);
    let previous = site
        .memory()
        .unwrap()
        .algorithm
        .previous()
        .cloned()
        .unwrap();
    assert_eq!(previous.len(), spec.tensors.len());
    for t in &trained.tensors {
        assert_eq!(previous[&t.name], t.data, "{}", t.name);
    }
    // Plain cross-entropy keeps no previous model.
    assert!(plain.memory().unwrap().algorithm.previous().is_none());

    // Round 2 from the server's model v1: what the agent's checkpoint holds after applying it
    // (the model and the memory), restored into a new process's site, trains the same bytes.
    for s in [&mut site, &mut plain] {
        s.receive(&spec, &manifest(2, moon(1.0)), &broadcast(&next, &spec, 1))
            .unwrap();
    }
    let state = export(&site.net, &spec, Select::All);
    let mut again = Site::new(
        "a",
        import(&net, &spec, &state, Select::All).unwrap(),
        tiny_data(16),
        tiny_data(8),
    )
    .unwrap();
    again.restore_memory(site.memory().unwrap(), &spec).unwrap();
    let m2 = manifest(2, moon(1.0));
    let uninterrupted = site
        .train_round(&spec, &fed, &m2, &tc, &device(), |_| {})
        .unwrap();
    let restarted = again
        .train_round(&spec, &fed, &m2, &tc, &device(), |_| {})
        .unwrap();
    assert_eq!(uninterrupted, restarted);
    // The contrastive term changed round 2 (it had a previous model to contrast with).
    let fedavg = plain
        .train_round(
            &spec,
            &fed,
            &manifest(2, Objective::CrossEntropy),
            &tc,
            &device(),
            |_| {},
        )
        .unwrap();
    assert_ne!(uninterrupted, fedavg);

    // A previous model that does not fit the spec is refused, naming the tensor.
    let mut short = site.memory().unwrap();
    let name = spec.tensors[0].name.clone();
    let ClientState::Moon { previous: Some(p) } = &mut short.algorithm else {
        panic!("MOON's state is {:?}", short.algorithm);
    };
    p.get_mut(&name).unwrap().pop();
    let err = Site::new("a", net.clone(), tiny_data(16), tiny_data(8))
        .unwrap()
        .restore_memory(short, &spec)
        .unwrap_err();
    assert!(err.to_string().contains(&name), "{err}");
    // One that lacks a tensor cannot train, and says which.
    let mut partial = site.memory().unwrap();
    let ClientState::Moon { previous: Some(p) } = &mut partial.algorithm else {
        panic!("MOON's state is {:?}", partial.algorithm);
    };
    p.remove(&name);
    let mut lacking = Site::new("a", net, tiny_data(16), tiny_data(8)).unwrap();
    lacking.restore_memory(partial, &spec).unwrap();
    let err = lacking
        .train_round(&spec, &fed, &m2, &tc, &device(), |_| {})
        .unwrap_err();
    assert!(err.to_string().contains(&name), "{err}");
}
