//! The experiment's progress on a terminal: one bar for the whole experiment (rounds done of
//! all to do, with the time left) and one per job (the run it trains, its round and mean test
//! accuracy). Elsewhere (a log file, CI) one line per round instead.

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use unifed_sim::experiment::{Progress, clock};

/// Bars on a terminal, lines otherwise.
pub enum Bars {
    /// stderr is a terminal: the overall bar, and a bar for each job as it starts.
    Drawn {
        /// Holds the bars together.
        all: MultiProgress,
        /// Rounds done of all; drawn from the first finished round on.
        total: Option<ProgressBar>,
        /// Each job's current run.
        jobs: Vec<ProgressBar>,
    },
    /// stderr is not a terminal: one line per round.
    Lines,
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("static template")
        .progress_chars("=> ")
}

impl Bars {
    /// Bars when stderr is a terminal, lines otherwise.
    pub fn for_stderr() -> Bars {
        match std::io::stderr().is_terminal() {
            true => Bars::Drawn {
                all: MultiProgress::new(),
                total: None,
                jobs: Vec::new(),
            },
            false => Bars::Lines,
        }
    }

    /// Shows one finished round.
    pub fn show(&mut self, e: &Progress) {
        match self {
            Bars::Lines => eprintln!("{e}"),
            Bars::Drawn { all, total, jobs } => {
                let total = total.get_or_insert_with(|| {
                    all.insert(
                        0,
                        ProgressBar::new(e.total)
                            .with_style(style("experiment [{bar:40}] {pos}/{len} rounds {msg}")),
                    )
                });
                total.set_position(e.done);
                total.set_message(format!("about {} left", clock(e.seconds_left)));
                while jobs.len() <= e.job {
                    jobs.push(
                        all.add(
                            ProgressBar::new(e.rounds)
                                .with_style(style("  {prefix} [{bar:12}] round {pos}/{len} {msg}")),
                        ),
                    );
                }
                let bar = &jobs[e.job];
                bar.set_prefix(e.run.to_string());
                bar.set_position(e.round);
                bar.set_message(format!(
                    "mean test accuracy {:.2}%",
                    100.0 * e.mean_test_accuracy
                ));
            }
        }
    }

    /// Leaves the overall bar as it ended and clears the jobs' bars.
    pub fn finish(self) {
        if let Bars::Drawn { total, jobs, .. } = self {
            jobs.iter().for_each(ProgressBar::finish_and_clear);
            if let Some(t) = total {
                t.finish();
            }
        }
    }
}
