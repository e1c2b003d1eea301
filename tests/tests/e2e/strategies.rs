//! Stateful strategies over MQTT with the real binaries: a FedAdam federation (server moments),
//! a SCAFFOLD federation (control variates both ways), a MOON federation (each site's previous
//! local model), a FedDC federation (variates, each site's drift, the server's drift sum) and a
//! FedCD federation (each site's mask, the federation's mask gradient), each run once uninterrupted and once with an agent killed (SIGKILL) while it trains and the
//! aggregator killed with a round half collected. Both must end bit-identical: the global
//! model, the server's stored strategy state, and every site's model (BN included) and memory. The uninterrupted run
//! must also equal the in-process run of the same federation.

use crate::common;

use std::time::Duration;
use unifed_aggregator::Algorithm;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_models::checkpoint;
use unifed_models::client::ClientState;
use unifed_models::site::Memory;
use unifed_net::report::Report;
use unifed_protocol::messages::BnPolicy;

const SITES: [&str; 3] = ["grey", "texture", "lowres"];
const PACKET: usize = 32 << 10;
const LONG: Duration = Duration::from_secs(300);

/// `lowres` trains on more images than the others, so it is still training when the others
/// have reported.
fn fed_for(dir: &std::path::Path, port: u16, algorithm: Algorithm, bn: BnPolicy) -> Fed {
    let mut fed = Fed::new(dir, port, PACKET);
    fed.resend_secs = 2;
    fed.samples.insert("lowres".into(), 743);
    fed.algorithm = algorithm;
    fed.bn_policy = bn;
    fed
}

/// A memory in short: each part's tensor count and the first value of each (a failure's
/// message).
fn summary(m: &Memory) -> String {
    let first = |t: &std::collections::BTreeMap<String, Vec<f32>>| -> Vec<f32> {
        t.values()
            .map(|v| v.first().copied().unwrap_or(0.0))
            .collect()
    };
    match &m.algorithm {
        ClientState::FedDc { controls, drift } => format!(
            "residual {} held {:?} c_i {:?} server {:?} drift {:?}",
            m.residual.len(),
            m.held.as_ref().map(|h| h.0),
            first(&controls.control),
            controls.server.as_ref().map(|(v, c)| (*v, first(c))),
            first(drift)
        ),
        other => format!("{other:?}"),
    }
}

/// What a finished federation left on disk, compared bit for bit.
#[derive(Debug, PartialEq)]
struct Outcome {
    /// The spec's tensors in order: name, and whether BN owns it.
    tensors: Vec<(String, bool)>,
    model: Vec<Vec<u32>>,
    strategy: Vec<u8>,
    /// The strategy's state, read back.
    state: Option<unifed_aggregator::strategy::StrategyState>,
    sites: Vec<(Vec<Vec<u32>>, Memory)>,
}

/// The memory (residuals, the algorithm's state) in a site's `checkpoint.bin`: magic and version 7,
/// then the postcard of (progress, memory, (model file's number, its length, its sum)), then
/// the file's sum.
fn memory(dir: &std::path::Path) -> Memory {
    let bytes = std::fs::read(dir.join("checkpoint.bin")).unwrap();
    assert_eq!(&bytes[..8], b"UFSC\x07\0\0\0");
    type Progress = (Option<u64>, Vec<u64>, Option<unifed_protocol::RunId>);
    type ModelFile = (u64, u64, [u8; 16]);
    let body = &bytes[8..bytes.len() - 16];
    let (memory, rest) = postcard::take_from_bytes::<(Progress, Memory, ModelFile)>(body).unwrap();
    assert!(rest.is_empty(), "{} bytes after the record", rest.len());
    memory.1
}

fn outcome(fed: &Fed) -> Outcome {
    let spec = fed.spec();
    let bits = |t: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        t.into_iter()
            .map(|v| v.into_iter().map(f32::to_bits).collect())
            .collect()
    };
    let store = Store::open(&fed.agg_dir()).unwrap();
    let model = store.load_model(fed.rounds, &spec.hash().0).unwrap();
    let state = store.load_strategy(fed.rounds, &spec.hash().0).unwrap();
    assert!(
        model.iter().flatten().all(|v| v.is_finite()),
        "a committed model holds NaN or infinity"
    );
    let strategy = std::fs::read(
        fed.agg_dir()
            .join(format!("models/v{}.strategy", fed.rounds)),
    )
    .unwrap();
    let sites = SITES
        .iter()
        .map(|s| {
            let dir = fed.site_dir(s);
            let m = checkpoint::load(&dir.join("model.safetensors"), &spec).unwrap();
            (
                bits(m.tensors.into_iter().map(|t| t.data).collect()),
                memory(&dir),
            )
        })
        .collect();
    Outcome {
        tensors: spec
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.kind.is_bn()))
            .collect(),
        model: bits(model),
        strategy,
        state,
        sites,
    }
}

fn uninterrupted(algorithm: Algorithm, bn: BnPolicy) -> Outcome {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port, algorithm, bn);
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    common::same_as_in_process(&fed, &SITES, algorithm);
    outcome(&fed)
}

fn disturbed(algorithm: Algorithm, bn: BnPolicy) -> Outcome {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port, algorithm, bn);
    let mut agg = fed.aggregator();
    let mut grey = fed.agent("grey");
    let mut texture = fed.agent("texture");
    let mut lowres = fed.agent("lowres");
    // An agent killed while it trains round 2: it restarts from its checkpoint and memory.
    let training = |r: &Report| matches!(r, Report::Training { round: 2, .. });
    assert!(
        fed.wait_report(&["lowres"], training, LONG).is_some(),
        "{}",
        fed.logs()
    );
    lowres.kill();
    let mut lowres = fed.agent("lowres");
    // The aggregator killed with round 3 half collected: it restarts from its spool, its
    // committed model and the strategy state stored with it.
    let accepted = |r: &Report| {
        matches!(
            r,
            Report::Answered {
                round: 3,
                accepted: true
            }
        )
    };
    assert!(
        fed.wait_report(&["grey", "texture"], accepted, LONG)
            .is_some(),
        "{}",
        fed.logs()
    );
    agg.kill();
    let mut agg = fed.aggregator();
    for (g, s) in [
        (&mut grey, "grey"),
        (&mut texture, "texture"),
        (&mut lowres, "lowres"),
    ] {
        fed.wait_ok(g, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    // Round 3 closed once, by the restarted aggregator, with all three sites.
    let log = std::fs::read_to_string(fed.dir.join("agg.log")).unwrap();
    assert_eq!(
        log.matches("round 3 closed with 3 update(s)").count(),
        1,
        "{log}"
    );
    outcome(&fed)
}

#[test]
fn fedadam_with_global_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::FedAdam(Default::default()), BnPolicy::Global);
    let got = disturbed(Algorithm::FedAdam(Default::default()), BnPolicy::Global);
    assert!(got.model == want.model, "the global model differs");
    assert!(got.strategy == want.strategy, "the server moments differ");
    assert!(got.sites == want.sites, "a site's model or memory differs");
}

#[test]
fn scaffold_with_local_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::Scaffold(Default::default()), BnPolicy::Local);
    let got = disturbed(Algorithm::Scaffold(Default::default()), BnPolicy::Local);
    assert!(got.model == want.model, "the global model differs");
    assert!(
        got.strategy == want.strategy,
        "the server control variate differs"
    );
    assert!(
        got.sites == want.sites,
        "a site's model or control variate differs"
    );
    // Every site holds its control variate and the server's of the final model (SCAFFOLD
    // ran, not FedAvg).
    for (_, m) in &want.sites {
        let ClientState::Scaffold(c) = &m.algorithm else {
            panic!("a site's state is {:?}", m.algorithm);
        };
        assert!(!c.control.is_empty() && c.control.values().flatten().any(|&v| v != 0.0));
        assert_eq!(c.server.as_ref().map(|(v, _)| *v), Some(3));
    }
}

#[test]
fn moon_with_local_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::Moon(Default::default()), BnPolicy::Local);
    let got = disturbed(Algorithm::Moon(Default::default()), BnPolicy::Local);
    assert!(got.model == want.model, "the global model differs");
    assert!(
        got.sites == want.sites,
        "a site's model or previous local model differs"
    );
    // Every site ends holding the model it trained in the last round as its previous one: its
    // own BN, as in its model file, beside non-BN weights that the final model replaced there.
    for (model, m) in &want.sites {
        let previous = m.algorithm.previous().expect("no previous local model");
        let mut replaced = 0;
        for (k, (name, bn)) in want.tensors.iter().enumerate() {
            let kept: Vec<u32> = previous[name].iter().map(|v| v.to_bits()).collect();
            if *bn {
                assert!(
                    kept == model[k],
                    "{name}: the previous model's BN is not the site's"
                );
            } else {
                replaced += usize::from(kept != model[k]);
            }
        }
        assert!(replaced > 0, "the previous model is the final global one");
    }
}

#[test]
fn feddc_with_global_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::FedDc(Default::default()), BnPolicy::Global);
    let got = disturbed(Algorithm::FedDc(Default::default()), BnPolicy::Global);
    assert!(got.model == want.model, "the global model differs");
    assert!(
        got.strategy == want.strategy,
        "the server's variate or drift sum differs"
    );
    for (k, (g, w)) in got.sites.iter().zip(&want.sites).enumerate() {
        assert!(g.0 == w.0, "site {}: its model differs", SITES[k]);
        assert!(
            g.1 == w.1,
            "site {}: its memory differs\n{:?}\n{:?}",
            SITES[k],
            summary(&g.1),
            summary(&w.1)
        );
    }
    // Every site holds a drift (its accepted deltas summed) and a variate (FedDC ran): under
    // global BN they cover the BN affine tensors, never the running statistics.
    for (_, m) in &want.sites {
        let ClientState::FedDc { controls, drift } = &m.algorithm else {
            panic!("a site's state is {:?}", m.algorithm);
        };
        assert!(drift.values().flatten().any(|&v| v != 0.0));
        assert!(
            drift
                .keys()
                .any(|k| k.ends_with(".weight") && k.contains("bn"))
        );
        assert!(!drift.keys().any(|k| k.contains("running")));
        assert!(!controls.control.is_empty());
    }
}

#[test]
fn fedcd_with_local_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::named("fedcd").unwrap(), BnPolicy::Local);
    let got = disturbed(Algorithm::named("fedcd").unwrap(), BnPolicy::Local);
    assert!(got.model == want.model, "the global model differs");
    assert!(
        got.strategy == want.strategy,
        "the server's mask gradient differs"
    );
    assert!(
        got.sites == want.sites,
        "a site's model, mask or federation mask gradient differs"
    );
    // Every site holds a trained mask of the classifier's width, its own, and the federation's
    // mask gradient of the final model.
    // The classifier is the last linear layer: its weight holds classes x width values.
    let n = want.tensors.len();
    let (weight, bias) = (&want.model[n - 2], &want.model[n - 1]);
    assert!(want.tensors[n - 2].0.ends_with("weight") && !want.tensors[n - 2].1);
    let width = weight.len() / bias.len();
    let mut masks = Vec::new();
    for (_, m) in &want.sites {
        let ClientState::FedCd { mask, server } = &m.algorithm else {
            panic!("a site's state is {:?}", m.algorithm);
        };
        let mask = mask.as_ref().expect("no trained mask");
        assert_eq!(mask.len(), width);
        assert!(mask.iter().any(|&v| v != 1.0));
        let (version, g) = server.as_ref().expect("no federation mask gradient");
        assert_eq!(*version, 3);
        assert_eq!(g.values().next().map(Vec::len), Some(width));
        masks.push(mask.clone());
    }
    assert!(
        masks[0] != masks[1] && masks[1] != masks[2],
        "the masks are shared"
    );
}

#[test]
fn fedimpro_with_local_bn_killed_agent_and_aggregator_ends_bit_identical() {
    let want = uninterrupted(Algorithm::named("fedimpro").unwrap(), BnPolicy::Local);
    let got = disturbed(Algorithm::named("fedimpro").unwrap(), BnPolicy::Local);
    assert!(got.model == want.model, "the global model differs");
    assert!(
        got.strategy == want.strategy,
        "the server's feature statistics differ"
    );
    assert!(
        got.sites == want.sites,
        "a site's model, statistics or the federation's Gaussians differ"
    );
    // The server holds a Gaussian of every class some site saw; each site its own running
    // statistics at the default split (the middle: after conv3) and the federation's of the
    // final model.
    let Some(unifed_aggregator::strategy::StrategyState::FedImpro {
        stats: Some(global),
    }) = &want.state
    else {
        panic!("the server's state is {:?}", want.state);
    };
    assert!(global.classes.iter().filter(|c| c.is_some()).count() >= 2);
    let mut kept = Vec::new();
    for (_, m) in &want.sites {
        let ClientState::FedImpro { local, server } = &m.algorithm else {
            panic!("a site's state is {:?}", m.algorithm);
        };
        let (split, stats) = local.as_ref().expect("no running statistics");
        assert_eq!(*split, 3);
        assert_eq!(stats.width, global.width);
        let (version, g) = server.as_ref().expect("no federation statistics");
        assert_eq!(*version, 3);
        assert_eq!(g.as_ref(), Some(global));
        kept.push(stats.clone());
    }
    assert!(kept[0] != kept[1], "the sites' statistics are shared");
}
