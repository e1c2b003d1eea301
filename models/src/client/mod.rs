//! Client algorithms: what a federation's algorithm does on a site around local training, one
//! module per algorithm, chosen by the round's plan ([`for_plan`]), never by flags. A module
//! keeps its typed state in [`ClientState`] (persisted with the site's checkpoint, the site's
//! mirror of the server's `StrategyState`), supplies what its objective's term
//! ([`crate::objective::Term`]) needs from that state, says what the update carries beside the
//! delta, and how its state advances once the update is accepted.
//!
//! | plan (`Objective`) | module | state |
//! |---|---|---|
//! | `CrossEntropy`, `Proximal` | [`plain`] (FedAvg, FedBN, FedProx, FedOpt, FedNova) | none |
//! | `Scaffold` | [`scaffold`] | `c_i` and the server's `c` |
//! | `Contrastive` | [`moon`] | the previous local model |
//! | `Drift` | [`feddc`] | `c_i`, the server's `c` and the drift `h_i` |
//! | `Meta` | [`perfedavg`] (personalises before it evaluates) | none |
//! | `Invariant` | [`fedcd`] (masks its representation) | its mask, the server's mask gradient |
//! | `Decoupled` | [`fedimpro`] (splits its model) | its feature statistics, the server's |

pub mod fedcd;
pub mod feddc;
pub mod fedimpro;
pub mod moon;
pub mod perfedavg;
pub mod plain;
pub mod scaffold;

use crate::backend::Device;
use crate::data::Dataset;
use crate::decoupled::Decoupler;
use crate::error::SiteError;
use crate::invariant::Intervener;
use crate::objective::SiteState;
use crate::state::{Select, StateDict};
use crate::train::{TrainConfig, TrainReport};
use crate::zoo::Net;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use unifed_protocol::ModelSpec;
use unifed_protocol::encoding::EncodedTensorRef;
use unifed_protocol::messages::{FeatureStats, Objective, RoundManifest, ServerExtras, SiteExtras};

/// Tensors by name.
pub type Tensors = BTreeMap<String, Vec<f32>>;

/// Tensors by name, with the model version they are of.
pub type Versioned = (u64, Tensors);

/// SCAFFOLD's variates on a site (FedDC's too).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Controls {
    /// The site's control variate `c_i` as the server knows it (its accepted deltas summed);
    /// absent tensors are zero.
    pub control: Tensors,
    /// The server control variate `c` of the model version applied last, and that version.
    pub server: Option<Versioned>,
}

/// What a site's algorithm carries from round to round, one variant per algorithm that keeps
/// anything (the site's mirror of the server's `StrategyState`). Persisted with the site's
/// checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum ClientState {
    /// Nothing (FedAvg, FedBN, FedProx, FedOpt, FedNova, Per-FedAvg).
    #[default]
    Stateless,
    /// SCAFFOLD's variates.
    Scaffold(Controls),
    /// MOON's previous local model: every tensor of the model the site trained in its last
    /// accepted round, BN included (`None` before the first).
    Moon {
        /// The previous local model.
        previous: Option<Tensors>,
    },
    /// FedDC's variates and local drift.
    FedDc {
        /// SCAFFOLD's variates.
        controls: Controls,
        /// The local drift `h_i`: the sum of the site's accepted deltas as the server decoded
        /// them, per trainable averaged tensor; absent tensors are zero.
        drift: Tensors,
    },
    /// FedCD's mask and the federation's mask gradient.
    FedCd {
        /// The site's mask on its representation, as of its last accepted update (`None`:
        /// all ones, the paper's start).
        mask: Option<Vec<f32>>,
        /// The federation's mask gradient `g_g` that came with the model version applied last,
        /// and that version (no tensor: none came, before the first round closed).
        server: Option<Versioned>,
    },
    /// FedImpro's running feature statistics and the federation's Gaussians.
    FedImpro {
        /// The site's running per-class statistics of its low-level features, as of its last
        /// accepted update (`None` before its first), and the split they are of.
        local: Option<(u32, FeatureStats)>,
        /// The federation's per-class Gaussians that came with the model version applied
        /// last, and that version (`None` inside: none came, before the first round closed).
        server: Option<(u64, Option<FeatureStats>)>,
    },
}

/// What a client algorithm keeps of what the server sent beside a model version
/// ([`ClientAlgorithm::received`]), typed by algorithm.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// Tensors by name (SCAFFOLD's and FedDC's control variate, FedCD's mask gradient).
    Tensors(Versioned),
    /// FedImpro's per-class Gaussians of the version (`None`: none yet).
    FeatureStats(u64, Option<FeatureStats>),
}

impl ClientState {
    /// The state a checkpoint written before client states were typed held in its separate
    /// fields (all but those of one algorithm empty).
    pub fn from_fields(
        control: Tensors,
        server: Option<Versioned>,
        previous: Option<Tensors>,
        drift: Tensors,
    ) -> ClientState {
        let controls = Controls { control, server };
        if previous.is_some() {
            ClientState::Moon { previous }
        } else if !drift.is_empty() {
            ClientState::FedDc { controls, drift }
        } else if controls != Controls::default() {
            ClientState::Scaffold(controls)
        } else {
            ClientState::Stateless
        }
    }

    /// SCAFFOLD's variates, if the algorithm keeps them.
    pub fn controls(&self) -> Option<&Controls> {
        match self {
            ClientState::Scaffold(c) | ClientState::FedDc { controls: c, .. } => Some(c),
            _ => None,
        }
    }

    fn controls_mut(&mut self) -> Option<&mut Controls> {
        match self {
            ClientState::Scaffold(c) | ClientState::FedDc { controls: c, .. } => Some(c),
            _ => None,
        }
    }

    /// MOON's previous local model, if the site has one.
    pub fn previous(&self) -> Option<&Tensors> {
        match self {
            ClientState::Moon { previous } => previous.as_ref(),
            _ => None,
        }
    }

    /// FedDC's drift, if the algorithm keeps one.
    pub fn drift(&self) -> Option<&Tensors> {
        match self {
            ClientState::FedDc { drift, .. } => Some(drift),
            _ => None,
        }
    }

    /// What the server sent beside the model applied last, where the state keeps it.
    fn server_mut(&mut self) -> Option<&mut Option<Versioned>> {
        match self {
            ClientState::FedCd { server, .. } => Some(server),
            other => other.controls_mut().map(|c| &mut c.server),
        }
    }

    /// Sets what the server sent beside the model just applied ([`ClientAlgorithm::received`]:
    /// SCAFFOLD's control variate, FedCD's mask gradient, FedImpro's Gaussians), where the
    /// state keeps it.
    pub(crate) fn set_server(&mut self, received: Option<Received>) {
        if let ClientState::FedImpro { server, .. } = self {
            *server = match received {
                Some(Received::FeatureStats(v, s)) => Some((v, s)),
                _ => None,
            };
        } else if let Some(s) = self.server_mut() {
            *s = match received {
                Some(Received::Tensors(t)) => Some(t),
                _ => None,
            };
        }
    }

    /// Takes what an accepted update advanced (`next`), keeping what the server sent beside
    /// the model applied last (a newer model may have come since the update was made).
    pub(crate) fn accept(&mut self, mut next: ClientState) {
        if let (ClientState::FedImpro { server: held, .. }, ClientState::FedImpro { server, .. }) =
            (&mut *self, &mut next)
        {
            *server = held.take();
        }
        let server = self.server_mut().and_then(Option::take);
        if let Some(s) = next.server_mut() {
            *s = server;
        }
        *self = next;
    }

    /// Every model tensor it holds, by name, in one fixed order (for checks against the spec;
    /// FedCD's vectors, of the head's width, are checked by [`fedcd::check`]).
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&String, &Vec<f32>)> {
        let controls = self.controls();
        controls
            .into_iter()
            .flat_map(|c| c.control.iter().chain(c.server.iter().flat_map(|(_, s)| s)))
            .chain(self.previous().into_iter().flatten())
            .chain(self.drift().into_iter().flatten())
    }

    /// Every tensor's values, in [`ClientState::tensors`]'s order (for parking them in a file).
    pub(crate) fn values_mut(&mut self) -> Box<dyn Iterator<Item = &mut Vec<f32>> + '_> {
        fn controls(c: &mut Controls) -> impl Iterator<Item = &mut Vec<f32>> {
            let server = c.server.iter_mut().flat_map(|(_, s)| s.values_mut());
            c.control.values_mut().chain(server)
        }
        match self {
            ClientState::Stateless => Box::new(std::iter::empty()),
            ClientState::Scaffold(c) => Box::new(controls(c)),
            ClientState::Moon { previous } => {
                Box::new(previous.iter_mut().flat_map(|p| p.values_mut()))
            }
            ClientState::FedDc { controls: c, drift } => {
                Box::new(controls(c).chain(drift.values_mut()))
            }
            ClientState::FedCd { mask, server } => Box::new(
                mask.iter_mut()
                    .chain(server.iter_mut().flat_map(|(_, s)| s.values_mut())),
            ),
            // A few per-class vectors, kept in memory.
            ClientState::FedImpro { .. } => Box::new(std::iter::empty()),
        }
    }
}

/// What a client algorithm reads before the site trains.
pub struct Before<'a, N: Net> {
    /// The site's model as the round starts.
    pub net: &'a N,
    /// The model's spec.
    pub spec: &'a ModelSpec,
    /// The tensors the federation averages.
    pub select: Select,
    /// The round.
    pub manifest: &'a RoundManifest,
    /// The algorithm's state.
    pub state: &'a ClientState,
}

/// What the objective's term needs from the state, owned ([`Inputs::site_state`] lends it).
pub struct Inputs<N: Net> {
    /// SCAFFOLD's (and FedDC's) correction `c - c_i`.
    pub correction: Option<StateDict>,
    /// MOON's previous local model.
    pub previous: Option<N>,
    /// FedDC's anchor `w - h_i`.
    pub anchor: Option<StateDict>,
    /// FedCD's mask and the federation's mask gradient.
    pub intervener: Option<Intervener>,
    /// FedImpro's split, running statistics and the federation's Gaussians.
    pub decoupler: Option<Decoupler>,
}

impl<N: Net> Default for Inputs<N> {
    fn default() -> Self {
        Inputs {
            correction: None,
            previous: None,
            anchor: None,
            intervener: None,
            decoupler: None,
        }
    }
}

impl<N: Net> Inputs<N> {
    /// The inputs as the term takes them (the previous model moves into it).
    pub fn site_state(&mut self) -> SiteState<'_, N> {
        SiteState {
            correction: self.correction.as_ref(),
            previous: self.previous.take(),
            anchor: self.anchor.as_ref(),
            intervener: self.intervener.take(),
            decoupler: self.decoupler.take(),
        }
    }
}

/// What a client algorithm reads once the site has trained and made its delta.
pub struct After<'a, N: Net> {
    /// The trained model.
    pub net: &'a N,
    /// The model's spec.
    pub spec: &'a ModelSpec,
    /// The update's delta (`y_i - x`), before its encoding.
    pub delta: &'a StateDict,
    /// Local optimiser steps taken.
    pub steps: usize,
    /// The effective learning rate of a step (`lr / (1 - momentum)`).
    pub lr: f64,
    /// Training's report (FedCD's trained mask, mask gradient and risk are in it).
    pub report: &'a TrainReport,
    /// The round.
    pub manifest: &'a RoundManifest,
    /// The algorithm's state as the round started.
    pub state: &'a ClientState,
}

/// One algorithm's part on a site. Every hook but [`ClientAlgorithm::adopt`] has the default
/// of an algorithm that keeps nothing and sends nothing beside the delta.
pub trait ClientAlgorithm<N: Net> {
    /// The state this algorithm keeps, made from what the site holds: its own kept, parts it
    /// shares with another algorithm's taken over (FedDC takes SCAFFOLD's variates), anything
    /// else started afresh.
    fn adopt(&self, held: ClientState) -> ClientState;

    /// Checks what the server sent beside model `version` (the download's extras) against the
    /// round's plan, before the site applies anything, and returns what the state keeps of it
    /// ([`ClientState::set_server`]). Extras the algorithm does not use are
    /// [`SiteError::Plan`].
    fn received(
        &self,
        _spec: &ModelSpec,
        _select: Select,
        m: &RoundManifest,
        _version: u64,
        extras: &ServerExtras,
    ) -> Result<Option<Received>, SiteError> {
        match extras {
            ServerExtras::None => Ok(None),
            _ => Err(SiteError::Plan {
                round: m.round,
                message: "algorithm tensors beside the model that the plan does not ask for".into(),
            }),
        }
    }

    /// What the objective's term needs from the state before training (a missing part the
    /// round needs is [`SiteError::Plan`]).
    fn inputs(&self, _before: &Before<'_, N>) -> Result<Inputs<N>, SiteError> {
        Ok(Inputs::default())
    }

    /// False when the algorithm makes something of the delta besides the update (its extras,
    /// its next state): the update is then never streamed from the trained model alone.
    fn streams_update(&self) -> bool {
        true
    }

    /// The extras the update carries, and the state an accepted update leaves behind.
    fn after_delta(&self, _after: &After<'_, N>) -> Result<(SiteExtras, ClientState), SiteError> {
        Ok((SiteExtras::None, ClientState::Stateless))
    }

    /// Advances `next` by the update's delta as encoded (what the server decodes).
    fn after_encoding(
        &self,
        _spec: &ModelSpec,
        _encoded: &[EncodedTensorRef<'_>],
        _next: &mut ClientState,
    ) -> Result<(), SiteError> {
        Ok(())
    }

    /// The per-feature scale the site applies to its representation before the head, in
    /// training and evaluation alike (FedCD's mask); `None`: none.
    fn representation_mask(&self, _state: &ClientState) -> Option<Vec<f32>> {
        None
    }

    /// The model the site evaluates in place of `net`, when the algorithm personalises it
    /// first (Per-FedAvg); `None`: `net` itself.
    fn personalise(
        &self,
        _net: &N,
        _train: &Dataset,
        _classes: usize,
        _tc: &TrainConfig,
        _device: &Device,
    ) -> Result<Option<N>, SiteError> {
        Ok(None)
    }
}

/// The client algorithm the plan's objective names.
pub fn for_plan<N: Net>(objective: &Objective) -> Box<dyn ClientAlgorithm<N>> {
    match *objective {
        Objective::CrossEntropy | Objective::Proximal { .. } => Box::new(plain::Plain),
        Objective::Scaffold => Box::new(scaffold::Scaffold),
        Objective::Contrastive { .. } => Box::new(moon::Moon),
        Objective::Drift { .. } => Box::new(feddc::FedDc),
        Objective::Meta { alpha, .. } => Box::new(perfedavg::PerFedAvg { alpha }),
        Objective::Invariant { lambda } => Box::new(fedcd::FedCd { lambda }),
        Objective::Decoupled { split, beta, noise } => {
            Box::new(fedimpro::FedImpro { split, beta, noise })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> Tensors {
        [("w".to_string(), vec![v])].into()
    }

    #[test]
    fn a_state_of_separate_fields_becomes_the_one_algorithm_it_holds() {
        assert_eq!(
            ClientState::from_fields(Tensors::new(), None, None, Tensors::new()),
            ClientState::Stateless
        );
        assert_eq!(
            ClientState::from_fields(t(1.0), Some((3, t(2.0))), None, Tensors::new()),
            ClientState::Scaffold(Controls {
                control: t(1.0),
                server: Some((3, t(2.0)))
            })
        );
        assert!(matches!(
            ClientState::from_fields(t(1.0), None, None, t(4.0)),
            ClientState::FedDc { drift, .. } if drift == t(4.0)
        ));
        assert_eq!(
            ClientState::from_fields(Tensors::new(), None, Some(t(5.0)), Tensors::new()).previous(),
            Some(&t(5.0))
        );
    }

    #[test]
    fn an_accepted_state_keeps_the_server_variate_applied_since() {
        let mut held = ClientState::Scaffold(Controls {
            control: t(1.0),
            server: Some((7, t(9.0))),
        });
        let next = ClientState::Scaffold(Controls {
            control: t(2.0),
            server: None,
        });
        held.accept(next);
        assert_eq!(
            held,
            ClientState::Scaffold(Controls {
                control: t(2.0),
                server: Some((7, t(9.0)))
            })
        );
        let values: Vec<f32> = held.values_mut().map(|v| v[0]).collect();
        let names: Vec<f32> = held.tensors().map(|(_, v)| v[0]).collect();
        assert_eq!((values, names), (vec![2.0, 9.0], vec![2.0, 9.0]));
    }
}
