//! Every algorithm under both BN policies, through the real binaries over MQTT and through the
//! in-process runner: one client round and one server round for both, so every site must end
//! with the same model, bit for bit (BN included). Prints each run's global model hash, the
//! table a refactor's before and after are compared by.

use crate::common;

use sha2::Digest;
use std::time::Duration;
use unifed_aggregator::Algorithm;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_protocol::messages::BnPolicy;

const SITES: [&str; 3] = ["grey", "texture", "lowres"];

/// The hash of the aggregator's final model (its little-endian bytes, spec order).
fn final_hash(fed: &Fed) -> String {
    let model = Store::open(&fed.agg_dir())
        .unwrap()
        .load_model(fed.rounds, &fed.spec().hash().0)
        .unwrap();
    let mut h = sha2::Sha256::new();
    for v in model.iter().flatten() {
        h.update(v.to_le_bytes());
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn every_algorithm_under_both_bn_policies_ends_the_same_over_mqtt_as_in_process() {
    let _one = serial();
    let mut table = Vec::new();
    for algorithm in Algorithm::all() {
        for bn in [BnPolicy::Local, BnPolicy::Global] {
            let dir = tempfile::tempdir().unwrap();
            let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
            let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
            fed.rounds = 2;
            fed.algorithm = algorithm;
            fed.bn_policy = bn;
            let mut agg = fed.aggregator();
            let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
            for (a, s) in agents.iter_mut().zip(SITES) {
                fed.wait_ok(a, s, Duration::from_secs(300));
            }
            fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));
            drop(broker);
            for r in 1..=fed.rounds {
                assert_eq!(fed.accepted(r), ["grey", "lowres", "texture"], "round {r}");
            }
            common::same_as_in_process(&fed, &SITES, algorithm);
            table.push(format!(
                "{:<10} {:<6} {}",
                algorithm.name(),
                format!("{bn:?}").to_lowercase(),
                final_hash(&fed)
            ));
        }
    }
    println!("algorithm  bn     global model (MQTT = in process)");
    for row in table {
        println!("{row}");
    }
}
