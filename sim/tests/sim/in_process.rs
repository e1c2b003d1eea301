//! The in-process federation, 3 sites x 3 rounds: every site's weights after every round equal
//! the sample-weighted mean computed independently from the decoded updates on the transport.

use std::collections::BTreeMap;
use unifed_aggregator::{Algorithm, FederationConfig};
use unifed_models::backend::Device;
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::state::{Select, StateDict, export};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, seeded, spec_of};
use unifed_protocol::encoding::{Encoding, decode};
use unifed_protocol::envelope::Envelope;
use unifed_protocol::messages::{BnPolicy, ServerBroadcast, SiteUpdate};
use unifed_protocol::{Input, ModelSpec, Scaling};
use unifed_sim::{Evaluation, Observed, Observer, Site, Sites, run_federation};

struct Captured {
    spec: ModelSpec,
    records: Vec<unifed_sim::RoundRecord>,
    updates: BTreeMap<u64, Vec<SiteUpdate>>,
    models: BTreeMap<u64, ServerBroadcast>,
    states: BTreeMap<u64, Vec<StateDict>>,
    /// Each site's state as it evaluated each model, while the run goes on.
    evaluated: BTreeMap<u64, Vec<Option<StateDict>>>,
}

fn federate(bn: BnPolicy, encoding: Encoding) -> Captured {
    federate_with(Algorithm::FedAvg, bn, encoding, [48, 64, 40])
}

/// A federation of `algorithm` whose sites (grey, texture, lowres) train on `train` images.
fn federate_with(
    algorithm: Algorithm,
    bn: BnPolicy,
    encoding: Encoding,
    train: [usize; 3],
) -> Captured {
    let device = Device::flex();
    let cfg = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    };
    let input = Input::Image {
        channels: 3,
        height: 28,
        width: 28,
        scaling: Scaling::MinusOneToOne,
    };
    let classes: Vec<String> = (0..10).map(|d| d.to_string()).collect();
    let init = || seeded(&device, 3, |d| cfg.init(d));
    let net0 = init();
    let spec = spec_of(&net0, &classes, &input);
    let data = BuiltinData::load().unwrap();
    let mut sites: Vec<Site<DigitsCnn>> = [Domain::Grey, Domain::Texture, Domain::Lowres]
        .into_iter()
        .zip(train)
        .map(|(d, n)| {
            let dd = data
                .domain(
                    d,
                    &SplitSizes {
                        train: n,
                        val: 0,
                        test: 32,
                        unseen_test: 64,
                    },
                    0,
                )
                .unwrap();
            Site::new(
                d.name(),
                init(),
                dd.train.dataset("train", &spec).unwrap(),
                dd.test.dataset("test", &spec).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let initial = unifed_sim::initial_model(&net0, &spec);
    let fc = FederationConfig {
        algorithm,
        bn_policy: bn,
        encoding,
        // What these tests compute from the decoded updates is each strategy's own arithmetic:
        // no update scaled by the cohort's norm bound (the aggregator's tests cover it; the
        // runner vouches for every site's count, so no weight is capped either).
        max_norm_of_median: f64::INFINITY,
        ..FederationConfig::new("test-fed", 3, 3, Vec::new())
    };
    let mut cap = Captured {
        spec: spec.clone(),
        records: Vec::new(),
        updates: BTreeMap::new(),
        models: BTreeMap::new(),
        states: BTreeMap::new(),
        evaluated: BTreeMap::new(),
    };
    let records = run_federation(
        fc,
        initial,
        Sites::new(&mut sites, &TrainConfig::default(), &device),
        &mut cap,
    )
    .unwrap();
    assert_eq!(records.len(), 3);
    cap.records = records;
    cap.states = std::mem::take(&mut cap.evaluated)
        .into_iter()
        .map(|(v, s)| {
            (
                v,
                s.into_iter()
                    .map(|s| s.expect("every site evaluated"))
                    .collect(),
            )
        })
        .collect();
    cap
}

impl Observer<DigitsCnn> for Captured {
    fn message(&mut self, o: Observed<'_>) {
        match o {
            Observed::Update { bytes, .. } => {
                let u: SiteUpdate = Envelope::decode(bytes).unwrap().payload_as().unwrap();
                self.updates.entry(u.round).or_default().push(u);
            }
            Observed::Model { version, payload } => {
                self.models
                    .insert(version, postcard::from_bytes(payload).unwrap());
            }
        }
    }

    /// Each site's state as it evaluated a model past the initial one, in site order (grey,
    /// texture, lowres).
    fn evaluated(&mut self, site: &Site<DigitsCnn>, e: &Evaluation) {
        let k = ["grey", "texture", "lowres"]
            .iter()
            .position(|n| *n == site.id.as_str())
            .unwrap();
        let states = self
            .evaluated
            .entry(e.version)
            .or_insert_with(|| vec![None; 3]);
        states[k] = Some(export(&site.net, &self.spec, Select::All));
    }
}

/// Expected tensors of version `v`: the broadcast of `v - 1` plus the weighted mean of round
/// v's decoded deltas, computed here in f64.
fn expected(cap: &Captured, v: u64) -> BTreeMap<String, Vec<f32>> {
    expected_sum(cap, v, |p, _| p, 1.0)
}

/// The broadcast of `v - 1` plus `scale * sum_i coef(p_i, u_i) delta_i` over round v's decoded
/// updates `u_i`, `p_i` their share of the samples; in f64.
fn expected_sum(
    cap: &Captured,
    v: u64,
    coef: impl Fn(f64, &SiteUpdate) -> f64,
    scale: f64,
) -> BTreeMap<String, Vec<f32>> {
    let prev = &cap.models[&(v - 1)];
    let ups = &cap.updates[&v];
    let total: f64 = ups.iter().map(|u| u.samples as f64).sum();
    prev.weights
        .iter()
        .map(|w| {
            let base = decode(w).unwrap();
            let mut acc = vec![0.0f64; base.len()];
            for u in ups {
                let c = coef(u.samples as f64 / total, u);
                let d = decode(u.delta.iter().find(|t| t.name == w.name).unwrap()).unwrap();
                for (a, x) in acc.iter_mut().zip(d) {
                    *a += c * x as f64;
                }
            }
            (
                w.name.clone(),
                base.iter()
                    .zip(acc)
                    .map(|(b, a)| (*b as f64 + scale * a) as f32)
                    .collect(),
            )
        })
        .collect()
}

fn check_means(cap: &Captured, select: Select) {
    for v in 1..=3u64 {
        let want = expected(cap, v);
        assert_eq!(cap.states[&v].len(), 3);
        for state in &cap.states[&v] {
            for t in state.tensors.iter().filter(|t| select.keeps(t.kind)) {
                let w = &want[&t.name];
                let err = t
                    .data
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err <= 1e-6, "v{v} {}: {err}", t.name);
            }
        }
    }
}

#[test]
fn fedbn_sites_share_the_weighted_mean_keep_their_own_bn_and_never_send_bn() {
    let cap = federate(BnPolicy::Local, Encoding::F32);
    check_means(&cap, Select::NonBn);
    let is_bn = |name: &str| cap.spec.tensor(name).unwrap().kind.is_bn();
    for ups in cap.updates.values() {
        assert_eq!(ups.len(), 3);
        assert!(
            ups.iter().flat_map(|u| &u.delta).all(|t| !is_bn(&t.name)),
            "an update carried a BN tensor"
        );
    }
    assert!(
        cap.models
            .values()
            .flat_map(|m| &m.weights)
            .all(|t| !is_bn(&t.name)),
        "a broadcast carried a BN tensor"
    );
    // The sites' BN tensors are their own: pairwise different after the last round.
    let bn = |s: &StateDict| {
        s.filter(Select::BnStats)
            .tensors
            .into_iter()
            .map(|t| t.data)
            .collect::<Vec<_>>()
    };
    let last = &cap.states[&3];
    assert_ne!(bn(&last[0]), bn(&last[1]));
    assert_ne!(bn(&last[1]), bn(&last[2]));
    // ... and their non-BN tensors identical.
    assert_eq!(last[0].filter(Select::NonBn), last[1].filter(Select::NonBn));
}

#[test]
fn fedavg_averages_bn_too() {
    let cap = federate(BnPolicy::Global, Encoding::F32);
    check_means(&cap, Select::All);
    let is_bn = |name: &str| cap.spec.tensor(name).unwrap().kind.is_bn();
    assert!(
        cap.updates[&1]
            .iter()
            .all(|u| u.delta.iter().any(|t| is_bn(&t.name)))
    );
    let last = &cap.states[&3];
    assert_eq!(last[0], last[1]);
    assert_eq!(last[1], last[2]);
}

/// Under a lossy encoding the model goes down as deltas (after the first, whole download):
/// every site's broadcast tensors equal the whole model the aggregator serves bit for bit, so
/// the sites that follow deltas and one that fetches the model hold the same weights, and
/// each delta is at least 8x smaller than the model (on this tiny model tensor names and
/// framing weigh more than on a real one).
fn check_deltas(bn: BnPolicy, select: Select) {
    let cap = federate(bn, Encoding::TopKQ8 { per_mille: 100 });
    for r in &cap.records {
        let model = &cap.models[&r.round];
        for (k, state) in cap.states[&r.round].iter().enumerate() {
            let kept: Vec<_> = state
                .tensors
                .iter()
                .filter(|t| select.keeps(t.kind))
                .collect();
            assert_eq!(kept.len(), model.weights.len());
            for (t, w) in kept.iter().zip(&model.weights) {
                assert_eq!(t.name, w.name);
                assert!(
                    t.data == decode(w).unwrap(),
                    "v{} site {k} `{}` differs from the served model",
                    r.round,
                    t.name
                );
            }
            assert!(
                r.download_bytes[k] * 8 <= r.model_bytes,
                "v{}: {} bytes down against a model of {}",
                r.round,
                r.download_bytes[k],
                r.model_bytes
            );
        }
        // Training moves every round's model.
        assert_ne!(model, &cap.models[&(r.round - 1)]);
    }
}

#[test]
fn fedbn_with_a_lossy_encoding_sends_the_model_down_as_deltas_that_every_site_applies_exactly() {
    check_deltas(BnPolicy::Local, Select::NonBn);
}

#[test]
fn fedavg_with_a_lossy_encoding_sends_bn_statistics_whole_beside_the_deltas() {
    check_deltas(BnPolicy::Global, Select::All);
}

/// FedNova's model of version `v` computed here from the decoded updates of round `v` and their
/// reported step counts: `prev + tau_eff * sum_i p_i delta_i / tau_i` (plain SGD).
fn expected_nova(cap: &Captured, v: u64) -> BTreeMap<String, Vec<f32>> {
    let ups = &cap.updates[&v];
    let total: f64 = ups.iter().map(|u| u.samples as f64).sum();
    let tau_eff: f64 = ups
        .iter()
        .map(|u| u.samples as f64 / total * u.report.local_steps as f64)
        .sum();
    expected_sum(cap, v, |p, u| p / u.report.local_steps as f64, tau_eff)
}

#[test]
fn fednova_through_the_site_engine_is_fedavg_bit_for_bit_with_equal_steps_and_normalised_without() {
    let nova = Algorithm::FedNova(Default::default());
    // 48, 64 and 40 images in batches of 32 are 2 steps each.
    let equal = [48, 64, 40];
    let avg = federate_with(Algorithm::FedAvg, BnPolicy::Local, Encoding::F32, equal);
    let fednova = federate_with(nova, BnPolicy::Local, Encoding::F32, equal);
    let steps =
        |c: &Captured| -> Vec<u64> { c.updates[&1].iter().map(|u| u.report.local_steps).collect() };
    assert_eq!(steps(&fednova), vec![2, 2, 2]);
    assert_eq!(fednova.models, avg.models);
    // 48, 128 and 40 images: 2, 4 and 2 steps.
    let unequal = [48, 128, 40];
    let avg = federate_with(Algorithm::FedAvg, BnPolicy::Local, Encoding::F32, unequal);
    let fednova = federate_with(nova, BnPolicy::Local, Encoding::F32, unequal);
    let mut s = steps(&fednova);
    s.sort();
    assert_eq!(s, vec![2, 2, 4]);
    assert_ne!(fednova.models[&1], avg.models[&1]);
    for v in 1..=3u64 {
        let want = expected_nova(&fednova, v);
        for w in &fednova.models[&v].weights {
            let got = decode(w).unwrap();
            let err = got
                .iter()
                .zip(&want[&w.name])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(err <= 1e-6, "v{v} {}: {err}", w.name);
        }
    }
}

#[test]
fn moon_through_the_site_engine_is_fedavg_in_round_one_then_contrasts_with_each_previous_model() {
    let sizes = [48, 64, 40];
    let avg = federate_with(Algorithm::FedAvg, BnPolicy::Local, Encoding::F32, sizes);
    let moon = federate_with(
        Algorithm::Moon(Default::default()),
        BnPolicy::Local,
        Encoding::F32,
        sizes,
    );
    // No site has a previous local model in round 1: MOON's updates are FedAvg's, bit for bit.
    assert_eq!(moon.updates[&1], avg.updates[&1]);
    assert_eq!(moon.models[&1], avg.models[&1]);
    // From round 2 the contrastive term moves every site's update.
    for (m, a) in moon.updates[&2].iter().zip(&avg.updates[&2]) {
        assert_ne!(m.delta, a.delta, "round 2 of a MOON site equals FedAvg's");
    }
    // The server's rule is FedAvg's: every model is the weighted mean of the decoded updates.
    check_means(&moon, Select::NonBn);
}

#[test]
fn per_fedavg_sites_take_meta_steps_and_the_server_takes_their_mean() {
    let cap = federate_with(
        Algorithm::PerFedAvg(Default::default()),
        BnPolicy::Local,
        Encoding::F32,
        [48, 64, 40],
    );
    // Each meta-step takes two batches of 32: 48, 64 and 40 images are one step each.
    for ups in cap.updates.values() {
        let steps: Vec<u64> = ups.iter().map(|u| u.report.local_steps).collect();
        assert_eq!(steps, vec![1, 1, 1]);
    }
    check_means(&cap, Select::NonBn);
    // Every round was evaluated after personalisation, on every site.
    assert!(cap.records.iter().all(|r| r.accuracy.len() == 3));
}
