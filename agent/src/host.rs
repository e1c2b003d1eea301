//! What the agent process adds to the site driver ([`unifed_site::SiteDriver`] over
//! [`unifed_models::worker::ModelWorker`]): the [`AgentHost`] (the checkpoint's files, memory
//! modes, the training bar and timeline, a late joiner's onboarding package over MQTT) and the
//! [`AgentOutbox`] (publishes on the MQTT client, report lines, log lines, the site's status,
//! and the chunk filter the receiving task applies while the site trains).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unifed_models::site::Site;
use unifed_models::state::{Select, StateDict};
use unifed_models::train::TrainEvent;
use unifed_models::worker::Host;
use unifed_models::zoo::AnyNet;
use unifed_net::report;
use unifed_net::{Client, Qos};
use unifed_protocol::ModelSpec;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{Answer, RoundManifest, SiteState, SiteStatus};
use unifed_protocol::topics::Topics;
use unifed_site::driver::BoxError;
use unifed_site::{ChunkFilter, Note, Outbox, Progress};

use crate::config::AgentConfig;
use crate::files::SiteFiles;
use crate::progress::{Phase, Report, training_bar};
use crate::registry::{Identity, Owner};

/// What the driver's thread and the task that receives messages share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// While the site trains: the chunks the receiving task drops instead of holding them.
    pub filter: Option<ChunkFilter>,
    /// The round the site trains now.
    pub training: Option<u64>,
    /// The model version the checkpoint on disk holds.
    pub saved: Option<u64>,
}

/// The site's ids, keys and spec: what its status messages are signed and addressed with.
#[derive(Clone)]
pub(crate) struct Who {
    pub site: Id,
    pub federation: Id,
    pub spec: ModelSpec,
    pub identity: Identity,
    pub topics: Topics,
}

impl Who {
    /// The site's signed status message, of no run (what it says before it follows one).
    pub fn status(&self, state: SiteState, detail: &str) -> Vec<u8> {
        self.status_in(unifed_protocol::RunId::default(), state, detail)
    }

    /// The site's signed status message in the federation's run `run` (the aggregator takes
    /// only its own run's).
    pub fn status_in(
        &self,
        run: unifed_protocol::RunId,
        state: SiteState,
        detail: &str,
    ) -> Vec<u8> {
        self.identity.key.sign(
            &Envelope::new(
                MessageKind::SiteStatus,
                self.federation.clone(),
                self.site.clone(),
                0,
                0,
                self.spec.hash(),
                &SiteStatus {
                    state,
                    detail: detail.into(),
                },
            )
            .in_run(run),
        )
    }
}

/// The agent's [`Host`]: its files, memory modes, training bar and timeline, and the
/// onboarding package a late joiner fetches.
pub(crate) struct AgentHost {
    pub who: Who,
    pub files: SiteFiles,
    pub cfg: AgentConfig,
    /// The runtime the MQTT work runs on (a package fetch is a short session of its own).
    pub runtime: tokio::runtime::Handle,
    /// Training's peak memory, apart from encoding's.
    pub train_peak: Arc<Mutex<Option<u64>>>,
}

impl Host<AnyNet> for AgentHost {
    fn compute<T>(&mut self, f: impl FnOnce() -> T) -> T {
        unifed_net::memory::with_fast_allocation(f)
    }

    fn progress(&mut self, round: u64) -> Box<dyn FnMut(TrainEvent)> {
        let mut bar = training_bar(self.who.site.as_str(), round);
        let peak = self.train_peak.clone();
        Box::new(move |ev| {
            if ev == TrainEvent::Trained {
                *peak.lock().unwrap_or_else(|p| p.into_inner()) = report::take_peak();
                // Training's freed buffers go back before the update is encoded: encoding
                // holds the model, the delta and the update's bytes at once.
                unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Lean);
                unifed_net::release_free_memory();
            }
            bar(ev)
        })
    }

    fn trained(&mut self, round: u64, train_seconds: f64, encode_seconds: f64) {
        let peak = self
            .train_peak
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        // Training ended before the update was encoded.
        report::phase_ended(
            round,
            Phase::Train,
            train_seconds,
            peak,
            Duration::from_secs_f64(encode_seconds),
        );
        report::phase_seconds(round, Phase::Encode, encode_seconds);
    }

    fn rested(&mut self) {
        // Training's buffers and the update's pieces are freed now.
        unifed_net::release_free_memory();
        // A GPU's pipelines compiled for this round (its first, mostly) are kept for the next
        // start.
        unifed_models::backend::save_compiled_kernels();
    }

    fn package_bn(&mut self, m: &RoundManifest) -> Option<StateDict> {
        let site = &self.who.site;
        let fetched = self
            .runtime
            .block_on(package_bn(&self.cfg, &self.who, m.model_version));
        match fetched {
            Ok((sd, detail)) => {
                println!(
                    "{site}: BN from the onboarding package of model v{} ({detail})",
                    m.model_version
                );
                Some(sd)
            }
            // Not fatal: the joiner calibrates its own BN instead.
            Err(e) => {
                eprintln!(
                    "{site}: onboarding package unavailable ({e:#}); calibrating the model's own BN"
                );
                None
            }
        }
    }

    fn checkpoint(&mut self, site: &Site<AnyNet>, progress: &Progress) -> Result<(), BoxError> {
        self.files.write(&self.who.spec, site, progress)?;
        // The download's or the upload's buffers and the checkpoint's are freed now.
        unifed_net::release_free_memory();
        Ok(())
    }
}

/// The BN layers of model `version`'s onboarding package, fetched in a short session of its own,
/// and a description (policy, sites) for the log.
async fn package_bn(
    cfg: &AgentConfig,
    who: &Who,
    version: u64,
) -> anyhow::Result<(StateDict, String)> {
    let owner = Owner {
        federation: who.federation.clone(),
        site: who.site.clone(),
        spec: who.spec.hash(),
    };
    let (info, state) = crate::registry::fetch_package(
        &cfg.broker,
        owner,
        &who.identity,
        &who.spec,
        Some(version),
        |_, _| {},
    )
    .await?;
    let sd = state.filter(Select::Bn);
    let sites: Vec<&str> = info.bn_sites.iter().map(|x| x.as_str()).collect();
    Ok((
        sd,
        format!("{} of {}", info.bn_sharing.name(), sites.join(", ")),
    ))
}

/// The agent's [`Outbox`]: the MQTT client, report and log lines, the site's status.
pub(crate) struct AgentOutbox {
    pub who: Who,
    pub client: Client,
    pub runtime: tokio::runtime::Handle,
    pub shared: Arc<Mutex<Shared>>,
    /// While a model comes in the agent allocates as a relay (see `Allocation::Relay`): each
    /// chunk's packet reuses the heap instead of faulting in fresh pages.
    pub relaying: bool,
    /// The round of the update on its way, and when its upload started.
    pub upload_started: Option<(u64, Instant)>,
}

impl AgentOutbox {
    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, topic: String, retain: bool, payload: Vec<u8>) -> Result<(), BoxError> {
        let client = self.client.clone();
        self.runtime.block_on(async move {
            client
                .publish(topic, Qos::AtLeastOnce, retain, payload)
                .await
        })?;
        Ok(())
    }

    /// Says (retained, on the site's status topic) that the site holds the final model
    /// `version` of `run`, so the aggregator stops serving it once every site has it. A failure
    /// is logged: the aggregator's linger ends its serving anyway.
    pub(crate) fn say_finished(&self, run: unifed_protocol::RunId, version: u64) {
        let msg = self.who.status_in(
            run,
            SiteState::Finished {
                model_version: version,
            },
            "finished",
        );
        if let Err(e) = self.send(self.who.topics.status(&self.who.site), true, msg) {
            tracing::warn!("could not say the site finished: {e}");
        }
    }

    /// Reports the aggregator's answer to the update of `round`.
    fn answered(&mut self, round: u64, answer: Answer) {
        let site = &self.who.site;
        if let Some((_, t)) = self.upload_started.take_if(|(r, _)| *r == round) {
            report::phase_seconds(round, Phase::Upload, t.elapsed().as_secs_f64());
        }
        let accepted = answer == Answer::Accepted;
        Report::Answered { round, accepted }.emit();
        match answer {
            Answer::Accepted => println!("{site}: update for round {round} accepted"),
            Answer::Rejected(r) => eprintln!("{site}: update for round {round} rejected: {r:?}"),
            // The engine re-sends by itself; it never reports this answer.
            Answer::Resend => {}
        }
    }
}

impl Outbox for AgentOutbox {
    fn publish(&mut self, topic: String, payload: Vec<u8>) -> Result<(), BoxError> {
        if !self.relaying && topic == self.who.topics.chunk_request(&self.who.site) {
            unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Relay);
            self.relaying = true;
        }
        self.send(topic, false, payload)
    }

    fn note(&mut self, note: Note) {
        let site = self.who.site.clone();
        match note {
            Note::Applying { version, fetch_ms } => {
                if std::mem::take(&mut self.relaying) {
                    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Lean);
                }
                // The model of version v is what round v + 1 trains from.
                report::phase_seconds(version + 1, Phase::Download, fetch_ms as f64 / 1000.0);
            }
            Note::ApplyDone { version, seconds } => {
                report::phase_seconds(version + 1, Phase::Apply, seconds)
            }
            Note::Joined { version, images } => {
                println!("{site}: joined at model v{version}; calibrated BN on {images} own images")
            }
            Note::Applied {
                version,
                bytes,
                fetch_ms,
            } => {
                println!("{site}: applied model v{version}");
                Report::Applied {
                    version,
                    bytes,
                    seconds: fetch_ms as f64 / 1000.0,
                }
                .emit();
                // The download's buffers go back before evaluation and training take memory.
                unifed_net::release_free_memory();
            }
            Note::Evaluated(e) => {
                report::phase_seconds(e.version + 1, Phase::Evaluate, e.seconds);
                Report::Evaluated {
                    version: e.version,
                    accuracy: e.accuracy,
                }
                .emit();
            }
            Note::Training { round, version } => {
                println!("{site}: training round {round} from model v{version}");
                self.shared().training = Some(round);
                let status = self.who.status(SiteState::Training { round }, "");
                let topic = self.who.topics.status(&site);
                if let Err(e) = self.send(topic, true, status) {
                    tracing::warn!(error = %e, "the training status was not sent");
                }
            }
            Note::TrainRefused { round, error } => {
                eprintln!("{site}: round {round}: {error}; no update sent this round")
            }
            Note::Uploading {
                round,
                bytes,
                messages,
            } => {
                self.upload_started = Some((round, Instant::now()));
                Report::Uploaded {
                    round,
                    bytes,
                    messages,
                }
                .emit()
            }
            Note::Answered { round, answer } => self.answered(round, answer),
            Note::Checkpointed {
                round,
                version,
                seconds,
            } => {
                self.shared().saved = version;
                report::phase_seconds(round, Phase::Checkpoint, seconds);
            }
            Note::Finished { version, accuracy } => println!(
                "{site}: federation finished at model v{version}; test accuracy {:.2}%",
                100.0 * accuracy
            ),
        }
    }

    /// Training ends with `None`: the round is no longer trained (a stop then says what the
    /// checkpoint holds).
    fn busy(&mut self, filter: Option<ChunkFilter>) {
        let mut shared = self.shared();
        if filter.is_none() {
            shared.training = None;
        }
        shared.filter = filter;
    }
}
