//! Progress on the terminal (indicatif) for the steps that take a while before training starts: importing
//! or generating a dataset, writing it, partitioning it, and building the worker image. Shown only when
//! standard error is a terminal, so logs, pipes and tests see no bar at all.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Whether bars are drawn: standard error is a terminal.
pub(crate) fn shown() -> bool {
    std::io::stderr().is_terminal()
}

/// A spinner with the elapsed time while `f` runs ("partitioning into 4 parts 3s"); cleared after.
pub(crate) fn step<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let bar = spinner(what);
    let out = f();
    bar.finish_and_clear();
    out
}

pub(crate) fn spinner(what: &str) -> ProgressBar {
    if !shown() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner().with_message(what.to_string());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bar over `total` bytes ("importing the runtime base [====>   ] 12 MiB/40 MiB"); hidden off a
/// terminal. The caller advances it (e.g. `ProgressBar::wrap_read`) and finishes it.
pub(crate) fn bytes(what: &str, total: u64) -> ProgressBar {
    if !shown() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total).with_message(what.to_string());
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}
