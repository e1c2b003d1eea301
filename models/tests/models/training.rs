//! Local training: reproducible from a seed, and a SingleSet run that learns the grey domain.

use crate::common;

use common::*;
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::state::Select;
use unifed_models::train::{TrainConfig, TrainEvent, evaluate, train_local};
use unifed_models::zoo::{DigitsCnnConfig, seeded, spec_of};

/// A digits CNN small enough for quick tests.
fn small_cnn() -> DigitsCnnConfig {
    DigitsCnnConfig {
        conv: [8, 8, 16],
        fc: [64, 32],
        ..Default::default()
    }
}

#[test]
fn training_is_reproducible_from_a_seed_and_reports_its_counts() {
    let d = device();
    let data = BuiltinData::load().unwrap();
    let sizes = SplitSizes {
        train: 100,
        ..SplitSizes::default()
    };
    let dd = data.domain(Domain::Texture, &sizes, 0).unwrap();
    let cfg = small_cnn();
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

#[test]
fn evaluation_sums_each_batchs_mean_loss_by_its_size_and_counts_right_predictions() {
    // Evaluation reads its batches' losses and counts back together at the end; the figures
    // must be those of reading each batch as it ends: its mean loss times its size, added in
    // f64 in batch order, over every sample.
    use burn::module::Module;
    use burn::nn::loss::CrossEntropyLossConfig;
    use unifed_models::bn::BnPass;
    use unifed_models::train::batch_tensors;
    use unifed_models::zoo::Net;
    let d = device();
    let data = BuiltinData::load().unwrap();
    let sizes = SplitSizes {
        train: 10,
        test: 70,
        ..SplitSizes::default()
    };
    let dd = data.domain(Domain::Fonts, &sizes, 0).unwrap();
    let net = seeded(&d, 3, |d| small_cnn().init(d));
    let spec = spec_of(&net, &classes(10), &image_input(3, 28, 28));
    let test = dd.test.dataset("fonts/test", &spec).unwrap();
    let ev = evaluate(&net, &test, 10, 32, &d).unwrap();

    let plain = d.clone().without_autodiff();
    let valid = net.valid();
    let idx: Vec<usize> = (0..test.len()).collect();
    let (mut loss, mut correct) = (0.0f64, 0usize);
    for chunk in idx.chunks(32) {
        let (x, y) = batch_tensors(&test, chunk, &plain);
        let logits = valid.forward(x, &mut BnPass::standard());
        let l = CrossEntropyLossConfig::new()
            .init(&plain)
            .forward(logits.clone(), y.clone())
            .into_scalar::<f32>();
        loss += l as f64 * chunk.len() as f64;
        let pred = logits.argmax(1).reshape([chunk.len()]);
        correct += pred.equal(y).int().sum().into_scalar::<i64>() as usize;
    }
    assert_eq!((ev.samples, ev.correct), (70, correct));
    assert!(
        correct > 0 && correct < 70,
        "{correct} of 70: a count, not 0 or all"
    );
    assert_eq!(ev.loss.to_bits(), (loss / 70.0).to_bits());
}

#[test]
fn each_seed_round_and_site_shuffles_on_a_stream_of_its_own() {
    use unifed_models::site::round_seed;
    use unifed_models::train::shuffle_epoch;
    // `seed ^ round` gave these three the same stream, and every site of a run the same.
    let collided = [(0, 3), (1, 2), (2, 1)].map(|(s, r)| round_seed(s, r, "grey"));
    assert!(collided[0] != collided[1] && collided[1] != collided[2] && collided[0] != collided[2]);
    let sites = ["grey", "color", "texture", "lowres", "fonts"];
    let mut all = std::collections::HashSet::new();
    for seed in 0..4 {
        for round in 0..16 {
            for site in sites {
                assert!(
                    all.insert(round_seed(seed, round, site)),
                    "{seed} {round} {site}"
                );
            }
        }
    }
    // The same (seed, round, site) always gives the same stream: an agent that restarts
    // trains the round it resumes as it would have.
    assert_eq!(round_seed(7, 5, "grey"), round_seed(7, 5, "grey"));
    // Two sites of one run, in one round, take their samples in different orders.
    let order = |site: &str| {
        let mut o: Vec<usize> = (0..100).collect();
        shuffle_epoch(&mut o, round_seed(0, 1, site), 0);
        o
    };
    assert_ne!(order("grey"), order("color"));
    // Every bit of the seed reaches the stream: flipping one changes about half of them.
    for bit in 0..64 {
        let flipped = (round_seed(1 << bit, 3, "grey") ^ round_seed(0, 3, "grey")).count_ones();
        assert!(
            (12..=52).contains(&flipped),
            "bit {bit}: {flipped} bits moved"
        );
    }
}
