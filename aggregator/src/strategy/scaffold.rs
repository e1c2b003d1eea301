//! SCAFFOLD (Karimireddy et al., Algorithm 1, option II), server side. Sites correct every
//! local step with `c - c_i` and report `Δy_i = y_i - x` and `Δc_i = c_i+ - c_i`; the server
//! moves
//!
//! ```text
//! x <- x + eta_g * sum w_i Δy_i / sum w_i      (FedAvg's weighted mean; eta_g = 1 by default)
//! c <- c + (1 / N) sum_{i in S} Δc_i           (S: the sites that reported, N: all sites)
//! ```
//!
//! so that `c` stays the mean of every site's `c_i` (a site that is not sampled, misses a round
//! or is rejected keeps its `c_i`, so its share of `c` is unchanged). `N` is the number of
//! registered sites; an open federation (no site list) counts the sites that have reported a
//! variate so far. When `N` changes (a site reports for the first time, or the site list was
//! edited between runs) `c` is re-weighted to the mean over the new set,
//! `c <- (N_old c + sum Δc_i) / N_new` (a new site's `c_i` starts at 0).
//!
//! A variate delta whose L2 norm exceeds `max_control_norm` is rejected: honest deltas are of
//! the size of a gradient, and one absurd (finite) delta would otherwise enter `c` and make every
//! site's corrected training diverge. It stops gross values, not a careful attacker (that takes
//! authenticated sites).
//!
//! The variates cover the trainable averaged tensors: non-BN under `local` BN, BN affine too
//! under `global`; BN running statistics never (under `global` they take the plain mean).

use super::{
    Contribution, Contributions, Extras, ReadError, Setup, Strategy, StrategyError, StrategyState,
    dense, exact, parameter, step_by,
};
use serde::{Deserialize, Serialize};
use unifed_protocol::TensorSpec;
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::{
    Objective, RejectReason, RoundPlan, ServerExtras, SiteExtras, SiteUpdateRef,
};

/// SCAFFOLD's server parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaffoldConfig {
    /// The global step size `eta_g` on the mean delta (1: the paper's experiments, FedAvg's
    /// mean).
    pub server_lr: f64,
    /// The largest L2 norm of a site's control-variate delta that is accepted.
    pub max_control_norm: f64,
}

impl Default for ScaffoldConfig {
    fn default() -> Self {
        ScaffoldConfig {
            server_lr: 1.0,
            max_control_norm: 1e4,
        }
    }
}

impl ScaffoldConfig {
    /// Checks every value, naming the bad one.
    pub fn validate(&self) -> Result<(), StrategyError> {
        for (name, v) in [
            ("server_lr", self.server_lr),
            ("max_control_norm", self.max_control_norm),
        ] {
            parameter(v.is_finite() && v > 0.0, name, "be positive and finite", v)?;
        }
        Ok(())
    }
}

/// The server's control-variate update: `c <- (n_old c + sum_i Δc_i) / n_new`, the sum over
/// the reporting sites in site order, in f64.
pub fn update_control(c: &mut [Vec<f32>], deltas: &[&[Vec<f32>]], n_old: usize, n_new: usize) {
    for (k, c) in c.iter_mut().enumerate() {
        for (e, c) in c.iter_mut().enumerate() {
            let sum: f64 = deltas.iter().map(|d| d[k][e] as f64).sum();
            *c = ((n_old as f64 * *c as f64 + sum) / n_new as f64) as f32;
        }
    }
}

/// The SCAFFOLD server.
#[derive(Debug, Clone, PartialEq)]
pub struct Scaffold {
    cfg: ScaffoldConfig,
    /// The trainable averaged tensors (the variates' layout).
    trainable: Vec<TensorSpec>,
    /// Per averaged tensor: trainable (stepped by `eta_g`) or a running statistic (mean).
    stepped: Vec<bool>,
    encoding: Encoding,
    /// Registered sites (0: open federation).
    registered: usize,
    c: Vec<Vec<f32>>,
    known: Vec<String>,
    /// The `N` that `c` is the mean over.
    n: u64,
}

impl Scaffold {
    /// A SCAFFOLD server for `setup`, resuming from `state` (`c = 0` when `None`).
    pub fn new(
        cfg: ScaffoldConfig,
        setup: &Setup,
        state: Option<StrategyState>,
    ) -> Result<Self, StrategyError> {
        cfg.validate()?;
        let (c, known, n) = match state {
            Some(StrategyState::Scaffold { c, known, n }) => {
                setup.check_shapes("control variate", &c)?;
                (c, known, n)
            }
            None => (setup.zeros(), Vec::new(), 0),
            Some(other) => {
                return Err(StrategyError::StateOfAnother {
                    stored: other.name(),
                    algorithm: "scaffold",
                });
            }
        };
        Ok(Scaffold {
            cfg,
            trainable: setup.trainable().cloned().collect(),
            stepped: setup.trained(),
            encoding: setup.encoding,
            registered: setup.sites,
            c,
            known,
            n,
        })
    }

    /// The `N` that `c` averages over now.
    pub(crate) fn sites(&self) -> u64 {
        if self.registered > 0 {
            self.registered as u64
        } else {
            self.known.len() as u64
        }
    }

    /// The server control variate, in trainable-tensor order.
    pub fn control(&self) -> &[Vec<f32>] {
        &self.c
    }

    /// Steps `model` by the round's weighted mean delta (`eta_g` on trained tensors, the plain
    /// mean on running statistics); false when nothing carried weight.
    pub(crate) fn step_mean(
        &self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<bool, ReadError> {
        let Some(mean) = round.mean_delta(&super::lens(model))? else {
            return Ok(false);
        };
        for ((x, d), &stepped) in model.iter_mut().zip(&mean).zip(&self.stepped) {
            step_by(x, d, if stepped { self.cfg.server_lr } else { 1.0 });
        }
        Ok(true)
    }

    /// Moves the control variate by every reporting site's Δc_i, in site order (one spooled
    /// under another layout, e.g. before the BN policy was edited, is left out), in one read of
    /// the spool that also hands each contribution to `visit` (FedDC sums the deltas there).
    pub(crate) fn fold_controls(
        &mut self,
        round: &dyn Contributions,
        mut visit: impl FnMut(&str, &Contribution),
    ) -> Result<(), ReadError> {
        let shape: Vec<usize> = self.c.iter().map(Vec::len).collect();
        let mut deltas: Vec<Vec<Vec<f32>>> = Vec::new();
        for c in round.iter() {
            let (site, c) = c?;
            visit(site, &c);
            match c.extras {
                Extras::Control(dc) if dc.iter().map(Vec::len).eq(shape.iter().copied()) => {
                    deltas.push(dc);
                    if self.registered == 0
                        && let Err(at) = self.known.binary_search_by(|k| k.as_str().cmp(site))
                    {
                        self.known.insert(at, site.to_string());
                    }
                }
                _ => tracing::warn!(site, "a contribution without a fitting control variate"),
            }
        }
        let n_new = self.sites();
        if n_new > 0 && (!deltas.is_empty() || n_new != self.n) {
            let refs: Vec<&[Vec<f32>]> = deltas.iter().map(Vec::as_slice).collect();
            update_control(&mut self.c, &refs, self.n as usize, n_new as usize);
            self.n = n_new;
        }
        Ok(())
    }

    /// What the state keeps: `c`, the sites known so far and the `N` that `c` is the mean over.
    pub(crate) fn parts(&self) -> (Vec<Vec<f32>>, Vec<String>, u64) {
        (self.c.clone(), self.known.clone(), self.n)
    }
}

impl Strategy for Scaffold {
    fn plan(&self, _round: u64) -> RoundPlan {
        RoundPlan {
            objective: Objective::Scaffold,
        }
    }

    fn extras(&self) -> ServerExtras {
        ServerExtras::Control(exact(
            self.trainable.iter().zip(self.c.iter().map(Vec::as_slice)),
        ))
    }

    fn check(&self, update: &SiteUpdateRef<'_>) -> Result<Extras, RejectReason> {
        match &update.extras {
            SiteExtras::Control(tensors) => {
                let specs: Vec<&TensorSpec> = self.trainable.iter().collect();
                let dc = dense(&specs, tensors, self.encoding)?;
                let norm = dc
                    .iter()
                    .flatten()
                    .map(|&x| (x as f64) * (x as f64))
                    .sum::<f64>()
                    .sqrt();
                if norm > self.cfg.max_control_norm {
                    return Err(RejectReason::NormTooLarge {
                        norm,
                        bound: self.cfg.max_control_norm,
                    });
                }
                Ok(Extras::Control(dc))
            }
            SiteExtras::None | SiteExtras::MaskGradient { .. } | SiteExtras::FeatureStats(_) => {
                Err(RejectReason::UnexpectedExtras(
                    "no control variate, which this algorithm's rounds need".into(),
                ))
            }
        }
    }

    fn aggregate(
        &mut self,
        round: &dyn Contributions,
        model: &mut [&mut Vec<f32>],
    ) -> Result<(), ReadError> {
        if self.step_mean(round, model)? {
            self.fold_controls(round, |_, _| {})?;
        }
        Ok(())
    }

    fn state(&self) -> StrategyState {
        let (c, known, n) = self.parts();
        StrategyState::Scaffold { c, known, n }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_variate_moves_by_the_sum_of_deltas_over_all_sites() {
        // N = 4 registered, two report: c = [1, -2] + ([0.5, 1] + [1.5, -3]) / 4 = [1.5, -2.5].
        let mut c = vec![vec![1.0f32, -2.0]];
        let a = vec![vec![0.5f32, 1.0]];
        let b = vec![vec![1.5f32, -3.0]];
        update_control(&mut c, &[&a, &b], 4, 4);
        assert_eq!(c, vec![vec![1.5f32, -2.5]]);
    }

    #[test]
    fn an_open_federation_reweights_the_variate_when_a_site_joins() {
        // Two known sites with mean c = [2]; a third reports Δc = [3] for the first time:
        // c = (2*2 + 3) / 3 = 7/3, the mean of c_1 + c_2 = 4 and c_3 = 3.
        let mut c = vec![vec![2.0f32]];
        let d = vec![vec![3.0f32]];
        update_control(&mut c, &[&d], 2, 3);
        assert_eq!(c[0][0], (7.0f64 / 3.0) as f32);
    }
}
