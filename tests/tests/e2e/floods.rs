//! Floods against the real aggregator while an honest federation runs: chunk sets from an
//! enrolled site's stolen key, a chunk-request storm, and junk on every topic from a client with
//! only the broker's address. The honest rounds must close with the in-process model, the
//! aggregator's upload memory stay under its configured cap, chunks be served a bounded number
//! of times, and the audit log stay small. Peak memory and CPU of the aggregator under each
//! flood are printed (`cargo test --release -p unifed-e2e --test e2e -- floods --nocapture`).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_protocol::auth::{Keyring, SigningKey};
use unifed_protocol::chunking::payload_hash;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{Chunk, ChunkRequest, Payload, RoundManifest};
use unifed_protocol::topics::Topics;

const SITES: [&str; 3] = ["grey", "texture", "lowres"];
const LONG: Duration = Duration::from_secs(300);
/// The aggregator's configured cap on upload memory in these runs.
const UPLOAD_CAP: usize = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Flood {
    None,
    ChunkSets,
    RequestStorm,
    Junk,
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

/// Resident memory (VmRSS) of `pid` in bytes.
fn rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// CPU seconds (user + system) `pid` has used.
fn cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// Sends `flood` until `stop`, counting the messages sent in `sent`.
fn flood(fed: Fed, kind: Flood, stop: Arc<AtomicBool>, counted: Arc<AtomicU64>) {
    if kind == Flood::None {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rogue = fed.key("rogue");
    let mallory = SigningKey::from_seed([0x77; 32]);
    let aggregator = Keyring::aggregator(fed.key("aggregator").public());
    let hash = fed.spec().hash();
    rt.block_on(async move {
        let topics = Topics::new(&id("e2e"));
        let opts = unifed_net::BrokerConfig::new("127.0.0.1", fed.port)
            .options("flood", None)
            .unwrap();
        let (client, mut rx) = unifed_net::spawn_event_loop(opts, vec![topics.manifest()]);
        let mut version = 0u64;
        let mut run = unifed_protocol::RunId::default();
        let mut round = 0u64;
        let mut k = 0u64;
        let env = |sender: &str, kind, (run, round, version), payload: Vec<u8>| Envelope {
            kind,
            federation: id("e2e"),
            sender: id(sender),
            round,
            model_version: version,
            spec_hash: hash,
            run,
            payload,
            signature: None,
        };
        while !stop.load(Ordering::Relaxed) {
            while let Ok(ev) = rx.try_recv() {
                if let unifed_net::NetEvent::Message { payload, .. } = ev
                    && let Ok(e) = aggregator.open(&payload, 1 << 20)
                    && let Ok(m) = e.payload_as::<RoundManifest>()
                {
                    (version, run, round) = (m.model_version, m.run, m.round);
                }
            }
            k += 1;
            let mut out: Vec<(String, Vec<u8>)> = Vec::new();
            match kind {
                Flood::ChunkSets => {
                    // 30 kB chunks of 12 MB sets, one set after the other: two sets are
                    // more than the rogue's share of the upload memory.
                    let set = k / 400;
                    let c = Chunk {
                        payload_hash: payload_hash(&set.to_le_bytes()),
                        index: (k % 400) as u32,
                        count: 400,
                        total_len: 12_000_000,
                        data: vec![(k % 251) as u8; 30_000],
                    };
                    let bytes = rogue.sign(&env(
                        "rogue",
                        MessageKind::UpdateChunk,
                        (run, round, version),
                        postcard::to_allocvec(&c).unwrap(),
                    ));
                    out.push((topics.update(&id("rogue")), bytes));
                }
                Flood::RequestStorm => {
                    let req = ChunkRequest {
                        model_version: version,
                        indices: vec![],
                        payload: Payload::Model,
                        alone: false,
                    };
                    let payload = postcard::to_allocvec(&req).unwrap();
                    out.push((
                        topics.chunk_request(&id("rogue")),
                        rogue.sign(&env(
                            "rogue",
                            MessageKind::ChunkRequest,
                            (run, round, version),
                            payload.clone(),
                        )),
                    ));
                    out.push((
                        topics.chunk_request(&id("grey")),
                        mallory.sign(&env(
                            "grey",
                            MessageKind::ChunkRequest,
                            (run, round, version),
                            payload,
                        )),
                    ));
                }
                Flood::Junk => {
                    let junk: Vec<u8> = (0..(k % 30_000) as u32)
                        .map(|i| ((i * 131 + k as u32 * 17) % 251) as u8)
                        .collect();
                    for site in ["grey", "rogue", "nobody"] {
                        let s = id(site);
                        for t in [
                            topics.update(&s),
                            topics.chunk_request(&s),
                            topics.onboard_request(&s),
                        ] {
                            out.push((t, junk.clone()));
                        }
                    }
                }
                Flood::None => {}
            }
            for (t, p) in out {
                if client
                    .publish(t, unifed_net::Qos::AtMostOnce, false, p)
                    .await
                    .is_ok()
                {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = client.disconnect().await;
    })
}

/// What one run measured.
#[derive(Debug)]
struct Measured {
    flood: Flood,
    sent: u64,
    peak_rss: u64,
    cpu_secs: f64,
    wall_secs: f64,
}

fn run(kind: Flood) -> Measured {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 32 << 10);
    let mut fed = Fed::new(dir.path(), broker.port, 32 << 10);
    fed.sites = vec![
        "grey".into(),
        "texture".into(),
        "lowres".into(),
        "rogue".into(),
    ];
    fed.resend_secs = 2;
    fed.service_edit = Some(|c| c.max_upload_bytes = UPLOAD_CAP);
    let mut agg = fed.aggregator();
    let pid = agg.0.id();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            let mut cpu = 0.0;
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = rss(pid) {
                    peak.fetch_max(r, Ordering::Relaxed);
                }
                cpu = cpu_secs(pid).unwrap_or(cpu);
                std::thread::sleep(Duration::from_millis(20));
            }
            cpu
        })
    };
    let counted = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (fed, stop, counted) = (fed.clone(), stop.clone(), counted.clone());
        std::thread::spawn(move || flood(fed, kind, stop, counted))
    };
    let t0 = Instant::now();
    // The flood is in full swing before the sites start (a quick federation would otherwise
    // end before it).
    while kind != Flood::None && counted.load(Ordering::Relaxed) < 1500 {
        assert!(t0.elapsed() < LONG, "{kind:?}: the flood did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    // The federation is done: stop the flood before the aggregator's linger ends.
    stop.store(true, Ordering::Relaxed);
    let wall_secs = t0.elapsed().as_secs_f64();
    flooder.join().unwrap();
    let sent = counted.load(Ordering::Relaxed);
    let cpu_secs = sampler.join().unwrap();
    fed.wait_ok(&mut agg, "aggregator", LONG);

    // The honest federation's rounds closed with its own sites and model.
    for round in 1..=fed.rounds {
        assert_eq!(
            fed.accepted(round),
            ["grey", "lowres", "texture"],
            "{kind:?} round {round}"
        );
    }
    common::same_as_in_process(&fed, &SITES, unifed_aggregator::Algorithm::FedAvg);
    // The audit log took no junk: the disk floor is never approached.
    let audit_len = std::fs::metadata(fed.agg_dir().join("audit.log"))
        .unwrap()
        .len();
    assert!(
        audit_len < 64 << 10,
        "{kind:?}: audit.log of {audit_len} bytes"
    );
    let log = std::fs::read_to_string(dir.path().join("agg.log")).unwrap();
    match kind {
        // Every rogue set completes (its chunks are signed, so it is not hashed) and the core
        // refuses it: its bytes are no update envelope.
        Flood::ChunkSets => assert!(
            log.lines()
                .any(|l| l.contains("update refused") && l.contains("rogue")),
            "{kind:?}: {sent} sent\n{}",
            &log[log.len().saturating_sub(3000)..]
        ),
        Flood::RequestStorm => {
            assert!(log.contains("chunks asked for too often"), "{kind:?}");
            assert!(log.contains("chunk request refused"), "{kind:?}");
        }
        Flood::Junk => assert!(log.contains("refused"), "{kind:?}"),
        Flood::None => {}
    }
    assert!(
        kind == Flood::None || sent > 100,
        "{kind:?}: only {sent} sent"
    );
    Measured {
        flood: kind,
        sent,
        peak_rss: peak.load(Ordering::Relaxed),
        cpu_secs,
        wall_secs,
    }
}

#[test]
fn under_each_flood_the_honest_rounds_close_and_the_aggregator_stays_bounded() {
    let _one = serial();
    let runs: Vec<Measured> = [
        Flood::None,
        Flood::ChunkSets,
        Flood::RequestStorm,
        Flood::Junk,
    ]
    .into_iter()
    .map(run)
    .collect();
    println!("flood            messages  aggregator peak RSS   CPU s   wall s   CPU %");
    for m in &runs {
        println!(
            "{:<14} {:>10}  {:>15.1} MiB  {:>6.2}  {:>7.1}  {:>6.1}",
            format!("{:?}", m.flood),
            m.sent,
            m.peak_rss as f64 / (1 << 20) as f64,
            m.cpu_secs,
            m.wall_secs,
            100.0 * m.cpu_secs / m.wall_secs
        );
    }
    // Upload memory is capped at UPLOAD_CAP shared by the four enrolled sites: the chunk-set
    // flood may add at most the rogue's share to the quiet run's peak (with allocator slack).
    let quiet = runs[0].peak_rss;
    for m in &runs[1..] {
        assert!(
            m.peak_rss < quiet + (UPLOAD_CAP as u64 / 4) * 3 / 2 + (48 << 20),
            "{:?}: peak {} MiB against {} MiB quiet",
            m.flood,
            m.peak_rss >> 20,
            quiet >> 20
        );
    }
}

/// The next event of a test client's connection.
async fn next(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<unifed_net::NetEvent>,
) -> unifed_net::NetEvent {
    match tokio::time::timeout(LONG, rx.recv()).await {
        Ok(Some(ev)) => ev,
        other => panic!("a test client's connection: {other:?}"),
    }
}

/// Captures the first update message on the update topics (`update/<site>`) and publishes it
/// `times` times more, without any key; says on `ready` once it listens, and returns the
/// update's site once every replay has come back through the broker.
fn replay_first_update(fed: &Fed, times: usize, ready: std::sync::mpsc::Sender<()>) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let topics = Topics::new(&id("e2e"));
        let opts = fed.broker().options("replayer", None).unwrap();
        let (client, mut rx) = unifed_net::spawn_event_loop(opts, vec![topics.updates_filter()]);
        while !matches!(next(&mut rx).await, unifed_net::NetEvent::Subscribed) {}
        ready.send(()).unwrap();
        let (topic, payload) = loop {
            // An update this small travels as one message: a chunk set of one chunk.
            if let unifed_net::NetEvent::Message { topic, payload } = next(&mut rx).await
                && matches!(
                    Envelope::peek_kind(&payload),
                    Some(MessageKind::SiteUpdate | MessageKind::UpdateChunk)
                )
            {
                break (topic, payload);
            }
        };
        // One at a time: each comes back to this subscription once the broker has routed it
        // (to the aggregator's too) before the next goes.
        for _ in 0..times {
            let q = unifed_net::Qos::AtLeastOnce;
            client
                .publish(topic.clone(), q, false, payload.to_vec())
                .await
                .unwrap();
            loop {
                if let unifed_net::NetEvent::Message { payload: p, .. } = next(&mut rx).await
                    && p[..] == payload[..]
                {
                    break;
                }
            }
        }
        topic.rsplit('/').next().unwrap().to_string()
    })
}

/// Replays of a captured update in [`replays_of_an_accepted_update_are_audited_up_to_the_limit_then_counted_in_one_line`].
const REPLAYS: usize = 80;

#[test]
fn replays_of_an_accepted_update_are_audited_up_to_the_limit_then_counted_in_one_line() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.rounds = 1;
    let mut agg = fed.aggregator();
    // Round 1 waits for all three: grey and texture report, a stranger replays the first
    // update it sees REPLAYS times while the round is open.
    let (ready, listening) = std::sync::mpsc::channel();
    let replayer = {
        let fed = fed.clone();
        std::thread::spawn(move || replay_first_update(&fed, REPLAYS, ready))
    };
    listening.recv_timeout(LONG).unwrap();
    let mut agents: Vec<_> = ["grey", "texture"]
        .into_iter()
        .map(|s| (s, fed.agent(s)))
        .collect();
    let replayed = replayer.join().unwrap();
    let limit = unifed_aggregator::core::AUDITED_REJECTS as usize;
    let duplicates = |fed: &Fed| {
        fed.audit()
            .into_iter()
            .filter(|e| e.event == "duplicate" && e.site == replayed)
            .count()
    };
    let t0 = Instant::now();
    while duplicates(&fed) < limit {
        assert!(
            t0.elapsed() < LONG,
            "the replays were not answered\n{}",
            fed.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agents.push(("lowres", fed.agent("lowres")));
    for (s, a) in &mut agents {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    // The replays took 32 audit lines, not one fsynced line each, and the close said how
    // many more came.
    assert_eq!(duplicates(&fed), limit, "{}", fed.logs());
    let suppressed: Vec<String> = fed
        .audit()
        .into_iter()
        .filter(|e| e.event == "audit-suppressed" && e.site == replayed)
        .map(|e| e.detail)
        .collect();
    assert_eq!(suppressed.len(), 1, "{suppressed:?}");
    let counted: usize = suppressed[0]
        .rsplit(": ")
        .next()
        .and_then(|c| c.strip_suffix(" duplicate"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{suppressed:?}"));
    // (All of them, unless the round closed before the last were taken.)
    assert!(counted >= 1 && counted + limit <= REPLAYS, "{suppressed:?}");
    assert_eq!(fed.accepted(1), ["grey", "lowres", "texture"]);
}
