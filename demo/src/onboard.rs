//! The never-seen domains after a demo: how a new site would fare with the federation's
//! models, under each baseline of UniFed / FedBN appendix G, from the files the FedBN and FedAvg
//! runs left in the work folder.
//!
//! - (a) `global, own BN`: the FedBN global non-BN weights with the global model's own,
//!   never-trained BN layers (policy `none`, UniFed's baseline);
//! - (b) `global, avg affine+stats`: with the sites' BN weight and bias averaged and their
//!   statistics pooled (policy `affine+stats`). Means are sample-weighted; variances are pooled
//!   as the variance of the sites' mixture, `sum w_i (var_i + (mean_i - mean)^2)`;
//! - (c) `FedAvg model`: the `global`-BN run's final model as is;
//! - (d) `stream`: UniFed Algorithm 1 on the test images themselves, from the package's
//!   statistics, with the affine parameters of `none` (d-none) or of `affine` (d-affine);
//! - (e) `calibrate`: exact statistics of the domain's separate unlabelled split, with the
//!   affine parameters of `none` (e-none) or `affine` (e-affine).

use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use unifed_models::backend::Device;
use unifed_models::bn::{BnStart, CalibrateConfig, StreamConfig};
use unifed_models::calibrate::calibrate;
use unifed_models::checkpoint;
use unifed_models::data::{BuiltinData, Dataset, Domain, SplitSizes};
use unifed_models::state::{Select, StateDict, import};
use unifed_models::train::{EVAL_BATCH, evaluate, evaluate_stream};
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig};
use unifed_protocol::{ModelSpec, TensorSpec};

/// One never-seen domain's accuracies (fractions), by baseline.
#[derive(Debug, Clone, Serialize)]
pub struct DomainRow {
    /// Domain name.
    pub domain: String,
    /// Test images.
    pub test_images: usize,
    /// Unlabelled calibration images (for e).
    pub calib_images: usize,
    /// Baseline name -> accuracy.
    pub accuracy: BTreeMap<String, f64>,
    /// Stream sweep (when asked): `(affine, tau, batch, order seed) -> accuracy`.
    pub stream_sweep: Vec<SweepCell>,
}

/// One cell of the stream sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SweepCell {
    /// `none` or `affine`.
    pub affine: String,
    /// Weight on history.
    pub tau: f64,
    /// Test batch size.
    pub batch: usize,
    /// Order seed.
    pub order: u64,
    /// Accuracy.
    pub accuracy: f64,
}

/// The baselines' column names, in table order.
pub const COLUMNS: [&str; 7] = [
    "a global, own BN",
    "b avg affine+stats",
    "c FedAvg model",
    "d stream (none)",
    "d stream (affine)",
    "e calibrate (none)",
    "e calibrate (affine)",
];

fn build(spec: &ModelSpec, state: &StateDict, device: &Device) -> Result<DigitsCnn> {
    let cfg = DigitsCnnConfig::from_spec(spec).map_err(anyhow::Error::msg)?;
    Ok(import(&cfg.init(device), spec, state, Select::All)?)
}

/// `base` with its tensors of the kinds `keep` selects replaced by `from`'s.
fn with(base: &StateDict, from: &StateDict, keep: Select) -> StateDict {
    let mut s = base.clone();
    for (t, f) in s.tensors.iter_mut().zip(&from.tensors) {
        if keep.keeps(t.kind) {
            t.data = f.data.clone();
        }
    }
    s
}

/// The sites' BN tensors combined as the aggregator does under policy `affine+stats`
/// (`unifed_aggregator::bnshare::pool`), with equal weights: every demo site trains on the same
/// number of images.
fn average_bn(sites: &[StateDict]) -> StateDict {
    let mut out = sites[0].clone();
    let idx: Vec<usize> = (0..out.tensors.len())
        .filter(|&k| out.tensors[k].kind.is_bn())
        .collect();
    let specs: Vec<TensorSpec> = idx
        .iter()
        .map(|&k| TensorSpec {
            name: out.tensors[k].name.clone(),
            shape: out.tensors[k].shape.clone(),
            kind: out.tensors[k].kind,
        })
        .collect();
    let per_site: Vec<(f64, Vec<Vec<f32>>)> = sites
        .iter()
        .map(|s| {
            (
                1.0,
                idx.iter().map(|&k| s.tensors[k].data.clone()).collect(),
            )
        })
        .collect();
    let pooled = unifed_aggregator::bnshare::pool(&specs.iter().collect::<Vec<_>>(), &per_site);
    for (&k, t) in idx.iter().zip(pooled) {
        out.tensors[k].data = t;
    }
    out
}

fn stream(
    net: &DigitsCnn,
    test: &Dataset,
    tau: f64,
    batch: usize,
    order_seed: u64,
    device: &Device,
) -> Result<f64> {
    let mut order: Vec<usize> = (0..test.len()).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(order_seed));
    let cfg = StreamConfig {
        tau,
        batch_size: batch,
        start: BnStart::Stored,
    };
    Ok(evaluate_stream(net, test, 10, &cfg, &order, device)?.accuracy())
}

/// What a finished FedBN run left in `<work>/local`: the spec, the initial model (whose BN
/// layers the global model keeps under `local` BN) and every site's final checkpoint; with the
/// built-in data, loaded once for the table and the late joiners.
pub struct FedBnRun {
    work: std::path::PathBuf,
    site_names: Vec<String>,
    device: Device,
    spec: ModelSpec,
    init: StateDict,
    sites: Vec<StateDict>,
    data: BuiltinData,
}

impl FedBnRun {
    /// Loads the run in `work` with its sites `sites`, and the built-in data.
    pub fn load(work: &Path, sites: &[String]) -> Result<FedBnRun> {
        let device = unifed_models::backend::Backend::Flex
            .device()
            .map_err(anyhow::Error::msg)?;
        let local = work.join("local");
        let spec: ModelSpec = serde_json::from_slice(
            &std::fs::read(unifed_protocol::spec_path(&local.join("init.safetensors")))
                .with_context(|| format!("reading the FedBN run in {}", local.display()))?,
        )?;
        let load =
            |p: &Path| checkpoint::load(p, &spec).with_context(|| format!("{}", p.display()));
        let init = load(&local.join("init.safetensors"))?;
        let states: Vec<StateDict> = sites
            .iter()
            .map(|s| load(&local.join(s).join("model.safetensors")))
            .collect::<Result<_>>()?;
        if states.is_empty() {
            bail!("no site checkpoints in {}", local.display());
        }
        Ok(FedBnRun {
            work: work.to_path_buf(),
            site_names: sites.to_vec(),
            device,
            spec,
            init,
            sites: states,
            data: BuiltinData::load().context("loading the built-in data")?,
        })
    }
}

/// Evaluates every baseline on every never-seen domain from the FedBN run and the FedAvg run
/// beside it; with `sweep`, also the full stream grid: tau {0, 0.5, 0.9} x batch {2, 8, 32,
/// 128, 512} x 3 orders, for both affine choices.
pub fn table(run: &FedBnRun, sweep: bool, mut say: impl FnMut(String)) -> Result<Vec<DomainRow>> {
    let FedBnRun {
        work,
        site_names: sites,
        device,
        spec,
        init,
        sites: site_states,
        data,
    } = run;
    let load = |p: &Path| checkpoint::load(p, spec).with_context(|| format!("{}", p.display()));
    // Every FedBN site holds the same final non-BN weights; the BN layers are each its own.
    let global_own_bn = with(init, &site_states[0], Select::NonBn);
    let avg = average_bn(site_states);
    let avg_all = with(&global_own_bn, &avg, Select::Bn);
    let avg_affine = with(&global_own_bn, &avg, Select::BnAffine);
    let fedavg = load(
        &work
            .join("global")
            .join(&sites[0])
            .join("model.safetensors"),
    )
    .context("the FedAvg run's model")?;
    let net_a = build(spec, &global_own_bn, device)?;
    let net_b = build(spec, &avg_all, device)?;
    let net_c = build(spec, &fedavg, device)?;
    let net_aff = build(spec, &avg_affine, device)?;

    let mut rows = Vec::new();
    for d in Domain::UNSEEN {
        let dd = data.domain(d, &SplitSizes::default(), 0)?;
        let test = dd.test.dataset(&format!("{}/test", d.name()), spec)?;
        let calib = dd.calib.dataset(&format!("{}/calib", d.name()), spec)?;
        let acc = |net: &DigitsCnn| -> Result<f64> {
            Ok(evaluate(net, &test, 10, EVAL_BATCH, device)?.accuracy())
        };
        let cal = |net: &DigitsCnn| -> Result<DigitsCnn> {
            Ok(calibrate(
                net,
                &calib.x,
                device,
                &CalibrateConfig::default(),
                |_, _| {},
            )?)
        };
        let mut accuracy = BTreeMap::new();
        let vals = [
            acc(&net_a)?,
            acc(&net_b)?,
            acc(&net_c)?,
            stream(&net_a, &test, 0.9, 32, 0, device)?,
            stream(&net_aff, &test, 0.9, 32, 0, device)?,
            acc(&cal(&net_a)?)?,
            acc(&cal(&net_aff)?)?,
        ];
        for (c, v) in COLUMNS.iter().zip(vals) {
            accuracy.insert(c.to_string(), v);
        }
        let mut cells = Vec::new();
        if sweep {
            for (affine, net) in [("none", &net_a), ("affine", &net_aff)] {
                for tau in [0.0, 0.5, 0.9] {
                    for batch in [2, 8, 32, 128, 512] {
                        for order in 0..3 {
                            let accuracy = stream(net, &test, tau, batch, order, device)?;
                            cells.push(SweepCell {
                                affine: affine.into(),
                                tau,
                                batch,
                                order,
                                accuracy,
                            });
                        }
                    }
                }
            }
        }
        say(format!("never-seen domain {} evaluated", d.name()));
        rows.push(DomainRow {
            domain: d.name().into(),
            test_images: test.len(),
            calib_images: calib.len(),
            accuracy,
            stream_sweep: cells,
        });
    }
    Ok(rows)
}

/// A late joiner's first round under the two BN starting rules.
#[derive(Debug, Clone, Serialize)]
pub struct LateJoiner {
    /// The joining site's domain.
    pub domain: String,
    /// Test accuracy with the global weights and never-trained BN, before training.
    pub fresh_before: f64,
    /// After one local epoch from there.
    pub fresh_after: f64,
    /// Test accuracy with BN calibrated on the site's own training images, before training.
    pub calibrated_before: f64,
    /// After one local epoch from there.
    pub calibrated_after: f64,
}

/// Each training domain as a site joining with the FedBN run's final global weights: its
/// accuracy before and after one local epoch (FedBN's recipe), starting from never-trained BN
/// or from BN calibrated on its own training images (the agent's default, `join_bn`).
pub fn late_joiners(
    run: &FedBnRun,
    train_samples: usize,
    mut say: impl FnMut(String),
) -> Result<Vec<LateJoiner>> {
    let FedBnRun {
        device,
        spec,
        init,
        sites: site_states,
        data,
        ..
    } = run;
    let fresh = build(spec, &with(init, &site_states[0], Select::NonBn), device)?;
    let tc = unifed_models::train::TrainConfig::default();
    let mut out = Vec::new();
    for d in Domain::TRAINING {
        let dd = data.domain(
            d,
            &SplitSizes {
                train: train_samples,
                ..SplitSizes::default()
            },
            0,
        )?;
        let train = dd.train.dataset(&format!("{}/train", d.name()), spec)?;
        let test = dd.test.dataset(&format!("{}/test", d.name()), spec)?;
        let acc = |net: &DigitsCnn| -> Result<f64> {
            Ok(evaluate(net, &test, 10, EVAL_BATCH, device)?.accuracy())
        };
        let one_epoch = |net: &DigitsCnn| -> Result<DigitsCnn> {
            Ok(unifed_models::train::train_local(net, &train, 10, &tc, device, |_| {})?.0)
        };
        let cal = calibrate(
            &fresh,
            &train.x,
            device,
            &CalibrateConfig::default(),
            |_, _| {},
        )?;
        let row = LateJoiner {
            domain: d.name().into(),
            fresh_before: acc(&fresh)?,
            fresh_after: acc(&one_epoch(&fresh)?)?,
            calibrated_before: acc(&cal)?,
            calibrated_after: acc(&one_epoch(&cal)?)?,
        };
        say(format!(
            "late joiner {}: fresh BN {:.2}% -> {:.2}%, calibrated BN {:.2}% -> {:.2}% after one epoch",
            row.domain,
            100.0 * row.fresh_before,
            100.0 * row.fresh_after,
            100.0 * row.calibrated_before,
            100.0 * row.calibrated_after
        ));
        out.push(row);
    }
    Ok(out)
}

/// The table as text: one row per domain, one column per baseline (percent).
pub fn render(rows: &[DomainRow]) -> String {
    let mut s = format!("\n{:<10}", "never-seen");
    for c in COLUMNS {
        s += &format!("{c:>21}");
    }
    s.push('\n');
    for r in rows {
        s += &format!("{:<10}", r.domain);
        for c in COLUMNS {
            s += &format!("{:>21.2}", 100.0 * r.accuracy[c]);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_models::state::NamedTensor;
    use unifed_protocol::TensorKind;

    fn site(w: f32, mean: f32, var: f32) -> StateDict {
        let t = |name: &str, kind, v: f32| NamedTensor {
            name: name.into(),
            shape: vec![1],
            kind,
            data: vec![v],
        };
        StateDict {
            spec_hash: unifed_protocol::SpecHash([0; 32]),
            tensors: vec![
                t("fc.weight", TensorKind::NonBn, w),
                t("bn.weight", TensorKind::BnWeight, w),
                t("bn.running_mean", TensorKind::BnRunningMean, mean),
                t("bn.running_var", TensorKind::BnRunningVar, var),
            ],
        }
    }

    #[test]
    fn averaged_bn_pools_variances_as_the_sites_mixture_and_leaves_non_bn_alone() {
        let avg = average_bn(&[site(1.0, 0.0, 1.0), site(3.0, 2.0, 3.0)]);
        let v: Vec<f32> = avg.tensors.iter().map(|t| t.data[0]).collect();
        // Non-BN from the first site; affine and means averaged; variance = mean of the
        // variances (2) + the spread of the means around their mean 1 (1).
        assert_eq!(v, vec![1.0, 2.0, 1.0, 3.0]);
    }
}
