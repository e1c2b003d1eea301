//! The aggregator's integration tests, one test binary: its core, the spool, the strategies and
//! onboarding.

mod cli;
mod common;
mod core;
mod onboarding;
mod spool;
mod strategies;
