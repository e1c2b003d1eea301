//! Faults with the real binaries: an agent killed mid-federation and restarted, the aggregator
//! killed between and during rounds, the broker killed mid-round, and a late joiner that gets
//! a model larger than the packet limit in chunks. Processes are killed with SIGKILL (no
//! clean-up, no MQTT DISCONNECT). Packets are limited to 32 KiB so that models and updates go in
//! chunks.

use std::sync::OnceLock;
use std::time::Duration;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, Erased, Guard, Proxy, serial};
use unifed_models::checkpoint;
use unifed_net::report::Report;
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::encoding::decode;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::messages::{BnSharing, Chunk, RoundManifest, ServerBroadcast, SiteUpdate};

/// A report that `round`'s update was accepted.
fn accepted(round: u64) -> impl Fn(&Report) -> bool {
    move |r| matches!(r, Report::Answered { round: a, accepted: true } if *a == round)
}

/// A report of training `round`.
fn training(round: u64) -> impl Fn(&Report) -> bool {
    move |r| matches!(r, Report::Training { round: t, .. } if *t == round)
}

/// The aggregator's report that `round` closed.
fn closed(round: u64) -> impl Fn(&Report) -> bool {
    move |r| matches!(r, Report::RoundClosed { round: c, .. } if *c == round)
}

const SITES: [&str; 3] = ["grey", "texture", "lowres"];
const PACKET: usize = 32 << 10;
const LONG: Duration = Duration::from_secs(240);

fn wait_ok(g: &mut Guard, what: &str, fed: &Fed) {
    fed.wait_ok(g, what, LONG);
}

fn final_model(fed: &Fed) -> Vec<Vec<f32>> {
    let store = Store::open(&fed.agg_dir()).unwrap();
    store.load_model(fed.rounds, &fed.spec().hash().0).unwrap()
}

/// Every agent's non-BN weights equal the aggregator's final model.
fn agents_hold(fed: &Fed, sites: &[&str], global: &[Vec<f32>]) {
    let spec = fed.spec();
    for s in sites {
        let st = checkpoint::load(&fed.site_dir(s).join("model.safetensors"), &spec).unwrap();
        for (t, g) in spec.tensors.iter().zip(global) {
            if !t.kind.is_bn() {
                assert_eq!(&st.get(&t.name).unwrap().data, g, "{s}: {}", t.name);
            }
        }
    }
}

/// The final model of an uninterrupted run of the federation the aggregator and broker tests
/// disturb (computed once).
fn reference() -> &'static Vec<Vec<f32>> {
    static REF: OnceLock<Vec<Vec<f32>>> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::start(BrokerKind::Embedded, PACKET);
        let fed = fed_for(dir.path(), broker.port);
        let mut agg = fed.aggregator();
        let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
        for (a, s) in agents.iter_mut().zip(SITES) {
            wait_ok(a, s, &fed);
        }
        wait_ok(&mut agg, "aggregator", &fed);
        final_model(&fed)
    })
}

/// The faults' federation: `lowres` trains on more images than the others, so it reports
/// last and a round is still open after the first two updates.
fn fed_for(dir: &std::path::Path, port: u16) -> Fed {
    let mut fed = Fed::new(dir, port, PACKET);
    fed.resend_secs = 2;
    fed.samples.insert("lowres".into(), 743);
    fed
}

#[test]
fn an_agent_killed_mid_federation_is_left_out_at_the_deadline_and_resumes_after_restart() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let mut fed = fed_for(dir.path(), broker.port);
    fed.deadline_secs = 20;
    let mut agg = fed.aggregator();
    let mut grey = fed.agent("grey");
    let mut texture = fed.agent("texture");
    let mut lowres = fed.agent("lowres");
    // Killed as soon as round 1 has its update (it may have begun training round 2 by then: a
    // model comes down in well under a second): it is dead while round 2 runs.
    assert!(
        fed.wait_report(&["lowres"], accepted(1), LONG).is_some(),
        "{}",
        fed.logs()
    );
    lowres.kill();
    let round_2 =
        |r: &Report| matches!(r, Report::RoundClosed { round: 2, sites, .. } if sites.len() == 2);
    assert!(
        fed.wait_report(&["agg"], round_2, LONG).is_some(),
        "round 2 must close at its deadline with the two live sites\n{}",
        fed.logs()
    );
    // Restarted: it resumes from its checkpoint and trains round 3. Its log goes on after the
    // killed agent's.
    let killed = fed.reports("lowres").len();
    let mut lowres = fed.agent("lowres");
    for (g, s) in [
        (&mut grey, "grey"),
        (&mut texture, "texture"),
        (&mut lowres, "lowres"),
    ] {
        wait_ok(g, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    assert_eq!(fed.accepted(1), ["grey", "lowres", "texture"]);
    assert_eq!(fed.accepted(2), ["grey", "texture"]);
    assert_eq!(fed.accepted(3), ["grey", "lowres", "texture"]);
    agents_hold(&fed, &SITES, &final_model(&fed));
    let restarted = fed.reports("lowres").split_off(killed);
    let trained = |round: u64| {
        restarted
            .iter()
            .any(|r| matches!(r, Report::Training { round: t, .. } if *t == round))
    };
    assert!(
        !trained(2),
        "the restarted lowres trained round 2, which closed without it"
    );
    assert!(trained(3), "the restarted lowres did not train round 3");
    assert!(!trained(1), "the restarted agent trained round 1 again");
}

#[test]
fn sigterm_mid_round_stops_an_agent_with_its_checkpoint_and_the_restart_ends_as_if_uninterrupted() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port);
    let mut agg = fed.aggregator();
    let mut grey = fed.agent("grey");
    // A second aggregator on the aggregator's data folder, and a second agent on grey's state
    // folder, are refused at start and name the holder; the first ones go on undisturbed (the
    // final model below is an uninterrupted run's). Checked before the other sites start, so no
    // round can close meanwhile.
    let config = fed.aggregator_config();
    second_is_refused(
        "unifed-aggregator",
        &["serve", "--config", &config.to_string_lossy()],
        &fed.agg_dir(),
        &agg,
    );
    let config = fed.dir.join("grey.toml");
    second_is_refused(
        "unifed-agent",
        &["train", "--config", &config.to_string_lossy()],
        &fed.site_dir("grey"),
        &grey,
    );
    let mut texture = fed.agent("texture");
    let mut lowres = fed.agent("lowres");
    // lowres trains on 743 images: stopped while it trains round 2.
    assert!(
        fed.wait_report(&["lowres"], training(2), LONG).is_some(),
        "{}",
        fed.logs()
    );
    lowres.terminate();
    let st = lowres
        .wait_for(Duration::from_secs(30))
        .expect("the agent did not stop on SIGTERM");
    assert!(
        st.success(),
        "SIGTERM is a clean stop, not a failure: {st:?}"
    );
    let log = std::fs::read_to_string(fed.dir.join("lowres.log")).unwrap();
    assert!(log.contains("stopping on request"), "{log}");
    // What it left is a whole checkpoint, no temp files: round 1's outcome (its model trained
    // from v0, and the answer). Model v1, which round 2 trains from, is persisted only with
    // round 2's outcome, so the restart fetches it again.
    let site = fed.site_dir("lowres");
    checkpoint::load(&site.join("model.safetensors"), &fed.spec()).unwrap();
    let progress: serde_json::Value =
        serde_json::from_slice(&std::fs::read(site.join("progress.json")).unwrap()).unwrap();
    assert_eq!(progress["applied_version"], 0);
    assert_eq!(progress["answered_rounds"], serde_json::json!([1]));
    let leftovers: Vec<_> = std::fs::read_dir(&site)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // Restarted, it fetches v1, trains round 2 again and the federation ends with the model of
    // an uninterrupted run.
    let mut lowres = fed.agent("lowres");
    // A second request while an agent stops ends it at once (status 130); what it leaves is a
    // checkpoint like a killed agent's, and the restarted grey goes on from it.
    let before = std::fs::read_to_string(fed.dir.join("grey.log"))
        .unwrap()
        .len();
    grey.terminate();
    let asked = (0..3000).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        std::fs::read_to_string(fed.dir.join("grey.log")).unwrap()[before..]
            .contains("unifed-agent: stopping; ask again")
    });
    assert!(asked, "{}", fed.logs());
    grey.terminate();
    let st = grey
        .wait_for(Duration::from_secs(30))
        .expect("grey did not stop");
    assert_eq!(st.code(), Some(130), "{}", fed.logs());
    let log = std::fs::read_to_string(fed.dir.join("grey.log")).unwrap();
    assert!(
        log[before..].contains("stopping now, on a second request"),
        "{log}"
    );
    let mut grey = fed.agent("grey");
    for (g, s) in [
        (&mut grey, "grey"),
        (&mut texture, "texture"),
        (&mut lowres, "lowres"),
    ] {
        wait_ok(g, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    assert_eq!(final_model(&fed), want);
    assert_eq!(fed.accepted(2), ["grey", "lowres", "texture"]);
}

#[test]
fn a_service_agent_trains_two_runs_one_after_another_and_waits_out_an_aggregator_restart() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port);
    let mut agg = fed.aggregator();
    let mut agents: Vec<Guard> = SITES.iter().map(|s| fed.service(s)).collect();
    // The first run ends: the aggregator stops once every site said it holds the final model,
    // and the agents stay up.
    wait_ok(&mut agg, "aggregator", &fed);
    assert_eq!(final_model(&fed), want);
    std::thread::sleep(Duration::from_secs(1));
    for (a, s) in agents.iter_mut().zip(SITES) {
        assert!(
            matches!(a.0.try_wait(), Ok(None)),
            "{s} ended\n{}",
            fed.logs()
        );
    }
    let first_run = Store::open(&fed.agg_dir())
        .unwrap()
        .load_state()
        .unwrap()
        .unwrap()
        .run;
    let first_run = first_run.expect("a run").to_string();
    // A new run of the federation: its state put aside by the command, a fresh one served.
    let config = fed.aggregator_config();
    let out = std::process::Command::new(unifed_e2e::binary("unifed-aggregator"))
        .args(["new-run", "--config", &config.to_string_lossy()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let aside = fed.agg_dir().join("runs").join(&first_run);
    assert!(aside.join("state.json").is_file(), "{}", aside.display());
    let before = fed.reports("lowres").len();
    let mut agg = fed.aggregator();
    // Killed while lowres trains round 2 of the new run, down for 3 s, then back: the agents
    // wait it out without a restart of their own.
    fed.wait_each(&["lowres"], &[before], training(2), LONG);
    agg.kill();
    std::thread::sleep(Duration::from_secs(3));
    let mut agg = fed.aggregator();
    wait_ok(&mut agg, "aggregator", &fed);
    // The second run ends with an uninterrupted run's model, held by every site; each site's
    // state of the first run is in runs/<run>/, its model the first run's final one.
    assert_eq!(final_model(&fed), want);
    agents_hold(&fed, &SITES, &want);
    let spec = fed.spec();
    for s in SITES {
        let old = fed
            .site_dir(s)
            .join("runs")
            .join(&first_run)
            .join("model.safetensors");
        let st = checkpoint::load(&old, &spec).unwrap();
        for (t, g) in spec.tensors.iter().zip(&want) {
            if !t.kind.is_bn() {
                assert_eq!(&st.get(&t.name).unwrap().data, g, "{s}: {}", t.name);
            }
        }
        let log = std::fs::read_to_string(fed.dir.join(format!("{s}.log"))).unwrap();
        assert!(log.contains("joining the new run as a new site"), "{log}");
    }
    std::thread::sleep(Duration::from_secs(1));
    for (a, s) in agents.iter_mut().zip(SITES) {
        assert!(
            matches!(a.0.try_wait(), Ok(None)),
            "{s} ended\n{}",
            fed.logs()
        );
        a.terminate();
        let st = a
            .wait_for(Duration::from_secs(30))
            .expect("stops on SIGTERM");
        assert!(st.success(), "{s}: {st:?}");
    }
}

#[test]
fn raising_rounds_after_a_federation_finished_goes_on_from_its_final_model() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let mut fed = fed_for(dir.path(), broker.port);
    fed.rounds = 2;
    let mut agg = fed.aggregator();
    let mut agents: Vec<Guard> = SITES.iter().map(|s| fed.service(s)).collect();
    wait_ok(&mut agg, "aggregator", &fed);
    // Served again as it is, a finished federation says so and how to go on.
    let mut again = fed.aggregator();
    wait_ok(&mut again, "aggregator", &fed);
    let log = std::fs::read_to_string(fed.dir.join("agg.log")).unwrap();
    assert!(
        log.contains("finished at round 2") && log.contains("Raise `rounds` above 2"),
        "{log}"
    );
    // Three rounds asked for: the same run goes on with round 3, and ends where a federation of
    // three rounds does.
    fed.rounds = 3;
    let mut agg = fed.aggregator();
    wait_ok(&mut agg, "aggregator", &fed);
    assert!(final_model(&fed) == want, "{}", fed.logs());
    agents_hold(&fed, &SITES, &want);
    assert!(
        fed.audit()
            .iter()
            .any(|e| e.event == "extended" && e.round == 3),
        "{:?}",
        fed.audit()
    );
    // `reset` is refused while the agent runs, and afterwards puts the site's state aside
    // under the run it was of.
    let reset = || {
        std::process::Command::new(unifed_e2e::binary("unifed-agent"))
            .args([
                "reset",
                "--config",
                &fed.dir.join("grey.toml").to_string_lossy(),
            ])
            .output()
            .unwrap()
    };
    let refused = reset();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("in use by another unifed-agent"));
    for (a, s) in agents.iter_mut().zip(SITES) {
        assert!(
            matches!(a.0.try_wait(), Ok(None)),
            "{s} ended\n{}",
            fed.logs()
        );
        a.terminate();
        assert!(
            a.wait_for(Duration::from_secs(30))
                .is_some_and(|st| st.success())
        );
    }
    assert!(reset().status.success());
    let run = Store::open(&fed.agg_dir())
        .unwrap()
        .load_state()
        .unwrap()
        .unwrap()
        .run;
    let aside = fed
        .site_dir("grey")
        .join("runs")
        .join(run.unwrap().to_string());
    assert!(
        aside.join("checkpoint.bin").is_file(),
        "{}",
        aside.display()
    );
    assert!(!fed.site_dir("grey").join("checkpoint.bin").exists());
}

/// Starts `binary args` once `first` holds the state folder `folder`: it must end at once with
/// a failure that names `first`'s pid, and leave `first` running.
fn second_is_refused(binary: &str, args: &[&str], folder: &std::path::Path, first: &Guard) {
    let pid = first.0.id();
    let held = (0..3000).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        std::fs::read_to_string(folder.join("lock")).is_ok_and(|t| t.trim() == pid.to_string())
    });
    assert!(held, "{binary} (pid {pid}) never took {}", folder.display());
    let log = folder.with_extension(format!("second-{binary}.log"));
    let mut second = Guard(
        std::process::Command::new(unifed_e2e::binary(binary))
            .args(args)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let st = second
        .wait_for(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("a second {binary} on one state folder kept running"));
    let err = std::fs::read_to_string(log.with_extension("err")).unwrap();
    assert!(!st.success(), "{binary}: {st:?}\n{err}");
    let want = format!("in use by another {binary} (pid {pid})");
    assert!(err.contains(&want), "{binary}: {err}");
}

/// Publishes junk on every topic the agents and the aggregator subscribe to, every 50 ms, until
/// `stop` is set: random bytes, truncated envelopes, valid headers with garbage payloads (also
/// retained), another protocol version, another federation's and another sender's manifests,
/// chunks whose count or hash contradict the current manifest, answers to other bytes, junk
/// updates, chunk and onboarding requests. Returns how many messages it sent.
fn noise(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    started: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> usize {
    use unifed_protocol::chunking::payload_hash;
    use unifed_protocol::ids::Id;
    use unifed_protocol::messages::{Answer, ChunkRequest, Payload, UpdateAnswer};
    use unifed_protocol::topics::Topics;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let id = |s: &str| Id::new(s).unwrap();
        let topics = Topics::new(&id("e2e"));
        let opts = unifed_net::BrokerConfig::new("127.0.0.1", port)
            .options("noise", None)
            .unwrap();
        let (client, mut rx) = unifed_net::spawn_event_loop(opts, vec![topics.manifest()]);
        let mut current: Option<(RoundManifest, unifed_protocol::SpecHash)> = None;
        let mut sent = 0;
        let mut k = 0u32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            while let Ok(ev) = rx.try_recv() {
                if let unifed_net::NetEvent::Message { payload, .. } = ev
                    && let Ok(env) = Envelope::decode(&payload)
                    && env.sender.as_str() == "aggregator"
                    && let Ok(m) = env.payload_as::<RoundManifest>()
                {
                    current = Some((m, env.spec_hash));
                }
            }
            k += 1;
            let random: Vec<u8> = (0..97u32)
                .map(|i| ((i * 131 + k * 17) % 251) as u8)
                .collect();
            let mut junk: Vec<(String, Vec<u8>, bool)> = Vec::new();
            let mut all = |t: String, retain: bool, extra: &[Vec<u8>]| {
                for p in [random.clone(), random[..5].to_vec()]
                    .into_iter()
                    .chain(extra.iter().cloned())
                {
                    junk.push((t.clone(), p, retain));
                }
            };
            if let Some((m, hash)) = &current {
                let env = |fed: &str, sender: &str, kind, payload: &dyn Erased| {
                    Envelope {
                        kind,
                        federation: id(fed),
                        sender: id(sender),
                        round: m.round,
                        model_version: m.model_version,
                        spec_hash: *hash,
                        run: m.run,
                        payload: payload.bytes(),
                        signature: None,
                    }
                    .encode()
                };
                let real = env("e2e", "aggregator", MessageKind::RoundManifest, m);
                let truncated = real[..real.len() / 2].to_vec();
                let mut garbage = Envelope::decode(&real).unwrap();
                garbage.payload = random.clone();
                let mut old_version = real.clone();
                old_version[4..6].copy_from_slice(&1u16.to_le_bytes());
                let mut newer = m.clone();
                newer.round += 1;
                newer.model_version += 1;
                newer.finished = true;
                let manifests = [
                    truncated.clone(),
                    garbage.encode(),
                    old_version,
                    env("other", "aggregator", MessageKind::RoundManifest, &newer),
                    env("e2e", "grey", MessageKind::RoundManifest, &newer),
                ];
                all(topics.manifest(), false, &manifests);
                if k.is_multiple_of(10) || started.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                    all(topics.manifest(), true, &[garbage.encode()]);
                }
                for site in SITES {
                    let site = id(site);
                    let chunk = |count: u32, hash: [u8; 32]| Chunk {
                        payload_hash: hash,
                        index: 0,
                        count,
                        total_len: m.payload_len,
                        data: random.clone(),
                    };
                    let chunks = [
                        env(
                            "e2e",
                            "aggregator",
                            MessageKind::ModelChunk,
                            &chunk(m.chunk_count + 1, m.payload_hash),
                        ),
                        env(
                            "e2e",
                            "aggregator",
                            MessageKind::ModelChunk,
                            &chunk(m.chunk_count, payload_hash(&random)),
                        ),
                        env("e2e", "aggregator", MessageKind::ModelChunk, &truncated),
                    ];
                    all(topics.chunk_reply(&site), false, &chunks);
                    let answer = UpdateAnswer {
                        round: m.round,
                        update_hash: payload_hash(&random),
                        answer: Answer::Accepted,
                    };
                    all(
                        topics.ack(&site),
                        false,
                        &[env("e2e", "aggregator", MessageKind::UpdateAnswer, &answer)],
                    );
                    all(
                        topics.update(&site),
                        false,
                        &[truncated.clone(), garbage.encode()],
                    );
                    let req = ChunkRequest {
                        model_version: m.model_version + 7,
                        indices: vec![0, 1],
                        payload: Payload::Model,
                        alone: false,
                    };
                    all(
                        topics.chunk_request(&site),
                        false,
                        &[env("e2e", "grey", MessageKind::ChunkRequest, &req)],
                    );
                    all(topics.onboard_request(&site), false, &[]);
                }
            }
            let any = !junk.is_empty();
            for (t, p, retain) in junk {
                if client
                    .publish(t, unifed_net::Qos::AtLeastOnce, retain, p)
                    .await
                    .is_ok()
                {
                    sent += 1;
                }
            }
            if any {
                started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = client.disconnect().await;
        sent
    })
}

#[test]
fn junk_on_every_topic_leaves_agents_and_aggregator_running_and_the_model_unchanged() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let mut fed = fed_for(dir.path(), broker.port);
    // The aggregator re-publishes its retained manifest every second, replacing retained junk.
    fed.manifest_every_secs = 1;
    let mut agg = fed.aggregator();
    // Junk starts before the agents: the first retained manifest an agent sees may be junk.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let noisy = {
        let (port, stop, started) = (broker.port, stop.clone(), started.clone());
        std::thread::spawn(move || noise(port, stop, started))
    };
    let t0 = std::time::Instant::now();
    while started.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(
            t0.elapsed() < LONG,
            "the noise never started\n{}",
            fed.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        wait_ok(a, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = noisy.join().unwrap();
    assert!(sent > 100, "only {sent} junk messages went out");
    // Same model as without the noise; the junk reached both sides and was dropped or refused.
    assert_eq!(final_model(&fed), want);
    for r in 1..=fed.rounds {
        assert_eq!(fed.accepted(r), ["grey", "lowres", "texture"]);
    }
    // Unsigned junk is refused in the log and earns no audit entry (no disk write).
    assert!(!fed.audit().iter().any(|e| e.event == "rejected"));
    let agg_log = std::fs::read_to_string(fed.dir.join("agg.log")).unwrap();
    assert!(agg_log.contains("update refused"), "{agg_log}");
    let grey = std::fs::read_to_string(fed.dir.join("grey.log")).unwrap();
    assert!(grey.contains("message dropped"), "{grey}");
}

#[test]
fn the_aggregator_killed_between_and_during_rounds_ends_with_the_uninterrupted_model() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    // Between rounds: right after round 1 closed.
    let (_broker, fed, mut agents) = killed_after_round_one(dir.path());
    let mut agg = fed.aggregator();
    // During round 3: as soon as one site's round-3 update was accepted (lowres, the slow
    // one, is still training then).
    assert!(
        fed.wait_report(&SITES, accepted(3), LONG).is_some(),
        "{}",
        fed.logs()
    );
    agg.kill();
    let mut agg = fed.aggregator();
    for (a, s) in agents.iter_mut().zip(SITES) {
        wait_ok(a, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    let got = final_model(&fed);
    assert!(
        got == want,
        "the final model differs from the uninterrupted run's"
    );
    // Every round folded all three, and the audit says so (an update spooled just before a
    // kill and folded after the restart gets its line from the restart).
    for r in 1..=3 {
        assert_eq!(
            fed.folded(r),
            ["grey", "lowres", "texture"],
            "round {r}\n{}",
            fed.logs()
        );
    }
    audit_matches_the_folds(&fed);
    agents_hold(&fed, &SITES, &got);
}

/// The faults' federation in `dir` on a broker of its own, its aggregator killed right after
/// round 1 closed: the broker, the federation and its running agents.
fn killed_after_round_one(dir: &std::path::Path) -> (Broker, Fed, Vec<Guard>) {
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir, broker.port);
    let mut agg = fed.aggregator();
    let agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    assert!(
        fed.wait_report(&["agg"], closed(1), LONG).is_some(),
        "{}",
        fed.logs()
    );
    agg.kill();
    (broker, fed, agents)
}

/// Every round of `fed` has an `accepted` line for each site it folded, and one
/// `round-closed` line.
fn audit_matches_the_folds(fed: &Fed) {
    let audit = fed.audit();
    for r in 1..=fed.rounds {
        let mut accepted: Vec<String> = audit
            .iter()
            .filter(|e| e.round == r && e.event == "accepted")
            .map(|e| e.site.clone())
            .collect();
        accepted.sort();
        accepted.dedup();
        assert_eq!(accepted, fed.folded(r), "round {r}: {audit:#?}");
        let closes = audit
            .iter()
            .filter(|e| e.round == r && e.event == "round-closed")
            .count();
        assert_eq!(closes, 1, "round {r}: {audit:#?}");
    }
}

/// The audit is as durable as the model: the aggregator is killed right after round 1 closed
/// and its audit log cut back to what a kill between the commit of round 1's last update and
/// its `accepted` line leaves (the log is append-only and written after the spool and the
/// model, so a kill leaves a prefix; the state on disk says round 1 was folded). The restart
/// writes the missing lines back from its state and spool, and every round ends with an
/// `accepted` line for each site it folded and one `round-closed`.
#[test]
fn a_kill_between_a_rounds_commit_and_its_audit_lines_loses_no_line() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let (_broker, fed, mut agents) = killed_after_round_one(dir.path());
    let path = fed.agg_dir().join("audit.log");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let is = |l: &str, event: &str| {
        let e: unifed_aggregator::store::AuditEntry = serde_json::from_str(l).unwrap();
        e.round == 1 && e.event == event
    };
    let last_accept = lines.iter().rposition(|l| is(l, "accepted")).unwrap();
    assert!(lines[last_accept..].iter().any(|l| is(l, "round-closed")));
    let cut: String = lines[..last_accept]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&path, cut).unwrap();
    assert_eq!(fed.accepted(1).len(), 2);
    let mut agg = fed.aggregator();
    for (a, s) in agents.iter_mut().zip(SITES) {
        wait_ok(a, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    assert_eq!(fed.folded(1), ["grey", "lowres", "texture"]);
    audit_matches_the_folds(&fed);
    let found: Vec<_> = fed
        .audit()
        .into_iter()
        .filter(|e| e.detail.contains("found at start"))
        .map(|e| (e.round, e.event))
        .collect();
    assert!(found.contains(&(1, "accepted".to_string())), "{found:?}");
    assert!(
        found.contains(&(1, "round-closed".to_string())),
        "{found:?}"
    );
    assert_eq!(final_model(&fed), *reference());
}

#[test]
fn the_broker_killed_mid_round_loses_no_update() {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port);
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    // Mid-round: round 2 is open and the first site has started on it.
    assert!(
        fed.wait_report(&SITES, training(2), LONG).is_some(),
        "{}",
        fed.logs()
    );
    let before: Vec<usize> = SITES.iter().map(|s| fed.reports(s).len()).collect();
    broker.kill();
    // Restarted once every agent has lost its connection.
    let lost = |r: &Report| matches!(r, Report::Connection { up: false, .. });
    fed.wait_each(&SITES, &before, lost, LONG);
    broker.restart();
    for (a, s) in agents.iter_mut().zip(SITES) {
        wait_ok(a, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    // Rounds wait for all three sites (no deadline passes), so every update arrived.
    for r in 1..=3 {
        assert_eq!(fed.accepted(r), ["grey", "lowres", "texture"], "round {r}");
    }
    let got = final_model(&fed);
    assert!(
        got == want,
        "the final model differs from the uninterrupted run's"
    );
    agents_hold(&fed, &SITES, &got);
}

#[test]
fn a_late_joiner_gets_a_model_larger_than_the_packet_limit_in_chunks() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let proxy = Proxy::start(broker.port);
    let mut fed = fed_for(dir.path(), proxy.port);
    // Rounds 1 and 2 close at the deadline with the two first sites; rounds 3 and 4 wait for all
    // three (unless the joiner misses the deadline).
    fed.deadline_secs = 8;
    fed.rounds = 4;
    // The sites share their BN weight and bias: the joiner's BN starts from their average.
    fed.bn_sharing = BnSharing::Affine;
    let mut agg = fed.aggregator();
    let mut grey = fed.agent("grey");
    let mut texture = fed.agent("texture");
    assert!(
        fed.wait_report(&["agg"], closed(2), LONG).is_some(),
        "{}",
        fed.logs()
    );
    let mut late = fed.agent("lowres");
    for (g, s) in [
        (&mut grey, "grey"),
        (&mut texture, "texture"),
        (&mut late, "lowres"),
    ] {
        wait_ok(g, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    let global = final_model(&fed);
    agents_hold(&fed, &["grey", "texture", "lowres"], &global);
    // Joining at a later model version, it took its BN from the onboarding package (the two
    // sites' averaged affine) and calibrated the statistics on its own images.
    let log = std::fs::read_to_string(fed.dir.join("lowres.log")).unwrap();
    assert!(
        log.contains("BN from the onboarding package of model v2 (affine of grey, texture)"),
        "{log}"
    );
    assert!(log.contains("calibrated BN on 743 own images"), "{log}");
    // It took part from a round after it joined.
    let rounds: Vec<u64> = fed
        .audit()
        .into_iter()
        .filter(|e| e.event == "accepted" && e.site == "lowres")
        .map(|e| e.round)
        .collect();
    assert!(
        !rounds.is_empty() && rounds.iter().all(|&r| r >= 3),
        "lowres updates in rounds {rounds:?}"
    );
    // Every model it fetched was larger than a packet and came in chunks that each fit one.
    let packets = proxy.packets();
    let manifest: RoundManifest = packets
        .iter()
        .filter(|p| p.to_broker && p.topic == "unifed/v1/e2e/manifest")
        .map(|p| Envelope::decode(&p.payload).unwrap().payload_as().unwrap())
        .next_back()
        .unwrap();
    assert!(manifest.payload_len as usize > PACKET);
    let chunks: Vec<Chunk> = packets
        .iter()
        .filter(|p| {
            !p.to_broker
                && (p.topic == "unifed/v1/e2e/chunks/reply/lowres"
                    || (p.topic == "unifed/v1/e2e/chunks/model"
                        && p.client == "unifed-agent-lowres"))
        })
        .map(|p| {
            assert!(p.payload.len() <= PACKET);
            let e = Envelope::decode(&p.payload).unwrap();
            assert_eq!(e.kind, MessageKind::ModelChunk);
            e.payload_as().unwrap()
        })
        .collect();
    // Each chunk of the final model at least once (one that went out for every site before
    // lowres asked was also sent to it alone).
    let last: std::collections::BTreeSet<u32> = chunks
        .iter()
        .filter(|c| c.payload_hash == manifest.payload_hash)
        .map(|c| c.index)
        .collect();
    assert_eq!(
        last.len() as u32,
        manifest.chunk_count,
        "chunks of the final model"
    );
    assert!(manifest.chunk_count > 1);
    // The package it was sent carries the sample-weighted mean of the BN weight and bias the
    // two sites sent with their round-2 updates.
    let mut sets = Reassembler::new(u64::MAX, 1 << 30);
    let package: ServerBroadcast = chunks
        .iter()
        .filter_map(|c| sets.insert(c.as_ref(), 0).unwrap())
        .map(|b| postcard::from_bytes::<ServerBroadcast>(&b).unwrap())
        .find(|b| b.weights.iter().any(|t| t.name.ends_with("running_mean")))
        .expect("the onboarding package reached the joiner");
    assert_eq!(package.model_version, 2);
    let mut uploads = Reassembler::new(u64::MAX, 1 << 30);
    // (site, update) of round 2, in site-id order as the aggregator folds them.
    let mut round2: Vec<(String, SiteUpdate)> = packets
        .iter()
        .filter(|p| p.to_broker && p.topic.starts_with("unifed/v1/e2e/update/"))
        .filter_map(|p| {
            let e = Envelope::decode(&p.payload).unwrap();
            match e.kind {
                MessageKind::UpdateChunk => uploads
                    .insert(e.payload_as::<Chunk>().unwrap().as_ref(), 0)
                    .unwrap()
                    .map(|b| Envelope::decode(&b).unwrap()),
                _ => Some(e),
            }
        })
        .map(|e| (e.sender.to_string(), e.payload_as::<SiteUpdate>().unwrap()))
        .filter(|(_, u)| u.round == 2)
        .collect();
    round2.sort_by(|a, b| a.0.cmp(&b.0));
    round2.dedup_by(|a, b| a.0 == b.0);
    assert_eq!(round2.len(), 2, "grey and texture in round 2");
    let total: f64 = round2.iter().map(|(_, u)| u.samples as f64).sum();
    let spec = fed.spec();
    let shared: Vec<&str> = round2[0].1.bn.iter().map(|b| b.name.as_str()).collect();
    let affine = unifed_e2e::bn_affine_names(&spec);
    assert_eq!(
        shared, affine,
        "the sites shared exactly their BN weight and bias"
    );
    for t in package
        .weights
        .iter()
        .filter(|t| shared.contains(&t.name.as_str()))
    {
        let mut acc = vec![0f64; decode(t).unwrap().len()];
        for (_, u) in &round2 {
            let b = u.bn.iter().find(|b| b.name == t.name).unwrap();
            for (a, x) in acc.iter_mut().zip(decode(b).unwrap()) {
                *a += u.samples as f64 * x as f64;
            }
        }
        let want: Vec<f32> = acc.iter().map(|a| (a / total) as f32).collect();
        assert_eq!(decode(t).unwrap(), want, "package `{}`", t.name);
    }
}

#[test]
fn a_damaged_spool_file_is_set_aside_the_round_closes_with_the_resent_update_and_a_damaged_model_is_never_served()
 {
    let want = reference().clone();
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, PACKET);
    let fed = fed_for(dir.path(), broker.port);
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    // grey's accepted update of round 1 gets a NaN on disk before lowres (slower) reports.
    let spool = fed.agg_dir().join("spool/r1/grey.upd");
    let t0 = std::time::Instant::now();
    while !spool.exists() {
        assert!(
            t0.elapsed() < LONG,
            "grey's update never spooled\n{}",
            fed.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut b = std::fs::read(&spool).unwrap();
    b[36..40].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&spool, b).unwrap();
    for (a, s) in agents.iter_mut().zip(SITES) {
        wait_ok(a, s, &fed);
    }
    wait_ok(&mut agg, "aggregator", &fed);
    // Set aside, re-sent, folded: the model is the undisturbed run's.
    assert!(
        fed.audit()
            .iter()
            .any(|e| e.event == "spool-damaged" && e.site == "grey" && e.round == 1),
        "{:?}",
        fed.audit()
    );
    assert_eq!(
        std::fs::read_dir(fed.agg_dir().join("spool-corrupt"))
            .unwrap()
            .count(),
        1
    );
    let grey = std::fs::read_to_string(fed.dir.join("grey.log")).unwrap();
    assert!(grey.contains("re-sending it"), "{grey}");
    assert_eq!(final_model(&fed), want);
    agents_hold(&fed, &SITES, &want);

    // A flipped byte in the final model: a restarted aggregator refuses to serve it, by name.
    let model = fed.agg_dir().join(format!("models/v{}.bin", fed.rounds));
    let mut b = std::fs::read(&model).unwrap();
    b[100] ^= 0x20;
    std::fs::write(&model, b).unwrap();
    let mut again = fed.aggregator();
    let st = again.wait_for(LONG);
    assert!(st.is_some_and(|s| !s.success()), "{st:?}");
    let log = std::fs::read_to_string(fed.dir.join("agg.log")).unwrap();
    assert!(
        log.contains(&format!("v{}.bin: checksum mismatch", fed.rounds)),
        "{log}"
    );
}
