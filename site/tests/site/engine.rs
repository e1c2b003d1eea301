//! The site engine driven by scripted messages: no broker, no model, no clock.

use crate::common;

use common::*;
use unifed_protocol::auth::Keyring;
use unifed_protocol::chunking::{payload_hash, split};
use unifed_protocol::envelope::{Envelope, MessageKind, PROTOCOL_VERSION};
use unifed_protocol::messages::{
    Answer, Chunk, ChunkRequest, Download, Payload, RejectReason, RoundManifest, UpdateAnswer,
    UpdateReceipt,
};
use unifed_site::{Action, Event, Progress, SiteEngine};

#[test]
fn a_site_holding_the_base_version_fetches_the_delta_and_falls_back_to_the_whole_model() {
    let progress = Progress {
        applied_version: Some(2),
        answered_rounds: vec![2],
        ..Default::default()
    };
    let mut e = engine(Some(progress));
    let (m, chunks, delta_chunks) = with_delta(3, 3);
    let req = request(&e.handle(manifest_msg(&m), 0));
    assert_eq!(req.payload, Payload::Delta);
    assert_eq!(req.indices.len(), delta_chunks.len());
    // The whole model's chunks are not what it fetches: ignored.
    assert!(deliver(&mut e, &m, &chunks).is_empty());
    let acts = deliver(&mut e, &m, &delta_chunks);
    let [
        Action::Apply {
            download, bytes, ..
        },
    ] = &acts[..]
    else {
        panic!("{acts:?}")
    };
    let Ok(Download::Delta(d)) = download.read() else {
        panic!("{download:?}")
    };
    assert_eq!((d.from_version, d.model_version), (2, 3));
    assert_eq!(download.bytes().len() as u64, *bytes);
    assert_eq!(*bytes, m.delta.unwrap().payload_len);
    // The driver cannot apply it (say its held model was lost): the whole model comes next.
    let acts = e.handle(
        Event::ApplyFailed {
            version: 3,
            error: "no held model".into(),
        },
        2,
    );
    let req = request(&acts);
    assert_eq!(req.payload, Payload::Model);
    assert_eq!(req.indices, (0..chunks.len() as u32).collect::<Vec<_>>());
    let acts = deliver(&mut e, &m, &chunks);
    assert!(
        matches!(&acts[..], [Action::Apply { download, .. }]
            if matches!(download.read(), Ok(Download::Model(b)) if b.model_version == 3)),
        "{acts:?}"
    );
}

#[test]
fn a_site_behind_or_new_fetches_the_whole_model_even_when_a_delta_is_offered() {
    for progress in [
        None,
        Some(Progress {
            applied_version: Some(1),
            answered_rounds: vec![1],
            ..Default::default()
        }),
    ] {
        let mut e = engine(progress);
        let (m, chunks, _) = with_delta(3, 3);
        let req = request(&e.handle(manifest_msg(&m), 0));
        assert_eq!(req.payload, Payload::Model);
        assert_eq!(req.indices.len(), chunks.len());
    }
}

#[test]
fn a_manifest_whose_delta_does_not_fit_is_dropped() {
    let mut e = engine(None);
    let (mut m, _, _) = with_delta(3, 3);
    m.delta.as_mut().unwrap().from_version = 3;
    assert!(e.handle(manifest_msg(&m), 0).is_empty());
    assert!(e.manifest().is_none());
}

#[test]
fn a_fetch_asks_for_more_once_half_its_window_arrived_and_never_for_a_chunk_twice() {
    let mut e = engine(None);
    // 1-byte chunks: far more than one window (64 chunks at most).
    let (m, chunks) = model_cut(1, 0, &[], 1);
    assert!(chunks.len() > 128, "{}", chunks.len());
    let first = request(&e.handle(manifest_msg(&m), 0));
    assert_eq!(first.indices, (0..64).collect::<Vec<u32>>());
    let mut asked: Vec<u32> = first.indices.clone();
    let mut next = 0usize;
    let mut applied = false;
    // Deliver what was asked, in order; each time half a window is left, more is asked for.
    while next < chunks.len() {
        let acts = e.handle(chunk_msg(&m, &chunks[next]), 1);
        next += 1;
        match &acts[..] {
            [] => {}
            [Action::Apply { .. }] => applied = true,
            _ => {
                let more = request(&acts);
                // Exactly enough to fill the window again: half of it, the next in line.
                assert_eq!(asked.len() - next, 32, "{acts:?}");
                let from = *asked.last().unwrap() + 1;
                let want: Vec<u32> = (from..(from + 32).min(chunks.len() as u32)).collect();
                assert_eq!(more.indices, want);
                asked.extend(more.indices);
            }
        }
        assert!(next <= asked.len(), "chunk {next} arrived unasked");
    }
    assert!(applied);
    // Every chunk was asked for once.
    assert_eq!(asked, (0..chunks.len() as u32).collect::<Vec<_>>());
}

#[test]
fn chunks_sent_for_every_site_complete_a_fetch_and_are_not_asked_for_again() {
    let mut e = engine(None);
    assert!(e.subscriptions().contains(&topics().model_chunks()));
    let (m, chunks) = model_cut(1, 0, &[], 1);
    let shared = |c: &Chunk| {
        msg(
            topics().model_chunks(),
            agg(MessageKind::ModelChunk, m.round, m.model_version, c),
        )
    };
    // A chunk of a model the site does not follow yet (it overtook the manifest) is dropped.
    assert!(e.handle(shared(&chunks[0]), 0).is_empty());
    let first = request(&e.handle(manifest_msg(&m), 0));
    assert_eq!(first.indices, (0..64).collect::<Vec<u32>>());
    // Another site's requests shared the next windows before this one asked for them: when
    // half its window is in, it asks only for what it still lacks.
    for c in &chunks[64..128] {
        assert!(e.handle(shared(c), 1).is_empty());
    }
    let mut asked = Vec::new();
    for c in &chunks[..32] {
        for a in e.handle(shared(c), 1) {
            asked.extend(request(&[a]).indices);
        }
    }
    assert_eq!(asked, (128..160).collect::<Vec<u32>>());
    // The rest arrives shared and on the site's own topic, some twice; the model is applied
    // once.
    let mut applied = 0;
    for (i, c) in chunks.iter().enumerate().skip(32) {
        let ev = if i % 2 == 0 {
            shared(c)
        } else {
            chunk_msg(&m, c)
        };
        let acts = e.handle(ev, 2);
        applied += acts
            .iter()
            .filter(|a| matches!(a, Action::Apply { .. }))
            .count();
        if i == 40 {
            assert!(e.handle(shared(c), 2).is_empty(), "a chunk had twice");
        }
    }
    assert_eq!(applied, 1);
}

#[test]
fn a_site_ignores_the_chunks_of_a_model_it_does_not_fetch_and_only_those() {
    let mut e = engine(None);
    let (m, chunks) = model_cut(1, 0, &[], 1);
    let (m2, chunks2) = model_cut(2, 1, &[], 1);
    let shared = |m: &RoundManifest, c: &Chunk| {
        (
            topics().model_chunks(),
            agg(MessageKind::ModelChunk, m.round, m.model_version, c),
        )
    };
    // No model announced yet: any chunk is dropped.
    let (t, p) = shared(&m, &chunks[0]);
    assert!(e.ignores(&t, &p));
    e.handle(manifest_msg(&m), 0);
    // The model it fetches is wanted, shared or sent to it alone; another payload is not.
    assert!(!e.ignores(&t, &p));
    let own = topics().chunk_reply(&id("a"));
    assert!(!e.ignores(&own, &p));
    let (t2, p2) = shared(&m2, &chunks2[0]);
    assert!(e.ignores(&t2, &p2));
    // Neither a manifest, nor a chunk that fails the envelope's checks (signed by another
    // key), nor bytes that are no envelope: `handle` checks and reports those.
    let manifest = agg(MessageKind::RoundManifest, m.round, m.model_version, &m);
    assert!(!e.ignores(&topics().manifest(), &manifest));
    let forged = from("mallory", "fed", MessageKind::ModelChunk, 1, 0, &chunks2[0]);
    assert!(!e.ignores(&t, &forged));
    assert!(!e.ignores(&t, b"not an envelope"));
    // Once the model is in (being applied, then applied), its chunks are dropped too.
    let acts = deliver(&mut e, &m, &chunks);
    assert!(acts.iter().any(|a| matches!(a, Action::Apply { .. })));
    assert!(e.ignores(&t, &p));
    e.handle(Event::Applied { version: 0 }, 2);
    assert!(e.ignores(&t, &p));
    // What `ignores` says is what `handle` does: nothing.
    assert!(e.handle(msg(t.clone(), p.clone()), 3).is_empty());
}

#[test]
fn after_a_reconnect_or_a_silence_a_site_asks_for_its_own_copies() {
    let mut e = engine(None);
    let (m, chunks) = model_cut(1, 0, &[], 1);
    let first = request(&e.handle(manifest_msg(&m), 0));
    assert!(!first.alone, "a first request listens to what is shared");
    // The connection dropped: chunks shared meanwhile were missed.
    let again = request(&e.handle(Event::Connected, 10));
    assert_eq!(again.indices, first.indices);
    assert!(again.alone);
    // The next window is asked for as usual.
    let mut next = Vec::new();
    for c in &chunks[..32] {
        next.extend(e.handle(chunk_msg(&m, c), 20));
    }
    assert!(!request(&next).alone);
    // Nothing came for longer than the retry time: what is missing is asked for alone.
    let late = request(&e.handle(Event::Tick, 20 + unifed_site::engine::FETCH_RETRY_MS + 1));
    assert!(late.alone);
    assert_eq!(late.indices[0], 32);
}

#[test]
fn a_new_site_fetches_applies_trains_uploads_and_checkpoints_on_its_answer() {
    let mut e = engine(None);
    let (m, chunks) = model(1, 0, &[]);
    let acts = e.handle(manifest_msg(&m), 0);
    let [Action::Publish { topic, payload }] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(topic, &topics().chunk_request(&id("a")));
    let req: ChunkRequest = Envelope::decode(payload).unwrap().payload_as().unwrap();
    assert_eq!(req.indices, (0..chunks.len() as u32).collect::<Vec<_>>());
    let acts = deliver(&mut e, &m, &chunks);
    let [
        Action::Apply {
            download,
            joining: false,
            ..
        },
    ] = &acts[..]
    else {
        panic!("{acts:?}")
    };
    let Ok(Download::Model(broadcast)) = download.read() else {
        panic!("{download:?}")
    };
    assert_eq!(broadcast.model_version, 0);
    // Trained from at once: checkpointed with the round's outcome, on the answer.
    let acts = e.handle(Event::Applied { version: 0 }, 2);
    assert!(matches!(&acts[..], [Action::Train { manifest }] if manifest.round == 1));
    assert_eq!(e.progress().applied_version, Some(0));
    let acts = e.handle(
        Event::Trained {
            round: 1,
            update: update_envelope(),
        },
        3,
    );
    let signed = key("a").sign(&Envelope::decode(&update_envelope()).unwrap());
    let n = signed.len() as u64;
    assert!(
        matches!(&acts[..], [Action::Uploading { round: 1, bytes, messages: 1 }, Action::Publish { topic, payload }] if *bytes == n && topic == &topics().update(&id("a")) && payload == &signed)
    );
    // What the site sends is signed by its key.
    assert!(
        Keyring::single(id("a"), key("a").public())
            .open(&signed, 1 << 16)
            .is_ok()
    );
    // Unanswered: sent again after the re-send interval, not before.
    assert!(e.handle(Event::Tick, 5_000).is_empty());
    assert_eq!(e.handle(Event::Tick, 10_004).len(), 1);
    // An answer to other bytes (someone's garbage on this site's topic) is not this update's.
    let other = UpdateAnswer {
        round: 1,
        update_hash: payload_hash(b"garbage"),
        answer: Answer::Rejected(RejectReason::NoSamples),
    };
    let acts = e.handle(
        msg(
            topics().ack(&id("a")),
            agg(MessageKind::UpdateAnswer, 1, 0, &other),
        ),
        10_005,
    );
    assert!(acts.is_empty(), "{acts:?}");
    let answer = UpdateAnswer {
        round: 1,
        update_hash: payload_hash(&signed),
        answer: Answer::Rejected(RejectReason::NoSamples),
    };
    let acts = e.handle(
        msg(
            topics().ack(&id("a")),
            agg(MessageKind::UpdateAnswer, 1, 0, &answer),
        ),
        10_005,
    );
    assert_eq!(
        acts,
        vec![
            Action::Answered {
                round: 1,
                answer: answer.answer.clone()
            },
            Action::Checkpoint
        ]
    );
    assert_eq!(e.progress().answered_rounds, vec![1]);
    // Answered: nothing more to do in round 1.
    assert!(e.handle(Event::Tick, 20_000).is_empty());
}

/// The chunk indices of the update chunks among `acts`.
fn chunk_indices(acts: &[Action]) -> Vec<u32> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Publish { payload, .. } => {
                let env = Envelope::decode(payload).unwrap();
                assert_eq!(env.kind, MessageKind::UpdateChunk);
                Some(env.payload_as::<Chunk>().unwrap().index)
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_chunked_update_keeps_the_manifests_upload_window_in_flight() {
    // 1.5 MB: 25 chunks of about 61 KB under the engine's 64 KiB packets.
    let update = Envelope::new(
        MessageKind::SiteUpdate,
        id("fed"),
        id("a"),
        1,
        0,
        HASH,
        &vec![9u8; 1_500_000],
    )
    .encode();
    let signed = key("a").sign(&Envelope::decode(&update).unwrap());
    // (announced window, chunks in flight): at least one chunk, however small the window.
    for (window, in_flight) in [(0u32, 1usize), (200_000, 3), (130_000, 2)] {
        let (mut m, chunks) = model(1, 0, &[]);
        m.upload_window_bytes = window;
        let (mut e, acts) = trained_round_one(&m, &chunks, update.clone());
        let [Action::Uploading { messages, .. }, ..] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(*messages, 25);
        let sent = chunk_indices(&acts[1..]);
        assert_eq!(sent, (0..in_flight as u32).collect::<Vec<_>>(), "{window}");
        // Nothing more until a receipt frees a place in the window.
        assert!(e.handle(Event::Tick, 4).is_empty());
        let receipt = UpdateReceipt {
            round: 1,
            payload_hash: payload_hash(&signed),
            index: 0,
        };
        // The receipt of chunk 0 lets exactly the next one go.
        let acts = e.handle(
            msg(
                topics().ack(&id("a")),
                agg(MessageKind::UpdateReceipt, 1, 0, &receipt),
            ),
            5,
        );
        assert_eq!(chunk_indices(&acts), vec![in_flight as u32]);
        assert!(e.handle(Event::Tick, 6).is_empty());
    }
}

/// Chunks are cut and signed as they are sent: each is byte for byte the signed envelope of
/// the chunk `split` cuts, however many times it is sent.
#[test]
fn every_chunk_sent_is_the_signed_envelope_of_the_cut() {
    let update: Vec<u8> = (0..1_500_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let max_packet = 64 << 10;
    let mut up = unifed_site::Upload::new(
        (&id("fed"), &id("a"), HASH),
        &key("a"),
        (Default::default(), 3, 2),
        update.clone(),
        max_packet,
        usize::MAX,
    );
    let cut = split(&update, max_packet - 4096 - 512);
    assert_eq!((up.messages(), up.len()), (cut.len(), update.len()));
    assert_eq!(up.hash(), payload_hash(&update));
    let expected: Vec<Vec<u8>> = cut
        .iter()
        .map(|c| {
            key("a").sign(&Envelope::new(
                MessageKind::UpdateChunk,
                id("fed"),
                id("a"),
                3,
                2,
                HASH,
                c,
            ))
        })
        .collect();
    assert_eq!(up.pump(0, 60_000), expected);
    // Without receipts, every chunk goes again after the timeout: the same bytes.
    let again = up.pump(unifed_site::upload::CHUNK_TIMEOUT_MS + 1, 60_000);
    assert_eq!(again, expected);
}

#[test]
fn bad_input_on_every_topic_is_dropped_and_changes_nothing() {
    let mut e = engine(None);
    let (m, chunks) = model(1, 0, &[]);
    e.handle(manifest_msg(&m), 0);
    let good = agg(MessageKind::RoundManifest, 1, 0, &m);
    let mut other_version = good.clone();
    other_version[4..6].copy_from_slice(&(PROTOCOL_VERSION - 1).to_le_bytes());
    let mut garbage_payload = Envelope::decode(&good).unwrap();
    garbage_payload.payload = vec![0xff; 40];
    let (bigger, _) = model(2, 1, &[]);
    let mut wrong_count = chunks[0].clone();
    wrong_count.count += 1;
    let mut wrong_len = chunks[0].clone();
    wrong_len.total_len += 1;
    let mut liar = m.clone();
    liar.payload_len = 1 << 30; // more than the site accepts
    let mut bad_plan = m.clone();
    bad_plan.round = 2;
    bad_plan.plan.objective = unifed_protocol::Objective::Proximal { mu: f64::NAN };
    let junk: Vec<Vec<u8>> = vec![
        vec![],
        vec![0x42; 3],
        (0..200u32).map(|i| (i * 37 % 251) as u8).collect(),
        good[..good.len() / 2].to_vec(),
        garbage_payload.encode(),
        other_version,
        from(
            "aggregator",
            "other-fed",
            MessageKind::RoundManifest,
            2,
            1,
            &bigger,
        ),
        from("mallory", "fed", MessageKind::RoundManifest, 2, 1, &bigger),
        // Claims to be the aggregator, signed by another key; unsigned; signed for another
        // round than it names.
        key("mallory").sign(&Envelope::new(
            MessageKind::RoundManifest,
            id("fed"),
            id("aggregator"),
            2,
            1,
            HASH,
            &bigger,
        )),
        Envelope::new(
            MessageKind::RoundManifest,
            id("fed"),
            id("aggregator"),
            2,
            1,
            HASH,
            &bigger,
        )
        .encode(),
        {
            let mut moved =
                Envelope::decode(&agg(MessageKind::RoundManifest, 2, 1, &bigger)).unwrap();
            moved.round = 3;
            moved.encode()
        },
        agg(MessageKind::RoundManifest, 2, 1, &liar),
        agg(MessageKind::RoundManifest, 2, 1, &bad_plan),
        agg(MessageKind::ModelChunk, 1, 0, &chunks[0]),
        agg(
            MessageKind::UpdateAnswer,
            1,
            0,
            &UpdateAnswer {
                round: 1,
                update_hash: [0; 32],
                answer: Answer::Accepted,
            },
        ),
    ];
    for topic in [
        topics().manifest(),
        topics().chunk_reply(&id("a")),
        topics().ack(&id("a")),
        "unifed/v1/fed/elsewhere".to_string(),
    ] {
        for j in &junk {
            let acts = e.handle(msg(topic.clone(), j.clone()), 1);
            assert!(
                acts.iter().all(|a| matches!(a, Action::Publish { .. })),
                "{topic}: {acts:?}"
            );
            assert_eq!(e.manifest(), Some(&m), "{topic}");
        }
    }
    for c in [wrong_count, wrong_len] {
        assert!(e.handle(chunk_msg(&m, &c), 1).is_empty());
    }
    // The real chunks still give the real model, and the site trains as if nothing happened.
    let acts = deliver(&mut e, &m, &chunks);
    assert!(matches!(&acts[..], [Action::Apply { download, .. }]
            if matches!(download.read(), Ok(Download::Model(b)) if b.weights[0].name == "fc.weight")));
    assert!(e.progress().answered_rounds.is_empty());
}

#[test]
fn a_site_not_sampled_applies_the_model_but_does_not_train() {
    let (m, chunks) = model(1, 0, &["b", "c"]);
    let (mut e, _) = fetched(&m, &chunks);
    let acts = e.handle(Event::Applied { version: 0 }, 1);
    assert_eq!(acts, vec![Action::Checkpoint]);
}

#[test]
fn a_resumed_site_neither_refetches_its_model_nor_retrains_an_answered_round() {
    let progress = Progress {
        applied_version: Some(0),
        answered_rounds: vec![1],
        ..Default::default()
    };
    let mut e = engine(Some(progress));
    let (m, _) = model(1, 0, &[]);
    assert!(e.handle(manifest_msg(&m), 0).is_empty());
    // The next round trains from the model it holds; a late model would not make it a joiner.
    let (m2, chunks2) = model(2, 1, &[]);
    e.handle(manifest_msg(&m2), 1);
    let acts = deliver(&mut e, &m2, &chunks2);
    assert!(matches!(&acts[..], [Action::Apply { joining: false, .. }]));
}

#[test]
fn a_new_site_whose_first_model_is_past_version_zero_is_a_joiner() {
    let (m, chunks) = model(3, 2, &[]);
    let (_, acts) = fetched(&m, &chunks);
    assert!(matches!(&acts[..], [Action::Apply { joining: true, .. }]));
}

#[test]
fn an_older_manifest_is_not_followed() {
    let mut e = engine(None);
    let (m2, _) = model(2, 1, &[]);
    let (m1, _) = model(1, 0, &[]);
    e.handle(manifest_msg(&m2), 0);
    assert!(e.handle(manifest_msg(&m1), 1).is_empty());
    assert_eq!(e.manifest(), Some(&m2));
}

#[test]
fn a_round_whose_training_failed_is_not_trained_again_and_the_next_one_is() {
    let (m, chunks) = model(1, 0, &[]);
    let (mut e, _) = fetched(&m, &chunks);
    let acts = e.handle(Event::Applied { version: 0 }, 1);
    assert!(matches!(&acts[..], [Action::Train { .. }]));
    let acts = e.handle(
        Event::TrainFailed {
            round: 1,
            error: "training diverged".into(),
        },
        2,
    );
    assert!(acts.is_empty(), "{acts:?}");
    // The same manifest again (re-published) and time passing train nothing.
    assert!(e.handle(manifest_msg(&m), 3).is_empty());
    assert!(e.handle(Event::Tick, 60_000).is_empty());
    // The next round, on a new model, trains.
    let (m2, chunks2) = model(2, 1, &[]);
    e.handle(manifest_msg(&m2), 60_001);
    deliver(&mut e, &m2, &chunks2);
    let acts = e.handle(Event::Applied { version: 1 }, 60_002);
    assert!(
        matches!(&acts[..], [Action::Train { manifest }] if manifest.round == 2),
        "{acts:?}"
    );
}

/// An engine that has fetched model v0 by the round-1 manifest `m` and trained `update`; returns
/// the engine and what it did on the update.
fn trained_round_one(
    m: &RoundManifest,
    chunks: &[Chunk],
    update: Vec<u8>,
) -> (SiteEngine, Vec<Action>) {
    let mut e = engine(None);
    e.handle(manifest_msg(m), 0);
    deliver(&mut e, m, chunks);
    e.handle(Event::Applied { version: 0 }, 1);
    let acts = e.handle(Event::Trained { round: 1, update }, 2);
    (e, acts)
}

/// An engine that has fetched model v0, trained round 1 and sent its update; returns the
/// engine and the update's bytes.
fn sent_round_one() -> (SiteEngine, Vec<u8>) {
    let (m, chunks) = model(1, 0, &[]);
    let (e, acts) = trained_round_one(&m, &chunks, update_envelope());
    let Some(Action::Publish { payload: sent, .. }) = acts.last() else {
        panic!("{acts:?}")
    };
    let sent = sent.clone();
    (e, sent)
}

/// The aggregator's answer to the update of `round` with hash `update_hash`.
fn answer(round: u64, update_hash: [u8; 32], answer: Answer) -> Event {
    msg(
        topics().ack(&id("a")),
        agg(
            MessageKind::UpdateAnswer,
            round,
            0,
            &UpdateAnswer {
                round,
                update_hash,
                answer,
            },
        ),
    )
}

/// True when `acts` send no update.
fn sends_no_update(acts: &[Action]) -> bool {
    acts.iter()
        .all(|a| !matches!(a, Action::Publish { topic, .. } if topic == &topics().update(&id("a"))))
}

#[test]
fn a_resend_answer_sends_the_accepted_update_again_until_its_round_closes() {
    let (mut e, sent) = sent_round_one();
    e.handle(answer(1, payload_hash(&sent), Answer::Accepted), 3);
    assert_eq!(e.progress().answered_rounds, vec![1]);
    // Another round's resend is not this update's; this round's sends the same bytes again.
    assert!(e.handle(answer(2, [0; 32], Answer::Resend), 4).is_empty());
    let acts = e.handle(answer(1, [0; 32], Answer::Resend), 5);
    assert_eq!(
        acts,
        vec![Action::Publish {
            topic: topics().update(&id("a")),
            payload: sent.clone()
        }]
    );
    assert!(e.progress().answered_rounds.is_empty());
    let acts = e.handle(answer(1, payload_hash(&sent), Answer::Accepted), 6);
    assert!(matches!(
        &acts[..],
        [Action::Answered { round: 1, .. }, Action::Checkpoint]
    ));
    // Once the next round opens (before its model is fetched), the update is let go: a late
    // resend of round 1 finds nothing to send and leaves round 1 answered.
    let (m2, _) = model(2, 1, &[]);
    e.handle(manifest_msg(&m2), 7);
    let acts = e.handle(answer(1, [0; 32], Answer::Resend), 8);
    assert!(sends_no_update(&acts), "{acts:?}");
    assert_eq!(e.progress().answered_rounds, vec![1]);
}

#[test]
fn the_final_manifest_lets_the_delivered_update_go() {
    let (mut e, sent) = sent_round_one();
    e.handle(answer(1, payload_hash(&sent), Answer::Accepted), 3);
    // The federation ends with round 1: its manifest keeps the round number, and finishes.
    let (mut last, _) = model(1, 1, &[]);
    last.finished = true;
    e.handle(manifest_msg(&last), 4);
    let acts = e.handle(answer(1, [0; 32], Answer::Resend), 5);
    assert!(sends_no_update(&acts), "{acts:?}");
    assert_eq!(e.progress().answered_rounds, vec![1]);
}

#[test]
fn the_final_model_is_checkpointed_before_the_site_finishes() {
    // The federation's last model: nothing trains from it, so it is persisted when applied.
    let (mut m, chunks) = model(3, 3, &[]);
    m.finished = true;
    let (mut e, _) = fetched(&m, &chunks);
    let acts = e.handle(Event::Applied { version: 3 }, 1);
    assert!(
        matches!(&acts[..], [Action::Checkpoint, Action::Finished { manifest }] if manifest.model_version == 3),
        "{acts:?}"
    );
    assert_eq!(e.progress().applied_version, Some(3));
}

#[test]
fn a_model_overtaken_while_applied_is_checkpointed_and_the_newer_one_fetched() {
    let (m1, chunks1) = model(1, 0, &[]);
    let (mut e, _) = fetched(&m1, &chunks1);
    // Model v1 is announced while v0 is being applied: v0 is not trained from.
    let (m2, _) = model(2, 1, &[]);
    e.handle(manifest_msg(&m2), 1);
    let acts = e.handle(Event::Applied { version: 0 }, 2);
    let [Action::Checkpoint, Action::Publish { topic, payload }] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(topic, &topics().chunk_request(&id("a")));
    let req: ChunkRequest = Envelope::decode(payload).unwrap().payload_as().unwrap();
    assert_eq!(req.model_version, 1);
    // Nothing more to persist until something changes.
    assert!(
        e.handle(Event::Tick, 3)
            .iter()
            .all(|a| !matches!(a, Action::Checkpoint))
    );
}

/// True when `acts` send `sent` on the site's update topic.
fn sends(acts: &[Action], sent: &[u8]) -> bool {
    acts.iter().any(|a| {
        matches!(a, Action::Publish { topic, payload }
            if topic == &topics().update(&id("a")) && payload == sent)
    })
}

/// True when `acts` train `round`.
fn trains(acts: &[Action], round: u64) -> bool {
    acts.iter()
        .any(|a| matches!(a, Action::Train { manifest } if manifest.round == round))
}

/// An engine whose round-1 update is unanswered when round 2 opens and its model (v1) is
/// applied; the actions of the apply, and the update's bytes.
fn round_closed_unanswered() -> (SiteEngine, Vec<Action>, Vec<u8>) {
    let (mut e, sent) = sent_round_one();
    let (m2, chunks2) = model(2, 1, &[]);
    e.handle(manifest_msg(&m2), 3);
    deliver(&mut e, &m2, &chunks2);
    let acts = e.handle(Event::Applied { version: 1 }, 4);
    (e, acts, sent)
}

#[test]
fn an_update_whose_round_closed_unanswered_is_asked_about_before_the_next_round_trains() {
    // An aggregator that crashed after it spooled the update and before it answered folds it
    // after its restart: the answer settles the site's residual and variates.
    let (mut e, acts, sent) = round_closed_unanswered();
    assert!(sends(&acts, &sent), "{acts:?}");
    assert!(!trains(&acts, 2), "{acts:?}");
    assert!(!trains(&e.handle(Event::Tick, 5), 2));
    // The aggregator's record of round 1: accepted. Settled, then round 2 trains.
    let mut acts = e.handle(answer(1, payload_hash(&sent), Answer::Accepted), 6);
    assert!(
        matches!(
            &acts[..],
            [
                Action::Answered {
                    round: 1,
                    answer: Answer::Accepted
                },
                Action::Checkpoint,
                ..
            ]
        ),
        "{acts:?}"
    );
    assert_eq!(e.progress().answered_rounds, vec![1]);
    acts.extend(e.handle(Event::Tick, 7));
    assert!(trains(&acts, 2), "{acts:?}");
}

#[test]
fn an_unanswered_update_of_a_closed_round_is_let_go_after_three_resend_periods() {
    let (mut e, _, sent) = round_closed_unanswered();
    // Asked again once a re-send period has passed, and nothing trains ...
    let acts = e.handle(Event::Tick, 4 + 10_001);
    assert!(sends(&acts, &sent) && !trains(&acts, 2), "{acts:?}");
    assert!(!trains(&e.handle(Event::Tick, 4 + 30_000), 2));
    // ... until three have passed: the update is moot, round 2 trains, round 1 stays
    // unanswered.
    let acts = e.handle(Event::Tick, 4 + 30_001);
    assert!(trains(&acts, 2), "{acts:?}");
    assert!(e.progress().answered_rounds.is_empty());
}

/// Fuzzing of what the aggregator's key can make a site decode: 4,000 messages signed by the
/// pinned aggregator on the site's topics (manifests, model chunks, answers and receipts), each
/// a valid one with random bytes of its payload flipped, set, cut or inserted (a fixed-seed
/// generator, so a failure replays). The engine must take every one without a panic, and a
/// site fed all of them still fetches and applies a valid model announced after them.
#[test]
fn signed_mutations_of_every_message_a_site_reads_never_stop_it() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (m, chunks) = model(1, 0, &[]);
    let answer = UpdateAnswer {
        round: 1,
        update_hash: [7; 32],
        answer: Answer::Rejected(RejectReason::NoSamples),
    };
    let receipt = UpdateReceipt {
        round: 1,
        payload_hash: [7; 32],
        index: 0,
    };
    let t = topics();
    let bases: Vec<(String, MessageKind, Vec<u8>)> = vec![
        (
            t.manifest(),
            MessageKind::RoundManifest,
            postcard::to_allocvec(&m).unwrap(),
        ),
        (
            t.chunk_reply(&id("a")),
            MessageKind::ModelChunk,
            postcard::to_allocvec(&chunks[0]).unwrap(),
        ),
        (
            t.model_chunks(),
            MessageKind::ModelChunk,
            postcard::to_allocvec(&chunks[1]).unwrap(),
        ),
        (
            t.ack(&id("a")),
            MessageKind::UpdateAnswer,
            postcard::to_allocvec(&answer).unwrap(),
        ),
        (
            t.ack(&id("a")),
            MessageKind::UpdateReceipt,
            postcard::to_allocvec(&receipt).unwrap(),
        ),
    ];
    let mut e = engine(None);
    for i in 0..4_000u64 {
        let (topic, kind, base) = &bases[(next() % bases.len() as u64) as usize];
        let mut p = base.clone();
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
        let mut env = Envelope::new(*kind, id("fed"), id("aggregator"), 1, 0, HASH, &());
        env.payload = p;
        e.handle(msg(topic.clone(), key("aggregator").sign(&env)), i);
        e.handle(Event::Tick, i);
    }
    // A site that saw all of that, and a later model: it fetches and applies it.
    let (m, chunks) = model(u64::MAX - 1, u64::MAX - 1, &[]);
    e.handle(manifest_msg(&m), 10_000);
    let last = deliver(&mut e, &m, &chunks);
    assert!(
        last.iter().any(|a| matches!(a, Action::Apply { .. })),
        "{last:?}"
    );
}

/// Runs: a site that did something in one run of its federation reports a later run's
/// manifest once ([`Action::NewRun`]) and does not follow it, since its model, BN and algorithm
/// state are the earlier run's; a fresh engine following the later run (what the agent starts
/// after putting the old state aside) asks for the later run's model even at a lower round and
/// version, and from then on drops manifests of the earlier run, whatever round they name (a
/// replay of the earlier run's last manifest no longer wedges it). A site that did nothing yet
/// in its run moves to the later one as it is.
#[test]
fn a_later_run_is_reported_and_followed_afresh_and_an_earlier_one_is_dropped() {
    use unifed_protocol::RunId;
    // Not sampled: the site holds the model and trains nothing.
    let (m, chunks) = model(3, 2, &["b"]);
    let (mut e, _) = fetched(&m, &chunks);
    e.handle(Event::Applied { version: 2 }, 2);
    assert_eq!(e.progress().run, Some(m.run));
    let later = RunId {
        created_ms: 1_795_000_000_000,
        nonce: 1,
    };
    let (mut m1, _) = model(1, 0, &[]);
    m1.run = later;
    let signed = key("aggregator").sign(
        &Envelope::new(
            MessageKind::RoundManifest,
            id("fed"),
            id("aggregator"),
            1,
            0,
            HASH,
            &m1,
        )
        .in_run(later),
    );
    let acts = e.handle(msg(topics().manifest(), signed.clone()), 3);
    assert_eq!(
        acts,
        vec![Action::NewRun {
            from: m.run,
            to: later
        }]
    );
    assert_eq!(e.manifest().map(|m| m.run), Some(m.run), "not followed");
    assert_eq!(
        e.progress().applied_version,
        Some(2),
        "state kept for its owner"
    );
    // Reported once: the re-published manifest asks nothing more.
    assert!(
        e.handle(msg(topics().manifest(), signed.clone()), 4)
            .is_empty()
    );
    // A fresh site following the later run fetches its model, in that run.
    let mut fresh = engine(None).following(later);
    let acts = fresh.handle(msg(topics().manifest(), signed.clone()), 5);
    assert_eq!(fresh.manifest().map(|m| (m.run, m.round)), Some((later, 1)));
    let asked: Vec<RunId> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Publish { payload, .. } => Envelope::decode(payload).ok().map(|e| e.run),
            _ => None,
        })
        .collect();
    assert!(
        !asked.is_empty() && asked.iter().all(|r| *r == later),
        "{acts:?}"
    );
    // The earlier run's manifest, even of a later round, is dropped.
    let (old, _) = model(9, 8, &[]);
    fresh.handle(manifest_msg(&old), 6);
    assert_eq!(fresh.manifest().map(|m| (m.run, m.round)), Some((later, 1)));
    // A site that only heard of the earlier run (nothing applied) moves on as it is.
    let mut idle = engine(None);
    idle.handle(manifest_msg(&old), 7);
    assert_eq!(idle.manifest().map(|m| m.run), Some(old.run));
    let acts = idle.handle(msg(topics().manifest(), signed), 8);
    assert!(
        !acts.iter().any(|a| matches!(a, Action::NewRun { .. })),
        "{acts:?}"
    );
    assert_eq!(idle.manifest().map(|m| (m.run, m.round)), Some((later, 1)));
    assert_eq!(idle.progress().run, Some(later));
}
