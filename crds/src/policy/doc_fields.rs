//! The docs name only `ConnectionPolicy` fields that exist: every backticked dotted path in the
//! user docs (README.md, docs/, manifests/README.md, the chart README) whose first segment is a
//! field of the policy's `spec`, of a backend (`spec.backends[]`) or of `status` must resolve in
//! the CRD's schema, segment by segment (`[]` or not for arrays). A renamed or invented field
//! (`listener.idleTimeout` where the listener has no such field) fails here, not in a user's
//! `kubectl apply`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::crd;

/// The documents checked, relative to the workspace root: the user docs. Left out: the
/// generated reference (made from the schema) and the standalone gateway's and the gateway
/// crate's docs, whose dotted names are the limits document's (`crds/src/limits.rs`), not the
/// policy's.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![
        root.join("README.md"),
        root.join("manifests/README.md"),
        root.join("charts/poolpilot/README.md"),
    ];
    let skip = ["connectionpolicy-reference.md", "standalone-gateway.md"];
    if let Ok(dir) = std::fs::read_dir(root.join("docs")) {
        let mut docs: Vec<PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .filter(|p| !skip.iter().any(|s| p.file_name().is_some_and(|n| n == *s)))
            .collect();
        docs.sort();
        out.extend(docs);
    }
    out.retain(|p| p.is_file());
    out
}

/// Paths the docs name that look like a policy's and are another object's.
const NOT_POLICY_FIELDS: &[&str] = &[
    "status.podIP", // a Pod's, for the downward API
];

/// The backticked spans of a markdown text that look like field paths: `a.bC`, `a[].b.c`.
fn dotted_paths(markdown: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in markdown.lines().enumerate() {
        for (i, span) in line.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            let path = span.trim();
            let segments: Vec<&str> = path.split('.').collect();
            let field = |s: &str| {
                let s = s.strip_suffix("[]").unwrap_or(s);
                s.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                    && s.chars().all(|c| c.is_ascii_alphanumeric())
            };
            if segments.len() >= 2 && segments.iter().all(|s| field(s)) {
                out.push((n + 1, path.to_owned()));
            }
        }
    }
    out
}

/// The schema at `path` below `schema` (`None`: no such field).
fn resolve<'a>(mut schema: &'a Value, path: &[&str]) -> Option<&'a Value> {
    for segment in path {
        let name = segment.strip_suffix("[]").unwrap_or(segment);
        if schema["type"] == "array" {
            schema = &schema["items"];
        }
        schema = schema["properties"].get(name)?;
    }
    Some(schema)
}

#[test]
fn the_docs_name_only_fields_the_crd_has() {
    let crd = serde_json::to_value(crd()).expect("the CRD serialises");
    let root_schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let spec = &root_schema["properties"]["spec"];
    let status = &root_schema["properties"]["status"];
    let backend = &spec["properties"]["backends"]["items"];
    let roots = [("spec", spec), ("status", status), ("backend", backend)];

    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let workspace =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or(workspace, |d| PathBuf::from(d).join(".."));
    let files = documents(&workspace);
    assert!(files.len() >= 5, "the docs are there: {files:?}");
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("readable");
        for (line, path) in dotted_paths(&text) {
            let segments: Vec<&str> = path.split('.').collect();
            let (segments, candidates): (&[&str], Vec<&Value>) = match segments[0] {
                "spec" => (&segments[1..], vec![spec]),
                "status" => (&segments[1..], vec![status]),
                first => {
                    let first = first.strip_suffix("[]").unwrap_or(first);
                    let matching: Vec<&Value> = roots
                        .iter()
                        .filter(|(_, r)| r["properties"].get(first).is_some())
                        .map(|(_, r)| *r)
                        .collect();
                    (&segments[..], matching)
                }
            };
            if candidates.is_empty() || NOT_POLICY_FIELDS.contains(&path.as_str()) {
                continue; // not a policy field's path (a chart value, a file name, ...)
            }
            checked += 1;
            if !candidates.iter().any(|r| resolve(r, segments).is_some()) {
                let name = file.strip_prefix(&workspace).unwrap_or(file);
                wrong.push(format!("{}:{line}: `{path}`", name.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} field paths found: the scan is broken"
    );
    assert!(
        wrong.is_empty(),
        "the docs name ConnectionPolicy fields the CRD does not have:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn a_path_resolves_through_arrays_and_objects() {
    let crd = serde_json::to_value(crd()).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert!(resolve(spec, &["backends", "pool", "leaseTimeout"]).is_some());
    assert!(resolve(spec, &["backends[]", "pool", "leaseTimeout"]).is_some());
    assert!(resolve(spec, &["backends", "pool", "noSuchField"]).is_none());
    assert_eq!(
        dotted_paths("set `pool.leaseTimeout` and `a.b`, not `x`, `Foo.bar` or `docs/x.md`"),
        vec![(1, "pool.leaseTimeout".to_owned()), (1, "a.b".to_owned())]
    );
}
