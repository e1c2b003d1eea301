//! BN statistics re-estimation (`calibrate`, `stream`) checked against moments computed without
//! the BN code.

use crate::common;

use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2dConfig;
use burn::tensor::{Tensor, TensorData};
use common::*;
use unifed_models::bn::{BnPass, BnStart, CalibrateConfig, Estimator, StreamEstimator};
use unifed_models::calibrate::calibrate;
use unifed_models::error::BnError;
use unifed_models::state::{Select, export};
use unifed_models::zoo::{DigitsCnnConfig, Mlp, Net, seeded};
use unifed_protocol::ModelSpec;

fn small_cnn() -> DigitsCnnConfig {
    DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    }
}

/// Per-channel mean and biased variance over all axes but 1 of an `[n, c, rest]` array, in f64.
fn moments(v: &[f32], n: usize, c: usize, rest: usize) -> (Vec<f64>, Vec<f64>) {
    let mut mean = vec![0.0; c];
    let mut var = vec![0.0; c];
    for ch in 0..c {
        let vals: Vec<f64> = (0..n)
            .flat_map(|i| (0..rest).map(move |r| (i, r)))
            .map(|(i, r)| v[(i * c + ch) * rest + r] as f64)
            .collect();
        let m = vals.iter().sum::<f64>() / vals.len() as f64;
        mean[ch] = m;
        var[ch] = vals.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / vals.len() as f64;
    }
    (mean, var)
}

fn get(state: &unifed_models::state::StateDict, name: &str) -> Vec<f32> {
    state
        .get(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .data
        .clone()
}

fn close(a: &[f32], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn exact_calibration_gives_the_conv1_output_moments_over_the_whole_set() {
    let d = device();
    let net = seeded(&d, 11, |d| small_cnn().init(d));
    let spec = spec(&net, 10, image_input(3, 28, 28));
    let n = 70; // two batches of 32 and a trailing 6
    let images: Vec<f32> = noise(n * 3 * 28 * 28, 3)
        .iter()
        .map(|v| v * 0.8 + 0.1)
        .collect();
    let cal = calibrate(
        &net,
        &images,
        &d,
        &CalibrateConfig {
            batch_size: 32,
            ..Default::default()
        },
        |_, _| {},
    )
    .unwrap();
    // conv1 rebuilt from the exported weights: independent of every BN code path.
    let state = export(&net, &spec, Select::NonBn);
    let mut conv = Conv2dConfig::new([3, 4], [5, 5])
        .with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2))
        .init(&d);
    conv.weight = conv.weight.map(|_| {
        Tensor::from_data(
            TensorData::new(get(&state, "conv1.weight"), [4, 3, 5, 5]),
            &d,
        )
    });
    conv.bias = conv
        .bias
        .map(|b| b.map(|_| Tensor::from_data(TensorData::new(get(&state, "conv1.bias"), [4]), &d)));
    let x: Tensor<4> = Tensor::from_data(TensorData::new(images, [n, 3, 28, 28]), &d);
    let out = conv
        .forward(x)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap();
    let (mean, var) = moments(&out, n, 4, 28 * 28);
    let stats = export(&cal, &spec, Select::BnStats);
    close(
        &get(&stats, "bn1.running_mean"),
        &mean,
        1e-4,
        "bn1.running_mean",
    );
    close(
        &get(&stats, "bn1.running_var"),
        &var,
        1e-4,
        "bn1.running_var",
    );
    // The calibrated model is a new model: the original keeps its statistics.
    assert_eq!(
        get(&export(&net, &spec, Select::BnStats), "bn1.running_mean"),
        vec![0.0; 4]
    );
}

fn mlp() -> (Mlp, ModelSpec) {
    mlp_net(12, 20, [16, 16], 3)
}

/// fc1 outputs `x W^T + b` of `n` rows, computed on the host from the exported weights.
fn fc1(spec: &ModelSpec, net: &Mlp, x: &[f32], n: usize) -> Vec<f32> {
    let st = export(net, spec, Select::NonBn);
    let (w, b) = (get(&st, "fc1.weight"), get(&st, "fc1.bias"));
    let mut out = vec![0.0f32; n * 16];
    for i in 0..n {
        for o in 0..16 {
            let mut s = b[o] as f64;
            for k in 0..20 {
                s += w[o * 20 + k] as f64 * x[i * 20 + k] as f64;
            }
            out[i * 16 + o] = s as f32;
        }
    }
    out
}

#[test]
fn exact_calibration_at_a_batchnorm1d_layer_with_batch_8_uses_the_biased_variance() {
    let d = device();
    let (net, spec) = mlp();
    let x: Vec<f32> = noise(8 * 20, 21).iter().map(|v| v * 3.0 + 0.5).collect();
    let cal = calibrate(
        &net,
        &x,
        &d,
        &CalibrateConfig {
            batch_size: 8,
            ..Default::default()
        },
        |_, _| {},
    )
    .unwrap();
    let h = fc1(&spec, &net, &x, 8);
    let (mean, var) = moments(&h, 8, 16, 1);
    let stats = export(&cal, &spec, Select::BnStats);
    close(&get(&stats, "bn1.running_mean"), &mean, 1e-4, "mean");
    close(&get(&stats, "bn1.running_var"), &var, 1e-4, "biased var");
    let unbiased: Vec<f64> = var.iter().map(|v| v * 8.0 / 7.0).collect();
    let got = get(&stats, "bn1.running_var");
    assert!(
        got.iter()
            .zip(&unbiased)
            .all(|(g, u)| (*g as f64 - u).abs() > 1e-3 * u),
        "variance is the unbiased one"
    );
}

#[test]
fn stream_with_tau_zero_equals_a_train_mode_bn_forward_of_each_batch() {
    let d = device();
    let net = seeded(&d, 13, |d| small_cnn().init(d));
    let mut est = StreamEstimator::new(0.0, BnStart::Stored).unwrap();
    // burn's own train-mode BN (batch statistics) on an autodiff copy as the reference.
    let train_net = net.valid().train();
    let ad = d.clone().autodiff();
    for (b, n) in [(0u64, 8usize), (1, 5), (2, 12)] {
        let x = noise(n * 3 * 28 * 28, 30 + b);
        let got = values(
            est.forward(&net, tensor2(&[n, 3 * 28 * 28], x.clone(), &d))
                .unwrap(),
        );
        let want = values(
            train_net
                .forward(tensor2(&[n, 3 * 28 * 28], x, &ad), &mut BnPass::standard())
                .inner(),
        );
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-4, "batch {b}: {err}");
    }
}

#[test]
fn stream_follows_the_ema_formula_over_three_batches_at_a_batchnorm1d_layer() {
    let d = device();
    let (net, spec) = mlp();
    let tau = 0.6;
    let stored = export(&net, &spec, Select::BnStats);
    let (mut m, mut v): (Vec<f64>, Vec<f64>) = (
        get(&stored, "bn1.running_mean")
            .iter()
            .map(|&x| x as f64)
            .collect(),
        get(&stored, "bn1.running_var")
            .iter()
            .map(|&x| x as f64)
            .collect(),
    );
    let mut est = StreamEstimator::new(tau, BnStart::Stored).unwrap();
    for (b, n) in [(0u64, 4usize), (1, 7), (2, 3)] {
        let x: Vec<f32> = noise(n * 20, 40 + b)
            .iter()
            .map(|v| v * (1.0 + b as f32) + b as f32)
            .collect();
        est.forward(&net, tensor2(&[n, 20], x.clone(), &d)).unwrap();
        let (bm, bv) = moments(&fc1(&spec, &net, &x, n), n, 16, 1);
        for c in 0..16 {
            m[c] = tau * m[c] + (1.0 - tau) * bm[c];
            v[c] = tau * v[c] + (1.0 - tau) * bv[c];
        }
    }
    let stats = export(&est.store_into(&net), &spec, Select::BnStats);
    close(&get(&stats, "bn1.running_mean"), &m, 1e-4, "ema mean");
    close(&get(&stats, "bn1.running_var"), &v, 1e-4, "ema var");
}

#[test]
fn neither_mode_changes_a_non_bn_or_affine_tensor() {
    let d = device();
    let net = seeded(&d, 14, |d| small_cnn().init(d));
    let spec = spec(&net, 10, image_input(3, 28, 28));
    let images = noise(40 * 3 * 28 * 28, 50);
    let keep = |n: &unifed_models::zoo::DigitsCnn| {
        (
            bits(n, &spec, Select::NonBn),
            bits(n, &spec, Select::BnAffine),
        )
    };
    let before = keep(&net);
    for estimator in [Estimator::Exact, Estimator::Ema { tau: 0.9 }] {
        let cal = calibrate(
            &net,
            &images,
            &d,
            &CalibrateConfig {
                estimator,
                batch_size: 16,
                start: BnStart::FirstBatch,
            },
            |_, _| {},
        )
        .unwrap();
        assert_eq!(keep(&cal), before);
        assert_ne!(
            bits(&cal, &spec, Select::BnStats),
            bits(&net, &spec, Select::BnStats)
        );
    }
    let mut est = StreamEstimator::new(0.9, BnStart::Stored).unwrap();
    est.forward(&net, tensor2(&[40, 3 * 28 * 28], images, &d))
        .unwrap();
    assert_eq!(keep(&est.store_into(&net)), before);
    assert_eq!(keep(&net), before);
}

#[test]
fn bad_requests_are_refused_with_their_reason() {
    let d = device();
    let (net, _) = mlp();
    let cfg = CalibrateConfig::default();
    assert_eq!(
        calibrate(&net, &[], &d, &cfg, |_, _| {}).unwrap_err(),
        BnError::NoImages
    );
    assert_eq!(
        calibrate(&net, &noise(20, 1), &d, &cfg, |_, _| {}).unwrap_err(),
        BnError::SingleImage
    );
    assert_eq!(
        calibrate(&net, &noise(30, 1), &d, &cfg, |_, _| {}).unwrap_err(),
        BnError::WrongInput {
            expected: 20,
            found: 30
        }
    );
    assert_eq!(
        calibrate(
            &net,
            &noise(200, 1),
            &d,
            &CalibrateConfig {
                batch_size: 1,
                ..cfg
            },
            |_, _| {}
        )
        .unwrap_err(),
        BnError::BatchTooSmall(1)
    );
    assert_eq!(
        StreamEstimator::new(1.5, BnStart::Stored).unwrap_err(),
        BnError::BadTau(1.5)
    );
    let mut est = StreamEstimator::new(0.5, BnStart::Stored).unwrap();
    assert_eq!(
        est.forward(&net, tensor2(&[1, 20], noise(20, 2), &d))
            .unwrap_err(),
        BnError::SingleImage
    );
    assert_eq!(
        est.forward(&net, tensor2(&[2, 10], noise(20, 2), &d))
            .unwrap_err(),
        BnError::WrongInput {
            expected: 20,
            found: 10
        }
    );
}

#[test]
fn stream_with_first_batch_start_normalises_the_first_batch_by_itself() {
    let d = device();
    let (net, _) = mlp();
    let x = noise(6 * 20, 60);
    let mut a = StreamEstimator::new(0.9, BnStart::FirstBatch).unwrap();
    let mut b = StreamEstimator::new(0.0, BnStart::Stored).unwrap();
    let ya = values(a.forward(&net, tensor2(&[6, 20], x.clone(), &d)).unwrap());
    let yb = values(b.forward(&net, tensor2(&[6, 20], x, &d)).unwrap());
    assert!(max_abs_diff(&ya, &yb) < 1e-6);
}
