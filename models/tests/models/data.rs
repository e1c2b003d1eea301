//! Data loading, preprocessing, bad input, and the built-in multi-domain dataset.

use crate::common;

use common::*;
use image::{GrayImage, Luma, Rgb, RgbImage};
use std::io::Write;
use unifed_models::data::{
    BuiltinData, Domain, SplitSizes, load_labelled, load_split, load_unlabelled,
    load_unlabelled_named, read_idx_digits, skip_limit,
};
use unifed_models::error::DataError;
use unifed_models::zoo::{DigitsCnnConfig, spec_of};
use unifed_protocol::ModelSpec;

fn digits_spec(channels: u32) -> ModelSpec {
    let net = DigitsCnnConfig {
        in_channels: channels as usize,
        conv: [2, 2, 2],
        fc: [4, 4],
        ..Default::default()
    }
    .init(&device());
    spec_of(&net, &classes(10), &image_input(channels, 28, 28))
}

fn grey(v: u8) -> GrayImage {
    GrayImage::from_pixel(20, 20, Luma([v]))
}

#[test]
fn a_labelled_folder_loads_with_spec_class_indices_and_preprocessing() {
    let dir = tempfile::tempdir().unwrap();
    for (split, label, v) in [("train", "7", 255u8), ("train", "2", 0), ("test", "7", 0)] {
        let d = dir.path().join(split).join(label);
        std::fs::create_dir_all(&d).unwrap();
        grey(v).save(d.join("a.png")).unwrap();
    }
    let [train, val, test] = load_labelled(dir.path(), &digits_spec(3)).unwrap();
    // Sorted by label folder name: "2" before "7"; class index from the spec, not the listing.
    assert_eq!(train.y, vec![2, 7]);
    assert_eq!(train.features, 3 * 28 * 28);
    // Grey 0 -> -1, 255 -> +1, repeated over 3 channels and resized to 28x28.
    assert!(train.x[..3 * 784].iter().all(|&v| v == -1.0));
    assert!(train.x[3 * 784..].iter().all(|&v| v == 1.0));
    assert!(val.is_empty());
    assert_eq!(test.y, vec![7]);
}

#[test]
fn a_csv_manifest_is_read_instead_of_the_folders() {
    let dir = tempfile::tempdir().unwrap();
    grey(10).save(dir.path().join("x.png")).unwrap();
    grey(20).save(dir.path().join("y.png")).unwrap();
    std::fs::write(
        dir.path().join("manifest.csv"),
        "split,label,path\ntrain,3,x.png\ntest,4,y.png\ntrain,5,y.png\n",
    )
    .unwrap();
    let train = load_split(dir.path(), "train", &digits_spec(1)).unwrap();
    assert_eq!(train.y, vec![3, 5]);
    std::fs::write(dir.path().join("manifest.csv"), "label,path\n3,x.png\n").unwrap();
    let err = load_split(dir.path(), "train", &digits_spec(1)).unwrap_err();
    assert!(err.to_string().contains("missing column `split`"), "{err}");
}

#[test]
fn a_few_unusable_images_are_skipped_and_a_folder_of_them_is_refused() {
    let spec = digits_spec(1);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("train/3")).unwrap();
    for i in 0..20u8 {
        grey(i * 10)
            .save(dir.path().join(format!("train/3/{i:02}.png")))
            .unwrap();
    }
    // One damaged file among 21: skipped, the other 20 load in order.
    std::fs::write(dir.path().join("train/3/05x.png"), b"\x89PNG cut short").unwrap();
    assert_eq!(skip_limit(21), 1);
    let train = load_split(dir.path(), "train", &spec).unwrap();
    assert_eq!(train.y.len(), 20);
    let clean = {
        let d2 = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d2.path().join("train/3")).unwrap();
        for i in 0..20u8 {
            grey(i * 10)
                .save(d2.path().join(format!("train/3/{i:02}.png")))
                .unwrap();
        }
        load_split(d2.path(), "train", &spec).unwrap()
    };
    assert_eq!(
        train.x, clean.x,
        "the skipped file leaves no row and shifts none"
    );
    // A second one is more than one in twenty: the load fails and says how many.
    std::fs::write(dir.path().join("train/3/06x.png"), b"not an image").unwrap();
    let err = load_split(dir.path(), "train", &spec).unwrap_err();
    assert!(
        matches!(
            &err,
            DataError::TooManyUnreadable {
                skipped: 2,
                total: 22,
                limit: 1,
                ..
            }
        ),
        "{err:?}"
    );
    // Unlabelled folders follow the same rule, and the files listed are those that loaded.
    let flat = dir.path().join("train/3");
    std::fs::remove_file(flat.join("06x.png")).unwrap();
    let (files, x) = load_unlabelled_named(&flat, &spec).unwrap();
    assert_eq!(files.len(), 20);
    assert!(files.iter().all(|f| !f.ends_with("05x.png")));
    assert_eq!(x, clean.x);
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let spec = digits_spec(1);
    let dir = tempfile::tempdir().unwrap();
    // Missing folder.
    assert!(
        matches!(load_labelled(&dir.path().join("absent"), &spec), Err(DataError::MissingFolder(p)) if p.ends_with("absent"))
    );
    // Empty dataset.
    std::fs::create_dir_all(dir.path().join("train/3")).unwrap();
    assert!(matches!(
        load_split(dir.path(), "train", &spec),
        Err(DataError::Empty(_))
    ));
    // A folder whose only image is corrupt: nothing to skip to.
    std::fs::write(dir.path().join("train/3/bad.png"), b"\x89PNG garbage").unwrap();
    let err = load_split(dir.path(), "train", &spec).unwrap_err();
    match &err {
        DataError::TooManyUnreadable {
            skipped: 1,
            total: 1,
            first,
            ..
        } => assert!(
            matches!(&**first, DataError::CorruptImage { path, .. } if path.ends_with("bad.png"))
        ),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("bad.png"), "{err}");
    std::fs::remove_file(dir.path().join("train/3/bad.png")).unwrap();
    // Colour image for a grey model, alone.
    RgbImage::from_pixel(28, 28, Rgb([200, 10, 10]))
        .save(dir.path().join("train/3/c.png"))
        .unwrap();
    let err = load_split(dir.path(), "train", &spec).unwrap_err();
    assert!(
        matches!(&err, DataError::TooManyUnreadable { first, .. } if matches!(**first, DataError::WrongChannels { expected: 1, found: 3, .. })),
        "{err:?}"
    );
    std::fs::remove_file(dir.path().join("train/3/c.png")).unwrap();
    // Label not in the spec.
    std::fs::create_dir_all(dir.path().join("train/cat")).unwrap();
    grey(1).save(dir.path().join("train/cat/a.png")).unwrap();
    grey(1).save(dir.path().join("train/3/a.png")).unwrap();
    let err = load_split(dir.path(), "train", &spec).unwrap_err();
    assert!(matches!(&err, DataError::UnknownLabel { label, .. } if label == "cat"));
    assert!(err.to_string().contains("0, 1, 2"), "{err}");
    // Unlabelled folder: images load in name order; an empty folder is an error.
    let flat = dir.path().join("flat");
    std::fs::create_dir_all(&flat).unwrap();
    assert!(matches!(
        load_unlabelled(&flat, &spec),
        Err(DataError::Empty(_))
    ));
    grey(255).save(flat.join("b.png")).unwrap();
    grey(0).save(flat.join("a.png")).unwrap();
    let x = load_unlabelled(&flat, &spec).unwrap();
    assert_eq!((x.len(), x[0], x[784]), (2 * 784, -1.0, 1.0));
}

fn write_idx(path: &std::path::Path, dims: &[u32], body: &[u8], gz: bool) {
    let mut raw = vec![0u8, 0, 8, dims.len() as u8];
    for d in dims {
        raw.extend(d.to_be_bytes());
    }
    raw.extend(body);
    let mut f = std::fs::File::create(path).unwrap();
    if gz {
        let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
        e.write_all(&raw).unwrap();
        e.finish().unwrap();
    } else {
        f.write_all(&raw).unwrap();
    }
}

#[test]
fn idx_files_load_plain_or_gzipped_and_malformed_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (im, lb) = (dir.path().join("im.gz"), dir.path().join("lb"));
    write_idx(
        &im,
        &[2, 3, 3],
        &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        true,
    );
    write_idx(&lb, &[2], &[4, 9], false);
    let base = read_idx_digits(&im, &lb).unwrap();
    assert_eq!(
        (base.size, base.labels.clone(), base.images[1][0]),
        ([3, 3], vec![4, 9], 9)
    );
    write_idx(&lb, &[3], &[4, 9, 1], false);
    assert!(
        read_idx_digits(&im, &lb)
            .unwrap_err()
            .to_string()
            .contains("do not match")
    );
    write_idx(&lb, &[2], &[4, 12], false);
    assert!(
        read_idx_digits(&im, &lb)
            .unwrap_err()
            .to_string()
            .contains("label 12")
    );
    write_idx(&im, &[2, 3, 3], &[0; 10], false);
    assert!(
        read_idx_digits(&im, &lb)
            .unwrap_err()
            .to_string()
            .contains("promises 18 values")
    );
}

#[test]
fn the_builtin_dataset_has_eight_deterministic_domains_of_the_promised_sizes() {
    let data = BuiltinData::load().unwrap();
    let sizes = SplitSizes::default();
    let spec = digits_spec(3);
    let mut means = Vec::new();
    for domain in Domain::all() {
        let dd = data.domain(domain, &sizes, 0).unwrap();
        if domain.is_unseen() {
            assert_eq!(dd.test.images.len(), 1024, "{domain:?}");
            assert!(dd.calib.images.len() >= 512, "{domain:?}");
            assert!(dd.train.images.is_empty());
        } else {
            assert_eq!(
                (
                    dd.train.images.len(),
                    dd.val.images.len(),
                    dd.test.images.len()
                ),
                (743, 100, 600),
                "{domain:?}"
            );
            // Every digit is present in training.
            let ds = dd.train.dataset("t", &spec).unwrap();
            assert!(
                ds.class_counts(10).iter().all(|&c| c >= 40),
                "{domain:?}: {:?}",
                ds.class_counts(10)
            );
        }
        let test = dd.test.dataset("t", &spec).unwrap();
        means.push(test.x.iter().sum::<f32>() / test.x.len() as f32);
        // Deterministic: the same seed gives the same images; the test set does not depend
        // on the number of training images.
        let again = data
            .domain(
                domain,
                &SplitSizes {
                    train: 300,
                    ..sizes
                },
                0,
            )
            .unwrap();
        assert_eq!(again.test.images, dd.test.images, "{domain:?}");
    }
    // The domains look different: mean input levels are spread out.
    let spread = means.iter().cloned().fold(f32::MIN, f32::max)
        - means.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 0.5, "means {means:?}");
    let other_seed = data.domain(Domain::Texture, &sizes, 1).unwrap();
    assert_ne!(
        other_seed.test.images,
        data.domain(Domain::Texture, &sizes, 0).unwrap().test.images
    );
    let too_many = data
        .domain(
            Domain::Grey,
            &SplitSizes {
                train: 5000,
                ..sizes
            },
            0,
        )
        .unwrap_err();
    assert!(too_many.to_string().contains("base images"), "{too_many}");
}

#[test]
fn pooled_datasets_keep_every_sample_in_order_and_refuse_other_sizes() {
    use unifed_models::data::Dataset;
    let d = |name: &str, features, x: Vec<f32>, y: Vec<usize>| Dataset {
        name: name.into(),
        features,
        x,
        y,
    };
    let a = d("a/train", 2, vec![1.0, 2.0, 3.0, 4.0], vec![0, 1]);
    let b = d("b/train", 2, vec![5.0, 6.0], vec![7]);
    let p = Dataset::pooled("pooled", &[&a, &b]).unwrap();
    assert_eq!(p.len(), 3);
    assert_eq!(p.features, 2);
    assert_eq!(p.x, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(p.y, vec![0, 1, 7]);
    assert_eq!(p.subset("b again", &[2]).x, b.x);
    let c = d("c/train", 3, vec![0.0; 3], vec![0]);
    match Dataset::pooled("pooled", &[&a, &c]) {
        Err(DataError::Invalid(m)) => {
            assert!(m.contains("a/train") && m.contains("c/train"), "{m}")
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert!(matches!(
        Dataset::pooled("pooled", &[]),
        Err(DataError::Invalid(_))
    ));
}
