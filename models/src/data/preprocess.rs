//! The model spec's preprocessing of one image.

use crate::error::DataError;
use image::{DynamicImage, imageops::FilterType};
use std::path::Path;
use unifed_protocol::{Input, Scaling};

/// Turns a decoded image into the model's input row (CHW, scaled): resized to the spec's size
/// (bilinear), grey repeated to 3 channels for a colour model, alpha dropped. A colour image
/// for a grey model is an error rather than a silent conversion.
pub fn preprocess(img: &DynamicImage, input: &Input, path: &Path) -> Result<Vec<f32>, DataError> {
    let Input::Image {
        channels,
        height,
        width,
        scaling,
    } = *input
    else {
        return Err(DataError::NotAnImageModel);
    };
    if img.width() == 0 || img.height() == 0 {
        return Err(DataError::CorruptImage {
            path: path.into(),
            message: "image has no pixels".into(),
        });
    }
    let colour = img.color();
    let img_channels = if colour.has_color() { 3 } else { 1 };
    if channels == 1 && img_channels == 3 {
        return Err(DataError::WrongChannels {
            path: path.into(),
            expected: 1,
            found: 3,
        });
    }
    if channels != 1 && channels != 3 {
        return Err(DataError::WrongChannels {
            path: path.into(),
            expected: channels,
            found: img_channels,
        });
    }
    let resized = if img.width() != width || img.height() != height {
        img.resize_exact(width, height, FilterType::Triangle)
    } else {
        img.clone()
    };
    let scale = |v: u8| match scaling {
        Scaling::MinusOneToOne => v as f32 / 127.5 - 1.0,
        Scaling::ZeroToOne => v as f32 / 255.0,
    };
    let plane = (width * height) as usize;
    let mut out = vec![0.0f32; plane * channels as usize];
    if img_channels == 1 {
        let g = resized.to_luma8();
        for (i, p) in g.pixels().enumerate() {
            for c in 0..channels as usize {
                out[c * plane + i] = scale(p.0[0]);
            }
        }
    } else {
        let rgb = resized.to_rgb8();
        for (i, p) in rgb.pixels().enumerate() {
            for c in 0..3 {
                out[c * plane + i] = scale(p.0[c]);
            }
        }
    }
    Ok(out)
}
