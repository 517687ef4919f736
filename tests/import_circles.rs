//! No import circle anywhere in the tree (issue 42): the modules of the planner, the runtime and
//! the CLI form a directed acyclic graph, so each shared type has a home below its users.
//!
//! The graph is read from the source, one node per file (a directory's `mod.rs` is that module):
//! every `use` and every inline `crate::…` or `super::…` path is an edge from the file that
//! writes it to the file that defines what it names. A name that a module only re-exports (`pub
//! use`) is followed to its definition, and a `pub use` itself is no edge: it names, it does not
//! depend. A module naming its own submodule is containment, not an import, and is no edge
//! either (`mod.rs` calling its child while the child reads the parent's types is the ordinary
//! shape of a Rust module). Test modules (`tests.rs`, `*_tests.rs`, anything under
//! `#[cfg(test)]`) may import siblings freely and are left out.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use petgraph::algo::tarjan_scc;
use petgraph::graph::DiGraph;

/// A module's path below its crate root (`[]` is `lib.rs` or `main.rs`).
type Module = Vec<String>;

/// Circles allowed for now, as the sorted module names of their strongly connected component:
/// a failure names any other circle, and any change to these. None is left.
const ALLOWED: &[(&str, &[&str])] = &[];

#[derive(Default)]
struct File {
    /// Names the file defines (functions, types, constants, modules).
    defs: BTreeSet<String>,
    /// `pub use` names: what each one re-exports, as written.
    reexports: HashMap<String, Vec<Vec<String>>>,
    /// Every other path it writes that starts at `crate`, `super`, `self` or a child module.
    imports: Vec<Vec<String>>,
}

struct Tree {
    files: BTreeMap<Module, File>,
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn module_of(root: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(root).unwrap().with_extension("");
    let mut m: Module = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if m.last().is_some_and(|l| l == "mod") || (m.len() == 1 && (m[0] == "lib" || m[0] == "main")) {
        m.pop();
    }
    m
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// A line without its leading visibility (`pub`, `pub(crate)`, …), and whether it had one.
fn after_vis(line: &str) -> (&str, bool) {
    let line = line.trim_start();
    match line.strip_prefix("pub") {
        Some(r) if r.starts_with('(') => {
            (r.split_once(')').map_or(r, |(_, r)| r).trim_start(), true)
        }
        Some(r) if r.starts_with(' ') => (r.trim_start(), true),
        _ => (line, false),
    }
}

/// The `mod NAME` a line declares (`None` if it declares none), and whether it opens a block.
fn declared_mod(line: &str) -> Option<(String, bool)> {
    let name = after_vis(line).0.strip_prefix("mod ")?.trim();
    let ident: String = name.chars().take_while(|&c| is_ident(c)).collect();
    Some((ident, name.ends_with('{')))
}

/// The file's code without line comments and `#[cfg(test)]` items, and the test-only child
/// modules it declares (`#[cfg(test)] mod name;`).
fn strip(src: &str) -> (String, Vec<String>) {
    let (mut code, mut test_mods) = (String::new(), Vec::new());
    let (mut cfg_test, mut skip_depth) = (false, 0i64);
    for raw in src.lines() {
        let line = raw.find("//").map_or(raw, |i| &raw[..i]);
        if skip_depth > 0 {
            skip_depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
            continue;
        }
        let t = line.trim();
        if t == "#[cfg(test)]" {
            cfg_test = true;
            continue;
        }
        if cfg_test && t.starts_with("#[") {
            continue;
        }
        if cfg_test {
            cfg_test = false;
            if let Some((name, block)) = declared_mod(t) {
                if block {
                    skip_depth =
                        line.matches('{').count() as i64 - line.matches('}').count() as i64;
                } else {
                    test_mods.push(name);
                }
                continue;
            }
        }
        code.push_str(line);
        code.push('\n');
    }
    (code, test_mods)
}

/// `a::{b, c::{d, e as f}}` as `[a::b, a::c::d, a::c::e as f]`.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        if !tree.is_empty() {
            out.push(format!("{prefix}{tree}"));
        }
        return;
    };
    let head = format!("{prefix}{}", &tree[..open]);
    let close = tree.rfind('}').filter(|&c| c > open);
    let inner = &tree[open + 1..close.unwrap_or_else(|| panic!("unbalanced `use {tree}`"))];
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&head, &inner[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    expand(&head, &inner[start..], out);
}

fn segments(path: &str) -> Vec<String> {
    path.split("::")
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The name a line defines, if it starts an item.
fn defined(line: &str) -> Option<String> {
    const KEYWORDS: [&str; 10] = [
        "fn",
        "struct",
        "enum",
        "const",
        "static",
        "type",
        "trait",
        "union",
        "mod",
        "macro_rules!",
    ];
    let mut words = line.split_whitespace().peekable();
    while let Some(w) = words.next() {
        if w.starts_with("pub") || ["unsafe", "async", "extern", "\"C\""].contains(&w) {
            continue;
        }
        if w == "const" && words.peek() == Some(&"fn") {
            continue;
        }
        if !KEYWORDS.contains(&w) {
            return None;
        }
        let name: String = words.next()?.chars().take_while(|&c| is_ident(c)).collect();
        return (!name.is_empty()).then_some(name);
    }
    None
}

fn parse(code: &str) -> File {
    let mut file = File::default();
    let mut rest = String::new();
    for s in code.split_inclusive(';') {
        // A statement starts after the previous `;`: find a `use` that begins a line in it.
        let Some(at) = s.lines().position(|l| after_vis(l).0.starts_with("use ")) else {
            rest.push_str(s);
            continue;
        };
        let lines: Vec<&str> = s.lines().collect();
        let stmt = lines[at..].join(" ");
        let (stmt, public) = after_vis(stmt.trim().trim_end_matches(';'));
        let body = &stmt["use ".len()..];
        // A line of a string that happens to start with "use " is no statement.
        if !body.chars().all(|c| is_ident(c) || ":{}, *".contains(c)) {
            rest.push_str(s);
            continue;
        }
        rest.push_str(&lines[..at].join("\n"));
        rest.push('\n');
        let mut paths = Vec::new();
        expand("", body, &mut paths);
        for p in paths {
            let (path, name) = match p.split_once(" as ") {
                Some((path, alias)) => (segments(path), alias.trim().to_string()),
                None => {
                    let s = segments(&p);
                    let last = s.last().cloned().unwrap_or_default();
                    (s, last)
                }
            };
            if public {
                file.reexports.entry(name).or_default().push(path);
            } else {
                file.imports.push(path);
            }
        }
    }
    for line in rest.lines() {
        if let Some(name) = defined(line) {
            file.defs.insert(name);
        }
    }
    // Inline paths: `crate::a::b` and `super::a` anywhere in the code (types, calls, attributes).
    for start in ["crate::", "super::"] {
        for (i, _) in rest.match_indices(start) {
            if rest[..i]
                .chars()
                .next_back()
                .is_some_and(|c| is_ident(c) || c == ':')
            {
                continue;
            }
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(is_ident(c) || c == ':'))
                .unwrap_or(tail.len());
            file.imports.push(segments(&tail[..end]));
        }
    }
    file
}

impl Tree {
    fn read(root: &Path) -> Tree {
        let mut paths = Vec::new();
        rs_files(root, &mut paths);
        let (mut files, mut tests) = (BTreeMap::new(), BTreeSet::new());
        for p in &paths {
            let m = module_of(root, p);
            let name = p.file_stem().unwrap().to_string_lossy();
            if name == "tests" || name.ends_with("_tests") {
                tests.insert(m.clone());
            }
            let (code, test_mods) = strip(&fs::read_to_string(p).unwrap());
            for t in test_mods {
                tests.insert([m.clone(), vec![t]].concat());
            }
            files.insert(m, parse(&code));
        }
        files.retain(|m, _| !(0..=m.len()).any(|n| tests.contains(&m[..n])));
        Tree { files }
    }

    /// The file that defines what `path`, written in `from`, names (`None`: outside the crate).
    fn resolve(&self, from: &Module, path: &[String], depth: usize) -> Option<Module> {
        let (mut at, mut rest) = match path.first()?.as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (from.clone(), &path[1..]),
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                (
                    from[..from.len().saturating_sub(ups)].to_vec(),
                    &path[ups..],
                )
            }
            child
                if self
                    .files
                    .contains_key(&[from.clone(), vec![child.into()]].concat()) =>
            {
                (from.clone(), path)
            }
            _ => return None,
        };
        while let Some(seg) = rest.first() {
            let next = [at.clone(), vec![seg.clone()]].concat();
            if !self.files.contains_key(&next) {
                break;
            }
            (at, rest) = (next, &rest[1..]);
        }
        let (Some(name), Some(file)) = (rest.first(), self.files.get(&at)) else {
            return Some(at);
        };
        if depth < 8 && !file.defs.contains(name) {
            for p in file.reexports.get(name).into_iter().flatten() {
                if let Some(t) = self.resolve(&at, p, depth + 1) {
                    return Some(t);
                }
            }
        }
        Some(at)
    }

    /// Each circle: its modules, and the imports that close it (`from -> to: path`).
    fn circles(&self) -> Vec<(Vec<String>, Vec<String>)> {
        let mut g = DiGraph::<&Module, String>::new();
        let nodes: BTreeMap<&Module, _> = self.files.keys().map(|m| (m, g.add_node(m))).collect();
        let mut seen = BTreeSet::new();
        for (m, file) in &self.files {
            for path in &file.imports {
                let Some(t) = self.resolve(m, path, 0) else {
                    continue;
                };
                // A module naming itself or its own submodule is no import.
                if t.starts_with(m) || !nodes.contains_key(&t) || !seen.insert((m, t.clone())) {
                    continue;
                }
                g.add_edge(nodes[m], nodes[&t], path.join("::"));
            }
        }
        let name = |m: &Module| m.join("::");
        let mut out = Vec::new();
        for scc in tarjan_scc(&g) {
            if scc.len() < 2 {
                continue;
            }
            let mut modules: Vec<String> = scc.iter().map(|&n| name(g[n])).collect();
            modules.sort();
            let mut edges: Vec<String> = g
                .edge_indices()
                .filter_map(|e| {
                    let (a, b) = g.edge_endpoints(e)?;
                    (scc.contains(&a) && scc.contains(&b))
                        .then(|| format!("{} -> {}: {}", name(g[a]), name(g[b]), g[e]))
                })
                .collect();
            edges.sort();
            out.push((modules, edges));
        }
        out.sort();
        out
    }
}

#[test]
fn no_import_circle_in_the_tree() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut failures = Vec::new();
    for dir in ["planner/src", "runtime/src", "src"] {
        let tree = Tree::read(&repo.join(dir));
        assert!(tree.files.len() > 5, "{dir}: too few modules read");
        for (modules, edges) in tree.circles() {
            let allowed = ALLOWED
                .iter()
                .any(|(d, m)| *d == dir && *m == modules.as_slice());
            if !allowed {
                failures.push(format!(
                    "{dir}: import circle through {}:\n    {}",
                    modules.join(", "),
                    edges.join("\n    ")
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "give each shared type a home below its users:\n{}",
        failures.join("\n")
    );
}

fn write_tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, src) in files {
        let p = dir.path().join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, src).unwrap();
    }
    dir
}

/// The checker itself: a circle closed by an inline path through a re-export is found, named
/// by its imports; a test module's import and a parent calling its child are not circles.
#[test]
fn the_checker_finds_a_circle_through_a_reexport() {
    let dir = write_tree(&[
        ("lib.rs", "mod low;\nmod high;\npub use high::High;\n"),
        (
            "low.rs",
            "pub struct Low;\nfn f() -> crate::High { todo!() }\n",
        ),
        (
            "high/mod.rs",
            "use crate::low::Low;\nmod part;\npub struct High;\n",
        ),
        ("high/part.rs", "use super::High;\n"),
    ]);
    let circles = Tree::read(dir.path()).circles();
    assert_eq!(
        circles,
        vec![(
            vec!["high".to_string(), "low".to_string()],
            vec![
                "high -> low: crate::low::Low".to_string(),
                "low -> high: crate::High".to_string()
            ]
        )]
    );

    let dir = write_tree(&[
        ("lib.rs", "mod low;\nmod high;\n"),
        (
            "low.rs",
            "pub struct Low;\n#[cfg(test)]\nmod tests {\n    use crate::high::High;\n}\n",
        ),
        (
            "high/mod.rs",
            "use crate::low::Low;\nmod part;\npub struct High;\nfn g() { part::f() }\n",
        ),
        ("high/part.rs", "use super::High;\npub fn f() {}\n"),
    ]);
    assert_eq!(Tree::read(dir.path()).circles(), vec![]);
}
