//! Property tests that throw arbitrary and mutated input at every decoder and at the chunk
//! reassembler: nothing may panic, and the reassembler must stay inside its memory limit.

use proptest::prelude::*;
use unifed_protocol::messages::*;
use unifed_protocol::*;

/// Cases per property. Each property below runs this many inputs.
const CASES: u32 = 2000;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        ..ProptestConfig::default()
    }
}

/// Largest tensor the fuzz tests let `decode` allocate; a receiver checks shapes against the
/// model spec before decoding, so it never decodes an unbounded claimed size either.
const MAX_FUZZ_NUMEL: usize = 1 << 20;

/// One edit of a valid encoding.
#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, mask: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Insert { at: usize, byte: u8 },
    Remove { at: usize },
    Append(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        1 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Append),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let n = bytes.len();
        match m {
            Mutation::Flip { at, mask } if n > 0 => bytes[at % n] ^= mask,
            Mutation::Set { at, byte } if n > 0 => bytes[at % n] = *byte,
            Mutation::Truncate { at } => bytes.truncate(at % (n + 1)),
            Mutation::Insert { at, byte } => bytes.insert(at % (n + 1), *byte),
            Mutation::Remove { at } if n > 0 => {
                bytes.remove(at % n);
            }
            Mutation::Append(junk) => bytes.extend_from_slice(junk),
            _ => {}
        }
    }
    bytes
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn sample_update() -> SiteUpdate {
    SiteUpdate {
        round: 3,
        base_version: 2,
        samples: 100,
        delta: vec![
            encode(
                "a",
                &[2, 3],
                &[1.0, -2.0, 3.0, 0.5, 0.0, -0.25],
                Encoding::F32,
                None,
            ),
            encode("b", &[4], &[1.0, -2.0, 3.0, 0.5], Encoding::F16, None),
            encode("c", &[3], &[1.0, -2.0, 3.0], Encoding::Q8, None),
            encode(
                "d",
                &[2, 4],
                &[0.0, 9.0, 0.0, 0.0, -7.0, 0.0, 1.0, 0.0],
                Encoding::TopK { per_mille: 300 },
                None,
            ),
        ],
        bn: vec![encode("bn.weight", &[2], &[1.0, 0.5], Encoding::F32, None)],
        report: LocalReport {
            local_steps: 24,
            train_loss: 0.5,
        },
        extras: SiteExtras::None,
    }
}

fn sample_envelope() -> Vec<u8> {
    let mut e = Envelope::new(
        MessageKind::SiteUpdate,
        id("fed"),
        id("site-1"),
        3,
        2,
        SpecHash([1; 32]),
        &sample_update(),
    );
    e.signature = Some(vec![5; 8]);
    e.encode()
}

/// Decodes every tensor of an update whose size is plausible, as a receiver would.
fn decode_update(u: &SiteUpdate) {
    for t in u.delta.iter().chain(&u.bn) {
        if t.numel().is_some_and(|n| n <= MAX_FUZZ_NUMEL)
            && let Ok(v) = decode(t)
        {
            assert_eq!(Some(v.len()), t.numel());
        }
    }
}

/// Follows a decoded envelope all the way down, and checks it re-encodes to itself.
fn check_envelope(result: Result<Envelope, DecodeError>) {
    if let Ok(e) = result {
        assert_eq!(Envelope::decode(&e.encode()).as_ref(), Ok(&e));
        if let Ok(u) = e.payload_as::<SiteUpdate>() {
            decode_update(&u);
        }
    }
}

/// Sizes for a tensor shape: mostly small, sometimes huge enough to overflow.
fn dim() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0..8u32, 1 => Just(u32::MAX), 1 => any::<u32>()]
}

fn values() -> impl Strategy<Value = Values> {
    let bytes = || prop::collection::vec(any::<u8>(), 0..80);
    prop_oneof![
        bytes().prop_map(Values::F32),
        bytes().prop_map(Values::F16),
        (any::<f32>(), bytes()).prop_map(|(scale, data)| Values::Q8 { scale, data }),
        (
            // Dense lengths either small or too large to match any small shape.
            prop_oneof![3 => 0..600u32, 1 => (MAX_FUZZ_NUMEL as u32)..],
            prop::collection::vec(prop_oneof![3 => 0..4u32, 1 => any::<u32>()], 0..12),
            prop::collection::vec(any::<f32>(), 0..12),
        )
            .prop_map(|(len, gaps, values)| Values::Sparse { len, gaps, values }),
    ]
}

/// Values whose length fits `numel`, so that decoding often succeeds (or fails late, on the
/// sparse indices).
fn fitting_values(numel: usize) -> impl Strategy<Value = Values> {
    let bytes = move |width: usize| prop::collection::vec(any::<u8>(), numel * width);
    prop_oneof![
        bytes(4).prop_map(Values::F32),
        bytes(2).prop_map(Values::F16),
        (any::<f32>(), bytes(1)).prop_map(|(scale, data)| Values::Q8 { scale, data }),
        prop::collection::vec((0..4u32, any::<f32>()), 0..=numel).prop_map(move |kept| {
            Values::Sparse {
                len: numel as u32,
                gaps: kept.iter().map(|k| k.0).collect(),
                values: kept.iter().map(|k| k.1).collect(),
            }
        }),
    ]
}

fn encoded_tensor() -> impl Strategy<Value = EncodedTensor> {
    let arbitrary = (prop::collection::vec(dim(), 0..4), values());
    let fitting = prop::collection::vec(0..6u32, 0..3).prop_flat_map(|shape| {
        let numel = shape.iter().product::<u32>() as usize;
        (Just(shape), fitting_values(numel))
    });
    prop_oneof![arbitrary, fitting].prop_map(|(shape, values)| EncodedTensor {
        name: "t".into(),
        shape,
        values,
    })
}

fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![
        Just(Encoding::F32),
        Just(Encoding::F16),
        Just(Encoding::Q8),
        any::<u16>().prop_map(|per_mille| Encoding::TopK { per_mille }),
    ]
}

/// One step of a reassembler run.
#[derive(Debug, Clone)]
enum Step {
    /// Deliver chunk `chunk` of payload `payload`, edited by `edit`.
    Deliver {
        payload: usize,
        chunk: usize,
        edit: u8,
        noise: u64,
    },
    /// Let time pass and expire old sets.
    Wait(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (any::<usize>(), any::<usize>(), 0..16u8, any::<u64>())
            .prop_map(|(payload, chunk, edit, noise)| Step::Deliver { payload, chunk, edit, noise }),
        1 => (0..400u64).prop_map(Step::Wait),
    ]
}

/// Applies edit `edit` (most are no edit at all) to a chunk.
fn edit_chunk(c: &mut Chunk, edit: u8, noise: u64) {
    let small = (noise % 7) as u32;
    match edit {
        0 if !c.data.is_empty() => {
            let i = noise as usize % c.data.len();
            c.data[i] ^= 1 + (noise >> 32) as u8 % 255;
        }
        1 => c.count = c.count.wrapping_add(small).wrapping_sub(3),
        2 => c.index = c.index.wrapping_add(small).wrapping_sub(3),
        3 => c.total_len = c.total_len.wrapping_add(u64::from(small)).wrapping_sub(3),
        4 => c.payload_hash[(noise % 32) as usize] ^= 1,
        5 => c.data.truncate(noise as usize % (c.data.len() + 1)),
        6 => c.data.extend((0..small).map(|i| i as u8)),
        7 => {
            c.count = noise as u32;
            c.total_len = noise >> 16;
            c.index = (noise >> 40) as u32;
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn envelope_decode_survives_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        check_envelope(Envelope::decode(&bytes));
        // Give the header a chance to pass so the body parser gets exercised too.
        let mut framed = sample_envelope()[..8].to_vec();
        framed.extend_from_slice(&bytes);
        check_envelope(Envelope::decode(&framed));
    }

    #[test]
    fn envelope_decode_survives_mutated_valid_messages(
        mutations in prop::collection::vec(mutation(), 1..6),
        limit in 0..400usize,
    ) {
        let bytes = mutate(sample_envelope(), &mutations);
        check_envelope(Envelope::decode(&bytes));
        let limited = Envelope::decode_limited(&bytes, limit);
        if bytes.len() > limit {
            prop_assert_eq!(limited, Err(DecodeError::TooLarge { len: bytes.len(), limit }));
        }
    }

    #[test]
    fn payload_decoders_survive_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(u) = postcard::from_bytes::<SiteUpdate>(&bytes) {
            decode_update(&u);
        }
        let _ = postcard::from_bytes::<RoundManifest>(&bytes);
        let _ = postcard::from_bytes::<Chunk>(&bytes);
        let _ = postcard::from_bytes::<ChunkRequest>(&bytes);
        let _ = postcard::from_bytes::<UpdateAnswer>(&bytes);
        let _ = postcard::from_bytes::<SiteStatus>(&bytes);
        let _ = postcard::from_bytes::<ServerBroadcast>(&bytes);
        let _ = postcard::from_bytes::<ServerBroadcast<&[u8]>>(&bytes);
        let _ = postcard::from_bytes::<ChunkRef>(&bytes);
        let _ = postcard::from_bytes::<UpdateReceipt>(&bytes);
        let _ = postcard::from_bytes::<OnboardRequest>(&bytes);
        let _ = postcard::from_bytes::<OnboardReply>(&bytes);
        let _ = postcard::from_bytes::<RegistryEntry>(&bytes);
        let _ = postcard::from_bytes::<ModelDelta>(&bytes);
        let _ = postcard::from_bytes::<SiteUpdateRef>(&bytes);
        // A model or delta payload as a site receives it, checked to decode and then read.
        for delta in [false, true] {
            if let Ok(d) = Downloaded::new(bytes.clone(), delta) {
                let _ = d.read();
            }
        }
    }

    #[test]
    fn site_update_decoding_survives_mutated_valid_updates(
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let valid = postcard::to_allocvec(&sample_update()).unwrap();
        let bytes = mutate(valid, &mutations);
        if let Ok(u) = postcard::from_bytes::<SiteUpdate>(&bytes) {
            decode_update(&u);
        }
    }

    #[test]
    fn tensor_decode_survives_arbitrary_tensors(t in encoded_tensor()) {
        let result = decode(&t);
        if t.numel().is_none() {
            prop_assert_eq!(&result, &Err(TensorError::ShapeOverflow("t".into())));
        }
        if let Ok(v) = result {
            prop_assert_eq!(Some(v.len()), t.numel());
            if let Values::Sparse { gaps, .. } = &t.values {
                prop_assert!(v.iter().filter(|x| x.to_bits() != 0).count() <= gaps.len());
            }
        }
    }

    #[test]
    fn check_passes_exactly_the_tensors_that_decode_and_a_borrowed_tensor_decodes_alike(
        t in encoded_tensor(),
        out in prop::collection::vec(any::<f32>(), 0..64),
    ) {
        let decoded = decode(&t);
        prop_assert_eq!(check(&t).map_err(|e| e.to_string()), decoded.as_ref().map(|v| v.len()).map_err(|e| e.to_string()));
        // Read in place from its wire bytes, the tensor decodes (and adds) bit for bit alike.
        let wire = postcard::to_allocvec(&t).unwrap();
        let borrowed: EncodedTensorRef<'_> = postcard::from_bytes(&wire).unwrap();
        prop_assert_eq!(postcard::to_allocvec(&borrowed).unwrap(), wire.clone());
        prop_assert_eq!(postcard::to_allocvec(&t.as_ref()).unwrap(), wire.clone());
        let bits = |r: Result<Vec<f32>, TensorError>| r.map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        prop_assert_eq!(bits(decode(&borrowed)), bits(decoded));
        let (mut a, mut b) = (out.clone(), out);
        let (ra, rb) = (decode_add(&t, &mut a), decode_add(&borrowed, &mut b));
        prop_assert_eq!(ra, rb);
        prop_assert_eq!(bits(Ok(a)), bits(Ok(b)));
    }

    #[test]
    fn encode_then_decode_keeps_the_length_of_any_values(
        x in prop::collection::vec(any::<f32>(), 0..200),
        enc in encoding(),
        residual in prop::option::of(prop::collection::vec(any::<f32>(), 0..250)),
    ) {
        let mut residual = residual;
        let t = encode("t", &[x.len() as u32], &x, enc, residual.as_mut());
        prop_assert_eq!(decode(&t).map(|v| v.len()), Ok(x.len()));
        if let Some(r) = residual {
            // Exact f32 leaves an empty residual (all zeros); the others one per value.
            let want = if enc == Encoding::F32 { 0 } else { x.len() };
            prop_assert_eq!(r.len(), want);
            prop_assert!(r.iter().all(|e| e.is_finite()));
        }
    }

    #[test]
    fn reassembler_stays_within_its_memory_limit(
        sizes in prop::collection::vec(0..300usize, 1..4),
        max_chunk in 1..64usize,
        limit in 0..1200usize,
        steps in prop::collection::vec(step(), 0..120),
    ) {
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(p, &n)| (0..n).map(|i| (i * 7 + p * 13) as u8).collect())
            .collect();
        let sets: Vec<Vec<Chunk>> = payloads.iter().map(|p| split(p, max_chunk)).collect();
        let mut r = Reassembler::new(250, limit);
        let mut now = 0u64;
        for s in steps {
            match s {
                Step::Deliver { payload, chunk, edit, noise } => {
                    let set = &sets[payload % sets.len()];
                    let mut c = set[chunk % set.len()].clone();
                    edit_chunk(&mut c, edit, noise);
                    let hash = c.payload_hash;
                    if let Ok(Some(p)) = r.insert(c.as_ref(), now) {
                        prop_assert!(payloads.contains(&p));
                        prop_assert_eq!(payload_hash(&p), hash);
                    }
                    if let Some(missing) = r.missing(&hash) {
                        prop_assert!(!missing.is_empty());
                    }
                }
                Step::Wait(ms) => {
                    now += ms;
                    r.expire(now);
                }
            }
            prop_assert!(r.pending_bytes() <= limit);
            prop_assert!(r.pending_sets() <= r.pending_bytes());
        }
        r.expire(now + 251);
        prop_assert_eq!(r.pending_bytes(), 0);
        prop_assert_eq!(r.pending_sets(), 0);
    }
}
