//! What the site's tests share: keys, models cut into chunks, manifests and messages signed as
//! the aggregator sends them.
#![allow(dead_code)]

use unifed_protocol::SpecHash;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::chunking::{payload_hash, split};
use unifed_protocol::encoding::{Encoding, encode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnPolicy, BnSharing, Chunk, ChunkRequest, DeltaInfo, ModelDelta, RoundManifest, RoundPlan,
    ServerBroadcast, ServerExtras,
};
use unifed_protocol::topics::Topics;
use unifed_site::{Action, EngineConfig, Event, Progress, SiteEngine};

pub const HASH: SpecHash = SpecHash([7; 32]);

pub fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

pub fn topics() -> Topics {
    Topics::new(&id("fed"))
}

/// The test key of `who`: the aggregator's, the site's (`a`) or an attacker's.
pub fn key(who: &str) -> SigningKey {
    SigningKey::from_seed(match who {
        "aggregator" => [1; 32],
        "a" => [2; 32],
        _ => [3; 32],
    })
}

pub fn engine(progress: Option<Progress>) -> SiteEngine {
    SiteEngine::new(
        EngineConfig {
            site: id("a"),
            federation: id("fed"),
            spec_hash: HASH,
            max_packet: 1 << 16,
            resend_ms: 10_000,
            max_model_bytes: 1 << 16,
            key: key("a"),
            aggregator: key("aggregator").public(),
        },
        progress,
    )
}

/// What the site sends for its update: an unsigned envelope (the engine signs it).
pub fn update_envelope() -> Vec<u8> {
    Envelope::new(
        MessageKind::SiteUpdate,
        id("fed"),
        id("a"),
        1,
        0,
        HASH,
        &[1u8, 2, 3],
    )
    .encode()
}

/// Model version `v`: its broadcast payload cut into chunks, and its manifest for `round`.
pub fn model(round: u64, v: u64, sampled: &[&str]) -> (RoundManifest, Vec<Chunk>) {
    model_cut(round, v, sampled, 64)
}

/// [`model`] cut into chunks of `cut` bytes.
pub fn model_cut(round: u64, v: u64, sampled: &[&str], cut: usize) -> (RoundManifest, Vec<Chunk>) {
    let b = ServerBroadcast {
        model_version: v,
        weights: vec![encode(
            "fc.weight",
            &[40],
            &[v as f32 * 0.5; 40],
            Encoding::F32,
            None,
        )],
        extras: ServerExtras::None,
    };
    let payload = postcard::to_allocvec(&b).unwrap();
    let chunks = split(&payload, cut);
    let m = RoundManifest {
        run: Default::default(),
        round,
        model_version: v,
        spec_hash: HASH,
        chunk_count: chunks.len() as u32,
        payload_len: payload.len() as u64,
        payload_hash: payload_hash(&payload),
        delta: None,
        encoding: Encoding::F32,
        bn_policy: BnPolicy::Local,
        bn_sharing: BnSharing::None,
        sampled: sampled.iter().map(|s| id(s)).collect(),
        upload_window_bytes: 2 << 20,
        plan: RoundPlan::default(),
        deadline_ms: 0,
        finished: false,
    };
    (m, chunks)
}

pub fn from(
    sender: &str,
    fed: &str,
    kind: MessageKind,
    round: u64,
    v: u64,
    p: &impl serde::Serialize,
) -> Vec<u8> {
    key(sender).sign(&Envelope::new(kind, id(fed), id(sender), round, v, HASH, p))
}

pub fn agg(kind: MessageKind, round: u64, v: u64, p: &impl serde::Serialize) -> Vec<u8> {
    from("aggregator", "fed", kind, round, v, p)
}

pub fn msg(topic: String, payload: Vec<u8>) -> Event {
    Event::Message {
        topic,
        payload: payload.into(),
    }
}

pub fn manifest_msg(m: &RoundManifest) -> Event {
    msg(
        topics().manifest(),
        agg(MessageKind::RoundManifest, m.round, m.model_version, m),
    )
}

pub fn chunk_msg(m: &RoundManifest, c: &Chunk) -> Event {
    msg(
        topics().chunk_reply(&id("a")),
        agg(MessageKind::ModelChunk, m.round, m.model_version, c),
    )
}

/// Delivers every chunk and returns the actions of the last one.
pub fn deliver(e: &mut SiteEngine, m: &RoundManifest, chunks: &[Chunk]) -> Vec<Action> {
    let mut last = Vec::new();
    for c in chunks {
        last = e.handle(chunk_msg(m, c), 1);
    }
    last
}

/// A new site that follows manifest `m` and receives every chunk of its model: the engine and
/// the actions of the last chunk.
pub fn fetched(m: &RoundManifest, chunks: &[Chunk]) -> (SiteEngine, Vec<Action>) {
    let mut e = engine(None);
    e.handle(manifest_msg(m), 0);
    let acts = deliver(&mut e, m, chunks);
    (e, acts)
}

/// Model version `v` of [`model`] also offered as a q8 delta from `v - 1`: the manifest and
/// the delta's chunks.
pub fn with_delta(round: u64, v: u64) -> (RoundManifest, Vec<Chunk>, Vec<Chunk>) {
    let (mut m, chunks) = model(round, v, &[]);
    let d = ModelDelta {
        from_version: v - 1,
        model_version: v,
        delta: vec![encode("fc.weight", &[40], &[0.5; 40], Encoding::Q8, None)],
        values: vec![],
        extras: ServerExtras::None,
    };
    let payload = postcard::to_allocvec(&d).unwrap();
    let delta_chunks = split(&payload, 16);
    m.encoding = Encoding::Q8;
    m.delta = Some(DeltaInfo {
        from_version: v - 1,
        chunk_count: delta_chunks.len() as u32,
        payload_len: payload.len() as u64,
        payload_hash: payload_hash(&payload),
    });
    (m, chunks, delta_chunks)
}

pub fn request(acts: &[Action]) -> ChunkRequest {
    let [Action::Publish { topic, payload }] = acts else {
        panic!("{acts:?}")
    };
    assert_eq!(topic, &topics().chunk_request(&id("a")));
    Envelope::decode(payload).unwrap().payload_as().unwrap()
}
