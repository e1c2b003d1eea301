//! MNIST IDX files, optionally gzipped.

use super::BaseDigits;
use crate::error::DataError;
use std::io::Read;
use std::path::Path;

/// Reads an IDX file of unsigned bytes (gzipped or not): returns its dimensions and values.
pub fn read_idx(path: &Path) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let raw = std::fs::read(path).map_err(|e| DataError::Io {
        path: path.into(),
        message: e.to_string(),
    })?;
    parse_idx(&raw, path)
}

pub(crate) fn parse_idx(raw: &[u8], path: &Path) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let bad = |m: String| DataError::BadIdx {
        path: path.into(),
        message: m,
    };
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(raw)
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gzip: {e}")))?;
        out
    } else {
        raw.to_vec()
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad("missing IDX magic (00 00 type ndim)".into()));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "element type 0x{:02x} is not unsigned byte (0x08)",
            bytes[2]
        )));
    }
    let ndim = bytes[3] as usize;
    if ndim == 0 || bytes.len() < 4 + 4 * ndim {
        return Err(bad("truncated header".into()));
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| {
            u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes")) as usize
        })
        .collect();
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("dimensions overflow".into()))?;
    let body = &bytes[4 + 4 * ndim..];
    if body.len() != n {
        return Err(bad(format!(
            "header promises {n} values ({dims:?}), file holds {}",
            body.len()
        )));
    }
    Ok((dims, body.to_vec()))
}

/// Reads an images IDX file (`[n, h, w]`) and a labels IDX file (`[n]`, values 0-9) as digits.
pub fn read_idx_digits(images: &Path, labels: &Path) -> Result<BaseDigits, DataError> {
    let (di, pix) = read_idx(images)?;
    let (dl, lab) = read_idx(labels)?;
    BaseDigits::from_idx(di, pix, dl, lab, images)
}
