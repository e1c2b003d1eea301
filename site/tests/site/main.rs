//! The site engine's and driver's integration tests, one test binary.

mod common;
mod driver;
mod engine;
