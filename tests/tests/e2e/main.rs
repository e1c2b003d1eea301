//! The end-to-end tests, one test binary (one link of the real binaries' crates instead of one
//! per file): each module runs the broker, `unifed-aggregator` and `unifed-agent` processes for
//! one part of the system, one test at a time (`unifed_e2e::serial`).

mod any_model;
mod auth;
mod common;
mod evaluate;
mod every_algorithm;
mod faults;
mod federation;
mod floods;
mod hostile;
mod mtls;
mod onboarding;
mod outcomes;
mod package;
mod provision;
mod side;
mod strategies;
mod tls;
