//! Every decoder that reads bytes from outside, behind one entry point per input kind: the fuzz targets
//! (`fuzz/fuzz_targets/*.rs`, libFuzzer through cargo-fuzz) and the corpus replay test
//! (`tests/tests/fuzz_corpus.rs`, which runs in CI without a fuzzer) call exactly these functions.
//!
//! Each entry point takes arbitrary bytes, runs the decoder and whatever validation the product runs on
//! what it decoded, and returns `Ok` or the decoder's error as text. What must never happen, whatever the
//! bytes: a panic, an abort (an allocation the input asked for), or a hang. File decoders get the bytes in a
//! file (the product opens paths), written to a scratch file per process and per kind.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The job file parser.
pub use physalia_coordinator::spec;

/// One input kind of the fuzzing harness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A mesh or control frame: header and payload as they arrive on a stream.
    Frame,
    /// A control message's JSON (worker <-> coordinator), also inside a control frame.
    Control,
    /// A dataset file (`physalia data import` output): opened, checksums verified, contents validated.
    Dataset,
    /// A stored partition set's `partition.safetensors`.
    Partitioning,
    /// A stored part file (`partK.safetensors`).
    Part,
    /// A training checkpoint (`checkpoints/epoch-N.safetensors`).
    Checkpoint,
    /// A job file (YAML).
    JobFile,
    /// A scaling policy file (YAML).
    Policy,
    /// A price catalog (`physalia plan --catalog`).
    Catalog,
    /// A part delta (`partitions/prep<L>-k<K>/delta<R>.bin`: what a worker applies to the part it holds
    /// at an in-place resize).
    PartDelta,
}

impl Kind {
    pub const ALL: [Kind; 10] = [
        Kind::Frame,
        Kind::Control,
        Kind::Dataset,
        Kind::Partitioning,
        Kind::Part,
        Kind::Checkpoint,
        Kind::JobFile,
        Kind::Policy,
        Kind::Catalog,
        Kind::PartDelta,
    ];

    /// The fuzz target's name, which is also its corpus folder under `fuzz/corpus/`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Frame => "frame",
            Kind::Control => "control",
            Kind::Dataset => "dataset",
            Kind::Partitioning => "partitioning",
            Kind::Part => "part",
            Kind::Checkpoint => "checkpoint",
            Kind::JobFile => "job_file",
            Kind::Policy => "policy",
            Kind::Catalog => "catalog",
            Kind::PartDelta => "part_delta",
        }
    }

    /// Runs this kind's decoder on `data`.
    pub fn decode(self, data: &[u8]) -> Result<(), String> {
        match self {
            Kind::Frame => frame(data),
            Kind::Control => control(data),
            Kind::Dataset => dataset(data),
            Kind::Partitioning => partitioning(data),
            Kind::Part => part(data),
            Kind::Checkpoint => checkpoint(data),
            Kind::JobFile => job_file(data),
            Kind::Policy => policy(data),
            Kind::Catalog => catalog(data),
            Kind::PartDelta => part_delta(data),
        }
    }
}

fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A part delta as a worker reads it (the file the coordinator serves), with the input-halo rows it
/// carries checked. Applying it sizes a map by the header's node count, which only the coordinator
/// writes; the decoder itself allocates no more than the bytes it holds.
pub fn part_delta(data: &[u8]) -> Result<(), String> {
    let path = scratch("part_delta", data)?;
    physalia_worker::delta::PartDelta::read(&path)
        .and_then(|d| d.halo_rows())
        .map(|_| ())
        .map_err(|e| format!("{e:#}"))
}

/// A frame: the header (magic, version, phase, dtype, lengths), then the payload as its phase reads it:
/// control JSON, or tensor values widened to f32.
pub fn frame(data: &[u8]) -> Result<(), String> {
    use physalia_wire::{Frame, FrameHeader, Phase};
    // the header alone, as the stream readers decode it before reading a payload
    if data.len() >= physalia_wire::HEADER_LEN {
        FrameHeader::decode(&data[..physalia_wire::HEADER_LEN]).map_err(text)?;
    }
    let f = Frame::decode(data).map_err(text)?;
    f.validate().map_err(text)?;
    if f.header.phase == Phase::Control {
        control_json(&f.payload)
    } else {
        f.to_f32().map(|_| ()).map_err(text)
    }
}

/// A control message as JSON: every message type either side reads.
pub fn control(data: &[u8]) -> Result<(), String> {
    control_json(data)
}

fn control_json(data: &[u8]) -> Result<(), String> {
    use physalia_control::transfer::{Reply, Request};
    use physalia_control::{ToCoordinator, ToWorker};
    let a = serde_json::from_slice::<ToCoordinator>(data).map(|_| ());
    let b = serde_json::from_slice::<ToWorker>(data).map(|_| ());
    let c = serde_json::from_slice::<Request>(data).map(|_| ());
    let d = serde_json::from_slice::<Reply>(data).map(|_| ());
    a.or(b).or(c).or(d).map_err(text)
}

/// `data` in this process's scratch file for `kind`, so decoders that open paths read it.
fn scratch(kind: &str, data: &[u8]) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("physalia-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(text)?;
    let path = dir.join(format!("{kind}.safetensors"));
    let mut f = std::fs::File::create(&path).map_err(text)?;
    f.write_all(data).map_err(text)?;
    Ok(path)
}

fn in_file(
    kind: &str,
    data: &[u8],
    read: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    let path = scratch(kind, data)?;
    read(&path)
}

/// A dataset file: `Dataset::open` (header, dtypes, shapes, checksums, content validation), then the
/// statistics and splits every command reads.
pub fn dataset(data: &[u8]) -> Result<(), String> {
    in_file("dataset", data, |p| {
        let ds = physalia_graph::Dataset::open(p).map_err(text)?;
        let _ = ds.stats();
        let _ = ds.features_f32();
        for s in physalia_graph::Split::ALL {
            let _ = ds.split(s);
        }
        Ok(())
    })
}

/// A partition set's assignment file.
pub fn partitioning(data: &[u8]) -> Result<(), String> {
    in_file("partitioning", data, |p| {
        physalia_graph::partition::load_partitioning(p)
            .map(|_| ())
            .map_err(text)
    })
}

/// A part file.
pub fn part(data: &[u8]) -> Result<(), String> {
    in_file("part", data, |p| {
        physalia_graph::partition::Part::load(p)
            .map(|_| ())
            .map_err(text)
    })
}

/// A checkpoint: configuration, optimizer state and weights.
pub fn checkpoint(data: &[u8]) -> Result<(), String> {
    in_file("checkpoint", data, |p| {
        physalia_gnn::save::load_checkpoint(p)
            .map(|_| ())
            .map_err(text)
    })
}

/// A job file, parsed and validated as `physalia validate` does (without reading the files it names).
pub fn job_file(data: &[u8]) -> Result<(), String> {
    let s = std::str::from_utf8(data).map_err(text)?;
    spec::parse_str(s, "fuzz.yaml", &[])
        .map(|_| ())
        .map_err(text)
}

/// A scaling policy file: parsed, then checked.
pub fn policy(data: &[u8]) -> Result<(), String> {
    let s = std::str::from_utf8(data).map_err(text)?;
    let p = physalia_policies::parse_str(s, "fuzz.yaml").map_err(text)?;
    let errors = physalia_policies::check(&p);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(physalia_policies::locate(errors, s, "fuzz.yaml", "")
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; "))
    }
}

/// A price catalog, parsed and merged into the built-in one.
pub fn catalog(data: &[u8]) -> Result<(), String> {
    let s = std::str::from_utf8(data).map_err(text)?;
    let extra = physalia_planner::Catalog::from_yaml_str(s, "fuzz.yaml").map_err(text)?;
    physalia_planner::Catalog::builtin()
        .merge(extra)
        .map(|_| ())
        .map_err(text)
}
