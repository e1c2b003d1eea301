//! The burn side of UniFed Edge: a model zoo with client-specific BatchNorm, the BN/non-BN
//! partition of a model's tensors, local training and evaluation, BN statistics re-estimation,
//! and datasets (including a built-in multi-domain digits dataset).
//!
//! # Quick start
//! ```no_run
//! use unifed_models::{backend::Backend, zoo::{ModelConfig, Net, spec_of, DigitsCnnConfig}};
//! use unifed_models::state::{export, Select};
//! let device = Backend::Flex.device().unwrap();
//! let cfg = ModelConfig::fedbn_digits();
//! let net = DigitsCnnConfig::default().init(&device);
//! let spec = spec_of(&net, &cfg.classes, &cfg.input);
//! assert_eq!(spec.non_bn_params(), 14_213_578);
//! let non_bn = export(&net, &spec, Select::NonBn);
//! ```
//!
//! # Layout
//! - [`zoo`]: the models and the [`zoo::Net`] trait (`features` / `head`).
//! - [`net`]: the [`net::Net`] trait every model implements (re-exported by [`zoo`]).
//! - [`bn`]: the BN hook every model's layers go through.
//! - [`calibrate`]: BN re-estimation over a whole model (`stream` batches, `calibrate`).
//! - [`state`]: flat named `f32` tensors in PyTorch names; export, import, delta, apply non-BN.
//! - [`checkpoint`]: safetensors files (PyTorch-compatible).
//! - [`train`]: local SGD training and evaluation with a progress hook.
//! - [`objective`]: local objectives' gradient terms (FedProx's proximal term).
//! - [`client`]: each algorithm's part on a site (its state, what its term needs, what it sends
//!   beside the delta), one module per algorithm, chosen by the round's plan.
//! - [`data`]: image folders, CSV manifests, MNIST IDX, built-in domains, site partitioner.
//! - [`site`]: one federated site (apply a broadcast, train, encode its update).
//! - [`worker`]: the site driver's worker over a [`site::Site`] (one for the agent and the
//!   in-process runner), with a [`worker::Host`] for what a process adds.
//! - [`backend`]: device selection and the CPU thread cap.
//!
//! # Feature flags
//! - `flex` (default): burn's portable CPU backend.
//! - `wgpu`, `vulkan`: GPU through wgpu (Vulkan/Metal/WebGPU; Vulkan only).
//! - `cuda`: NVIDIA CUDA.

pub mod backend;
pub mod bn;
pub mod calibrate;
pub mod checkpoint;
pub mod client;
pub mod data;
pub mod decoupled;
pub mod error;
pub mod invariant;
mod memory;
pub mod net;
pub mod objective;
mod park;
pub mod site;
pub mod state;
pub mod train;
mod update;
pub mod worker;
pub mod zoo;
