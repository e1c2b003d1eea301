//! The burn side of the site driver: [`ModelWorker`], the [`Worker`] every site runs over its
//! [`Site`] (the MQTT agent and the in-process runner alike). What a process adds (report lines,
//! memory modes, files, the onboarding package over the network) comes through its [`Host`];
//! everything that decides what the model becomes is here once.

use crate::backend::Device;
use crate::data::Dataset;
use crate::error::TrainError;
use crate::site::{Site, SiteError};
use crate::state::{Select, StateDict, import};
use crate::train::{TrainConfig, TrainEvent};
use crate::zoo::Net;
use std::thread::JoinHandle;
use std::time::Instant;
use unifed_protocol::ModelSpec;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{BnSharing, Downloaded, RoundManifest};
use unifed_site::driver::BoxError;
use unifed_site::{Evaluation, Progress, WorkError, Worker};

/// What a process adds to its site's work: all optional but the checkpoint's files.
pub trait Host<N: Net> {
    /// Runs compute-heavy work (training, evaluation, calibration); the agent allocates fast
    /// inside it.
    fn compute<T>(&mut self, f: impl FnOnce() -> T) -> T {
        f()
    }
    /// The progress callback of round `round`'s training.
    fn progress(&mut self, _round: u64) -> Box<dyn FnMut(TrainEvent)> {
        Box::new(|_| {})
    }
    /// Training of `round` gave its update: seconds training and seconds encoding it.
    fn trained(&mut self, _round: u64, _train_seconds: f64, _encode_seconds: f64) {}
    /// A round's work on the model is over (training, and an evaluation left running): the
    /// agent frees memory and keeps a GPU's compiled kernels.
    fn rested(&mut self) {}
    /// The BN layers of the onboarding package of the model `m` announces, for a late joiner
    /// under a BN sharing policy; `None` when there is none to have.
    fn package_bn(&mut self, _m: &RoundManifest) -> Option<StateDict> {
        None
    }
    /// The site evaluated the model it holds (not a frozen copy).
    fn evaluated(&mut self, _site: &Site<N>, _evaluation: &Evaluation) {}
    /// Persists the site (its model and memory) with `progress`.
    fn checkpoint(&mut self, _site: &Site<N>, _progress: &Progress) -> Result<(), BoxError> {
        Ok(())
    }
}

/// A host that adds nothing: an in-process site without files.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHost;

impl<N: Net> Host<N> for NoHost {}

/// What a site's model work needs besides the site: its federation, spec, training settings
/// and device.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The federation (updates name it).
    pub federation: Id,
    /// The model spec the site runs.
    pub spec: ModelSpec,
    /// Local training settings (the site's seed among them).
    pub train: TrainConfig,
    /// The device the site computes on.
    pub device: Device,
    /// A validation split evaluated beside the test split (an experiment's, to select rounds).
    pub validation: Option<Dataset>,
}

/// An evaluation running on its own thread: it holds the site until it ends.
type Running<N> = JoinHandle<(Site<N>, Result<Evaluation, WorkError>)>;

/// The [`Worker`] over a burn [`Site`].
pub struct ModelWorker<N: Net, H> {
    /// The site, `None` while an evaluation left running holds it.
    site: Option<Site<N>>,
    running: Option<Running<N>>,
    /// The outcome of the evaluation that ran last, until [`Worker::wait`] takes it.
    done: Option<Result<Evaluation, WorkError>>,
    cfg: WorkerConfig,
    host: H,
}

impl<N: Net, H> std::fmt::Debug for ModelWorker<N, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelWorker")
            .field("site", &self.site.as_ref().map(|s| s.id.as_str()))
            .field("evaluating", &self.running.is_some())
            .finish()
    }
}

impl<N: Net, H: Host<N>> ModelWorker<N, H> {
    /// The worker of `site`.
    pub fn new(site: Site<N>, cfg: WorkerConfig, host: H) -> Self {
        ModelWorker {
            site: Some(site),
            running: None,
            done: None,
            cfg,
            host,
        }
    }

    /// The site, once no evaluation holds it.
    pub fn site(&mut self) -> Result<&mut Site<N>, WorkError> {
        Ok(self.parts()?.0)
    }

    /// The site, giving the worker up.
    pub fn into_site(mut self) -> Result<Site<N>, WorkError> {
        self.settle();
        self.site.take().ok_or_else(lost)
    }

    /// The site (once no evaluation holds it), the settings and the host, borrowed apart.
    fn parts(&mut self) -> Result<(&mut Site<N>, &WorkerConfig, &mut H), WorkError> {
        self.settle();
        let site = self.site.as_mut().ok_or_else(lost)?;
        Ok((site, &self.cfg, &mut self.host))
    }

    /// Waits for an evaluation left running and keeps its outcome for [`Worker::wait`].
    fn settle(&mut self) {
        let Some(job) = self.running.take() else {
            return;
        };
        match job.join() {
            Ok((site, r)) => {
                self.site = Some(site);
                self.done = Some(r);
            }
            Err(_) => self.done = Some(Err(WorkError::failed("the evaluation thread panicked"))),
        }
        self.host.rested();
    }
}

/// The error of a worker whose site went with an evaluation thread that panicked.
fn lost() -> WorkError {
    WorkError::failed("the site's model was lost with its evaluation")
}

/// A site error as a worker's: what the federation's model made of training is a refusal (the
/// site goes on), anything else the site's own failure.
fn refusal_or_failure(e: SiteError) -> WorkError {
    match e {
        SiteError::NonFinite(_)
        | SiteError::Plan { .. }
        | SiteError::Train(TrainError::Diverged(..)) => WorkError::Refused(e.to_string()),
        e => WorkError::failed(e),
    }
}

/// Evaluates `net`, the site's model as it applied the model of `m` (the model itself, or a
/// copy [`Site::freeze`] made), on the test split and `cfg`'s validation split.
fn evaluation<N: Net>(
    site: &Site<N>,
    net: &N,
    m: &RoundManifest,
    cfg: &WorkerConfig,
) -> Result<Evaluation, WorkError> {
    let started = Instant::now();
    let (spec, tc, device) = (&cfg.spec, &cfg.train, &cfg.device);
    let test = site
        .evaluate_net(net, &site.test, spec, &m.plan, tc, device)
        .map_err(WorkError::failed)?;
    let validation = match &cfg.validation {
        Some(val) => Some(
            site.evaluate_net(net, val, spec, &m.plan, tc, device)
                .map_err(WorkError::failed)?
                .accuracy(),
        ),
        None => None,
    };
    Ok(Evaluation {
        version: m.model_version,
        accuracy: test.accuracy(),
        loss: test.loss,
        validation,
        train_loss: site
            .last_report()
            .filter(|(r, _)| *r == m.model_version)
            .map(|(_, rep)| rep.train_loss),
        seconds: started.elapsed().as_secs_f64(),
    })
}

impl<N: Net, H: Host<N>> Worker for ModelWorker<N, H> {
    fn apply(&mut self, m: &RoundManifest, download: Downloaded) -> Result<(), WorkError> {
        let (site, cfg, _) = self.parts()?;
        let applied = match download.read() {
            Ok(d) => site.receive(&cfg.spec, m, &d).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        applied.map_err(WorkError::Refused)
    }

    fn join(&mut self, m: &RoundManifest) -> Result<usize, WorkError> {
        // BN from the onboarding package (the sites' shared BN, if the policy shares any), then
        // its statistics re-estimated on the site's own images.
        let package = if m.bn_sharing != BnSharing::None {
            self.host.package_bn(m)
        } else {
            None
        };
        let (site, cfg, host) = self.parts()?;
        if let Some(sd) = package {
            site.net = import(&site.net, &cfg.spec, &sd, Select::Bn).map_err(WorkError::failed)?;
        }
        site.net = host
            .compute(|| {
                crate::calibrate::calibrate(
                    &site.net,
                    &site.train.x,
                    &cfg.device,
                    &Default::default(),
                    |_, _| {},
                )
            })
            .map_err(WorkError::failed)?;
        Ok(site.train.len())
    }

    fn evaluate(&mut self, m: &RoundManifest) -> Result<Evaluation, WorkError> {
        let (site, cfg, host) = self.parts()?;
        let e = host.compute(|| evaluation(site, &site.net, m, cfg));
        if let Ok(e) = &e {
            host.evaluated(site, e);
        }
        host.rested();
        e
    }

    fn train(&mut self, m: &RoundManifest, evaluate_after: bool) -> Result<Vec<u8>, WorkError> {
        self.settle();
        let mut site = self.site.take().ok_or_else(lost)?;
        let frozen = evaluate_after.then(|| site.freeze());
        let started = Instant::now();
        let progress = self.host.progress(m.round);
        let cfg = &self.cfg;
        let r = self.host.compute(|| {
            site.train_round(
                &cfg.spec,
                &cfg.federation,
                m,
                &cfg.train,
                &cfg.device,
                progress,
            )
        });
        if r.is_ok() {
            let encode = site.encode_seconds();
            let train = started.elapsed().as_secs_f64() - encode;
            self.host.trained(m.round, train, encode);
        }
        match frozen {
            // The update goes up now; the site stays with the evaluation while it runs.
            Some(net) => {
                let (m, cfg) = (m.clone(), self.cfg.clone());
                self.running = Some(std::thread::spawn(move || {
                    let e = evaluation(&site, &net, &m, &cfg);
                    (site, e)
                }));
            }
            None => {
                self.site = Some(site);
                self.host.rested();
            }
        }
        r.map_err(refusal_or_failure)
    }

    fn wait(&mut self) -> Option<Result<Evaluation, WorkError>> {
        self.settle();
        self.done.take()
    }

    fn answered(&mut self, round: u64, accepted: bool) -> Result<(), WorkError> {
        self.site()?.answered(round, accepted);
        Ok(())
    }

    fn checkpoint(&mut self, progress: &Progress) -> Result<(), WorkError> {
        let (site, _, host) = self.parts()?;
        host.checkpoint(site, progress).map_err(WorkError::Failed)
    }
}
