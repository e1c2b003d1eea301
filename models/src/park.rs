//! A site's starting model parked in a file while it trains: training then holds one copy of the
//! model, and the update's delta reads the starting tensors back a block at a time.

use crate::state::{NamedTensor, Select, StateDict};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use unifed_protocol::SpecHash;

/// Bytes read from the file at a time.
const BLOCK: usize = 1 << 20;

/// The tensors of a [`StateDict`] written to a file as raw little-endian `f32`, one after the
/// other; their names, shapes and kinds stay here (with empty data).
#[derive(Debug)]
pub(crate) struct Parked {
    path: PathBuf,
    spec_hash: SpecHash,
    layout: Vec<NamedTensor>,
}

impl Parked {
    /// Parks every tensor of `net`, read from the model a block at a time in [`export`]'s order
    /// (no model-sized copy of it is made), and keeps its layout.
    ///
    /// [`export`]: crate::state::export
    pub(crate) fn write_net<N: crate::zoo::Net>(
        path: &Path,
        net: &N,
        spec: &unifed_protocol::ModelSpec,
    ) -> io::Result<Parked> {
        let mut w = BufWriter::with_capacity(BLOCK, File::create(path)?);
        let mut bytes = Vec::with_capacity(BLOCK);
        crate::state::export_blocks_in_order(
            net,
            Select::All,
            crate::state::READ_BLOCK,
            |_, values| put_f32s(&mut w, &mut bytes, values),
        )?;
        w.into_inner().map_err(|e| e.into_error())?;
        let layout = crate::state::export_layout(net, spec, Select::All);
        Ok(Parked {
            path: path.to_path_buf(),
            spec_hash: layout.spec_hash,
            layout: layout.tensors,
        })
    }

    /// The parked values in order, a tensor and a block at a time ([`Base`]).
    pub(crate) fn base(&self) -> io::Result<Base<'_>> {
        Ok(Base {
            layout: self.layout.iter(),
            r: self.open()?,
            bytes: Vec::new(),
            left: 0,
        })
    }

    /// Subtracts the parked values from the tensors of `d` of the same names; `d` must hold a
    /// subset of the parked tensors in the same order.
    pub(crate) fn subtract_from(&self, d: &mut StateDict) -> io::Result<()> {
        let mut base = self.base()?;
        for w in &mut d.tensors {
            base.start(&w.name, w.data.len())?;
            for block in w.data.chunks_mut(BLOCK / 4) {
                base.subtract_from(block)?;
            }
        }
        Ok(())
    }

    /// The parked tensors, whole.
    pub(crate) fn read(&self) -> io::Result<StateDict> {
        let mut r = self.open()?;
        let mut tensors = Vec::with_capacity(self.layout.len());
        let mut bytes = vec![0u8; BLOCK];
        for t in &self.layout {
            tensors.push(NamedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                kind: t.kind,
                data: read_f32s(&mut r, numel(t), &mut bytes)?,
            });
        }
        Ok(StateDict {
            spec_hash: self.spec_hash,
            tensors,
        })
    }

    /// Removes the file.
    pub(crate) fn remove(self) -> io::Result<()> {
        std::fs::remove_file(&self.path)
    }

    /// The file to read, checked for its length.
    fn open(&self) -> io::Result<BufReader<File>> {
        open_f32s(&self.path, self.layout.iter().map(numel).sum())
    }

    /// Where the model is parked.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// The parked values read in order: [`Base::start`] moves to a tensor (past those before it),
/// [`Base::subtract_from`] takes its values a block at a time.
pub(crate) struct Base<'a> {
    layout: std::slice::Iter<'a, NamedTensor>,
    r: BufReader<File>,
    bytes: Vec<u8>,
    /// Values of the current tensor not read yet.
    left: usize,
}

impl Base<'_> {
    /// Moves to the parked tensor `name` with `n` values, past the rest of the current one and
    /// any other before it.
    pub(crate) fn start(&mut self, name: &str, n: usize) -> io::Result<()> {
        self.r.seek_relative(4 * self.left as i64)?;
        self.left = 0;
        for t in self.layout.by_ref() {
            if t.name == name {
                if numel(t) != n {
                    return Err(mismatch(name));
                }
                self.left = n;
                return Ok(());
            }
            self.r.seek_relative(4 * numel(t) as i64)?;
        }
        Err(mismatch(name))
    }

    /// Subtracts the current tensor's next `block.len()` parked values from `block`.
    pub(crate) fn subtract_from(&mut self, block: &mut [f32]) -> io::Result<()> {
        if block.len() > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more values than the parked tensor holds",
            ));
        }
        self.left -= block.len();
        self.bytes.resize(4 * block.len(), 0);
        self.r.read_exact(&mut self.bytes)?;
        for (x, c) in block.iter_mut().zip(self.bytes.chunks_exact(4)) {
            *x -= f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
}

/// Writes the slices to `path` (replacing what is there) as raw little-endian `f32`, one after
/// the other, a block at a time.
fn write_f32s<'a>(path: &Path, slices: impl Iterator<Item = &'a [f32]>) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(BLOCK, File::create(path)?);
    let mut bytes = Vec::with_capacity(BLOCK);
    for s in slices {
        put_f32s(&mut w, &mut bytes, s)?;
    }
    w.into_inner().map_err(|e| e.into_error())?;
    Ok(())
}

/// Writes `values` to `w` as raw little-endian `f32`, a block at a time through `bytes`.
fn put_f32s(w: &mut impl Write, bytes: &mut Vec<u8>, values: &[f32]) -> io::Result<()> {
    for block in values.chunks(BLOCK / 4) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
        w.write_all(bytes)?;
    }
    Ok(())
}

/// The file at `path`, to read `n` raw little-endian `f32` from: checked to hold exactly that
/// many bytes.
fn open_f32s(path: &Path, n: usize) -> io::Result<BufReader<File>> {
    let f = File::open(path)?;
    let (want, len) = (4 * n as u64, f.metadata()?.len());
    if len != want {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{len} bytes where {want} were written"),
        ));
    }
    Ok(BufReader::with_capacity(BLOCK, f))
}

/// Reads `n` raw little-endian `f32` from `r`, a block at a time through `bytes` (at least 4
/// bytes long).
fn read_f32s(r: &mut impl Read, n: usize, bytes: &mut [u8]) -> io::Result<Vec<f32>> {
    let per_block = bytes.len() / 4;
    let mut data = Vec::with_capacity(n);
    let mut left = n;
    while left > 0 {
        let k = left.min(per_block);
        r.read_exact(&mut bytes[..4 * k])?;
        data.extend(
            bytes[..4 * k]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        left -= k;
    }
    Ok(data)
}

/// The values a parked tensor holds (its data is not kept here).
fn numel(t: &NamedTensor) -> usize {
    t.shape.iter().product()
}

fn mismatch(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("`{name}` is not parked in this order or size"),
    )
}

/// Vectors of `f32` written to a file, one after the other, while their owner does not need
/// them; only their lengths stay in memory. They come back in the order they were written.
#[derive(Debug)]
pub(crate) struct Spilled {
    path: PathBuf,
    lens: Vec<usize>,
}

impl Spilled {
    /// Writes every vector of `vs` to `path` (replacing what is there), then empties them all
    /// and frees their memory; if writing fails, they are left as they were.
    pub(crate) fn write<'a>(
        path: &Path,
        vs: impl Iterator<Item = &'a mut Vec<f32>>,
    ) -> io::Result<Spilled> {
        let mut vs: Vec<&mut Vec<f32>> = vs.collect();
        write_f32s(path, vs.iter().map(|v| v.as_slice()))?;
        let lens = vs.iter().map(|v| v.len()).collect();
        for v in &mut vs {
            **v = Vec::new();
        }
        Ok(Spilled {
            path: path.to_path_buf(),
            lens,
        })
    }

    /// Reads the vectors back into `vs`, which must yield as many (empty) vectors as were
    /// written, in the same order, and removes the file.
    pub(crate) fn read<'a>(self, vs: impl Iterator<Item = &'a mut Vec<f32>>) -> io::Result<()> {
        let mut r = open_f32s(&self.path, self.lens.iter().sum())?;
        let mut bytes = vec![0u8; BLOCK];
        let mut lens = self.lens.iter();
        for v in vs {
            let Some(&n) = lens.next() else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "more vectors than were spilled",
                ));
            };
            *v = read_f32s(&mut r, n, &mut bytes)?;
        }
        if lens.next().is_some() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "fewer vectors than were spilled",
            ));
        }
        drop(r);
        std::fs::remove_file(&self.path)
    }

    /// Where the vectors are.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Named vectors of `f32` waiting in a file between uses: raw little-endian values one after
/// the other, with each vector's name, place and length kept here. The file goes when the stash
/// is dropped.
#[derive(Debug)]
pub(crate) struct Stash {
    path: PathBuf,
    /// Name → (offset in values, length), in name order.
    entries: BTreeMap<String, (u64, usize)>,
}

impl Stash {
    /// Starts a stash at `path` (replacing what is there); [`StashWriter::finish`] ends it.
    pub(crate) fn create(path: &Path) -> io::Result<StashWriter> {
        let file = File::create(path)?;
        Ok(StashWriter {
            w: Some(BufWriter::with_capacity(BLOCK, file)),
            stash: Stash {
                path: path.to_path_buf(),
                entries: BTreeMap::new(),
            },
            at: 0,
            open: None,
            bytes: Vec::with_capacity(BLOCK),
            failed: None,
        })
    }

    /// The names of the vectors, in order.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The number of values of every vector together.
    pub(crate) fn values(&self) -> u64 {
        self.entries.values().map(|&(_, n)| n as u64).sum()
    }

    /// The length of vector `name`, if the stash holds it.
    pub(crate) fn len_of(&self, name: &str) -> Option<usize> {
        self.entries.get(name).map(|&(_, n)| n)
    }

    /// Calls `f` with the values of vector `name` a block at a time, in order, with the index
    /// of the block's first value; a vector the stash lacks calls nothing.
    fn blocks(&self, name: &str, mut f: impl FnMut(usize, &[f32])) -> io::Result<()> {
        let Some(&(offset, n)) = self.entries.get(name) else {
            return Ok(());
        };
        let mut r = self.open()?;
        r.seek_relative(4 * offset as i64)?;
        let mut bytes = vec![0u8; BLOCK.min(4 * n)];
        let mut values = Vec::with_capacity(bytes.len() / 4);
        let mut done = 0;
        while done < n {
            let k = (n - done).min(BLOCK / 4);
            r.read_exact(&mut bytes[..4 * k])?;
            values.clear();
            values.extend(
                bytes[..4 * k]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            f(done, &values);
            done += k;
        }
        Ok(())
    }

    /// Adds the values of vector `name` to `dst`, which must be as long.
    pub(crate) fn add_into(&self, name: &str, dst: &mut [f32]) -> io::Result<()> {
        if self.len_of(name).is_some_and(|n| n != dst.len()) {
            return Err(mismatch(name));
        }
        self.blocks(name, |at, values| {
            dst[at..at + values.len()]
                .iter_mut()
                .zip(values)
                .for_each(|(d, v)| *d += v);
        })
    }

    /// The values of vector `name`, if the stash holds it.
    pub(crate) fn get(&self, name: &str) -> io::Result<Option<Vec<f32>>> {
        let Some(n) = self.len_of(name) else {
            return Ok(None);
        };
        let mut v = Vec::with_capacity(n);
        self.blocks(name, |_, values| v.extend_from_slice(values))?;
        Ok(Some(v))
    }

    /// Every vector, read back into memory.
    pub(crate) fn load(&self) -> io::Result<BTreeMap<String, Vec<f32>>> {
        let mut out = BTreeMap::new();
        for name in self.entries.keys() {
            out.insert(name.clone(), self.get(name)?.expect("a name of the stash"));
        }
        Ok(out)
    }

    /// Where the vectors are.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The file, checked for its length.
    fn open(&self) -> io::Result<BufReader<File>> {
        open_f32s(&self.path, self.entries.values().map(|&(_, n)| n).sum())
    }
}

impl Drop for Stash {
    fn drop(&mut self) {
        // Scratch: a file left behind (the process ended first) is never read again.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A [`Stash`] being written, one vector after the other. The first failure to write is kept
/// and given by [`StashWriter::finish`].
#[derive(Debug)]
pub(crate) struct StashWriter {
    w: Option<BufWriter<File>>,
    stash: Stash,
    /// Values written so far.
    at: u64,
    /// The vector being appended ([`StashWriter::begin`]): its name and first value.
    open: Option<(String, u64)>,
    /// Bytes waiting for a block to fill.
    bytes: Vec<u8>,
    failed: Option<io::Error>,
}

impl StashWriter {
    /// Appends vector `name` (a name given twice is an error).
    pub(crate) fn put(&mut self, name: &str, values: &[f32]) {
        self.begin(name);
        for block in values.chunks(BLOCK / 4) {
            self.extend(block);
        }
        self.end();
    }

    /// Starts vector `name`, whose values [`StashWriter::push`] then appends until
    /// [`StashWriter::end`].
    pub(crate) fn begin(&mut self, name: &str) {
        self.end();
        if self.stash.entries.contains_key(name) {
            self.failed.get_or_insert_with(|| mismatch(name));
        }
        self.open = Some((name.to_string(), self.at));
    }

    /// Appends a value to the vector begun last.
    pub(crate) fn push(&mut self, v: f32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self.at += 1;
        if self.bytes.len() >= BLOCK {
            self.flush_bytes();
        }
    }

    /// Appends values to the vector begun last.
    fn extend(&mut self, values: &[f32]) {
        self.bytes
            .extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.at += values.len() as u64;
        if self.bytes.len() >= BLOCK {
            self.flush_bytes();
        }
    }

    /// Ends the vector begun last, if any.
    pub(crate) fn end(&mut self) {
        if let Some((name, first)) = self.open.take() {
            let n = (self.at - first) as usize;
            self.stash.entries.entry(name).or_insert((first, n));
        }
    }

    /// Writes the waiting bytes.
    fn flush_bytes(&mut self) {
        if self.failed.is_none()
            && let Err(e) = self
                .w
                .as_mut()
                .expect("open until finished")
                .write_all(&self.bytes)
        {
            self.failed = Some(e);
        }
        self.bytes.clear();
    }

    /// Flushes the file and gives the stash, or the first error.
    pub(crate) fn finish(mut self) -> io::Result<Stash> {
        self.end();
        self.flush_bytes();
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let w = self.w.take().expect("open until finished");
        w.into_inner().map_err(|e| e.into_error())?;
        Ok(std::mem::replace(
            &mut self.stash,
            Stash {
                path: PathBuf::new(),
                entries: BTreeMap::new(),
            },
        ))
    }

    /// Where the vectors go.
    pub(crate) fn path(&self) -> &Path {
        &self.stash.path
    }
}

/// `Serialize` of a [`Stash`] as the map of its vectors by name (as a `BTreeMap<String,
/// Vec<f32>>` serialises, value by value), read from the file as it goes: the serialised form
/// is the same as the loaded map's, without a copy of it in memory.
impl serde::Serialize for Stash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.entries.len()))?;
        for name in self.entries.keys() {
            map.serialize_entry(name, &Values { stash: self, name })?;
        }
        map.end()
    }
}

/// One vector of a stash, serialised as a sequence of `f32` read from the file.
struct Values<'a> {
    stash: &'a Stash,
    name: &'a str,
}

impl serde::Serialize for Values<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeSeq};
        let n = self.stash.len_of(self.name).unwrap_or(0);
        let mut seq = s.serialize_seq(Some(n))?;
        let mut failed = None;
        let read = self.stash.blocks(self.name, |_, values| {
            for v in values {
                if failed.is_none()
                    && let Err(e) = seq.serialize_element(v)
                {
                    failed = Some(e);
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        read.map_err(|e| {
            S::Error::custom(format!(
                "`{}` in {}: {e}",
                self.name,
                self.stash.path.display()
            ))
        })?;
        seq.end()
    }
}

/// Named vectors of `f32` kept in memory, or waiting in a [`Stash`] file between uses.
#[derive(Debug)]
pub(crate) enum Kept {
    /// In memory.
    Here(BTreeMap<String, Vec<f32>>),
    /// In a file.
    Filed(Stash),
}

impl Default for Kept {
    fn default() -> Self {
        Kept::Here(BTreeMap::new())
    }
}

impl Kept {
    /// The length of vector `name`, if kept.
    pub(crate) fn len_of(&self, name: &str) -> Option<usize> {
        match self {
            Kept::Here(m) => m.get(name).map(Vec::len),
            Kept::Filed(s) => s.len_of(name),
        }
    }

    /// Adds the values of vector `name` (if kept) to `dst`, which must be as long.
    pub(crate) fn add_into(&self, name: &str, dst: &mut [f32]) -> io::Result<()> {
        match self {
            Kept::Here(m) => match m.get(name) {
                Some(v) if v.len() != dst.len() => Err(mismatch(name)),
                Some(v) => {
                    dst.iter_mut().zip(v).for_each(|(d, v)| *d += v);
                    Ok(())
                }
                None => Ok(()),
            },
            Kept::Filed(s) => s.add_into(name, dst),
        }
    }

    /// A copy of the values of vector `name`, if kept.
    pub(crate) fn get(&self, name: &str) -> io::Result<Option<Vec<f32>>> {
        match self {
            Kept::Here(m) => Ok(m.get(name).cloned()),
            Kept::Filed(s) => s.get(name),
        }
    }

    /// The names of the vectors, in order.
    pub(crate) fn names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match self {
            Kept::Here(m) => Box::new(m.keys().map(String::as_str)),
            Kept::Filed(s) => Box::new(s.entries.keys().map(String::as_str)),
        }
    }

    /// A copy of every vector, in memory.
    pub(crate) fn load(&self) -> io::Result<BTreeMap<String, Vec<f32>>> {
        match self {
            Kept::Here(m) => Ok(m.clone()),
            Kept::Filed(s) => s.load(),
        }
    }

    /// The vectors held in memory (none when filed).
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Vec<f32>> {
        match self {
            Kept::Here(m) => Some(m.values_mut()),
            Kept::Filed(_) => None,
        }
        .into_iter()
        .flatten()
    }

    /// Moves the vectors into a stash at `path`, when they hold any value; `self` is left as it
    /// was if writing fails.
    pub(crate) fn file_at(&mut self, path: &Path) -> io::Result<()> {
        let Kept::Here(m) = self else {
            return Ok(());
        };
        if m.values().all(Vec::is_empty) {
            return Ok(());
        }
        let mut w = Stash::create(path)?;
        for (name, v) in m.iter() {
            w.put(name, v);
        }
        *self = Kept::Filed(w.finish()?);
        Ok(())
    }
}

impl serde::Serialize for Kept {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Kept::Here(m) => m.serialize(s),
            Kept::Filed(stash) => stash.serialize(s),
        }
    }
}

/// Vectors being kept, one after the other: in memory, or written to a stash file as they come.
#[derive(Debug)]
pub(crate) enum KeptWriter {
    /// Into memory.
    Here(BTreeMap<String, Vec<f32>>),
    /// Into a stash file.
    Filed(StashWriter),
}

impl KeptWriter {
    /// Keeps vector `name`, moved in (in memory) or written and freed (to a file).
    pub(crate) fn put_owned(&mut self, name: String, values: Vec<f32>) {
        match self {
            KeptWriter::Here(m) => {
                m.insert(name, values);
            }
            KeptWriter::Filed(w) => w.put(&name, &values),
        }
    }

    /// Keeps vector `name` of `from`, if `from` has it.
    pub(crate) fn copy(&mut self, name: &str, from: &Kept) -> io::Result<()> {
        if let Some(v) = from.get(name)? {
            self.put_owned(name.to_string(), v);
        }
        Ok(())
    }

    /// Whether vector `name` is kept already.
    pub(crate) fn has(&self, name: &str) -> bool {
        match self {
            KeptWriter::Here(m) => m.contains_key(name),
            KeptWriter::Filed(w) => w.stash.entries.contains_key(name),
        }
    }
}

impl crate::state::Keep for KeptWriter {
    fn keep(&mut self, name: &str, values: &[f32]) {
        match self {
            KeptWriter::Here(m) => {
                m.insert(name.to_string(), values.to_vec());
            }
            KeptWriter::Filed(w) => w.put(name, values),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cuts the file at `path` short, to 8 bytes.
    fn cut_to_8_bytes(path: &Path) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(8)
            .unwrap();
    }

    #[test]
    fn spilled_vectors_come_back_bit_identical_and_the_file_goes() {
        let dir = std::env::temp_dir().join(format!("unifed-spill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("memory");
        // Longer than a block, empty, and values whose bits a text round trip would change.
        let original = vec![
            (0..(BLOCK / 4 + 3))
                .map(|i| i as f32 * 0.1)
                .collect::<Vec<f32>>(),
            Vec::new(),
            vec![f32::MIN_POSITIVE, -0.0, f32::from_bits(1), f32::MAX],
        ];
        let mut vs = original.clone();
        let s = Spilled::write(&path, vs.iter_mut()).unwrap();
        assert!(vs.iter().all(|v| v.is_empty() && v.capacity() == 0));
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            4 * (BLOCK as u64 / 4 + 7)
        );
        s.read(vs.iter_mut()).unwrap();
        let bits = |vs: &[Vec<f32>]| -> Vec<Vec<u32>> {
            vs.iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&vs), bits(&original));
        assert!(!path.exists());

        // A file cut short, and a reader asking for a different count, are errors.
        let mut vs = original.clone();
        let s = Spilled::write(&path, vs.iter_mut()).unwrap();
        cut_to_8_bytes(&path);
        let e = s.read(vs.iter_mut()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let mut vs = original.clone();
        let s = Spilled::write(&path, vs.iter_mut()).unwrap();
        let e = s.read(vs.iter_mut().take(2)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stash_reads_adds_and_serialises_its_vectors_as_the_map_would_and_its_file_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stash.1");
        // Written out of name order, one longer than a block, one empty.
        let long: Vec<f32> = (0..(BLOCK / 4 + 5))
            .map(|i| i as f32 * 0.25 - 3.0)
            .collect();
        let map: BTreeMap<String, Vec<f32>> = [
            ("z.weight".to_string(), long.clone()),
            (
                "a.bias".to_string(),
                vec![f32::MIN_POSITIVE, -0.0, f32::from_bits(1)],
            ),
            ("m.empty".to_string(), Vec::new()),
        ]
        .into();
        let mut w = Stash::create(&path).unwrap();
        for name in ["z.weight", "a.bias", "m.empty"] {
            w.put(name, &map[name]);
        }
        let stash = w.finish().unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            4 * (long.len() as u64 + 3)
        );
        let bits = |m: &BTreeMap<String, Vec<f32>>| -> Vec<(String, Vec<u32>)> {
            m.iter()
                .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect()))
                .collect()
        };
        assert_eq!(bits(&stash.load().unwrap()), bits(&map));
        assert_eq!(stash.len_of("a.bias"), Some(3));
        assert_eq!(stash.get("nope").unwrap(), None);
        // Added in place, a block at a time, as an in-memory sum adds.
        let mut dst: Vec<f32> = (0..long.len()).map(|i| (i % 7) as f32 * 0.1).collect();
        let want: Vec<f32> = dst.iter().zip(&long).map(|(d, v)| d + v).collect();
        stash.add_into("z.weight", &mut dst).unwrap();
        assert_eq!(dst, want);
        let e = stash.add_into("a.bias", &mut [0.0; 2]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        // Serialised from the file, the bytes are the in-memory map's.
        let kept = Kept::Filed(stash);
        assert_eq!(
            postcard::to_allocvec(&kept).unwrap(),
            postcard::to_allocvec(&map).unwrap()
        );
        // A name twice is an error at the end; a file cut short is an error naming its size,
        // and fails the serialisation.
        let mut w = Stash::create(&dir.path().join("twice")).unwrap();
        w.put("a", &[1.0]);
        w.put("a", &[2.0]);
        assert_eq!(w.finish().unwrap_err().kind(), io::ErrorKind::InvalidInput);
        cut_to_8_bytes(&path);
        let Kept::Filed(stash) = &kept else {
            unreachable!()
        };
        assert_eq!(stash.load().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let e = postcard::to_allocvec(&kept).unwrap_err();
        assert!(matches!(e, postcard::Error::SerdeSerCustom), "{e:?}");
        drop(kept);
        assert!(!path.exists(), "a dropped stash left its file");
        // Moved to a file only when it holds a value; left as it was when it cannot be written.
        let mut k = Kept::Here(map.clone());
        let e = k
            .file_at(&dir.path().join("no-such").join("x"))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(matches!(&k, Kept::Here(m) if bits(m) == bits(&map)));
        k.file_at(&path).unwrap();
        assert!(matches!(&k, Kept::Filed(_)) && path.exists());
        let mut empty = Kept::Here([("a".to_string(), Vec::new())].into());
        empty.file_at(&dir.path().join("empty")).unwrap();
        assert!(matches!(empty, Kept::Here(_)));
    }
}
