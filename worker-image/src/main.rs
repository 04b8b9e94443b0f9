//! `physalia-worker`: the process each worker runs. It is started by the coordinator (`physalia submit`
//! with `workers` above 1) with its rank, the job and the coordinator's address in its environment; see
//! [`physalia_worker::run`].
//!
//! Exit codes: 0 trained and reported, 1 an error (printed on stderr, also reported to the coordinator),
//! 3 stopped by the coordinator or lost it.

fn main() {
    if let Err(e) = physalia_worker::run::run_from_env() {
        eprintln!("physalia-worker: error: {e:#}");
        std::process::exit(1);
    }
}
