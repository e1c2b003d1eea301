//! The simulator's integration tests, one test binary: encodings, experiments and the in-process
//! runner.

mod encodings;
mod experiment;
mod in_process;
