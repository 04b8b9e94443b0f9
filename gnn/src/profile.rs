//! Where an epoch's time goes, kernel by kernel: wall time and calls per [`Cpu`](crate::Cpu) operation,
//! summed over the process while profiling is on. Off by default, and then a span costs one relaxed load.
//!
//! Spans wrap the device operations the layers call from the training thread (each one a parallel kernel),
//! never the work inside a rayon task, so their times add up to the epoch and nest only where one operation
//! is composed of others (a layer-level operation calling a primitive is counted under both names).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<Vec<(&'static str, f64, u64)>> = Mutex::new(Vec::new());

/// Whether profiling is on: an engine whose operations run asynchronously (the GPU's) waits for its queue
/// around each span only then, so the span measures the work, not its launch.
#[inline]
pub fn on() -> bool {
    ON.load(Relaxed)
}

/// Starts counting (and forgets what was counted).
pub fn enable() {
    TOTALS.lock().expect("profile lock").clear();
    ON.store(true, Relaxed);
}

/// Stops counting and returns `(operation, seconds, calls)`, most time first.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    ON.store(false, Relaxed);
    let mut v = std::mem::take(&mut *TOTALS.lock().expect("profile lock"));
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// Times from now until dropped, under `name`, while profiling is on.
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
}

#[inline]
pub fn span(name: &'static str) -> Span {
    Span {
        name,
        start: ON.load(Relaxed).then(Instant::now),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(t0) = self.start else { return };
        let s = t0.elapsed().as_secs_f64();
        let mut totals = TOTALS.lock().expect("profile lock");
        match totals.iter_mut().find(|(n, _, _)| *n == self.name) {
            Some(e) => {
                e.1 += s;
                e.2 += 1;
            }
            None => totals.push((self.name, s, 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_only_while_enabled() {
        drop(span("profile-test-before"));
        enable();
        drop(span("profile-test"));
        drop(span("profile-test"));
        let t = take();
        drop(span("profile-test-after"));
        let names: Vec<_> = t.iter().map(|e| e.0).collect();
        assert!(names.contains(&"profile-test"));
        assert!(!names.contains(&"profile-test-before"));
        let e = t.iter().find(|e| e.0 == "profile-test").expect("counted");
        assert_eq!(e.2, 2);
    }
}
