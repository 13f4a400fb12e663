//! The layer rule: a module of `src/` imports only from the layers below its own, never from a
//! sibling of its layer, never from above. It reads every file's `use crate::…` lines (groups
//! included), inline `crate::a::b` paths and `super::` paths, with comments and strings
//! blanked, and names each offending line. Test modules are held to the rule too: a test that
//! needs a layer above belongs in `tests/`.
//!
//! The layers, from the bottom; see docs/architecture.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const LAYERS: &[&[&str]] = &[
    &["telemetry"],
    &["protocol"],
    &["conf"],
    &["routing"],
    &["fleet"],
    &["link"],
    &["cluster"],
    &["history"],
    &["overload"],
    &["proxy", "admin"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The source with comments, string and char literals replaced by spaces (lines kept).
fn blank(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let keep = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(keep(b[i]));
                    i += 1;
                }
            }
        } else if rest.starts_with(b"r#\"") || rest.starts_with(b"r\"") || rest.starts_with(b"br\"")
        {
            // A raw string: r"…", r#"…"#, with as many hashes at the end.
            let start = i;
            while b[i] != b'r' {
                i += 1;
            }
            i += 1;
            let mut hashes = 0;
            while b[i] == b'#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            let mut end = vec![b'"'];
            end.extend(std::iter::repeat_n(b'#', hashes));
            while i < b.len() && !b[i..].starts_with(&end) {
                i += 1;
            }
            i = (i + end.len()).min(b.len());
            out.extend(b[start..i].iter().map(|&c| keep(c)));
        } else if b[i] == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(keep(b[i]));
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if b[i] == b'\'' && (rest.starts_with(b"'\\") || rest.get(2) == Some(&b'\'')) {
            // A char literal ('x', '\n', '\''); a lifetime has no closing quote.
            let close = if rest[1] == b'\\' {
                rest[3..].iter().position(|&c| c == b'\'').map(|p| p + 3)
            } else {
                Some(2)
            };
            let n = close.map_or(1, |p| p + 1);
            out.extend(std::iter::repeat_n(b' ', n));
            i += n;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("blanking keeps ASCII")
}

fn ident_at(s: &[u8], i: usize) -> Option<&str> {
    let n = s[i..]
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
        .count();
    (n > 0).then(|| std::str::from_utf8(&s[i..i + n]).expect("ascii"))
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The top-level modules a file's code names, with the line of each: `module` is the file's
/// module path under the crate (`["fleet", "replica", "load"]` for src/fleet/replica/load.rs).
pub fn references(module: &[&str], src: &str) -> Vec<(String, usize)> {
    let text = blank(src);
    let s = text.as_bytes();
    let line_of = |i: usize| 1 + s[..i].iter().filter(|&&c| c == b'\n').count();
    let mut found = Vec::new();
    // Inline modules open as `mod name {`: each is one level deeper for `super::`.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let starts = i == 0 || !is_ident_byte(s[i - 1]) && s[i - 1] != b':';
        if c == b'{' {
            depth += 1;
            i += 1;
            continue;
        }
        if c == b'}' {
            if inline.last() == Some(&depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
            i += 1;
            continue;
        }
        if starts && s[i..].starts_with(b"mod ") {
            let mut j = i + 4;
            while s[j] == b' ' {
                j += 1;
            }
            if let Some(name) = ident_at(s, j) {
                j += name.len();
                while s.get(j) == Some(&b' ') || s.get(j) == Some(&b'\n') {
                    j += 1;
                }
                if s.get(j) == Some(&b'{') {
                    inline.push(depth + 1);
                }
            }
        }
        if starts && s[i..].starts_with(b"crate::") {
            let j = i + "crate::".len();
            if s.get(j) == Some(&b'{') {
                // A group: every path that starts at its top level.
                let mut k = j + 1;
                let mut d = 1;
                let mut expect = true;
                while k < s.len() && d > 0 {
                    match s[k] {
                        b'{' => d += 1,
                        b'}' => d -= 1,
                        b',' if d == 1 => expect = true,
                        c if d == 1 && expect && is_ident_byte(c) => {
                            let name = ident_at(s, k).expect("an identifier");
                            found.push((name.to_string(), line_of(k)));
                            expect = false;
                            k += name.len();
                            continue;
                        }
                        _ => {}
                    }
                    k += 1;
                }
                i = j;
                continue;
            }
            if let Some(name) = ident_at(s, j) {
                found.push((name.to_string(), line_of(i)));
            }
            i = j;
            continue;
        }
        if starts && s[i..].starts_with(b"super::") {
            let mut here: Vec<&str> = module.to_vec();
            // Inside inline modules `super` first climbs out of them.
            let mut climbs_inline = inline.len();
            let mut j = i;
            let mut escaped = false;
            while s[j..].starts_with(b"super::") {
                j += "super::".len();
                if climbs_inline > 0 {
                    climbs_inline -= 1;
                } else if here.pop().is_none() {
                    escaped = true;
                }
            }
            if escaped {
                found.push(("<above the crate root>".to_string(), line_of(i)));
            } else if here.is_empty() {
                if let Some(name) = ident_at(s, j) {
                    found.push((name.to_string(), line_of(i)));
                }
            }
            i = j;
            continue;
        }
        i += 1;
    }
    found
}

/// Every breach of the rule in one file, as `path:line: what`.
fn breaches(path: &str, module: &[&str], src: &str) -> Vec<String> {
    let Some(own) = module.first() else {
        return vec![]; // lib.rs declares the layers; it imports nothing.
    };
    let Some(mine) = layer_of(own) else {
        return vec![format!(
            "{path}: module `{own}` is in no layer (add it to LAYERS in tests/layers.rs)"
        )];
    };
    references(module, src)
        .into_iter()
        .filter(|(m, _)| m != own && m != "self")
        .filter_map(|(m, line)| match layer_of(&m) {
            Some(l) if l < mine => None,
            Some(l) if l == mine => Some(format!(
                "{path}:{line}: `{own}` uses `{m}`, a sibling in its layer"
            )),
            Some(_) => Some(format!(
                "{path}:{line}: `{own}` (layer {mine}) uses `{m}`, above it (layer {})",
                layer_of(&m).unwrap_or(0)
            )),
            None => Some(format!("{path}:{line}: `{own}` uses `{m}`, in no layer")),
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src is readable") {
        let p = e.expect("an entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// src/fleet/replica/load.rs → ["fleet", "replica", "load"]; a mod.rs names its folder.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

#[test]
fn every_module_imports_only_from_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut all = Vec::new();
    let mut per_layer: BTreeMap<usize, usize> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).expect("under src");
        if rel == Path::new("main.rs") {
            continue; // the binary wires every layer together
        }
        let module = module_path(rel);
        let module: Vec<&str> = module.iter().map(String::as_str).collect();
        let text = std::fs::read_to_string(f).expect("readable");
        if let Some(l) = module.first().and_then(|m| layer_of(m)) {
            *per_layer.entry(l).or_default() += 1;
        }
        all.extend(breaches(&rel.display().to_string(), &module, &text));
    }
    assert!(
        all.is_empty(),
        "the layer rule is broken:\n{}",
        all.join("\n")
    );
    // The table names real folders: a layer left empty by a rename is a stale table.
    for (l, names) in LAYERS.iter().enumerate() {
        for n in *names {
            let exists = src.join(n).is_dir() || src.join(format!("{n}.rs")).is_file();
            assert!(exists, "layer {l} names `{n}`, which src/ lacks");
        }
    }
    assert!(per_layer.len() == LAYERS.len(), "{per_layer:?}");
}

#[test]
fn the_checker_catches_each_form_of_reaching_up() {
    let fleet = ["fleet", "replica", "load"];
    let cases: &[(&str, &[&str], &str, usize)] = &[
        ("a use line", &fleet, "use crate::proxy::Balancer;\n", 1),
        ("an inline path", &fleet, "fn f() { crate::admin::Admin::new(); }\n", 1),
        (
            "a group",
            &fleet,
            "use crate::{\n    conf::Mode,\n    cluster::{Cluster, Table},\n};\n",
            1,
        ),
        ("super to the root", &fleet, "use super::super::super::overload::X;\n", 1),
        ("super above the root", &fleet, "use super::super::super::super::x;\n", 1),
        (
            "a sibling",
            &["proxy", "mod"][..1],
            "use crate::admin::Admin;\n",
            1,
        ),
        (
            "inside a test module",
            &fleet,
            "#[cfg(test)]\nmod tests {\n    use super::super::super::super::routing::x;\n    fn t() { crate::cluster::Cluster::new(); }\n}\n",
            1,
        ),
    ];
    for (what, module, src, n) in cases {
        let got = breaches("planted.rs", module, src);
        assert_eq!(got.len(), *n, "{what}: {got:?}");
    }
    // What is allowed stays quiet: downward, own module, comments, strings, super within.
    let quiet =
        "// crate::proxy is above\n/* crate::admin */\nconst S: &str = \"crate::cluster::x\";\n\
        use crate::conf::Mode;\nuse crate::fleet::index::PrefixIndex;\nuse super::Replica;\n\
        fn f<'a>(x: &'a str) -> char { crate::routing::Route::Spread; 'c' }\n\
        #[cfg(test)]\nmod tests {\n    use super::super::super::routing::Route;\n}\n";
    assert_eq!(breaches("quiet.rs", &fleet, quiet), Vec::<String>::new());
    // A module the table does not know is a breach too.
    assert_eq!(breaches("x.rs", &["newthing"], "").len(), 1);
}
