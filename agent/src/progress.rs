//! How an agent reports what it does: a progress bar for local training on a terminal, and, for
//! a supervising process such as the demo (environment `UNIFED_REPORT=1`), one line per event
//! on stdout: the prefix `@unifed ` and a JSON [`Report`].

use serde::{Deserialize, Serialize};

/// The prefix of a report line.
pub const PREFIX: &str = "@unifed ";

/// One event of an agent, as a supervisor reads it.
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
        /// Bytes of the model payload fetched.
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

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("UNIFED_REPORT").is_some_and(|v| v == "1"))
}

/// A progress bar for one round of local training on stderr (drawn only on a terminal) that
/// also emits [`Report::Training`] lines.
pub fn training_bar(
    site: &str,
    round: u64,
) -> impl FnMut(unifed_models::train::TrainEvent) + Send + use<> {
    use unifed_models::train::TrainEvent;
    let bar = indicatif::ProgressBar::new(0)
        .with_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps {msg}")
                .expect("static template")
                .progress_chars("=> "),
        )
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_prefix(format!("{site} round {round}"));
    let mut steps = 0;
    move |ev| match ev {
        TrainEvent::EpochStart { epoch, steps: s } => {
            steps = s;
            bar.set_length(s as u64);
            bar.set_position(0);
            bar.set_message(format!("epoch {}", epoch + 1));
        }
        TrainEvent::Step { epoch, done } => {
            bar.set_position(done as u64);
            Report::Training {
                round,
                epoch,
                done,
                steps,
            }
            .emit();
        }
        TrainEvent::EpochEnd { epoch, loss } => {
            bar.set_message(format!("epoch {} loss {loss:.4}", epoch + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_line_round_trips_and_other_lines_are_not_reports() {
        let r = Report::Applied {
            version: 3,
            bytes: 56_854_635,
            seconds: 1.5,
        };
        let line = format!("{PREFIX}{}", serde_json::to_string(&r).unwrap());
        assert!(line.starts_with("@unifed {\"event\":\"applied\""));
        assert_eq!(Report::parse(&line), Some(r));
        assert_eq!(Report::parse("grey: applied model v3"), None);
        assert_eq!(Report::parse("@unifed {\"event\":\"nope\"}"), None);
    }
}
