//! `physalia`: the command line.
//!
//! Exit codes: 0 success, 1 an error (printed once as one line: the context chain joined by ": "),
//! 2 a usage error reported by the argument parser.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};

mod data;
mod dataset;
mod jobdir;
mod spec;
mod submit;

#[derive(Parser)]
#[command(name = "physalia", version, about = "Train graph neural networks on serverless GPU containers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train the job described by a job file.
    Submit(SubmitArgs),
    /// Check a job file without running it.
    Validate(ValidateArgs),
    /// Print the JSON Schema of job files (for editors).
    Schema,
    /// Import, generate and inspect datasets.
    #[command(subcommand)]
    Data(DataCommand),
}

#[derive(Args)]
struct SubmitArgs {
    /// The job file (YAML).
    job: PathBuf,
    /// Override a field of the job file, e.g. `--set train.lr=0.005` (repeatable).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
    /// `json` prints a machine-readable summary as the last line of standard output.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
    /// No per-epoch lines.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args)]
struct ValidateArgs {
    job: PathBuf,
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Turn a raw dataset folder (generic Cora-style layout or OGB node-property layout) into a dataset file.
    Import(data::ImportArgs),
    /// Generate a synthetic dataset.
    #[command(subcommand)]
    Synth(data::SynthCommand),
    /// Show a dataset file's metadata and statistics (validates it and verifies checksums).
    Inspect(data::InspectArgs),
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Submit(a) => submit::run(&a.job, &a.overrides, a.output, a.quiet),
        Command::Validate(a) => {
            let spec = spec::load(&a.job, &a.overrides)?;
            println!("{}: ok ({} {} layers, {} epochs)", a.job.display(), kind_name(&spec), spec.model.layers, spec.train.epochs);
            Ok(())
        }
        Command::Schema => {
            println!("{}", serde_json::to_string_pretty(&spec::json_schema())?);
            Ok(())
        }
        Command::Data(DataCommand::Import(a)) => data::import(&a),
        Command::Data(DataCommand::Synth(c)) => data::synth(&c),
        Command::Data(DataCommand::Inspect(a)) => data::inspect(&a),
    }
}

fn kind_name(spec: &spec::JobSpec) -> &'static str {
    match spec.model.kind {
        spec::ModelKind::Gcn => "gcn",
        spec::ModelKind::Sage => "sage",
        spec::ModelKind::Gat => "gat",
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            ExitCode::from(1)
        }
    }
}
