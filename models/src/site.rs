//! One federated site: its own model (and so its own BatchNorm layers), data and
//! error-feedback residuals, speaking the wire protocol: it applies a server broadcast, trains
//! locally and encodes its update envelope. The agent service and the in-process runner share it.

use crate::backend::Device;
use crate::data::Dataset;
use crate::error::{StateError, TrainError};
use crate::state::{Select, delta, export, import};
use crate::train::{EvalReport, TrainConfig, TrainEvent, evaluate, train_objective};
use crate::zoo::Net;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnPolicy, LocalReport, RoundManifest, ServerBroadcast, SiteExtras, SiteUpdate,
};
use unifed_protocol::{ModelSpec, TensorKind};

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
    /// Training left a tensor with NaN or infinity; nothing is sent.
    #[error("training left non-finite values in `{0}`; the update is not sent")]
    NonFinite(String),
    /// The site's state file could not be read or written.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// Which tensors travel under a BN policy.
pub fn select_for(bn: BnPolicy) -> Select {
    match bn {
        BnPolicy::Local => Select::NonBn,
        BnPolicy::Global => Select::All,
    }
}

/// The seed of a site's local training in `round`: the one rule the agent and the in-process
/// runner share (`seed` is the site's configured training seed).
pub fn round_seed(seed: u64, round: u64) -> u64 {
    seed ^ round
}

/// The encoding a tensor of `kind` travels in when the federation's update encoding is
/// `encoding`: BN running statistics always go as exact f32 without error feedback (a lossy
/// or error-fed variance can fold to a negative value and give NaN at inference).
pub fn encoding_for(kind: TensorKind, encoding: Encoding) -> Encoding {
    if kind.is_bn_stat() {
        Encoding::F32
    } else {
        encoding
    }
}

const RESIDUAL_MAGIC: &[u8; 4] = b"UFSR";
const RESIDUAL_VERSION: u32 = 1;

/// One site: its own model (and so its own BN layers), data and error-feedback residuals.
#[derive(Debug)]
pub struct Site<N: Net> {
    /// Site id.
    pub id: Id,
    /// The site's model.
    pub net: N,
    /// Training split.
    pub train: Dataset,
    /// Test split.
    pub test: Dataset,
    /// Error-feedback residual of each tensor, as of the last accepted update.
    residual: BTreeMap<String, Vec<f32>>,
    /// The residual the update of a round leaves behind, kept until the aggregator answers:
    /// only an accepted update advances it.
    pending: Option<(u64, BTreeMap<String, Vec<f32>>)>,
}

impl<N: Net> Site<N> {
    /// A site with its own copy of the initial model.
    pub fn new(id: &str, net: N, train: Dataset, test: Dataset) -> Result<Self, SiteError> {
        Ok(Site {
            id: Id::new(id).map_err(|e| SiteError::Id(id.to_string(), e.to_string()))?,
            net,
            train,
            test,
            residual: BTreeMap::new(),
            pending: None,
        })
    }

    /// Applies a server broadcast: the non-BN weights under `local` BN (the site keeps its BN),
    /// every tensor under `global`.
    pub fn receive(
        &mut self,
        spec: &ModelSpec,
        b: &ServerBroadcast,
        bn: BnPolicy,
    ) -> Result<(), SiteError> {
        let sd = crate::state::from_encoded(spec, &b.weights)?;
        self.net = import(&self.net, spec, &sd, select_for(bn))?;
        Ok(())
    }

    /// Trains locally for the round that `m` announces, from the current model, with the
    /// round's plan and the federation's policies, and returns the encoded update envelope.
    /// `tc.seed` is the site's seed; the round's is [`round_seed`]. Under `local` BN the update
    /// carries the trained BN tensors the sharing policy lets leave the site, as exact f32.
    /// The error-feedback residual it leaves behind takes effect when [`Site::answered`] reports
    /// the update accepted.
    pub fn train_round(
        &mut self,
        spec: &ModelSpec,
        federation: &Id,
        m: &RoundManifest,
        tc: &TrainConfig,
        device: &Device,
        progress: impl FnMut(TrainEvent),
    ) -> Result<Vec<u8>, SiteError> {
        let select = select_for(m.bn_policy);
        let base = export(&self.net, spec, select);
        let tc = TrainConfig {
            seed: round_seed(tc.seed, m.round),
            ..tc.clone()
        };
        let (net, rep) = train_objective(
            &self.net,
            &self.train,
            spec.classes.len(),
            &tc,
            &m.plan.objective,
            select,
            device,
            progress,
        )?;
        self.net = net;
        let d = delta(&export(&self.net, spec, select), &base)?;
        if let Some(t) = d
            .tensors
            .iter()
            .find(|t| t.data.iter().any(|v| !v.is_finite()))
        {
            return Err(SiteError::NonFinite(t.name.clone()));
        }
        let mut residual = self.residual.clone();
        let encoded = d
            .tensors
            .iter()
            .map(|t| {
                // Statistics carry no error feedback; everything else keeps its residual.
                let r = (!t.kind.is_bn_stat()).then(|| residual.entry(t.name.clone()).or_default());
                t.encode(encoding_for(t.kind, m.encoding), r)
            })
            .collect();
        let shared = if m.bn_policy == BnPolicy::Local {
            export(&self.net, spec, Select::Bn)
                .tensors
                .into_iter()
                .filter(|t| m.bn_sharing.shares(t.kind))
                .map(|t| t.encode(Encoding::F32, None))
                .collect()
        } else {
            Vec::new()
        };
        self.pending = Some((m.round, residual));
        let upd = SiteUpdate {
            round: m.round,
            base_version: m.model_version,
            samples: self.train.len() as u64,
            delta: encoded,
            bn: shared,
            report: LocalReport {
                local_steps: rep.steps as u64,
                train_loss: *rep.epoch_losses.last().unwrap_or(&f64::NAN),
            },
            extras: SiteExtras::None,
        };
        Ok(Envelope::new(
            MessageKind::SiteUpdate,
            federation.clone(),
            self.id.clone(),
            m.round,
            m.model_version,
            spec.hash(),
            &upd,
        )
        .encode())
    }

    /// The aggregator answered the update of `round`: an accepted update advances the
    /// error-feedback residual, a rejected one leaves it as it was.
    pub fn answered(&mut self, round: u64, accepted: bool) {
        if let Some((r, next)) = self.pending.take() {
            if r == round && accepted {
                self.residual = next;
            } else if r != round {
                self.pending = Some((r, next));
            }
        }
    }

    /// The error-feedback residual of tensor `name` as of the last accepted update (empty when
    /// nothing is left behind).
    pub fn residual(&self, name: &str) -> &[f32] {
        self.residual.get(name).map_or(&[], Vec::as_slice)
    }

    /// Writes the error-feedback residuals to `path` atomically, beside the site's checkpoint.
    pub fn save_residual(&self, path: &Path) -> Result<(), SiteError> {
        let mut bytes = RESIDUAL_MAGIC.to_vec();
        bytes.extend_from_slice(&RESIDUAL_VERSION.to_le_bytes());
        bytes.extend(postcard::to_allocvec(&self.residual).expect("residuals serialise"));
        Ok(crate::checkpoint::write_atomic(path, &bytes)?)
    }

    /// Reads the error-feedback residuals written by [`Site::save_residual`]; a missing file
    /// means none. Residuals whose name or length the spec does not know are refused.
    pub fn load_residual(&mut self, path: &Path, spec: &ModelSpec) -> Result<(), SiteError> {
        let bad = |m: String| SiteError::File {
            path: path.to_path_buf(),
            message: m,
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(bad(e.to_string())),
        };
        if bytes.len() < 8 || &bytes[..4] != RESIDUAL_MAGIC {
            return Err(bad("not a residual file".into()));
        }
        let v = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        if v != RESIDUAL_VERSION {
            return Err(bad(format!("format version {v} is not {RESIDUAL_VERSION}")));
        }
        let r: BTreeMap<String, Vec<f32>> =
            postcard::from_bytes(&bytes[8..]).map_err(|e| bad(e.to_string()))?;
        for (name, values) in &r {
            let ok = spec
                .tensors
                .iter()
                .any(|t| &t.name == name && (values.is_empty() || t.numel() == values.len()));
            if !ok {
                return Err(bad(format!(
                    "residual `{name}` does not fit the model spec"
                )));
            }
        }
        self.residual = r;
        self.pending = None;
        Ok(())
    }

    /// Test accuracy with the site's own model and BN statistics.
    pub fn evaluate(&self, spec: &ModelSpec, device: &Device) -> Result<EvalReport, SiteError> {
        Ok(evaluate(
            &self.net,
            &self.test,
            spec.classes.len(),
            256,
            device,
        )?)
    }
}
