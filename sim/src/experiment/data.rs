//! Where an experiment's sites come from: the built-in training domains, a user's folder of
//! domains (`<root>/<domain>/{train,val,test}/<class>/<image>`), or the built-in domains pooled
//! and split by Dirichlet label skew; loaded once per experiment.

use super::Preset;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use unifed_models::backend::Backend;
use unifed_models::data::{BuiltinData, Dataset, Domain, Partition, load_labelled, partition};
use unifed_models::zoo::{DigitsCnnConfig, ModelConfig, spec_of};
use unifed_protocol::{Input, ModelSpec, Scaling};

/// The data of an experiment's sites.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSource {
    /// The built-in training domains (`data = "builtin"`), split by `sizes`.
    #[default]
    Builtin,
    /// A folder of domains, one site each (`data = { folder = "..." }`):
    /// `<root>/<domain>/{train,val,test}/<class>/<image>`, PNG or JPEG, resized to the model's
    /// input; `sizes` does not apply.
    Folder(PathBuf),
    /// Label skew (`data = { dirichlet = { alpha = 0.1, sites = 10 } }`): the built-in training
    /// domains' splits (`sizes` each) pooled and spread over `sites` sites, each class by
    /// proportions drawn from Dirichlet(`alpha`), the same proportions for a site's training,
    /// validation and test images.
    Dirichlet(LabelSkew),
}

/// Label skew over pooled built-in domains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelSkew {
    /// The Dirichlet concentration (FedImpro: 0.1 and 0.05; small is skewed).
    pub alpha: f64,
    /// The number of sites.
    pub sites: usize,
    /// The built-in domains pooled (default: all five training domains).
    #[serde(default)]
    pub domains: Vec<String>,
}

/// The fewest training images a label-skewed site may get (and validation and test images: 2);
/// a draw that leaves a site with fewer is drawn again, as FedImpro's partitioner does.
const MIN_TRAIN: usize = 10;

/// One site's data: its name and splits.
#[derive(Debug, Clone)]
pub struct SiteData {
    /// The site (its domain's name).
    pub name: String,
    /// Training split.
    pub train: Dataset,
    /// Validation split (selects the round).
    pub val: Dataset,
    /// Test split.
    pub test: Dataset,
}

/// The model spec and every site's data of `preset`, loaded once.
pub fn load_sites(preset: &Preset, builtin: &BuiltinData) -> Result<(ModelSpec, Vec<SiteData>)> {
    let input = Input::Image {
        channels: preset.model.in_channels as u32,
        height: preset.model.size[0] as u32,
        width: preset.model.size[1] as u32,
        scaling: Scaling::MinusOneToOne,
    };
    let classes = match &preset.data {
        DataSource::Builtin | DataSource::Dirichlet(_) => ModelConfig::fedbn_digits().classes,
        DataSource::Folder(root) => folder_classes(root)?,
    };
    let model = DigitsCnnConfig {
        classes: classes.len(),
        ..preset.model.clone()
    };
    let device = Backend::Flex.device().map_err(anyhow::Error::msg)?;
    let spec = spec_of(&model.init(&device), &classes, &input);
    let sites = match &preset.data {
        DataSource::Builtin => Domain::TRAINING
            .into_iter()
            .map(|d| {
                let dd = builtin.domain(d, &preset.sizes, 0)?;
                let split = |s: &unifed_models::data::DomainSplit, what: &str| {
                    s.dataset(&format!("{}/{what}", d.name()), &spec)
                };
                Ok(SiteData {
                    name: d.name().to_string(),
                    train: split(&dd.train, "train")?,
                    val: split(&dd.val, "val")?,
                    test: split(&dd.test, "test")?,
                })
            })
            .collect::<Result<Vec<_>>>()?,
        DataSource::Dirichlet(skew) => label_skew(skew, preset, builtin, &spec)?,
        DataSource::Folder(root) => domains(root)?
            .into_iter()
            .map(|(name, dir)| {
                let [train, val, test] = load_labelled(&dir, &spec)
                    .with_context(|| format!("domain `{name}` ({})", dir.display()))?;
                if val.is_empty() {
                    bail!(
                        "domain `{name}` has no validation images ({}): rounds are selected on \
                         them",
                        dir.join("val").display()
                    );
                }
                Ok(SiteData {
                    name,
                    train,
                    val,
                    test,
                })
            })
            .collect::<Result<Vec<_>>>()?,
    };
    Ok((spec, sites))
}

/// The domains of a folder: its subfolders, sorted, as (name, path).
fn domains(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).with_context(|| format!("reading {}", root.display()))? {
        let p = e
            .with_context(|| format!("reading {}", root.display()))?
            .path();
        if p.is_dir() {
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("{}: not a UTF-8 name", p.display()))?;
            out.push((name.to_string(), p.clone()));
        }
    }
    out.sort();
    if out.len() < 2 {
        bail!(
            "{} holds {} domain folder(s); a federation needs at least two",
            root.display(),
            out.len()
        );
    }
    Ok(out)
}

/// The classes of a folder of domains: the union of the class folders of every split, sorted.
fn folder_classes(root: &Path) -> Result<Vec<String>> {
    let mut classes = std::collections::BTreeSet::new();
    for (_, dir) in domains(root)? {
        for split in ["train", "val", "test"] {
            let Ok(entries) = std::fs::read_dir(dir.join(split)) else {
                continue;
            };
            for e in entries.flatten() {
                if e.path().is_dir()
                    && let Some(n) = e.file_name().to_str()
                {
                    classes.insert(n.to_string());
                }
            }
        }
    }
    if classes.len() < 2 {
        bail!(
            "{}: found {} class folder(s) under <domain>/{{train,val,test}}; a classifier needs \
             at least two",
            root.display(),
            classes.len()
        );
    }
    Ok(classes.into_iter().collect())
}

/// The label-skewed sites of `skew`: the pooled splits of its domains, partitioned together so
/// that each site's training, validation and test images follow the same class proportions.
fn label_skew(
    skew: &LabelSkew,
    preset: &Preset,
    builtin: &BuiltinData,
    spec: &ModelSpec,
) -> Result<Vec<SiteData>> {
    if skew.sites < 2 {
        bail!("label skew needs at least two sites, got {}", skew.sites);
    }
    let names: Vec<Domain> = if skew.domains.is_empty() {
        Domain::TRAINING.to_vec()
    } else {
        skew.domains
            .iter()
            .map(|d| Domain::parse(d).map_err(anyhow::Error::msg))
            .collect::<Result<_>>()?
    };
    let (mut train, mut val, mut test) = (Vec::new(), Vec::new(), Vec::new());
    for d in names {
        let dd = builtin.domain(d, &preset.sizes, 0)?;
        train.push(dd.train.dataset(&format!("{}/train", d.name()), spec)?);
        val.push(dd.val.dataset(&format!("{}/val", d.name()), spec)?);
        test.push(dd.test.dataset(&format!("{}/test", d.name()), spec)?);
    }
    let pool =
        |parts: &[Dataset], name: &str| Dataset::pooled(name, &parts.iter().collect::<Vec<_>>());
    let (train, val, test) = (
        pool(&train, "train")?,
        pool(&val, "val")?,
        pool(&test, "test")?,
    );
    // One partition of all three splits' labels, so a site's share of each class is the same
    // in each split.
    let labels: Vec<usize> = [&train, &val, &test]
        .iter()
        .flat_map(|d| d.y.iter().copied())
        .collect();
    let (nt, nv) = (train.len(), val.len());
    for attempt in 0..100u64 {
        let parts = partition(
            &labels,
            skew.sites,
            Partition::Dirichlet { alpha: skew.alpha },
            attempt,
        )
        .map_err(anyhow::Error::msg)?;
        let split = |p: &[usize]| {
            let t: Vec<usize> = p.iter().copied().filter(|&i| i < nt).collect();
            let v: Vec<usize> = p
                .iter()
                .filter(|&&i| i >= nt && i < nt + nv)
                .map(|&i| i - nt)
                .collect();
            let e: Vec<usize> = p
                .iter()
                .filter(|&&i| i >= nt + nv)
                .map(|&i| i - nt - nv)
                .collect();
            (t, v, e)
        };
        let splits: Vec<_> = parts.iter().map(|p| split(p)).collect();
        if splits
            .iter()
            .any(|(t, v, e)| t.len() < MIN_TRAIN || v.len() < 2 || e.len() < 2)
        {
            continue;
        }
        return Ok(splits
            .iter()
            .enumerate()
            .map(|(k, (t, v, e))| {
                let name = format!("site-{k:02}");
                SiteData {
                    train: train.subset(format!("{name}/train"), t),
                    val: val.subset(format!("{name}/val"), v),
                    test: test.subset(format!("{name}/test"), e),
                    name,
                }
            })
            .collect());
    }
    bail!(
        "100 Dirichlet({}) draws over {} sites each left a site with fewer than {MIN_TRAIN} \
         training images; use a larger alpha, fewer sites or larger sizes",
        skew.alpha,
        skew.sites
    )
}
