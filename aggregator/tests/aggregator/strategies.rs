//! Strategies read a round through `Contributions`: every algorithm combines a round held in
//! memory (`InMemory`, no files) exactly as it combines the same round read from the spool
//! (`SpoolRound`), model and state bit for bit; and the rules' numbers are the papers', worked
//! by hand on rounds in memory.

use unifed_aggregator::Weighting;
use unifed_aggregator::spoolround::SpoolRound;
use unifed_aggregator::store::{SpoolEntry, SpoolTensor, Store};
use unifed_aggregator::strategy::{
    Algorithm, Contribution, Contributions, Extras, FedCdConfig, FedImproConfig, InMemory,
    ReadError, Setup, StrategyState, from_config, rea_weights,
};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::{ClassStats, FeatureStats, LocalReport};
use unifed_protocol::{TensorKind, TensorSpec};

fn spec(name: &str, n: usize, kind: TensorKind) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        shape: vec![n],
        kind,
    }
}

/// Three trainable tensors (the last a linear classifier of width 3) and a BN running mean
/// (as under BN policy `global`).
fn setup(sites: usize) -> Setup {
    Setup {
        tensors: vec![
            spec("w", 5, TensorKind::NonBn),
            spec("bn.weight", 3, TensorKind::BnWeight),
            spec("bn.running_mean", 3, TensorKind::BnRunningMean),
            TensorSpec {
                name: "fc.weight".into(),
                shape: vec![2, 3],
                kind: TensorKind::NonBn,
            },
        ],
        encoding: Encoding::F32,
        sites,
        spec: None,
    }
}

/// Site `i`'s contribution: deltas of irregular values, its own step count and sample count,
/// and the extras `algorithm` asks for (a control-variate delta, a mask gradient and risk).
fn contribution(setup: &Setup, i: usize, algorithm: &Algorithm) -> Contribution {
    let value = |k: usize, e: usize| ((i * 7 + k * 3 + e) as f32 * 0.37).sin() * 0.1;
    let delta: Vec<Vec<f32>> = setup
        .tensors
        .iter()
        .enumerate()
        .map(|(k, t)| (0..t.numel()).map(|e| value(k, e)).collect())
        .collect();
    let extras = match algorithm {
        Algorithm::Scaffold(_) | Algorithm::FedDc(_) => Extras::Control(
            setup
                .trainable()
                .enumerate()
                .map(|(k, t)| (0..t.numel()).map(|e| value(k + 5, e) * 0.5).collect())
                .collect(),
        ),
        Algorithm::FedCd(_) => Extras::MaskGradient {
            gradient: (0..3).map(|e| value(9, e)).collect(),
            risk: 0.3 + i as f64 * 0.2,
        },
        // Two classes (the classifier's rows) of four features; site 1 never saw class 1.
        Algorithm::FedImpro(_) => Extras::FeatureStats(FeatureStats {
            width: 4,
            classes: (0..2)
                .map(|k| {
                    (i != 1 || k == 0).then(|| ClassStats {
                        mean: (0..4).map(|e| value(11 + k, e)).collect(),
                        var: (0..4).map(|e| value(13 + k, e).abs()).collect(),
                    })
                })
                .collect(),
        }),
        _ => Extras::None,
    };
    Contribution {
        samples: 10 + 13 * i as u64,
        report: LocalReport {
            local_steps: 4 + i as u64,
            train_loss: 0.5,
        },
        extras,
        delta,
        bn: Vec::new(),
    }
}

fn model(setup: &Setup) -> Vec<Vec<f32>> {
    setup
        .tensors
        .iter()
        .enumerate()
        .map(|(k, t)| {
            (0..t.numel())
                .map(|e| 1.0 + (k + e) as f32 * 0.25)
                .collect()
        })
        .collect()
}

/// Two rounds of `algorithm` over `round` (the second from the state the first left): the
/// model after each, and the state.
fn combine(
    algorithm: &Algorithm,
    setup: &Setup,
    rounds: [&dyn Contributions; 2],
) -> (Vec<Vec<Vec<f32>>>, StrategyState) {
    let mut strategy = from_config(algorithm, setup, None).unwrap();
    let mut x = model(setup);
    let mut models = Vec::new();
    for round in rounds {
        let mut targets: Vec<&mut Vec<f32>> = x.iter_mut().collect();
        strategy.aggregate(round, &mut targets).unwrap();
        models.push(x.clone());
    }
    (models, strategy.state())
}

fn spool(store: &Store, round: u64, site: &str, c: &Contribution) {
    let delta: Vec<SpoolTensor> = c.delta.iter().map(|d| SpoolTensor::Values(d)).collect();
    store
        .spool_put(
            round,
            site,
            &SpoolEntry {
                message: &[],
                staged: None,
                samples: c.samples,
                norm: 1.0,
                report: &c.report,
                extras: &c.extras,
                delta: &delta,
                bn: &c.bn,
            },
        )
        .unwrap();
}

#[test]
fn every_algorithm_combines_a_round_in_memory_as_it_combines_it_from_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let setup = setup(4);
    for weighting in [Weighting::Samples, Weighting::Uniform] {
        for algorithm in Algorithm::all() {
            let mut memory = Vec::new();
            let mut spooled = Vec::new();
            for (r, sites) in [(1u64, [0usize, 2, 3].as_slice()), (2, &[1, 2])] {
                let round: Vec<(String, Contribution)> = sites
                    .iter()
                    .map(|&i| {
                        (
                            format!("site-{i}"),
                            contribution(&setup, i + r as usize, &algorithm),
                        )
                    })
                    .collect();
                for (site, c) in &round {
                    spool(&store, r, site, c);
                }
                let names = round.iter().map(|(s, _)| s.clone()).collect();
                spooled.push(SpoolRound::new(&store, r, names, weighting));
                memory.push(InMemory::new(r, weighting, round));
            }
            let in_memory = combine(&algorithm, &setup, [&memory[0], &memory[1]]);
            let from_spool = combine(&algorithm, &setup, [&spooled[0], &spooled[1]]);
            assert_eq!(in_memory, from_spool, "{}", algorithm.name());
            // Every round moved the model.
            assert_ne!(in_memory.0[0], model(&setup), "{}", algorithm.name());
            assert_ne!(in_memory.0[1], in_memory.0[0], "{}", algorithm.name());
            store.spool_clear_before(3).unwrap();
        }
    }
}

#[test]
fn fedavg_steps_the_model_by_the_sample_weighted_mean_of_the_deltas() {
    let setup = Setup {
        tensors: vec![spec("w", 2, TensorKind::NonBn)],
        encoding: Encoding::F32,
        sites: 0,
        spec: None,
    };
    let c = |samples, delta: [f32; 2]| Contribution {
        samples,
        report: LocalReport::default(),
        extras: Extras::None,
        delta: vec![delta.to_vec()],
        bn: Vec::new(),
    };
    // Weights 1 and 3: ((1 * 1 + 3 * 5) / 4, (1 * 2 + 3 * 6) / 4) = (4, 5).
    let round = InMemory::new(
        1,
        Weighting::Samples,
        [
            ("b".to_string(), c(3, [5.0, 6.0])),
            ("a".into(), c(1, [1.0, 2.0])),
        ],
    );
    assert_eq!(round.sites(), ["a", "b"]);
    let mut strategy = from_config(&Algorithm::FedAvg, &setup, None).unwrap();
    let mut x = vec![vec![0.5f32, -1.0]];
    strategy
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap();
    assert_eq!(x, vec![vec![4.5f32, 4.0]]);
    // Uniform weighting: the plain mean (3, 4).
    let round = InMemory::new(
        1,
        Weighting::Uniform,
        [
            ("b".to_string(), c(3, [5.0, 6.0])),
            ("a".into(), c(1, [1.0, 2.0])),
        ],
    );
    let mut x = vec![vec![0.0f32, 0.0]];
    strategy
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap();
    assert_eq!(x, vec![vec![3.0f32, 4.0]]);
}

#[test]
fn scaffold_moves_its_control_variate_by_the_sum_of_deltas_over_all_registered_sites() {
    let setup = Setup {
        tensors: vec![spec("w", 2, TensorKind::NonBn)],
        encoding: Encoding::F32,
        sites: 4,
        spec: None,
    };
    let c = |dc: [f32; 2]| Contribution {
        samples: 1,
        report: LocalReport::default(),
        extras: Extras::Control(vec![dc.to_vec()]),
        delta: vec![vec![0.0, 0.0]],
        bn: Vec::new(),
    };
    // N = 4, two report: c = ([0.5, 1] + [1.5, -3]) / 4 = [0.5, -0.5].
    let round = InMemory::new(
        1,
        Weighting::Samples,
        [
            ("a".to_string(), c([0.5, 1.0])),
            ("b".into(), c([1.5, -3.0])),
        ],
    );
    let algorithm = Algorithm::named("scaffold").unwrap();
    let mut strategy = from_config(&algorithm, &setup, None).unwrap();
    let mut x = [vec![0.0f32, 0.0]];
    strategy
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap();
    match strategy.state() {
        StrategyState::Scaffold { c, n, .. } => {
            assert_eq!(c, vec![vec![0.5f32, -0.5]]);
            assert_eq!(n, 4);
        }
        other => panic!("SCAFFOLD's state is {other:?}"),
    }
}

#[test]
fn a_contribution_a_round_does_not_hold_is_a_typed_read_error() {
    let round = InMemory::new(3, Weighting::Samples, []);
    assert!(matches!(
        round.get("nobody"),
        Err(ReadError::Unreadable { what, .. }) if what.contains("`nobody`")
    ));
}

#[test]
fn a_damaged_spool_file_is_a_damaged_read_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let setup = setup(0);
    let c = contribution(&setup, 1, &Algorithm::FedAvg);
    spool(&store, 1, "a", &c);
    let path = dir.path().join("spool/r1/a.upd");
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let round = SpoolRound::new(&store, 1, vec!["a".into()], Weighting::Samples);
    assert!(matches!(
        round.get("a"),
        Err(ReadError::Damaged { what, .. }) if what.ends_with("a.upd")
    ));
    assert!(matches!(
        round.summary("a"),
        Err(ReadError::Damaged { what, .. }) if what.ends_with("a.upd")
    ));
    let mut strategy = from_config(&Algorithm::FedAvg, &setup, None).unwrap();
    let mut x = model(&setup);
    let err = strategy
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap_err();
    assert!(matches!(err, ReadError::Damaged { .. }), "{err}");
}

#[test]
fn fedcd_shares_the_weighted_mask_gradient_and_weighs_deltas_by_rea() {
    let setup = Setup {
        tensors: vec![TensorSpec {
            name: "fc.weight".into(),
            shape: vec![1, 2],
            kind: TensorKind::NonBn,
        }],
        encoding: Encoding::F32,
        sites: 0,
        spec: None,
    };
    let c = |samples, delta: [f32; 2], gradient: [f32; 2], risk| Contribution {
        samples,
        report: LocalReport::default(),
        extras: Extras::MaskGradient {
            gradient: gradient.to_vec(),
            risk,
        },
        delta: vec![delta.to_vec()],
        bn: Vec::new(),
    };
    let round = InMemory::new(
        1,
        Weighting::Samples,
        [
            ("a".to_string(), c(1, [1.0, 0.0], [1.0, -2.0], 1.0)),
            ("b".into(), c(3, [0.0, 4.0], [3.0, 2.0], 3.0)),
        ],
    );
    let run = |rea: bool| {
        let algorithm = Algorithm::FedCd(FedCdConfig {
            eta: 0.8,
            rea,
            ..FedCdConfig::default()
        });
        let mut strategy = from_config(&algorithm, &setup, None).unwrap();
        let mut x = vec![vec![0.0f32, 0.0]];
        strategy
            .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
            .unwrap();
        (x, strategy.state())
    };
    // g_g = (1 [1, -2] + 3 [3, 2]) / 4 = [2.5, 1].
    let want = StrategyState::FedCd {
        gradient: Some(vec![2.5, 1.0]),
    };
    // SCI alone: FedAvg's mean, (1 [1, 0] + 3 [0, 4]) / 4 = [0.25, 3].
    assert_eq!(run(false), (vec![vec![0.25f32, 3.0]], want.clone()));
    // REA: w = (1, 1/3) / (4/3) = (0.75, 0.25); c = softmax(0.8 w + p) with p = (0.25, 0.75).
    let (la, lb) = (0.8f64 * 0.75 + 0.25, 0.8f64 * 0.25 + 0.75);
    let ca = la.exp() / (la.exp() + lb.exp());
    assert_eq!(rea_weights(&[0.25, 0.75], &[1.0, 3.0], 0.8)[0], ca);
    let (x, state) = run(true);
    assert_eq!(state, want);
    assert_eq!(x, vec![vec![ca as f32, (4.0 * (1.0 - ca)) as f32]]);
}

#[test]
fn fedimpro_averages_each_class_over_the_sites_that_sent_it_and_steps_by_fedavgs_mean() {
    let setup = Setup {
        tensors: vec![TensorSpec {
            name: "fc.weight".into(),
            shape: vec![2, 2],
            kind: TensorKind::NonBn,
        }],
        encoding: Encoding::F32,
        sites: 0,
        spec: None,
    };
    let class = |m: f32, v: f32| {
        Some(ClassStats {
            mean: vec![m, -m],
            var: vec![v, v],
        })
    };
    let c = |samples, delta: f32, classes: Vec<Option<ClassStats>>| Contribution {
        samples,
        report: LocalReport::default(),
        extras: Extras::FeatureStats(FeatureStats { width: 2, classes }),
        delta: vec![vec![delta; 4]],
        bn: Vec::new(),
    };
    let round = InMemory::new(
        1,
        Weighting::Samples,
        [
            ("a".to_string(), c(1, 4.0, vec![class(1.0, 1.0), None])),
            (
                "b".into(),
                c(3, 0.0, vec![class(3.0, 2.0), class(5.0, 4.0)]),
            ),
        ],
    );
    let algorithm = Algorithm::FedImpro(FedImproConfig::default());
    let mut strategy = from_config(&algorithm, &setup, None).unwrap();
    let mut x = vec![vec![0.0f32; 4]];
    strategy
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap();
    // The deltas by sample weight: (1 * 4 + 3 * 0) / 4; the statistics unweighted (Eq. 8),
    // class 1 from b alone.
    assert_eq!(x, vec![vec![1.0f32; 4]]);
    let want = FeatureStats {
        width: 2,
        classes: vec![class(2.0, 1.5), class(5.0, 4.0)],
    };
    let state = strategy.state();
    assert_eq!(
        state,
        StrategyState::FedImpro {
            stats: Some(want.clone())
        }
    );
    assert_eq!(
        strategy.extras(),
        unifed_protocol::ServerExtras::FeatureStats(want.clone())
    );
    // A restarted server resumes from the state: a round where no site sent class 1 keeps it.
    let mut again = from_config(&algorithm, &setup, Some(state)).unwrap();
    let round = InMemory::new(
        2,
        Weighting::Samples,
        [("a".to_string(), c(1, 0.0, vec![class(4.0, 1.5), None]))],
    );
    again
        .aggregate(&round, &mut x.iter_mut().collect::<Vec<_>>())
        .unwrap();
    let StrategyState::FedImpro { stats: Some(s) } = again.state() else {
        panic!()
    };
    assert_eq!(s.classes, vec![class(4.0, 1.5), class(5.0, 4.0)]);
    // A stored state of another class count, or with a negative variance, is refused.
    let three = StrategyState::FedImpro {
        stats: Some(FeatureStats {
            width: 2,
            classes: vec![None; 3],
        }),
    };
    let err = from_config(&algorithm, &setup, Some(three))
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 classes, not 2"), "{err}");
    let negative = StrategyState::FedImpro {
        stats: Some(FeatureStats {
            width: 2,
            classes: vec![class(1.0, -1.0), None],
        }),
    };
    assert!(negative.check().is_err());
}
