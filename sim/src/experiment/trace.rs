//! FedImpro's trace of a run (Theorem 4.2): at two model versions, the middle and the last, the
//! gradient dissimilarity across sites of the head's gradient, `(1/M) sum_m ||g_m - mean||^2`,
//! of the real cross-entropy alone and of FedImpro's objective with one synthetic feature per
//! real sample drawn from the federation's Gaussians of that version. Each site's gradient is
//! taken at the model it evaluates, on 128 of its training images (the same ones for both
//! kinds), with BN normalising each batch by itself and storing nothing.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use unifed_models::decoupled::{Dissimilarity, head_gradients};
use unifed_models::site::Site;
use unifed_models::zoo::DigitsCnn;
use unifed_protocol::messages::{Downloaded, FeatureStats, ServerExtras};

/// Training images per site a gradient is taken on.
const SAMPLES: usize = 128;

/// One measured model version of a FedImpro run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FedImproRound {
    /// The model version (the round that made it).
    pub round: u64,
    /// The head's gradient dissimilarity of the real cross-entropy alone.
    pub real: f64,
    /// The same of FedImpro's objective (real and synthetic features, Eq. 6).
    pub mixed: f64,
    /// Sites measured.
    pub sites: usize,
}

/// What a FedImpro run's observer gathers for [`FedImproRound`]s.
pub(super) struct Trace {
    split: usize,
    versions: [u64; 2],
    seed: u64,
    gaussians: BTreeMap<u64, FeatureStats>,
    measured: BTreeMap<u64, (Dissimilarity, Dissimilarity)>,
}

impl Trace {
    /// A trace of a run of `rounds` rounds splitting at `split`, drawing with `seed`.
    pub(super) fn new(split: usize, rounds: u64, seed: u64) -> Self {
        Trace {
            split,
            versions: [(rounds / 2).max(1), rounds],
            seed,
            gaussians: BTreeMap::new(),
            measured: BTreeMap::new(),
        }
    }

    /// Keeps the federation's Gaussians of a measured `version` from its broadcast `payload`.
    pub(super) fn model(&mut self, version: u64, payload: &[u8]) {
        if !self.versions.contains(&version) {
            return;
        }
        let download = Downloaded::new(payload.to_vec(), false)
            .or_else(|_| Downloaded::new(payload.to_vec(), true));
        if let Ok(d) = download
            && let Ok(read) = d.read()
            && let ServerExtras::FeatureStats(s) = read.extras()
        {
            self.gaussians.insert(version, s.clone());
        }
    }

    /// Takes `site`'s head gradients at the model `version` it evaluates, if measured.
    pub(super) fn evaluated(&mut self, site: &Site<DigitsCnn>, version: u64) {
        let Some(global) = self.gaussians.get(&version) else {
            return;
        };
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        let mut idx: Vec<usize> = (0..site.train.len()).collect();
        idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(
            self.seed ^ version,
        ));
        idx.truncate(SAMPLES);
        let Ok(device) = unifed_models::backend::Backend::Flex.device() else {
            return;
        };
        // Each site draws its synthetic features from a stream of its own.
        let seed = unifed_models::site::round_seed(self.seed, version, site.id.as_str());
        if let Ok(Some((real, mixed))) = head_gradients(
            &site.net,
            &site.train,
            &idx,
            (self.split, global),
            seed,
            &device,
        ) {
            let m = self.measured.entry(version).or_default();
            m.0.add(&real);
            m.1.add(&mixed);
        }
    }

    /// The measured versions, in order.
    pub(super) fn rounds(&self) -> Vec<FedImproRound> {
        self.measured
            .iter()
            .filter_map(|(&round, (real, mixed))| {
                Some(FedImproRound {
                    round,
                    real: real.value()?,
                    mixed: mixed.value()?,
                    sites: real.sites(),
                })
            })
            .collect()
    }
}
