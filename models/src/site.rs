//! One federated site: its own model (and so its own BatchNorm layers), data and
//! error-feedback residuals, speaking the wire protocol: it applies a server broadcast, trains
//! locally and encodes its update envelope. The agent service and the in-process runner share it.

use crate::backend::Device;
use crate::data::Dataset;
use crate::error::{StateError, TrainError};
use crate::state::{Select, delta, export, import};
use crate::train::{EvalReport, TrainConfig, TrainEvent, evaluate, train_local};
use crate::zoo::Net;
use std::collections::HashMap;
use unifed_protocol::encoding::Encoding;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{BnPolicy, Extras, Scalar, ServerBroadcast, SiteUpdate};
use unifed_protocol::{BnSharing, ModelSpec};

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
}

/// Which tensors travel under a BN policy.
pub fn select_for(bn: BnPolicy) -> Select {
    match bn {
        BnPolicy::Local => Select::NonBn,
        BnPolicy::Global => Select::All,
    }
}

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
    residual: HashMap<String, Vec<f32>>,
}

impl<N: Net> Site<N> {
    /// A site with its own copy of the initial model.
    pub fn new(id: &str, net: N, train: Dataset, test: Dataset) -> Result<Self, SiteError> {
        Ok(Site {
            id: Id::new(id).map_err(|e| SiteError::Id(id.to_string(), e.to_string()))?,
            net,
            train,
            test,
            residual: HashMap::new(),
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

    /// Trains locally from the current model (reporting to `progress`) and returns the encoded
    /// update envelope. Under `local` BN it carries the trained BN tensors that `sharing` lets
    /// leave the site, as exact f32 values.
    #[allow(clippy::too_many_arguments)]
    pub fn train_round(
        &mut self,
        spec: &ModelSpec,
        federation: &Id,
        round: u64,
        version: u64,
        tc: &TrainConfig,
        encoding: Encoding,
        bn: BnPolicy,
        sharing: BnSharing,
        device: &Device,
        progress: impl FnMut(TrainEvent),
    ) -> Result<Vec<u8>, SiteError> {
        let select = select_for(bn);
        let base = export(&self.net, spec, select);
        let (net, rep) = train_local(
            &self.net,
            &self.train,
            spec.classes.len(),
            tc,
            device,
            progress,
        )?;
        self.net = net;
        let d = delta(&export(&self.net, spec, select), &base)?;
        let encoded = d
            .tensors
            .iter()
            .map(|t| {
                t.encode(
                    encoding,
                    Some(self.residual.entry(t.name.clone()).or_default()),
                )
            })
            .collect();
        let shared = if bn == BnPolicy::Local {
            export(&self.net, spec, Select::Bn)
                .tensors
                .into_iter()
                .filter(|t| sharing.shares(t.kind))
                .map(|t| t.encode(Encoding::F32, None))
                .collect()
        } else {
            Vec::new()
        };
        let upd = SiteUpdate {
            round,
            base_version: version,
            samples: self.train.len() as u64,
            delta: encoded,
            bn: shared,
            extras: Extras {
                tensors: Vec::new(),
                scalars: vec![
                    Scalar {
                        name: "local_steps".into(),
                        value: rep.steps as f64,
                    },
                    Scalar {
                        name: "train_loss".into(),
                        value: *rep.epoch_losses.last().unwrap_or(&f64::NAN),
                    },
                ],
            },
        };
        Ok(Envelope::new(
            MessageKind::SiteUpdate,
            federation.clone(),
            self.id.clone(),
            round,
            version,
            spec.hash(),
            &upd,
        )
        .encode())
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
