//! The module map at the top of `src/lib.rs` is true: every top-level module uses only modules
//! to its left in the map's chain, so the module graph has no circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The chain of `lib.rs`'s map: each step's modules, in order.
fn the_maps_chain(lib: &str) -> Vec<Vec<String>> {
    let doc: String = lib
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!"))
        .collect::<Vec<_>>()
        .join(" ");
    let start = doc
        .find("`secret` ->")
        .expect("the map's chain starts at `secret`");
    let end = start
        + doc[start..]
            .find('.')
            .expect("the chain ends with a full stop");
    doc[start..end]
        .split("->")
        .map(|step| {
            step.split(',')
                .map(|m| m.trim().trim_matches('`').to_owned())
                .collect()
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules each module's code (its tests left out) names as `crate::<module>`.
fn uses(src: &Path, modules: &BTreeSet<String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut uses = BTreeMap::new();
    for module in modules {
        let mut files = Vec::new();
        let dir = src.join(module);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        }
        let file = src.join(format!("{module}.rs"));
        if file.is_file() {
            files.push(file);
        }
        let used: &mut BTreeSet<String> = uses.entry(module.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            // `crate::x` and `crate::{x, y::z}`.
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + "crate::".len()..];
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group[..group.find('}').unwrap_or(group.len())]
                        .split(',')
                        .map(|n| n.trim().split("::").next().unwrap_or_default())
                        .collect(),
                    None => vec![
                        rest.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                            .next()
                            .unwrap_or_default(),
                    ],
                };
                for name in names {
                    if name != module && modules.contains(name) {
                        used.insert(name.to_owned());
                    }
                }
            }
        }
    }
    uses
}

#[test]
fn every_module_uses_only_modules_left_of_it_in_the_map() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let chain = the_maps_chain(&lib);
    let step: BTreeMap<String, usize> = chain
        .iter()
        .enumerate()
        .flat_map(|(i, modules)| modules.iter().map(move |m| (m.clone(), i)))
        .collect();
    let declared: BTreeSet<String> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').to_owned())
        .collect();
    let unmapped: Vec<_> = declared.iter().filter(|m| !step.contains_key(*m)).collect();
    assert!(
        unmapped.is_empty(),
        "modules missing from the map: {unmapped:?}"
    );

    let mut wrong = Vec::new();
    for (module, used) in uses(&root.join("src"), &declared) {
        for other in used {
            if step[&other] >= step[&module] {
                wrong.push(format!("{module} uses {other}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "against the map's direction (lib.rs): {wrong:?}"
    );
}

/// The tables whose SQL lives in one context only, and that context: the others read them
/// through the owner's functions or the view it publishes for them (`order_money`).
const OWNED_TABLES: &[(&str, &str)] = &[
    ("orders", "orders"),
    ("subscriptions", "orders"),
    ("jobs", "the queue crate"),
];

#[test]
fn a_table_is_written_and_read_by_its_owner_alone() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut wrong = Vec::new();
    for file in files {
        let relative = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        // The binary's tools (bench, demo, soak) read what they measure, show and check.
        if [
            "bench",
            "demo.rs",
            "main.rs",
            "cli.rs",
            "soak",
            "scratch.rs",
        ]
        .iter()
        .any(|b| relative.starts_with(b))
        {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let words: Vec<&str> = code
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        for (table, owner) in OWNED_TABLES {
            if relative.starts_with(&format!("{owner}/")) {
                continue;
            }
            let named = words
                .windows(2)
                .any(|w| ["FROM", "JOIN", "UPDATE", "INTO"].contains(&w[0]) && w[1] == *table);
            if named {
                wrong.push(format!(
                    "{relative} names the {table} table, owned by {owner}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
}
