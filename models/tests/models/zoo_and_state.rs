//! The model zoo's shapes, the model spec and the BN/non-BN partition contract.

use crate::common;

use common::*;
use unifed_models::checkpoint;
use unifed_models::data::Dataset;
use unifed_models::error::StateError;
use unifed_models::state::{
    CheckedImport, Select, StateDict, add_delta, apply_non_bn, delta, export, from_encoded, import,
};
use unifed_models::train::{TrainConfig, train_local};
use unifed_models::zoo::{DigitsCnnConfig, MlpConfig, ResNetConfig, Stem, seeded};
use unifed_protocol::{EncodedTensor, EncodedTensorRef, Encoding, ModelSpec, TensorKind, Values};

#[test]
fn digits_cnn_has_the_papers_layers_and_14213578_non_bn_parameters() {
    let net = DigitsCnnConfig::default().init(&device());
    let spec = spec(&net, 10, image_input(3, 28, 28));
    let shapes: Vec<(&str, Vec<usize>)> = spec
        .tensors
        .iter()
        .filter(|t| !t.kind.is_bn())
        .map(|t| (t.name.as_str(), t.shape.clone()))
        .collect();
    assert_eq!(
        shapes,
        vec![
            ("conv1.weight", vec![64, 3, 5, 5]),
            ("conv1.bias", vec![64]),
            ("conv2.weight", vec![64, 64, 5, 5]),
            ("conv2.bias", vec![64]),
            ("conv3.weight", vec![128, 64, 5, 5]),
            ("conv3.bias", vec![128]),
            ("fc1.weight", vec![2048, 6272]),
            ("fc1.bias", vec![2048]),
            ("fc2.weight", vec![512, 2048]),
            ("fc2.bias", vec![512]),
            ("fc3.weight", vec![10, 512]),
            ("fc3.bias", vec![10]),
        ]
    );
    assert_eq!(spec.non_bn_params(), 14_213_578);
    // Five BN layers, each with weight, bias, running mean and running var, found by layer type.
    let bn: Vec<(&str, TensorKind, usize)> = spec
        .tensors
        .iter()
        .filter(|t| t.kind.is_bn())
        .map(|t| (t.name.as_str(), t.kind, t.numel()))
        .collect();
    assert_eq!(bn.len(), 20);
    for (layer, width) in [
        ("bn1", 64),
        ("bn2", 64),
        ("bn3", 128),
        ("bn4", 2048),
        ("bn5", 512),
    ] {
        for (suffix, kind) in [
            ("weight", TensorKind::BnWeight),
            ("bias", TensorKind::BnBias),
            ("running_mean", TensorKind::BnRunningMean),
            ("running_var", TensorKind::BnRunningVar),
        ] {
            let name = format!("{layer}.{suffix}");
            assert!(
                bn.contains(&(name.as_str(), kind, width)),
                "missing {name} ({kind:?}, {width})"
            );
        }
    }
    assert!(spec.validate().is_ok());
    assert_eq!(spec.hash(), spec.clone().hash());
}

#[test]
fn resnet18_names_follow_torchvision_and_its_parameter_count_is_right() {
    let net = ResNetConfig::new(3, [224, 224], 1000).init(&device());
    let spec = spec(&net, 1000, image_input(3, 224, 224));
    // torchvision's resnet18 has 11,689,512 trainable parameters (BN affine included).
    assert_eq!(spec.numel_where(|k| !k.is_bn_stat()), 11_689_512);
    assert!(spec.tensor("layer2.0.downsample.0.weight").is_some());
    assert_eq!(
        spec.tensor("layer2.0.downsample.1.running_var")
            .unwrap()
            .kind,
        TensorKind::BnRunningVar
    );
    assert_eq!(spec.tensor("fc.weight").unwrap().shape, vec![1000, 512]);
    assert_eq!(
        spec.tensors
            .iter()
            .filter(|t| t.kind == TensorKind::BnWeight)
            .count(),
        20
    );
}

#[test]
fn export_then_import_round_trips_bit_exactly() {
    let d = device();
    let a = seeded(&d, 1, |d| {
        DigitsCnnConfig {
            conv: [4, 6, 8],
            fc: [32, 16],
            ..Default::default()
        }
        .init(d)
    });
    let b = seeded(&d, 2, |d| {
        DigitsCnnConfig {
            conv: [4, 6, 8],
            fc: [32, 16],
            ..Default::default()
        }
        .init(d)
    });
    let spec = spec(&a, 10, image_input(3, 28, 28));
    // Give a's BN statistics non-default values so that they are really carried over.
    let mut state = export(&a, &spec, Select::All);
    for t in &mut state.tensors {
        if t.kind.is_bn() {
            t.data
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = 0.5 + i as f32 * 0.25);
        }
    }
    let a = import(&a, &spec, &state, Select::All).unwrap();
    // A selection exports the same tensors, in the same order, as the whole export filtered.
    for select in [Select::NonBn, Select::Bn, Select::BnAffine, Select::BnStats] {
        let mut want = state.clone();
        want.tensors.retain(|t| select.keeps(t.kind));
        assert!(!want.tensors.is_empty());
        assert_eq!(export(&a, &spec, select), want, "{select:?}");
    }
    let b2 = import(&b, &spec, &export(&a, &spec, Select::All), Select::All).unwrap();
    assert_eq!(bits(&a, &spec, Select::All), bits(&b2, &spec, Select::All));
    assert_eq!(export(&b2, &spec, Select::All), state);
    // And through a safetensors file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    checkpoint::save(&path, &state, &spec).unwrap();
    assert_eq!(checkpoint::load(&path, &spec).unwrap(), state);
    // The same state always gives the same bytes (the metadata map has no stable order of
    // its own), so two devices' copies of a model can be compared with `cmp`.
    let first = std::fs::read(&path).unwrap();
    for _ in 0..8 {
        checkpoint::save(&path, &state, &spec).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), first);
    }
}

#[test]
fn applying_non_bn_weights_leaves_every_bn_tensor_bit_identical() {
    let d = device();
    let cfg = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    };
    let site = seeded(&d, 3, |d| cfg.init(d));
    let spec = spec(&site, 10, image_input(3, 28, 28));
    // Train the site a little so its BN statistics are its own.
    let data = Dataset {
        name: "noise".into(),
        features: 3 * 28 * 28,
        x: noise(64 * 3 * 28 * 28, 5),
        y: (0..64).map(|i| i % 10).collect(),
    };
    let (site, _) = train_local(&site, &data, 10, &TrainConfig::default(), &d, |_| {}).unwrap();
    let global = seeded(&d, 4, |d| cfg.init(d));
    let new_weights = export(&global, &spec, Select::NonBn);
    let updated = apply_non_bn(&site, &spec, &new_weights).unwrap();
    assert_eq!(
        bits(&updated, &spec, Select::Bn),
        bits(&site, &spec, Select::Bn)
    );
    assert_eq!(
        bits(&updated, &spec, Select::NonBn),
        bits(&global, &spec, Select::NonBn)
    );
    assert_ne!(
        bits(&updated, &spec, Select::NonBn),
        bits(&site, &spec, Select::NonBn)
    );
    // A delta against the reference, added back, gives the weights again.
    let d1 = delta(
        &export(&updated, &spec, Select::NonBn),
        &export(&site, &spec, Select::NonBn),
    )
    .unwrap();
    let back = add_delta(&export(&site, &spec, Select::NonBn), &d1).unwrap();
    assert!(max_abs_diff(&back.tensors[0].data, &new_weights.tensors[0].data) < 1e-6);
    assert!(d1.tensors.iter().all(|t| !t.kind.is_bn()));
}

#[test]
fn two_clones_trained_apart_keep_different_bn_statistics() {
    let d = device();
    let cfg = MlpConfig {
        inputs: 20,
        hidden: [16, 16],
        classes: 3,
    };
    let global = seeded(&d, 9, |d| cfg.init(d));
    let spec = spec(&global, 3, unifed_protocol::Input::Features { len: 20 });
    let before = bits(&global, &spec, Select::BnStats);
    let a0 = global.clone();
    let b0 = global.clone();
    let da = Dataset {
        name: "a".into(),
        features: 20,
        x: noise(64 * 20, 1).iter().map(|v| v + 2.0).collect(),
        y: (0..64).map(|i| i % 3).collect(),
    };
    let db = Dataset {
        name: "b".into(),
        features: 20,
        x: noise(64 * 20, 2).iter().map(|v| v * 5.0).collect(),
        y: (0..64).map(|i| i % 3).collect(),
    };
    let (a, _) = train_local(&a0, &da, 3, &TrainConfig::default(), &d, |_| {}).unwrap();
    let (b, _) = train_local(&b0, &db, 3, &TrainConfig::default(), &d, |_| {}).unwrap();
    let (sa, sb) = (
        bits(&a, &spec, Select::BnStats),
        bits(&b, &spec, Select::BnStats),
    );
    assert_ne!(sa, sb);
    // Neither training touched the shared global model's statistics.
    assert_eq!(bits(&global, &spec, Select::BnStats), before);
    assert_ne!(sa, before);
}

#[test]
fn imports_reject_a_wrong_spec_hash_a_wrong_shape_and_unknown_tensors() {
    let d = device();
    let net = MlpConfig {
        inputs: 20,
        hidden: [16, 16],
        classes: 3,
    }
    .init(&d);
    let spec = spec(&net, 3, unifed_protocol::Input::Features { len: 20 });
    let other = MlpConfig {
        inputs: 21,
        hidden: [16, 16],
        classes: 3,
    }
    .init(&d);
    let other_spec = spec_of_features(&other, 21);
    let foreign = export(&other, &other_spec, Select::All);
    assert!(matches!(
        import(&net, &spec, &foreign, Select::All),
        Err(StateError::SpecHashMismatch { .. })
    ));
    let mut state = export(&net, &spec, Select::All);
    state.tensors[0].shape = vec![20, 16];
    match import(&net, &spec, &state, Select::All) {
        Err(StateError::WrongShape {
            name,
            expected,
            found,
        }) => {
            assert_eq!(
                (name.as_str(), expected, found),
                ("fc1.weight", vec![16, 20], vec![20, 16])
            );
        }
        other => panic!("expected WrongShape, got {other:?}"),
    }
    let mut state = export(&net, &spec, Select::All);
    state.tensors[0].name = "fc9.weight".into();
    assert!(
        matches!(import(&net, &spec, &state, Select::All), Err(StateError::Unexpected(n)) if n == "fc9.weight")
    );
    let mut state = export(&net, &spec, Select::NonBn);
    state.tensors.pop();
    assert!(
        matches!(apply_non_bn(&net, &spec, &state), Err(StateError::Missing(n)) if n == "fc3.bias")
    );
    let mut state = export(&net, &spec, Select::All);
    state.tensors[1].data.pop();
    assert!(matches!(
        import(&net, &spec, &state, Select::All),
        Err(StateError::WrongLength { .. })
    ));
    // A checkpoint written for another spec is refused by hash.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("o.safetensors");
    checkpoint::save(&p, &foreign, &other_spec).unwrap();
    assert!(matches!(
        checkpoint::load(&p, &spec),
        Err(StateError::SpecHashMismatch { .. })
    ));
    std::fs::write(&p, b"not a checkpoint").unwrap();
    assert!(matches!(
        checkpoint::load(&p, &spec),
        Err(StateError::File { .. })
    ));
}

fn spec_of_features(net: &unifed_models::zoo::Mlp, len: u32) -> unifed_protocol::ModelSpec {
    spec(net, 3, unifed_protocol::Input::Features { len })
}

#[test]
fn resnet_split_stage_composes_to_the_full_forward() {
    let d = device();
    let cfg = ResNetConfig {
        in_channels: 1,
        size: [16, 16],
        classes: 4,
        width: 4,
        stem: Stem::Cifar,
        split: 2,
    };
    let net = seeded(&d, 5, |d| cfg.init(d));
    let x = tensor2(&[3, 256], noise(3 * 256, 8), &d);
    use unifed_models::bn::BnPass;
    use unifed_models::zoo::Net;
    let full = values(net.forward(x.clone(), &mut BnPass::standard()));
    // Stage 2 ends after 1 + 4 * 2 weight layers: 8 channels of 8 x 8.
    let z = net.low(x.clone(), 9, &mut BnPass::standard());
    assert_eq!(z.dims(), [3, 8 * 8 * 8]);
    assert_eq!(values(net.high(z, 9, &mut BnPass::standard())), full);
    for p in net.split_points() {
        let z = net.low(x.clone(), p, &mut BnPass::standard());
        let split = values(net.high(z, p, &mut BnPass::standard()));
        assert_eq!(split, full, "split at {p}");
    }
}

#[test]
fn a_digits_cnn_config_is_read_back_from_its_spec_and_a_foreign_spec_is_refused() {
    let device = device();
    let mc = unifed_models::zoo::ModelConfig::fedbn_digits();
    for cfg in [
        DigitsCnnConfig::default(),
        DigitsCnnConfig {
            conv: [4, 6, 8],
            fc: [32, 16],
            ..Default::default()
        },
    ] {
        let spec = unifed_models::zoo::spec_of(&cfg.init(&device), &mc.classes, &mc.input);
        assert_eq!(DigitsCnnConfig::from_spec(&spec), Ok(cfg));
    }
    let mlp = unifed_models::zoo::MlpConfig::abide(100, 2).init(&device);
    let spec = unifed_models::zoo::spec_of(
        &mlp,
        &classes(2),
        &unifed_protocol::Input::Features { len: 100 },
    );
    let err = DigitsCnnConfig::from_spec(&spec).unwrap_err().to_string();
    assert!(err.contains("not a digits-CNN spec"), "{err}");
}

/// What `safetensors::serialize` writes for `state` (with zero BN counters), its header's keys
/// then sorted: the bytes our streaming writer must reproduce.
fn reference_bytes(state: &StateDict, spec: &ModelSpec) -> Vec<u8> {
    use safetensors::{Dtype, tensor::TensorView};
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = state
        .tensors
        .iter()
        .map(|t| {
            let b = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            (t.name.clone(), t.shape.clone(), b)
        })
        .collect();
    let zero = 0i64.to_le_bytes();
    let counters: Vec<String> = state
        .tensors
        .iter()
        .filter_map(|t| t.name.strip_suffix(".running_mean"))
        .map(|p| format!("{p}.num_batches_tracked"))
        .collect();
    let views = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .chain(counters.iter().map(|n| {
            (
                n.clone(),
                TensorView::new(Dtype::I64, vec![], &zero).unwrap(),
            )
        }));
    let meta = std::collections::HashMap::from([
        (
            checkpoint::META_SPEC_HASH.to_string(),
            state.spec_hash.to_string(),
        ),
        (checkpoint::META_ARCH.to_string(), spec.architecture.clone()),
        ("format".to_string(), "pt".to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(meta)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    // serde_json's map is sorted by key (the workspace does not turn on `preserve_order`).
    let sorted: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_value(header).unwrap();
    let mut text = serde_json::to_vec(&sorted).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

#[test]
fn safetensors_are_streamed_byte_for_byte_as_the_safetensors_crate_writes_them() {
    let d = device();
    let small = seeded(&d, 5, |d| {
        DigitsCnnConfig {
            conv: [4, 6, 8],
            fc: [32, 16],
            ..Default::default()
        }
        .init(d)
    });
    let resnet = seeded(&d, 6, |d| ResNetConfig::new(3, [32, 32], 3).init(d));
    for (state, spec) in [
        {
            let spec = spec(&small, 10, image_input(3, 28, 28));
            (export(&small, &spec, Select::All), spec)
        },
        {
            let spec = spec(&resnet, 3, image_input(3, 32, 32));
            (export(&resnet, &spec, Select::All), spec)
        },
    ] {
        let layout = checkpoint::Layout::new(&state, &spec);
        let bytes = checkpoint::to_bytes(&state, &spec).unwrap();
        assert_eq!(bytes.len() as u64, layout.len());
        assert_eq!(
            bytes,
            reference_bytes(&state, &spec),
            "{}",
            spec.architecture
        );
        assert_eq!(checkpoint::from_bytes(&bytes, &spec).unwrap(), state);
    }
    // Written from the model a block at a time, with the layout made from the spec alone: the
    // same bytes (the full-size CNN's `fc1` spans many blocks, transposed on the way).
    let full = seeded(&d, 7, |d| DigitsCnnConfig::default().init(d));
    streamed_is_exported(&small, &spec(&small, 10, image_input(3, 28, 28)));
    streamed_is_exported(&resnet, &spec(&resnet, 3, image_input(3, 32, 32)));
    streamed_is_exported(&full, &spec(&full, 10, image_input(3, 28, 28)));
    // burn's own initialisation stores a linear weight `[in, out]`, as training leaves it (a
    // seeded or imported model holds a transposed view of PyTorch's `[out, in]`): read
    // transposed, a tile of rows at a time, and edges that are not whole blocks of 8.
    let odd = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [37, 13],
        ..Default::default()
    };
    for net in [odd.init(&d), DigitsCnnConfig::default().init(&d)] {
        streamed_is_exported(&net, &spec(&net, 10, image_input(3, 28, 28)));
    }
}

/// `Layout::of_spec(spec).write_net(net)` writes what `Layout::new(export).write(export)`
/// writes, byte for byte; a spec of another model is an error naming a tensor.
fn streamed_is_exported<N: unifed_models::zoo::Net>(net: &N, spec: &ModelSpec) {
    let state = export(net, spec, Select::All);
    let mut want = Vec::new();
    checkpoint::Layout::new(&state, spec)
        .write(&state, &mut want)
        .unwrap();
    let layout = checkpoint::Layout::of_spec(spec);
    assert_eq!(layout.len(), want.len() as u64, "{}", spec.architecture);
    let mut got = Vec::new();
    layout.write_net(net, &mut got).unwrap();
    assert!(
        got == want,
        "{}: the streamed file differs",
        spec.architecture
    );
    let mut other = spec.clone();
    other.tensors[0].shape = vec![other.tensors[0].numel() + 1];
    let e = checkpoint::Layout::of_spec(&other)
        .write_net(net, &mut Vec::new())
        .unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
}

#[test]
fn an_import_read_in_place_writes_what_a_decoded_one_does_and_a_bad_message_changes_nothing() {
    let d = device();
    let cfg = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    };
    let site = || seeded(&d, 3, |d| cfg.init(d));
    let global = seeded(&d, 4, |d| cfg.init(d));
    let spec = spec(&global, 10, image_input(3, 28, 28));
    for (select, encoding) in [
        (Select::NonBn, Encoding::F32),
        (Select::All, Encoding::F16),
        (Select::NonBn, Encoding::Q8),
    ] {
        let encoded: Vec<EncodedTensor> = export(&global, &spec, select)
            .tensors
            .iter()
            .map(|t| t.encode(encoding, None))
            .collect();
        let wire = postcard::to_allocvec(&encoded).unwrap();
        let read: Vec<EncodedTensorRef> = postcard::from_bytes(&wire).unwrap();
        let decoded = from_encoded(&spec, &encoded).unwrap();
        let want = import(&site(), &spec, &decoded, select).unwrap();
        let mut got = site();
        let mut kept = std::collections::BTreeMap::new();
        CheckedImport::new(&spec, &read, select)
            .unwrap()
            .import_into(&mut got, Some(&mut kept))
            .unwrap();
        assert_eq!(
            bits(&got, &spec, Select::All),
            bits(&want, &spec, Select::All),
            "{select:?} {encoding:?}"
        );
        // What it keeps is every tensor it wrote, as decoded.
        let kept: Vec<_> = kept.into_iter().collect();
        let mut want_kept: Vec<_> = decoded
            .tensors
            .into_iter()
            .map(|t| (t.name, t.data))
            .collect();
        want_kept.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(kept, want_kept);
    }
    // Refused before anything is written: a tensor short of a value, a tensor missing, a shape
    // other than the spec's.
    let good: Vec<EncodedTensor> = export(&global, &spec, Select::All)
        .tensors
        .iter()
        .map(|t| t.encode(Encoding::F32, None))
        .collect();
    let mut short = good.clone();
    if let Values::F32(b) = &mut short[1].values {
        b.truncate(b.len() - 4);
    }
    let mut missing = good.clone();
    missing.remove(0);
    let mut reshaped = good.clone();
    reshaped[0].shape.push(1);
    for (bad, what) in [
        (short, good[1].name.clone()),
        (missing, good[0].name.clone()),
        (reshaped, good[0].name.clone()),
    ] {
        let err = CheckedImport::new(&spec, &bad, Select::NonBn)
            .err()
            .unwrap();
        assert!(err.to_string().contains(&what), "{err}");
    }
    let before = bits(&site(), &spec, Select::All);
    let mut net = site();
    assert!(CheckedImport::new(&spec, &good[1..], Select::NonBn).is_err());
    assert_eq!(bits(&net, &spec, Select::All), before);
    // Tensors the selection does not keep (BN, here) are ignored, as `import` ignores them.
    CheckedImport::new(&spec, &good, Select::NonBn)
        .unwrap()
        .import_into(&mut net, None)
        .unwrap();
    assert_eq!(
        bits(&net, &spec, Select::Bn),
        bits(&site(), &spec, Select::Bn)
    );
}
