//! When an agent evaluates the models it trains from: before training, or while its update
//! uploads, on a copy frozen before training. Two sites with the same data and seed train the
//! same models bit for bit, so an agent of each kind must report the same accuracy for every
//! version, and the one evaluating while uploading must do so after its training.

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

#[test]
fn an_agent_evaluating_while_it_uploads_reports_what_one_evaluating_before_training_does() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.credentials = broker.credentials.clone();
    fed.sites = vec!["grey".into(), "twin".into()];
    fed.min_sites = 2;
    fed.domains.insert("twin".into(), "grey".into());
    fed.agent_edits.insert("grey".into(), |c| {
        c.evaluate_each_model = true;
        c.evaluate_at = Some(EvaluateAt::BeforeTraining);
    });
    fed.agent_edits.insert("twin".into(), |c| {
        c.evaluate_each_model = true;
        c.evaluate_at = Some(EvaluateAt::WhileUploading);
    });
    let mut agg = fed.aggregator();
    let mut agents = [fed.agent("grey"), fed.agent("twin")];
    for (a, s) in agents.iter_mut().zip(["grey", "twin"]) {
        fed.wait_ok(a, s, Duration::from_secs(300));
    }
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));

    let (before, aside) = (fed.reports("grey"), fed.reports("twin"));
    let want: Vec<u64> = (0..=fed.rounds).collect();
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

    // Each round's evaluation ended after that round's training on the twin, before it on
    // grey (phase reports come in the order phases end).
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
    for round in 1..=fed.rounds {
        assert_eq!(
            order(&before)[&round],
            [Phase::Evaluate, Phase::Train],
            "grey, round {round}"
        );
        assert_eq!(
            order(&aside)[&round],
            [Phase::Train, Phase::Evaluate],
            "twin, round {round}"
        );
    }
}
