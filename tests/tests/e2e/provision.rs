//! Provisioning where the private key never leaves the site: `unifed-agent enrol` makes the
//! site's key and a signed request, `unifed-aggregator approve` (with the fingerprint read out
//! by the site) enrols it in the service config, and the site then trains in a federation;
//! `enrol --rotate` and `approve` replace its key and revoke the old one.

use std::process::Command;
use std::time::Duration;
use unifed_e2e::fed::{Fed, write_toml};
use unifed_e2e::{Broker, BrokerKind, Guard, binary, serial};

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(binary(bin)).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{bin} {args:?}: {text}");
    text
}

#[test]
fn a_site_enrolled_by_request_and_approval_trains_and_its_rotation_revokes_the_old_key() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.sites = vec!["grey".into()];
    (fed.min_sites, fed.rounds) = (1, 1);
    // The site's config names a key that does not exist yet: `enrol` makes it, there.
    let mut site = fed.agent_config("grey", "grey", None);
    let key = dir.path().join("site-keys/identity.key");
    site.identity = key.clone();
    let site_cfg = dir.path().join("grey.toml");
    write_toml(&site_cfg, &site);
    let request = dir.path().join("request.json");
    let said = run(
        "unifed-agent",
        &[
            "enrol",
            "--config",
            &site_cfg.to_string_lossy(),
            "--out",
            &request.to_string_lossy(),
        ],
    );
    let public = unifed_protocol::SigningKey::load(&key).unwrap().public();
    assert!(said.contains(&public.fingerprint()), "{said}");
    // The coordinator's config enrols nobody; approving with a wrong fingerprint changes
    // nothing, with the one read out it enrols the site.
    let mut service = fed.service_config();
    service.federation.sites.clear();
    let agg_cfg = dir.path().join("agg.toml");
    write_toml(&agg_cfg, &service);
    let before = std::fs::read_to_string(&agg_cfg).unwrap();
    let wrong = Command::new(binary("unifed-aggregator"))
        .args(["approve", "--config", &agg_cfg.to_string_lossy()])
        .args([
            "--request",
            &request.to_string_lossy(),
            "--fingerprint",
            "0000-0000-0000-0000",
        ])
        .output()
        .unwrap();
    assert!(!wrong.status.success());
    assert_eq!(std::fs::read_to_string(&agg_cfg).unwrap(), before);
    let said = run(
        "unifed-aggregator",
        &[
            "approve",
            "--config",
            &agg_cfg.to_string_lossy(),
            "--request",
            &request.to_string_lossy(),
            "--fingerprint",
            &public.fingerprint(),
        ],
    );
    assert!(said.contains("enrolled `grey`"), "{said}");
    // The federation runs with the approved key.
    let log = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
    let mut agg = Guard(
        Command::new(binary("unifed-aggregator"))
            .args(["serve", "--config", &agg_cfg.to_string_lossy()])
            .env("UNIFED_REPORT", "1")
            .stdout(log("agg.log"))
            .stderr(log("agg.err"))
            .spawn()
            .unwrap(),
    );
    let mut agent = Guard(
        Command::new(binary("unifed-agent"))
            .args(["train", "--config", &site_cfg.to_string_lossy()])
            .stdout(log("grey.log"))
            .stderr(log("grey.err"))
            .spawn()
            .unwrap(),
    );
    for (g, what) in [(&mut agent, "grey"), (&mut agg, "agg")] {
        let st = g.wait_for(Duration::from_secs(120));
        let err = std::fs::read_to_string(dir.path().join(format!("{what}.err"))).unwrap();
        assert!(st.is_some_and(|s| s.success()), "{what}: {st:?}\n{err}");
    }
    assert_eq!(fed.accepted(1), ["grey"]);
    // Rotation: a new key, the request signed by both; approved, the old key is revoked.
    let rotated = dir.path().join("rotation.json");
    run(
        "unifed-agent",
        &[
            "enrol",
            "--config",
            &site_cfg.to_string_lossy(),
            "--out",
            &rotated.to_string_lossy(),
            "--rotate",
        ],
    );
    let new = unifed_protocol::SigningKey::load(&key).unwrap().public();
    assert_ne!(new, public);
    let said = run(
        "unifed-aggregator",
        &[
            "approve",
            "--config",
            &agg_cfg.to_string_lossy(),
            "--request",
            &rotated.to_string_lossy(),
        ],
    );
    assert!(said.contains("rotated `grey`'s key"), "{said}");
    let cfg = unifed_aggregator::service::read_config(&agg_cfg).unwrap();
    assert_eq!(cfg.federation.sites.len(), 1);
    assert_eq!(cfg.federation.sites[0].key, new);
    assert_eq!(cfg.federation.revoked, [public]);
    // And `revoke` revokes the site's current key.
    run(
        "unifed-aggregator",
        &[
            "revoke",
            "--config",
            &agg_cfg.to_string_lossy(),
            "--site",
            "grey",
        ],
    );
    let cfg = unifed_aggregator::service::read_config(&agg_cfg).unwrap();
    assert_eq!(cfg.federation.revoked, [public, new]);
}
