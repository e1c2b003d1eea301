//! Local objectives: the terms a federation's algorithm adds to a site's training. Each term is
//! applied to the gradients after backpropagation, not through autodiff over the whole model
//! (an autograd proximal term doubled the round time of our PyTorch reference).
//!
//! The round's plan names the objective ([`Objective`]); [`Term::new`] prepares it from the
//! model the site starts training from, and [`Term::apply`] adjusts each step's gradients.
//! MOON's term is the exception: its loss is a function of the representation the model is
//! training, so [`Term::contrast`] hands training a [`Contrast`] whose loss joins the
//! cross-entropy before backpropagation.

use crate::bn::BnPass;
use crate::decoupled::Decoupler;
pub use crate::error::TermError;
use crate::invariant::Intervener;
use crate::state::{Select, StateDict, Walker, burn_tensor};
use crate::zoo::Net;
use burn::module::{ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use std::collections::HashMap;
use unifed_protocol::Objective;

/// The trainable tensors a term covers, as they were when local training started (the round's
/// global model for every averaged tensor), keyed by parameter.
#[derive(Debug, Clone, Default)]
pub struct Reference {
    tensors: HashMap<ParamId, Tensor<1>>,
}

impl Reference {
    /// Snapshots the tensors of `net` that `scope` selects, leaving out BN running statistics
    /// (they are not trained by gradients).
    pub fn of<N: Net>(net: &N, scope: Select) -> Self {
        struct Snap {
            walk: Walker,
            scope: Select,
            out: HashMap<ParamId, Tensor<1>>,
        }
        impl ModuleVisitor for Snap {
            fn enter_module(&mut self, name: &str, container_type: &str) {
                self.walk.enter(name, container_type);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.walk.exit();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let (_, kind, _) = self.walk.current();
                if self.scope.keeps(kind) && !kind.is_bn_stat() {
                    let t = param.val().inner();
                    let n = t.dims().iter().product::<usize>();
                    self.out.insert(param.id, t.reshape([n]));
                }
            }
        }
        let mut snap = Snap {
            walk: Walker::default(),
            scope,
            out: HashMap::new(),
        };
        net.visit(&mut snap);
        Reference { tensors: snap.out }
    }

    /// The tensors of `values` (PyTorch names and layouts) placed on the parameters of `net`
    /// that `scope` selects, in burn's layout; BN running statistics and names `values` does
    /// not hold are left out.
    pub fn from_values<N: Net>(net: &N, values: &StateDict, scope: Select) -> Self {
        struct Place<'a, N: Net> {
            net: &'a N,
            walk: Walker,
            scope: Select,
            values: HashMap<&'a str, &'a crate::state::NamedTensor>,
            out: HashMap<ParamId, Tensor<1>>,
        }
        impl<N: Net> ModuleVisitor for Place<'_, N> {
            fn enter_module(&mut self, name: &str, container_type: &str) {
                self.walk.enter(name, container_type);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.walk.exit();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some((name, kind, linear_w)) = self.walk.kept(self.net, self.scope) else {
                    return;
                };
                if kind.is_bn_stat() {
                    return;
                }
                let Some(src) = self.values.get(name.as_str()) else {
                    return;
                };
                let w = param.val().inner();
                if src.shape.len() != D || src.data.len() != w.dims().iter().product::<usize>() {
                    return;
                }
                let t = burn_tensor::<D>(src, linear_w, &w.device());
                self.out.insert(param.id, t.reshape([src.data.len()]));
            }
        }
        let mut place = Place {
            net,
            walk: Walker::default(),
            scope,
            values: values
                .tensors
                .iter()
                .map(|t| (t.name.as_str(), t))
                .collect(),
            out: HashMap::new(),
        };
        net.visit(&mut place);
        Reference { tensors: place.out }
    }

    /// Number of tensors held.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when no tensor is held.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// Adds FedProx's gradient term `mu (w - w_ref)` (the gradient of `mu/2 ||w - w_ref||^2`) to
/// the gradient of every parameter of `net` that `reference` holds and `grads` has.
pub fn add_proximal<N: Net>(net: &N, grads: &mut GradientsParams, reference: &Reference, mu: f64) {
    struct Prox<'a> {
        grads: &'a mut GradientsParams,
        reference: &'a Reference,
        mu: f32,
    }
    impl ModuleVisitor for Prox<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(r) = self.reference.tensors.get(&param.id) else {
                return;
            };
            let Some(g) = self.grads.remove::<D>(param.id) else {
                return;
            };
            let w = param.val().inner();
            let r = r.clone().reshape(w.dims());
            self.grads
                .register(param.id, g + (w - r).mul_scalar(self.mu));
        }
    }
    net.visit(&mut Prox {
        grads,
        reference,
        mu: mu as f32,
    });
}

/// Adds SCAFFOLD's correction `c - c_i` (held in `correction`, by parameter) to the gradient of
/// every parameter of `net` that it holds and `grads` has: the step then follows
/// `g - c_i + c`.
pub fn add_correction<N: Net>(net: &N, grads: &mut GradientsParams, correction: &Reference) {
    struct Corr<'a> {
        grads: &'a mut GradientsParams,
        correction: &'a Reference,
    }
    impl ModuleVisitor for Corr<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(c) = self.correction.tensors.get(&param.id) else {
                return;
            };
            let Some(g) = self.grads.remove::<D>(param.id) else {
                return;
            };
            let c = c.clone().reshape(g.dims());
            self.grads.register(param.id, g + c);
        }
    }
    net.visit(&mut Corr { grads, correction });
}

/// The cosine similarity of each row of `x` with the same row of `y`, `[n, d] x [n, d] ->
/// [n, 1]`: each row divided by its L2 norm clamped at 1e-8 (PyTorch's `cosine_similarity`,
/// so an all-zero representation has similarity 0 instead of NaN).
pub fn cosine_rows(x: Tensor<2>, y: Tensor<2>) -> Tensor<2> {
    let unit = |t: Tensor<2>| {
        let norm = t.clone().powi_scalar(2).sum_dim(1).sqrt().clamp_min(1e-8);
        t / norm
    };
    (unit(x) * unit(y)).sum_dim(1)
}

/// MOON's model-contrastive loss (Li et al. 2021, eq. 3) of representations `z` (the model
/// being trained), `z_glob` (the round's starting model) and `z_prev` (the site's previous
/// local model), rows being samples: the mean over the batch of
/// `-log(e^(a/t) / (e^(a/t) + e^(b/t)))` with `a = cos(z, z_glob)`, `b = cos(z, z_prev)`,
/// computed as `softplus((b - a) / t)`. Shape `[1]`.
pub fn contrastive_loss(
    z: Tensor<2>,
    z_glob: Tensor<2>,
    z_prev: Tensor<2>,
    temperature: f64,
) -> Tensor<1> {
    let a = cosine_rows(z.clone(), z_glob);
    let b = cosine_rows(z, z_prev);
    burn::tensor::activation::softplus((b - a).div_scalar(temperature), 1.0).mean()
}

/// MOON's term prepared for one local training run: the round's starting model and the site's
/// previous local model, both frozen in inference mode (BN on their stored statistics), whose
/// representations of each batch anchor the contrastive loss.
#[derive(Debug, Clone)]
pub struct Contrast<N: Net> {
    mu: f64,
    temperature: f64,
    global: N,
    previous: N,
}

impl<N: Net> Contrast<N> {
    /// `mu` times the contrastive loss of `z`, the representation of the batch `x` by the model
    /// being trained (autodiff), against the two frozen models' representations of `x`, which
    /// are computed without autodiff and so enter the loss as constants.
    pub fn loss(&self, z: Tensor<2>, x: &Tensor<2>) -> Tensor<1> {
        let x = x.clone().inner();
        let z_glob = self.global.features(x.clone(), &mut BnPass::standard());
        let z_prev = self.previous.features(x, &mut BnPass::standard());
        contrastive_loss(z, z_glob, z_prev, self.temperature).mul_scalar(self.mu)
    }
}

/// An objective prepared for one local training run.
#[derive(Debug, Clone)]
pub enum Term<N: Net> {
    /// Nothing beyond the loss's own gradients.
    None,
    /// FedProx's proximal term toward the starting tensors.
    Proximal {
        /// The weight `mu`.
        mu: f64,
        /// The starting tensors.
        reference: Reference,
    },
    /// SCAFFOLD's control-variate correction `c - c_i`.
    Control {
        /// The correction, by parameter.
        correction: Reference,
    },
    /// MOON's model-contrastive loss.
    Contrastive(Contrast<N>),
    /// FedDC's drift penalty `alpha (w - (w_global - h_i))` beside SCAFFOLD's correction.
    Drift {
        /// The weight `alpha`.
        alpha: f64,
        /// The penalty's anchor `w_global - h_i`.
        anchor: Reference,
        /// The correction `c - c_i`, by parameter.
        correction: Reference,
    },
    /// Per-FedAvg's first-order meta-steps (two batches per step).
    Meta {
        /// The inner step size.
        alpha: f64,
        /// The outer step size.
        beta: f64,
    },
    /// FedCD's SCI: the site's mask on the representation and the gradient-matching penalty
    /// (`crate::invariant`).
    Invariant(Intervener),
    /// FedImpro's split model, per-class feature statistics and synthetic features
    /// (`crate::decoupled`).
    Decoupled(Decoupler),
}

/// What a site keeps between rounds that an objective may train against.
#[derive(Debug, Clone)]
pub struct SiteState<'a, N: Net> {
    /// SCAFFOLD's and FedDC's correction `c - c_i` (PyTorch names and layouts).
    pub correction: Option<&'a StateDict>,
    /// MOON's previous local model: the model the site trained in its last accepted round.
    pub previous: Option<N>,
    /// FedDC's anchor `w_global - h_i`: the starting tensors less the site's local drift
    /// (PyTorch names and layouts).
    pub anchor: Option<&'a StateDict>,
    /// FedCD's mask, penalty weight and federation mask gradient.
    pub intervener: Option<Intervener>,
    /// FedImpro's split, running statistics and federation Gaussians.
    pub decoupler: Option<Decoupler>,
}

impl<N: Net> Default for SiteState<'_, N> {
    fn default() -> Self {
        SiteState {
            correction: None,
            previous: None,
            anchor: None,
            intervener: None,
            decoupler: None,
        }
    }
}

impl<N: Net> Term<N> {
    /// Prepares `objective` for training that starts from `net`; `scope` selects the tensors
    /// the federation averages (a term covers the trainable ones among them). SCAFFOLD needs
    /// the site's correction; MOON trains on cross-entropy alone until the site has a previous
    /// local model. An objective that cannot be prepared is an error naming why.
    pub fn new(
        objective: &Objective,
        net: &N,
        scope: Select,
        state: SiteState<'_, N>,
    ) -> Result<Self, TermError> {
        objective.validate()?;
        Ok(match *objective {
            Objective::CrossEntropy => Term::None,
            // mu = 0 is FedAvg exactly: no term, no snapshot, the same bits.
            Objective::Proximal { mu: 0.0 } => Term::None,
            Objective::Proximal { mu } => Term::Proximal {
                mu,
                reference: Reference::of(net, scope),
            },
            Objective::Scaffold => {
                let values = state.correction.ok_or(TermError::Missing {
                    algorithm: "SCAFFOLD",
                    what: "the control-variate correction c - c_i",
                })?;
                Term::Control {
                    correction: Reference::from_values(net, values, scope),
                }
            }
            Objective::Drift { alpha } => {
                let (Some(correction), Some(anchor)) = (state.correction, state.anchor) else {
                    return Err(TermError::Missing {
                        algorithm: "FedDC",
                        what: "the correction c - c_i and the anchor w - h_i",
                    });
                };
                Term::Drift {
                    alpha,
                    anchor: Reference::from_values(net, anchor, scope),
                    correction: Reference::from_values(net, correction, scope),
                }
            }
            Objective::Meta { alpha, beta } => Term::Meta { alpha, beta },
            Objective::Invariant { .. } => {
                Term::Invariant(state.intervener.ok_or(TermError::Missing {
                    algorithm: "FedCD",
                    what: "the site's mask",
                })?)
            }
            Objective::Decoupled { .. } => {
                Term::Decoupled(state.decoupler.ok_or(TermError::Missing {
                    algorithm: "FedImpro",
                    what: "the split and the feature statistics",
                })?)
            }
            Objective::Contrastive { mu: 0.0, .. } => Term::None,
            Objective::Contrastive { mu, temperature } => match state.previous {
                // The paper's code: with no previous model the only logit is the positive
                // one, whose cross-entropy is 0.
                None => Term::None,
                Some(previous) => Term::Contrastive(Contrast {
                    mu,
                    temperature,
                    global: net.valid(),
                    previous: previous.valid(),
                }),
            },
        })
    }

    /// Adjusts one step's gradients of `net`.
    pub fn apply(&self, net: &N, grads: &mut GradientsParams) {
        match self {
            Term::None
            | Term::Contrastive(_)
            | Term::Meta { .. }
            | Term::Invariant(_)
            | Term::Decoupled(_) => {}
            Term::Proximal { mu, reference } => add_proximal(net, grads, reference, *mu),
            Term::Control { correction } => add_correction(net, grads, correction),
            Term::Drift {
                alpha,
                anchor,
                correction,
            } => {
                add_proximal(net, grads, anchor, *alpha);
                add_correction(net, grads, correction);
            }
        }
    }

    /// The loss term on the representation, if the objective has one (MOON).
    pub fn contrast(&self) -> Option<&Contrast<N>> {
        match self {
            Term::Contrastive(c) => Some(c),
            _ => None,
        }
    }

    /// FedCD's SCI, if the term is it: training masks the representation and adds its penalty.
    pub fn intervener(&self) -> Option<&Intervener> {
        match self {
            Term::Invariant(i) => Some(i),
            _ => None,
        }
    }

    /// FedImpro's term, if it is the objective: training splits the model and adds the
    /// synthetic features' loss.
    pub fn decoupler(&self) -> Option<&Decoupler> {
        match self {
            Term::Decoupled(d) => Some(d),
            _ => None,
        }
    }

    /// Per-FedAvg's inner and outer step sizes, if the term is its meta-steps.
    pub fn meta(&self) -> Option<(f64, f64)> {
        match self {
            Term::Meta { alpha, beta } => Some((*alpha, *beta)),
            _ => None,
        }
    }

    /// True when the term keeps a model-sized copy of the starting weights itself (FedProx's
    /// reference, MOON's frozen starting model, FedDC's anchor), so parking them in a file
    /// would save nothing.
    pub fn holds_start(&self) -> bool {
        matches!(
            self,
            Term::Proximal { .. } | Term::Contrastive(_) | Term::Drift { .. }
        )
    }
}
