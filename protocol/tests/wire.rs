//! Every payload type travels through an [`Envelope`] and back unchanged, and the encodings
//! shrink a site update by the factor they promise.

use serde::Serialize;
use serde::de::DeserializeOwned;
use unifed_protocol::*;

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn spec_hash() -> SpecHash {
    SpecHash([7; 32])
}

/// Wraps `payload` in an envelope, encodes, decodes, and returns the payload and wire size.
fn through_envelope<T>(kind: MessageKind, payload: &T) -> (T, usize)
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let e = Envelope::new(kind, id("fed"), id("site-1"), 4, 9, spec_hash(), payload);
    let bytes = e.encode();
    let back = Envelope::decode(&bytes).unwrap();
    assert_eq!(back, e);
    assert_eq!(back.kind, kind);
    let p: T = back.payload_as().unwrap();
    assert_eq!(&p, payload);
    (p, bytes.len())
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(seed).wrapping_add(12345) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn update(encoding: Encoding) -> SiteUpdate {
    let tensors = [
        ("conv1.weight", vec![64u32, 3, 5, 5]),
        ("fc1.weight", vec![128, 64]),
        ("fc1.bias", vec![128]),
    ];
    SiteUpdate {
        round: 4,
        base_version: 9,
        samples: 743,
        delta: tensors
            .iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n = shape.iter().product::<u32>() as usize;
                encode(name, shape, &values(n, 31 + i as u32), encoding, None)
            })
            .collect(),
        bn: vec![],
        report: LocalReport {
            local_steps: 24,
            train_loss: 0.61,
        },
        extras: SiteExtras::None,
    }
}

#[test]
fn a_round_manifest_round_trips_through_an_envelope() {
    let m = RoundManifest {
        run: RunId {
            created_ms: 1_795_000_000_000,
            nonce: 42,
        },
        round: 4,
        model_version: 9,
        spec_hash: spec_hash(),
        chunk_count: 12,
        payload_len: 1_234_567,
        payload_hash: payload_hash(b"model"),
        delta: Some(DeltaInfo {
            from_version: 8,
            chunk_count: 1,
            payload_len: 4_321,
            payload_hash: payload_hash(b"delta"),
        }),
        encoding: Encoding::TopK { per_mille: 10 },
        bn_policy: BnPolicy::Local,
        bn_sharing: BnSharing::Affine,
        sampled: vec![id("a"), id("b.c")],
        upload_window_bytes: 2 << 20,
        plan: RoundPlan {
            objective: Objective::Proximal { mu: 0.01 },
        },
        deadline_ms: 1_700_000_000_000,
        finished: false,
    };
    through_envelope(MessageKind::RoundManifest, &m);
}

#[test]
fn every_other_payload_round_trips_through_an_envelope() {
    for enc in [
        Encoding::F32,
        Encoding::F16,
        Encoding::Q8,
        Encoding::TopK { per_mille: 100 },
        Encoding::TopKQ8 { per_mille: 100 },
    ] {
        let mut u = update(enc);
        u.bn = vec![encode("bn.weight", &[2], &[1.0, -1.0], Encoding::F32, None)];
        through_envelope(MessageKind::SiteUpdate, &u);
        let b = ServerBroadcast {
            model_version: 10,
            weights: u.delta.clone(),
            extras: ServerExtras::None,
        };
        through_envelope(MessageKind::ServerBroadcast, &b);
        let d = ModelDelta {
            from_version: 9,
            model_version: 10,
            delta: u.delta.clone(),
            values: u.bn.clone(),
            extras: ServerExtras::None,
        };
        through_envelope(MessageKind::ModelDelta, &d);
    }
    for chunk in split(&[1, 2, 3, 4, 5], 2) {
        through_envelope(MessageKind::ModelChunk, &chunk);
        through_envelope(MessageKind::UpdateChunk, &chunk);
    }
    through_envelope(
        MessageKind::ChunkRequest,
        &ChunkRequest {
            model_version: 9,
            indices: vec![],
            payload: Payload::Package,
            alone: false,
        },
    );
    for req in [
        OnboardRequest::Package {
            model_version: None,
        },
        OnboardRequest::RegistryGet {
            model_version: Some(3),
        },
    ] {
        through_envelope(MessageKind::OnboardRequest, &req);
    }
    for reply in [
        OnboardReply::Package(PackageInfo {
            model_version: 3,
            bn_sharing: BnSharing::AffineStats,
            bn_sites: vec![id("a"), id("b")],
            chunk_count: 4,
            payload_len: 1000,
            payload_hash: payload_hash(b"package"),
        }),
        OnboardReply::Registered {
            model_version: 3,
            entry_hash: payload_hash(b"entry"),
        },
        OnboardReply::Error(OnboardError::UnknownVersion {
            requested: 9,
            available: vec![2, 3],
        }),
        OnboardReply::Error(OnboardError::NotRegistered {
            requested: None,
            available: vec![],
        }),
    ] {
        through_envelope(MessageKind::OnboardReply, &reply);
    }
    let entry = RegistryEntry {
        model_version: 3,
        sealing: Sealing::ChaCha20Poly1305 { nonce: [7; 12] },
        data: vec![1, 2, 3],
    };
    let bytes = postcard::to_allocvec(&entry).unwrap();
    assert_eq!(
        postcard::from_bytes::<RegistryEntry>(&bytes).unwrap(),
        entry
    );
    for chunk in split(&bytes, 4) {
        through_envelope(MessageKind::RegistryPut, &chunk);
        through_envelope(MessageKind::RegistryEntry, &chunk);
    }

    for answer in [
        Answer::Accepted,
        Answer::Rejected(RejectReason::WrongRound {
            expected: 4,
            got: 3,
        }),
        Answer::Rejected(RejectReason::NormTooLarge {
            norm: 12.5,
            bound: 10.0,
        }),
        Answer::Rejected(RejectReason::NonFinite("fc1.weight".into())),
    ] {
        through_envelope(
            MessageKind::UpdateAnswer,
            &UpdateAnswer {
                round: 4,
                update_hash: [3; 32],
                answer,
            },
        );
    }
    for state in [
        SiteState::Online,
        SiteState::Training { round: 4 },
        SiteState::Offline,
        SiteState::Finished { model_version: 12 },
    ] {
        through_envelope(
            MessageKind::SiteStatus,
            &SiteStatus {
                state,
                detail: "gpu busy".into(),
            },
        );
    }
}

#[test]
fn a_site_update_costs_what_its_encoding_promises() {
    let raw_f32 = update(Encoding::F32)
        .delta
        .iter()
        .map(|t| t.numel().unwrap() * 4)
        .sum::<usize>();
    assert_eq!(raw_f32, (64 * 3 * 25 + 128 * 64 + 128) * 4);
    let size = |enc| through_envelope(MessageKind::SiteUpdate, &update(enc)).1 as f64;
    let ratio = |enc| size(enc) / raw_f32 as f64;
    // Names, shapes, lengths and the envelope cost well under 1 % here.
    assert!(
        (1.0..1.01).contains(&ratio(Encoding::F32)),
        "f32 {}",
        ratio(Encoding::F32)
    );
    assert!(
        (0.5..0.51).contains(&ratio(Encoding::F16)),
        "f16 {}",
        ratio(Encoding::F16)
    );
    assert!(
        (0.25..0.26).contains(&ratio(Encoding::Q8)),
        "q8 {}",
        ratio(Encoding::Q8)
    );
    // Top-k at 1 % sends 1 % of the values as f32 plus short delta-coded indices.
    let topk = ratio(Encoding::TopK { per_mille: 10 });
    assert!(topk < 0.02, "top-k {topk}");
    // With q8 values, 10 % costs about two bytes per kept value: a twentieth of f32.
    let topkq8 = ratio(Encoding::TopKQ8 { per_mille: 100 });
    assert!((0.045..0.0625).contains(&topkq8), "top-k q8 {topkq8}");
    // Ternary: 1.6 bits per value and an f16 scale per 256 values.
    let ternary = ratio(Encoding::Ternary { block: 256 });
    assert!((0.05..0.0625).contains(&ternary), "ternary {ternary}");
    // Ternary-q8: the 128 x 64 matrix in ternary (1 703 bytes), the convolution kernel and the
    // bias in q8 (4 936 bytes): 6 639 of 52 480.
    let mixed = ratio(Encoding::TernaryQ8 { block: 256 });
    assert!((0.1265..0.135).contains(&mixed), "ternary-q8 {mixed}");
    // A scale per 64 values instead of 256 adds 96 f16 scales to the 8 192-value matrix (the
    // block size shrinks to a one-byte varint, the scales' length grows to a two-byte one).
    assert_eq!(
        size(Encoding::TernaryQ8 { block: 64 }) - size(Encoding::TernaryQ8 { block: 256 }),
        96.0 * 2.0
    );
}

#[test]
fn bn_sharing_policies_parse_and_select_their_tensors() {
    for p in [BnSharing::None, BnSharing::Affine, BnSharing::AffineStats] {
        assert_eq!(p.name().parse::<BnSharing>(), Ok(p));
    }
    assert!(
        "stats"
            .parse::<BnSharing>()
            .unwrap_err()
            .to_string()
            .contains("affine+stats")
    );
    let kinds = [
        TensorKind::NonBn,
        TensorKind::BnWeight,
        TensorKind::BnBias,
        TensorKind::BnRunningMean,
        TensorKind::BnRunningVar,
    ];
    let shared = |p: BnSharing| kinds.map(|k| p.shares(k));
    assert_eq!(shared(BnSharing::None), [false; 5]);
    assert_eq!(shared(BnSharing::Affine), [false, true, true, false, false]);
    assert_eq!(
        shared(BnSharing::AffineStats),
        [false, true, true, true, true]
    );
}

/// Byte strings are (de)serialised as one block, where they once went byte by byte through
/// serde's sequence visitor: postcard writes the same bytes either way (a length, then the
/// bytes), so peers of both kinds read each other.
#[test]
fn byte_strings_make_the_same_postcard_bytes_as_sequences_of_bytes() {
    #[derive(Serialize)]
    struct SeqChunk {
        payload_hash: [u8; 32],
        index: u32,
        count: u32,
        total_len: u64,
        data: Vec<u8>,
    }
    #[derive(Serialize)]
    enum SeqValues {
        F32(Vec<u8>),
        _F16(Vec<u8>),
        Q8 { scale: f32, data: Vec<u8> },
    }
    #[derive(Serialize)]
    struct SeqBody<'a> {
        federation: &'a Id,
        sender: &'a Id,
        round: u64,
        model_version: u64,
        spec_hash: &'a SpecHash,
        run: RunId,
        payload: &'a [u8],
        signature: Option<&'a [u8]>,
    }
    let data: Vec<u8> = (0..=255u8).cycle().take(700).collect();
    let c = Chunk {
        payload_hash: [3; 32],
        index: 2,
        count: 9,
        total_len: 1000,
        data: data.clone(),
    };
    let seq = SeqChunk {
        payload_hash: [3; 32],
        index: 2,
        count: 9,
        total_len: 1000,
        data: data.clone(),
    };
    let bytes = postcard::to_allocvec(&c).unwrap();
    assert_eq!(bytes, postcard::to_allocvec(&seq).unwrap());
    assert_eq!(postcard::from_bytes::<Chunk>(&bytes).unwrap(), c);
    assert_eq!(
        postcard::to_allocvec(&Values::F32(data.clone())).unwrap(),
        postcard::to_allocvec(&SeqValues::F32(data.clone())).unwrap()
    );
    let q8 = Values::Q8 {
        scale: 0.5,
        data: data.clone(),
    };
    let seq_q8 = SeqValues::Q8 { scale: 0.5, data };
    assert_eq!(
        postcard::to_allocvec(&q8).unwrap(),
        postcard::to_allocvec(&seq_q8).unwrap()
    );
    let e = Envelope::new(
        MessageKind::UpdateChunk,
        id("fed"),
        id("site-1"),
        4,
        9,
        spec_hash(),
        &c,
    );
    let wire = e.encode();
    let body = SeqBody {
        federation: &e.federation,
        sender: &e.sender,
        round: 4,
        model_version: 9,
        spec_hash: &e.spec_hash,
        run: e.run,
        payload: &e.payload,
        signature: None,
    };
    assert_eq!(&wire[8..], &postcard::to_allocvec(&body).unwrap()[..]);
    assert_eq!(Envelope::decode(&wire).unwrap(), e);
}

/// Whether `part` lies inside `whole`'s memory: read in place, not copied.
fn lies_in(part: &[u8], whole: &[u8]) -> bool {
    let (p, w) = (part.as_ptr() as usize, whole.as_ptr() as usize);
    p >= w && p + part.len() <= w + whole.len()
}

/// A receiver reads a chunk in place: the envelope's payload and the chunk's bytes are slices
/// of the received message, with the same fields as the owned decode, and a borrowed chunk
/// encodes to the very bytes of the owned one.
#[test]
fn a_chunk_is_read_in_place_with_the_fields_and_bytes_of_an_owned_one() {
    let data: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    let c = Chunk {
        payload_hash: [7; 32],
        index: 5,
        count: 11,
        total_len: 32_000,
        data,
    };
    assert_eq!(
        postcard::to_allocvec(&c.as_ref()).unwrap(),
        postcard::to_allocvec(&c).unwrap()
    );
    let key = SigningKey::from_seed([9; 32]);
    // Serialised straight from the borrowed chunk, as a site sends one.
    let unsigned = Envelope::encode_new(
        MessageKind::UpdateChunk,
        &id("fed"),
        &id("site-1"),
        (RunId::default(), 4, 9),
        spec_hash(),
        &c.as_ref(),
    );
    let wire = key.sign_encoded(unsigned).unwrap();
    let opened = Keyring::single(id("site-1"), key.public())
        .open(&wire, 1 << 20)
        .unwrap();
    assert!(lies_in(opened.payload, &wire));
    assert!(lies_in(opened.signature.unwrap(), &wire));
    let chunk: ChunkRef = opened.payload_as().unwrap();
    assert!(lies_in(chunk.data, &wire));
    assert_eq!(chunk, c.as_ref());
    // The owned reads agree field for field.
    let owned = Envelope::decode(&wire).unwrap();
    assert_eq!(EnvelopeRef::read(&wire).unwrap().into_owned(), owned);
    assert_eq!(opened.into_owned(), owned);
    assert_eq!(owned.payload_as::<Chunk>().unwrap(), c);
    // A limit below the message's length refuses it before anything is parsed.
    assert!(matches!(
        Keyring::single(id("site-1"), key.public()).open(&wire, wire.len() - 1),
        Err(AuthError::Decode(DecodeError::TooLarge { .. }))
    ));
}

#[test]
fn a_downloaded_model_is_read_in_place_and_a_payload_of_the_wrong_kind_is_refused() {
    let t = |name: &str, values: Values| EncodedTensor {
        name: name.into(),
        shape: vec![3],
        values,
    };
    let model = ServerBroadcast {
        model_version: 7,
        weights: vec![
            encode("fc.weight", &[3], &[1.0, -2.5, 3.25], Encoding::F32, None),
            t("fc.bias", Values::F16(vec![0, 60, 0, 188, 0, 0])),
        ],
        extras: ServerExtras::None,
    };
    let bytes = postcard::to_allocvec(&model).unwrap();
    let d = Downloaded::new(bytes.clone(), false).unwrap();
    assert_eq!((d.model_version(), d.from_version()), (7, None));
    let Download::Model(read) = d.read().unwrap() else {
        panic!("a whole model reads as one");
    };
    // Every tensor's bytes are a slice of the payload, and the read encodes as the owned model.
    for w in &read.weights {
        let (Values::F32(b) | Values::F16(b)) = &w.values else {
            panic!("dense tensors")
        };
        assert!(lies_in(b, d.bytes()));
    }
    assert_eq!(postcard::to_allocvec(&read).unwrap(), bytes);
    assert_eq!(decode(&read.weights[0]).unwrap(), vec![1.0, -2.5, 3.25]);
    assert_eq!(decode(&read.weights[1]).unwrap(), vec![1.0, -1.0, 0.0]);

    let delta = ModelDelta {
        from_version: 6,
        model_version: 7,
        delta: vec![t(
            "fc.weight",
            Values::Q8 {
                scale: 0.5,
                data: vec![2, 254, 0],
            },
        )],
        values: Vec::new(),
        extras: ServerExtras::None,
    };
    let dbytes = postcard::to_allocvec(&delta).unwrap();
    let dd = Downloaded::new(dbytes.clone(), true).unwrap();
    assert_eq!((dd.model_version(), dd.from_version()), (7, Some(6)));
    let Download::Delta(read) = dd.read().unwrap() else {
        panic!("a delta reads as one");
    };
    assert_eq!(decode(&read.delta[0]).unwrap(), vec![1.0, -1.0, 0.0]);
    // A truncated payload, and a delta's bytes where a model's are expected, are refused.
    assert!(Downloaded::new(bytes[..bytes.len() - 5].to_vec(), false).is_err());
    assert!(Downloaded::new(dbytes, false).is_err());
}

/// The run is signed with the rest: a message of one run moved to another (its signature
/// kept) no longer opens, and the run survives encoding as it was.
#[test]
fn a_message_moved_to_another_run_fails_its_signature() {
    let key = SigningKey::from_seed([9; 32]);
    let run = RunId {
        created_ms: 1_795_000_000_000,
        nonce: 7,
    };
    let e = Envelope::new(
        MessageKind::SiteStatus,
        id("fed"),
        id("site-1"),
        3,
        2,
        spec_hash(),
        &(),
    )
    .in_run(run);
    let wire = key.sign(&e);
    let ring = Keyring::single(id("site-1"), key.public());
    assert_eq!(ring.open(&wire, 1 << 20).unwrap().run, run);
    // Sixteen bytes whatever the run: a message is as long in every run.
    let small = e.clone().in_run(RunId::default()).encode().len();
    let large = e
        .clone()
        .in_run(RunId {
            created_ms: u64::MAX,
            nonce: u64::MAX,
        })
        .encode()
        .len();
    assert_eq!(small, large);
    let mut moved = Envelope::decode(&wire).unwrap();
    moved.run.nonce += 1;
    assert!(matches!(
        ring.open(&moved.encode(), 1 << 20),
        Err(unifed_protocol::AuthError::BadSignature(_))
    ));
}
