//! Workspace-level end-to-end tests that start the real binaries (broker, aggregator, agents).
//!
//! The federation over MQTT (issue 9) adds them here; the agent's own command-line tests live in
//! `agent/tests/`.
