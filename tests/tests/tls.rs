//! TLS to the broker: Mosquitto with a TLS listener and a password file; the aggregator and two
//! agents check its certificate against a CA file and federate; an agent given another CA is
//! refused (and says why in its log).

use std::path::Path;
use std::time::Duration;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, TlsFiles, mosquitto_available, serial};

/// A CA and a server certificate for 127.0.0.1/localhost signed by it, written as PEM files;
/// plus a second, unrelated CA.
fn certificates(dir: &Path) -> (TlsFiles, std::path::PathBuf) {
    let ca = |name: &str| {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca_cert, ca_key) = ca("UniFed test CA");
    let (other, _) = ca("Another CA");
    let mut p =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "unifed test broker");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
    let files = TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    };
    std::fs::write(&files.ca, ca_cert.pem()).unwrap();
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, key.serialize_pem()).unwrap();
    let other_path = dir.join("other-ca.pem");
    std::fs::write(&other_path, other.pem()).unwrap();
    (files, other_path)
}

#[test]
fn a_federation_over_tls_checks_the_broker_against_the_ca_file() {
    if !mosquitto_available() {
        return;
    }
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let (tls, other_ca) = certificates(dir.path());
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
    assert!(
        fed.wait_line("lowres", "certificate", Duration::from_secs(60)),
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
