//! safetensors import and export in PyTorch's state_dict names and layouts.
//!
//! Files we write carry the spec hash and architecture in the safetensors metadata; on load a
//! hash, when present, must match the model's spec. PyTorch checkpoints carry no hash and are
//! matched by name and shape; their BN `num_batches_tracked` counters (int64) are skipped, as
//! burn keeps no such counter.

use crate::error::StateError;
use crate::state::{NamedTensor, StateDict};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::HashMap;
use std::path::Path;
use unifed_protocol::{ModelSpec, SpecHash};

/// Metadata key of the spec hash in files we write.
pub const META_SPEC_HASH: &str = "unifed.spec_hash";
/// Metadata key of the architecture string in files we write.
pub const META_ARCH: &str = "unifed.architecture";

fn file_err(path: &Path, message: impl ToString) -> StateError {
    StateError::File {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

/// A tensor of a [`Layout`]: name, kind, shape and count of values.
type Entry<'a> = (&'a str, unifed_protocol::TensorKind, &'a [usize], usize);

/// The safetensors layout of a state: its canonical header and the order of its data, so the
/// file can be written straight from the state's tensors, without a serialised copy in memory.
/// The bytes are those of `safetensors::serialize` with the header's keys sorted (the metadata
/// is a map whose order changes from process to process), so the same state always gives the
/// same bytes.
pub struct Layout {
    header: Vec<u8>,
    /// Tensor indices of `state` in data order (the crate's: by name).
    order: Vec<usize>,
    /// Each tensor's name and count of values, in data order.
    entries: Vec<(String, usize)>,
    /// BN layers, each with an int64 `num_batches_tracked` of 0 written before the floats.
    counters: usize,
    data_len: u64,
}

impl Layout {
    /// The layout of `state` (F32 tensors, the spec hash and architecture in the metadata).
    /// PyTorch's BatchNorm also saves an int64 `num_batches_tracked`; burn keeps no such
    /// counter, so 0 is written for every BN layer and `load_state_dict(strict=True)` accepts
    /// the file (the counter only matters to PyTorch BN layers built with momentum=None).
    pub fn new(state: &StateDict, spec: &ModelSpec) -> Layout {
        let tensors: Vec<Entry> = state
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.kind, t.shape.as_slice(), t.data.len()))
            .collect();
        Layout::build(&tensors, state.spec_hash, spec)
    }

    /// The layout of `tensors` of a state with hash `spec_hash`.
    fn build(tensors: &[Entry], spec_hash: SpecHash, spec: &ModelSpec) -> Layout {
        use serde_json::{Value, json};
        use std::collections::BTreeMap;
        let mut counters: Vec<String> = tensors
            .iter()
            .filter(|t| t.1 == unifed_protocol::TensorKind::BnRunningMean)
            .filter_map(|t| {
                t.0.strip_suffix(".running_mean")
                    .map(|p| format!("{p}.num_batches_tracked"))
            })
            .collect();
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by(|&a, &b| tensors[a].0.cmp(tensors[b].0));
        let mut header: BTreeMap<String, Value> = BTreeMap::new();
        let mut offset = 0u64;
        // safetensors puts the wider dtype first: the int64 counters, then the floats.
        counters.sort();
        for n in &counters {
            header.insert(
                n.clone(),
                json!({"data_offsets": [offset, offset + 8], "dtype": "I64", "shape": []}),
            );
            offset += 8;
        }
        for &i in &order {
            let (name, _, shape, n) = tensors[i];
            let len = 4 * n as u64;
            header.insert(
                name.to_string(),
                json!({"data_offsets": [offset, offset + len], "dtype": "F32", "shape": shape}),
            );
            offset += len;
        }
        let meta: BTreeMap<&str, String> = BTreeMap::from([
            (META_SPEC_HASH, spec_hash.to_string()),
            (META_ARCH, spec.architecture.clone()),
            ("format", "pt".to_string()),
        ]);
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(meta).expect("a map of strings serialises"),
        );
        let mut text = serde_json::to_vec(&header).expect("a JSON map serialises");
        // safetensors pads the header with spaces to a multiple of 8 bytes.
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
        Layout {
            header: text,
            entries: order
                .iter()
                .map(|&i| (tensors[i].0.to_string(), tensors[i].3))
                .collect(),
            order,
            counters: counters.len(),
            data_len: offset,
        }
    }

    /// The layout of `export(net, spec, Select::All)` for a model of `spec`, from the spec alone
    /// (no export needed): for [`Layout::write_net`].
    pub fn of_spec(spec: &ModelSpec) -> Layout {
        let tensors: Vec<Entry> = spec
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.kind, t.shape.as_slice(), t.numel()))
            .collect();
        Layout::build(&tensors, spec.hash(), spec)
    }

    /// Writes the file of `net`'s tensors (the layout made by [`Layout::of_spec`] for `net`'s
    /// spec) to `w`, reading each tensor from the model a block of rows at a time
    /// ([`crate::state::export_blocks`]): the same bytes as [`Layout::write`] of `export(net,
    /// spec, Select::All)`, without the export's copy of the model. A tensor the layout does
    /// not name, or of another length, is an error (the file is then incomplete).
    pub fn write_net<N: crate::zoo::Net>(
        &self,
        net: &N,
        w: &mut impl std::io::Write,
    ) -> std::io::Result<()> {
        w.write_all(&(self.header.len() as u64).to_le_bytes())?;
        w.write_all(&self.header)?;
        for _ in 0..self.counters {
            w.write_all(&0i64.to_le_bytes())?;
        }
        let misfit = |name: &str| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("tensor `{name}` does not fit the checkpoint's layout"),
            )
        };
        let mut buf = Vec::with_capacity(64 << 10);
        // The entry being written and the values it still needs.
        let (mut at, mut left): (Option<usize>, usize) = (None, 0);
        crate::state::export_blocks(
            net,
            crate::state::Select::All,
            crate::state::READ_BLOCK,
            |name, values| {
                if at.is_none_or(|i| self.entries[i].0 != name) {
                    if left != 0 {
                        return Err(misfit(name));
                    }
                    let next = at.map_or(0, |i| i + 1);
                    match self.entries.get(next) {
                        Some((n, len)) if n == name => (at, left) = (Some(next), *len),
                        _ => return Err(misfit(name)),
                    }
                }
                left = left.checked_sub(values.len()).ok_or_else(|| misfit(name))?;
                for part in values.chunks(16 << 10) {
                    buf.clear();
                    buf.extend(part.iter().flat_map(|v| v.to_le_bytes()));
                    w.write_all(&buf)?;
                }
                Ok(())
            },
        )?;
        let written = at.map_or(0, |i| i + 1);
        match self.entries.get(written) {
            Some((n, _)) => Err(misfit(n)),
            None if left != 0 => Err(misfit("the last")),
            None => Ok(()),
        }
    }

    /// Length of the whole file in bytes.
    pub fn len(&self) -> u64 {
        8 + self.header.len() as u64 + self.data_len
    }

    /// True for a file without tensors (it still has a header).
    pub fn is_empty(&self) -> bool {
        self.order.is_empty() && self.counters == 0
    }

    /// Writes the file of `state` (the state this layout was made from) to `w`, a few KiB of
    /// bytes at a time.
    pub fn write(&self, state: &StateDict, w: &mut impl std::io::Write) -> std::io::Result<()> {
        w.write_all(&(self.header.len() as u64).to_le_bytes())?;
        w.write_all(&self.header)?;
        for _ in 0..self.counters {
            w.write_all(&0i64.to_le_bytes())?;
        }
        let mut buf = Vec::with_capacity(64 << 10);
        for &i in &self.order {
            for part in state.tensors[i].data.chunks(16 << 10) {
                buf.clear();
                buf.extend(part.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&buf)?;
            }
        }
        Ok(())
    }
}

/// Serialises `state` as safetensors bytes (F32), with the spec hash in the metadata (see
/// [`Layout`]).
pub fn to_bytes(state: &StateDict, spec: &ModelSpec) -> Result<Vec<u8>, StateError> {
    let layout = Layout::new(state, spec);
    let mut out = Vec::with_capacity(layout.len() as usize);
    layout
        .write(state, &mut out)
        .expect("writing to memory cannot fail");
    Ok(out)
}

/// Writes `state` to `path` as safetensors, atomically and durably (temporary file, fsync,
/// rename, fsync of the folder), so a crash leaves the old or the new checkpoint. The file is
/// written from the tensors as it goes, never whole in memory.
pub fn save(path: &Path, state: &StateDict, spec: &ModelSpec) -> Result<(), StateError> {
    let layout = Layout::new(state, spec);
    write_atomic_with(path, |w| layout.write(state, w))
}

/// Writes `bytes` to `path` atomically and durably (`<path>.tmp`, fsync, rename, fsync of the
/// folder): a crash leaves the old file or the new one, never half of one. Every file a site
/// keeps (checkpoint, residual, progress) is written this way.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    write_atomic_with(path, |w| std::io::Write::write_all(w, bytes))
}

/// [`write_atomic`] of what `write` writes, through a buffer: a large file need not be whole in
/// memory first.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<(), StateError> {
    use std::io::Write;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    {
        let f = std::fs::File::create(&tmp).map_err(|e| file_err(&tmp, e))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        write(&mut w)
            .and_then(|_| w.flush())
            .and_then(|_| w.get_ref().sync_all())
            .map_err(|e| file_err(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| file_err(path, e))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| file_err(dir, e))
}

/// Reads a safetensors file and matches it against `spec`: every float tensor must be a tensor of
/// the spec with the right shape; `num_batches_tracked` counters are skipped; a spec hash in the
/// metadata must equal the spec's. Tensors the spec has but the file lacks are simply absent
/// (check with [`crate::state::validate`]).
pub fn load(path: &Path, spec: &ModelSpec) -> Result<StateDict, StateError> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    from_bytes(&bytes, spec).map_err(|e| match e {
        StateError::File { message, .. } => file_err(path, message),
        other => other,
    })
}

/// [`load`] from bytes in memory.
pub fn from_bytes(bytes: &[u8], spec: &ModelSpec) -> Result<StateDict, StateError> {
    let not_st = |e: safetensors::SafeTensorError| StateError::File {
        path: "<memory>".into(),
        message: format!("not a safetensors file: {e}"),
    };
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(not_st)?;
    let expected = spec.hash();
    if let Some(found) = meta.metadata().as_ref().and_then(|m| m.get(META_SPEC_HASH))
        && *found != expected.to_string()
    {
        return Err(StateError::SpecHashMismatch {
            expected: expected.to_string(),
            found: found.clone(),
        });
    }
    let st = SafeTensors::deserialize(bytes).map_err(not_st)?;
    let mut by_name: HashMap<String, TensorView<'_>> = st.tensors().into_iter().collect();
    let mut tensors = Vec::new();
    for s in &spec.tensors {
        let Some(view) = by_name.remove(&s.name) else {
            continue;
        };
        if view.shape() != s.shape.as_slice() {
            return Err(StateError::WrongShape {
                name: s.name.clone(),
                expected: s.shape.clone(),
                found: view.shape().to_vec(),
            });
        }
        let data = decode(&s.name, &view)?;
        tensors.push(NamedTensor {
            name: s.name.clone(),
            shape: s.shape.clone(),
            kind: s.kind,
            data,
        });
    }
    let mut extra: Vec<String> = by_name
        .into_keys()
        .filter(|n| !n.ends_with(".num_batches_tracked"))
        .collect();
    extra.sort();
    if let Some(first) = extra.into_iter().next() {
        return Err(StateError::Unexpected(first));
    }
    Ok(StateDict {
        spec_hash: expected,
        tensors,
    })
}

fn decode(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, StateError> {
    let b = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(StateError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}
