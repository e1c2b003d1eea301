//! Tensor encodings on the wire: `f32`, `f16`, `q8` (per-tensor symmetric int8 with a scale)
//! top-k sparse with f32 or q8 values, dense ternary with a scale per block, and ternary-q8
//! (ternary matrices, q8 for the rest); the sender keeps the error-feedback residual.

use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// How a federation encodes tensors on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Encoding {
    /// 4 bytes per value, exact.
    F32,
    /// IEEE half precision, 2 bytes per value.
    F16,
    /// Per-tensor symmetric int8: `value = q * scale`, `scale = max|x| / 127`.
    Q8,
    /// Keep the `k = ceil(len * per_mille / 1000)` largest-magnitude entries of each tensor (at
    /// least 1), as f32 with delta-coded indices; the sender adds what it dropped to the next
    /// round's tensor (error feedback).
    TopK {
        /// Fraction kept, in thousandths (1..=1000).
        per_mille: u16,
    },
    /// Top-k as [`Encoding::TopK`] with the kept values in per-tensor q8: about 2 bytes per
    /// kept entry (a one-byte gap and a one-byte value), so `topkq8100` is ~20x below f32.
    TopKQ8 {
        /// Fraction kept, in thousandths (1..=1000).
        per_mille: u16,
    },
    /// Every value as one of `{-s, 0, +s}`, with one f16 scale `s` per `block` values (the
    /// scale that minimises the block's squared error), five values packed per byte: with
    /// blocks of 256, 1.66 bits per value and ~19x below f32. Every value moves every round
    /// (with error feedback, what it rounds away goes out later).
    Ternary {
        /// Values per scale, in [`TERNARY_BLOCKS`].
        block: u16,
    },
    /// [`Encoding::Ternary`] for weight matrices (rank-2 tensors: fully connected layers, most
    /// of a CNN's bytes) and [`Encoding::Q8`] for every other tensor (convolution kernels,
    /// biases), which are few values but carry more per value.
    TernaryQ8 {
        /// Values per scale of the ternary matrices, in [`TERNARY_BLOCKS`].
        block: u16,
    },
}

/// Values per scale of `ternary` and `ternaryq8` when the name gives no `b<block>`.
pub const TERNARY_BLOCK: u16 = 256;

/// The ternary block sizes a peer accepts: from 16 values per scale (2 bits of scale per value)
/// to 4096.
pub const TERNARY_BLOCKS: core::ops::RangeInclusive<u16> = 16..=4096;

impl core::str::FromStr for Encoding {
    type Err = EncodingParseError;

    /// Parses `f32`, `f16`, `q8`, `ternary`, `ternaryq8`, `topk<per-mille>` (e.g. `topk100`
    /// keeps 10%) or `topkq8<per-mille>` (the same with q8 values); `ternary` and `ternaryq8`
    /// take an optional `b<block>` (e.g. `ternaryq8b64`: a scale per 64 values).
    fn from_str(s: &str) -> Result<Self, EncodingParseError> {
        let per_mille = |t: &str, digits: &str| {
            digits
                .parse::<u16>()
                .map_err(|_| EncodingParseError::BadPerMille(t.into()))
        };
        let block = |t: &str, rest: &str| match rest {
            "" => Ok(TERNARY_BLOCK),
            b => b
                .strip_prefix('b')
                .and_then(|d| d.parse::<u16>().ok())
                .ok_or_else(|| EncodingParseError::BadBlock(t.into())),
        };
        let e = match s {
            "f32" => Encoding::F32,
            "f16" => Encoding::F16,
            "q8" => Encoding::Q8,
            t if t.starts_with("ternaryq8") => Encoding::TernaryQ8 {
                block: block(t, &t[9..])?,
            },
            t if t.starts_with("ternary") => Encoding::Ternary {
                block: block(t, &t[7..])?,
            },
            t if t.starts_with("topkq8") => Encoding::TopKQ8 {
                per_mille: per_mille(t, &t[6..])?,
            },
            t if t.starts_with("topk") => Encoding::TopK {
                per_mille: per_mille(t, &t[4..])?,
            },
            other => return Err(EncodingParseError::Unknown(other.into())),
        };
        e.validate()
            .map_err(|reason| EncodingParseError::OutOfRange {
                name: s.into(),
                reason,
            })?;
        Ok(e)
    }
}

/// Why an encoding's name cannot be parsed into an [`Encoding`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodingParseError {
    /// The name is none of the known encodings.
    #[error(
        "unknown encoding `{0}`: f32, f16, q8, ternary[b<block>], ternaryq8[b<block>], topk<per-mille> or topkq8<per-mille>"
    )]
    Unknown(String),
    /// A `topk` or `topkq8` name whose per-mille fraction is not a number.
    #[error("`{0}`: topk<per-mille> or topkq8<per-mille>, e.g. topk100 keeps 10%")]
    BadPerMille(String),
    /// A `ternary` or `ternaryq8` name whose block suffix is not `b` and a number.
    #[error("`{0}`: ternary or ternaryq8 with an optional b<block>, e.g. ternaryq8b64")]
    BadBlock(String),
    /// The name parses, but its fraction or block size is outside the accepted range
    /// ([`Encoding::validate`]).
    #[error("{reason}")]
    OutOfRange {
        /// The encoding's name as given.
        name: String,
        /// Which parameter is out of range.
        reason: &'static str,
    },
}

impl From<EncodingParseError> for String {
    fn from(e: EncodingParseError) -> String {
        alloc::format!("{e}")
    }
}

/// The values of one tensor in some encoding. Their bytes are owned (`Vec<u8>`, the default)
/// or read in place from a received message (`&[u8]`, see [`EncodedTensorRef`]): both encode
/// alike. Sparse gaps and values are varints and f32s, always decoded into vectors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub enum Values<B = Vec<u8>> {
    /// Little-endian f32 bytes.
    F32(#[serde(with = "serde_bytes")] B),
    /// Little-endian IEEE f16 bytes.
    F16(#[serde(with = "serde_bytes")] B),
    /// int8 values (as bytes) and their scale.
    Q8 {
        /// `max|x| / 127` (0 for an all-zero tensor).
        scale: f32,
        /// Two's-complement int8 values.
        #[serde(with = "serde_bytes")]
        data: B,
    },
    /// Sparse: `len` values, all zero except at `indices` (strictly increasing, each stored as
    /// the gap to the previous one) where they are `values`.
    Sparse {
        /// Dense length.
        len: u32,
        /// Gaps between successive kept indices (the first is the index itself).
        gaps: Vec<u32>,
        /// The kept values.
        values: Vec<f32>,
    },
    /// Sparse as [`Values::Sparse`], the kept values as int8 with one scale.
    SparseQ8 {
        /// Dense length.
        len: u32,
        /// Gaps between successive kept indices (the first is the index itself).
        gaps: Vec<u32>,
        /// `max|kept| / 127` (0 when every kept value is 0).
        scale: f32,
        /// Two's-complement int8 values, one per kept index.
        #[serde(with = "serde_bytes")]
        data: B,
    },
    /// Dense ternary: value `i` is `(t_i - 1) * scale_{i / block}` with the digit `t_i` in
    /// `0..=2`.
    Ternary {
        /// Dense length.
        len: u32,
        /// Values per scale, in [`TERNARY_BLOCKS`].
        block: u16,
        /// One little-endian f16 scale per `block` values (the last block may be shorter).
        #[serde(with = "serde_bytes")]
        scales: B,
        /// Five base-3 digits per byte, the first in the lowest place (each byte below 243).
        #[serde(with = "serde_bytes")]
        digits: B,
    },
}

/// A named tensor in wire form, its value bytes owned or read in place (see [`Values`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "B: serde_bytes::Serialize",
    deserialize = "B: serde_bytes::Deserialize<'de>"
))]
pub struct EncodedTensor<B = Vec<u8>> {
    /// state_dict name.
    pub name: String,
    /// Shape.
    pub shape: Vec<u32>,
    /// Values.
    pub values: Values<B>,
}

/// An [`EncodedTensor`] read in place: its value bytes are a slice of the message it came in,
/// so a receiver decodes them where they lie.
pub type EncodedTensorRef<'a> = EncodedTensor<&'a [u8]>;

/// Why a tensor cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// Byte length or value count disagrees with the shape.
    #[error("tensor `{name}`: {found} values for a shape of {expected}")]
    WrongLength {
        /// Tensor name.
        name: String,
        /// Values the shape needs.
        expected: usize,
        /// Values present.
        found: usize,
    },
    /// Sparse indices out of range or not increasing.
    #[error("tensor `{0}`: sparse indices out of range or not increasing")]
    BadIndices(String),
    /// The shape's product overflows.
    #[error("tensor `{0}`: shape overflows")]
    ShapeOverflow(String),
    /// A ternary block size outside [`TERNARY_BLOCKS`].
    #[error("tensor `{name}`: ternary block of {block} values (16 to 4096 accepted)")]
    BadBlock {
        /// Tensor name.
        name: String,
        /// The block size it gave.
        block: u16,
    },
}

impl Encoding {
    /// Checks the encoding's parameters: a top-k fraction must lie in `1..=1000` per mille, a
    /// ternary block in [`TERNARY_BLOCKS`].
    pub fn validate(&self) -> Result<(), &'static str> {
        match *self {
            Encoding::TopK { per_mille } | Encoding::TopKQ8 { per_mille }
                if !(1..=1000).contains(&per_mille) =>
            {
                Err("top-k per_mille must be between 1 and 1000")
            }
            Encoding::Ternary { block } | Encoding::TernaryQ8 { block }
                if !TERNARY_BLOCKS.contains(&block) =>
            {
                Err("a ternary block must hold between 16 and 4096 values")
            }
            _ => Ok(()),
        }
    }

    /// True for `f32`, the one encoding that loses nothing.
    pub fn is_exact(&self) -> bool {
        matches!(self, Encoding::F32)
    }

    /// True if the values of `t` are what this encoding sends for a tensor of its shape.
    pub fn holds<B>(&self, t: &EncodedTensor<B>) -> bool {
        match (&t.values, self) {
            (Values::Ternary { block: b, .. }, Encoding::TernaryQ8 { block }) => {
                t.shape.len() == 2 && b == block
            }
            (Values::Q8 { .. }, Encoding::TernaryQ8 { .. }) => t.shape.len() != 2,
            (Values::Ternary { block: b, .. }, Encoding::Ternary { block }) => b == block,
            (values, encoding) => matches!(
                (values, encoding),
                (Values::F32(_), Encoding::F32)
                    | (Values::F16(_), Encoding::F16)
                    | (Values::Q8 { .. }, Encoding::Q8)
                    | (Values::Sparse { .. }, Encoding::TopK { .. })
                    | (Values::SparseQ8 { .. }, Encoding::TopKQ8 { .. })
            ),
        }
    }
}

impl core::fmt::Display for Encoding {
    /// The name [`core::str::FromStr`] parses: `f32`, `f16`, `q8`, `ternary`, `ternaryq8b64`,
    /// `topk100`, `topkq8100` (a ternary block is named only when it is not the default).
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Encoding::F32 => f.write_str("f32"),
            Encoding::F16 => f.write_str("f16"),
            Encoding::Q8 => f.write_str("q8"),
            Encoding::TopK { per_mille } => write!(f, "topk{per_mille}"),
            Encoding::TopKQ8 { per_mille } => write!(f, "topkq8{per_mille}"),
            Encoding::Ternary { block } | Encoding::TernaryQ8 { block } => {
                let name = match self {
                    Encoding::Ternary { .. } => "ternary",
                    _ => "ternaryq8",
                };
                f.write_str(name)?;
                if *block != TERNARY_BLOCK {
                    write!(f, "b{block}")?;
                }
                Ok(())
            }
        }
    }
}

impl EncodedTensor {
    /// This tensor with its value bytes borrowed (its name, shape and any sparse gaps and
    /// values copied).
    pub fn as_ref(&self) -> EncodedTensorRef<'_> {
        EncodedTensor {
            name: self.name.clone(),
            shape: self.shape.clone(),
            values: match &self.values {
                Values::F32(b) => Values::F32(b),
                Values::F16(b) => Values::F16(b),
                Values::Q8 { scale, data } => Values::Q8 {
                    scale: *scale,
                    data,
                },
                Values::Sparse { len, gaps, values } => Values::Sparse {
                    len: *len,
                    gaps: gaps.clone(),
                    values: values.clone(),
                },
                Values::SparseQ8 {
                    len,
                    gaps,
                    scale,
                    data,
                } => Values::SparseQ8 {
                    len: *len,
                    gaps: gaps.clone(),
                    scale: *scale,
                    data,
                },
                Values::Ternary {
                    len,
                    block,
                    scales,
                    digits,
                } => Values::Ternary {
                    len: *len,
                    block: *block,
                    scales,
                    digits,
                },
            },
        }
    }
}

impl<B> EncodedTensor<B> {
    /// Number of elements the shape describes (1 for an empty shape), or `None` if the
    /// product overflows `usize`.
    pub fn numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
    }
}

/// Encodes `values` (laid out as `shape`) as `encoding`, with optional error feedback.
///
/// When `residual` is given it is first resized to `values.len()` (new entries zero), added to
/// the values, and then overwritten with what the receiver will *not* see: the values that
/// top-k dropped, or the rounding error `x - decoded(x)` of `f32`, `f16` and `q8`. Passing
/// the same residual every round therefore gives error feedback for every encoding. Entries
/// whose error is not finite (NaN or infinite inputs) are reset to zero so that one bad value
/// does not poison later rounds; the bad value itself is still sent, and the receiver is
/// expected to reject non-finite tensors after decoding.
///
/// Top-k keeps `k = ceil(len * per_mille / 1000)` entries (at least 1, at most `len`; a
/// `per_mille` outside `1..=1000` is clamped into it), choosing the largest magnitudes with
/// ties broken by the lower index. `q8` uses `scale = max|x| / 127` and
/// `q = round(x / scale)` clamped to `[-127, 127]`. The shape is copied as given; this
/// function never fails and never panics, so check `values.len()` against the shape first.
pub fn encode(
    name: &str,
    shape: &[u32],
    values: &[f32],
    encoding: Encoding,
    residual: Option<&mut Vec<f32>>,
) -> EncodedTensor {
    let values = match residual {
        // Without feedback, exact f32 reads the values where they are; the others encode a
        // copy (their rounding error is dropped).
        None if encoding.is_exact() => f32_bytes(values),
        None => encode_values(&mut values.to_vec(), shape, encoding),
        // An empty residual is all zeros: exact f32 sends the values as they are and leaves
        // nothing behind.
        Some(r) if r.is_empty() && encoding.is_exact() => f32_bytes(values),
        Some(r) => {
            // The tensor to send is `values + residual`, summed in the residual's own memory,
            // which the encoder then turns into what the receiver will not see.
            if r.is_empty() {
                r.extend_from_slice(values);
            } else {
                r.resize(values.len(), 0.0);
                r.iter_mut().zip(values).for_each(|(e, &v)| *e += v);
            }
            return encode_leaving_error(name, shape, r, encoding);
        }
    };
    EncodedTensor {
        name: name.into(),
        shape: shape.to_vec(),
        values,
    }
}

/// Encodes `x` (values already summed with any error-feedback residual) as `encoding` and
/// leaves in `x` what the receiver will not see: the next residual, computed in `x`'s own
/// memory, as [`encode`] leaves it (empty under exact f32). For a caller that owns the values
/// and must keep the previous residual until the update is answered, this saves a copy of
/// the residual.
pub fn encode_leaving_error(
    name: &str,
    shape: &[u32],
    x: &mut Vec<f32>,
    encoding: Encoding,
) -> EncodedTensor {
    let values = encode_values(x, shape, encoding);
    if encoding.is_exact() {
        // Exact: nothing is left behind, and the buffer is freed rather than kept empty with
        // a tensor's worth of capacity (a site keeps the residual from round to round).
        *x = Vec::new();
    }
    EncodedTensor {
        name: name.into(),
        shape: shape.to_vec(),
        values,
    }
}

/// Encodes `x` as `encoding` and replaces every entry of `x` by what the receiver will not see
/// (`x - decoded(x)`; top-k: the dropped values whole); an error that is not finite becomes 0.
fn encode_values(x: &mut [f32], shape: &[u32], encoding: Encoding) -> Values {
    let encoded = match encoding {
        Encoding::F32 => {
            let v = f32_bytes(x);
            x.fill(0.0);
            v
        }
        Encoding::F16 => {
            let mut bytes = Vec::with_capacity(2 * x.len());
            for v in x.iter_mut() {
                let h = half::f16::from_f32(*v);
                bytes.extend_from_slice(&h.to_le_bytes());
                *v -= h.to_f32();
            }
            Values::F16(bytes)
        }
        Encoding::TernaryQ8 { block } if shape.len() == 2 => ternary(x, block),
        Encoding::Q8 | Encoding::TernaryQ8 { .. } => {
            let scale = q8_scale(x);
            let mut data = Vec::with_capacity(x.len());
            for v in x.iter_mut() {
                let q = q8_quantise(*v, scale);
                data.push(q as u8);
                *v -= f32::from(q) * scale;
            }
            Values::Q8 { scale, data }
        }
        Encoding::Ternary { block } => ternary(x, block),
        Encoding::TopK { per_mille } | Encoding::TopKQ8 { per_mille } => {
            let kept = top_k_indices(x, per_mille);
            let mut gaps = Vec::with_capacity(kept.len());
            let mut prev = 0u32;
            for (n, &i) in kept.iter().enumerate() {
                gaps.push(if n == 0 { i } else { i - prev });
                prev = i;
            }
            let len = u32::try_from(x.len()).unwrap_or(u32::MAX);
            let values: Vec<f32> = kept.iter().map(|&i| x[i as usize]).collect();
            if matches!(encoding, Encoding::TopKQ8 { .. }) {
                let scale = q8_scale(&values);
                let mut data = Vec::with_capacity(values.len());
                for &i in &kept {
                    // Dropped entries stay whole; kept ones leave their rounding error.
                    let e = &mut x[i as usize];
                    let q = q8_quantise(*e, scale);
                    data.push(q as u8);
                    *e -= f32::from(q) * scale;
                }
                Values::SparseQ8 {
                    len,
                    gaps,
                    scale,
                    data,
                }
            } else {
                // What was not sent stays behind; what was sent leaves nothing.
                for &i in &kept {
                    x[i as usize] = 0.0;
                }
                Values::Sparse { len, gaps, values }
            }
        }
    };
    for e in x.iter_mut() {
        if !e.is_finite() {
            *e = 0.0;
        }
    }
    encoded
}

/// `x` as little-endian f32 bytes.
fn f32_bytes(x: &[f32]) -> Values {
    Values::F32(x.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// The little-endian `f32` values of an exact tensor, checked against its shape as
/// [`decode`] checks them and read in place (no copy); `None` for any other encoding.
pub fn exact_le_bytes<B: AsRef<[u8]>>(t: &EncodedTensor<B>) -> Result<Option<&[u8]>, TensorError> {
    let Values::F32(bytes) = &t.values else {
        return Ok(None);
    };
    let numel = t
        .numel()
        .ok_or_else(|| TensorError::ShapeOverflow(t.name.clone()))?;
    let bytes = bytes.as_ref();
    check_bytes(t, numel, bytes.len(), 4)?;
    Ok(Some(bytes))
}

/// Checks a tensor against its shape exactly as [`decode`] and [`decode_add`] do, without
/// allocating or decoding anything, and gives its element count: a tensor that passes decodes.
///
/// Dense encodings must hold exactly one value per element of the shape. A sparse tensor's
/// `len` must equal the shape's element count, it needs one value per index, and its indices
/// (first gap = first index, later gaps at least 1) must stay below `len`. A ternary tensor's
/// block must be in [`TERNARY_BLOCKS`], with one scale per block and digits below 243.
pub fn check<B: AsRef<[u8]>>(t: &EncodedTensor<B>) -> Result<usize, TensorError> {
    let numel = t
        .numel()
        .ok_or_else(|| TensorError::ShapeOverflow(t.name.clone()))?;
    match &t.values {
        Values::F32(bytes) => check_bytes(t, numel, bytes.as_ref().len(), 4)?,
        Values::F16(bytes) => check_bytes(t, numel, bytes.as_ref().len(), 2)?,
        Values::Q8 { data, .. } => check_bytes(t, numel, data.as_ref().len(), 1)?,
        Values::Sparse { len, gaps, values } => check_sparse(t, numel, *len, gaps, values.len())?,
        Values::SparseQ8 {
            len, gaps, data, ..
        } => check_sparse(t, numel, *len, gaps, data.as_ref().len())?,
        Values::Ternary { len, block, .. } => {
            check_ternary(t, numel, *len, *block)?;
            ternary_parts(numel, &t.values).map_err(|found| wrong_length(t, numel, found))?;
        }
    }
    Ok(numel)
}

/// Decodes a tensor to dense `f32` values after checking it against its shape ([`check`]).
/// Decoding a sparse tensor allocates its full dense length, so compare the shape with the
/// model spec first.
pub fn decode<B: AsRef<[u8]>>(t: &EncodedTensor<B>) -> Result<Vec<f32>, TensorError> {
    let numel = check(t)?;
    Ok(match &t.values {
        Values::F32(bytes) => bytes
            .as_ref()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Values::F16(bytes) => bytes
            .as_ref()
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Values::Q8 { scale, data } => data
            .as_ref()
            .iter()
            .map(|&q| f32::from(q as i8) * scale)
            .collect(),
        Values::Sparse { gaps, values, .. } => sparse(numel, gaps, |n| values[n]),
        Values::SparseQ8 {
            gaps, scale, data, ..
        } => {
            let data = data.as_ref();
            sparse(numel, gaps, |n| f32::from(data[n] as i8) * scale)
        }
        Values::Ternary { .. } => {
            decode_ternary(numel, &t.values).map_err(|found| wrong_length(t, numel, found))?
        }
    })
}

/// Calls `f(at, values)` with the values [`decode`] gives for `t`, `block` values at a time in
/// order from value `at` (the last block may be shorter), bit for bit the slices of
/// `decode(t)`, without allocating the decoded tensor: one block of scratch. `t` is checked
/// first ([`check`]); on an error `f` is never called.
pub fn decode_blocks<B: AsRef<[u8]>>(
    t: &EncodedTensor<B>,
    block: usize,
    mut f: impl FnMut(usize, &[f32]),
) -> Result<(), TensorError> {
    let numel = check(t)?;
    let ternary = match &t.values {
        Values::Ternary { .. } => {
            Some(ternary_parts(numel, &t.values).map_err(|found| wrong_length(t, numel, found))?)
        }
        _ => None,
    };
    let mut buf = alloc::vec![0.0f32; block.max(1).min(numel)];
    // Sparse tensors: the gaps consumed so far and the index of the last one.
    let (mut cursor, mut last) = (0usize, 0usize);
    let mut at = 0;
    while at < numel {
        let n = buf.len().min(numel - at);
        let out = &mut buf[..n];
        let mut sparse_block = |gaps: &[u32], value: &dyn Fn(usize) -> f32| {
            out.fill(0.0);
            while let Some(&g) = gaps.get(cursor) {
                let i = if cursor == 0 {
                    g as usize
                } else {
                    last + g as usize
                };
                if i >= at + n {
                    break;
                }
                out[i - at] = value(cursor);
                (last, cursor) = (i, cursor + 1);
            }
        };
        match &t.values {
            Values::F32(bytes) => {
                let bytes = &bytes.as_ref()[4 * at..4 * (at + n)];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Values::F16(bytes) => {
                let bytes = &bytes.as_ref()[2 * at..2 * (at + n)];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Values::Q8 { scale, data } => {
                for (o, &q) in out.iter_mut().zip(&data.as_ref()[at..at + n]) {
                    *o = f32::from(q as i8) * scale;
                }
            }
            Values::Sparse { gaps, values, .. } => sparse_block(gaps, &|k| values[k]),
            Values::SparseQ8 {
                gaps, scale, data, ..
            } => {
                let data = data.as_ref();
                sparse_block(gaps, &|k| f32::from(data[k] as i8) * scale)
            }
            Values::Ternary { .. } => {
                let (size, scales, digits) = ternary.expect("parts of a ternary tensor");
                // A scale at a time, as `decode_ternary`: each digit's value times its scale.
                let mut i = at;
                while i < at + n {
                    let b = i / size;
                    let end = ((b + 1) * size).min(at + n);
                    let s = half::f16::from_le_bytes([scales[2 * b], scales[2 * b + 1]]).to_f32();
                    for (o, j) in out[i - at..end - at].iter_mut().zip(i..end) {
                        *o = TRITS[usize::from(digits[j / 5])][j % 5] * s;
                    }
                    i = end;
                }
            }
        }
        f(at, out);
        at += n;
    }
    Ok(())
}

/// Adds the values [`decode`] gives for `t` to `out`, in place and bit for bit as
/// `out[i] + decode(t)[i]`, without allocating the decoded tensor. `out` must hold exactly the
/// tensor's values. Everything is checked before anything is written: on an error `out` is
/// unchanged.
pub fn decode_add<B: AsRef<[u8]>>(
    t: &EncodedTensor<B>,
    out: &mut [f32],
) -> Result<(), TensorError> {
    let numel = t
        .numel()
        .ok_or_else(|| TensorError::ShapeOverflow(t.name.clone()))?;
    if out.len() != numel {
        return Err(wrong_length(t, out.len(), numel));
    }
    check(t)?;
    match &t.values {
        Values::F32(bytes) => {
            for (o, b) in out.iter_mut().zip(bytes.as_ref().chunks_exact(4)) {
                *o += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Values::F16(bytes) => {
            for (o, b) in out.iter_mut().zip(bytes.as_ref().chunks_exact(2)) {
                *o += half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Values::Q8 { scale, data } => {
            for (o, &q) in out.iter_mut().zip(data.as_ref()) {
                *o += f32::from(q as i8) * scale;
            }
        }
        Values::Sparse { gaps, values, .. } => sparse_add(gaps, |n| values[n], out),
        Values::SparseQ8 {
            gaps, scale, data, ..
        } => {
            let data = data.as_ref();
            sparse_add(gaps, |n| f32::from(data[n] as i8) * scale, out)
        }
        Values::Ternary { .. } => {
            ternary_add(&t.values, out).map_err(|found| wrong_length(t, numel, found))?;
        }
    }
    Ok(())
}

/// Ternary encoding of `x` (see [`Encoding::Ternary`]) with a scale per `block` values: per
/// block the scale `s` and digits that minimise the squared error exactly (for `m` kept values
/// the best are the `m` largest magnitudes with `s` their mean, which removes `(sum)^2 / m` of
/// the error; `m` is the one that removes most), `s` rounded to f16 and each value rounded to
/// the nearest of `{-s, 0, s}`. A block holding NaN or infinity gets a NaN scale so that it
/// decodes as NaN and is rejected. `block` is clamped into [`TERNARY_BLOCKS`]. Every value of
/// `x` is replaced by its rounding error.
fn ternary(x: &mut [f32], block: u16) -> Values {
    let block = block.clamp(*TERNARY_BLOCKS.start(), *TERNARY_BLOCKS.end());
    let size = usize::from(block);
    let mut scales = Vec::with_capacity(2 * x.len().div_ceil(size));
    let mut digits = Vec::with_capacity(x.len().div_ceil(5));
    let mut sorted = Vec::with_capacity(size);
    let (mut byte, mut place, mut filled) = (0u8, 1u8, 0);
    for values in x.chunks_mut(size) {
        let s = if values.iter().any(|v| !v.is_finite()) {
            f32::NAN
        } else {
            best_ternary_scale(values, &mut sorted)
        };
        let h = half::f16::from_f32(s);
        scales.extend_from_slice(&h.to_le_bytes());
        let s = h.to_f32();
        for v in values.iter_mut() {
            let d = if s > 0.0 && *v >= s / 2.0 {
                2
            } else if s > 0.0 && *v <= -s / 2.0 {
                0
            } else {
                1
            };
            // Less exactly what `decode_ternary` computes for this digit.
            *v -= (f32::from(d) - 1.0) * s;
            byte += d * place;
            filled += 1;
            if filled == 5 {
                digits.push(byte);
                (byte, place, filled) = (0, 1, 0);
            } else {
                place *= 3;
            }
        }
    }
    if filled > 0 {
        digits.push(byte);
    }
    Values::Ternary {
        len: u32::try_from(x.len()).unwrap_or(u32::MAX),
        block,
        scales,
        digits,
    }
}

/// The scale `s` minimising `sum (v - s t)^2` over `t` in `{-1, 0, 1}` for finite `values`: the
/// mean of the `m` largest magnitudes for the `m` that maximises `(their sum)^2 / m` (0 for an
/// all-zero block). `sorted` is scratch space.
fn best_ternary_scale(values: &[f32], sorted: &mut Vec<u32>) -> f32 {
    // Finite magnitudes order as their bit patterns do, which sort faster than floats.
    sorted.clear();
    sorted.extend(values.iter().map(|v| v.abs().to_bits()));
    sorted.sort_unstable();
    let (mut sum, mut best, mut scale) = (0.0f64, 0.0f64, 0.0f64);
    for (m, &a) in sorted.iter().rev().enumerate() {
        sum += f64::from(f32::from_bits(a));
        let removed = sum * sum / (m + 1) as f64;
        if removed > best {
            (best, scale) = (removed, sum / (m + 1) as f64);
        }
    }
    scale as f32
}

/// `TRITS[b]`: the five base-3 digits of a byte `b` below 243, the first in the lowest place,
/// each less one (the unscaled ternary values the byte packs).
const TRITS: [[f32; 5]; 243] = {
    let mut t = [[0.0f32; 5]; 243];
    let mut b = 0;
    while b < 243 {
        let (mut v, mut k) = (b, 0);
        while k < 5 {
            t[b][k] = (v % 3) as f32 - 1.0;
            v /= 3;
            k += 1;
        }
        b += 1;
    }
    t
};

/// The `numel` values of a [`Values::Ternary`] whose block is in [`TERNARY_BLOCKS`]; on a
/// length that does not fit, the count of values the bytes hold, for the error.
fn decode_ternary<B: AsRef<[u8]>>(numel: usize, v: &Values<B>) -> Result<Vec<f32>, usize> {
    let (size, scales, digits) = ternary_parts(numel, v)?;
    let scale = |b: usize| half::f16::from_le_bytes([scales[2 * b], scales[2 * b + 1]]).to_f32();
    // Five values per byte from the table, then each block times its scale.
    let mut out = vec![0.0f32; numel];
    let mut whole = out.chunks_exact_mut(5);
    for (values, &b) in (&mut whole).zip(digits) {
        values.copy_from_slice(&TRITS[usize::from(b)]);
    }
    let tail = whole.into_remainder();
    if let Some(&b) = digits.get(numel / 5) {
        let n = tail.len();
        tail.copy_from_slice(&TRITS[usize::from(b)][..n]);
    }
    for (b, values) in out.chunks_mut(size).enumerate() {
        let s = scale(b);
        values.iter_mut().for_each(|v| *v *= s);
    }
    Ok(out)
}

/// Checks a ternary tensor's stated length against `numel` and its block size against
/// [`TERNARY_BLOCKS`].
fn check_ternary<B>(
    t: &EncodedTensor<B>,
    numel: usize,
    len: u32,
    block: u16,
) -> Result<(), TensorError> {
    if len as usize != numel {
        return Err(wrong_length(t, numel, len as usize));
    }
    if !TERNARY_BLOCKS.contains(&block) {
        return Err(TensorError::BadBlock {
            name: t.name.clone(),
            block,
        });
    }
    Ok(())
}

/// The block size, scales and digits of a [`Values::Ternary`] of `numel` values, checked: on a
/// length that does not fit, the count of values the bytes hold, for the error.
fn ternary_parts<B: AsRef<[u8]>>(
    numel: usize,
    v: &Values<B>,
) -> Result<(usize, &[u8], &[u8]), usize> {
    let Values::Ternary {
        block,
        scales,
        digits,
        ..
    } = v
    else {
        return Err(0);
    };
    let (scales, digits) = (scales.as_ref(), digits.as_ref());
    let size = usize::from(*block).max(1);
    if scales.len() != 2 * numel.div_ceil(size) {
        return Err(scales.len() / 2 * size);
    }
    if digits.len() != numel.div_ceil(5) || digits.iter().any(|&b| b > 242) {
        return Err(digits.len() * 5);
    }
    Ok((size, scales, digits))
}

/// [`decode_ternary`] added to `out` in place, bit for bit: each value is its digit times its
/// block's scale, then added.
fn ternary_add<B: AsRef<[u8]>>(v: &Values<B>, out: &mut [f32]) -> Result<(), usize> {
    let (size, scales, digits) = ternary_parts(out.len(), v)?;
    for (b, values) in out.chunks_mut(size).enumerate() {
        let s = half::f16::from_le_bytes([scales[2 * b], scales[2 * b + 1]]).to_f32();
        let first = b * size;
        for (k, o) in values.iter_mut().enumerate() {
            let i = first + k;
            *o += TRITS[usize::from(digits[i / 5])][i % 5] * s;
        }
    }
    Ok(())
}

/// The dense tensor of `numel` values, zero except at the indices `gaps` names (checked by
/// [`check`]), where the `n`th is `value(n)`.
fn sparse(numel: usize, gaps: &[u32], value: impl Fn(usize) -> f32) -> Vec<f32> {
    let mut dense = alloc::vec![0.0f32; numel];
    let mut i = 0usize;
    for (n, &g) in gaps.iter().enumerate() {
        i = if n == 0 { g as usize } else { i + g as usize };
        dense[i] = value(n);
    }
    dense
}

/// [`sparse`] added to `out` (of the tensor's length, indices checked by [`check`]) in place:
/// every value of `out` gets the dense tensor's value, zero included, so the result is bit for
/// bit `out + sparse(..)`.
fn sparse_add(gaps: &[u32], value: impl Fn(usize) -> f32, out: &mut [f32]) {
    // Adding zero is not a no-op on -0.0: the dense sum turns it into +0.0.
    let (mut next, mut i) = (0usize, 0usize);
    for (n, &g) in gaps.iter().enumerate() {
        i = if n == 0 { g as usize } else { i + g as usize };
        out[next..i].iter_mut().for_each(|o| *o += 0.0);
        out[i] += value(n);
        next = i + 1;
    }
    out[next..].iter_mut().for_each(|o| *o += 0.0);
}

/// Checks a sparse tensor's dense length against `numel`, its value count against its gaps,
/// and every index it names (in range, strictly increasing) before anything is written.
fn check_sparse<B>(
    t: &EncodedTensor<B>,
    numel: usize,
    len: u32,
    gaps: &[u32],
    count: usize,
) -> Result<(), TensorError> {
    let len = len as usize;
    if len != numel {
        return Err(wrong_length(t, numel, len));
    }
    if count != gaps.len() {
        return Err(wrong_length(t, gaps.len(), count));
    }
    if gaps.len() > len {
        return Err(TensorError::BadIndices(t.name.clone()));
    }
    // Validate every index before allocating the dense tensor.
    let mut prev = 0usize;
    for (n, &g) in gaps.iter().enumerate() {
        let i = if n == 0 {
            g as usize
        } else if g == 0 {
            return Err(TensorError::BadIndices(t.name.clone()));
        } else {
            prev.saturating_add(g as usize)
        };
        if i >= len {
            return Err(TensorError::BadIndices(t.name.clone()));
        }
        prev = i;
    }
    Ok(())
}

/// Checks that `bytes` bytes hold exactly `numel` values of `width` bytes each.
fn check_bytes<B>(
    t: &EncodedTensor<B>,
    numel: usize,
    bytes: usize,
    width: usize,
) -> Result<(), TensorError> {
    let expected = numel
        .checked_mul(width)
        .ok_or_else(|| TensorError::ShapeOverflow(t.name.clone()))?;
    if bytes == expected {
        return Ok(());
    }
    // Round a partial trailing value away from `numel` so the message never reads "n for n".
    let found = if bytes > expected {
        bytes.div_ceil(width)
    } else {
        bytes / width
    };
    Err(wrong_length(t, numel, found))
}

fn wrong_length<B>(t: &EncodedTensor<B>, expected: usize, found: usize) -> TensorError {
    TensorError::WrongLength {
        name: t.name.clone(),
        expected,
        found,
    }
}

/// `max|x| / 127`; 0 for an empty or all-zero tensor. A tensor holding NaN or infinity gets a
/// NaN scale, so every value decodes as NaN and the receiver rejects it as non-finite: q8 must
/// never turn a NaN into a plausible 0.
fn q8_scale(x: &[f32]) -> f32 {
    if x.iter().any(|v| !v.is_finite()) {
        return f32::NAN;
    }
    x.iter().map(|&v| magnitude(v)).fold(0.0f32, f32::max) / 127.0
}

/// `round(v / scale)` (half away from zero) clamped to `[-127, 127]`; 0 when `scale` is 0.
fn q8_quantise(v: f32, scale: f32) -> i8 {
    if scale == 0.0 {
        return 0;
    }
    let r = v / scale;
    if r.is_nan() {
        return 0;
    }
    let r = r.clamp(-127.0, 127.0);
    // `r` is small, so truncation and the fractional part are exact.
    let t = r as i32;
    let frac = r - t as f32;
    let q = if frac >= 0.5 {
        t + 1
    } else if frac <= -0.5 {
        t - 1
    } else {
        t
    };
    q.clamp(-127, 127) as i8
}

/// `|v|` with the sign bit cleared, so NaN compares as the largest magnitude under `total_cmp`.
fn magnitude(v: f32) -> f32 {
    f32::from_bits(v.to_bits() & 0x7fff_ffff)
}

/// Indices of the `k` largest-magnitude entries, increasing; ties go to the lower index.
fn top_k_indices(x: &[f32], per_mille: u16) -> Vec<u32> {
    let len = x.len().min(u32::MAX as usize);
    if len == 0 {
        return Vec::new();
    }
    let per_mille = u64::from(per_mille.clamp(1, 1000));
    let k = ((len as u64 * per_mille).div_ceil(1000) as usize).clamp(1, len);
    let mut idx: Vec<u32> = (0..len as u32).collect();
    if k < len {
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            magnitude(x[b as usize])
                .total_cmp(&magnitude(x[a as usize]))
                .then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_unstable();
    }
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    const TERNARY: Encoding = Encoding::Ternary {
        block: TERNARY_BLOCK,
    };
    const TERNARY_Q8: Encoding = Encoding::TernaryQ8 {
        block: TERNARY_BLOCK,
    };

    /// A deterministic spread of values over several orders of magnitude, both signs.
    fn sample(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let unit = (s >> 8) as f32 / (1u32 << 24) as f32; // [0, 1)
                let mag = [1e-3f32, 1e-2, 0.1, 1.0, 10.0][(s % 5) as usize];
                (unit * 2.0 - 1.0) * mag
            })
            .collect()
    }

    #[test]
    fn decode_blocks_gives_the_decoded_tensor_bit_for_bit_in_order_and_checks_first() {
        let x = sample(3 * 257 + 11, 7);
        let encodings = [
            Encoding::F32,
            Encoding::F16,
            Encoding::Q8,
            Encoding::TopK { per_mille: 30 },
            Encoding::TopKQ8 { per_mille: 30 },
            TERNARY,
            Encoding::Ternary { block: 16 },
            TERNARY_Q8,
        ];
        for enc in encodings {
            for shape in [vec![x.len() as u32], vec![1, x.len() as u32]] {
                let t = encode("w", &shape, &x, enc, None);
                let want: Vec<u32> = decode(&t).unwrap().iter().map(|v| v.to_bits()).collect();
                // Blocks that split ternary scales and packed bytes, one value, and one block.
                for block in [1, 7, 100, 256, 1000, x.len(), 10 * x.len()] {
                    let mut got = Vec::new();
                    decode_blocks(&t, block, |at, v| {
                        assert_eq!(at, got.len(), "{enc} block {block}");
                        assert!(v.len() <= block);
                        got.extend(v.iter().map(|v| v.to_bits()));
                    })
                    .unwrap();
                    assert_eq!(got, want, "{enc} {shape:?} block {block}");
                }
            }
        }
        // A malformed tensor is an error before any block.
        let mut t = encode("w", &[x.len() as u32], &x, TERNARY, None);
        if let Values::Ternary { digits, .. } = &mut t.values {
            digits.pop();
        }
        let mut called = false;
        assert!(decode_blocks(&t, 64, |_, _| called = true).is_err());
        assert!(!called);
    }

    #[test]
    fn decode_add_is_bit_for_bit_the_decoded_tensor_added_and_checks_before_writing() {
        let encodings = [
            Encoding::F32,
            Encoding::F16,
            Encoding::Q8,
            Encoding::TopK { per_mille: 100 },
            Encoding::TopKQ8 { per_mille: 100 },
            TERNARY,
            TERNARY_Q8,
        ];
        // 2-D (ternary-q8 is ternary there), long enough for several ternary blocks and an odd
        // tail; the base holds -0.0, which adding a dense zero turns into +0.0.
        let (rows, cols) = (7usize, 131usize);
        let x = sample(rows * cols, 3);
        let mut base = sample(rows * cols, 4);
        base.iter_mut().step_by(3).for_each(|v| *v = -0.0);
        for enc in encodings {
            let t = encode("w", &[rows as u32, cols as u32], &x, enc, None);
            let want: Vec<u32> = base
                .iter()
                .zip(decode(&t).unwrap())
                .map(|(b, d)| (b + d).to_bits())
                .collect();
            let mut got = base.clone();
            decode_add(&t, &mut got).unwrap();
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{enc:?}");

            // A tensor cut short, or a buffer of another length: an error, nothing written.
            let mut short = t.clone();
            match &mut short.values {
                Values::F32(b) | Values::F16(b) => {
                    b.pop();
                }
                Values::Q8 { data, .. } => {
                    data.pop();
                }
                Values::Sparse { gaps, .. } | Values::SparseQ8 { gaps, .. } => {
                    gaps.push(u32::MAX);
                }
                Values::Ternary { digits, .. } => {
                    digits.pop();
                }
            }
            let mut untouched = base.clone();
            assert!(decode_add(&short, &mut untouched).is_err(), "{enc:?}");
            assert_eq!(
                untouched.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                base.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{enc:?}"
            );
            let mut other = vec![0.0; rows * cols - 1];
            assert!(decode_add(&t, &mut other).is_err(), "{enc:?}");
        }
    }

    fn round_trip(x: &[f32], enc: Encoding) -> (EncodedTensor, Vec<f32>) {
        let t = encode("w", &[x.len() as u32], x, enc, None);
        let back = decode(&t).unwrap();
        assert_eq!(back.len(), x.len());
        (t, back)
    }

    #[test]
    fn ternary_keeps_signs_costs_under_two_bits_and_feeds_back_its_error() {
        let x = sample(1000, 9);
        let (t, back) = round_trip(&x, TERNARY);
        let Values::Ternary { scales, digits, .. } = &t.values else {
            panic!("{t:?}")
        };
        assert_eq!((scales.len(), digits.len()), (8, 200));
        for (a, b) in x.iter().zip(&back) {
            // Zero or the value's own sign.
            assert!(*b == 0.0 || a.signum() == b.signum(), "{a} -> {b}");
        }
        // Error feedback: what is sent plus what stays behind is the input.
        let mut r = Vec::new();
        let t = encode("w", &[1000], &x, TERNARY, Some(&mut r));
        let sent = decode(&t).unwrap();
        for ((a, s), e) in x.iter().zip(&sent).zip(&r) {
            assert!((s + e - a).abs() <= 1e-6 * a.abs().max(1.0));
        }
        // A NaN poisons its block's scale, so the receiver sees non-finite values.
        let mut bad = x.clone();
        bad[300] = f32::NAN;
        let back = decode(&encode("w", &[1000], &bad, TERNARY, None)).unwrap();
        assert!(back[256..512].iter().all(|v| v.is_nan()));
        assert!(back[..256].iter().all(|v| v.is_finite()));
    }

    #[test]
    fn ternary_decodes_five_digits_per_byte_lowest_place_first_with_a_short_last_byte() {
        // Digits 0,1,2,2,1 in the first byte, 2,0 in the second; one scale of 2.
        let t = EncodedTensor {
            name: "w".into(),
            shape: vec![7],
            values: Values::Ternary {
                len: 7,
                block: 16,
                scales: half::f16::from_f32(2.0).to_le_bytes().to_vec(),
                digits: vec![3 + 2 * 9 + 2 * 27 + 81, 2],
            },
        };
        assert_eq!(decode(&t).unwrap(), [-2.0, 0.0, 2.0, 2.0, 0.0, 2.0, -2.0]);
    }

    #[test]
    fn a_malformed_ternary_tensor_is_an_error() {
        let x = sample(12, 3);
        let t = encode("w", &[12], &x, TERNARY, None);
        let with = |f: &dyn Fn(&mut Vec<u8>, &mut Vec<u8>)| {
            let mut t = t.clone();
            if let Values::Ternary { scales, digits, .. } = &mut t.values {
                f(scales, digits);
            }
            decode(&t)
        };
        assert!(with(&|_, d| d[0] = 243).is_err());
        assert!(with(&|_, d| d.push(0)).is_err());
        assert!(with(&|s, _| s.push(0)).is_err());
        // A block size outside 16..=4096 is refused by name, before its scales are counted.
        for bad in [0u16, 15, 4097] {
            let mut b = t.clone();
            if let Values::Ternary { block, .. } = &mut b.values {
                *block = bad;
            }
            assert_eq!(
                decode(&b),
                Err(TensorError::BadBlock {
                    name: "w".into(),
                    block: bad
                })
            );
        }
        let mut short = t.clone();
        short.shape = vec![11];
        assert!(decode(&short).is_err());
    }

    #[test]
    fn f32_round_trip_is_exact() {
        let x = sample(257, 1);
        let (_, back) = round_trip(&x, Encoding::F32);
        assert_eq!(back, x);
    }

    #[test]
    fn f16_round_trip_has_relative_error_at_most_two_to_the_minus_eleven() {
        let x = sample(1000, 2);
        let (t, back) = round_trip(&x, Encoding::F16);
        assert!(matches!(&t.values, Values::F16(b) if b.len() == 2000));
        for (a, b) in x.iter().zip(&back) {
            // f16's smallest normal is 2^-14; below it the error is absolute, not relative.
            if a.abs() >= 6.2e-5 {
                assert!(((a - b) / a).abs() <= 1.0 / 2048.0, "{a} -> {b}");
            }
        }
    }

    #[test]
    fn q8_round_trip_has_absolute_error_at_most_half_a_step() {
        let x = sample(1000, 3);
        let (t, back) = round_trip(&x, Encoding::Q8);
        let Values::Q8 { scale, data } = &t.values else {
            panic!("not q8")
        };
        assert_eq!(data.len(), 1000);
        let max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(*scale, max / 127.0);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= scale / 2.0 * (1.0 + 1e-5), "{a} -> {b}");
        }
    }

    #[test]
    fn q8_of_an_all_zero_tensor_has_zero_scale_and_decodes_to_zeros() {
        let (t, back) = round_trip(&[0.0; 5], Encoding::Q8);
        assert!(matches!(t.values, Values::Q8 { scale, .. } if scale == 0.0));
        assert_eq!(back, vec![0.0; 5]);
    }

    #[test]
    fn top_k_keeps_exactly_the_k_largest_magnitudes() {
        let x = sample(1000, 4);
        let (t, back) = round_trip(&x, Encoding::TopK { per_mille: 15 });
        let Values::Sparse { values, .. } = &t.values else {
            panic!("not sparse")
        };
        assert_eq!(values.len(), 15);
        let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        mags.sort_by(|a, b| b.total_cmp(a));
        let threshold = mags[14];
        let kept: Vec<usize> = (0..x.len()).filter(|&i| back[i] != 0.0).collect();
        assert_eq!(kept.len(), 15);
        for &i in &kept {
            assert_eq!(back[i], x[i]);
            assert!(x[i].abs() >= threshold);
        }
    }

    #[test]
    fn top_k_rounds_k_up_and_keeps_at_least_one() {
        let k = |len: usize, per_mille| {
            let t = encode(
                "w",
                &[len as u32],
                &sample(len, 5),
                Encoding::TopK { per_mille },
                None,
            );
            match t.values {
                Values::Sparse { values, .. } => values.len(),
                _ => unreachable!(),
            }
        };
        assert_eq!(k(10, 1), 1);
        assert_eq!(k(1001, 1), 2);
        assert_eq!(k(10, 1000), 10);
        assert_eq!(k(10, 0), 1);
        assert_eq!(k(10, 5000), 10);
        assert_eq!(k(0, 10), 0);
    }

    #[test]
    fn top_k_breaks_ties_by_the_lower_index() {
        let x = [1.0, -2.0, 2.0, 0.5, -2.0];
        let t = encode("w", &[5], &x, Encoding::TopK { per_mille: 400 }, None);
        assert_eq!(
            t.values,
            Values::Sparse {
                len: 5,
                gaps: vec![1, 1],
                values: vec![-2.0, 2.0]
            }
        );
    }

    #[test]
    fn top_k_residual_carries_what_was_not_sent_into_the_next_round() {
        let a = sample(500, 6);
        let b = sample(500, 7);
        let enc = Encoding::TopK { per_mille: 50 };
        let mut residual = Vec::new();
        let d1 = decode(&encode("w", &[500], &a, enc, Some(&mut residual))).unwrap();
        let d2 = decode(&encode("w", &[500], &b, enc, Some(&mut residual))).unwrap();
        assert_eq!(residual.len(), 500);
        for i in 0..500 {
            let sent = d1[i] + d2[i] + residual[i];
            assert!((sent - (a[i] + b[i])).abs() <= 1e-6, "index {i}");
            // Whatever was sent in the last round left nothing behind.
            if d2[i] != 0.0 {
                assert_eq!(residual[i], 0.0);
            }
        }
    }

    #[test]
    fn error_feedback_eventually_sends_a_value_never_in_the_top_k_on_its_own() {
        // Index 3 is always the smallest, so plain top-1 would never send it.
        let x = [1.0f32, -1.0, 1.0, 0.3];
        let enc = Encoding::TopK { per_mille: 250 };
        let plain = decode(&encode("w", &[4], &x, enc, None)).unwrap();
        assert_eq!(plain[3], 0.0);
        let mut residual = Vec::new();
        let mut total = [0.0f32; 4];
        let mut first_sent = None;
        for round in 0..20 {
            let d = decode(&encode("w", &[4], &x, enc, Some(&mut residual))).unwrap();
            for (t, v) in total.iter_mut().zip(&d) {
                *t += v;
            }
            if d[3] != 0.0 && first_sent.is_none() {
                first_sent = Some(round);
            }
        }
        assert!(first_sent.is_some(), "index 3 was never sent");
        // Over many rounds every coordinate gets through at its own rate.
        for i in 0..4 {
            assert!((total[i] + residual[i] - 20.0 * x[i]).abs() <= 1e-4);
        }
    }

    #[test]
    fn every_encoding_keeps_its_rounding_error_as_the_residual() {
        let x = sample(300, 8);
        for enc in [
            Encoding::F32,
            Encoding::F16,
            Encoding::Q8,
            Encoding::Ternary { block: 64 },
        ] {
            let mut residual = vec![0.0; 10]; // wrong length: replaced
            let d = decode(&encode("w", &[300], &x, enc, Some(&mut residual))).unwrap();
            // Exact f32 leaves nothing behind: an empty residual (all zeros, no memory).
            let want = if enc == Encoding::F32 { 0 } else { 300 };
            assert_eq!(residual.len(), want, "{enc:?}");
            for i in 0..300 {
                let r = residual.get(i).copied().unwrap_or(0.0);
                // Bit for bit: the residual is the input less exactly what the receiver decodes.
                assert_eq!(r, x[i] - d[i], "{enc:?} index {i}");
            }
        }
    }

    #[test]
    fn encoding_in_the_values_own_buffer_equals_encoding_with_a_residual() {
        let (x, old) = (sample(600, 2), sample(600, 5));
        for (enc, shape) in [
            (Encoding::F32, [600, 1]),
            (Encoding::Q8, [600, 1]),
            (Encoding::TopKQ8 { per_mille: 100 }, [20, 30]),
            (TERNARY_Q8, [20, 30]),
            (TERNARY_Q8, [600, 1]),
        ] {
            let shape = &shape[..1 + usize::from(shape[1] != 1)];
            let mut r = old.clone();
            let want = encode("w", shape, &x, enc, Some(&mut r));
            // The caller sums the values and the residual itself, in the values' buffer.
            let mut own: Vec<f32> = x.iter().zip(&old).map(|(v, r)| v + r).collect();
            let got = encode_leaving_error("w", shape, &mut own, enc);
            assert_eq!(got, want, "{enc:?} {shape:?}");
            assert_eq!(own, r, "{enc:?} {shape:?}");
            // A site keeps this buffer as its residual until the next round: an exact encoding
            // leaves nothing behind, not even the buffer's memory.
            assert_eq!(own.capacity() == 0, enc.is_exact(), "{enc:?} {shape:?}");
        }
    }

    #[test]
    fn ternaryq8_sends_matrices_in_ternary_and_every_other_tensor_in_q8() {
        let x = sample(600, 4);
        for (shape, ternary) in [
            (vec![20u32, 30], true),
            (vec![6, 4, 5, 5], false),
            (vec![600], false),
        ] {
            let mut residual = Vec::new();
            let t = encode("w", &shape, &x, TERNARY_Q8, Some(&mut residual));
            assert_eq!(
                matches!(t.values, Values::Ternary { .. }),
                ternary,
                "{shape:?}"
            );
            assert_eq!(matches!(t.values, Values::Q8 { .. }), !ternary, "{shape:?}");
            assert!(TERNARY_Q8.holds(&t), "{shape:?}");
            let plain = if ternary { TERNARY } else { Encoding::Q8 };
            assert!(plain.holds(&t));
            // The same values as the plain encoding, and the same error fed back.
            assert_eq!(t.values, encode("w", &shape, &x, plain, None).values);
            let d = decode(&t).unwrap();
            for i in 0..600 {
                assert!((d[i] + residual[i] - x[i]).abs() <= 1e-6, "{shape:?} {i}");
            }
            // The wrong kind for the shape is not what the encoding sends.
            let mut other = t.clone();
            other.shape = if ternary { vec![600] } else { vec![20, 30] };
            assert!(!TERNARY_Q8.holds(&other), "{shape:?}");
        }
        assert_eq!("ternaryq8".parse(), Ok(TERNARY_Q8));
        assert_eq!(TERNARY_Q8.to_string(), "ternaryq8");
    }

    #[test]
    fn encoding_nan_and_infinity_does_not_panic() {
        let x = [f32::NAN, 1.0, f32::INFINITY, -f32::NAN, 0.0];
        for enc in [
            Encoding::F32,
            Encoding::F16,
            Encoding::Q8,
            Encoding::TopK { per_mille: 400 },
        ] {
            let mut residual = vec![f32::NAN; 5];
            let t = encode("w", &[5], &x, enc, Some(&mut residual));
            assert_eq!(decode(&t).map(|v| v.len()), Ok(5));
            assert!(residual.iter().all(|r| r.is_finite()), "{enc:?}");
        }
    }

    #[test]
    fn q8_of_a_tensor_holding_nan_or_infinity_decodes_as_non_finite_not_as_zero() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let t = encode("w", &[3], &[0.5, bad, -1.0], Encoding::Q8, None);
            let back = decode(&t).unwrap();
            assert!(back.iter().all(|v| v.is_nan()), "{bad}: {back:?}");
        }
        let back = decode(&encode("w", &[2], &[0.5, -1.0], Encoding::Q8, None)).unwrap();
        assert!(back.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn decode_rejects_lengths_that_disagree_with_the_shape() {
        let mut t = encode("w", &[2, 3], &[1.0; 6], Encoding::F32, None);
        t.shape = vec![7];
        assert_eq!(
            decode(&t),
            Err(TensorError::WrongLength {
                name: "w".into(),
                expected: 7,
                found: 6
            })
        );
        t.values = Values::F32(vec![0; 29]);
        assert!(matches!(
            decode(&t),
            Err(TensorError::WrongLength { found: 8, .. })
        ));
        t.values = Values::Q8 {
            scale: 1.0,
            data: vec![0; 3],
        };
        assert!(matches!(
            decode(&t),
            Err(TensorError::WrongLength { found: 3, .. })
        ));
    }

    #[test]
    fn decode_rejects_an_overflowing_shape() {
        let mut t = encode("w", &[1], &[1.0], Encoding::F16, None);
        t.shape = vec![u32::MAX; 3];
        assert_eq!(decode(&t), Err(TensorError::ShapeOverflow("w".into())));
        assert_eq!(t.numel(), None);
    }

    #[test]
    fn decode_rejects_bad_sparse_indices() {
        let sparse = |len, gaps: Vec<u32>| EncodedTensor::<Vec<u8>> {
            name: "s".into(),
            shape: vec![len],
            values: Values::Sparse {
                len,
                values: vec![1.0; gaps.len()],
                gaps,
            },
        };
        assert_eq!(
            decode(&sparse(4, vec![0, 1, 2])),
            Ok(vec![1.0, 1.0, 0.0, 1.0])
        );
        assert_eq!(decode(&sparse(4, vec![])), Ok(vec![0.0; 4]));
        let bad = Err(TensorError::BadIndices("s".into()));
        assert_eq!(decode(&sparse(4, vec![4])), bad, "out of range");
        assert_eq!(decode(&sparse(4, vec![1, 0])), bad, "repeated index");
        assert_eq!(decode(&sparse(4, vec![1, 1, 2])), bad, "runs past the end");
        assert_eq!(decode(&sparse(4, vec![0, u32::MAX])), bad, "gap overflows");
        assert_eq!(
            decode(&sparse(2, vec![0, 1, 1])),
            bad,
            "more indices than len"
        );
        let mut t = sparse(4, vec![0]);
        t.shape = vec![5];
        assert!(matches!(
            decode(&t),
            Err(TensorError::WrongLength {
                expected: 5,
                found: 4,
                ..
            })
        ));
        let mut t = sparse(4, vec![0, 1]);
        if let Values::Sparse { values, .. } = &mut t.values {
            values.pop();
        }
        assert!(matches!(
            decode(&t),
            Err(TensorError::WrongLength {
                expected: 2,
                found: 1,
                ..
            })
        ));
    }

    #[test]
    fn numel_of_an_empty_shape_is_one() {
        let t = encode("scalar", &[], &[3.0], Encoding::F32, None);
        assert_eq!(t.numel(), Some(1));
        assert_eq!(decode(&t), Ok(vec![3.0]));
    }

    #[test]
    fn validate_accepts_only_per_mille_between_one_and_a_thousand() {
        assert!(Encoding::F16.validate().is_ok());
        assert!(Encoding::TopK { per_mille: 1 }.validate().is_ok());
        assert!(Encoding::TopK { per_mille: 1000 }.validate().is_ok());
        assert!(Encoding::TopK { per_mille: 0 }.validate().is_err());
        assert!(Encoding::TopK { per_mille: 1001 }.validate().is_err());
        assert!(Encoding::Ternary { block: 16 }.validate().is_ok());
        assert!(Encoding::TernaryQ8 { block: 4096 }.validate().is_ok());
        assert!(Encoding::Ternary { block: 15 }.validate().is_err());
        assert!(Encoding::TernaryQ8 { block: 4097 }.validate().is_err());
    }

    /// `sum (x - decoded)^2` of `x` in ternary with one scale for the whole of `x`.
    fn ternary_error(x: &[f32], scale: f32) -> f64 {
        x.iter()
            .map(|&v| {
                let d = if v >= scale / 2.0 {
                    scale
                } else if v <= -scale / 2.0 {
                    -scale
                } else {
                    0.0
                };
                f64::from(v - d).powi(2)
            })
            .sum()
    }

    #[test]
    fn the_ternary_scale_minimises_the_blocks_squared_error() {
        for seed in 0..20 {
            // Heavy-tailed blocks (several orders of magnitude) and plain uniform ones.
            let x: Vec<f32> = if seed % 2 == 0 {
                sample(64, seed)
            } else {
                sample(64, seed)
                    .iter()
                    .map(|v| v.signum() * v.abs().sqrt())
                    .collect()
            };
            let t = encode("w", &[64], &x, Encoding::Ternary { block: 64 }, None);
            let Values::Ternary { scales, .. } = &t.values else {
                panic!("{t:?}")
            };
            let ours = half::f16::from_le_bytes([scales[0], scales[1]]).to_f32();
            // No other scale does better, up to the f16 rounding of ours: every candidate is
            // the mean of some number of largest magnitudes, and a fine grid besides.
            let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            mags.sort_by(|a, b| b.total_cmp(a));
            let mut candidates: Vec<f32> = (1..=64)
                .map(|m| mags[..m].iter().sum::<f32>() / m as f32)
                .collect();
            candidates.extend((1..=2000).map(|i| mags[0] * i as f32 / 1000.0));
            let best = candidates
                .iter()
                .map(|&s| ternary_error(&x, s))
                .fold(f64::INFINITY, f64::min);
            let error = ternary_error(&x, ours);
            assert!(
                error <= best * (1.0 + 2e-3) + 1e-12,
                "seed {seed}: {error} > {best}"
            );
            // And the decoded block is exactly that rounding.
            let back = decode(&t).unwrap();
            let direct: f64 = x
                .iter()
                .zip(&back)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            assert!(
                (direct - error).abs() <= 1e-9 * error.max(1.0),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn a_bad_encoding_name_is_refused_with_what_is_wrong() {
        let parse = |s: &str| s.parse::<Encoding>().unwrap_err();
        assert!(matches!(parse("f64"), EncodingParseError::Unknown(n) if n == "f64"));
        assert!(matches!(parse("topkx"), EncodingParseError::BadPerMille(_)));
        assert!(matches!(
            parse("topkq8"),
            EncodingParseError::BadPerMille(_)
        ));
        assert!(matches!(
            parse("ternaryq8x64"),
            EncodingParseError::BadBlock(_)
        ));
        assert!(matches!(
            parse("topk1001"),
            EncodingParseError::OutOfRange { ref name, .. } if name == "topk1001"
        ));
        assert!(matches!(
            parse("ternaryb8"),
            EncodingParseError::OutOfRange { .. }
        ));
        assert_eq!(
            String::from(parse("topk0")),
            "top-k per_mille must be between 1 and 1000"
        );
        assert!(
            parse("f64")
                .to_string()
                .starts_with("unknown encoding `f64`: f32, f16")
        );
    }

    #[test]
    fn a_ternary_block_size_sets_the_scales_and_is_part_of_the_encoding() {
        let x = sample(1000, 5);
        let small = Encoding::TernaryQ8 { block: 64 };
        assert_eq!("ternaryq8b64".parse(), Ok(small));
        assert_eq!(small.to_string(), "ternaryq8b64");
        assert_eq!("ternaryb100".parse(), Ok(Encoding::Ternary { block: 100 }));
        assert_eq!(
            "ternary".parse::<Encoding>().unwrap().to_string(),
            "ternary"
        );
        for bad in ["ternaryq8b", "ternaryq8x64", "ternaryb8", "ternaryq8b5000"] {
            assert!(bad.parse::<Encoding>().is_err(), "{bad}");
        }
        let t = encode("w", &[10, 100], &x, small, None);
        let Values::Ternary { block, scales, .. } = &t.values else {
            panic!("{t:?}")
        };
        assert_eq!((*block, scales.len()), (64, 2 * 16));
        assert!(small.holds(&t));
        // Blocks of another size are not what this federation sends.
        assert!(!TERNARY_Q8.holds(&t));
        assert!(!Encoding::Ternary { block: 64 }.holds(&encode("w", &[1000], &x, TERNARY, None)));
        // Smaller blocks fit the values more closely.
        let error = |enc| {
            let t = encode("w", &[10, 100], &x, enc, None);
            let d = decode(&t).unwrap();
            x.iter()
                .zip(d)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>()
        };
        assert!(error(small) < error(TERNARY_Q8));
    }
}
