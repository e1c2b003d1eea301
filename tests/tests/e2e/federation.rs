//! Federations over MQTT with the real binaries: a broker (embedded or Mosquitto), a capturing
//! proxy in front of it, `unifed-aggregator serve` and three `unifed-agent train` processes,
//! 3 rounds. From the captured bytes alone the test recomputes every round's sample-weighted
//! mean and checks it against the model every agent was sent and the one it ends with; it
//! checks which tensors crossed the wire (no BN tensor under `local`, all of them under
//! `global`) and how many messages of each kind did.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, Packet, Proxy, mosquitto_available, serial};
use unifed_models::checkpoint;
use unifed_net::report::Report;
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::encoding::{Encoding, decode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::messages::{
    Answer, BnPolicy, Chunk, ModelDelta, RoundManifest, ServerBroadcast, SiteState, SiteStatus,
    SiteUpdate, UpdateAnswer,
};

const SITES: [&str; 3] = ["grey", "texture", "lowres"];

/// Runs the federation and returns its folder and the captured packets.
fn run(kind: BrokerKind, bn: BnPolicy, max_packet: usize) -> (tempfile::TempDir, Fed, Vec<Packet>) {
    run_with(kind, bn, max_packet, Encoding::F32)
}

/// [`run`] with the federation's encoding.
fn run_with(
    kind: BrokerKind,
    bn: BnPolicy,
    max_packet: usize,
    encoding: Encoding,
) -> (tempfile::TempDir, Fed, Vec<Packet>) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(kind, max_packet);
    let proxy = Proxy::start(broker.port);
    let mut fed = Fed::new(dir.path(), proxy.port, max_packet);
    fed.credentials = broker.credentials.clone();
    fed.bn_policy = bn;
    fed.encoding = encoding;
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = SITES.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, Duration::from_secs(300));
    }
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));
    let packets = proxy.packets();
    drop(broker);
    (dir, fed, packets)
}

fn envelope(p: &Packet) -> Envelope {
    Envelope::decode(&p.payload)
        .unwrap_or_else(|e| panic!("undecodable payload on {}: {e}", p.topic))
}

/// Whether `p` brought model chunks to `site`: on its own reply topic, or on the topic every
/// site reads (to its connection).
fn sent_to(p: &Packet, site: &str) -> bool {
    !p.to_broker
        && (p.topic == format!("unifed/v1/e2e/chunks/reply/{site}")
            || (p.topic == "unifed/v1/e2e/chunks/model"
                && p.client == format!("unifed-agent-{site}")))
}

/// Checks everything the judged test asks from the captured packets and the agents' files.
fn check(fed: &Fed, packets: &[Packet]) {
    let local = fed.bn_policy == BnPolicy::Local;
    let spec = fed.spec();
    let rounds = fed.rounds;
    let init = checkpoint::load(&fed.model(), &spec).unwrap();

    // Updates as the sites sent them (client -> broker), reassembled when chunked.
    let mut updates: BTreeMap<(u64, String), SiteUpdate> = BTreeMap::new();
    let mut update_msgs = 0;
    // Per update: messages seen, and the messages one send takes (its chunk count).
    let mut sent: BTreeMap<(u64, String), (usize, usize)> = BTreeMap::new();
    let mut uploads = Reassembler::new(u64::MAX, 1 << 30);
    for p in packets
        .iter()
        .filter(|p| p.to_broker && p.topic.starts_with("unifed/v1/e2e/update/"))
    {
        update_msgs += 1;
        let site = p.topic.rsplit('/').next().unwrap().to_string();
        let env = envelope(p);
        let whole = match env.kind {
            MessageKind::UpdateChunk => {
                let c: Chunk = env.payload_as().unwrap();
                let e = sent.entry((env.round, site.clone())).or_default();
                (e.0, e.1) = (e.0 + 1, c.count as usize);
                uploads
                    .insert(c.as_ref(), 0)
                    .unwrap()
                    .map(|b| Envelope::decode(&b).unwrap())
            }
            MessageKind::SiteUpdate => {
                let e = sent.entry((env.round, site.clone())).or_default();
                (e.0, e.1) = (e.0 + 1, 1);
                Some(env)
            }
            k => panic!("{k:?} on an update topic"),
        };
        if let Some(env) = whole {
            let u: SiteUpdate = env.payload_as().unwrap();
            if let Some(prev) = updates.insert((u.round, site.clone()), u.clone()) {
                assert_eq!(prev, u, "a re-sent update differs");
            }
        }
    }
    assert_eq!(
        updates.len() as u64,
        rounds * SITES.len() as u64,
        "one update per site per round"
    );
    // Updates above the 32 KiB packet limit go in chunks; none was re-sent, so every update took
    // exactly its chunk count of messages.
    assert!(update_msgs > updates.len(), "updates were chunked");
    for ((round, site), (msgs, count)) in &sent {
        assert_eq!(msgs, count, "{site}: messages of its round-{round} update");
    }
    assert_eq!(update_msgs, sent.values().map(|s| s.1).sum::<usize>());

    // The independent weighted mean, round by round, over the tensors the updates carry.
    let bn_of = |name: &str| {
        spec.tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("`{name}` is not in the spec"))
            .kind
            .is_bn()
    };
    let mut model: BTreeMap<String, Vec<f32>> = init
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.clone()))
        .collect();
    let mut expected: Vec<BTreeMap<String, Vec<f32>>> = vec![model.clone()];
    for r in 1..=rounds {
        let ups: Vec<&SiteUpdate> = updates
            .iter()
            .filter(|((round, _), _)| *round == r)
            .map(|(_, u)| u)
            .collect();
        assert_eq!(ups.len(), SITES.len(), "round {r}");
        let total: f64 = ups.iter().map(|u| u.samples as f64).sum();
        let names: Vec<String> = ups[0].delta.iter().map(|t| t.name.clone()).collect();
        for name in &names {
            assert!(
                !local || !bn_of(name),
                "BN tensor `{name}` sent under local"
            );
        }
        let carried: usize = spec
            .tensors
            .iter()
            .filter(|t| !local || !t.kind.is_bn())
            .count();
        assert_eq!(names.len(), carried, "tensors per update (round {r})");
        for (k, name) in names.iter().enumerate() {
            let mut acc = vec![0f64; model[name].len()];
            // Sites in id order (the BTreeMap's), each delta weighted by its samples.
            for u in &ups {
                assert_eq!(&u.delta[k].name, name);
                let d = decode(&u.delta[k]).unwrap();
                for (a, x) in acc.iter_mut().zip(&d) {
                    *a += u.samples as f64 * *x as f64;
                }
            }
            let m = model.get_mut(name).unwrap();
            for (x, a) in m.iter_mut().zip(&acc) {
                *x = (*x as f64 + a / total) as f32;
            }
        }
        expected.push(model.clone());
    }

    // The models each agent was sent (broker -> agent on its chunk reply topic, or on the
    // topic every site reads).
    let mut sets: BTreeMap<String, Reassembler> = BTreeMap::new();
    let mut received: BTreeMap<(String, u64), ServerBroadcast> = BTreeMap::new();
    let mut chunk_msgs: BTreeMap<String, usize> = BTreeMap::new();
    for p in packets.iter().filter(|p| !p.to_broker) {
        let Some(site) = SITES.iter().find(|s| sent_to(p, s)).map(|s| s.to_string()) else {
            continue;
        };
        *chunk_msgs.entry(site.clone()).or_default() += 1;
        let c: Chunk = envelope(p).payload_as().unwrap();
        let r = sets
            .entry(site.clone())
            .or_insert_with(|| Reassembler::new(u64::MAX, 1 << 30));
        if let Some(bytes) = r.insert(c.as_ref(), 0).unwrap() {
            let b: ServerBroadcast = postcard::from_bytes(&bytes).unwrap();
            received.insert((site, b.model_version), b);
        }
    }
    for site in SITES {
        for (v, want) in expected.iter().enumerate() {
            let b = received
                .get(&(site.to_string(), v as u64))
                .unwrap_or_else(|| panic!("{site} never received model v{v}"));
            for t in &b.weights {
                assert!(
                    !local || !bn_of(&t.name),
                    "BN tensor `{}` broadcast",
                    t.name
                );
                assert_eq!(
                    decode(t).unwrap(),
                    want[&t.name],
                    "{site}: model v{v} tensor {} differs from the weighted mean",
                    t.name
                );
            }
        }
    }

    // Every agent ends with the final mean; under `local` its BN statistics are its own.
    let last = &expected[rounds as usize];
    let mut stats = Vec::new();
    for site in SITES {
        let st = checkpoint::load(&fed.site_dir(site).join("model.safetensors"), &spec).unwrap();
        for t in &st.tensors {
            if !local || !t.kind.is_bn() {
                assert_eq!(t.data, last[&t.name], "{site}: final {}", t.name);
            }
        }
        stats.push(st.filter(unifed_models::state::Select::BnStats));
    }
    if local {
        assert_ne!(stats[0], stats[1]);
        assert_ne!(stats[1], stats[2]);
    }

    // Message counts: one retained manifest per model version; one answer per update, all
    // accepted; every chunk of every version delivered to every site exactly once.
    let manifests: Vec<RoundManifest> = packets
        .iter()
        .filter(|p| p.to_broker && p.topic == "unifed/v1/e2e/manifest")
        .map(|p| {
            assert!(p.retain, "manifests are retained");
            envelope(p).payload_as().unwrap()
        })
        .collect();
    assert_eq!(manifests.len() as u64, rounds + 1, "manifests published");
    assert!(manifests.last().unwrap().finished);
    let acks: Vec<Envelope> = packets
        .iter()
        .filter(|p| p.to_broker && p.topic.starts_with("unifed/v1/e2e/ack/"))
        .map(envelope)
        .collect();
    let answers: Vec<UpdateAnswer> = acks
        .iter()
        .filter(|e| e.kind == MessageKind::UpdateAnswer)
        .map(|e| e.payload_as().unwrap())
        .collect();
    assert_eq!(answers.len(), updates.len(), "answers sent");
    // One receipt per update chunk: the uploads' flow control.
    let receipts = acks
        .iter()
        .filter(|e| e.kind == MessageKind::UpdateReceipt)
        .count();
    assert_eq!(receipts, update_msgs, "receipts sent");
    assert!(answers.iter().all(|a| a.answer == Answer::Accepted));
    // Every chunk of every version went out once on the topic every site reads, and reached
    // each site (a site whose first request came after the others' was sent its own copy of
    // what had gone out before it asked, so a site may have had a chunk twice).
    let per_version: u64 = manifests.iter().map(|m| m.chunk_count as u64).sum::<u64>();
    let mut shared: BTreeMap<([u8; 32], u32), usize> = BTreeMap::new();
    for p in packets
        .iter()
        .filter(|p| p.to_broker && p.topic == "unifed/v1/e2e/chunks/model")
    {
        let c: Chunk = envelope(p).payload_as().unwrap();
        *shared.entry((c.payload_hash, c.index)).or_default() += 1;
    }
    assert_eq!(shared.len() as u64, per_version, "chunks shared");
    assert!(shared.values().all(|&n| n == 1), "a chunk shared twice");
    for site in SITES {
        let got = chunk_msgs.get(site).copied().unwrap_or(0) as u64;
        assert!(
            (per_version..=2 * per_version).contains(&got),
            "{site}: {got} model chunks delivered for {per_version}"
        );
    }
}

#[test]
fn local_bn_three_agents_three_rounds_on_the_embedded_broker() {
    let _one = serial();
    let (_dir, fed, packets) = run(BrokerKind::Embedded, BnPolicy::Local, 32 << 10);
    check(&fed, &packets);
    common::same_as_in_process(&fed, &SITES, unifed_aggregator::Algorithm::FedAvg);
}

#[test]
fn global_bn_three_agents_three_rounds_on_the_embedded_broker() {
    let _one = serial();
    let (_dir, fed, packets) = run(BrokerKind::Embedded, BnPolicy::Global, 32 << 10);
    check(&fed, &packets);
    common::same_as_in_process(&fed, &SITES, unifed_aggregator::Algorithm::FedAvg);
}

#[test]
fn local_bn_three_agents_three_rounds_on_mosquitto() {
    if !mosquitto_available() {
        return;
    }
    let _one = serial();
    let (_dir, fed, packets) = run(BrokerKind::Mosquitto, BnPolicy::Local, 32 << 10);
    check(&fed, &packets);
}

/// Under a lossy encoding the model goes down as deltas over MQTT: each agent fetches the
/// whole model once (version 0) and then only deltas, at least 8x smaller than the model on
/// this small CNN; the sum of the deltas it was sent is, bit for bit, the model it ends with and
/// the whole model the aggregator serves; and the run equals the in-process one.
#[test]
fn under_a_lossy_encoding_agents_fetch_deltas_that_add_up_to_the_model_they_end_with() {
    let _one = serial();
    let enc = Encoding::TopKQ8 { per_mille: 100 };
    let (_dir, fed, packets) = run_with(BrokerKind::Embedded, BnPolicy::Local, 32 << 10, enc);
    let spec = fed.spec();
    let manifests: Vec<RoundManifest> = packets
        .iter()
        .filter(|p| p.to_broker && p.topic == "unifed/v1/e2e/manifest")
        .map(|p| envelope(p).payload_as().unwrap())
        .collect();
    assert_eq!(manifests.len() as u64, fed.rounds + 1);
    assert!(manifests[0].delta.is_none());
    let by_hash = |h: [u8; 32]| {
        manifests
            .iter()
            .find_map(|m| {
                if m.payload_hash == h {
                    Some((m.model_version, false, m.payload_len))
                } else {
                    m.delta
                        .filter(|d| d.payload_hash == h)
                        .map(|_| (m.model_version, true, m.payload_len))
                }
            })
            .expect("a payload some manifest announces")
    };
    for site in SITES {
        let mut r = Reassembler::new(u64::MAX, 1 << 30);
        let mut held: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let mut fetched = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for p in packets.iter().filter(|p| sent_to(p, site)) {
            let c: Chunk = envelope(p).payload_as().unwrap();
            // A payload whose chunks came twice (shared, and sent to the site alone) once.
            if seen.contains(&c.payload_hash) {
                continue;
            }
            let Some(bytes) = r.insert(c.as_ref(), 0).unwrap() else {
                continue;
            };
            seen.insert(c.payload_hash);
            let (v, is_delta, model_len) = by_hash(unifed_protocol::payload_hash(&bytes));
            fetched.push((v, is_delta));
            if is_delta {
                assert!(
                    bytes.len() as u64 * 8 <= model_len,
                    "{site}: delta of v{v} is {} bytes against a model of {model_len}",
                    bytes.len()
                );
                let d: ModelDelta = postcard::from_bytes(&bytes).unwrap();
                assert_eq!(d.from_version + 1, v);
                for t in &d.delta {
                    let add = decode(t).unwrap();
                    let h = held.get_mut(&t.name).unwrap();
                    h.iter_mut().zip(&add).for_each(|(h, a)| *h += a);
                }
            } else {
                let b: ServerBroadcast = postcard::from_bytes(&bytes).unwrap();
                held = b
                    .weights
                    .iter()
                    .map(|t| (t.name.clone(), decode(t).unwrap()))
                    .collect();
            }
        }
        let want: Vec<(u64, bool)> = (0..=fed.rounds).map(|v| (v, v > 0)).collect();
        assert_eq!(fetched, want, "{site}: the whole model once, then deltas");
        let last = checkpoint::load(&fed.site_dir(site).join("model.safetensors"), &spec).unwrap();
        for t in last.tensors.iter().filter(|t| !t.kind.is_bn()) {
            assert_eq!(t.data, held[&t.name], "{site}: final `{}`", t.name);
        }
    }
    common::same_as_in_process(&fed, &SITES, unifed_aggregator::Algorithm::FedAvg);
}

/// A site's status as `key` signs it, sent as `sender`.
fn status(fed: &Fed, key: &unifed_protocol::SigningKey, sender: &str, state: SiteState) -> Vec<u8> {
    let id = |s: &str| unifed_protocol::ids::Id::new(s).unwrap();
    key.sign(&Envelope::new(
        MessageKind::SiteStatus,
        id("e2e"),
        id(sender),
        0,
        0,
        fed.spec().hash(),
        &SiteStatus {
            state,
            detail: String::new(),
        },
    ))
}

#[test]
fn the_aggregator_stops_once_every_site_says_it_holds_the_final_model_and_not_before() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.rounds = 2;
    // Rounds close with two of the three enrolled sites; nothing but the sites' word ends the
    // aggregator's serving of the final model before ten minutes.
    fed.min_sites = 2;
    fed.linger_secs = 600;
    let mut agg = fed.aggregator();
    let mut agents = ["grey", "texture"].map(|s| (s, fed.agent(s)));
    for (s, a) in &mut agents {
        fed.wait_ok(a, s, Duration::from_secs(300));
    }
    // Both said they hold the final model; lowres has not. Its word forged by a stranger, by
    // grey, for another model version, and junk: none of them counts.
    let finished = |v| SiteState::Finished { model_version: v };
    let stranger = unifed_protocol::SigningKey::from_seed([0x42; 32]);
    let forged = [
        status(&fed, &stranger, "lowres", finished(2)),
        status(&fed, &fed.key("grey"), "lowres", finished(2)),
        status(&fed, &fed.key("grey"), "grey", finished(2)),
        status(&fed, &fed.key("lowres"), "lowres", finished(1)),
        b"UFED junk".to_vec(),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let topic = "unifed/v1/e2e/status/lowres";
        let opts = fed.broker().options("stranger", None).unwrap();
        let (client, mut rx) = unifed_net::spawn_event_loop(opts, vec![topic.into()]);
        let mut left: Vec<Vec<u8>> = forged.to_vec();
        let mut sent = false;
        // Each comes back to the stranger's own subscription: the broker has routed it to the
        // aggregator's too.
        while !left.is_empty() {
            match rx.recv().await.expect("the stranger's connection") {
                unifed_net::NetEvent::Subscribed if !sent => {
                    for bytes in &forged {
                        let q = unifed_net::Qos::AtLeastOnce;
                        client
                            .publish(topic, q, false, bytes.clone())
                            .await
                            .unwrap();
                    }
                    sent = true;
                }
                unifed_net::NetEvent::Message { payload, .. } => {
                    left.retain(|b| b[..] != payload[..]);
                }
                _ => {}
            }
        }
    });
    // Had any of them counted, the aggregator would have stopped, and lowres could not fetch
    // the final model it now fetches.
    let mut lowres = fed.agent("lowres");
    fed.wait_ok(&mut lowres, "lowres", Duration::from_secs(300));
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(120));
    let stopped: Vec<Report> = fed
        .reports("agg")
        .into_iter()
        .filter(|r| matches!(r, Report::Stopped { .. }))
        .collect();
    assert_eq!(
        stopped,
        [Report::Stopped {
            model_version: 2,
            every_site: true,
            holding: ["grey", "lowres", "texture"].map(String::from).to_vec(),
        }],
        "{}",
        fed.logs()
    );
    let applied = |r: &Report| matches!(r, Report::Applied { version: 2, .. });
    assert!(fed.reports("lowres").iter().any(applied), "{}", fed.logs());
}
