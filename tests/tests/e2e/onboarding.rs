//! Onboarding a new site over MQTT with the real binaries: a two-site federation runs under a
//! BN sharing policy, then a never-seen site fetches the onboarding package, calibrates its BN
//! on its own unlabelled images and registers it (sealed with its site key); other devices of
//! the site fetch the calibrated model back, also after the aggregator restarts. From the
//! captured MQTT payloads the tests check what crossed the wire: under `none` no BN tensor of
//! any site, under `affine` no running statistic of any site.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, Packet, Proxy, binary, serial};
use unifed_models::checkpoint;
use unifed_models::state::{Select, StateDict};
use unifed_protocol::ModelSpec;
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::encoding::decode;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::messages::{BnSharing, Chunk, SiteUpdate};

const SITES: [&str; 2] = ["grey", "texture"];
const NEW: &str = "morpho";

/// Runs `unifed-agent` with `args`; returns (success, stdout + stderr).
fn agent(args: &[&str]) -> (bool, String) {
    let out = Command::new(binary("unifed-agent"))
        .args(["--threads", "1"])
        .args(args)
        .output()
        .expect("running unifed-agent");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn load(p: &Path, spec: &ModelSpec) -> StateDict {
    checkpoint::load(p, spec).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every logical payload that crossed the wire: each message's raw bytes, and each chunk set
/// (updates, model and package chunks, registry entries) put back together.
fn payloads(packets: &[Packet]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = packets.iter().map(|p| p.payload.clone()).collect();
    let mut sets: BTreeMap<String, Reassembler> = BTreeMap::new();
    for p in packets {
        let Ok(env) = Envelope::decode(&p.payload) else {
            continue;
        };
        out.push(env.payload.clone());
        if matches!(
            env.kind,
            MessageKind::UpdateChunk
                | MessageKind::ModelChunk
                | MessageKind::RegistryPut
                | MessageKind::RegistryEntry
        ) {
            let c: Chunk = env.payload_as().unwrap();
            let r = sets
                .entry(p.topic.clone())
                .or_insert_with(|| Reassembler::new(u64::MAX, 1 << 30));
            if let Ok(Some(whole)) = r.insert(c.as_ref(), 0) {
                if let Ok(inner) = Envelope::decode(&whole) {
                    out.push(inner.payload);
                }
                out.push(whole);
            }
        }
    }
    out
}

/// Every update the sites sent, reassembled.
fn updates(packets: &[Packet]) -> Vec<(String, SiteUpdate)> {
    let mut r = Reassembler::new(u64::MAX, 1 << 30);
    let mut out = Vec::new();
    for p in packets
        .iter()
        .filter(|p| p.to_broker && p.topic.starts_with("unifed/v1/e2e/update/"))
    {
        let site = p.topic.rsplit('/').next().unwrap().to_string();
        let env = Envelope::decode(&p.payload).unwrap();
        let whole = match env.kind {
            MessageKind::UpdateChunk => r
                .insert(env.payload_as::<Chunk>().unwrap().as_ref(), 0)
                .unwrap()
                .map(|b| Envelope::decode(&b).unwrap()),
            _ => Some(env),
        };
        if let Some(e) = whole {
            out.push((site, e.payload_as().unwrap()));
        }
    }
    out
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Asserts that no tensor of `states` selected by `select` appears, as raw bytes, in any
/// payload on the wire.
fn assert_absent(payloads: &[Vec<u8>], states: &[(&str, &StateDict)], select: Select) {
    for (who, st) in states {
        for t in st.tensors.iter().filter(|t| select.keeps(t.kind)) {
            let needle = bytes_of(&t.data);
            let found = payloads
                .iter()
                .any(|p| p.windows(needle.len()).any(|w| w == needle.as_slice()));
            assert!(!found, "{who}'s `{}` is on the wire in plaintext", t.name);
        }
    }
}

struct Run {
    _dir: tempfile::TempDir,
    fed: Fed,
    broker: Broker,
    proxy: Proxy,
    agg: unifed_e2e::Guard,
}

/// A two-site federation under `sharing`, finished, with its aggregator still serving.
fn federation(sharing: BnSharing, rounds: u64) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 32 << 10);
    let proxy = Proxy::start(broker.port);
    let mut fed = Fed::new(dir.path(), proxy.port, 32 << 10);
    // The new site is enrolled before it onboards: only enrolled sites are served.
    fed.sites = vec![SITES[0].into(), SITES[1].into(), NEW.into()];
    fed.credentials = broker.credentials.clone();
    fed.bn_sharing = sharing;
    fed.rounds = rounds;
    fed.min_sites = SITES.len();
    fed.linger_secs = 600;
    let agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, Duration::from_secs(300));
    }
    Run {
        _dir: dir,
        fed,
        broker,
        proxy,
        agg,
    }
}

#[test]
fn under_affine_a_new_site_calibrates_registers_sealed_and_its_other_devices_fetch_it() {
    let _one = serial();
    let mut run = federation(BnSharing::Affine, 2);
    let fed = run.fed.clone();
    let spec = fed.spec();
    let key = fed.dir.join("morpho.key");
    let (ok, out) = agent(&["keygen", "--out", path(&key)]);
    assert!(ok, "{out}");

    // The new site: package, calibration on its own unlabelled images, registration.
    let cfg = fed.device_config(NEW, "morpho-a", Some(&key));
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg)]);
    assert!(ok, "{out}\n{}", fed.logs());
    assert!(
        out.contains("onboarding package of model v2 (BN sharing `affine`, BN of grey, texture"),
        "{out}"
    );
    assert!(
        out.contains("registered the calibrated BN of model v2"),
        "{out}"
    );
    assert!(out.contains("sealed with the site key"), "{out}");
    let stored_path = fed.site_dir("morpho-a").join("calibrated/v2.safetensors");
    let stored = load(&stored_path, &spec);

    // The package's BN affine is the sample-weighted mean of the sites' (their BN after the
    // last round is what their checkpoints hold); calibration kept it and changed only the
    // statistics. The non-BN weights are the federation's.
    let sites: Vec<StateDict> = SITES
        .iter()
        .map(|s| load(&fed.site_dir(s).join("model.safetensors"), &spec))
        .collect();
    let samples = fed.train_samples as f64;
    for (k, t) in stored.tensors.iter().enumerate() {
        if t.kind.is_bn_affine() {
            let want: Vec<f32> = (0..t.data.len())
                .map(|i| {
                    let s: f64 = sites
                        .iter()
                        .map(|s| samples * s.tensors[k].data[i] as f64)
                        .sum();
                    (s / (samples * sites.len() as f64)) as f32
                })
                .collect();
            assert_eq!(t.data, want, "package affine `{}`", t.name);
        } else if !t.kind.is_bn() {
            assert_eq!(t.data, sites[0].tensors[k].data, "non-BN `{}`", t.name);
        }
    }
    let init = load(&fed.model(), &spec);
    assert_ne!(
        stored.filter(Select::BnStats),
        init.filter(Select::BnStats),
        "calibration re-estimated the statistics"
    );

    // Another device of the site fetches the calibrated model: equal to the stored one.
    let cfg_b = fed.device_config(NEW, "morpho-b", Some(&key));
    let (ok, out) = agent(&["fetch-calibrated", "--config", path(&cfg_b)]);
    assert!(ok, "{out}\n{}", fed.logs());
    let fetched = load(
        &fed.site_dir("morpho-b").join("calibrated/v2.safetensors"),
        &spec,
    );
    assert_eq!(fetched, stored);

    // The registry survives an aggregator restart.
    run.agg.kill();
    run.agg = fed.aggregator();
    let cfg_c = fed.device_config(NEW, "morpho-c", Some(&key));
    let (ok, out) = agent(&[
        "fetch-calibrated",
        "--config",
        path(&cfg_c),
        "--version",
        "2",
    ]);
    assert!(ok, "{out}\n{}", fed.logs());
    let again = load(
        &fed.site_dir("morpho-c").join("calibrated/v2.safetensors"),
        &spec,
    );
    assert_eq!(again, stored);

    // A device with another key cannot open the entry.
    let other = fed.dir.join("other.key");
    assert!(agent(&["keygen", "--out", path(&other)]).0);
    let cfg_d = fed.device_config(NEW, "morpho-d", Some(&other));
    let (ok, out) = agent(&["fetch-calibrated", "--config", path(&cfg_d)]);
    assert!(
        !ok && out.contains("does not open with this site key"),
        "{out}"
    );

    // On the wire: every update carried exactly the sites' BN weight and bias besides its
    // non-BN deltas, and no running statistic of any site travelled in plaintext.
    let packets = run.proxy.packets();
    let ups = updates(&packets);
    assert_eq!(ups.len(), SITES.len() * fed.rounds as usize);
    let affine = unifed_e2e::bn_affine_names(&spec);
    for (site, u) in &ups {
        let kind = |n: &str| spec.tensor(n).unwrap().kind;
        assert!(u.delta.iter().all(|t| !kind(&t.name).is_bn()), "{site}");
        let names: Vec<&str> = u.bn.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, affine, "{site}: shared BN tensors");
        assert!(u.bn.iter().all(|t| decode(t).is_ok()));
    }
    let all = payloads(&packets);
    let named: Vec<(&str, &StateDict)> = SITES
        .iter()
        .copied()
        .zip(&sites)
        .chain([(NEW, &stored)])
        .collect();
    assert_absent(&all, &named, Select::BnStats);
    // The search does find what was shared: the sites' last-round BN weight and bias.
    for (s, st) in SITES.iter().zip(&sites) {
        for t in st.tensors.iter().filter(|t| t.kind.is_bn_affine()) {
            let needle = bytes_of(&t.data);
            assert!(
                all.iter()
                    .any(|p| p.windows(needle.len()).any(|w| w == needle.as_slice())),
                "{s}'s shared `{}` not found on the wire",
                t.name
            );
        }
    }
    drop(run.broker);
}

#[test]
fn under_none_no_bn_tensor_of_any_site_is_on_the_wire_and_bad_requests_are_named() {
    let _one = serial();
    let run = federation(BnSharing::None, 1);
    let fed = run.fed.clone();
    let spec = fed.spec();

    // Without a site key the calibrated BN cannot be registered under `none`.
    let cfg = fed.device_config(NEW, "morpho-a", None);
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg)]);
    assert!(
        !ok && out.contains("site_key") && out.contains("--no-register"),
        "{out}"
    );
    // An unknown model version is refused with the versions the aggregator holds.
    let key = fed.dir.join("morpho.key");
    assert!(agent(&["keygen", "--out", path(&key)]).0);
    let cfg = fed.device_config(NEW, "morpho-a", Some(&key));
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg), "--version", "9"]);
    assert!(
        !ok && out.contains("no model version 9 (it holds 0, 1)"),
        "{out}"
    );
    // Nothing registered yet.
    let (ok, out) = agent(&["fetch-calibrated", "--config", path(&cfg)]);
    assert!(
        !ok && out.contains("no calibrated model of this site is registered"),
        "{out}"
    );

    let (ok, out) = agent(&["calibrate", "--config", path(&cfg)]);
    assert!(ok, "{out}\n{}", fed.logs());
    assert!(out.contains("model v1 (BN sharing `none`;"), "{out}");
    let stored = load(
        &fed.site_dir("morpho-a").join("calibrated/v1.safetensors"),
        &spec,
    );
    // The package's BN is the global model's own (never trained): the affine part is the
    // initial model's.
    let init = load(&fed.model(), &spec);
    assert_eq!(
        stored.filter(Select::BnAffine),
        init.filter(Select::BnAffine)
    );

    let packets = run.proxy.packets();
    for (site, u) in updates(&packets) {
        assert!(u.bn.is_empty(), "{site} shared BN under none");
    }
    let sites: Vec<StateDict> = SITES
        .iter()
        .map(|s| load(&fed.site_dir(s).join("model.safetensors"), &spec))
        .collect();
    let named: Vec<(&str, &StateDict)> = SITES.iter().copied().zip(&sites).collect();
    assert_absent(&payloads(&packets), &named, Select::Bn);
    assert_absent(&payloads(&packets), &[(NEW, &stored)], Select::BnStats);
    drop(run.broker);
}

/// Flips one byte in the middle of the file at `p`.
fn flip(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x40;
    std::fs::write(p, b).unwrap();
}

#[test]
fn a_damaged_kept_file_ends_its_request_not_the_aggregator() {
    let _one = serial();
    let mut run = federation(BnSharing::None, 2);
    let fed = run.fed.clone();
    let alive = |run: &mut Run| run.agg.0.try_wait().unwrap().is_none();
    let key = fed.dir.join("morpho.key");
    assert!(agent(&["keygen", "--out", path(&key)]).0);
    let cfg = fed.device_config(NEW, "morpho-a", Some(&key));
    // A byte of the kept model v1 flips on the aggregator's disk: asking for its package is
    // refused by name, and the aggregator goes on serving.
    flip(&fed.agg_dir().join("models/v1.bin"));
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg), "--version", "1"]);
    assert!(
        !ok && out.contains("could not read its copy of model version 1"),
        "{out}\n{}",
        fed.logs()
    );
    assert!(alive(&mut run), "{}", fed.logs());
    // Set aside, v1 is no longer offered; the current version is served and registered.
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg), "--version", "1"]);
    assert!(
        !ok && out.contains("no model version 1 (it holds 0, 2)"),
        "{out}"
    );
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg)]);
    assert!(ok, "{out}\n{}", fed.logs());
    // Its registry entry damaged: fetching it is refused, and the aggregator goes on.
    let entry = fed.agg_dir().join(format!("registry/{NEW}/v2.entry"));
    flip(&entry);
    let (ok, out) = agent(&["fetch-calibrated", "--config", path(&cfg)]);
    assert!(
        !ok && out.contains("could not read its copy of model version 2"),
        "{out}\n{}",
        fed.logs()
    );
    assert!(alive(&mut run), "{}", fed.logs());
    let mut aside: Vec<String> = std::fs::read_dir(fed.agg_dir().join("corrupt"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    aside.sort();
    assert_eq!(aside.len(), 2, "{aside:?}");
    assert!(aside[0].starts_with("models-v1.bin-"), "{aside:?}");
    assert!(
        aside[1].starts_with(&format!("registry-{NEW}-v2.entry-")),
        "{aside:?}"
    );
    let damaged = fed
        .audit()
        .into_iter()
        .filter(|e| e.event == "damaged-file")
        .count();
    assert_eq!(damaged, 2);
    drop(run.broker);
}

/// Registry uploads have a share per site: an enrolled site (grey's key) that keeps opening
/// registry entries of the largest size and never finishes them, while a new site registers,
/// evicted the new site's entry from the one reassembler every site's `RegistryPut` shared.
/// Now each site reassembles its own (two entries at once): the new site registers its
/// calibrated model however many sets grey opens meanwhile.
#[test]
fn unfinished_registry_entries_of_one_site_leave_others_room_to_register() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let _one = serial();
    let run = federation(BnSharing::Affine, 2);
    let fed = run.fed.clone();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flood = {
        let (fed, stop) = (fed.clone(), stop.clone());
        std::thread::spawn(move || open_registry_sets(&fed, "grey", &stop))
    };
    let key = fed.dir.join("morpho.key");
    let (ok, out) = agent(&["keygen", "--out", path(&key)]);
    assert!(ok, "{out}");
    let cfg = fed.device_config(NEW, "morpho-a", Some(&key));
    let (ok, out) = agent(&["calibrate", "--config", path(&cfg)]);
    stop.store(true, Ordering::Relaxed);
    let sent = flood.join().unwrap();
    assert!(sent >= 40, "the flood did not run: {sent}");
    assert!(ok, "{out}\n{}", fed.logs());
    assert!(
        out.contains("registered the calibrated BN of model v2"),
        "{out}"
    );
    drop(run);
}

/// Publishes, signed by `site`, the first chunk of ever new registry entries of the largest
/// size, one every millisecond until `stop`; returns how many.
fn open_registry_sets(fed: &Fed, site: &str, stop: &std::sync::atomic::AtomicBool) -> usize {
    use unifed_protocol::ids::Id;
    use unifed_protocol::messages::RoundManifest;
    let spec = fed.spec();
    let max_entry = unifed_protocol::messages::max_registry_entry_bytes(&spec);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let topics = unifed_protocol::topics::Topics::new(&Id::new("e2e").unwrap());
        let (client, mut rx) = unifed_net::spawn_event_loop(
            fed.broker().options("flooder", None).unwrap(),
            vec![topics.manifest()],
        );
        // The run, from the retained manifest.
        let m = loop {
            match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
                Ok(Some(unifed_net::NetEvent::Message { payload, .. })) => {
                    let e = Envelope::decode(&payload).unwrap();
                    break e.payload_as::<RoundManifest>().unwrap();
                }
                Ok(Some(_)) => {}
                other => panic!("no manifest: {other:?}"),
            }
        };
        let key = fed.key(site);
        let topic = topics.onboard_request(&Id::new(site).unwrap());
        let mut sent = 0usize;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut entry = vec![0u8; max_entry];
            entry[..8].copy_from_slice(&(sent as u64).to_le_bytes());
            let first = unifed_protocol::chunking::split(&entry, 16 << 10).swap_remove(0);
            let env = Envelope::new(
                MessageKind::RegistryPut,
                Id::new("e2e").unwrap(),
                Id::new(site).unwrap(),
                0,
                m.model_version,
                spec.hash(),
                &first,
            )
            .in_run(m.run);
            let bytes = key.sign(&env);
            if client
                .publish(topic.clone(), unifed_net::Qos::AtLeastOnce, false, bytes)
                .await
                .is_ok()
            {
                sent += 1;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let _ = client.disconnect().await;
        sent
    })
}
