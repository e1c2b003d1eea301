//! Onboarding a shifted domain by BN re-estimation: a model trained on grey digits, deployed on
//! shifted images with its stored statistics (baseline b) or never-trained BN layers (baseline
//! a), against `calibrate` on a separate unlabelled split and `stream` on the test images.
//!
//! Which shifts BN can undo: a per-channel affine intensity change (contrast and brightness)
//! becomes an affine change of every first-layer channel, which re-estimated statistics remove
//! exactly; speckle noise mostly shifts statistics too. A contrast inversion does not: it flips
//! the sign of the normalised first-layer activations, so the built-in `inverted` domain stays
//! near chance under any BN statistics (measured: stored 10.4%, calibrate 11.4%, stream 12.2%).

use crate::common;

use common::device;
use unifed_models::bn::{CalibrateConfig, StreamConfig};
use unifed_models::calibrate::calibrate;
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes};
use unifed_models::state::{Select, export, import};
use unifed_models::train::{TrainConfig, evaluate, evaluate_stream, train_local};
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, ModelConfig, seeded, spec_of};

struct Scores {
    stored: f64,
    calibrated: f64,
    streamed: f64,
}

fn scores(net: &DigitsCnn, test: &Dataset, calib: &[f32]) -> (Scores, DigitsCnn) {
    let device = device();
    let stored = evaluate(net, test, 10, 256, &device).unwrap().accuracy();
    let cal = calibrate(net, calib, &device, &CalibrateConfig::default(), |_, _| {}).unwrap();
    let calibrated = evaluate(&cal, test, 10, 256, &device).unwrap().accuracy();
    let order: Vec<usize> = (0..test.len()).collect();
    let streamed = evaluate_stream(net, test, 10, &StreamConfig::default(), &order, &device)
        .unwrap()
        .accuracy();
    (
        Scores {
            stored,
            calibrated,
            streamed,
        },
        cal,
    )
}

#[test]
fn calibrate_and_stream_recover_shifted_domains_and_touch_only_bn_statistics() {
    let device = device();
    let data = BuiltinData::load().unwrap();
    let cfg = DigitsCnnConfig {
        conv: [16, 32, 32],
        fc: [128, 64],
        ..Default::default()
    };
    let mc = ModelConfig::fedbn_digits();
    let net = seeded(&device, 0, |d| cfg.init(d));
    let spec = spec_of(&net, &mc.classes, &mc.input);
    let untrained_bn = export(&net, &spec, Select::Bn);
    let grey = data
        .domain(Domain::Grey, &SplitSizes::default(), 0)
        .unwrap();
    let train = grey.train.dataset("grey/train", &spec).unwrap();
    let tc = TrainConfig {
        epochs: 4,
        ..Default::default()
    };
    let (net, _) = train_local(&net, &train, 10, &tc, &device, |_| {}).unwrap();
    let grey_test = grey.test.dataset("grey/test", &spec).unwrap();
    let on_grey = evaluate(&net, &grey_test, 10, 256, &device)
        .unwrap()
        .accuracy();
    assert!(
        on_grey > 0.85,
        "the trained model works on its own domain: {on_grey}"
    );

    // A deterministic strong shift: the grey images at 30% contrast, brightened.
    let dim = |mut d: Dataset| {
        for v in &mut d.x {
            *v = 0.3 * *v + 0.5;
        }
        d
    };
    let test = dim(grey_test.clone());
    let calib = dim(grey.val.dataset("grey/val", &spec).unwrap());
    let (s, cal) = scores(&net, &test, &calib.x);
    eprintln!(
        "dim grey: stored {:.4} calibrate {:.4} stream {:.4} (grey {on_grey:.4})",
        s.stored, s.calibrated, s.streamed
    );
    // Baseline (a): the trained weights with never-trained BN layers, as a site gets them under
    // BN sharing `none`. Baseline (b), the averaged BN of the training sites, is the model's own
    // (one training site): `stored`.
    let a = import(&net, &spec, &untrained_bn, Select::Bn).unwrap();
    let s_a = evaluate(&a, &test, 10, 256, &device).unwrap().accuracy();
    eprintln!("dim grey: (a) never-trained BN {s_a:.4}");
    assert!(
        s.calibrated > s_a + 0.2 && s.streamed > s_a + 0.2,
        "calibrate and stream beat baseline (a) {s_a}"
    );
    assert!(s.stored < 0.3, "the shift breaks the stored statistics");
    assert!(
        s.calibrated > on_grey - 0.02,
        "calibrate restores the source accuracy"
    );
    assert!(s.streamed > s.stored + 0.4);
    // Calibration leaves every non-BN tensor and the BN affine parameters bit-identical.
    assert_eq!(
        export(&cal, &spec, Select::NonBn),
        export(&net, &spec, Select::NonBn)
    );
    assert_eq!(
        export(&cal, &spec, Select::BnAffine),
        export(&net, &spec, Select::BnAffine)
    );
    assert_ne!(
        export(&cal, &spec, Select::BnStats),
        export(&net, &spec, Select::BnStats)
    );

    // The built-in never-seen speckle domain, calibrated on its own unlabelled split.
    let sp = data
        .domain(Domain::Speckle, &SplitSizes::default(), 0)
        .unwrap();
    let (s, _) = scores(
        &net,
        &sp.test.dataset("speckle/test", &spec).unwrap(),
        &sp.calib.dataset("speckle/calib", &spec).unwrap().x,
    );
    eprintln!(
        "speckle: stored {:.4} calibrate {:.4} stream {:.4}",
        s.stored, s.calibrated, s.streamed
    );
    assert!(s.calibrated > s.stored + 0.2 && s.streamed > s.stored + 0.2);
}
