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
use unifed_protocol::ids::{Id, RunId};
use unifed_protocol::messages::{ChunkRef, UpdateReceipt};

/// Largest update chunk: small enough that a window of every site fits a broker's log, and
/// its packet fits in 256 KiB ([`unifed_protocol::chunking::CHUNK_BYTES`]).
pub const MAX_CHUNK: usize = unifed_protocol::chunking::CHUNK_BYTES;
/// A chunk without a receipt for this long (ms) is sent again.
pub const CHUNK_TIMEOUT_MS: u64 = 10_000;

/// One update on its way.
#[derive(Debug)]
pub struct Upload {
    /// The round it is for.
    pub round: u64,
    /// The signed update envelope.
    bytes: Vec<u8>,
    payload_hash: [u8; 32],
    /// What a chunk's envelope says and who signs it: chunks are cut and signed as they are
    /// sent, so the first leaves at once and none is held twice.
    signer: ChunkSigner,
    /// Length of every chunk but the last; 0 when the update goes whole.
    chunk: usize,
    /// Number of chunks; 0 when the update goes whole.
    count: usize,
    next: usize,
    /// Chunks in flight without a receipt at most (at least 1).
    window: usize,
    inflight: BTreeMap<u32, Option<u64>>,
    last_progress: Option<u64>,
}

/// The envelope fields of an update's chunks, and the key that signs them.
#[derive(Debug)]
struct ChunkSigner {
    federation: Id,
    site: Id,
    hash: SpecHash,
    run: RunId,
    version: u64,
    key: SigningKey,
}

impl Upload {
    /// Prepares the signed update envelope `bytes` of `run`'s `round` (trained from `version`) for a
    /// broker whose packet limit is `max_packet`, with at most `window_bytes` of chunks
    /// without a receipt (at least one chunk); chunks are signed with `key` too, so the
    /// aggregator checks each before it holds any.
    pub fn new(
        (federation, site, hash): (&Id, &Id, SpecHash),
        key: &SigningKey,
        (run, round, version): (RunId, u64, u64),
        bytes: Vec<u8>,
        max_packet: usize,
        window_bytes: usize,
    ) -> Upload {
        let limit = max_packet.saturating_sub(4096).max(1024);
        // The update's hash: `chunks` computes it with its cut, so it is not computed again.
        let (payload_hash, chunk, count) = if bytes.len() <= limit {
            (payload_hash(&bytes), 0, 0)
        } else {
            let cut = chunks(&bytes, (limit - 512).min(MAX_CHUNK));
            (cut.payload_hash(), cut.chunk_len(), cut.len())
        };
        let window = if count == 0 {
            1
        } else {
            (window_bytes / chunk).max(1)
        };
        Upload {
            round,
            bytes,
            payload_hash,
            signer: ChunkSigner {
                federation: federation.clone(),
                site: site.clone(),
                hash,
                run,
                version,
                key: key.clone(),
            },
            chunk,
            count,
            next: 0,
            window,
            inflight: BTreeMap::new(),
            last_progress: None,
        }
    }

    /// The signed envelope of chunk `index`: the bytes [`chunks`] cuts, in the envelope
    /// `Envelope::new` would make, serialised straight into it.
    fn chunk_envelope(&self, index: usize) -> Vec<u8> {
        let at = index * self.chunk;
        let s = &self.signer;
        let c = ChunkRef {
            payload_hash: self.payload_hash,
            index: index as u32,
            count: self.count as u32,
            total_len: self.bytes.len() as u64,
            data: &self.bytes[at..(at + self.chunk).min(self.bytes.len())],
        };
        let unsigned = Envelope::encode_new(
            MessageKind::UpdateChunk,
            &s.federation,
            &s.site,
            (s.run, self.round, s.version),
            s.hash,
            &c,
        );
        s.key
            .sign_encoded(unsigned)
            .expect("encode_new writes an unsigned envelope")
    }

    /// Bytes of the update envelope.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the update is empty (never: an envelope has a header).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Hash of the update envelope (what the aggregator's answer names).
    pub fn hash(&self) -> [u8; 32] {
        self.payload_hash
    }

    /// MQTT messages one complete send takes.
    pub fn messages(&self) -> usize {
        self.count.max(1)
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
        if self.count == 0 {
            self.last_progress = None;
        }
    }

    /// What is due at `now_ms`: the whole update if unanswered for `resend_ms`, or chunks to
    /// fill the window, re-sending those whose receipt is overdue.
    pub fn pump(&mut self, now_ms: u64, resend_ms: u64) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let overdue =
            |t: Option<u64>, limit: u64| t.is_none_or(|t| now_ms.saturating_sub(t) > limit);
        if self.count == 0 {
            if overdue(self.last_progress, resend_ms) {
                out.push(self.bytes.clone());
                self.last_progress = Some(now_ms);
            }
            return out;
        }
        if self.next == self.count
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
            out.push(self.chunk_envelope(i as usize));
            self.inflight.insert(i, Some(now_ms));
        }
        while self.inflight.len() < self.window && self.next < self.count {
            out.push(self.chunk_envelope(self.next));
            self.inflight.insert(self.next as u32, Some(now_ms));
            self.next += 1;
        }
        out
    }
}
