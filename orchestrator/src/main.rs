//! `physalia`: the command line.
//!
//! Exit codes: 0 success, 1 an error (printed once as one line: the context chain joined by ": "),
//! 2 a usage error reported by the argument parser.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Large buffers start on a cache line, so a gathered row of a width-16 matrix is one line, not two
/// (issue 34): local workers are this binary's `worker` subcommand, and repeated seeds train in it, so
/// they get the allocator `physalia-worker` has.
#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

mod calibrate;
mod data;
mod find;
mod jobs;
mod output;
mod plan;
mod progress;
mod replay;
mod report;
mod submit;

// the coordinator library's modules, under the names the commands use (`crate::spec`, ...)
use physalia_coordinator::driver::{cluster, image, workers};
use physalia_coordinator::{elastic, job, jobdir, spec, store};

use output::{OutputFormat, Terminal};

#[derive(Parser)]
#[command(
    name = "physalia",
    version,
    about = "Train graph neural networks on serverless GPU containers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Show more of what happens, live on stderr: `-v` info, `-vv` debug, `-vvv` trace (warnings are
    /// always shown; PHYSALIA_LOG=LEVEL sets the level too).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

#[derive(Subcommand)]
enum Command {
    /// Train the job described by a job file.
    Submit(SubmitArgs),
    /// Check a job file without running it.
    Validate(ValidateArgs),
    /// Show how the planner would run a job: the chosen mode, worker count and container type with
    /// predicted memory, time and cost, the best alternatives, and why the others were rejected.
    Plan(plan::PlanArgs),
    /// Measure this machine's engine and loopback network once, for `physalia plan --calibration`.
    Calibrate(calibrate::CalibrateArgs),
    /// The jobs recorded in a folder of job directories, oldest first.
    List(jobs::ListArgs),
    /// What a job is doing, from its record: state, epoch, workers, cost so far, last epoch's numbers.
    Status(jobs::StatusArgs),
    /// A job's coordinator log, or a worker's output with `--rank`; `--follow` until it ends.
    Logs(jobs::LogsArgs),
    /// Stop a running job: its coordinator stops every worker and records it as cancelled (a job whose
    /// coordinator is gone is cleaned up here).
    Cancel(jobs::CancelArgs),
    /// Write a self-contained HTML report of a job directory: curves, workers, bytes, cost, scaling events.
    Report(report::ReportArgs),
    /// Build the worker container image (for `backend: docker`) from the physalia-worker beside this binary.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Print the JSON Schema of job files (for editors).
    Schema,
    /// Import, generate, inspect and partition datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Run one worker of a job (started by the coordinator with the job in its environment; see
    /// `physalia_control::env`).
    #[command(hide = true)]
    Worker,
    /// Coordinate a cluster-mode job from its store (started by `submit` on the platform, next to the
    /// workers; see `cluster.rs`).
    #[command(hide = true)]
    Coordinate(CoordinateArgs),
}

#[derive(Args)]
struct CoordinateArgs {
    /// The job in its store: `STORE_URL/JOB_ID`.
    job_url: String,
    /// The UDP port of the control endpoint, the one the coordinator's platform object declares.
    #[arg(long, default_value_t = physalia_coordinator::driver::platform::COORDINATOR_PORT)]
    control_port: u16,
    /// Continue the job from its newest checkpoint in the store (`submit --resume STORE/JOB`).
    #[arg(long)]
    resume: bool,
}

#[derive(Args)]
struct SubmitArgs {
    /// The job file (YAML).
    #[arg(required_unless_present = "resume")]
    job: Option<PathBuf>,
    /// Continue the job in this job directory from its newest checkpoint instead (its coordinator died or
    /// was stopped); a cluster-mode job by its URL in the job store, `STORE/JOB_ID`.
    #[arg(long, value_name = "JOB_DIR|JOB_URL", conflicts_with_all = ["job", "overrides"])]
    resume: Option<PathBuf>,
    /// Override a field of the job file, e.g. `--set train.lr=0.005` (repeatable).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
    /// Run on this platform instead of the job file's `backend.name` (the file's section for it applies).
    #[arg(long, value_name = "NAME", conflicts_with = "resume", value_parser = crate::backend_arg())]
    backend: Option<spec::BackendKind>,
    /// `json` prints a machine-readable summary as the last line of standard output.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
    /// No per-epoch lines.
    #[arg(long, short)]
    quiet: bool,
    /// Launch even when the planner predicts the job does not fit in this machine's memory.
    #[arg(long)]
    skip_memory_check: bool,
    /// Cluster mode: return once the coordinator runs, printing the job's id and how to follow it.
    #[arg(long)]
    detach: bool,
}

#[derive(Args)]
struct ValidateArgs {
    job: PathBuf,
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
    /// Validate for this platform instead of the job file's `backend.name`, as `submit --backend`
    /// would run it (its section, and in cluster mode what `submit` asks of it).
    #[arg(long, value_name = "NAME", value_parser = crate::backend_arg())]
    backend: Option<spec::BackendKind>,
    /// A catalog of further SKUs (as `physalia plan --catalog` takes): checked to be readable and valid.
    #[arg(long, value_name = "FILE")]
    catalog: Option<PathBuf>,
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Build (or find) `physalia-worker:<hash>` with no registry: a runtime base from this machine's
    /// libraries, then worker-image/Dockerfile. `--cuda`: `physalia-worker:<hash>-cuda` for GPU workers.
    Build(ImageBuildArgs),
    /// Build (or find) the image as `image build` does, then push it to REGISTRY through the Docker
    /// Engine (log it in first: `docker login`); prints the pushed reference, the `image` of a job
    /// file's kubernetes, ecs or aci section.
    Push(ImagePushArgs),
}

#[derive(Args)]
struct ImagePushArgs {
    /// The registry and optional path, no scheme: `123456789012.dkr.ecr.us-east-1.amazonaws.com`,
    /// `ghcr.io/team`, `myregistry.azurecr.io`. The image goes there as `physalia-worker:<tag>`.
    registry: String,
    #[command(flatten)]
    image: ImageBuildArgs,
}

#[derive(Args)]
struct ImageBuildArgs {
    /// The CUDA image (worker-image/Dockerfile.cuda): the same runtime base plus NVRTC and cuBLAS from
    /// NVIDIA's PyPI wheels, which `pip download` fetches once into ~/.cache/physalia/wheels
    /// (PHYSALIA_WHEEL_CACHE elsewhere). No base image is pulled.
    #[arg(long)]
    cuda: bool,
    /// The worker image with the `physalia` CLI added (worker-image/Dockerfile.cli): the coordinator's
    /// image in cluster mode (`backend.*.coordinator_image`, by default the worker `image`), which also
    /// runs workers. Tagged `physalia-worker:<hash>-cli`.
    #[arg(long, conflicts_with = "cuda")]
    with_cli: bool,
    /// Tag the image NAME:TAG instead of `physalia-worker:<hash>[-cuda]` (an image already under it is
    /// kept).
    #[arg(long, value_name = "NAME:TAG")]
    tag: Option<String>,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Turn a raw dataset folder (generic Cora-style layout or OGB node-property layout) into a dataset file.
    Import(data::ImportArgs),
    /// Generate a synthetic dataset.
    #[command(subcommand)]
    Synth(data::SynthCommand),
    /// Show a dataset file's metadata and statistics (validates it and verifies checksums), and the
    /// partition sets stored beside it.
    Inspect(data::InspectArgs),
    /// Split a dataset into k parts per worker (METIS), stored beside it and reused while it is unchanged.
    Partition(data::PartitionArgs),
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Submit(a) => match (&a.resume, &a.job) {
            (Some(dir), _) if store::is_url(dir) => cluster::resume(
                &dir.to_string_lossy(),
                &Terminal::new(a.output, a.quiet),
                a.detach,
            ),
            (Some(dir), _) => submit::resume(dir, a.output, a.quiet, !a.skip_memory_check),
            (None, Some(job)) => submit::run(
                job,
                &a.overrides,
                a.backend,
                a.output,
                a.quiet,
                !a.skip_memory_check,
                a.detach,
            ),
            (None, None) => unreachable!("clap requires a job file or --resume"),
        },
        Command::Plan(a) => plan::run(&a),
        Command::Calibrate(a) => calibrate::run(&a),
        Command::Report(a) => report::run(&a),
        Command::List(a) => jobs::list(&a),
        Command::Status(a) => jobs::status(&a),
        Command::Logs(a) => jobs::logs(&a),
        Command::Cancel(a) => jobs::cancel(&a),
        Command::Image(ImageCommand::Build(a)) => {
            println!("{}", build_or_find_image(&a)?);
            Ok(())
        }
        Command::Image(ImageCommand::Push(a)) => {
            let local = build_or_find_image(&a.image)?;
            let remote = image::push_image(&local, &a.registry)?;
            if let Some(digest) = image::pushed_digest(&remote) {
                eprintln!("pushed {local} as {remote} ({digest})");
            }
            println!("{remote}");
            Ok(())
        }
        Command::Validate(a) => {
            let spec = spec::load_on(&a.job, &a.overrides, a.backend)?;
            // what `submit` refuses in cluster mode before it creates anything (the store's URL, the
            // platform's coordinator settings)
            if spec.backend.mode() == spec::Mode::Cluster {
                cluster::check_settings(&spec).with_context(|| a.job.display().to_string())?;
            }
            // what `submit` would open first: the dataset must be there and readable
            if let Some(path) = &spec.dataset.path {
                readable(path).with_context(|| {
                    format!("{}: dataset.path: {}", a.job.display(), path.display())
                })?;
            }
            // the scaling policy file was read by `spec::load` (a missing one names `scaling_file`)
            if let Some(path) = &a.catalog {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("--catalog: {}: cannot read", path.display()))?;
                let extra =
                    physalia_planner::Catalog::from_yaml_str(&text, &path.display().to_string())
                        .with_context(|| format!("--catalog: {}", path.display()))?;
                physalia_planner::Catalog::builtin()
                    .merge(extra)
                    .with_context(|| format!("--catalog: {}", path.display()))?;
            }
            println!(
                "{}: ok ({} {} layers, {} epochs)",
                a.job.display(),
                spec.model.kind.as_str(),
                spec.model.layers,
                spec.train.epochs
            );
            Ok(())
        }
        Command::Schema => {
            let text = serde_json::to_string_pretty(&spec::json_schema())?;
            let mut out = std::io::stdout().lock();
            // a closed pipe (`physalia schema | head`) is the reader's choice, not an error
            match writeln!(out, "{text}") {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                r => Ok(r?),
            }
        }
        Command::Data(DataCommand::Import(a)) => data::import(&a),
        Command::Data(DataCommand::Synth(c)) => data::synth(&c),
        Command::Data(DataCommand::Inspect(a)) => data::inspect(&a),
        Command::Data(DataCommand::Partition(a)) => data::partition(&a),
        // exit codes as physalia-worker's: 1 an error (also reported to the coordinator), 3 stopped
        Command::Worker => physalia_worker::run::run_from_env(),
        Command::Coordinate(a) => cluster::coordinate(
            &a.job_url,
            a.control_port,
            a.resume,
            &Terminal::new(OutputFormat::Text, false),
        ),
    }
}

/// `physalia image build`'s image: found, or built from the physalia-worker (and physalia) beside this
/// binary; its local reference.
/// `--backend NAME`: one of the platforms, listed in `--help` and in the error for another name.
pub(crate) fn backend_arg() -> impl clap::builder::TypedValueParser<Value = spec::BackendKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(spec::BackendKind::ALL.map(|b| b.as_str()))
        .map(|name| name.parse().expect("one of the possible values"))
}

fn build_or_find_image(a: &ImageBuildArgs) -> Result<String> {
    let worker = workers::worker_binary()?;
    let obs = &Terminal::new(OutputFormat::Text, false);
    if a.with_cli {
        let cli = std::env::current_exe().context("locating the physalia executable")?;
        return image::ensure_cli_image(&worker, &cli, a.tag.as_deref(), obs);
    }
    match (a.cuda, &a.tag) {
        (true, None) => image::ensure_cuda_image(&worker, obs),
        (true, Some(t)) => image::ensure_cuda_image_tagged(&worker, t, obs),
        (false, None) => image::ensure_image(&worker, obs),
        (false, Some(t)) => image::ensure_image_tagged(&worker, t, obs),
    }
}

/// A file that opens for reading, or a folder that lists.
fn readable(path: &std::path::Path) -> std::io::Result<()> {
    if std::fs::metadata(path)?.is_dir() {
        std::fs::read_dir(path).map(|_| ())
    } else {
        std::fs::File::open(path).map(|_| ())
    }
}

/// Keeps freed memory in the process instead of returning it to the OS.
///
/// Training allocates the same large activation buffers every epoch. glibc serves allocations above 32 MiB
/// with fresh `mmap`s and unmaps them on free, so every epoch would page-fault its whole working set in again
/// (a quarter of a 1M-node epoch on this VM). Serving them from the heap and never trimming it makes the
/// second epoch reuse the first epoch's pages. The price: a buffer freed for good stays resident as a hole
/// the next, larger buffer may not fit in, so the engine trims at those points
/// (`physalia_gnn::heap::release_freed_memory`, e.g. once GCN's `A X` is cached) and the coordinator after
/// partitioning (`physalia_coordinator::driver::distributed`).
fn keep_freed_memory() {
    // SAFETY: mallopt only tunes allocator parameters; it is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// The error and its causes joined by ": ", skipping a cause whose text an outer message already
/// includes (library errors often print their source themselves).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out.replace('\n', " ")
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    physalia_worker::logging::init(cli.verbose);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(1)
        }
    }
}
