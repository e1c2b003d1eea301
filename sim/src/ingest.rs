//! How fast the aggregator takes in uploads that arrive at once, as on a GPU where every site
//! finishes training within milliseconds: each site's full-size f32 update signed in chunks as
//! an agent cuts them, the sites' chunks interleaved, through the service's ingest threads
//! ([`unifed_aggregator::ingest::spawn_sharded`]: signature checks, the spool to disk with its
//! writeback, a signed receipt per chunk), until every set is complete.

use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::path::Path;
use unifed_aggregator::core::Admission;
use unifed_aggregator::ingest::{Ingest, Shards, spawn_sharded};
use unifed_aggregator::uploads::SpooledUploads;
use unifed_net::NetEvent;
use unifed_protocol::SpecHash;
use unifed_protocol::auth::{Keyring, SigningKey};
use unifed_protocol::chunking::{CHUNK_BYTES, chunks};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::UpdateReceipt;

/// One measurement: `sites` uploads of `update_bytes` taken in on `shards` threads.
#[derive(Debug, Clone, Serialize)]
pub struct IngestRow {
    /// Ingest threads.
    pub shards: usize,
    /// Uploads arriving at once.
    pub sites: usize,
    /// How many sites each thread took.
    pub sites_per_shard: Vec<usize>,
    /// Bytes of each upload.
    pub update_bytes: usize,
    /// Seconds from the first chunk handed over to the last set complete, each repeat.
    pub seconds: Vec<f64>,
}

/// Takes in `sites` uploads of `update_bytes` each on `shards` threads, spooled under `dir`;
/// returns the seconds from the first chunk to the last complete set.
pub fn measure(sites: usize, shards: usize, update_bytes: usize, dir: &Path) -> Result<f64> {
    if sites == 0 || shards == 0 {
        bail!("at least one site and one shard");
    }
    let id = |s: &str| Id::new(s).map_err(|e| anyhow::anyhow!("{e}"));
    let names: Vec<String> = (0..sites).map(|i| format!("site-{i:03}")).collect();
    let keys: Vec<SigningKey> = (0..sites)
        .map(|i| SigningKey::from_seed([i as u8 + 1; 32]))
        .collect();
    let mut ring = Keyring::default();
    for (s, k) in names.iter().zip(&keys) {
        ring.enrol(id(s)?, k.public());
    }
    let fed = id("ingest")?;
    let (_admit, admission) = tokio::sync::watch::channel(Admission::new(ring, fed.clone()));
    // Round 1 from version 0 is open, as the chunks below say.
    let (_open, open) = tokio::sync::watch::channel(unifed_aggregator::ingest::Rounds {
        round: 1,
        version: 0,
        open: true,
    });
    let (complete, mut completed) = tokio::sync::mpsc::channel(2 * sites);
    let (resent, _) = tokio::sync::mpsc::channel(1);
    let work =
        tempfile::tempdir_in(dir).with_context(|| format!("a folder in {}", dir.display()))?;
    let mut ingests = Vec::with_capacity(shards);
    for k in 0..shards {
        ingests.push(Ingest {
            uploads: SpooledUploads::open(
                &work.path().join(k.to_string()),
                2 * update_bytes as u64,
                600_000,
            )?,
            admission: admission.clone(),
            open: open.clone(),
            limit: CHUNK_BYTES + 4096,
            prefix: "u/".into(),
            complete: complete.clone(),
            resent: unifed_aggregator::ingest::ResentQueue::new(resent.clone()),
        });
    }
    drop(complete);
    // Every chunk signed beforehand, as the agents send them.
    let mut signed: Vec<Vec<Vec<u8>>> = Vec::with_capacity(sites);
    for (i, (s, k)) in names.iter().zip(&keys).enumerate() {
        let payload: Vec<u8> = (0..update_bytes)
            .map(|j| (j.wrapping_mul(31) ^ i) as u8)
            .collect();
        let site = id(s)?;
        signed.push(
            chunks(&payload, CHUNK_BYTES)
                .map(|c| {
                    k.sign(&Envelope::new(
                        MessageKind::UpdateChunk,
                        fed.clone(),
                        site.clone(),
                        1,
                        0,
                        SpecHash([0; 32]),
                        &c,
                    ))
                })
                .collect(),
        );
    }
    let shards = Shards::new(&names, shards);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let count = signed[0].len();
    for c in 0..count {
        for (s, v) in names.iter().zip(&mut signed) {
            let payload = std::mem::take(&mut v[c]);
            tx.send(NetEvent::Message {
                topic: format!("u/{s}"),
                payload: payload.into(),
            })
            .map_err(|_| anyhow::anyhow!("the ingest's input closed"))?;
        }
    }
    drop((tx, signed));
    // Receipts are signed as the service signs them; sending them is the MQTT client's work.
    let receipt_key = SigningKey::from_seed([0xAA; 32]);
    let started = std::time::Instant::now();
    let done = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()?
        .block_on(async move {
            spawn_sharded(
                ingests,
                shards,
                rx,
                move |(site, r): (Id, UpdateReceipt)| {
                    let env = Envelope::new(
                        MessageKind::UpdateReceipt,
                        Id::new("ingest").expect("valid"),
                        site,
                        r.round,
                        0,
                        SpecHash([0; 32]),
                        &r,
                    );
                    std::hint::black_box(receipt_key.sign(&env));
                    async { Ok(()) }
                },
            )?;
            let mut done = 0;
            while completed.recv().await.is_some() {
                done += 1;
            }
            anyhow::Ok(done)
        })?;
    let seconds = started.elapsed().as_secs_f64();
    if done != sites {
        bail!("{done} of {sites} uploads completed");
    }
    Ok(seconds)
}

/// How many of `sites` sites each of `shards` threads takes.
pub fn sites_per_shard(sites: usize, shards: usize) -> Vec<usize> {
    let names: Vec<String> = (0..sites).map(|i| format!("site-{i:03}")).collect();
    let map = Shards::new(&names, shards);
    let mut per = vec![0; map.count()];
    for s in &names {
        per[map.of(s)] += 1;
    }
    per
}
