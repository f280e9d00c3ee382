//! The `ConnectionPolicy` reference (`docs/connectionpolicy-reference.md`), rendered from the
//! CRD's OpenAPI v3 schema: for every field its type, whether it is required, its default, its
//! schema constraints, its description and the CEL rules declared on it; one section per object;
//! the printer columns; and the conditions and Events of [`super::conditions`]. `crdgen
//! --reference` prints it, `make crds` writes it, and a test fails when the committed file drifts.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::Value;

use super::conditions::{CONDITIONS, EVENTS};
use crate::duration::DURATION_PATTERN;

/// Where the reference is committed, relative to the workspace root.
pub const REFERENCE_PATH: &str = "docs/connectionpolicy-reference.md";

/// The reference doc of the `ConnectionPolicy` CRD, exactly as committed in
/// [`REFERENCE_PATH`].
pub fn reference_markdown() -> String {
    let crd = serde_json::to_value(super::crd()).expect("a CRD serialises");
    render(&crd)
}

/// One object of the schema, with a section of its own.
#[derive(Debug)]
struct Section<'a> {
    /// Field path: `spec.backends[].pool`.
    path: String,
    /// 0 for `spec` and `status`.
    depth: usize,
    /// The object's schema (it has `properties`).
    schema: &'a Value,
    /// The field's description, then the items' one for an array of objects.
    descriptions: Vec<&'a str>,
    /// The enclosing object's path.
    parent: Option<String>,
}

/// Renders the reference of `crd` (a `CustomResourceDefinition` as JSON).
fn render(crd: &Value) -> String {
    let spec = &crd["spec"];
    let version = &spec["versions"][0];
    let root = &version["schema"]["openAPIV3Schema"];

    let mut sections = Vec::new();
    for (name, prop) in properties(root) {
        if let Some((path, schema, descriptions)) = object_of("", name, prop) {
            collect(path, 0, schema, descriptions, None, &mut sections);
        }
    }
    let kind = spec["names"]["kind"].as_str().unwrap_or_default();
    // Anchors in the order of the headings, as GitHub numbers repeats.
    let mut anchors = Anchors::default();
    let title = format!("{kind} reference");
    for heading in [title.as_str(), "Contents", "Conventions", "Printer columns"] {
        anchors.add(heading);
    }
    let section_anchors: Vec<String> = sections.iter().map(|s| anchors.add(&s.path)).collect();
    let (conditions_anchor, events_anchor) = (anchors.add("Conditions"), anchors.add("Events"));
    let anchor_of = |path: &str| {
        sections
            .iter()
            .position(|s| s.path == path)
            .map(|i| section_anchors[i].clone())
    };

    let mut out = String::new();
    let w = &mut out;
    let api_version = format!(
        "{}/{}",
        spec["group"].as_str().unwrap_or_default(),
        version["name"].as_str().unwrap_or_default()
    );
    let _ = writeln!(
        w,
        "<!-- Generated from the {kind} CRD by `make crds` (`crdgen --reference`); do not edit. \
         The descriptions are the doc comments of crds/src/policy.rs. -->\n"
    );
    let _ = writeln!(w, "# {title}\n");
    let short: Vec<&str> = str_list(&spec["names"]["shortNames"]);
    let categories: Vec<&str> = str_list(&spec["names"]["categories"]);
    let _ = writeln!(
        w,
        "`apiVersion: {api_version}`, `kind: {kind}`: {} (`kubectl get {}`), short name {}, \
         category {}.\n",
        spec["scope"].as_str().unwrap_or_default().to_lowercase(),
        spec["names"]["plural"].as_str().unwrap_or_default(),
        join_code(&short),
        join_code(&categories),
    );
    let _ = writeln!(w, "{}\n", text(root["description"].as_str().unwrap_or("")));
    let _ = writeln!(w, "{INTRO}\n");

    let _ = writeln!(w, "## Contents\n");
    let _ = writeln!(w, "- [Conventions](#conventions)");
    let _ = writeln!(w, "- [Printer columns](#printer-columns)");
    for (s, anchor) in sections.iter().zip(&section_anchors) {
        let indent = "  ".repeat(s.depth);
        let _ = writeln!(w, "{indent}- [`{}`](#{anchor})", s.path);
    }
    let _ = writeln!(w, "- [Conditions](#{conditions_anchor})");
    let _ = writeln!(w, "- [Events](#{events_anchor})\n");

    let _ = writeln!(w, "## Conventions\n");
    let _ = writeln!(w, "{}\n", conventions());

    let _ = writeln!(w, "## Printer columns\n");
    let _ = writeln!(w, "What `kubectl get cpol` shows.\n");
    let _ = writeln!(w, "| Column | Type | JSON path | Description |");
    let _ = writeln!(w, "|---|---|---|---|");
    for c in version["additionalPrinterColumns"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} |",
            cell(c["name"].as_str().unwrap_or_default()),
            cell(c["type"].as_str().unwrap_or_default()),
            cell(&code(c["jsonPath"].as_str().unwrap_or_default())),
            cell(&text(c["description"].as_str().unwrap_or("—"))),
        );
    }
    let _ = writeln!(w);

    for s in &sections {
        section(w, s, &anchor_of);
    }

    conditions(w);
    events(w);
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

const INTRO: &str = "A policy describes one group of model backends to the poolpilot operator, \
    once: which gateway pods enforce it (`spec.gatewaySelector`), which requests go to each \
    backend and what one backend instance can take for the whole gateway fleet \
    (`spec.backends`), how much each client may use (`spec.clients`, `spec.listener`), and how \
    the operator tunes the pool targets and rolls them out (`spec.autoscale`, \
    `spec.fileDescriptors`, `spec.rollout`). The operator reports what it observed, decided and \
    applied in `status`, with [conditions](#conditions), and publishes [Events](#events) on the \
    policy.\n\n\
    A commented example: [`manifests/samples/connectionpolicy.yaml`](../manifests/samples/connectionpolicy.yaml). \
    Reading status and acting on it: [operating.md](operating.md). Installing the CRD: \
    [deploying.md](deploying.md).";

fn conventions() -> String {
    format!(
        "- **Durations** are strings such as `300ms`, `30s`, `1m30s` or `2h` (units `ns`, `us`, \
         `µs`, `ms`, `s`, `m`, `h`; pattern {}, at most 32 characters), and must be longer than \
         `0s`.\n\
         - **Defaults** are filled in by the apiserver when a policy is created or updated: \
         `kubectl get cpol NAME -o yaml` shows them. An object whose default is *its fields' \
         defaults* may be left out entirely.\n\
         - **Validation** is the apiserver's: the schema constraints and the CEL rules below make \
         `kubectl apply` refuse a policy that breaks them, with the rule's message. A rule listed \
         under an object sees that object as `self`. What the schema cannot check, the operator \
         does: it reports `Accepted=False` with reason `Invalid`.\n\
         - **Descriptions** are also what `kubectl explain connectionpolicy.spec.backends.pool` \
         prints.\n\
         - **`status`** is a subresource written by the operator only.",
        code(DURATION_PATTERN)
    )
}

/// Appends `path`'s section and, depth first, those of the objects among its fields.
fn collect<'a>(
    path: String,
    depth: usize,
    schema: &'a Value,
    descriptions: Vec<&'a str>,
    parent: Option<String>,
    out: &mut Vec<Section<'a>>,
) {
    let children: Vec<_> = properties(schema)
        .filter_map(|(name, prop)| object_of(&path, name, prop))
        .collect();
    out.push(Section {
        path: path.clone(),
        depth,
        schema,
        descriptions,
        parent,
    });
    for (child, child_schema, child_descriptions) in children {
        collect(
            child,
            depth + 1,
            child_schema,
            child_descriptions,
            Some(path.clone()),
            out,
        );
    }
}

/// The object that field `name` of the object at `parent` opens a section for: the field itself
/// when it has properties, or its items (path `name[]`) for an array of such objects.
fn object_of<'a>(
    parent: &str,
    name: &str,
    prop: &'a Value,
) -> Option<(String, &'a Value, Vec<&'a str>)> {
    let path = if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}.{name}")
    };
    let own = prop["description"].as_str();
    if prop.get("properties").is_some() {
        return Some((path, prop, own.into_iter().collect()));
    }
    let items = &prop["items"];
    if prop["type"] == "array" && items.get("properties").is_some() {
        let descriptions = own
            .into_iter()
            .chain(items["description"].as_str())
            .collect();
        return Some((format!("{path}[]"), items, descriptions));
    }
    None
}

fn properties(schema: &Value) -> impl Iterator<Item = (&String, &Value)> {
    schema["properties"].as_object().into_iter().flatten()
}

fn section(w: &mut String, s: &Section<'_>, anchor_of: &dyn Fn(&str) -> Option<String>) {
    let hashes = if s.depth == 0 { "##" } else { "###" };
    let _ = writeln!(w, "{hashes} `{}`\n", s.path);
    if let Some(parent) = &s.parent {
        let link = anchor_of(parent).unwrap_or_default();
        let _ = writeln!(w, "In [`{parent}`](#{link}).\n");
    }
    match s.descriptions.as_slice() {
        [] => {}
        [one] => {
            let _ = writeln!(w, "{}\n", text(one));
        }
        [field, item, ..] => {
            let _ = writeln!(w, "{}\n\nEach item: {}\n", text(field), text(item));
        }
    }
    let required: BTreeSet<&str> = str_list(&s.schema["required"]).into_iter().collect();
    let _ = writeln!(w, "| Field | Description | Default | Validation |");
    let _ = writeln!(w, "|---|---|---|---|");
    for (name, prop) in properties(s.schema) {
        let link = object_of(&s.path, name, prop).and_then(|(child, _, _)| anchor_of(&child));
        let mut field = format!("{}<br>{}", code(name), type_of(prop, link.as_deref()));
        if required.contains(name.as_str()) {
            field.push_str("<br>**required**");
        }
        let description = text(prop["description"].as_str().unwrap_or_default());
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} |",
            cell(&field),
            cell(&description),
            cell(&default_of(prop)),
            cell(&constraints(prop).join("<br>")),
        );
    }
    let _ = writeln!(w);
    let rules = rules(s.schema);
    if !rules.is_empty() {
        let _ = writeln!(w, "Rules on `{}` (CEL; `self` is this object):\n", s.path);
        for r in rules {
            let _ = writeln!(w, "- {r}");
        }
        let _ = writeln!(w);
    }
}

/// The type of a field, with a link to the section of an object.
fn type_of(prop: &Value, link: Option<&str>) -> String {
    let format = prop["format"].as_str();
    match prop["type"].as_str() {
        Some("array") => format!("array of {}", type_of(&prop["items"], link)),
        Some("object") if prop.get("properties").is_some() => match link {
            Some(anchor) => format!("[object](#{anchor})"),
            None => "object".to_owned(),
        },
        Some("object") if prop["additionalProperties"].is_object() => {
            format!(
                "map of string to {}",
                type_of(&prop["additionalProperties"], None)
            )
        }
        Some("object") => "object (no fields: `{}`)".to_owned(),
        Some("string") if prop["pattern"] == DURATION_PATTERN => {
            "[duration](#conventions)".to_owned()
        }
        Some(t) => match format {
            Some(f) => format!("{t} ({f})"),
            None => t.to_owned(),
        },
        None => "any".to_owned(),
    }
}

/// A field's default: a value, or *its fields' defaults* for an object that defaults to them.
fn default_of(prop: &Value) -> String {
    let Some(default) = prop.get("default") else {
        return String::new();
    };
    match default {
        Value::Object(map) if !map.is_empty() && *default == fields_defaults(prop) => {
            "*its fields' defaults*".to_owned()
        }
        Value::String(s) => code(s),
        other => code(&other.to_string()),
    }
}

/// The object the defaults of `schema`'s fields make up.
fn fields_defaults(schema: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for (name, prop) in properties(schema) {
        if let Some(d) = prop.get("default") {
            out.insert(name.clone(), d.clone());
        } else if prop.get("properties").is_some() {
            let nested = fields_defaults(prop);
            if nested.as_object().is_some_and(|m| !m.is_empty()) {
                out.insert(name.clone(), nested);
            }
        }
    }
    Value::Object(out)
}

/// A field's constraints: enum, pattern, bounds, and the CEL rules declared on it (an object with
/// fields lists its rules in its own section).
fn constraints(prop: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(values) = prop["enum"].as_array() {
        let values: Vec<String> = values
            .iter()
            .map(|v| {
                code(
                    v.as_str()
                        .map_or_else(|| v.to_string(), str::to_owned)
                        .as_str(),
                )
            })
            .collect();
        out.push(format!("one of {}", values.join(", ")));
    }
    if let Some(p) = prop["pattern"].as_str()
        && p != DURATION_PATTERN
    {
        out.push(format!("matches {}", code(p)));
    }
    let bound = |key: &str| prop[key].as_f64().map(number);
    out.extend(range(bound("minimum"), bound("maximum"), ""));
    if let Some(m) = bound("exclusiveMinimum") {
        out.push(format!("> {m}"));
    }
    if let Some(m) = bound("exclusiveMaximum") {
        out.push(format!("< {m}"));
    }
    // A duration's length bound is the same everywhere: the Conventions give it once.
    if prop["pattern"] != DURATION_PATTERN {
        out.extend(range(bound("minLength"), bound("maxLength"), " characters"));
    }
    out.extend(range(bound("minItems"), bound("maxItems"), " items"));
    if prop["x-kubernetes-list-type"] == "map"
        && let Some(keys) = prop["x-kubernetes-list-map-keys"].as_array()
    {
        let keys: Vec<String> = keys.iter().filter_map(Value::as_str).map(code).collect();
        out.push(format!(
            "unique by {} (a list map: a duplicate is refused, server-side apply merges by it)",
            keys.join(" and ")
        ));
    }
    out.extend(range(
        bound("minProperties"),
        bound("maxProperties"),
        " entries",
    ));
    let items = &prop["items"];
    if prop["type"] == "array" && items.get("properties").is_none() {
        out.extend(constraints(items).into_iter().map(|c| format!("each: {c}")));
    }
    if prop.get("properties").is_none() {
        out.extend(rules(prop));
    }
    out
}

fn range(min: Option<String>, max: Option<String>, unit: &str) -> Option<String> {
    match (min, max) {
        (Some(a), Some(b)) => Some(format!("{a} to {b}{unit}")),
        (Some(a), None) => Some(format!("at least {a}{unit}")),
        (None, Some(b)) => Some(format!("at most {b}{unit}")),
        (None, None) => None,
    }
}

fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        v.to_string()
    }
}

/// The CEL rules declared on `schema`: message, rule, and the field a failure is reported at.
fn rules(schema: &Value) -> Vec<String> {
    schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let mut s = format!(
                "{} (rule {})",
                r["message"].as_str().unwrap_or("(no message)"),
                code(r["rule"].as_str().unwrap_or_default())
            );
            if let Some(at) = r["fieldPath"].as_str() {
                let _ = write!(s, ", reported at {}", code(at));
            }
            s
        })
        .collect()
}

fn conditions(w: &mut String) {
    let _ = writeln!(w, "## Conditions\n");
    let _ = writeln!(
        w,
        "`status.conditions` has one entry of each type, in this order, with `status`, `reason`, \
         `message` (the numbers), `lastTransitionTime` and `observedGeneration`. Types and \
         reasons are stable; messages may change. What to do about each: \
         [operating.md](operating.md#conditions).\n"
    );
    let _ = writeln!(w, "| Condition | Status | Reason | Meaning |");
    let _ = writeln!(w, "|---|---|---|---|");
    for c in CONDITIONS {
        let _ = writeln!(
            w,
            "| {} | | | {} |",
            cell(&format!("**{}**", code(c.type_))),
            cell(c.meaning)
        );
        for r in c.reasons {
            let _ = writeln!(
                w,
                "| | {} | {} | {} |",
                r.status,
                cell(&code(r.reason)),
                cell(r.meaning)
            );
        }
    }
    let _ = writeln!(w);
}

fn events(w: &mut String) {
    let _ = writeln!(w, "## Events\n");
    let _ = writeln!(
        w,
        "The operator publishes these Events on the policy (`kubectl events --for \
         connectionpolicy/NAME`). A repeated Event is counted in one series rather than \
         repeated.\n"
    );
    let _ = writeln!(w, "| Type | Reason | When |");
    let _ = writeln!(w, "|---|---|---|");
    for e in EVENTS {
        let _ = writeln!(
            w,
            "| {} | {} | {} |",
            e.type_,
            cell(&code(e.reason)),
            cell(e.meaning)
        );
    }
    let _ = writeln!(w);
}

/// GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, `-1`, `-2`... on
/// a repeat.
#[derive(Debug, Default)]
struct Anchors(BTreeSet<String>);

impl Anchors {
    fn slug(heading: &str) -> String {
        heading
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .flat_map(char::to_lowercase)
            .collect()
    }

    fn add(&mut self, heading: &str) -> String {
        let base = Self::slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while !self.0.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        anchor
    }
}

/// `s` as a code span, fenced with more backticks than it contains in a row.
fn code(s: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in s.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    if longest > 0 || s.starts_with(' ') || s.ends_with(' ') {
        format!("{fence} {s} {fence}")
    } else {
        format!("{fence}{s}{fence}")
    }
}

/// A description as Markdown: paragraphs kept, line breaks inside them joined.
fn text(s: &str) -> String {
    s.trim()
        .split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// `s` fit for a table cell: paragraphs as `<br><br>`, pipes escaped.
fn cell(s: &str) -> String {
    s.replace("\n\n", "<br><br>")
        .replace('\n', " ")
        .replace('|', "\\|")
}

fn str_list(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn join_code(items: &[&str]) -> String {
    items.iter().map(|s| code(s)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_spans_survive_backticks_and_tables_survive_pipes() {
        assert_eq!(code("a"), "`a`");
        assert_eq!(code("a`b"), "`` a`b ``");
        assert_eq!(cell(&code("a || b")), "`a \\|\\| b`");
    }

    #[test]
    fn anchors_follow_github_and_stay_unique() {
        let mut a = Anchors::default();
        assert_eq!(a.add("spec.backends[].pool"), "specbackendspool");
        assert_eq!(a.add("Printer columns"), "printer-columns");
        assert_eq!(a.add("Printer columns"), "printer-columns-1");
    }

    #[test]
    fn numbers_read_as_written() {
        assert_eq!(number(1_000_000.0), "1000000");
        assert_eq!(number(0.9), "0.9");
        assert_eq!(
            range(Some("1".into()), None, " items").as_deref(),
            Some("at least 1 items")
        );
    }
}
