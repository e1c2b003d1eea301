//! Spool files of format 7 (6 is read too: it lacks the norm): the message an update arrived in, kept verbatim at the head of the
//! file, then a footer that says where its exact tensors lie in it. A chunked upload is already
//! on disk when the core accepts it, so its reassembled file *becomes* the spool file: the
//! footer and checksum are appended, the file is synced and renamed into the spool. A 57 MB
//! update is no longer written a second time (on the demo's VM that write took 0.09-0.17 s of
//! each update's 0.2-0.35 s spool, on the round's critical path).
//!
//! ```text
//! head     the message (when an exact tensor lies in it), then the values of any exact
//!          tensor that does not (little-endian)
//! footer   round u64, samples u64, norm f64 (the delta's L2 norm; not in format 6),
//!          head length u64,
//!          delta: count u32, then per tensor a tag and
//!            2: an exact tensor in the head: offset u64, value count u64
//!            1: a lossy tensor: length u64, its postcard wire form
//!          BN tensors (count u32; per tensor length u64, values), report and extras
//!          (length u32, postcard)
//! tail     footer length u64, "UFES", 7u32
//! trailer  XXH3-128 of everything before it, then its tag (as every sealed file)
//! ```
//!
//! A reader takes the tail and footer first (positioned reads), then reads the file once from
//! the start, summing it and handing each exact tensor's values on a block at a time; nothing
//! it made of the file counts until the checksum has passed, and a damaged file is reported as
//! the checksum mismatch it is, whatever its footer says. The fold of a round of such files
//! ([`Exact`]) reads each twice instead, its values by range and its sum whole, on several
//! threads.

use crate::disk::{StoreError, corrupt, io};
use crate::sealed::{CHECKSUM_LEN, Sealed, SealedFile, Sum, trailer_of};
use crate::strategy::Extras;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// An accepted update as [`crate::store::Store::spool_put`] keeps it: the delta as it arrived (in the order
/// the core hands to the strategy), the rest as [`crate::strategy::Contribution`] holds it.
#[derive(Debug)]
pub struct SpoolEntry<'a> {
    /// The message the update arrived in. Exact tensors that are slices of it are spooled as
    /// where they lie in it, and it is kept whole at the head of the spool file (empty: none).
    pub message: &'a [u8],
    /// A file of the data directory's file system that holds `message` and nothing else (a
    /// reassembled upload): it becomes the spool file, so the message is not written again.
    /// It is renamed away when it is adopted, and left alone otherwise.
    pub staged: Option<&'a Path>,
    /// Training samples behind it.
    pub samples: u64,
    /// The L2 norm of its delta (as decoded), what the round's norm clip compares.
    pub norm: f64,
    /// The site's report of its local training.
    pub report: &'a unifed_protocol::LocalReport,
    /// Its algorithm tensors, decoded.
    pub extras: &'a Extras,
    /// The delta, one tensor per averaged tensor in the strategy's order.
    pub delta: &'a [SpoolTensor<'a>],
    /// The BN tensors the sharing policy lets leave the site (values).
    pub bn: &'a [Vec<f32>],
}

/// One tensor of a spooled delta: exact values, or a lossy tensor in its wire form (what the
/// spool keeps of it: under ternary-q8 a seventeenth of its values' bytes).
#[derive(Debug, Clone, Copy)]
pub enum SpoolTensor<'a> {
    /// The values of an exact tensor.
    Values(&'a [f32]),
    /// The values of an exact tensor as little-endian bytes (as it arrived): spooled exactly as
    /// [`SpoolTensor::Values`] of the same values.
    Le(&'a [u8]),
    /// A lossy tensor as it arrived (read in place from the message).
    Wire(&'a unifed_protocol::EncodedTensorRef<'a>),
}

/// The spool files' magic (all formats).
pub(crate) const MAGIC: &[u8; 4] = b"UFES";
/// The format these files are written in.
pub(crate) const VERSION: u32 = 7;
/// The previous format, read still: its footer holds no norm.
const VERSION_NO_NORM: u32 = 6;
/// Bytes of the tail: footer length, magic, version.
const TAIL: u64 = 16;
/// Tag of an exact tensor in the head.
const IN_HEAD: u8 = 2;
/// Tag of a lossy tensor in its wire form.
const WIRE: u8 = 1;

/// Where `inner` starts in `outer`, when it is a slice of it.
fn offset_in(outer: &[u8], inner: &[u8]) -> Option<u64> {
    let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
    (!inner.is_empty() && i >= o && i + inner.len() <= o + outer.len()).then(|| (i - o) as u64)
}

/// Writes `entry` as the spool file `path`, synced under its temporary name until the
/// [`Sealed`] is committed: `entry.staged` is adopted when it holds the message and an exact
/// tensor lies in it; otherwise a new file is written.
pub(crate) fn seal(path: &Path, round: u64, entry: &SpoolEntry) -> Result<Sealed, StoreError> {
    // Exact tensors that are slices of the message, in the order they lie there (each at most
    // once, none overlapping another).
    let mut in_message: Vec<(usize, u64, u64)> = Vec::new();
    for (k, t) in entry.delta.iter().enumerate() {
        if let SpoolTensor::Le(b) = t
            && let Some(at) = offset_in(entry.message, b)
        {
            in_message.push((k, at, b.len() as u64));
        }
    }
    in_message.sort_by_key(|&(_, at, _)| at);
    let mut end = 0;
    in_message.retain(|&(_, at, len)| {
        let fits = at >= end;
        if fits {
            end = at + len;
        }
        fits
    });
    let keep_message = !in_message.is_empty();
    let head = if keep_message { entry.message } else { &[] };
    let adopted = match entry.staged {
        Some(staged) if keep_message => SealedFile::adopt(staged, path, head)?,
        _ => None,
    };
    let mut f = match adopted {
        Some(f) => f,
        None => {
            let mut f = SealedFile::create(path)?;
            f.put(head)?;
            f
        }
    };
    // Every exact tensor not in the message goes after it, as its values.
    let mut offsets: Vec<Option<(u64, u64)>> = vec![None; entry.delta.len()];
    for &(k, at, len) in &in_message {
        offsets[k] = Some((at, len / 4));
    }
    for (k, t) in entry.delta.iter().enumerate() {
        if offsets[k].is_some() {
            continue;
        }
        let at = f.len();
        match t {
            SpoolTensor::Le(b) => {
                f.put(b)?;
                offsets[k] = Some((at, b.len() as u64 / 4));
            }
            SpoolTensor::Values(v) => {
                f.put_f32s(v)?;
                offsets[k] = Some((at, v.len() as u64));
            }
            SpoolTensor::Wire(_) => {}
        }
    }
    let head_len = f.len();
    let mut footer = Vec::new();
    footer.extend_from_slice(&round.to_le_bytes());
    footer.extend_from_slice(&entry.samples.to_le_bytes());
    footer.extend_from_slice(&entry.norm.to_le_bytes());
    footer.extend_from_slice(&head_len.to_le_bytes());
    footer.extend_from_slice(&(entry.delta.len() as u32).to_le_bytes());
    for (t, place) in entry.delta.iter().zip(&offsets) {
        match (t, place) {
            (SpoolTensor::Wire(t), _) => {
                let wire = postcard::to_allocvec(t).expect("a tensor serialises");
                footer.push(WIRE);
                footer.extend_from_slice(&(wire.len() as u64).to_le_bytes());
                footer.extend_from_slice(&wire);
            }
            (_, Some((at, count))) => {
                footer.push(IN_HEAD);
                footer.extend_from_slice(&at.to_le_bytes());
                footer.extend_from_slice(&count.to_le_bytes());
            }
            (_, None) => unreachable!("every exact tensor has a place in the head"),
        }
    }
    footer.extend_from_slice(&(entry.bn.len() as u32).to_le_bytes());
    for t in entry.bn {
        footer.extend_from_slice(&(t.len() as u64).to_le_bytes());
        footer.extend(t.iter().flat_map(|v| v.to_le_bytes()));
    }
    let typed = postcard::to_allocvec(&(entry.report, entry.extras)).expect("report serialises");
    footer.extend_from_slice(&(typed.len() as u32).to_le_bytes());
    footer.extend_from_slice(&typed);
    let footer_len = footer.len() as u64;
    footer.extend_from_slice(&footer_len.to_le_bytes());
    footer.extend_from_slice(MAGIC);
    footer.extend_from_slice(&VERSION.to_le_bytes());
    f.put(&footer)?;
    f.seal()
}

/// One tensor of a spooled delta, as the footer places it.
pub(crate) enum Placed {
    /// An exact tensor: `count` values at `offset` of the head.
    InHead {
        /// Byte offset in the file.
        offset: u64,
        /// Values.
        count: usize,
    },
    /// A lossy tensor's wire form, decoded once the checksum has passed.
    Wire(Vec<u8>),
}

/// A spool file's footer, read before the checksum has vouched for it: what it sizes is bounded
/// by the file's length.
pub(crate) struct Footer {
    /// Training samples behind the update.
    pub samples: u64,
    /// The L2 norm of the delta (`None` in format 6).
    pub norm: Option<f64>,
    /// The delta, in the strategy's order.
    pub delta: Vec<Placed>,
    /// Shared BN tensors.
    pub bn: Vec<Vec<f32>>,
    /// Postcard (report, extras).
    pub typed: Vec<u8>,
}

/// The footer's bytes, read in order.
struct Cursor<'a> {
    b: &'a [u8],
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], StoreError> {
        if n > self.b.len() as u64 {
            return Err(corrupt(self.path, "footer truncated"));
        }
        let (a, rest) = self.b.split_at(n as usize);
        self.b = rest;
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
}

/// Parses a footer (`b`) of a file whose head is `head_len` bytes, of spool round `round`.
fn parse_footer(
    path: &Path,
    b: &[u8],
    head_len: u64,
    round: u64,
    version: u32,
) -> Result<Footer, StoreError> {
    let mut c = Cursor { b, path };
    if c.u64()? != round {
        return Err(corrupt(path, "round in the file differs from its folder"));
    }
    let samples = c.u64()?;
    let norm = if version == VERSION_NO_NORM {
        None
    } else {
        Some(f64::from_bits(c.u64()?))
    };
    if c.u64()? != head_len {
        return Err(corrupt(path, "footer names another head length"));
    }
    let n = c.u32()? as usize;
    let mut delta = Vec::with_capacity(n.min(4096));
    for k in 0..n {
        delta.push(match c.take(1)?[0] {
            IN_HEAD => {
                let (offset, count) = (c.u64()?, c.u64()?);
                if count
                    .checked_mul(4)
                    .and_then(|b| b.checked_add(offset))
                    .is_none_or(|end| end > head_len)
                {
                    return Err(corrupt(
                        path,
                        format!("delta tensor {k} lies outside the head"),
                    ));
                }
                Placed::InHead {
                    offset,
                    count: count as usize,
                }
            }
            WIRE => {
                let len = c.u64()?;
                Placed::Wire(c.take(len)?.to_vec())
            }
            tag => return Err(corrupt(path, format!("unknown tensor tag {tag}"))),
        });
    }
    // Read in one pass: no two tensors may share bytes.
    if in_head_order(&delta)
        .windows(2)
        .any(|w| w[1].1 < w[0].1 + w[0].2 as u64 * 4)
    {
        return Err(corrupt(path, "delta tensors overlap in the head"));
    }
    let nb = c.u32()? as usize;
    let mut bn = Vec::with_capacity(nb.min(4096));
    for _ in 0..nb {
        let len = c.u64()?;
        let bytes = c.take(len.saturating_mul(4))?;
        bn.push(
            bytes
                .chunks_exact(4)
                .map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]))
                .collect(),
        );
    }
    let typed_len = u64::from(c.u32()?);
    let typed = c.take(typed_len)?.to_vec();
    if !c.b.is_empty() {
        return Err(corrupt(path, "trailing bytes in the footer"));
    }
    Ok(Footer {
        samples,
        norm,
        delta,
        bn,
        typed,
    })
}

/// The exact tensors of `delta` that lie in the head, as (index, offset, count), in the order
/// they lie there.
fn in_head_order(delta: &[Placed]) -> Vec<(usize, u64, usize)> {
    let mut v: Vec<(usize, u64, usize)> = delta
        .iter()
        .enumerate()
        .filter_map(|(k, p)| match *p {
            Placed::InHead { offset, count } => Some((k, offset, count)),
            Placed::Wire(_) => None,
        })
        .collect();
    v.sort_by_key(|&(_, offset, _)| offset);
    v
}

/// Whether the file `f` starts with the spool magic: a file of format 4 or 5, which begin with
/// their magic and version (one of format 6 begins with its message, or its round).
pub(crate) fn starts_with_magic(path: &Path, f: &File) -> Result<bool, StoreError> {
    let mut head = [0u8; 4];
    match f.read_exact_at(&mut head, 0) {
        Ok(()) => Ok(&head == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io(path, e)),
    }
}

/// Reads the spool file `f` (at `path`, of round `round`): its footer goes to `check`, which
/// makes the reader's state, then each exact tensor's values go to `values(state, k, first
/// value, little-endian bytes)` a block at a time as the file is read and summed. Returns the
/// footer and the state once the checksum has passed. Errors come in this order: the checksum,
/// the footer, `check`, `values` (which sees values the checksum has not vouched for yet: what
/// it makes of them must be dropped on an error).
pub(crate) fn read<T>(
    path: &Path,
    f: File,
    round: u64,
    check: impl FnOnce(&Footer) -> Result<T, StoreError>,
    mut values: impl FnMut(&mut T, usize, usize, &[u8]) -> Result<(), StoreError>,
) -> Result<(Footer, T), StoreError> {
    let (body, trailer) = trailer_of(path, &f)?;
    let footer = footer_of(path, &f, body, round);
    let footer = footer.and_then(|ft| check(&ft).map(|state| (ft, state)));
    // Then the whole body in order, summed; exact tensors' values handed on as they pass.
    let ranges = match &footer {
        Ok((ft, _)) => in_head_order(&ft.delta),
        Err(_) => Vec::new(),
    };
    let mut b = Body::new(&f, READ_BLOCK, &trailer, path.to_path_buf());
    let mut failed = None;
    let mut footer = footer;
    for &(k, offset, count) in &ranges {
        b.read_to(offset, |_, _| {})?;
        b.read_to(offset + count as u64 * 4, |at, bytes| {
            if failed.is_none()
                && let Ok((_, st)) = footer.as_mut()
                && let Err(e) = values(st, k, at, bytes)
            {
                failed = Some(e);
            }
        })?;
    }
    b.read_to(body, |_, _| {})?;
    b.check(body, &trailer)?;
    let footer = footer?;
    match failed {
        Some(e) => Err(e),
        None => Ok(footer),
    }
}

/// The footer of the file `f` whose body (all but the checksum) is `body` bytes: tail and footer
/// read by position, only what the file can hold.
fn footer_of(path: &Path, f: &File, body: u64, round: u64) -> Result<Footer, StoreError> {
    let at = body
        .checked_sub(TAIL)
        .ok_or_else(|| corrupt(path, "truncated: no footer"))?;
    let mut tail = [0u8; TAIL as usize];
    f.read_exact_at(&mut tail, at).map_err(|e| io(path, e))?;
    let version = u32::from_le_bytes(tail[12..].try_into().expect("4"));
    if &tail[8..12] != MAGIC {
        return Err(corrupt(path, "bad magic"));
    }
    if version != VERSION && version != VERSION_NO_NORM {
        return Err(corrupt(
            path,
            format!("format version {version} is not {VERSION} (or 4 to 6, which it reads)"),
        ));
    }
    let footer_len = u64::from_le_bytes(tail[..8].try_into().expect("8"));
    let head_len = at
        .checked_sub(footer_len)
        .ok_or_else(|| corrupt(path, "footer longer than the file"))?;
    let mut b = vec![0u8; footer_len as usize];
    f.read_exact_at(&mut b, head_len).map_err(|e| io(path, e))?;
    parse_footer(path, &b, head_len, round, version)
}

/// The footer of the spool file `f` at `path` of round `round`, read before its checksum has
/// vouched for it (what a round's bounds are computed from; the fold checks every file).
pub(crate) fn footer(path: &Path, f: &File, round: u64) -> Result<Footer, StoreError> {
    let (len, _) = trailer_of(path, f)?;
    footer_of(path, f, len, round)
}

/// A spool file whose delta is exact tensors in its head only, read by position from any
/// number of threads at once: several files of a round are folded value range by value range
/// this way ([`crate::spoolround::fold_round`]), while [`Exact::verify`] reads each
/// one whole and checks its sum. Nothing read counts until `verify` has passed.
pub(crate) struct Exact {
    /// The footer (read before the checksum has vouched for it).
    pub footer: Footer,
    /// The delta's tensors as (index, offset, count), in the order they lie in the file.
    pub ranges: Vec<(usize, u64, usize)>,
    f: File,
    path: std::path::PathBuf,
    len: u64,
    trailer: [u8; CHECKSUM_LEN],
}

impl Exact {
    /// Opens the spool file `f` at `path` of round `round` by its footer; `None` when a delta
    /// tensor is lossy (in its wire form).
    pub(crate) fn open(
        path: std::path::PathBuf,
        f: File,
        round: u64,
    ) -> Result<Option<Exact>, StoreError> {
        let (len, trailer) = trailer_of(&path, &f)?;
        let footer = footer_of(&path, &f, len, round)?;
        if footer.delta.iter().any(|t| matches!(t, Placed::Wire(_))) {
            return Ok(None);
        }
        Ok(Some(Exact {
            ranges: in_head_order(&footer.delta),
            footer,
            f,
            path,
            len,
            trailer,
        }))
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Fills `buf` from byte `at` of the file (the footer placed every tensor in the head).
    pub(crate) fn read_at(&self, at: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.f.read_exact_at(buf, at).map_err(|e| io(&self.path, e))
    }

    /// Reads the whole body in order, sums it and checks it against the trailer.
    pub(crate) fn verify(&self) -> Result<(), StoreError> {
        let mut body = Body::new(&self.f, READ_BLOCK, &self.trailer, self.path.clone());
        body.read_to(self.len, |_, _| {})?;
        body.check(self.len, &self.trailer)
    }
}

/// Bytes read at a time: straight into the block handed on (no buffered reader's copy between).
const READ_BLOCK: usize = 1 << 20;

/// A file's body read in order (by position) and summed.
struct Body<'f> {
    f: &'f File,
    buf: Vec<u8>,
    sum: Sum,
    /// Bytes read so far.
    pos: u64,
    path: std::path::PathBuf,
}

impl<'f> Body<'f> {
    /// The body of `f` (at `path`), read `block` bytes at a time into the sum `trailer` names.
    fn new(
        f: &'f File,
        block: usize,
        trailer: &[u8; CHECKSUM_LEN],
        path: std::path::PathBuf,
    ) -> Body<'f> {
        Body {
            f,
            buf: vec![0u8; block],
            sum: Sum::for_trailer(trailer),
            pos: 0,
            path,
        }
    }

    /// Checks the body read up to `len` against `trailer`, and that the file has not grown
    /// since it was measured (a file that grew is not the file that was sealed).
    fn check(&self, len: u64, trailer: &[u8; CHECKSUM_LEN]) -> Result<(), StoreError> {
        let now = self.f.metadata().map_err(|e| io(&self.path, e))?.len();
        if now != len + CHECKSUM_LEN as u64 || self.sum.trailer() != *trailer {
            return Err(corrupt(
                &self.path,
                "checksum mismatch: the file was damaged or changed outside the aggregator",
            ));
        }
        Ok(())
    }

    /// Reads and sums the body up to byte `to`, handing `each` every block read with the index
    /// of its first value counted from where this call started.
    fn read_to(&mut self, to: u64, mut each: impl FnMut(usize, &[u8])) -> Result<(), StoreError> {
        let mut at = 0;
        while self.pos < to {
            let n = ((to - self.pos) as usize).min(self.buf.len());
            self.f
                .read_exact_at(&mut self.buf[..n], self.pos)
                .map_err(|e| io(&self.path, e))?;
            self.sum.update(&self.buf[..n]);
            each(at, &self.buf[..n]);
            at += n / 4;
            self.pos += n as u64;
        }
        Ok(())
    }
}
