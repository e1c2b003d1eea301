//! `unifed-agent warmup`: a site's training and evaluation, run on a throwaway copy of its
//! model so that a GPU backend tunes and compiles every kernel a round uses into the site's
//! kernel cache. A service runs it at install time; its first round then starts tuned.

use crate::config::{load_config, load_data};
use anyhow::Result;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;
use unifed_models::backend::Backend;
use unifed_models::train::{EVAL_BATCH, evaluate, train_local};

/// Seconds of one pass: a local training run as the site's config sets it, then an evaluation
/// of its test split.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Pass {
    /// Seconds of the local training.
    pub train_s: f64,
    /// Seconds of the evaluation.
    pub evaluate_s: f64,
}

/// What a warm-up did: the backend, where the kernels are kept, and the passes' timings
/// (the first pays for whatever the cache did not hold; the second runs tuned).
#[derive(Debug, Clone, Serialize)]
pub struct Warmup {
    /// The backend warmed.
    pub backend: String,
    /// The kernel cache, or `None` for the CPU backend, which has none.
    pub kernel_cache: Option<std::path::PathBuf>,
    /// One entry per pass, in order.
    pub passes: Vec<Pass>,
}

/// Reads the agent config at `path` and runs `passes` training-and-evaluation passes on its
/// model and data without touching the site's checkpoint: only the kernel cache is written.
pub fn run(path: &Path, passes: usize) -> Result<Warmup> {
    let cfg = load_config(path)?;
    let backend: Backend = cfg.backend.parse().map_err(anyhow::Error::msg)?;
    let device = cfg.device(backend).map_err(anyhow::Error::msg)?;
    let (net, spec) = cfg.model_and_spec(&device)?;
    let (train, test) = load_data(&cfg, &spec)?;
    let classes = spec.classes.len();
    let mut out = Vec::with_capacity(passes);
    for _ in 0..passes {
        let t = Instant::now();
        let (trained, _) = train_local(&net, &train, classes, &cfg.train, &device, |_| {})?;
        let train_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        evaluate(&trained, &test, classes, EVAL_BATCH, &device)?;
        out.push(Pass {
            train_s,
            evaluate_s: t.elapsed().as_secs_f64(),
        });
    }
    unifed_models::backend::save_compiled_kernels();
    Ok(Warmup {
        backend: backend.to_string(),
        kernel_cache: backend.is_gpu().then(|| cfg.kernel_cache()),
        passes: out,
    })
}
