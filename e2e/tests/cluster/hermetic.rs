//! Nothing the embedded cluster's users send leaves this machine: the pod range and the Service
//! range are routed to nowhere, so a connect to a pod that is gone, to an address no pod holds or
//! to a ClusterIP fails here at once, while the addresses of live pods keep working: each is
//! routed into the node by itself while its pod holds it (the node's CNI plugin,
//! e2e/cluster/cniroute.go), and unrouted again before the pod is gone from the API.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use poolpilot_e2e::hermetic::{POD_RANGE, SERVICE_RANGE, UNHELD_POD_ADDRESS};
use poolpilot_e2e::scenario::figure;
use poolpilot_e2e::{eventually, wait_for, with_namespace};
use serde_json::json;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(60);
/// "Fails locally": the kernel answers at once, no SYN waits for a SYN-ACK.
const LOCAL_FAILURE: Duration = Duration::from_millis(100);

/// Connects to `addr` and returns what happened and how long it took (a timeout after 3 s means
/// the SYN went somewhere).
async fn connect(addr: SocketAddr) -> (std::io::Result<tokio::net::TcpStream>, Duration) {
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr))
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
    (result, start.elapsed())
}

/// Asserts that a connect to `addr` fails with EHOSTUNREACH within [`LOCAL_FAILURE`].
async fn assert_unreachable_here(addr: SocketAddr, what: &str) {
    let (result, took) = connect(addr).await;
    let err = result
        .err()
        .unwrap_or_else(|| panic!("{what} {addr}: the connect succeeded"));
    assert_eq!(
        err.raw_os_error(),
        Some(nix::errno::Errno::EHOSTUNREACH as i32),
        "{what} {addr}: {err} after {took:?}, want No route to host"
    );
    assert!(
        took < LOCAL_FAILURE,
        "{what} {addr}: failed after {took:?}, want < {LOCAL_FAILURE:?}"
    );
    figure(
        "hermetic",
        &format!("connect to {what}: EHOSTUNREACH after"),
        format!("{took:?}"),
    );
}

/// `ip` with `args`: (success, stdout + stderr).
fn ip(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The route the kernel picks for `addr` is the cluster's unreachable route for `range`.
fn assert_routed_to_nowhere(addr: IpAddr, (net, bits): (std::net::Ipv4Addr, u8)) {
    let (ok, answer) = ip(&["-4", "route", "get", &addr.to_string()]);
    assert!(
        !ok && answer.contains("No route to host"),
        "ip route get {addr}: {answer}"
    );
    // Of the routes that match, the longest prefix (the one in force) is ours.
    let (_, matching) = ip(&["-4", "route", "show", "match", &addr.to_string()]);
    let longest = matching
        .lines()
        .max_by_key(|line| {
            line.split_whitespace()
                .find_map(|word| word.split_once('/').and_then(|(_, b)| b.parse::<u8>().ok()))
                .unwrap_or(0)
        })
        .unwrap_or_default();
    assert_eq!(
        longest.trim(),
        format!("unreachable {net}/{bits}"),
        "routes matching {addr}:\n{matching}"
    );
}

#[tokio::test]
async fn cluster_addresses_that_nothing_holds_fail_on_this_machine() -> anyhow::Result<()> {
    with_namespace("hermetic", async |ns| {
        // A free pod-range address and the apiserver's own ClusterIP.
        assert_routed_to_nowhere(UNHELD_POD_ADDRESS.into(), POD_RANGE);
        assert_routed_to_nowhere("10.96.0.1".parse()?, SERVICE_RANGE);
        assert_unreachable_here(
            SocketAddr::new(UNHELD_POD_ADDRESS.into(), 8000),
            "a free pod address",
        )
        .await;

        // A Service's ClusterIP: nothing serves it here (kube-proxy runs in the node, for its
        // pods).
        let services: Api<Service> = ns.api();
        let service = services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "web"},
                    "spec": {"selector": {"app": "web"}, "ports": [{"port": 8000}]}
                }))?,
            )
            .await?;
        let cluster_ip: IpAddr = service
            .spec
            .and_then(|s| s.cluster_ip)
            .expect("a ClusterIP")
            .parse()?;
        assert_routed_to_nowhere(cluster_ip, SERVICE_RANGE);
        assert_unreachable_here(SocketAddr::new(cluster_ip, 8000), "a ClusterIP").await;

        // A live pod's address works (its /32 route wins over the unreachable route)...
        let pods: Api<Pod> = ns.api();
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web", "labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "main", "image": "poolpilot/modelsim:local",
                        "imagePullPolicy": "Never",
                        "args": ["--port=8000", "--model=web"],
                        "ports": [{"containerPort": 8000}],
                        "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}
                    }]
                }
            }))?,
        )
        .await?;
        let pod = wait_for(&pods, "web", "Ready with an IP", WAIT, |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .await?
        .expect("the pod exists");
        let pod_ip: IpAddr = pod
            .status
            .and_then(|s| s.pod_ip)
            .expect("a pod IP")
            .parse()?;
        let pod_addr = SocketAddr::new(pod_ip, 8000);
        let (live, _) = connect(pod_addr).await;
        live.map_err(|e| anyhow::anyhow!("the live pod {pod_addr}: {e}"))?;

        // ...and the moment the pod is gone from the API, its address fails here.
        pods.delete("web", &DeleteParams::default()).await?;
        eventually("the pod is gone", WAIT, || async {
            let left = pods.list(&ListParams::default()).await?.items.len();
            anyhow::ensure!(left == 0, "{left} pods left");
            Ok(())
        })
        .await?;
        assert_unreachable_here(pod_addr, "a deleted pod's address").await;
        Ok(())
    })
    .await
}
