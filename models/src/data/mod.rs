//! Datasets: labelled image folders and CSV manifests, unlabelled image folders, MNIST IDX
//! files, the built-in multi-domain digits dataset and a site partitioner.
//!
//! Every loader runs images through the model spec's preprocessing ([`preprocess`]): resize to
//! the spec's size, grey repeated to 3 channels when the model takes colour, scaling. Class
//! indices come from the spec's class names, never from a folder listing.

pub mod dicom;
mod domains;
mod folder;
mod idx;
mod partition;
mod preprocess;

pub use domains::{
    Assets, BaseDigits, BuiltinData, Domain, DomainData, DomainError, DomainSplit, SplitSizes,
    assets_dir, preview_grid,
};
pub use folder::{load_labelled, load_split, load_unlabelled, load_unlabelled_named, skip_limit};
pub use idx::{read_idx, read_idx_digits};
pub use partition::{Partition, PartitionError, partition};
pub use preprocess::preprocess;

use crate::error::DataError;

/// Labelled samples, preprocessed for one model input: row `i` of `x` (length `features`) has
/// class index `y[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Name used in errors and tables (e.g. `grey/train`).
    pub name: String,
    /// Values per sample.
    pub features: usize,
    /// Row-major samples.
    pub x: Vec<f32>,
    /// Class index of every sample.
    pub y: Vec<usize>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The samples at `idx`, in that order.
    pub fn subset(&self, name: impl Into<String>, idx: &[usize]) -> Dataset {
        let f = self.features;
        let mut x = Vec::with_capacity(idx.len() * f);
        for &i in idx {
            x.extend_from_slice(&self.x[i * f..(i + 1) * f]);
        }
        Dataset {
            name: name.into(),
            features: f,
            x,
            y: idx.iter().map(|&i| self.y[i]).collect(),
        }
    }

    /// The samples of every part, in order, as one dataset (centralised training on the sites'
    /// pooled data). Parts of different sample sizes are refused, naming both.
    pub fn pooled(name: impl Into<String>, parts: &[&Dataset]) -> Result<Dataset, DataError> {
        let Some(first) = parts.first() else {
            return Err(DataError::Invalid("no datasets to pool".into()));
        };
        if let Some(other) = parts.iter().find(|p| p.features != first.features) {
            return Err(DataError::Invalid(format!(
                "{} has {} values per sample and {} has {}: they cannot be pooled",
                first.name, first.features, other.name, other.features
            )));
        }
        Ok(Dataset {
            name: name.into(),
            features: first.features,
            x: parts.iter().flat_map(|p| p.x.iter().copied()).collect(),
            y: parts.iter().flat_map(|p| p.y.iter().copied()).collect(),
        })
    }

    /// Samples per class index, for `classes` classes.
    pub fn class_counts(&self, classes: usize) -> Vec<usize> {
        let mut c = vec![0; classes];
        for &y in &self.y {
            if y < classes {
                c[y] += 1;
            }
        }
        c
    }
}
