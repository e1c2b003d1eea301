//! How a site's update reaches the aggregator. An update that fits one MQTT packet is sent
//! whole and re-sent until answered. A larger one is cut into `UpdateChunk` messages sent
//! through a window: at most [`WINDOW`] chunks without an `UpdateReceipt` are in flight, so the
//! broker never holds more than a few of a site's chunks for the aggregator. rumqttd keeps a
//! bounded log per subscription and skips what a slow subscriber has not read, so an unpaced
//! 57 MB upload from five sites at once loses chunks. A chunk without a receipt is sent again
//! after [`CHUNK_TIMEOUT`] (at once after a reconnect); if all chunks have receipts but no
//! answer comes within the re-send interval, the whole update goes again.

use anyhow::Result;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use unifed_net::{Client, Qos};
use unifed_protocol::SpecHash;
use unifed_protocol::chunking::{payload_hash, split};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{RoundManifest, UpdateReceipt};

/// Chunks of one update in flight without a receipt.
pub const WINDOW: usize = 4;
/// Largest update chunk: small enough that a window of every site fits a broker's log.
pub const MAX_CHUNK: usize = 256 << 10;
/// A chunk without a receipt for this long is sent again.
pub const CHUNK_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a site's updates go.
pub struct Uplink {
    /// The MQTT client.
    pub client: Client,
    /// The site's update topic.
    pub topic: String,
    /// Federation id.
    pub fed: Id,
    /// This site.
    pub site: Id,
    /// The model's spec hash.
    pub hash: SpecHash,
    /// Largest MQTT packet the broker takes.
    pub max_packet: usize,
}

/// One update on its way.
pub struct Upload {
    /// The round it is for.
    pub round: u64,
    len: usize,
    bytes: Vec<u8>,
    payload_hash: [u8; 32],
    /// Encoded chunk envelopes; empty when the update goes whole.
    chunks: Vec<Vec<u8>>,
    next: usize,
    inflight: BTreeMap<u32, Option<Instant>>,
    last_progress: Option<Instant>,
}

impl Upload {
    /// Bytes of the update envelope.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the update is empty (never: an envelope has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// MQTT messages one complete send takes.
    pub fn messages(&self) -> usize {
        self.chunks.len().max(1)
    }

    /// The aggregator holds a chunk.
    pub fn receipt(&mut self, r: &UpdateReceipt) {
        if r.payload_hash == self.payload_hash && self.inflight.remove(&r.index).is_some() {
            self.last_progress = Some(Instant::now());
        }
    }

    /// The connection was re-established: what was in flight is sent again now.
    pub fn reconnected(&mut self) {
        for t in self.inflight.values_mut() {
            *t = None;
        }
        if self.chunks.is_empty() {
            self.last_progress = None;
        }
    }
}

impl Uplink {
    /// Prepares the update envelope `bytes` for the round of `m`.
    pub fn start(&self, m: &RoundManifest, bytes: Vec<u8>) -> Upload {
        let limit = self.max_packet.saturating_sub(4096).max(1024);
        let chunks = if bytes.len() <= limit {
            Vec::new()
        } else {
            split(&bytes, (limit - 512).min(MAX_CHUNK))
                .into_iter()
                .map(|c| {
                    Envelope::new(
                        MessageKind::UpdateChunk,
                        self.fed.clone(),
                        self.site.clone(),
                        m.round,
                        m.model_version,
                        self.hash,
                        &c,
                    )
                    .encode()
                })
                .collect()
        };
        Upload {
            round: m.round,
            payload_hash: payload_hash(&bytes),
            len: bytes.len(),
            // A chunked update lives in its chunks only (no second copy of the whole).
            bytes: if chunks.is_empty() { bytes } else { Vec::new() },
            chunks,
            next: 0,
            inflight: BTreeMap::new(),
            last_progress: None,
        }
    }

    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        self.client
            .publish(self.topic.clone(), Qos::AtLeastOnce, false, payload)
            .await?;
        Ok(())
    }

    /// Sends what is due: the whole update if unanswered for `resend`, or chunks to fill the
    /// window, re-sending those whose receipt is overdue.
    pub async fn pump(&self, up: &mut Upload, resend: Duration) -> Result<()> {
        let now = Instant::now();
        if up.chunks.is_empty() {
            if up.last_progress.is_none_or(|t| now - t > resend) {
                self.publish(up.bytes.clone()).await?;
                up.last_progress = Some(now);
            }
            return Ok(());
        }
        if up.next == up.chunks.len()
            && up.inflight.is_empty()
            && up.last_progress.is_none_or(|t| now - t > resend)
        {
            // Every chunk has a receipt but no answer came: send the update again.
            up.next = 0;
        }
        let due: Vec<u32> = up
            .inflight
            .iter()
            .filter(|(_, t)| t.is_none_or(|t| now - t > CHUNK_TIMEOUT))
            .map(|(&i, _)| i)
            .collect();
        for i in due {
            self.publish(up.chunks[i as usize].clone()).await?;
            up.inflight.insert(i, Some(now));
        }
        while up.inflight.len() < WINDOW && up.next < up.chunks.len() {
            let i = up.next as u32;
            self.publish(up.chunks[up.next].clone()).await?;
            up.inflight.insert(i, Some(now));
            up.next += 1;
        }
        Ok(())
    }
}
