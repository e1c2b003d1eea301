//! A site's model frozen before it trains, evaluated after: the report is the one evaluating
//! the site's model gave when it was frozen, as an agent that evaluates while its update
//! uploads relies on. Clones of a burn model share their BN running statistics, which
//! training moves; a frozen copy must not see them move.

use crate::common;

use common::*;
use unifed_models::site::Site;
use unifed_models::train::TrainConfig;
use unifed_protocol::Encoding;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{BnPolicy, Objective, RoundPlan};

#[test]
fn a_model_frozen_before_training_evaluates_as_the_model_did_then() {
    let (net, spec) = tiny_mlp(5);
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        lr: 0.5,
        ..TrainConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    for (objective, parked) in [
        (Objective::CrossEntropy, false),
        // As an agent trains: the starting model waits in a file, the model itself is moved
        // into training.
        (Objective::CrossEntropy, true),
        // Per-FedAvg personalises the evaluated model on the site's training data first.
        (
            Objective::Meta {
                alpha: 0.1,
                beta: 0.1,
            },
            true,
        ),
    ] {
        let mut site = Site::new("a", net.clone(), tiny_data(32), tiny_data(24)).unwrap();
        if parked {
            site.park_base_in(dir.path().join("parked")).unwrap();
        }
        let plan = RoundPlan { objective };
        let then = site.evaluate(&spec, &plan, &tc, &device()).unwrap();
        let frozen = site.freeze();
        let m = tiny_manifest(1, Encoding::F32, BnPolicy::Local, objective);
        site.train_round(&spec, &fed, &m, &tc, &device(), |_| {})
            .unwrap();
        // Training moved the model: the site's model now evaluates otherwise.
        let now = site.evaluate(&spec, &plan, &tc, &device()).unwrap();
        assert_ne!(now.loss.to_bits(), then.loss.to_bits(), "{objective:?}");
        let got = site
            .evaluate_frozen(&frozen, &spec, &plan, &tc, &device())
            .unwrap();
        assert_eq!(
            (got.samples, got.correct, got.loss.to_bits()),
            (then.samples, then.correct, then.loss.to_bits()),
            "{objective:?}"
        );
    }
}
