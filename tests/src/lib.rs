//! End-to-end tests live in `tests/tests/`; this library holds helpers they share.
