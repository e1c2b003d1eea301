//! The spool keeps a lossy delta tensor in its wire form and gives back exactly its decoded
//! values, an exact one as its values; a spool file of the previous format (version 4) is still read.
//! Either way the fold streamed from the file is bit for bit the fold of the delta read whole.

use sha2::Digest;
use unifed_aggregator::fold::Fold;
use unifed_aggregator::spoolround::{fold_one, fold_round};
use unifed_aggregator::store::{SpoolEntry, SpoolTensor, Store};
use unifed_aggregator::strategy::Extras;
use unifed_protocol::encoding::{Encoding, decode, encode};
use unifed_protocol::messages::LocalReport;

/// Folds `site`'s spooled update of `round` twice: streamed by `fold_one`, and from
/// `spool_get`'s delta with `Fold::add`; the two must agree bit for bit. A fold shaped
/// otherwise than the delta is refused by name.
fn streamed_fold_is_the_fold_of_the_read_delta(store: &Store, round: u64, site: &str) {
    let c = store.spool_get(round, site).unwrap();
    let lens: Vec<usize> = c.delta.iter().map(Vec::len).collect();
    let mut whole = Fold::new(&lens);
    whole.add(c.samples as f64 * 0.5, &c.delta);
    let mut streamed = Fold::new(&lens);
    fold_one(store, round, site, (|n| n as f64 * 0.5, 1.0), &mut streamed).unwrap();
    assert_eq!((streamed.count(), streamed.weight()), (1, whole.weight()));
    let bits = |f: Fold| -> Vec<Vec<u64>> {
        f.mean()
            .unwrap()
            .into_iter()
            .map(|t| t.into_iter().map(f64::to_bits).collect())
            .collect()
    };
    assert_eq!(bits(streamed), bits(whole));

    let mut longer = lens.clone();
    longer[0] += 1;
    let err = fold_one(
        store,
        round,
        site,
        (|n| n as f64, 1.0),
        &mut Fold::new(&longer),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains(&format!("not {}", longer[0])), "{err}");
    let err = fold_one(
        store,
        round,
        site,
        (|n| n as f64, 1.0),
        &mut Fold::new(&lens[1..]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("delta tensors where the model has"), "{err}");
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|k| (k as f32 * 0.37 + seed).sin() * 0.01)
        .collect()
}

#[test]
fn a_lossy_delta_is_spooled_as_it_arrived_and_read_back_as_its_decoded_values() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let matrix = encode(
        "fc.weight",
        &[64, 2100],
        // More values than the fold decodes at a time.
        &values(134_400, 1.0),
        Encoding::TernaryQ8 { block: 256 },
        Some(&mut Vec::new()),
    );
    let bias = encode(
        "fc.bias",
        &[64],
        &values(64, 2.0),
        Encoding::TernaryQ8 { block: 256 },
        None,
    );
    let stats = values(4, 3.0);
    let report = LocalReport {
        local_steps: 7,
        train_loss: 0.25,
    };
    let bn = vec![vec![0.5f32, 1.5]];
    store
        .spool_put(
            3,
            "a",
            &SpoolEntry {
                message: &[],
                staged: None,
                samples: 11,
                norm: 1.0,
                report: &report,
                extras: &Extras::None,
                delta: &[
                    SpoolTensor::Wire(&matrix.as_ref()),
                    SpoolTensor::Wire(&bias.as_ref()),
                    SpoolTensor::Values(&stats),
                ],
                bn: &bn,
            },
        )
        .unwrap();
    // About 1.6 bits per matrix value, not 32.
    let bytes = std::fs::metadata(dir.path().join("spool/r3/a.upd"))
        .unwrap()
        .len();
    assert!(bytes < 134_400 * 4 / 15, "{bytes} bytes");
    let c = store.spool_get(3, "a").unwrap();
    assert_eq!(c.samples, 11);
    assert_eq!(c.report, report);
    assert_eq!(c.bn, bn);
    assert_eq!(
        c.delta,
        [decode(&matrix).unwrap(), decode(&bias).unwrap(), stats]
    );

    streamed_fold_is_the_fold_of_the_read_delta(&store, 3, "a");

    // A flipped bit in the wire form is a checksum failure, not a decoding accident.
    let p = dir.path().join("spool/r3/a.upd");
    let mut b = std::fs::read(&p).unwrap();
    b[200] ^= 0x04;
    std::fs::write(&p, b).unwrap();
    let err = store.spool_get(3, "a").unwrap_err().to_string();
    assert!(err.contains("checksum"), "{err}");
}

#[test]
fn a_version_4_spool_file_is_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let delta = [values(6, 1.0), values(2, 2.0)];
    let report = LocalReport::default();
    // Version 4: every tensor as its length and little-endian values.
    let mut body = b"UFES".to_vec();
    body.extend_from_slice(&4u32.to_le_bytes());
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&5u64.to_le_bytes());
    body.extend_from_slice(&2u32.to_le_bytes());
    for t in &delta {
        body.extend_from_slice(&(t.len() as u64).to_le_bytes());
        body.extend(t.iter().flat_map(|v| v.to_le_bytes()));
    }
    body.extend_from_slice(&0u32.to_le_bytes());
    let typed = postcard::to_allocvec(&(&report, &Extras::None)).unwrap();
    body.extend_from_slice(&(typed.len() as u32).to_le_bytes());
    body.extend_from_slice(&typed);
    let sum = sha2::Sha256::digest(&body);
    body.extend_from_slice(&sum);
    std::fs::create_dir_all(dir.path().join("spool/r1")).unwrap();
    std::fs::write(dir.path().join("spool/r1/b.upd"), &body).unwrap();
    let c = store.spool_get(1, "b").unwrap();
    assert_eq!((c.samples, c.delta.as_slice()), (5, delta.as_slice()));
    streamed_fold_is_the_fold_of_the_read_delta(&store, 1, "b");

    // A version from the future is refused by name.
    body[4..8].copy_from_slice(&7u32.to_le_bytes());
    let n = body.len() - 32;
    let sum = sha2::Sha256::digest(&body[..n]);
    body[n..].copy_from_slice(&sum);
    std::fs::write(dir.path().join("spool/r1/b.upd"), &body).unwrap();
    let err = store.spool_get(1, "b").unwrap_err().to_string();
    assert!(err.contains("format version 7 is not 6"), "{err}");
}

/// Version 5 (the last before the message was kept): a tag per delta tensor, exact ones as
/// their values, lossy ones in their wire form; XXH3 trailer.
#[test]
fn a_version_5_spool_file_is_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let exact = values(40, 1.0);
    let lossy = encode(
        "w",
        &[300],
        &values(300, 2.0),
        Encoding::TernaryQ8 { block: 64 },
        None,
    );
    let wire = postcard::to_allocvec(&lossy).unwrap();
    let report = LocalReport {
        local_steps: 2,
        train_loss: 0.75,
    };
    let mut body = b"UFES".to_vec();
    body.extend_from_slice(&5u32.to_le_bytes());
    body.extend_from_slice(&4u64.to_le_bytes());
    body.extend_from_slice(&8u64.to_le_bytes());
    body.extend_from_slice(&2u32.to_le_bytes());
    body.push(0);
    body.extend_from_slice(&(exact.len() as u64).to_le_bytes());
    body.extend(exact.iter().flat_map(|v| v.to_le_bytes()));
    body.push(1);
    body.extend_from_slice(&(wire.len() as u64).to_le_bytes());
    body.extend_from_slice(&wire);
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&2u64.to_le_bytes());
    body.extend(values(2, 3.0).iter().flat_map(|v| v.to_le_bytes()));
    let typed = postcard::to_allocvec(&(&report, &Extras::None)).unwrap();
    body.extend_from_slice(&(typed.len() as u32).to_le_bytes());
    body.extend_from_slice(&typed);
    body.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(&body).to_le_bytes());
    body.extend_from_slice(b"UniFed.xxh3-128\0");
    std::fs::create_dir_all(dir.path().join("spool/r4")).unwrap();
    std::fs::write(dir.path().join("spool/r4/c.upd"), &body).unwrap();
    let c = store.spool_get(4, "c").unwrap();
    assert_eq!((c.samples, &c.report), (8, &report));
    assert_eq!(c.delta, [exact, decode(&lossy).unwrap()]);
    assert_eq!(c.bn, [values(2, 3.0)]);
    streamed_fold_is_the_fold_of_the_read_delta(&store, 4, "c");
}

/// A message whose exact tensors lie in it, as an update arrives: `hdr`, weights, `mid`, stats.
fn message_with(
    weights: &[f32],
    stats: &[f32],
) -> (Vec<u8>, std::ops::Range<usize>, std::ops::Range<usize>) {
    let mut m = b"UFED-header".to_vec();
    let w = m.len()..m.len() + weights.len() * 4;
    m.extend(weights.iter().flat_map(|v| v.to_le_bytes()));
    m.extend_from_slice(b"-mid-");
    let s = m.len()..m.len() + stats.len() * 4;
    m.extend(stats.iter().flat_map(|v| v.to_le_bytes()));
    m.extend_from_slice(b"-end");
    (m, w, s)
}

/// The core's path: a reassembled upload (the staged file) becomes the spool file. Its bytes
/// are not written again (the spool file is the staged file, renamed), the message stays whole
/// at its head, the exact tensors are read from where they lie in it, and the fold streamed
/// from it is the fold of what it holds. A damaged byte anywhere is a checksum mismatch.
#[test]
fn a_staged_upload_becomes_the_spool_file_and_its_tensors_are_read_where_they_lie() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let (weights, stats) = (values(50_003, 6.0), values(9, 7.0));
    let (message, w, s) = message_with(&weights, &stats);
    let staged = dir.path().join("incoming.complete");
    std::fs::write(&staged, &message).unwrap();
    let inode =
        |p: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let staged_inode = inode(&staged);
    let report = LocalReport {
        local_steps: 5,
        train_loss: 0.125,
    };
    let bias = encode(
        "b",
        &[64],
        &values(64, 8.0),
        Encoding::TernaryQ8 { block: 64 },
        None,
    );
    // The strategy's order is not the message's: stats first.
    let delta = [
        SpoolTensor::Le(&message[s.clone()]),
        SpoolTensor::Wire(&bias.as_ref()),
        SpoolTensor::Le(&message[w.clone()]),
    ];
    let put = |site: &str, bn: &[Vec<f32>]| {
        let entry = SpoolEntry {
            message: &message,
            staged: Some(&staged),
            samples: 13,
            norm: 1.0,
            report: &report,
            extras: &Extras::None,
            delta: &delta,
            bn,
        };
        store.spool_put(6, site, &entry).unwrap();
    };
    put("a", &[vec![0.25, 4.0]]);
    let p = dir.path().join("spool/r6/a.upd");
    assert!(!staged.exists());
    assert_eq!(inode(&p), staged_inode);
    let file = std::fs::read(&p).unwrap();
    assert_eq!(&file[..message.len()], &message[..]);
    // The footer is small: where two tensors lie, the lossy one, BN and the report.
    assert!(
        file.len() - message.len() < 400,
        "{} bytes",
        file.len() - message.len()
    );
    let c = store.spool_get(6, "a").unwrap();
    assert_eq!((c.samples, &c.report), (13, &report));
    assert_eq!(
        c.delta,
        [stats.clone(), decode(&bias).unwrap(), weights.clone()]
    );
    assert_eq!(c.bn, [vec![0.25, 4.0]]);
    streamed_fold_is_the_fold_of_the_read_delta(&store, 6, "a");

    // A flipped bit in the message, in a tensor, or in the footer's length is the checksum's.
    for at in [3, w.start + 1001, file.len() - 32 - 16] {
        let mut b = file.clone();
        b[at] ^= 0x10;
        std::fs::write(&p, &b).unwrap();
        let err = store.spool_get(6, "a").unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{at}: {err}");
        let lens = [stats.len(), 64, weights.len()];
        let err = fold_one(&store, 6, "a", (|n| n as f64, 1.0), &mut Fold::new(&lens))
            .unwrap_err()
            .to_string();
        assert!(err.contains("checksum mismatch"), "{at}: {err}");
    }

    // A staged file that does not hold the message is left alone, and the message written.
    std::fs::write(&staged, b"something else").unwrap();
    put("b", &[]);
    assert_eq!(std::fs::read(&staged).unwrap(), b"something else");
    let b = std::fs::read(dir.path().join("spool/r6/b.upd")).unwrap();
    assert_eq!(&b[..message.len()], &message[..]);
    assert_eq!(store.spool_get(6, "b").unwrap().delta[2], weights);
}

/// An exact tensor spooled from the bytes it arrived in (`SpoolTensor::Le`, what the core does
/// to skip a copy) makes the very file its decoded values make, and reads back as those values.
#[test]
fn an_exact_tensor_spooled_from_its_bytes_is_the_file_of_its_values() {
    let report = LocalReport {
        local_steps: 3,
        train_loss: 0.5,
    };
    let (weights, stats) = (values(70_001, 4.0), values(6, 5.0));
    let le = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (weights_le, stats_le) = (le(&weights), le(&stats));
    let spooled = |delta: &[SpoolTensor]| {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let entry = SpoolEntry {
            message: &[],
            staged: None,
            samples: 9,
            norm: 1.0,
            report: &report,
            extras: &Extras::None,
            delta,
            bn: &[],
        };
        store.spool_put(2, "a", &entry).unwrap();
        let c = store.spool_get(2, "a").unwrap();
        assert_eq!(c.delta, [weights.clone(), stats.clone()]);
        (
            std::fs::read(dir.path().join("spool/r2/a.upd")).unwrap(),
            dir,
            store,
        )
    };
    let (from_values, _d1, _) =
        spooled(&[SpoolTensor::Values(&weights), SpoolTensor::Values(&stats)]);
    let (from_bytes, _d2, store) =
        spooled(&[SpoolTensor::Le(&weights_le), SpoolTensor::Le(&stats_le)]);
    assert_eq!(from_bytes, from_values);
    streamed_fold_is_the_fold_of_the_read_delta(&store, 2, "a");
}

/// Spools an exact update of `site` in `round` with `samples` and these delta tensors.
fn spool_exact(store: &Store, round: u64, site: &str, samples: u64, delta: &[Vec<f32>]) {
    let report = LocalReport {
        local_steps: 1,
        train_loss: 0.5,
    };
    let tensors: Vec<SpoolTensor> = delta.iter().map(|v| SpoolTensor::Values(v)).collect();
    store
        .spool_put(
            round,
            site,
            &SpoolEntry {
                message: &[],
                staged: None,
                samples,
                norm: 1.0,
                report: &report,
                extras: &Extras::None,
                delta: &tensors,
                bn: &[],
            },
        )
        .unwrap();
}

/// Whether a round was folded, and its mean's bits per tensor.
type RoundMean = (bool, Vec<Vec<u64>>);

/// The round's mean by `fold_round`, gathered from its blocks (each value handed on
/// exactly once when folded, none otherwise).
fn round_mean(
    store: &Store,
    round: u64,
    sites: &[String],
    lens: &[usize],
) -> Result<Option<RoundMean>, String> {
    // Each value's bits, and how often it was handed on.
    let mut mean: Vec<Vec<(u64, u8)>> = lens.iter().map(|&n| vec![(0, 0); n]).collect();
    let mut targets: Vec<&mut [(u64, u8)]> = mean.iter_mut().map(|t| &mut t[..]).collect();
    let folded = fold_round(
        store,
        round,
        (sites, &[]),
        |_, n| n as f64 * 0.5,
        &mut targets,
        |t, m| {
            for (x, v) in t.iter_mut().zip(m) {
                *x = (v.to_bits(), x.1 + 1);
            }
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(folded.map(|f| {
        // Every value exactly once when folded, none otherwise.
        let want = u8::from(f);
        assert!(mean.iter().flatten().all(|&(_, s)| s == want));
        (
            f,
            mean.iter()
                .map(|t| t.iter().map(|&(b, _)| b).collect())
                .collect(),
        )
    }))
}

/// Spools an exact update of `round` for each of `sites` (tensor `k` of site `i` filled from
/// `value(i, k)`, `samples(i)` samples) and gives the bits of their mean folded one update at a
/// time, each weighted by half its samples.
fn spool_and_fold(
    store: &Store,
    round: u64,
    sites: &[String],
    lens: &[usize],
    value: impl Fn(usize, usize) -> f32,
    samples: impl Fn(usize) -> u64,
) -> Vec<Vec<u64>> {
    let mut whole = Fold::new(lens);
    for (i, s) in sites.iter().enumerate() {
        let delta: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(k, &n)| values(n, value(i, k)))
            .collect();
        spool_exact(store, round, s, samples(i), &delta);
        fold_one(store, round, s, (|n| n as f64 * 0.5, 1.0), &mut whole).unwrap();
    }
    whole
        .mean()
        .unwrap()
        .into_iter()
        .map(|t| t.into_iter().map(f64::to_bits).collect())
        .collect()
}

#[test]
fn a_round_folded_in_step_across_its_files_is_the_fold_of_one_update_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let block = unifed_aggregator::spoolround::ROUND_BLOCK;
    // One tensor over two blocks and a half, a small one, and one of a single value.
    let lens = [2 * block + block / 2, 7, 1];
    let sites: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let whole = spool_and_fold(
        &store,
        4,
        &sites,
        &lens,
        |i, k| (i * 3 + k) as f32,
        |i| 10 + 7 * i as u64,
    );
    let (folded, mean) = round_mean(&store, 4, &sites, &lens).unwrap().unwrap();
    assert!(folded);
    assert_eq!(mean, whole);
    // A round of 40 sites too.
    let many: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
    let whole = spool_and_fold(
        &store,
        7,
        &many,
        &lens,
        |i, k| (i * 5 + k) as f32 * 0.25,
        |i| 3 + i as u64,
    );
    assert_eq!(
        round_mean(&store, 7, &many, &lens).unwrap().unwrap().1,
        whole
    );

    // Small tensors first: the value ranges split the large one at no block boundary of its
    // own.
    let shuffled = [7, 1, 2 * block + block / 2];
    let whole = spool_and_fold(
        &store,
        8,
        &sites,
        &shuffled,
        |i, k| (i * 7 + k) as f32 * 0.125,
        |i| 5 + 2 * i as u64,
    );
    assert_eq!(
        round_mean(&store, 8, &sites, &shuffled).unwrap().unwrap().1,
        whole
    );

    // No site, or no weight: nothing folded, nothing handed on.
    assert_eq!(
        round_mean(&store, 4, &[], &lens).unwrap().map(|m| m.0),
        Some(false)
    );
    spool_exact(
        &store,
        5,
        "z",
        0,
        &[vec![1.0; lens[0]], vec![1.0; 7], vec![1.0]],
    );
    let zero = ["z".to_string()];
    assert_eq!(
        round_mean(&store, 5, &zero, &lens).unwrap().map(|m| m.0),
        Some(false)
    );

    // A model of another shape is refused by name.
    let err = round_mean(&store, 4, &sites, &[lens[0], 8, 1]).unwrap_err();
    assert!(err.contains("holds 7 values, not 8"), "{err}");
    let err = round_mean(&store, 4, &sites, &lens[1..]).unwrap_err();
    assert!(err.contains("delta tensors where the model has"), "{err}");

    // A lossy update: the round is left to the fold of one update at a time.
    let lossy = encode(
        "w",
        &[7],
        &values(7, 1.0),
        Encoding::TernaryQ8 { block: 256 },
        None,
    );
    let report = LocalReport {
        local_steps: 1,
        train_loss: 0.5,
    };
    let big = values(lens[0], 9.0);
    store
        .spool_put(
            4,
            "d",
            &SpoolEntry {
                message: &[],
                staged: None,
                samples: 3,
                norm: 1.0,
                report: &report,
                extras: &Extras::None,
                delta: &[
                    SpoolTensor::Values(&big),
                    SpoolTensor::Wire(&lossy.as_ref()),
                    SpoolTensor::Values(&[0.5]),
                ],
                bn: &[],
            },
        )
        .unwrap();
    let mut with_lossy = sites.clone();
    with_lossy.push("d".into());
    assert_eq!(round_mean(&store, 4, &with_lossy, &lens).unwrap(), None);

    // A damaged file: a checksum mismatch, or a value that is not finite, named by its path.
    let p = dir.path().join("spool/r4/b.upd");
    let good = std::fs::read(&p).unwrap();
    let mut bad = good.clone();
    bad[1000] ^= 0x10;
    std::fs::write(&p, &bad).unwrap();
    let err = round_mean(&store, 4, &sites, &lens).unwrap_err();
    assert!(err.contains("checksum") && err.contains("b.upd"), "{err}");
    std::fs::write(&p, &good).unwrap();
    spool_exact(
        &store,
        6,
        "n",
        1,
        &[vec![f32::NAN; lens[0]], vec![0.0; 7], vec![0.0]],
    );
    let err = round_mean(&store, 6, &["n".to_string()], &lens).unwrap_err();
    assert!(err.contains("not finite") && err.contains("n.upd"), "{err}");
    // The file named is the one holding it, after one that is sound.
    spool_exact(
        &store,
        6,
        "m",
        1,
        &[values(lens[0], 1.0), vec![0.0; 7], vec![0.0]],
    );
    let two = ["m".to_string(), "n".to_string()];
    let err = round_mean(&store, 6, &two, &lens).unwrap_err();
    assert!(err.contains("not finite") && err.contains("n.upd"), "{err}");
}

#[test]
fn closed_rounds_and_pruned_models_leave_the_store_at_once_and_are_deleted_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let hash = [7u8; 32];
    let models: Vec<Vec<Vec<f32>>> = (1..=4).map(|v| vec![values(10, v as f32)]).collect();
    for (v, m) in (1..).zip(&models) {
        store.save_model(v, &hash, m).unwrap();
    }
    for round in 1..=3 {
        spool_exact(&store, round, "a", 5, &[values(10, 1.0)]);
    }
    store.spool_clear_before(3).unwrap();
    store.prune_models(4, 2).unwrap();
    // Gone from where the aggregator reads at once (the deleting happens on a thread).
    assert_eq!(store.model_versions().unwrap(), vec![3, 4]);
    assert!(store.spool_sites(1).unwrap().is_empty());
    assert!(store.spool_sites(2).unwrap().is_empty());
    assert_eq!(store.spool_sites(3).unwrap(), vec!["a".to_string()]);
    assert_eq!(store.load_model(4, &hash).unwrap(), models[3]);
    // Whatever is still waiting in the trash is gone once the store is opened again.
    drop(store);
    let again = Store::open(dir.path()).unwrap();
    assert_eq!(
        std::fs::read_dir(dir.path().join("trash")).unwrap().count(),
        0
    );
    assert_eq!(again.model_versions().unwrap(), vec![3, 4]);
}
