//! A federation over MQTT with the real binaries: the embedded broker, `unifed-aggregator serve`
//! and three `unifed-agent train` processes, 2 rounds. Afterwards every agent holds the
//! aggregator's final non-BN weights, and its own BN statistics.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use unifed_aggregator::store::Store;
use unifed_e2e::{Guard, binary};
use unifed_models::checkpoint;
use unifed_models::state::Select;
use unifed_protocol::ModelSpec;

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn three_agents_federate_two_rounds_through_the_embedded_broker() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut broker = Guard(
        Command::new(binary("unifed-broker"))
            .args(["--listen", "127.0.0.1:0", "--max-packet-bytes", "32768"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(broker.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().rsplit(':').next().unwrap().parse().unwrap();

    let model = d.join("init.safetensors");
    let st = Command::new(binary("unifed-agent"))
        .args([
            "init", "--arch", "digits", "--conv", "4,6,8", "--fc", "64,16", "--out",
        ])
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success());
    let broker_toml =
        format!("[broker]\nhost = \"127.0.0.1\"\nport = {port}\nmax_packet_bytes = 32768\n");
    write(
        &d.join("agg.toml"),
        &format!(
            "data_dir = \"{}\"\nmodel = \"{}\"\nchunk_bytes = 8192\nlinger_secs = 5\n{broker_toml}\n[federation]\nfederation = \"e2e\"\nrounds = 2\nmin_sites = 3\ndeadline_secs = 300\nfraction = 1.0\nsites = []\nencoding = \"F32\"\nbn_policy = \"Local\"\nweighting = \"samples\"\nkeep_versions = 3\nmax_update_bytes = 16777216\nseed = 0\n",
            d.join("agg").display(),
            model.display()
        ),
    );
    let mut agg = Guard(
        Command::new(binary("unifed-aggregator"))
            .args(["serve", "--config"])
            .arg(d.join("agg.toml"))
            .spawn()
            .unwrap(),
    );
    let sites = ["grey", "texture", "lowres"];
    let mut agents: Vec<Guard> = sites
        .iter()
        .map(|s| {
            let cfg = d.join(format!("{s}.toml"));
            write(
                &cfg,
                &format!(
                    "site = \"{s}\"\nfederation = \"e2e\"\nstate_dir = \"{}\"\nresend_secs = 3\n[model]\nconv = [4, 6, 8]\nfc = [64, 16]\n[train]\nbatch_size = 16\n{broker_toml}\n[data]\nbuiltin = \"{s}\"\ntrain_samples = 48\n",
                    d.join(s).display()
                ),
            );
            Guard(Command::new(binary("unifed-agent")).args(["train", "--config"]).arg(&cfg).spawn().unwrap())
        })
        .collect();
    for (a, s) in agents.iter_mut().zip(sites) {
        let status = a.wait_for(Duration::from_secs(60));
        assert!(status.is_some_and(|s| s.success()), "agent {s}: {status:?}");
    }
    let status = agg.wait_for(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "aggregator: {status:?}"
    );
    drop(broker);

    // The aggregator's final model and every agent's checkpoint.
    let spec: ModelSpec =
        serde_json::from_slice(&std::fs::read(d.join("init.safetensors.spec.json")).unwrap())
            .unwrap();
    let store = Store::open(&d.join("agg")).unwrap();
    let global = store.load_model(2, &spec.hash().0).unwrap();
    let states: Vec<_> = sites
        .iter()
        .map(|s| checkpoint::load(&d.join(s).join("model.safetensors"), &spec).unwrap())
        .collect();
    for st in &states {
        for (t, g) in spec.tensors.iter().zip(&global) {
            if !t.kind.is_bn() {
                assert_eq!(&st.get(&t.name).unwrap().data, g, "{}", t.name);
            }
        }
    }
    let bn = |s: &unifed_models::state::StateDict| s.filter(Select::BnStats);
    assert_ne!(bn(&states[0]), bn(&states[1]));
    assert_ne!(bn(&states[1]), bn(&states[2]));
    let audit = store.audit_entries().unwrap();
    assert_eq!(audit.iter().filter(|e| e.event == "accepted").count(), 6);
}
