//! Sealed binary files of the data directory: the body, then a 32-byte trailer that sums it.
//! Both ways go a block at a time, so a model-sized file is never whole in memory:
//! [`SealedFile`] sums what it writes, and [`read_sealed`] sums what it reads and checks the
//! trailer at the end before the caller gets anything.
//!
//! The sum guards the aggregator's own files against torn writes and damaged disks; nothing an
//! attacker sends reaches them unchecked (signatures do that). Files are written with XXH3-128
//! (the trailer is the sum, then [`XXH3_TAG`]), about 10x faster than SHA-256 on a CPU with
//! SHA instructions: a model-sized file was hashed five times a round. Files written before
//! that end with a SHA-256 and are still read.

use crate::disk::{FORMAT_VERSION, StoreError, commit, corrupt, io};
use sha2::Digest;
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use unifed_protocol::EncodedTensor;

/// A delta tensor read from the spool: values, or a lossy tensor's wire form.
pub(crate) enum SpooledTensor {
    /// The values.
    Dense(Vec<f32>),
    /// A postcard [`EncodedTensor`], not decoded yet.
    Wire(Vec<u8>),
}

impl SpooledTensor {
    /// The tensor's values (decoding a wire form), or what is wrong with it.
    pub(crate) fn decode(self, path: &Path) -> Result<Vec<f32>, StoreError> {
        match self {
            SpooledTensor::Dense(v) => Ok(v),
            SpooledTensor::Wire(bytes) => {
                let t: EncodedTensor =
                    postcard::from_bytes(&bytes).map_err(|e| corrupt(path, e.to_string()))?;
                unifed_protocol::decode(&t).map_err(|e| corrupt(path, e.to_string()))
            }
        }
    }
    /// Calls `f(at, values)` with the tensor's values a block at a time in order (a wire form
    /// decoded as it goes, without a decoded copy of the whole tensor) when it holds `len` of
    /// them; gives the count it holds (nothing is called when that is not `len`).
    pub(crate) fn each_block(
        self,
        path: &Path,
        len: usize,
        mut f: impl FnMut(usize, &[f32]),
    ) -> Result<usize, StoreError> {
        match self {
            SpooledTensor::Dense(v) => {
                if v.len() == len {
                    f(0, &v);
                }
                Ok(v.len())
            }
            SpooledTensor::Wire(bytes) => {
                let t: EncodedTensor =
                    postcard::from_bytes(&bytes).map_err(|e| corrupt(path, e.to_string()))?;
                let n = t
                    .numel()
                    .ok_or_else(|| corrupt(path, "a shape that overflows"))?;
                if n == len {
                    unifed_protocol::encoding::decode_blocks(&t, DECODE_BLOCK, f)
                        .map_err(|e| corrupt(path, e.to_string()))?;
                }
                Ok(n)
            }
        }
    }
}

/// Values a wire-form tensor is decoded in at a time.
const DECODE_BLOCK: usize = 1 << 16;

/// Length of the trailer of every sealed file.
pub(crate) const CHECKSUM_LEN: usize = 32;

/// The second half of an XXH3-128 trailer (the first is the sum, little-endian). A SHA-256
/// trailer ends this way with probability 2^-128.
pub(crate) const XXH3_TAG: &[u8; 16] = b"UniFed.xxh3-128\0";

/// The running sum of a sealed file's body.
pub(crate) enum Sum {
    /// What every file is written with.
    Xxh3(Box<xxhash_rust::xxh3::Xxh3Default>),
    /// Files written before XXH3 (read only).
    Sha256(sha2::Sha256),
}

impl Sum {
    pub(crate) fn xxh3() -> Sum {
        Sum::Xxh3(Box::new(xxhash_rust::xxh3::Xxh3Default::new()))
    }

    /// The sum a trailer names: XXH3 when it ends with [`XXH3_TAG`], SHA-256 otherwise.
    pub(crate) fn for_trailer(trailer: &[u8; CHECKSUM_LEN]) -> Sum {
        if &trailer[16..] == XXH3_TAG {
            Sum::xxh3()
        } else {
            Sum::Sha256(sha2::Sha256::new())
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            Sum::Xxh3(h) => h.update(bytes),
            Sum::Sha256(h) => h.update(bytes),
        }
    }

    /// The trailer of what was summed.
    pub(crate) fn trailer(&self) -> [u8; CHECKSUM_LEN] {
        match self {
            Sum::Xxh3(h) => {
                let mut t = [0u8; CHECKSUM_LEN];
                t[..16].copy_from_slice(&h.digest128().to_le_bytes());
                t[16..].copy_from_slice(XXH3_TAG);
                t
            }
            Sum::Sha256(h) => h.clone().finalize().into(),
        }
    }
}

/// Values read or written per block.
const BLOCK_VALUES: usize = 16 << 10;

/// A sealed binary file written as it goes: atomically and durably (temporary file, fsync,
/// rename, fsync of the folder), its sum computed on the way and appended by
/// [`SealedFile::finish`]; its writeback to the disk starts as it goes.
pub(crate) struct SealedFile {
    w: std::io::BufWriter<File>,
    h: Sum,
    /// Body bytes so far.
    len: u64,
    /// The file's writeback, started as it is written.
    writeback: unifed_net::disk::Writeback,
    tmp: PathBuf,
    path: PathBuf,
}

impl SealedFile {
    /// Starts writing `path` (as `path.tmp` until [`SealedFile::finish`]).
    pub(crate) fn create(path: &Path) -> Result<SealedFile, StoreError> {
        let tmp = path.with_extension("tmp");
        let f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        Ok(SealedFile {
            w: std::io::BufWriter::with_capacity(1 << 20, f),
            h: Sum::xxh3(),
            len: 0,
            writeback: Default::default(),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// Goes on writing `path` from the file `staged`, which holds `head` and nothing else
    /// (a file of this aggregator's, on the same file system): the body starts with `head`
    /// without writing it again, and [`SealedFile::finish`] renames `staged` to `path`.
    /// `None` when `staged` does not hold exactly `head`'s length.
    pub(crate) fn adopt(
        staged: &Path,
        path: &Path,
        head: &[u8],
    ) -> Result<Option<SealedFile>, StoreError> {
        let f = File::options()
            .append(true)
            .open(staged)
            .map_err(|e| io(staged, e))?;
        if f.metadata().map_err(|e| io(staged, e))?.len() != head.len() as u64 {
            return Ok(None);
        }
        let mut h = Sum::xxh3();
        h.update(head);
        Ok(Some(SealedFile {
            w: std::io::BufWriter::with_capacity(1 << 20, f),
            h,
            len: head.len() as u64,
            writeback: Default::default(),
            tmp: staged.to_path_buf(),
            path: path.to_path_buf(),
        }))
    }

    /// Body bytes written so far (where the next [`SealedFile::put`] lands).
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Appends `bytes` to the body.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.h.update(bytes);
        self.len += bytes.len() as u64;
        self.w.write_all(bytes).map_err(|e| io(&self.tmp, e))?;
        // A body is the file from its start.
        self.writeback.wrote_through(&self.w, self.len);
        Ok(())
    }

    /// Tensors as the store keeps them: their count, then each one's length and its
    /// little-endian values, a block of values at a time.
    pub(crate) fn put_tensors(&mut self, tensors: &[Vec<f32>]) -> Result<(), StoreError> {
        self.put(&(tensors.len() as u32).to_le_bytes())?;
        for t in tensors {
            self.put_values(t)?;
        }
        Ok(())
    }

    /// One tensor's length and little-endian values, a block of values at a time.
    fn put_values(&mut self, t: &[f32]) -> Result<(), StoreError> {
        self.put(&(t.len() as u64).to_le_bytes())?;
        self.put_f32s(t)
    }

    /// Values little-endian, a block at a time (no length before them).
    pub(crate) fn put_f32s(&mut self, t: &[f32]) -> Result<(), StoreError> {
        let mut buf = Vec::with_capacity(BLOCK_VALUES.min(t.len()) * 4);
        for part in t.chunks(BLOCK_VALUES) {
            buf.clear();
            buf.extend(part.iter().flat_map(|v| v.to_le_bytes()));
            self.put(&buf)?;
        }
        Ok(())
    }

    /// Appends the checksum, syncs, and puts the file in place.
    pub(crate) fn finish(self) -> Result<(), StoreError> {
        self.seal()?.commit()
    }

    /// Appends the checksum and syncs, leaving the file under its temporary name: durable but
    /// not in place until [`Sealed::commit`] (the slow half of [`SealedFile::finish`], which
    /// files of different names may do side by side).
    pub(crate) fn seal(mut self) -> Result<Sealed, StoreError> {
        let sum = self.h.trailer();
        self.w.write_all(&sum).map_err(|e| io(&self.tmp, e))?;
        self.w.flush().map_err(|e| io(&self.tmp, e))?;
        self.w.get_ref().sync_all().map_err(|e| io(&self.tmp, e))?;
        Ok(Sealed {
            tmp: std::mem::take(&mut self.tmp),
            path: std::mem::take(&mut self.path),
        })
    }
}

/// A sealed file synced under its temporary name ([`SealedFile::seal`]); dropped without
/// [`Sealed::commit`], the temporary file is removed.
#[derive(Debug)]
pub(crate) struct Sealed {
    tmp: PathBuf,
    path: PathBuf,
}

impl Sealed {
    /// Puts the file in place and syncs its folder.
    pub(crate) fn commit(mut self) -> Result<(), StoreError> {
        let tmp = std::mem::take(&mut self.tmp);
        commit(&tmp, &self.path)
    }
}

impl Drop for Sealed {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `body` sealed, atomically and durably.
pub(crate) fn write_sealed(path: &Path, body: &[u8]) -> Result<(), StoreError> {
    let mut f = SealedFile::create(path)?;
    f.put(body)?;
    f.finish()
}

/// Reads the body of the sealed file `path` with `parse`, which must consume all of it. The
/// checksum is checked after `parse`, and a damaged file is reported as a checksum mismatch
/// whatever `parse` made of it, so nothing read from a damaged file reaches the caller.
pub(crate) fn read_sealed<T>(
    path: &Path,
    parse: impl FnOnce(&mut Reader) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let f = File::open(path).map_err(|e| io(path, e))?;
    read_open(path, f, parse)
}

/// [`read_sealed`], or `None` when `path` does not exist.
pub(crate) fn read_sealed_optional<T>(
    path: &Path,
    parse: impl FnOnce(&mut Reader) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    match File::open(path) {
        Ok(f) => read_open(path, f, parse).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path, e)),
    }
}

/// The length of the sealed file `f`'s body, and its trailer (not checked yet).
pub(crate) fn trailer_of(path: &Path, f: &File) -> Result<(u64, [u8; CHECKSUM_LEN]), StoreError> {
    let len = f.metadata().map_err(|e| io(path, e))?.len();
    let Some(body) = len.checked_sub(CHECKSUM_LEN as u64) else {
        return Err(corrupt(path, "truncated: shorter than its checksum"));
    };
    let mut trailer = [0u8; CHECKSUM_LEN];
    f.read_exact_at(&mut trailer, body)
        .map_err(|e| io(path, e))?;
    Ok((body, trailer))
}

pub(crate) fn read_open<T>(
    path: &Path,
    f: File,
    parse: impl FnOnce(&mut Reader) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    // The trailer names the sum; `Reader::finish` reads it again in order and compares.
    let (body, trailer) = trailer_of(path, &f)?;
    let mut r = Reader {
        f: BufReader::with_capacity(1 << 20, f),
        h: Sum::for_trailer(&trailer),
        left: body,
        buf: Vec::new(),
        path,
    };
    let parsed = parse(&mut r);
    // Whatever `parse` left unread is hashed too: the checksum speaks first.
    let sealed = r.finish();
    match (parsed, sealed) {
        (_, Err(e)) => Err(e),
        (Err(e), Ok(_)) => Err(e),
        (Ok(t), Ok(0)) => Ok(t),
        (Ok(_), Ok(_)) => Err(corrupt(path, "trailing bytes")),
    }
}

/// The body of a sealed file, read in order and summed on the way.
pub(crate) struct Reader<'a> {
    f: BufReader<File>,
    h: Sum,
    /// Body bytes not read yet.
    left: u64,
    buf: Vec<u8>,
    path: &'a Path,
}

impl Reader<'_> {
    /// The file being read.
    pub(crate) fn path(&self) -> &Path {
        self.path
    }

    /// Body bytes not read yet.
    pub(crate) fn left(&self) -> u64 {
        self.left
    }

    /// The next `n` bytes of the body.
    pub(crate) fn take(&mut self, n: usize) -> Result<&[u8], StoreError> {
        if n as u64 > self.left {
            return Err(corrupt(self.path, "truncated"));
        }
        self.buf.resize(n, 0);
        self.f
            .read_exact(&mut self.buf)
            .map_err(|e| io(self.path, e))?;
        self.h.update(&self.buf);
        self.left -= n as u64;
        Ok(&self.buf)
    }

    /// A little-endian u32.
    pub(crate) fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    /// A little-endian u64.
    pub(crate) fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A magic and format version, which must be `m` and `want`.
    pub(crate) fn magic_version(&mut self, m: &[u8; 4], want: u32) -> Result<(), StoreError> {
        if self.take(4)? != m {
            return Err(corrupt(self.path, "bad magic"));
        }
        let v = self.u32()?;
        if v != want {
            return Err(corrupt(
                self.path,
                format!("format version {v} is not {want}"),
            ));
        }
        Ok(())
    }

    /// A magic and the store's format version.
    pub(crate) fn magic(&mut self, m: &[u8; 4]) -> Result<(), StoreError> {
        self.magic_version(m, FORMAT_VERSION)
    }

    /// Checks a file's header: magic and format version, spec hash (when the file has one) and
    /// the version its name gives.
    pub(crate) fn header(
        &mut self,
        magic: &[u8; 4],
        spec_hash: Option<&[u8; 32]>,
        version: u64,
    ) -> Result<(), StoreError> {
        self.magic(magic)?;
        if let Some(h) = spec_hash
            && self.take(32)? != h
        {
            return Err(corrupt(
                self.path,
                "spec hash differs from the federation's",
            ));
        }
        if self.u64()? != version {
            return Err(corrupt(
                self.path,
                "version in the file differs from its name",
            ));
        }
        Ok(())
    }

    /// Tensors as [`SealedFile::put_tensors`] writes them; a length is checked against what is
    /// left of the file before anything is allocated for it.
    pub(crate) fn tensors(&mut self) -> Result<Vec<Vec<f32>>, StoreError> {
        let n = self.u32()? as usize;
        let mut out = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            out.push(self.values()?);
        }
        Ok(out)
    }

    /// The length of the tensor that comes next, as [`SealedFile::put_values`] writes it,
    /// checked against what is left of the file; its values follow ([`Reader::value_blocks`]).
    pub(crate) fn value_count(&mut self) -> Result<usize, StoreError> {
        let len = self.u64()?;
        if len.checked_mul(4).is_none_or(|b| b > self.left) {
            return Err(corrupt(self.path, "truncated"));
        }
        Ok(len as usize)
    }

    /// The `len` values after [`Reader::value_count`], handed to `f` a block of little-endian
    /// bytes at a time with the index of the block's first value. `f` sees values that the
    /// checksum has not vouched for yet: what it makes of them must be dropped if the read
    /// fails.
    pub(crate) fn value_blocks(
        &mut self,
        len: usize,
        mut f: impl FnMut(usize, &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut at = 0;
        while at < len {
            let part = (len - at).min(BLOCK_VALUES);
            f(at, self.take(part * 4)?)?;
            at += part;
        }
        Ok(())
    }

    /// One tensor's length and values as [`SealedFile::put_tensors`] writes them.
    fn values(&mut self) -> Result<Vec<f32>, StoreError> {
        let len = self.value_count()?;
        let mut t = Vec::with_capacity(len);
        while t.len() < len {
            let part = (len - t.len()).min(BLOCK_VALUES);
            let bytes = self.take(part * 4)?;
            t.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(t)
    }

    /// A delta as a spool file of format 5 holds it: its count, then per tensor a tag and either
    /// its values as [`SealedFile::put_tensors`] writes one (tag 0: an exact tensor) or its length
    /// and wire form (tag 1: a lossy tensor). Lossy tensors come back in wire form, to
    /// be decoded with [`SpooledTensor::decode`] only once the checksum has passed (a damaged
    /// shape must not size an allocation).
    pub(crate) fn delta(&mut self) -> Result<Vec<SpooledTensor>, StoreError> {
        let n = self.u32()? as usize;
        let mut out = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            out.push(match self.delta_tensor()? {
                Some(wire) => SpooledTensor::Wire(wire),
                None => SpooledTensor::Dense(self.values()?),
            });
        }
        Ok(out)
    }

    /// The next tensor of a delta as [`Reader::delta`] reads it: a lossy tensor's wire
    /// form, or `None` for an exact tensor, whose length and values come next
    /// ([`Reader::value_count`]).
    pub(crate) fn delta_tensor(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        match self.take(1)?[0] {
            0 => Ok(None),
            1 => {
                let len = self.u64()?;
                if len > self.left {
                    return Err(corrupt(self.path, "truncated"));
                }
                Ok(Some(self.take(len as usize)?.to_vec()))
            }
            tag => Err(corrupt(self.path, format!("unknown tensor tag {tag}"))),
        }
    }

    /// Hashes the rest of the body, checks the checksum, and returns how many body bytes the
    /// parse had left unread.
    fn finish(mut self) -> Result<u64, StoreError> {
        let unread = self.left;
        let mut block = vec![0u8; 64 << 10];
        while self.left > 0 {
            let n = (self.left as usize).min(block.len());
            self.f
                .read_exact(&mut block[..n])
                .map_err(|e| io(self.path, e))?;
            self.h.update(&block[..n]);
            self.left -= n as u64;
        }
        let mut sum = [0u8; CHECKSUM_LEN];
        self.f.read_exact(&mut sum).map_err(|e| io(self.path, e))?;
        // A file that grew since it was measured is not the file that was sealed.
        let grew = self.f.read(&mut [0u8; 1]).map_err(|e| io(self.path, e))? > 0;
        if grew || self.h.trailer() != sum {
            return Err(corrupt(
                self.path,
                "checksum mismatch: the file was damaged or changed outside the aggregator",
            ));
        }
        Ok(unread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a file of a magic, then tensors longer than a block, and returns its path.
    fn sample(dir: &Path) -> (PathBuf, Vec<Vec<f32>>) {
        let tensors = vec![
            (0..BLOCK_VALUES * 2 + 7).map(|i| i as f32 * 0.5).collect(),
            vec![],
            vec![-1.25, f32::MIN_POSITIVE],
        ];
        let p = dir.join("x.bin");
        let mut f = SealedFile::create(&p).unwrap();
        f.put(b"UFEX").unwrap();
        f.put_tensors(&tensors).unwrap();
        f.finish().unwrap();
        (p, tensors)
    }

    fn parse(r: &mut Reader) -> Result<Vec<Vec<f32>>, StoreError> {
        if r.take(4)? != b"UFEX" {
            return Err(corrupt(r.path(), "bad magic"));
        }
        r.tensors()
    }

    fn message(e: StoreError) -> String {
        match e {
            StoreError::Corrupt { message, .. } => message,
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    /// A sealed file is durable under its temporary name only: in place once committed, its
    /// temporary file gone if it is dropped instead (an update refused after it was sealed).
    #[test]
    fn a_sealed_file_is_in_place_only_once_committed_and_gone_if_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let sealed = |name: &str| {
            let p = dir.path().join(name);
            let mut f = SealedFile::create(&p).unwrap();
            f.put(b"UFEX").unwrap();
            f.put_tensors(&[vec![1.5f32, -2.0]]).unwrap();
            (p.clone(), p.with_extension("tmp"), f.seal().unwrap())
        };
        let (kept, kept_tmp, s) = sealed("kept.bin");
        assert!(kept_tmp.exists() && !kept.exists());
        s.commit().unwrap();
        assert!(kept.exists() && !kept_tmp.exists());
        assert_eq!(read_sealed(&kept, parse).unwrap(), vec![vec![1.5f32, -2.0]]);
        let (dropped, dropped_tmp, s) = sealed("dropped.bin");
        assert!(dropped_tmp.exists());
        drop(s);
        assert!(!dropped.exists() && !dropped_tmp.exists());
    }

    #[test]
    fn tensors_read_back_exactly_across_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let (p, tensors) = sample(dir.path());
        assert_eq!(read_sealed(&p, parse).unwrap(), tensors);
        let body = 4 + 4 + 3 * 8 + 4 * (BLOCK_VALUES * 2 + 7 + 2);
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            (body + CHECKSUM_LEN) as u64
        );
    }

    #[test]
    fn files_are_sealed_with_xxh3_and_files_sealed_with_sha256_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let (p, tensors) = sample(dir.path());
        let new = std::fs::read(&p).unwrap();
        let (body, trailer) = new.split_at(new.len() - CHECKSUM_LEN);
        assert_eq!(&trailer[16..], XXH3_TAG);
        assert_eq!(
            trailer[..16],
            xxhash_rust::xxh3::xxh3_128(body).to_le_bytes()
        );

        // The same body as the store wrote it before XXH3: then its SHA-256.
        let mut old = body.to_vec();
        old.extend_from_slice(&sha2::Sha256::digest(body));
        std::fs::write(&p, &old).unwrap();
        assert_eq!(read_sealed(&p, parse).unwrap(), tensors);

        old[100] ^= 1;
        std::fs::write(&p, &old).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));

        // A SHA-256 trailer passed off as XXH3's (the tag written over its second half) is
        // checked as XXH3, and fails.
        old[100] ^= 1;
        let n = old.len();
        old[n - 16..].copy_from_slice(XXH3_TAG);
        std::fs::write(&p, &old).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));
    }

    #[test]
    fn a_damaged_length_is_reported_as_the_checksum_mismatch_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = sample(dir.path());
        let mut b = std::fs::read(&p).unwrap();
        // The first tensor's length (after magic and count) made huge: the parse alone would
        // call it truncated.
        b[8 + 7] = 0x7f;
        std::fs::write(&p, &b).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));
    }

    #[test]
    fn a_flipped_value_an_extra_byte_and_a_cut_file_are_all_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = sample(dir.path());
        let good = std::fs::read(&p).unwrap();

        let mut flipped = good.clone();
        flipped[100] ^= 1;
        std::fs::write(&p, &flipped).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));

        let mut longer = good.clone();
        longer.push(0);
        std::fs::write(&p, &longer).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));

        std::fs::write(&p, &good[..200]).unwrap();
        assert!(message(read_sealed(&p, parse).unwrap_err()).starts_with("checksum mismatch"));

        std::fs::write(&p, &good[..5]).unwrap();
        assert_eq!(
            message(read_sealed(&p, parse).unwrap_err()),
            "truncated: shorter than its checksum"
        );
    }

    #[test]
    fn a_body_the_parse_leaves_unread_is_trailing_bytes_and_an_absent_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = sample(dir.path());
        let magic_only = |r: &mut Reader| r.take(4).map(<[u8]>::to_vec);
        assert_eq!(
            message(read_sealed(&p, magic_only).unwrap_err()),
            "trailing bytes"
        );
        assert!(
            read_sealed_optional(&dir.path().join("absent.bin"), parse)
                .unwrap()
                .is_none()
        );
    }
}
