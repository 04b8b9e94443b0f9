//! From a field path (`rules[1].when`) back to a line and column of the YAML text.
//!
//! The text is read a second time into a tree of [`serde_saphyr::Spanned`] nodes that keeps
//! where every value starts. A problem inside a CEL condition is then placed by walking the
//! condition and its source side by side: the parsed string differs from the source only by
//! quotes, escapes, indentation and folded line breaks, which the walk skips.

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::error::{Location, PolicyError, one_line};

/// A YAML value with where each part starts.
#[derive(Debug)]
enum Node {
    Str(String),
    Other,
    Seq(Vec<Spanned<Node>>),
    Map(Vec<(String, Spanned<Node>)>),
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Node, E> {
        Ok(Node::Str(v.to_string()))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_none<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        Node::deserialize(d)
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        Node::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Node>>()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(Key(key)) = map.next_key::<Key>()? {
            entries.push((key, map.next_value::<Spanned<Node>>()?));
        }
        Ok(Node::Map(entries))
    }
}

/// A mapping key as text; keys that are not scalars become `?` (no field of ours is one).
struct Key(String);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a mapping key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Key, E> {
                Ok(Key("?".to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Key, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Key("?".to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Key, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Key("?".to_string()))
            }
        }
        deserializer.deserialize_any(KeyVisitor)
    }
}

fn spanned_location(node: &Spanned<Node>) -> Option<Location> {
    let location = node.referenced;
    let line = u32::try_from(location.line()).ok().filter(|l| *l > 0)?;
    let column = u32::try_from(location.column()).ok().filter(|c| *c > 0)?;
    Some(Location { line, column })
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

/// `rules[1].when` as `rules`, `1`, `when`.
fn segments(path: &str) -> Vec<Segment<'_>> {
    let mut out = Vec::new();
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (key, mut rest) = part.split_once('[').map_or((part, ""), |(k, r)| (k, r));
        if !key.is_empty() {
            out.push(Segment::Key(key));
        }
        while let Some((index, tail)) = rest.split_once(']') {
            if let Ok(i) = index.parse() {
                out.push(Segment::Index(i));
            }
            rest = tail.strip_prefix('[').unwrap_or(tail);
        }
    }
    out
}

/// The node at `path` under `root`, or the deepest one on the way there.
fn find<'n>(root: &'n Spanned<Node>, path: &str) -> &'n Spanned<Node> {
    let mut node = root;
    for segment in segments(path) {
        let next = match (&node.value, segment) {
            (Node::Map(entries), Segment::Key(key)) => {
                entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
            }
            (Node::Seq(items), Segment::Index(i)) => items.get(i),
            _ => None,
        };
        match next {
            Some(next) => node = next,
            None => break,
        }
    }
    node
}

/// Places the errors of a policy found in `text`, which holds the policy at the dotted path
/// `under` (`""` for a policy file, `"scaling"` for the section of a job file). Sets each
/// error's origin and line and column, prefixes its path with `under`, and returns the errors
/// in the order of the text. Errors whose place cannot be found keep no location.
pub fn locate(errors: Vec<PolicyError>, text: &str, origin: &str, under: &str) -> Vec<PolicyError> {
    let origin = one_line(origin);
    let root = crate::parse::saphyr_parse::<Spanned<Node>>(text).ok();
    let mut errors: Vec<PolicyError> = errors
        .into_iter()
        .map(|error| match error {
            PolicyError::Invalid {
                location,
                path,
                in_condition,
                message,
                ..
            } => {
                let full = join(under, &path);
                let found = root.as_ref().map(|root| find(root, &full));
                let location = location.or_else(|| {
                    let node = found?;
                    let start = spanned_location(node)?;
                    Some(match (&node.value, in_condition) {
                        (Node::Str(scalar), Some(at)) => {
                            within_scalar(text, start, scalar, at).unwrap_or(start)
                        }
                        _ => start,
                    })
                });
                PolicyError::Invalid {
                    origin: Some(origin.clone()),
                    location,
                    path: full,
                    in_condition,
                    message,
                }
            }
            PolicyError::Parse {
                location,
                path,
                message,
                ..
            } => PolicyError::Parse {
                origin: origin.clone(),
                location,
                path: join(under, &path),
                message,
            },
        })
        .collect();
    // Stable: errors at one place keep the order the checks found them in.
    errors.sort_by_key(|e| {
        e.location()
            .map_or((u32::MAX, u32::MAX), |l| (l.line, l.column))
    });
    errors
}

fn join(under: &str, path: &str) -> String {
    match (under.is_empty(), path.is_empty()) {
        (true, _) => path.to_string(),
        (false, true) => under.to_string(),
        (false, false) if path.starts_with('[') => format!("{under}{path}"),
        (false, false) => format!("{under}.{path}"),
    }
}

/// Where the character at `at` (line and column inside `scalar`, the parsed string) was
/// written in `text`, given that the scalar's source starts at `start`.
fn within_scalar(text: &str, start: Location, scalar: &str, at: Location) -> Option<Location> {
    let target = char_index(scalar, at)?;
    // The source from `start` on, with each character's line and column.
    let line_start = text
        .split_inclusive('\n')
        .take(usize::try_from(start.line).ok()?.checked_sub(1)?)
        .map(str::len)
        .sum::<usize>();
    let mut source = text
        .get(line_start..)?
        .chars()
        .skip(usize::try_from(start.column).ok()?.checked_sub(1)?);
    let (mut line, mut column) = (start.line, start.column);
    // Give up rather than wander off into the rest of the file.
    let mut budget = 4 * scalar.len() + 256;
    let mut last_matched = start;
    for (i, wanted) in scalar.chars().enumerate() {
        loop {
            let c = source.next()?;
            budget = budget.checked_sub(1)?;
            let here = Location { line, column };
            if c == '\n' {
                line = line.saturating_add(1);
                column = 1;
            } else {
                column = column.saturating_add(1);
            }
            if c == wanted {
                if i == target {
                    return Some(here);
                }
                last_matched = Location { line, column };
                break;
            }
        }
    }
    // The end of the condition (an error at end of input).
    Some(last_matched)
}

/// Index (in characters) of the 1-based `at` in `s`; the length of `s` for just past its end.
fn char_index(s: &str, at: Location) -> Option<usize> {
    let (mut line, mut column) = (1u32, 1u32);
    for (i, c) in s.chars().enumerate() {
        if line == at.line && column == at.column {
            return Some(i);
        }
        if c == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    Some(s.chars().count())
}
