//! The `tracing` subscriber of the `physalia` CLI and of `physalia-worker`: one line per event on stderr,
//! which for a worker is its log file (`logs/worker-<rank>.log` on the local backend, the container's log
//! elsewhere). Without it, the mesh's `warn!` lines (refused connections) and the engine's events went
//! nowhere.
//!
//! The level: warnings by default; `PHYSALIA_LOG` (`error`, `warn`, `info`, `debug`, `trace`) overrides it
//! in any process, and the CLI's `-v` (info), `-vv` (debug), `-vvv` (trace) raise it. Physalia's own crates
//! log at that level; other crates (quinn, rustls) only from warnings up, and only from debug on with `-vv`,
//! so their chatter never mixes into a command's one-line errors.

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Names the level overriding the default in every physalia process.
pub const ENV_LOG: &str = "PHYSALIA_LOG";

/// The level for `verbose` (`-v` count): 0 warn, 1 info, 2 debug, 3+ trace; `PHYSALIA_LOG` wins when it
/// names a level.
pub fn level(verbose: u8) -> LevelFilter {
    if let Some(l) = std::env::var(ENV_LOG)
        .ok()
        .and_then(|v| v.trim().parse::<LevelFilter>().ok())
    {
        return l;
    }
    match verbose {
        0 => LevelFilter::WARN,
        1 => LevelFilter::INFO,
        2 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The filter for `level`: physalia's crates at `level`, every other crate at warnings (or at `level`
/// once it is debug or finer).
pub fn filter(level: LevelFilter) -> Targets {
    let others = if level >= LevelFilter::DEBUG {
        level
    } else {
        LevelFilter::WARN.min(level)
    };
    Targets::new()
        .with_default(others)
        .with_targets(PHYSALIA_TARGETS.iter().map(|t| (*t, level)))
}

/// The crates whose events follow the chosen level.
const PHYSALIA_TARGETS: [&str; 9] = [
    "physalia",
    "physalia_worker",
    "physalia_wire",
    "physalia_control",
    "physalia_graph",
    "physalia_gnn",
    "physalia_gnn_cuda",
    "physalia_backends",
    "physalia_planner",
];

/// Installs the subscriber (once per process; a later call does nothing): a line per event on stderr,
/// `<time> <LEVEL> <target>: <message> <fields>`.
pub fn init(verbose: u8) {
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(true);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(filter(level(verbose)))
        .try_init();
}
