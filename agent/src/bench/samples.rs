//! The samples the benchmark trains and infers on, and their file for the PyTorch reference.
//!
//! Real images: kernels whose work depends on the data (a max pool's choices, which branch
//! where the data are uneven) run as they do in a federation, not as they do on noise. burn's
//! side and PyTorch's see the same bytes.

use anyhow::{Context, Result};
use std::path::Path;
use unifed_models::backend::Device;
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, seeded, spec_of};

/// The built-in domains the samples come from, in turn: the demo federation's five sites.
pub const DOMAINS: [Domain; 5] = [
    Domain::Grey,
    Domain::Texture,
    Domain::Noisy,
    Domain::Lowres,
    Domain::Fonts,
];

/// Values per sample: [3, 28, 28].
pub const SAMPLE_LEN: usize = 3 * 28 * 28;

/// `n` samples of the digits CNN's input and their labels, and what they are.
pub struct Samples {
    /// `n` samples of [`SAMPLE_LEN`] values, row-major.
    pub x: Vec<f32>,
    /// Labels 0..9.
    pub y: Vec<i64>,
    /// What the samples are, for the result file.
    pub what: String,
}

impl Samples {
    /// The first images of each of [`DOMAINS`]' blocks, taken from the domains in turn and
    /// preprocessed as a site's training is; N(0, 1) noise where the built-in images cannot be
    /// loaded (a binary copied without the repository's `assets/`), saying why.
    pub fn new(n: usize, device: &Device) -> Samples {
        match images(n, device) {
            Ok((x, y)) => Samples {
                x,
                y,
                what: format!(
                    "built-in images: the first of the {} domains, in turn",
                    DOMAINS.map(Domain::name).join(", ")
                ),
            },
            Err(e) => {
                let (x, y) = noise(n);
                Samples {
                    x,
                    y,
                    what: format!("N(0, 1) noise (no built-in images: {e:#})"),
                }
            }
        }
    }

    /// The first `n` samples and labels.
    pub fn first(&self, n: usize) -> (&[f32], &[i64]) {
        (&self.x[..n * SAMPLE_LEN], &self.y[..n])
    }

    /// Writes the samples for `scripts/torch_bench.py --inputs`: the count (u32), the values
    /// (f32) and the labels (i64), little-endian.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut b = Vec::with_capacity(4 + self.x.len() * 4 + self.y.len() * 8);
        b.extend_from_slice(&(self.y.len() as u32).to_le_bytes());
        b.extend(self.x.iter().flat_map(|v| v.to_le_bytes()));
        b.extend(self.y.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(path, b).with_context(|| format!("writing {}", path.display()))
    }
}

/// `n` built-in images and labels, from [`DOMAINS`] in turn.
fn images(n: usize, device: &Device) -> Result<(Vec<f32>, Vec<i64>)> {
    let data = BuiltinData::load().context("loading the built-in digits and assets")?;
    let cfg = ModelConfig::fedbn_digits();
    let net = seeded(device, 0, |d| DigitsCnnConfig::default().init(d));
    let spec = spec_of(&net, &cfg.classes, &cfg.input);
    let per = n.div_ceil(DOMAINS.len());
    let sizes = SplitSizes {
        train: per,
        val: 0,
        test: 0,
        unseen_test: 0,
    };
    let mut sets = Vec::new();
    for d in DOMAINS {
        let set = data.domain(d, &sizes, 0)?.train.dataset(d.name(), &spec)?;
        anyhow::ensure!(
            set.features == SAMPLE_LEN,
            "{} has {} values a sample",
            set.name,
            set.features
        );
        sets.push(set);
    }
    let (mut x, mut y) = (Vec::with_capacity(n * SAMPLE_LEN), Vec::with_capacity(n));
    for i in 0..n {
        let set = &sets[i % DOMAINS.len()];
        let k = i / DOMAINS.len();
        x.extend_from_slice(&set.x[k * SAMPLE_LEN..(k + 1) * SAMPLE_LEN]);
        y.push(set.y[k] as i64);
    }
    Ok((x, y))
}

/// `n` samples of N(0, 1) noise (Box-Muller from a fixed LCG) and labels 0..9.
fn noise(n: usize) -> (Vec<f32>, Vec<i64>) {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state
    };
    let x: Vec<f32> = (0..n * SAMPLE_LEN)
        .map(|_| {
            let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    let y: Vec<i64> = (0..n).map(|_| (next() >> 33) as i64 % 10).collect();
    (x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_samples_are_built_in_images_from_each_domain_in_turn() {
        let device = unifed_models::backend::Backend::Flex.device().unwrap();
        let s = Samples::new(7, &device);
        assert!(s.what.starts_with("built-in images"), "{}", s.what);
        assert_eq!((s.x.len(), s.y.len()), (7 * SAMPLE_LEN, 7));
        // Preprocessed into [-1, 1] (a third of N(0, 1) noise would fall outside).
        assert!(s.x.iter().all(|v| (-1.0..=1.0).contains(v)));
        assert!(s.y.iter().all(|l| (0..10).contains(l)));
        let (x, y) = s.first(2);
        assert_eq!((x.len(), y.len()), (2 * SAMPLE_LEN, 2));
        // The same bytes every time (burn's side and PyTorch's are made apart).
        let again = Samples::new(7, &device);
        assert_eq!((again.x, again.y), (s.x.clone(), s.y.clone()));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.bin");
        s.write(&p).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(b.len(), 4 + 7 * SAMPLE_LEN * 4 + 7 * 8);
        assert_eq!(&b[..4], &7u32.to_le_bytes());
        assert_eq!(&b[4..8], &s.x[0].to_le_bytes());
        assert_eq!(&b[b.len() - 8..], &s.y[6].to_le_bytes());
    }
}
