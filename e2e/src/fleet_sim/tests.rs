//! The simulated fleet at 20 pods against the operator's own rollout client (its HTTPS client
//! trusting the fleet's CA, the bounded, timed pushes of its rollout step): the normal pods
//! take their documents, the failing ones answer 503, the slow ones are abandoned at the
//! per-pod timeout; the scrape target then serves what each pod runs. Real time: this crate's
//! tokio is built without the paused clock.

use std::sync::Arc;
use std::time::Duration;

use poolpilot_api::GatewayLimits;
use poolpilot_operator::gateway::{GatewayTrust, Gateways as _, HttpGateways, PutError, Ranking};
use poolpilot_operator::reconcile::PushBound;
use poolpilot_operator::reconcile::rollout::{Delivery, send_all};

use super::*;
use crate::credentials::{Pki, server_name};

const TEMPLATE: &str = "poolpilot-gateway-admin.{namespace}.svc";

/// The example limits document of the gateway, at `generation`.
fn example(generation: u64) -> Arc<GatewayLimits> {
    let mut doc: GatewayLimits =
        serde_norway::from_str(include_str!("../../../gateway/examples/limits.yaml")).unwrap();
    doc.generation = generation;
    Arc::new(doc.with_content_revision())
}

fn spec(pods: usize, first: Ipv4Addr) -> FleetSpec {
    FleetSpec {
        pods,
        first,
        port: 0,
        namespace: "sim".into(),
        prefix: "gw-".into(),
        token: "s3cr3t".into(),
        latency: Duration::from_millis(20),
        slow_fraction: 0.1,
        slow_latency: Duration::from_secs(30),
        fail_fraction: 0.1,
        leased: 3.0,
        calls_per_second: 10.0,
    }
}

/// The fleet of `spec` over TLS for its namespace, and the operator's client trusting its CA.
async fn fleet_and_client(spec: FleetSpec) -> (Fleet, HttpGateways, tempfile::TempDir) {
    crate::install_crypto_provider();
    let pki = Pki::generate("fleet sim CA", &server_name(&spec.namespace)).unwrap();
    let tls = server_config(&pki.cert_pem, &pki.key_pem).unwrap();
    let fleet = Fleet::start(spec, tls).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let trust = GatewayTrust::load(ca, TEMPLATE.into(), Duration::from_secs(600)).unwrap();
    let client = HttpGateways::with_trust(Duration::from_secs(600), trust).unwrap();
    (fleet, client, dir)
}

#[test]
fn addresses_follow_the_first_and_skip_network_and_broadcast_ones() {
    let s = spec(600, Ipv4Addr::new(127, 1, 0, 1));
    let at = |i| s.address(i).unwrap().to_string();
    assert_eq!(
        [at(0), at(253), at(254), at(508), at(599)],
        [
            "127.1.0.1",
            "127.1.0.254",
            "127.1.1.1",
            "127.1.2.1",
            "127.1.2.92"
        ]
    );
    assert!(spec(1, Ipv4Addr::new(127, 1, 0, 0)).address(0).is_err());
    assert!(
        spec(1, Ipv4Addr::new(127, 255, 255, 254))
            .address(1)
            .is_err()
    );
    // A tenth slow, counted from the first pod, and a tenth failing, from the last.
    let s20 = spec(20, Ipv4Addr::new(127, 1, 0, 1));
    let which = |kind| -> Vec<usize> { (0..20).filter(|&i| s20.kind(i) == kind).collect() };
    assert_eq!(
        (which(PodKind::Slow), which(PodKind::Failing)),
        (vec![9, 19], vec![0, 10])
    );
    let none = FleetSpec {
        slow_fraction: 0.0,
        fail_fraction: 0.0,
        ..s20
    };
    assert!((0..20).all(|i| none.kind(i) == PodKind::Normal));
}

#[tokio::test]
async fn twenty_pods_take_the_operators_rollout_except_the_slow_and_failing_ones() {
    let (fleet, client, _dir) = fleet_and_client(spec(20, Ipv4Addr::new(127, 3, 0, 1))).await;
    let doc = example(1);
    let pods = fleet
        .pods
        .iter()
        .map(|p| (p.name.clone(), p.addr, doc.clone()))
        .collect();
    let bound = PushBound {
        concurrency: 4,
        timeout: Duration::from_secs(2),
    };
    let started = Instant::now();
    let outcomes = send_all(&client, "sim", ("s3cr3t", None), pods, bound).await;
    let took = started.elapsed();

    let mut by_kind: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (name, _, delivery) in &outcomes {
        let kind = match delivery {
            Delivery::Answered(Ok(ack)) => {
                assert_eq!(
                    (ack.revision.as_str(), ack.generation),
                    (doc.revision.as_str(), 1)
                );
                "acked"
            }
            Delivery::Answered(Err(PutError::Unexpected { status: 503, .. })) => "failed",
            Delivery::TimedOut(_) => "timed out",
            Delivery::Answered(Err(e)) => panic!("{name}: {e:?}"),
        };
        by_kind.entry(kind).or_default().push(name.clone());
    }
    for names in by_kind.values_mut() {
        names.sort();
    }
    assert_eq!(by_kind["failed"], ["gw-0", "gw-10"]);
    assert_eq!(by_kind["timed out"], ["gw-19", "gw-9"]);
    assert_eq!(by_kind["acked"].len(), 16);
    // 18 answers of 20 ms over 4 slots, the two slow pods holding a slot for 2 s each (real
    // time: this crate's tokio has no paused clock; the margin is for a loaded machine).
    assert!(
        took >= bound.timeout && took < bound.timeout + Duration::from_secs(3),
        "{took:?}"
    );
    for pod in &fleet.pods {
        let runs = pod.limits().map(|l| l.revision);
        let expect = (pod.kind == PodKind::Normal).then(|| doc.revision.clone());
        assert_eq!(runs, expect, "{}", pod.name);
    }

    // An older generation is refused as the gateway does, naming the one it runs; a wrong
    // token is not accepted.
    let normal = &fleet.pods[1];
    let older = client.put("sim", normal.addr, "s3cr3t", &example(0)).await;
    assert!(
        matches!(
            older,
            Err(PutError::Older {
                generation: Some(1),
                ..
            })
        ),
        "{older:?}"
    );
    let wrong = client.put("sim", normal.addr, "other", &doc).await;
    assert!(matches!(wrong, Err(PutError::Unauthorized)), "{wrong:?}");
    for by in [Ranking::Demand, Ranking::Tokens] {
        let report = client
            .clients("sim", normal.addr, "s3cr3t", by)
            .await
            .unwrap();
        assert_eq!(report.policies.len(), 1, "{by:?}");
        assert_eq!(report.policies[0].name, "default");
    }

    // The scrape target: the series of every pod that runs a document, labelled with the pod.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = fleet.exposition();
    assert!(
        text.contains(&format!(
            "poolpilot_limits_info{{namespace=\"sim\",pod=\"gw-1\",revision=\"{}\",generation=\"1\"}} 1",
            doc.revision
        )),
        "{text}"
    );
    assert!(
        text.contains("poolpilot_pool_max_connections{namespace=\"sim\",pod=\"gw-1\",backend=\"model-a\",endpoint=\"model-a-0\"} 64"),
        "{text}"
    );
    assert!(
        !text.contains("pod=\"gw-0\",revision"),
        "a failing pod runs nothing"
    );
    assert_eq!(
        text.matches("poolpilot_limits_info{").count(),
        16,
        "one per pod that took a document"
    );
    assert_eq!(text.matches("process_max_fds{").count(), 20);
    let calls = text
        .lines()
        .find(|l| {
            l.starts_with(
                "poolpilot_upstream_request_duration_seconds_count{namespace=\"sim\",pod=\"gw-1\"",
            )
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert!(calls >= 10.0, "10 calls/s for 1 s or more: {calls}");
}

#[tokio::test]
async fn the_scrape_target_serves_the_exposition_over_http() {
    let (mut fleet, _, _dir) = fleet_and_client(spec(3, Ipv4Addr::new(127, 3, 1, 1))).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    fleet.serve_metrics(listener);
    let client = reqwest::Client::new();
    let text = client
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.starts_with("# TYPE process_max_fds gauge\n"), "{text}");
    assert_eq!(text.matches("process_max_fds{namespace=\"sim\"").count(), 3);
    let missing = client
        .get(format!("http://{addr}/other"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

/// The rollout of one document to 1,000 simulated pods (5 ms each, none slow or failing) over
/// TLS, first to a cold fleet (a TLS handshake per pod) and again over the kept connections,
/// at several concurrency bounds; prints the times. Not in `make test` (it takes the machine
/// for seconds): `cargo test -p poolpilot-e2e --lib fleet_sim -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn rollout_time_to_a_thousand_pods() {
    for (i, concurrency) in [8usize, 32, 128].into_iter().enumerate() {
        let spec = FleetSpec {
            latency: Duration::from_millis(5),
            slow_fraction: 0.0,
            fail_fraction: 0.0,
            ..spec(1000, Ipv4Addr::new(127, 4 + i as u8, 0, 1))
        };
        let (fleet, client, _dir) = fleet_and_client(spec).await;
        let bound = PushBound {
            concurrency,
            timeout: Duration::from_secs(5),
        };
        for (round, generation) in [("cold", 1), ("warm", 2)] {
            let doc = example(generation);
            let pods = fleet
                .pods
                .iter()
                .map(|p| (p.name.clone(), p.addr, doc.clone()))
                .collect();
            let started = Instant::now();
            let outcomes = send_all(&client, "sim", ("s3cr3t", None), pods, bound).await;
            let took = started.elapsed();
            let acked = outcomes
                .iter()
                .filter(|(_, _, d)| matches!(d, Delivery::Answered(Ok(_))))
                .count();
            assert_eq!(acked, 1000, "concurrency {concurrency}, {round}");
            println!(
                "rollout to 1000 pods, concurrency {concurrency:>3}, {round}: {:.2} s",
                took.as_secs_f64()
            );
        }
    }
}
