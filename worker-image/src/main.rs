//! `physalia-worker`: the process each worker container runs.
//!
//! Until multi-worker training lands (issue 3) the single local worker runs inside `physalia submit`
//! itself, so this binary only says so instead of pretending to join a mesh.

fn main() {
    eprintln!(
        "physalia-worker: multi-worker execution is not built yet; `physalia submit` trains with one in-process worker"
    );
    std::process::exit(2);
}
