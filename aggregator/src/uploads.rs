//! Sites' chunked uploads, spooled to disk as their chunks arrive: an incomplete update costs
//! the aggregator a file and a set of received indices, not its bytes in memory, however many
//! sites upload at once. A complete update is read back once and handed to the core with its
//! file, which the core makes its spool file when it accepts the update (so the update is not
//! written again); the file is removed otherwise.
//!
//! Every chunk handed in was opened with its site's key by the caller (an ingest thread), so a
//! set is not hashed: each byte was signed by the site with its index and the set's hash and
//! length, and only a site that cut its own update wrong could make the set differ from the
//! hash it names (as a site takes the aggregator's signed chunks,
//! `Reassembler::of_signed_chunks`).
//!
//! Chunks are written where they belong in the payload: every chunk but the last has the same
//! length (as `unifed_protocol::chunking::chunks` cuts them), which the set's first chunk fixes;
//! a chunk that disagrees is refused before anything is written. Each site holds at most two
//! sets (a new one drops its oldest) of at most `per_site` bytes each; sets whose first chunk is
//! older than the timeout are dropped. A set is begun only when the disk keeps its free-space
//! floor with the whole set and every set in progress written ([`SpooledUploads::with_disk_floor`]). The folder is emptied at start: chunks of a previous
//! process are re-sent by their sites.

use bytes::Bytes;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use unifed_net::disk::{Flusher, WRITEBACK_BYTES};
use unifed_net::memory::MappedFile;
use unifed_protocol::chunking::{Arrivals, ChunkError, check_set, cut_size};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{Chunk, ChunkRef};

/// Milliseconds between sweeps of expired sets (amortised: not on every message).
pub const SWEEP_EVERY_MS: u64 = 1_000;
/// Incomplete sets one site may hold at once.
const SETS_PER_SITE: usize = 2;
/// Shortest chunk (but the last) accepted: senders cut at least this much (`unifed_site`'s
/// upload keeps 512 bytes below the packet limit of at least 1 KiB), and it bounds the
/// received-index bitmap of a set to a bit per 512 bytes of its payload.
pub const MIN_CHUNK: u64 = 512;

/// Why a chunk was not kept.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The chunk does not fit its set (see [`ChunkError`]).
    #[error(transparent)]
    Chunk(#[from] ChunkError),
    /// Beginning the set would take the disk below its free-space floor (counting the bytes
    /// the sets in progress have still to write).
    #[error(
        "a set of {set_bytes} bytes would leave {free_bytes} free bytes, less than the floor of {floor_bytes} with {pending_bytes} still to come for sets in progress"
    )]
    DiskFloor {
        /// Bytes the set would write.
        set_bytes: u64,
        /// Bytes free on the disk now.
        free_bytes: u64,
        /// The floor.
        floor_bytes: u64,
        /// Bytes the sets in progress have still to write.
        pending_bytes: u64,
    },
    /// The spool file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// One incomplete set.
#[derive(Debug)]
struct Set {
    hash: [u8; 32],
    count: u32,
    total_len: u64,
    /// Length of every chunk but the last.
    size: u64,
    first_ms: u64,
    arrived: Arrivals,
    file: Arc<File>,
    /// Bytes written since the file's writeback was last started.
    unflushed: u64,
    path: PathBuf,
}

impl Set {
    /// The length chunk `index` must have.
    fn chunk_len(&self, index: u32) -> u64 {
        unifed_protocol::chunking::chunk_len(index, self.count, self.total_len, self.size)
    }
}

/// A set whose chunks have all arrived: its file (under a name of its own) holds the payload
/// and nothing else. Handing this on rather than the bytes keeps a complete update out of
/// memory until its reader takes it. The file is removed when this is dropped, unless it was
/// moved away from [`Received::path`] (the core adopts it as a spool file) by then.
#[derive(Debug)]
pub struct Received {
    file: Arc<File>,
    path: PathBuf,
    len: u64,
    hash: [u8; 32],
}

impl Drop for Received {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Received {
    /// The set's payload hash (what its chunks named).
    pub fn hash(&self) -> [u8; 32] {
        self.hash
    }

    /// The file holding the payload (no other set's file ever has this name).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The payload: the file's pages mapped, not copied into a fresh buffer (see
    /// [`MappedFile`]; the file is this aggregator's own).
    pub fn read(&self) -> Result<Bytes, UploadError> {
        let io = |source| UploadError::Io {
            path: self.path.clone(),
            source,
        };
        let len =
            usize::try_from(self.len).map_err(|_| io(std::io::ErrorKind::FileTooLarge.into()))?;
        let payload = MappedFile::map(&self.file, len).map_err(io)?;
        Ok(Bytes::from_owner(payload))
    }
}

/// Every site's incomplete chunked uploads, spooled in one folder.
#[derive(Debug)]
pub struct SpooledUploads {
    dir: PathBuf,
    per_site: u64,
    timeout_ms: u64,
    sites: BTreeMap<Id, Vec<Set>>,
    last_sweep_ms: Option<u64>,
    /// Sets begun so far: each one's file (incomplete, then complete) gets a name of its own,
    /// never reused.
    begun: u64,
    /// Starts the sets' writeback as they come.
    flusher: Flusher,
    /// Free bytes the disk must keep (0: none).
    floor: u64,
}

impl SpooledUploads {
    /// Uploads spooled in `dir` (emptied now), each at most `per_site` bytes, dropped when
    /// their first chunk is older than `timeout_ms`.
    pub fn open(dir: &Path, per_site: u64, timeout_ms: u64) -> Result<Self, UploadError> {
        let io = |source| UploadError::Io {
            path: dir.to_path_buf(),
            source,
        };
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
            _ => {}
        }
        std::fs::create_dir_all(dir).map_err(io)?;
        Ok(SpooledUploads {
            dir: dir.to_path_buf(),
            per_site,
            timeout_ms,
            sites: BTreeMap::new(),
            last_sweep_ms: None,
            begun: 0,
            flusher: Flusher::start().map_err(io)?,
            floor: 0,
        })
    }

    /// These uploads, begun only while the disk keeps `floor` free bytes with the new set and
    /// the rest of every set in progress written (the aggregator's `min_free_disk_bytes`).
    pub fn with_disk_floor(mut self, floor: u64) -> Self {
        self.floor = floor;
        self
    }

    /// `Err` when a set of `set_bytes` would take the disk below the floor.
    fn room_for(&self, set_bytes: u64) -> Result<(), UploadError> {
        if self.floor == 0 {
            return Ok(());
        }
        let free_bytes = crate::disk::free_bytes(&self.dir).map_err(|e| UploadError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let pending_bytes: u64 = self
            .sites
            .values()
            .flatten()
            .map(|s| {
                s.total_len
                    .saturating_sub(s.size * u64::from(s.arrived.got()))
            })
            .sum();
        let needed = set_bytes
            .saturating_add(pending_bytes)
            .saturating_add(self.floor);
        if free_bytes < needed {
            return Err(UploadError::DiskFloor {
                set_bytes,
                free_bytes,
                floor_bytes: self.floor,
                pending_bytes,
            });
        }
        Ok(())
    }

    /// Adds `site`'s chunk, received at `now_ms` and opened with `site`'s key; returns the set
    /// when this chunk completes it (its payload is read by [`Received::read`]). A repeated
    /// chunk is ignored.
    pub fn insert(
        &mut self,
        site: &Id,
        chunk: ChunkRef<'_>,
        now_ms: u64,
    ) -> Result<Option<Received>, UploadError> {
        let Chunk {
            payload_hash: hash,
            index,
            count,
            total_len,
            data,
        } = chunk;
        let len = data.len() as u64;
        check_set((index, count, total_len), self.per_site as usize)?;
        let bad_len = |room: u64| ChunkError::BadChunkLength {
            index,
            len: data.len(),
            room,
        };
        // A new set is begun only when the disk has room for it.
        if !self
            .sites
            .get(site)
            .is_some_and(|sets| sets.iter().any(|s| s.hash == hash))
        {
            self.room_for(total_len)?;
        }
        let sets = self.sites.entry(site.clone()).or_default();
        let k = match sets.iter().position(|s| s.hash == hash) {
            Some(k) => {
                let s = &sets[k];
                if s.count != count || s.total_len != total_len {
                    return Err(ChunkError::SetMismatch {
                        count,
                        total_len,
                        set_count: s.count,
                        set_total_len: s.total_len,
                    }
                    .into());
                }
                if s.arrived.has(index) {
                    return Ok(None);
                }
                if len != s.chunk_len(index) {
                    return Err(bad_len(s.chunk_len(index)).into());
                }
                k
            }
            None => {
                let size = geometry(index, count, total_len, len).ok_or_else(|| bad_len(0))?;
                if sets.len() >= SETS_PER_SITE {
                    // The oldest set goes: a site uploads one update at a time.
                    let old = sets.remove(0);
                    let _ = std::fs::remove_file(&old.path);
                }
                // A file of its own, made new: the hash is what the site claims (a site
                // with a key can start two sets whose hashes share any prefix), and a file
                // two sets wrote could change an update after it was checked.
                self.begun += 1;
                let path = self
                    .dir
                    .join(format!("{site}.{}.{}.part", hex(&hash), self.begun));
                let file = create_part(&path)?;
                sets.push(Set {
                    hash,
                    count,
                    total_len,
                    size,
                    first_ms: now_ms,
                    arrived: Arrivals::new(count),
                    file: Arc::new(file),
                    unflushed: 0,
                    path,
                });
                sets.len() - 1
            }
        };
        let s = &mut sets[k];
        s.file
            .write_all_at(data, s.size * u64::from(index))
            .map_err(|source| UploadError::Io {
                path: s.path.clone(),
                source,
            })?;
        s.arrived.mark(index);
        // The disk takes the set as it comes: the fsync that makes an accepted update durable
        // (on the aggregator's path to answering it) then finds it written, not 57 MB to write.
        s.unflushed += len;
        if s.unflushed >= WRITEBACK_BYTES || s.arrived.got() == count {
            self.flusher.flush(&s.file, 0, s.total_len);
            s.unflushed = 0;
        }
        if s.arrived.got() < count {
            return Ok(None);
        }
        let s = sets.remove(k);
        if sets.is_empty() {
            self.sites.remove(site);
        }
        completed(s).map(Some)
    }

    /// Drops (and deletes) every set whose first chunk is older than the timeout at `now_ms`;
    /// called on every message, it sweeps at most once per [`SWEEP_EVERY_MS`].
    pub fn expire(&mut self, now_ms: u64) {
        if self
            .last_sweep_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < SWEEP_EVERY_MS)
        {
            return;
        }
        self.last_sweep_ms = Some(now_ms);
        let timeout = self.timeout_ms;
        for sets in self.sites.values_mut() {
            sets.retain(|s| {
                let keep = now_ms.saturating_sub(s.first_ms) <= timeout;
                if !keep {
                    let _ = std::fs::remove_file(&s.path);
                }
                keep
            });
        }
        self.sites.retain(|_, sets| !sets.is_empty());
    }

    /// Incomplete sets held, over all sites.
    pub fn pending_sets(&self) -> usize {
        self.sites.values().map(Vec::len).sum()
    }
}

/// The length of every chunk but the last in a set of `count` chunks and `total_len` bytes
/// whose chunk `index` has `len` bytes ([`cut_size`]), or `None` if no such cut exists or its
/// chunks are shorter than [`MIN_CHUNK`].
fn geometry(index: u32, count: u32, total_len: u64, len: u64) -> Option<u64> {
    cut_size(index, count, total_len, len).filter(|&size| count == 1 || size >= MIN_CHUNK)
}

/// Makes the file of a new set at `path` (never an existing one).
fn create_part(path: &Path) -> Result<File, UploadError> {
    File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|source| UploadError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// A set whose chunks have all arrived, its file renamed to a name of its own.
fn completed(s: Set) -> Result<Received, UploadError> {
    // Renamed now, keeping the set's own number: the complete one's name is never reused,
    // so removing it never removes another's.
    let path = s.path.with_extension("complete");
    if let Err(source) = std::fs::rename(&s.path, &path) {
        let _ = std::fs::remove_file(&s.path);
        return Err(UploadError::Io {
            path: s.path,
            source,
        });
    }
    Ok(Received {
        file: s.file,
        path,
        len: s.total_len,
        hash: s.hash,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::chunking::{chunks, payload_hash};

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn site(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    #[test]
    fn chunks_in_any_order_give_the_payload_back_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut u = SpooledUploads::open(&dir.path().join("in"), 1 << 20, 60_000).unwrap();
        let p = payload(10_000);
        let mut cs: Vec<Chunk> = chunks(&p, 3_000).collect();
        cs.reverse(); // the last chunk (1,000 bytes) first
        let n = cs.len();
        for (k, c) in cs.into_iter().enumerate() {
            let done = u.insert(&site("a"), c.as_ref(), 0).unwrap();
            assert_eq!(done.is_some(), k + 1 == n);
            if let Some(got) = done {
                assert_eq!(got.hash(), payload_hash(&p));
                assert_eq!(got.read().unwrap(), p);
            }
        }
        assert_eq!(u.pending_sets(), 0);
        assert_eq!(std::fs::read_dir(dir.path().join("in")).unwrap().count(), 0);
    }

    #[test]
    fn a_chunk_of_the_wrong_length_is_refused_before_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut u = SpooledUploads::open(dir.path(), 1 << 20, 60_000).unwrap();
        let p = payload(10_000);
        let cs: Vec<Chunk> = chunks(&p, 3_000).collect();
        u.insert(&site("a"), cs[0].as_ref(), 0).unwrap();
        let mut short = cs[1].clone();
        short.data.truncate(2_000);
        assert!(matches!(
            u.insert(&site("a"), short.as_ref(), 0),
            Err(UploadError::Chunk(ChunkError::BadChunkLength {
                index: 1,
                ..
            }))
        ));
        // A first chunk that no equal cut explains (a 1,001-byte last chunk of 4).
        let mut odd = chunks(&payload(9_001), 3_000).last().unwrap();
        odd.data.push(0);
        assert!(matches!(
            u.insert(&site("b"), odd.as_ref(), 0),
            Err(UploadError::Chunk(ChunkError::BadChunkLength { .. }))
        ));
        // The set of `a` is intact and completes.
        let mut done = None;
        for c in cs.into_iter().skip(1) {
            done = u.insert(&site("a"), c.as_ref(), 0).unwrap();
        }
        assert_eq!(done.map(|d| d.read().unwrap().to_vec()), Some(p));
    }

    fn names(d: &Path) -> Vec<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Chunks come opened with their site's key: a set is handed on as they wrote it, in order
    /// or not, without being hashed (a tampered byte stands for a site that cut its own update
    /// wrong), and its file is the only one left until it is dropped.
    #[test]
    fn a_set_is_what_its_chunks_wrote_in_any_order_and_is_not_hashed() {
        for swap in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let mut u = SpooledUploads::open(dir.path(), 1 << 20, 60_000).unwrap();
            let p = payload(5_000);
            let mut cs: Vec<Chunk> = chunks(&p, 1_000).collect();
            cs[2].data[7] ^= 1;
            if swap {
                cs.swap(0, 1);
            }
            let mut last = None;
            for c in cs {
                last = u.insert(&site("a"), c.as_ref(), 0).unwrap();
            }
            assert_eq!(u.pending_sets(), 0);
            let set = last.unwrap();
            assert_eq!(set.hash(), payload_hash(&p));
            let mut tampered = p.clone();
            tampered[2_007] ^= 1;
            assert_eq!(set.read().unwrap(), tampered);
            assert_eq!(
                names(dir.path()),
                [set.path().file_name().unwrap().to_string_lossy()]
            );
            drop(set);
            assert!(names(dir.path()).is_empty());
        }
    }

    /// The same update sent again while the first copy waits for the core is another file:
    /// dropping (or adopting) one never touches the other.
    #[test]
    fn a_complete_set_keeps_its_file_apart_from_a_resend_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut u = SpooledUploads::open(dir.path(), 1 << 20, 60_000).unwrap();
        let p = payload(5_000);
        let mut sets = Vec::new();
        for _ in 0..2 {
            let mut last = None;
            for c in chunks(&p, 1_000) {
                last = u.insert(&site("a"), c.as_ref(), 0).unwrap();
            }
            sets.push(last.unwrap());
        }
        assert_ne!(sets[0].path(), sets[1].path());
        let second = sets.pop().unwrap();
        let kept = second.path().to_path_buf();
        drop(sets);
        assert_eq!(std::fs::read(&kept).unwrap(), p);
        assert_eq!(second.read().unwrap(), p);
        // Moved away (as the core adopts it), the file outlives the set.
        let adopted = dir.path().join("adopted");
        std::fs::rename(&kept, &adopted).unwrap();
        drop(second);
        assert_eq!(std::fs::read(&adopted).unwrap(), p);
    }

    /// A site with a key claims any hash: two of its sets whose hashes share their first
    /// bytes, their chunks interleaved, each get a file of their own and their own bytes back
    /// (they shared one, named by the prefix, so one set's chunks went into the other's file).
    #[test]
    fn sets_whose_claimed_hashes_share_a_prefix_keep_apart() {
        let dir = tempfile::tempdir().unwrap();
        let mut u = SpooledUploads::open(dir.path(), 1 << 20, 60_000).unwrap();
        let (p, q) = (payload(5_000), vec![0xA5; 5_000]);
        let mut a: Vec<Chunk> = chunks(&p, 1_000).collect();
        let mut b: Vec<Chunk> = chunks(&q, 1_000).collect();
        let mut hash = a[0].payload_hash;
        hash[31] ^= 1;
        b.iter_mut().for_each(|c| c.payload_hash = hash);
        let last_of_a = a.pop().unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!(u.insert(&site("a"), x.as_ref(), 0).unwrap().is_none());
            assert!(u.insert(&site("a"), y.as_ref(), 0).unwrap().is_none());
        }
        let first = u
            .insert(&site("a"), last_of_a.as_ref(), 0)
            .unwrap()
            .unwrap();
        assert_eq!(first.read().unwrap(), p);
        let second = u.insert(&site("a"), b[4].as_ref(), 0).unwrap().unwrap();
        assert_eq!(second.hash(), hash);
        assert_eq!(second.read().unwrap(), q);
        assert_eq!(first.read().unwrap(), p);
        assert_ne!(first.path(), second.path());
    }

    /// A set is begun only while the disk keeps its floor with the whole set and the rest of
    /// every set in progress: a floor above the free space refuses a site's first chunk before
    /// any file is made, and sets in progress still complete.
    #[test]
    fn a_set_that_would_take_the_disk_below_its_floor_is_not_begun() {
        const MIB: usize = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let free = crate::disk::free_bytes(dir.path()).unwrap();
        let payload = payload(3 * MIB);
        let cs: Vec<Chunk> = chunks(&payload, MIB).collect();
        // Room for one set of 3 MiB, not for a second one beside it (1 MiB of slack either
        // way for what other tests write meanwhile).
        let mut up = SpooledUploads::open(&dir.path().join("in"), 8 << 20, 60_000)
            .unwrap()
            .with_disk_floor(free - 4 * MIB as u64);
        assert!(up.insert(&site("a"), cs[0].as_ref(), 0).unwrap().is_none());
        let other: Vec<u8> = payload.iter().map(|b| b ^ 1).collect();
        let first_of_other = chunks(&other, MIB).next().unwrap();
        match up.insert(&site("b"), first_of_other.as_ref(), 0) {
            Err(UploadError::DiskFloor {
                set_bytes,
                pending_bytes,
                ..
            }) => assert_eq!((set_bytes, pending_bytes), (3 << 20, 2 << 20)),
            other => panic!("{other:?}"),
        }
        assert_eq!(names(&dir.path().join("in")).len(), 1);
        let mut done = None;
        for c in &cs[1..] {
            done = up.insert(&site("a"), c.as_ref(), 0).unwrap();
        }
        assert_eq!(done.unwrap().read().unwrap(), payload);
        let mut full = SpooledUploads::open(&dir.path().join("full"), 8 << 20, 60_000)
            .unwrap()
            .with_disk_floor(u64::MAX / 2);
        assert!(matches!(
            full.insert(&site("a"), cs[0].as_ref(), 0),
            Err(UploadError::DiskFloor { .. })
        ));
        assert!(names(&dir.path().join("full")).is_empty());
    }

    #[test]
    fn limits_sets_per_site_size_and_age() {
        let dir = tempfile::tempdir().unwrap();
        let mut u = SpooledUploads::open(dir.path(), 4_000, 1_000).unwrap();
        assert!(matches!(
            u.insert(
                &site("a"),
                chunks(&payload(5_000), 1_000).next().unwrap().as_ref(),
                0
            ),
            Err(UploadError::Chunk(ChunkError::PayloadTooLarge { .. }))
        ));
        // Three sets of one site: the oldest is dropped, the others stay.
        for (k, n) in [3_000, 3_001, 3_002].into_iter().enumerate() {
            let c = chunks(&payload(n), 1_000).next().unwrap();
            u.insert(&site("a"), c.as_ref(), k as u64).unwrap();
        }
        u.insert(
            &site("b"),
            chunks(&payload(2_000), 1_000).next().unwrap().as_ref(),
            500,
        )
        .unwrap();
        assert_eq!(u.pending_sets(), 3);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
        // At 1,400 ms the sets of `a` (first chunks at 1 and 2 ms) are too old; `b`'s is not.
        u.expire(1_400);
        assert_eq!(u.pending_sets(), 1);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn geometry_accepts_exactly_the_cuts_of_chunks() {
        for (total, size) in [(10_000u64, 3_000u64), (9_000, 3_000), (1, 1), (1_025, 512)] {
            let count = total.div_ceil(size) as u32;
            for index in 0..count {
                let len = if index + 1 == count {
                    total - size * u64::from(count - 1)
                } else {
                    size
                };
                assert_eq!(
                    geometry(index, count, total, len),
                    Some(size),
                    "{total}/{size}"
                );
            }
        }
        assert_eq!(geometry(0, 2, 10_000, 4_000), None); // 2 x 4,000 cannot carry 10,000 bytes
        assert_eq!(geometry(1, 2, 10_000, 0), None); // an empty last chunk
        assert_eq!(geometry(0, 3, 1_000, 400), None); // chunks shorter than MIN_CHUNK
        assert_eq!(geometry(0, 1, 0, 0), Some(0)); // the empty payload
    }
}
