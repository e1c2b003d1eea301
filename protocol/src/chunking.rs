//! Splitting payloads larger than the MQTT packet limit into [`Chunk`]s, and putting them back
//! together on the other side with bounded memory and a timeout for sets that never complete.

use crate::messages::{Chunk, ChunkRef};
use alloc::borrow::Cow;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::sync::Arc;
use alloc::vec::Vec;
/// BLAKE3 of `payload`: the id of its chunk set and the check on reassembly.
pub fn payload_hash(payload: &[u8]) -> [u8; 32] {
    blake3::hash(payload).into()
}

/// [`payload_hash`] of a payload fed to it in order, piece by piece (a streamed [`Cut`]'s
/// pieces as they are written), instead of the whole payload at once.
#[derive(Debug, Clone, Default)]
pub struct PayloadHasher(blake3::Hasher);

impl PayloadHasher {
    /// Nothing hashed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next bytes of the payload.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    /// The hash of everything fed so far.
    pub fn finalize(&self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// Splits `payload` into chunks of at most `max_chunk_bytes` bytes (every chunk full but the
/// last). An empty payload gives one empty chunk. A `max_chunk_bytes` of 0 is treated as 1,
/// and chunks grow beyond it only if the payload would otherwise need more than `u32::MAX`.
pub fn split(payload: &[u8], max_chunk_bytes: usize) -> Vec<Chunk> {
    chunks(payload, max_chunk_bytes).collect()
}

/// The chunks of [`split`] one at a time, each copied out of `payload` only when it is taken
/// (a sender that signs and keeps them never holds the whole payload twice in chunks).
pub fn chunks(payload: &[u8], max_chunk_bytes: usize) -> Chunks<'_> {
    let (size, count) = cut_of(payload.len(), max_chunk_bytes);
    Chunks {
        payload,
        hash: payload_hash(payload),
        size,
        count,
        next: 0,
    }
}

/// The chunk length and count [`split`] cuts a payload of `len` bytes into.
fn cut_of(len: usize, max_chunk_bytes: usize) -> (usize, u32) {
    let size = max_chunk_bytes.max(1).max(len.div_ceil(u32::MAX as usize));
    // An empty payload is one empty chunk.
    (size, len.div_ceil(size).max(1) as u32)
}

/// Chunk `index` of `payload` cut into `count` chunks of `size` bytes (the last shorter).
fn chunk_of(payload: &[u8], hash: [u8; 32], size: usize, count: u32, index: u32) -> ChunkRef<'_> {
    let len = payload.len();
    let at = (index as usize).saturating_mul(size).min(len);
    Chunk {
        payload_hash: hash,
        index,
        count,
        total_len: len as u64,
        data: &payload[at..at.saturating_add(size).min(len)],
    }
}

/// A payload written in order by whatever holds its values, each time it is needed, instead of
/// being held as bytes (a [`Cut::streamed`] payload: a model serialised from its tensors).
pub trait PayloadSource: Send + Sync {
    /// Hands the payload's bytes to `out` in order, in pieces of any length: the same bytes on
    /// every call.
    fn write_payload(&self, out: &mut dyn FnMut(&[u8]));
}

/// Where a [`Cut`]'s bytes are.
#[derive(Clone)]
enum Source {
    /// Held as bytes.
    Held(Vec<u8>),
    /// Written by its source when asked.
    Streamed(Arc<dyn PayloadSource>),
}

/// A payload with its hash, handed out as the chunks [`split`] would make: borrowed from it
/// when it is held ([`ChunkRef`]: a sender that signs every chunk holds no copy of them), or
/// written by its [`PayloadSource`] through one chunk-sized buffer when it is streamed (no
/// payload-sized buffer at all).
#[derive(Clone)]
pub struct Cut {
    payload: Source,
    len: usize,
    hash: [u8; 32],
    size: usize,
    count: u32,
}

impl Cut {
    /// `payload` in chunks of at most `max_chunk_bytes` bytes, as [`split`] cuts it.
    pub fn new(payload: Vec<u8>, max_chunk_bytes: usize) -> Cut {
        let (size, count) = cut_of(payload.len(), max_chunk_bytes);
        Cut {
            hash: payload_hash(&payload),
            len: payload.len(),
            payload: Source::Held(payload),
            size,
            count,
        }
    }

    /// The payload `source` writes, in chunks of at most `max_chunk_bytes` bytes as [`split`]
    /// cuts it. Its length and hash are taken now, in one pass over it; its bytes are written
    /// again whenever chunks are asked for.
    pub fn streamed(source: Arc<dyn PayloadSource>, max_chunk_bytes: usize) -> Cut {
        let mut hasher = PayloadHasher::new();
        let mut len = 0usize;
        source.write_payload(&mut |piece| {
            hasher.update(piece);
            len += piece.len();
        });
        let (size, count) = cut_of(len, max_chunk_bytes);
        Cut {
            payload: Source::Streamed(source),
            len,
            hash: hasher.finalize(),
            size,
            count,
        }
    }

    /// The same cut with its payload held as bytes (written once if it was streamed): for a
    /// sender that hands out single chunks ([`Cut::chunk`]) over time.
    pub fn into_held(self) -> Cut {
        match self.payload {
            Source::Held(_) => self,
            Source::Streamed(_) => Cut {
                payload: Source::Held(self.bytes().into_owned()),
                ..self
            },
        }
    }

    /// The payload's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty (it is still one empty chunk).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole payload: borrowed when held, written into a new buffer when streamed.
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        match &self.payload {
            Source::Held(p) => Cow::Borrowed(p),
            Source::Streamed(s) => {
                let mut out = Vec::with_capacity(self.len);
                s.write_payload(&mut |piece| out.extend_from_slice(piece));
                Cow::Owned(out)
            }
        }
    }

    /// The payload's hash ([`payload_hash`]), which every chunk carries.
    pub fn payload_hash(&self) -> [u8; 32] {
        self.hash
    }

    /// Number of chunks (at least one).
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Chunk `index` of a held payload; `None` past the last, and for a streamed one (see
    /// [`Cut::into_held`]).
    pub fn chunk(&self, index: u32) -> Option<ChunkRef<'_>> {
        match &self.payload {
            Source::Held(p) if index < self.count => {
                Some(chunk_of(p, self.hash, self.size, self.count, index))
            }
            _ => None,
        }
    }

    /// Hands every chunk to `each` in order. A streamed payload is written once, through one
    /// buffer of a chunk's length.
    pub fn for_each_chunk(&self, mut each: impl FnMut(ChunkRef<'_>)) {
        let source = match &self.payload {
            Source::Held(p) => {
                for i in 0..self.count {
                    each(chunk_of(p, self.hash, self.size, self.count, i));
                }
                return;
            }
            Source::Streamed(s) => s,
        };
        fn chunk<'a>(cut: &Cut, index: u32, data: &'a [u8]) -> ChunkRef<'a> {
            Chunk {
                payload_hash: cut.hash,
                index,
                count: cut.count,
                total_len: cut.len as u64,
                data,
            }
        }
        let mut buf = Vec::with_capacity(self.size.min(self.len));
        let mut index = 0u32;
        let mut written = 0usize;
        source.write_payload(&mut |mut piece| {
            written += piece.len();
            while !piece.is_empty() {
                let take = (self.size - buf.len()).min(piece.len());
                buf.extend_from_slice(&piece[..take]);
                piece = &piece[take..];
                if buf.len() == self.size {
                    each(chunk(self, index, &buf));
                    index += 1;
                    buf.clear();
                }
            }
        });
        assert_eq!(
            written, self.len,
            "a payload source wrote another length than it first did"
        );
        // The last chunk when it is shorter than the others, or the one empty chunk of an
        // empty payload.
        if index < self.count {
            each(chunk(self, index, &buf));
        }
    }
}

impl PartialEq for Cut {
    /// Cuts are equal when they cut payloads of the same length and hash alike, held or
    /// streamed.
    fn eq(&self, other: &Cut) -> bool {
        (self.len, self.hash, self.size, self.count)
            == (other.len, other.hash, other.size, other.count)
    }
}

impl Eq for Cut {}

impl core::fmt::Debug for Cut {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cut")
            .field("held", &matches!(self.payload, Source::Held(_)))
            .field("len", &self.len)
            .field("hash", &self.hash)
            .field("size", &self.size)
            .field("count", &self.count)
            .finish()
    }
}

/// The chunks of a payload one at a time ([`chunks`]); it hashes the payload once, and says
/// that hash ([`Chunks::payload_hash`]) so a sender need not hash the payload again.
#[derive(Debug, Clone)]
pub struct Chunks<'a> {
    payload: &'a [u8],
    hash: [u8; 32],
    size: usize,
    count: u32,
    next: u32,
}

impl Chunks<'_> {
    /// The payload's hash ([`payload_hash`]), which every chunk carries.
    pub fn payload_hash(&self) -> [u8; 32] {
        self.hash
    }

    /// Length of every chunk but the last (which may be shorter).
    pub fn chunk_len(&self) -> usize {
        self.size
    }
}

impl ExactSizeIterator for Chunks<'_> {}

impl Iterator for Chunks<'_> {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        if self.next >= self.count {
            return None;
        }
        let i = self.next;
        self.next += 1;
        let c = chunk_of(self.payload, self.hash, self.size, self.count, i);
        Some(Chunk {
            payload_hash: c.payload_hash,
            index: c.index,
            count: c.count,
            total_len: c.total_len,
            data: c.data.to_vec(),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.count - self.next) as usize;
        (left, Some(left))
    }
}

/// Why a chunk was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// The chunk's `count` and `total_len` cannot describe a real set: zero chunks, more
    /// chunks than payload bytes, or an empty payload in more than one chunk.
    #[error("a set of {count} chunks cannot carry a payload of {total_len} bytes")]
    ImpossibleSet {
        /// Chunks claimed.
        count: u32,
        /// Payload length claimed.
        total_len: u64,
    },
    /// The chunk's index is not below its count.
    #[error("chunk index {index} is out of range for a set of {count} chunks")]
    IndexOutOfRange {
        /// The chunk's index.
        index: u32,
        /// Chunks in the set.
        count: u32,
    },
    /// The chunk disagrees with the first chunk of its set about the set's size.
    #[error(
        "chunk claims {count} chunks and {total_len} bytes, but its set has {set_count} chunks \
         and {set_total_len} bytes"
    )]
    SetMismatch {
        /// Chunks the chunk claims.
        count: u32,
        /// Payload length the chunk claims.
        total_len: u64,
        /// Chunks in the set.
        set_count: u32,
        /// Payload length of the set.
        set_total_len: u64,
    },
    /// The chunk's length does not fit its set's cut: every chunk but the last as long as the
    /// set's first full one, the last no longer and not empty (unless the payload is).
    #[error(
        "chunk {index} carries {len} bytes, but its set's cut has room for {room} there (0: no \
         cut of the set has a chunk of that length there)"
    )]
    BadChunkLength {
        /// The chunk's index.
        index: u32,
        /// Bytes in the chunk.
        len: usize,
        /// Bytes the chunk must carry, or 0 when no cut fits it.
        room: u64,
    },
    /// All chunks arrived but the payload's hash differs from the set's hash; the set is
    /// dropped and should be requested again.
    #[error("reassembled payload does not match its hash")]
    HashMismatch,
    /// The payload alone is larger than the reassembler may hold.
    #[error("payload of {total_len} bytes exceeds the reassembly limit of {limit} bytes")]
    PayloadTooLarge {
        /// Announced payload length.
        total_len: u64,
        /// The reassembler's limit.
        limit: usize,
    },
    /// Keeping the chunk would push the bytes held across all sets past the limit.
    #[error("{pending} bytes already pending, {incoming} more would exceed the limit of {limit}")]
    TooMuchPending {
        /// Bytes held now.
        pending: usize,
        /// Bytes in the refused chunk.
        incoming: usize,
        /// The reassembler's limit.
        limit: usize,
    },
}

/// The length of every chunk but the last in a set of `count` chunks carrying `total_len`
/// bytes whose chunk `index` has `len` bytes, cut as [`split`] cuts (every chunk full but the
/// last, which is not empty unless the payload is), or `None` if no such cut exists.
pub fn cut_size(index: u32, count: u32, total_len: u64, len: u64) -> Option<u64> {
    if count <= 1 {
        return (count == 1 && len == total_len).then_some(len);
    }
    let others = u64::from(count - 1);
    let size = if index + 1 == count {
        // The last chunk: the others share what it leaves, equally.
        let rest = total_len.checked_sub(len)?;
        (rest % others == 0).then_some(rest / others)?
    } else {
        len
    };
    let last = total_len.checked_sub(size.checked_mul(others)?)?;
    (last > 0 && last <= size).then_some(size)
}

/// The length chunk `index` of a set of `count` chunks carrying `total_len` bytes must have,
/// when every chunk but the last has `size` bytes (see [`cut_size`]).
pub fn chunk_len(index: u32, count: u32, total_len: u64, size: u64) -> u64 {
    if index + 1 == count {
        total_len - size * u64::from(count - 1)
    } else {
        size
    }
}

/// Which chunks of a set have arrived: one bit per chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrivals {
    bits: Vec<u64>,
    got: u32,
}

impl Arrivals {
    /// None of `count` chunks yet.
    pub fn new(count: u32) -> Arrivals {
        Arrivals {
            bits: alloc::vec![0; (count as usize).div_ceil(64)],
            got: 0,
        }
    }

    /// Whether chunk `index` has arrived.
    pub fn has(&self, index: u32) -> bool {
        self.bits
            .get(index as usize / 64)
            .is_some_and(|w| w & (1 << (index % 64)) != 0)
    }

    /// Records chunk `index` (below the count); false if it had already arrived.
    pub fn mark(&mut self, index: u32) -> bool {
        let had = self.has(index);
        if !had {
            self.bits[index as usize / 64] |= 1 << (index % 64);
            self.got += 1;
        }
        !had
    }

    /// How many chunks have arrived.
    pub fn got(&self) -> u32 {
        self.got
    }

    /// Bytes the bitmap of `count` chunks takes: what a set's bookkeeping costs.
    pub fn bytes_for(count: u32) -> usize {
        (count as usize).div_ceil(64) * 8
    }
}

/// One incomplete chunk set, written in place into its payload as chunks arrive.
#[derive(Debug)]
struct PendingSet {
    count: u32,
    total_len: u64,
    /// Length of every chunk but the last.
    size: u64,
    /// When the set's first chunk arrived.
    first_ms: u64,
    /// The payload, zeroed where no chunk has arrived yet. Allocated zeroed, so its pages are
    /// the system's until a chunk is written into them.
    payload: Vec<u8>,
    arrived: Arrivals,
}

impl PendingSet {
    /// Memory the set holds, as the reassembler counts it: all of it from its first chunk.
    fn held(&self) -> usize {
        held_for(self.total_len, self.count)
    }

    /// The length chunk `index` must have.
    fn len_of(&self, index: u32) -> u64 {
        chunk_len(index, self.count, self.total_len, self.size)
    }
}

/// Memory an incomplete set costs beyond its payload and bitmap: its entries in the set map
/// and the expiry order.
pub const SET_OVERHEAD: usize = 192;

/// The memory a [`Reassembler`] holds for one set of `count` chunks carrying `total_len`
/// bytes, counted from its first chunk: what to allow for one payload in flight.
pub fn held_for(total_len: u64, count: u32) -> usize {
    usize::try_from(total_len)
        .unwrap_or(usize::MAX)
        .saturating_add(Arrivals::bytes_for(count))
        .saturating_add(SET_OVERHEAD)
}

/// Checks what a chunk `(index, count, total_len)` claims about its set before anything is held:
/// a set that can exist (one chunk for an empty payload, no more chunks than bytes), an index
/// in range, and a payload of at most `limit` bytes.
pub fn check_set(
    (index, count, total_len): (u32, u32, u64),
    limit: usize,
) -> Result<(), ChunkError> {
    let possible = if total_len == 0 {
        count == 1
    } else {
        count >= 1 && u64::from(count) <= total_len
    };
    if !possible {
        return Err(ChunkError::ImpossibleSet { count, total_len });
    }
    if index >= count {
        return Err(ChunkError::IndexOutOfRange { index, count });
    }
    if total_len > limit as u64 {
        return Err(ChunkError::PayloadTooLarge { total_len, limit });
    }
    Ok(())
}

/// Bytes of data in a full chunk of a model or an update: 1 KiB below 256 KiB, so that the
/// whole MQTT packet of a chunk (signed envelope, topic and header, under 600 bytes more) fits
/// in 256 KiB. A broker reads packets into buffers that grow by doubling and keeps each
/// packet in its log as a slice of its buffer: a packet just over a power of two pins a
/// buffer of twice its size for as long as the log holds it.
pub const CHUNK_BYTES: usize = (256 << 10) - 1024;

/// Bytes of chunks a receiver asks for at once: a broker keeps only a few MiB per topic in
/// memory (`unifed-broker` keeps 8 MiB per site), so a larger request would overrun a slow
/// subscriber.
pub const FETCH_WINDOW_BYTES: u64 = 4 << 20;

/// How many chunks of a payload of `total_len` bytes in `count` chunks to ask for at once:
/// [`FETCH_WINDOW_BYTES`] worth, at least one and at most 64.
pub fn fetch_window(total_len: u64, count: u32) -> usize {
    let chunk = total_len.div_ceil(u64::from(count.max(1))).max(1);
    (FETCH_WINDOW_BYTES / chunk).clamp(1, 64) as usize
}

/// Collects chunks of many payloads at once and hands each payload back once it is complete
/// and its hash checks out. Each chunk is written in place into its payload, so a payload is
/// held once and never copied after its chunks arrive. Chunks must be cut as [`split`] cuts
/// (every chunk as long as the first full one, the last no longer). Memory is bounded by
/// `max_pending_bytes`, each set counted in full ([`held_for`]) from its first chunk, so a
/// flood of tiny chunks or sets is bounded as tightly as one of large ones. Expiry is
/// amortised O(1) per set, and at most `max_sets` sets are held (the oldest is dropped for a
/// new one).
#[derive(Debug)]
pub struct Reassembler {
    timeout_ms: u64,
    max_pending_bytes: usize,
    max_payload: usize,
    max_sets: usize,
    /// Whether a complete payload is hashed and checked against its set's hash.
    check_hash: bool,
    sets: BTreeMap<[u8; 32], PendingSet>,
    /// Incomplete sets by arrival of their first chunk, oldest first.
    order: BTreeSet<(u64, [u8; 32])>,
    pending_bytes: usize,
}

impl Reassembler {
    /// A reassembler that drops sets older than `timeout_ms` (see [`Reassembler::expire`]) and
    /// holds at most `max_pending_bytes` bytes of incomplete payloads.
    pub fn new(timeout_ms: u64, max_pending_bytes: usize) -> Self {
        Reassembler {
            timeout_ms,
            max_pending_bytes,
            max_payload: max_pending_bytes,
            max_sets: usize::MAX,
            check_hash: true,
            sets: BTreeMap::new(),
            order: BTreeSet::new(),
            pending_bytes: 0,
        }
    }

    /// The same, holding at most `max_sets` incomplete sets: the first chunk of a new set
    /// drops the oldest one (a sender uploads one payload at a time).
    pub fn with_max_sets(mut self, max_sets: usize) -> Self {
        self.max_sets = max_sets.max(1);
        self
    }

    /// The same, refusing a payload of more than `max_payload` bytes (by default the whole
    /// memory limit): one sender's set cannot claim the room of many.
    pub fn with_max_payload(mut self, max_payload: usize) -> Self {
        self.max_payload = max_payload.min(self.max_pending_bytes);
        self
    }

    /// The same, for chunks each authenticated before they are handed in as coming from the
    /// one who cut the payload and announced its hash (a site's model chunks, each signed by
    /// its pinned aggregator, whose signed manifest names the hash): a complete payload is
    /// handed back without being hashed again. Every byte of it was signed as part of the
    /// chunk that carried it, with its index and the payload's hash and length, so only a
    /// signer that cut its own payload wrong could make it differ.
    pub fn of_signed_chunks(mut self) -> Self {
        self.check_hash = false;
        self
    }

    /// Removes the set `hash`, freeing what it held.
    fn drop_set(&mut self, hash: &[u8; 32]) -> Option<PendingSet> {
        let set = self.sets.remove(hash)?;
        self.order.remove(&(set.first_ms, *hash));
        self.pending_bytes -= set.held();
        Some(set)
    }

    /// Adds a chunk received at `now_ms`; returns the payload when this chunk completes it.
    ///
    /// Chunks may come in any order; a repeated index is ignored. A refused chunk leaves its set
    /// as it was, except on [`ChunkError::HashMismatch`], which drops the whole set.
    pub fn insert(
        &mut self,
        chunk: ChunkRef<'_>,
        now_ms: u64,
    ) -> Result<Option<Vec<u8>>, ChunkError> {
        let Chunk {
            payload_hash: hash,
            index,
            count,
            total_len,
            data,
        } = chunk;
        check_set((index, count, total_len), self.max_payload)?;
        let len = data.len() as u64;
        let bad_len = |room: u64| ChunkError::BadChunkLength {
            index,
            len: data.len(),
            room,
        };

        match self.sets.get(&hash) {
            Some(set) => {
                if set.count != count || set.total_len != total_len {
                    return Err(ChunkError::SetMismatch {
                        count,
                        total_len,
                        set_count: set.count,
                        set_total_len: set.total_len,
                    });
                }
                if set.arrived.has(index) {
                    return Ok(None);
                }
                if len != set.len_of(index) {
                    return Err(bad_len(set.len_of(index)));
                }
            }
            None => {
                let size = cut_size(index, count, total_len, len).ok_or_else(|| bad_len(0))?;
                if count == 1 {
                    // A whole payload in one chunk: nothing is held.
                    return match !self.check_hash || payload_hash(data) == hash {
                        true => Ok(Some(data.to_vec())),
                        false => Err(ChunkError::HashMismatch),
                    };
                }
                if self.sets.len() >= self.max_sets
                    && let Some(&(_, oldest)) = self.order.first()
                {
                    self.drop_set(&oldest);
                }
                let cost = held_for(total_len, count);
                if self.pending_bytes + cost > self.max_pending_bytes {
                    return Err(ChunkError::TooMuchPending {
                        pending: self.pending_bytes,
                        incoming: cost,
                        limit: self.max_pending_bytes,
                    });
                }
                self.pending_bytes += cost;
                self.order.insert((now_ms, hash));
                self.sets.insert(
                    hash,
                    PendingSet {
                        count,
                        total_len,
                        size,
                        first_ms: now_ms,
                        // Checked against the limit above, so it fits a usize.
                        payload: alloc::vec![0; total_len as usize],
                        arrived: Arrivals::new(count),
                    },
                );
            }
        }
        let set = self.sets.get_mut(&hash).expect("present or just inserted");
        let at = (set.size * u64::from(index)) as usize;
        set.payload[at..at + data.len()].copy_from_slice(data);
        set.arrived.mark(index);
        if set.arrived.got() < count {
            return Ok(None);
        }
        let set = self.drop_set(&hash).expect("present");
        if self.check_hash && payload_hash(&set.payload) != hash {
            return Err(ChunkError::HashMismatch);
        }
        Ok(Some(set.payload))
    }

    /// Drops every set whose first chunk arrived more than the timeout before `now_ms`, frees
    /// its memory and returns the dropped sets' payload hashes.
    pub fn expire(&mut self, now_ms: u64) -> Vec<[u8; 32]> {
        let mut expired = Vec::new();
        // Oldest first: the scan stops at the first set still in time.
        while let Some(&(first, hash)) = self.order.first()
            && now_ms.saturating_sub(first) > self.timeout_ms
        {
            self.drop_set(&hash);
            expired.push(hash);
        }
        expired
    }

    /// Memory held for incomplete sets: each set's payload, bitmap and overhead.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Number of incomplete sets.
    pub fn pending_sets(&self) -> usize {
        self.sets.len()
    }

    /// Indices not yet received for the set `payload_hash`, or `None` if no such set is pending.
    pub fn missing(&self, payload_hash: &[u8; 32]) -> Option<Vec<u32>> {
        let set = self.sets.get(payload_hash)?;
        Some((0..set.count).filter(|&i| !set.arrived.has(i)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_hands_out_the_chunks_split_makes_borrowed() {
        for (len, max) in [(0, 4), (1, 4), (8, 4), (9, 4), (10_000, 333), (5, 0)] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let owned = split(&payload, max);
            let cut = Cut::new(payload.clone(), max);
            assert_eq!(cut.count() as usize, owned.len(), "{len} bytes by {max}");
            assert_eq!(&cut.bytes()[..], &payload[..]);
            assert_eq!(cut.len(), payload.len());
            assert_eq!(cut.payload_hash(), payload_hash(&payload));
            let mut borrowed = Vec::new();
            cut.for_each_chunk(|c| borrowed.push(owned_chunk(c)));
            assert_eq!(borrowed, owned, "{len} bytes by {max}");
            let by_index: Vec<Chunk> = (0..cut.count())
                .map(|i| owned_chunk(cut.chunk(i).unwrap()))
                .collect();
            assert_eq!(by_index, owned, "{len} bytes by {max}");
            assert_eq!(cut.chunk(cut.count()), None);
            // Both forms encode alike.
            for (i, o) in owned.iter().enumerate() {
                assert_eq!(
                    postcard::to_allocvec(&cut.chunk(i as u32).unwrap()).unwrap(),
                    postcard::to_allocvec(o).unwrap()
                );
            }
        }
    }

    fn owned_chunk(c: ChunkRef<'_>) -> Chunk {
        Chunk {
            payload_hash: c.payload_hash,
            index: c.index,
            count: c.count,
            total_len: c.total_len,
            data: c.data.to_vec(),
        }
    }

    /// A payload written in pieces of every length from 1 to 13 bytes, in turn.
    struct Pieces(Vec<u8>);

    impl PayloadSource for Pieces {
        fn write_payload(&self, out: &mut dyn FnMut(&[u8])) {
            let mut rest = &self.0[..];
            for n in (1..=13).cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, tail) = rest.split_at(n.min(rest.len()));
                out(piece);
                rest = tail;
            }
        }
    }

    #[test]
    fn a_streamed_cut_hands_out_the_chunks_split_makes() {
        for (len, max) in [
            (0, 4),
            (1, 4),
            (8, 4),
            (9, 4),
            (10_000, 333),
            (4096, 1024),
            (5, 0),
        ] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let owned = split(&payload, max);
            let cut = Cut::streamed(Arc::new(Pieces(payload.clone())), max);
            assert_eq!(cut, Cut::new(payload.clone(), max), "{len} bytes by {max}");
            assert_eq!(cut.count() as usize, owned.len(), "{len} bytes by {max}");
            assert_eq!(cut.len(), len);
            assert_eq!(cut.payload_hash(), payload_hash(&payload));
            assert_eq!(&cut.bytes()[..], &payload[..]);
            let mut streamed = Vec::new();
            cut.for_each_chunk(|c| streamed.push(owned_chunk(c)));
            assert_eq!(streamed, owned, "{len} bytes by {max}");
            // Single chunks come from a held payload only.
            assert_eq!(cut.chunk(0), None);
            let held = cut.into_held();
            assert_eq!(held.chunk(0), Some(owned[0].as_ref()));
            assert_eq!(&held.bytes()[..], &payload[..]);
        }
    }

    #[test]
    fn the_fetch_window_is_a_few_mib_of_chunks() {
        // 57 MB in 256 KiB chunks: 16 at a time; in 1 MiB chunks: 4; tiny chunks: 64 at most.
        assert_eq!(fetch_window(56_850_000, 217), 16);
        assert_eq!(fetch_window(56_850_000, 55), 4);
        assert_eq!(fetch_window(64 << 20, 2), 1);
        assert_eq!(fetch_window(10_000, 100), 64);
        assert_eq!(fetch_window(0, 0), 64);
    }
    use alloc::vec;

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn split_makes_full_chunks_and_a_short_last_one() {
        let p = payload(10);
        let chunks = split(&p, 4);
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks.iter().map(|c| c.data.len()).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.index, i as u32);
            assert_eq!(c.count, 3);
            assert_eq!(c.total_len, 10);
            assert_eq!(c.payload_hash, payload_hash(&p));
        }
        assert_eq!(split(&p, 0).len(), 10);
        assert_eq!(split(&p, 100).len(), 1);
    }

    #[test]
    fn chunks_say_the_payloads_hash_and_how_many_are_left() {
        let p = payload(10);
        let mut it = chunks(&p, 4);
        assert_eq!(it.payload_hash(), payload_hash(&p));
        assert_eq!(it.size_hint(), (3, Some(3)));
        it.next();
        assert_eq!(it.size_hint(), (2, Some(2)));
        assert_eq!(it.collect::<Vec<_>>(), split(&p, 4)[1..]);
    }

    #[test]
    fn an_empty_payload_is_one_empty_chunk_and_reassembles() {
        let chunks = split(&[], 8);
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].count, chunks[0].total_len), (1, 0));
        let mut r = Reassembler::new(1000, 100);
        assert_eq!(r.insert(chunks[0].as_ref(), 0), Ok(Some(vec![])));
    }

    #[test]
    fn reassembly_works_across_out_of_order_and_duplicated_chunks() {
        let p = payload(1000);
        let chunks = split(&p, 64);
        assert_eq!(chunks.len(), 16);
        let mut r = Reassembler::new(1000, 10_000);
        let order = [
            15, 3, 3, 0, 7, 15, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 0, 13, 14,
        ];
        let mut done = None;
        for (n, &i) in order.iter().enumerate() {
            assert!(done.is_none(), "completed early");
            done = r.insert(chunks[i].as_ref(), n as u64).unwrap();
        }
        assert_eq!(done, Some(p));
        assert_eq!(r.pending_bytes(), 0);
        assert_eq!(r.pending_sets(), 0);
    }

    #[test]
    fn two_sets_reassemble_interleaved() {
        let (p, q) = (payload(100), payload(77));
        let (a, b) = (split(&p, 10), split(&q, 10));
        let mut r = Reassembler::new(1000, 4000);
        let mut out = vec![];
        for i in 0..10 {
            out.extend(r.insert(a[i].as_ref(), 0).unwrap());
            if i < b.len() {
                out.extend(r.insert(b[i].as_ref(), 0).unwrap());
            }
        }
        assert_eq!(out, vec![q, p]);
    }

    #[test]
    fn signed_chunks_are_not_hashed_again_once_complete() {
        let p = payload(100);
        let mut chunks = split(&p, 30);
        chunks[1].data[5] ^= 1;
        let mut tampered = p.clone();
        tampered[35] ^= 1;
        // What the signatures vouch for is handed back as it came; the check is theirs.
        let mut r = Reassembler::new(500, 1000).of_signed_chunks();
        let mut done = None;
        for c in &chunks {
            done = r.insert(c.as_ref(), 0).unwrap();
        }
        assert_eq!(done, Some(tampered));
        // The same chunks, unsigned, fail the hash.
        let mut r = Reassembler::new(500, 1000);
        let last = chunks.pop().unwrap();
        for c in &chunks {
            r.insert(c.as_ref(), 0).unwrap();
        }
        assert_eq!(r.insert(last.as_ref(), 0), Err(ChunkError::HashMismatch));
    }

    #[test]
    fn a_missing_chunk_times_out_and_its_memory_is_freed() {
        let p = payload(100);
        let chunks = split(&p, 30);
        let mut r = Reassembler::new(500, 1000);
        r.insert(chunks[0].as_ref(), 1000).unwrap();
        r.insert(chunks[2].as_ref(), 1400).unwrap();
        // The whole set is counted from its first chunk: its payload is allocated then.
        assert_eq!(r.pending_bytes(), 100 + 8 + SET_OVERHEAD);
        assert_eq!(r.pending_bytes(), held_for(100, 4));
        assert_eq!(r.missing(&payload_hash(&p)), Some(vec![1, 3]));
        // The timeout counts from the first chunk, not the latest.
        assert!(r.expire(1500).is_empty());
        assert_eq!(r.expire(1501), vec![payload_hash(&p)]);
        assert_eq!(r.pending_bytes(), 0);
        assert_eq!(r.pending_sets(), 0);
        assert_eq!(r.missing(&payload_hash(&p)), None);
    }

    #[test]
    fn a_chunk_with_a_mismatched_count_is_rejected() {
        let chunks = split(&payload(100), 30);
        let mut r = Reassembler::new(500, 1000);
        r.insert(chunks[0].as_ref(), 0).unwrap();
        let mut odd = chunks[1].clone();
        odd.count = 5;
        assert_eq!(
            r.insert(odd.as_ref(), 0),
            Err(ChunkError::SetMismatch {
                count: 5,
                total_len: 100,
                set_count: 4,
                set_total_len: 100
            })
        );
        let mut odd = chunks[1].clone();
        odd.total_len = 99;
        assert!(matches!(
            r.insert(odd.as_ref(), 0),
            Err(ChunkError::SetMismatch { .. })
        ));
        // The set is unharmed.
        for c in &chunks[1..3] {
            assert_eq!(r.insert(c.as_ref(), 0), Ok(None));
        }
        assert!(r.insert(chunks[3].as_ref(), 0).unwrap().is_some());
    }

    #[test]
    fn impossible_chunks_are_rejected() {
        let c = split(&payload(10), 4).remove(0);
        let mut r = Reassembler::new(500, 1000);
        let with = |f: fn(&mut Chunk)| {
            let mut c = c.clone();
            f(&mut c);
            c
        };
        assert_eq!(
            r.insert(with(|c| c.index = 3).as_ref(), 0),
            Err(ChunkError::IndexOutOfRange { index: 3, count: 3 })
        );
        assert!(matches!(
            r.insert(with(|c| c.count = 0).as_ref(), 0),
            Err(ChunkError::ImpossibleSet { .. })
        ));
        assert!(matches!(
            r.insert(with(|c| c.count = 11).as_ref(), 0),
            Err(ChunkError::ImpossibleSet { .. })
        ));
        assert!(matches!(
            r.insert(with(|c| c.data = vec![0; 11]).as_ref(), 0),
            Err(ChunkError::BadChunkLength {
                len: 11,
                room: 0,
                ..
            })
        ));
        assert!(matches!(
            r.insert(with(|c| c.data.clear()).as_ref(), 0),
            Err(ChunkError::BadChunkLength { .. })
        ));
        assert!(matches!(
            r.insert(with(|c| c.total_len = 5000).as_ref(), 0),
            Err(ChunkError::PayloadTooLarge {
                total_len: 5000,
                limit: 1000
            })
        ));
        assert_eq!(r.pending_bytes(), 0);
        assert_eq!(r.pending_sets(), 0);
    }

    #[test]
    fn corrupted_data_is_a_hash_mismatch_and_drops_the_set() {
        let p = payload(100);
        let mut chunks = split(&p, 30);
        chunks[1].data[5] ^= 1;
        let mut r = Reassembler::new(500, 1000);
        for c in &chunks[..3] {
            assert_eq!(r.insert(c.as_ref(), 0), Ok(None));
        }
        assert_eq!(
            r.insert(chunks[3].as_ref(), 0),
            Err(ChunkError::HashMismatch)
        );
        assert_eq!(r.pending_bytes(), 0);
        assert_eq!(r.pending_sets(), 0);
    }

    #[test]
    fn a_chunk_of_another_length_than_its_cut_is_refused_and_the_set_kept() {
        let p = payload(100);
        let chunks = split(&p, 30);
        let mut r = Reassembler::new(500, 1000);
        for c in &chunks[..2] {
            r.insert(c.as_ref(), 0).unwrap();
        }
        let with = |i: usize, f: fn(&mut Chunk)| {
            let mut c = chunks[i].clone();
            f(&mut c);
            c
        };
        // The last chunk one byte short, a middle one one byte long.
        assert_eq!(
            r.insert(with(3, |c| c.data.truncate(9)).as_ref(), 0),
            Err(ChunkError::BadChunkLength {
                index: 3,
                len: 9,
                room: 10
            })
        );
        assert_eq!(
            r.insert(with(2, |c| c.data.push(0)).as_ref(), 0),
            Err(ChunkError::BadChunkLength {
                index: 2,
                len: 31,
                room: 30
            })
        );
        assert_eq!(r.missing(&payload_hash(&p)), Some(vec![2, 3]));
        assert_eq!(r.insert(chunks[2].as_ref(), 0), Ok(None));
        assert_eq!(r.insert(chunks[3].as_ref(), 0), Ok(Some(p)));
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn a_set_begun_with_its_last_chunk_takes_its_cut_from_it() {
        let p = payload(100);
        let chunks = split(&p, 30);
        let mut r = Reassembler::new(500, 1000);
        // 10 bytes last of 4 chunks: the others carry 30 each.
        assert_eq!(r.insert(chunks[3].as_ref(), 0), Ok(None));
        let mut long = chunks[0].clone();
        long.data.extend_from_slice(&[0; 5]);
        assert_eq!(
            r.insert(long.as_ref(), 0),
            Err(ChunkError::BadChunkLength {
                index: 0,
                len: 35,
                room: 30
            })
        );
        for c in &chunks[..2] {
            assert_eq!(r.insert(c.as_ref(), 0), Ok(None));
        }
        assert_eq!(r.insert(chunks[2].as_ref(), 0), Ok(Some(p)));
        // A last chunk no cut of the set can end with: 100 - 11 is not shared by 3 equally.
        let mut odd = chunks[3].clone();
        odd.data.push(0);
        assert_eq!(
            r.insert(odd.as_ref(), 0),
            Err(ChunkError::BadChunkLength {
                index: 3,
                len: 11,
                room: 0
            })
        );
        assert_eq!(r.pending_sets(), 0);
    }

    #[test]
    fn a_payload_in_one_chunk_is_handed_back_without_being_held() {
        let p = payload(50);
        let one = split(&p, 64).remove(0);
        let mut r = Reassembler::new(500, 60);
        assert_eq!(r.insert(one.as_ref(), 0), Ok(Some(p)));
        let mut bad = one.clone();
        bad.data[0] ^= 1;
        assert_eq!(r.insert(bad.as_ref(), 0), Err(ChunkError::HashMismatch));
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn a_payload_over_the_per_set_limit_is_refused() {
        let chunks = split(&payload(100), 30);
        let mut r = Reassembler::new(500, 10_000).with_max_payload(99);
        assert_eq!(
            r.insert(chunks[0].as_ref(), 0),
            Err(ChunkError::PayloadTooLarge {
                total_len: 100,
                limit: 99
            })
        );
        let mut r = Reassembler::new(500, 10_000).with_max_payload(100);
        assert_eq!(r.insert(chunks[0].as_ref(), 0), Ok(None));
    }

    #[test]
    fn cut_size_accepts_exactly_the_cuts_of_split() {
        for (total, size) in [
            (10_000u64, 3_000u64),
            (9_000, 3_000),
            (1, 1),
            (1_025, 512),
            (7, 1),
        ] {
            let count = total.div_ceil(size) as u32;
            let cut = split(&payload(total as usize), size as usize);
            for (index, c) in (0..count).zip(&cut) {
                assert_eq!(
                    cut_size(index, count, total, c.data.len() as u64),
                    Some(if count == 1 { total } else { size }),
                    "{total}/{size}"
                );
            }
        }
        assert_eq!(cut_size(0, 2, 10_000, 4_000), None); // 2 x 4,000 cannot carry 10,000 bytes
        assert_eq!(cut_size(1, 2, 10_000, 0), None); // an empty last chunk
        assert_eq!(cut_size(2, 3, 1_000, 500), None); // 500 + 2 x 250: a last chunk too long
        assert_eq!(cut_size(0, 1, 10, 9), None); // one chunk short of its payload
        assert_eq!(cut_size(0, 1, 0, 0), Some(0)); // the empty payload
        assert_eq!(cut_size(0, 0, 0, 0), None);
    }

    #[test]
    fn a_payload_hashed_piece_by_piece_has_its_whole_hash() {
        let p = payload(1000);
        let mut h = PayloadHasher::new();
        assert_eq!(h.finalize(), payload_hash(&[]));
        for c in split(&p, 64) {
            h.update(&c.data);
        }
        assert_eq!(h.finalize(), payload_hash(&p));
    }

    #[test]
    fn arrivals_count_each_chunk_once() {
        let mut a = Arrivals::new(130);
        assert_eq!(Arrivals::bytes_for(130), 24);
        assert!(a.mark(129) && a.mark(0) && a.mark(64));
        assert!(!a.mark(64));
        assert!(a.has(129) && a.has(64) && !a.has(1) && !a.has(130));
        assert_eq!(a.got(), 3);
    }

    #[test]
    fn memory_past_the_limit_is_refused_counting_whole_sets() {
        let (p, q) = (payload(100), payload(90));
        let limit = held_for(100, 2) + held_for(90, 2) + 39;
        let mut r = Reassembler::new(500, limit);
        r.insert(split(&p, 50)[0].as_ref(), 0).unwrap();
        let qs = split(&q, 45);
        r.insert(qs[0].as_ref(), 0).unwrap();
        assert_eq!(r.pending_bytes(), held_for(100, 2) + held_for(90, 2));
        assert_eq!(
            r.insert(split(&payload(80), 40)[0].as_ref(), 0),
            Err(ChunkError::TooMuchPending {
                pending: held_for(100, 2) + held_for(90, 2),
                incoming: held_for(80, 2),
                limit
            })
        );
        // Completing a set needs no extra room and frees what it held.
        assert_eq!(r.insert(qs[1].as_ref(), 0), Ok(Some(q)));
        assert_eq!(r.pending_bytes(), held_for(100, 2));
    }

    #[test]
    fn a_flood_of_one_byte_chunks_is_bounded_by_their_real_cost() {
        let mut r = Reassembler::new(500, 100_000);
        let mut taken = 0;
        for k in 0..100_000u32 {
            let c = Chunk {
                payload_hash: payload_hash(&k.to_le_bytes()),
                index: 0,
                count: 2,
                total_len: 2,
                data: vec![1],
            };
            if r.insert(c.as_ref(), 0).is_ok() {
                taken += 1;
            }
        }
        assert_eq!(taken, 100_000 / held_for(2, 2));
        assert_eq!(held_for(2, 2), 2 + 8 + SET_OVERHEAD);
        assert!(r.pending_bytes() <= 100_000);
    }

    #[test]
    fn at_most_max_sets_are_held_the_oldest_dropped_first_and_expiry_goes_oldest_first() {
        let mut r = Reassembler::new(100, 1 << 20).with_max_sets(2);
        let sets: Vec<Vec<Chunk>> = (0..3).map(|k| split(&payload(20 + k), 10)).collect();
        for (t, s) in sets.iter().enumerate() {
            r.insert(s[0].as_ref(), t as u64 * 10).unwrap();
        }
        assert_eq!(r.pending_sets(), 2);
        assert!(r.missing(&sets[0][0].payload_hash).is_none());
        assert_eq!(r.expire(115), vec![sets[1][0].payload_hash]);
        assert_eq!(r.pending_sets(), 1);
        assert_eq!(r.expire(125), vec![sets[2][0].payload_hash]);
        assert_eq!(r.pending_bytes(), 0);
    }
}
