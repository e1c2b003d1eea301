//! The Debian packages (`packaging/deb/build.sh`): installed into a fresh root made by the test
//! (`dpkg --root`), their units pass `systemd-analyze verify`, the installed agent (its binary,
//! the key its package made, its state folder) joins a federation, an upgrade keeps the state
//! folder, the key and an edited config, and a purge removes them. Skipped (SKIPPED printed)
//! where dpkg or systemd-analyze are missing, unless `UNIFED_REQUIRE_DEB` is set.

use std::path::{Path, PathBuf};
use std::process::Command;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, binary, serial};

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().expect("starting a tool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?}: {text}");
    text
}

/// Builds both packages of version `ver` from the workspace's binaries into `out`.
fn build(ver: &str, out: &Path) -> (PathBuf, PathBuf) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/deb/build.sh");
    let bins = binary("unifed-agent").parent().unwrap().to_path_buf();
    // gzip: a test's packages need not be small.
    let text = sh(Command::new("sh")
        .arg(script)
        .arg(ver)
        .arg(out)
        .arg(&bins)
        .env("DEB_COMPRESSION", "gzip"));
    let mut debs = text.lines().map(PathBuf::from);
    (debs.next().unwrap(), debs.next().unwrap())
}

/// `dpkg` on the root `root`: maintainer scripts run outside it with `DPKG_ROOT` set.
fn dpkg(root: &Path, args: &[&str]) -> String {
    sh(Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args([
            "--force-script-chrootless",
            "--force-not-root",
            "--force-depends",
            "--force-confold",
            "--log=/dev/null",
        ])
        .args(args))
}

/// A fresh, empty dpkg root.
fn fresh_root(dir: &Path) -> PathBuf {
    let root = dir.join("root");
    for d in ["info", "updates", "triggers"] {
        std::fs::create_dir_all(root.join("var/lib/dpkg").join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    root
}

#[test]
fn the_agent_package_installs_joins_a_federation_upgrades_keeping_state_and_purges() {
    if !(have("dpkg-deb") && have("dpkg") && have("systemd-analyze")) {
        assert!(
            std::env::var_os("UNIFED_REQUIRE_DEB").is_none(),
            "UNIFED_REQUIRE_DEB is set but dpkg or systemd-analyze is missing"
        );
        eprintln!("SKIPPED: dpkg-deb, dpkg or systemd-analyze is not installed");
        return;
    }
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let (agent_v1, aggregator_v1) = build("0.1.0", &dir.path().join("v1"));
    let (agent_v2, _) = build("0.1.1", &dir.path().join("v2"));
    let root = fresh_root(dir.path());
    let out = dpkg(&root, &["-i", &agent_v1.to_string_lossy()]);
    dpkg(&root, &["-i", &aggregator_v1.to_string_lossy()]);
    // The key was made on install, owner-only, and its public half printed to enrol.
    let creds = root.join("etc/unifed/credentials");
    let key = creds.join("agent-identity.key");
    let mode = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    };
    assert_eq!((mode(&key), mode(&creds)), (0o600, 0o700));
    let public = std::fs::read_to_string(creds.join("agent-identity.pub")).unwrap();
    let public = public.lines().next().unwrap().to_string();
    assert!(out.contains(&public), "{out}");
    assert!(root.join("etc/unifed/agent.toml").is_file());
    // Both units verify (their ExecStart pointed at the installed binaries).
    for unit in ["unifed-agent", "unifed-aggregator"] {
        let text = std::fs::read_to_string(root.join(format!("lib/systemd/system/{unit}.service")))
            .unwrap()
            .replace("/usr/bin/", &format!("{}/usr/bin/", root.display()));
        let copy = dir.path().join(format!("{unit}.service"));
        std::fs::write(&copy, text).unwrap();
        sh(Command::new("systemd-analyze").arg("verify").arg(&copy));
    }

    // The installed agent joins a federation: its key enrolled, given to it as systemd's
    // LoadCredential= does ($CREDENTIALS_DIRECTORY/identity.key), its state in the root.
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(&dir.path().join("fed"), broker.port, 1 << 20);
    fed.sites = vec!["grey".into()];
    (fed.min_sites, fed.rounds) = (1, 2);
    std::fs::create_dir_all(fed.dir.join("keys")).unwrap();
    std::fs::copy(&key, fed.dir.join("keys/grey.key")).unwrap();
    let state = root.join("var/lib/unifed-agent");
    let mut cfg = toml::Value::try_from(fed.agent_config("grey", "grey", None)).unwrap();
    cfg["identity"] = "$CREDENTIALS_DIRECTORY/identity.key".into();
    cfg["state_dir"] = state.to_string_lossy().as_ref().into();
    let cfg_file = dir.path().join("site.toml");
    std::fs::write(&cfg_file, toml::to_string(&cfg).unwrap()).unwrap();
    let loaded = dir.path().join("credentials");
    std::fs::create_dir_all(&loaded).unwrap();
    std::fs::copy(&key, loaded.join("identity.key")).unwrap();
    let mut agg = fed.aggregator();
    let installed = root.join("usr/bin/unifed-agent");
    let st = Command::new(&installed)
        .args(["train", "--config", &cfg_file.to_string_lossy()])
        .env("CREDENTIALS_DIRECTORY", &loaded)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    fed.wait_ok(&mut agg, "aggregator", std::time::Duration::from_secs(120));
    assert_eq!(fed.accepted(2), ["grey"]);
    let checkpoint = std::fs::read(state.join("checkpoint.bin")).unwrap();

    // An upgrade keeps the state folder, the key and the site's edit of its config.
    let conf = root.join("etc/unifed/agent.toml");
    let edited = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("change-me", "site-a");
    std::fs::write(&conf, &edited).unwrap();
    let key_bytes = std::fs::read(&key).unwrap();
    dpkg(&root, &["-i", &agent_v2.to_string_lossy()]);
    let status = std::fs::read_to_string(root.join("var/lib/dpkg/status")).unwrap();
    assert!(
        status.contains("Package: unifed-agent\nStatus: install ok installed"),
        "{status}"
    );
    assert!(status.contains("Version: 0.1.1"), "{status}");
    assert_eq!(std::fs::read(&key).unwrap(), key_bytes);
    assert_eq!(
        std::fs::read(state.join("checkpoint.bin")).unwrap(),
        checkpoint
    );
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), edited);
    // Removed, the key and state stay; purged, they go.
    dpkg(&root, &["-r", "unifed-agent"]);
    assert!(key.is_file() && state.join("checkpoint.bin").is_file());
    dpkg(&root, &["-P", "unifed-agent"]);
    assert!(!key.exists() && !state.exists() && !conf.exists());
    assert!(
        creds.join("aggregator.key").is_file(),
        "the aggregator's key is not the agent's to purge"
    );
}
