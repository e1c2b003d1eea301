//! The site driver with a scripted worker and outbox: what it asks of the model side, in which
//! order, and what it sends, for a site that diverges, a late joiner, evaluations and failures.

use crate::common;

use common::*;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::messages::{Answer, BnPolicy, Chunk, Downloaded, RoundManifest, UpdateAnswer};
use unifed_site::driver::{BoxError, Step};
use unifed_site::{
    DriverConfig, Evaluate, Evaluation, Note, Outbox, Progress, SiteDriver, WorkError, Worker,
};

/// A worker that logs what it is asked, refuses training in `refuse` rounds and fails it in
/// `fail` rounds.
#[derive(Default)]
struct Scripted {
    log: Vec<String>,
    refuse: Vec<u64>,
    fail: Vec<u64>,
}

impl Worker for Scripted {
    fn apply(&mut self, m: &RoundManifest, download: Downloaded) -> Result<(), WorkError> {
        assert_eq!(download.model_version(), m.model_version);
        self.log.push(format!("apply v{}", m.model_version));
        Ok(())
    }

    fn join(&mut self, m: &RoundManifest) -> Result<usize, WorkError> {
        self.log.push(format!("join v{}", m.model_version));
        Ok(7)
    }

    fn evaluate(&mut self, m: &RoundManifest) -> Result<Evaluation, WorkError> {
        self.log.push(format!("evaluate v{}", m.model_version));
        Ok(Evaluation {
            version: m.model_version,
            accuracy: 0.25 * m.model_version as f64,
            loss: 1.0,
            validation: None,
            train_loss: None,
            seconds: 0.0,
        })
    }

    fn train(&mut self, m: &RoundManifest, _after: bool) -> Result<Vec<u8>, WorkError> {
        self.log.push(format!("train r{}", m.round));
        if self.refuse.contains(&m.round) {
            return Err(WorkError::Refused("training diverged".into()));
        }
        if self.fail.contains(&m.round) {
            return Err(WorkError::failed("the disk is full"));
        }
        Ok(Envelope::new(
            MessageKind::SiteUpdate,
            id("fed"),
            id("a"),
            m.round,
            m.model_version,
            HASH,
            &[m.round as u8],
        )
        .encode())
    }

    fn answered(&mut self, round: u64, accepted: bool) -> Result<(), WorkError> {
        self.log.push(format!("answered r{round} {accepted}"));
        Ok(())
    }

    fn checkpoint(&mut self, p: &Progress) -> Result<(), WorkError> {
        self.log.push(format!("checkpoint {:?}", p.applied_version));
        Ok(())
    }
}

/// An outbox that keeps what it is given.
#[derive(Default)]
struct Kept {
    sent: Vec<(String, Vec<u8>)>,
    notes: Vec<Note>,
    /// Rounds whose update [`round`] has answered.
    answered: Vec<u64>,
}

impl Outbox for Kept {
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError> {
        self.sent.push((topic, payload));
        Ok(())
    }

    fn note(&mut self, note: Note) {
        self.notes.push(note);
    }
}

impl Kept {
    /// The last update sent, if its round closes with the manifest of `round` (`finished`)
    /// and it has not been answered yet (each is answered once).
    fn unanswered(&mut self, round: u64, finished: bool) -> Option<Vec<u8>> {
        let (_, update) = self
            .sent
            .iter()
            .rev()
            .find(|(t, _)| *t == topics().update(&id("a")))?;
        let r = Envelope::decode(update).unwrap().round;
        if (r < round || (r == round && finished)) && !self.answered.contains(&r) {
            self.answered.push(r);
            return Some(update.clone());
        }
        None
    }

    /// The rounds of the updates sent.
    fn updates(&self) -> Vec<u64> {
        self.sent
            .iter()
            .filter(|(t, _)| *t == topics().update(&id("a")))
            .map(|(_, p)| Envelope::decode(p).unwrap().round)
            .collect()
    }
}

fn driver(progress: Option<Progress>, cfg: DriverConfig, w: Scripted) -> SiteDriver<Scripted> {
    SiteDriver::new(engine(progress), w, cfg)
}

const PLAIN: DriverConfig = DriverConfig {
    evaluate: Evaluate::Final,
    calibrate_joiners: true,
};

/// Announces `m` and delivers its chunks; the last handle's outcome.
fn round(
    d: &mut SiteDriver<Scripted>,
    out: &mut Kept,
    (m, chunks): &(RoundManifest, Vec<Chunk>),
) -> Result<Option<f64>, unifed_site::DriverError> {
    // The aggregator answers an update before it opens the next round (or finishes).
    if let Some(update) = out.unanswered(m.round, m.finished) {
        let env = Envelope::decode(&update).unwrap();
        let answer = UpdateAnswer {
            round: env.round,
            update_hash: unifed_protocol::chunking::payload_hash(&update),
            answer: Answer::Accepted,
        };
        let ack = msg(
            topics().ack(&id("a")),
            agg(MessageKind::UpdateAnswer, env.round, 0, &answer),
        );
        d.handle(ack, 0, out)?;
    }
    let mut last = d.handle(manifest_msg(m), 0, out);
    for c in chunks {
        last = d.handle(chunk_msg(m, c), 1, out);
    }
    last
}

#[test]
fn a_site_whose_training_diverges_sends_nothing_that_round_and_trains_the_next() {
    let w = Scripted {
        refuse: vec![1],
        ..Scripted::default()
    };
    let mut d = driver(None, PLAIN, w);
    let mut out = Kept::default();
    assert_eq!(round(&mut d, &mut out, &model(1, 0, &[])).unwrap(), None);
    assert!(out.updates().is_empty());
    assert!(out.notes.contains(&Note::TrainRefused {
        round: 1,
        error: "training diverged".into()
    }));
    round(&mut d, &mut out, &model(2, 1, &[])).unwrap();
    assert_eq!(out.updates(), vec![2]);
    assert_eq!(
        d.worker().log,
        ["apply v0", "train r1", "apply v1", "train r2"]
    );
}

#[test]
fn a_late_joiner_re_estimates_its_bn_before_it_trains_only_under_local_bn_when_configured() {
    for (bn, calibrate, resumed, joins) in [
        (BnPolicy::Local, true, false, true),
        (BnPolicy::Global, true, false, false),
        (BnPolicy::Local, false, false, false),
        (BnPolicy::Local, true, true, false),
    ] {
        let progress = resumed.then(|| Progress {
            applied_version: Some(1),
            answered_rounds: vec![1],
            ..Default::default()
        });
        let cfg = DriverConfig {
            calibrate_joiners: calibrate,
            ..PLAIN
        };
        let mut d = driver(progress, cfg, Scripted::default());
        let mut out = Kept::default();
        let (mut m, chunks) = model(3, 2, &[]);
        m.bn_policy = bn;
        round(&mut d, &mut out, &(m, chunks)).unwrap();
        let expected: &[&str] = if joins {
            &["apply v2", "join v2", "train r3"]
        } else {
            &["apply v2", "train r3"]
        };
        assert_eq!(d.worker().log, expected, "{bn:?} {calibrate} {resumed}");
        assert_eq!(
            out.notes.contains(&Note::Joined {
                version: 2,
                images: 7
            }),
            joins
        );
        assert_eq!(out.updates(), vec![3]);
    }
}

#[test]
fn every_trained_model_is_evaluated_before_the_site_trains_from_it_and_the_initial_one_is_not() {
    for (evaluate, expected) in [
        (
            Evaluate::EveryTrainedModel,
            &[
                "apply v0",
                "train r1",
                "answered r1 true",
                "checkpoint Some(0)",
                "apply v1",
                "evaluate v1",
                "train r2",
            ][..],
        ),
        (
            Evaluate::EveryModel,
            &[
                "apply v0",
                "evaluate v0",
                "train r1",
                "answered r1 true",
                "checkpoint Some(0)",
                "apply v1",
                "evaluate v1",
                "train r2",
            ][..],
        ),
    ] {
        let cfg = DriverConfig { evaluate, ..PLAIN };
        let mut d = driver(None, cfg, Scripted::default());
        let mut out = Kept::default();
        round(&mut d, &mut out, &model(1, 0, &[])).unwrap();
        round(&mut d, &mut out, &model(2, 1, &[])).unwrap();
        assert_eq!(d.worker().log, expected, "{evaluate:?}");
    }
}

#[test]
fn a_site_not_sampled_checkpoints_the_model_before_it_is_evaluated() {
    let cfg = DriverConfig {
        evaluate: Evaluate::EveryModel,
        ..PLAIN
    };
    let mut d = driver(None, cfg, Scripted::default());
    let mut out = Kept::default();
    round(&mut d, &mut out, &model(1, 0, &["b"])).unwrap();
    assert_eq!(
        d.worker().log,
        ["apply v0", "checkpoint Some(0)", "evaluate v0"]
    );
    assert!(out.updates().is_empty());
}

#[test]
fn an_answer_advances_the_worker_and_is_checkpointed_and_the_final_model_gives_the_accuracy() {
    let mut d = driver(None, PLAIN, Scripted::default());
    let mut out = Kept::default();
    round(&mut d, &mut out, &model(1, 0, &[])).unwrap();
    let (_, update) = out.sent.last().unwrap().clone();
    let answer = UpdateAnswer {
        round: 1,
        update_hash: unifed_protocol::chunking::payload_hash(&update),
        answer: Answer::Accepted,
    };
    let ack = msg(
        topics().ack(&id("a")),
        agg(MessageKind::UpdateAnswer, 1, 0, &answer),
    );
    assert_eq!(d.handle(ack, 2, &mut out).unwrap(), None);
    let (mut m, chunks) = model(2, 1, &[]);
    m.finished = true;
    assert_eq!(round(&mut d, &mut out, &(m, chunks)).unwrap(), Some(0.25));
    assert_eq!(
        d.worker().log,
        [
            "apply v0",
            "train r1",
            "answered r1 true",
            "checkpoint Some(0)",
            "apply v1",
            "checkpoint Some(1)",
            "evaluate v1"
        ]
    );
    assert!(out.notes.contains(&Note::Finished {
        version: 1,
        accuracy: 0.25
    }));
}

#[test]
fn a_failure_of_the_site_itself_stops_the_driver_naming_the_step_and_version() {
    let w = Scripted {
        fail: vec![1],
        ..Scripted::default()
    };
    let mut d = driver(None, PLAIN, w);
    let mut out = Kept::default();
    let e = round(&mut d, &mut out, &model(1, 0, &[])).unwrap_err();
    assert_eq!((e.step, e.version), (Step::Train, 0));
    assert_eq!(e.source.to_string(), "the disk is full");
    assert!(out.updates().is_empty());
}

#[test]
fn the_chunk_filter_drops_chunks_of_payloads_the_site_does_not_fetch_and_keeps_the_rest() {
    let (m, chunks) = model(1, 0, &[]);
    let (other, other_chunks) = model(1, 5, &[]);
    let mut e = engine(None);
    let topic = topics().chunk_reply(&id("a"));
    let chunk =
        |m: &RoundManifest, c: &Chunk| agg(MessageKind::ModelChunk, m.round, m.model_version, c);
    // No manifest yet: every chunk is of nothing the site fetches.
    assert!(e.chunk_filter().ignores(&topic, &chunk(&m, &chunks[0])));
    e.handle(manifest_msg(&m), 0);
    let f = e.chunk_filter();
    assert!(!f.ignores(&topic, &chunk(&m, &chunks[0])));
    assert!(f.ignores(&topic, &chunk(&other, &other_chunks[0])));
    // Not a chunk, or not signed by the aggregator: the engine must see it.
    assert!(!f.ignores(&topics().manifest(), &chunk(&other, &other_chunks[0])));
    let forged = from(
        "rogue",
        "fed",
        MessageKind::ModelChunk,
        1,
        5,
        &other_chunks[0],
    );
    assert!(!f.ignores(&topic, &forged));
}
