//! Why a policy was rejected: one error per problem, each naming the file, line and column.
//!
//! A policy file is checked in two passes. The YAML parser and the schema stop at the first
//! problem ([`PolicyError::Parse`]); the semantic checks of [`crate::check`] go on and report
//! every problem they find ([`PolicyError::Invalid`]). Semantic errors name the field by its
//! path (`rules[1].when`), and [`crate::locate`] turns that path back into a line and column
//! of the text, plus the offset inside a CEL condition when the problem is there.

use std::fmt;

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

/// One problem with a policy. Every message is a single line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// The text is not YAML, or it does not fit the schema (unknown field, wrong type, missing
    /// field, unknown action). Parsing stops at the first such problem.
    #[error("{}{message}", prefix(Some(origin), *location, path))]
    Parse {
        /// What the text is called in messages (a file name).
        origin: String,
        /// Where the parser stopped, when it knows.
        location: Option<Location>,
        /// Dotted path of the offending field (`rules[0].then`); empty for the document root.
        path: String,
        message: String,
    },
    /// The policy fits the schema but a value is wrong: a CEL condition that does not parse or
    /// reads an unknown metric, `min_workers` above `max_workers`, an action out of range.
    #[error("{}{message}", prefix(origin.as_deref(), *location, path))]
    Invalid {
        /// `None` from [`crate::check`]; filled in by [`crate::parse_str`] and [`crate::locate`].
        origin: Option<String>,
        /// Line and column in the text, once located.
        location: Option<Location>,
        /// Dotted path of the offending field (`rules[1].when`); empty for the document root.
        path: String,
        /// For a problem inside a CEL condition: where in the condition (1-based line and
        /// column of the expression itself). [`crate::locate`] adds it to the field's position.
        in_condition: Option<Location>,
        message: String,
    },
}

impl PolicyError {
    /// Line and column in the text, when known.
    pub fn location(&self) -> Option<Location> {
        match self {
            PolicyError::Parse { location, .. } | PolicyError::Invalid { location, .. } => {
                *location
            }
        }
    }

    /// Dotted path of the offending field; empty for the document root.
    pub fn path(&self) -> &str {
        match self {
            PolicyError::Parse { path, .. } | PolicyError::Invalid { path, .. } => path,
        }
    }

    /// The problem, without file, position or path.
    pub fn message(&self) -> &str {
        match self {
            PolicyError::Parse { message, .. } | PolicyError::Invalid { message, .. } => message,
        }
    }

    pub(crate) fn invalid(path: impl Into<String>, message: impl Into<String>) -> Self {
        PolicyError::Invalid {
            origin: None,
            location: None,
            path: path.into(),
            in_condition: None,
            message: one_line(&message.into()),
        }
    }

    pub(crate) fn in_condition(
        path: impl Into<String>,
        at: Option<Location>,
        message: impl Into<String>,
    ) -> Self {
        PolicyError::Invalid {
            origin: None,
            location: None,
            path: path.into(),
            in_condition: at,
            message: one_line(&message.into()),
        }
    }
}

fn prefix(origin: Option<&str>, location: Option<Location>, path: &str) -> String {
    let mut out = String::new();
    if let Some(origin) = origin {
        out.push_str(origin);
        if let Some(location) = location {
            out.push_str(&format!(":{location}"));
        }
        out.push_str(": ");
    } else if let Some(location) = location {
        out.push_str(&format!("{location}: "));
    }
    if !path.is_empty() {
        out.push_str(path);
        out.push_str(": ");
    }
    out
}

/// Every problem found in one policy, in the order of the text; never empty when returned
/// as an error.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl PolicyErrors {
    /// The errors, in the order of the text.
    pub fn errors(&self) -> &[PolicyError] {
        &self.0
    }
}

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PolicyErrors {}

impl From<PolicyError> for PolicyErrors {
    fn from(error: PolicyError) -> Self {
        PolicyErrors(vec![error])
    }
}

/// Escapes control characters so that text from a file cannot break the one-line shape of a
/// message.
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
