//! The onboarding side of the federation core: BN tensors shared under each BN sharing policy,
//! the onboarding package they give, and the registry of sites' calibrated BN.

use crate::common::{opened, this_run};
use unifed_aggregator::{Action, Aggregator, Event, FederationConfig, GlobalModel, Incoming};
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::encoding::{Encoding, decode, encode};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    Answer, BnSharing, LocalReport, OnboardError, OnboardReply, RegistryEntry, RejectReason,
    Sealing, ServerBroadcast, SiteExtras, SiteUpdate,
};
use unifed_protocol::{Input, ModelSpec, TensorKind, TensorSpec};

/// The test key of site `s` (its seed spells the site's name).
fn key(s: &str) -> unifed_protocol::SigningKey {
    let mut seed = [7u8; 32];
    seed[..s.len()].copy_from_slice(s.as_bytes());
    unifed_protocol::SigningKey::from_seed(seed)
}

/// Sites `a`, `b` and `c`, enrolled with their test keys.
fn enrolled() -> Vec<unifed_aggregator::EnrolledSite> {
    ["a", "b", "c"]
        .iter()
        .map(|s| unifed_aggregator::EnrolledSite {
            // Vouched for: each claim counts as it is, up to the federation's cap (the tests
            // of the median cap enrol without a count).
            max_samples: Some(u64::MAX),
            ..unifed_aggregator::EnrolledSite::new(s, key(s).public())
        })
        .collect()
}

fn spec() -> ModelSpec {
    let t = |n: &str, k| TensorSpec {
        name: n.into(),
        shape: vec![2],
        kind: k,
    };
    ModelSpec {
        architecture: "toy".into(),
        tensors: vec![
            t("fc.weight", TensorKind::NonBn),
            t("bn.weight", TensorKind::BnWeight),
            t("bn.bias", TensorKind::BnBias),
            t("bn.running_mean", TensorKind::BnRunningMean),
            t("bn.running_var", TensorKind::BnRunningVar),
        ],
        classes: vec!["a".into(), "b".into()],
        input: Input::Features { len: 2 },
    }
}

fn initial() -> GlobalModel {
    GlobalModel {
        spec: spec(),
        tensors: vec![
            vec![0.5, 0.5],
            vec![1.0; 2],
            vec![0.0; 2],
            vec![0.0; 2],
            vec![1.0; 2],
        ],
    }
}

fn open(dir: &std::path::Path, sharing: BnSharing) -> Aggregator {
    let cfg = FederationConfig {
        bn_sharing: sharing,
        ..FederationConfig::new("fed1", 3, 2, enrolled())
    };
    opened(Aggregator::open(dir, cfg, initial(), 16).unwrap())
}

/// Site `s`'s BN tensors after training: weight, bias, running mean, running variance.
fn site_bn(s: &str) -> [Vec<f32>; 4] {
    match s {
        "a" => [
            vec![1.5, 0.5],
            vec![0.25, -1.0],
            vec![0.0, 4.0],
            vec![1.0, 1.0],
        ],
        _ => [
            vec![0.5, 1.5],
            vec![-0.75, 1.0],
            vec![4.0, 4.0],
            vec![3.0, 1.0],
        ],
    }
}

const NAMES: [&str; 4] = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"];

/// An update of site `s` in `round` carrying the BN tensors named by `bn`.
fn update(s: &str, round: u64, samples: u64, bn: &[&str]) -> Vec<u8> {
    let vals = site_bn(s);
    let bn = bn
        .iter()
        .map(|n| {
            let k = NAMES.iter().position(|m| m == n).unwrap();
            encode(n, &[2], &vals[k], Encoding::F32, None)
        })
        .collect();
    update_with(s, round, samples, bn)
}

/// An update of site `s` in `round` carrying the encoded tensors `bn`.
fn update_with(
    s: &str,
    round: u64,
    samples: u64,
    bn: Vec<unifed_protocol::EncodedTensor>,
) -> Vec<u8> {
    let upd = SiteUpdate {
        round,
        base_version: round - 1,
        samples,
        delta: vec![encode(
            "fc.weight",
            &[2],
            &[0.25, -0.25],
            Encoding::F32,
            None,
        )],
        bn,
        report: LocalReport::default(),
        extras: SiteExtras::None,
    };
    key(s).sign(
        &Envelope::new(
            MessageKind::SiteUpdate,
            Id::new("fed1").unwrap(),
            Id::new(s).unwrap(),
            round,
            round - 1,
            spec().hash(),
            &upd,
        )
        .in_run(this_run()),
    )
}

fn answer(agg: &mut Aggregator, s: &str, bytes: Vec<u8>) -> Answer {
    let actions = agg
        .handle(
            Event::Update(Incoming {
                site: s.into(),
                bytes: bytes.into(),
                arrival: unifed_aggregator::Arrival::Message,
                staged: None,
            }),
            1_000,
        )
        .unwrap();
    if actions.contains(&Action::Close) {
        agg.handle(Event::Close, 1_000).unwrap();
    }
    actions
        .iter()
        .find_map(|a| match a {
            Action::Answer { answer, .. } => Some(answer.clone()),
            _ => None,
        })
        .unwrap()
}

/// The package of `version` reassembled from its chunks: name -> values.
fn package(agg: &Aggregator, version: Option<u64>) -> (Vec<String>, Vec<(String, Vec<f32>)>) {
    let (info, chunks) = agg.package(version).unwrap().unwrap();
    assert_eq!(info.chunk_count as usize, chunks.len());
    let mut r = Reassembler::new(1_000, 1 << 20);
    let mut bytes = None;
    for c in chunks {
        bytes = r.insert(c.as_ref(), 0).unwrap();
    }
    let bytes = bytes.unwrap();
    assert_eq!(unifed_protocol::payload_hash(&bytes), info.payload_hash);
    let b: ServerBroadcast = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(b.model_version, info.model_version);
    let sites = info.bn_sites.iter().map(|s| s.to_string()).collect();
    let tensors = b
        .weights
        .iter()
        .map(|t| (t.name.clone(), decode(t).unwrap()))
        .collect();
    (sites, tensors)
}

fn get<'a>(p: &'a [(String, Vec<f32>)], name: &str) -> &'a [f32] {
    &p.iter().find(|(n, _)| n == name).unwrap().1
}

#[test]
fn each_policy_accepts_exactly_the_bn_tensors_it_shares() {
    let all = NAMES.as_slice();
    let affine = &NAMES[..2];
    for (sharing, want) in [
        (BnSharing::None, &[][..]),
        (BnSharing::Affine, affine),
        (BnSharing::AffineStats, all),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), sharing);
        agg.handle(Event::Start, 0).unwrap();
        // One more tensor than the policy shares: the first one it does not share.
        if let Some(extra) = NAMES.iter().find(|n| !want.contains(n)) {
            let mut more = want.to_vec();
            more.push(extra);
            assert_eq!(
                answer(&mut agg, "a", update("a", 1, 10, &more)),
                Answer::Rejected(RejectReason::UnexpectedTensor(extra.to_string())),
                "{sharing:?}"
            );
        }
        if let Some(first) = want.first() {
            assert_eq!(
                answer(&mut agg, "a", update("a", 1, 10, &want[1..])),
                Answer::Rejected(RejectReason::MissingTensor(first.to_string())),
                "{sharing:?}"
            );
        }
        assert_eq!(
            answer(&mut agg, "a", update("a", 1, 10, want)),
            Answer::Accepted
        );
    }
}

#[test]
fn shared_bn_of_the_wrong_shape_encoding_or_sign_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), BnSharing::AffineStats);
    agg.handle(Event::Start, 0).unwrap();
    let with_bn = |bn| update_with("a", 1, 10, bn);
    let good = |n: &str, v: &[f32]| encode(n, &[2], v, Encoding::F32, None);
    let base = || {
        vec![
            good("bn.weight", &[1.0, 1.0]),
            good("bn.bias", &[0.0, 0.0]),
            good("bn.running_mean", &[0.0, 0.0]),
        ]
    };
    let mut wrong_shape = base();
    wrong_shape.push(encode(
        "bn.running_var",
        &[1, 2],
        &[1.0, 1.0],
        Encoding::F32,
        None,
    ));
    let mut half = base();
    half.push(encode(
        "bn.running_var",
        &[2],
        &[1.0, 1.0],
        Encoding::F16,
        None,
    ));
    let mut negative = base();
    negative.push(good("bn.running_var", &[1.0, -0.5]));
    let mut dup = base();
    dup.push(good("bn.bias", &[0.0, 0.0]));
    for (bn, want) in [
        (
            wrong_shape,
            RejectReason::WrongShape("bn.running_var".into()),
        ),
        (half, RejectReason::WrongEncoding),
        (
            negative,
            RejectReason::Malformed("`bn.running_var` holds a negative variance".into()),
        ),
        (dup, RejectReason::DuplicateTensor("bn.bias".into())),
    ] {
        assert_eq!(answer(&mut agg, "a", with_bn(bn)), Answer::Rejected(want));
    }
}

#[test]
fn shared_bn_reaches_only_the_package_affine_averaged_and_variances_pooled() {
    for sharing in [BnSharing::None, BnSharing::Affine, BnSharing::AffineStats] {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), sharing);
        agg.handle(Event::Start, 0).unwrap();
        let shared: Vec<&str> = NAMES
            .iter()
            .zip([
                TensorKind::BnWeight,
                TensorKind::BnBias,
                TensorKind::BnRunningMean,
                TensorKind::BnRunningVar,
            ])
            .filter(|(_, k)| sharing.shares(*k))
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(
            answer(&mut agg, "b", update("b", 1, 30, &shared)),
            Answer::Accepted
        );
        assert_eq!(
            answer(&mut agg, "a", update("a", 1, 10, &shared)),
            Answer::Accepted
        );
        assert_eq!(agg.model_version(), 1);
        // The global model's BN is never touched under local BN.
        assert_eq!(&agg.model()[1..], &initial().tensors[1..]);
        let (sites, p) = package(&agg, None);
        assert_eq!(get(&p, "fc.weight"), agg.model()[0].as_slice());
        let (w, b, m, v) = (
            get(&p, "bn.weight"),
            get(&p, "bn.bias"),
            get(&p, "bn.running_mean"),
            get(&p, "bn.running_var"),
        );
        match sharing {
            BnSharing::None => {
                assert!(sites.is_empty());
                assert_eq!(
                    [w, b, m, v],
                    [&[1.0f32, 1.0][..], &[0.0, 0.0], &[0.0, 0.0], &[1.0, 1.0]]
                );
            }
            _ => {
                assert_eq!(sites, vec!["a", "b"]);
                // Weights 10 and 30.
                assert_eq!(w, &[0.75, 1.25]);
                assert_eq!(b, &[-0.5, 0.5]);
                if sharing == BnSharing::Affine {
                    assert_eq!([m, v], [&[0.0f32, 0.0][..], &[1.0, 1.0]]);
                } else {
                    assert_eq!(m, &[3.0, 4.0]);
                    // Channel 0: (10 (1 + 9) + 30 (3 + 1)) / 40 = 5.5.
                    assert_eq!(v, &[5.5, 1.0]);
                }
            }
        }
        // Version 0's package is the initial model, whatever the policy.
        let (_, p0) = package(&agg, Some(0));
        let want: Vec<Vec<f32>> = initial().tensors;
        let got: Vec<Vec<f32>> = p0.iter().map(|(_, v)| v.clone()).collect();
        assert_eq!(got, want);
        // A version the federation has not reached is refused with those it holds.
        assert_eq!(
            agg.package(Some(7)).unwrap().unwrap_err(),
            OnboardError::UnknownVersion {
                requested: 7,
                available: vec![0, 1]
            }
        );
    }
}

fn entry(version: u64, sealing: Sealing, data: &[u8]) -> Vec<u8> {
    postcard::to_allocvec(&RegistryEntry {
        model_version: version,
        sealing,
        data: data.to_vec(),
    })
    .unwrap()
}

#[test]
fn the_registry_stores_sealed_entries_durably_and_refuses_what_it_must() {
    let dir = tempfile::tempdir().unwrap();
    let site = Id::new("new-site").unwrap();
    let sealed = entry(
        0,
        Sealing::ChaCha20Poly1305 { nonce: [3; 12] },
        b"ciphertext",
    );
    {
        let mut agg = open(dir.path(), BnSharing::None);
        agg.handle(Event::Start, 0).unwrap();
        assert_eq!(
            agg.registry_get(&site, None).unwrap().unwrap_err(),
            OnboardError::NotRegistered {
                requested: None,
                available: vec![]
            }
        );
        let r = agg.registry_put(&site, &sealed, 5).unwrap();
        assert_eq!(
            r,
            OnboardReply::Registered {
                model_version: 0,
                entry_hash: unifed_protocol::payload_hash(&sealed)
            }
        );
        let plain = entry(0, Sealing::Plain, b"stats");
        match agg.registry_put(&site, &plain, 5).unwrap() {
            OnboardReply::Error(OnboardError::Refused(m)) => {
                assert!(m.contains("plaintext") && m.contains("`none`"), "{m}")
            }
            o => panic!("{o:?}"),
        }
        assert_eq!(
            agg.registry_put(&site, &entry(4, Sealing::Plain, b""), 5)
                .unwrap(),
            OnboardReply::Error(OnboardError::UnknownVersion {
                requested: 4,
                available: vec![0]
            })
        );
        match agg.registry_put(&site, b"\xff\xff", 5).unwrap() {
            OnboardReply::Error(OnboardError::Refused(m)) => {
                assert!(m.contains("malformed"), "{m}")
            }
            o => panic!("{o:?}"),
        }
    }
    // A restarted aggregator serves the same bytes.
    let agg = open(dir.path(), BnSharing::None);
    assert_eq!(agg.registry_get(&site, None).unwrap().unwrap(), sealed);
    assert_eq!(agg.registry_get(&site, Some(0)).unwrap().unwrap(), sealed);
    assert_eq!(
        agg.registry_get(&site, Some(2)).unwrap().unwrap_err(),
        OnboardError::NotRegistered {
            requested: Some(2),
            available: vec![0]
        }
    );
    assert_eq!(
        agg.registry_get(&Id::new("other").unwrap(), None)
            .unwrap()
            .unwrap_err(),
        OnboardError::NotRegistered {
            requested: None,
            available: vec![]
        }
    );
    // Under affine+stats a site may store its BN in plaintext.
    let dir2 = tempfile::tempdir().unwrap();
    let agg = open(dir2.path(), BnSharing::AffineStats);
    assert!(matches!(
        agg.registry_put(&site, &entry(0, Sealing::Plain, b"stats"), 5)
            .unwrap(),
        OnboardReply::Registered { .. }
    ));
}

#[test]
fn sharing_needs_local_bn() {
    let cfg = FederationConfig {
        bn_sharing: BnSharing::Affine,
        bn_policy: unifed_protocol::BnPolicy::Global,
        ..FederationConfig::new("fed1", 3, 2, enrolled())
    };
    let errs = cfg.validate().unwrap_err().0;
    assert_eq!(
        errs,
        [unifed_aggregator::ConfigProblem::SharingNeedsLocal(
            "affine"
        )]
    );
}

#[test]
fn registry_entries_are_pruned_with_their_model_and_uncommitted_versions_are_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        keep_versions: 1,
        ..FederationConfig::new("fed1", 3, 1, enrolled())
    };
    let mut agg = opened(Aggregator::open(dir.path(), cfg, initial(), 16).unwrap());
    agg.handle(Event::Start, 0).unwrap();
    let site = Id::new("new-site").unwrap();
    let sealed = entry(0, Sealing::ChaCha20Poly1305 { nonce: [1; 12] }, b"v0");
    assert!(matches!(
        agg.registry_put(&site, &sealed, 5).unwrap(),
        OnboardReply::Registered { .. }
    ));
    // A model file past the committed version (a close that crashed before its commit).
    agg.store()
        .save_model(5, &spec().hash().0, &initial().tensors)
        .unwrap();
    assert_eq!(
        agg.package(Some(5)).unwrap().unwrap_err(),
        OnboardError::UnknownVersion {
            requested: 5,
            available: vec![0]
        }
    );
    // Round 1 closes: version 0 is pruned (keep 1), and its registry entry with it.
    assert_eq!(
        answer(&mut agg, "a", update("a", 1, 10, &[])),
        Answer::Accepted
    );
    assert_eq!(agg.model_version(), 1);
    assert_eq!(
        agg.registry_get(&site, None).unwrap().unwrap_err(),
        OnboardError::NotRegistered {
            requested: None,
            available: vec![]
        }
    );
    assert!(agg.package(Some(0)).unwrap().is_err());
}

/// Flips one byte in the middle of the file at `p`.
fn flip(p: &std::path::Path) {
    crate::core::tamper(p, |b| {
        let i = b.len() / 2;
        b[i] ^= 0x40;
    });
}

/// The files set aside in the data folder's `corrupt/`, by name without the time.
fn set_aside(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("corrupt"))
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let n = e.file_name().to_string_lossy().to_string();
                    n[..n.rfind('-').unwrap()].to_string()
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_damaged_kept_file_refuses_its_request_is_set_aside_and_is_found_again_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig::new("fed1", 3, 1, enrolled());
    let mut agg = opened(Aggregator::open(dir.path(), cfg.clone(), initial(), 16).unwrap());
    agg.handle(Event::Start, 0).unwrap();
    let site = Id::new("new-site").unwrap();
    let sealed = entry(0, Sealing::ChaCha20Poly1305 { nonce: [1; 12] }, b"v0");
    agg.registry_put(&site, &sealed, 5).unwrap();
    assert_eq!(
        answer(&mut agg, "a", update("a", 1, 10, &[])),
        Answer::Accepted
    );
    assert_eq!(agg.model_version(), 1);
    // Version 0 is kept on disk; a byte of it and of the registry entry flips.
    flip(&dir.path().join("models/v0.bin"));
    flip(&dir.path().join("registry/new-site/v0.entry"));
    // Each request is refused by name, and the core goes on.
    assert_eq!(
        agg.package(Some(0)).unwrap().unwrap_err(),
        OnboardError::Unreadable { requested: 0 }
    );
    assert_eq!(
        agg.registry_get(&site, Some(0)).unwrap().unwrap_err(),
        OnboardError::Unreadable { requested: 0 }
    );
    assert_eq!(
        set_aside(dir.path()),
        ["models-v0.bin", "registry-new-site-v0.entry"]
    );
    // Set aside, they are no longer offered; the current version is served as before.
    assert_eq!(
        agg.package(Some(0)).unwrap().unwrap_err(),
        OnboardError::UnknownVersion {
            requested: 0,
            available: vec![1]
        }
    );
    assert_eq!(package(&agg, Some(1)).1.len(), spec().tensors.len());
    assert_eq!(
        answer(&mut agg, "b", update("b", 2, 10, &[])),
        Answer::Accepted
    );
    let damaged: Vec<String> = agg
        .store()
        .audit_entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "damaged-file")
        .map(|e| e.detail)
        .collect();
    assert_eq!(damaged.len(), 2, "{damaged:?}");
    assert!(damaged[0].contains("v0.bin"), "{damaged:?}");
    drop(agg);
    // A file damaged while the aggregator is stopped is set aside when it starts, before any
    // request reads it.
    flip(&dir.path().join("models/v1.bin"));
    let agg = opened(Aggregator::open(dir.path(), cfg, initial(), 16).unwrap());
    assert_eq!(
        set_aside(dir.path()),
        [
            "models-v0.bin",
            "models-v1.bin",
            "registry-new-site-v0.entry"
        ]
    );
    assert_eq!(
        agg.package(Some(1)).unwrap().unwrap_err(),
        OnboardError::UnknownVersion {
            requested: 1,
            available: vec![2]
        }
    );
}
