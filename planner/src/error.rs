//! Why the planner said no: a catalog or profile that does not parse or check (with file, line
//! and column), a request with a value out of range, or a well-formed request that no candidate
//! satisfies ([`PlanError::Infeasible`], an expected outcome with one reason per candidate class).

use std::fmt;

use crate::search::ClassReason;

/// A 1-based line and column (in characters) of a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    pub line: u32,
    pub column: u32,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// Everything that can go wrong in the planner. Messages are one line each, lowercase, with
/// no final period; [`PlanError::Infeasible`] lists its reasons on the lines after the first.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A catalog or calibration text that is not YAML, does not fit the schema, or holds a
    /// value out of range (a negative price, an unknown backend, a duplicate SKU name).
    #[error("{}{message}", prefix(origin, *location, path))]
    Parse {
        /// What the text is called in messages (a file name).
        origin: String,
        /// Where the problem is, when known.
        location: Option<Location>,
        /// Dotted path of the offending field (`skus[2].price.usd_per_hour`); empty for the root.
        path: String,
        message: String,
    },
    /// A request value out of range (`graph.nodes: must be at least 1`).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// Nothing fits: one reason per candidate class (mode and SKU), each the rejection of the
    /// candidate of that class that came closest.
    #[error("{}", infeasible_message(reasons))]
    Infeasible { reasons: Vec<ClassReason> },
}

impl PlanError {
    /// Line and column in the text, for [`PlanError::Parse`] when known.
    pub fn location(&self) -> Option<Location> {
        match self {
            PlanError::Parse { location, .. } => *location,
            _ => None,
        }
    }

    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        PlanError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

fn prefix(origin: &str, location: Option<Location>, path: &str) -> String {
    let mut out = origin.to_string();
    if let Some(l) = location {
        out.push_str(&format!(":{l}"));
    }
    out.push_str(": ");
    if !path.is_empty() {
        out.push_str(path);
        out.push_str(": ");
    }
    out
}

fn infeasible_message(reasons: &[ClassReason]) -> String {
    let mut out = format!(
        "no plan fits: every candidate was rejected ({} candidate classes)",
        reasons.len()
    );
    for r in reasons {
        out.push_str("\n  ");
        out.push_str(&r.to_string());
    }
    out
}

/// `text` with control characters escaped, so that a message stays on one line.
pub(crate) fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}
