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
use unifed_protocol::ModelSpec;

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

/// Serialises `state` as safetensors bytes (F32), with the spec hash in the metadata.
pub fn to_bytes(state: &StateDict, spec: &ModelSpec) -> Result<Vec<u8>, StateError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = state
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.shape.clone(),
                t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    // PyTorch's BatchNorm also saves an int64 `num_batches_tracked`; burn keeps no such
    // counter, so write 0 for every BN layer so that `load_state_dict(strict=True)` accepts
    // the file (the counter only matters to PyTorch BN layers built with momentum=None).
    let zero = 0i64.to_le_bytes();
    let counters: Vec<String> = state
        .tensors
        .iter()
        .filter(|t| t.kind == unifed_protocol::TensorKind::BnRunningMean)
        .filter_map(|t| {
            t.name
                .strip_suffix(".running_mean")
                .map(|p| format!("{p}.num_batches_tracked"))
        })
        .collect();
    let counter_views = counters.iter().map(|n| {
        TensorView::new(Dtype::I64, vec![], &zero)
            .map(|v| (n.clone(), v))
            .map_err(|e| StateError::Mismatch(e.to_string()))
    });
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b)
                    .map_err(|e| StateError::Mismatch(e.to_string()))?,
            ))
        })
        .chain(counter_views)
        .collect::<Result<Vec<_>, StateError>>()?;
    let meta = HashMap::from([
        (META_SPEC_HASH.to_string(), state.spec_hash.to_string()),
        (META_ARCH.to_string(), spec.architecture.clone()),
        ("format".to_string(), "pt".to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| StateError::Mismatch(e.to_string()))?;
    Ok(canonical_header(bytes))
}

/// The file with its JSON header's keys sorted (the metadata map is a `HashMap`, whose order
/// changes from process to process), so the same state always gives the same bytes. Tensor
/// offsets are relative to the data section and stay valid.
fn canonical_header(bytes: Vec<u8>) -> Vec<u8> {
    use serde_json::Value;
    use std::collections::BTreeMap;
    fn sorted(v: Value) -> Value {
        match v {
            Value::Object(m) => {
                let b: BTreeMap<String, Value> =
                    m.into_iter().map(|(k, v)| (k, sorted(v))).collect();
                serde_json::to_value(b).expect("a map of values serialises")
            }
            other => other,
        }
    }
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    else {
        return bytes;
    };
    let Some(Ok(header)) = bytes.get(8..8 + n).map(serde_json::from_slice::<Value>) else {
        return bytes;
    };
    // `to_value` of a BTreeMap builds a serde_json map in the BTreeMap's (sorted) order, and
    // serialising it keeps that order with or without serde_json's `preserve_order`.
    let mut text = serde_json::to_vec(&sorted(header)).expect("a JSON value serialises");
    // safetensors pads the header with spaces to a multiple of 8 bytes.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// Writes `state` to `path` as safetensors, atomically and durably (temporary file, fsync,
/// rename, fsync of the folder), so a crash leaves the old or the new checkpoint.
pub fn save(path: &Path, state: &StateDict, spec: &ModelSpec) -> Result<(), StateError> {
    write_atomic(path, &to_bytes(state, spec)?)
}

/// Writes `bytes` to `path` atomically and durably (`<path>.tmp`, fsync, rename, fsync of the
/// folder): a crash leaves the old file or the new one, never half of one. Every file a site
/// keeps (checkpoint, residual, progress) is written this way.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(|e| file_err(&tmp, e))?;
        f.write_all(bytes)
            .and_then(|_| f.sync_all())
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
