//! The federation core driven by scripted updates: no burn, no network.

use crate::common::{opened, this_run};
use std::path::Path;
use unifed_aggregator::core::AdmitError;
use unifed_aggregator::store::{AuditEntry, SpoolEntry, SpoolTensor, Store};
use unifed_aggregator::{
    Action, Aggregator, Arrival, ConfigProblem, ConfigProblems, Event, FederationConfig,
    GlobalModel, Incoming, Weighting,
};
use unifed_protocol::AuthError;
use unifed_protocol::encoding::{Encoding, encode};
use unifed_protocol::envelope::{Envelope, MessageKind, PROTOCOL_VERSION};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    Answer, BnPolicy, LocalReport, RejectReason, SiteExtras, SiteUpdate,
};
use unifed_protocol::{Input, ModelSpec, TensorKind, TensorSpec};

/// The test key of site `s` (its seed spells the site's name).
fn key(s: &str) -> unifed_protocol::SigningKey {
    let mut seed = [7u8; 32];
    seed[..s.len()].copy_from_slice(s.as_bytes());
    unifed_protocol::SigningKey::from_seed(seed)
}

/// Every site of these tests (`a`, `b` and `c` first), enrolled with its test key.
fn enrolled() -> Vec<unifed_aggregator::EnrolledSite> {
    ["a", "b", "c", "bb", "ccc", "site-a", "site-b", "site-c"]
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
    let t = |n: &str, s: &[usize], k| TensorSpec {
        name: n.into(),
        shape: s.to_vec(),
        kind: k,
    };
    ModelSpec {
        architecture: "toy".into(),
        tensors: vec![
            t("fc.weight", &[2, 3], TensorKind::NonBn),
            t("fc.bias", &[2], TensorKind::NonBn),
            t("bn.weight", &[2], TensorKind::BnWeight),
            t("bn.bias", &[2], TensorKind::BnBias),
            t("bn.running_mean", &[2], TensorKind::BnRunningMean),
            t("bn.running_var", &[2], TensorKind::BnRunningVar),
        ],
        classes: vec!["a".into(), "b".into()],
        input: Input::Features { len: 3 },
    }
}

fn initial() -> GlobalModel {
    GlobalModel {
        spec: spec(),
        tensors: vec![
            vec![0.5; 6],
            vec![0.1, -0.1],
            vec![1.0; 2],
            vec![0.0; 2],
            vec![0.0; 2],
            vec![1.0; 2],
        ],
    }
}

fn config(rounds: u64, min_sites: usize, bn: BnPolicy) -> FederationConfig {
    FederationConfig {
        bn_policy: bn,
        ..FederationConfig::new("fed1", rounds, min_sites, enrolled())
    }
}

/// `cfg` with no site enrolled with a sample count: every weight is capped at the median's.
fn unvouched(mut cfg: FederationConfig) -> FederationConfig {
    for s in &mut cfg.sites {
        s.max_samples = None;
    }
    cfg
}

/// Per-site deterministic delta values for tensor `i` of `round`.
fn delta_values(site: &str, round: u64, i: usize, len: usize) -> Vec<f32> {
    let s = site.bytes().map(u32::from).sum::<u32>() as f32;
    (0..len)
        .map(|k| (s * 0.37 + round as f32 * 1.3 + i as f32 * 0.7 + k as f32 * 0.11).sin() * 0.2)
        .collect()
}

struct Upd<'a> {
    site: &'a str,
    round: u64,
    version: u64,
    samples: u64,
    bn: BnPolicy,
}

fn update_bytes(u: &Upd, tweak: impl FnOnce(&mut SiteUpdate, &mut Envelope)) -> Vec<u8> {
    let sp = spec();
    let delta = sp
        .tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| u.bn == BnPolicy::Global || !t.kind.is_bn())
        .map(|(i, t)| {
            let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
            encode(
                &t.name,
                &shape,
                &delta_values(u.site, u.round, i, t.numel()),
                Encoding::F32,
                None,
            )
        })
        .collect();
    let mut upd = SiteUpdate {
        round: u.round,
        base_version: u.version,
        samples: u.samples,
        delta,
        bn: vec![],
        report: LocalReport::default(),
        extras: SiteExtras::None,
    };
    let fed = Id::new("fed1").unwrap();
    let site = Id::new(u.site).unwrap();
    let mut env = Envelope::new(
        MessageKind::SiteUpdate,
        fed,
        site,
        u.round,
        u.version,
        sp.hash(),
        &upd,
    )
    .in_run(this_run());
    tweak(&mut upd, &mut env);
    env.payload = postcard::to_allocvec(&upd).unwrap();
    key(u.site).sign(&env)
}

fn good(site: &str, round: u64, version: u64, samples: u64, bn: BnPolicy) -> Vec<u8> {
    update_bytes(
        &Upd {
            site,
            round,
            version,
            samples,
            bn,
        },
        |_, _| {},
    )
}

/// Site `a`'s update for federation `fed2`, signed by `a`.
fn elsewhere_signed() -> Vec<u8> {
    let mut e = Envelope::decode(&good("a", 1, 0, 5, BnPolicy::Local)).unwrap();
    e.federation = Id::new("fed2").unwrap();
    e.signature = None;
    e.encode()
}

fn answers(actions: &[Action]) -> Vec<(String, Answer)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Answer { site, answer, .. } => Some((site.to_string(), answer.clone())),
            _ => None,
        })
        .collect()
}

/// The actions of an update, with the fold an [`Action::Close`] asks for done in its place.
fn send(agg: &mut Aggregator, site: &str, bytes: Vec<u8>) -> Vec<Action> {
    let acts = agg
        .handle(
            Event::Update(Incoming {
                site: site.into(),
                bytes: bytes.into(),
                arrival: Arrival::Message,
                staged: None,
            }),
            1_000,
        )
        .unwrap();
    closed(agg, acts)
}

/// `acts` with an [`Action::Close`] replaced by what the core does on [`Event::Close`].
fn closed(agg: &mut Aggregator, acts: Vec<Action>) -> Vec<Action> {
    let mut out = Vec::new();
    for a in acts {
        if a == Action::Close {
            out.extend(agg.handle(Event::Close, 1_000).unwrap());
        } else {
            out.push(a);
        }
    }
    out
}

/// The expected model after one round: base + sum(w * delta) / sum(w), computed here in f64.
fn expected_after(
    base: &[Vec<f32>],
    sites: &[(&str, u64)],
    round: u64,
    bn: BnPolicy,
) -> Vec<Vec<f32>> {
    let sp = spec();
    let total: f64 = sites.iter().map(|s| s.1 as f64).sum();
    base.iter()
        .enumerate()
        .map(|(i, b)| {
            if bn == BnPolicy::Local && sp.tensors[i].kind.is_bn() {
                return b.clone();
            }
            (0..b.len())
                .map(|k| {
                    let s: f64 = sites
                        .iter()
                        .map(|(site, n)| {
                            *n as f64 * delta_values(site, round, i, b.len())[k] as f64
                        })
                        .sum();
                    (b[k] as f64 + s / total) as f32
                })
                .collect()
        })
        .collect()
}

fn open(dir: &Path, cfg: FederationConfig) -> Aggregator {
    opened(Aggregator::open(dir, cfg, initial(), 64).unwrap())
}

#[test]
fn a_round_gives_the_sample_weighted_mean_and_leaves_bn_alone_under_local() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 3, BnPolicy::Local));
    let start = agg.handle(Event::Start, 0).unwrap();
    assert!(
        matches!(&start[0], Action::Publish { manifest, model, .. } if manifest.round == 1 && manifest.chunk_count == model.count() && manifest.payload_hash == model.payload_hash())
    );
    let sites = [("site-a", 100u64), ("site-b", 300), ("site-c", 50)];
    let mut last = Vec::new();
    for (s, n) in sites {
        last = send(&mut agg, s, good(s, 1, 0, n, BnPolicy::Local));
        assert_eq!(answers(&last), vec![(s.to_string(), Answer::Accepted)]);
    }
    assert!(last.iter().any(|a| matches!(a, Action::RoundClosed { round: 1, model_version: 1, sites } if sites.len() == 3)));
    let want = expected_after(&initial().tensors, &sites, 1, BnPolicy::Local);
    for (got, want) in agg.model().iter().zip(&want) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }
    assert_eq!(
        &agg.model()[2..],
        &initial().tensors[2..],
        "BN tensors untouched under local"
    );
    assert_eq!((agg.round(), agg.model_version()), (2, 1));
}

#[test]
fn under_global_bn_the_bn_tensors_are_averaged_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(1, 2, BnPolicy::Global));
    agg.handle(Event::Start, 0).unwrap();
    let sites = [("a", 10u64), ("b", 30)];
    for (s, n) in sites {
        send(&mut agg, s, good(s, 1, 0, n, BnPolicy::Global));
    }
    let want = expected_after(&initial().tensors, &sites, 1, BnPolicy::Global);
    assert_ne!(agg.model()[4], initial().tensors[4]);
    for (got, want) in agg.model().iter().zip(&want) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6);
        }
    }
    assert!(agg.finished());
}

/// The update that completes a round is answered before the round is folded: the core asks
/// for the fold with `Action::Close` after the answer, and folds on `Event::Close` only while
/// the round has the updates it needs.
#[test]
fn the_last_update_is_answered_before_the_fold_it_asks_for() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let update = |agg: &mut Aggregator, site: &str| {
        agg.handle(
            Event::Update(Incoming {
                site: site.into(),
                bytes: good(site, 1, 0, 10, BnPolicy::Local).into(),
                arrival: Arrival::Message,
                staged: None,
            }),
            1_000,
        )
        .unwrap()
    };
    let first = update(&mut agg, "a");
    assert_eq!(answers(&first), vec![("a".into(), Answer::Accepted)]);
    assert!(!first.contains(&Action::Close));
    // One update of the two needed: a Close changes nothing.
    assert!(agg.handle(Event::Close, 1_000).unwrap().is_empty());
    assert_eq!((agg.round(), agg.model_version()), (1, 0));
    let last = update(&mut agg, "b");
    assert_eq!(answers(&last), vec![("b".into(), Answer::Accepted)]);
    assert_eq!(last.last(), Some(&Action::Close));
    assert_eq!(last.len(), 2, "{last:?}");
    // Answered, spooled, not yet folded.
    assert_eq!((agg.round(), agg.model_version()), (1, 0));
    let fold = agg.handle(Event::Close, 1_000).unwrap();
    assert!(fold.iter().any(|a| matches!(
        a,
        Action::RoundClosed {
            round: 1,
            model_version: 1,
            ..
        }
    )));
    assert_eq!((agg.round(), agg.model_version()), (2, 1));
    // The round is closed: another Close does nothing.
    assert!(agg.handle(Event::Close, 1_000).unwrap().is_empty());
    assert_eq!(agg.model_version(), 1);
}

#[test]
fn a_redelivered_update_is_counted_once_and_answered_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let a = good("a", 1, 0, 10, BnPolicy::Local);
    assert_eq!(
        answers(&send(&mut agg, "a", a.clone())),
        vec![("a".into(), Answer::Accepted)]
    );
    assert_eq!(
        answers(&send(&mut agg, "a", a.clone())),
        vec![("a".into(), Answer::Accepted)]
    );
    assert_eq!(agg.accepted(), vec!["a".to_string()]);
    send(&mut agg, "b", good("b", 1, 0, 10, BnPolicy::Local));
    assert_eq!(agg.round(), 2);
    // After the round closed: the original answer again, and the model is unchanged.
    let model = agg.model().to_vec();
    assert_eq!(
        answers(&send(&mut agg, "a", a)),
        vec![("a".into(), Answer::Accepted)]
    );
    assert_eq!(agg.model(), &model[..]);
    // A site that never reported in round 1 gets RoundClosed.
    assert_eq!(
        answers(&send(&mut agg, "c", good("c", 1, 0, 10, BnPolicy::Local))),
        vec![("c".into(), Answer::Rejected(RejectReason::RoundClosed(1)))]
    );
    let dups = agg
        .store()
        .audit_entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "duplicate")
        .count();
    assert_eq!(dups, 2);
}

/// The first chunk of an upload re-sent after its round closed (all the ingest hands on) is
/// answered as the whole update would be, naming the hash it names: accepted for a site folded
/// into that round, `RoundClosed` for one that was not; nothing for the open round.
#[test]
fn a_resent_first_chunk_of_a_closed_round_gets_the_rounds_answer() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let resent = |agg: &mut Aggregator, site: &str, round: u64| {
        let event = Event::Resent {
            site: Id::new(site).unwrap(),
            round,
            hash: [round as u8; 32],
        };
        agg.handle(event, 1_000).unwrap()
    };
    // Round 1 is open: not answered (the ingest takes its chunks).
    assert!(resent(&mut agg, "a", 1).is_empty());
    send(&mut agg, "a", good("a", 1, 0, 10, BnPolicy::Local));
    send(&mut agg, "b", good("b", 1, 0, 10, BnPolicy::Local));
    assert_eq!(agg.round(), 2);
    let model = agg.model().to_vec();
    let got = resent(&mut agg, "a", 1);
    assert_eq!(
        got,
        vec![Action::Answer {
            site: Id::new("a").unwrap(),
            round: 1,
            update_hash: [1; 32],
            answer: Answer::Accepted
        }]
    );
    assert_eq!(
        answers(&resent(&mut agg, "c", 1)),
        vec![("c".into(), Answer::Rejected(RejectReason::RoundClosed(1)))]
    );
    // Round 2 is open, and nothing changed.
    assert!(resent(&mut agg, "a", 2).is_empty());
    assert_eq!((agg.round(), agg.model()), (2, &model[..]));
}

#[test]
fn an_answer_names_the_transports_hash_of_a_reassembled_update_or_the_bytes_own() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 3, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let hashes = |actions: &[Action]| -> Vec<[u8; 32]> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Answer { update_hash, .. } => Some(*update_hash),
                _ => None,
            })
            .collect()
    };
    let a = good("a", 1, 0, 10, BnPolicy::Local);
    let own = unifed_protocol::chunking::payload_hash(&a);
    assert_eq!(hashes(&send(&mut agg, "a", a)), vec![own]);
    // A chunked update's set hash is what its signed chunks named: the core answers with it
    // instead of hashing the bytes (a stand-in value makes that visible).
    let b = good("b", 1, 0, 10, BnPolicy::Local);
    let set = [7u8; 32];
    assert_ne!(set, unifed_protocol::chunking::payload_hash(&b));
    let acts = agg
        .handle(
            Event::Update(Incoming {
                site: "b".into(),
                bytes: b.into(),
                arrival: Arrival::SignedChunks { hash: set },
                staged: None,
            }),
            1_000,
        )
        .unwrap();
    assert_eq!(hashes(&acts), vec![set]);
    assert_eq!(answers(&acts), vec![("b".into(), Answer::Accepted)]);
}

/// An update that came as signed chunks is not checked against its envelope's own signature
/// (every byte of it was signed in its chunk); everything else about the envelope still is.
/// One message is checked in full.
#[test]
fn signed_chunks_spare_the_envelopes_signature_and_nothing_else() {
    let update = |agg: &mut Aggregator, site: &str, bytes: Vec<u8>, arrival| {
        let acts = agg
            .handle(
                Event::Update(Incoming {
                    site: site.into(),
                    bytes: bytes.into(),
                    arrival,
                    staged: None,
                }),
                1_000,
            )
            .unwrap();
        answers(&acts)
    };
    let chunks = Arrival::SignedChunks { hash: [1; 32] };
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(3, 3, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    // The signature's last byte flipped: refused as a message, taken from chunks.
    let mut forged = good("a", 1, 0, 10, BnPolicy::Local);
    *forged.last_mut().unwrap() ^= 1;
    assert_eq!(
        update(&mut agg, "a", forged.clone(), Arrival::Message),
        vec![]
    );
    assert_eq!(
        update(&mut agg, "a", forged, chunks),
        vec![("a".into(), Answer::Accepted)]
    );
    // On another site's topic, unsigned, of another federation, from a site not enrolled:
    // refused and not answered, whichever way they came.
    let mut unsigned = Envelope::decode(&good("b", 1, 0, 10, BnPolicy::Local)).unwrap();
    unsigned.signature = None;
    let stranger = {
        let mut e = Envelope::decode(&good("b", 1, 0, 10, BnPolicy::Local)).unwrap();
        e.sender = Id::new("zed").unwrap();
        key("zed").sign(&e)
    };
    for arrival in [Arrival::Message, chunks] {
        for (topic, bytes) in [
            ("c", good("b", 1, 0, 10, BnPolicy::Local)),
            ("b", unsigned.encode()),
            ("a", elsewhere_signed()),
            ("zed", stranger.clone()),
        ] {
            assert_eq!(update(&mut agg, topic, bytes, arrival), vec![], "{topic}");
        }
    }
    assert_eq!(
        update(&mut agg, "b", good("b", 1, 0, 10, BnPolicy::Local), chunks),
        vec![("b".into(), Answer::Accepted)]
    );
}

/// An accepted update's staged file (the service's reassembled upload) becomes its spool
/// file: the same file, renamed, with the message at its head. A refused update's staged file
/// is left where it is, for the caller to remove. The round folds from the adopted file as it
/// folds from a written one, to the same bits.
#[test]
fn an_accepted_update_adopts_its_staged_file_as_the_spool_and_a_refused_one_leaves_it() {
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let mut models = Vec::new();
    for stage in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
        agg.handle(Event::Start, 0).unwrap();
        let incoming = tempfile::tempdir_in(dir.path()).unwrap();
        let update = |agg: &mut Aggregator, site: &str, bytes: Vec<u8>| {
            let staged = incoming.path().join(format!("{site}.complete"));
            std::fs::write(&staged, &bytes).unwrap();
            let ino = inode(&staged);
            let acts = agg
                .handle(
                    Event::Update(Incoming {
                        site: site.into(),
                        bytes: bytes.clone().into(),
                        arrival: Arrival::Message,
                        staged: stage.then(|| staged.clone()),
                    }),
                    1_000,
                )
                .unwrap();
            (closed(agg, acts), staged, ino, bytes)
        };
        // Refused (a round that is not open): the file stays.
        let (acts, staged, _, _) = update(&mut agg, "a", good("a", 2, 0, 10, BnPolicy::Local));
        assert!(matches!(answers(&acts)[..], [(_, Answer::Rejected(_))]));
        assert!(staged.exists());
        for site in ["a", "b"] {
            let spool = dir.path().join(format!("spool/r1/{site}.upd"));
            let (acts, staged, ino, bytes) = update(
                &mut agg,
                site,
                good(site, 1, 0, 10 + site.len() as u64, BnPolicy::Local),
            );
            assert_eq!(answers(&acts)[0], (site.to_string(), Answer::Accepted));
            if site == "b" {
                // The round closed and its spool went with it.
                assert!(!spool.exists());
                continue;
            }
            assert_eq!(staged.exists(), !stage);
            assert_eq!(inode(&spool) == ino, stage);
            assert_eq!(std::fs::read(&spool).unwrap()[..bytes.len()], bytes[..]);
        }
        assert_eq!(agg.model_version(), 1);
        models.push(agg.model().to_vec());
    }
    let bits = |m: &[Vec<f32>]| -> Vec<Vec<u32>> {
        m.iter()
            .map(|t| t.iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits(&models[0]), bits(&models[1]));
}

/// Updates the service finds waiting together are taken as one event, checked and spooled
/// side by side (in waves of different sites), yet answered, audited and folded exactly as if
/// they had come one by one: a bad one is refused alone, a site's second message waits for its
/// first, a staged file is adopted, and the round's fold is asked for once, after every answer.
#[test]
fn updates_taken_together_are_answered_and_folded_as_if_taken_one_by_one() {
    let mut runs = Vec::new();
    for together in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), config(2, 4, BnPolicy::Local));
        agg.handle(Event::Start, 0).unwrap();
        // Messages of this aggregator's run.
        let nan = update_bytes(
            &Upd {
                site: "b",
                round: 1,
                version: 0,
                samples: 5,
                bn: BnPolicy::Local,
            },
            |upd, _| upd.delta[1] = encode("fc.bias", &[2], &[f32::NAN, 0.0], Encoding::F32, None),
        );
        // On two cores or more, the second `a` would share the first's wave if a site's messages
        // were not kept to one a wave.
        let batch: Vec<(&str, Vec<u8>, bool)> = vec![
            ("a", good("a", 1, 0, 100, BnPolicy::Local), false),
            ("a", good("a", 1, 0, 100, BnPolicy::Local), false),
            ("b", nan, false),
            ("bb", good("bb", 1, 0, 70, BnPolicy::Local), true),
            ("c", good("c", 2, 0, 30, BnPolicy::Local), false),
            ("c", good("c", 1, 0, 30, BnPolicy::Local), false),
            ("ccc", good("ccc", 1, 0, 20, BnPolicy::Local), true),
        ];
        let incoming = tempfile::tempdir_in(dir.path()).unwrap();
        let items: Vec<Incoming> = batch
            .iter()
            .enumerate()
            .map(|(i, (site, bytes, stage))| {
                let staged = incoming.path().join(format!("{i}.complete"));
                std::fs::write(&staged, bytes).unwrap();
                Incoming {
                    site: site.to_string(),
                    bytes: bytes.clone().into(),
                    arrival: Arrival::Message,
                    staged: stage.then_some(staged),
                }
            })
            .collect();
        let acts: Vec<Action> = if together {
            agg.handle(Event::Updates(items), 1_000).unwrap()
        } else {
            items
                .into_iter()
                .flat_map(|u| agg.handle(Event::Update(u), 1_000).unwrap())
                .collect()
        };
        // One Close, after every answer; nothing folded before it.
        assert_eq!(acts.iter().filter(|a| **a == Action::Close).count(), 1);
        assert_eq!(acts.last(), Some(&Action::Close));
        assert_eq!((agg.round(), agg.model_version()), (1, 0));
        let answered = answers(&acts);
        for (i, staged) in [(3, true), (6, true), (0, false)] {
            // Adopted as the spool file: gone from where it was staged.
            assert_eq!(
                !incoming.path().join(format!("{i}.complete")).exists(),
                staged
            );
        }
        let folded = agg.handle(Event::Close, 1_000).unwrap();
        assert!(folded.iter().any(|a| matches!(a, Action::RoundClosed { round: 1, model_version: 1, sites } if sites == &["a", "bb", "c", "ccc"])));
        let audit: Vec<(String, String)> = agg
            .store()
            .audit_entries()
            .unwrap()
            .into_iter()
            .map(|e| (e.site, e.event))
            .collect();
        let bits: Vec<Vec<u32>> = agg
            .model()
            .iter()
            .map(|t| t.iter().map(|v| v.to_bits()).collect())
            .collect();
        runs.push((answered, audit, bits));
    }
    let accepted = |s: &str| (s.to_string(), Answer::Accepted);
    assert_eq!(
        runs[0].0,
        vec![
            accepted("a"),
            accepted("a"),
            (
                "b".into(),
                Answer::Rejected(RejectReason::NonFinite("fc.bias".into()))
            ),
            accepted("bb"),
            (
                "c".into(),
                Answer::Rejected(RejectReason::WrongRound {
                    expected: 1,
                    got: 2
                })
            ),
            accepted("c"),
            accepted("ccc"),
        ]
    );
    assert_eq!(runs[0], runs[1]);
    let want = expected_after(
        &initial().tensors,
        &[("a", 100), ("bb", 70), ("c", 30), ("ccc", 20)],
        1,
        BnPolicy::Local,
    );
    for (got, want) in runs[1].2.iter().zip(&want) {
        for (g, w) in got.iter().zip(want) {
            assert!((f32::from_bits(*g) - w).abs() < 1e-6);
        }
    }
}

#[test]
fn bad_updates_are_rejected_with_their_reason_while_the_round_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(1, 2, BnPolicy::Local);
    cfg.max_update_bytes = 4096;
    cfg.norm_bound = Some(100.0);
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    let u = |s| Upd {
        site: s,
        round: 1,
        version: 0,
        samples: 5,
        bn: BnPolicy::Local,
    };
    let rej = |agg: &mut Aggregator, bytes: Vec<u8>| -> RejectReason {
        match answers(&send(agg, "a", bytes)).pop() {
            Some((_, Answer::Rejected(r))) => r,
            other => panic!("expected a reject, got {other:?}"),
        }
    };
    let full = good("a", 1, 0, 5, BnPolicy::Local);
    // What is not the site's own signed bytes is dropped unanswered: cut, too large, of
    // another protocol version, unsigned, signed by another key, or replayed from another
    // federation.
    let mut big = full.clone();
    big.resize(5000, 0);
    let mut wrong_version = full.clone();
    wrong_version[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let unsigned = {
        let mut e = Envelope::decode(&full).unwrap();
        e.signature = None;
        e.encode()
    };
    let forged = key("b").sign(&Envelope::decode(&full).unwrap());
    let elsewhere = {
        let mut e = Envelope::decode(&full).unwrap();
        e.federation = Id::new("fed2").unwrap();
        e.encode()
    };
    for junk in [
        full[..full.len() / 2].to_vec(),
        big,
        wrong_version,
        unsigned,
        forged,
        elsewhere,
        key("a").sign(&Envelope::decode(&elsewhere_signed()).unwrap()),
    ] {
        assert!(answers(&send(&mut agg, "a", junk)).is_empty());
    }
    assert!(agg.store().audit_entries().unwrap().is_empty());
    let wrong_spec = update_bytes(&u("a"), |_, e| e.spec_hash.0[0] ^= 1);
    assert_eq!(rej(&mut agg, wrong_spec), RejectReason::SpecHashMismatch);
    let wrong_shape = update_bytes(&u("a"), |upd, _| upd.delta[0].shape = vec![3, 2]);
    assert_eq!(
        rej(&mut agg, wrong_shape),
        RejectReason::WrongShape("fc.weight".into())
    );
    let nan = update_bytes(&u("a"), |upd, _| {
        upd.delta[1] = encode("fc.bias", &[2], &[f32::NAN, 0.0], Encoding::F32, None)
    });
    assert_eq!(
        rej(&mut agg, nan),
        RejectReason::NonFinite("fc.bias".into())
    );
    let bn = update_bytes(&u("a"), |upd, _| {
        upd.delta.push(encode(
            "bn.running_mean",
            &[2],
            &[0.0, 0.0],
            Encoding::F32,
            None,
        ))
    });
    assert_eq!(
        rej(&mut agg, bn),
        RejectReason::UnexpectedTensor("bn.running_mean".into())
    );
    let missing = update_bytes(&u("a"), |upd, _| {
        upd.delta.pop();
    });
    assert_eq!(
        rej(&mut agg, missing),
        RejectReason::MissingTensor("fc.bias".into())
    );
    let f16 = update_bytes(&u("a"), |upd, _| {
        upd.delta[1] = encode("fc.bias", &[2], &[0.0, 0.0], Encoding::F16, None)
    });
    assert_eq!(rej(&mut agg, f16), RejectReason::WrongEncoding);
    let huge = update_bytes(&u("a"), |upd, _| {
        upd.delta[1] = encode("fc.bias", &[2], &[500.0, 0.0], Encoding::F32, None)
    });
    // The bound on by default: the model's own norm (over what updates carry) times
    // max_relative_norm = 1, under the absolute norm_bound of 100.
    let model_norm = initial().tensors[..2]
        .iter()
        .flatten()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    assert!(
        matches!(rej(&mut agg, huge), RejectReason::NormTooLarge { norm, bound } if bound == model_norm && (norm - 500.0).abs() < 1e-3)
    );
    assert_eq!(
        rej(&mut agg, good("a", 2, 0, 5, BnPolicy::Local)),
        RejectReason::WrongRound {
            expected: 1,
            got: 2
        }
    );
    assert_eq!(
        rej(&mut agg, good("a", 1, 7, 5, BnPolicy::Local)),
        RejectReason::WrongModelVersion {
            expected: 0,
            got: 7
        }
    );
    assert_eq!(
        rej(&mut agg, good("a", 1, 0, 0, BnPolicy::Local)),
        RejectReason::NoSamples
    );
    // The round still runs: two good updates close it.
    send(&mut agg, "a", full);
    let done = send(&mut agg, "b", good("b", 1, 0, 5, BnPolicy::Local));
    assert!(
        done.iter()
            .any(|a| matches!(a, Action::Finished { model_version: 1 }))
    );
    let audit = agg.store().audit_entries().unwrap();
    assert_eq!(audit.iter().filter(|e| e.event == "rejected").count(), 10);
    assert_eq!(audit.iter().filter(|e| e.event == "accepted").count(), 2);
}

#[test]
fn the_deadline_closes_a_round_with_the_sites_that_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(2, 3, BnPolicy::Local);
    cfg.deadline_secs = 10;
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    send(&mut agg, "a", good("a", 1, 0, 7, BnPolicy::Local));
    assert!(agg.handle(Event::Tick, 9_999).unwrap().is_empty());
    let acts = agg.handle(Event::Tick, 10_000).unwrap();
    assert!(acts.iter().any(|a| matches!(a, Action::RoundClosed { round: 1, sites, .. } if sites == &vec!["a".to_string()])));
    // A deadline with no update at all extends the round instead of publishing an unchanged model.
    let acts = agg.handle(Event::Tick, 30_000).unwrap();
    assert!(
        matches!(&acts[..], [Action::Publish { manifest, .. }] if manifest.round == 2 && manifest.deadline_ms == 40_000)
    );
}

/// Runs 3 rounds of 3 sites, feeding updates in the given per-round site order, optionally
/// dropping and reopening the core at the given (round, after-n-updates) points.
fn run(order: [&str; 3], crash_at: &[(u64, usize)]) -> Vec<Vec<u32>> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(3, 3, BnPolicy::Local);
    let mut agg = open(dir.path(), cfg.clone());
    agg.handle(Event::Start, 0).unwrap();
    for round in 1..=3u64 {
        for (k, s) in order.iter().enumerate() {
            if crash_at.contains(&(round, k)) {
                drop(agg);
                agg = open(dir.path(), cfg.clone());
                agg.handle(Event::Start, 0).unwrap();
            }
            let samples = 10 + s.len() as u64 * 7 + round;
            send(
                &mut agg,
                s,
                good(s, round, round - 1, samples, BnPolicy::Local),
            );
        }
    }
    assert!(agg.finished());
    agg.model()
        .iter()
        .map(|t| t.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn the_same_updates_in_any_arrival_order_give_the_bit_identical_model() {
    let base = run(["a", "bb", "ccc"], &[]);
    for order in [["ccc", "a", "bb"], ["bb", "ccc", "a"], ["ccc", "bb", "a"]] {
        assert_eq!(run(order, &[]), base, "{order:?}");
    }
}

#[test]
fn a_crash_between_or_during_rounds_loses_no_accepted_update() {
    let base = run(["a", "bb", "ccc"], &[]);
    // During round 1 (after one and after two updates), between rounds 2 and 3.
    assert_eq!(run(["a", "bb", "ccc"], &[(1, 1), (1, 2), (3, 0)]), base);
}

#[test]
fn a_stop_between_a_rounds_commit_and_its_audit_lines_is_recovered_on_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(2, 2, BnPolicy::Local);
    let lines = || {
        let mut v: Vec<(u64, String, String)> = Store::open(dir.path())
            .unwrap()
            .audit_entries()
            .unwrap()
            .into_iter()
            .filter(|e| e.event == "accepted" || e.event == "round-closed")
            .map(|e| (e.round, e.site, e.event))
            .collect();
        v.sort();
        v
    };
    {
        let mut agg = open(dir.path(), cfg.clone());
        agg.handle(Event::Start, 0).unwrap();
        send(&mut agg, "a", good("a", 1, 0, 5, BnPolicy::Local));
        send(&mut agg, "b", good("b", 1, 0, 5, BnPolicy::Local));
        assert_eq!(agg.round(), 2);
    }
    let whole = lines();
    let line = |r: u64, s: &str, e: &str| (r, s.to_string(), e.to_string());
    assert_eq!(
        whole,
        [
            line(1, "-", "round-closed"),
            line(1, "a", "accepted"),
            line(1, "b", "accepted")
        ]
    );
    // The process stopped after the round's commit, before b's line and the close's were
    // written (the commit of the spool and of the state come before their lines).
    let log = dir.path().join("audit.log");
    let text = std::fs::read_to_string(&log).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("\"round-closed\"") && !l.contains("\"site\":\"b\""))
        .collect();
    std::fs::write(&log, kept.join("\n") + "\n").unwrap();
    assert_eq!(lines(), [line(1, "a", "accepted")]);
    // Started again, the aggregator writes them from its state.
    let mut agg = open(dir.path(), cfg.clone());
    agg.handle(Event::Start, 0).unwrap();
    assert_eq!(lines(), whole);
    // And only once.
    drop(agg);
    open(dir.path(), cfg).handle(Event::Start, 0).unwrap();
    assert_eq!(lines(), whole);
}

#[test]
fn a_crash_after_the_last_accept_closes_the_round_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(1, 2, BnPolicy::Local);
    {
        let mut agg = open(dir.path(), cfg.clone());
        agg.handle(Event::Start, 0).unwrap();
        send(&mut agg, "a", good("a", 1, 0, 5, BnPolicy::Local));
    }
    // Simulate the crash window: b's update is spooled but the round was never committed.
    let store = Store::open(dir.path()).unwrap();
    let delta = [delta_values("b", 1, 0, 6), delta_values("b", 1, 1, 2)];
    store
        .spool_put(
            1,
            "b",
            &SpoolEntry {
                message: &[],
                staged: None,
                samples: 5,
                norm: delta
                    .iter()
                    .flatten()
                    .map(|&v| (v * v) as f64)
                    .sum::<f64>()
                    .sqrt(),
                report: &LocalReport::default(),
                extras: &unifed_aggregator::strategy::Extras::None,
                delta: &[
                    SpoolTensor::Values(&delta[0]),
                    SpoolTensor::Values(&delta[1]),
                ],
                bn: &[],
            },
        )
        .unwrap();
    let mut agg = open(dir.path(), cfg);
    let acts = agg.handle(Event::Start, 0).unwrap();
    assert!(acts.iter().any(|a| matches!(a, Action::Finished { .. })));
    let want = expected_after(
        &initial().tensors,
        &[("a", 5), ("b", 5)],
        1,
        BnPolicy::Local,
    );
    assert!(
        agg.model()[0]
            .iter()
            .zip(&want[0])
            .all(|(g, w)| (g - w).abs() < 1e-6)
    );
}

#[test]
fn a_data_directory_of_another_federation_or_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    open(dir.path(), config(1, 1, BnPolicy::Local));
    let other = FederationConfig {
        federation: "fed2".into(),
        ..config(1, 1, BnPolicy::Local)
    };
    let err = Aggregator::open(dir.path(), other, initial(), 64).unwrap_err();
    assert!(err.to_string().contains("fed2"), "{err}");
    let mut m = initial();
    m.spec.classes.push("c".into());
    let err = Aggregator::open(dir.path(), config(1, 1, BnPolicy::Local), m, 64).unwrap_err();
    assert!(err.to_string().contains("spec"), "{err}");
}

#[test]
fn config_validation_reports_every_problem() {
    let cfg = FederationConfig {
        federation: "a/b".into(),
        rounds: 0,
        fraction: 1.5,
        weighting: Weighting::Uniform,
        broker_update_log_bytes: 4096,
        ..FederationConfig::new("x", 1, 0, enrolled())
    };
    let ConfigProblems(errs) = cfg.validate().unwrap_err();
    assert_eq!(errs.len(), 5, "{errs:?}");
    assert!(matches!(errs[0], ConfigProblem::Federation(_)), "{errs:?}");
    let fields: Vec<&str> = errs
        .iter()
        .filter_map(|e| match e {
            ConfigProblem::OutOfRange { field, .. } => Some(*field),
            _ => None,
        })
        .collect();
    assert_eq!(
        fields,
        ["rounds", "min_sites", "broker_update_log_bytes", "fraction"]
    );
    assert_eq!(
        errs[3].to_string(),
        "broker_update_log_bytes must be at least 1 MiB (1048576), got 4096"
    );
}

#[test]
fn sampling_picks_a_fraction_of_the_sites_and_refuses_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        sites: (0..10)
            .map(|i| format!("s{i}"))
            .map(|s| unifed_aggregator::EnrolledSite::new(&s, key(&s).public()))
            .collect(),
        fraction: 0.3,
        min_sites: 3,
        ..config(1, 3, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg);
    let acts = agg.handle(Event::Start, 0).unwrap();
    let Action::Publish { manifest, .. } = &acts[0] else {
        panic!()
    };
    assert_eq!(manifest.sampled.len(), 3);
    // Each of the 3 sampled sites gets a quarter of the broker's 32 MiB update log as its
    // upload window (one share is kept spare).
    assert_eq!(manifest.upload_window_bytes, 8 << 20);
    let outsider = (0..10)
        .map(|i| format!("s{i}"))
        .find(|s| !manifest.sampled.iter().any(|m| m.as_str() == s))
        .unwrap();
    assert_eq!(
        answers(&send(
            &mut agg,
            &outsider,
            good(&outsider, 1, 0, 5, BnPolicy::Local)
        )),
        vec![(outsider.clone(), Answer::Rejected(RejectReason::NotSampled))]
    );
}

#[test]
fn the_example_service_config_parses_and_validates() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/aggregator.toml"
    ))
    .unwrap();
    let cfg: unifed_aggregator::service::ServiceConfig = toml::from_str(&text).unwrap();
    cfg.federation.validate().unwrap();
    // Read from its file, its paths are relative to the file's folder.
    let path = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/aggregator.toml"
    ));
    let read = unifed_aggregator::service::read_config(path).unwrap();
    let configs = path.parent().unwrap();
    assert_eq!(read.data_dir, configs.join("../run/aggregator"));
    assert_eq!(read.model, configs.join("../run/init.safetensors"));
    assert_eq!(read.key, configs.join("../run/aggregator.key"));
    assert_eq!(
        (cfg.federation.bn_policy, cfg.federation.encoding),
        (BnPolicy::Local, Encoding::F32)
    );
    // The encoding's name, and the wire enum's old spelling (read with a warning).
    let federation = &text[text.find("[federation]").unwrap() + 13..];
    for spelling in ["\"topk100\"", "{ TopK = { per_mille = 100 } }"] {
        let topk: FederationConfig = toml::from_str(
            &federation.replace("encoding = \"f32\"", &format!("encoding = {spelling}")),
        )
        .unwrap();
        assert_eq!(
            topk.encoding,
            Encoding::TopK { per_mille: 100 },
            "{spelling}"
        );
    }
}

#[test]
fn a_finished_federation_resumed_serves_its_final_model_and_says_it_is_finished() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(1, 1, BnPolicy::Local);
    let last = {
        let mut agg = open(dir.path(), cfg.clone());
        agg.handle(Event::Start, 0).unwrap();
        let acts = send(&mut agg, "a", good("a", 1, 0, 5, BnPolicy::Local));
        assert!(
            acts.iter()
                .any(|a| matches!(a, Action::Finished { model_version: 1 }))
        );
        agg.model().to_vec()
    };
    let mut agg = open(dir.path(), cfg);
    let acts = agg.handle(Event::Start, 0).unwrap();
    assert_eq!(acts.len(), 2, "{acts:?}");
    assert!(
        matches!(&acts[0], Action::Publish { manifest, .. } if manifest.finished && manifest.model_version == 1)
    );
    assert_eq!(acts[1], Action::Finished { model_version: 1 });
    assert_eq!(agg.model(), &last[..]);
}

fn with_delta(
    site: &str,
    round: u64,
    samples: u64,
    bn: BnPolicy,
    edit: impl FnOnce(&mut Vec<unifed_protocol::EncodedTensor>),
) -> Vec<u8> {
    update_bytes(
        &Upd {
            site,
            round,
            version: round - 1,
            samples,
            bn,
        },
        |u, _| edit(&mut u.delta),
    )
}

#[test]
fn a_sample_count_above_the_federations_bound_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        max_samples: 1_000,
        ..config(1, 2, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(&mut agg, "a", good("a", 1, 0, u64::MAX, BnPolicy::Local));
    assert_eq!(
        answers(&acts),
        vec![(
            "a".to_string(),
            Answer::Rejected(RejectReason::TooManySamples {
                samples: u64::MAX,
                bound: 1_000
            })
        )]
    );
    let acts = send(&mut agg, "a", good("a", 1, 0, 1_000, BnPolicy::Local));
    assert_eq!(answers(&acts), vec![("a".to_string(), Answer::Accepted)]);
}

/// Under `encoding` and `bn`, site `a`'s update edited by `edit(true)` is refused as the wrong
/// encoding and the one edited by `edit(false)` is accepted.
fn wrong_then_right_encoding<E>(encoding: Encoding, bn: BnPolicy, edit: impl Fn(bool) -> E)
where
    E: FnOnce(&mut Vec<unifed_protocol::EncodedTensor>),
{
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        encoding,
        ..config(1, 2, bn)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(&mut agg, "a", with_delta("a", 1, 10, bn, edit(true)));
    assert_eq!(
        answers(&acts),
        vec![(
            "a".to_string(),
            Answer::Rejected(RejectReason::WrongEncoding)
        )]
    );
    let acts = send(&mut agg, "a", with_delta("a", 1, 10, bn, edit(false)));
    assert_eq!(answers(&acts), vec![("a".to_string(), Answer::Accepted)]);
}

#[test]
fn bn_running_statistics_must_travel_as_exact_f32_under_a_lossy_encoding() {
    // Statistics in q8 too (what an older agent sent): refused; weights in q8, statistics in
    // exact f32: accepted.
    wrong_then_right_encoding(Encoding::Q8, BnPolicy::Global, |all: bool| {
        move |d: &mut Vec<unifed_protocol::EncodedTensor>| {
            for t in d.iter_mut() {
                let stat = t.name.contains("running");
                if all || !stat {
                    let v = unifed_protocol::decode(t).unwrap();
                    *t = encode(&t.name, &t.shape, &v, Encoding::Q8, None);
                }
            }
        }
    });
}

#[test]
fn under_ternary_q8_matrices_must_be_ternary_and_other_weights_q8() {
    // The matrix in q8: refused; every tensor as ternary-q8 says for its shape: accepted.
    wrong_then_right_encoding(
        Encoding::TernaryQ8 { block: 64 },
        BnPolicy::Local,
        |swap: bool| {
            move |d: &mut Vec<unifed_protocol::EncodedTensor>| {
                for t in d.iter_mut() {
                    let v = unifed_protocol::decode(t).unwrap();
                    let enc = if swap && t.shape.len() == 2 {
                        Encoding::Q8
                    } else {
                        Encoding::TernaryQ8 { block: 64 }
                    };
                    *t = encode(&t.name, &t.shape, &v, enc, None);
                }
            }
        },
    );
}

#[test]
fn an_update_that_would_make_a_running_variance_negative_is_rejected_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(1, 2, BnPolicy::Global));
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(
        &mut agg,
        "a",
        with_delta("a", 1, 10, BnPolicy::Global, |d| {
            let t = d.iter_mut().find(|t| t.name == "bn.running_var").unwrap();
            *t = encode(&t.name, &[2], &[-2.0, 0.1], Encoding::F32, None);
        }),
    );
    assert_eq!(
        answers(&acts),
        vec![(
            "a".to_string(),
            Answer::Rejected(RejectReason::NegativeVariance("bn.running_var".into()))
        )]
    );
    send(&mut agg, "a", good("a", 1, 0, 10, BnPolicy::Global));
    send(&mut agg, "b", good("b", 1, 0, 10, BnPolicy::Global));
    assert!(agg.finished());
    assert!(agg.model()[5].iter().all(|&v| v >= 0.0));
}

#[test]
fn a_combined_model_that_is_not_finite_is_never_committed() {
    let dir = tempfile::tempdir().unwrap();
    let mut init = initial();
    init.tensors[1] = vec![3.0e38, 0.0];
    let cfg = config(2, 2, BnPolicy::Local);
    let mut agg = opened(Aggregator::open(dir.path(), cfg.clone(), init.clone(), 64).unwrap());
    agg.handle(Event::Start, 0).unwrap();
    // Each update is finite and valid alone; their mean on the base overflows f32.
    let huge = |s: &str| {
        with_delta(s, 1, 10, BnPolicy::Local, |d| {
            let t = d.iter_mut().find(|t| t.name == "fc.bias").unwrap();
            *t = encode(&t.name, &[2], &[3.0e38, 0.0], Encoding::F32, None);
        })
    };
    send(&mut agg, "a", huge("a"));
    let acts = send(&mut agg, "b", huge("b"));
    assert!(
        acts.iter().any(|a| matches!(
            a,
            Action::RoundClosed {
                round: 1,
                model_version: 1,
                ..
            }
        )),
        "{acts:?}"
    );
    // The model is unchanged, re-published as version 1 (so sites that trained apply it again
    // instead of training on from their own weights), and the audit says why.
    assert_eq!(agg.model_version(), 1);
    assert_eq!(agg.model(), &init.tensors[..]);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(
        store.load_model(1, &init.spec.hash().0).unwrap(),
        init.tensors
    );
    assert!(acts.iter().any(
        |a| matches!(a, Action::Publish { manifest, .. } if manifest.round == 2 && manifest.model_version == 1)
    ));
    let audit = agg.store().audit_entries().unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.event == "round-discarded" && e.detail.contains("fc.bias"))
    );
    // A restart resumes in round 2 from version 1.
    drop(agg);
    let agg = opened(Aggregator::open(dir.path(), cfg, init, 64).unwrap());
    assert_eq!((agg.round(), agg.model_version()), (2, 1));
}

#[test]
fn the_manifest_carries_the_strategys_typed_plan() {
    use unifed_aggregator::Algorithm;
    use unifed_protocol::messages::Objective;
    for (algorithm, objective) in [
        (Algorithm::FedAvg, Objective::CrossEntropy),
        (
            Algorithm::FedProx { mu: 0.01 },
            Objective::Proximal { mu: 0.01 },
        ),
        (
            Algorithm::Moon(unifed_aggregator::strategy::MoonConfig {
                mu: 5.0,
                temperature: 0.2,
            }),
            Objective::Contrastive {
                mu: 5.0,
                temperature: 0.2,
            },
        ),
        (
            Algorithm::PerFedAvg(Default::default()),
            Objective::Meta {
                alpha: 0.01,
                beta: 0.01,
            },
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = FederationConfig {
            algorithm,
            ..config(1, 1, BnPolicy::Global)
        };
        let mut agg = open(dir.path(), cfg);
        let acts = agg.handle(Event::Start, 0).unwrap();
        let Action::Publish { manifest, .. } = &acts[0] else {
            panic!("{acts:?}")
        };
        assert_eq!(manifest.plan.objective, objective);
    }
}

#[test]
fn the_algorithm_is_read_from_the_config_and_validated() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/aggregator.toml"
    ))
    .unwrap();
    let fed = &text[text.find("[federation]").unwrap() + 13..];
    let prox: FederationConfig = toml::from_str(&fed.replace(
        "algorithm = { name = \"fedavg\" }",
        "algorithm = { name = \"fedprox\", mu = 0.01 }",
    ))
    .unwrap();
    assert_eq!(
        prox.algorithm,
        unifed_aggregator::Algorithm::FedProx { mu: 0.01 }
    );
    let bad: FederationConfig = toml::from_str(&fed.replace(
        "algorithm = { name = \"fedavg\" }",
        "algorithm = { name = \"fedprox\", mu = -1.0 }",
    ))
    .unwrap();
    let errs = bad.validate().unwrap_err().0;
    assert!(algorithm_named(&errs, "mu"), "{errs:?}");
    assert!(
        toml::from_str::<FederationConfig>(&fed.replace(
            "algorithm = { name = \"fedavg\" }",
            "algorithm = { name = \"fedsgd\" }",
        ))
        .is_err()
    );
    let with = |line: &str| {
        toml::from_str::<FederationConfig>(&fed.replace("algorithm = { name = \"fedavg\" }", line))
    };
    use unifed_aggregator::Algorithm;
    use unifed_aggregator::strategy::{FedOptConfig, ScaffoldConfig};
    // FedOpt: the paper's defaults unless given; every parameter named.
    assert_eq!(
        with("algorithm = { name = \"fedadam\" }")
            .unwrap()
            .algorithm,
        Algorithm::FedAdam(FedOptConfig {
            server_lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3
        })
    );
    assert_eq!(
        with("algorithm = { name = \"fedyogi\", server_lr = 0.1, tau = 0.01 }")
            .unwrap()
            .algorithm,
        Algorithm::FedYogi(FedOptConfig {
            server_lr: 0.1,
            tau: 0.01,
            ..Default::default()
        })
    );
    assert!(matches!(
        with("algorithm = { name = \"fedadagrad\" }")
            .unwrap()
            .algorithm,
        Algorithm::FedAdagrad(_)
    ));
    assert_eq!(
        with("algorithm = { name = \"scaffold\" }")
            .unwrap()
            .algorithm,
        Algorithm::Scaffold(ScaffoldConfig {
            server_lr: 1.0,
            max_control_norm: 1e4
        })
    );
    assert_eq!(
        with("algorithm = { name = \"fednova\", momentum = 0.9 }")
            .unwrap()
            .algorithm,
        Algorithm::FedNova(unifed_aggregator::strategy::FedNovaConfig { momentum: 0.9 })
    );
    let errs = with("algorithm = { name = \"fednova\", momentum = 1.0 }")
        .unwrap()
        .validate()
        .unwrap_err()
        .0;
    assert!(algorithm_named(&errs, "momentum"), "{errs:?}");
    use unifed_aggregator::strategy::MoonConfig;
    assert_eq!(
        with("algorithm = { name = \"moon\" }").unwrap().algorithm,
        Algorithm::Moon(MoonConfig {
            mu: 1.0,
            temperature: 0.5
        })
    );
    assert_eq!(
        with("algorithm = { name = \"moon\", mu = 5.0, temperature = 0.2 }")
            .unwrap()
            .algorithm,
        Algorithm::Moon(MoonConfig {
            mu: 5.0,
            temperature: 0.2
        })
    );
    assert_eq!(
        with("algorithm = { name = \"feddc\", alpha = 0.1 }")
            .unwrap()
            .algorithm,
        Algorithm::FedDc(unifed_aggregator::strategy::FedDcConfig {
            alpha: 0.1,
            max_control_norm: 1e4
        })
    );
    assert_eq!(
        with("algorithm = { name = \"perfedavg\", beta = 0.002 }")
            .unwrap()
            .algorithm,
        Algorithm::PerFedAvg(unifed_aggregator::strategy::PerFedAvgConfig {
            alpha: 0.01,
            beta: 0.002
        })
    );
    let errs = with("algorithm = { name = \"perfedavg\", alpha = 0.0 }")
        .unwrap()
        .validate()
        .unwrap_err()
        .0;
    assert!(algorithm_named(&errs, "alpha"), "{errs:?}");
    let errs = with("algorithm = { name = \"feddc\", alpha = -0.1 }")
        .unwrap()
        .validate()
        .unwrap_err()
        .0;
    assert!(algorithm_named(&errs, "alpha"), "{errs:?}");
    for bad in ["temperature = 0.0", "mu = -1.0"] {
        let errs = with(&format!("algorithm = {{ name = \"moon\", {bad} }}"))
            .unwrap()
            .validate()
            .unwrap_err()
            .0;
        let field = bad.split(' ').next().unwrap();
        assert!(algorithm_named(&errs, field), "{errs:?}");
    }
    // A misspelt parameter is an error, not a silent default.
    assert!(with("algorithm = { name = \"fedadam\", beta_1 = 0.5 }").is_err());
    assert!(with("algorithm = { name = \"fedprox\", mu = 0.01, nu = 1.0 }").is_err());
    let errs = with("algorithm = { name = \"fedadam\", beta2 = 1.5 }")
        .unwrap()
        .validate()
        .unwrap_err()
        .0;
    assert!(algorithm_named(&errs, "beta2"), "{errs:?}");
}

/// Whether `errs` holds an algorithm problem that names `field` (a parameter out of range, or
/// the objective's).
fn algorithm_named(errs: &[ConfigProblem], field: &str) -> bool {
    use unifed_aggregator::strategy::StrategyError;
    errs.iter().any(|e| match e {
        ConfigProblem::Algorithm(StrategyError::Parameter { name, .. }) => *name == field,
        ConfigProblem::Algorithm(StrategyError::Objective(o)) => {
            use unifed_protocol::messages::ObjectiveError as O;
            matches!(
                (field, o),
                ("mu", O::ProximalMu(_) | O::ContrastiveMu(_))
                    | ("temperature", O::Temperature(_))
                    | ("alpha", O::DriftAlpha(_) | O::MetaAlpha(_))
            )
        }
        _ => false,
    })
}

/// The broadcast payload a publish action carries.
fn broadcast_of(actions: &[Action]) -> unifed_protocol::ServerBroadcast {
    let model = actions
        .iter()
        .rev()
        .find_map(|a| match a {
            Action::Publish { model, .. } => Some(model),
            _ => None,
        })
        .expect("a publish");
    let mut payload: Vec<u8> = Vec::new();
    model.for_each_chunk(|c| payload.extend_from_slice(c.data));
    assert_eq!(payload, &model.bytes()[..]);
    assert_eq!(payload.len(), model.len());
    assert_eq!(
        unifed_protocol::payload_hash(&payload),
        model.payload_hash()
    );
    let broadcast: unifed_protocol::ServerBroadcast = postcard::from_bytes(&payload).unwrap();
    // Written from the model in place, the payload is the owned broadcast's serialisation.
    assert_eq!(postcard::to_allocvec(&broadcast).unwrap(), payload);
    broadcast
}

fn fedadam(rounds: u64) -> FederationConfig {
    FederationConfig {
        algorithm: unifed_aggregator::Algorithm::FedAdam(
            unifed_aggregator::strategy::FedOptConfig {
                server_lr: 0.5,
                beta1: 0.9,
                beta2: 0.99,
                tau: 0.1,
            },
        ),
        ..config(rounds, 2, BnPolicy::Global)
    }
}

#[test]
fn fedadam_steps_the_trainable_tensors_and_only_averages_running_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), fedadam(2));
    agg.handle(Event::Start, 0).unwrap();
    let sites = [("a", 100u64), ("b", 300)];
    for (s, n) in sites {
        send(&mut agg, s, good(s, 1, 0, n, BnPolicy::Global));
    }
    assert_eq!(agg.model_version(), 1);
    // The mean delta d of each value, then m = 0.1 d, v = 0.99 * 0.01 + 0.01 d^2 (v starts at
    // tau^2 = 0.01) and x + 0.5 m / (sqrt(v) + 0.1); statistics take x + d.
    let mean = expected_after(&initial().tensors, &sites, 1, BnPolicy::Global);
    for (i, t) in spec().tensors.iter().enumerate() {
        for (k, &mk) in mean[i].iter().enumerate() {
            let x = initial().tensors[i][k] as f64;
            let d = mk as f64 - x;
            let want = if t.kind.is_bn_stat() {
                mk as f64
            } else {
                let (m, v) = (0.1 * d, 0.99 * 0.01 + 0.01 * d * d);
                x + 0.5 * m / (v.sqrt() + 0.1)
            };
            let got = agg.model()[i][k] as f64;
            assert!(
                (got - want).abs() < 1e-5,
                "{}[{k}]: {got} vs {want}",
                t.name
            );
        }
    }
    // A FedAdam step is not FedAvg's mean on a trainable tensor.
    assert_ne!(agg.model()[0], mean[0]);
    // The moments are stored with the model version they belong to.
    assert!(dir.path().join("models/v1.strategy").exists());
}

#[test]
fn a_stateful_strategy_resumed_after_a_crash_ends_bit_identical() {
    let run = |restart: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), fedadam(3));
        agg.handle(Event::Start, 0).unwrap();
        for round in 1..=3u64 {
            if restart {
                // A crash with the round open, then again after its first update.
                agg = open(dir.path(), fedadam(3));
                agg.handle(Event::Start, 0).unwrap();
            }
            send(
                &mut agg,
                "a",
                good("a", round, round - 1, 100, BnPolicy::Global),
            );
            if restart {
                agg = open(dir.path(), fedadam(3));
                agg.handle(Event::Start, 0).unwrap();
            }
            send(
                &mut agg,
                "b",
                good("b", round, round - 1, 300, BnPolicy::Global),
            );
        }
        assert!(agg.finished());
        agg.model().to_vec()
    };
    let plain = run(false);
    assert_eq!(run(true), plain);
    assert!(plain.iter().flatten().all(|v| v.is_finite()));
}

#[test]
fn a_stateful_strategy_without_its_stored_state_or_of_another_algorithm_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut agg = open(dir.path(), fedadam(3));
        agg.handle(Event::Start, 0).unwrap();
        send(&mut agg, "a", good("a", 1, 0, 100, BnPolicy::Global));
        send(&mut agg, "b", good("b", 1, 0, 300, BnPolicy::Global));
        assert_eq!(agg.model_version(), 1);
    }
    // Another algorithm on the same data directory: refused, naming both.
    let scaffold = FederationConfig {
        algorithm: unifed_aggregator::Algorithm::Scaffold(Default::default()),
        ..fedadam(3)
    };
    let err = Aggregator::open(dir.path(), scaffold, initial(), 64).unwrap_err();
    assert!(err.to_string().contains("scaffold"), "{err}");
    // The moments lost: refused, never restarted from zero in silence.
    std::fs::remove_file(dir.path().join("models/v1.strategy")).unwrap();
    let err = Aggregator::open(dir.path(), fedadam(3), initial(), 64).unwrap_err();
    assert!(err.to_string().contains("v1.strategy"), "{err}");
}

fn scaffold_cfg() -> FederationConfig {
    FederationConfig {
        algorithm: unifed_aggregator::Algorithm::Scaffold(Default::default()),
        sites: enrolled()[..3].to_vec(),
        ..config(2, 2, BnPolicy::Local)
    }
}

/// A control-variate delta of every non-BN tensor (the trainable averaged ones under local BN).
fn control(site: &str) -> SiteExtras {
    let sp = spec();
    SiteExtras::Control(
        sp.tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.kind.is_bn())
            .map(|(i, t)| {
                let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
                encode(
                    &t.name,
                    &shape,
                    &delta_values(site, 7, i, t.numel()),
                    Encoding::F32,
                    None,
                )
            })
            .collect(),
    )
}

fn with_extras(site: &str, round: u64, version: u64, extras: SiteExtras) -> Vec<u8> {
    update_bytes(
        &Upd {
            site,
            round,
            version,
            samples: 10,
            bn: BnPolicy::Local,
        },
        |u, _| u.extras = extras,
    )
}

#[test]
fn scaffold_broadcasts_c_and_moves_it_by_the_reported_deltas_over_all_sites() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), scaffold_cfg());
    let start = agg.handle(Event::Start, 0).unwrap();
    assert_eq!(
        start.iter().find_map(|a| match a {
            Action::Publish { manifest, .. } => Some(manifest.plan.objective),
            _ => None,
        }),
        Some(unifed_protocol::Objective::Scaffold)
    );
    // Version 0 carries c = 0 for the two non-BN tensors.
    let b0 = broadcast_of(&start);
    let unifed_protocol::ServerExtras::Control(c0) = &b0.extras else {
        panic!("{:?}", b0.extras)
    };
    let names: Vec<&str> = c0.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fc.weight", "fc.bias"]);
    assert!(c0.iter().all(|t| {
        unifed_protocol::decode(t)
            .unwrap()
            .iter()
            .all(|&v| v == 0.0)
    }));
    // Updates without a variate, or with one that misses a tensor, are rejected alone.
    let none = send(&mut agg, "a", with_extras("a", 1, 0, SiteExtras::None));
    assert!(matches!(
        &answers(&none)[0].1,
        Answer::Rejected(RejectReason::UnexpectedExtras(_))
    ));
    let SiteExtras::Control(mut short) = control("a") else {
        unreachable!()
    };
    short.pop();
    let short = send(
        &mut agg,
        "a",
        with_extras("a", 1, 0, SiteExtras::Control(short)),
    );
    assert_eq!(
        answers(&short)[0].1,
        Answer::Rejected(RejectReason::MissingTensor("fc.bias".into()))
    );
    send(&mut agg, "a", with_extras("a", 1, 0, control("a")));
    let closed = send(&mut agg, "b", with_extras("b", 1, 0, control("b")));
    assert_eq!(agg.model_version(), 1);
    // x: FedAvg's mean (eta_g = 1); c = (Δc_a + Δc_b) / 3: three registered sites, c ends as
    // the mean of c_a, c_b and c_c = 0.
    let want = expected_after(
        &initial().tensors,
        &[("a", 10), ("b", 10)],
        1,
        BnPolicy::Local,
    );
    assert_eq!(agg.model(), &want[..]);
    let b1 = broadcast_of(&closed);
    let unifed_protocol::ServerExtras::Control(c1) = &b1.extras else {
        panic!("{:?}", b1.extras)
    };
    for (j, i) in [0usize, 1].into_iter().enumerate() {
        let got = unifed_protocol::decode(&c1[j]).unwrap();
        let n = got.len();
        let (da, db) = (delta_values("a", 7, i, n), delta_values("b", 7, i, n));
        for k in 0..n {
            let w = ((da[k] as f64 + db[k] as f64) / 3.0) as f32;
            assert_eq!(got[k], w, "{}[{k}]", c1[j].name);
        }
    }
}

#[test]
fn a_federation_without_control_variates_refuses_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(1, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(&mut agg, "a", with_extras("a", 1, 0, control("a")));
    assert!(matches!(
        &answers(&acts)[0].1,
        Answer::Rejected(RejectReason::UnexpectedExtras(_))
    ));
}

#[test]
fn a_control_variate_that_is_too_large_is_rejected_and_one_that_overflows_is_never_committed() {
    let huge = || {
        let sp = spec();
        SiteExtras::Control(
            sp.tensors
                .iter()
                .filter(|t| !t.kind.is_bn())
                .map(|t| {
                    let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
                    encode(&t.name, &shape, &vec![3e38; t.numel()], Encoding::F32, None)
                })
                .collect(),
        )
    };
    // Under the default bound a gross delta is rejected alone.
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), scaffold_cfg());
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(&mut agg, "a", with_extras("a", 1, 0, huge()));
    assert!(matches!(
        &answers(&acts)[0].1,
        Answer::Rejected(RejectReason::NormTooLarge { bound, .. }) if *bound == 1e4
    ));
    // With the bound lifted: c = (3e38 + 3e38) / 2 = 3e38 after round 1, 6e38 (infinite in
    // f32) after round 2, which is never committed.
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        sites: enrolled()[..2].to_vec(),
        algorithm: unifed_aggregator::Algorithm::Scaffold(
            unifed_aggregator::strategy::ScaffoldConfig {
                max_control_norm: 1e300,
                ..Default::default()
            },
        ),
        ..scaffold_cfg()
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    for round in 1..=2u64 {
        for s in ["a", "b"] {
            let acts = send(&mut agg, s, with_extras(s, round, round - 1, huge()));
            assert_eq!(answers(&acts)[0].1, Answer::Accepted);
        }
    }
    let audit = agg.store().audit_entries().unwrap();
    let discarded = audit
        .iter()
        .find(|e| e.event == "round-discarded")
        .expect("an audit entry");
    assert_eq!(discarded.round, 2);
    assert!(
        discarded.detail.contains("control variate"),
        "{discarded:?}"
    );
    // Version 2 re-publishes version 1's model and state: c is still 3e38.
    let (v1, v2) = (
        std::fs::read(dir.path().join("models/v1.strategy")).unwrap(),
        std::fs::read(dir.path().join("models/v2.strategy")).unwrap(),
    );
    assert_eq!(v1.len(), v2.len());
    let store = Store::open(dir.path()).unwrap();
    let h = spec().hash().0;
    assert_eq!(
        store.load_model(1, &h).unwrap(),
        store.load_model(2, &h).unwrap()
    );
    assert_eq!(
        store.load_strategy(1, &h).unwrap(),
        store.load_strategy(2, &h).unwrap()
    );
}

#[test]
fn under_global_bn_the_control_variate_covers_bn_affine_but_never_running_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        bn_policy: BnPolicy::Global,
        ..scaffold_cfg()
    };
    let mut agg = open(dir.path(), cfg);
    let start = agg.handle(Event::Start, 0).unwrap();
    let unifed_protocol::ServerExtras::Control(c) = broadcast_of(&start).extras else {
        panic!("no control variate")
    };
    let names: Vec<&str> = c.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fc.weight", "fc.bias", "bn.weight", "bn.bias"]);
}

#[test]
fn enrolment_is_required_unique_and_bounds_each_sites_sample_count() {
    let none = FederationConfig::new("fed1", 1, 1, Vec::new());
    let errs = none.validate().unwrap_err().0;
    assert_eq!(errs, [ConfigProblem::NoSites]);
    let mut twice = enrolled()[..2].to_vec();
    twice.push(enrolled()[0].clone());
    twice[1].max_samples = Some(0);
    let errs = FederationConfig::new("fed1", 1, 1, twice)
        .validate()
        .unwrap_err()
        .0;
    assert_eq!(
        errs,
        [
            ConfigProblem::SiteMaxSamples("b".into()),
            ConfigProblem::EnrolledTwice("a".into())
        ]
    );

    // `b` enrolled with at most 50 samples: 51 is refused with that bound, 50 taken.
    let dir = tempfile::tempdir().unwrap();
    let mut sites = enrolled()[..3].to_vec();
    sites[1].max_samples = Some(50);
    let mut agg = open(
        dir.path(),
        FederationConfig {
            sites,
            ..config(1, 3, BnPolicy::Local)
        },
    );
    agg.handle(Event::Start, 0).unwrap();
    assert_eq!(
        answers(&send(&mut agg, "b", good("b", 1, 0, 51, BnPolicy::Local))),
        vec![(
            "b".into(),
            Answer::Rejected(RejectReason::TooManySamples {
                samples: 51,
                bound: 50
            })
        )]
    );
    assert_eq!(
        answers(&send(&mut agg, "b", good("b", 1, 0, 50, BnPolicy::Local))),
        vec![("b".into(), Answer::Accepted)]
    );
    // An enrolled site's update on another site's topic is not taken, nor answered.
    assert!(answers(&send(&mut agg, "c", good("a", 1, 0, 5, BnPolicy::Local))).is_empty());
}

#[test]
fn a_revoked_key_is_refused_whichever_enrolled_site_claims_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(
        dir.path(),
        FederationConfig {
            revoked: vec![key("a").public()],
            ..config(1, 2, BnPolicy::Local)
        },
    );
    agg.handle(Event::Start, 0).unwrap();
    assert!(answers(&send(&mut agg, "a", good("a", 1, 0, 5, BnPolicy::Local))).is_empty());
    assert!(agg.accepted().is_empty());
    assert!(matches!(
        agg.admission().admit(
            &Id::new("a").unwrap(),
            &good("a", 1, 0, 5, BnPolicy::Local),
            1 << 20
        ),
        Err(AdmitError::Auth(AuthError::Revoked { .. }))
    ));
    assert_eq!(
        answers(&send(&mut agg, "b", good("b", 1, 0, 5, BnPolicy::Local))),
        vec![("b".into(), Answer::Accepted)]
    );
}

#[test]
fn a_round_does_not_wait_for_a_revoked_site_and_the_next_does_not_sample_it() {
    let dir = tempfile::tempdir().unwrap();
    let three: Vec<_> = enrolled().into_iter().take(3).collect();
    let mut agg = open(dir.path(), FederationConfig::new("fed1", 2, 3, three));
    agg.handle(Event::Start, 0).unwrap();
    send(&mut agg, "a", good("a", 1, 0, 5, BnPolicy::Local));
    send(&mut agg, "b", good("b", 1, 0, 5, BnPolicy::Local));
    // Round 1 needs all three; c's key is revoked before it reports: the next tick closes the
    // round with a and b, long before its deadline.
    assert!(agg.handle(Event::Tick, 2_000).unwrap().is_empty());
    agg.set_revoked(vec![key("c").public()]);
    let tick = agg_tick(&mut agg, 2_500);
    let acts = closed(&mut agg, tick);
    assert!(
        acts.iter().any(
            |a| matches!(a, Action::RoundClosed { round: 1, sites, .. } if sites == &["a", "b"])
        ),
        "{acts:?}"
    );
    // Round 2 samples a and b only and closes with their updates.
    let manifest = acts
        .iter()
        .find_map(|a| match a {
            Action::Publish { manifest, .. } => Some(manifest.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(manifest.round, 2);
    let sampled: Vec<&str> = manifest.sampled.iter().map(|s| s.as_str()).collect();
    assert_eq!(sampled, ["a", "b"]);
    send(&mut agg, "a", good("a", 2, 1, 5, BnPolicy::Local));
    let acts = send(&mut agg, "b", good("b", 2, 1, 5, BnPolicy::Local));
    assert!(
        acts.iter().any(
            |a| matches!(a, Action::RoundClosed { round: 2, sites, .. } if sites == &["a", "b"])
        ),
        "{acts:?}"
    );
}

/// The actions of a tick at `now_ms`.
fn agg_tick(agg: &mut Aggregator, now_ms: u64) -> Vec<Action> {
    agg.handle(Event::Tick, now_ms).unwrap()
}

/// Writes `f(bytes)` over the file at `p`.
pub(crate) fn tamper(p: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(p).unwrap();
    f(&mut b);
    std::fs::write(p, b).unwrap();
}

#[test]
fn a_damaged_spool_file_is_set_aside_its_site_asked_to_resend_and_the_round_closes_as_if_intact() {
    let run = |damage: Option<fn(&mut Vec<u8>)>| {
        let dir = tempfile::tempdir().unwrap();
        let mut agg = open(dir.path(), config(1, 2, BnPolicy::Local));
        agg.handle(Event::Start, 0).unwrap();
        let a = good("a", 1, 0, 7, BnPolicy::Local);
        send(&mut agg, "a", a.clone());
        if let Some(f) = damage {
            tamper(&dir.path().join("spool/r1/a.upd"), f);
        }
        let acts = send(&mut agg, "b", good("b", 1, 0, 9, BnPolicy::Local));
        if damage.is_some() {
            // b's accept, then a asked again; the round waits for it.
            assert_eq!(
                answers(&acts),
                vec![("b".into(), Answer::Accepted), ("a".into(), Answer::Resend)]
            );
            assert_eq!(agg.round(), 1);
            assert_eq!(agg.accepted(), vec!["b".to_string()]);
            let set_aside = std::fs::read_dir(dir.path().join("spool-corrupt")).unwrap();
            assert_eq!(set_aside.count(), 1);
            let audit = agg.store().audit_entries().unwrap();
            assert!(
                audit
                    .iter()
                    .any(|e| e.event == "spool-damaged" && e.site == "a"),
                "{audit:?}"
            );
            assert_eq!(
                answers(&send(&mut agg, "a", a)),
                vec![("a".into(), Answer::Accepted)]
            );
        }
        assert!(agg.finished());
        agg.model().to_vec()
    };
    let intact = run(None);
    // A NaN written over the first delta value (after the header), and a flipped byte.
    assert_eq!(
        run(Some(|b| b[40..44].copy_from_slice(&f32::NAN.to_le_bytes()))),
        intact
    );
    assert_eq!(run(Some(|b| b[60] ^= 0x10)), intact);
    assert_eq!(run(Some(|b| b.truncate(b.len() - 9))), intact);
}

#[test]
fn an_update_found_damaged_by_the_fold_after_others_is_asked_again_and_the_round_closes_as_if_intact()
 {
    use unifed_aggregator::Algorithm;
    use unifed_aggregator::strategy::FedOptConfig;
    // FedAdam keeps moments: a fold stopped half-way must leave neither them nor the model moved.
    let run = |damage: bool| {
        let dir = tempfile::tempdir().unwrap();
        let cfg = FederationConfig {
            algorithm: Algorithm::FedAdam(FedOptConfig::default()),
            ..config(2, 3, BnPolicy::Local)
        };
        let mut agg = open(dir.path(), cfg);
        agg.handle(Event::Start, 0).unwrap();
        let b = good("b", 1, 0, 9, BnPolicy::Local);
        send(&mut agg, "a", good("a", 1, 0, 7, BnPolicy::Local));
        send(&mut agg, "b", b.clone());
        if damage {
            // "b" is folded after "a" (site order).
            tamper(&dir.path().join("spool/r1/b.upd"), |x| x[60] ^= 0x10);
        }
        let acts = send(&mut agg, "c", good("c", 1, 0, 5, BnPolicy::Local));
        if damage {
            assert_eq!(
                answers(&acts),
                vec![("c".into(), Answer::Accepted), ("b".into(), Answer::Resend)]
            );
            assert_eq!(agg.round(), 1);
            send(&mut agg, "b", b);
        }
        assert_eq!(agg.round(), 2);
        for (site, samples) in [("a", 7), ("b", 9), ("c", 5)] {
            send(&mut agg, site, good(site, 2, 1, samples, BnPolicy::Local));
        }
        assert!(agg.finished());
        agg.model().to_vec()
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn a_damaged_model_file_or_an_edited_or_stale_state_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    send(&mut agg, "a", good("a", 1, 0, 7, BnPolicy::Local));
    let stale = std::fs::read(dir.path().join("state.json")).unwrap();
    send(&mut agg, "b", good("b", 1, 0, 7, BnPolicy::Local));
    send(&mut agg, "a", good("a", 2, 1, 7, BnPolicy::Local));
    drop(agg);
    let reopen = || {
        Aggregator::open(dir.path(), config(2, 2, BnPolicy::Local), initial(), 64)
            .map(drop)
            .map_err(|e| e.to_string())
    };
    reopen().unwrap();

    // A flipped byte in the current model.
    let model = dir.path().join("models/v1.bin");
    tamper(&model, |b| b[50] ^= 1);
    let err = reopen().unwrap_err();
    assert!(
        err.contains("v1.bin") && err.contains("checksum mismatch"),
        "{err}"
    );
    tamper(&model, |b| b[50] ^= 1);
    reopen().unwrap();

    // state.json edited by hand (round 2 -> 3 would drop a's accepted update of round 2).
    let state = dir.path().join("state.json");
    let good_state = std::fs::read(&state).unwrap();
    let edited = String::from_utf8(good_state.clone())
        .unwrap()
        .replace("\"round\": 2", "\"round\": 3");
    assert_ne!(edited.as_bytes(), &good_state[..]);
    std::fs::write(&state, edited).unwrap();
    let err = reopen().unwrap_err();
    assert!(
        err.contains("state.json") && err.contains("checksum mismatch"),
        "{err}"
    );

    // An older, intact state.json put back: round 1 open while the spool holds round 2.
    std::fs::write(&state, &stale).unwrap();
    let err = reopen().unwrap_err();
    assert!(
        err.contains("round 2") && err.contains("older than the spool"),
        "{err}"
    );
    std::fs::write(&state, &good_state).unwrap();
    reopen().unwrap();
}

#[test]
fn below_the_disk_floor_updates_are_refused_unwritten_and_nothing_is_audited() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        min_free_disk_bytes: u64::MAX,
        ..config(1, 2, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    let a = good("a", 1, 0, 5, BnPolicy::Local);
    let acts = answers(&send(&mut agg, "a", a.clone()));
    assert!(
        matches!(&acts[..], [(s, Answer::Rejected(RejectReason::StorageFull { free_bytes, floor_bytes: u64::MAX }))] if s == "a" && *free_bytes < u64::MAX),
        "{acts:?}"
    );
    assert!(agg.accepted().is_empty());
    assert!(agg.store().spool_sites(1).unwrap().is_empty());
    assert!(agg.store().audit_entries().unwrap().is_empty());
    // Room again (the operator lowered the floor): the same update is taken.
    drop(agg);
    let mut agg = open(dir.path(), config(1, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    assert_eq!(
        answers(&send(&mut agg, "a", a)),
        vec![("a".into(), Answer::Accepted)]
    );
}

#[test]
fn a_sites_refusals_are_audited_up_to_a_limit_per_round_then_counted_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(2, 2, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let n = unifed_aggregator::core::AUDITED_REJECTS as usize;
    for _ in 0..n + 20 {
        let acts = answers(&send(&mut agg, "a", good("a", 1, 0, 0, BnPolicy::Local)));
        assert_eq!(
            acts,
            vec![("a".into(), Answer::Rejected(RejectReason::NoSamples))]
        );
    }
    let store = agg.store().clone();
    let count = |event: &str| {
        store
            .audit_entries()
            .unwrap()
            .iter()
            .filter(|e| e.event == event)
            .count()
    };
    assert_eq!((count("rejected"), count("audit-suppressed")), (n, 0));
    // Another site is audited again.
    send(&mut agg, "b", good("b", 1, 0, 0, BnPolicy::Local));
    assert_eq!(count("rejected"), n + 1);
    // a's update, then ten replays of it: duplicates, answered as before and, past a's limit,
    // only counted (no fsynced line each).
    let a = good("a", 1, 0, 5, BnPolicy::Local);
    for _ in 0..11 {
        let acts = answers(&send(&mut agg, "a", a.clone()));
        assert_eq!(acts, vec![("a".into(), Answer::Accepted)]);
    }
    assert_eq!(count("duplicate"), 0);
    send(&mut agg, "b", good("b", 1, 0, 5, BnPolicy::Local));
    assert_eq!(agg.round(), 2);
    // The round's close wrote one line for a with what it only counted.
    let suppressed: Vec<(String, String)> = store
        .audit_entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "audit-suppressed")
        .map(|e| (e.site, e.detail))
        .collect();
    assert_eq!(
        suppressed,
        [(
            "a".to_string(),
            format!(
                "past the first {n} refusals of the round, only counted: 10 duplicate, 20 rejected"
            )
        )]
    );
    // The next round audits again.
    send(&mut agg, "a", good("a", 2, 1, 0, BnPolicy::Local));
    assert_eq!(count("rejected"), n + 2);
}

/// The delta payload and manifest of the last publish among `actions`.
fn delta_of(
    actions: &[Action],
) -> Option<(unifed_protocol::DeltaInfo, unifed_protocol::ModelDelta)> {
    actions.iter().rev().find_map(|a| match a {
        Action::Publish {
            manifest, delta, ..
        } => {
            let info = manifest.delta?;
            let delta = delta.as_ref().expect("a delta announced is published");
            assert_eq!(delta.count(), info.chunk_count);
            let mut payload: Vec<u8> = Vec::new();
            delta.for_each_chunk(|c| payload.extend_from_slice(c.data));
            assert_eq!(payload.len() as u64, info.payload_len);
            assert_eq!(unifed_protocol::payload_hash(&payload), info.payload_hash);
            Some((info, postcard::from_bytes(&payload).unwrap()))
        }
        _ => None,
    })
}

#[test]
fn under_a_lossy_encoding_the_model_goes_down_as_error_fed_deltas_that_survive_a_restart() {
    let enc = Encoding::TopKQ8 { per_mille: 200 };
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        encoding: enc,
        ..config(3, 2, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg.clone());
    let acts = agg.handle(Event::Start, 0).unwrap();
    // Version 0 has no delta: every site fetches the whole model once.
    assert!(delta_of(&acts).is_none());
    assert_eq!(agg.held_model(), agg.model());
    let lossy = |d: &mut Vec<unifed_protocol::EncodedTensor>| {
        for t in d.iter_mut() {
            let v = unifed_protocol::decode(t).unwrap();
            *t = encode(&t.name, &t.shape, &v, enc, None);
        }
    };
    let sp = spec();
    let mut held_before = agg.held_model().to_vec();
    let mut model_before = agg.model().to_vec();
    for round in 1..=2u64 {
        send(
            &mut agg,
            "a",
            with_delta("a", round, 10, BnPolicy::Local, lossy),
        );
        let acts = send(
            &mut agg,
            "b",
            with_delta("b", round, 30, BnPolicy::Local, lossy),
        );
        let (info, d) = delta_of(&acts).expect("a delta");
        assert_eq!(
            (info.from_version, d.from_version, d.model_version),
            (round - 1, round - 1, round)
        );
        assert!(
            d.values.is_empty(),
            "no BN statistics go down under local BN"
        );
        let (model, held) = (agg.model().to_vec(), agg.held_model().to_vec());
        let whole = broadcast_of(&acts);
        for (i, t) in sp.tensors.iter().enumerate() {
            if t.kind.is_bn() {
                assert!(d.delta.iter().all(|x| x.name != t.name));
                assert_eq!(held[i], held_before[i], "`{}` is the site's own", t.name);
                continue;
            }
            let shape: Vec<u32> = t.shape.iter().map(|&s| s as u32).collect();
            let sent = d.delta.iter().find(|x| x.name == t.name).unwrap();
            // The delta encodes `model - held`: what earlier deltas dropped goes out now ...
            let owed: Vec<f32> = model[i]
                .iter()
                .zip(&held_before[i])
                .map(|(m, h)| m - h)
                .collect();
            assert_eq!(sent, &encode(&t.name, &shape, &owed, enc, None));
            if round == 2 && t.name == "fc.weight" {
                let fresh: Vec<f32> = model[i]
                    .iter()
                    .zip(&model_before[i])
                    .map(|(m, p)| m - p)
                    .collect();
                assert_ne!(
                    sent,
                    &encode(&t.name, &shape, &fresh, enc, None),
                    "`{}`",
                    t.name
                );
            }
            // ... and the held model is the previous one plus the decoded delta, bit for bit,
            // which is also what the whole model served carries.
            let back = unifed_protocol::decode(sent).unwrap();
            let want: Vec<f32> = held_before[i]
                .iter()
                .zip(&back)
                .map(|(h, d)| h + d)
                .collect();
            assert_eq!(held[i], want, "`{}`", t.name);
            let w = whole.weights.iter().find(|x| x.name == t.name).unwrap();
            assert_eq!(unifed_protocol::decode(w).unwrap(), held[i]);
        }
        // Top-k 20 % of six weights keeps two: the held model lags the exact one.
        assert_ne!(held[0], model[0]);
        held_before = held;
        model_before = model;
    }
    // A restarted aggregator serves the same held model and the same delta.
    let before = delta_of(&agg.handle(Event::Start, 5_000).unwrap()).unwrap();
    drop(agg);
    let mut agg = open(dir.path(), cfg);
    let after = delta_of(&agg.handle(Event::Start, 6_000).unwrap()).unwrap();
    assert_eq!(before, after);
    assert_eq!(agg.held_model(), &held_before[..]);
}

/// Site `site`'s update of round 1 reporting `steps` local steps.
fn with_steps(site: &str, samples: u64, steps: u64, bn: BnPolicy) -> Vec<u8> {
    update_bytes(
        &Upd {
            site,
            round: 1,
            version: 0,
            samples,
            bn,
        },
        |u, _| u.report.local_steps = steps,
    )
}

/// The model after one round of `algorithm` over `sites` (site, samples, local steps).
fn one_round(
    algorithm: unifed_aggregator::Algorithm,
    bn: BnPolicy,
    sites: &[(&str, u64, u64)],
) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        algorithm,
        ..config(1, sites.len(), bn)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    for &(s, n, steps) in sites {
        let acts = send(&mut agg, s, with_steps(s, n, steps, bn));
        assert_eq!(answers(&acts)[0].1, Answer::Accepted, "{s}");
    }
    assert_eq!(agg.model_version(), 1);
    agg.model().to_vec()
}

fn bits(model: &[Vec<f32>]) -> Vec<Vec<u32>> {
    model
        .iter()
        .map(|t| t.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn fednova_with_equal_step_counts_is_fedavg_bit_for_bit_and_differs_with_unequal_ones() {
    use unifed_aggregator::Algorithm;
    use unifed_aggregator::strategy::FedNovaConfig;
    let nova = |momentum| Algorithm::FedNova(FedNovaConfig { momentum });
    for bn in [BnPolicy::Local, BnPolicy::Global] {
        let equal = [("a", 743, 24), ("b", 300, 24), ("c", 57, 24)];
        let fedavg = one_round(Algorithm::FedAvg, bn, &equal);
        assert_eq!(bits(&one_round(nova(0.0), bn, &equal)), bits(&fedavg));
        assert_eq!(bits(&one_round(nova(0.9), bn, &equal)), bits(&fedavg));
        let unequal = [("a", 743, 24), ("b", 300, 10), ("c", 57, 2)];
        let fedavg = one_round(Algorithm::FedAvg, bn, &unequal);
        let fednova = one_round(nova(0.0), bn, &unequal);
        assert_ne!(fednova[0], fedavg[0]);
        // BN running statistics are not stepped: under `global` BN they take the plain mean.
        for (i, t) in spec().tensors.iter().enumerate() {
            if t.kind.is_bn_stat() {
                assert_eq!(fednova[i], fedavg[i], "{}", t.name);
            }
        }
    }
}

#[test]
fn fednova_steps_by_tau_eff_times_the_mean_of_normalised_deltas() {
    use unifed_aggregator::Algorithm;
    use unifed_aggregator::strategy::FedNovaConfig;
    // a: w 1, 2 steps; b: w 3, 4 steps. tau_eff = (1*2 + 3*4) / 4 = 3.5, and each value moves
    // by 3.5 * (1/4 * Δa / 2 + 3/4 * Δb / 4).
    let sites = [("a", 1, 2), ("b", 3, 4)];
    let got = one_round(
        Algorithm::FedNova(FedNovaConfig::default()),
        BnPolicy::Local,
        &sites,
    );
    let base = initial().tensors;
    for (i, t) in spec().tensors.iter().enumerate() {
        for k in 0..base[i].len() {
            let want = if t.kind.is_bn() {
                base[i][k] as f64
            } else {
                let da = delta_values("a", 1, i, base[i].len())[k] as f64;
                let db = delta_values("b", 1, i, base[i].len())[k] as f64;
                base[i][k] as f64 + 3.5 * (0.25 * da / 2.0 + 0.75 * db / 4.0)
            };
            let g = got[i][k] as f64;
            assert!((g - want).abs() < 1e-6, "{}[{k}]: {g} vs {want}", t.name);
        }
    }
}

#[test]
fn fednova_rejects_an_update_that_reports_no_local_steps() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        algorithm: unifed_aggregator::Algorithm::FedNova(Default::default()),
        ..config(1, 2, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    let acts = send(&mut agg, "a", with_steps("a", 10, 0, BnPolicy::Local));
    match &answers(&acts)[..] {
        [(s, Answer::Rejected(RejectReason::Malformed(m)))] => {
            assert_eq!(s, "a");
            assert!(m.contains("0 steps"), "{m}");
        }
        other => panic!("expected a malformed reject, got {other:?}"),
    }
    // The round goes on: a good update is still taken.
    let acts = send(&mut agg, "a", with_steps("a", 10, 5, BnPolicy::Local));
    assert_eq!(answers(&acts)[0].1, Answer::Accepted);
}

#[test]
fn feddc_adds_the_mean_drift_of_all_sites_to_the_mean_and_keeps_scaffolds_variate() {
    use unifed_aggregator::strategy::FedDcConfig;
    let cfg = || FederationConfig {
        algorithm: unifed_aggregator::Algorithm::FedDc(FedDcConfig {
            alpha: 0.05,
            ..Default::default()
        }),
        sites: enrolled()[..3].to_vec(),
        ..config(3, 2, BnPolicy::Local)
    };
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), cfg());
    let start = agg.handle(Event::Start, 0).unwrap();
    assert_eq!(
        start.iter().find_map(|a| match a {
            Action::Publish { manifest, .. } => Some(manifest.plan.objective),
            _ => None,
        }),
        Some(unifed_protocol::Objective::Drift { alpha: 0.05 })
    );
    assert!(matches!(
        broadcast_of(&start).extras,
        unifed_protocol::ServerExtras::Control(_)
    ));
    // Without a variate an update is refused, as under SCAFFOLD.
    let none = send(&mut agg, "a", with_extras("a", 1, 0, SiteExtras::None));
    assert!(matches!(
        &answers(&none)[0].1,
        Answer::Rejected(RejectReason::UnexpectedExtras(_))
    ));
    // Round 1 from a and b, round 2 from a and c, round 3 from b and c after a restart; N = 3
    // registered sites. Each model is FedAvg's mean plus H / 3, H the sum of every delta
    // received so far (non-BN under local), which the stored state carries over the restart.
    let mut h: Vec<Vec<f64>> = initial()
        .tensors
        .iter()
        .map(|t| vec![0.0; t.len()])
        .collect();
    let mut x = initial().tensors;
    for (round, sites) in [(1u64, ["a", "b"]), (2, ["a", "c"]), (3, ["b", "c"])] {
        if round == 3 {
            drop(agg);
            agg = open(dir.path(), cfg());
            agg.handle(Event::Start, 0).unwrap();
        }
        for s in sites {
            let acts = send(&mut agg, s, with_extras(s, round, round - 1, control(s)));
            assert_eq!(answers(&acts)[0].1, Answer::Accepted);
        }
        assert_eq!(agg.model_version(), round);
        let mean = expected_after(
            &x,
            &[(sites[0], 10), (sites[1], 10)],
            round,
            BnPolicy::Local,
        );
        let sp = spec();
        x = mean
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if sp.tensors[i].kind.is_bn() {
                    return m.clone();
                }
                let hsum: Vec<f32> = (0..m.len())
                    .map(|k| {
                        let add: f64 = sites
                            .iter()
                            .map(|s| delta_values(s, round, i, m.len())[k] as f64)
                            .sum();
                        h[i][k] = (h[i][k] + add) as f32 as f64;
                        h[i][k] as f32
                    })
                    .collect();
                m.iter()
                    .zip(hsum)
                    .map(|(m, h)| (*m as f64 + h as f64 / 3.0) as f32)
                    .collect()
            })
            .collect();
        assert_eq!(agg.model(), &x[..], "version {round}");
    }
    // A SCAFFOLD federation does not take a FedDC state.
    drop(agg);
    let scaffold = Aggregator::open(dir.path(), scaffold_cfg(), initial(), 64).unwrap_err();
    assert!(scaffold.to_string().contains("scaffold"), "{scaffold}");
}

#[test]
fn fedcd_refuses_bad_mask_gradients_alone_and_broadcasts_the_mean_after_a_round() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = FederationConfig {
        algorithm: unifed_aggregator::Algorithm::named("fedcd").unwrap(),
        ..scaffold_cfg()
    };
    let mut agg = open(dir.path(), cfg);
    let start = agg.handle(Event::Start, 0).unwrap();
    // No federation gradient before a round closed.
    assert_eq!(
        broadcast_of(&start).extras,
        unifed_protocol::ServerExtras::None
    );
    let width = spec().head_width().unwrap();
    let mask = |gradient: Vec<f32>, risk: f64| SiteExtras::MaskGradient { gradient, risk };
    let refused = |agg: &mut Aggregator, extras: SiteExtras| {
        let acts = send(agg, "a", with_extras("a", 1, 0, extras));
        match &answers(&acts)[0].1 {
            Answer::Rejected(r) => r.clone(),
            other => panic!("accepted: {other:?}"),
        }
    };
    assert!(matches!(
        refused(&mut agg, SiteExtras::None),
        RejectReason::UnexpectedExtras(_)
    ));
    assert!(matches!(
        refused(&mut agg, mask(vec![0.1; width + 1], 0.5)),
        RejectReason::Malformed(m) if m.contains("width")
    ));
    let mut nan = vec![0.1; width];
    nan[1] = f32::NAN;
    assert!(matches!(
        refused(&mut agg, mask(nan, 0.5)),
        RejectReason::NonFinite(_)
    ));
    assert!(matches!(
        refused(&mut agg, mask(vec![1.0; width], 0.5)),
        RejectReason::NormTooLarge { bound: 1.0, .. }
    ));
    for risk in [0.0, -1.0, f64::INFINITY] {
        assert!(matches!(
            refused(&mut agg, mask(vec![0.1; width], risk)),
            RejectReason::Malformed(m) if m.contains("risk")
        ));
    }
    send(
        &mut agg,
        "a",
        with_extras("a", 1, 0, mask(vec![0.125; width], 0.5)),
    );
    let closed = send(
        &mut agg,
        "b",
        with_extras("b", 1, 0, mask(vec![0.375; width], 1.5)),
    );
    assert_eq!(agg.model_version(), 1);
    // Equal samples: g_g = ([0.125..] + [0.375..]) / 2.
    assert_eq!(
        broadcast_of(&closed).extras,
        unifed_protocol::ServerExtras::MaskGradient(vec![0.25; width])
    );
}

#[test]
fn an_update_spooled_without_its_audit_line_is_audited_once_at_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut agg = open(dir.path(), config(2, 3, BnPolicy::Local));
        agg.handle(Event::Start, 0).unwrap();
        send(&mut agg, "a", good("a", 1, 0, 100, BnPolicy::Local));
        send(&mut agg, "b", good("b", 1, 0, 100, BnPolicy::Local));
    }
    // As if the process stopped after committing b's update, before writing its line (and
    // tore the line it was writing).
    let log = dir.path().join("audit.log");
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    std::fs::write(&log, format!("{}\n{{\"v\":", lines[0])).unwrap();
    let accepted_b = |agg: &Aggregator| {
        let text = std::fs::read_to_string(agg.store().dir().join("audit.log")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<unifed_aggregator::store::AuditEntry>(l).ok())
            .filter(|e| e.site == "b" && e.event == "accepted" && e.round == 1)
            .count()
    };
    for _ in 0..2 {
        let agg = open(dir.path(), config(2, 3, BnPolicy::Local));
        assert_eq!(accepted_b(&agg), 1);
    }
}

/// Item 1 of the hostile-site issue under the default config: `c` claims the most samples the
/// federation allows and sends minus the model. Its weight counts as `max_weight_of_median`
/// times the round's lower-median claim and its delta is scaled to `max_norm_of_median` times
/// the round's lower-median norm, so the model moves as the bounds say, not to zero; the audit
/// names what was cut.
#[test]
fn a_site_claiming_the_cap_and_sending_minus_the_model_counts_only_as_its_cohort_allows() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), unvouched(config(1, 3, BnPolicy::Local)));
    agg.handle(Event::Start, 0).unwrap();
    let base = initial().tensors;
    let small = |site: &str| {
        with_delta(site, 1, 100, BnPolicy::Local, |d| {
            for t in d.iter_mut() {
                let v: Vec<f32> = unifed_protocol::encoding::decode(t)
                    .unwrap()
                    .iter()
                    .map(|x| x * 0.05)
                    .collect();
                *t = encode(&t.name, &t.shape, &v, Encoding::F32, None);
            }
        })
    };
    send(&mut agg, "a", small("a"));
    send(&mut agg, "b", small("b"));
    let claim = FederationConfig::new("fed1", 1, 3, vec![]).max_samples;
    let minus = with_delta("c", 1, claim, BnPolicy::Local, |d| {
        for (t, b) in d.iter_mut().zip(&base) {
            let v: Vec<f32> = b.iter().map(|x| -x).collect();
            *t = encode(&t.name, &t.shape, &v, Encoding::F32, None);
        }
    });
    let acts = send(&mut agg, "c", minus);
    let acts = closed(&mut agg, acts);
    assert!(acts.iter().any(|a| matches!(a, Action::RoundClosed { .. })));
    // The expected model, from the bounds' definition.
    let honest = |site: &str, i: usize| -> Vec<f32> {
        delta_values(site, 1, i, base[i].len())
            .iter()
            .map(|x| x * 0.05)
            .collect()
    };
    let l2 = |ts: &[Vec<f32>]| {
        ts.iter()
            .flatten()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>()
            .sqrt()
    };
    let na = l2(&[honest("a", 0), honest("a", 1)]);
    let nb = l2(&[honest("b", 0), honest("b", 1)]);
    let nc = l2(&base[..2]);
    let cfg = FederationConfig::new("fed1", 1, 3, vec![]);
    let scale = cfg.max_norm_of_median * na.max(nb) / nc;
    let weight = (100.0 * cfg.max_weight_of_median).floor();
    assert!(scale < 0.5, "the attack is clipped: {scale}");
    for (i, b) in base.iter().enumerate().take(2) {
        let (da, db) = (honest("a", i), honest("b", i));
        for (k, &x) in b.iter().enumerate() {
            let attack = (-x as f64 * scale) as f32;
            let sum = 100.0 * da[k] as f64 + 100.0 * db[k] as f64 + weight * attack as f64;
            let want = (x as f64 + sum / (200.0 + weight)) as f32;
            assert_eq!(agg.model()[i][k], want, "tensor {i} value {k}");
        }
    }
    let left = l2(&agg.model()[..2]) / nc;
    assert!(left > 0.6, "the model keeps {left} of its norm, not 1.3e-5");
    let audit = agg.store().audit_entries().unwrap();
    let bounded: Vec<_> = audit.iter().filter(|e| e.event == "bounded").collect();
    assert_eq!(bounded.len(), 1, "{audit:?}");
    assert_eq!(bounded[0].site, "c");
    assert!(
        bounded[0].detail.starts_with(&format!(
            "weight counted as {weight} of {claim} claimed samples; delta scaled by {scale:.4}"
        )),
        "{}",
        bounded[0].detail
    );
}

/// A round of `a`, `b` and `c` claiming 100, 200 and 300 samples with a weight cap of the
/// lower median (200) and no norm bound, `c` enrolled with `c_count`: the model's first two
/// tensors and the audit.
fn claims_100_200_300(c_count: Option<u64>) -> (Vec<Vec<f32>>, Vec<AuditEntry>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = unvouched(config(1, 3, BnPolicy::Local));
    cfg.max_weight_of_median = 1.0;
    cfg.max_norm_of_median = f64::INFINITY;
    for s in cfg.sites.iter_mut().filter(|s| s.id == "c") {
        s.max_samples = c_count;
    }
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    for (site, n) in [("a", 100), ("b", 200), ("c", 300)] {
        send(&mut agg, site, good(site, 1, 0, n, BnPolicy::Local));
    }
    assert!(agg.finished());
    let audit = agg.store().audit_entries().unwrap();
    (agg.model()[..2].to_vec(), audit)
}

/// The first two tensors of the initial model plus the mean of `a`, `b` and `c`'s round-1
/// deltas weighed 100, 200 and `c_weight`.
fn mean_with_c_weighing(c_weight: f64) -> Vec<Vec<f32>> {
    let base = initial().tensors;
    base.iter()
        .take(2)
        .enumerate()
        .map(|(i, b)| {
            let d = |site| delta_values(site, 1, i, b.len());
            let (da, db, dc) = (d("a"), d("b"), d("c"));
            let total = 300.0 + c_weight;
            b.iter()
                .enumerate()
                .map(|(k, &x)| {
                    let sum = 100.0 * da[k] as f64 + 200.0 * db[k] as f64 + c_weight * dc[k] as f64;
                    (x as f64 + sum / total) as f32
                })
                .collect()
        })
        .collect()
}

/// A site enrolled with its sample count is vouched for by the operator: its claim counts in
/// full up to that count, past the round's median cap; unvouched, the same claim counts as
/// the lower median, and the audit says so.
#[test]
fn a_site_enrolled_with_its_count_weighs_as_it_claims_past_the_median_cap() {
    let (model, audit) = claims_100_200_300(Some(300));
    assert_eq!(model, mean_with_c_weighing(300.0));
    assert!(!audit.iter().any(|e| e.event == "bounded"), "{audit:?}");
    let (model, audit) = claims_100_200_300(None);
    assert_eq!(model, mean_with_c_weighing(200.0));
    let bounded: Vec<_> = audit.iter().filter(|e| e.event == "bounded").collect();
    assert_eq!(bounded.len(), 1);
    assert_eq!(bounded[0].site, "c");
}

/// The cohort bounds' arithmetic: the lower median (the smaller of two), a cap of at least one
/// sample, no clip of an update at the bound, and `inf` turning each bound off.
#[test]
fn cohort_bounds_take_the_lower_median_and_turn_off_at_infinity() {
    use unifed_aggregator::spoolround::{CohortBounds, Take};
    let b = CohortBounds {
        weight_of_median: 4.0,
        norm_of_median: 2.0,
    };
    let t = b.takes(&[(10, 1.0), (1000, 8.0)]);
    assert_eq!(
        t,
        vec![
            Take {
                claimed: 10,
                samples: 10,
                norm: 1.0,
                scale: 1.0
            },
            Take {
                claimed: 1000,
                samples: 40,
                norm: 8.0,
                scale: 0.25
            },
        ]
    );
    let t = b.takes(&[(7, 2.0), (9, 4.0), (8, 1.0)]);
    assert!(t.iter().all(|t| !t.bounded()), "{t:?}");
    assert_eq!(b.takes(&[(0, 0.0)])[0].samples, 0);
    let t = b.takes(&[(0, 0.0), (0, 0.0), (5, 3.0)]);
    assert_eq!((t[2].samples, t[2].scale), (1, 0.0));
    assert!(
        CohortBounds::OFF
            .takes(&[(1, 1.0), (u64::MAX, 1e30)])
            .iter()
            .all(|t| !t.bounded())
    );
}

/// Fuzzing of what an enrolled site can make the core decode: 3,000 validly signed envelopes
/// whose update payload is a valid update with random bytes flipped, set, cut or inserted (a
/// fixed-seed generator, so a failure replays). The core must answer each with a typed
/// refusal or an accept (or drop it), never fail or panic, and the model it folds must stay
/// finite.
#[test]
fn signed_mutations_of_an_update_are_answered_never_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(1_000_000, 1, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..3_000 {
        let (round, version) = (agg.round(), agg.model_version());
        // A valid update of the open round, its payload's bytes edited, signed again by `a`.
        let mut env = Envelope::decode(&good("a", round, version, 5, BnPolicy::Local)).unwrap();
        let p = &mut env.payload;
        for _ in 0..1 + next() % 4 {
            let n = p.len();
            let at = next() as usize % n.max(1);
            match next() % 4 {
                0 if n > 0 => p[at] ^= 1 << (next() % 8),
                1 if n > 0 => p[at] = next() as u8,
                2 => p.truncate(at),
                _ => p.insert(at.min(n), next() as u8),
            }
        }
        env.signature = None;
        let bytes = key("a").sign(&env);
        let acts = agg
            .handle(
                Event::Update(Incoming {
                    site: "a".into(),
                    bytes: bytes.into(),
                    arrival: Arrival::Message,
                    staged: None,
                }),
                1_000,
            )
            .unwrap_or_else(|e| panic!("a signed update ended the core: {e}"));
        let acts = closed(&mut agg, acts);
        for (_, answer) in answers(&acts) {
            match answer {
                Answer::Accepted => accepted += 1,
                Answer::Rejected(_) => refused += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(
        accepted > 0 && refused > 0,
        "{accepted} accepted, {refused} refused"
    );
    assert!(agg.model().iter().flatten().all(|v| v.is_finite()));
}

/// Runs: an update signed in another run of the same federation (a federation restarted with a
/// fresh data folder under the same id and keys, whose captures are replayed) is neither
/// answered nor counted, and the site's own update of this run is taken.
#[test]
fn an_update_of_another_run_is_refused_and_the_runs_own_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let mut agg = open(dir.path(), config(1, 1, BnPolicy::Local));
    agg.handle(Event::Start, 0).unwrap();
    let mine = good("a", 1, 0, 5, BnPolicy::Local);
    let mut earlier = Envelope::decode(&mine).unwrap();
    earlier.run.created_ms -= 1;
    earlier.signature = None;
    let earlier = key("a").sign(&earlier);
    let err = agg
        .admission()
        .admit(&Id::new("a").unwrap(), &earlier, 1 << 20)
        .unwrap_err();
    assert!(
        matches!(err, AdmitError::OtherRun { want, .. } if want == agg.run()),
        "{err}"
    );
    assert_eq!(answers(&send(&mut agg, "a", earlier)), vec![]);
    assert!(agg.accepted().is_empty());
    assert_eq!(
        answers(&send(&mut agg, "a", mine)),
        vec![("a".into(), Answer::Accepted)]
    );
    // A fresh data folder is another run.
    let other = tempfile::tempdir().unwrap();
    let first = agg.run();
    assert_ne!(
        open(other.path(), config(1, 1, BnPolicy::Local)).run(),
        first
    );
    // And a reopened one keeps its run.
    drop(agg);
    assert_eq!(open(dir.path(), config(1, 1, BnPolicy::Local)).run(), first);
}

/// The audit log keeps to its budget: a site that earns refusals round after round (each
/// audited) fills `audit.log` to a quarter of the budget, which is then rotated to
/// `audit.log.1` and so on to `.3`, the oldest lines dropped; every file stays within its
/// share, the entries read back newest last, and a restart's recovery reads the rotated files.
#[test]
fn the_audit_log_is_rotated_within_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 64 << 10;
    let cfg = FederationConfig {
        audit_budget_bytes: budget,
        ..config(1_000, 1, BnPolicy::Local)
    };
    let mut agg = open(dir.path(), cfg);
    agg.handle(Event::Start, 0).unwrap();
    // Round after round: one accepted update (it closes the round) and refusals.
    for round in 1..=150u64 {
        let version = round - 1;
        for _ in 0..4 {
            send(
                &mut agg,
                "b",
                good("b", round + 5, version, 5, BnPolicy::Local),
            );
        }
        send(&mut agg, "a", good("a", round, version, 5, BnPolicy::Local));
        assert_eq!(agg.round(), round + 1);
    }
    let share = budget / 4;
    let mut total = 0;
    for name in ["audit.log", "audit.log.1", "audit.log.2", "audit.log.3"] {
        let len = std::fs::metadata(dir.path().join(name)).unwrap().len();
        assert!(len <= share, "{name}: {len} bytes");
        total += len;
    }
    assert!(total <= budget);
    assert!(!dir.path().join("audit.log.4").exists());
    let entries = agg.store().audit_entries().unwrap();
    let last = entries.last().unwrap();
    assert_eq!((last.round, last.event.as_str()), (150, "round-closed"));
    // The oldest rounds were dropped, the newest kept, in order.
    assert!(entries.first().unwrap().round > 1);
    let closed: Vec<u64> = entries
        .iter()
        .filter(|e| e.event == "round-closed")
        .map(|e| e.round)
        .collect();
    assert!(closed.windows(2).all(|w| w[1] == w[0] + 1), "{closed:?}");
    assert_eq!(
        agg.store().audited(150, "accepted").unwrap(),
        ["a".to_string()].into()
    );
}
