//! Tests of the limits document: its YAML shape, content revision and validation.

use super::*;

const EXAMPLE: &str = r#"
generation: 3
listener:
  maxConnectionsPerClient: 64
clientPolicies:
- name: default
  identity: {header: x-api-key}
  maxConcurrency: 8
  maxQueue: 32
  queueTimeout: 2s
  overrides:
  - {name: batch-team, keySha256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", maxConcurrency: 40}
  slowCalls: {threshold: 20s, maxRatio: 0.2, demotedConcurrency: 2, cooldown: 5m}
backends:
- name: model-a
  match: {pathPrefix: /v1/, headers: {x-model: model-a}}
  endpoints:
  - {name: model-a-0, address: "127.0.0.10:8000"}
  - {name: model-a-1, address: "127.0.0.11:8000"}
  pool:
    maxConnectionsPerEndpoint: 16
    maxPending: 128
    leaseTimeout: 300ms
    idleTimeout: 30s
    maxLifetime: 10m
    connectTimeout: 1s
    validateAfterIdle: 2s
  timeouts: {firstByte: 15s, total: 120s, streamIdle: 15s}
  healthCheck: {path: /health, interval: 5s, unhealthyThreshold: 3, healthyThreshold: 2}
  outlierDetection: {consecutiveFailures: 5, baseEjection: 30s, maxEjectedPercent: 50}
  clientPolicy: default
"#;

fn example() -> GatewayLimits {
    serde_norway::from_str(EXAMPLE).expect("example parses")
}

#[test]
fn example_parses_and_validates() {
    let doc = example();
    assert_eq!(doc.generation, 3);
    assert_eq!(
        doc.backends[0].pool.lease_timeout,
        Duration::from_millis(300)
    );
    assert_eq!(
        doc.client_policies[0].identity,
        ClientIdentity::Header("x-api-key".into())
    );
    assert_eq!(
        doc.listener.max_connections,
        ListenerLimits::default().max_connections
    );
    doc.validate().expect("example is valid");
}

#[test]
fn a_backends_protocol_is_http1_unless_named_and_left_out_when_it_is() {
    let mut doc = example();
    assert_eq!(doc.backends[0].protocol, UpstreamProtocol::Http1);
    let text = serde_json::to_string(&doc).unwrap();
    assert!(!text.contains("protocol"), "{text}");
    for (name, protocol) in [
        ("auto", UpstreamProtocol::Auto),
        ("http2", UpstreamProtocol::Http2),
    ] {
        let yaml = EXAMPLE.replace(
            "  clientPolicy: default",
            &format!("  clientPolicy: default\n  protocol: {name}"),
        );
        doc = serde_norway::from_str(&yaml).unwrap();
        assert_eq!(doc.backends[0].protocol, protocol);
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(json["backends"][0]["protocol"], name);
    }
    let yaml = EXAMPLE.replace(
        "  clientPolicy: default",
        "  clientPolicy: default\n  protocol: h3",
    );
    assert!(serde_norway::from_str::<GatewayLimits>(&yaml).is_err());
}

#[test]
fn json_round_trip_keeps_the_revision() {
    let doc = example().with_content_revision();
    let json = serde_json::to_string(&doc).unwrap();
    let back: GatewayLimits = serde_json::from_str(&json).unwrap();
    assert_eq!(back, doc);
    assert_eq!(back.content_revision(), doc.revision);
    back.validate().unwrap();
}

#[test]
fn revision_follows_content_not_generation() {
    let a = example();
    let mut b = example();
    b.generation += 10;
    assert_eq!(a.content_revision(), b.content_revision());
    b.backends[0].pool.max_connections_per_endpoint += 1;
    assert_ne!(a.content_revision(), b.content_revision());
    assert_eq!(a.content_revision().len(), 12);
}

#[test]
fn a_generation_beyond_what_json_readers_keep_exactly_is_refused() {
    let mut doc = example();
    doc.generation = MAX_GENERATION;
    doc.validate().expect("the largest generation is valid");
    for generation in [MAX_GENERATION + 1, u64::MAX] {
        doc.generation = generation;
        let err = doc.validate().unwrap_err().to_string();
        assert!(
            err.contains("generation") && err.contains(&MAX_GENERATION.to_string()),
            "{err}"
        );
    }
}

#[test]
fn unknown_fields_are_refused() {
    let err = serde_norway::from_str::<GatewayLimits>("generation: 1\nbackendz: []\n").unwrap_err();
    assert!(err.to_string().contains("backendz"), "{err}");
}

#[test]
fn a_stale_revision_is_refused() {
    let mut doc = example().with_content_revision();
    doc.backends[0].pool.max_pending = 1;
    let err = doc.validate().unwrap_err();
    assert_eq!(err.violations.len(), 1);
    assert_eq!(err.violations[0].field, "revision");
}

#[test]
fn every_violation_is_reported_with_its_field() {
    let mut doc = example();
    doc.backends.push(doc.backends[0].clone());
    let b = &mut doc.backends[1];
    b.pool.max_connections_per_endpoint = 0;
    b.pool.lease_timeout = Duration::ZERO;
    b.timeouts.first_byte = Duration::from_secs(300);
    b.client_policy = Some("nope".into());
    b.endpoints.push(b.endpoints[0].clone());
    doc.client_policies[0].overrides[0].key_sha256 = "abc".into();
    doc.client_policies[0].overrides[0].weight = Some(101);
    let err = doc.validate().unwrap_err();
    let fields: Vec<&str> = err.violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "clientPolicies[0].overrides[0].keySha256",
            "clientPolicies[0].overrides[0].weight",
            "backends[1].name",
            "backends[1].endpoints[2].name",
            "backends[1].pool.maxConnectionsPerEndpoint",
            "backends[1].pool.leaseTimeout",
            "backends[1].timeouts.firstByte",
            "backends[1].clientPolicy",
        ]
    );
    let text = err.to_string();
    assert!(text.contains("duplicate backend \"model-a\""), "{text}");
    assert!(text.contains("no client policy named \"nope\""), "{text}");
}

#[test]
fn fallbacks_name_other_backends_of_the_document_once() {
    let mut doc = example();
    let mut other = doc.backends[0].clone();
    other.name = "model-b".into();
    doc.backends.push(other);
    doc.backends[0].fallback = vec!["model-b".into()];
    assert_eq!(doc.validate(), Ok(()));
    doc.backends[0].fallback = vec![
        "model-a".into(),
        "model-b".into(),
        "model-c".into(),
        "model-b".into(),
    ];
    let err = doc.validate().unwrap_err();
    let found: Vec<(&str, &str)> = err
        .violations
        .iter()
        .map(|v| (v.field.as_str(), v.message.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            (
                "backends[0].fallback[0]",
                "a backend cannot be its own fallback"
            ),
            (
                "backends[0].fallback[2]",
                "no backend \"model-c\" in this document"
            ),
            ("backends[0].fallback[3]", "\"model-b\" is named twice"),
        ]
    );
}

#[test]
fn a_backends_default_max_tokens_round_trips_and_must_be_positive() {
    let mut doc = example();
    assert_eq!(doc.backends[0].default_max_tokens, None, "omitted: none");
    assert!(
        !serde_json::to_string(&doc)
            .unwrap()
            .contains("defaultMaxTokens"),
        "and not written"
    );
    doc.backends[0].default_max_tokens = Some(4096);
    let json = serde_json::to_string(&doc).unwrap();
    assert!(json.contains("\"defaultMaxTokens\":4096"), "{json}");
    let back: GatewayLimits = serde_json::from_str(&json).unwrap();
    assert_eq!(back.backends[0].default_max_tokens, Some(4096));
    let yaml: GatewayLimits =
        serde_norway::from_str(&serde_norway::to_string(&doc).unwrap()).unwrap();
    assert_eq!(yaml, doc);
    assert_eq!(doc.validate(), Ok(()));
    doc.backends[0].default_max_tokens = Some(0);
    let err = doc.validate().unwrap_err();
    assert_eq!(
        err.violations
            .iter()
            .map(|v| (v.field.as_str(), v.message.as_str()))
            .collect::<Vec<_>>(),
        [("backends[0].defaultMaxTokens", "must be at least 1")]
    );
}

#[test]
fn source_ip_identity_round_trips() {
    let mut doc = example();
    doc.client_policies[0].identity = ClientIdentity::SourceIp;
    let yaml = serde_norway::to_string(&doc).unwrap();
    assert!(yaml.contains("sourceIp: {}"), "{yaml}");
    let back: GatewayLimits = serde_norway::from_str(&yaml).unwrap();
    assert_eq!(back, doc);
}

#[test]
fn identity_needs_exactly_one_kind() {
    for bad in [
        "{}",
        "{header: x-api-key, sourceIp: {}}",
        "{sourceIp: {a: 1}}",
    ] {
        let err = serde_norway::from_str::<ClientIdentity>(bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("identity"), "{bad}: {err}");
    }
}

/// The fields a document's validation names, in order.
fn violated_fields(doc: &GatewayLimits) -> Vec<String> {
    doc.validate()
        .unwrap_err()
        .violations
        .into_iter()
        .map(|v| v.field)
        .collect()
}

#[test]
fn header_names_and_label_names_are_checked() {
    let mut doc = example();
    doc.client_policies[0].identity = ClientIdentity::Header("x api key".into());
    doc.backends[0].name = "model a".into();
    doc.backends[0].client_policy = None;
    let fields = violated_fields(&doc);
    assert_eq!(
        fields,
        ["clientPolicies[0].identity.header", "backends[0].name"]
    );
}

#[test]
fn priority_rules_are_checked_and_classes_are_picked_as_documented() {
    let mut doc = example();
    doc.client_policies[0].priority = Some(Priority {
        header: Some("bad header".into()),
        aging_after: Some(Duration::ZERO),
        batch_max_percent: Some(101),
        ..Priority::default()
    });
    let fields = violated_fields(&doc);
    assert_eq!(
        fields,
        [
            "clientPolicies[0].priority.header",
            "clientPolicies[0].priority.agingAfter",
            "clientPolicies[0].priority.batchMaxPercent",
        ]
    );

    let p = Priority::default();
    assert_eq!(
        p.aging_in(std::time::Duration::from_millis(300)),
        std::time::Duration::from_millis(150),
        "half the queue's timeout by default"
    );
    use PriorityClass::{Batch, Interactive};
    assert_eq!(
        p.class_of(None, Some(b"batch")),
        Batch,
        "a call may lower itself"
    );
    assert_eq!(p.class_of(None, Some(b"INTERACTIVE")), Interactive);
    let batch_default = Priority {
        default_class: Batch,
        ..Priority::default()
    };
    assert_eq!(
        batch_default.class_of(None, Some(b"interactive")),
        Batch,
        "an untrusted header cannot raise a call"
    );
    let trusted = Priority {
        trust_header: true,
        ..batch_default
    };
    assert_eq!(trusted.class_of(None, Some(b"interactive")), Interactive);
    assert_eq!(
        trusted.class_of(Some(Batch), Some(b"interactive")),
        Batch,
        "an override's class wins"
    );
    assert_eq!(trusted.class_of(None, Some(b"urgent")), Batch);

    // The header sent several times, or as a list, classes by its lowest value: a trusted
    // proxy that appends `batch` (Envoy's `request_headers_to_add` appends by default) is not
    // overruled by the `interactive` its client put first.
    let trusted_interactive = Priority {
        default_class: Interactive,
        ..trusted.clone()
    };
    let values: [&[u8]; 2] = [b"interactive", b"batch"];
    assert_eq!(trusted_interactive.class_of(None, values), Batch);
    assert_eq!(
        trusted_interactive.class_of(None, [b"Interactive , BATCH".as_slice()]),
        Batch
    );
    assert_eq!(
        trusted_interactive.class_of(None, [b" batch\t".as_slice()]),
        Batch,
        "whitespace around a value does not hide it"
    );
    assert_eq!(
        trusted.class_of(None, [b"urgent".as_slice(), b"interactive"]),
        Interactive,
        "an unknown value beside a known one is ignored"
    );
    assert_eq!(
        trusted.class_of(None, Option::<&[u8]>::None),
        Batch,
        "no header: the default"
    );

    let yaml = "{name: p, identity: {header: x}, maxConcurrency: 1, maxQueue: 0, queueTimeout: 1s, overrides: [{name: n, keySha256: aa, maxConcurrency: 1, class: batch}], priority: {defaultClass: batch, agingAfter: 50ms, batchMaxPercent: 30}}";
    let cp: ClientPolicy = serde_norway::from_str(yaml).expect("parses");
    assert_eq!(cp.overrides[0].class, Some(Batch));
    assert_eq!(cp.priority.unwrap().batch_max_percent, Some(30));
}

#[test]
fn an_aging_bound_that_a_queue_times_out_before_is_refused_with_both_timeouts_named() {
    let with_aging = |aging: Duration| {
        let mut doc = example();
        doc.client_policies[0].queue_timeout = Duration::from_secs(2);
        doc.client_policies[0].priority = Some(Priority {
            aging_after: Some(aging),
            ..Priority::default()
        });
        doc.backends[0].client_policy = Some(doc.client_policies[0].name.clone());
        doc.backends[0].pool.lease_timeout = Duration::from_millis(300);
        doc
    };
    assert!(with_aging(Duration::from_millis(150)).validate().is_ok());

    let messages = |doc: GatewayLimits| -> Vec<String> {
        doc.validate()
            .unwrap_err()
            .violations
            .into_iter()
            .map(|v| format!("{}: {}", v.field, v.message))
            .collect()
    };
    assert_eq!(
        messages(with_aging(Duration::from_millis(300))),
        [
            "clientPolicies[0].priority.agingAfter: 300ms is not shorter than backends[0] (\"model-a\") pool.leaseTimeout 300ms: its batch calls would time out in the pool queue before they age"
        ]
    );
    assert_eq!(
        messages(with_aging(Duration::from_secs(2))),
        [
            "clientPolicies[0].priority.agingAfter: 2s is not shorter than queueTimeout 2s: batch calls would time out in their client queue before they age",
            "clientPolicies[0].priority.agingAfter: 2s is not shorter than backends[0] (\"model-a\") pool.leaseTimeout 300ms: its batch calls would time out in the pool queue before they age",
        ]
    );
}

/// A limits file may use the ConnectionPolicy's spellings, `sourceIP` and `ProxyV2` /
/// `XForwardedFor`, beside its own camelCase ones; it is written in its own.
#[test]
fn the_policys_spellings_of_identity_and_proxy_protocol_are_read_too() {
    let identity: ClientIdentity = serde_json::from_str(r#"{"sourceIP": {}}"#).unwrap();
    assert_eq!(identity, ClientIdentity::SourceIp);
    assert_eq!(
        serde_json::to_string(&identity).unwrap(),
        r#"{"sourceIp":{}}"#
    );
    for (spelling, want) in [
        ("ProxyV2", ProxyProtocol::ProxyV2),
        ("proxyV2", ProxyProtocol::ProxyV2),
        ("XForwardedFor", ProxyProtocol::XForwardedFor),
        ("xForwardedFor", ProxyProtocol::XForwardedFor),
    ] {
        let got: ProxyProtocol = serde_json::from_str(&format!("{spelling:?}")).unwrap();
        assert_eq!(got, want, "{spelling}");
    }
    assert_eq!(
        serde_json::to_string(&ProxyProtocol::ProxyV2).unwrap(),
        r#""proxyV2""#
    );
}

#[test]
fn an_endpoint_address_is_ip_port_or_host_port() {
    use crate::limits::EndpointAddress;
    let ip: EndpointAddress = "127.0.0.10:8000".parse().unwrap();
    assert_eq!(ip.ip(), Some(([127, 0, 0, 10], 8000).into()));
    let v6: EndpointAddress = "[::1]:8000".parse().unwrap();
    assert!(v6.ip().is_some());
    let host: EndpointAddress = "API.Example.test.:443".parse().unwrap();
    assert_eq!(
        host,
        EndpointAddress::Host {
            host: "api.example.test".into(),
            port: 443
        }
    );
    assert_eq!(host.to_string(), "api.example.test:443");
    assert_eq!(
        serde_json::to_value(&host).unwrap(),
        serde_json::json!("api.example.test:443")
    );
    for bad in [
        "api.example.test",
        "api.example.test:99999",
        "-api.example.test:443",
        "api_x.example.test:443",
        "10.1:80",
        "0x7f.1:80",
        ":443",
        "a..b:443",
    ] {
        assert!(bad.parse::<EndpointAddress>().is_err(), "{bad}");
    }
    let too_long = format!("{}.test:443", "a.".repeat(130));
    assert!(too_long.parse::<EndpointAddress>().is_err());
}

#[test]
fn token_budgets_read_with_their_defaults_and_their_bounds_are_checked() {
    let budget: TokenBudget = serde_norway::from_str("perMinute: 6000").unwrap();
    assert_eq!(budget.count, TokenCount::Total);
    assert_eq!(budget.default_max_tokens, TokenBudget::DEFAULT_MAX_TOKENS);
    assert_eq!((budget.per_day, budget.requests_per_minute), (None, None));
    assert_eq!(budget.cost(10, 5), 15.0);
    let output: TokenBudget = serde_norway::from_str("{perMinute: 60, count: output}").unwrap();
    assert_eq!(output.cost(10, 5), 5.0);
    let weighted: TokenBudget = serde_norway::from_str(
        "{perMinute: 60, count: weighted, weights: {input: 0.25, output: 2}}",
    )
    .unwrap();
    assert_eq!(weighted.cost(8, 5), 12.0);
    assert!(serde_norway::from_str::<TokenBudget>("{perMinute: 60, burst: 3}").is_err());

    let mut doc = example();
    doc.client_policies[0].tokens = Some(TokenBudget {
        per_minute: 0,
        per_day: Some(10),
        count: TokenCount::Weighted,
        weights: None,
        default_max_tokens: 0,
        requests_per_minute: Some(0),
    });
    doc.client_policies[0].overrides[0].tokens = Some(TokenBudget {
        weights: Some(TokenWeights {
            input: 0.0,
            output: 0.0,
        }),
        ..weighted.clone()
    });
    assert_eq!(
        violated_fields(&doc),
        [
            "clientPolicies[0].overrides[0].tokens.weights",
            "clientPolicies[0].tokens.perMinute",
            "clientPolicies[0].tokens.defaultMaxTokens",
            "clientPolicies[0].tokens.requestsPerMinute",
            "clientPolicies[0].tokens.weights",
        ]
    );
    doc.client_policies[0].tokens = Some(weighted);
    doc.client_policies[0].overrides[0].tokens = Some(TokenBudget {
        per_day: Some(59),
        ..output
    });
    assert_eq!(
        violated_fields(&doc),
        ["clientPolicies[0].overrides[0].tokens.perDay"]
    );
}

#[test]
fn a_clients_token_share_replaces_the_buckets_it_gives_and_is_checked_as_a_budget() {
    let policy: TokenBudget =
        serde_norway::from_str("{perMinute: 600, perDay: 6000, requestsPerMinute: 60}").unwrap();
    let share: ClientTokenShare = serde_norway::from_str(&format!(
        "{{keySha256: {}, perMinute: 500}}",
        "ab".repeat(32)
    ))
    .unwrap();
    let b = share.budget(&policy);
    assert_eq!(
        (b.per_minute, b.per_day, b.requests_per_minute),
        (500, Some(6000), Some(60)),
        "a bucket the share does not give stays the policy's"
    );
    let all = ClientTokenShare {
        per_day: Some(5000),
        requests_per_minute: Some(50),
        ..share.clone()
    };
    let b = all.budget(&policy);
    assert_eq!((b.per_day, b.requests_per_minute), (Some(5000), Some(50)));
    assert!(
        serde_norway::from_str::<ClientTokenShare>("{keySha256: ab, perMinute: 1, burst: 2}")
            .is_err()
    );

    let mut doc = example();
    let p = &mut doc.client_policies[0];
    p.tokens = None;
    p.client_token_shares = vec![share.clone()];
    assert_eq!(
        violated_fields(&doc),
        ["clientPolicies[0].clientTokenShares"],
        "parts of a budget the policy does not have"
    );
    let p = &mut doc.client_policies[0];
    p.tokens = Some(policy);
    p.client_token_shares = vec![
        share.clone(),
        share.clone(),
        ClientTokenShare {
            key_sha256: "not hex".into(),
            per_minute: 0,
            per_day: None,
            requests_per_minute: Some(0),
        },
    ];
    assert_eq!(
        violated_fields(&doc),
        [
            "clientPolicies[0].clientTokenShares[1].keySha256",
            "clientPolicies[0].clientTokenShares[2].keySha256",
            "clientPolicies[0].clientTokenShares[2].tokens.perMinute",
            "clientPolicies[0].clientTokenShares[2].tokens.requestsPerMinute",
        ]
    );
    doc.client_policies[0].client_token_shares = vec![share; MAX_CLIENT_SHARES + 1];
    assert!(violated_fields(&doc).contains(&"clientPolicies[0].clientTokenShares".to_owned()));
}
