//! Helpers shared by the integration tests.
#![allow(dead_code, missing_docs)]

use burn::tensor::{Device, Tensor, TensorData};
use std::path::{Path, PathBuf};
use unifed_models::state::{Select, export};
use unifed_models::zoo::{Net, spec_of};
use unifed_protocol::{Input, ModelSpec, Scaling};

pub fn device() -> Device {
    Device::flex()
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn classes(n: usize) -> Vec<String> {
    (0..n).map(|d| d.to_string()).collect()
}

pub fn image_input(c: u32, h: u32, w: u32) -> Input {
    Input::Image {
        channels: c,
        height: h,
        width: w,
        scaling: Scaling::MinusOneToOne,
    }
}

pub fn spec<N: Net>(net: &N, k: usize, input: Input) -> ModelSpec {
    spec_of(net, &classes(k), &input)
}

/// Reads a float tensor from a safetensors file as (shape, values).
pub fn read_tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(name).unwrap();
    assert_eq!(v.dtype(), safetensors::Dtype::F32);
    let data = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (v.shape().to_vec(), data)
}

pub fn tensor2(shape: &[usize], data: Vec<f32>, device: &Device) -> Tensor<2> {
    let f: usize = shape[1..].iter().product();
    Tensor::from_data(TensorData::new(data, [shape[0], f]), device)
}

pub fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

pub fn bits(net: &impl Net, spec: &ModelSpec, select: Select) -> Vec<(String, Vec<u32>)> {
    export(net, spec, select)
        .tensors
        .into_iter()
        .map(|t| (t.name, t.data.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// An MLP with BN (`inputs`, two hidden layers of `hidden`, `classes`) seeded with `seed`, and
/// its spec.
pub fn mlp_net(
    seed: u64,
    inputs: usize,
    hidden: [usize; 2],
    classes: usize,
) -> (unifed_models::zoo::Mlp, ModelSpec) {
    use unifed_models::zoo::{MlpConfig, seeded};
    let net = seeded(&device(), seed, |d| {
        MlpConfig {
            inputs,
            hidden,
            classes,
        }
        .init(d)
    });
    let spec = spec(&net, classes, Input::Features { len: inputs as u32 });
    (net, spec)
}

/// A tiny MLP (4 inputs, hidden 3 and 3 with BN, 2 classes) seeded with `seed`, and its spec.
pub fn tiny_mlp(seed: u64) -> (unifed_models::zoo::Mlp, ModelSpec) {
    mlp_net(seed, 4, [3, 3], 2)
}

/// Asserts that every non-BN tensor `t` of `got` differs from `plain` by `want(t, k)` at
/// index `k` (within 1e-6), and that BN tensors do not differ at all (`term` names what moved
/// them). Returns how many values were to move (|want| > 1e-6).
pub fn assert_moved_by(
    got: &[unifed_models::state::NamedTensor],
    plain: &[unifed_models::state::NamedTensor],
    want: impl Fn(usize, usize) -> f32,
    term: &str,
) -> usize {
    let mut moved = 0;
    for (t, (a, b)) in got.iter().zip(plain).enumerate() {
        if a.kind.is_bn() {
            assert_eq!(
                a.data, b.data,
                "{}: BN must not feel {term} under local",
                a.name
            );
            continue;
        }
        for k in 0..a.data.len() {
            let (d, w) = (a.data[k] - b.data[k], want(t, k));
            moved += usize::from(w.abs() > 1e-6);
            assert!((d - w).abs() < 1e-6, "{}[{k}]: {d} vs {w}", a.name);
        }
    }
    moved
}

/// `n` samples of 4 noise features for [`tiny_mlp`], labels alternating 0 and 1.
pub fn tiny_data(n: usize) -> unifed_models::data::Dataset {
    unifed_models::data::Dataset {
        name: "tiny".into(),
        features: 4,
        x: noise(4 * n, 11),
        y: (0..n).map(|i| i % 2).collect(),
    }
}

/// A round manifest of the tiny federation: round `round` from model `round - 1`, one chunk,
/// BN sharing none, the given encoding, BN policy and local objective.
pub fn tiny_manifest(
    round: u64,
    encoding: unifed_protocol::Encoding,
    bn: unifed_protocol::messages::BnPolicy,
    objective: unifed_protocol::messages::Objective,
) -> unifed_protocol::messages::RoundManifest {
    use unifed_protocol::messages::{BnSharing, RoundManifest, RoundPlan};
    RoundManifest {
        run: Default::default(),
        round,
        model_version: round - 1,
        spec_hash: unifed_protocol::SpecHash([0; 32]),
        chunk_count: 1,
        payload_len: 1,
        payload_hash: [0; 32],
        delta: None,
        encoding,
        bn_policy: bn,
        bn_sharing: BnSharing::None,
        sampled: vec![],
        upload_window_bytes: 2 << 20,
        plan: RoundPlan { objective },
        deadline_ms: 0,
        finished: false,
    }
}

/// A new process's site restored from what an agent's checkpoint keeps of a site: its model's
/// every tensor (`state`, imported into a model shaped like `like`) and its `memory`, with the
/// given data.
pub fn restored<N: Net>(
    like: &N,
    spec: &ModelSpec,
    state: &unifed_models::state::StateDict,
    memory: unifed_models::site::Memory,
    train: unifed_models::data::Dataset,
    test: unifed_models::data::Dataset,
) -> unifed_models::site::Site<N> {
    let model = unifed_models::state::import(like, spec, state, Select::All).unwrap();
    let mut s = unifed_models::site::Site::new("a", model, train, test).unwrap();
    s.restore_memory(memory, spec).unwrap();
    s
}

/// Trains round `m` on `site` and on `again` and asserts they send the same bytes; returns them.
pub fn same_round<N: Net>(
    site: &mut unifed_models::site::Site<N>,
    again: &mut unifed_models::site::Site<N>,
    spec: &ModelSpec,
    m: &unifed_protocol::messages::RoundManifest,
    tc: &unifed_models::train::TrainConfig,
) -> Vec<u8> {
    let fed = unifed_protocol::Id::new("fed").unwrap();
    let bytes = site
        .train_round(spec, &fed, m, tc, &device(), |_| {})
        .unwrap();
    let other = again
        .train_round(spec, &fed, m, tc, &device(), |_| {})
        .unwrap();
    assert!(bytes == other, "a restored site sent other bytes");
    bytes
}

/// The update a site's envelope `bytes` carry.
pub fn update(bytes: &[u8]) -> unifed_protocol::SiteUpdate {
    unifed_protocol::Envelope::decode(bytes)
        .unwrap()
        .payload_as()
        .unwrap()
}

/// Model `version` (the non-BN tensors of `net`, exact) with `extras` beside it.
pub fn broadcast<N: Net>(
    net: &N,
    spec: &ModelSpec,
    version: u64,
    extras: unifed_protocol::ServerExtras,
) -> unifed_protocol::messages::Download {
    let sd = unifed_models::state::export(net, spec, Select::NonBn);
    unifed_protocol::messages::Download::Model(unifed_protocol::ServerBroadcast {
        model_version: version,
        weights: sd
            .tensors
            .iter()
            .map(|t| t.encode(unifed_protocol::Encoding::F32, None))
            .collect(),
        extras,
    })
}
