//! DICOM input against pydicom: for every fixture (`models/tests/fixtures/dicom`, made by
//! `scripts/make_dicom_fixtures.py`) the decoded pixel values after the modality LUT equal
//! pydicom's, and the windowed values a model is fed equal an independent numpy computation;
//! folders of DICOM files load as datasets (a row per frame), labelled by class folder or by
//! SOP Instance UID, and a damaged file is skipped like any image.

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use unifed_models::data::dicom::{read_dicom, voi_linear};
use unifed_models::data::{load_split, load_unlabelled_named};
use unifed_models::error::DataError;
use unifed_models::zoo::{DigitsCnnConfig, spec_of};
use unifed_protocol::ModelSpec;

const FIXTURES: [&str; 7] = [
    "CT_small",
    "MR_small",
    "MR_small_RLE",
    "MR_small_3frames",
    "MR_small_8bit",
    "MR_small_12bit",
    "CT_small_mono1",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dicom")
}

fn expected(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixtures().join(format!("{name}.json"))).unwrap())
        .unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|f| {
            f.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn every_fixture_decodes_to_pydicoms_values_and_windows_as_numpy_does() {
    for name in FIXTURES {
        let d = read_dicom(&fixtures().join(format!("{name}.dcm"))).unwrap();
        let want = expected(name);
        assert_eq!(
            (d.rows, d.columns, d.modality.len() as u64),
            (
                want["rows"].as_u64().unwrap() as u32,
                want["columns"].as_u64().unwrap() as u32,
                want["frames"].as_u64().unwrap()
            ),
            "{name}"
        );
        assert_eq!(
            d.photometric,
            want["photometric"].as_str().unwrap(),
            "{name}"
        );
        assert_eq!(
            d.sop_instance_uid,
            want["sop_instance_uid"].as_str().unwrap(),
            "{name}"
        );
        let window = want["window"]
            .as_array()
            .map(|w| (w[0].as_f64().unwrap(), w[1].as_f64().unwrap()));
        assert_eq!(d.window, window, "{name}");
        // The modality LUT's values: pydicom's exactly (f32 holds every one of them here).
        for (f, (ours, theirs)) in d.modality.iter().zip(floats(&want["modality"])).enumerate() {
            assert_eq!(ours.len(), theirs.len(), "{name} frame {f}");
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(
                    f64::from(*a),
                    *b as f32 as f64,
                    "{name} frame {f} pixel {i}"
                );
            }
        }
        for (f, (ours, theirs)) in d.windowed().iter().zip(floats(&want["model"])).enumerate() {
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert!(
                    (f64::from(*a) - b).abs() < 1e-6,
                    "{name} frame {f} pixel {i}: {a} {b}"
                );
            }
        }
    }
}

#[test]
fn the_linear_voi_function_follows_the_standard_at_its_edges() {
    // Center 100, width 11: the bottom is 94.5, the top 104.5 (PS3.3 C.11.2.1.2.1).
    let v = voi_linear(
        &[0.0, 94.0, 94.5, 99.5, 104.5, 105.0, 1e6],
        Some((100.0, 11.0)),
    );
    assert_eq!(v, [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]);
    // Width 1: a threshold at center - 0.5.
    assert_eq!(
        voi_linear(&[9.0, 9.5, 10.0], Some((10.0, 1.0))),
        [0.0, 0.0, 1.0]
    );
    // No window: min-max; a flat frame is all 0.
    assert_eq!(voi_linear(&[-1024.0, 0.0, 1024.0], None), [0.0, 0.5, 1.0]);
    assert_eq!(voi_linear(&[7.0, 7.0], None), [0.0, 0.0]);
}

fn grey_spec(classes: &[&str]) -> ModelSpec {
    let net = DigitsCnnConfig {
        in_channels: 1,
        conv: [2, 2, 2],
        fc: [4, 4],
        classes: classes.len(),
        ..Default::default()
    }
    .init(&device());
    let classes: Vec<String> = classes.iter().map(|c| c.to_string()).collect();
    spec_of(&net, &classes, &image_input(1, 28, 28))
}

#[test]
fn dicom_folders_load_a_row_per_frame_labelled_by_folder_or_by_uid() {
    let spec = grey_spec(&["ct", "mr", "multi"]);
    let dir = tempfile::tempdir().unwrap();
    let put = |split: &str, class: &str, name: &str| {
        let to = dir.path().join(split).join(class);
        std::fs::create_dir_all(&to).unwrap();
        std::fs::copy(
            fixtures().join(format!("{name}.dcm")),
            to.join(format!("{name}.dcm")),
        )
        .unwrap();
    };
    put("train", "ct", "CT_small");
    put("train", "ct", "CT_small_mono1");
    put("train", "mr", "MR_small");
    put("train", "multi", "MR_small_3frames");
    let train = load_split(dir.path(), "train", &spec).unwrap();
    // Class folders in sorted order (ct, mr, multi); the three frames are three samples.
    assert_eq!(train.y, [0, 0, 1, 2, 2, 2]);
    assert_eq!(train.x.len(), 6 * 28 * 28);
    // MONOCHROME1 is the inverse of the same pixels as MONOCHROME2 (resized alike; the model's
    // scaling maps v to 2v - 1, so an inverse sums to 0, within 8-bit quantisation).
    let plane = 28 * 28;
    for (a, b) in train.x[..plane].iter().zip(&train.x[plane..2 * plane]) {
        assert!((a + b).abs() < 4.0 / 255.0, "{a} {b}");
    }
    // Flat files with labels.csv keyed by SOP Instance UID.
    let flat = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(flat.path().join("test")).unwrap();
    for name in ["CT_small", "MR_small_12bit"] {
        std::fs::copy(
            fixtures().join(format!("{name}.dcm")),
            flat.path().join("test").join(format!("{name}.dcm")),
        )
        .unwrap();
    }
    let uid = |n: &str| {
        expected(n)["sop_instance_uid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    std::fs::write(
        flat.path().join("labels.csv"),
        format!(
            "sop_instance_uid,label\n{},mr\n{},ct\n",
            uid("MR_small_12bit"),
            uid("CT_small")
        ),
    )
    .unwrap();
    let test = load_split(flat.path(), "test", &spec).unwrap();
    assert_eq!(test.y, [0, 1]);
    // A file the CSV does not name is an error that says so.
    std::fs::copy(
        fixtures().join("MR_small_8bit.dcm"),
        flat.path().join("test/MR_small_8bit.dcm"),
    )
    .unwrap();
    match load_split(flat.path(), "test", &spec) {
        Err(err) => assert!(err.to_string().contains("labels.csv"), "{err}"),
        Ok(d) => panic!("loaded {:?}", d.y),
    }
}

#[test]
fn a_damaged_dicom_file_is_skipped_like_any_image_and_named() {
    let spec = grey_spec(&["a"]);
    let dir = tempfile::tempdir().unwrap();
    let flat = dir.path().join("flat");
    std::fs::create_dir_all(&flat).unwrap();
    // A cut-off copy of MR_small among 20 good ones is skipped (one in twenty-one).
    for i in 0..20 {
        std::fs::copy(
            fixtures().join("MR_small.dcm"),
            flat.join(format!("{i:02}.dcm")),
        )
        .unwrap();
    }
    let whole = std::fs::read(fixtures().join("MR_small.dcm")).unwrap();
    std::fs::write(flat.join("99-cut.dcm"), &whole[..whole.len() / 2]).unwrap();
    let (files, x) = load_unlabelled_named(&flat, &spec).unwrap();
    assert_eq!((files.len(), x.len()), (20, 20 * 28 * 28));
    assert!(files.iter().all(|f| !f.ends_with("99-cut.dcm")));
    // Alone, it is an error naming the file.
    let alone = dir.path().join("alone");
    std::fs::create_dir_all(&alone).unwrap();
    std::fs::write(alone.join("cut.dcm"), &whole[..whole.len() / 2]).unwrap();
    match load_unlabelled_named(&alone, &spec).unwrap_err() {
        DataError::TooManyUnreadable { first, .. } => {
            assert!(first.to_string().contains("cut.dcm"), "{first}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn pixel_data_that_does_not_match_its_header_is_refused_naming_the_file() {
    // MR_small with BitsAllocated 32 (dicom-pixeldata decodes 1, 8 and 16 bits).
    let spec = grey_spec(&["a"]);
    let dir = tempfile::tempdir().unwrap();
    let mut ds = std::fs::read(fixtures().join("MR_small.dcm")).unwrap();
    // BitsAllocated (0028,0100) US 16 -> 32, in Explicit VR Little Endian.
    let tag = [0x28u8, 0x00, 0x00, 0x01, b'U', b'S', 2, 0, 16, 0];
    let at = ds
        .windows(tag.len())
        .position(|w| w == tag)
        .expect("BitsAllocated");
    ds[at + 8] = 32;
    std::fs::write(dir.path().join("x.dcm"), ds).unwrap();
    let err = read_dicom(&dir.path().join("x.dcm")).unwrap_err();
    assert!(matches!(err, DataError::CorruptImage { .. }), "{err:?}");
    assert!(err.to_string().contains("x.dcm"), "{err}");
    assert!(load_unlabelled_named(dir.path(), &spec).is_err());
}
