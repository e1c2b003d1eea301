//! The weighted mean of spooled deltas, folded one update at a time in site order: memory is
//! O(model) and the result is bit-identical whatever order the updates arrived in.

/// Accumulates `sum_i w_i * delta_i` in f64 and the total weight.
#[derive(Debug, Clone)]
pub struct Fold {
    acc: Vec<Vec<f64>>,
    weight: f64,
    count: usize,
}

impl Fold {
    /// An empty fold for tensors of the given lengths.
    pub fn new(lens: &[usize]) -> Self {
        Fold {
            acc: lens.iter().map(|&n| vec![0.0; n]).collect(),
            weight: 0.0,
            count: 0,
        }
    }

    /// Adds one delta with weight `w`. The caller adds updates in site order.
    pub fn add(&mut self, w: f64, delta: &[Vec<f32>]) {
        self.add_scaled(w, &vec![w; delta.len()], delta);
    }

    /// Adds one delta with weight `w` in the total, its tensor `k` scaled by `coefs[k]` in the
    /// sum (`coefs` all `w`: [`Fold::add`]). The caller adds updates in site order.
    pub fn add_scaled(&mut self, w: f64, coefs: &[f64], delta: &[Vec<f32>]) {
        for (k, (d, &c)) in delta.iter().zip(coefs).take(self.acc.len()).enumerate() {
            let n = d.len().min(self.acc[k].len());
            self.add_block(k, 0, c, d[..n].iter().copied());
        }
        self.count_added(w);
    }

    /// Adds `coef` times `values` into tensor `k` from value `at` on: a block of a delta
    /// streamed from its file (the arithmetic of [`Fold::add_scaled`]). Returns false if a
    /// value is not finite (the fold is then of no use). Tensor `k` must hold the block.
    pub(crate) fn add_block(
        &mut self,
        k: usize,
        at: usize,
        coef: f64,
        values: impl ExactSizeIterator<Item = f32>,
    ) -> bool {
        let mut finite = true;
        let acc = &mut self.acc[k][at..at + values.len()];
        for (x, y) in acc.iter_mut().zip(values) {
            finite &= y.is_finite();
            *x += coef * y as f64;
        }
        finite
    }

    /// [`Fold::add_block`] of little-endian f32 `bytes`.
    pub(crate) fn add_le_block(&mut self, k: usize, at: usize, coef: f64, bytes: &[u8]) -> bool {
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        self.add_block(k, at, coef, values)
    }

    /// Counts one update of weight `w` whose values [`Fold::add_block`] added.
    pub(crate) fn count_added(&mut self, w: f64) {
        self.weight += w;
        self.count += 1;
    }

    /// The length of each tensor.
    pub(crate) fn lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.acc.iter().map(Vec::len)
    }

    /// The total weight folded so far.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// Number of updates folded.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The weighted mean `sum w_i d_i / sum w_i` in f64, or `None` when nothing was folded.
    pub fn mean(self) -> Option<Vec<Vec<f64>>> {
        if self.weight <= 0.0 {
            return None;
        }
        let w = self.weight;
        Some(
            self.acc
                .into_iter()
                .map(|a| a.into_iter().map(|s| s / w).collect())
                .collect(),
        )
    }
}
