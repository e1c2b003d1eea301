//! The UniFed Edge aggregator: round state machine, server strategies, durable rounds, model
//! registry and new-site onboarding.
//!
//! Nothing is implemented here yet: the federation core (issue 8) and the MQTT service
//! (issue 9) build it on the wire types of `unifed-protocol`. The crate exists so the
//! workspace has its final shape and the dependency direction (`aggregator -> protocol`, no
//! burn) is fixed from the start.
