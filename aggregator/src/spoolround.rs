//! A closed round's contributions as the spool holds them ([`SpoolRound`], the
//! [`Contributions`] strategies read), and the fold of its files into the weighted mean: an
//! update at a time ([`fold_one`]), or every file at once by value range on several threads
//! ([`fold_round`]). The store keeps the files; this module only reads them.

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

/// A closed round's spooled contributions in site order, read from the store's files.
#[derive(Debug)]
pub struct SpoolRound<'a> {
    store: &'a Store,
    round: u64,
    sites: Vec<String>,
    weighting: Weighting,
}

impl<'a> SpoolRound<'a> {
    /// The contributions of `sites` (sorted) to `round` in `store`.
    pub fn new(store: &'a Store, round: u64, sites: Vec<String>, weighting: Weighting) -> Self {
        SpoolRound {
            store,
            round,
            sites,
            weighting,
        }
    }

    /// The weighted mean handed on as [`Contributions::mean_delta_into`] says, into targets of
    /// any type: every file at once when the round's files are exact ([`fold_round`]), an
    /// update at a time into sums of the model's size otherwise ([`fold_one`]).
    fn mean_into<T: Send>(
        &self,
        targets: &mut [&mut [T]],
        each: impl Fn(&mut [T], &[f64]) + Sync,
    ) -> Result<bool, StoreError> {
        let weight = |n| self.weighting.weight(n);
        if let Some(folded) =
            fold_round(self.store, self.round, &self.sites, weight, targets, &each)?
        {
            return Ok(folded);
        }
        let lens: Vec<usize> = targets.iter().map(|t| t.len()).collect();
        let mut fold = Fold::new(&lens);
        for s in &self.sites {
            fold_one(self.store, self.round, s, weight, &mut fold)?;
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
        Ok(self.store.spool_get(self.round, site)?)
    }

    fn summary(&self, site: &str) -> Result<Contribution, ReadError> {
        Ok(self.store.spool_summary(self.round, site)?)
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

/// Adds `site`'s spooled delta of `round` to `fold`, each tensor scaled by
/// `weight(samples)`, a block at a time: the update is never whole in memory, and the sums
/// are those of [`Fold::add`] on [`Store::spool_get`]'s delta. Its values reach `fold`
/// before the file's checksum has passed, so on any error `fold` holds part of an update
/// and must be dropped (the core then sets the damaged file aside and folds again).
pub fn fold_one(
    store: &Store,
    round: u64,
    site: &str,
    weight: impl FnOnce(u64) -> f64,
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
                    if fold.add_le_block(k, at, w, bytes) {
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
                if fold.add_le_block(k, at, w, bytes) {
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
            finite &= fold.add_block(k, at, w, values.iter().copied());
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

/// The weighted mean of the spooled deltas of `sites` (in that order) of `round`, each
/// scaled by `weight(samples)`, handed to `each(target, mean)` a block of values at a time
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
    sites: &[String],
    weight: impl Fn(u64) -> f64,
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
                    let mut finite = true;
                    for (s, b) in sums.iter_mut().zip(bytes.chunks_exact(4)) {
                        let y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        finite &= y.is_finite();
                        *s += w * y as f64;
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
    weight: &impl Fn(u64) -> f64,
    lens: &[usize],
) -> Result<Option<(Vec<spoolfile::Exact>, Vec<f64>, f64)>, StoreError> {
    let mut files = Vec::with_capacity(sites.len());
    let mut weights = Vec::with_capacity(sites.len());
    let mut total = 0.0;
    for site in sites {
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
        let w = weight(ft.samples);
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
