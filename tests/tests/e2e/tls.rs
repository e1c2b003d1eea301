//! TLS to the broker: Mosquitto with a TLS listener and a password file; the aggregator and two
//! agents check its certificate against a CA file and federate; an agent given another CA is
//! refused (and says why in its log).

use std::time::Duration;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, certificates, mosquitto_available, serial};
use unifed_net::report::Report;

#[test]
fn a_federation_over_tls_checks_the_broker_against_the_ca_file() {
    if !mosquitto_available() {
        return;
    }
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let (tls, other_ca) = certificates(dir.path(), &[]);
    let broker = Broker::start_with(BrokerKind::Mosquitto, 32 << 10, Some(tls.clone()));
    let mut fed = Fed::new(dir.path(), broker.port, 32 << 10);
    fed.credentials = broker.credentials.clone();
    fed.ca_file = Some(tls.ca.clone());
    fed.rounds = 2;
    fed.min_sites = 2;

    // An agent that trusts another CA never gets in, and its log names the certificate.
    let mut wrong = fed.clone();
    wrong.ca_file = Some(other_ca);
    let mut refused = wrong.agent("lowres");
    let certificate = |r: &Report| matches!(r, Report::Connection { up: false, error: Some(e) } if e.contains("certificate"));
    assert!(
        fed.wait_report(&["lowres"], certificate, Duration::from_secs(60))
            .is_some(),
        "{}",
        fed.logs()
    );
    assert!(
        refused.0.try_wait().unwrap().is_none(),
        "a refused agent keeps retrying"
    );
    refused.kill();

    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = ["grey", "texture"].iter().map(|s| fed.agent(s)).collect();
    for a in &mut agents {
        let st = a.wait_for(Duration::from_secs(240));
        assert!(st.is_some_and(|s| s.success()), "{st:?}\n{}", fed.logs());
    }
    let st = agg.wait_for(Duration::from_secs(60));
    assert!(st.is_some_and(|s| s.success()), "{st:?}\n{}", fed.logs());
    let store = Store::open(&fed.agg_dir()).unwrap();
    let accepted = store
        .audit_entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "accepted")
        .count();
    assert_eq!(accepted, 4, "2 sites x 2 rounds over TLS");
}
