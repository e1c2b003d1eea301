//! The aggregator's integration tests, one test binary: its core, the spool, the strategies and
//! onboarding.

mod core;
mod onboarding;
mod spool;
mod strategies;
