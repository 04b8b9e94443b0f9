//! The crate's single error type.
//!
//! Every variant that comes from a file carries its `path`, and where it makes sense the tensor, field or
//! line, so a message alone tells the user which input to fix and what was expected. Messages are lowercase
//! with no final period.

use std::path::PathBuf;

/// Everything that can go wrong while importing, generating, validating, writing or opening a dataset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed at the OS level.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is not a readable safetensors file (bad header, truncated, trailing bytes).
    #[error("{}: not a valid dataset file: {reason}", path.display())]
    NotSafetensors { path: PathBuf, reason: String },

    /// The `physalia` metadata JSON is missing, malformed, unsupported or inconsistent.
    #[error("{}: metadata: {problem}", path.display())]
    Metadata { path: PathBuf, problem: String },

    /// A tensor is missing, has the wrong dtype or shape, or its contents break an invariant.
    #[error("{}: tensor '{tensor}': {problem}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        problem: String,
    },

    /// A tensor's bytes do not hash to the checksum recorded in the metadata.
    #[error(
        "{}: tensor '{tensor}': checksum mismatch: metadata says {expected}, contents hash to {actual}",
        path.display()
    )]
    Checksum {
        path: PathBuf,
        tensor: String,
        expected: String,
        actual: String,
    },

    /// A line of a text input (CSV, txt, gzipped CSV) could not be used. `line` is 1-based.
    #[error("{}:{line}: {problem}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },

    /// An input file (or directory) is unusable as a whole: missing, wrong size, bad header, inconsistent
    /// with the other inputs.
    #[error("{}: {problem}", path.display())]
    Input { path: PathBuf, problem: String },

    /// A generator or importer parameter is out of its valid range.
    #[error("invalid parameter '{param}': {problem}")]
    Param {
        param: &'static str,
        problem: String,
    },

    /// A partitioning does not fit the graph it is applied to, or METIS failed on it.
    #[error("partitioning: {problem}")]
    Partition { problem: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn input(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Input {
            path: path.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn line(path: impl Into<PathBuf>, line: usize, problem: impl Into<String>) -> Self {
        Error::Line {
            path: path.into(),
            line,
            problem: problem.into(),
        }
    }

    pub(crate) fn tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        problem: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            tensor: tensor.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn metadata(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Metadata {
            path: path.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn partition(problem: impl Into<String>) -> Self {
        Error::Partition {
            problem: problem.into(),
        }
    }

    pub(crate) fn param(param: &'static str, problem: impl Into<String>) -> Self {
        Error::Param {
            param,
            problem: problem.into(),
        }
    }
}
