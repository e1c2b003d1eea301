//! A site's starting model parked in a file while it trains: training then holds one copy of the
//! model, and the update's delta reads the starting tensors back a block at a time.

use crate::state::{NamedTensor, StateDict};
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
    /// Writes `state` to `path` (replacing what is there) and keeps its layout.
    pub(crate) fn write(path: &Path, state: &StateDict) -> io::Result<Parked> {
        let mut w = BufWriter::with_capacity(BLOCK, File::create(path)?);
        let mut bytes = Vec::with_capacity(BLOCK);
        for t in &state.tensors {
            for block in t.data.chunks(BLOCK / 4) {
                bytes.clear();
                bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&bytes)?;
            }
        }
        w.into_inner().map_err(|e| e.into_error())?;
        Ok(Parked {
            path: path.to_path_buf(),
            spec_hash: state.spec_hash,
            layout: state
                .tensors
                .iter()
                .map(|t| NamedTensor {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    kind: t.kind,
                    data: Vec::new(),
                })
                .collect(),
        })
    }

    /// Subtracts the parked values from the tensors of `d` of the same names; `d` must hold a
    /// subset of the parked tensors in the same order.
    pub(crate) fn subtract_from(&self, d: &mut StateDict) -> io::Result<()> {
        let mut r = self.open()?;
        let mut bytes = vec![0u8; BLOCK];
        let mut wanted = d.tensors.iter_mut().peekable();
        for t in &self.layout {
            let n = numel(t);
            match wanted.next_if(|w| w.name == t.name) {
                Some(w) if w.data.len() == n => {
                    for block in w.data.chunks_mut(BLOCK / 4) {
                        let b = &mut bytes[..4 * block.len()];
                        r.read_exact(b)?;
                        for (x, c) in block.iter_mut().zip(b.chunks_exact(4)) {
                            *x -= f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                }
                Some(w) => return Err(mismatch(&w.name)),
                None => r.seek_relative(4 * n as i64)?,
            }
        }
        match wanted.next() {
            Some(w) => Err(mismatch(&w.name)),
            None => Ok(()),
        }
    }

    /// The parked tensors, whole.
    pub(crate) fn read(&self) -> io::Result<StateDict> {
        let mut r = self.open()?;
        let mut tensors = Vec::with_capacity(self.layout.len());
        let mut bytes = vec![0u8; BLOCK];
        for t in &self.layout {
            let mut data = Vec::with_capacity(numel(t));
            let mut left = numel(t);
            while left > 0 {
                let n = left.min(BLOCK / 4);
                r.read_exact(&mut bytes[..4 * n])?;
                data.extend(
                    bytes[..4 * n]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
                left -= n;
            }
            tensors.push(NamedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                kind: t.kind,
                data,
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
        let f = File::open(&self.path)?;
        let want: u64 = self.layout.iter().map(|t| 4 * numel(t) as u64).sum();
        let len = f.metadata()?.len();
        if len != want {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes where {want} were written"),
            ));
        }
        Ok(BufReader::with_capacity(BLOCK, f))
    }

    /// Where the model is parked.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
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
