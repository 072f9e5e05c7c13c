//! Imports point only downward: the layer list at the top of `src/lib.rs` is read, and every
//! `crate::` path in the library's non-test code must name a module of its own layer or a
//! lower one. Every module `lib.rs` declares must be in exactly one layer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Module -> layer (1 = lowest), from the numbered list of `lib.rs`'s docs.
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.strip_prefix("//! ") else {
            continue;
        };
        let Some((num, rest)) = rest.split_once(". ") else {
            continue;
        };
        let Ok(layer) = num.parse::<usize>() else {
            continue;
        };
        let names = rest.split(':').next().unwrap_or("");
        for name in names.split(',') {
            let name = name.trim().trim_matches('`');
            assert!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "layer {layer} of lib.rs names `{name}`, not a module"
            );
            let before = out.insert(name.to_string(), layer);
            assert!(before.is_none(), "{name} is in two layers of lib.rs");
        }
    }
    out
}

/// The top-level modules `lib.rs` declares.
fn declared(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .chain(lib.lines().filter_map(|l| l.trim().strip_prefix("mod ")))
        .map(|m| m.trim_end_matches(';').to_string())
        .collect()
}

/// The text of a source file without comments, string and char literals and
/// `#[cfg(test)]` items.
fn code(text: &str) -> String {
    without_test_items(&without_literals(text))
}

fn without_literals(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if text[i..].starts_with("//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if text[i..].starts_with("/*") {
            i += text[i..].find("*/").map_or(b.len() - i, |e| e + 2);
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            // '\n', '\'', '\u{..}'
            i += 3 + text[i + 3..].find('\'').map_or(b.len(), |e| e + 1);
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3; // 'x' (a lifetime has no closing quote)
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn without_test_items(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("#[cfg(test)]") {
        out.push_str(&text[i..i + at]);
        i += at;
        // Skip the item: to the end of its block, or of its statement.
        let rest = &text[i..];
        match (rest.find('{'), rest.find(';')) {
            (Some(o), s) if s.is_none_or(|s| o < s) => {
                let mut depth = 0;
                let mut j = i + o;
                while j < b.len() {
                    match b[j] {
                        b'{' => depth += 1,
                        b'}' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                i = (j + 1).min(b.len());
            }
            (_, Some(s)) => i += s + 1,
            _ => i = b.len(),
        }
    }
    out.push_str(&text[i..]);
    out
}

/// The top-level modules a piece of code names through `crate::` (paths and `use` groups).
fn imports(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::X, b, c::{..}}`: the first name of each top-level member.
            let (mut depth, mut member) = (0, true);
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => member = true,
                    _ if member && !c.is_whitespace() => {
                        out.push(ident(&group[k..]));
                        member = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// `(file, importing module, imported module)` for every import of a higher layer.
fn violations(
    files: &[(String, String)],
    layer: &BTreeMap<String, usize>,
) -> Vec<(String, String, String)> {
    let mut bad = Vec::new();
    for (path, text) in files {
        let top = path
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let own = *layer
            .get(&top)
            .unwrap_or_else(|| panic!("{path}: module `{top}` is in no layer of lib.rs"));
        for m in imports(&code(text)) {
            let Some(&l) = layer.get(&m) else {
                continue; // an item of lib.rs itself (`crate::VERSION`)
            };
            if l > own {
                bad.push((path.clone(), top.clone(), m));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The library's source files outside test code (`tests.rs`, `tests/`), relative to src/.
fn library_sources(src: &Path) -> Vec<(String, String)> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    let mut files = Vec::new();
    for p in paths {
        let rel = p
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let test_code = rel.ends_with("/tests.rs") || rel.contains("/tests/");
        // The binary (main.rs, cli/) sits above every layer.
        let binary = rel == "main.rs" || rel.starts_with("cli/");
        if rel == "lib.rs" || test_code || binary {
            continue;
        }
        files.push((rel, std::fs::read_to_string(&p).unwrap()));
    }
    files
}

#[test]
fn imports_point_only_to_the_same_or_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let layer = layers(&lib);
    let mut mods = declared(&lib);
    mods.sort();
    let mut listed: Vec<String> = layer.keys().cloned().collect();
    listed.sort();
    assert_eq!(
        mods, listed,
        "the modules lib.rs declares and the ones its layer list names differ"
    );
    let files = library_sources(&src);
    assert!(files.len() > 50, "only {} source files found", files.len());
    let bad = violations(&files, &layer);
    let lines: Vec<String> = bad
        .iter()
        .map(|(f, a, b)| {
            format!(
                "{f}: `{a}` (layer {}) imports `{b}` (layer {})",
                layer[a], layer[b]
            )
        })
        .collect();
    assert!(bad.is_empty(), "imports pointing up:\n{}", lines.join("\n"));
}

/// The checker itself: upward paths in `use` lines, groups and expressions are found;
/// comments, strings, test modules and lower layers are not.
#[test]
fn the_checker_finds_upward_imports_and_only_them() {
    let lib = "//! Layers:\n//! 1. `kernels`, `kv`: low.\n//! 2. `model`: middle.\n//! 3. `server`: top.\npub mod kernels;\npub mod kv;\npub mod model;\nmod server;\n";
    let layer = layers(lib);
    assert_eq!(layer["kv"], 1);
    assert_eq!(layer["server"], 3);
    assert_eq!(declared(lib).len(), 4);
    let file = |p: &str, t: &str| (p.to_string(), t.to_string());
    let files = [
        file(
            "kernels/matmul.rs",
            "use crate::kv::X;\nfn f() { crate::model::ops::g(); }\n",
        ),
        file(
            "kv/mod.rs",
            "use crate::{kernels::pool, model::{A, B}};\n// crate::server in a comment\nconst S: &str = \"crate::server\";\n",
        ),
        file(
            "model/mod.rs",
            "use crate::kv::KvCache;\n#[cfg(test)]\nmod tests {\n    use crate::server::X;\n    fn f() { { '}' } }\n}\nfn g<'a>(c: char) { if c == '\"' { crate::server::h() } }\n",
        ),
        file("server/mod.rs", "use crate::{model, kernels::*};\n"),
    ];
    let got = violations(&files, &layer);
    let want = [
        ("kernels/matmul.rs", "kernels", "model"),
        ("kv/mod.rs", "kv", "model"),
        ("model/mod.rs", "model", "server"),
    ]
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()));
    assert_eq!(got, want.to_vec());
}
