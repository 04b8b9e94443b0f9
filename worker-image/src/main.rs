//! `physalia-worker`: the process each worker runs. It is started by the coordinator (`physalia submit`
//! with `workers` above 1) with its rank, the job and the coordinator's address in its environment; see
//! [`physalia_worker::run`].
//!
//! Exit codes: 0 trained and reported, 1 an error (printed on stderr, also reported to the coordinator),
//! 3 stopped by the coordinator or lost it.

/// Large buffers start on a cache line, so a gathered row of a width-16 matrix is one line, not two (issue 34).
#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;

fn main() {
    // the image's health check: the binary loads and runs
    if std::env::args().nth(1).as_deref() == Some("--health") {
        println!("physalia-worker {}: ok", env!("CARGO_PKG_VERSION"));
        return;
    }
    // the init container of platforms that inject secrets as environment values (ecs)
    if std::env::args().nth(1).as_deref() == Some("unpack-secrets") {
        match physalia_worker::secrets::unpack_from_env() {
            Ok(names) => println!("physalia-worker: unpacked {}", names.join(", ")),
            Err(e) => {
                eprintln!("physalia-worker unpack-secrets: error: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    // Epochs free and reallocate the same large buffers; glibc would return them to the OS and fault them
    // back in every epoch. Keep freed memory in the heap, as the `physalia` CLI does (peak memory is the
    // working set either way).
    // SAFETY: mallopt only tunes allocator parameters; it is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
    // stderr is the worker's log file: the mesh's refusals and every warning land there
    physalia_worker::logging::init(0);
    if let Err(e) = physalia_worker::run::run_from_env() {
        eprintln!("physalia-worker: error: {e:#}");
        std::process::exit(1);
    }
}
