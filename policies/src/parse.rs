//! Reading a policy from YAML text, with every error placed at its file, line and column.

use std::borrow::Cow;

use serde::de::DeserializeOwned;

use crate::error::{Location, PolicyError, PolicyErrors, one_line};
use crate::schema::PolicySet;

/// Parses and checks a policy from YAML `text`; `origin` names the text in messages (a file
/// name). On failure, returns every problem found, each with `origin:line:column`: the first
/// YAML or schema problem if there is one, otherwise every semantic problem of [`crate::check`].
pub fn parse_str(text: &str, origin: &str) -> Result<PolicySet, PolicyErrors> {
    let policy = saphyr_parse::<PolicySet>(text).map_err(|raw| PolicyError::Parse {
        origin: one_line(origin),
        location: raw.location,
        path: raw.path,
        message: raw.message,
    })?;
    let problems = crate::check::check(&policy);
    if problems.is_empty() {
        Ok(policy)
    } else {
        Err(PolicyErrors(crate::locate::locate(
            problems, text, origin, "",
        )))
    }
}

/// A deserialization failure before it is tied to a file.
pub(crate) struct RawError {
    pub location: Option<Location>,
    pub path: String,
    pub message: String,
}

fn options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.with_snippet = false;
    options
}

/// Deserializes `text` into `T`, keeping the parser's location and the failing field's path.
pub(crate) fn saphyr_parse<T: DeserializeOwned>(text: &str) -> Result<T, RawError> {
    let mut path = String::new();
    let result =
        serde_saphyr::with_deserializer_from_str_with_options(text, options(), |deserializer| {
            serde_path_to_error::deserialize::<_, T>(deserializer).map_err(|e| {
                let text = e.path().to_string();
                path = if text == "." { String::new() } else { text };
                e.into_inner()
            })
        });
    result.map_err(|e| RawError {
        location: e.location().and_then(|l| {
            Some(Location {
                line: u32::try_from(l.line()).ok().filter(|l| *l > 0)?,
                column: u32::try_from(l.column()).ok().filter(|c| *c > 0)?,
            })
        }),
        path: one_line(&path),
        message: one_line(&message(&e)),
    })
}

/// The message of a saphyr error without its location suffix or snippet.
fn message(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::MessageFormatter as _;
    let message: Cow<'_, str> =
        serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet());
    message.into_owned()
}
