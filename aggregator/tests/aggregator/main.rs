//! The aggregator's integration tests, one test binary: its core, the spool, the strategies and
//! onboarding.

mod common;
mod core;
mod onboarding;
mod spool;
mod strategies;
