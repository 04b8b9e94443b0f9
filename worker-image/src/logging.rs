//! The `tracing` subscriber of the `physalia` CLI and of `physalia-worker`: one line per event on stderr,
//! which for a worker is its log file (`logs/worker-<rank>.log` on the local backend, the container's log
//! elsewhere). Without it, the mesh's `warn!` lines (refused connections) and the engine's events went
//! nowhere.
//!
//! The level: warnings by default; `PHYSALIA_LOG` (`error`, `warn`, `info`, `debug`, `trace`) overrides it
//! in any process, and the CLI's `-v` (info), `-vv` (debug), `-vvv` (trace) raise it. Physalia's own crates
//! log at that level; other crates (quinn, rustls) only from warnings up, and only from debug on with `-vv`,
//! so their chatter never mixes into a command's one-line errors.
//!
//! Warnings and errors also go two more ways, whatever the level: a worker [`forward`]s them to its
//! coordinator over its control connection (its log file may be a container's, read only when the
//! container ends), which writes them into `logs/coordinator.log` and shows them live with `-v`; and a
//! coordinator [`tee`]s its own into `logs/coordinator.log`.

use std::io::Write;
use std::sync::Mutex;

use tracing::Level;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
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
const PHYSALIA_TARGETS: [&str; 10] = [
    "physalia",
    "physalia_coordinator",
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
/// `<time> <LEVEL> <target>: <message> <fields>`, and warnings and errors to [`forward`] and [`tee`].
pub fn init(verbose: u8) {
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(true);
    let forwarded = tracing_subscriber::fmt::layer()
        .with_writer(Forwarder)
        .with_ansi(false)
        .without_time()
        .with_level(false)
        .with_target(true)
        .with_filter(LevelFilter::WARN);
    let teed = tracing_subscriber::fmt::layer()
        .with_writer(Teed)
        .with_ansi(false)
        .with_target(true)
        .with_filter(LevelFilter::WARN);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(forwarded)
        .with(teed)
        .with(filter(level(verbose)))
        .try_init();
}

/// Where a process's warnings and errors go besides stderr: nowhere yet (kept, up to [`PENDING_LINES`]),
/// or a sink.
enum Forward {
    Pending(Vec<(Level, String)>),
    To(Sink),
}

/// Takes (level, line); see [`forward`].
type Sink = Box<dyn Fn(Level, &str) + Send>;

/// Warnings kept for a sink not set yet (a worker warns before its control connection exists); later
/// ones are dropped from the forwarding, not from stderr.
pub const PENDING_LINES: usize = 32;

static FORWARD: Mutex<Forward> = Mutex::new(Forward::Pending(Vec::new()));

/// Hands every warning and error of this process, from now on and the ones kept before, to `sink` as
/// (level, `target: message fields`). The sink runs on the thread that logged, under a lock: it must not
/// wait or log.
pub fn forward(sink: impl Fn(Level, &str) + Send + 'static) {
    let mut f = FORWARD.lock().unwrap_or_else(|p| p.into_inner());
    if let Forward::Pending(kept) = &*f {
        for (level, line) in kept {
            sink(*level, line);
        }
    }
    *f = Forward::To(Box::new(sink));
}

/// What the forwarding layer writes an event into: sent whole when the formatter drops it.
struct ForwardLine {
    level: Level,
    buf: Vec<u8>,
}

impl Write for ForwardLine {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for ForwardLine {
    fn drop(&mut self) {
        let line = String::from_utf8_lossy(&self.buf);
        let line = line.trim_end();
        if line.is_empty() {
            return;
        }
        let mut f = FORWARD.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *f {
            Forward::To(sink) => sink(self.level, line),
            Forward::Pending(kept) if kept.len() < PENDING_LINES => {
                kept.push((self.level, line.to_string()))
            }
            Forward::Pending(_) => {}
        }
    }
}

struct Forwarder;

impl<'a> MakeWriter<'a> for Forwarder {
    type Writer = ForwardLine;
    fn make_writer(&'a self) -> ForwardLine {
        ForwardLine {
            level: Level::WARN,
            buf: Vec::new(),
        }
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> ForwardLine {
        ForwardLine {
            level: *meta.level(),
            buf: Vec::new(),
        }
    }
}

static TEE: Mutex<Option<std::fs::File>> = Mutex::new(None);

/// Appends this process's warnings and errors (stderr's lines) to `file` as well, until the next call;
/// `None` stops it. The coordinator tees into `logs/coordinator.log` while it runs a job.
pub fn tee(file: Option<std::fs::File>) {
    *TEE.lock().unwrap_or_else(|p| p.into_inner()) = file;
}

struct Teed;

/// One event's line, written to the tee file whole when the formatter drops it.
struct TeeLine(Vec<u8>);

impl Write for TeeLine {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for TeeLine {
    fn drop(&mut self) {
        if let Some(f) = &mut *TEE.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = f.write_all(&self.0);
        }
    }
}

impl<'a> MakeWriter<'a> for Teed {
    type Writer = TeeLine;
    fn make_writer(&'a self) -> TeeLine {
        TeeLine(Vec::new())
    }
}
