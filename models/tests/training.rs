//! Local training: reproducible from a seed, and a SingleSet run that learns the grey domain.

mod common;

use common::*;
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::state::Select;
use unifed_models::train::{TrainConfig, TrainEvent, evaluate, train_local};
use unifed_models::zoo::{DigitsCnnConfig, seeded, spec_of};

#[test]
fn training_is_reproducible_from_a_seed_and_reports_its_counts() {
    let d = device();
    let data = BuiltinData::load().unwrap();
    let dd = data
        .domain(
            Domain::Texture,
            &SplitSizes {
                train: 100,
                ..SplitSizes::default()
            },
            0,
        )
        .unwrap();
    let cfg = DigitsCnnConfig {
        conv: [8, 8, 16],
        fc: [64, 32],
        ..Default::default()
    };
    let run = |seed: u64| {
        let net = seeded(&d, 7, |d| cfg.init(d));
        let spec = spec_of(&net, &classes(10), &image_input(3, 28, 28));
        let train = dd.train.dataset("texture/train", &spec).unwrap();
        let mut events = Vec::new();
        let tc = TrainConfig {
            epochs: 2,
            seed,
            momentum: 0.9,
            weight_decay: 5e-4,
            ..Default::default()
        };
        let (net, rep) = train_local(&net, &train, 10, &tc, &d, |e| events.push(e)).unwrap();
        (bits(&net, &spec, Select::All), rep, events)
    };
    let (a, rep, events) = run(1);
    let (b, _, _) = run(1);
    let (c, _, _) = run(2);
    assert_eq!(a, b, "same seed, same weights");
    assert_ne!(a, c, "another seed shuffles differently");
    // 100 samples, batch 32: batches 32, 32, 32, 4 per epoch.
    assert_eq!(
        (rep.samples, rep.steps, rep.epoch_losses.len()),
        (200, 8, 2)
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, TrainEvent::Step { .. }))
            .count(),
        8
    );
    assert!(matches!(
        events.last(),
        Some(TrainEvent::EpochEnd { epoch: 1, .. })
    ));
}

#[test]
fn singleset_on_the_grey_domain_reaches_90_percent() {
    let d = device();
    let data = BuiltinData::load().unwrap();
    let dd = data
        .domain(Domain::Grey, &SplitSizes::default(), 0)
        .unwrap();
    let mut net = seeded(&d, 0, |d| DigitsCnnConfig::default().init(d));
    let spec = spec_of(&net, &classes(10), &image_input(3, 28, 28));
    let train = dd.train.dataset("grey/train", &spec).unwrap();
    let test = dd.test.dataset("grey/test", &spec).unwrap();
    for epoch in 0..6 {
        let tc = TrainConfig {
            seed: epoch,
            ..Default::default()
        };
        net = train_local(&net, &train, 10, &tc, &d, |_| {}).unwrap().0;
    }
    let ev = evaluate(&net, &test, 10, 256, &d).unwrap();
    assert_eq!(ev.samples, 600);
    assert!(
        ev.accuracy() >= 0.90,
        "grey SingleSet accuracy {:.3}",
        ev.accuracy()
    );
}
