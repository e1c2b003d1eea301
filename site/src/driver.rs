//! The site driver: the one loop around the [`SiteEngine`] that every site runs, the MQTT agent
//! and the in-process runner alike. It owns what a round holds between the engine's actions (the
//! model applied and not yet announced, the round the next checkpoint belongs to, the events the
//! work itself produced) and does the engine's actions with a [`Worker`] (the model side) and an
//! [`Outbox`] (the transport side). So a site that diverges, a late joiner, a refused model and a
//! finished federation behave the same in every driver by construction.
//!
//! The driver does no I/O of its own: the outbox sends and hears the driver's [`Note`]s (what a
//! process reports), the worker applies, trains, evaluates and keeps the model. Time comes in
//! with each event, as the engine takes it.

use crate::engine::{Action, ChunkFilter, Event, Progress, SiteEngine};
use std::collections::VecDeque;
use std::time::Instant;
use unifed_protocol::RunId;
use unifed_protocol::messages::{Answer, BnPolicy, Downloaded, RoundManifest};

/// Any error of a worker's or an outbox's own (files, devices, the transport).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a [`Worker`] did not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum WorkError {
    /// The model the federation sent is at fault, not the site: a model that does not fit the
    /// site, or training from it diverged. The site goes on without it (it fetches the whole
    /// model again instead of a refused delta, or sends nothing for the round).
    #[error("{0}")]
    Refused(String),
    /// The site itself failed (a file, the device): the driver stops.
    #[error(transparent)]
    Failed(BoxError),
}

impl WorkError {
    /// A failure of the site itself.
    pub fn failed(e: impl Into<BoxError>) -> Self {
        WorkError::Failed(e.into())
    }
}

/// The step of a round a [`DriverError`] stopped the driver in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Sending a message.
    Publish,
    /// Applying a model.
    Apply,
    /// Re-estimating a late joiner's BN.
    Join,
    /// Evaluating a model.
    Evaluate,
    /// Training a round.
    Train,
    /// Taking the aggregator's answer.
    Answer,
    /// Writing the checkpoint.
    Checkpoint,
}

/// Why a driver stopped: a failure of the site itself (network input never stops it).
#[derive(Debug, thiserror::Error)]
#[error("{step:?} of model v{version}: {source}")]
pub struct DriverError {
    /// The step that failed.
    pub step: Step,
    /// The model version the site followed then.
    pub version: u64,
    /// What failed.
    #[source]
    pub source: BoxError,
}

/// One evaluation of the site's model.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The model version evaluated.
    pub version: u64,
    /// Accuracy on the site's test split.
    pub accuracy: f64,
    /// Mean cross-entropy on the site's test split.
    pub loss: f64,
    /// Accuracy on the site's validation split, when it has one.
    pub validation: Option<f64>,
    /// The training loss of the site's update that went into this version (its last local
    /// epoch's mean), when the site trained in the round that made it.
    pub train_loss: Option<f64>,
    /// Seconds the evaluation took.
    pub seconds: f64,
}

/// The model side of a site: what the engine's actions ask of the model and its files.
pub trait Worker {
    /// Applies the model of `manifest` from `download` (whole, or a delta from the version the
    /// site holds). [`WorkError::Refused`] when it does not fit the site: nothing changed.
    fn apply(&mut self, manifest: &RoundManifest, download: Downloaded) -> Result<(), WorkError>;
    /// Re-estimates the BN statistics of a site whose first model is past version 0 (a late
    /// joiner under `local` BN); returns the images it used.
    fn join(&mut self, manifest: &RoundManifest) -> Result<usize, WorkError>;
    /// Evaluates the model applied last (of `manifest`), as the plan deploys it.
    fn evaluate(&mut self, manifest: &RoundManifest) -> Result<Evaluation, WorkError>;
    /// Trains the round `manifest` opens and returns the unsigned update envelope. With
    /// `evaluate_after`, the model it trains from is also evaluated, on a frozen copy, after the
    /// update is handed over, while the upload goes on (its result comes from [`Worker::wait`]).
    fn train(
        &mut self,
        manifest: &RoundManifest,
        evaluate_after: bool,
    ) -> Result<Vec<u8>, WorkError>;
    /// Waits for the evaluation a [`Worker::train`] left running, if any, and returns it. The
    /// driver calls it before anything but sending needs the model.
    fn wait(&mut self) -> Option<Result<Evaluation, WorkError>> {
        None
    }
    /// The aggregator answered the site's update of `round` (an accepted update advances the
    /// site's memory).
    fn answered(&mut self, round: u64, accepted: bool) -> Result<(), WorkError>;
    /// Persists the model applied last, the site's memory and `progress` together.
    fn checkpoint(&mut self, progress: &Progress) -> Result<(), WorkError>;
}

/// Something the driver did that a process may report (a report line, a status, a chart).
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// A model came in and is being applied.
    Applying {
        /// Its version.
        version: u64,
        /// Milliseconds its fetch took.
        fetch_ms: u64,
    },
    /// A model was applied (and a late joiner's BN re-estimated) in `seconds`.
    ApplyDone {
        /// Its version.
        version: u64,
        /// Seconds applying took.
        seconds: f64,
    },
    /// A late joiner re-estimated its BN statistics on its own images.
    Joined {
        /// The model version it joined at.
        version: u64,
        /// The images it used.
        images: usize,
    },
    /// A model applied before is announced: persisted, or about to be trained from.
    Applied {
        /// Its version.
        version: u64,
        /// Bytes fetched for it (the whole model's or the delta's).
        bytes: u64,
        /// Milliseconds its fetch took.
        fetch_ms: u64,
    },
    /// A model was evaluated.
    Evaluated(Evaluation),
    /// Training of a round starts.
    Training {
        /// The round.
        round: u64,
        /// The model version it trains from.
        version: u64,
    },
    /// Training of a round did not give an update: the site sends nothing for it.
    TrainRefused {
        /// The round.
        round: u64,
        /// Why.
        error: String,
    },
    /// An update's first send.
    Uploading {
        /// Its round.
        round: u64,
        /// Bytes of the update envelope.
        bytes: u64,
        /// Messages one send takes.
        messages: u64,
    },
    /// The aggregator answered the update of `round`.
    Answered {
        /// The round.
        round: u64,
        /// The answer (never [`Answer::Resend`], which the engine handles).
        answer: Answer,
    },
    /// The checkpoint was written.
    Checkpointed {
        /// The round whose timeline it belongs to.
        round: u64,
        /// The model version it holds.
        version: Option<u64>,
        /// Seconds writing took.
        seconds: f64,
    },
    /// The federation finished; the final model was evaluated.
    Finished {
        /// The final model version.
        version: u64,
        /// The site's test accuracy with it.
        accuracy: f64,
    },
}

/// The transport side of a site: sends, and hears what the driver did.
pub trait Outbox {
    /// Publishes `payload` on `topic` (QoS 1, not retained).
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError>;
    /// Hears what the driver did.
    fn note(&mut self, _note: Note) {}
    /// The driver is busy training until `None` comes: the transport may drop the chunks
    /// `filter` ignores instead of holding them (up to a model's bytes) until it listens again.
    fn busy(&mut self, _filter: Option<ChunkFilter>) {}
}

/// When a site evaluates its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evaluate {
    /// Only the final model, when the federation finishes.
    Final,
    /// Every model applied (for convergence curves), before the site trains from it.
    EveryModel,
    /// Every model applied, on a copy frozen before training, while the update uploads (the
    /// same accuracy off the round's critical path, for the memory of a second model).
    EveryModelWhileUploading,
    /// Every model the federation trained (past version 0), before the site trains from it.
    EveryTrainedModel,
}

/// How a driver runs its site.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverConfig {
    /// When the site evaluates its model.
    pub evaluate: Evaluate,
    /// Whether a late joiner re-estimates its BN on its own images under `local` BN.
    pub calibrate_joiners: bool,
}

/// A model applied and not yet announced: its manifest, fetch milliseconds and bytes.
type Announce = (RoundManifest, u64, u64);

/// The site driver: the engine, the worker, and the round state between their steps.
#[derive(Debug)]
pub struct SiteDriver<W> {
    engine: SiteEngine,
    worker: W,
    cfg: DriverConfig,
    /// Events the driver itself produced (applied, trained), handled before new input.
    queue: VecDeque<Event>,
    /// A model applied, announced once it is checkpointed or, when the site trains from it at
    /// once, before training.
    announce: Option<Announce>,
    /// The round the next checkpoint belongs to in the timeline.
    checkpoint_round: u64,
    /// The final accuracy, once the federation finished.
    finished: Option<f64>,
    /// A later run the aggregator announced while the site holds state of another.
    new_run: Option<(RunId, RunId)>,
}

impl<W: Worker> SiteDriver<W> {
    /// A driver of `engine` with `worker`.
    pub fn new(engine: SiteEngine, worker: W, cfg: DriverConfig) -> Self {
        SiteDriver {
            engine,
            worker,
            cfg,
            queue: VecDeque::new(),
            announce: None,
            checkpoint_round: 0,
            finished: None,
            new_run: None,
        }
    }

    /// The driver of a fresh site that follows run `run` and nothing earlier
    /// ([`SiteEngine::following`]).
    pub fn following(mut self, run: RunId) -> Self {
        self.engine = self.engine.following(run);
        self
    }

    /// The site's run and a later one the aggregator announced ([`Action::NewRun`]), once it
    /// did: the site's state belongs to the first, and the driver does no more for either. Its
    /// owner puts the state aside and starts a fresh site on the second.
    pub fn new_run(&self) -> Option<(RunId, RunId)> {
        self.new_run
    }

    /// The engine.
    pub fn engine(&self) -> &SiteEngine {
        &self.engine
    }

    /// The worker.
    pub fn worker(&self) -> &W {
        &self.worker
    }

    /// The worker, giving the driver up.
    pub fn into_worker(self) -> W {
        self.worker
    }

    /// The site's final test accuracy once the federation finished.
    pub fn finished(&self) -> Option<f64> {
        self.finished
    }

    /// Handles `event` at `now_ms` (a monotonic clock), and every event the work it causes
    /// produces, sending through `out`. Returns the final accuracy once the federation has
    /// finished. An error is the site's own failure: the driver should not be used after it.
    pub fn handle(
        &mut self,
        event: Event,
        now_ms: u64,
        out: &mut impl Outbox,
    ) -> Result<Option<f64>, DriverError> {
        self.queue.push_back(event);
        while let Some(event) = self.queue.pop_front() {
            for action in self.engine.handle(event, now_ms) {
                // Sending needs no model; anything else waits for an evaluation left running.
                if !matches!(action, Action::Publish { .. } | Action::Uploading { .. }) {
                    self.collect(out)?;
                }
                self.act(action, out)?;
            }
        }
        Ok(self.finished)
    }

    /// An error of `step` at the version the site follows.
    fn error(&self, step: Step, source: impl Into<BoxError>) -> DriverError {
        DriverError {
            step,
            version: self.engine.manifest().map_or(0, |m| m.model_version),
            source: source.into(),
        }
    }

    /// `r` with a refusal or failure as the driver's error of `step`.
    fn must<T>(&self, step: Step, r: Result<T, WorkError>) -> Result<T, DriverError> {
        r.map_err(|e| match e {
            WorkError::Refused(why) => self.error(step, why),
            WorkError::Failed(e) => self.error(step, e),
        })
    }

    /// Does one engine action.
    fn act(&mut self, action: Action, out: &mut impl Outbox) -> Result<(), DriverError> {
        match action {
            Action::Publish { topic, payload } => out
                .publish(topic, payload)
                .map_err(|e| self.error(Step::Publish, e)),
            Action::Apply {
                manifest,
                download,
                joining,
                fetch_ms,
                bytes,
            } => self.apply((manifest, fetch_ms, bytes), download, joining, out),
            Action::Train { manifest } => {
                // A finished federation extended by more rounds is not finished any more.
                self.finished = None;
                self.train(manifest, out)
            }
            Action::Uploading {
                round,
                bytes,
                messages,
            } => {
                out.note(Note::Uploading {
                    round,
                    bytes,
                    messages,
                });
                Ok(())
            }
            Action::Answered { round, answer } => {
                let r = self.worker.answered(round, answer == Answer::Accepted);
                self.must(Step::Answer, r)?;
                self.checkpoint_round = round;
                out.note(Note::Answered { round, answer });
                Ok(())
            }
            Action::Checkpoint => {
                let started = Instant::now();
                let r = self.worker.checkpoint(self.engine.progress());
                self.must(Step::Checkpoint, r)?;
                out.note(Note::Checkpointed {
                    round: self.checkpoint_round,
                    version: self.engine.progress().applied_version,
                    seconds: started.elapsed().as_secs_f64(),
                });
                match self.announce.take() {
                    Some(a) => self.announced(a, out),
                    None => Ok(()),
                }
            }
            Action::NewRun { from, to } => {
                self.new_run = Some((from, to));
                Ok(())
            }
            Action::Finished { manifest } => {
                let r = self.worker.evaluate(&manifest);
                let e = self.must(Step::Evaluate, r)?;
                let accuracy = e.accuracy;
                out.note(Note::Evaluated(e));
                out.note(Note::Finished {
                    version: manifest.model_version,
                    accuracy,
                });
                self.finished = Some(accuracy);
                Ok(())
            }
        }
    }

    /// Applies a model; a late joiner re-estimates its BN first when the driver is so
    /// configured. A model the worker refuses is reported to the engine, which fetches the
    /// whole model instead of a refused delta.
    fn apply(
        &mut self,
        a: Announce,
        download: Downloaded,
        joining: bool,
        out: &mut impl Outbox,
    ) -> Result<(), DriverError> {
        let m = &a.0;
        let version = m.model_version;
        out.note(Note::Applying {
            version,
            fetch_ms: a.1,
        });
        let started = Instant::now();
        match self.worker.apply(m, download) {
            Ok(()) => {}
            Err(WorkError::Refused(error)) => {
                self.queue.push_back(Event::ApplyFailed { version, error });
                return Ok(());
            }
            Err(WorkError::Failed(e)) => return Err(self.error(Step::Apply, e)),
        }
        if joining && m.bn_policy == BnPolicy::Local && self.cfg.calibrate_joiners {
            let r = self.worker.join(m);
            let images = self.must(Step::Join, r)?;
            out.note(Note::Joined { version, images });
        }
        out.note(Note::ApplyDone {
            version,
            seconds: started.elapsed().as_secs_f64(),
        });
        // The model of version v is what round v + 1 trains from.
        self.checkpoint_round = version + 1;
        self.queue.push_back(Event::Applied { version });
        self.announce = Some(a);
        Ok(())
    }

    /// Whether the site evaluates the model of `m` when it announces it (the final model is
    /// evaluated when the federation finishes).
    fn evaluates(&self, m: &RoundManifest) -> bool {
        !m.finished
            && match self.cfg.evaluate {
                Evaluate::Final => false,
                Evaluate::EveryModel | Evaluate::EveryModelWhileUploading => true,
                Evaluate::EveryTrainedModel => m.model_version > 0,
            }
    }

    /// Announces an applied model, and evaluates it when the driver is so configured.
    fn announced(&mut self, a: Announce, out: &mut impl Outbox) -> Result<(), DriverError> {
        out.note(Note::Applied {
            version: a.0.model_version,
            bytes: a.2,
            fetch_ms: a.1,
        });
        if self.evaluates(&a.0) {
            let r = self.worker.evaluate(&a.0);
            let e = self.must(Step::Evaluate, r)?;
            out.note(Note::Evaluated(e));
        }
        Ok(())
    }

    /// Trains the round `m` opens. A model trained from at once is checkpointed with its
    /// training's outcome: it is announced here, and evaluated here or, frozen, after the
    /// update is handed over.
    fn train(&mut self, m: RoundManifest, out: &mut impl Outbox) -> Result<(), DriverError> {
        let mut evaluate_after = false;
        if let Some(a) = self.announce.take() {
            if self.cfg.evaluate == Evaluate::EveryModelWhileUploading {
                evaluate_after = self.evaluates(&a.0);
                out.note(Note::Applied {
                    version: a.0.model_version,
                    bytes: a.2,
                    fetch_ms: a.1,
                });
            } else {
                self.announced(a, out)?;
            }
        }
        out.note(Note::Training {
            round: m.round,
            version: m.model_version,
        });
        out.busy(Some(self.engine.chunk_filter()));
        let trained = self.worker.train(&m, evaluate_after);
        out.busy(None);
        let round = m.round;
        match trained {
            Ok(update) => self.queue.push_back(Event::Trained { round, update }),
            // What the federation's model made of training: no update this round, the next
            // model may train (a failure of the site itself stops the driver).
            Err(WorkError::Refused(error)) => {
                out.note(Note::TrainRefused {
                    round,
                    error: error.clone(),
                });
                self.queue.push_back(Event::TrainFailed { round, error });
            }
            Err(WorkError::Failed(e)) => return Err(self.error(Step::Train, e)),
        }
        Ok(())
    }

    /// Waits for an evaluation the worker left running, and reports it.
    fn collect(&mut self, out: &mut impl Outbox) -> Result<(), DriverError> {
        if let Some(r) = self.worker.wait() {
            let e = self.must(Step::Evaluate, r)?;
            out.note(Note::Evaluated(e));
        }
        Ok(())
    }
}
