//! One federation with a site whose training diverges and a site that joins late, run through
//! the real binaries over MQTT and through the in-process runner: both drive their sites with
//! the one site driver, so both must give every site the same model, bit for bit, and fold the
//! same sites into every round.

use crate::common;

use std::time::Duration;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_models::train::TrainConfig;
use unifed_net::report::Report;

/// Trains normally.
const STEADY: [&str; 2] = ["grey", "texture"];
/// Trains with a learning rate that overflows its weights: every round it trains diverges, so
/// it sends nothing and goes on with the next model.
const DIVERGING: &str = "lowres";
/// Starts once round 1 has closed: a late joiner, which re-estimates its BN on its own images.
const LATE: &str = "fonts";
const DIVERGING_LR: f64 = 1e30;

#[test]
fn a_diverging_site_and_a_late_joiner_end_the_same_over_mqtt_as_in_process() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.rounds = 2;
    let all = [STEADY[0], STEADY[1], DIVERGING, LATE];
    fed.sites = all.map(String::from).to_vec();
    // Every enrolled site is needed, so each round closes at its deadline with the updates it
    // has: which sites a round folds does not depend on who is faster.
    fed.min_sites = all.len();
    fed.deadline_secs = 30;
    fed.agent_edits
        .insert(DIVERGING.into(), |c| c.train.lr = DIVERGING_LR);
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = [STEADY[0], STEADY[1], DIVERGING]
        .iter()
        .map(|s| (s.to_string(), fed.agent(s)))
        .collect();
    let round_1 = |r: &Report| matches!(r, Report::RoundClosed { round: 1, .. });
    assert!(
        fed.wait_report(&["agg"], round_1, Duration::from_secs(120))
            .is_some(),
        "round 1 did not close\n{}",
        fed.logs()
    );
    agents.push((LATE.to_string(), fed.agent(LATE)));
    for (s, a) in &mut agents {
        fed.wait_ok(a, s, Duration::from_secs(300));
    }
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));
    drop(broker);

    let (records, sites, closed) =
        common::in_process(&fed, &all, unifed_aggregator::Algorithm::FedAvg, |s| {
            s.train_site(
                2,
                TrainConfig {
                    batch_size: 16,
                    lr: DIVERGING_LR,
                    ..TrainConfig::default()
                },
            )
            .join_at(3, 1)
        });
    assert_eq!(records.len(), 2);
    // In process: round 1 folds the steady sites, round 2 the late joiner too; the diverging
    // site is in neither.
    let sorted = |v: &[&str]| {
        let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
        v.sort();
        v
    };
    let expected = vec![
        (1, sorted(&STEADY)),
        (2, sorted(&[STEADY[0], STEADY[1], LATE])),
    ];
    let in_process: Vec<(u64, Vec<String>)> = closed
        .0
        .into_iter()
        .map(|(r, s)| (r, sorted(&s.iter().map(String::as_str).collect::<Vec<_>>())))
        .collect();
    assert_eq!(in_process, expected);
    // Over MQTT: the same sites accepted in each round.
    for (round, sites) in &expected {
        assert_eq!(
            &fed.accepted(*round),
            sites,
            "round {round}\n{}",
            fed.logs()
        );
    }
    // The diverging site sent nothing and the late joiner trained only round 2.
    let uploaded = |site: &str| -> Vec<u64> {
        fed.reports(site)
            .into_iter()
            .filter_map(|r| match r {
                Report::Uploaded { round, .. } => Some(round),
                _ => None,
            })
            .collect()
    };
    assert_eq!(uploaded(DIVERGING), Vec::<u64>::new());
    assert_eq!(uploaded(LATE), vec![2]);
    common::same_models(&fed, &sites);
}
