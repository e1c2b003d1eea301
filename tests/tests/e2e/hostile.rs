//! An enrolled site turned hostile, under the aggregator's default config: the attacks of the
//! hostile-site issue that need a site's key, with the real binaries on loopback.

use std::time::Duration;
use unifed_aggregator::config::FederationConfig;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_protocol::auth::Keyring;
use unifed_protocol::encoding::{Encoding, encode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{LocalReport, RoundManifest, SiteExtras, SiteUpdate};
use unifed_protocol::topics::Topics;

const SITES: [&str; 3] = ["grey", "texture", "lowres"];
const LONG: Duration = Duration::from_secs(120);

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

/// The L2 norm of the tensors of `model` an update carries under local BN.
fn non_bn_norm(spec: &unifed_protocol::ModelSpec, model: &[Vec<f32>]) -> f64 {
    spec.tensors
        .iter()
        .zip(model)
        .filter(|(t, _)| !t.kind.is_bn())
        .flat_map(|(_, v)| v)
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt()
}

/// `rogue` (enrolled) answers round 1's manifest at once with minus the model, claiming the
/// most samples the default config allows (10^7): under the old defaults the next model was
/// 1.3e-5 times the first. The cohort bounds count its weight as the round's lower-median
/// claim and scale its delta to twice the lower-median norm (the defaults): the model keeps
/// most of its norm, the honest sites finish, and the audit says what was cut.
#[test]
fn a_site_claiming_the_most_samples_with_minus_the_model_does_not_zero_it() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    // Enrolled as a deployment with no tuning does: no site vouched for.
    fed.vouched = false;
    fed.sites = vec![
        "grey".into(),
        "texture".into(),
        "lowres".into(),
        "rogue".into(),
    ];
    // One round that waits for all four, so that the rogue's update is in it.
    fed.rounds = 1;
    fed.min_sites = 4;
    let spec = fed.spec();
    let initial = unifed_aggregator::service::load_model(&fed.model()).unwrap();
    let claim = unifed_aggregator::config::default_max_samples();
    let mut agg = fed.aggregator();
    let rt = runtime();
    let (sent_tx, sent_rx) = std::sync::mpsc::channel();
    let rogue = {
        let (fed, spec, initial) = (fed.clone(), spec.clone(), initial.tensors.clone());
        std::thread::spawn(move || {
            rt.block_on(async move {
                let topics = Topics::new(&id("e2e"));
                let aggregator = Keyring::aggregator(fed.key("aggregator").public());
                let (client, mut rx) = stranger(&fed, "rogue-attacker", vec![topics.manifest()]);
                while let Some(ev) = rx.recv().await {
                    let unifed_net::NetEvent::Message { payload, .. } = ev else {
                        continue;
                    };
                    let Ok(e) = aggregator.open(&payload, 1 << 20) else {
                        continue;
                    };
                    let Ok(m) = e.payload_as::<RoundManifest>() else {
                        continue;
                    };
                    if m.round != 1 {
                        continue;
                    }
                    let delta = spec
                        .tensors
                        .iter()
                        .zip(&initial)
                        .filter(|(t, _)| !t.kind.is_bn())
                        .map(|(t, v)| {
                            let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
                            let minus: Vec<f32> = v.iter().map(|x| -x).collect();
                            encode(&t.name, &shape, &minus, Encoding::F32, None)
                        })
                        .collect();
                    let u = SiteUpdate {
                        round: 1,
                        base_version: m.model_version,
                        samples: claim,
                        delta,
                        bn: vec![],
                        report: LocalReport::default(),
                        extras: SiteExtras::None,
                    };
                    let env = Envelope::new(
                        MessageKind::SiteUpdate,
                        id("e2e"),
                        id("rogue"),
                        1,
                        m.model_version,
                        spec.hash(),
                        &u,
                    )
                    .in_run(m.run);
                    let signed = fed.key("rogue").sign(&env);
                    let ok = client
                        .publish(
                            topics.update(&id("rogue")),
                            unifed_net::Qos::AtLeastOnce,
                            false,
                            signed,
                        )
                        .await
                        .is_ok();
                    let _ = sent_tx.send(ok);
                    break;
                }
                // Connected until the message has surely left (QoS 1 is acknowledged later).
                tokio::time::sleep(Duration::from_secs(3)).await;
                let _ = client.disconnect().await;
            })
        })
    };
    assert_eq!(sent_rx.recv_timeout(LONG), Ok(true), "rogue never sent");
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    rogue.join().unwrap();

    assert_eq!(fed.accepted(1), ["grey", "lowres", "rogue", "texture"]);
    let store = unifed_aggregator::store::Store::open(&fed.agg_dir()).unwrap();
    let v1 = store.load_model(1, &spec.hash().0).unwrap();
    let kept = non_bn_norm(&spec, &v1) / non_bn_norm(&spec, &initial.tensors);
    assert!(kept > 0.5, "round 1 left {kept} of the model's norm");
    let bounded: Vec<String> = fed
        .audit()
        .into_iter()
        .filter(|e| e.event == "bounded")
        .map(|e| format!("{} {}", e.site, e.detail))
        .collect();
    assert_eq!(bounded.len(), 1, "{bounded:?}");
    let counted =
        fed.train_samples as f64 * FederationConfig::new("e2e", 1, 1, vec![]).max_weight_of_median;
    let want = format!(
        "rogue weight counted as {} of {claim} claimed samples",
        counted.floor()
    );
    assert!(bounded[0].starts_with(&want), "{bounded:?}");
}

/// A stranger with a broker login and no key captures the first chunk of each of `grey`'s
/// uploads and, from round 3 on, replays those of the earlier rounds every 2 ms and right
/// behind grey's own chunks. Each opened a set of grey's own on the aggregator's disk (two at
/// most per site, the oldest dropped: a long upload could be evicted again and again). Chunk
/// sets are now taken only of the open round and its model version: the replays are dropped
/// before they take any of grey's share or disk, and every round folds all three sites.
#[test]
fn replayed_first_chunks_of_earlier_uploads_do_not_evict_a_sites_current_upload() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    // Updates of several chunks each.
    let packet = 32 << 10;
    let broker = Broker::start(BrokerKind::Embedded, packet);
    let mut fed = Fed::new(dir.path(), broker.port, packet);
    fed.rounds = 3;
    fed.deadline_secs = 40;
    let mut agg = fed.aggregator();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let attacker = {
        let (fed, stop) = (fed.clone(), stop.clone());
        std::thread::spawn(move || replay_first_chunks(&fed, "grey", stop, ready_tx))
    };
    ready_rx
        .recv_timeout(LONG)
        .expect("the attacker never connected");
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replays = attacker.join().unwrap();
    assert!(replays >= 2, "the replay did not run: {replays}");
    for round in 1..=3 {
        assert_eq!(
            fed.folded(round),
            ["grey", "lowres", "texture"],
            "round {round}"
        );
    }
    // The replays took no disk: no incomplete set is left in the upload folders.
    let mut left = Vec::new();
    let mut dirs = vec![fed.agg_dir().join("incoming")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                dirs.push(e.path());
            } else {
                left.push(e.path());
            }
        }
    }
    assert!(left.is_empty(), "replayed sets on disk: {left:?}");
    // The replayed first chunks of grey's closed rounds were answered from the rounds' record
    // (at most once a second each), as a re-send of them is.
    let answered = fed
        .audit()
        .into_iter()
        .filter(|e| {
            e.site == "grey"
                && e.event == "duplicate"
                && e.detail == "re-send after its round closed"
        })
        .count();
    assert!(answered >= 1, "no replay was answered from the record");
}

/// Captures the first chunk of each of `site`'s uploads and, once round 3 is announced,
/// replays those of earlier rounds right behind each chunk `site` sends and every 2 ms, until
/// `stop`; returns how many it published.
fn replay_first_chunks(
    fed: &Fed,
    site: &str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ready: std::sync::mpsc::Sender<()>,
) -> usize {
    use std::sync::atomic::Ordering;
    let rt = runtime();
    rt.block_on(async move {
        let topics = Topics::new(&id("e2e"));
        let (client, mut rx) = stranger(
            fed,
            "replayer",
            vec![topics.manifest(), topics.updates_filter()],
        );
        let mut firsts: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
        let mut round = 0;
        let mut replays = 0;
        let mut tick = tokio::time::interval(Duration::from_millis(2));
        // Publishes the captured first chunks of rounds before `round`; how many went out.
        let replay = |firsts: &std::collections::BTreeMap<u64, Vec<u8>>, round: u64| {
            let sends: Vec<_> = firsts
                .range(..round)
                .map(|(_, bytes)| {
                    client.publish(
                        topics.update(&id(site)),
                        unifed_net::Qos::AtLeastOnce,
                        false,
                        bytes.clone(),
                    )
                })
                .collect();
            async move {
                let mut n = 0;
                for s in sends {
                    n += usize::from(s.await.is_ok());
                }
                n
            }
        };
        while !stop.load(Ordering::Relaxed) {
            tokio::select! {
                ev = rx.recv() => match ev {
                    None => break,
                    Some(unifed_net::NetEvent::Connected) => {
                        let _ = ready.send(());
                    }
                    Some(unifed_net::NetEvent::Message { topic, payload }) => {
                        let Ok(env) = Envelope::decode(&payload) else { continue };
                        if topic == topics.manifest() {
                            round = round.max(env.round);
                        } else if topic == topics.update(&id(site))
                            && env.kind == MessageKind::UpdateChunk
                        {
                            if env
                                .payload_as::<unifed_protocol::messages::Chunk>()
                                .is_ok_and(|c| c.index == 0)
                            {
                                firsts.entry(env.round).or_insert_with(|| payload.to_vec());
                            }
                            // Right behind each chunk of the current upload.
                            if env.round >= 3 {
                                replays += replay(&firsts, env.round).await;
                            }
                        }
                    }
                    Some(_) => {}
                },
                _ = tick.tick() => {
                    if round >= 3 {
                        replays += replay(&firsts, round).await;
                    }
                }
            }
        }
        let _ = client.disconnect().await;
        replays
    })
}

/// Under a free-space floor above what the disk has, `grey`'s chunked upload was written to
/// `incoming/` chunk by chunk (an enrolled site could fill a small disk to 0 bytes that way)
/// and only the complete update was refused. Now a chunk set is begun only while the disk
/// keeps its floor with the whole set: the chunks are dropped before any byte is written.
#[test]
fn an_upload_that_would_take_the_disk_below_its_floor_is_dropped_before_it_is_written() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let packet = 32 << 10;
    let broker = Broker::start(BrokerKind::Embedded, packet);
    let mut fed = Fed::new(dir.path(), broker.port, packet);
    fed.sites = vec!["grey".into()];
    fed.min_sites = 1;
    fed.rounds = 1;
    fed.service_edit = Some(|cfg| {
        let free = unifed_aggregator::free_bytes(&cfg.data_dir)
            .or_else(|_| unifed_aggregator::free_bytes(&std::env::temp_dir()))
            .unwrap();
        cfg.federation.min_free_disk_bytes = free + (1 << 30);
    });
    let _agg = fed.aggregator();
    let _grey = fed.agent("grey");
    let log = dir.path().join("agg.log");
    let t0 = std::time::Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("update chunk dropped")
    {
        assert!(t0.elapsed() < LONG, "no chunk was dropped\n{}", fed.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("less than the floor"), "{text}");
    let incoming = fed.agg_dir().join("incoming");
    let mut dirs = vec![incoming];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            assert!(e.path().is_dir(), "{} was written", e.path().display());
            dirs.push(e.path());
        }
    }
}

/// Listens to the manifest topic until `stop` and returns the last manifest message seen
/// (its bytes, as published).
fn last_manifest(
    fed: &Fed,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seen: std::sync::mpsc::Sender<()>,
) -> Vec<u8> {
    let rt = runtime();
    rt.block_on(async move {
        let topics = Topics::new(&id("e2e"));
        let (client, mut rx) = stranger(fed, "recorder", vec![topics.manifest()]);
        let mut last = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(Some(unifed_net::NetEvent::Message { payload, .. })) =
                tokio::time::timeout(Duration::from_millis(50), rx.recv()).await
            {
                last = payload.to_vec();
                let _ = seen.send(());
            }
        }
        let _ = client.disconnect().await;
        last
    })
}

/// Publishes `bytes` on the manifest topic, retained, as a stranger with a broker login.
fn publish_retained_manifest(fed: &Fed, bytes: Vec<u8>) {
    let rt = runtime();
    rt.block_on(async move {
        let topics = Topics::new(&id("e2e"));
        let (client, _rx) = stranger(fed, "replayer", vec![]);
        client
            .publish(topics.manifest(), unifed_net::Qos::AtLeastOnce, true, bytes)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = client.disconnect().await;
    })
}

/// A federation run to its end, then started again with fresh data folders under the same id
/// and keys (another run). A stranger replays the first run's last manifest, retained, once
/// the second run has begun. It was validly signed and named a later round and version than the
/// second run's first manifest, so every agent dropped each real manifest as older than the one
/// it followed and the second run never closed a round. Now the second run's manifests are of
/// a later run: sites follow them and drop the replay, and the second run ends with every site.
#[test]
fn a_replayed_manifest_of_an_earlier_run_does_not_wedge_the_next_run() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.rounds = 1;
    fed.manifest_every_secs = 2;
    // The first run, recorded.
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (seen_tx, seen) = std::sync::mpsc::channel();
    let recorder = {
        let (fed, stop) = (fed.clone(), stop.clone());
        std::thread::spawn(move || last_manifest(&fed, stop, seen_tx))
    };
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    stop.store(true, Ordering::Relaxed);
    let earlier = recorder.join().unwrap();
    let first = unifed_protocol::Envelope::decode(&earlier).unwrap();
    assert_eq!((first.round, first.model_version), (1, 1));
    while seen.try_recv().is_ok() {}
    // The second run: fresh data folders, the same keys; the replay once it has begun.
    for d in [fed.agg_dir()]
        .into_iter()
        .chain(SITES.iter().map(|s| fed.site_dir(s)))
    {
        let _ = std::fs::remove_dir_all(d);
    }
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (seen_tx, seen) = std::sync::mpsc::channel();
    let watcher = {
        let (fed, stop) = (fed.clone(), stop.clone());
        std::thread::spawn(move || last_manifest(&fed, stop, seen_tx))
    };
    let mut agg = fed.aggregator();
    // The first run's retained manifest, then the second run's own.
    seen.recv_timeout(LONG).unwrap();
    seen.recv_timeout(LONG).unwrap();
    publish_retained_manifest(&fed, earlier);
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    assert_eq!(fed.folded(1), ["grey", "lowres", "texture"]);
    let grey = std::fs::read_to_string(dir.path().join("grey.log")).unwrap();
    assert!(
        grey.contains("of an earlier run than the one the site follows")
            || grey.contains("the federation moved to a later run")
            || grey.contains("joining the new run as a new site"),
        "the replay was never seen"
    );
}

/// A runtime for a client of the test's own.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A client of `fed`'s broker with MQTT client id `client_id` and no key, subscribed to
/// `subs` (inside a runtime).
fn stranger(
    fed: &Fed,
    client_id: &str,
    subs: Vec<String>,
) -> (
    unifed_net::Client,
    tokio::sync::mpsc::UnboundedReceiver<unifed_net::NetEvent>,
) {
    let opts = unifed_net::BrokerConfig::new("127.0.0.1", fed.port)
        .options(client_id, None)
        .unwrap();
    unifed_net::spawn_event_loop(opts, subs)
}
