//! Benchmarks are driven by `bench/run.sh`; see `bench/README.md`.
