//! Control and data messages, tensor framing, QUIC endpoints and collectives.
//!
//! Empty on purpose until partition-parallel training lands (issue 3): a single worker exchanges nothing.
//! See `docs/ARCHITECTURE.md` for what this crate will own.
