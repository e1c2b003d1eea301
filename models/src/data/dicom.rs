//! DICOM input (dicom-rs): an imaging device's files read as a model's input, without an export
//! to PNG first. A file's frames are decoded (native, RLE and JPEG transfer syntaxes: pure Rust,
//! no C libraries), the modality LUT applied (rescale slope and intercept: Hounsfield units for
//! CT), the file's first window applied by DICOM's linear VOI function (the frame's min-max
//! without one), MONOCHROME1 inverted so that bright means high everywhere, and each frame then
//! resized to the model's input like any greyscale image. Colour DICOM is refused.

use crate::error::DataError;
use dicom_pixeldata::PixelDecoder;
use std::path::Path;

/// A DICOM file's frames after the modality LUT, with what the model's view of them needs.
#[derive(Debug, Clone)]
pub struct DicomFrames {
    /// Rows of each frame.
    pub rows: u32,
    /// Columns of each frame.
    pub columns: u32,
    /// The photometric interpretation (`MONOCHROME1` or `MONOCHROME2`).
    pub photometric: String,
    /// The file's first window, center and width, if it has one.
    pub window: Option<(f64, f64)>,
    /// SOP Instance UID: the file's identity, by which a label CSV names it.
    pub sop_instance_uid: String,
    /// Per frame, row-major, the values after the modality LUT.
    pub modality: Vec<Vec<f32>>,
}

fn corrupt(path: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::CorruptImage {
        path: path.into(),
        message: message.to_string(),
    }
}

/// Reads and decodes the DICOM file at `path`.
pub fn read_dicom(path: &Path) -> Result<DicomFrames, DataError> {
    let obj = dicom_object::open_file(path).map_err(|e| corrupt(path, e))?;
    let sop_instance_uid = obj
        .element(dicom_dictionary_std::tags::SOP_INSTANCE_UID)
        .ok()
        .and_then(|e| e.to_str().ok())
        .map(|s| s.trim_end_matches(['\0', ' ']).to_string())
        .unwrap_or_default();
    let pixels = obj.decode_pixel_data().map_err(|e| corrupt(path, e))?;
    if pixels.samples_per_pixel() != 1 {
        return Err(DataError::WrongChannels {
            path: path.into(),
            expected: 1,
            found: u32::from(pixels.samples_per_pixel()),
        });
    }
    let window = pixels
        .window()
        .ok()
        .flatten()
        .and_then(|w| w.first())
        .map(|w| (w.center, w.width));
    let modality = (0..pixels.number_of_frames())
        .map(|f| pixels.to_vec_frame::<f32>(f))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| corrupt(path, e))?;
    Ok(DicomFrames {
        rows: pixels.rows(),
        columns: pixels.columns(),
        photometric: pixels.photometric_interpretation().as_str().to_string(),
        window,
        sop_instance_uid,
        modality,
    })
}

/// DICOM's linear VOI function (PS3.3 C.11.2.1.2.1) to [0, 1] for `window` (center, width):
/// at or below the window's bottom 0, above its top 1, linear between; without a window, the
/// values' min-max (all 0 when they are equal).
pub fn voi_linear(values: &[f32], window: Option<(f64, f64)>) -> Vec<f32> {
    match window {
        Some((c, w)) if w <= 1.0 => values
            .iter()
            .map(|&v| if f64::from(v) > c - 0.5 { 1.0 } else { 0.0 })
            .collect(),
        Some((c, w)) => values
            .iter()
            .map(|&v| (((f64::from(v) - (c - 0.5)) / (w - 1.0) + 0.5).clamp(0.0, 1.0)) as f32)
            .collect(),
        None => {
            let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let span = f64::from(hi) - f64::from(lo);
            values
                .iter()
                .map(|&v| {
                    if span > 0.0 {
                        ((f64::from(v) - f64::from(lo)) / span) as f32
                    } else {
                        0.0
                    }
                })
                .collect()
        }
    }
}

impl DicomFrames {
    /// The frames as a model sees them before resizing: windowed to [0, 1]
    /// ([`voi_linear`]), MONOCHROME1 inverted.
    pub fn windowed(&self) -> Vec<Vec<f32>> {
        let invert = self.photometric == "MONOCHROME1";
        self.modality
            .iter()
            .map(|f| {
                let mut w = voi_linear(f, self.window);
                if invert {
                    w.iter_mut().for_each(|v| *v = 1.0 - *v);
                }
                w
            })
            .collect()
    }
}

/// Each frame of the DICOM file at `path` as a model input row for `spec` (windowed, then
/// resized and scaled as a 16-bit greyscale image).
pub(crate) fn load_dicom(
    path: &Path,
    spec: &unifed_protocol::ModelSpec,
) -> Result<Vec<Vec<f32>>, DataError> {
    let d = read_dicom(path)?;
    d.windowed()
        .into_iter()
        .map(|frame| {
            let grey: Vec<u16> = frame.iter().map(|v| (v * 65535.0).round() as u16).collect();
            let img = image::ImageBuffer::<image::Luma<u16>, _>::from_raw(d.columns, d.rows, grey)
                .ok_or_else(|| corrupt(path, "its frame is not rows x columns values"))?;
            super::preprocess(&image::DynamicImage::ImageLuma16(img), &spec.input, path)
        })
        .collect()
}
