//! Local objectives and the site's update: FedProx's gradient term on hand-computed values, its
//! effect on a real training step, SCAFFOLD's corrected step and control variates, and the
//! error-feedback residual and variate that only an accepted update advances.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use common::*;
use unifed_models::client::ClientState;
use unifed_models::data::Dataset;
use unifed_models::objective::{Reference, SiteState, Term, add_proximal};
use unifed_models::site::Site;
use unifed_models::state::{Select, export, import};
use unifed_models::train::{TrainConfig, TrainEvent, train_objective};
use unifed_models::zoo::{Mlp, MlpConfig, seeded};
use unifed_protocol::messages::{BnPolicy, Download, Objective, RoundManifest, RoundPlan};
use unifed_protocol::{Encoding, Envelope, Id, Input, ModelSpec, SiteUpdate, SpecHash, Values};

fn tiny() -> (Mlp, ModelSpec) {
    tiny_mlp(3)
}

fn data(n: usize) -> Dataset {
    tiny_data(n)
}

/// Every float parameter's gradient, with whether a BatchNorm layer owns it and whether it is a
/// running statistic, in visiting order.
struct Grads<'a> {
    grads: &'a GradientsParams,
    owners: Vec<String>,
    field: Vec<String>,
    out: Vec<(bool, bool, Vec<f32>)>,
}

impl ModuleVisitor for Grads<'_> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.owners.push(container.into());
        self.field.push(name.into());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.owners.pop();
        self.field.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let bn = self.owners.last().is_some_and(|o| o == "Struct:BatchNorm");
        let stat = self.field.last().is_some_and(|f| f.starts_with("running"));
        let g = self.grads.get::<D>(param.id).unwrap();
        self.out
            .push((bn, stat, g.into_data().try_into_vec_as::<f32>().unwrap()));
    }
}

/// Registers a gradient of 0.25 everywhere for every float parameter.
struct Quarter<'a>(&'a mut GradientsParams);

impl ModuleVisitor for Quarter<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let g = param.val().inner().zeros_like().add_scalar(0.25);
        self.0.register(param.id, g);
    }
}

fn proximal_grads(scope: Select) -> Vec<(bool, bool, Vec<f32>)> {
    let (net0, spec) = tiny();
    let reference = Reference::of(&net0, scope);
    // Every trainable tensor moves 0.5 away from where training started.
    let mut sd = export(&net0, &spec, Select::All);
    for t in &mut sd.tensors {
        if !t.kind.is_bn_stat() {
            t.data.iter_mut().for_each(|v| *v += 0.5);
        }
    }
    let net1 = import(&net0, &spec, &sd, Select::All).unwrap();
    let mut grads = GradientsParams::new();
    net1.visit(&mut Quarter(&mut grads));
    add_proximal(&net1, &mut grads, &reference, 0.1);
    let mut v = Grads {
        grads: &grads,
        owners: Vec::new(),
        field: Vec::new(),
        out: Vec::new(),
    };
    net1.visit(&mut v);
    v.out
}

#[test]
fn the_proximal_term_adds_mu_times_the_distance_to_the_reference_to_each_gradient() {
    // g + mu (w - w_ref) = 0.25 + 0.1 * 0.5 = 0.30 on the non-BN tensors; BN untouched (local).
    let local = proximal_grads(Select::NonBn);
    assert_eq!(local.len(), 3 * 2 + 2 * 4); // three linear layers, two BN layers
    for (bn, _, g) in &local {
        let want = if *bn { 0.25 } else { 0.30 };
        assert!(g.iter().all(|x| (x - want).abs() < 1e-6), "{bn}: {g:?}");
    }
    // Under global BN the BN affine parameters are averaged, so the term covers them too;
    // running statistics are never trained by gradients.
    let global = proximal_grads(Select::All);
    for (bn, stat, g) in &global {
        let want = if *stat { 0.25 } else { 0.30 };
        assert!(
            g.iter().all(|x| (x - want).abs() < 1e-6),
            "{bn} {stat}: {g:?}"
        );
    }
}

#[test]
fn a_fedprox_step_pulls_the_averaged_weights_toward_the_round_model_and_leaves_local_bn_alone() {
    let (net0, spec) = tiny();
    let d = data(8);
    let tc = |epochs| TrainConfig {
        lr: 0.1,
        batch_size: 8,
        epochs,
        seed: 5,
        ..TrainConfig::default()
    };
    let run = |epochs, objective: Objective, scope| {
        let term = Term::new(&objective, &net0, scope, SiteState::default()).unwrap();
        let (n, _) = train_objective(&net0, &d, 2, &tc(epochs), &term, &device(), |_| {}).unwrap();
        export(&n, &spec, Select::All).tensors
    };
    let w0 = export(&net0, &spec, Select::All).tensors;
    let w1 = run(1, Objective::CrossEntropy, Select::NonBn);
    let plain = run(2, Objective::CrossEntropy, Select::NonBn);
    let (mu, lr) = (0.5f32, 0.1f32);
    let prox = run(2, Objective::Proximal { mu: 0.5 }, Select::NonBn);
    // Step 1 starts at the reference, so the term is zero; step 2 adds lr * mu * (w1 - w0).
    let moved = assert_moved_by(
        &prox,
        &plain,
        |t, i| -lr * mu * (w1[t].data[i] - w0[t].data[i]),
        "the term",
    );
    // (A linear bias feeding a BN layer has no gradient; every other weight moves.)
    assert!(moved > 20, "only {moved} values felt the term");
    // mu = 0 is FedAvg bit for bit.
    assert_eq!(
        run(2, Objective::Proximal { mu: 0.0 }, Select::NonBn),
        plain
    );
    // Under global BN the affine parameters feel it too.
    let prox_all = run(2, Objective::Proximal { mu: 0.5 }, Select::All);
    let gamma = prox_all.iter().position(|t| t.kind.is_bn_affine()).unwrap();
    assert_ne!(prox_all[gamma].data, plain[gamma].data);
}

fn manifest(round: u64, encoding: Encoding, bn: BnPolicy) -> RoundManifest {
    tiny_manifest(round, encoding, bn, Objective::CrossEntropy)
}

fn update(bytes: &[u8]) -> SiteUpdate {
    Envelope::decode(bytes).unwrap().payload_as().unwrap()
}

/// Asserts that `err` says training or its delta went non-finite.
fn assert_diverged(err: &unifed_models::site::SiteError) {
    use unifed_models::site::SiteError;
    assert!(
        matches!(err, SiteError::NonFinite(_) | SiteError::Train(_)),
        "{err}"
    );
}

/// Site `a` on 16 training and 8 test samples, parking its starting model in `dir` when asked.
fn site_parked_in(net: &Mlp, dir: Option<&std::path::Path>) -> Site<Mlp> {
    let mut site = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    if let Some(d) = dir {
        site.park_base_in(d.join("base.f32")).unwrap();
    }
    site
}

#[test]
fn a_round_reports_trained_once_after_its_last_step_with_the_base_parked_or_held() {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    for parked in [false, true] {
        let mut site = site_parked_in(&net, parked.then_some(dir.path()));
        let mut events = Vec::new();
        let m = manifest(1, Encoding::F32, BnPolicy::Local);
        site.train_round(&spec, &fed, &m, &tc, &device(), |e| events.push(e))
            .unwrap();
        // 16 samples in batches of 8: two steps, the epoch's end, then training is over.
        let steps = events
            .iter()
            .filter(|e| matches!(e, TrainEvent::Step { .. }))
            .count();
        let trained = events.iter().filter(|e| **e == TrainEvent::Trained).count();
        assert_eq!((steps, trained), (2, 1), "parked: {parked}");
        assert_eq!(
            events.last(),
            Some(&TrainEvent::Trained),
            "parked: {parked}"
        );
    }
}

#[test]
fn only_an_accepted_update_advances_the_error_feedback_residual_and_it_survives_a_restart() {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let topk = Encoding::TopK { per_mille: 100 };
    let mut site = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    let w = spec.tensors[0].name.clone();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    site.train_round(
        &spec,
        &fed,
        &manifest(1, topk, BnPolicy::Local),
        &tc,
        &device(),
        |_| {},
    )
    .unwrap();
    assert!(
        site.residual(&w).unwrap().is_empty(),
        "advanced before any answer"
    );
    site.answered(1, false);
    assert!(
        site.residual(&w).unwrap().is_empty(),
        "a rejected update advanced it"
    );
    site.train_round(
        &spec,
        &fed,
        &manifest(2, topk, BnPolicy::Local),
        &tc,
        &device(),
        |_| {},
    )
    .unwrap();
    site.answered(1, true); // an answer for another round changes nothing
    assert!(site.residual(&w).unwrap().is_empty());
    site.answered(2, true);
    let kept = site.residual(&w).unwrap();
    assert_eq!(kept.len(), spec.tensors[0].numel());
    assert!(kept.iter().any(|&v| v != 0.0));
    // The next update starts from that residual and makes its own, which a rejection drops:
    // the residual of the last accepted update is then exactly as it was.
    site.train_round(
        &spec,
        &fed,
        &manifest(3, topk, BnPolicy::Local),
        &tc,
        &device(),
        |_| {},
    )
    .unwrap();
    site.answered(3, false);
    assert_eq!(
        site.residual(&w).unwrap(),
        kept,
        "a rejected update moved it"
    );

    // What the checkpoint keeps, restored into a new process's site.
    let mut again = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    again.restore_memory(site.memory().unwrap(), &spec).unwrap();
    assert_eq!(again.residual(&w).unwrap(), kept);
    // The memory of another model is refused, naming the tensor.
    let (other, other_spec) = {
        let n = seeded(&device(), 3, |d| {
            MlpConfig {
                inputs: 5,
                hidden: [3, 3],
                classes: 2,
            }
            .init(d)
        });
        let s = common::spec(&n, 2, Input::Features { len: 5 });
        (n, s)
    };
    let err = Site::new("a", other, data(16), data(8))
        .unwrap()
        .restore_memory(site.memory().unwrap(), &other_spec)
        .unwrap_err();
    assert!(err.to_string().contains(&w), "{err}");
}

/// An exact (f32) update carries exactly `trained - base` for every averaged tensor, its
/// values' little-endian bytes (the site writes them from the delta's own buffer), and the
/// shared BN tensors as their values; nothing is left behind as a residual. Parked or not.
#[test]
fn an_exact_update_carries_the_trained_minus_base_bits_and_leaves_no_residual() {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    for (parked, bn) in [(false, BnPolicy::Local), (true, BnPolicy::Global)] {
        let mut site = site_parked_in(&net, parked.then_some(dir.path()));
        let select = if bn == BnPolicy::Local {
            Select::NonBn
        } else {
            Select::All
        };
        let base = export(&site.net, &spec, select);
        let bytes = site
            .train_round(
                &spec,
                &fed,
                &manifest(1, Encoding::F32, bn),
                &tc,
                &device(),
                |_| {},
            )
            .unwrap();
        let trained = export(&site.net, &spec, select);
        let u = update(&bytes);
        assert_eq!(u.delta.len(), base.tensors.len());
        for ((t, b), a) in u.delta.iter().zip(&base.tensors).zip(&trained.tensors) {
            assert_eq!(t.name, b.name);
            let want: Vec<u8> = a
                .data
                .iter()
                .zip(&b.data)
                .flat_map(|(a, b)| (a - b).to_le_bytes())
                .collect();
            assert!(
                matches!(&t.values, Values::F32(v) if *v == want),
                "{}",
                t.name
            );
            assert!(site.residual(&t.name).unwrap().is_empty(), "{}", t.name);
        }
        assert!(want_moved(&u), "training moved nothing");
    }
}

fn want_moved(u: &SiteUpdate) -> bool {
    u.delta
        .iter()
        .any(|t| matches!(&t.values, Values::F32(v) if v.iter().any(|&b| b != 0)))
}

#[test]
fn bn_running_statistics_travel_as_exact_f32_whatever_the_update_encoding() {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let mut site = Site::new("a", net, data(16), data(8)).unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    for enc in [
        Encoding::Q8,
        Encoding::F16,
        Encoding::TopK { per_mille: 100 },
    ] {
        let bytes = site
            .train_round(
                &spec,
                &fed,
                &manifest(1, enc, BnPolicy::Global),
                &tc,
                &device(),
                |_| {},
            )
            .unwrap();
        let u = update(&bytes);
        assert_eq!(u.delta.len(), spec.tensors.len());
        for (t, s) in u.delta.iter().zip(&spec.tensors) {
            let exact = matches!(t.values, Values::F32(_));
            assert_eq!(exact, s.kind.is_bn_stat(), "{enc:?} {}", t.name);
        }
        assert!(u.report.local_steps == 2 && u.report.train_loss.is_finite());
    }
}

#[test]
fn a_scaffold_step_follows_the_gradient_corrected_by_c_minus_c_i() {
    let (net0, spec) = tiny();
    let d = data(8);
    // One step over the whole batch: the corrected step is the plain one minus lr (c - c_i).
    let tc = TrainConfig {
        lr: 0.1,
        batch_size: 8,
        seed: 5,
        ..TrainConfig::default()
    };
    let mut correction = export(&net0, &spec, Select::NonBn);
    for t in &mut correction.tensors {
        t.data
            .iter_mut()
            .enumerate()
            .for_each(|(k, v)| *v = 0.5 - 0.01 * k as f32);
    }
    let run = |term: &Term<Mlp>| {
        let (n, rep) = train_objective(&net0, &d, 2, &tc, term, &device(), |_| {}).unwrap();
        assert_eq!(rep.steps, 1);
        export(&n, &spec, Select::All).tensors
    };
    let plain = run(&Term::None);
    let term = Term::new(
        &Objective::Scaffold,
        &net0,
        Select::NonBn,
        SiteState {
            correction: Some(&correction),
            ..SiteState::default()
        },
    )
    .unwrap();
    let corrected = run(&term);
    assert_moved_by(
        &corrected,
        &plain,
        |_, k| -0.1 * (0.5 - 0.01 * k as f32),
        "the correction",
    );
    // A SCAFFOLD round without its correction cannot be prepared.
    assert!(
        Term::new(
            &Objective::Scaffold,
            &net0,
            Select::NonBn,
            SiteState::default()
        )
        .is_err()
    );
}

#[test]
fn the_site_variate_change_is_minus_c_minus_the_delta_over_k_lr() {
    use std::collections::BTreeMap;
    use unifed_models::client::scaffold::control_delta;
    use unifed_models::state::{NamedTensor, StateDict};
    use unifed_protocol::TensorKind;
    let t = |name: &str, kind, data: Vec<f32>| NamedTensor {
        name: name.into(),
        shape: vec![data.len()],
        kind,
        data,
    };
    // K = 4 steps of lr 0.5 (K lr = 2) moved w by [1, -2] (x - y = [-1, 2]); c = [0.25, 0.5]:
    // c_i+ - c_i = -c + (x - y) / (K lr) = [-0.25 - 0.5, -0.5 + 1] = [-0.75, 0.5].
    let delta = StateDict {
        spec_hash: SpecHash([0; 32]),
        tensors: vec![
            t("w", TensorKind::NonBn, vec![1.0, -2.0]),
            t("bn.running_var", TensorKind::BnRunningVar, vec![0.3]),
        ],
    };
    let c: BTreeMap<String, Vec<f32>> = [("w".to_string(), vec![0.25, 0.5])].into();
    let dc = control_delta(&delta, &c, 4, 0.5);
    assert_eq!(dc.len(), 1, "running statistics have no variate");
    assert_eq!(dc[0].data, vec![-0.75, 0.5]);
}

#[test]
fn only_an_accepted_scaffold_update_advances_the_site_variate_and_it_survives_a_restart() {
    use unifed_protocol::messages::{ServerBroadcast, ServerExtras, SiteExtras};
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let mut site = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let scaffold = |round| RoundManifest {
        run: Default::default(),
        plan: RoundPlan {
            objective: Objective::Scaffold,
        },
        ..manifest(round, Encoding::F32, BnPolicy::Local)
    };
    // The server's model with c = 0.1 everywhere on the non-BN tensors.
    let sd = export(&net, &spec, Select::NonBn);
    let c: Vec<_> = sd
        .tensors
        .iter()
        .map(|t| {
            let mut t = t.clone();
            t.data.iter_mut().for_each(|v| *v = 0.1);
            t.encode(Encoding::F32, None)
        })
        .collect();
    let broadcast = |version| ServerBroadcast {
        model_version: version,
        weights: sd
            .tensors
            .iter()
            .map(|t| t.encode(Encoding::F32, None))
            .collect(),
        extras: ServerExtras::Control(c.clone()),
    };
    // A SCAFFOLD round's model without c is refused and changes nothing.
    let bare = ServerBroadcast {
        extras: ServerExtras::None,
        ..broadcast(0)
    };
    assert!(
        site.receive(&spec, &scaffold(1), &Download::Model(bare))
            .is_err()
    );
    site.receive(&spec, &scaffold(1), &Download::Model(broadcast(0)))
        .unwrap();
    let bytes = site
        .train_round(&spec, &fed, &scaffold(1), &tc, &device(), |_| {})
        .unwrap();
    let u = update(&bytes);
    let SiteExtras::Control(dc) = &u.extras else {
        panic!("{:?}", u.extras)
    };
    assert_eq!(dc.len(), sd.tensors.len());
    // Two steps of lr 0.01: Δc_i = -c - Δy / (2 * 0.01), c_i starting at 0.
    for (e, d) in dc.iter().zip(&u.delta) {
        let (dc, dy) = (decode(e), decode(d));
        for k in 0..dc.len() {
            let want = -0.1 - dy[k] as f64 / 0.02;
            assert!((dc[k] as f64 - want).abs() < 1e-3 * want.abs().max(1.0));
        }
    }
    let w = &sd.tensors[0].name;
    assert!(site.control(w).is_empty(), "advanced before the answer");
    site.answered(1, false);
    assert!(site.control(w).is_empty(), "a rejected update advanced it");
    site.train_round(&spec, &fed, &scaffold(1), &tc, &device(), |_| {})
        .unwrap();
    site.answered(1, true);
    let ci = site.control(w).to_vec();
    assert_eq!(ci.len(), sd.tensors[0].data.len());
    assert!(ci.iter().any(|&v| v != 0.0));
    // Restored from the checkpoint: c_i and the server's c of version 0.
    let mut again = Site::new("a", net, data(16), data(8)).unwrap();
    again.restore_memory(site.memory().unwrap(), &spec).unwrap();
    assert_eq!(again.control(w), &ci[..]);
    // A control variate of the wrong length is refused (it would index out of range).
    let mut short = site.memory().unwrap();
    let ClientState::Scaffold(controls) = &mut short.algorithm else {
        panic!("SCAFFOLD's state is {:?}", short.algorithm);
    };
    controls.control.get_mut(w.as_str()).unwrap().pop();
    assert!(
        Site::new("a", tiny().0, data(16), data(8))
            .unwrap()
            .restore_memory(short, &spec)
            .is_err()
    );
    again
        .train_round(&spec, &fed, &scaffold(1), &tc, &device(), |_| {})
        .unwrap();
    // A plan for a model version whose c was never applied cannot train.
    assert!(
        again
            .train_round(&spec, &fed, &scaffold(2), &tc, &device(), |_| {})
            .is_err()
    );
}

fn decode(t: &unifed_protocol::EncodedTensor) -> Vec<f32> {
    unifed_protocol::decode(t).unwrap()
}

#[test]
fn under_a_lossy_encoding_the_site_variate_moves_by_exactly_what_the_server_decodes() {
    use unifed_protocol::messages::{ServerBroadcast, ServerExtras, SiteExtras};
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let sd = export(&net, &spec, Select::NonBn);
    for enc in [
        Encoding::Q8,
        Encoding::F16,
        Encoding::TopK { per_mille: 300 },
    ] {
        let mut site = Site::new("a", net.clone(), data(16), data(8)).unwrap();
        let m = RoundManifest {
            run: Default::default(),
            plan: RoundPlan {
                objective: Objective::Scaffold,
            },
            ..manifest(1, enc, BnPolicy::Local)
        };
        let b = ServerBroadcast {
            model_version: 0,
            weights: sd
                .tensors
                .iter()
                .map(|t| t.encode(Encoding::F32, None))
                .collect(),
            extras: ServerExtras::Control(
                sd.tensors
                    .iter()
                    .map(|t| t.encode(Encoding::F32, None))
                    .collect(),
            ),
        };
        site.receive(&spec, &m, &Download::Model(b)).unwrap();
        let u = update(
            &site
                .train_round(&spec, &fed, &m, &tc, &device(), |_| {})
                .unwrap(),
        );
        site.answered(1, true);
        let SiteExtras::Control(dc) = &u.extras else {
            panic!("{:?}", u.extras)
        };
        for t in dc {
            assert_eq!(
                site.control(&t.name),
                &decode(t)[..],
                "{enc:?} {}: c_i must be what the server adds",
                t.name
            );
        }
    }
}

#[test]
fn a_site_that_parks_its_starting_model_and_memory_on_disk_sends_the_same_bytes_and_restores_them_on_failure()
 {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("base.f32");
    let memory_file = dir.path().join("base.memory");
    let held_file = dir.path().join("base.held");
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    // Under top-k the site carries an error-feedback residual from round to round and holds
    // the broadcast it applied: a parking site keeps both in files of their own between uses.
    // A stale file of an earlier process goes when the site parks; other files stay.
    let stale = dir.path().join("base.residual.999999");
    let other = dir.path().join("base.residual.x");
    std::fs::write(&stale, b"old").unwrap();
    std::fs::write(&other, b"not ours").unwrap();
    let stashes = |part: &str| -> Vec<u64> {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                let n = name.strip_prefix(&format!("base.{part}."))?;
                n.parse::<u64>()
                    .ok()
                    .map(|_| std::fs::metadata(dir.path().join(&name)).unwrap().len())
            })
            .collect()
    };
    let non_bn_bytes: u64 = spec
        .tensors
        .iter()
        .filter(|t| !t.kind.is_bn())
        .map(|t| 4 * t.numel() as u64)
        .sum();
    for encoding in [Encoding::F32, Encoding::TopK { per_mille: 100 }] {
        for bn in [BnPolicy::Local, BnPolicy::Global] {
            let mut plain = Site::new("a", net.clone(), data(16), data(8)).unwrap();
            let mut parking = Site::new("a", net.clone(), data(16), data(8)).unwrap();
            parking.park_base_in(file.clone()).unwrap();
            for round in 1..=3 {
                let m = manifest(round, encoding, bn);
                let b = unifed_protocol::messages::ServerBroadcast {
                    model_version: round - 1,
                    weights: export(&plain.net, &spec, unifed_models::site::select_for(bn))
                        .tensors
                        .iter()
                        .map(|t| t.encode(Encoding::F32, None))
                        .collect(),
                    extras: unifed_protocol::messages::ServerExtras::None,
                };
                plain
                    .receive(&spec, &m, &Download::Model(b.clone()))
                    .unwrap();
                parking.receive(&spec, &m, &Download::Model(b)).unwrap();
                // Both sites train the round; their updates' bytes must be the same.
                let train_both = |plain: &mut Site<_>, parking: &mut Site<_>, what: &str| {
                    let a = plain
                        .train_round(&spec, &fed, &m, &tc, &device(), |_| {})
                        .unwrap();
                    let b = parking
                        .train_round(&spec, &fed, &m, &tc, &device(), |_| {})
                        .unwrap();
                    assert_eq!(
                        a, b,
                        "{encoding:?} {bn:?} round {round}: {what} bytes differ"
                    );
                };
                train_both(&mut plain, &mut parking, "the update's");
                let case = format!("{encoding:?} {bn:?} round {round}");
                assert_eq!(
                    export(&plain.net, &spec, Select::All),
                    export(&parking.net, &spec, Select::All)
                );
                if round == 2 {
                    // A rejected update's residual goes, and its file with it.
                    plain.answered(round, false);
                    parking.answered(round, false);
                    assert_eq!(plain.memory().unwrap(), parking.memory().unwrap(), "{case}");
                    train_both(&mut plain, &mut parking, "the resent update's");
                }
                plain.answered(round, true);
                parking.answered(round, true);
                assert_eq!(plain.memory().unwrap(), parking.memory().unwrap(), "{case}");
                // The checkpoint's bytes are the same, whether the memory waits in files
                // (streamed from them) or in memory.
                let bytes = postcard::to_allocvec(&plain.memory().unwrap()).unwrap();
                assert_eq!(
                    postcard::to_allocvec(&parking.stored_memory()).unwrap(),
                    bytes,
                    "{case}"
                );
                assert_eq!(
                    postcard::to_allocvec(&plain.stored_memory()).unwrap(),
                    bytes,
                    "{case}"
                );
                // Between rounds a lossy encoding's residual and held broadcast wait in one
                // file each (the non-BN tensors under local BN, every trainable one and the
                // held statistics under global BN); an exact encoding keeps neither.
                let (residual, held) = (stashes("residual"), stashes("held"));
                if encoding == Encoding::F32 {
                    assert!(residual.is_empty() && held.is_empty(), "{case}");
                } else {
                    assert_eq!(residual.len(), 1, "{case}: {residual:?}");
                    assert_eq!(held.len(), 1, "{case}: {held:?}");
                    if bn == BnPolicy::Local {
                        assert_eq!(
                            (residual[0], held[0]),
                            (non_bn_bytes, non_bn_bytes),
                            "{case}"
                        );
                    }
                }
                // An exact encoding leaves no error behind.
                assert_eq!(
                    parking
                        .memory()
                        .unwrap()
                        .residual
                        .values()
                        .all(Vec::is_empty),
                    encoding == Encoding::F32,
                    "{case}"
                );
                assert_eq!(
                    parking.memory().unwrap().held.is_some(),
                    encoding != Encoding::F32,
                    "{case}"
                );
                assert!(!file.exists(), "the parked model outlived its round");
                assert!(!stale.exists() && other.exists());
                assert!(
                    !memory_file.exists() && !held_file.exists(),
                    "the parked memory outlived its round"
                );
            }
        }
    }

    // A round that blows up sends nothing and leaves the starting model and the memory in
    // place, bit for bit.
    let topk = Encoding::TopK { per_mille: 100 };
    let mut site = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    site.park_base_in(file.clone()).unwrap();
    site.train_round(
        &spec,
        &fed,
        &manifest(1, topk, BnPolicy::Local),
        &tc,
        &device(),
        |_| {},
    )
    .unwrap();
    site.answered(1, true);
    let before = export(&site.net, &spec, Select::All);
    let memory = site.memory().unwrap();
    assert!(memory.residual.values().any(|v| !v.is_empty()));
    // A memory restored into a parking site goes to its files and reads back the same.
    let mut again = Site::new("a", net.clone(), data(16), data(8)).unwrap();
    again.park_base_in(dir.path().join("again.f32")).unwrap();
    again.restore_memory(memory.clone(), &spec).unwrap();
    assert_eq!(again.memory().unwrap(), memory);
    let files = |prefix: &str| {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_str().unwrap().starts_with(prefix)
            })
            .count()
    };
    assert_eq!(files("again.residual."), 1);
    drop(again);
    assert_eq!(files("again."), 0, "a dropped site leaves no file");
    let wild = TrainConfig {
        lr: 1e30,
        ..tc.clone()
    };
    let err = site
        .train_round(
            &spec,
            &fed,
            &manifest(2, topk, BnPolicy::Local),
            &wild,
            &device(),
            |_| {},
        )
        .unwrap_err();
    assert_diverged(&err);
    assert_eq!(export(&site.net, &spec, Select::All), before);
    assert_eq!(site.memory().unwrap(), memory);

    // A parking file that cannot be written is an error naming it, nothing trains, and the
    // memory stays.
    let bad = dir.path().join("no-such-folder").join("base.f32");
    site.park_base_in(bad.clone()).unwrap();
    let err = site
        .train_round(
            &spec,
            &fed,
            &manifest(2, topk, BnPolicy::Local),
            &tc,
            &device(),
            |_| {},
        )
        .unwrap_err();
    assert!(err.to_string().contains("no-such-folder"), "{err}");
    assert_eq!(export(&site.net, &spec, Select::All), before);
    assert_eq!(site.memory().unwrap(), memory);
}

/// An exact update from a parked base is written into its envelope from the trained model and
/// the parked file a block at a time; its bytes are those of the update made from a delta in
/// memory (the base held), whatever BN policy and sharing, round after round.
#[test]
fn an_exact_update_written_from_the_parked_base_is_the_one_made_in_memory_byte_for_byte() {
    use unifed_protocol::messages::BnSharing;
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        ..TrainConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    for (bn, sharing) in [
        (BnPolicy::Local, BnSharing::None),
        (BnPolicy::Local, BnSharing::Affine),
        (BnPolicy::Global, BnSharing::None),
    ] {
        let mut held = site_parked_in(&net, None);
        let mut parked = site_parked_in(&net, Some(dir.path()));
        for round in 1..=2 {
            let m = RoundManifest {
                run: Default::default(),
                bn_sharing: sharing,
                ..manifest(round, Encoding::F32, bn)
            };
            let a = held
                .train_round(&spec, &fed, &m, &tc, &device(), |_| {})
                .unwrap();
            let b = parked
                .train_round(&spec, &fed, &m, &tc, &device(), |_| {})
                .unwrap();
            assert_eq!(a, b, "{bn:?} {sharing:?} round {round}");
            let u = update(&b);
            assert_eq!(u.round, round);
            assert_eq!(u.bn.is_empty(), sharing == BnSharing::None, "{sharing:?}");
            held.answered(round, true);
            parked.answered(round, true);
        }
        assert_eq!(
            export(&held.net, &spec, Select::All),
            export(&parked.net, &spec, Select::All)
        );
    }
}

/// A parked round whose delta is not finite sends nothing and leaves the starting model.
#[test]
fn a_parked_exact_round_that_diverges_leaves_the_starting_model() {
    let (net, spec) = tiny();
    let fed = Id::new("fed").unwrap();
    let wild = TrainConfig {
        batch_size: 8,
        lr: 1e30,
        ..TrainConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut site = site_parked_in(&net, Some(dir.path()));
    let before = export(&site.net, &spec, Select::All);
    let err = site
        .train_round(
            &spec,
            &fed,
            &manifest(1, Encoding::F32, BnPolicy::Local),
            &wild,
            &device(),
            |_| {},
        )
        .unwrap_err();
    assert_diverged(&err);
    assert_eq!(export(&site.net, &spec, Select::All), before);
}
