//! How a site's update reaches the aggregator, without I/O. An update that fits one MQTT packet
//! is sent whole and re-sent until answered. A larger one is cut into `UpdateChunk` messages
//! sent through a window: at most the round manifest's `upload_window_bytes` of chunks without an
//! `UpdateReceipt` are in flight (the aggregator's share of the broker's log for each sampled
//! site), so the broker never holds more of a site's chunks for the aggregator than it keeps.
//! rumqttd keeps a bounded log per subscription and skips what a slow subscriber has not read, so an unpaced
//! 57 MB upload from five sites at once loses chunks. A chunk without a receipt is sent again
//! after [`CHUNK_TIMEOUT_MS`] (at once after a reconnect); if all chunks have receipts but no
//! answer comes within the re-send interval, the whole update goes again.

use std::collections::BTreeMap;
use unifed_protocol::SpecHash;
use unifed_protocol::auth::SigningKey;
use unifed_protocol::chunking::{chunks, payload_hash};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::UpdateReceipt;

/// Largest update chunk: small enough that a window of every site fits a broker's log.
pub const MAX_CHUNK: usize = 256 << 10;
/// A chunk without a receipt for this long (ms) is sent again.
pub const CHUNK_TIMEOUT_MS: u64 = 10_000;

/// One update on its way.
#[derive(Debug)]
pub struct Upload {
    /// The round it is for.
    pub round: u64,
    len: usize,
    bytes: Vec<u8>,
    payload_hash: [u8; 32],
    /// Encoded chunk envelopes; empty when the update goes whole.
    chunks: Vec<Vec<u8>>,
    next: usize,
    /// Chunks in flight without a receipt at most (at least 1).
    window: usize,
    inflight: BTreeMap<u32, Option<u64>>,
    last_progress: Option<u64>,
}

impl Upload {
    /// Prepares the signed update envelope `bytes` of `round` (trained from `version`) for a
    /// broker whose packet limit is `max_packet`, with at most `window_bytes` of chunks
    /// without a receipt (at least one chunk); chunks are signed with `key` too, so the
    /// aggregator checks each before it holds any.
    pub fn new(
        (federation, site, hash): (&Id, &Id, SpecHash),
        key: &SigningKey,
        round: u64,
        version: u64,
        bytes: Vec<u8>,
        max_packet: usize,
        window_bytes: usize,
    ) -> Upload {
        let limit = max_packet.saturating_sub(4096).max(1024);
        // The update's hash: `chunks` computes it for its chunks, so it is not computed again.
        let (update_hash, chunks) = if bytes.len() <= limit {
            (payload_hash(&bytes), Vec::new())
        } else {
            let cut = chunks(&bytes, (limit - 512).min(MAX_CHUNK));
            let update_hash = cut.payload_hash();
            let signed = cut
                .map(|c| {
                    key.sign(&Envelope::new(
                        MessageKind::UpdateChunk,
                        federation.clone(),
                        site.clone(),
                        round,
                        version,
                        hash,
                        &c,
                    ))
                })
                .collect();
            (update_hash, signed)
        };
        let window = chunks
            .first()
            .map_or(1, |c| (window_bytes / c.len().max(1)).max(1));
        Upload {
            round,
            payload_hash: update_hash,
            len: bytes.len(),
            // A chunked update lives in its chunks only (no second copy of the whole).
            bytes: if chunks.is_empty() { bytes } else { Vec::new() },
            chunks,
            next: 0,
            window,
            inflight: BTreeMap::new(),
            last_progress: None,
        }
    }

    /// Bytes of the update envelope.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the update is empty (never: an envelope has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Hash of the update envelope (what the aggregator's answer names).
    pub fn hash(&self) -> [u8; 32] {
        self.payload_hash
    }

    /// MQTT messages one complete send takes.
    pub fn messages(&self) -> usize {
        self.chunks.len().max(1)
    }

    /// The aggregator holds a chunk.
    pub fn receipt(&mut self, r: &UpdateReceipt, now_ms: u64) {
        if r.payload_hash == self.payload_hash && self.inflight.remove(&r.index).is_some() {
            self.last_progress = Some(now_ms);
        }
    }

    /// The aggregator asked for the update again (its stored copy was damaged): every byte
    /// goes out again from the start.
    pub fn restart(&mut self) {
        self.next = 0;
        self.inflight.clear();
        self.last_progress = None;
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

    /// What is due at `now_ms`: the whole update if unanswered for `resend_ms`, or chunks to
    /// fill the window, re-sending those whose receipt is overdue.
    pub fn pump(&mut self, now_ms: u64, resend_ms: u64) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let overdue =
            |t: Option<u64>, limit: u64| t.is_none_or(|t| now_ms.saturating_sub(t) > limit);
        if self.chunks.is_empty() {
            if overdue(self.last_progress, resend_ms) {
                out.push(self.bytes.clone());
                self.last_progress = Some(now_ms);
            }
            return out;
        }
        if self.next == self.chunks.len()
            && self.inflight.is_empty()
            && overdue(self.last_progress, resend_ms)
        {
            // Every chunk has a receipt but no answer came: send the update again.
            self.next = 0;
        }
        let due: Vec<u32> = self
            .inflight
            .iter()
            .filter(|(_, t)| overdue(**t, CHUNK_TIMEOUT_MS))
            .map(|(&i, _)| i)
            .collect();
        for i in due {
            out.push(self.chunks[i as usize].clone());
            self.inflight.insert(i, Some(now_ms));
        }
        while self.inflight.len() < self.window && self.next < self.chunks.len() {
            out.push(self.chunks[self.next].clone());
            self.inflight.insert(self.next as u32, Some(now_ms));
            self.next += 1;
        }
        out
    }
}
