//! Tests of the whole planning run: fleet division, the fd check with its numbers, conflicts,
//! rendering with monotonic generations, status conditions, and the budget properties.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use poolpilot_api::limits::{Endpoint, TokenCount, UpstreamProtocol};
use poolpilot_api::policy::{CooldownStatus, Mode, StartFrom, TokenThroughput};
use poolpilot_api::{ConnectionPolicySpec, ConnectionPolicyStatus, Duration as ApiDuration};
use proptest::prelude::*;

use super::budget;
use super::conditions::Kind;
use super::status::{RolloutReport, compute};
use super::waves::PodState;
use super::*;

pub(crate) fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

/// Plans `input` with `memory`, and again with its last rendering forgotten: the same policies
/// and documents (what the rendering keeps from the last one only saves work).
fn plans_as_a_fresh_rendering(
    input: &FleetInput,
    memory: &mut Memory,
    now: Timestamp,
) -> Result<(), TestCaseError> {
    let mut fresh = memory.clone();
    fresh.rendered = None;
    let kept = plan(input, memory, now);
    let rendered = plan(input, &mut fresh, now);
    prop_assert_eq!(&kept.policies, &rendered.policies);
    prop_assert_eq!(&kept.documents, &rendered.documents);
    Ok(())
}

/// A policy named `name`, created at `created`, from a YAML spec; every backend gets `endpoints`
/// resolved endpoints.
pub(crate) fn policy(name: &str, created: i64, spec: &str, endpoints: u32) -> PolicyInput {
    let spec: ConnectionPolicySpec = serde_norway::from_str(spec).expect("test spec parses");
    let endpoints = spec
        .backends
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let eps = (0..endpoints)
                .map(|j| Endpoint {
                    name: format!("{}-{j}", b.name),
                    address: SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(10, 1, i as u8, j as u8)),
                        8000,
                    )
                    .into(),
                    tls: None,
                })
                .collect();
            (b.name.clone(), eps)
        })
        .collect();
    PolicyInput {
        key: PolicyKey {
            namespace: "ns".into(),
            name: name.into(),
        },
        generation: 1,
        created: at(created),
        spec,
        status: None,
        endpoints,
    }
}

/// `n` ready gateway pods `gw-0..` labelled `app=gw`.
pub(crate) fn pods(n: usize) -> Vec<GatewayPod> {
    (0..n)
        .map(|i| GatewayPod {
            name: format!("gw-{i}"),
            labels: [("app".to_owned(), "gw".to_owned())].into(),
            ip: Some(IpAddr::V4(Ipv4Addr::new(127, 0, 1, i as u8))),
            ready: true,
            terminating: false,
            stopped: false,
            acked: None,
        })
        .collect()
}

fn spec(backend: &str, capacity: u32, extra: &str) -> String {
    format!(
        "gatewaySelector: {{matchLabels: {{app: gw}}}}\nbackends:\n- name: {backend}\n  endpoints: {{service: {{name: {backend}, port: 8000}}}}\n  capacity: {{maxConnectionsPerEndpoint: {capacity}, headroom: 0.2}}\n{extra}"
    )
}

fn key(name: &str) -> PolicyKey {
    PolicyKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn fds(pods: &[GatewayPod], max: u64) -> BTreeMap<String, PodSample> {
    pods.iter()
        .map(|p| {
            (
                p.name.clone(),
                PodSample {
                    max_fds: Some(max),
                    open_fds: Some(100),
                },
            )
        })
        .collect()
}

/// The fleet of `policies` on `pods`, with no samples yet.
fn input_of(policies: Vec<PolicyInput>, pods: Vec<GatewayPod>) -> FleetInput {
    FleetInput {
        policies,
        pods,
        ..FleetInput::default()
    }
}

/// The fleet of `policies` on `pods`, each pod sampled with a `process_max_fds` of `max_fds`.
fn input_with_fds(policies: Vec<PolicyInput>, pods: Vec<GatewayPod>, max_fds: u64) -> FleetInput {
    let samples = Samples {
        pods: fds(&pods, max_fds),
        ..Samples::default()
    };
    FleetInput {
        samples: samples.into(),
        ..input_of(policies, pods)
    }
}

/// One planning run of `input` at [`at`]`(0)`, from an empty memory.
fn plan_once(input: &FleetInput) -> FleetPlan {
    plan(input, &mut Memory::default(), at(0))
}

/// The first policy's status after `fleet`, with nothing rolled out.
fn status_now(
    input: &FleetInput,
    fleet: &FleetPlan,
    memory: &Memory,
    now: Timestamp,
) -> ConnectionPolicyStatus {
    compute(
        &input.policies[0],
        &fleet.policies[0],
        memory,
        &RolloutReport::default(),
        now,
    )
}

/// Condition `kind` of `status`.
fn condition<'a>(status: &'a ConnectionPolicyStatus, kind: &str) -> &'a Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .unwrap_or_else(|| panic!("no {kind} condition in {status:?}"))
}

#[test]
fn fleet_budget_is_divided_across_every_pod_that_may_hold_connections() {
    // 64 × 0.8 = 51 per endpoint for the fleet; autoscale off runs at that bound.
    let p = policy(
        "a",
        0,
        &spec("model-a", 64, "autoscale: {enabled: false}\n"),
        2,
    );
    let mut pods = pods(5);
    pods[2].ready = false; // starting: it may serve from the ConfigMap any moment
    pods[3].ready = false;
    pods[3].terminating = true; // draining: it holds its connections until it is gone
    pods[4].ready = false;
    pods[4].stopped = true; // its containers exited for good: it holds nothing
    let input = input_of(vec![p], pods);
    let fleet = plan_once(&input);
    let pp = &fleet.policies[0];
    let b = &pp.backends[0];
    assert_eq!((b.target, b.per_pod), (51, 12), "51 over 4 holders");
    assert_eq!(pp.holders, ["gw-0", "gw-1", "gw-2", "gw-3"]);
    assert_eq!(
        pp.live,
        ["gw-0", "gw-1", "gw-2"],
        "documents go to pods not terminating"
    );
    assert_eq!(pp.ready, ["gw-0", "gw-1"]);
    let share = |pod: &str| {
        fleet.documents[pod].backends[0]
            .pool
            .max_connections_per_endpoint
    };
    assert_eq!(
        [share("gw-0"), share("gw-1"), share("gw-2")],
        [13, 13, 13],
        "the remainder 3 goes to the first holders"
    );
    assert_eq!(
        pp.share(b, "gw-3"),
        12,
        "the terminating pod keeps its rank's share"
    );
    assert_eq!(pp.pooled(b), 26, "the ready pods pool 13 + 13");
    assert_eq!(fleet.documents["gw-0"].backends[0].endpoints.len(), 2);
}

#[test]
fn the_configmap_document_holds_the_smallest_share_and_no_later_generation() {
    // 51 over 4 pods: 13, 13, 13, 12. A pod that starts from the ConfigMap takes 12, and the
    // document the operator then sends it is never "older" than the file it started from.
    let p = policy("a", 0, &spec("m", 64, "autoscale: {enabled: false}\n"), 1);
    let input = input_of(vec![p], pods(4));
    let fleet = plan_once(&input);
    let doc = fleet.policies[0]
        .document
        .as_ref()
        .expect("a ConfigMap document");
    assert_eq!(doc.backends[0].pool.max_connections_per_endpoint, 12);
    for (pod, d) in &fleet.documents {
        assert!(
            doc.generation <= d.generation,
            "{pod}: generation {} below the ConfigMap's {}",
            d.generation,
            doc.generation
        );
    }
    assert_eq!(
        fleet.documents["gw-3"].revision, doc.revision,
        "the last pod runs the base share: the same document"
    );
}

#[test]
fn policies_on_the_same_pods_share_one_configmap_document() {
    // Rendered once for all of them: with hundreds of policies on the same pods, a document per
    // policy made every planning run quadratic in the number of policies.
    let policies: Vec<PolicyInput> = (0..20)
        .map(|i| {
            let extra = "autoscale: {enabled: false}\n";
            policy(
                &format!("p{i:02}"),
                i,
                &spec(&format!("b{i:02}"), 64, extra),
                1,
            )
        })
        .collect();
    let input = input_of(policies, pods(3));
    let fleet = plan_once(&input);
    let first = fleet.policies[0].document.clone().expect("a document");
    assert_eq!(
        first.backends.len(),
        20,
        "every policy's backend, at the base share"
    );
    for p in &fleet.policies {
        let doc = p.document.as_ref().expect("a document");
        assert!(Arc::ptr_eq(doc, &first), "{} has its own copy", p.key);
    }
}

/// The shares of `names` (holders, every one ready) for a fleet target of `target`.
fn shares_over(target: u32, names: &[String]) -> BTreeMap<String, u32> {
    let extra = format!("autoscale: {{enabled: false, min: 1, max: {target}}}\n");
    let p = policy("a", 0, &spec("m", 10_000, &extra), 1);
    let mut pods = pods(names.len());
    for (pod, name) in pods.iter_mut().zip(names) {
        pod.name.clone_from(name);
    }
    let input = input_of(vec![p], pods);
    let fleet = plan_once(&input);
    fleet
        .documents
        .iter()
        .map(|(pod, d)| (pod.clone(), d.backends[0].pool.max_connections_per_endpoint))
        .collect()
}

#[test]
fn resizing_the_fleet_never_lets_it_hold_more_than_the_target() {
    // Shares shrink when a pod is created and grow when one is gone. For the fleet to stay
    // within its target while pods come and go, joining must never raise another pod's share
    // (the newcomer starts serving while the others still hold theirs) and leaving must never
    // lower one (the others would shrink only as their calls end, while the grown ones fill).
    for target in 1..=40u32 {
        for n in 1..=8usize {
            let names: Vec<String> = (0..n).map(|i| format!("gw-{}", 2 * i)).collect();
            let before = shares_over(target, &names);
            if target as usize >= n {
                assert_eq!(before.values().sum::<u32>(), target, "{target} over {n}");
            }
            for slot in 0..=n {
                // A newcomer at every place of the name order.
                let mut joined = names.clone();
                joined.insert(slot, format!("gw-{}", 2 * slot as i64 - 1));
                let after = shares_over(target, &joined);
                for (pod, share) in &before {
                    assert!(
                        after[pod] <= *share,
                        "target {target}, {n} → {} pods: {pod} grew {share} → {}",
                        n + 1,
                        after[pod]
                    );
                }
            }
            for gone in 0..n {
                let mut left = names.clone();
                left.remove(gone);
                let after = shares_over(target, &left);
                for (pod, share) in &after {
                    assert!(
                        *share >= before[pod],
                        "target {target}, {n} → {} pods: {pod} shrank {} → {share}",
                        n - 1,
                        before[pod]
                    );
                }
            }
        }
    }
}

#[test]
fn the_remainder_of_the_division_goes_to_the_first_pods_so_shares_add_up_to_the_target() {
    // 64 × 0.8 = 51 for the fleet: over 2 ready pods 26 + 25, over 3 17 each, over 4 13·3 + 12.
    let p = policy("a", 0, &spec("m", 64, "autoscale: {enabled: false}\n"), 3);
    for (n, want) in [
        (1, vec![51]),
        (2, vec![26, 25]),
        (3, vec![17, 17, 17]),
        (4, vec![13, 13, 13, 12]),
        (5, vec![11, 10, 10, 10, 10]),
    ] {
        let input = input_of(vec![p.clone()], pods(n));
        let fleet = plan_once(&input);
        let shares: Vec<u32> = fleet
            .documents
            .values()
            .map(|d| d.backends[0].pool.max_connections_per_endpoint)
            .collect();
        assert_eq!(shares, want, "{n} pods");
        assert_eq!(
            shares.iter().sum::<u32>(),
            51,
            "{n} pods hold the fleet target"
        );
        let pp = &fleet.policies[0];
        assert_eq!(pp.pooled(&pp.backends[0]), 51);
        // The durable document holds the base share: a pod starting from it takes no more
        // than the smallest share.
        assert_eq!(
            pp.document.as_ref().unwrap().backends[0]
                .pool
                .max_connections_per_endpoint,
            *want.last().unwrap()
        );
    }
}

#[test]
fn pods_three_to_six_grow_the_fleet_total_by_at_most_five_percent() {
    for capacity in [10, 32, 64, 100, 257, 700, 1000] {
        let p = policy(
            "a",
            0,
            &spec("m", capacity, "autoscale: {enabled: false}\n"),
            1,
        );
        let total = |n: usize| {
            let input = input_of(vec![p.clone()], pods(n));
            let plan = plan_once(&input);
            plan.documents
                .values()
                .map(|d| f64::from(d.backends[0].pool.max_connections_per_endpoint))
                .sum::<f64>()
        };
        let (three, six) = (total(3), total(6));
        assert!(
            six <= three * 1.05,
            "capacity {capacity}: 3 pods hold {three}, 6 pods hold {six}"
        );
        assert!(
            six <= f64::from(p.spec.backends[0].capacity.budget()),
            "never above the fleet budget"
        );
    }
}

#[test]
fn a_pod_wide_upstream_cap_counts_instead_of_the_pools_and_reaches_the_gateway() {
    // 7 endpoints × 82 = 574 pool connections would not fit beside 512 + 256 in 1024 fds; a cap
    // of 200 upstream connections does: 200 + 768 = 968, nothing is scaled down.
    let extra = "listener: {maxConnections: 512, maxUpstreamConnections: 200}\nfileDescriptors: {reserve: 256}\nautoscale: {enabled: false, max: 82}\n";
    let p = policy("a", 0, &spec("model-a", 200, extra), 7);
    let pods = pods(1);
    let input = input_with_fds(vec![p], pods, 2048);
    let capped = plan_once(&input);
    let pp = &capped.policies[0];
    assert_eq!(pp.backends[0].per_pod, 82, "not clamped");
    assert_eq!(pp.fds.within(), Some(true));
    assert_eq!(pp.fds.needed, 968);
    assert_eq!(
        pp.fds.message(),
        "needs 968 fds, pods allow 1024 (pod gw-0), pools capped at 200 by listener.maxUpstreamConnections"
    );
    let doc = &capped.documents["gw-0"];
    assert_eq!(doc.listener.max_upstream_connections, Some(200));
    assert_eq!(doc.backends[0].pool.max_connections_per_endpoint, 82);

    // A cap too large to help: the pools are scaled down as without it.
    let extra = "listener: {maxConnections: 512, maxUpstreamConnections: 5000}\nfileDescriptors: {reserve: 256}\nautoscale: {enabled: false, max: 82}\n";
    let input = FleetInput {
        policies: vec![policy("a", 0, &spec("model-a", 200, extra), 7)],
        ..input
    };
    let too_large = plan_once(&input);
    assert_eq!(too_large.policies[0].backends[0].per_pod, 36);
    assert_eq!(
        too_large.policies[0].fds.message(),
        "needs 1342 fds, pods allow 1024 (pod gw-0); pool shares scaled down to need 1020"
    );
}

#[test]
fn fd_check_clamps_with_the_exact_numbers() {
    // One pod, 7 endpoints × 82 + 512 client connections + 256 reserve = 1342 fds; a limit of
    // 2048 allows half of it, 1024.
    let extra = "listener: {maxConnections: 512}\nfileDescriptors: {reserve: 256}\nautoscale: {enabled: false, max: 82}\n";
    let p = policy("a", 0, &spec("model-a", 200, extra), 7);
    let pods = pods(1);
    let input = input_with_fds(vec![p], pods, 2048);
    let plan = plan_once(&input);
    let pp = &plan.policies[0];
    assert_eq!(pp.backends[0].target, 82);
    assert_eq!(pp.backends[0].per_pod, 36, "82 × 256/574, rounded down");
    assert_eq!(pp.fds.within(), Some(false));
    assert_eq!(
        pp.fds.message(),
        "needs 1342 fds, pods allow 1024 (pod gw-0); pool shares scaled down to need 1020"
    );
    assert_eq!(
        plan.documents["gw-0"].backends[0]
            .pool
            .max_connections_per_endpoint,
        36
    );
}

#[test]
fn fd_check_counts_sockets_for_http2_backends_not_streams() {
    // The numbers of the test above: 7 endpoints × 82 slots + 768 is over 1024 for HTTP/1.1.
    let extra = "listener: {maxConnections: 512}\nfileDescriptors: {reserve: 256}\nautoscale: {enabled: false, max: 82}\n";
    let run = |protocol: &str, h2_max_streams: Option<f64>| {
        let p = policy(
            "a",
            0,
            &spec("model-a", 200, &format!("  protocol: {protocol}\n{extra}")),
            7,
        );
        let mut input = input_with_fds(vec![p], pods(1), 2048);
        Arc::make_mut(&mut input.samples).backends.insert(
            (key("a"), "model-a".to_owned()),
            BackendSample {
                h2_max_streams,
                ..BackendSample::default()
            },
        );
        let plan = plan_once(&input);
        let pp = &plan.policies[0];
        assert!(!pp.backends.is_empty(), "{:?}", pp.acceptance);
        (pp.backends[0].per_pod, pp.fds.within(), pp.fds.message())
    };
    assert_eq!(
        run("Http1", Some(2.0)).0,
        36,
        "a socket a slot, whatever a sample says"
    );
    // HTTP/2 with the documented default of 100 streams: one socket per endpoint, 7 + 768.
    let (per_pod, within, message) = run("Http2", None);
    assert_eq!((per_pod, within), (82, Some(true)), "{message}");
    assert_eq!(message, "needs 775 fds, pods allow 1024 (pod gw-0)");
    // The servers' own limit when the pods report it: ⌈82 / 3⌉ = 28 sockets × 7 + 768 fits.
    let (per_pod, within, message) = run("Http2", Some(3.0));
    assert_eq!((per_pod, within), (82, Some(true)), "{message}");
    assert_eq!(message, "needs 964 fds, pods allow 1024 (pod gw-0)");
    // Two streams a socket: 41 × 7 + 768 = 1055 does not; the share is scaled to whole
    // sockets, 72 streams on 36 sockets per endpoint, 252 + 768 = 1020.
    let (per_pod, within, message) = run("Http2", Some(2.0));
    assert_eq!(per_pod, 72, "{message}");
    assert_eq!(within, Some(false));
    assert_eq!(
        message,
        "needs 1055 fds, pods allow 1024 (pod gw-0); pool shares scaled down to need 1020"
    );
}

#[test]
fn the_pods_http1_fallback_shows_in_status() {
    let spec = "gatewaySelector: {matchLabels: {app: gw}}\nbackends:\n- name: p\n  protocol: Auto\n  endpoints: {external: [{host: api.example.com, port: 443, tls: {}}]}\n  capacity: {maxConnectionsPerEndpoint: 8}\n";
    let fallback = |h2_fallback: Option<f64>| {
        let mut input = input_of(vec![policy("a", 0, spec, 1)], pods(2));
        Arc::make_mut(&mut input.samples).backends.insert(
            (key("a"), "p".to_owned()),
            BackendSample {
                h2_fallback,
                ..BackendSample::default()
            },
        );
        let memory = Memory::default();
        let fleet = plan(&input, &mut memory.clone(), at(0));
        status_now(&input, &fleet, &memory, at(0)).backends[0].http1_fallback
    };
    assert_eq!(
        fallback(Some(2.0)),
        Some(2),
        "two pods fell back on the address"
    );
    assert_eq!(fallback(None), None, "no pod reports one");
    assert_eq!(fallback(Some(0.0)), None);
}

#[test]
fn the_providers_refusals_and_failed_certificates_show_in_status_while_the_window_has_some() {
    let seen = |sample: BackendSample| {
        let mut input = input_of(vec![policy("a", 0, &spec("model-a", 16, ""), 1)], pods(2));
        Arc::make_mut(&mut input.samples)
            .backends
            .insert((key("a"), "model-a".to_owned()), sample);
        let memory = Memory::default();
        let fleet = plan(&input, &mut memory.clone(), at(0));
        let b = status_now(&input, &fleet, &memory, at(0)).backends[0].clone();
        (b.cooldown, b.tls_verification_failures)
    };
    // increase() extrapolates: fractional counts are rounded.
    let (cooldown, tls) = seen(BackendSample {
        provider_refusals: Some(23.4),
        cooldown_refused: Some(1.6),
        fallbacks: None,
        tls_verification_failures: Some(3.5),
        ..BackendSample::default()
    });
    assert_eq!(
        cooldown,
        Some(CooldownStatus {
            refusals: 23,
            refused_calls: 2,
            fallback_calls: 0
        })
    );
    assert_eq!(tls, Some(4));
    // None in the window (the series is flat, or absent): nothing to show.
    assert_eq!(
        seen(BackendSample {
            provider_refusals: Some(0.0),
            cooldown_refused: Some(12.0),
            tls_verification_failures: Some(0.2),
            ..BackendSample::default()
        }),
        (None, None)
    );
    assert_eq!(seen(BackendSample::default()), (None, None));
}

#[test]
fn a_backends_tokens_a_second_show_in_status_to_three_figures_and_not_without_samples() {
    let seen = |tokens: Option<input::TokenRates>| {
        let mut input = input_of(vec![policy("a", 0, &spec("model-a", 16, ""), 1)], pods(2));
        Arc::make_mut(&mut input.samples).backends.insert(
            (key("a"), "model-a".to_owned()),
            BackendSample {
                tokens,
                ..busy_sample(4.0, 0.0)
            },
        );
        let memory = Memory::default();
        let fleet = plan(&input, &mut memory.clone(), at(0));
        status_now(&input, &fleet, &memory, at(0)).backends[0]
            .tokens_per_second
            .clone()
    };
    assert_eq!(
        seen(Some(input::TokenRates {
            input: 123_456.7,
            output: 0.012_345,
        })),
        Some(TokenThroughput {
            input: 123_000.0,
            output: 0.0123,
        })
    );
    assert_eq!(
        seen(Some(input::TokenRates {
            input: 0.0,
            output: 0.0,
        })),
        Some(TokenThroughput::default()),
        "counted before, none in the window: zero"
    );
    assert_eq!(seen(None), None, "no pod counted tokens for the backend");
    assert_eq!(
        seen(Some(input::TokenRates {
            input: f64::NAN,
            output: 1.0,
        })),
        None
    );
}

#[test]
fn the_rounding_of_token_rates_keeps_three_significant_figures() {
    use super::status::three_figures;
    for (v, rounded) in [
        (1234.5, 1230.0),
        (999.6, 1000.0),
        (45.678, 45.7),
        (0.5, 0.5),
        (0.033_333, 0.0333),
        (0.0, 0.0),
        (987_654_321.0, 988_000_000.0),
    ] {
        assert_eq!(three_figures(v), rounded, "{v}");
    }
}

#[test]
fn a_backend_closing_idle_connections_sooner_gets_a_lower_idle_timeout_kept_across_restarts() {
    let p = policy(
        "a",
        0,
        &spec("model-a", 16, "autoscale: {enabled: false}\n"),
        2,
    );
    let mut input = input_of(vec![p], pods(2));
    let closes = |input: &mut FleetInput, closed_after: Option<f64>| {
        Arc::make_mut(&mut input.samples).backends.insert(
            (key("a"), "model-a".to_owned()),
            BackendSample {
                peer_idle_close: closed_after,
                ..BackendSample::default()
            },
        );
    };
    let idle = |fleet: &FleetPlan, pod: &str| fleet.documents[pod].backends[0].pool.idle_timeout;
    let mut memory = Memory::default();
    // The spec's 30s (the default) while the pods find no closes.
    let fleet = plan(&input, &mut memory, at(0));
    assert_eq!(idle(&fleet, "gw-0"), ApiDuration::from_secs(30));
    assert_eq!(
        status_now(&input, &fleet, &memory, at(0)).backends[0].idle_timeout,
        None
    );
    // The pods find connections closed after 2.05 s idle: every document runs 1.23 s, the
    // status says why, and the run that lowered it says so once.
    closes(&mut input, Some(2.05));
    let fleet = plan(&input, &mut memory, at(10));
    for pod in ["gw-0", "gw-1"] {
        assert_eq!(idle(&fleet, pod), ApiDuration::from_millis(1230));
    }
    assert!(
        fleet.policies[0].backends[0]
            .idle_timeout
            .lowered
            .unwrap()
            .now
    );
    let status = status_now(&input, &fleet, &memory, at(10));
    let recorded = status.backends[0].idle_timeout.clone().unwrap();
    assert_eq!(
        (
            recorded.in_force,
            recorded.configured,
            recorded.backend_closed_after_seconds
        ),
        (
            ApiDuration::from_millis(1230),
            ApiDuration::from_secs(30),
            2.05
        )
    );
    assert_eq!(recorded.since.0, at(10));
    // No closes since (the gateway closes first): it stays, with no new Event.
    closes(&mut input, None);
    let fleet = plan(&input, &mut memory, at(20));
    assert_eq!(idle(&fleet, "gw-0"), ApiDuration::from_millis(1230));
    assert!(
        !fleet.policies[0].backends[0]
            .idle_timeout
            .lowered
            .unwrap()
            .now
    );
    // A new operator (empty memory) restores it from status instead of meeting the closes again,
    // with the tries that doubled its wait.
    let mut status = status;
    status.backends[0].idle_timeout.as_mut().unwrap().tries = 2;
    input.policies[0].status = Some(status);
    let mut restarted = Memory::default();
    let fleet = plan(&input, &mut restarted, at(30));
    assert_eq!(idle(&fleet, "gw-1"), ApiDuration::from_millis(1230));
    assert_eq!(fleet.policies[0].backends[0].idle_timeout.tries, 2);
    // Four hours (an hour × 2²) after the lowering without closes, the spec's value again.
    let fleet = plan(&input, &mut restarted, at(10 + 4 * 3600 - 1));
    assert_eq!(idle(&fleet, "gw-0"), ApiDuration::from_millis(1230));
    let fleet = plan(&input, &mut restarted, at(10 + 4 * 3600));
    assert_eq!(idle(&fleet, "gw-0"), ApiDuration::from_secs(30));
    assert!(
        fleet.policies[0].backends[0]
            .idle_timeout
            .tried
            .unwrap()
            .now
    );
    // An edit of the spec's idleTimeout starts over from it.
    input.policies[0].spec.backends[0].pool.idle_timeout = ApiDuration::from_secs(20);
    let fleet = plan(&input, &mut memory, at(40));
    assert_eq!(idle(&fleet, "gw-0"), ApiDuration::from_secs(20));
}

#[test]
fn fd_check_spans_every_policy_on_the_same_pods_and_respects_min() {
    let extra = |min| {
        format!(
            "listener: {{maxConnections: 100}}\nfileDescriptors: {{reserve: 100}}\nautoscale: {{enabled: false, min: {min}, max: 100}}\n"
        )
    };
    let a = policy("a", 0, &spec("model-a", 200, &extra(80)), 2);
    let b = policy("b", 10, &spec("model-b", 200, &extra(1)), 2);
    let pods = pods(1);
    let input = input_with_fds(vec![a, b], pods, 1000);
    let plan = plan_once(&input);
    // Needs 2×100 + 2×100 + 100 + 100 = 600 > 500: 300 fds for the pools, 75 per endpoint each.
    // model-a cannot go below its min of 80 (160 fds), so model-b gets the remaining 140 fds.
    let shares: Vec<u32> = plan
        .policies
        .iter()
        .map(|p| p.backends[0].per_pod)
        .collect();
    assert_eq!(shares, [80, 70]);
    for p in &plan.policies {
        assert_eq!(
            p.fds.message(),
            "needs 600 fds, pods allow 500 (pod gw-0); pool shares scaled down to need 500"
        );
    }
    let doc = &plan.documents["gw-0"];
    assert_eq!(
        doc.backends
            .iter()
            .map(|b| b.name.as_str())
            .collect::<Vec<_>>(),
        ["model-a", "model-b"]
    );
}

#[test]
fn fd_check_reports_when_even_the_minimum_does_not_fit() {
    let extra = "listener: {maxConnections: 400}\nfileDescriptors: {reserve: 100}\nautoscale: {enabled: false, min: 50, max: 100}\n";
    let p = policy("a", 0, &spec("model-a", 200, extra), 2);
    let pods = pods(1);
    let input = input_with_fds(vec![p], pods, 1000);
    let plan = plan_once(&input);
    assert_eq!(plan.policies[0].backends[0].per_pod, 50, "never below min");
    assert_eq!(
        plan.policies[0].fds.message(),
        "needs 700 fds, pods allow 500 (pod gw-0); even at autoscale.min the pools need 600"
    );
}

#[test]
fn fd_limit_is_remembered_while_its_sample_is_missing_and_rechecked_when_it_changes() {
    let extra = "listener: {maxConnections: 512}\nfileDescriptors: {reserve: 256}\nautoscale: {enabled: false, max: 82}\n";
    let p = policy("a", 0, &spec("model-a", 200, extra), 7);
    let pods = pods(1);
    let mut memory = Memory::default();
    let mut input = FleetInput {
        policies: vec![p],
        pods: pods.clone(),
        samples: Samples {
            pods: fds(&pods, 2048),
            ..Samples::default()
        }
        .into(),
        ..FleetInput::default()
    };
    assert_eq!(
        plan(&input, &mut memory, at(0)).policies[0].backends[0].per_pod,
        36
    );
    Arc::make_mut(&mut input.samples).pods.clear();
    let again = plan(&input, &mut memory, at(15));
    assert_eq!(
        again.policies[0].backends[0].per_pod, 36,
        "a missing fd sample holds the last known limit"
    );
    Arc::make_mut(&mut input.samples).pods = fds(&pods, 65536);
    let raised = plan(&input, &mut memory, at(30));
    assert_eq!(
        raised.policies[0].backends[0].per_pod, 82,
        "only the fd limit changed, and the clamp lifts"
    );
    assert_eq!(raised.policies[0].fds.within(), Some(true));
}

#[test]
fn a_pod_whose_fd_limit_is_not_known_yet_is_held_to_the_smallest_known() {
    // The fd_budget scenario's numbers: 3 pods, 200 client connections + 32 reserve, 3 endpoints
    // at 16 each = 280 fds against 256 allowed; the third pod just started and has no sample.
    let extra = "listener: {maxConnections: 200}\nfileDescriptors: {reserve: 32}\nautoscale: {enabled: false, max: 48}\n";
    let p = policy("a", 0, &spec("model-a", 200, extra), 3);
    let mut input = input_with_fds(vec![p], pods(3), 512);
    let newest = input.samples.pods.keys().last().cloned().unwrap();
    Arc::make_mut(&mut input.samples)
        .pods
        .get_mut(&newest)
        .unwrap()
        .max_fds = None;
    let plan = plan_once(&input);
    let pp = &plan.policies[0];
    for (pod, doc) in &plan.documents {
        assert_eq!(
            doc.backends[0].pool.max_connections_per_endpoint, 8,
            "{pod}: 16 × 24 / 48"
        );
    }
    assert_eq!(
        pp.fds.message(),
        "needs 280 fds, pods allow 256 (pod gw-2); pool shares scaled down to need 256"
    );
}

#[test]
fn unknown_fd_limit_renders_unclamped_and_says_so() {
    let p = policy("a", 0, &spec("model-a", 64, ""), 1);
    let input = input_of(vec![p], pods(1));
    let plan = plan_once(&input);
    assert_eq!(plan.policies[0].fds.within(), None);
    assert_eq!(
        plan.policies[0].fds.message(),
        "process_max_fds of the selected pods is not known yet"
    );
}

#[test]
fn duplicate_backend_on_shared_pods_conflicts_and_the_oldest_wins() {
    let older = policy("older", 0, &spec("model-a", 64, ""), 1);
    let newer = policy("newer", 10, &spec("model-a", 64, ""), 1);
    let input = input_of(vec![newer, older], pods(2));
    let plan = plan_once(&input);
    assert!(plan.policy(&key("older")).unwrap().acceptance.is_accepted());
    assert_eq!(
        plan.policy(&key("newer")).unwrap().acceptance,
        validate::Acceptance::Conflicted(
            "backend \"model-a\" is already defined by the older policy ns/older on pod gw-0"
                .into()
        )
    );
    assert_eq!(plan.documents["gw-0"].backends.len(), 1);
    assert_eq!(
        plan.documents["gw-0"].backends[0].policy.as_deref(),
        Some("ns/older")
    );
}

#[test]
fn conflicts_need_shared_pods_or_the_same_selector() {
    let other = "gatewaySelector: {matchLabels: {app: other}}\nbackends:\n- name: model-a\n  endpoints: {service: {name: a, port: 80}}\n  capacity: {maxConnectionsPerEndpoint: 10}\n";
    let a = policy("a", 0, &spec("model-a", 64, ""), 1);
    let b = policy("b", 10, other, 1);
    let input = input_of(vec![a.clone(), b], pods(2));
    let plan1 = plan_once(&input);
    assert!(
        plan1.policies.iter().all(|p| p.acceptance.is_accepted()),
        "disjoint pods do not conflict"
    );

    // No pods at all: the same selector is enough.
    let c = policy("c", 5, &spec("model-a", 64, ""), 1);
    let input = input_of(vec![a, c], vec![]);
    let plan2 = plan_once(&input);
    assert!(matches!(&plan2.policy(&key("c")).unwrap().acceptance,
        validate::Acceptance::Conflicted(m) if m.ends_with("on the same gateway selector")));
}

#[test]
fn conflict_ties_are_broken_by_name() {
    let b = policy("b", 0, &spec("model-a", 64, ""), 1);
    let a = policy("a", 0, &spec("model-a", 64, ""), 1);
    let input = input_of(vec![b, a], pods(1));
    let plan = plan_once(&input);
    assert!(plan.policy(&key("a")).unwrap().acceptance.is_accepted());
    assert!(!plan.policy(&key("b")).unwrap().acceptance.is_accepted());
}

#[test]
fn invalid_specs_list_every_broken_rule() {
    let bad = "gatewaySelector: {}\nbackends:\n- name: m\n  endpoints: {addresses: [{address: 'not-an-address'}]}\n  capacity: {maxConnectionsPerEndpoint: 10, headroom: 0.5}\n  timeouts: {firstByte: 30s, total: 10s}\n- name: m\n  endpoints: {service: {name: m, port: 80}}\n  capacity: {maxConnectionsPerEndpoint: 10}\nautoscale: {min: 6, max: 4}\n";
    let p = policy("a", 0, bad, 1);
    let errors = match validate::validate_spec(&p.spec) {
        Err(e) => e,
        Ok(()) => panic!("the spec is invalid"),
    };
    let expected = [
        "spec.autoscale.min: 6 exceeds autoscale.max 4",
        "spec.autoscale.min: 6 exceeds backend \"m\" capacity × (1 − headroom) = 5",
        "spec.backends[0].endpoints.addresses[0].address: \"not-an-address\" is not ip:port",
        "spec.backends[0].timeouts.firstByte: 30s exceeds timeouts.total 10s",
        "spec.backends[1].name: duplicate backend name \"m\"",
    ];
    for e in expected {
        assert!(
            errors.iter().any(|got| got == e),
            "missing {e:?} in {errors:#?}"
        );
    }
}

#[test]
fn a_backends_protocol_reaches_its_document_and_auto_needs_tls_as_the_crd_rule_says() {
    let rendered = |extra: &str| {
        let p = policy("a", 0, &spec("model-a", 64, extra), 1);
        let doc = plan_once(&input_of(vec![p], pods(1))).documents["gw-0"].clone();
        doc.validate().expect("rendered documents validate");
        doc.backends[0].protocol
    };
    assert_eq!(rendered(""), UpstreamProtocol::Http1, "the default");
    assert_eq!(rendered("  protocol: Http1\n"), UpstreamProtocol::Http1);
    assert_eq!(rendered("  protocol: Http2\n"), UpstreamProtocol::Http2);

    let external = |tls: &str| {
        format!(
            "gatewaySelector: {{matchLabels: {{app: gw}}}}\nbackends:\n- name: p\n  protocol: Auto\n  endpoints: {{external: [{{host: api.example.com, port: 443{tls}}}, {{host: b.example.com, port: 443, tls: {{}}}}]}}\n  capacity: {{maxConnectionsPerEndpoint: 8}}\n"
        )
    };
    let auto_rule = "spec.backends[0].protocol: Auto negotiates by ALPN, over TLS only: set tls on every endpoints.external, or say Http1 or Http2 (h2c) for plain endpoints";
    let errors = |spec: &str| validate::validate_spec(&policy("a", 0, spec, 1).spec).err();
    assert_eq!(errors(&external(", tls: {}")), None);
    assert_eq!(errors(&external("")), Some(vec![auto_rule.to_owned()]));
    assert_eq!(
        errors(&spec("model-a", 64, "  protocol: Auto\n")),
        Some(vec![auto_rule.to_owned()]),
        "a Service's endpoints are plain"
    );
    assert_eq!(
        errors(&spec("model-a", 64, "  protocol: Http2\n")),
        None,
        "h2c"
    );

    let p = policy("a", 0, &external(", tls: {}"), 1);
    let doc = plan_once(&input_of(vec![p], pods(1))).documents["gw-0"].clone();
    assert_eq!(doc.backends[0].protocol, UpstreamProtocol::Auto);
}

#[test]
fn a_backends_fallbacks_reach_its_document_in_order_and_must_name_other_backends_of_the_policy() {
    let with = |fallback_a: &str| {
        format!(
            "gatewaySelector: {{matchLabels: {{app: gw}}}}\nbackends:\n- name: a\n  fallback: {fallback_a}\n  endpoints: {{service: {{name: a, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: 8}}\n- name: b\n  endpoints: {{service: {{name: b, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: 8}}\n- name: c\n  endpoints: {{service: {{name: c, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: 8}}\n"
        )
    };
    let p = policy("p", 0, &with("[c, b]"), 1);
    assert_eq!(validate::validate_spec(&p.spec), Ok(()));
    let doc = plan_once(&input_of(vec![p], pods(1))).documents["gw-0"].clone();
    doc.validate().expect("rendered documents validate");
    assert_eq!(doc.backends[0].fallback, ["c", "b"]);
    assert!(doc.backends[1].fallback.is_empty());

    // The CRD's rule, for a policy stored without it.
    let errors = |fallback: &str| validate::validate_spec(&policy("p", 0, &with(fallback), 1).spec);
    assert_eq!(
        errors("[a]"),
        Err(vec![
            "spec.backends[0].fallback[0]: \"a\" is not another backend of this policy".to_owned()
        ])
    );
    assert_eq!(
        errors("[b, model-x]"),
        Err(vec![
            "spec.backends[0].fallback[1]: \"model-x\" is not another backend of this policy"
                .to_owned()
        ])
    );
}

#[test]
fn a_backends_default_max_tokens_reaches_its_document() {
    let spec = "gatewaySelector: {matchLabels: {app: gw}}\nbackends:\n- name: a\n  defaultMaxTokens: 4096\n  endpoints: {service: {name: a, port: 80}}\n  capacity: {maxConnectionsPerEndpoint: 8}\n- name: b\n  endpoints: {service: {name: b, port: 80}}\n  capacity: {maxConnectionsPerEndpoint: 8}\n";
    let p = policy("p", 0, spec, 1);
    assert_eq!(validate::validate_spec(&p.spec), Ok(()));
    let doc = plan_once(&input_of(vec![p], pods(1))).documents["gw-0"].clone();
    doc.validate().expect("rendered documents validate");
    assert_eq!(doc.backends[0].default_max_tokens, Some(4096));
    assert_eq!(doc.backends[1].default_max_tokens, None, "omitted: none");
}

#[test]
fn an_aging_bound_a_queue_times_out_before_is_invalid_as_the_crd_rules_say() {
    // The CRD's CEL rules refuse it; an apiserver without them (or a policy written before
    // them) must not reach the gateways, which refuse such a limits document.
    let with = |aging: &str| {
        let spec = format!(
            "gatewaySelector: {{}}\nbackends:\n- name: m\n  endpoints: {{service: {{name: m, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: 10}}\n  pool: {{leaseTimeout: 300ms}}\nclients:\n  identity: {{header: x-api-key}}\n  maxConcurrency: 4\n  queueTimeout: 2s\n  priority: {{agingAfter: {aging}}}\n"
        );
        validate::validate_spec(&policy("a", 0, &spec, 1).spec)
    };
    assert_eq!(with("150ms"), Ok(()));
    assert_eq!(
        with("300ms"),
        Err(vec![
            "spec.clients.priority.agingAfter: 300ms is not shorter than backends[0].pool.leaseTimeout 300ms".to_string()
        ])
    );
    assert_eq!(
        with("2s"),
        Err(vec![
            "spec.clients.priority.agingAfter: 2s is not shorter than clients.queueTimeout 2s".to_string(),
            "spec.clients.priority.agingAfter: 2s is not shorter than backends[0].pool.leaseTimeout 300ms".to_string(),
        ])
    );
}

#[test]
fn static_endpoints_on_loopback_link_local_or_metadata_addresses_need_allow_private_addresses() {
    let with = |addresses: &[&str], allow: bool| {
        let list: Vec<String> = addresses
            .iter()
            .map(|a| format!("{{address: '{a}'}}"))
            .collect();
        let allow = if allow {
            ", allowPrivateAddresses: true"
        } else {
            ""
        };
        let spec = format!(
            "gatewaySelector: {{}}\nbackends:\n- name: m\n  endpoints: {{addresses: [{}]{allow}}}\n  capacity: {{maxConnectionsPerEndpoint: 10}}\n",
            list.join(", ")
        );
        validate::validate_spec(&policy("a", 0, &spec, 1).spec)
    };
    let refused = [
        "127.0.0.1:9901",          // the gateway's own admin port
        "127.8.9.10:80",           // all of 127/8
        "[::1]:9901",              // IPv6 loopback
        "[::ffff:127.0.0.1]:9901", // loopback written as IPv4-mapped IPv6
        "0.0.0.0:9901",            // the unspecified address connects to this host
        "[::]:9901",
        "169.254.169.254:80", // cloud metadata (AWS, GCP, Azure, OpenStack)
        "169.254.1.1:80",     // IPv4 link-local
        "[fe80::1]:80",       // IPv6 link-local
        "[fd00:ec2::254]:80", // AWS metadata over IPv6
        "100.100.100.200:80", // Alibaba Cloud metadata
        "224.0.0.1:80",       // multicast
        "255.255.255.255:80", // broadcast
    ];
    for address in refused {
        let errors = with(&[address], false).expect_err(address);
        assert_eq!(
            errors,
            [format!(
                "spec.backends[0].endpoints.addresses[0].address: {address:?} is a loopback, link-local, metadata or other non-unicast address; set endpoints.allowPrivateAddresses to use it"
            )],
            "{address}"
        );
        assert_eq!(with(&[address], true), Ok(()), "allowed: {address}");
    }
    // Pod, node and public unicast addresses need no permission.
    assert_eq!(
        with(
            &[
                "10.0.0.5:8000",
                "192.168.1.20:80",
                "[2001:db8::7]:8000",
                "100.64.0.1:80"
            ],
            false
        ),
        Ok(())
    );
}

#[test]
fn generations_only_increase() {
    let p = policy(
        "a",
        0,
        &spec("model-a", 64, "autoscale: {enabled: false}\n"),
        1,
    );
    let mut input = input_of(vec![p], pods(1));
    let first = plan_once(&input).documents["gw-0"].clone();
    assert_eq!(first.generation, 1);
    assert_eq!(first.revision, first.content_revision());

    // The pod acknowledged it: same content, same generation.
    input.pods[0].acked = Some(Acked {
        revision: first.revision.clone(),
        generation: 1,
    });
    let same = plan(&input, &mut Memory::default(), at(15)).documents["gw-0"].clone();
    assert_eq!(
        (same.revision.clone(), same.generation),
        (first.revision.clone(), 1)
    );

    // New content: a generation above everything known (the ConfigMap says 7).
    input.policies[0].spec.backends[0].pool.max_pending = 64;
    input.published = vec![Acked {
        revision: "0123456789ab".into(),
        generation: 7,
    }];
    let next = plan(&input, &mut Memory::default(), at(30)).documents["gw-0"].clone();
    assert_ne!(next.revision, first.revision);
    assert_eq!(next.generation, 8);
    next.validate().expect("rendered documents validate");

    // A pod said it runs generation 20 (a 409): even known content goes above it.
    input.generation_floor = 20;
    let above = plan(&input, &mut Memory::default(), at(45)).documents["gw-0"].clone();
    assert_eq!(above.generation, 21);
}

#[test]
fn implausible_generations_are_ignored_never_wrapped_and_listed() {
    use poolpilot_api::limits::MAX_GENERATION;
    let p = policy(
        "a",
        0,
        &spec("model-a", 64, "autoscale: {enabled: false}\n"),
        1,
    );
    let mut input = input_of(vec![p], pods(2));
    // Plausible history: generation 7 published. Implausible: an annotation edited to u64::MAX,
    // a pod claiming 2^60, a status recording MAX_GENERATION + 1, and a 409 floor of u64::MAX.
    input.published = vec![
        Acked {
            revision: "aaaaaaaaaaaa".into(),
            generation: 7,
        },
        Acked {
            revision: "bbbbbbbbbbbb".into(),
            generation: u64::MAX,
        },
    ];
    input.pods[1].acked = Some(Acked {
        revision: "cccccccccccc".into(),
        generation: 1 << 60,
    });
    input.policies[0].status = Some(ConnectionPolicyStatus {
        revision: Some("dddddddddddd".into()),
        limits_generation: Some(MAX_GENERATION + 1),
        ..Default::default()
    });
    input.generation_floor = u64::MAX;
    let fleet = plan_once(&input);
    let mut generations: Vec<u64> = fleet.documents.values().map(|d| d.generation).collect();
    generations.sort_unstable();
    assert_eq!(
        generations,
        [8, 9],
        "the two pods' documents (shares 26 and 25) go just above the plausible history"
    );
    for doc in fleet.documents.values() {
        doc.validate().expect("rendered documents validate");
    }
    let ignored = implausible_generations(&input);
    assert_eq!(ignored.len(), 4, "{ignored:#?}");
    for (needle, value) in [
        ("a published limits ConfigMap", u64::MAX),
        ("pod gw-1", 1 << 60),
        ("the status of policy ns/a", MAX_GENERATION + 1),
        ("a pod's answer (409)", u64::MAX),
    ] {
        assert!(
            ignored
                .iter()
                .any(|i| i.contains(needle) && i.contains(&value.to_string())),
            "{needle} {value}: {ignored:#?}"
        );
    }

    // At the very top of the plausible range, the next new document cannot go above it: no
    // document is rendered above MAX_GENERATION, and the plan says so.
    input.published[0].generation = MAX_GENERATION;
    input.policies[0].spec.backends[0].pool.max_pending = 64;
    let fleet = plan(&input, &mut Memory::default(), at(15));
    for doc in fleet.documents.values() {
        assert!(doc.generation <= MAX_GENERATION, "{}", doc.generation);
    }
}

proptest! {
    #[test]
    fn rendered_generations_stay_plausible_and_above_the_plausible_history(
        known in prop::collection::vec(any::<u64>(), 0..6),
        floor in prop_oneof![0u64..100, any::<u64>()],
    ) {
        let p = policy("a", 0, &spec("model-a", 64, "autoscale: {enabled: false}\n"), 1);
        let input = FleetInput {
            policies: vec![p],
            pods: pods(1),
            published: known
                .iter()
                .enumerate()
                .map(|(i, g)| Acked { revision: format!("{i:012}"), generation: *g })
                .collect(),
            generation_floor: floor,
            ..FleetInput::default()
        };
        let plausible_max = known
            .iter()
            .chain([&floor])
            .copied()
            .filter(|g| *g < poolpilot_api::limits::MAX_GENERATION)
            .max()
            .unwrap_or(0);
        let doc = plan_once(&input).documents["gw-0"].clone();
        prop_assert!(doc.generation <= poolpilot_api::limits::MAX_GENERATION);
        prop_assert!(doc.generation > plausible_max, "{} <= {plausible_max}", doc.generation);
    }
}

#[test]
fn pods_without_an_accepted_policy_get_an_empty_document() {
    let input = input_of(vec![], pods(1));
    let plan = plan_once(&input);
    assert!(
        plan.documents["gw-0"].backends.is_empty(),
        "a deleted policy's backends are removed"
    );
}

#[test]
fn clients_become_a_named_client_policy() {
    let extra = "clients:\n  identity: {header: x-api-key}\n  maxConcurrency: 8\n  maxQueue: 32\n  maxConnectionsPerClient: 64\n  overrides:\n  - {name: batch, match: {keySha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}, maxConcurrency: 40}\n";
    let p = policy("team-a", 0, &spec("model-a", 64, extra), 1);
    let input = input_of(vec![p], pods(1));
    let doc = plan_once(&input).documents["gw-0"].clone();
    assert_eq!(doc.client_policies[0].name, "team-a");
    assert_eq!(doc.client_policies[0].overrides[0].max_concurrency, 40);
    assert_eq!(doc.backends[0].client_policy.as_deref(), Some("team-a"));
    assert_eq!(doc.listener.max_connections_per_client, Some(64));
    doc.validate().expect("rendered documents validate");
}

#[test]
fn token_budgets_are_divided_over_the_pods_as_the_client_limits_are() {
    let budgets = |scope: &str| {
        let extra = format!(
            "clients:\n  identity: {{header: authorization}}\n  scope: {scope}\n  maxConcurrency: 8\n  tokens: {{perMinute: 1000, perDay: 100000, requestsPerMinute: 10, count: Weighted, weights: {{input: 0.5, output: 2}}}}\n  overrides:\n  - name: vip\n    match: {{keySha256: \"{}\"}}\n    maxConcurrency: 4\n    tokens: {{perMinute: 9}}\n",
            "a".repeat(64)
        );
        let p = policy("a", 0, &spec("model-a", 64, &extra), 1);
        let fleet = plan_once(&input_of(vec![p], pods(3)));
        let docs: Vec<_> = (0..3)
            .map(|i| fleet.documents[&format!("gw-{i}")].clone())
            .collect();
        for doc in &docs {
            doc.validate().expect("rendered documents validate");
        }
        docs.iter()
            .map(|d| {
                let c = &d.client_policies[0];
                let t = c.tokens.clone().expect("a budget");
                let vip = c.overrides[0]
                    .tokens
                    .clone()
                    .expect("the override's budget");
                assert_eq!(t.count, TokenCount::Weighted);
                assert_eq!(t.weights.map(|w| (w.input, w.output)), Some((0.5, 2.0)));
                assert_eq!(vip.count, TokenCount::Total);
                (
                    t.per_minute,
                    t.per_day,
                    t.requests_per_minute,
                    vip.per_minute,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        budgets("Fleet"),
        [
            (334, Some(33334), Some(4), 3),
            (333, Some(33333), Some(3), 3),
            (333, Some(33333), Some(3), 3),
        ]
    );
    assert_eq!(budgets("PerPod"), [(1000, Some(100000), Some(10), 9); 3]);
}

#[test]
fn listener_settings_take_the_most_permissive_and_the_oldest_policys_proxies() {
    let a = policy(
        "a",
        0,
        &spec(
            "model-a",
            64,
            "listener: {sendTimeout: 10s, bodyReadTimeout: 90s, minBodyRate: 500, maxConcurrentStreams: 50, trustedProxies: {cidrs: [10.0.0.0/8], protocol: XForwardedFor}}\nclients:\n  identity: {header: authorization}\n  maxConcurrency: 4\n  maxClients: 1000\n",
        ),
        1,
    );
    let b = policy(
        "b",
        1,
        &spec(
            "model-b",
            64,
            "listener: {sendTimeout: 30s, minBodyRate: 100, trustedProxies: {cidrs: [192.168.0.0/16], protocol: ProxyV2}}\n",
        ),
        1,
    );
    let input = input_of(vec![a, b], pods(1));
    let doc = plan_once(&input).documents["gw-0"].clone();
    let l = &doc.listener;
    assert_eq!(l.send_timeout, poolpilot_api::Duration::from_secs(30));
    assert_eq!(l.body_read_timeout, poolpilot_api::Duration::from_secs(90));
    assert_eq!(l.min_body_rate, 100);
    assert_eq!(l.http2.max_concurrent_streams, 100, "b's default");
    let proxies = l.trusted_proxies.as_ref().expect("a's proxies");
    assert_eq!(proxies.cidrs, vec!["10.0.0.0/8".parse().unwrap()]);
    assert_eq!(
        proxies.protocol,
        poolpilot_api::limits::ProxyProtocol::XForwardedFor
    );
    assert_eq!(doc.client_policies[0].max_clients, 1000);
    doc.validate().expect("rendered documents validate");
}

#[test]
fn autoscale_runs_once_per_interval_inside_the_plan() {
    let p = policy("a", 0, &spec("model-a", 700, "autoscale: {min: 16}\n"), 1);
    let k = (key("a"), "model-a".to_owned());
    let mut memory = Memory::default();
    let mut input = input_of(vec![p], pods(1));
    input.policies[0].status = Some(ConnectionPolicyStatus {
        backends: vec![poolpilot_api::policy::BackendStatus {
            name: "model-a".into(),
            target: 300,
            ..Default::default()
        }],
        ..Default::default()
    });
    Arc::make_mut(&mut input.samples).backends.insert(
        k.clone(),
        BackendSample {
            leased: Some(300.0),
            pending: Some(150.0),
            completed: Some(100.0),
            bytes: Some(10_000.0),
            ..BackendSample::default()
        },
    );
    let first = plan(&input, &mut memory, at(0));
    assert_eq!(
        first.policies[0].backends[0].target, 540,
        "the recorded 300 grows to 540 in one decision"
    );
    let early = plan(&input, &mut memory, at(5));
    assert_eq!(early.policies[0].backends[0].decision, None, "not due yet");
    assert_eq!(early.policies[0].backends[0].target, 540);
}

#[test]
fn every_backend_due_decides_whichever_reconcile_plans_and_none_decides_twice() {
    let a = policy("a", 0, &spec("model-a", 700, ""), 1);
    let b = policy("b", 1, &spec("model-b", 700, ""), 1);
    let busy = BackendSample {
        leased: Some(10.0),
        pending: Some(0.0),
        completed: Some(100.0),
        bytes: Some(10_000.0),
        ..BackendSample::default()
    };
    let mut input = FleetInput {
        policies: vec![a, b],
        pods: pods(1),
        focus: Some([key("a")].into()),
        ..FleetInput::default()
    };
    for k in ["a", "b"] {
        let backend = if k == "a" { "model-a" } else { "model-b" };
        Arc::make_mut(&mut input.samples)
            .backends
            .insert((key(k), backend.to_owned()), busy);
    }
    let mut memory = Memory::default();
    // a's reconcile plans: b's decision is due too, and made in the same run.
    let fleet = plan(&input, &mut memory, at(400));
    for k in ["a", "b"] {
        assert!(
            fleet.policy(&key(k)).unwrap().backends[0]
                .decision
                .is_some(),
            "{k} decided"
        );
    }
    // b's reconcile right after: nothing is due, nothing decides again.
    input.focus = Some([key("b")].into());
    let fleet = plan(&input, &mut memory, at(405));
    for k in ["a", "b"] {
        let b = &fleet.policy(&key(k)).unwrap().backends[0];
        assert_eq!(b.decision, None, "{k} decided once");
        assert_eq!(b.target, 560, "{k} keeps the target its decision made");
    }
}

#[test]
fn a_run_that_changes_nothing_rendered_reuses_the_last_rendering() {
    let a = policy("a", 0, &spec("model-a", 700, ""), 2);
    let b = policy("b", 1, &spec("model-b", 700, ""), 2);
    let mut input = FleetInput {
        policies: vec![a, b],
        pods: pods(3),
        focus: Some([key("a")].into()),
        ..FleetInput::default()
    };
    let steady = BackendSample {
        leased: Some(10.0),
        pending: Some(0.0),
        completed: Some(100.0),
        bytes: Some(10_000.0),
        ..BackendSample::default()
    };
    Arc::make_mut(&mut input.samples)
        .backends
        .insert((key("a"), "model-a".into()), steady);
    let mut memory = Memory::default();
    let first = plan(&input, &mut memory, at(0));
    let target = first.policies[0].backends[0].target;

    // Fresh samples, another policy in focus, a status written meanwhile: nothing the
    // documents are made from.
    Arc::make_mut(&mut input.samples).backends.insert(
        (key("a"), "model-a".into()),
        BackendSample {
            leased: Some(11.0),
            ..steady
        },
    );
    input.focus = Some([key("b")].into());
    input.policies[1].status = Some(ConnectionPolicyStatus {
        observed_generation: Some(1),
        ..ConnectionPolicyStatus::default()
    });
    // b's next decision falls due (no samples: it holds its target).
    let b_memory = memory.backends.get_mut(&(key("b"), "model-b".into()));
    b_memory.expect("b decided at the first run").last_decision = None;
    let again = plan(&input, &mut memory, at(5));
    assert!(
        again
            .documents
            .iter()
            .all(|(pod, d)| Arc::ptr_eq(d, &first.documents[pod])),
        "the documents are the last rendering's"
    );
    assert!(
        again.policies[1].backends[0].decision.is_some(),
        "this run's decision is still reported"
    );
    assert_eq!(
        again.policies[0].backends[0].sample.leased,
        Some(11.0),
        "and this run's samples"
    );

    // A spec change is rendered anew, exactly as without the memo.
    input.policies[0].spec.backends[0].pool.max_pending = 7;
    let mut without = memory.clone();
    without.rendered = None;
    let changed = plan(&input, &mut memory, at(10));
    assert_eq!(changed.documents["gw-0"].backends[0].pool.max_pending, 7);
    assert_eq!(
        changed.documents,
        plan(&input, &mut without, at(10)).documents
    );
    assert_eq!(changed.policies[0].backends[0].target, target);
}

/// Two backends: model-a loses its samples, model-b has no traffic. `MetricsAvailable` names
/// model-a with what it lacks, never model-b, stays False until model-a's two fresh samples,
/// and says so while it waits.
#[test]
fn metrics_availability_names_the_backend_it_is_about() {
    let two = "gatewaySelector: {matchLabels: {app: gw}}\nbackends:\n- name: model-a\n  endpoints: {service: {name: model-a, port: 8000}}\n  capacity: {maxConnectionsPerEndpoint: 64}\n- name: model-b\n  endpoints: {service: {name: model-b, port: 8000}}\n  capacity: {maxConnectionsPerEndpoint: 32}\n";
    let mut input = input_of(vec![policy("a", 0, two, 2)], pods(1));
    let idle = BackendSample {
        leased: Some(0.0),
        pending: Some(0.0),
        ..BackendSample::default()
    };
    let busy = BackendSample {
        leased: Some(10.0),
        pending: Some(0.0),
        ..BackendSample::default()
    };
    let mut memory = Memory::default();
    let mut state = |a: BackendSample, t: i64| {
        Arc::make_mut(&mut input.samples)
            .backends
            .insert((key("a"), "model-a".into()), a);
        Arc::make_mut(&mut input.samples)
            .backends
            .insert((key("a"), "model-b".into()), idle);
        let fleet = plan(&input, &mut memory, at(t));
        let m = fleet.policies[0].metrics_available.clone().unwrap();
        (m.available, m.message)
    };
    assert_eq!(
        state(busy, 0),
        (true, "fresh samples for every backend".into())
    );
    let lost = BackendSample::default();
    assert_eq!(
        state(lost, 15),
        (
            true,
            "model-a: no usable leased sample at the last decision; their targets are held".into()
        )
    );
    state(lost, 30);
    assert_eq!(
        state(lost, 45),
        (
            false,
            "model-a: no usable leased sample for 3 decisions or more in a row; their targets are held"
                .into()
        )
    );
    assert_eq!(
        state(busy, 60),
        (
            false,
            "model-a: samples fresh again, 1 of the 2 needed to resume; their targets are held"
                .into()
        )
    );
    assert_eq!(
        state(busy, 75),
        (true, "fresh samples for every backend".into())
    );
}

/// A backend the planner has just seen has no samples until its pods run it and are scraped and
/// queried: its misses within that horizon hold its target and are said, but do not make its
/// metrics unavailable (at a cold start of thousands of policies each would warn
/// `MetricsMissing`); past it they count as before, and a backend with data from the start is
/// judged at once.
#[test]
fn a_new_backends_first_misses_within_the_samples_horizon_do_not_make_metrics_unavailable() {
    let p = policy("a", 0, &spec("model-a", 64, ""), 2);
    let mut input = input_of(vec![p], pods(1));
    input.samples_horizon = std::time::Duration::from_secs(60);
    let mut memory = Memory::default();
    let mut state = |sample: BackendSample, t: i64| {
        Arc::make_mut(&mut input.samples)
            .backends
            .insert((key("a"), "model-a".into()), sample);
        let fleet = plan(&input, &mut memory, at(t));
        let m = fleet.policies[0].metrics_available.clone().unwrap();
        (m.available, m.message)
    };
    let none = BackendSample::default();
    for t in [0, 15, 30, 45] {
        assert_eq!(
            state(none, t),
            (
                true,
                "model-a: no usable leased sample at the last decision; their targets are held"
                    .into()
            ),
            "at {t} s, within the horizon"
        );
    }
    assert_eq!(
        state(none, 60),
        (
            false,
            "model-a: no usable leased sample for 3 decisions or more in a row; their targets are held"
                .into()
        ),
        "the horizon passed: the misses in a row count"
    );
}

#[test]
fn status_reports_conditions_targets_and_pods() {
    let p = policy(
        "a",
        0,
        &spec("model-a", 64, "autoscale: {enabled: false}\n"),
        2,
    );
    let pods = pods(2);
    let mut input = input_with_fds(vec![p], pods, 4096);
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let pp = &fleet.policies[0];
    let rev = pp.document.as_ref().unwrap().revision.clone();
    let pod_state = |name: &str, acked: Option<&str>| PodState {
        generation: acked.map(|_| 1),
        name: name.into(),
        desired: rev.clone(),
        acked: acked.map(Into::into),
        refused: None,
        unanswered_at: None,
    };
    let halfway = RolloutReport {
        pods: vec![pod_state("gw-0", Some(&rev)), pod_state("gw-1", None)],
        waiting: Some("verifying 1 canary pod(s) for 20s more".into()),
        ..RolloutReport::default()
    };
    let s1 = compute(&input.policies[0], pp, &memory, &halfway, at(0));
    assert_eq!(s1.targets.as_deref(), Some("model-a=51"));
    assert_eq!(s1.updated.as_deref(), Some("1/2"));
    assert_eq!(s1.backends[0].per_pod, 25);
    let cond = |s: &ConnectionPolicyStatus, k: Kind| {
        let c = s.conditions.iter().find(|c| c.type_ == k.as_str()).unwrap();
        (c.status.clone(), c.reason.clone(), c.last_transition_time.0)
    };
    assert_eq!(cond(&s1, Kind::Accepted).0, "True");
    assert_eq!(cond(&s1, Kind::RolledOut).1, "Progressing");
    assert_eq!(
        cond(&s1, Kind::Ready),
        ("False".into(), "Progressing".into(), at(0))
    );
    assert_eq!(cond(&s1, Kind::FdBudget).1, "WithinBudget");
    assert_eq!(cond(&s1, Kind::MetricsAvailable).1, "AutoscaleDisabled");
    assert_eq!(s1.pods.as_ref().unwrap().fd_limit, Some(4096));
    // The busiest pod: gw-0 holds 26 of the 51 (the remainder), on 2 endpoints.
    assert_eq!(s1.pods.as_ref().unwrap().fd_needed, 2 * 26 + 1024 + 256);

    input.policies[0].status = Some(s1);
    let done = RolloutReport {
        pods: vec![pod_state("gw-0", Some(&rev)), pod_state("gw-1", Some(&rev))],
        ..RolloutReport::default()
    };
    let s2 = compute(&input.policies[0], pp, &memory, &done, at(30));
    assert_eq!(
        cond(&s2, Kind::Ready),
        ("True".into(), "Ready".into(), at(30))
    );
    assert_eq!(
        cond(&s2, Kind::Accepted).2,
        at(0),
        "unchanged conditions keep their transition time"
    );
    assert_eq!(s2.updated.as_deref(), Some("2/2"));
}

#[test]
fn status_of_a_conflicted_policy_says_why() {
    let older = policy("older", 0, &spec("model-a", 64, ""), 1);
    let newer = policy("newer", 10, &spec("model-a", 64, ""), 1);
    let input = input_of(vec![older, newer], pods(1));
    let memory = Memory::default();
    let fleet = plan(&input, &mut memory.clone(), at(0));
    let s = compute(
        &input.policies[1],
        &fleet.policies[1],
        &memory,
        &RolloutReport::default(),
        at(0),
    );
    let accepted = s.conditions.iter().find(|c| c.type_ == "Accepted").unwrap();
    assert_eq!(
        (accepted.status.as_str(), accepted.reason.as_str()),
        ("False", "Conflicted")
    );
    assert!(s.targets.is_none());
    assert_eq!(s.revision, None);
}

// === properties ===

prop_compose! {
    fn arb_fleet()(
        capacities in prop::collection::vec((1u32..2000, 0u32..9).prop_map(|(c, h)| (c, if f64::from(c) * (1.0 - f64::from(h) / 10.0) < 1.0 { 0 } else { h })), 1..4),
        endpoints in 1u32..9,
        n_pods in 1usize..12,
        fd_limit in prop::option::of(256u64..100_000),
        listener in 1u32..3000,
        reserve in 0u32..1000,
        min in 1u32..40,
        demand in prop::collection::vec((0.0f64..5000.0, 0.0f64..500.0), 4),
        enabled in any::<bool>(),
    ) -> (FleetInput, u32) {
        let backends: String = capacities.iter().enumerate().map(|(i, (cap, headroom))| format!(
            "- name: b{i}\n  endpoints: {{service: {{name: b{i}, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: {cap}, headroom: 0.{headroom}}}\n"
        )).collect();
        let min_budget = capacities.iter().map(|(c, h)| ((f64::from(*c) * (1.0 - f64::from(*h) / 10.0)).floor() as u32).max(1)).min().unwrap();
        let min = min.min(min_budget);
        let spec = format!(
            "gatewaySelector: {{matchLabels: {{app: gw}}}}\nbackends:\n{backends}listener: {{maxConnections: {listener}}}\nfileDescriptors: {{reserve: {reserve}}}\nautoscale: {{enabled: {enabled}, min: {min}}}\n"
        );
        let p = policy("p", 0, &spec, endpoints);
        let pods = pods(n_pods);
        let mut samples = Samples::default();
        if let Some(l) = fd_limit {
            samples.pods = fds(&pods, l);
        }
        for (i, (leased, pending)) in demand.iter().enumerate().take(capacities.len()) {
            samples.backends.insert((key("p"), format!("b{i}")), BackendSample {
                leased: Some(*leased), pending: Some(*pending), completed: Some(100.0), bytes: Some(10_000.0), ..BackendSample::default()
            });
        }
        (FleetInput { policies: vec![p], pods, samples: samples.into(), ..FleetInput::default() }, min)
    }
}

proptest! {
    #[test]
    fn two_policies_on_shared_pods_fit_the_fd_budget(
        shares in prop::collection::vec((1u32..500, 1u32..6, 1u32..30), 2),
        n_pods in 1usize..6,
        fd_limit in 512u64..20_000,
        listener in 1u32..500,
    ) {
        let policies: Vec<PolicyInput> = shares.iter().enumerate().map(|(i, (max, endpoints, min))| {
            let extra = format!(
                "listener: {{maxConnections: {listener}}}\nfileDescriptors: {{reserve: 64}}\nautoscale: {{enabled: false, min: {}, max: {max}}}\n",
                (*min).min(*max)
            );
            policy(&format!("p{i}"), i as i64, &spec(&format!("b{i}"), 1000, &extra), *endpoints)
        }).collect();
        let pods = pods(n_pods);
        let samples = Samples { pods: fds(&pods, fd_limit), ..Samples::default() };
        let input = FleetInput { policies: policies.clone(), pods, samples: samples.into(), ..FleetInput::default() };
        let fleet = plan_once(&input);
        let allowed = budget::allowed(fd_limit);
        let fixed = u64::from(listener) + 64;
        let minima: u64 = policies.iter().zip(&fleet.policies).map(|(p, pp)| {
            let min = u64::from(budget::share(p.spec.autoscale.min.min(p.spec.autoscale.max.unwrap_or(1)), n_pods as u32));
            min * u64::from(pp.backends[0].endpoints)
        }).sum();
        for doc in fleet.documents.values() {
            prop_assert_eq!(doc.backends.len(), 2, "both policies' backends are merged");
            let need: u64 = doc.backends.iter()
                .map(|b| u64::from(b.pool.max_connections_per_endpoint) * b.endpoints.len() as u64)
                .sum::<u64>() + fixed;
            if fixed + minima <= allowed {
                prop_assert!(need <= allowed, "pod needs {} fds, allowed {}", need, allowed);
            }
        }
    }

    /// Reusing the last rendering gives exactly what rendering again would, over runs whose
    /// decisions change the targets (and so the documents) or not, and pods that come and go.
    #[test]
    fn the_reused_rendering_is_what_rendering_again_gives((mut input, _) in arb_fleet(), changes in prop::collection::vec(0u8..6, 1..8)) {
        let mut memory = Memory::default();
        for (t, change) in changes.iter().enumerate() {
            match change {
                0 => {}
                1 => input.pods[0].ready = !input.pods[0].ready,
                2 => input.pods.last_mut().unwrap().terminating = true,
                3 => input.pods.push(GatewayPod {
                    name: format!("other-{t}"),
                    labels: [("app".to_owned(), "other".to_owned())].into(),
                    ..GatewayPod::default()
                }),
                // A pod said it runs a later generation (a 409).
                4 => input.generation_floor += 3,
                _ => {
                    for s in Arc::make_mut(&mut input.samples).backends.values_mut() {
                        s.pending = s.pending.map(|p| p + 50.0);
                    }
                }
            }
            plans_as_a_fresh_rendering(&input, &mut memory, at(t as i64 * 15))?;
        }
    }

    #[test]
    fn rendered_shares_respect_capacity_and_the_fd_budget((input, min) in arb_fleet(), ticks in 1i64..6) {
        let mut memory = Memory::default();
        let mut fleet = FleetPlan::default();
        for t in 0..ticks {
            fleet = plan(&input, &mut memory, at(t * 15));
        }
        let p = &input.policies[0];
        let ready = input.pods.len() as u64;
        for (spec, b) in p.spec.backends.iter().zip(&fleet.policies[0].backends) {
            let budget = u64::from(spec.capacity.budget());
            if ready <= budget {
                prop_assert!(u64::from(b.per_pod) * ready <= budget,
                    "{}: {} per pod × {ready} pods > budget {budget}", spec.name, b.per_pod);
            }
            prop_assert!(b.per_pod >= 1);
        }
        let Some(limit) = input.samples.pods.values().next().and_then(|s| s.max_fds) else { return Ok(()) };
        let allowed = budget::allowed(limit);
        let endpoints = u64::from(fleet.policies[0].backends[0].endpoints);
        let fixed = u64::from(p.spec.listener.max_connections) + u64::from(p.spec.file_descriptors.reserve);
        let min_share = u64::from(budget::share(min, ready as u32));
        let minima_fit = fixed + p.spec.backends.len() as u64 * min_share * endpoints <= allowed;
        for doc in fleet.documents.values() {
            let need: u64 = doc.backends.iter()
                .map(|b| u64::from(b.pool.max_connections_per_endpoint) * b.endpoints.len() as u64)
                .sum::<u64>() + fixed;
            if minima_fit {
                prop_assert!(need <= allowed, "pod needs {need} fds, allowed {allowed}");
            }
            doc.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
    }
}

#[test]
fn a_backend_without_endpoints_is_reported_saturated_naming_its_service() {
    // No EndpointSlice address for the Service: zero endpoints resolved.
    let p = policy(
        "a",
        0,
        &spec("model-b", 32, "autoscale: {enabled: false}\n"),
        0,
    );
    let input = input_of(vec![p], pods(2));
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let s = status_now(&input, &fleet, &memory, at(0));
    assert_eq!(s.backends[0].endpoints, 0);
    let saturated = condition(&s, "Saturated");
    assert_eq!(
        (saturated.status.as_str(), saturated.reason.as_str()),
        ("True", "Saturated")
    );
    assert_eq!(
        saturated.message,
        "model-b: no endpoints: Service model-b has no ready endpoint on port 8000; requests for \
         model-b fail with 503"
    );

    // With endpoints, nothing is said about them.
    let p = policy(
        "a",
        0,
        &spec("model-b", 32, "autoscale: {enabled: false}\n"),
        1,
    );
    let input = input_of(vec![p], pods(2));
    let fleet = plan(&input, &mut memory, at(0));
    let s = status_now(&input, &fleet, &memory, at(0));
    let saturated = condition(&s, "Saturated");
    assert_eq!(saturated.status, "False", "{saturated:?}");
}

#[test]
fn a_share_floor_over_the_backend_budget_is_named_with_the_numbers() {
    // capacity 10 × (1 − 0.2) = 8 per endpoint; ten gateway pods each keep at least one.
    let p = policy(
        "a",
        0,
        &spec("model-a", 10, "autoscale: {enabled: false}\n"),
        1,
    );
    let input = input_of(vec![p], pods(10));
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let b = &fleet.policies[0].backends[0];
    assert_eq!((b.target, b.per_pod), (8, 1));
    assert_eq!(b.overcommit(), Some((10, 8)));
    let s = status_now(&input, &fleet, &memory, at(0));
    let c = condition(&s, "Saturated");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
        (
            "True",
            "Overcommitted",
            "model-a: 10 gateway pods keep at least 1 connection per endpoint each, 10 in all, \
             over the backend's budget of 8 per endpoint; run fewer gateway pods or raise the \
             budget"
        )
    );

    // Eight pods fit the budget exactly: nothing to say.
    let input = FleetInput {
        pods: pods(8),
        ..input
    };
    let fleet = plan(&input, &mut memory, at(15));
    assert_eq!(fleet.policies[0].backends[0].overcommit(), None);
    let s = status_now(&input, &fleet, &memory, at(15));
    let c = condition(&s, "Saturated");
    assert_eq!(c.status, "False", "{c:?}");
}

#[test]
fn a_ready_pod_without_fresh_samples_holds_the_target_and_is_named() {
    let p = policy("a", 0, &spec("model-a", 64, ""), 2);
    let pods = pods(3);
    let mut samples = Samples {
        pods: fds(&pods, 4096),
        ..Samples::default()
    };
    // As `Snapshot::samples` gives it: gw-2 is ready and not scraped, so the sums are missing.
    samples.pods.insert("gw-2".into(), PodSample::default());
    samples.backends.insert(
        (key("a"), "model-a".into()),
        BackendSample {
            unscraped: 1,
            ..BackendSample::default()
        },
    );
    let input = FleetInput {
        policies: vec![p],
        pods,
        samples: samples.into(),
        ..FleetInput::default()
    };
    let mut memory = Memory::default();
    let before = memory_target(&input, &mut memory);
    let fleet = plan(&input, &mut memory, at(15));
    let b = &fleet.policies[0].backends[0];
    assert!(
        matches!(b.decision, Some(autoscale::Decision::MissingData { .. })),
        "{:?}",
        b.decision
    );
    assert_eq!(
        b.target, before,
        "held, never lowered to the scraped pods' demand"
    );
    let m = fleet.policies[0].metrics_available.clone().unwrap();
    assert_eq!(
        m.message,
        "model-a: no usable leased sample (ready pods without fresh samples: gw-2) at the last \
         decision; their targets are held"
    );
    let why = &memory.backends[&(key("a"), "model-a".into())]
        .last_decision
        .as_ref()
        .unwrap()
        .reason;
    assert!(
        why.contains("a ready gateway pod has no fresh samples"),
        "{why}"
    );
}

/// The target after a first planning run at `at(0)`.
fn memory_target(input: &FleetInput, memory: &mut Memory) -> u32 {
    plan(input, memory, at(0)).policies[0].backends[0].target
}

proptest! {
    /// Whatever the budget and the number of holders: the shares add up to the target when
    /// it allows one connection per holder, and otherwise the overcommit is reported with the
    /// fleet's true total.
    #[test]
    fn the_overcommit_is_reported_exactly_when_the_shares_exceed_the_target(
        capacity in 2u32..64,
        n in 1usize..40,
    ) {
        let p = policy("a", 0, &spec("model-a", capacity, "autoscale: {enabled: false}\n"), 1);
        let input = FleetInput { policies: vec![p], pods: pods(n), ..FleetInput::default() };
        let mut memory = Memory::default();
        let fleet = plan(&input, &mut memory, at(0));
        let pp = &fleet.policies[0];
        prop_assert!(pp.acceptance.is_accepted(), "{:?}", pp.acceptance);
        let b = &pp.backends[0];
        let total: u64 = pp.holders.iter().map(|h| u64::from(pp.share(b, h))).sum();
        prop_assert_eq!(total, b.fleet_total());
        if total > u64::from(b.target) {
            prop_assert_eq!(b.overcommit(), Some((total, b.target)));
            prop_assert!(n as u64 > u64::from(b.target));
            let s = compute(&input.policies[0], pp, &memory, &RolloutReport::default(), at(0));
            let c = s.conditions.iter().find(|c| c.type_ == "Saturated").unwrap();
            prop_assert_eq!(c.reason.as_str(), "Overcommitted");
            let needle = format!("{total} in all");
            prop_assert!(c.message.contains(&needle), "{}", c.message);
        } else {
            prop_assert_eq!(total, u64::from(b.target), "the shares add up to the target");
            prop_assert_eq!(b.overcommit(), None);
        }
    }
}

proptest! {
    /// Shadow mode plans exactly as enforcement does: over runs whose demand changes, the
    /// decisions, targets, shares, fd check, documents and status of a Recommend policy are
    /// those of the same policy in Enforce, so switching to Enforce rolls out what was shown.
    #[test]
    fn shadow_equals_enforces_plan(
        (input, _) in arb_fleet(),
        demand in prop::collection::vec(0.0f64..3000.0, 1..6),
        start in prop::sample::select(vec![StartFrom::Max, StartFrom::Min, StartFrom::Current]),
        current in prop::option::of(1.0f64..500.0),
    ) {
        let mut enforce = input;
        enforce.policies[0].spec.autoscale.start_from = start;
        for s in Arc::make_mut(&mut enforce.samples).backends.values_mut() {
            s.current = current;
        }
        let mut shadow = enforce.clone();
        shadow.policies[0].spec.mode = Mode::Recommend;
        let (mut m_enforce, mut m_shadow) = (Memory::default(), Memory::default());
        for (t, d) in demand.iter().enumerate() {
            for input in [&mut enforce, &mut shadow] {
                for s in Arc::make_mut(&mut input.samples).backends.values_mut() {
                    s.pending = Some(*d);
                }
            }
            let now = at(t as i64 * 15);
            let a = plan(&enforce, &mut m_enforce, now);
            let b = plan(&shadow, &mut m_shadow, now);
            prop_assert_eq!(&a.policies, &b.policies);
            prop_assert_eq!(&a.documents, &b.documents);
            let report = RolloutReport::default();
            let sa = compute(&enforce.policies[0], &a.policies[0], &m_enforce, &report, now);
            let sb = compute(&shadow.policies[0], &b.policies[0], &m_shadow, &report, now);
            prop_assert_eq!(&sa.backends, &sb.backends);
            prop_assert_eq!(&sa.targets, &sb.targets);
            prop_assert_eq!(&sa.revision, &sb.revision);
        }
    }
}

#[test]
fn a_new_policy_starts_from_max_min_or_what_the_pods_run() {
    let start = |from: &str, current: Option<f64>| {
        let p = policy(
            "a",
            0,
            &spec(
                "model-a",
                64,
                &format!("autoscale: {{min: 4, max: 40, startFrom: {from}}}\n"),
            ),
            2,
        );
        let mut samples = Samples::default();
        samples.backends.insert(
            (key("a"), "model-a".into()),
            BackendSample {
                current,
                ..BackendSample::default()
            },
        );
        let input = FleetInput {
            policies: vec![p],
            pods: pods(3),
            samples: samples.into(),
            ..FleetInput::default()
        };
        // Not yet due to decide: the starting target stands.
        let mut memory = Memory::default();
        plan(&input, &mut memory, at(0));
        memory.backends[&(key("a"), "model-a".into())].target
    };
    assert_eq!(start("Max", Some(12.0)), 40);
    assert_eq!(start("Min", Some(12.0)), 4);
    assert_eq!(start("Current", Some(12.0)), 12, "3 pods running 4 each");
    assert_eq!(start("Current", Some(100.0)), 40, "within the bounds");
    assert_eq!(
        start("Current", None),
        40,
        "not known yet: the upper bound, as a static configuration"
    );
}

#[test]
fn a_recommend_policy_on_pods_an_enforce_policy_selects_is_conflicted() {
    let a = policy("a", 0, &spec("model-a", 64, ""), 1);
    let mut b = policy("b", 1, &spec("model-b", 64, ""), 1);
    b.spec.mode = Mode::Recommend;
    let input = input_of(vec![a.clone(), b.clone()], pods(2));
    let fleet = plan_once(&input);
    assert!(fleet.policies[0].acceptance.is_accepted());
    match &fleet.policies[1].acceptance {
        validate::Acceptance::Conflicted(why) => assert_eq!(
            why,
            "mode Recommend on pod gw-0, which policy ns/a enforces: its documents would roll \
             this policy's targets out; give this policy pods of its own, or the same mode"
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        fleet.documents["gw-0"]
            .backends
            .iter()
            .all(|x| x.name == "model-a"),
        "the recommendation is in no enforced document"
    );
    // Both in Recommend: both accepted.
    let mut a = a;
    a.spec.mode = Mode::Recommend;
    let input = input_of(vec![a, b], pods(2));
    let fleet = plan_once(&input);
    assert!(fleet.policies.iter().all(|p| p.acceptance.is_accepted()));
}

#[test]
fn status_lists_what_each_pod_runs_since_when_and_its_last_error_bounded_to_fifty() {
    let p = policy(
        "a",
        0,
        &spec("model-a", 2000, "autoscale: {enabled: false}\n"),
        1,
    );
    let mut input = input_of(vec![p], pods(60));
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let pp = &fleet.policies[0];
    let rev = pp.document.as_ref().unwrap().revision.clone();
    let state = |name: &str, acked: Option<(&str, u64)>, refused: Option<&str>| PodState {
        name: name.into(),
        desired: rev.clone(),
        acked: acked.map(|(r, _)| r.to_owned()),
        generation: acked.map(|(_, g)| g),
        refused: refused.map(Into::into),
        unanswered_at: None,
    };
    // gw-0 runs the current revision; gw-1 an older one and refused the new one; gw-10 is
    // unreachable; the others run nothing known yet.
    let first = RolloutReport {
        pods: vec![
            state("gw-0", Some((&rev, 2)), None),
            state("gw-1", Some(("old", 1)), Some("HTTP 422: bad limits")),
        ],
        unreachable: [("gw-10".to_owned(), "connection refused".to_owned())].into(),
        ..RolloutReport::default()
    };
    let s1 = compute(&input.policies[0], pp, &memory, &first, at(0));
    let pods1 = s1.pods.clone().unwrap();
    assert_eq!(pods1.items.len(), 50, "bounded");
    assert_eq!(pods1.omitted, 10, "and the rest counted");
    assert_eq!(pods1.selected, 60);
    let item = |s: &ConnectionPolicyStatus, name: &str| {
        s.pods
            .as_ref()
            .unwrap()
            .items
            .iter()
            .find(|i| i.name == name)
            .cloned()
            .unwrap()
    };
    let gw0 = item(&s1, "gw-0");
    assert_eq!(
        (gw0.revision.as_deref(), gw0.generation, gw0.current),
        (Some(rev.as_str()), Some(2), true)
    );
    assert_eq!(gw0.since, Some(Time(at(0))));
    let gw1 = item(&s1, "gw-1");
    assert!(!gw1.current);
    assert_eq!(gw1.last_error.as_deref(), Some("HTTP 422: bad limits"));
    assert_eq!(
        item(&s1, "gw-10").last_error.as_deref(),
        Some("connection refused")
    );
    assert_eq!(item(&s1, "gw-2").revision, None);
    assert_eq!(item(&s1, "gw-2").since, None);

    // 30 s later: gw-0 still runs it (its time stays), gw-1 took the new revision (its error
    // is over), gw-10 answers now but runs nothing known: its last error stays.
    input.policies[0].status = Some(s1);
    let later = RolloutReport {
        pods: vec![
            state("gw-0", Some((&rev, 2)), None),
            state("gw-1", Some((&rev, 2)), None),
        ],
        ..RolloutReport::default()
    };
    let s2 = compute(&input.policies[0], pp, &memory, &later, at(30));
    assert_eq!(item(&s2, "gw-0").since, Some(Time(at(0))));
    let gw1 = item(&s2, "gw-1");
    assert_eq!((gw1.since, gw1.last_error), (Some(Time(at(30))), None));
    assert_eq!(
        item(&s2, "gw-10").last_error.as_deref(),
        Some("connection refused")
    );
}

proptest! {
    /// Fleet-wide client limits: over the pods the backends' targets are divided over (every
    /// selected pod not stopped) the parts add up to the fleet limit (or to one call per pod
    /// when that is more), differ by at most one, and are divided again as pods come and go;
    /// per pod, every pod gets the limit itself.
    #[test]
    fn fleet_client_limits_divide_over_the_pods_and_sum_to_the_fleet_limit(
        max_concurrency in 1u32..200,
        max_queue in 0u32..200,
        vip in 1u32..200,
        n in 1usize..12,
        states in prop::collection::vec(0u8..3, 12),
        per_pod in any::<bool>(),
    ) {
        let scope = if per_pod { "PerPod" } else { "Fleet" };
        let extra = format!(
            "clients:\n  identity: {{header: authorization}}\n  scope: {scope}\n  maxConcurrency: {max_concurrency}\n  maxQueue: {max_queue}\n  overrides:\n  - name: vip\n    match: {{keySha256: \"{}\"}}\n    maxConcurrency: {vip}\n",
            "a".repeat(64)
        );
        let p = policy("a", 0, &spec("model-a", 64, &extra), 1);
        let mut pods = pods(n);
        // Ready, starting (not ready yet) or stopped for good.
        for (pod, s) in pods.iter_mut().zip(&states) {
            pod.ready = *s == 0;
            pod.stopped = *s == 2;
        }
        let input = FleetInput { policies: vec![p], pods, ..FleetInput::default() };
        let fleet = plan_once(&input);
        let pp = &fleet.policies[0];
        prop_assert!(pp.acceptance.is_accepted(), "{:?}", pp.acceptance);
        let parts: Vec<(u32, u32, u32)> = pp
            .live
            .iter()
            .map(|pod| {
                let c = &fleet.documents[pod].client_policies[0];
                (c.max_concurrency, c.max_queue, c.overrides[0].max_concurrency)
            })
            .collect();
        let holders = pp.holders.len();
        for (i, limit) in [max_concurrency, max_queue, vip].into_iter().enumerate() {
            let got: Vec<u32> = parts.iter().map(|p| [p.0, p.1, p.2][i]).collect();
            if per_pod {
                prop_assert!(got.iter().all(|g| *g == limit), "{:?}", got);
                continue;
            }
            // A call in flight per pod at least (a pod must serve the client); the queue may
            // be 0. So the parts add up to the limit, or to one per pod when that is more.
            let floor = u32::from(i != 1);
            if holders > 0 {
                let want = limit.max(floor * holders as u32);
                prop_assert_eq!(got.iter().sum::<u32>(), want, "parts {:?} of {}", got, limit);
            }
            if let (Some(lo), Some(hi)) = (got.iter().min(), got.iter().max()) {
                prop_assert!(hi - lo <= 1, "{:?}", got);
            }
        }
        // A pod turning ready changes no document.
        let mut turned = input.clone();
        for pod in turned.pods.iter_mut().filter(|p| !p.stopped) {
            pod.ready = true;
        }
        let again = plan(&turned, &mut Memory::default(), at(0));
        for pod in &pp.live {
            prop_assert_eq!(
                &fleet.documents[pod].client_policies,
                &again.documents[pod].client_policies
            );
        }
    }
}

/// A fleet sample for `plan`: `leased` + `pending` in all, with the throughput a decision needs.
fn busy_sample(leased: f64, pending: f64) -> BackendSample {
    BackendSample {
        leased: Some(leased),
        pending: Some(pending),
        leased_now: Some(leased),
        pending_now: Some(pending),
        completed: Some(10.0),
        bytes: Some(1_000.0),
        ttfb: Some(0.1),
        ..BackendSample::default()
    }
}

/// Each pod's own pool in `input` for policy `a`'s backend `model-a`.
fn set_pools(input: &mut FleetInput, pools: &[(f64, f64)]) {
    for (i, &(leased, pending)) in pools.iter().enumerate() {
        Arc::make_mut(&mut input.samples).pools.insert(
            (key("a"), "model-a".into(), format!("gw-{i}")),
            input::PodPool {
                leased,
                pending,
                leased_now: leased,
            },
        );
    }
}

#[test]
fn a_crowd_on_one_pod_gets_the_target_divided_by_demand_and_a_rebalance_says_why() {
    // Target fixed at 8 per endpoint (min = max) over 2 endpoints and 2 pods; demand 13 in all
    // recommends the target itself, so the autoscaler alone would say NoChange.
    let p = policy(
        "a",
        0,
        &spec("model-a", 64, "autoscale: {min: 8, max: 8}\n"),
        2,
    );
    let mut input = input_with_fds(vec![p], pods(2), 65_536);
    let k = (key("a"), "model-a".to_owned());
    Arc::make_mut(&mut input.samples)
        .backends
        .insert(k.clone(), busy_sample(10.0, 3.0));
    set_pools(&mut input, &[(5.0, 1.5), (5.0, 1.5)]);
    let mut memory = Memory::default();
    let even = plan(&input, &mut memory, at(0));
    assert_eq!(even.policies[0].backends[0].shares, [4, 4]);

    // The load moves onto gw-0: 8 leased and 3 pending there, 2 leased on gw-1.
    set_pools(&mut input, &[(8.0, 3.0), (2.0, 0.0)]);
    let fleet = plan(&input, &mut memory, at(15));
    let b = &fleet.policies[0].backends[0];
    assert_eq!((b.target, b.shares.clone()), (8, vec![7, 1]));
    assert_eq!(
        b.per_pod, 1,
        "the smallest share, for the ConfigMap's document"
    );
    let shares: Vec<u32> = ["gw-0", "gw-1"]
        .iter()
        .map(|p| {
            fleet.documents[*p].backends[0]
                .pool
                .max_connections_per_endpoint
        })
        .collect();
    assert_eq!(shares, [7, 1], "each pod's document carries its own share");
    let why = b.rebalanced.clone().expect("a rebalance");
    assert_eq!(
        why,
        "gw-0 queues at share 4 with demand 5.5 per endpoint while gw-1 uses 1.0 of its 4: \
         target 8 re-divided by demand from [4, 4] to [7, 1]"
    );
    let d = memory.backends[&k].last_decision.clone().unwrap();
    assert_eq!(d.action, poolpilot_api::policy::DecisionAction::Rebalance);
    assert!(d.reason.starts_with(&why), "{}", d.reason);
    let s = status_now(&input, &fleet, &memory, at(15));
    let shown: Vec<(String, u32, Option<f64>)> = s.backends[0]
        .shares
        .iter()
        .map(|s| (s.pod.clone(), s.share, s.demand))
        .collect();
    assert_eq!(
        shown,
        [
            ("gw-0".to_owned(), 7, Some(5.5)),
            ("gw-1".to_owned(), 1, Some(1.0))
        ]
    );
    assert_eq!(
        s.backends[0].last_decision.as_ref().unwrap().action,
        poolpilot_api::policy::DecisionAction::Rebalance
    );
}

#[test]
fn the_burst_fills_the_budget_left_by_the_shares_and_stops_at_a_hold() {
    // Capacity 20 × (1 − 0.2 / 2) = 18 per endpoint for shares and bursts; max 16; target 4
    // over 2 pods: burst ⌊(16 − 4) ÷ 2⌋ = 6 per pod.
    let p = policy(
        "a",
        0,
        &spec("model-a", 20, "autoscale: {min: 4, max: 16}\n"),
        1,
    );
    let mut input = input_with_fds(vec![p], pods(2), 65_536);
    let k = (key("a"), "model-a".to_owned());
    input.policies[0].status = Some(ConnectionPolicyStatus {
        backends: vec![poolpilot_api::policy::BackendStatus {
            name: "model-a".into(),
            target: 4,
            ..Default::default()
        }],
        ..Default::default()
    });
    Arc::make_mut(&mut input.samples)
        .backends
        .insert(k.clone(), busy_sample(3.0, 0.0));
    set_pools(&mut input, &[(2.0, 0.0), (1.0, 0.0)]);
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let b = &fleet.policies[0].backends[0];
    assert_eq!((b.target, b.burst), (4, 6), "{:?}", b.decision);
    assert_eq!(
        fleet.documents["gw-0"].backends[0].pool.burst_per_endpoint,
        6
    );
    assert_eq!(
        fleet.policies[0].document.as_ref().unwrap().backends[0]
            .pool
            .burst_per_endpoint,
        0,
        "a pod that starts from the ConfigMap is not counted yet: no burst"
    );
    // Growth held at the upper bound: no burst.
    Arc::make_mut(&mut input.samples)
        .backends
        .insert(k, busy_sample(40.0, 20.0));
    plan(&input, &mut memory, at(15));
    let held = plan(&input, &mut memory, at(30));
    let b = &held.policies[0].backends[0];
    assert!(b.held > 0, "{:?}", b.decision);
    assert_eq!(b.burst, 0, "no burst while growth is held");
}

/// One policy over two busy pods whose client limits (8 calls, 4 queue places, and `more`)
/// hold for the whole fleet.
fn fleet_wide_clients(more: &str) -> FleetInput {
    let extra = format!(
        "autoscale: {{min: 8, max: 8}}\nclients:\n  identity: {{header: x-api-key}}\n  maxConcurrency: 8\n  maxQueue: 4\n{more}"
    );
    let p = policy("a", 0, &spec("model-a", 64, &extra), 2);
    let mut input = input_with_fds(vec![p], pods(2), 65_536);
    Arc::make_mut(&mut input.samples)
        .backends
        .insert((key("a"), "model-a".into()), busy_sample(10.0, 3.0));
    set_pools(&mut input, &[(8.0, 3.0), (2.0, 0.0)]);
    input
}

#[test]
fn a_new_operator_keeps_the_client_divisions_it_finds_in_status() {
    // A client with all its calls on gw-0 gets most of its fleet-wide 8 there; a restarted (or
    // newly elected) operator, with Prometheus away, must send the pods the same client limits,
    // not fall back to the even split.
    let mut input = fleet_wide_clients("");
    let client = "c".repeat(64);
    let busy = input::ClientUse {
        key_sha256: client.clone(),
        in_flight: 6,
        queued: 2,
        demand: 7.5,
        ..input::ClientUse::default()
    };
    input.clients.insert((key("a"), "gw-0".into()), vec![busy]);
    input.clients.insert((key("a"), "gw-1".into()), Vec::new());
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let parts = |f: &FleetPlan| -> Vec<(u32, u32)> {
        ["gw-0", "gw-1"]
            .iter()
            .flat_map(|p| f.documents[*p].client_policies[0].client_shares.clone())
            .map(|s| (s.max_concurrency, s.max_queue))
            .collect()
    };
    let divided = parts(&fleet);
    assert_eq!(
        divided,
        [(7, 4), (1, 0)],
        "divided by where the calls arrive"
    );

    let status = status_now(&input, &fleet, &memory, at(0));
    assert_eq!(status.clients.len(), 1);
    let shown: Vec<(String, u32, Option<f64>)> = status.clients[0]
        .shares
        .iter()
        .map(|s| (s.pod.clone(), s.share, s.demand))
        .collect();
    assert_eq!(
        (
            status.clients[0].key_sha256.as_str(),
            status.clients[0].max_concurrency
        ),
        (client.as_str(), 8)
    );
    assert_eq!(
        shown,
        [
            ("gw-0".to_owned(), 7, Some(7.5)),
            ("gw-1".to_owned(), 1, None)
        ]
    );

    // A new operator: nothing in memory, the status as stored, no samples from Prometheus.
    let mut restarted = input.clone();
    Arc::make_mut(&mut restarted.samples).backends.clear();
    Arc::make_mut(&mut restarted.samples).pools.clear();
    let forgetful = plan(&restarted, &mut Memory::default(), at(15));
    assert!(
        parts(&forgetful).is_empty(),
        "without status the division is lost"
    );
    restarted.policies[0].status = Some(status.clone());
    let again = plan(&restarted, &mut Memory::default(), at(15));
    assert_eq!(parts(&again), divided);

    // A division that no longer fits (the limit changed) is not restored.
    let mut changed = restarted.clone();
    changed.policies[0]
        .spec
        .clients
        .as_mut()
        .unwrap()
        .max_concurrency = 12;
    assert!(parts(&plan(&changed, &mut Memory::default(), at(15))).is_empty());
    // Nor one over other pods.
    let mut more = restarted;
    more.pods = pods(3);
    assert!(parts(&plan(&more, &mut Memory::default(), at(15))).is_empty());
}

/// A round of reconciles, one per policy (each in focus once): the first one's run makes every
/// decision due and divides each backend; each later one judges its own policy's division
/// again and keeps the others' in memory, planning with the very shares their own reconciles
/// made. A new set of holders is divided anew at once, in whichever reconcile sees it first.
#[test]
fn a_round_of_reconciles_divides_each_backend_once() {
    let n = 12;
    let names: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    let policies = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let extra = "autoscale: {min: 8, max: 24}\n";
            policy(name, i as i64, &spec(&format!("model-{i}"), 64, extra), 2)
        })
        .collect();
    let mut input = input_with_fds(policies, pods(3), 65_536);
    let set_demand = |input: &mut FleetInput, busy: usize| {
        for (i, name) in names.iter().enumerate() {
            let backend = format!("model-{i}");
            Arc::make_mut(&mut input.samples)
                .backends
                .insert((key(name), backend.clone()), busy_sample(20.0, 4.0));
            for pod in 0..3 {
                let leased = if pod == busy { 16.0 } else { 2.0 };
                Arc::make_mut(&mut input.samples).pools.insert(
                    (key(name), backend.clone(), format!("gw-{pod}")),
                    input::PodPool {
                        leased,
                        pending: if pod == busy { 4.0 } else { 0.0 },
                        leased_now: leased,
                    },
                );
            }
        }
    };
    let mut memory = Memory::default();
    // One round: every policy in focus once; how many divisions it computed in all, and each
    // policy's shares as its own reconcile made them.
    let round = |input: &mut FleetInput, memory: &mut Memory, t: i64| {
        let mut divided = 0;
        let mut own = BTreeMap::new();
        for name in &names {
            input.focus = Some([key(name)].into());
            let fleet = plan(input, memory, at(t));
            divided += fleet.divided;
            own.insert(
                name.clone(),
                fleet.policy(&key(name)).unwrap().backends[0].shares.clone(),
            );
        }
        (divided, own)
    };
    set_demand(&mut input, 0);
    let (first, _) = round(&mut input, &mut memory, 0);
    assert_eq!(
        first,
        n + (n - 1),
        "the first reconcile divides every backend"
    );

    // The crowd moves to gw-2: the first run decides and divides every backend, each later
    // reconcile judges its own again.
    set_demand(&mut input, 2);
    let (divided, own) = round(&mut input, &mut memory, 15);
    assert_eq!(
        divided,
        n + (n - 1),
        "every backend at its decision, each again in its own reconcile"
    );
    for shares in own.values() {
        assert!(shares[2] > shares[0] && shares[2] > shares[1], "{shares:?}");
    }
    // Any later reconcile plans every other policy with the shares its own reconcile made.
    input.focus = Some([key("p0")].into());
    let fleet = plan(&input, &mut memory, at(20));
    assert_eq!(fleet.divided, 1);
    for name in &names[1..] {
        assert_eq!(
            fleet.policy(&key(name)).unwrap().backends[0].shares,
            own[name],
            "{name}"
        );
    }

    // A fourth pod: every division no longer fits, and is made anew over the four.
    input.pods = pods(4);
    let fleet = plan(&input, &mut memory, at(25));
    assert_eq!(fleet.divided, n);
    for p in &fleet.policies {
        assert_eq!(p.backends[0].shares.len(), 4, "{}", p.key.name);
    }
}

#[test]
fn a_named_clients_fleet_token_budget_follows_its_use_to_the_pod_it_is_pinned_to() {
    // 60000 tokens a minute over 3 pods; the override `batch` (the policy's budget) sends all
    // of its calls to gw-1. Run 1 splits evenly; run 2, having seen its use there, gives gw-1
    // all but a floor of 60000 ÷ 3 ÷ 100 = 200 on each other pod. The clients without an
    // override keep the even split: the metric does not tell them apart.
    let key_hash = "b".repeat(64);
    let extra = format!(
        "autoscale: {{min: 8, max: 8}}\nclients:\n  identity: {{header: x-api-key}}\n  maxConcurrency: 8\n  tokens: {{perMinute: 60000, perDay: 6000000, requestsPerMinute: 300}}\n  overrides:\n  - name: batch\n    match: {{keySha256: {key_hash}}}\n    maxConcurrency: 8\n"
    );
    let p = policy("a", 0, &spec("model-a", 64, &extra), 3);
    let mut input = input_with_fds(vec![p], pods(3), 65_536);
    Arc::make_mut(&mut input.samples)
        .backends
        .insert((key("a"), "model-a".into()), busy_sample(3.0, 0.0));
    set_pools(&mut input, &[(1.0, 0.0), (1.0, 0.0), (1.0, 0.0)]);
    let use_on = |input: &mut FleetInput, used: [f64; 3]| {
        for (i, v) in used.iter().enumerate() {
            Arc::make_mut(&mut input.samples).token_use.insert(
                (key("a"), format!("gw-{i}")),
                BTreeMap::from([("batch".to_owned(), *v), ("other".to_owned(), 10.0)]),
            );
        }
    };
    let parts = |f: &FleetPlan| -> Vec<(u64, Option<u64>, Option<u32>, u64)> {
        (0..3)
            .map(|i| {
                let c = &f.documents[&format!("gw-{i}")].client_policies[0];
                let t = c.overrides[0].tokens.as_ref().expect("a divided budget");
                let policy = c.tokens.as_ref().expect("the policy's budget");
                (
                    t.per_minute,
                    t.per_day,
                    t.requests_per_minute,
                    policy.per_minute,
                )
            })
            .collect()
    };
    use_on(&mut input, [0.0; 3]);
    let mut memory = Memory::default();
    let first = plan(&input, &mut memory, at(0));
    assert_eq!(
        parts(&first),
        vec![(20_000, Some(2_000_000), Some(100), 20_000); 3]
    );
    use_on(&mut input, [0.0, 19_500.0, 0.0]);
    let second = plan(&input, &mut memory, at(15));
    assert_eq!(
        parts(&second),
        [
            (200, Some(20_000), Some(1), 20_000),
            (59_600, Some(5_960_000), Some(298), 20_000),
            (200, Some(20_000), Some(1), 20_000),
        ]
    );
    for doc in second.documents.values() {
        doc.validate().expect("a valid document");
    }
    let status = status_now(&input, &second, &memory, at(15));
    let batch = status
        .tokens
        .iter()
        .find(|t| t.client == "batch")
        .expect("batch");
    assert_eq!(
        (batch.per_minute, batch.used_per_minute),
        (60_000, Some(19_500.0))
    );
    let shown: Vec<(&str, u64)> = batch
        .shares
        .iter()
        .map(|s| (s.pod.as_str(), s.per_minute))
        .collect();
    assert_eq!(shown, [("gw-0", 200), ("gw-1", 59_600), ("gw-2", 200)]);
    let other = status
        .tokens
        .iter()
        .find(|t| t.client == "other")
        .expect("other");
    assert_eq!(
        (other.per_minute, other.used_per_minute, other.shares.len()),
        (60_000, Some(30.0), 0)
    );

    // A new operator with the status as stored and Prometheus away keeps the division.
    let mut restarted = input.clone();
    restarted.policies[0].status = Some(status);
    Arc::make_mut(&mut restarted.samples).token_use.clear();
    let again = plan(&restarted, &mut Memory::default(), at(30));
    assert_eq!(parts(&again), parts(&second));

    // `scope: PerPod`: every pod gets the whole budget, whatever the use.
    let per_pod = extra.replace("clients:\n", "clients:\n  scope: PerPod\n");
    let mut input = input_with_fds(
        vec![policy("a", 0, &spec("model-a", 64, &per_pod), 3)],
        pods(3),
        65_536,
    );
    use_on(&mut input, [0.0, 19_500.0, 0.0]);
    let fleet = plan(&input, &mut Memory::default(), at(0));
    assert!(
        parts_per_pod(&fleet).iter().all(|&m| m == 60_000),
        "{:?}",
        parts_per_pod(&fleet)
    );
}

/// The policy's `perMinute` in each of three pods' documents.
fn parts_per_pod(f: &FleetPlan) -> Vec<u64> {
    (0..3)
        .map(|i| {
            f.documents[&format!("gw-{i}")].client_policies[0]
                .tokens
                .as_ref()
                .map_or(0, |t| t.per_minute)
        })
        .collect()
}

#[test]
fn a_client_without_an_override_spending_its_budget_on_one_pod_gets_it_there_in_that_pods_document()
{
    let mut input =
        fleet_wide_clients("  tokens: {perMinute: 6000, perDay: 600000, requestsPerMinute: 60}\n");
    let client = "c".repeat(64);
    // 50 tokens a second on gw-0 (3,000 a minute: all of its even part there).
    let spender = input::ClientUse {
        key_sha256: client.clone(),
        in_flight: 1,
        input_tokens: 20.0,
        output_tokens: 30.0,
        ..input::ClientUse::default()
    };
    input
        .clients
        .insert((key("a"), "gw-0".into()), vec![spender]);
    input.clients.insert((key("a"), "gw-1".into()), Vec::new());
    let mut memory = Memory::default();
    let fleet = plan(&input, &mut memory, at(0));
    let shares = |pod: &str| {
        fleet.documents[pod].client_policies[0]
            .client_token_shares
            .clone()
    };
    let (gw0, gw1) = (shares("gw-0"), shares("gw-1"));
    assert_eq!(gw0.len(), 1);
    assert_eq!(
        (
            gw0[0].key_sha256.as_str(),
            gw0[0].per_minute,
            gw0[0].per_day,
            gw0[0].requests_per_minute
        ),
        (client.as_str(), 5_970, Some(597_000), Some(59)),
        "the floor (6000 ÷ 2 ÷ 100 = 30) elsewhere, the rest where it spends; the day and \
         requests in the same proportion"
    );
    assert_eq!((gw1[0].per_minute, gw1[0].per_day), (30, Some(3_000)));
    // Every document is valid as the gateways check it, and the even part stays the policy's.
    for pod in ["gw-0", "gw-1"] {
        fleet.documents[pod].validate().expect("a valid document");
        assert_eq!(
            fleet.documents[pod].client_policies[0]
                .tokens
                .as_ref()
                .map(|t| t.per_minute),
            Some(3_000)
        );
    }
    // The ConfigMap's document, for pods not counted yet, has none.
    let shared = fleet.policies[0].document.as_ref().expect("a document");
    assert!(shared.client_policies[0].client_token_shares.is_empty());
}

/// Pods `gw-0..` of groups of `per_group` (`group: gN`, and `app: gw` for the fleet-wide
/// policy), every one sampled with plenty of file descriptors.
fn grouped_fleet(n_pods: usize, per_group: usize) -> FleetInput {
    let mut pods = pods(n_pods);
    for (i, p) in pods.iter_mut().enumerate() {
        p.labels
            .insert("group".to_owned(), format!("g{}", i / per_group.max(1)));
    }
    FleetInput {
        samples: Samples {
            pods: fds(&pods, 65_536),
            ..Samples::default()
        }
        .into(),
        pods,
        ..FleetInput::default()
    }
}

/// A policy `name` of group `group` (`None`: fleet-wide) whose one backend `b-{name}` caps
/// each endpoint at `capacity`.
fn grouped_policy(name: &str, created: i64, group: Option<usize>, capacity: u32) -> PolicyInput {
    let selector = match group {
        Some(g) => format!("{{group: g{g}}}"),
        None => "{app: gw}".to_owned(),
    };
    policy(
        name,
        created,
        &format!(
            "gatewaySelector: {{matchLabels: {selector}}}\nbackends:\n- name: b-{name}\n  endpoints: {{service: {{name: b-{name}, port: 80}}}}\n  capacity: {{maxConnectionsPerEndpoint: {capacity}, headroom: 0.2}}\nautoscale: {{enabled: false}}\n"
        ),
        2,
    )
}

#[test]
fn a_pod_whose_policies_are_unchanged_keeps_its_document_when_another_pods_change() {
    let mut input = grouped_fleet(4, 2);
    input.policies = vec![
        grouped_policy("a", 0, Some(0), 32),
        grouped_policy("b", 1, Some(1), 32),
    ];
    let mut memory = Memory::default();
    let first = plan(&input, &mut memory, at(0));
    // The pods run what they were sent.
    for pod in &mut input.pods {
        let doc = &first.documents[&pod.name];
        pod.acked = Some(Acked {
            revision: doc.revision.clone(),
            generation: doc.generation,
        });
    }
    // Policy a's capacity changes: the documents of its pods (group g0: gw-0, gw-1) change,
    // group g1's are the last ones, the same allocation.
    input.policies[0] = grouped_policy("a", 0, Some(0), 48);
    let mut fresh = memory.clone();
    fresh.rendered = None;
    let second = plan(&input, &mut memory, at(15));
    let again = plan(&input, &mut fresh, at(15));
    assert_eq!(second.documents, again.documents);
    assert_eq!(second.policies, again.policies);
    for pod in ["gw-0", "gw-1"] {
        assert_ne!(
            first.documents[pod].revision, second.documents[pod].revision,
            "{pod} runs policy a"
        );
    }
    for pod in ["gw-2", "gw-3"] {
        assert!(
            Arc::ptr_eq(&first.documents[pod], &second.documents[pod]),
            "{pod} runs only policy b, unchanged: its document is kept, not rendered again"
        );
    }
    // The ConfigMaps' documents likewise: a's is rendered again, b's kept.
    let configmap = |fleet: &FleetPlan, i: usize| fleet.policies[i].document.clone().unwrap();
    assert_ne!(
        configmap(&first, 0).revision,
        configmap(&second, 0).revision
    );
    assert!(
        Arc::ptr_eq(&configmap(&first, 1), &configmap(&second, 1)),
        "policy b is unchanged: its ConfigMap's document is kept, not rendered again"
    );
}

proptest! {
    /// Whatever the sequence of changes (a policy's spec edited, a policy added or deleted, a
    /// pod moved to another group, added or removed, a later generation floor, statuses
    /// recording generations), every pod's document and every plan are those a rendering
    /// from nothing gives: a kept document is never stale, its generation never behind.
    #[test]
    fn kept_pod_documents_are_what_rendering_them_again_gives(
        n_pods in 1usize..9,
        per_group in 1usize..4,
        changes in prop::collection::vec((0u8..9, 0usize..8, 1u32..200), 1..10),
    ) {
        let mut input = grouped_fleet(n_pods, per_group);
        let groups = n_pods.div_ceil(per_group);
        input.policies = vec![grouped_policy("fleet", 0, None, 64)];
        for g in 0..groups {
            input.policies.push(grouped_policy(&format!("p{g}"), 1 + g as i64, Some(g), 32));
        }
        let mut memory = Memory::default();
        let mut next = 0;
        for (t, (change, which, capacity)) in changes.into_iter().enumerate() {
            match change {
                0 => {}
                1 => {
                    let i = which % input.policies.len();
                    let (name, created) = (input.policies[i].key.name.clone(), input.policies[i].created);
                    let group = (name != "fleet").then_some(which % groups);
                    input.policies[i] = grouped_policy(&name, 0, group, capacity);
                    input.policies[i].created = created;
                }
                2 => {
                    next += 1;
                    input.policies.push(grouped_policy(&format!("new{next}"), 100 + next, Some(which % groups), capacity));
                }
                3 if input.policies.len() > 1 => {
                    input.policies.remove(which % input.policies.len());
                }
                4 => {
                    let i = which % input.pods.len();
                    input.pods[i].labels.insert("group".to_owned(), format!("g{}", capacity as usize % groups));
                }
                5 => {
                    next += 1;
                    let mut pod = pods(1).remove(0);
                    pod.name = format!("gw-new{next}");
                    pod.labels.insert("group".to_owned(), format!("g{}", which % groups));
                    input.pods.push(pod);
                }
                6 if input.pods.len() > 1 => {
                    input.pods.remove(which % input.pods.len());
                }
                7 => input.generation_floor += u64::from(capacity),
                // What the last run published, as if written: the statuses record it.
                _ => {
                    let last = plan(&input, &mut memory.clone(), at(t as i64 * 15));
                    for (p, pp) in input.policies.iter_mut().zip(&last.policies) {
                        if let Some(doc) = &pp.document {
                            let status = p.status.get_or_insert_with(Default::default);
                            status.revision = Some(doc.revision.clone());
                            status.limits_generation = Some(doc.generation);
                        }
                    }
                }
            }
            plans_as_a_fresh_rendering(&input, &mut memory, at(t as i64 * 15))?;
        }
    }
}
