//! Onboarding on the device. `calibrate` re-estimates every BN layer's statistics on the site's
//! own unlabelled images, from a model file or (`--config`) from the federation's onboarding
//! package fetched over MQTT, writes the calibrated model and registers its BN, sealed with
//! the site key, with the aggregator; `fetch-calibrated` brings the registered model to
//! another device of the site. `evaluate` measures a model on labelled images with its stored
//! BN statistics, under `stream` re-estimation (UniFed Algorithm 1) or after a fresh
//! `calibrate`; `predict` classifies a folder.

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use std::path::{Path, PathBuf};
use unifed_models::backend::Device;
use unifed_models::bn::{BnStart, CalibrateConfig, Estimator, StreamConfig, StreamEstimator};
use unifed_models::checkpoint;
use unifed_models::data::{
    BuiltinData, Dataset, Domain, DomainData, SplitSizes, load_split, load_unlabelled,
};
use unifed_models::state::{Select, StateDict, export, import};
use unifed_models::train::{EVAL_BATCH, evaluate, evaluate_stream};
use unifed_models::zoo::AnyNet;
use unifed_protocol::ModelSpec;

/// A model file and where its labelled evaluation images come from.
#[derive(clap::Args, Debug, Clone)]
pub struct Source {
    /// Model file (safetensors), its spec beside it as `<file>.spec.json`. `calibrate
    /// --config` fetches the federation's onboarding package instead.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A built-in domain: its test split is evaluated, its calibration split calibrates.
    #[arg(long)]
    pub builtin: Option<String>,
    /// A labelled dataset folder (`train/ val/ test/`, each `label/file`, or a manifest.csv).
    #[arg(long)]
    pub folder: Option<PathBuf>,
    /// The folder's split to evaluate.
    #[arg(long, default_value = "test")]
    pub split: String,
}

/// BN re-estimation options shared by both commands.
#[derive(clap::Args, Debug, Clone)]
pub struct BnArgs {
    /// `stream`: weight on history in [0, 1]; `calibrate --estimator ema`: the EMA's tau.
    #[arg(long, default_value_t = 0.9)]
    pub tau: f64,
    /// Images per batch (stream: the test batch size; it must leave no batch of one).
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Starting statistics: `stored` (the model's) or `first-batch`. Default: stored for
    /// stream (Algorithm 1), first-batch for an EMA calibration.
    #[arg(long)]
    pub start: Option<String>,
    /// Seed of the order images arrive in under `stream`.
    #[arg(long, default_value_t = 0)]
    pub order_seed: u64,
}

/// `unifed-agent evaluate`.
#[derive(clap::Args, Debug)]
pub struct EvaluateArgs {
    #[command(flatten)]
    source: Source,
    /// BN statistics: `stored`, `stream` or `calibrate`.
    #[arg(long, default_value = "stored")]
    bn: String,
    #[command(flatten)]
    bn_args: BnArgs,
    /// Unlabelled images to calibrate on with `--bn calibrate` (default for a built-in domain:
    /// its calibration split).
    #[arg(long)]
    calib_images: Option<PathBuf>,
}

/// `unifed-agent calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub(crate) source: Source,
    /// Unlabelled images of the site (a flat folder). Default for a built-in domain: its
    /// calibration split.
    #[arg(long)]
    pub(crate) images: Option<PathBuf>,
    /// `calibrate` (one pass per BN layer) or `stream` (one pass, UniFed Algorithm 1).
    #[arg(long, default_value = "calibrate")]
    pub(crate) mode: String,
    /// `calibrate` pooling: `exact` (population statistics) or `ema` (tau-EMA over batches).
    #[arg(long, default_value = "exact")]
    pub(crate) estimator: String,
    #[command(flatten)]
    pub(crate) bn_args: BnArgs,
    /// Where to write the calibrated model (and its spec beside it). With `--config` the
    /// default is `<state_dir>/calibrated/v<version>.safetensors`.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Agent config (broker, federation, site, data, `site_key`): fetch the onboarding package
    /// from the aggregator instead of reading `--model`, and register the calibrated BN.
    #[arg(long, conflicts_with = "model")]
    pub(crate) config: Option<PathBuf>,
    /// With `--config`: the model version to calibrate (default: the newest).
    #[arg(long, requires = "config")]
    pub(crate) version: Option<u64>,
    /// With `--config`: keep the calibrated model on this device only.
    #[arg(long, requires = "config")]
    pub(crate) no_register: bool,
}

/// `unifed-agent fetch-calibrated`.
#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// Agent config of this device (same site, federation and `site_key` as the device that
    /// calibrated).
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// Model version (default: the newest registered for the site).
    #[arg(long)]
    pub(crate) version: Option<u64>,
    /// Where to write the calibrated model (default:
    /// `<state_dir>/calibrated/v<version>.safetensors`).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

/// `unifed-agent predict`.
#[derive(clap::Args, Debug)]
pub struct PredictArgs {
    /// Model file (safetensors), its spec beside it as `<file>.spec.json`.
    #[arg(long)]
    model: PathBuf,
    /// A flat folder of images to classify.
    #[arg(long)]
    images: PathBuf,
    /// BN statistics: `stored`, `stream` (in file order) or `calibrate` (on these images).
    #[arg(long, default_value = "stored")]
    bn: String,
    #[command(flatten)]
    bn_args: BnArgs,
}

fn model_arg(src: &Source) -> Result<&Path> {
    src.model
        .as_deref()
        .context("give --model FILE (a safetensors model with its spec beside it)")
}

/// Loads a model file and its spec (`<model>.spec.json`), which decides the architecture.
pub fn load_model(model: &Path, device: &Device) -> Result<(AnyNet, ModelSpec)> {
    let sp = crate::model::spec_path(model);
    let spec = crate::model::read_spec(&sp)?;
    let net = crate::model::net_for(&spec, device).with_context(|| format!("{}", sp.display()))?;
    let state = checkpoint::load(model, &spec)?;
    Ok((import(&net, &spec, &state, Select::All)?, spec))
}

fn start(arg: &Option<String>, default: BnStart) -> Result<BnStart> {
    Ok(match arg.as_deref() {
        None => default,
        Some("stored") => BnStart::Stored,
        Some("first-batch") => BnStart::FirstBatch,
        Some(o) => bail!("--start `{o}`: expected stored or first-batch"),
    })
}

/// The built-in domain a source names, rendered once per command (both the labelled test
/// split and the calibration split come from it).
fn builtin(src: &Source) -> Result<Option<DomainData>> {
    let Some(d) = &src.builtin else {
        return Ok(None);
    };
    if src.folder.is_some() {
        bail!("give --builtin or --folder, not both");
    }
    let data = BuiltinData::load().context("loading the built-in data")?;
    let domain = Domain::parse(d).map_err(anyhow::Error::msg)?;
    Ok(Some(data.domain(domain, &SplitSizes::default(), 0)?))
}

/// The labelled evaluation set of a source, if it has one.
fn labelled(src: &Source, dd: Option<&DomainData>, spec: &ModelSpec) -> Result<Option<Dataset>> {
    match (dd, &src.folder) {
        (Some(dd), _) => Ok(Some(
            dd.test
                .dataset(&format!("{}/test", dd.domain.name()), spec)?,
        )),
        (None, Some(f)) => Ok(Some(load_split(f, &src.split, spec)?)),
        (None, None) => Ok(None),
    }
}

/// Unlabelled calibration images: `images` if given, else the built-in domain's calibration
/// split (or its training images for a training domain, which has none), else the training
/// split of a dataset folder (labels unused).
fn calibration(
    src: &Source,
    dd: Option<&DomainData>,
    images: &Option<PathBuf>,
    spec: &ModelSpec,
) -> Result<Vec<f32>> {
    if let Some(dir) = images {
        return Ok(load_unlabelled(dir, spec)?);
    }
    let Some(dd) = dd else {
        if let Some(f) = &src.folder {
            return Ok(load_split(f, "train", spec)?.x);
        }
        bail!("give --images (a folder of the site's unlabelled images) or --builtin");
    };
    let split = if dd.calib.images.is_empty() {
        &dd.train
    } else {
        &dd.calib
    };
    Ok(split
        .dataset(&format!("{}/calib", dd.domain.name()), spec)?
        .x)
}

pub(crate) fn bar(what: &str) -> ProgressBar {
    ProgressBar::new(0).with_style(
        ProgressStyle::with_template(&format!("{what} [{{bar:30}}] {{pos}}/{{len}}"))
            .expect("static template")
            .progress_chars("=> "),
    )
}

/// Re-estimates `net`'s BN statistics on `images` (`mode` calibrate or stream).
fn reestimate(
    net: &AnyNet,
    images: &[f32],
    mode: &str,
    estimator: &str,
    a: &BnArgs,
    device: &Device,
) -> Result<AnyNet> {
    let pb = bar("calibrating");
    let out = match mode {
        "calibrate" => {
            let estimator = match estimator {
                "exact" => Estimator::Exact,
                "ema" => Estimator::Ema { tau: a.tau },
                o => bail!("--estimator `{o}`: expected exact or ema"),
            };
            let cfg = CalibrateConfig {
                estimator,
                batch_size: a.batch_size,
                start: start(&a.start, BnStart::FirstBatch)?,
            };
            unifed_models::calibrate::calibrate(net, images, device, &cfg, |done, total| {
                pb.set_length(total as u64);
                pb.set_position(done as u64);
            })?
        }
        "stream" => {
            let f = unifed_models::zoo::Net::input_numel(net);
            let n = images.len() / f;
            let ranges = unifed_models::bn::bn_batches(n, a.batch_size)?;
            let mut est = StreamEstimator::new(a.tau, start(&a.start, BnStart::Stored)?)?;
            let valid = burn::module::Module::valid(net);
            let dev = device.clone().without_autodiff();
            pb.set_length(ranges.len() as u64);
            for r in ranges {
                let x = burn::tensor::Tensor::<2>::from_data(
                    burn::tensor::TensorData::new(
                        images[r.start * f..r.end * f].to_vec(),
                        [r.len(), f],
                    ),
                    &dev,
                );
                est.forward(&valid, x)?;
                pb.inc(1);
            }
            est.store_into(&valid)
        }
        o => bail!("--mode `{o}`: expected calibrate or stream"),
    };
    pb.finish_and_clear();
    Ok(out)
}

/// Runs `unifed-agent evaluate`.
pub fn evaluate_cmd(a: &EvaluateArgs, device: &Device) -> Result<f64> {
    let (net, spec) = load_model(model_arg(&a.source)?, device)?;
    let dd = builtin(&a.source)?;
    let Some(test) = labelled(&a.source, dd.as_ref(), &spec)? else {
        bail!("evaluate needs labelled images: --builtin DOMAIN or --folder DIR");
    };
    let classes = spec.classes.len();
    let rep = match a.bn.as_str() {
        "stored" => evaluate(&net, &test, classes, EVAL_BATCH, device)?,
        "stream" => {
            let mut order: Vec<usize> = (0..test.len()).collect();
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(
                a.bn_args.order_seed,
            ));
            let cfg = StreamConfig {
                tau: a.bn_args.tau,
                batch_size: a.bn_args.batch_size,
                start: start(&a.bn_args.start, BnStart::Stored)?,
            };
            evaluate_stream(&net, &test, classes, &cfg, &order, device)?
        }
        "calibrate" => {
            let images = calibration(&a.source, dd.as_ref(), &a.calib_images, &spec)?;
            let cal = reestimate(&net, &images, "calibrate", "exact", &a.bn_args, device)?;
            evaluate(&cal, &test, classes, EVAL_BATCH, device)?
        }
        o => bail!("--bn `{o}`: expected stored, stream or calibrate"),
    };
    println!(
        "{}: {:.2}% test accuracy on {} images (BN: {})",
        test.name,
        100.0 * rep.accuracy(),
        rep.samples,
        a.bn
    );
    Ok(rep.accuracy())
}

/// Runs `unifed-agent predict`: prints `file,class,probability` for every image.
pub fn predict_cmd(a: &PredictArgs, device: &Device) -> Result<()> {
    use burn::tensor::activation::softmax;
    use unifed_models::bn::BnPass;
    use unifed_models::zoo::Net;
    let (net, spec) = load_model(&a.model, device)?;
    let (files, x) = unifed_models::data::load_unlabelled_named(&a.images, &spec)?;
    let f = spec.input.numel();
    let dev = device.clone().without_autodiff();
    let batch = |r: std::ops::Range<usize>| {
        burn::tensor::Tensor::<2>::from_data(
            burn::tensor::TensorData::new(x[r.start * f..r.end * f].to_vec(), [r.len(), f]),
            &dev,
        )
    };
    let n = files.len();
    let mut probs: Vec<Vec<f32>> = Vec::with_capacity(n);
    let mut push = |logits: burn::tensor::Tensor<2>| -> Result<()> {
        let p = softmax(logits, 1)
            .into_data()
            .try_to_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        probs.extend(p.chunks(spec.classes.len()).map(|c| c.to_vec()));
        Ok(())
    };
    match a.bn.as_str() {
        "stored" | "calibrate" => {
            let net = if a.bn == "calibrate" {
                reestimate(&net, &x, "calibrate", "exact", &a.bn_args, device)?
            } else {
                burn::module::Module::valid(&net)
            };
            for start in (0..n).step_by(256) {
                push(net.forward(batch(start..(start + 256).min(n)), &mut BnPass::standard()))?;
            }
        }
        "stream" => {
            let valid = burn::module::Module::valid(&net);
            let mut est =
                StreamEstimator::new(a.bn_args.tau, start(&a.bn_args.start, BnStart::Stored)?)?;
            for r in unifed_models::bn::bn_batches(n, a.bn_args.batch_size)? {
                push(est.forward(&valid, batch(r))?)?;
            }
        }
        o => bail!("--bn `{o}`: expected stored, stream or calibrate"),
    }
    let mut out = String::from("file,class,probability");
    for (file, p) in files.iter().zip(&probs) {
        let (k, v) = p
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .expect("at least one class");
        out += &format!("\n{},{},{v:.4}", file.display(), spec.classes[k]);
    }
    // Piped into `head`, a closed pipe ends the command quietly.
    unifed_net::service::print_out(out)?;
    Ok(())
}

/// Runs `unifed-agent calibrate` on a model file (`--config` absent: see
/// `onboard_net::calibrate_cmd`).
pub fn calibrate_local(a: &CalibrateArgs, device: &Device) -> Result<()> {
    let (net, spec) = load_model(model_arg(&a.source)?, device)?;
    let out = a
        .out
        .as_deref()
        .context("give --out FILE for the calibrated model")?;
    calibrate_to(&net, &spec, a, &a.source, out, device)?;
    Ok(())
}

/// Calibrates `net` on the source's images, reports accuracy before and after when labels
/// exist, and writes the calibrated model and its spec to `out`.
pub(crate) fn calibrate_to(
    net: &AnyNet,
    spec: &ModelSpec,
    a: &CalibrateArgs,
    source: &Source,
    out: &Path,
    device: &Device,
) -> Result<AnyNet> {
    let dd = builtin(source)?;
    let images = calibration(source, dd.as_ref(), &a.images, spec)?;
    let n = images.len() / spec.input.numel();
    let test = labelled(source, dd.as_ref(), spec)?;
    let before = match &test {
        Some(t) => Some(evaluate(net, t, spec.classes.len(), EVAL_BATCH, device)?.accuracy()),
        None => None,
    };
    let cal = reestimate(net, &images, &a.mode, &a.estimator, &a.bn_args, device)?;
    write_model(out, &export(&cal, spec, Select::All), spec)?;
    println!(
        "calibrated every BN layer on {n} images ({}); wrote {}",
        a.mode,
        out.display()
    );
    if let (Some(t), Some(b)) = (&test, before) {
        let after = evaluate(&cal, t, spec.classes.len(), EVAL_BATCH, device)?.accuracy();
        println!(
            "{}: test accuracy {:.2}% before, {:.2}% after",
            t.name,
            100.0 * b,
            100.0 * after
        );
    }
    Ok(cal)
}

/// Writes a model file and its spec beside it, creating the folder.
pub(crate) fn write_model(out: &Path, state: &StateDict, spec: &ModelSpec) -> Result<()> {
    if let Some(parent) = out.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    checkpoint::save(out, state, spec).with_context(|| format!("writing {}", out.display()))?;
    let sp = crate::model::spec_path(out);
    std::fs::write(&sp, serde_json::to_vec_pretty(spec)?)
        .with_context(|| format!("writing {}", sp.display()))?;
    Ok(())
}
