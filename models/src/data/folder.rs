//! Labelled image folders (`train/`, `val/`, `test/`, each `label/file`), CSV manifests and flat
//! folders of unlabelled images.

use super::{Dataset, preprocess};
use crate::error::DataError;
use std::path::{Path, PathBuf};
use unifed_protocol::ModelSpec;

const IMAGE_EXT: [&str; 4] = ["png", "jpg", "jpeg", "dcm"];

fn is_dicom(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("dcm"))
}

fn is_image(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXT.contains(&e.to_ascii_lowercase().as_str()))
}

fn io_err(path: &Path, e: std::io::Error) -> DataError {
    DataError::Io {
        path: path.into(),
        message: e.to_string(),
    }
}

pub(crate) fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !dir.is_dir() {
        return Err(DataError::MissingFolder(dir.into()));
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io_err(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| io_err(dir, e)))
        .collect::<Result<_, _>>()?;
    v.sort();
    Ok(v)
}

/// The model input rows of the image file at `path`: one for a PNG or JPEG, one per frame for
/// DICOM.
fn load_image(path: &Path, spec: &ModelSpec) -> Result<Vec<Vec<f32>>, DataError> {
    if is_dicom(path) {
        return super::dicom::load_dicom(path, spec);
    }
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let img = image::load_from_memory(&bytes).map_err(|e| DataError::CorruptImage {
        path: path.into(),
        message: e.to_string(),
    })?;
    Ok(vec![preprocess(&img, &spec.input, path)?])
}

/// The labels of DICOM files by SOP Instance UID, from `<root>/labels.csv` (header
/// `sop_instance_uid,label`), if there is one.
fn uid_labels(root: &Path) -> Result<Option<std::collections::HashMap<String, String>>, DataError> {
    let path = root.join("labels.csv");
    if !path.is_file() {
        return Ok(None);
    }
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(&path)
        .map_err(|e| io_err(&path, std::io::Error::other(e)))?;
    let bad = |line: usize, message: String| DataError::BadManifest {
        path: path.clone(),
        line,
        message,
    };
    let headers = rdr.headers().map_err(|e| bad(1, e.to_string()))?.clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| {
                bad(
                    1,
                    format!("missing column `{name}` (expected sop_instance_uid,label)"),
                )
            })
    };
    let (cu, cl) = (col("sop_instance_uid")?, col("label")?);
    let mut out = std::collections::HashMap::new();
    for (i, rec) in rdr.records().enumerate() {
        let rec = rec.map_err(|e| bad(i + 2, e.to_string()))?;
        let get = |c: usize| rec.get(c).map(str::trim).unwrap_or_default().to_string();
        out.insert(get(cu), get(cl));
    }
    Ok(Some(out))
}

/// The SOP Instance UID of the DICOM file at `path`, read without its pixel data.
fn dicom_uid(path: &Path) -> Result<String, DataError> {
    let obj = dicom_object::OpenFileOptions::new()
        .read_until(dicom_dictionary_std::tags::PIXEL_DATA)
        .open_file(path)
        .map_err(|e| DataError::CorruptImage {
            path: path.into(),
            message: e.to_string(),
        })?;
    Ok(obj
        .element(dicom_dictionary_std::tags::SOP_INSTANCE_UID)
        .ok()
        .and_then(|e| e.to_str().ok())
        .map(|s| s.trim_end_matches(['\0', ' ']).to_string())
        .unwrap_or_default())
}

/// The most images of one split or folder a load skips as unusable before it fails: one in
/// twenty, and at least one. A stray damaged file costs its image; a folder of them (or of
/// colour images for a greyscale model) is a mistake to report, not to train around.
pub fn skip_limit(images: usize) -> usize {
    (images / 20).max(1)
}

/// Decodes `files` of `folder` in order into model input rows, with the index of the file each
/// row came from (a multi-frame DICOM file gives a row per frame). A file that cannot be read, decoded or given the model's channels is skipped
/// with a warning naming it; more than [`skip_limit`] of them, or all of them, fail the load.
fn load_images(
    folder: &str,
    files: &[&Path],
    spec: &ModelSpec,
) -> Result<(Vec<f32>, Vec<usize>), DataError> {
    let mut x = Vec::with_capacity(files.len() * spec.input.numel());
    let mut kept = Vec::with_capacity(files.len());
    let mut skipped = Vec::new();
    for (i, f) in files.iter().enumerate() {
        match load_image(f, spec) {
            Ok(rows) => {
                for row in rows {
                    x.extend(row);
                    kept.push(i);
                }
            }
            Err(
                e @ (DataError::Io { .. }
                | DataError::CorruptImage { .. }
                | DataError::WrongChannels { .. }),
            ) => {
                tracing::warn!("skipping an image: {e}");
                skipped.push(e);
            }
            Err(e) => return Err(e),
        }
    }
    let limit = skip_limit(files.len());
    if skipped.len() > limit || (kept.is_empty() && !skipped.is_empty()) {
        return Err(DataError::TooManyUnreadable {
            folder: folder.into(),
            skipped: skipped.len(),
            total: files.len(),
            limit,
            first: Box::new(skipped.swap_remove(0)),
        });
    }
    if !skipped.is_empty() {
        tracing::warn!(
            "{folder}: {} of {} images skipped as unusable",
            skipped.len(),
            files.len()
        );
    }
    Ok((x, kept))
}

fn class_of(label: &str, path: &Path, spec: &ModelSpec) -> Result<usize, DataError> {
    spec.class_index(label)
        .ok_or_else(|| DataError::UnknownLabel {
            label: label.into(),
            path: path.into(),
            classes: spec.classes.join(", "),
        })
}

/// Loads `root/<split>/<label>/<image>` (PNG/JPEG, files in sorted order) for `spec`. If
/// `root/manifest.csv` exists it is used instead (see [`load_labelled`]).
pub fn load_split(root: &Path, split: &str, spec: &ModelSpec) -> Result<Dataset, DataError> {
    let manifest = root.join("manifest.csv");
    let items = if manifest.is_file() {
        read_manifest(&manifest, Some(split))?
    } else {
        let dir = root.join(split);
        let mut items = Vec::new();
        let by_uid = uid_labels(root)?;
        for label_dir in sorted_entries(&dir)? {
            // DICOM files directly in the split folder are labelled by their SOP Instance UID.
            if let Some(labels) = by_uid.as_ref().filter(|_| is_dicom(&label_dir)) {
                let uid = dicom_uid(&label_dir)?;
                let label = labels.get(&uid).ok_or_else(|| DataError::UnknownLabel {
                    label: format!("(none for SOP Instance UID {uid} in labels.csv)"),
                    path: label_dir.clone(),
                    classes: spec.classes.join(", "),
                })?;
                items.push((label_dir.clone(), label.clone()));
                continue;
            }
            if !label_dir.is_dir() {
                continue;
            }
            let label = label_dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            for file in sorted_entries(&label_dir)? {
                if is_image(&file) {
                    items.push((file, label.clone()));
                }
            }
        }
        items
    };
    let name = format!("{}/{split}", root.display());
    if items.is_empty() {
        return Err(DataError::Empty(name));
    }
    let labels = items
        .iter()
        .map(|(path, label)| class_of(label, path, spec))
        .collect::<Result<Vec<_>, _>>()?;
    let paths: Vec<&Path> = items.iter().map(|(p, _)| p.as_path()).collect();
    let (x, kept) = load_images(&name, &paths, spec)?;
    let y = kept.into_iter().map(|i| labels[i]).collect();
    Ok(Dataset {
        name,
        features: spec.input.numel(),
        x,
        y,
    })
}

/// Loads the `train`, `val` and `test` splits of a labelled dataset folder; `val` may be absent
/// (an empty dataset is returned for it).
pub fn load_labelled(root: &Path, spec: &ModelSpec) -> Result<[Dataset; 3], DataError> {
    if !root.is_dir() {
        return Err(DataError::MissingFolder(root.into()));
    }
    let train = load_split(root, "train", spec)?;
    let val = match load_split(root, "val", spec) {
        Ok(v) => v,
        Err(DataError::MissingFolder(_)) | Err(DataError::Empty(_)) => Dataset {
            name: format!("{}/val", root.display()),
            features: spec.input.numel(),
            x: vec![],
            y: vec![],
        },
        Err(e) => return Err(e),
    };
    let test = load_split(root, "test", spec)?;
    Ok([train, val, test])
}

/// Reads a CSV manifest with header `split,label,path` (paths relative to the manifest's
/// folder); keeps the rows of `split` when given.
fn read_manifest(path: &Path, split: Option<&str>) -> Result<Vec<(PathBuf, String)>, DataError> {
    let base = path.parent().unwrap_or(Path::new("."));
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .map_err(|e| DataError::Io {
            path: path.into(),
            message: e.to_string(),
        })?;
    let headers = rdr
        .headers()
        .map_err(|e| DataError::BadManifest {
            path: path.into(),
            line: 1,
            message: e.to_string(),
        })?
        .clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| DataError::BadManifest {
                path: path.into(),
                line: 1,
                message: format!("missing column `{name}` (expected header split,label,path)"),
            })
    };
    let (cs, cl, cp) = (col("split")?, col("label")?, col("path")?);
    let mut out = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        let line = i + 2;
        let rec = rec.map_err(|e| DataError::BadManifest {
            path: path.into(),
            line,
            message: e.to_string(),
        })?;
        let get = |c: usize| rec.get(c).map(str::trim).unwrap_or_default();
        if get(cp).is_empty() || get(cl).is_empty() {
            return Err(DataError::BadManifest {
                path: path.into(),
                line,
                message: "empty label or path".into(),
            });
        }
        if split.is_none_or(|s| s == get(cs)) {
            out.push((base.join(get(cp)), get(cl).to_string()));
        }
    }
    Ok(out)
}

/// Loads a flat folder of unlabelled images (sorted by file name) as model input rows.
pub fn load_unlabelled(dir: &Path, spec: &ModelSpec) -> Result<Vec<f32>, DataError> {
    Ok(load_unlabelled_named(dir, spec)?.1)
}

/// Like [`load_unlabelled`], with the image files in row order.
pub fn load_unlabelled_named(
    dir: &Path,
    spec: &ModelSpec,
) -> Result<(Vec<PathBuf>, Vec<f32>), DataError> {
    let files: Vec<PathBuf> = sorted_entries(dir)?
        .into_iter()
        .filter(|p| is_image(p))
        .collect();
    if files.is_empty() {
        return Err(DataError::Empty(dir.display().to_string()));
    }
    let paths: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (x, kept) = load_images(&dir.display().to_string(), &paths, spec)?;
    let files = kept.into_iter().map(|i| files[i].clone()).collect();
    Ok((files, x))
}
