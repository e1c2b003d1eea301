//! Per-FedAvg (Fallah et al. 2020), first order, on the site: the meta-step against two plain
//! steps computed independently, the pairing of batches, and the personalisation step before a
//! site evaluates, on a copy that leaves the site's model and BN statistics alone.

use crate::common;

use common::*;
use unifed_models::data::Dataset;
use unifed_models::objective::{SiteState, Term};
use unifed_models::site::Site;
use unifed_models::state::{Select, export};
use unifed_models::train::{
    EVAL_BATCH, TrainConfig, evaluate, meta_pairs, shuffle_epoch, train_objective,
};
use unifed_protocol::messages::{Objective, RoundPlan};

fn subset(d: &Dataset, idx: &[usize]) -> Dataset {
    Dataset {
        name: d.name.clone(),
        features: d.features,
        x: idx
            .iter()
            .flat_map(|&i| d.x[i * d.features..(i + 1) * d.features].iter().copied())
            .collect(),
        y: idx.iter().map(|&i| d.y[i]).collect(),
    }
}

fn tc(lr: f64, batch_size: usize, seed: u64) -> TrainConfig {
    TrainConfig {
        lr,
        batch_size,
        seed,
        ..TrainConfig::default()
    }
}

#[test]
fn a_meta_step_applies_the_gradient_one_inner_step_ahead_to_the_model_as_it_was() {
    let (net0, spec) = tiny_mlp(3);
    let d = tiny_data(16);
    let (alpha, beta, seed) = (0.1, 0.05, 5);
    // 16 samples in batches of 8: one meta-step over the two halves of the epoch's order.
    let mut order: Vec<usize> = (0..16).collect();
    shuffle_epoch(&mut order, seed, 0);
    let pairs = meta_pairs(&order, 8);
    assert_eq!(pairs.len(), 1);
    let (first, second) = (subset(&d, pairs[0].0), subset(&d, pairs[0].1));
    let term = Term::new(
        &Objective::Meta { alpha, beta },
        &net0,
        Select::NonBn,
        SiteState::default(),
    )
    .unwrap();
    let (meta, rep) =
        train_objective(&net0, &d, 2, &tc(0.01, 8, seed), &term, &device(), |_| {}).unwrap();
    assert_eq!((rep.steps, rep.samples), (1, 16));
    // Independently: w' = w - alpha g(w; first), then w'' = w' - beta g(w'; second), so
    // the meta-step's w - beta g(w'; second) is w + (w'' - w').
    let one = |net, data: &Dataset, lr| {
        train_objective(
            net,
            data,
            2,
            &tc(lr, 8, seed),
            &Term::None,
            &device(),
            |_| {},
        )
        .unwrap()
        .0
    };
    let ahead = one(&net0, &first, alpha);
    let two = one(&ahead, &second, beta);
    let (w, w1, w2, got) = (
        export(&net0, &spec, Select::All).tensors,
        export(&ahead, &spec, Select::All).tensors,
        export(&two, &spec, Select::All).tensors,
        export(&meta, &spec, Select::All).tensors,
    );
    let mut moved = 0;
    for t in 0..w.len() {
        if w[t].kind.is_bn_stat() {
            continue;
        }
        for k in 0..w[t].data.len() {
            let want = w[t].data[k] + (w2[t].data[k] - w1[t].data[k]);
            moved += usize::from((got[t].data[k] - w[t].data[k]).abs() > 1e-6);
            assert!(
                (got[t].data[k] - want).abs() < 1e-5,
                "{}[{k}]: {} vs {want}",
                w[t].name,
                got[t].data[k]
            );
        }
    }
    assert!(moved > 20, "only {moved} values moved");
}

#[test]
fn meta_steps_pair_batches_in_halves_and_a_chunk_too_small_to_split_serves_as_both() {
    let order: Vec<usize> = (0..743).collect();
    let pairs = meta_pairs(&order, 32);
    // 743 = 11 x 64 + 39: twelve meta-steps, the last over 19 and 20 samples.
    assert_eq!(pairs.len(), 12);
    assert!(
        pairs[..11]
            .iter()
            .all(|(a, b)| a.len() == 32 && b.len() == 32)
    );
    assert_eq!((pairs[11].0.len(), pairs[11].1.len()), (19, 20));
    let all: Vec<usize> = pairs
        .iter()
        .flat_map(|(a, b)| a.iter().chain(b.iter()).copied())
        .collect();
    assert_eq!(all, order);
    // 3 samples cannot give two batches of two: one batch serves both steps.
    let small: Vec<usize> = (0..3).collect();
    let pairs = meta_pairs(&small, 8);
    assert_eq!(pairs, vec![(&small[..], &small[..])]);
}

#[test]
fn a_per_fedavg_site_evaluates_after_one_personalisation_step_on_a_copy() {
    let (net0, spec) = tiny_mlp(3);
    let train = tiny_data(16);
    let test = subset(&tiny_data(24), &(16..24).collect::<Vec<_>>());
    let site = Site::new("a", net0.clone(), train.clone(), test.clone()).unwrap();
    let (alpha, seed) = (0.5, 7);
    let plan = RoundPlan {
        objective: Objective::Meta { alpha, beta: 0.01 },
    };
    let before = bits(&site.net, &spec, Select::All);
    let got = site
        .evaluate(&spec, &plan, &tc(0.01, 4, seed), &device())
        .unwrap();
    // Independently: one step of alpha on the first batch of the first epoch's order.
    let mut order: Vec<usize> = (0..16).collect();
    shuffle_epoch(&mut order, seed, 0);
    let batch = subset(&train, &order[..4]);
    let (personal, _) = train_objective(
        &net0,
        &batch,
        2,
        &tc(alpha, 4, seed),
        &Term::None,
        &device(),
        |_| {},
    )
    .unwrap();
    let want = evaluate(&personal, &test, 2, EVAL_BATCH, &device()).unwrap();
    assert_eq!(got.correct, want.correct);
    assert!(
        (got.loss - want.loss).abs() < 1e-6,
        "{} vs {}",
        got.loss,
        want.loss
    );
    // The site's own model, BN statistics included, is untouched.
    assert_eq!(bits(&site.net, &spec, Select::All), before);
    // Under any other plan the site evaluates its model as it is.
    let plain = site
        .evaluate(&spec, &RoundPlan::default(), &tc(0.01, 4, seed), &device())
        .unwrap();
    let unpersonalised = evaluate(&net0, &test, 2, EVAL_BATCH, &device()).unwrap();
    assert_eq!(plain, unpersonalised);
    assert_ne!(plain.loss, got.loss);
}
