//! Sites' update chunks, taken in by threads of their own: each chunk is opened (signature,
//! sender, federation), spooled ([`SpooledUploads`]) and receipted here, so a site's upload
//! window keeps moving while the core's loop spools a whole update or folds a round (a few
//! hundred milliseconds each, during which every site's upload used to wait for its receipts).
//! A complete set goes to the core's loop as a [`Complete`] update. The enrolled sites are
//! spread over up to [`INGEST_SHARDS`] threads ([`spawn_sharded`]): opening and writing a
//! 57 MB upload takes about 40 ms of a core, and on a GPU every site's upload arrives at once.

use crate::core::{Admission, AdmitError};
use crate::uploads::{Received, SpooledUploads, UploadError};
use tokio::sync::{mpsc, watch};
use unifed_net::NetEvent;
use unifed_protocol::envelope::DecodeError;
use unifed_protocol::envelope::MessageKind;
use unifed_protocol::ids::{Id, IdError};
use unifed_protocol::messages::{ChunkRef, UpdateReceipt};

/// Why an update chunk was dropped (logged; the site's window stalls until it re-sends).
#[derive(Debug, thiserror::Error)]
enum Dropped {
    /// Its topic names no valid site.
    #[error("the topic's site: {0}")]
    Site(#[from] IdError),
    /// It was not admitted (signature, sender, federation).
    #[error(transparent)]
    Admit(#[from] AdmitError),
    /// It is another kind of message.
    #[error("a {0:?} message where an update chunk was expected")]
    NotAChunk(MessageKind),
    /// Its payload does not decode as a chunk.
    #[error("its payload: {0}")]
    Payload(#[from] DecodeError),
    /// It is of another round or model version than the open round's (a replay of an
    /// earlier upload, or a re-send after its round closed, of which only the first chunk is
    /// handed on): dropped before it takes any of its site's upload share.
    #[error("of round {round} from v{version}, not the open round's ({open})")]
    NotOpenRound {
        /// The round it names.
        round: u64,
        /// The model version it names.
        version: u64,
        /// The open round and its version, or none.
        open: String,
    },
    /// The upload refused it.
    #[error(transparent)]
    Upload(#[from] UploadError),
}

/// The core's round as the ingest threads see it: chunk sets are taken only of the open round
/// and the model version it trains from; the first chunk of a set of a round that has closed
/// is handed on as a [`Resent`], to be answered from the round's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rounds {
    /// The current round (0 before the first).
    pub round: u64,
    /// The model version it trains from.
    pub version: u64,
    /// Whether it is open (false before the first round and once the federation finished).
    pub open: bool,
}

impl Rounds {
    /// Whether chunks of `round` from model `version` are taken.
    pub fn takes(&self, round: u64, version: u64) -> bool {
        self.open && (self.round, self.version) == (round, version)
    }

    /// Whether `round` has closed (an earlier round, or the last one once finished).
    pub fn closed(&self, round: u64) -> bool {
        round > 0 && (round < self.round || (round == self.round && !self.open))
    }
}

/// The first chunk of a site's upload of a round that closed: a site re-sends an update whose
/// answer it did not get (the aggregator was killed before it answered, or the site was away
/// when it did), and the answer, which settles the site's state, comes from the round's
/// record ([`crate::Event::Resent`]). Only this is handed on: the set takes no disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resent {
    /// The site that signed it (the chunk was admitted).
    pub site: Id,
    /// The closed round it names.
    pub round: u64,
    /// The hash of the update it is the first chunk of.
    pub hash: [u8; 32],
}

/// A site's update whose chunks have all arrived, still on disk: the core's loop reads it
/// when it takes it, so updates waiting for the core cost no memory.
#[derive(Debug)]
pub struct Complete {
    /// The site whose topic it came on.
    pub site: String,
    /// The update envelope's chunk set.
    pub set: Received,
}

/// A receipt to send: the site, and what it acknowledges.
pub type Receipt = (Id, UpdateReceipt);

/// What an ingest thread needs, apart from its input.
pub struct Ingest {
    /// Incomplete uploads.
    pub uploads: SpooledUploads,
    /// How a chunk is opened; the core's loop sends a new one when revocations change.
    pub admission: watch::Receiver<Admission>,
    /// The core's round; the core's loop sends each change.
    pub open: watch::Receiver<Rounds>,
    /// Largest chunk envelope taken.
    pub limit: usize,
    /// The topic prefix of updates (`…/update/`), the site's id after it.
    pub prefix: String,
    /// Where complete updates go: a bounded queue, so sets waiting for the core (files
    /// outside the per-site share of `uploads`) take at most its capacity times a set's
    /// bytes of disk; a full queue holds this thread back until the core takes one.
    pub complete: mpsc::Sender<Complete>,
    /// Where first chunks of closed rounds' uploads go.
    pub resent: ResentQueue,
}

/// The queue of [`Resent`] first chunks to the core: bounded, dropping what does not fit (a
/// re-send is sent again; a flood of replays must not hold an ingest thread back), and handing
/// on the same upload's first chunk at most once a second (an honest site re-sends after its
/// re-send period, a replay flood gets one answer a second per upload it captured).
pub struct ResentQueue {
    tx: mpsc::Sender<Resent>,
    last: std::collections::HashMap<(Id, u64, [u8; 32]), u64>,
}

/// How often the same upload's first chunk is handed on at most.
const RESENT_EVERY_MS: u64 = 1_000;

impl ResentQueue {
    /// A queue into `tx`.
    pub fn new(tx: mpsc::Sender<Resent>) -> ResentQueue {
        ResentQueue {
            tx,
            last: Default::default(),
        }
    }

    /// Hands `r` on at `now_ms` unless the same upload's first chunk went within the last
    /// second or the queue is full.
    fn offer(&mut self, r: Resent, now_ms: u64) {
        let key = (r.site.clone(), r.round, r.hash);
        if self
            .last
            .get(&key)
            .is_some_and(|&t| now_ms.saturating_sub(t) < RESENT_EVERY_MS)
        {
            return;
        }
        if self.last.len() >= 4096 {
            self.last
                .retain(|_, t| now_ms.saturating_sub(*t) < RESENT_EVERY_MS);
        }
        if self.tx.try_send(r).is_ok() {
            self.last.insert(key, now_ms);
        }
    }
}

/// What became of a chunk that was not dropped.
enum Taken {
    /// Spooled: its receipt, and its set when it completed one.
    Chunk(Id, UpdateReceipt, Option<Received>),
    /// The first chunk of an upload of a closed round, handed on to be answered.
    Resent,
}

impl Ingest {
    /// Takes in the update chunks of `input` until it or the core's loop is gone; `receipt`
    /// sends each receipt (an error ends it, and with it every ingest thread and the service).
    pub async fn run<F, Fut>(mut self, mut input: mpsc::UnboundedReceiver<NetEvent>, receipt: F)
    where
        F: Fn(Receipt) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        while let Some(ev) = input.recv().await {
            let NetEvent::Message { topic, payload } = ev else {
                continue;
            };
            let Some(site) = topic.strip_prefix(&self.prefix) else {
                continue;
            };
            let now = crate::clock::now_ms();
            // A chunk is checked before it takes any disk: signature, sender, federation.
            let opened = {
                let admission = self.admission.borrow();
                Id::new(site).map_err(Dropped::from).and_then(|id| {
                    let env = admission.admit(&id, &payload, self.limit)?;
                    Ok((id, env))
                })
            };
            let taken = opened.and_then(|(id, env)| {
                // Only a chunk's bytes are its update's: the core takes a complete set as
                // signed in its chunks (`Arrival::SignedChunks`).
                if env.kind != MessageKind::UpdateChunk {
                    return Err(Dropped::NotAChunk(env.kind));
                }
                let rounds = *self.open.borrow();
                let c = env.payload_as::<ChunkRef>()?;
                if !rounds.takes(env.round, env.model_version) {
                    if rounds.closed(env.round) && c.index == 0 {
                        let resent = Resent {
                            site: id,
                            round: env.round,
                            hash: c.payload_hash,
                        };
                        self.resent.offer(resent, now);
                        return Ok(Taken::Resent);
                    }
                    return Err(Dropped::NotOpenRound {
                        round: env.round,
                        version: env.model_version,
                        open: if rounds.open {
                            format!("round {} from v{}", rounds.round, rounds.version)
                        } else {
                            "none".into()
                        },
                    });
                }
                let r = UpdateReceipt {
                    round: env.round,
                    payload_hash: c.payload_hash,
                    index: c.index,
                };
                // Inline: one positioned write of a chunk into the page cache (a quarter of a
                // millisecond), on a thread that does nothing else.
                let done = self.uploads.insert(&id, c, now)?;
                Ok(Taken::Chunk(id, r, done))
            });
            self.uploads.expire(now);
            match taken {
                Ok(Taken::Resent) => {}
                Ok(Taken::Chunk(id, r, done)) => {
                    // Receipt first: the site's upload window moves on.
                    if let Err(e) = receipt((id, r)).await {
                        tracing::error!(error = %e, "update receipts cannot be sent; taking no more chunks");
                        return;
                    }
                    if let Some(set) = done {
                        let done = Complete {
                            site: site.to_string(),
                            set,
                        };
                        if self.complete.send(done).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => tracing::warn!(site, error = %e, "update chunk dropped"),
            }
        }
    }
}

/// The most threads [`spawn_sharded`] takes chunks on.
pub const INGEST_SHARDS: usize = 4;

/// Which ingest thread takes each site's chunks: the enrolled sites in turn, fixed at start
/// (no state that a flood of made-up topics could grow; their chunks go to the first thread,
/// whose admission drops them).
#[derive(Debug, Clone)]
pub struct Shards {
    of: std::collections::BTreeMap<String, usize>,
    count: usize,
}

impl Shards {
    /// The threads a federation of the enrolled `sites` gets: one per core, at most one per
    /// site and at most [`INGEST_SHARDS`].
    pub fn for_sites(sites: &[String]) -> Shards {
        Shards::new(sites, crate::threads_up_to(INGEST_SHARDS.min(sites.len())))
    }

    /// `count` threads (at least one) for the enrolled `sites`, taken in turn.
    pub fn new(sites: &[String], count: usize) -> Shards {
        let count = count.max(1);
        Shards {
            of: sites
                .iter()
                .enumerate()
                .map(|(i, s)| (s.clone(), i % count))
                .collect(),
            count,
        }
    }

    /// The thread that takes `site`'s chunks.
    pub fn of(&self, site: &str) -> usize {
        self.of.get(site).copied().unwrap_or(0)
    }

    /// How many threads there are.
    pub fn count(&self) -> usize {
        self.count
    }
}

/// Runs each of `ingests` (one per shard of `shards`, their `prefix`es the same) on a thread of
/// its own, and routes the chunks of `input` to them by the site of their topic from a task on
/// the caller's runtime; `receipt` sends each thread's receipts. The threads end when `input`
/// does, when the core's loop is gone, or when one of them stops (its receipts could not be
/// sent): then all do, and the core's loop sees its updates' channel close.
pub fn spawn_sharded<F, Fut>(
    ingests: Vec<Ingest>,
    shards: Shards,
    mut input: mpsc::UnboundedReceiver<NetEvent>,
    receipt: F,
) -> std::io::Result<()>
where
    F: Fn(Receipt) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let Some(prefix) = ingests.first().map(|i| i.prefix.clone()) else {
        return Ok(());
    };
    assert_eq!(ingests.len(), shards.count(), "one ingest per shard");
    let (stopped_tx, mut stopped) = mpsc::unbounded_channel::<usize>();
    let mut inputs = Vec::with_capacity(ingests.len());
    for (k, ingest) in ingests.into_iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (receipt, stopped_tx) = (receipt.clone(), stopped_tx.clone());
        std::thread::Builder::new()
            .name(format!("ingest-{k}"))
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(ingest.run(rx, receipt)),
                    Err(e) => tracing::error!(error = %e, "ingest thread {k} has no runtime"),
                }
                let _ = stopped_tx.send(k);
            })?;
        inputs.push(tx);
    }
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                ev = input.recv() => ev,
                Some(k) = stopped.recv() => {
                    tracing::error!("ingest thread {k} stopped; taking no more update chunks");
                    None
                }
            };
            let Some(ev) = ev else {
                return;
            };
            let NetEvent::Message { topic, .. } = &ev else {
                continue;
            };
            let k = topic
                .strip_prefix(&prefix)
                .map_or(0, |site| shards.of(site));
            if inputs[k].send(ev).is_err() {
                return;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use unifed_protocol::SpecHash;
    use unifed_protocol::auth::{Keyring, SigningKey};
    use unifed_protocol::chunking::{chunks, payload_hash};
    use unifed_protocol::envelope::Envelope;
    use unifed_protocol::messages::Chunk;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    /// Round 1 open, from model version 0.
    const OPEN: Rounds = Rounds {
        round: 1,
        version: 0,
        open: true,
    };

    /// `n` ingests of the sites `keys` enrol (`u/<site>` topics), spooling under `dir`, and
    /// the channel their complete sets come out of.
    fn ingests(
        dir: &std::path::Path,
        keys: &[(&str, &SigningKey)],
        n: usize,
    ) -> (Vec<Ingest>, mpsc::Receiver<Complete>) {
        let mut ring = Keyring::default();
        for (s, k) in keys {
            ring.enrol(id(s), k.public());
        }
        let (_admit_tx, admission) = watch::channel(Admission::new(ring, id("fed")));
        let (_open_tx, open) = watch::channel(OPEN);
        let (complete, completed) = mpsc::channel(16);
        let (resent, _) = mpsc::channel(16);
        let ingests = (0..n)
            .map(|k| Ingest {
                uploads: SpooledUploads::open(&dir.join(k.to_string()), 1 << 20, 60_000).unwrap(),
                admission: admission.clone(),
                open: open.clone(),
                limit: 1 << 20,
                prefix: "u/".into(),
                complete: complete.clone(),
                resent: ResentQueue::new(resent.clone()),
            })
            .collect();
        (ingests, completed)
    }

    /// Only update chunks signed by the site of their topic, of the open round and version, are
    /// kept and receipted, whatever else the site signed: a set completes from them alone and
    /// goes to the core.
    #[test]
    fn only_the_topic_sites_update_chunks_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        let key = SigningKey::from_seed([5; 32]);
        let mut ring = Keyring::default();
        ring.enrol(id("a"), key.public());
        let (_admit_tx, admission) = watch::channel(Admission::new(ring, id("fed")));
        let (_open_tx, open) = watch::channel(OPEN);
        let (complete, mut completed) = mpsc::channel(4);
        let (resent, mut resents) = mpsc::channel(4);
        let ingest = Ingest {
            uploads: SpooledUploads::open(&dir.path().join("in"), 1 << 20, 60_000).unwrap(),
            admission,
            open,
            limit: 1 << 20,
            prefix: "u/".into(),
            complete,
            resent: ResentQueue::new(resent),
        };
        fn sign_at<T: serde::Serialize>(
            kind: MessageKind,
            k: &SigningKey,
            (round, version): (u64, u64),
            body: &T,
        ) -> Vec<u8> {
            let fed = Id::new("fed").unwrap();
            let a = Id::new("a").unwrap();
            k.sign(&Envelope::new(
                kind,
                fed,
                a,
                round,
                version,
                SpecHash([3; 32]),
                body,
            ))
        }
        fn sign<T: serde::Serialize>(kind: MessageKind, k: &SigningKey, body: &T) -> Vec<u8> {
            sign_at(kind, k, (1, 0), body)
        }
        let payload: Vec<u8> = (0..3_000).map(|i| (i % 251) as u8).collect();
        let other = SigningKey::from_seed([6; 32]);
        // A chunk of other bytes in a message of another kind the site signed, sent on its
        // update topic: not an update chunk.
        let mut first = chunks(&payload, 1_000).next().unwrap();
        first.data[0] ^= 1;
        let mut input = vec![("u/a", sign(MessageKind::ModelChunk, &key, &first))];
        // The site's own chunks of another upload, of a round or version that is not open (a
        // replay of an earlier upload): dropped before they open a set.
        let earlier: Vec<u8> = payload.iter().map(|b| b ^ 0x55).collect();
        for at in [(0, 0), (2, 0), (1, 1)] {
            for c in chunks(&earlier, 1_000) {
                input.push(("u/a", sign_at(MessageKind::UpdateChunk, &key, at, &c)));
            }
        }
        for c in chunks(&payload, 1_000) {
            // Signed by another key, and on another site's topic: refused.
            input.push(("u/a", sign(MessageKind::UpdateChunk, &other, &c)));
            input.push(("u/b", sign(MessageKind::UpdateChunk, &key, &c)));
            input.push(("u/a", sign(MessageKind::UpdateChunk, &key, &c)));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        for (topic, payload) in input {
            tx.send(NetEvent::Message {
                topic: topic.into(),
                payload: payload.into(),
            })
            .unwrap();
        }
        drop(tx);
        let receipts = std::sync::Mutex::new(Vec::new());
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(ingest.run(rx, |(site, r)| {
                receipts.lock().unwrap().push((site.to_string(), r.index));
                async { Ok(()) }
            }));
        assert_eq!(
            receipts.into_inner().unwrap(),
            vec![
                ("a".to_string(), 0),
                ("a".to_string(), 1),
                ("a".to_string(), 2)
            ]
        );
        let done = completed.try_recv().unwrap();
        assert_eq!(done.site, "a");
        assert_eq!(done.set.hash(), payload_hash(&payload));
        assert_eq!(done.set.read().unwrap(), payload);
        assert!(completed.try_recv().is_err());
        // None of them was of a round that closed.
        assert!(resents.try_recv().is_err());
    }

    /// Once its round has closed, a set's first chunk (and only it) is handed on to be
    /// answered, once a second however often it comes, up to the queue's room; nothing is
    /// receipted or spooled. Before the first round nothing has closed.
    #[test]
    fn the_first_chunk_of_a_closed_rounds_upload_is_handed_on_and_nothing_kept() {
        let key = SigningKey::from_seed([5; 32]);
        let payload: Vec<u8> = (0..3_000).map(|i| (i % 251) as u8).collect();
        let signed = |round: u64, c: &Chunk| {
            key.sign(&Envelope::new(
                MessageKind::UpdateChunk,
                id("fed"),
                id("a"),
                round,
                round - 1,
                SpecHash([3; 32]),
                c,
            ))
        };
        let run = |rounds: Rounds, input: Vec<Vec<u8>>| {
            let dir = tempfile::tempdir().unwrap();
            let (mut ingests, mut completed) = ingests(dir.path(), &[("a", &key)], 1);
            let mut ingest = ingests.pop().unwrap();
            let (resent, mut resents) = mpsc::channel(3);
            ingest.resent = ResentQueue::new(resent);
            ingest.open = watch::channel(rounds).1;
            let (tx, rx) = mpsc::unbounded_channel();
            for payload in input {
                let topic = "u/a".into();
                tx.send(NetEvent::Message {
                    topic,
                    payload: payload.into(),
                })
                .unwrap();
            }
            drop(tx);
            let receipts = std::sync::Mutex::new(0);
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(ingest.run(rx, |_| {
                    *receipts.lock().unwrap() += 1;
                    async { Ok(()) }
                }));
            assert_eq!(*receipts.lock().unwrap(), 0);
            assert!(completed.try_recv().is_err());
            let spooled = walk(dir.path());
            let mut got = Vec::new();
            while let Ok(r) = resents.try_recv() {
                got.push(r);
            }
            (got, spooled)
        };
        // Round 2 of 3 open: round 1 closed. Its whole set, five times over within a second:
        // its first chunk is handed on once.
        let all: Vec<Chunk> = chunks(&payload, 1_000).collect();
        let mut input = Vec::new();
        for _ in 0..5 {
            input.extend(all.iter().map(|c| signed(1, c)));
        }
        let open = Rounds {
            round: 2,
            version: 1,
            open: true,
        };
        let (got, spooled) = run(open, input.clone());
        let want = Resent {
            site: id("a"),
            round: 1,
            hash: payload_hash(&payload),
        };
        assert_eq!(got, vec![want.clone()]);
        assert_eq!(spooled, 0);
        // The first chunks of five different uploads: the queue holds three.
        let firsts = (0..5u8)
            .map(|k| {
                let mut p = payload.clone();
                p[0] = k;
                signed(1, &chunks(&p, 1_000).next().unwrap())
            })
            .collect();
        assert_eq!(run(open, firsts).0.len(), 3);
        // Finished after round 1: it closed too.
        let finished = Rounds {
            round: 1,
            version: 0,
            open: false,
        };
        assert_eq!(run(finished, input.clone()).0.len(), 1);
        // Before the first round it has not; and the set's other chunks are dropped.
        assert_eq!(run(Rounds::default(), input.clone()), (vec![], 0));
        let rest = all[1..].iter().map(|c| signed(1, c)).collect();
        assert_eq!(run(open, rest), (vec![], 0));
    }

    /// Files under `dir`, at any depth.
    fn walk(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    walk(&e.path())
                } else {
                    1
                }
            })
            .sum()
    }

    /// Chunks of six sites, interleaved as uploads that arrive at once, taken on three threads:
    /// every site's chunks on the thread of its shard, receipted in order, every set complete.
    #[test]
    fn sites_are_taken_on_the_threads_of_their_shards() {
        let dir = tempfile::tempdir().unwrap();
        let sites = ["a", "b", "c", "d", "e", "f"];
        let n = 3;
        let keys: Vec<SigningKey> = (0..sites.len())
            .map(|i| SigningKey::from_seed([i as u8 + 1; 32]))
            .collect();
        let enrolling: Vec<(&str, &SigningKey)> = sites.iter().copied().zip(&keys).collect();
        let (ingests, mut completed) = ingests(dir.path(), &enrolling, n);
        let enrolled: Vec<String> = sites.iter().map(|s| s.to_string()).collect();
        let shards = Shards::new(&enrolled, n);
        // The enrolled sites in turn: two a thread.
        let shard: BTreeMap<&str, usize> = sites.iter().map(|s| (*s, shards.of(s))).collect();
        assert_eq!(
            shard.values().copied().collect::<Vec<_>>(),
            [0, 1, 2, 0, 1, 2]
        );
        // A site nobody enrolled goes to the first thread.
        assert_eq!(shards.of("mallory"), 0);
        let payloads: Vec<Vec<u8>> = (0..sites.len())
            .map(|i| (0..5_000).map(|j| ((i * 7 + j) % 251) as u8).collect())
            .collect();
        let (tx, rx) = mpsc::unbounded_channel();
        for c in 0..5 {
            for ((s, k), p) in sites.iter().zip(&keys).zip(&payloads) {
                let chunk = chunks(p, 1_000).nth(c).unwrap();
                let fed = id("fed");
                let env = Envelope::new(
                    MessageKind::UpdateChunk,
                    fed,
                    id(s),
                    1,
                    0,
                    SpecHash([3; 32]),
                    &chunk,
                );
                tx.send(NetEvent::Message {
                    topic: format!("u/{s}"),
                    payload: k.sign(&env).into(),
                })
                .unwrap();
            }
        }
        drop(tx);
        let receipts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = receipts.clone();
        let done = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap()
            .block_on(async move {
                spawn_sharded(ingests, shards, rx, move |(site, r): Receipt| {
                    let thread = std::thread::current().name().map(String::from);
                    seen.lock()
                        .unwrap()
                        .push((site.to_string(), r.index, thread));
                    async { Ok(()) }
                })
                .unwrap();
                let mut done = Vec::new();
                while let Some(c) = completed.recv().await {
                    done.push(c);
                }
                done
            });
        let receipts = receipts.lock().unwrap().clone();
        for (s, p) in sites.iter().zip(&payloads) {
            let thread = Some(format!("ingest-{}", shard[s]));
            let mine: Vec<(u32, Option<String>)> = receipts
                .iter()
                .filter(|r| r.0 == *s)
                .map(|r| (r.1, r.2.clone()))
                .collect();
            let want: Vec<(u32, Option<String>)> = (0..5).map(|i| (i, thread.clone())).collect();
            assert_eq!(mine, want, "{s}");
            let set = done.iter().find(|c| c.site == *s).unwrap();
            assert_eq!(set.set.hash(), payload_hash(p), "{s}");
            assert_eq!(set.set.read().unwrap(), *p, "{s}");
        }
        assert_eq!(done.len(), sites.len());
    }

    /// A thread whose receipts cannot be sent stops, and with it every other thread, while the
    /// input is still open: the core's loop sees its updates' channel close at once.
    #[test]
    fn a_thread_that_stops_stops_them_all() {
        let dir = tempfile::tempdir().unwrap();
        let key = SigningKey::from_seed([5; 32]);
        let (ingests, mut completed) = ingests(dir.path(), &[("a", &key)], 2);
        let shards = Shards::new(&["a".to_string(), "b".to_string()], 2);
        let payload: Vec<u8> = (0..3_000).map(|i| (i % 251) as u8).collect();
        let chunk = chunks(&payload, 1_000).next().unwrap();
        let env = Envelope::new(
            MessageKind::UpdateChunk,
            id("fed"),
            id("a"),
            1,
            0,
            SpecHash([3; 32]),
            &chunk,
        );
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(NetEvent::Message {
            topic: "u/a".into(),
            payload: key.sign(&env).into(),
        })
        .unwrap();
        let closed = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                spawn_sharded(ingests, shards, rx, |_: Receipt| async {
                    anyhow::bail!("the MQTT client is gone")
                })
                .unwrap();
                let closed =
                    tokio::time::timeout(std::time::Duration::from_secs(30), completed.recv())
                        .await;
                // The input stays open until here.
                drop(tx);
                closed
            });
        assert!(matches!(closed, Ok(None)), "{closed:?}");
    }
}
