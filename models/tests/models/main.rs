//! The model crate's integration tests, one test binary: each module one part of the crate
//! (data, zoo, training, objectives, BN re-estimation, onboarding, CPU kernels), with the
//! helpers of `common`.

mod any_net;
mod bn_reestimation;
mod common;
mod cpu_kernels;
mod data;
mod dicom;
mod fedcd;
mod feddc;
mod fedimpro;
mod frozen;
mod moon;
mod objective;
mod onboarding;
mod perfedavg;
mod torch_fixtures;
mod training;
mod zoo_and_state;
