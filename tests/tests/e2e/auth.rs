//! An authenticated federation attacked the way a hostile client on the hospital network would
//! attack it, with nothing but the broker's address (and, for the poisoning probes, one enrolled
//! site's key): the real binaries must refuse every forgery, replay and poisoned update, count
//! the real sites' updates, and end with the model the honest federation computes in process.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, Erased, serial};
use unifed_net::report::Report;
use unifed_protocol::auth::{Keyring, SigningKey};
use unifed_protocol::chunking::payload_hash;
use unifed_protocol::encoding::{Encoding, encode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::{AGGREGATOR_ID, Id};
use unifed_protocol::messages::{
    Answer, BnSharing, Chunk, LocalReport, RoundManifest, SiteExtras, SiteUpdate, UpdateAnswer,
};
use unifed_protocol::topics::Topics;
use unifed_protocol::{ModelSpec, SpecHash};

const SITES: [&str; 3] = ["grey", "texture", "lowres"];
const LONG: Duration = Duration::from_secs(300);

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

/// A well-formed update of `round` trained from `version`: every non-BN tensor of `spec`
/// filled with `value`, claiming `samples`.
fn update(spec: &ModelSpec, (round, version): (u64, u64), value: f32, samples: u64) -> SiteUpdate {
    SiteUpdate {
        round,
        base_version: version,
        samples,
        delta: spec
            .tensors
            .iter()
            .filter(|t| !t.kind.is_bn())
            .map(|t| {
                let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
                encode(
                    &t.name,
                    &shape,
                    &vec![value; t.numel()],
                    Encoding::F32,
                    None,
                )
            })
            .collect(),
        bn: vec![],
        report: LocalReport::default(),
        extras: SiteExtras::None,
    }
}

/// What the attacker managed to send, by probe.
#[derive(Debug, Default)]
struct Sent {
    forged_manifests: usize,
    forged_chunks: usize,
    spoofed_answers: usize,
    forged_updates: usize,
    unenrolled_updates: usize,
    poisoned_updates: usize,
    replays: usize,
}

/// The attacker: a client with the broker's address and login, its own key (enrolled nowhere)
/// and the key of the enrolled site `rogue`. Until `stop`, on every round it sees: a forged
/// manifest (retained once) claiming the aggregator, newer, finished, asking for BN statistics;
/// forged model chunks; spoofed `Accepted` answers to every site's update; an update as `grey`
/// signed with its own key; one from the unenrolled `mallory`; `rogue`'s updates with huge
/// values and with 2^64 - 1 samples; and replays of grey's update of the round before, as it
/// was and moved to another federation.
fn attack(fed: Fed, stop: Arc<AtomicBool>, connected: Arc<AtomicBool>) -> Sent {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let spec = fed.spec();
    let hash: SpecHash = spec.hash();
    let aggregator = Keyring::aggregator(fed.key("aggregator").public());
    let mallory = SigningKey::from_seed([0x66; 32]);
    let rogue = fed.key("rogue");
    rt.block_on(async move {
        let topics = Topics::new(&id("e2e"));
        let opts = unifed_net::BrokerConfig::new("127.0.0.1", fed.port)
            .options("mallory", None)
            .unwrap();
        let (client, mut rx) =
            unifed_net::spawn_event_loop(opts, vec![topics.manifest(), topics.updates_filter()]);
        let publish = |topic: String, bytes: Vec<u8>, retain: bool| {
            let client = client.clone();
            async move {
                client
                    .publish(topic, unifed_net::Qos::AtLeastOnce, retain, bytes)
                    .await
                    .is_ok()
            }
        };
        let env = |sender: &str, m: &RoundManifest, kind, payload: &dyn Erased| Envelope {
            kind,
            federation: id("e2e"),
            sender: id(sender),
            round: m.round,
            model_version: m.model_version,
            spec_hash: hash,
            run: m.run,
            payload: payload.bytes(),
            signature: None,
        };
        let mut sent = Sent::default();
        let mut current: Option<RoundManifest> = None;
        // grey's signed update of each round, as captured.
        let mut grey: Vec<Vec<u8>> = Vec::new();
        let mut retained_once = false;
        while !stop.load(Ordering::Relaxed) {
            let ev = match tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(_) => continue,
            };
            if matches!(ev, unifed_net::NetEvent::Connected) {
                connected.store(true, Ordering::Relaxed);
            }
            let unifed_net::NetEvent::Message { topic, payload } = ev else {
                continue;
            };
            if let Some(site) = topics.site_of(&topic)
                && topic == topics.update(&id(site))
                && SITES.contains(&site)
            {
                // Every real update gets a spoofed "accepted" at once.
                let Some(m) = &current else { continue };
                let answer = UpdateAnswer {
                    round: m.round,
                    update_hash: payload_hash(&payload),
                    answer: Answer::Accepted,
                };
                let forged =
                    mallory.sign(&env(AGGREGATOR_ID, m, MessageKind::UpdateAnswer, &answer));
                if publish(topics.ack(&id(site)), forged, false).await {
                    sent.spoofed_answers += 1;
                }
                if site == "grey" {
                    grey.push(payload.to_vec());
                }
                continue;
            }
            if topic != topics.manifest() {
                continue;
            }
            let Ok(e) = aggregator.open(&payload, 1 << 20) else {
                continue; // our own forgery, retained
            };
            let Ok(m) = e.payload_as::<RoundManifest>() else {
                continue;
            };
            if current.as_ref().is_some_and(|c| c.round == m.round) || m.finished {
                current = Some(m);
                continue;
            }
            // A newer, finished manifest that asks sites for their BN statistics.
            let mut lie = m.clone();
            lie.round += 1;
            lie.model_version += 1;
            lie.finished = true;
            lie.bn_sharing = BnSharing::AffineStats;
            let forged = mallory.sign(&env(AGGREGATOR_ID, &lie, MessageKind::RoundManifest, &lie));
            let retain = !std::mem::replace(&mut retained_once, true);
            if publish(topics.manifest(), forged, retain).await {
                sent.forged_manifests += 1;
            }
            for site in SITES {
                // Chunks of the real model's payload with other bytes: accepted, they would
                // poison the site's reassembly.
                let chunk = Chunk {
                    payload_hash: m.payload_hash,
                    index: 0,
                    count: m.chunk_count,
                    total_len: m.payload_len,
                    data: vec![0x5a; (m.payload_len as usize).div_ceil(m.chunk_count as usize)],
                };
                let forged = mallory.sign(&env(AGGREGATOR_ID, &m, MessageKind::ModelChunk, &chunk));
                if publish(topics.chunk_reply(&id(site)), forged, false).await {
                    sent.forged_chunks += 1;
                }
            }
            let honest_looking = update(&spec, (m.round, m.model_version), 0.0, 10);
            let as_grey = mallory.sign(&env("grey", &m, MessageKind::SiteUpdate, &honest_looking));
            if publish(topics.update(&id("grey")), as_grey, false).await {
                sent.forged_updates += 1;
            }
            let own = mallory.sign(&env(
                "mallory",
                &m,
                MessageKind::SiteUpdate,
                &honest_looking,
            ));
            if publish(topics.update(&id("mallory")), own, false).await {
                sent.unenrolled_updates += 1;
            }
            for u in [
                update(&spec, (m.round, m.model_version), 1e30, 10),
                update(&spec, (m.round, m.model_version), 0.0, u64::MAX),
            ] {
                let signed = rogue.sign(&env("rogue", &m, MessageKind::SiteUpdate, &u));
                if publish(topics.update(&id("rogue")), signed, false).await {
                    sent.poisoned_updates += 1;
                }
            }
            if let Some(old) = grey.last() {
                let mut elsewhere = Envelope::decode(old).unwrap();
                elsewhere.federation = id("e2e-other");
                for bytes in [old.clone(), elsewhere.encode()] {
                    if publish(topics.update(&id("grey")), bytes, false).await {
                        sent.replays += 1;
                    }
                }
            }
            current = Some(m);
        }
        let _ = client.disconnect().await;
        sent
    })
}

#[test]
fn a_hostile_client_changes_nothing_the_honest_federation_computes() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    // `rogue` is enrolled (its key is the attacker's), `mallory` is not.
    // The rogue's claims meet the federation's own bound, not a vouched count.
    fed.vouched = false;
    fed.sites = vec![
        "grey".into(),
        "texture".into(),
        "lowres".into(),
        "rogue".into(),
    ];
    fed.manifest_every_secs = 2;
    let mut agg = fed.aggregator();
    let stop = Arc::new(AtomicBool::new(false));
    let connected = Arc::new(AtomicBool::new(false));
    let attacker = {
        let (fed, stop, connected) = (fed.clone(), stop.clone(), connected.clone());
        std::thread::spawn(move || attack(fed, stop, connected))
    };
    // The sites start once the attacker is on the broker.
    let t0 = std::time::Instant::now();
    while !connected.load(Ordering::Relaxed) {
        assert!(t0.elapsed() < LONG, "the attacker never connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    stop.store(true, Ordering::Relaxed);
    let sent = attacker.join().unwrap();
    assert!(
        sent.forged_manifests >= 2
            && sent.forged_chunks >= 6
            && sent.spoofed_answers >= 6
            && sent.forged_updates >= 2
            && sent.unenrolled_updates >= 2
            && sent.poisoned_updates >= 4
            && sent.replays >= 2,
        "the attack did not run: {sent:?}"
    );

    // Only the real sites' updates counted, every round.
    for round in 1..=fed.rounds {
        assert_eq!(
            fed.accepted(round),
            ["grey", "lowres", "texture"],
            "round {round}"
        );
    }
    // The enrolled attacker's poison was refused with its reasons.
    let rogue: Vec<String> = fed
        .audit()
        .into_iter()
        .filter(|e| e.site == "rogue")
        .map(|e| format!("{} {}", e.event, e.detail))
        .collect();
    assert!(
        rogue.iter().any(|d| d.starts_with("rejected NormTooLarge")),
        "{rogue:?}"
    );
    assert!(
        rogue.iter().any(|d| d.starts_with(
            "rejected TooManySamples { samples: 18446744073709551615, bound: 10000000 }"
        )),
        "{rogue:?}"
    );
    assert!(rogue.iter().all(|d| d.starts_with("rejected")), "{rogue:?}");
    // The forgeries were refused, each for its reason, before anything was done with them.
    let agg_log = std::fs::read_to_string(dir.path().join("agg.log")).unwrap();
    for reason in [
        "bad signature on a message from `grey`",
        "`mallory` is not an enrolled sender",
    ] {
        assert!(agg_log.contains(reason), "aggregator log lacks `{reason}`");
    }
    let grey_log = std::fs::read_to_string(dir.path().join("grey.log")).unwrap();
    assert!(
        grey_log.contains("bad signature on a message from `aggregator`"),
        "{grey_log}"
    );
    // And the models are bit for bit those of the honest federation run in process.
    common::same_as_in_process(&fed, &SITES, unifed_aggregator::Algorithm::FedAvg);
}

#[test]
fn a_site_revoked_while_everything_runs_is_refused_from_its_next_update() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.rounds = 2;
    fed.manifest_every_secs = 2;
    // Round 2 cannot have all three once lowres is revoked: it does not sample lowres, and
    // closes with the other two long before its deadline.
    let mut agg = fed.aggregator();
    // lowres reports first in round 1 ...
    let mut lowres = fed.agent("lowres");
    let t0 = std::time::Instant::now();
    while fed.accepted(1).is_empty() {
        assert!(t0.elapsed() < LONG, "lowres never reported\n{}", fed.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    // ... then the coordinator revokes its key in the config; nothing is restarted.
    fed.revoked = vec!["lowres".into()];
    fed.aggregator_config();
    let reloaded = |r: &Report| matches!(r, Report::Revocations { revoked: 1 });
    assert!(
        fed.wait_report(&["agg"], reloaded, LONG).is_some(),
        "{}",
        fed.logs()
    );
    // The others report; round 1 closes with what was accepted before the revocation, and
    // lowres's next update (round 2's) is refused by name.
    let mut agents: Vec<_> = ["grey", "texture"].iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(["grey", "texture"]) {
        fed.wait_ok(a, s, LONG);
    }
    fed.wait_ok(&mut agg, "aggregator", LONG);
    assert_eq!(fed.accepted(1), ["grey", "lowres", "texture"]);
    assert_eq!(fed.accepted(2), ["grey", "texture"]);
    // What lowres sent after the revocation was refused, and the aggregator's log says why,
    // naming the key.
    let fingerprint = fed.key("lowres").public().fingerprint();
    let agg_log = std::fs::read_to_string(dir.path().join("agg.log")).unwrap();
    assert!(
        agg_log.contains(&format!("the key of `lowres` ({fingerprint}) is revoked")),
        "{}",
        fed.logs()
    );
    // The revoked site is cut off: it is served nothing more, so it never gets the new model.
    lowres.kill();
    let applied_2 = |r: &Report| matches!(r, Report::Applied { version: 2, .. });
    assert!(
        !fed.reports("lowres").iter().any(applied_2),
        "{}",
        fed.logs()
    );
}
