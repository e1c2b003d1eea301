//! Errors of the models crate, one enum per concern, each naming what was wrong.

use std::path::PathBuf;

/// Errors when moving tensors between a model and its flat named form, or a checkpoint file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The tensors were made for another model spec.
    #[error("spec hash mismatch: the tensors are for spec {found}, the model has spec {expected}")]
    SpecHashMismatch {
        /// The model's spec hash.
        expected: String,
        /// The hash the tensors carry.
        found: String,
    },
    /// A tensor's shape differs from the spec.
    #[error("tensor `{name}` has shape {found:?}, the model spec says {expected:?}")]
    WrongShape {
        /// Tensor name.
        name: String,
        /// Shape in the spec.
        expected: Vec<usize>,
        /// Shape given.
        found: Vec<usize>,
    },
    /// A tensor the model needs is not there.
    #[error("tensor `{0}` is missing")]
    Missing(String),
    /// A tensor not in the model spec was given.
    #[error("tensor `{0}` is not part of the model spec")]
    Unexpected(String),
    /// The number of values does not match the shape.
    #[error("tensor `{name}` holds {found} values, its shape needs {expected}")]
    WrongLength {
        /// Tensor name.
        name: String,
        /// Values the shape needs.
        expected: usize,
        /// Values given.
        found: usize,
    },
    /// A tensor has a dtype we cannot read.
    #[error("tensor `{name}` has dtype {dtype}, expected a float type (F32, F64, F16, BF16)")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// Two state dicts that should line up do not.
    #[error("the two tensor sets differ: {0}")]
    Mismatch(String),
    /// Reading or writing a checkpoint file failed.
    #[error("checkpoint {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// Errors of BN statistics re-estimation.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BnError {
    /// There were no images to estimate from.
    #[error("no images to estimate BatchNorm statistics from")]
    NoImages,
    /// The batch size cannot give a variance.
    #[error("batch size {0} cannot give a batch variance: use 2 or more")]
    BatchTooSmall(usize),
    /// Only a single image is available, which has no batch variance at a BatchNorm1d layer.
    #[error("a single image has no batch variance: BN re-estimation needs at least 2 images")]
    SingleImage,
    /// `tau` must lie in [0, 1].
    #[error("tau must lie in [0, 1], got {0}")]
    BadTau(f64),
    /// The input does not match the model.
    #[error("input of {found} values per sample does not match the model's {expected}")]
    WrongInput {
        /// Values per sample the model expects.
        expected: usize,
        /// Values per sample given.
        found: usize,
    },
}

/// Errors of local training and evaluation.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TrainError {
    /// The dataset has no samples.
    #[error("the dataset `{0}` is empty")]
    EmptyDataset(String),
    /// A configuration value is out of range.
    #[error("invalid training config: {0}")]
    BadConfig(String),
    /// The input does not match the model.
    #[error("dataset `{name}` has {found} values per sample, the model expects {expected}")]
    WrongInput {
        /// Dataset name.
        name: String,
        /// Values per sample the model expects.
        expected: usize,
        /// Values per sample given.
        found: usize,
    },
    /// A label is outside the model's classes.
    #[error("dataset `{name}` has label index {label}, the model has {classes} classes")]
    LabelOutOfRange {
        /// Dataset name.
        name: String,
        /// The label index.
        label: usize,
        /// Number of classes.
        classes: usize,
    },
    /// The loss became NaN or infinite.
    #[error("training diverged: loss is {0} at epoch {1}")]
    Diverged(f64, usize),
}

/// Errors while loading or generating data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A folder that must exist does not.
    #[error("folder {0} does not exist")]
    MissingFolder(PathBuf),
    /// A file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// An image could not be decoded.
    #[error("corrupt or unsupported image {path}: {message}")]
    CorruptImage {
        /// The file.
        path: PathBuf,
        /// The decoder's message.
        message: String,
    },
    /// The image's channels cannot become the model's.
    #[error("image {path} has {found} colour channels, the model takes {expected}")]
    WrongChannels {
        /// The file.
        path: PathBuf,
        /// Channels the model takes.
        expected: u32,
        /// Channels of the image.
        found: u32,
    },
    /// A label is not one of the model spec's class names.
    #[error("label `{label}` ({path}) is not a class of the model spec (classes: {classes})")]
    UnknownLabel {
        /// The label.
        label: String,
        /// Where it was found.
        path: PathBuf,
        /// The spec's classes, comma-separated.
        classes: String,
    },
    /// No samples were found.
    #[error("dataset {0} holds no images")]
    Empty(String),
    /// More images of a folder could not be read than a load skips
    /// ([`crate::data::skip_limit`]): the data, not a stray file, is wrong.
    #[error(
        "{folder}: {skipped} of {total} images cannot be used (at most {limit} are skipped); the first: {first}"
    )]
    TooManyUnreadable {
        /// The split or folder.
        folder: String,
        /// Images that could not be used.
        skipped: usize,
        /// Images found.
        total: usize,
        /// The most a load skips for this many.
        limit: usize,
        /// Why the first of them could not be used.
        first: Box<DataError>,
    },
    /// A malformed IDX file.
    #[error("IDX file {path}: {message}")]
    BadIdx {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A malformed CSV manifest.
    #[error("manifest {path} line {line}: {message}")]
    BadManifest {
        /// The manifest.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The model takes feature vectors, not images.
    #[error("the model takes feature vectors, images cannot be loaded for it")]
    NotAnImageModel,
    /// A request the data cannot satisfy.
    #[error("{0}")]
    Invalid(String),
}

/// Errors of a site's federated work.
#[derive(Debug, thiserror::Error)]
pub enum SiteError {
    /// The site id is not valid.
    #[error("site id `{0}`: {1}")]
    Id(String, String),
    /// Moving tensors in or out of the model failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// Training or evaluation failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The round's objective cannot be prepared.
    #[error(transparent)]
    Term(#[from] TermError),
    /// Training left a tensor with NaN or infinity; nothing is sent.
    #[error("training left non-finite values in `{0}`; the update is not sent")]
    NonFinite(String),
    /// A broadcast does not fit the round's plan (a SCAFFOLD round without the server's
    /// control variate, or one that does not cover the averaged trainable tensors).
    #[error("the model of round {round} does not fit its plan: {message}")]
    Plan {
        /// The round.
        round: u64,
        /// What is wrong.
        message: String,
    },
    /// The memory kept in the site's checkpoint does not fit its model.
    #[error("the site's memory: {0}")]
    Memory(String),
    /// The starting model or the site's memory could not be parked in, or read back from, its
    /// file while training.
    #[error("the state parked in {path} while training: {source}")]
    Park {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// Why an objective's term cannot be prepared.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TermError {
    /// The objective's parameters are invalid.
    #[error(transparent)]
    Objective(#[from] unifed_protocol::ObjectiveError),
    /// The site lacks state the round's term needs.
    #[error("a {algorithm} round needs {what}")]
    Missing {
        /// The algorithm.
        algorithm: &'static str,
        /// What it needs.
        what: &'static str,
    },
}
