//! The module layering issue 29 asked for, held: no import circle among the coordinator crate's modules
//! (the core and its drivers) nor among the CLI's. A module's imports are the `crate::a::b` and
//! `super::x` paths of its non-test code; a child naming its parent module (`super::Observer`) is not a
//! circle with the parent that declares it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name (`driver::platform`) -> its source, for every `.rs` under `root`.
fn modules(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            // the non-test part, without line comments
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let code: String = code
                .lines()
                .map(|l| l.split("//").next().unwrap())
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(parts.join("::"), code);
        }
    }
    out
}

/// The modules each module imports (`crate::` paths resolved to their longest module prefix, `super::`
/// paths to a sibling).
fn imports(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut edges = BTreeMap::new();
    for (name, code) in mods {
        let mut to = BTreeSet::new();
        for (i, _) in code.match_indices("crate::") {
            let path: String = code[i + 7..].chars().take_while(|&c| ident(c)).collect();
            let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            if let Some(m) = (1..=segs.len())
                .rev()
                .map(|k| segs[..k].join("::"))
                .find(|m| mods.contains_key(m))
                && m != *name
            {
                to.insert(m);
            }
        }
        let parent: Vec<&str> = name.split("::").collect();
        for (i, _) in code.match_indices("super::") {
            let seg: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let sibling = [&parent[..parent.len().saturating_sub(1)], &[seg.as_str()]]
                .concat()
                .join("::");
            if !seg.is_empty() && mods.contains_key(&sibling) && sibling != *name {
                to.insert(sibling);
            }
        }
        edges.insert(name.clone(), to);
    }
    edges
}

/// A circle among the modules, if any: depth-first from each module.
fn circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            return Some(path[i..].to_vec());
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in &edges[m] {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|m| visit(m, edges, &mut Vec::new(), &mut done))
}

#[test]
fn the_coordinator_and_the_cli_have_no_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in [root.join("src"), root.join("../orchestrator/src")] {
        let mods = modules(&src);
        assert!(mods.len() > 5, "{}: {} modules", src.display(), mods.len());
        let edges = imports(&mods);
        assert_eq!(circle(&edges), None, "{}", src.display());
    }
}

/// The check finds a circle where there is one (two modules importing each other), so the test above
/// can fail.
#[test]
fn a_circle_is_found() {
    let mods: BTreeMap<String, String> = [
        ("a".to_string(), "use crate::b::X;".to_string()),
        ("b".to_string(), "fn f() { crate::a::g() }".to_string()),
        ("c".to_string(), "use crate::a;".to_string()),
    ]
    .into();
    let edges = imports(&mods);
    assert_eq!(circle(&edges), Some(vec!["a".to_string(), "b".to_string()]));
    let acyclic: BTreeMap<String, String> = [
        ("a".to_string(), "use crate::b::X;".to_string()),
        ("b".to_string(), String::new()),
    ]
    .into();
    assert_eq!(circle(&imports(&acyclic)), None);
}
