//! Where an experiment's sites come from: the built-in training domains, or a user's folder of
//! domains (`<root>/<domain>/{train,val,test}/<class>/<image>`), loaded once per experiment.

use super::Preset;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use unifed_models::backend::Backend;
use unifed_models::data::{BuiltinData, Dataset, Domain, load_labelled};
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
}

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
        DataSource::Builtin => ModelConfig::fedbn_digits().classes,
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
