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
        write_f32s(path, state.tensors.iter().map(|t| t.data.as_slice()))?;
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

/// Writes the slices to `path` (replacing what is there) as raw little-endian `f32`, one after
/// the other, a block at a time.
fn write_f32s<'a>(path: &Path, slices: impl Iterator<Item = &'a [f32]>) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(BLOCK, File::create(path)?);
    let mut bytes = Vec::with_capacity(BLOCK);
    for s in slices {
        for block in s.chunks(BLOCK / 4) {
            bytes.clear();
            bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
            w.write_all(&bytes)?;
        }
    }
    w.into_inner().map_err(|e| e.into_error())?;
    Ok(())
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
        let f = File::open(&self.path)?;
        let want: u64 = self.lens.iter().map(|&n| 4 * n as u64).sum();
        let len = f.metadata()?.len();
        if len != want {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes where {want} were written"),
            ));
        }
        let mut r = BufReader::with_capacity(BLOCK, f);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(8)
            .unwrap();
        let e = s.read(vs.iter_mut()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let mut vs = original.clone();
        let s = Spilled::write(&path, vs.iter_mut()).unwrap();
        let e = s.read(vs.iter_mut().take(2)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
