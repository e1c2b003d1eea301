//! Pooling the BatchNorm tensors sites share under the BN sharing policies `affine` and
//! `affine+stats` into the BN layers of an onboarding package (FedBN appendix G: "averaged
//! trainable BN parameters"; UniFed section 3.2 for the statistics).
//!
//! Affine parameters and running means are weighted means. A running variance is pooled as the
//! variance of the sites' mixture, `sum w_i (var_i + (mean_i - mean)^2) / sum w_i`: the plain
//! mean of the variances would ignore how far apart the sites' means lie, and a new site's
//! images are better described by the spread of all sites than by a typical site's.

use unifed_protocol::{TensorKind, TensorSpec};

/// Pools the sites' shared BN tensors. `specs` names the shared tensors in the order each
/// site's list holds them; `sites` holds each site's weight and tensors, in site order. Sums
/// run in f64 in that order, so the result does not depend on arrival order. A running
/// variance whose running mean is not shared is averaged like any tensor.
pub fn pool(specs: &[&TensorSpec], sites: &[(f64, Vec<Vec<f32>>)]) -> Vec<Vec<f32>> {
    let total: f64 = sites.iter().map(|(w, _)| w).sum();
    let mean_of = |k: usize| -> Vec<f64> {
        let mut acc = vec![0.0f64; specs[k].numel()];
        for (w, t) in sites {
            for (a, &x) in acc.iter_mut().zip(&t[k]) {
                *a += w * x as f64;
            }
        }
        acc.iter_mut().for_each(|a| *a /= total);
        acc
    };
    specs
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let paired_mean = (s.kind == TensorKind::BnRunningVar)
                .then(|| s.name.strip_suffix("running_var"))
                .flatten()
                .and_then(|prefix| {
                    specs
                        .iter()
                        .position(|m| m.name == format!("{prefix}running_mean"))
                });
            match paired_mean {
                Some(m) => {
                    let mean = mean_of(m);
                    let mut acc = vec![0.0f64; s.numel()];
                    for (w, t) in sites {
                        for (i, a) in acc.iter_mut().enumerate() {
                            let d = t[m][i] as f64 - mean[i];
                            *a += w * (t[k][i] as f64 + d * d);
                        }
                    }
                    acc.iter().map(|a| (a / total) as f32).collect()
                }
                None => mean_of(k).into_iter().map(|x| x as f32).collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, kind: TensorKind) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape: vec![2],
            kind,
        }
    }

    #[test]
    fn means_are_weighted_and_variances_pooled_as_the_mixture() {
        let specs = [
            t("bn.weight", TensorKind::BnWeight),
            t("bn.running_mean", TensorKind::BnRunningMean),
            t("bn.running_var", TensorKind::BnRunningVar),
        ];
        let refs: Vec<&TensorSpec> = specs.iter().collect();
        let sites = vec![
            (1.0, vec![vec![1.0, 2.0], vec![0.0, 4.0], vec![1.0, 1.0]]),
            (3.0, vec![vec![5.0, 2.0], vec![4.0, 4.0], vec![3.0, 1.0]]),
        ];
        let out = pool(&refs, &sites);
        assert_eq!(out[0], vec![4.0, 2.0]);
        assert_eq!(out[1], vec![3.0, 4.0]);
        // Channel 0: (1*(1 + 9) + 3*(3 + 1)) / 4 = 5.5; channel 1: equal means, variance 1.
        assert_eq!(out[2], vec![5.5, 1.0]);
    }

    #[test]
    fn a_variance_without_its_mean_is_a_plain_weighted_mean() {
        let specs = [t("bn.running_var", TensorKind::BnRunningVar)];
        let out = pool(
            &[&specs[0]],
            &[(1.0, vec![vec![1.0, 2.0]]), (1.0, vec![vec![3.0, 2.0]])],
        );
        assert_eq!(out, vec![vec![2.0, 2.0]]);
    }
}
