//! The import graph of flashover-parallel's top-level modules (issue "Layers you can read").
//!
//! Each `crate::module` path in a file under `src/module...` is an edge; modules that reach
//! each other through edges form a loop. The library has none: each module imports only the
//! layers below it (docs/architecture.md, "Layers"), and this test fails, naming the modules,
//! when a change closes a loop.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every `.rs` file under `dir`, with its path.
fn sources(dir: &Path, out: &mut Vec<(std::path::PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("a source file");
            out.push((path, text));
        }
    }
}

/// `text` without its `//` comments (doc links name modules without importing them).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a file's code names through `crate::`: `crate::a::..` and each item
/// of `crate::{a::.., b}`.
fn named_modules(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut named = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        match rest.strip_prefix('{') {
            None => {
                named.insert(ident(rest));
            }
            Some(group) => {
                // Items at the group's top level, up to its closing brace.
                let (mut depth, mut item_start) = (0usize, true);
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => item_start = true,
                        c if item_start && !c.is_whitespace() => {
                            named.insert(ident(&group[i..]));
                            item_start = false;
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    named
}

/// The modules on import loops of `edges` (strongly connected components of more than one).
fn looped(edges: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    let reaches = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for next in edges.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|m| (m, reaches(m))).collect();
    edges
        .keys()
        .filter(|m| {
            reach[m]
                .iter()
                .any(|other| other != *m && reach[other].contains(*m))
        })
        .cloned()
        .collect()
}

#[test]
fn no_top_level_module_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    sources(&src, &mut files);
    let module_of = |path: &Path| -> Option<String> {
        let first = path.strip_prefix(&src).ok()?.components().next()?;
        let name = first.as_os_str().to_str()?;
        let name = name.strip_suffix(".rs").unwrap_or(name);
        (name != "lib").then(|| name.to_string())
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| module_of(p)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (path, text) in &files {
        let Some(from) = module_of(path) else {
            continue;
        };
        for to in named_modules(&code(text)) {
            if to != from && modules.contains(&to) {
                edges.get_mut(&from).expect("a module").insert(to);
            }
        }
    }
    // Imports the parse must find: a `use crate::m::{..}` group and a `crate::m::item` path.
    assert!(
        edges["nn"].contains("placed") && edges["expert_parallel"].contains("moe"),
        "the parse finds nn -> placed (a group) and expert_parallel -> moe (a path)"
    );
    let found = looped(&edges);
    assert!(
        found.is_empty(),
        "flashover-parallel's top-level modules import each other in a loop: {found:?}. Each \
         module imports only the layers below it (docs/architecture.md, \"Layers\"): move what \
         both need down, or pass it as a trait"
    );
}
