//! How an agent reports what it does: a progress bar for local training on a terminal, and, for
//! a supervising process such as the demo (environment `UNIFED_REPORT=1`), one line per event
//! on stdout: the prefix `@unifed ` and a JSON [`Report`] (the contract of `unifed_net::report`).

pub use unifed_net::report::{PREFIX, Phase, Report};

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
        TrainEvent::Trained => bar.set_message("encoding the update"),
    }
}
