//! In-process federation: the aggregator core and one trainer per site, each with its own model
//! and BN state, exchanging the same encoded messages the network will carry (envelopes, model
//! chunks, postcard updates) over an in-memory transport. The experiment runner of the algorithm
//! suite grows from here.

pub mod chart;

use anyhow::{Context, Result, anyhow, bail};
use std::time::Instant;
use unifed_aggregator::{Action, Aggregator, Event, FederationConfig, GlobalModel};
use unifed_models::backend::Device;
pub use unifed_models::site::{Site, select_for};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::Net;
use unifed_protocol::chunking::Reassembler;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{Answer, ServerBroadcast};

/// What a federation run did in one round.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RoundRecord {
    /// The round.
    pub round: u64,
    /// Each site's test accuracy after the round (its model = new global + its BN under `local`).
    pub accuracy: Vec<f64>,
    /// Bytes of each site's update message.
    pub update_bytes: Vec<usize>,
    /// Bytes of the broadcast model payload.
    pub model_bytes: usize,
    /// Wall seconds of the round (training, aggregation, evaluation).
    pub seconds: f64,
}

/// Messages a run passed, lent to the observer, for tests that check what crossed the transport.
#[derive(Debug, Clone, Copy)]
pub enum Observed<'a> {
    /// A site's encoded update.
    Update {
        /// The site.
        site: &'a str,
        /// The envelope bytes.
        bytes: &'a [u8],
    },
    /// The reassembled broadcast payload of a model version.
    Model {
        /// The model version.
        version: u64,
        /// The payload bytes.
        payload: &'a [u8],
    },
}

/// Runs a federation of `sites` under `cfg` from `initial` in a fresh data directory, and calls
/// `observe` with every message it passes, and `on_round` after each round with the round's record
/// and the sites (each holding the new model). Returns one record per round.
pub fn run_federation<N: Net>(
    cfg: FederationConfig,
    initial: GlobalModel,
    sites: &mut [Site<N>],
    tc: &TrainConfig,
    device: &Device,
    mut observe: impl FnMut(Observed<'_>),
    mut on_round: impl FnMut(&RoundRecord, &[Site<N>]),
) -> Result<Vec<RoundRecord>> {
    let dir = tempfile::tempdir()?;
    let spec = initial.spec.clone();
    let federation = Id::new(&cfg.federation).map_err(|e| anyhow!("{e}"))?;
    let bn = cfg.bn_policy;
    let mut agg = Aggregator::open(dir.path(), cfg, initial, 256 << 10)?;
    let mut pending = agg.handle(Event::Start, 0)?;
    let mut records = Vec::new();
    let mut t0 = Instant::now();
    let mut update_bytes = vec![0; sites.len()];
    let mut now = 0u64;
    loop {
        let Some(action) = (!pending.is_empty()).then(|| pending.remove(0)) else {
            bail!("the aggregator stopped without finishing");
        };
        match action {
            Action::Answer {
                site,
                answer,
                round,
            } => {
                let accepted = answer == Answer::Accepted;
                if let Some(s) = sites.iter_mut().find(|s| s.id == site) {
                    s.answered(round, accepted);
                }
                if let Answer::Rejected(r) = answer {
                    bail!("update of {site} in round {round} rejected: {r:?}");
                }
            }
            Action::RoundClosed { .. } => {}
            Action::Finished { .. } => return Ok(records),
            Action::Publish { manifest, chunks } => {
                // The transport: chunks reassembled exactly as a site would.
                let mut re = Reassembler::new(60_000, 1 << 30);
                let mut payload = None;
                for c in chunks {
                    payload = re.insert(c, now)?.or(payload);
                }
                let payload = payload.context("model chunks did not reassemble")?;
                observe(Observed::Model {
                    version: manifest.model_version,
                    payload: &payload,
                });
                let b: ServerBroadcast = postcard::from_bytes(&payload)?;
                for s in sites.iter_mut() {
                    s.receive(&spec, &b, bn)?;
                }
                if manifest.model_version > 0 {
                    let accuracy = sites
                        .iter()
                        .map(|s| s.evaluate(&spec, device).map(|e| e.accuracy()))
                        .collect::<Result<Vec<_>, _>>()?;
                    let rec = RoundRecord {
                        round: manifest.model_version,
                        accuracy,
                        update_bytes: update_bytes.clone(),
                        model_bytes: payload.len(),
                        seconds: t0.elapsed().as_secs_f64(),
                    };
                    on_round(&rec, sites);
                    records.push(rec);
                    t0 = Instant::now();
                }
                if manifest.finished {
                    continue;
                }
                for (k, s) in sites.iter_mut().enumerate() {
                    // Only the sampled sites train, as agents do.
                    if !(manifest.sampled.is_empty() || manifest.sampled.contains(&s.id)) {
                        update_bytes[k] = 0;
                        continue;
                    }
                    let bytes = s.train_round(&spec, &federation, &manifest, tc, device, |_| {})?;
                    update_bytes[k] = bytes.len();
                    observe(Observed::Update {
                        site: s.id.as_str(),
                        bytes: &bytes,
                    });
                    now += 1;
                    pending.extend(agg.handle(
                        Event::Update {
                            site: s.id.to_string(),
                            bytes,
                        },
                        now,
                    )?);
                }
            }
        }
    }
}
