//! The repository stands alone: whoever clones it finds every reference inside it. A check over
//! the sources and docs for citations of what only the team had (an internal design document's
//! sections, issue numbers, the field reports by number or path); the design and the incidents
//! are told in docs/design.md. And a check that every source path a doc or comment cites
//! exists, so that a file that moves takes its citations with it.

use std::path::{Path, PathBuf};

/// Citations that resolve nowhere in a clone, case-insensitive. Built from parts so that this
/// file does not cite them itself.
fn patterns() -> regex::Regex {
    let parts = [
        ["DESIGN", r"(\.md)?\s*§"].concat(),
        [r"\bissue", r"\s+#?[0-9]"].concat(),
        [r"\bseed", r"[\s-]*[0-9]"].concat(),
        [r"shared/", "seeds"].concat(),
        [r"\.\./", "shared"].concat(),
    ];
    regex::RegexBuilder::new(&parts.join("|"))
        .case_insensitive(true)
        .build()
        .expect("the patterns compile")
}

/// The files a reader of the repository reads: sources, docs, manifests, the chart.
pub fn readable_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(root).into_iter().filter_entry(|e| {
        let name = e.file_name().to_str().unwrap_or("");
        !(e.file_type().is_dir() && (name == "target" || name.starts_with('.') && name != ".ci"))
    }) {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let kind = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if entry.file_type().is_file()
            && (matches!(
                kind,
                "rs" | "md" | "yaml" | "yml" | "json" | "toml" | "go" | "tpl" | "txt"
            ) || matches!(name, "Makefile" | "run"))
        {
            files.push(path.to_owned());
        }
    }
    files
}

/// `file:line: text` of every citation of something outside the repository.
pub fn outside_citations(root: &Path) -> Vec<String> {
    let patterns = patterns();
    let mut found = Vec::new();
    for path in readable_files(root) {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if patterns.is_match(line) {
                let shown = path.strip_prefix(root).unwrap_or(&path).display();
                found.push(format!("{shown}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    found
}

/// The folders of a package whose files docs cite by path.
const SOURCE_FOLDERS: [&str; 4] = ["src", "tests", "benches", "examples"];

/// `file:line: path` of every source path cited in backticks that does not exist: anywhere,
/// one that starts with a package's folder and then one of [`SOURCE_FOLDERS`]
/// (`gateway/src/pool/mod.rs`, from the root); in a package's README.md, also one that starts
/// with one of [`SOURCE_FOLDERS`] (`src/pool/mod.rs`, from the package).
pub fn missing_source_paths(root: &Path) -> Vec<String> {
    let cited = regex::Regex::new(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*)`")
        .expect("the pattern compiles");
    let packages = crate::paths::workspace_members(root);
    let in_sources = |path: &str| {
        SOURCE_FOLDERS
            .iter()
            .any(|f| path.starts_with(&format!("{f}/")))
    };
    let mut missing = Vec::new();
    for file in readable_files(root) {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(&file);
        let readme_of = shown
            .parent()
            .map(|dir| dir.display().to_string())
            .filter(|dir| shown.ends_with("README.md") && packages.contains(dir));
        for (n, line) in text.lines().enumerate() {
            for found in cited.captures_iter(line) {
                let path = &found[1];
                let base = if packages.iter().any(|p| {
                    path.strip_prefix(p.as_str())
                        .and_then(|rest| rest.strip_prefix('/'))
                        .is_some_and(in_sources)
                }) {
                    root.to_path_buf()
                } else if let Some(package) = readme_of.as_ref().filter(|_| in_sources(path)) {
                    root.join(package)
                } else {
                    continue;
                };
                if !base.join(path).exists() {
                    missing.push(format!("{}:{}: {path}", shown.display(), n + 1));
                }
            }
        }
    }
    missing.sort();
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patterns_catch_each_kind_of_citation_and_nothing_else() {
        let p = patterns();
        // Built from parts, like the patterns, so that this file cites nothing itself.
        for cited in [
            ["see DESIGN", " §4"].concat(),
            ["DESIGN.md", " §5 step 3"].concat(),
            ["Covers issue", " 5's acceptance"].concat(),
            ["Issue", " #12"].concat(),
            ["seed", " 1's numbers"].concat(),
            ["Seed", " 2 pinned this"].concat(),
            ["the seed", "-1 flash crowd"].concat(),
            ["in ..", "/sha", "red/seeds/"].concat(),
        ] {
            assert!(p.is_match(&cited), "{cited}");
        }
        for fine in [
            "Seed of the random draws",
            "docs/design.md",
            "an issue with the pool",
            "seeds from the OS",
        ] {
            assert!(!p.is_match(fine), "{fine}");
        }
    }

    #[test]
    fn every_reference_resolves_inside_the_repository() {
        let root = crate::paths::workspace_root();
        assert!(readable_files(&root).len() > 100);
        let found = outside_citations(&root);
        assert!(
            found.is_empty(),
            "cite docs/design.md (or say it in your own words) instead of:\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn every_source_path_a_doc_cites_exists() {
        let root = crate::paths::workspace_root();
        let missing = missing_source_paths(&root);
        assert!(
            missing.is_empty(),
            "cited source paths that do not exist (moved or renamed?):\n{}",
            missing.join("\n")
        );
    }

    #[test]
    fn a_cited_source_path_is_checked_from_the_root_or_from_its_package() {
        // Not a hidden folder (`.tmp…`): the walk skips those.
        let dir = tempfile::Builder::new()
            .prefix("standalone")
            .tempdir()
            .unwrap();
        let root = dir.path();
        for (path, text) in [
            (
                "Cargo.toml",
                "[workspace]\nmembers = [\"gw\", \"x/plot\"]\n",
            ),
            (
                "gw/src/lib.rs",
                "//! See `gw/src/gone.rs` and `gw/src/lib.rs`.",
            ),
            (
                "gw/README.md",
                "`src/lib.rs` `src/old.rs` `tests/` `cluster/x.rs` `gw/benches/b.rs`",
            ),
            (
                "docs/x.md",
                "`x/plot/src/main.rs` and `plan/input.rs`, `src/lib.rs`",
            ),
        ] {
            std::fs::create_dir_all(root.join(path).parent().unwrap()).unwrap();
            std::fs::write(root.join(path), text).unwrap();
        }
        std::fs::create_dir_all(root.join("gw/tests")).unwrap();
        assert_eq!(
            missing_source_paths(root),
            [
                "docs/x.md:1: x/plot/src/main.rs",
                "gw/README.md:1: gw/benches/b.rs",
                "gw/README.md:1: src/old.rs",
                "gw/src/lib.rs:1: gw/src/gone.rs",
            ]
        );
    }
}
