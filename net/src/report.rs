//! How the services report what they do to a supervising process such as the demo
//! (environment `UNIFED_REPORT=1`): one line per event on stdout, the prefix `@unifed ` and a
//! JSON [`Report`]. A typed contract between processes, never a log sentence to parse.

use serde::{Deserialize, Serialize};

/// The prefix of a report line.
pub const PREFIX: &str = "@unifed ";

/// A step of a federated round whose duration is reported: what the per-phase timeline of a
/// round is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// A site fetches the round's model (first chunk request to the complete payload).
    Download,
    /// A site applies it (and calibrates BN when joining).
    Apply,
    /// A site writes its checkpoint.
    Checkpoint,
    /// A site measures its test accuracy (a supervisor's measurement, not part of a round).
    Evaluate,
    /// A site's local training.
    Train,
    /// A site encodes its update (delta, error feedback, envelope).
    Encode,
    /// A site's update on the wire until the aggregator's answer (spooling included).
    Upload,
    /// The aggregator checks and stores one update durably.
    Spool,
    /// The aggregator folds the round's updates into the next model and commits it.
    Fold,
    /// The aggregator signs the new model's chunks and publishes its manifest.
    Publish,
}

impl Phase {
    /// Every phase in the order a round goes through them.
    pub const ALL: [Phase; 10] = [
        Phase::Download,
        Phase::Apply,
        Phase::Checkpoint,
        Phase::Evaluate,
        Phase::Train,
        Phase::Encode,
        Phase::Upload,
        Phase::Spool,
        Phase::Fold,
        Phase::Publish,
    ];

    /// The phase's name in reports and tables.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Download => "download",
            Phase::Apply => "apply",
            Phase::Checkpoint => "checkpoint",
            Phase::Evaluate => "evaluate",
            Phase::Train => "train",
            Phase::Encode => "encode",
            Phase::Upload => "upload",
            Phase::Spool => "spool",
            Phase::Fold => "fold",
            Phase::Publish => "publish",
        }
    }
}

/// One event of an agent or the aggregator, as a supervisor reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Report {
    /// A step of local training.
    Training {
        /// Round being trained.
        round: u64,
        /// Epoch (0-based).
        epoch: usize,
        /// Steps done in this epoch.
        done: usize,
        /// Steps in the epoch.
        steps: usize,
    },
    /// An update was sent (first send, not re-sends).
    Uploaded {
        /// Round of the update.
        round: u64,
        /// Application bytes of the update envelope.
        bytes: u64,
        /// MQTT messages it took.
        messages: u64,
    },
    /// The aggregator answered an update.
    Answered {
        /// Round of the update.
        round: u64,
        /// Whether it was accepted.
        accepted: bool,
    },
    /// A model version was fetched and applied.
    Applied {
        /// Model version.
        version: u64,
        /// Bytes of the payload fetched (the whole model's, or the delta's).
        bytes: u64,
        /// Seconds from its manifest to having applied it.
        seconds: f64,
    },
    /// Test accuracy of the site's model (global weights, the site's own BN under `local`).
    Evaluated {
        /// Model version.
        version: u64,
        /// Test accuracy in [0, 1].
        accuracy: f64,
    },
    /// A phase of `round` took `seconds` (a site's model of version `v` is fetched, applied,
    /// checkpointed and evaluated for round `v + 1`).
    Phase {
        /// The round.
        round: u64,
        /// The phase.
        phase: Phase,
        /// Its duration.
        seconds: f64,
        /// The process's peak resident memory since its previous phase report, bytes (Linux;
        /// absent where the kernel does not tell).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peak_bytes: Option<u64>,
        /// When it ended, ms since the Unix epoch: with `seconds`, where it lies on the clock
        /// that the processes of one machine share (absent from older reports).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ended_ms: Option<u64>,
    },
    /// The MQTT connection came up (`error` absent), or failed or was lost (`error` says why).
    Connection {
        /// Whether it is up.
        up: bool,
        /// Why it is down.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The aggregator re-read its revocation list: messages signed by one of `revoked` keys are
    /// refused from now on.
    Revocations {
        /// Keys revoked now.
        revoked: usize,
    },
    /// The aggregator closed `round` with the updates of `sites`, giving `model_version`.
    RoundClosed {
        /// The round.
        round: u64,
        /// The new model version.
        model_version: u64,
        /// Sites folded in.
        sites: Vec<String>,
    },
    /// The aggregator stopped serving the federation's final model `model_version`: every
    /// enrolled, unrevoked site said it holds it (`every_site`), or its linger ran out first
    /// with only `holding` saying so.
    Stopped {
        /// The final model's version.
        model_version: u64,
        /// Whether every site said it holds the final model.
        every_site: bool,
        /// The sites that said so, in order.
        holding: Vec<String>,
    },
}

impl Report {
    /// Prints the report line when a supervisor asked for reports.
    pub fn emit(&self) {
        if enabled()
            && let Ok(json) = serde_json::to_string(self)
        {
            println!("{PREFIX}{json}");
        }
    }

    /// Parses a report line (`None` for any other line).
    pub fn parse(line: &str) -> Option<Report> {
        serde_json::from_str(line.strip_prefix(PREFIX)?).ok()
    }
}

/// Reports the duration of `phase` of `round` since `since`.
pub fn phase(round: u64, phase: Phase, since: std::time::Instant) {
    phase_seconds(round, phase, since.elapsed().as_secs_f64());
}

/// Reports that `phase` of `round` took `seconds`, with the process's peak memory since the
/// previous phase report.
pub fn phase_seconds(round: u64, phase: Phase, seconds: f64) {
    phase_seconds_peak(round, phase, seconds, take_peak());
}

/// Reports that `phase` of `round` took `seconds` and peaked at `peak_bytes` (from
/// [`take_peak`] at the phase's end), and that it ended `since_end` ago: for a phase reported
/// later than it ended.
pub fn phase_ended(
    round: u64,
    phase: Phase,
    seconds: f64,
    peak_bytes: Option<u64>,
    since_end: std::time::Duration,
) {
    let ended = std::time::SystemTime::now()
        .checked_sub(since_end)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    Report::Phase {
        round,
        phase,
        seconds,
        peak_bytes,
        ended_ms: ended.map(|d| d.as_millis() as u64),
    }
    .emit();
}

/// Reports that `phase` of `round`, which just ended, took `seconds` and peaked at
/// `peak_bytes`.
pub fn phase_seconds_peak(round: u64, phase: Phase, seconds: f64, peak_bytes: Option<u64>) {
    phase_ended(round, phase, seconds, peak_bytes, std::time::Duration::ZERO);
}

/// The process's peak resident memory (`VmHWM`) since the previous call, bytes, and starts the
/// next period (Linux: `/proc/self/clear_refs`). Only while a supervisor asks for reports: a
/// process nobody watches leaves its peak alone. `None` where the kernel does not tell.
pub fn take_peak() -> Option<u64> {
    if !enabled() {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    // `5` resets the peak to the current resident set; the next period starts from there.
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    Some(kib * 1024)
}

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("UNIFED_REPORT").is_some_and(|v| v == "1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_line_round_trips_and_other_lines_are_not_reports() {
        for r in [
            Report::Applied {
                version: 3,
                bytes: 56_854_635,
                seconds: 1.5,
            },
            Report::Phase {
                round: 4,
                phase: Phase::Fold,
                seconds: 0.25,
                peak_bytes: Some(300 << 20),
                ended_ms: Some(1_795_000_000_123),
            },
            Report::Phase {
                round: 4,
                phase: Phase::Spool,
                seconds: 0.5,
                peak_bytes: None,
                ended_ms: None,
            },
            Report::RoundClosed {
                round: 4,
                model_version: 4,
                sites: vec!["grey".into()],
            },
        ] {
            let line = format!("{PREFIX}{}", serde_json::to_string(&r).unwrap());
            assert_eq!(Report::parse(&line), Some(r));
        }
        let line = format!(
            "{PREFIX}{}",
            serde_json::to_string(&Report::Phase {
                round: 1,
                phase: Phase::Train,
                seconds: 2.0,
                peak_bytes: None,
                ended_ms: None,
            })
            .unwrap()
        );
        assert_eq!(
            line,
            "@unifed {\"event\":\"phase\",\"round\":1,\"phase\":\"train\",\"seconds\":2.0}"
        );
        assert_eq!(Report::parse("grey: applied model v3"), None);
        assert_eq!(Report::parse("@unifed {\"event\":\"nope\"}"), None);
        assert_eq!(
            Phase::ALL.len(),
            Phase::ALL
                .iter()
                .map(|p| p.name())
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        );
    }
}
