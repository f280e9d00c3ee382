//! Tests of the `ConnectionPolicy` API: the committed CRD YAML and reference doc, the sample
//! policy, defaults and the shape of the generated schema (CEL rules, docs, printer columns).

use std::collections::BTreeSet;

use serde_json::Value;

use super::*;

const SAMPLE: &str = include_str!("../../examples/connectionpolicy.yaml");

fn crd_json() -> Value {
    serde_json::to_value(crd()).expect("the CRD serialises")
}

/// The schema of `spec`, or of a sub-object of it, by property path.
fn spec_schema(path: &[&str]) -> Value {
    let mut v =
        crd_json()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            .clone();
    for p in path {
        v = match v.get("items") {
            Some(items) if v["type"] == "array" => items["properties"][*p].clone(),
            _ => v["properties"][*p].clone(),
        };
        assert!(!v.is_null(), "no schema at {path:?} ({p})");
    }
    v
}

fn rules(schema: &Value) -> Vec<String> {
    schema["x-kubernetes-validations"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| r["rule"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// This crate's directory: cargo's at run time, so that a test binary reused from another
/// checkout sharing the target directory checks this checkout's files; else the compiled-in one.
fn crate_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}

#[test]
fn committed_crd_yaml_matches_the_types() {
    let path = crate_dir().join("connectionpolicy.yaml");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == crd_yaml(),
        "crds/connectionpolicy.yaml is out of date: run `make crds`"
    );
}

/// `make crds` copies the CRD where kustomize (manifests/crds) and Helm (the chart's crds/) read
/// it, since neither can reach this folder; a stale copy installs an older schema.
#[test]
fn the_crd_copies_in_manifests_and_the_chart_match_the_types() {
    for copy in [
        "manifests/crds/connectionpolicy.yaml",
        "charts/poolpilot/crds/connectionpolicy.yaml",
    ] {
        let committed =
            std::fs::read_to_string(crate_dir().join("..").join(copy)).unwrap_or_default();
        assert!(
            committed == crd_yaml(),
            "{copy} is out of date: run `make crds`"
        );
    }
}

fn committed_reference() -> String {
    let path = crate_dir().join("..").join(reference::REFERENCE_PATH);
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn committed_reference_doc_matches_the_crd() {
    let committed = committed_reference();
    let generated = reference_markdown();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "docs/connectionpolicy-reference.md is out of date (first difference at line {}): \
             run `make crds`",
            line + 1
        );
    }
}

/// The headings' anchors as GitHub makes them, in document order.
fn heading_anchors(markdown: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    let mut in_fence = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_fence = !in_fence;
        }
        let Some(heading) = line.strip_prefix('#').filter(|_| !in_fence) else {
            continue;
        };
        let slug: String = heading
            .trim_start_matches('#')
            .trim()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .flat_map(char::to_lowercase)
            .collect();
        let mut anchor = slug.clone();
        let mut n = 0;
        while !anchors.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
    }
    anchors
}

#[test]
fn the_reference_covers_every_field_and_its_links_resolve() {
    let doc = reference_markdown();
    let anchors = heading_anchors(&doc);
    let mut links = 0;
    for (i, _) in doc.match_indices("](#") {
        let target: String = doc[i + 3..].chars().take_while(|c| *c != ')').collect();
        assert!(
            anchors.contains(&target),
            "link to #{target} has no heading; headings: {anchors:?}"
        );
        links += 1;
    }
    assert!(links > 40, "only {links} internal links");
    // Every field of the schema is a row of its object's table.
    fn walk(path: &str, schema: &Value, doc: &str, rows: &mut usize) {
        for (name, sub) in schema["properties"].as_object().into_iter().flatten() {
            assert!(
                doc.contains(&format!("| `{name}`<br>")),
                "no row for {path}.{name}"
            );
            *rows += 1;
            walk(&format!("{path}.{name}"), sub, doc, rows);
        }
        if schema["type"] == "array" {
            walk(&format!("{path}[]"), &schema["items"], doc, rows);
        }
    }
    let root = &crd_json()["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut rows = 0;
    for top in ["spec", "status"] {
        walk(top, &root["properties"][top], &doc, &mut rows);
    }
    assert!(rows > 100, "walked only {rows} fields");
    for heading in [
        "## `spec`",
        "### `spec.backends[].pool`",
        "### `spec.clients.overrides[].match`",
        "## `status`",
        "### `status.conditions[]`",
        "## Printer columns",
        "## Conditions",
        "## Events",
    ] {
        assert!(
            doc.lines().any(|l| l == heading),
            "{heading} missing from the reference"
        );
    }
}

#[test]
fn the_reference_shows_types_defaults_bounds_and_rules_where_they_are_declared() {
    let doc = reference_markdown();
    let section = |heading: &str| -> String {
        let start = doc
            .find(&format!("\n{heading}\n"))
            .unwrap_or_else(|| panic!("no section {heading}"));
        let rest = &doc[start + heading.len() + 2..];
        let end = rest
            .find("\n## ")
            .into_iter()
            .chain(rest.find("\n### "))
            .min();
        rest[..end.unwrap_or(rest.len())].to_owned()
    };
    let row = |section: &str, field: &str| -> String {
        section
            .lines()
            .find(|l| l.starts_with(&format!("| `{field}`<br>")))
            .unwrap_or_else(|| panic!("no row {field} in:\n{section}"))
            .to_owned()
    };

    let pool = section("### `spec.backends[].pool`");
    let lease = row(&pool, "leaseTimeout");
    for part in [
        "[duration](#conventions)",
        "`300ms`",
        "Longest wait for a pooled connection",
        "must be longer than 0s (rule `duration(self) > duration('0s')`)",
    ] {
        assert!(lease.contains(part), "{part:?} missing from {lease}");
    }
    assert!(row(&pool, "maxPending").contains("0 to 1000000"));
    // The object's own rule is listed under the object, not under a field.
    assert!(pool.contains(
        "- pool.validateAfterIdle must not exceed pool.idleTimeout (rule \
         `duration(self.validateAfterIdle) <= duration(self.idleTimeout)`)"
    ));

    let capacity = section("### `spec.backends[].capacity`");
    let max = row(&capacity, "maxConnectionsPerEndpoint");
    assert!(max.contains("integer (int32)<br>**required**"), "{max}");
    assert!(max.contains("1 to 1000000"), "{max}");

    let spec = section("## `spec`");
    assert!(
        row(&spec, "backends").contains("array of [object](#specbackends)"),
        "{spec}"
    );
    assert!(row(&spec, "autoscale").contains("*its fields' defaults*"));
    assert!(
        row(&spec, "backends").contains(
            "unique by `name` (a list map: a duplicate is refused, server-side apply merges by it)"
        ),
        "{spec}"
    );

    let rollout = section("### `spec.rollout`");
    assert!(row(&rollout, "strategy").contains("one of `Progressive`, `AllAtOnce`"));
    let identity = section("### `spec.clients.identity`");
    assert!(
        row(&identity, "header").contains("\\|"),
        "a pipe in a pattern is escaped in the table"
    );

    for column in [
        "| Targets | string | `.status.targets` |",
        "| Ready | string | `.status.conditions[?(@.type==\"Ready\")].status` |",
    ] {
        assert!(doc.contains(column), "{column} missing");
    }
    for c in conditions::CONDITIONS {
        assert!(
            doc.contains(&format!("| **`{}`** |", c.type_)),
            "{}",
            c.type_
        );
    }
    assert!(doc.contains("| Warning | `ReconcileFailed` |"));
}

#[test]
fn a_backends_default_max_tokens_is_optional_and_bounded_by_the_schema() {
    let schema = spec_schema(&["backends", "defaultMaxTokens"]);
    assert_eq!(
        (schema["minimum"].as_f64(), schema["maximum"].as_f64()),
        (Some(1.0), Some(10_000_000.0)),
        "{schema}"
    );
    let required = spec_schema(&["backends"])["items"]["required"].clone();
    assert!(
        !required
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "defaultMaxTokens"),
        "{required}"
    );
    let mut p = sample();
    assert_eq!(p.spec.backends[0].default_max_tokens, None);
    let mut backend = serde_json::to_value(&p.spec.backends[0]).unwrap();
    backend["defaultMaxTokens"] = 8192.into();
    p.spec.backends[0] = serde_json::from_value(backend).unwrap();
    assert_eq!(p.spec.backends[0].default_max_tokens, Some(8192));
    assert_eq!(cel_errors(&p), Vec::<String>::new());
}

#[test]
fn sample_policy_parses_with_its_values() {
    let p: ConnectionPolicy = serde_norway::from_str(SAMPLE).expect("the sample parses");
    assert_eq!(p.spec.backends.len(), 2);
    let a = &p.spec.backends[0];
    assert_eq!(a.capacity.budget(), 51);
    assert_eq!(a.pool.lease_timeout, Duration::from_millis(300));
    assert_eq!(a.endpoints.service.as_ref().map(|s| s.port), Some(8000));
    let b = &p.spec.backends[1];
    assert_eq!(b.capacity.headroom, 0.2, "headroom defaults to 20%");
    assert_eq!(
        b.pool,
        PoolSpec::default(),
        "an omitted pool takes the defaults"
    );
    let clients = p.spec.clients.as_ref().expect("clients are set");
    assert_eq!(clients.identity.header.as_deref(), Some("authorization"));
    assert_eq!(clients.overrides[0].max_concurrency, 40);
    assert_eq!(p.spec.autoscale.max, Some(25));
    assert_eq!(p.spec.rollout.strategy, RolloutStrategy::Progressive);
}

#[test]
fn minimal_policy_takes_documented_defaults() {
    let p: ConnectionPolicySpec = serde_norway::from_str(
        "gatewaySelector: {}\nbackends:\n- name: m\n  endpoints: {addresses: [{address: '127.0.0.1:80'}]}\n  capacity: {maxConnectionsPerEndpoint: 10}\n",
    )
    .expect("a minimal spec parses");
    assert_eq!(p.autoscale, AutoscaleSpec::default());
    assert!(p.autoscale.enabled);
    assert_eq!(p.autoscale.interval, Duration::from_secs(15));
    assert_eq!(
        p.autoscale.scale_down.stabilization_window,
        Duration::from_secs(300)
    );
    assert_eq!(p.file_descriptors.reserve, 256);
    assert_eq!(p.listener.max_connections, 1024);
    assert_eq!(p.rollout.canary_pods, 1);
    assert_eq!(p.backends[0].timeouts.total, Duration::from_secs(120));
    assert_eq!(p.backends[0].capacity.budget(), 8);
}

#[test]
fn source_ip_identity_round_trips() {
    let id: ClientIdentitySpec = serde_norway::from_str("sourceIP: {}").unwrap();
    assert_eq!(id.source_ip, Some(SourceIp {}));
    assert_eq!(
        serde_json::to_value(&id).unwrap(),
        serde_json::json!({"sourceIP": {}})
    );
}

#[test]
fn capacity_budget_rounds_down_and_never_reaches_zero() {
    let c = |max, headroom| CapacitySpec {
        max_connections_per_endpoint: max,
        headroom,
    };
    assert_eq!(c(64, 0.2).budget(), 51);
    assert_eq!(c(700, 0.2).budget(), 560);
    assert_eq!(c(10, 0.0).budget(), 10);
    assert_eq!(c(1, 0.9).budget(), 1);
}

#[test]
fn crd_names_scope_and_subresources() {
    let crd = crd_json();
    assert_eq!(crd["metadata"]["name"], "connectionpolicies.poolpilot.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(
        crd["spec"]["names"]["shortNames"],
        serde_json::json!(["cpol"])
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert_eq!(version["subresources"]["status"], serde_json::json!({}));
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        columns,
        [
            "Targets",
            "Updated",
            "Ready",
            "Saturated",
            "Accepted",
            "Metrics",
            "FdBudget",
            "Rollout",
            "Age"
        ]
    );
    // The condition reasons show only with `kubectl get cpol -o wide`.
    let wide: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["priority"] == 1)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(wide, ["Accepted", "Metrics", "FdBudget", "Rollout"]);
}

#[test]
fn names_are_list_map_keys_where_they_must_be_unique() {
    // The API server refuses a duplicate key and server-side apply merges by it, in linear
    // time, where a CEL rule comparing every pair would be quadratic.
    for (schema, key) in [
        (spec_schema(&["backends"]), "name"),
        (spec_schema(&["clients", "overrides"]), "name"),
        (
            crd_json()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
                ["properties"]["conditions"]
                .clone(),
            "type",
        ),
    ] {
        assert_eq!(schema["x-kubernetes-list-type"], "map", "{schema}");
        assert_eq!(
            schema["x-kubernetes-list-map-keys"],
            serde_json::json!([key]),
            "{schema}"
        );
        assert!(
            schema["items"]["required"]
                .as_array()
                .is_some_and(|r| r.iter().any(|k| k == key)),
            "a list-map key must be required: {schema}"
        );
    }
}

#[test]
fn rules_that_can_name_the_numbers_do() {
    // Rules comparing two durations say which values, with messageExpression. (The API server
    // estimates the cost of a message that formats a number, `string(int)`, or names a backend
    // of the list as beyond its budget, so the rules on counts keep their fixed messages.)
    let expressions = |schema: &Value| -> Vec<String> {
        schema["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["messageExpression"].as_str().map(str::to_owned))
            .collect()
    };
    for (path, count) in [
        (&["backends", "pool"][..], 1),
        (&["backends", "timeouts"][..], 2),
        (&["backends", "healthCheck"][..], 1),
    ] {
        let found = expressions(&spec_schema(path));
        assert_eq!(found.len(), count, "{path:?}: {found:?}");
        for e in &found {
            assert!(e.contains("+ self."), "{e}");
        }
    }
}

#[test]
fn schema_carries_the_cross_field_rules() {
    let spec = rules(&spec_schema(&[]));
    assert!(
        spec.iter().any(|r| r.contains("self.autoscale.max")),
        "max ≤ capacity: {spec:?}"
    );
    assert!(
        spec.iter().any(|r| r.contains("self.autoscale.min")),
        "min ≤ capacity: {spec:?}"
    );
    assert!(
        rules(&spec_schema(&["autoscale"]))
            .iter()
            .any(|r| r == "!has(self.max) || self.min <= self.max")
    );
    let timeouts = rules(&spec_schema(&["backends", "timeouts"]));
    assert!(
        timeouts
            .iter()
            .any(|r| r.contains("firstByte") && r.contains("total")),
        "{timeouts:?}"
    );
    assert!(!rules(&spec_schema(&["backends", "endpoints"])).is_empty());
    assert!(!rules(&spec_schema(&["clients", "identity"])).is_empty());
    let lease = spec_schema(&["backends", "pool", "leaseTimeout"]);
    assert_eq!(rules(&lease), ["duration(self) > duration('0s')"]);
    assert_eq!(lease["pattern"], crate::duration::DURATION_PATTERN);
}

#[test]
fn every_spec_field_is_documented() {
    fn walk(path: &str, schema: &Value, seen: &mut usize, missing: &mut Vec<String>) {
        if let Some(props) = schema["properties"].as_object() {
            for (name, sub) in props {
                let at = format!("{path}.{name}");
                *seen += 1;
                if sub["description"].as_str().is_none_or(str::is_empty) {
                    missing.push(at.clone());
                }
                walk(&at, sub, seen, missing);
            }
        }
        if schema["type"] == "array" {
            walk(path, &schema["items"], seen, missing);
        }
    }
    let root = &crd_json()["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let (mut seen, mut missing) = (0, Vec::new());
    walk("spec", &root["properties"]["spec"], &mut seen, &mut missing);
    walk(
        "status",
        &root["properties"]["status"],
        &mut seen,
        &mut missing,
    );
    assert!(seen > 100, "the walk reached only {seen} fields");
    // Kubernetes' own types (label selectors, conditions) come documented from k8s-openapi.
    assert!(
        missing.is_empty(),
        "fields without a doc comment: {missing:?}"
    );
}

// === CEL rules, evaluated client-side as the apiserver would ===

fn sample() -> ConnectionPolicy {
    serde_norway::from_str(SAMPLE).expect("the sample parses")
}

/// The CEL messages `policy` violates (empty: the apiserver accepts it).
fn cel_errors(policy: &ConnectionPolicy) -> Vec<String> {
    match kube::core::cel::validate_cel(policy) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(|e| e.message.clone()).collect(),
    }
}

fn assert_refused(policy: &ConnectionPolicy, message: &str) {
    let errors = cel_errors(policy);
    assert!(
        errors.iter().any(|e| e.contains(message)),
        "expected {message:?}, got {errors:?}"
    );
}

#[test]
fn cel_accepts_the_sample() {
    assert_eq!(cel_errors(&sample()), Vec::<String>::new());
}

#[test]
fn cel_refuses_bounds_beyond_capacity() {
    let mut p = sample();
    p.spec.autoscale.max = Some(26); // model-b allows 32 × 0.8 = 25.6
    assert_refused(
        &p,
        "autoscale.max must not exceed capacity.maxConnectionsPerEndpoint × (1 − capacity.headroom)",
    );
    let mut p = sample();
    p.spec.autoscale.max = None;
    p.spec.autoscale.min = 30;
    assert_refused(
        &p,
        "autoscale.min must not exceed capacity.maxConnectionsPerEndpoint × (1 − capacity.headroom)",
    );
    let mut p = sample();
    p.spec.autoscale.min = 20;
    p.spec.autoscale.max = Some(10);
    assert_refused(&p, "autoscale.min must not exceed autoscale.max");
}

#[test]
fn cel_refuses_zero_durations_and_first_byte_beyond_total() {
    let mut p = sample();
    p.spec.backends[0].pool.lease_timeout = Duration::ZERO;
    assert_refused(&p, "must be longer than 0s");
    let mut p = sample();
    p.spec.backends[0].timeouts.first_byte = Duration::from_secs(200);
    assert_refused(&p, "timeouts.firstByte must not exceed timeouts.total");
    let mut p = sample();
    p.spec.backends[0].pool.validate_after_idle = Duration::from_secs(60);
    assert_refused(
        &p,
        "pool.validateAfterIdle must not exceed pool.idleTimeout",
    );
}

#[test]
fn cel_refuses_ambiguous_endpoints_and_identities() {
    let mut p = sample();
    p.spec.backends[0].endpoints.addresses = Some(vec![StaticEndpoint {
        name: None,
        address: "10.0.0.1:80".into(),
    }]);
    assert_refused(
        &p,
        "set exactly one of endpoints.service, endpoints.addresses and endpoints.external",
    );
    let mut p = sample();
    p.spec.clients.as_mut().unwrap().identity.source_ip = Some(SourceIp {});
    assert_refused(
        &p,
        "set exactly one of identity.header and identity.sourceIP",
    );
}

#[test]
fn cel_refuses_static_endpoints_that_lead_back_into_the_pod_or_to_the_node() {
    let with = |address: &str, allow: bool| {
        let mut p = sample();
        let endpoints = &mut p.spec.backends[0].endpoints;
        endpoints.service = None;
        endpoints.addresses = Some(vec![StaticEndpoint {
            name: None,
            address: address.into(),
        }]);
        endpoints.allow_private_addresses = allow;
        cel_errors(&p)
    };
    let message = "endpoints.addresses must be unicast addresses outside the pod and the node: loopback, link-local, metadata, multicast and broadcast addresses need endpoints.allowPrivateAddresses";
    for address in [
        "127.0.0.1:9901",
        "127.8.9.10:80",
        "[::1]:9901",
        "0.0.0.0:9901",
        "[::]:9901",
        "169.254.169.254:80",
        "[fe80::1]:80",
        "[fd00:ec2::254]:80",
        "[fd00:ec2:0::254]:80",
        "100.100.100.200:80",
        "224.0.0.1:80",
        "255.255.255.255:80",
    ] {
        assert_eq!(with(address, false), [message], "{address}");
        assert_eq!(
            with(address, true),
            Vec::<String>::new(),
            "allowed: {address}"
        );
    }
    // Not ip:port at all (Kubernetes' isIP also refuses IPv4-mapped IPv6), allowed or not.
    let not_ip_port = "endpoints.addresses must be ip:port (IPv6 as [addr]:port)";
    for address in [
        "not-an-address",
        "[::1",
        "10.0.0.1",
        "10.0.0.1:http",
        "[::ffff:127.0.0.1]:9901",
    ] {
        for allow in [false, true] {
            assert!(
                with(address, allow).contains(&not_ip_port.to_owned()),
                "{address}"
            );
        }
    }
    for address in ["10.0.0.5:8000", "192.168.1.20:80", "[2001:db8::7]:8000"] {
        assert_eq!(with(address, false), Vec::<String>::new(), "{address}");
    }
}

#[test]
fn cel_refuses_client_rule_breaks() {
    let mut p = sample();
    p.spec
        .clients
        .as_mut()
        .unwrap()
        .slow_calls
        .as_mut()
        .unwrap()
        .demoted_concurrency = 9;
    assert_refused(
        &p,
        "clients.slowCalls.demotedConcurrency must not exceed clients.maxConcurrency",
    );
}

#[test]
fn cel_refuses_trusted_proxies_that_are_not_cidrs() {
    let mut p = sample();
    p.spec.listener.trusted_proxies = Some(TrustedProxiesSpec {
        cidrs: vec!["10.0.0.0/8".into(), "fd00::/8".into()],
        protocol: TrustedProxyProtocol::ProxyV2,
    });
    assert_eq!(cel_errors(&p), Vec::<String>::new());
    p.spec.listener.trusted_proxies.as_mut().unwrap().cidrs = vec!["10.0.0.300/8".into()];
    assert_refused(&p, "every entry must be a CIDR");
}

#[test]
fn cel_refuses_a_capacity_that_leaves_nothing() {
    let mut p = sample();
    p.spec.autoscale.min = 1;
    p.spec.autoscale.max = None;
    p.spec.backends[1].capacity = CapacitySpec {
        max_connections_per_endpoint: 1,
        headroom: 0.5,
    };
    assert_refused(
        &p,
        "capacity leaves less than one connection per endpoint after headroom",
    );
}

#[test]
fn crd_uses_only_formats_kubernetes_knows_and_unwrapped_docs() {
    let text = serde_json::to_string(&crd_json()).unwrap();
    for f in ["uint8", "uint16", "uint32", "uint64"] {
        assert!(
            !text.contains(&format!("\"format\":\"{f}\"")),
            "format {f} left in the CRD"
        );
    }
    let pending = spec_schema(&["backends", "pool", "maxPending"]);
    assert!(
        !pending["description"].as_str().unwrap().contains('\n'),
        "{pending}"
    );
}

#[test]
fn cel_messages_name_the_durations() {
    let message = |p: &ConnectionPolicy| cel_errors(p).join(" | ");
    let mut p = sample();
    p.spec.backends[0].timeouts.first_byte = Duration::from_secs(200);
    assert_eq!(
        message(&p),
        "timeouts.firstByte must not exceed timeouts.total: 3m20s > 2m"
    );
    let mut p = sample();
    p.spec.backends[0].timeouts.stream_idle = Duration::from_secs(130);
    assert_eq!(
        message(&p),
        "timeouts.streamIdle must not exceed timeouts.total: 2m10s > 2m"
    );
    let mut p = sample();
    p.spec.backends[0].pool.validate_after_idle = Duration::from_secs(3600);
    assert!(
        message(&p).starts_with("pool.validateAfterIdle must not exceed pool.idleTimeout: 1h > "),
        "{}",
        message(&p)
    );
}

#[test]
fn cel_takes_priority_classes_and_refuses_an_aging_bound_the_queues_never_reach() {
    let with = |priority: PrioritySpec| {
        let mut p = sample();
        let clients = p.spec.clients.as_mut().expect("the sample limits clients");
        clients.queue_timeout = Duration::from_secs(2);
        clients.priority = Some(priority);
        for b in &mut p.spec.backends {
            b.pool.lease_timeout = Duration::from_millis(300);
        }
        p
    };
    let good = PrioritySpec {
        header: Some("x-poolpilot-priority".into()),
        aging_after: Some(Duration::from_millis(150)),
        batch_max_percent: Some(50),
        ..PrioritySpec::default()
    };
    assert_eq!(cel_errors(&with(good.clone())), Vec::<String>::new());
    assert_refused(
        &with(PrioritySpec {
            aging_after: Some(Duration::from_millis(300)),
            ..good.clone()
        }),
        "clients.priority.agingAfter must be shorter than every backend's pool.leaseTimeout",
    );
    let mut slow_pool = with(PrioritySpec {
        aging_after: Some(Duration::from_secs(3)),
        ..good.clone()
    });
    for b in &mut slow_pool.spec.backends {
        b.pool.lease_timeout = Duration::from_secs(10);
    }
    assert_refused(
        &slow_pool,
        "clients.priority.agingAfter must be shorter than clients.queueTimeout",
    );
    assert_refused(
        &with(PrioritySpec {
            header: None,
            trust_header: true,
            ..good
        }),
        "clients.priority.trustHeader needs clients.priority.header",
    );
}

#[test]
fn a_priority_spec_reads_as_documented() {
    let clients: ClientsSpec = serde_norway::from_str(
        "identity: {header: authorization}\nmaxConcurrency: 4\noverrides:\n- {name: nightly, match: {keySha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}, maxConcurrency: 2, class: Batch}\npriority: {header: x-poolpilot-priority}\n",
    )
    .expect("parses");
    let p = clients.priority.expect("priority");
    assert_eq!(p.default_class, PriorityClassSpec::Interactive);
    assert!(!p.trust_header);
    assert_eq!((p.aging_after, p.batch_max_percent), (None, None));
    assert_eq!(clients.overrides[0].class, Some(PriorityClassSpec::Batch));
}

#[test]
fn cel_takes_external_names_but_not_ones_inside_the_cluster() {
    let with = |host: &str, allow: bool| {
        let mut p = sample();
        let endpoints = &mut p.spec.backends[0].endpoints;
        endpoints.service = None;
        endpoints.external = Some(vec![ExternalEndpoint {
            name: None,
            host: host.into(),
            port: 443,
            tls: Some(Default::default()),
        }]);
        endpoints.allow_private_addresses = allow;
        cel_errors(&p)
    };
    assert_eq!(with("api.openai.com", false), Vec::<String>::new());
    let message = "endpoints.external must name hosts outside the cluster and the pod: localhost, *.localhost, *.svc, *.cluster.local and *.internal need endpoints.allowPrivateAddresses";
    for host in [
        "localhost",
        "gw.localhost",
        "kubernetes.default.svc",
        "x.default.svc.cluster.local",
        "metadata.google.internal",
    ] {
        assert_eq!(with(host, false), [message], "{host}");
        assert_eq!(with(host, true), Vec::<String>::new(), "{host}");
    }
    let mut p = sample();
    p.spec.backends[0].endpoints.external = Some(vec![ExternalEndpoint {
        name: None,
        host: "api.openai.com".into(),
        port: 443,
        tls: Some(Default::default()),
    }]);
    assert_refused(
        &p,
        "set exactly one of endpoints.service, endpoints.addresses and endpoints.external",
    );
}

#[test]
fn cel_holds_external_tls_and_credentials_to_their_rules() {
    let external = |port: u16, tls: Option<serde_json::Value>| {
        let mut p = sample();
        let endpoints = &mut p.spec.backends[0].endpoints;
        endpoints.service = None;
        endpoints.external = Some(vec![ExternalEndpoint {
            name: None,
            host: "api.openai.com".into(),
            port,
            tls: tls.map(|t| serde_json::from_value(t).unwrap()),
        }]);
        p
    };
    let plain_443 = "endpoints.external on port 443 must set tls (plain HTTP to an HTTPS port would carry keys in clear text)";
    assert_refused(&external(443, None), plain_443);
    assert_eq!(
        cel_errors(&external(443, Some(serde_json::json!({})))),
        Vec::<String>::new()
    );
    assert_eq!(cel_errors(&external(8080, None)), Vec::<String>::new());

    let with_credentials = |mut p: ConnectionPolicy, credentials: serde_json::Value| {
        p.spec.backends[0].credentials = Some(serde_json::from_value(credentials).unwrap());
        cel_errors(&p)
    };
    let bearer =
        serde_json::json!({"secretRef": {"name": "openai", "key": "api-key"}, "scheme": "Bearer"});
    assert_eq!(
        with_credentials(external(443, Some(serde_json::json!({}))), bearer.clone()),
        Vec::<String>::new()
    );
    assert_eq!(
        with_credentials(external(8080, None), bearer.clone()),
        ["credentials go to external endpoints over TLS only: set tls on every endpoints.external"]
    );
    let header_rule = "credentials.header is set exactly for the Header scheme";
    let tls = || {
        external(
            443,
            Some(serde_json::json!({"serverName": "api.openai.com"})),
        )
    };
    assert_eq!(
        with_credentials(
            tls(),
            serde_json::json!({"secretRef": {"name": "p", "key": "k"}, "scheme": "Header"})
        ),
        [header_rule]
    );
    assert_eq!(
        with_credentials(
            tls(),
            serde_json::json!({"secretRef": {"name": "p", "key": "k"}, "scheme": "Bearer", "header": "x-key"})
        ),
        [header_rule]
    );
    assert_eq!(
        with_credentials(
            tls(),
            serde_json::json!({"secretRef": {"name": "p", "key": "k"}, "scheme": "Header", "header": "x-goog-api-key"})
        ),
        Vec::<String>::new()
    );
}

#[test]
fn cel_refuses_auto_without_tls_and_takes_h2c() {
    let with = |protocol: &str, endpoints: serde_json::Value| {
        let mut p = sample();
        let b = &mut p.spec.backends[0];
        b.endpoints = serde_json::from_value(endpoints).unwrap();
        b.protocol = serde_json::from_value(serde_json::json!(protocol)).unwrap();
        cel_errors(&p)
    };
    let tls = serde_json::json!({"external": [
        {"host": "api.example.com", "port": 443, "tls": {}},
        {"host": "eu.example.com", "port": 8443, "tls": {"serverName": "api.example.com"}}
    ]});
    let one_plain = serde_json::json!({"external": [
        {"host": "api.example.com", "port": 443, "tls": {}},
        {"host": "eu.example.com", "port": 8080}
    ]});
    let service = serde_json::json!({"service": {"name": "vllm", "port": 8000}});
    let auto = "protocol Auto negotiates by ALPN, over TLS only: set tls on every endpoints.external, or say Http1 or Http2 (h2c) for plain endpoints";
    assert_eq!(with("Auto", tls.clone()), Vec::<String>::new());
    assert_eq!(with("Auto", one_plain.clone()), [auto]);
    assert_eq!(with("Auto", service.clone()), [auto]);
    for protocol in ["Http1", "Http2"] {
        for endpoints in [&tls, &one_plain, &service] {
            assert_eq!(
                with(protocol, endpoints.clone()),
                Vec::<String>::new(),
                "{protocol} {endpoints}"
            );
        }
    }
    let schema = spec_schema(&["backends", "protocol"]);
    assert_eq!(
        schema["enum"],
        serde_json::json!(["Http1", "Auto", "Http2"]),
        "no other value is taken: {schema}"
    );
    assert!(
        serde_json::from_value::<upstream::ProtocolSpec>(serde_json::json!("h2")).is_err(),
        "nor spelled otherwise"
    );
}

#[test]
fn the_providers_example_is_accepted() {
    let p: ConnectionPolicy =
        serde_norway::from_str(include_str!("../../examples/providers.yaml")).unwrap();
    assert_eq!(cel_errors(&p), Vec::<String>::new());
    let credentials: Vec<_> = p
        .spec
        .backends
        .iter()
        .map(|b| b.credentials.as_ref().unwrap().scheme)
        .collect();
    assert_eq!(
        credentials,
        [
            upstream::CredentialSchemeSpec::Bearer,
            upstream::CredentialSchemeSpec::Bearer,
            upstream::CredentialSchemeSpec::AzureApiKey
        ]
    );
    assert_eq!(p.spec.backends[0].fallback, ["openai-second-project"]);
}

#[test]
fn cel_refuses_a_fallback_that_is_not_another_backend_of_the_policy() {
    let with = |fallback: &[&str]| {
        let mut p = sample();
        p.spec.backends[0].fallback = fallback.iter().map(|f| f.to_string()).collect();
        cel_errors(&p)
    };
    assert_eq!(with(&["model-b"]), Vec::<String>::new());
    for bad in [&["model-a"][..], &["model-c"], &["model-b", "nope"]] {
        assert_eq!(
            with(bad),
            ["backends[].fallback names other backends of this policy"],
            "{bad:?}"
        );
    }
}

#[test]
fn cel_refuses_token_budgets_that_break_their_rules() {
    let with = |tokens: &str| {
        let mut p = sample();
        p.spec.clients.as_mut().unwrap().tokens =
            Some(serde_norway::from_str(tokens).expect("parses"));
        cel_errors(&p)
    };
    assert_eq!(
        with("{perMinute: 60000, perDay: 2000000, requestsPerMinute: 600}"),
        Vec::<String>::new()
    );
    assert_eq!(
        with("{perMinute: 600, count: Weighted, weights: {input: 0.25, output: 1}}"),
        Vec::<String>::new()
    );
    let defaults: TokenBudgetSpec = serde_norway::from_str("perMinute: 600").unwrap();
    assert_eq!(defaults.count, TokenCountSpec::Total);
    assert_eq!(defaults.default_max_tokens, 1024);
    let refused = |tokens: &str, message: &str| {
        let errors = with(tokens);
        assert!(
            errors.iter().any(|e| e.contains(message)),
            "{tokens}: expected {message:?}, got {errors:?}"
        );
    };
    refused(
        "{perMinute: 600, perDay: 100}",
        "tokens.perDay must be at least tokens.perMinute",
    );
    refused(
        "{perMinute: 600, count: Weighted}",
        "tokens.count Weighted needs tokens.weights",
    );
    refused(
        "{perMinute: 600, weights: {input: 0, output: 0}}",
        "tokens.weights must not both be 0",
    );
    // An override's budget is held to the same rules.
    let mut p = sample();
    p.spec.clients.as_mut().unwrap().overrides[0].tokens =
        Some(serde_norway::from_str("{perMinute: 600, perDay: 1}").unwrap());
    assert_refused(&p, "tokens.perDay must be at least tokens.perMinute");
}

/// The saturation query the docs show for vLLM (and modelsim, which exports the same gauge names)
/// is the one the vLLM sample configures: a reader who copies either gets the other.
#[test]
fn the_documented_vllm_saturation_query_is_the_one_the_vllm_sample_configures() {
    let root = crate_dir().join("..");
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap_or_default();
    let sample: ConnectionPolicy =
        serde_norway::from_str(&read("manifests/samples/vllm/connectionpolicy.yaml"))
            .expect("the vLLM sample parses");
    let saturation = sample.spec.backends[0]
        .saturation
        .as_ref()
        .expect("the vLLM sample configures its waiting queue as the saturation signal");
    assert!(
        saturation.query.contains("vllm:num_requests_waiting"),
        "{}",
        saturation.query
    );
    for doc in ["docs/vllm.md", "docs/autoscaling.md"] {
        assert!(
            read(doc).contains(&saturation.query),
            "{doc} does not show the query the vLLM sample configures: {}",
            saturation.query
        );
    }
    assert!(
        read("docs/autoscaling.md").contains(&format!("threshold: {}", saturation.threshold)),
        "docs/autoscaling.md shows another threshold than the sample's {}",
        saturation.threshold
    );
}
