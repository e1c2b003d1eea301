//! Splitting one domain's samples into several sites.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma};

/// How samples are spread over sites.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Partition {
    /// Uniformly at random, sizes differing by at most one.
    Iid,
    /// Label skew: each class is split over sites by proportions drawn from Dirichlet(alpha).
    Dirichlet {
        /// Concentration; small values give few classes per site.
        alpha: f64,
    },
}

/// Splits the sample indices `0..labels.len()` into `sites` disjoint sets covering all of them.
pub fn partition(
    labels: &[usize],
    sites: usize,
    how: Partition,
    seed: u64,
) -> Result<Vec<Vec<usize>>, PartitionError> {
    if sites == 0 {
        return Err(PartitionError::NoSites);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![Vec::new(); sites];
    match how {
        Partition::Iid => {
            let mut idx: Vec<usize> = (0..labels.len()).collect();
            idx.shuffle(&mut rng);
            for (k, i) in idx.into_iter().enumerate() {
                out[k % sites].push(i);
            }
        }
        Partition::Dirichlet { alpha } => {
            let gamma =
                Gamma::new(alpha, 1.0).map_err(|error| PartitionError::Alpha { alpha, error })?;
            let classes = labels.iter().copied().max().map_or(0, |m| m + 1);
            for c in 0..classes {
                let mut idx: Vec<usize> = (0..labels.len()).filter(|&i| labels[i] == c).collect();
                idx.shuffle(&mut rng);
                let w: Vec<f64> = (0..sites).map(|_| gamma.sample(&mut rng)).collect();
                let total: f64 = w.iter().sum();
                let mut start = 0usize;
                let mut acc = 0.0;
                for (s, wi) in w.iter().enumerate() {
                    acc += wi / total;
                    let end = if s + 1 == sites {
                        idx.len()
                    } else {
                        ((acc * idx.len() as f64).round() as usize).min(idx.len())
                    };
                    out[s].extend_from_slice(&idx[start..end.max(start)]);
                    start = end.max(start);
                }
            }
        }
    }
    for site in &mut out {
        site.sort_unstable();
    }
    Ok(out)
}

/// Why samples cannot be split by [`partition`].
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum PartitionError {
    /// Zero sites were asked for.
    #[error("the number of sites must be at least 1")]
    NoSites,
    /// The Dirichlet concentration is not positive (or not a number).
    #[error("Dirichlet alpha {alpha} is invalid: {error}")]
    Alpha {
        /// The concentration given.
        alpha: f64,
        /// Why the Gamma distribution refused it.
        error: rand_distr::GammaError,
    },
}

impl From<PartitionError> for String {
    fn from(e: PartitionError) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iid_covers_every_sample_once_with_balanced_sizes() {
        let labels: Vec<usize> = (0..103).map(|i| i % 10).collect();
        let parts = partition(&labels, 4, Partition::Iid, 7).unwrap();
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        assert_eq!(all, (0..103).collect::<Vec<_>>());
        assert!(parts.iter().all(|p| p.len() == 25 || p.len() == 26));
    }

    #[test]
    fn small_alpha_skews_labels_and_is_deterministic() {
        let labels: Vec<usize> = (0..1000).map(|i| i % 10).collect();
        let a = partition(&labels, 5, Partition::Dirichlet { alpha: 0.1 }, 3).unwrap();
        assert_eq!(
            a,
            partition(&labels, 5, Partition::Dirichlet { alpha: 0.1 }, 3).unwrap()
        );
        let mut all: Vec<usize> = a.concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
        // With alpha 0.1 most sites hold a few dominant classes: the largest class share of
        // some site is far above the iid 10%.
        let max_share = a
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| {
                let mut c = [0usize; 10];
                p.iter().for_each(|&i| c[labels[i]] += 1);
                *c.iter().max().unwrap() as f64 / p.len() as f64
            })
            .fold(0.0, f64::max);
        assert!(max_share > 0.4, "max class share {max_share}");
        assert!(matches!(
            partition(&labels, 5, Partition::Dirichlet { alpha: -1.0 }, 3),
            Err(PartitionError::Alpha { alpha, .. }) if alpha == -1.0
        ));
    }

    #[test]
    fn zero_sites_are_refused() {
        let err = partition(&[0, 1, 2], 0, Partition::Iid, 0).unwrap_err();
        assert_eq!(err, PartitionError::NoSites);
        assert_eq!(String::from(err), "the number of sites must be at least 1");
    }
}
