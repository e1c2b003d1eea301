//! A closed round's contributions as the spool holds them ([`SpoolRound`], the
//! [`Contributions`] strategies read), and the fold of its files into the weighted mean: an
//! update at a time ([`fold_one`]), or every file at once by value range on several threads
//! ([`fold_round`]). The store keeps the files; this module only reads them. A round's
//! [`CohortBounds`] cap each site's weight and clip each delta's norm relative to the round's
//! lower-median claim, so no site's share of the mean rests on what it says of itself.

use crate::config::Weighting;
use crate::disk::{StoreError, corrupt, io};
use crate::fold::Fold;
use crate::sealed::{SpooledTensor, read_open};
use crate::spoolfile::{self, Placed};
use crate::store::{Store, footer_fits, footer_sound, spool_head};
use crate::strategy::{Contribution, Contributions, Extras, ReadError};
use std::fs::File;

/// Values of every update summed at a time by [`fold_round`]: 16 Ki (128 KiB of
/// sums, 64 KiB read per file), small enough for a core's cache, large enough that a read of
/// each file costs little against its sums.
pub const ROUND_BLOCK: usize = 16 << 10;

/// The most threads [`fold_round`] reads a round's files on: past about eight, a
/// fold of page-cached files is bound by memory bandwidth rather than cores.
pub const FOLD_THREADS: usize = 8;

/// A piece of [`fold_round`]'s work: check file `j`'s sum, or fold value ranges
/// (tensor in file order, first value, its targets) of every file.
enum FoldTask<'t, T> {
    Verify(usize),
    Fold(Vec<(usize, usize, &'t mut [T])>),
}

/// How far a round trusts what a site says of its own update, relative to the round's
/// cohort: its weight counts at most `weight_of_median` times the round's lower-median claimed
/// sample count, and its delta is scaled down to at most `norm_of_median` times the round's
/// lower-median update norm (direction kept). The lower median (the smaller middle value of an
/// even count) is one an attacker cannot raise while the honest sites are at least half of
/// the round, and with two sites it is the smaller one. Infinite ratios turn a bound off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CohortBounds {
    /// Largest weight, as a multiple of the round's lower-median claimed sample count.
    pub weight_of_median: f64,
    /// Largest update norm, as a multiple of the round's lower-median update norm.
    pub norm_of_median: f64,
}

/// What a round takes of one site's update under its [`CohortBounds`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Take {
    /// The sample count the update claimed.
    pub claimed: u64,
    /// The sample count its weight counts: the claim, capped.
    pub samples: u64,
    /// The L2 norm of its delta as sent.
    pub norm: f64,
    /// The factor its delta is scaled by (1: as sent).
    pub scale: f64,
}

impl Take {
    /// Whether the bounds changed anything of the update.
    pub fn bounded(&self) -> bool {
        self.samples != self.claimed || self.scale != 1.0
    }
}

impl CohortBounds {
    /// No bound: every update counts as it claims.
    pub const OFF: CohortBounds = CohortBounds {
        weight_of_median: f64::INFINITY,
        norm_of_median: f64::INFINITY,
    };

    /// What a round whose updates claim `(samples, norm)` each takes of each, in that order.
    pub fn takes(&self, claims: &[(u64, f64)]) -> Vec<Take> {
        let lower_median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len().saturating_sub(1) / 2).copied()
        };
        let cap = lower_median(claims.iter().map(|c| c.0 as f64).collect())
            .filter(|_| self.weight_of_median.is_finite())
            .map_or(u64::MAX, |m| {
                (m * self.weight_of_median).floor().max(1.0) as u64
            });
        let bound = lower_median(claims.iter().map(|c| c.1).collect())
            .filter(|_| self.norm_of_median.is_finite())
            .map(|m| m * self.norm_of_median);
        claims
            .iter()
            .map(|&(claimed, norm)| Take {
                claimed,
                samples: claimed.min(cap),
                norm,
                scale: match bound {
                    Some(b) if norm > b => b / norm,
                    _ => 1.0,
                },
            })
            .collect()
    }
}

/// A delta value scaled by a [`Take`]'s factor, rounded to f32 as the update's values are:
/// what [`SpoolRound`]'s reads and its folds both use, so they agree bit for bit.
fn scaled(v: f32, scale: f64) -> f32 {
    (v as f64 * scale) as f32
}

/// A closed round's spooled contributions in site order, read from the store's files, under
/// the round's [`CohortBounds`] when it was made by [`SpoolRound::bounded`].
#[derive(Debug)]
pub struct SpoolRound<'a> {
    store: &'a Store,
    round: u64,
    sites: Vec<String>,
    weighting: Weighting,
    /// What the round takes of each site's update, in site order (empty: all of each).
    takes: Vec<Take>,
}

impl<'a> SpoolRound<'a> {
    /// The contributions of `sites` (sorted) to `round` in `store`, each as it was sent.
    pub fn new(store: &'a Store, round: u64, sites: Vec<String>, weighting: Weighting) -> Self {
        SpoolRound {
            store,
            round,
            sites,
            weighting,
            takes: Vec::new(),
        }
    }

    /// The contributions of `sites` (sorted) to `round` in `store` under `bounds`, computed
    /// from the claims in the files' footers (each file is checked whole when it is read).
    /// The weight of a site for which `vouched` is true (one enrolled with its sample count)
    /// counts as claimed, whatever the round's median: admission held it to that count.
    pub fn bounded(
        store: &'a Store,
        round: u64,
        (sites, vouched): (Vec<String>, impl Fn(&str) -> bool),
        weighting: Weighting,
        bounds: CohortBounds,
    ) -> Result<Self, StoreError> {
        let claims = sites
            .iter()
            .map(|s| store.spool_claim(round, s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut takes = bounds.takes(&claims);
        for (t, s) in takes.iter_mut().zip(&sites) {
            if vouched(s) {
                t.samples = t.claimed;
            }
        }
        let mut round = SpoolRound::new(store, round, sites, weighting);
        round.takes = takes;
        Ok(round)
    }

    /// What the round takes of each site's update, in site order (empty when unbounded).
    pub fn takes(&self) -> &[Take] {
        &self.takes
    }

    /// The [`Take`] of `site`, when the round is bounded.
    fn take_of(&self, site: &str) -> Option<&Take> {
        let i = self.sites.iter().position(|s| s == site)?;
        self.takes.get(i)
    }

    /// The sample count the weight of the `i`th site's update of `samples` counts: capped as
    /// its [`Take`] says.
    fn counted(&self, i: usize, samples: u64) -> u64 {
        self.takes
            .get(i)
            .map_or(samples, |t| samples.min(t.samples))
    }

    /// [`SpoolRound::counted`] of `site`'s update.
    fn counted_of(&self, site: &str, samples: u64) -> u64 {
        self.take_of(site)
            .map_or(samples, |t| samples.min(t.samples))
    }

    /// The factor each site's delta is scaled by, in site order.
    fn scales(&self) -> Vec<f64> {
        (0..self.sites.len())
            .map(|i| self.takes.get(i).map_or(1.0, |t| t.scale))
            .collect()
    }

    /// The weighted mean handed on as [`Contributions::mean_delta_into`] says, into targets of
    /// any type: every file at once when the round's files are exact ([`fold_round`]), an
    /// update at a time into sums of the model's size otherwise ([`fold_one`]).
    fn mean_into<T: Send>(
        &self,
        targets: &mut [&mut [T]],
        each: impl Fn(&mut [T], &[f64]) + Sync,
    ) -> Result<bool, StoreError> {
        let weight = |i, n| self.weighting.weight(self.counted(i, n));
        let scales = self.scales();
        let sites = (&self.sites[..], &scales[..]);
        if let Some(folded) = fold_round(self.store, self.round, sites, weight, targets, &each)? {
            return Ok(folded);
        }
        let lens: Vec<usize> = targets.iter().map(|t| t.len()).collect();
        let mut fold = Fold::new(&lens);
        for (i, (s, &scale)) in self.sites.iter().zip(&scales).enumerate() {
            let w = |n| weight(i, n);
            fold_one(self.store, self.round, s, (w, scale), &mut fold)?;
        }
        let Some(mean) = fold.mean() else {
            return Ok(false);
        };
        for (t, m) in targets.iter_mut().zip(&mean) {
            each(t, m);
        }
        Ok(true)
    }
}

impl Contributions for SpoolRound<'_> {
    fn round(&self) -> u64 {
        self.round
    }

    fn sites(&self) -> &[String] {
        &self.sites
    }

    fn weighting(&self) -> Weighting {
        self.weighting
    }

    fn get(&self, site: &str) -> Result<Contribution, ReadError> {
        let mut c = self.store.spool_get(self.round, site)?;
        c.samples = self.counted_of(site, c.samples);
        if let Some(t) = self.take_of(site).filter(|t| t.scale != 1.0) {
            c.delta
                .iter_mut()
                .flatten()
                .for_each(|v| *v = scaled(*v, t.scale));
        }
        Ok(c)
    }

    fn summary(&self, site: &str) -> Result<Contribution, ReadError> {
        let mut c = self.store.spool_summary(self.round, site)?;
        c.samples = self.counted_of(site, c.samples);
        Ok(c)
    }

    fn mean_delta_into(
        &self,
        targets: &mut [&mut [f32]],
        each: &(dyn Fn(&mut [f32], &[f64]) + Sync),
    ) -> Result<bool, ReadError> {
        Ok(self.mean_into(targets, each)?)
    }

    fn mean_delta(&self, lens: &[usize]) -> Result<Option<Vec<Vec<f64>>>, ReadError> {
        let mut mean: Vec<Vec<f64>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        let mut targets: Vec<&mut [f64]> = mean.iter_mut().map(|t| &mut t[..]).collect();
        let folded = self.mean_into(&mut targets, |t, m| t.copy_from_slice(m))?;
        Ok(folded.then_some(mean))
    }
}

impl From<StoreError> for ReadError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Corrupt { path, message } => ReadError::Damaged {
                what: path.display().to_string(),
                message,
            },
            StoreError::Io { path, message } => ReadError::Unreadable {
                what: path.display().to_string(),
                message,
            },
        }
    }
}

/// Adds `site`'s spooled delta of `round` to `fold`, each value scaled by `scale` (rounded to
/// f32) and then weighed by `weight(samples)`, a block at a time: the update is never whole in
/// memory, and the sums are those of [`Fold::add`] on [`Store::spool_get`]'s delta so scaled.
/// Its values reach `fold`
/// before the file's checksum has passed, so on any error `fold` holds part of an update
/// and must be dropped (the core then sets the damaged file aside and folds again).
pub fn fold_one(
    store: &Store,
    round: u64,
    site: &str,
    (weight, scale): (impl FnOnce(u64) -> f64, f64),
    fold: &mut Fold,
) -> Result<(), StoreError> {
    let p = store.spool_path(round, site);
    let lens: Vec<usize> = fold.lens().collect();
    let not_finite = || corrupt(&p, "holds a value that is not finite");
    let misfit = |k: usize, len: usize| {
        corrupt(
            &p,
            format!("delta tensor {k} holds {len} values, not {}", lens[k]),
        )
    };
    let f = File::open(&p).map_err(|e| io(&p, e))?;
    let legacy = spoolfile::starts_with_magic(&p, &f)?;
    let (w, lossy) = if legacy {
        read_open(&p, f, |r| {
            let (version, samples) = spool_head(r, round)?;
            let w = weight(samples);
            let n = r.u32()? as usize;
            if n != lens.len() {
                return Err(corrupt(
                    &p,
                    format!("holds {n} delta tensors where the model has {}", lens.len()),
                ));
            }
            // Lossy tensors are decoded once the checksum has passed.
            let mut lossy = Vec::new();
            for (k, &want) in lens.iter().enumerate() {
                // Version 4 holds exact tensors only, untagged.
                let wire = if version == 4 {
                    None
                } else {
                    r.delta_tensor()?
                };
                if let Some(wire) = wire {
                    lossy.push((k, SpooledTensor::Wire(wire)));
                    continue;
                }
                let len = r.value_count()?;
                if len != want {
                    return Err(misfit(k, len));
                }
                r.value_blocks(len, |at, bytes| {
                    if add_le(fold, (k, at), (w, scale), bytes) {
                        Ok(())
                    } else {
                        Err(not_finite())
                    }
                })?;
            }
            if r.tensors()?.iter().flatten().any(|v| !v.is_finite()) {
                return Err(not_finite());
            }
            let n = r.u32()? as usize;
            postcard::from_bytes::<(unifed_protocol::LocalReport, Extras)>(r.take(n)?)
                .map_err(|e| corrupt(&p, e.to_string()))?;
            Ok((w, lossy))
        })?
    } else {
        let (footer, w) = spoolfile::read(
            &p,
            f,
            round,
            |ft| {
                footer_fits(&p, ft, &lens)?;
                Ok(weight(ft.samples))
            },
            |&mut w, k, at, bytes| {
                if add_le(fold, (k, at), (w, scale), bytes) {
                    Ok(())
                } else {
                    Err(not_finite())
                }
            },
        )?;
        footer_sound(&p, &footer)?;
        let lossy = footer
            .delta
            .into_iter()
            .enumerate()
            .filter_map(|(k, t)| match t {
                Placed::Wire(w) => Some((k, SpooledTensor::Wire(w))),
                Placed::InHead { .. } => None,
            })
            .collect();
        (w, lossy)
    };
    // Lossy tensors are decoded a block at a time into the sums, never whole: a decoded
    // tensor would be a fresh model-sized buffer per update.
    for (k, t) in lossy {
        let mut finite = true;
        let len = t.each_block(&p, lens[k], |at, values| {
            finite &= fold.add_block(k, at, w, values.iter().map(|&v| scaled(v, scale)));
        })?;
        if len != lens[k] {
            return Err(misfit(k, len));
        }
        if !finite {
            return Err(not_finite());
        }
    }
    fold.count_added(w);
    Ok(())
}

/// Adds little-endian f32 `bytes`, each scaled by `scale`, weighed by `w`, into tensor `k` of
/// `fold` from value `at` on; false if one is not finite.
fn add_le(fold: &mut Fold, (k, at): (usize, usize), (w, scale): (f64, f64), bytes: &[u8]) -> bool {
    if scale == 1.0 {
        return fold.add_le_block(k, at, w, bytes);
    }
    let values = bytes
        .chunks_exact(4)
        .map(|b| scaled(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), scale));
    fold.add_block(k, at, w, values)
}

/// The weighted mean of the spooled deltas of `sites` (in that order, each with the factor
/// its values are scaled by) of `round`, each weighed by `weight(samples)`, handed to `each(target, mean)` a block of values at a time
/// with the part of `targets` (one slice per delta tensor, as long as the tensor) the block
/// is of: every value exactly once. The files are read by value range on up to
/// [`FOLD_THREADS`] threads (at most one per core), each range of every file in step, while
/// other threads read each file whole to check its sum; so neither an update nor the sums
/// are ever whole in memory (a block of [`ROUND_BLOCK`] sums and a read buffer per thread).
/// The sums are [`Fold`]'s, bit for bit (per value in site order, in f64, then divided by
/// the total weight), however the values are split. Returns `Ok(Some(false))` when no
/// weight was folded (nothing goes to `each`), and `Ok(None)`, having handed nothing on,
/// when a file holds a lossy tensor, is of an older format, or places the tensors in
/// another order than the first: such a round is folded an update at a time
/// ([`fold_one`]). Values reach `each` before the files' checksums have passed: on
/// any error, what it made of them must be dropped.
pub fn fold_round<T: Send>(
    store: &Store,
    round: u64,
    (sites, scales): (&[String], &[f64]),
    weight: impl Fn(usize, u64) -> f64,
    targets: &mut [&mut [T]],
    each: impl Fn(&mut [T], &[f64]) + Sync,
) -> Result<Option<bool>, StoreError> {
    let lens: Vec<usize> = targets.iter().map(|t| t.len()).collect();
    let Some((files, weights, total)) = exact_spools(store, round, sites, &weight, &lens)? else {
        return Ok(None);
    };
    let order = |f: &spoolfile::Exact| -> Vec<(usize, usize)> {
        f.ranges.iter().map(|&(k, _, n)| (k, n)).collect()
    };
    let Some(first) = files.first().map(order) else {
        return Ok(Some(false));
    };
    if files.iter().any(|f| order(f) != first) {
        return Ok(None);
    }
    let folded = total > 0.0;
    let threads = crate::threads_up_to(FOLD_THREADS);
    // Value ranges of about a quarter of a thread's share, whole blocks, so that threads
    // that also check a file's sum still get an even share.
    let values: usize = first.iter().map(|&(_, n)| n).sum();
    let part = values
        .div_ceil(threads * 4)
        .next_multiple_of(ROUND_BLOCK)
        .max(ROUND_BLOCK);
    // Taken from the end: the value ranges first, then the files' checks (the other way
    // round was no faster, and less steady, on 2 cores).
    let mut tasks: Vec<FoldTask<'_, T>> = (0..files.len()).map(FoldTask::Verify).collect();
    let mut slots: Vec<Option<&mut [T]>> = targets.iter_mut().map(|t| Some(&mut **t)).collect();
    let mut pieces = Vec::new();
    let mut filled = 0;
    for (i, &(k, _)) in first.iter().enumerate() {
        let mut rest = slots[k].take().unwrap_or_default();
        let mut at = 0;
        while !rest.is_empty() {
            let n = rest.len().min(part - filled);
            let (piece, tail) = rest.split_at_mut(n);
            pieces.push((i, at, piece));
            (rest, at, filled) = (tail, at + n, filled + n);
            if filled == part {
                tasks.push(FoldTask::Fold(std::mem::take(&mut pieces)));
                filled = 0;
            }
        }
    }
    if !pieces.is_empty() {
        tasks.push(FoldTask::Fold(pieces));
    }
    let fold = |pieces: Vec<(usize, usize, &mut [T])>| -> Result<(), (usize, u8, StoreError)> {
        let mut buf = vec![0u8; ROUND_BLOCK * 4];
        let mut sums = vec![0.0f64; ROUND_BLOCK];
        for (i, first_value, target) in pieces {
            for (b, target) in target.chunks_mut(ROUND_BLOCK).enumerate() {
                let n = target.len();
                let sums = &mut sums[..n];
                sums.fill(0.0);
                let at = (first_value + b * ROUND_BLOCK) as u64 * 4;
                for (j, (f, &w)) in files.iter().zip(&weights).enumerate() {
                    let bytes = &mut buf[..n * 4];
                    f.read_at(f.ranges[i].1 + at, bytes)
                        .map_err(|e| (j, 1, e))?;
                    let values = bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                    let mut finite = true;
                    match scales.get(j) {
                        Some(&scale) if scale != 1.0 => {
                            for (s, y) in sums.iter_mut().zip(values) {
                                finite &= y.is_finite();
                                *s += w * scaled(y, scale) as f64;
                            }
                        }
                        _ => {
                            for (s, y) in sums.iter_mut().zip(values) {
                                finite &= y.is_finite();
                                *s += w * y as f64;
                            }
                        }
                    }
                    if !finite {
                        return Err((j, 1, corrupt(f.path(), "holds a value that is not finite")));
                    }
                }
                if folded {
                    sums.iter_mut().for_each(|s| *s /= total);
                    each(target, sums);
                }
            }
        }
        Ok(())
    };
    let run = |task: FoldTask<'_, T>| match task {
        FoldTask::Verify(j) => files[j].verify().map_err(|e| (j, 0, e)),
        FoldTask::Fold(pieces) => fold(pieces),
    };
    let mut errors = run_queue(tasks, threads, run);
    // One error whatever the threads' timing: the first file's, a damaged sum before
    // anything else it holds.
    errors.sort_by_key(|&(j, rank, _)| (j, rank));
    match errors.into_iter().next() {
        Some((.., e)) => Err(e),
        None => Ok(Some(folded)),
    }
}

/// The spool files of `sites` of `round` as exact files, with each one's weight
/// (`weight(samples)`) and their total; `None` when one is lossy or of an older format.
#[allow(clippy::type_complexity)]
fn exact_spools(
    store: &Store,
    round: u64,
    sites: &[String],
    weight: &impl Fn(usize, u64) -> f64,
    lens: &[usize],
) -> Result<Option<(Vec<spoolfile::Exact>, Vec<f64>, f64)>, StoreError> {
    let mut files = Vec::with_capacity(sites.len());
    let mut weights = Vec::with_capacity(sites.len());
    let mut total = 0.0;
    for (i, site) in sites.iter().enumerate() {
        let p = store.spool_path(round, site);
        let f = File::open(&p).map_err(|e| io(&p, e))?;
        if spoolfile::starts_with_magic(&p, &f)? {
            return Ok(None);
        }
        let Some(file) = spoolfile::Exact::open(p.clone(), f, round)? else {
            return Ok(None);
        };
        let ft = &file.footer;
        footer_fits(&p, ft, lens)?;
        footer_sound(&p, ft)?;
        let w = weight(i, ft.samples);
        total += w;
        weights.push(w);
        files.push(file);
    }
    Ok(Some((files, weights, total)))
}

/// Runs `tasks` (taken from the end) with `run` on this thread and as many helpers as the
/// system gives, up to `threads` in all and one per task; returns every task's error.
fn run_queue<Task: Send, E: Send>(
    tasks: Vec<Task>,
    threads: usize,
    run: impl Fn(Task) -> Result<(), E> + Sync,
) -> Vec<E> {
    // Up to one helper per task beside this thread (which can do all of it alone).
    let helpers = threads.min(tasks.len()).saturating_sub(1);
    let queue = std::sync::Mutex::new(tasks);
    let next = || queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let work = || {
        let mut errors = Vec::new();
        while let Some(task) = next() {
            if let Err(e) = run(task) {
                errors.push(e);
            }
        }
        errors
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (0..helpers)
            .map_while(|_| std::thread::Builder::new().spawn_scoped(s, work).ok())
            .collect();
        let mut errors = work();
        for h in helpers {
            errors.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        errors
    })
}
