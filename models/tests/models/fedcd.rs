//! FedCD's SCI on the site: the closed-form mask gradient against autodiff and finite
//! differences, the penalty's gradient (through the features, the head and the mask) against
//! finite differences, and a site's rounds: the mask stays on the site, trains, masks the
//! site's evaluation, advances only with an accepted update and survives a restart bit for bit.

use crate::common;

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::*;
use unifed_models::bn::BnPass;
use unifed_models::client::ClientState;
use unifed_models::invariant::{Intervener, mask_gradient};
use unifed_models::site::Site;
use unifed_models::state::{Select, export};
use unifed_models::train::{TrainConfig, evaluate, evaluate_masked};
use unifed_models::zoo::Net;
use unifed_protocol::messages::{
    BnPolicy, Download, Objective, RoundPlan, ServerExtras, SiteExtras,
};
use unifed_protocol::{Encoding, Id, ModelSpec};

/// A linear classifier over its input: the head alone, with its parameters in reach.
#[derive(Module, Debug)]
struct Probe {
    head: Linear,
}

impl Net for Probe {
    fn architecture(&self) -> String {
        "probe".into()
    }

    fn input_numel(&self) -> usize {
        self.head.weight.val().dims()[0]
    }

    fn features(&self, x: Tensor<2>, _bn: &mut BnPass) -> Tensor<2> {
        x
    }

    fn head(&self, h: Tensor<2>) -> Tensor<2> {
        self.head.forward(h)
    }

    fn split_points(&self) -> Vec<usize> {
        vec![0]
    }

    fn low(&self, x: Tensor<2>, _split: usize, _bn: &mut BnPass) -> Tensor<2> {
        x
    }

    fn high(&self, h: Tensor<2>, _split: usize, _bn: &mut BnPass) -> Tensor<2> {
        self.head.forward(h)
    }
}

const D: usize = 5;
const C: usize = 3;
const N: usize = 4;

fn row(v: &[f32], dims: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v.to_vec(), dims), device)
}

/// The probe with weight `w` (`[D, C]`, burn's layout) and bias `b`.
fn probe(w: &[f32], b: &[f32], device: &Device) -> Probe {
    let mut head = LinearConfig::new(D, C).init(device);
    assert_eq!(head.weight.val().dims(), [D, C]);
    head.weight = Param::from_tensor(row(w, [D, C], device));
    head.bias = Some(Param::from_tensor(Tensor::from_data(
        TensorData::new(b.to_vec(), [C]),
        device,
    )));
    Probe { head }
}

fn labels(device: &Device) -> Tensor<1, Int> {
    Tensor::from_data(TensorData::new(vec![0i64, 2, 1, 2], [N]), device)
}

/// The point every check is made at: features, mask, weight, bias, the federation's gradient.
#[derive(Clone)]
struct Point {
    h: Vec<f32>,
    m: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    gg: Vec<f32>,
}

fn point() -> Point {
    Point {
        h: noise(N * D, 1).iter().map(|v| 2.0 * v).collect(),
        m: noise(D, 2).iter().map(|v| 1.0 + 0.3 * v).collect(),
        w: noise(D * C, 3),
        b: noise(C, 4),
        gg: noise(D, 5).iter().map(|v| 0.2 * v).collect(),
    }
}

fn values1(t: Tensor<2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// The mean cross-entropy of `head(m ⊙ h)`, plain.
fn cross_entropy(p: &Point) -> f64 {
    let device = device();
    let net = probe(&p.w, &p.b, &device);
    let logits = net.head(row(&p.h, [N, D], &device) * row(&p.m, [1, D], &device));
    let ce = CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits, labels(&device));
    ce.into_scalar::<f32>() as f64
}

/// The whole SCI loss `ce + lambda ||g - gg||^2`, plain.
fn sci_loss(p: &Point, lambda: f64) -> f64 {
    let device = device();
    let net = probe(&p.w, &p.b, &device);
    let h = row(&p.h, [N, D], &device);
    let logits = net.head(h.clone() * row(&p.m, [1, D], &device));
    let g = values1(mask_gradient(&net, h, logits, labels(&device)));
    let pen: f64 = g
        .iter()
        .zip(&p.gg)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    cross_entropy(p) + lambda * pen
}

/// The central difference of `f` along every value of the field `pick` selects.
fn numeric(
    p: &Point,
    f: impl Fn(&Point) -> f64,
    pick: fn(&mut Point) -> &mut Vec<f32>,
) -> Vec<f64> {
    let eps = 1e-2f32;
    let len = pick(&mut p.clone()).len();
    (0..len)
        .map(|k| {
            let at = |delta: f32| {
                let mut q = p.clone();
                pick(&mut q)[k] += delta;
                f(&q)
            };
            (at(eps) - at(-eps)) / (2.0 * eps as f64)
        })
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{k}]: {g} vs {w}"
        );
    }
}

#[test]
fn the_closed_form_mask_gradient_equals_autodiff_and_finite_differences() {
    let p = point();
    let ad = device().autodiff();
    let net = probe(&p.w, &p.b, &ad);
    let h = row(&p.h, [N, D], &ad);
    let m = row(&p.m, [1, D], &ad).require_grad();
    let logits = net.head(h.clone() * m.clone());
    let ce = CrossEntropyLossConfig::new()
        .init(&ad)
        .forward(logits.clone(), labels(&ad));
    let closed = values1(mask_gradient(&net, h, logits, labels(&ad)));
    let autodiff = values1(m.grad(&ce.backward()).unwrap());
    for (c, a) in closed.iter().zip(&autodiff) {
        assert!((c - a).abs() < 1e-6, "closed form {c} vs autodiff {a}");
    }
    assert!(autodiff.iter().any(|v| v.abs() > 1e-3), "{autodiff:?}");
    let fd = numeric(&p, cross_entropy, |q| &mut q.m);
    assert_close("mask gradient", &closed, &fd, 2e-3);
}

#[test]
fn the_penalty_trains_the_features_the_head_and_the_mask_by_its_true_gradient() {
    let p = point();
    let lambda = 0.7;
    let ad = device().autodiff();
    let net = probe(&p.w, &p.b, &ad);
    let h = row(&p.h, [N, D], &ad).require_grad();
    let m = row(&p.m, [1, D], &ad).require_grad();
    let logits = net.head(h.clone() * m.clone());
    let ce = CrossEntropyLossConfig::new()
        .init(&ad)
        .forward(logits.clone(), labels(&ad));
    let intervener = Intervener::new(lambda, Some(p.gg.clone()), p.m.clone());
    let mut run = intervener.start(&ad);
    let total = run.loss(&net, h.clone(), logits, labels(&ad), ce);
    assert!((total.clone().into_scalar::<f32>() as f64 - sci_loss(&p, lambda)).abs() < 1e-5);
    let grads = total.backward();
    let grad = |t: Option<Tensor<2>>| values1(t.unwrap());
    assert_close(
        "d/dm",
        &grad(m.grad(&grads)),
        &numeric(&p, |q| sci_loss(q, lambda), |q| &mut q.m),
        5e-3,
    );
    assert_close(
        "d/dh",
        &grad(h.grad(&grads)),
        &numeric(&p, |q| sci_loss(q, lambda), |q| &mut q.h),
        5e-3,
    );
    let params = burn::optim::GradientsParams::from_grads(grads, &net);
    let w = params.get::<2>(net.head.weight.id).unwrap();
    assert_close(
        "d/dW",
        &values1(w),
        &numeric(&p, |q| sci_loss(q, lambda), |q| &mut q.w),
        5e-3,
    );
    let b = params
        .get::<1>(net.head.bias.as_ref().unwrap().id)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect::<Vec<_>>();
    assert_close(
        "d/db",
        &b,
        &numeric(&p, |q| sci_loss(q, lambda), |q| &mut q.b),
        5e-3,
    );
    // The run keeps the batch's mask gradient and its whole loss.
    let outcome = run.finish();
    let closed = values1(mask_gradient(
        &probe(&p.w, &p.b, &device()),
        row(&p.h, [N, D], &device()),
        probe(&p.w, &p.b, &device())
            .head(row(&p.h, [N, D], &device()) * row(&p.m, [1, D], &device())),
        labels(&device()),
    ));
    // (times the batch size and back: within a rounding)
    assert_close(
        "the run's gradient",
        &outcome.gradient,
        &closed.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        1e-6,
    );
    assert!((outcome.risk - sci_loss(&p, lambda)).abs() < 1e-5);
    assert_eq!(outcome.mask, p.m, "no step was taken");
}

/// Model `version` (the non-BN tensors of `net`) with the federation's mask gradient `gg`.
fn broadcast(
    net: &unifed_models::zoo::Mlp,
    spec: &ModelSpec,
    version: u64,
    gg: Option<Vec<f32>>,
) -> Download {
    common::broadcast(
        net,
        spec,
        version,
        gg.map_or(ServerExtras::None, ServerExtras::MaskGradient),
    )
}

fn mask<N: Net>(site: &Site<N>) -> Option<Vec<f32>> {
    match site.memory().unwrap().algorithm {
        ClientState::FedCd { mask, .. } => mask,
        other => panic!("not FedCD's state: {other:?}"),
    }
}

#[test]
fn a_fedcd_site_keeps_its_mask_sends_its_gradient_and_resumes_bit_for_bit() {
    let (net, spec) = mlp_net(3, 4, [6, 5], 2);
    let width = spec.head_width().unwrap();
    assert_eq!(width, 5);
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        lr: 0.1,
        ..TrainConfig::default()
    };
    let objective = Objective::Invariant { lambda: 0.8 };
    let m = |round| tiny_manifest(round, Encoding::F32, BnPolicy::Local, objective);
    let data = |n| unifed_models::data::Dataset {
        name: "d".into(),
        features: 4,
        x: noise(4 * n, 21),
        y: (0..n).map(|i| (i / 3) % 2).collect(),
    };
    let mut site = Site::new("a", net.clone(), data(24), data(16)).unwrap();
    // A mask gradient of another width is refused before anything is applied.
    let bad = broadcast(&net, &spec, 0, Some(vec![0.1; width + 1]));
    assert!(site.receive(&spec, &m(1), &bad).is_err());
    // Round 1: no federation gradient yet.
    site.receive(&spec, &m(1), &broadcast(&net, &spec, 0, None))
        .unwrap();
    let u1 = update(
        &site
            .train_round(&spec, &fed, &m(1), &tc, &device(), |_| {})
            .unwrap(),
    );
    let SiteExtras::MaskGradient { gradient, risk } = &u1.extras else {
        panic!("{:?}", u1.extras)
    };
    assert_eq!(gradient.len(), width);
    assert!(gradient.iter().any(|g| *g != 0.0) && risk.is_finite() && *risk > 0.0);
    // The mask is the site's alone: no tensor of the update is of its width and name.
    assert!(
        u1.delta
            .iter()
            .all(|t| t.name.starts_with("fc") || t.name.starts_with("bn"))
    );
    assert_eq!(mask(&site), None, "advanced before the answer");
    site.answered(1, true);
    let trained = mask(&site).expect("an accepted update leaves the trained mask");
    assert_eq!(trained.len(), width);
    assert!(
        trained.iter().any(|v| (v - 1.0).abs() > 1e-6),
        "{trained:?}"
    );
    // The site evaluates through its mask.
    let plan = RoundPlan { objective };
    let own = site.evaluate(&spec, &plan, &tc, &device()).unwrap();
    let masked = evaluate_masked(&site.net, &data(16), 2, 64, &device(), Some(&trained)).unwrap();
    let bare = evaluate(&site.net, &data(16), 2, 64, &device()).unwrap();
    assert_eq!(own, masked);
    assert_ne!(own.loss, bare.loss);

    // Round 2 with the federation's gradient: a restored site sends the same bytes.
    let gg = gradient.iter().map(|g| 0.5 * g).collect::<Vec<_>>();
    site.receive(
        &spec,
        &m(2),
        &broadcast(&mlp_net(4, 4, [6, 5], 2).0, &spec, 1, Some(gg)),
    )
    .unwrap();
    let state = export(&site.net, &spec, Select::All);
    let kept = site.memory().unwrap();
    let mut again = restored(&net, &spec, &state, kept, data(24), data(16));
    same_round(&mut site, &mut again, &spec, &m(2), &tc);
    site.answered(2, true);
    again.answered(2, true);
    assert_eq!(mask(&site), mask(&again));
    assert_ne!(mask(&site), Some(trained));
}
