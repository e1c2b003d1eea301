//! Wire-level types of UniFed Edge that need neither burn nor tokio.
//!
//! Today this crate holds the **model spec**: the plain-data description of a model's tensors
//! (name, shape, and whether each belongs to a BatchNorm layer), its classes and its input
//! preprocessing, with a stable hash that every message, checkpoint and registry entry carries.
//! The federation issues add the envelope, encodings, chunking and topics here.
//!
//! # Layout
//! - [`spec`]: [`ModelSpec`], [`TensorSpec`], [`TensorKind`], [`Input`], [`SpecHash`].
//!
//! # Feature flags
//! - `std` (default): implements `std::error::Error` for the error types. Without it the crate
//!   is `#![no_std]` + `alloc`.
#![cfg_attr(not(feature = "std"), no_std)]

extern crate alloc;

pub mod spec;

pub use spec::{Input, ModelSpec, Scaling, SpecError, SpecHash, TensorKind, TensorSpec};
