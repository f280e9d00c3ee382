//! The import graph of the workspace's Rust modules, to keep its dependencies one way: for every
//! crate target (library, binaries, test crates) the modules its `mod` declarations reach, and
//! an edge `a → b` when module `a` names module `b` in a `use` or a path (`crate::b::…`,
//! `super::…`, a child module by name). A unit test fails on a circle (a strongly connected set
//! of two or more modules), on a `#[path]` attribute, and on an import by a module its crate
//! documents as a leaf ([`LEAVES`]); with `--nocapture` it lists every edge:
//!
//! ```sh
//! cargo test -p poolpilot-e2e --lib module_graph -- --nocapture
//! ```
//!
//! Comments and string literals are left out before reading, so doc links and messages that name
//! a module are no edges. Inline modules (`mod tests { … }`) belong to their file's module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;

/// A module of one crate target: its path from the crate root (empty for the root).
pub type ModulePath = Vec<String>;

/// One crate target's modules and import edges.
#[derive(Debug, Default)]
pub struct CrateGraph {
    /// The target, as `<package dir>/<root file>`.
    pub name: String,
    /// Every module, with its file.
    pub modules: BTreeMap<ModulePath, PathBuf>,
    /// `from → to` edges between distinct modules.
    pub edges: BTreeSet<(ModulePath, ModulePath)>,
}

/// Shows a module path as `crate::a::b`.
pub fn show(path: &ModulePath) -> String {
    std::iter::once("crate")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

/// The source without comments and with every string and char literal emptied.
fn strip(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &source[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            let mut j = 0;
            while j < rest.len() {
                if rest[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += rest[j..].chars().next().map_or(1, char::len_utf8);
                }
            }
            i += j;
            out.push(' ');
        } else if let Some(len) = raw_string_len(rest) {
            i += len;
            out.push_str("\"\"");
        } else if rest.starts_with('"') {
            let mut j = 1;
            while j < rest.len() {
                match rest.as_bytes()[j] {
                    b'\\' => j += 2,
                    b'"' => {
                        j += 1;
                        break;
                    }
                    _ => j += 1,
                }
            }
            i += j.min(rest.len());
            out.push_str("\"\"");
        } else if let Some(len) = char_literal_len(rest) {
            i += len;
            out.push_str("' '");
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of a raw string literal (`r"…"`, `r#"…"#`, `br"…"`) at the start of `s`.
fn raw_string_len(s: &str) -> Option<usize> {
    let after_prefix = s.strip_prefix("br").or_else(|| s.strip_prefix('r'))?;
    let hashes = after_prefix.len() - after_prefix.trim_start_matches('#').len();
    let body = after_prefix[hashes..].strip_prefix('"')?;
    let closing = format!("\"{}", "#".repeat(hashes));
    let end = body.find(&closing)?;
    Some(s.len() - body.len() + end + closing.len())
}

/// The length of a char literal (`'a'`, `'\n'`, `'\u{1F600}'`) at the start of `s`; `None` for
/// a lifetime.
fn char_literal_len(s: &str) -> Option<usize> {
    let rest = s.strip_prefix('\'')?;
    let len = if let Some(escaped) = rest.strip_prefix('\\') {
        // The escaped character (`'\''` too), then up to the closing quote (`\u{…}`).
        escaped.get(1..)?.find('\'')? + 2
    } else {
        rest.chars().next()?.len_utf8()
    };
    (rest[len..].starts_with('\'')).then_some(len + 2)
}

static MOD_DECL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")
        .expect("a valid regex")
});
static USE_DECL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)\b(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]+);").expect("a valid regex")
});
static INLINE_MOD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\bmod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{").expect("a valid regex"));
static PATH: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b([A-Za-z_][A-Za-z0-9_]*)((?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")
        .expect("a valid regex")
});

/// The spans of the inline modules (`mod tests { … }`) of a stripped text.
fn inline_modules(text: &str) -> Vec<(usize, usize)> {
    INLINE_MOD
        .find_iter(text)
        .map(|m| {
            let mut depth = 0;
            let end = text[m.end() - 1..]
                .char_indices()
                .find_map(|(i, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    (depth == 0).then_some(m.end() - 1 + i)
                })
                .unwrap_or(text.len());
            (m.start(), end)
        })
        .collect()
}

/// A path as written at `at` in a module's text whose inline modules are `inline`: the first
/// `super`s that only leave inline modules (`use super::*` in `mod tests { … }`) are dropped.
fn from_file_module(segments: Vec<String>, at: usize, inline: &[(usize, usize)]) -> Vec<String> {
    let nesting = inline.iter().filter(|(s, e)| *s < at && at < *e).count();
    let supers = segments.iter().take_while(|s| *s == "super").count();
    let dropped = nesting.min(supers);
    if dropped == 0 {
        return segments;
    }
    let rest = segments[dropped..].to_vec();
    if rest.first().is_some_and(|s| s == "super") {
        rest
    } else {
        std::iter::once("self".to_owned()).chain(rest).collect()
    }
}

/// The file of module `name` declared in `file`, a crate root or `mod.rs` when `owns_dir`.
fn child_file(file: &Path, owns_dir: bool, name: &str) -> Option<PathBuf> {
    let dir = file.parent()?;
    let base = if owns_dir {
        dir.to_owned()
    } else {
        dir.join(file.file_stem()?)
    };
    [
        base.join(format!("{name}.rs")),
        base.join(name).join("mod.rs"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// The modules reachable from crate root `root` by `mod` declarations, with their stripped text.
fn modules_of(root: &Path) -> BTreeMap<ModulePath, (PathBuf, String)> {
    let mut modules = BTreeMap::new();
    let mut pending = vec![(ModulePath::new(), root.to_owned(), true)];
    while let Some((path, file, owns_dir)) = pending.pop() {
        let Ok(source) = std::fs::read_to_string(&file) else {
            continue;
        };
        let text = strip(&source);
        for declared in MOD_DECL.captures_iter(&text) {
            let name = declared[1].to_owned();
            if let Some(child) = child_file(&file, owns_dir, &name) {
                let owns = child.file_name().is_some_and(|n| n == "mod.rs");
                let mut child_path = path.clone();
                child_path.push(name);
                pending.push((child_path, child, owns));
            }
        }
        modules.insert(path, (file, text));
    }
    modules
}

/// A path a `use` brings in, and the name it binds (`None` for a glob).
type Import = (Vec<String>, Option<String>);

/// Expands a `use` tree (`a::{b, c::{d, e as f}, *}`) into its paths and the names they bind.
fn expand_use(tree: &str) -> Vec<Import> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
        for (i, c) in s.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts
    }
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<Import>) {
        let tree = tree.trim();
        if tree.is_empty() {
            return;
        }
        let (head, group) = match tree.find('{') {
            Some(open) if tree.ends_with('}') => {
                (&tree[..open], Some(&tree[open + 1..tree.len() - 1]))
            }
            _ => (tree, None),
        };
        let (head, alias) = match head.split_once(" as ") {
            Some((head, alias)) => (head, Some(alias.trim().to_owned())),
            None => (head, None),
        };
        let glob = head.trim().ends_with('*');
        let mut path = prefix.to_vec();
        path.extend(
            head.split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty() && *s != "*" && *s != "self")
                .map(str::to_owned),
        );
        match group {
            Some(group) => {
                for part in split_top(group) {
                    walk(&path, part, out);
                }
            }
            None => {
                let name = if glob {
                    None
                } else {
                    alias.or_else(|| path.last().cloned())
                };
                out.push((path, name));
            }
        }
    }
    let mut out = Vec::new();
    walk(&[], tree.trim_start_matches("::"), &mut out);
    out
}

/// What each module's `use` declarations bind, by name.
type Imports = BTreeMap<ModulePath, BTreeMap<String, Vec<String>>>;

/// The module a path names from module `from`, if it names one of `modules`: `crate`, `super`
/// and `self` lead, or a child of `from`; then as many segments as are modules; then, when the
/// next segment is a name that module imports (a re-export such as `pub use child::Item`), the
/// module that import names: an item is owned by the module that defines it.
fn resolve(
    from: &ModulePath,
    segments: &[String],
    modules: &BTreeMap<ModulePath, (PathBuf, String)>,
    imports: &Imports,
    depth: usize,
) -> Option<ModulePath> {
    let mut current = from.clone();
    let mut rest = segments;
    match segments.first().map(String::as_str) {
        Some("crate") => {
            current.clear();
            rest = &segments[1..];
        }
        Some("self") => rest = &segments[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                current.pop()?;
                rest = &rest[1..];
            }
        }
        Some(name) => {
            let mut child = from.clone();
            child.push(name.to_owned());
            if !modules.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    let mut rest = rest.iter();
    for segment in rest.by_ref() {
        let mut next = current.clone();
        next.push(segment.clone());
        if modules.contains_key(&next) {
            current = next;
        } else {
            if depth < 8
                && let Some(target) = imports.get(&current).and_then(|i| i.get(segment))
                && let Some(owner) = resolve(&current, target, modules, imports, depth + 1)
            {
                return Some(owner);
            }
            break;
        }
    }
    Some(current)
}

/// The graph of the crate target whose root file is `root`.
pub fn crate_graph(name: String, root: &Path) -> CrateGraph {
    let modules = modules_of(root);
    let mut used: BTreeMap<ModulePath, Vec<Import>> = BTreeMap::new();
    let mut imports = Imports::new();
    // Each module's text without its `use` declarations, where paths and names are looked for.
    let mut bodies: BTreeMap<&ModulePath, String> = BTreeMap::new();
    for (module, (_, text)) in &modules {
        bodies.insert(
            module,
            USE_DECL
                .replace_all(text, |c: &regex::Captures<'_>| " ".repeat(c[0].len()))
                .into_owned(),
        );
    }
    for (module, (_, text)) in &modules {
        let inline = inline_modules(text);
        for found in USE_DECL.captures_iter(text) {
            let at = found.get(0).map_or(0, |m| m.start());
            let reexport = found.get(1).is_some();
            for (path, name) in expand_use(&found[2]) {
                let path = from_file_module(path, at, &inline);
                // A re-export (`pub use child::Item`) is a dependency only when this module's
                // own code uses the name too; it always serves to resolve paths through it.
                let uses_it = !reexport
                    || name.as_ref().is_some_and(|n| {
                        Regex::new(&format!(r"\b{}\b", regex::escape(n)))
                            .is_ok_and(|r| r.is_match(&bodies[module]))
                    });
                if let Some(name) = &name {
                    imports
                        .entry(module.clone())
                        .or_default()
                        .insert(name.clone(), path.clone());
                }
                if uses_it {
                    used.entry(module.clone()).or_default().push((path, name));
                }
            }
        }
    }
    let mut edges = BTreeSet::new();
    for (from, (_, text)) in &modules {
        let inline = inline_modules(text);
        let body = &bodies[from];
        let mut paths: Vec<Vec<String>> = used
            .get(from)
            .into_iter()
            .flatten()
            .map(|(path, _)| path.clone())
            .collect();
        for found in PATH.captures_iter(body) {
            let at = found.get(0).map_or(0, |m| m.start());
            let mut segments = vec![found[1].to_owned()];
            segments.extend(
                found[2]
                    .split("::")
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
            paths.push(from_file_module(segments, at, &inline));
        }
        for segments in paths {
            if let Some(to) = resolve(from, &segments, &modules, &imports, 0)
                && &to != from
            {
                edges.insert((from.clone(), to));
            }
        }
    }
    CrateGraph {
        name,
        modules: modules
            .into_iter()
            .map(|(k, (file, _))| (k, file))
            .collect(),
        edges,
    }
}

/// Modules their crates document as leaves, by crate target: they import nothing of their
/// crate, so that every other module may name them without a circle.
pub const LEAVES: &[(&str, &str)] = &[
    // Label values shared by the metrics and the modules that report them.
    ("gateway/src/lib.rs", "crate::observe::labels"),
    // The power of two choices, pure: no state, no clock, no metrics.
    ("gateway/src/lib.rs", "crate::pool::select"),
    // The one PEM parser, over rustls' own.
    ("gateway/src/lib.rs", "crate::pem"),
];

/// What `leaf` imports of its crate in `graph`: every module it has an edge to, or `None` when
/// the graph has no such module.
pub fn imports_of(graph: &CrateGraph, leaf: &str) -> Option<Vec<String>> {
    let module = graph.modules.keys().find(|m| show(m) == leaf)?;
    Some(
        graph
            .edges
            .iter()
            .filter(|(from, _)| from == module)
            .map(|(_, to)| show(to))
            .collect(),
    )
}

/// The crate roots of the package in `dir`: library, binaries, tests, benches, examples.
fn roots_of(dir: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["src/lib.rs", "src/main.rs", "build.rs"]
        .iter()
        .map(|r| dir.join(r))
        .filter(|p| p.is_file())
        .collect();
    for folder in ["src/bin", "tests", "benches", "examples"] {
        let Ok(entries) = std::fs::read_dir(dir.join(folder)) else {
            continue;
        };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter_map(|p| {
                if p.extension().is_some_and(|e| e == "rs") {
                    Some(p)
                } else {
                    Some(p.join("main.rs")).filter(|m| m.is_file())
                }
            })
            .collect();
        found.sort();
        roots.extend(found);
    }
    roots
}

/// Every crate target of the workspace at `root` (the packages its Cargo.toml lists).
pub fn workspace_graphs(root: &Path) -> Vec<CrateGraph> {
    let mut graphs = Vec::new();
    for member in crate::paths::workspace_members(root) {
        for crate_root in roots_of(&root.join(&member)) {
            let shown = crate_root
                .strip_prefix(root)
                .unwrap_or(&crate_root)
                .display()
                .to_string();
            graphs.push(crate_graph(shown, &crate_root));
        }
    }
    graphs
}

/// The circles of a graph: each strongly connected set of two or more modules (Tarjan).
pub fn circles(graph: &CrateGraph) -> Vec<Vec<ModulePath>> {
    struct Tarjan<'a> {
        next: BTreeMap<&'a ModulePath, Vec<&'a ModulePath>>,
        index: BTreeMap<&'a ModulePath, usize>,
        low: BTreeMap<&'a ModulePath, usize>,
        stack: Vec<&'a ModulePath>,
        on_stack: BTreeSet<&'a ModulePath>,
        found: Vec<Vec<ModulePath>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a ModulePath) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.next.get(v).cloned().unwrap_or_default() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut set = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    set.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if set.len() > 1 {
                    set.sort();
                    self.found.push(set);
                }
            }
        }
    }
    let mut next: BTreeMap<&ModulePath, Vec<&ModulePath>> = BTreeMap::new();
    for (from, to) in &graph.edges {
        next.entry(from).or_default().push(to);
    }
    let mut tarjan = Tarjan {
        next,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for module in graph.modules.keys() {
        if !tarjan.index.contains_key(module) {
            tarjan.visit(module);
        }
    }
    tarjan.found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    fn edges(graph: &CrateGraph) -> Vec<(String, String)> {
        graph
            .edges
            .iter()
            .map(|(a, b)| (show(a), show(b)))
            .collect()
    }

    #[test]
    fn uses_paths_and_child_names_are_edges_and_comments_and_strings_are_not() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            &[
                (
                    "lib.rs",
                    "//! See [`crate::c`].\nmod a;\npub mod b;\nmod c;\npub use a::{Thing, inner::{self, Other as O}};\n\
                     fn f() { let s = \"super::c::x\"; b::go(); O::new(); }",
                ),
                ("a/mod.rs", "pub mod inner;\nuse super::b;\n/* crate::c */"),
                ("a/inner.rs", "pub fn g() { crate::c::h(); }"),
                (
                    "b.rs",
                    "pub fn go() {}\n#[cfg(test)]\nmod tests { use super::*; }",
                ),
                ("c.rs", "// use crate::a;\npub fn h() -> char { '\"' }"),
            ],
        );
        let graph = crate_graph("t".into(), &dir.path().join("lib.rs"));
        assert_eq!(
            graph.modules.keys().map(show).collect::<Vec<_>>(),
            [
                "crate",
                "crate::a",
                "crate::a::inner",
                "crate::b",
                "crate::c"
            ]
        );
        assert_eq!(
            edges(&graph),
            [
                // `Thing` is only re-exported: no edge to `a`; `O` is used.
                ("crate".into(), "crate::a::inner".into()),
                ("crate".into(), "crate::b".into()),
                ("crate::a".into(), "crate::b".into()),
                ("crate::a::inner".into(), "crate::c".into()),
            ]
        );
        assert!(circles(&graph).is_empty());
    }

    #[test]
    fn a_child_importing_what_its_parent_defines_while_the_parent_imports_it_is_a_circle() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            &[
                (
                    "main.rs",
                    "mod server;\nmod engine;\nfn main() { server::run(); }",
                ),
                (
                    "server.rs",
                    "use super::engine::Admission;\npub struct Shared;",
                ),
                (
                    "engine.rs",
                    "use crate::server::Shared;\npub struct Admission;",
                ),
            ],
        );
        let graph = crate_graph("t".into(), &dir.path().join("main.rs"));
        let found: Vec<Vec<String>> = circles(&graph)
            .iter()
            .map(|c| c.iter().map(show).collect())
            .collect();
        assert_eq!(found, [["crate::engine", "crate::server"]]);
    }

    #[test]
    fn no_module_of_the_workspace_imports_itself_through_a_circle() {
        let root = crate::paths::workspace_root();
        let graphs = workspace_graphs(&root);
        assert!(
            graphs.len() > 20,
            "found only {} crate targets",
            graphs.len()
        );
        let mut found = Vec::new();
        for graph in &graphs {
            println!("{} ({} modules)", graph.name, graph.modules.len());
            for (from, to) in &graph.edges {
                println!("  {} -> {}", show(from), show(to));
            }
            for circle in circles(graph) {
                let names: Vec<String> = circle.iter().map(show).collect();
                println!("  CIRCLE: {}", names.join(", "));
                found.push(format!("{}: {}", graph.name, names.join(", ")));
            }
        }
        assert!(
            found.is_empty(),
            "modules that import each other (directly or around a circle):\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn a_module_its_crate_documents_as_a_leaf_imports_nothing_of_it() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            &[
                ("lib.rs", "mod labels;\nmod metrics;\nmod pool;"),
                ("labels.rs", "pub enum Reason { Idle }"),
                ("metrics.rs", "use crate::labels::Reason;"),
                (
                    "pool.rs",
                    "use crate::metrics::x; fn f() { crate::labels::Reason::Idle; }",
                ),
            ],
        );
        let graph = crate_graph("t".into(), &dir.path().join("lib.rs"));
        assert_eq!(imports_of(&graph, "crate::labels"), Some(vec![]));
        assert_eq!(
            imports_of(&graph, "crate::pool"),
            Some(vec![
                "crate::labels".to_owned(),
                "crate::metrics".to_owned()
            ])
        );
        assert_eq!(imports_of(&graph, "crate::gone"), None);
    }

    #[test]
    fn the_modules_documented_as_leaves_import_nothing_of_their_crate() {
        let root = crate::paths::workspace_root();
        let graphs = workspace_graphs(&root);
        let mut found = Vec::new();
        for (target, leaf) in LEAVES {
            let graph = graphs
                .iter()
                .find(|g| g.name == *target)
                .unwrap_or_else(|| panic!("no crate target {target}"));
            match imports_of(graph, leaf) {
                None => found.push(format!("{target}: no module {leaf}")),
                Some(imports) if !imports.is_empty() => {
                    found.push(format!("{target}: {leaf} imports {}", imports.join(", ")))
                }
                Some(_) => {}
            }
        }
        assert!(
            found.is_empty(),
            "leaves that are not:\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn no_source_file_moves_a_module_with_a_path_attribute() {
        let root = crate::paths::workspace_root();
        let mut offenders = Vec::new();
        for graph in workspace_graphs(&root) {
            for file in graph.modules.values() {
                let text = strip(&std::fs::read_to_string(file).unwrap_or_default());
                if text.contains("#[path") {
                    offenders.push(file.display().to_string());
                }
            }
        }
        assert!(offenders.is_empty(), "#[path] in {offenders:?}");
    }
}
