//! When an agent evaluates the models it trains from: before training, or while its update
//! uploads, on a copy frozen before training. A site's federation run twice with the same data
//! and seed trains the same models bit for bit (a site's shuffles derive from its id, so two
//! sites of one run never share them), so an agent of each kind must report the same accuracy
//! for every version, and the one evaluating while uploading must do so after its training.

use std::collections::BTreeMap;
use std::time::Duration;
use unifed_agent::config::EvaluateAt;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_net::report::{Phase, Report};

/// Each model version's reported accuracy, in the order reported.
fn accuracies(reports: &[Report]) -> Vec<(u64, f64)> {
    reports
        .iter()
        .filter_map(|r| match *r {
            Report::Evaluated { version, accuracy } => Some((version, accuracy)),
            _ => None,
        })
        .collect()
}

/// The reports of the one site `grey` of a federation whose agent evaluates each model `at`,
/// and the federation's rounds.
fn reports(at: EvaluateAt) -> (Vec<Report>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.credentials = broker.credentials.clone();
    fed.sites = vec!["grey".into()];
    fed.min_sites = 1;
    fed.agent_edits.insert(
        "grey".into(),
        match at {
            EvaluateAt::BeforeTraining => |c| {
                c.evaluate_each_model = true;
                c.evaluate_at = Some(EvaluateAt::BeforeTraining);
            },
            EvaluateAt::WhileUploading => |c| {
                c.evaluate_each_model = true;
                c.evaluate_at = Some(EvaluateAt::WhileUploading);
            },
        },
    );
    let mut agg = fed.aggregator();
    let mut agent = fed.agent("grey");
    fed.wait_ok(&mut agent, "grey", Duration::from_secs(300));
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));
    (fed.reports("grey"), fed.rounds)
}

#[test]
fn an_agent_evaluating_while_it_uploads_reports_what_one_evaluating_before_training_does() {
    let _serial = serial();
    let (before, rounds) = reports(EvaluateAt::BeforeTraining);
    let (aside, _) = reports(EvaluateAt::WhileUploading);
    let want: Vec<u64> = (0..=rounds).collect();
    let versions = |r: &[Report]| -> Vec<u64> { accuracies(r).iter().map(|a| a.0).collect() };
    assert_eq!(versions(&before), want);
    assert_eq!(versions(&aside), want);
    // Bit for bit: the same models, BN statistics included, evaluated on the same images.
    let bits = |r: &[Report]| -> Vec<(u64, u64)> {
        accuracies(r)
            .iter()
            .map(|&(v, a)| (v, a.to_bits()))
            .collect()
    };
    assert_eq!(bits(&aside), bits(&before));
    // Training moved the models: the accuracies are not all one value.
    assert!(
        accuracies(&before)
            .iter()
            .any(|a| a.1 != accuracies(&before)[0].1)
    );

    // Each round's evaluation ended after that round's training while uploading, before it
    // otherwise (phase reports come in the order phases end).
    let order = |r: &[Report]| -> BTreeMap<u64, Vec<Phase>> {
        let mut m: BTreeMap<u64, Vec<Phase>> = BTreeMap::new();
        for x in r {
            if let Report::Phase { round, phase, .. } = *x
                && matches!(phase, Phase::Evaluate | Phase::Train)
            {
                m.entry(round).or_default().push(phase);
            }
        }
        m
    };
    for round in 1..=rounds {
        assert_eq!(
            order(&before)[&round],
            [Phase::Evaluate, Phase::Train],
            "before training, round {round}"
        );
        assert_eq!(
            order(&aside)[&round],
            [Phase::Train, Phase::Evaluate],
            "while uploading, round {round}"
        );
    }
}
