//! The fleet-scale run's pure parts: the plan's groups and expected documents, the objects it
//! creates, settling, query counts and `/proc` readings.

use std::collections::BTreeSet;

use poolpilot_api::ConnectionPolicy;
use serde_json::json;

use super::*;

#[test]
fn the_full_plan_is_the_acceptance_size_in_groups_of_ten() {
    let plan = FleetPlan::full();
    assert_eq!((plan.policies, plan.pods), (2000, 1000));
    assert_eq!(plan.groups(), 100);
    assert_eq!(plan.group_policies(), 1999);
    // 1,999 group policies round the 100 groups: 20 on the first 99, 19 on the last.
    assert_eq!(plan.expected_backends(0).len(), 20 + 1);
    assert_eq!(plan.expected_backends(99).len(), 19 + 1);
    assert!(plan.expected_backends(3).contains(FLEET_BACKEND));
    assert!(plan.expected_backends(3).contains("b-0003"));
    assert!(plan.expected_backends(3).contains("b-0103"));
    assert!(!plan.expected_backends(3).contains("b-0004"));
    // 990 pods × (3 + 16 × 21) + 10 × (3 + 16 × 20).
    assert_eq!(plan.series(), 990 * (3 + 16 * 21) + 10 * (3 + 16 * 20));
    let small = FleetPlan::small();
    assert_eq!((small.policies, small.pods, small.groups()), (100, 50, 5));
    assert_ne!(small.first_address, plan.first_address);
}

#[test]
fn a_partial_last_group_is_sized_and_selected_as_it_is() {
    let plan = FleetPlan {
        pods: 25,
        pods_per_group: 10,
        policies: 7,
        ..FleetPlan::small()
    };
    assert_eq!(plan.groups(), 3);
    assert_eq!(
        (plan.group_size(0), plan.group_size(2), plan.group_size(3)),
        (10, 5, 0)
    );
    assert_eq!((plan.group_of_pod(9), plan.group_of_pod(10)), (0, 1));
    assert_eq!(selected_by(&plan, "p-0002"), Some(5));
    assert_eq!(selected_by(&plan, "p-0003"), Some(10));
    assert_eq!(selected_by(&plan, FLEET_POLICY), Some(25));
    assert_eq!(selected_by(&plan, "p-0006"), None, "only 6 group policies");
    assert_eq!(selected_by(&plan, "models"), None);
}

#[test]
fn pods_are_gated_labelled_by_group_and_ready_at_their_address() {
    let plan = FleetPlan::small();
    let spec = plan.fleet_spec("ns-a", "t", 9901);
    let pod = pod_object(&plan, &spec, 13);
    assert_eq!(pod["metadata"]["name"], "gw-sim-13");
    assert_eq!(pod["metadata"]["labels"][GROUP_LABEL], "g001");
    assert_eq!(pod["metadata"]["labels"][GATEWAY_LABEL.0], GATEWAY_LABEL.1);
    assert_eq!(
        pod["metadata"]["annotations"][LIMITS_CONFIGMAP_ANNOTATION],
        "gw-g001-limits"
    );
    assert_eq!(pod["spec"]["schedulingGates"][0]["name"], SIMULATED_GATE);
    // It parses as a Pod.
    let _: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).unwrap();
    let ip = spec.address(13).unwrap();
    let status = pod_status(ip);
    assert_eq!(status["status"]["podIP"], ip.to_string());
    assert_eq!(status["status"]["podIPs"][0]["ip"], ip.to_string());
    assert_eq!(status["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(spec.namespace, "ns-a");
    assert_eq!((spec.slow_fraction, spec.fail_fraction), (0.0, 0.0));
}

#[test]
fn policies_parse_select_their_group_and_fit_their_capacity() {
    let plan = FleetPlan::small();
    let all = all_policies(&plan).unwrap();
    assert_eq!(all.len(), plan.policies);
    let names: BTreeSet<_> = all
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names.len(), plan.policies, "distinct names");
    let backends: BTreeSet<_> = all
        .iter()
        .map(|p| {
            p["spec"]["backends"][0]["name"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        backends.len(),
        plan.policies,
        "distinct backends: none Conflicted"
    );
    let p7 = &all[7];
    assert_eq!(
        p7["spec"]["gatewaySelector"]["matchLabels"][GROUP_LABEL],
        "g002"
    );
    let fleet = all.last().unwrap();
    assert_eq!(fleet["metadata"]["name"], FLEET_POLICY);
    assert_eq!(
        fleet["spec"]["backends"][0]["pool"]["maxPending"],
        FLEET_MAX_PENDING
    );
    assert_eq!(fleet["spec"]["rollout"]["verifyIntervals"], 0);
    for p in &all {
        let spec = &p["spec"];
        let max = spec["autoscale"]["max"].as_f64().unwrap();
        let cap = spec["backends"][0]["capacity"]["maxConnectionsPerEndpoint"]
            .as_f64()
            .unwrap();
        assert_eq!(spec["autoscale"]["min"], spec["autoscale"]["max"]);
        assert!(max <= cap * 0.8, "{p}");
        let _: ConnectionPolicy = serde_json::from_value(p.clone()).unwrap();
    }
    assert_eq!(
        fleet_policy(&plan, 17).unwrap()["spec"]["backends"][0]["pool"]["maxPending"],
        17
    );
    assert_eq!(
        all[3]["spec"]["backends"][0]["pool"]["maxPending"],
        GROUP_MAX_PENDING
    );
    let changed = group_policy_with(&plan, 3, GROUP_MAX_PENDING + 1).unwrap();
    assert_eq!(
        changed["spec"]["backends"][0]["pool"]["maxPending"],
        GROUP_MAX_PENDING + 1
    );
    assert_eq!(changed["metadata"]["name"], all[3]["metadata"]["name"]);
}

fn with_status(
    name: &str,
    generation: i64,
    observed: i64,
    selected: u32,
    updated: u32,
) -> ConnectionPolicy {
    let mut p: ConnectionPolicy =
        serde_json::from_value(group_policy(&FleetPlan::small(), 0).unwrap()).unwrap();
    p.metadata.name = Some(name.to_owned());
    p.metadata.generation = Some(generation);
    let condition = |kind: &str| {
        json!({"type": kind, "status": "True", "reason": "R", "message": "",
               "lastTransitionTime": "2026-12-03T00:00:00Z", "observedGeneration": observed})
    };
    p.status = Some(
        serde_json::from_value(json!({
            "conditions": [condition("Accepted"), condition("RolledOut")],
            "pods": {"selected": selected, "ready": selected, "updated": updated, "fdNeeded": 0},
        }))
        .unwrap(),
    );
    p
}

#[test]
fn a_policy_settles_on_its_generation_with_every_pod_updated() {
    let plan = FleetPlan::small();
    assert!(settled(&plan, &with_status("p-0000", 1, 1, 10, 10)));
    assert!(
        !settled(&plan, &with_status("p-0000", 2, 1, 10, 10)),
        "an older generation"
    );
    assert!(
        !settled(&plan, &with_status("p-0000", 1, 1, 10, 9)),
        "a pod not updated"
    );
    assert!(
        !settled(&plan, &with_status("p-0000", 1, 1, 9, 9)),
        "a pod not selected"
    );
    assert!(settled(&plan, &with_status(FLEET_POLICY, 1, 1, 50, 50)));
    assert!(!settled(&plan, &with_status(FLEET_POLICY, 1, 1, 10, 10)));
    assert!(!settled(&plan, &with_status("other", 1, 1, 10, 10)));
    let mut bare = with_status("p-0000", 1, 1, 10, 10);
    bare.status = None;
    assert!(!settled(&plan, &bare));
    assert_eq!(
        unsettled_why(&plan, &bare).as_deref(),
        Some("p-0000: no status")
    );
}

#[test]
fn a_policy_that_did_not_settle_says_its_conditions_and_pods() {
    let plan = FleetPlan::small();
    assert_eq!(
        unsettled_why(&plan, &with_status("p-0000", 1, 1, 10, 10)),
        None
    );
    assert_eq!(
        unsettled_why(&plan, &with_status("p-0000", 2, 1, 10, 9)).as_deref(),
        Some(
            "p-0000 generation Some(2), 10 selected, 9 updated of Some(10) expected; \
             Accepted=True (generation Some(1), R: ); RolledOut=True (generation Some(1), R: )"
        )
    );
}

#[test]
fn queries_are_counted_per_metric_per_round() {
    let before = "poolpilot_operator_prometheus_rounds_total 10\n\
        poolpilot_operator_prometheus_queries_total{query=\"leased\"} 10\n\
        poolpilot_operator_prometheus_queries_total{query=\"pending\"} 10\n";
    let after = "poolpilot_operator_prometheus_rounds_total 14\n\
        poolpilot_operator_prometheus_queries_total{query=\"leased\"} 14\n\
        poolpilot_operator_prometheus_queries_total{query=\"pending\"} 18\n\
        poolpilot_operator_prometheus_queries_total{query=\"saturation\"} 2\n";
    let (by_query, rounds) = queries_per_round(before, after);
    assert_eq!(rounds, 4.0);
    assert_eq!(by_query["leased"], 1.0);
    assert_eq!(by_query["pending"], 2.0);
    assert_eq!(by_query["saturation"], 0.5);
    assert_eq!(query_labels(after).len(), 3);
    let (none, zero) = queries_per_round(after, after);
    assert_eq!(zero, 0.0);
    assert!(none.values().all(|v| *v == 0.0));
    let prom = "prometheus_http_requests_total{code=\"200\",handler=\"/api/v1/query\"} 40\n\
        prometheus_http_requests_total{code=\"400\",handler=\"/api/v1/query\"} 2\n\
        prometheus_http_requests_total{code=\"200\",handler=\"/api/v1/query_range\"} 7\n\
        prometheus_http_requests_total{code=\"200\",handler=\"/metrics\"} 5\n";
    assert_eq!(served_queries(prom), 42.0);
}

#[test]
fn served_per_metric_round_and_the_highest_metric() {
    let plan = FleetPlan::small();
    let r = FleetResult {
        plan,
        operator_bin: Default::default(),
        setup: 0.0,
        settle: None,
        settled: 0,
        pods_wrong: (0, Vec::new()),
        cold_reconcile: (None, None),
        cold_reconciles: 0.0,
        cold_api: Default::default(),
        cold_steps: Vec::new(),
        cold_passes: Default::default(),
        steady_reconcile: (None, None),
        run_p99: None,
        steady_reconciles_per_interval: 0.0,
        steady_api: Default::default(),
        window: std::time::Duration::ZERO,
        queries_per_round: [("a".to_owned(), 1.0), ("b".to_owned(), 0.75)].into(),
        rounds: 4.0,
        served: (30.0, 20.0),
        rollout: None,
        rollout_reached: 0,
        rollout_puts: 0.0,
        change_all: (12.0, Some(45.0)),
        change_reconcile: (None, None),
        change_steps: Vec::new(),
        change_settled: 0,
        rss: (0, None),
        cpu: (None, None),
    };
    assert_eq!(r.max_queries_per_metric(), 1.0);
    assert_eq!(r.served_per_metric_round(), Some(0.75));
}

#[test]
fn prometheus_keeps_the_fleets_labels() {
    let config = prometheus_config(
        "127.0.0.1:9464".parse().unwrap(),
        std::time::Duration::from_secs(15),
    );
    assert!(config.contains("honor_labels: true"));
    assert!(config.contains("- targets: ['127.0.0.1:9464']"));
    assert!(config.contains("scrape_interval: 15s"));
    assert!(config.contains("scrape_timeout: 12s"));
    let parsed: serde_json::Value = serde_norway::from_str(&config).unwrap();
    assert_eq!(parsed["scrape_configs"][0]["honor_labels"], true);
}

#[test]
fn proc_files_give_memory_and_cpu() {
    let status = "Name:\tpoolpilot-opera\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
    assert_eq!(status_bytes(status, "VmRSS"), Some(100 * 1024 * 1024));
    assert_eq!(status_bytes(status, "VmHWM"), Some(200 * 1024 * 1024));
    assert_eq!(status_bytes(status, "VmSwap"), None);
    // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0";
    assert_eq!(stat_cpu_seconds(stat), Some(3.0));
    assert_eq!(stat_cpu_seconds("garbage"), None);
}

/// The example limits document of the gateway with one backend for each of `names` (the
/// example's first, renamed, its model the name), at `generation`.
fn document(
    names: &BTreeSet<String>,
    generation: u64,
) -> std::sync::Arc<poolpilot_api::GatewayLimits> {
    let mut doc: poolpilot_api::GatewayLimits =
        serde_norway::from_str(include_str!("../../../gateway/examples/limits.yaml")).unwrap();
    let template = doc.backends[0].clone();
    doc.backends = names
        .iter()
        .map(|n| {
            let mut b = template.clone();
            b.name = n.clone();
            b.route.model = Some(n.clone());
            b
        })
        .collect();
    doc.generation = generation;
    std::sync::Arc::new(doc.with_content_revision())
}

/// A pod is judged by what it runs: none, another group's document, or its own with a backend
/// missing is wrong; its group's exact backends are right. The documents go through the
/// operator's own HTTPS client to the simulated pods.
#[tokio::test]
async fn wrong_pods_are_those_off_their_groups_document() {
    use poolpilot_operator::gateway::{GatewayTrust, Gateways as _, HttpGateways};
    crate::install_crypto_provider();
    let plan = FleetPlan {
        pods: 4,
        pods_per_group: 2,
        policies: 3,
        first_address: std::net::Ipv4Addr::new(127, 4, 0, 1),
        ..FleetPlan::small()
    };
    let pki =
        crate::credentials::Pki::generate("t", &crate::credentials::server_name("ns")).unwrap();
    let fleet = crate::fleet_sim::Fleet::start(
        plan.fleet_spec("ns", "tok", 0),
        crate::fleet_sim::server_config(&pki.cert_pem, &pki.key_pem).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        wrong_pods(&plan, &fleet).len(),
        4,
        "no pod runs a document yet"
    );
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let trust = GatewayTrust::load(
        ca,
        "poolpilot-gateway-admin.{namespace}.svc".into(),
        std::time::Duration::from_secs(600),
    )
    .unwrap();
    let client = HttpGateways::with_trust(std::time::Duration::from_secs(600), trust).unwrap();
    let (g0, g1) = (plan.expected_backends(0), plan.expected_backends(1));
    assert_eq!(g0, ["b-0000", FLEET_BACKEND].map(String::from).into());
    assert_eq!(g1, ["b-0001", FLEET_BACKEND].map(String::from).into());
    let mut short = g1.clone();
    short.remove(FLEET_BACKEND);
    let sends = [(0, &g0), (1, &g0), (2, &g0), (3, &short)];
    for (i, names) in sends {
        client
            .put("ns", fleet.pods[i].addr, "tok", &document(names, 1))
            .await
            .unwrap();
    }
    assert_eq!(
        wrong_pods(&plan, &fleet),
        ["gw-sim-2", "gw-sim-3"],
        "pod 2 runs group 0's document, pod 3 lacks the fleet-wide backend"
    );
    for i in [2, 3] {
        client
            .put("ns", fleet.pods[i].addr, "tok", &document(&g1, 2))
            .await
            .unwrap();
    }
    assert!(wrong_pods(&plan, &fleet).is_empty());
    assert_eq!(pods_with_max_pending(&fleet, 1_000_000), 0);
    let mp = fleet.pods[0].limits().unwrap().backends[0].pool.max_pending;
    assert_eq!(
        pods_with_max_pending(&fleet, mp),
        4,
        "the fleet-wide backend's"
    );
    assert_eq!(pods_with_group_pending(&fleet, mp), 4);
    assert_eq!(pods_with_group_pending(&fleet, mp + 1), 0);
}

#[test]
fn the_cold_starts_steps_and_passes_are_read_from_the_operators_metrics() {
    let text = "\
        poolpilot_operator_step_duration_seconds_bucket{step=\"plan\",le=\"0.01\"} 90\n\
        poolpilot_operator_step_duration_seconds_bucket{step=\"plan\",le=\"1.0\"} 100\n\
        poolpilot_operator_step_duration_seconds_bucket{step=\"plan\",le=\"+Inf\"} 100\n\
        poolpilot_operator_step_duration_seconds_bucket{step=\"status\",le=\"0.01\"} 5\n\
        poolpilot_operator_step_duration_seconds_bucket{step=\"status\",le=\"+Inf\"} 5\n\
        poolpilot_operator_namespace_passes_total{outcome=\"reused\"} 80\n\
        poolpilot_operator_namespace_passes_total{outcome=\"planned\"} 20\n";
    let steps = step_times(text);
    assert_eq!(
        steps
            .iter()
            .map(|t| (t.step.as_str(), t.count))
            .collect::<Vec<_>>(),
        [
            ("clients", 0.0),
            ("plan", 100.0),
            ("rollout", 0.0),
            ("status", 5.0)
        ]
    );
    let plan = &steps[1];
    assert!(plan.p50_p99.0.is_some_and(|p| p <= 0.01), "{plan:?}");
    assert!(plan.p50_p99.1.is_some_and(|p| p > 0.01), "{plan:?}");
    assert_eq!(steps[0].p50_p99, (None, None), "a step that never ran");
    let passes = passes(text);
    assert_eq!(passes["reused"], 80.0);
    assert_eq!(passes["planned"], 20.0);
    assert_eq!(format!("{:.0}", passes["private"]), "0", "none, not -0");
}
