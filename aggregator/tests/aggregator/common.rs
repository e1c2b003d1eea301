//! What the test modules share: the run of the aggregator a test opened, which the messages
//! they build are signed in.

use unifed_aggregator::Aggregator;

thread_local! {
    /// The run of the aggregator this test opened last: the messages the helpers build are of it.
    static RUN: std::cell::Cell<unifed_protocol::RunId> = Default::default();
}

/// `agg`, whose run the helpers' messages take from now on.
pub fn opened(agg: Aggregator) -> Aggregator {
    RUN.with(|r| r.set(agg.run()));
    agg
}

/// The run of the aggregator the test opened last.
pub fn this_run() -> unifed_protocol::RunId {
    RUN.with(|r| r.get())
}
