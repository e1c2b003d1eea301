//! The aggregator's memory against the number of sites: one round of the full-size digits CNN
//! with `n` enrolled sites, each sending a full update in the federation's encoding, driven
//! through the aggregator core in this process. Run once per process (peak resident memory only grows), so the
//! `aggregator-memory` command starts one child per site count.

use crate::sim_key;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use unifed_aggregator::core::VET_WIDTH;
use unifed_aggregator::{
    Action, Aggregator, Arrival, EnrolledSite, Event, FederationConfig, Incoming,
};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{Answer, LocalReport, SiteExtras, SiteUpdate};

/// What one site count measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemoryRow {
    /// The federation's encoding of updates and model deltas (rows written before it was
    /// recorded were f32).
    #[serde(default = "f32_name")]
    pub encoding: String,
    /// Enrolled sites, all sending an update in the round.
    pub sites: usize,
    /// Values of the model.
    pub model_values: usize,
    /// Bytes of one update envelope.
    pub update_bytes: usize,
    /// Peak resident memory of the process before the aggregator opened (the model, the spec
    /// and the test's own buffers), bytes.
    pub baseline_peak_bytes: u64,
    /// Peak resident memory of the process at the end of the round, bytes.
    pub peak_bytes: u64,
    /// The most heap bytes the aggregator held at once: its state, the update handed to it,
    /// and everything it allocated while spooling and folding (counted by
    /// [`crate::heap::Counting`]; 0 where that is not the global allocator).
    pub aggregator_heap_peak_bytes: u64,
    /// Whether the updates were handed to the core [`VET_WIDTH`] at a time
    /// ([`Event::Updates`], as the service hands it uploads that complete together) rather
    /// than one by one (rows written before it was recorded were one by one).
    #[serde(default)]
    pub together: bool,
    /// Mean seconds to check and spool one update: the time the core took over them all,
    /// divided by their number.
    pub spool_seconds_per_update: f64,
    /// Seconds to fold the round into the next model and commit it.
    pub fold_seconds: f64,
}

fn f32_name() -> String {
    Encoding::F32.to_string()
}

/// The process's peak resident memory (`VmHWM`), bytes.
pub fn peak_rss() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb * 1024)
}

/// Site `site`'s signed update of round 1 in `run` (federation `memory`), every tensor an update
/// carries under local BN holding the same delta times `scale`, in `encoding`: made when it is
/// sent, so the measuring program holds nothing model-sized beside the aggregator.
fn site_update(
    spec: &unifed_protocol::ModelSpec,
    encoding: Encoding,
    (site, run): (&str, unifed_protocol::RunId),
    scale: f32,
) -> Vec<u8> {
    let delta = spec
        .tensors
        .iter()
        .filter(|t| !t.kind.is_bn())
        .map(|t| {
            let scaled: Vec<f32> = (0..t.numel())
                .map(|k| 1e-3 * ((k % 997) as f32 * 0.37).sin() * scale)
                .collect();
            t.encode(&scaled, encoding, None)
        })
        .collect();
    let u = SiteUpdate {
        round: 1,
        base_version: 0,
        samples: 100,
        delta,
        bn: Vec::new(),
        report: LocalReport::default(),
        extras: SiteExtras::None,
    };
    let federation = Id::new("memory").expect("valid id");
    let id = Id::new(site).expect("valid id");
    let env = Envelope::new(
        MessageKind::SiteUpdate,
        federation,
        id,
        1,
        0,
        spec.hash(),
        &u,
    );
    sim_key(site).sign(&env.in_run(run))
}

/// One round of `n` sites through the aggregator core, in a temporary data directory, every
/// update and the model delta sent back in `encoding`; the updates handed to the core one by
/// one, or `together` ([`VET_WIDTH`] at a time).
pub fn measure(n: usize, encoding: Encoding, together: bool) -> Result<MemoryRow> {
    if n == 0 {
        bail!("at least one site");
    }
    let (net, spec) = crate::full_size_digits()?;
    let initial = crate::initial_model(&net, &spec);
    drop(net);
    let ids: Vec<String> = (0..n).map(|i| format!("site-{i:03}")).collect();
    let mut cfg = FederationConfig::new(
        "memory",
        1,
        n,
        ids.iter()
            .map(|s| EnrolledSite::new(s, sim_key(s).public()))
            .collect(),
    );
    cfg.encoding = encoding;
    let update =
        |i: usize, run| site_update(&spec, encoding, (&ids[i], run), 1.0 + i as f32 / n as f32);
    let first = update(0, Default::default());
    let update_bytes = first.len();
    drop(first);
    let baseline = peak_rss()?;
    let dir = tempfile::tempdir()?;
    // What the measuring program holds itself from here on (the initial model moves into the
    // aggregator and counts as its own).
    let outside =
        crate::heap::live().saturating_sub(initial.tensors.iter().map(|t| t.len() * 4).sum());
    let mut held = 0;
    crate::heap::reset_peak();
    let mut agg = Aggregator::open(dir.path(), cfg, initial, 256 << 10)?;
    agg.handle(Event::Start, 0)?;
    held = held.max(crate::heap::peak());
    let incoming = dir.path().join("incoming");
    std::fs::create_dir_all(&incoming)?;
    // As the service hands an update on: mapped from its reassembled upload, which the core
    // makes the spool file. Making and staging the update is the site's and the chunk task's
    // work: the time and peak are taken over the handling alone.
    let run = agg.run();
    let stage = |i: usize| -> Result<Incoming> {
        let staged = incoming.join(format!("{}.complete", ids[i]));
        std::fs::write(&staged, update(i, run))?;
        let file = std::fs::File::open(&staged)?;
        let len = file.metadata()?.len() as usize;
        let mapped = unifed_net::memory::MappedFile::map(&file, len)?;
        Ok(Incoming {
            site: ids[i].clone(),
            bytes: bytes::Bytes::from_owner(mapped),
            arrival: Arrival::Message,
            staged: Some(staged),
        })
    };
    // Together: in events of as many updates as the service hands the core at once.
    let per_event = if together { VET_WIDTH } else { 1 };
    let mut acts = Vec::new();
    let mut spool = 0.0;
    for first in (0..n).step_by(per_event) {
        let batch = (first..(first + per_event).min(n))
            .map(stage)
            .collect::<Result<Vec<_>>>()?;
        crate::heap::reset_peak();
        let t = Instant::now();
        acts.extend(agg.handle(Event::Updates(batch), 1)?);
        spool += t.elapsed().as_secs_f64();
        held = held.max(crate::heap::peak());
    }
    let accepted = acts
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::Answer {
                    answer: Answer::Accepted,
                    ..
                }
            )
        })
        .count();
    if accepted != n || !acts.contains(&Action::Close) {
        bail!("{accepted} of {n} updates were accepted: {acts:?}");
    }
    crate::heap::reset_peak();
    let t = Instant::now();
    let closed = agg.handle(Event::Close, 1)?;
    let fold = t.elapsed().as_secs_f64();
    held = held.max(crate::heap::peak());
    if !closed
        .iter()
        .any(|a| matches!(a, Action::RoundClosed { .. }))
    {
        bail!("the round did not close: {closed:?}");
    }
    if agg.model_version() != 1 {
        bail!("the round did not close");
    }
    let peak = peak_rss()?;
    Ok(MemoryRow {
        encoding: encoding.to_string(),
        sites: n,
        model_values: spec.tensors.iter().map(|t| t.numel()).sum(),
        update_bytes,
        baseline_peak_bytes: baseline,
        peak_bytes: peak,
        aggregator_heap_peak_bytes: held.saturating_sub(outside) as u64,
        together,
        spool_seconds_per_update: spool / n as f64,
        fold_seconds: fold,
    })
}
