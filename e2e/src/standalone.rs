//! The repository stands alone: whoever clones it finds every reference inside it. A check over
//! the sources and docs for citations of what only the team had (an internal design document's
//! sections, issue numbers, the field reports by number or path); the design and the incidents
//! are told in docs/design.md.

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
}
