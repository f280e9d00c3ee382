//! The local kubelet runs pods as real processes: each on its own pod IP (10.244.x.y on the loopback interface), restarted with
//! back-off when they crash, Ready only when their readiness probe passes, with ConfigMap
//! volumes that follow the ConfigMap, the open-files limit from the pod annotation, and
//! processes that stop when their pods are deleted.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::{TestNamespace, eventually, wait_for, with_namespace};
use poolpilot_local_kubelet::logs::Query;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// Whether the cluster runs the real node, where these tests of the local kubelet's own
/// behaviour (host binaries as images, its log files, its annotation) do not apply: the real
/// node's are in `node.rs`.
async fn on_the_real_node() -> anyhow::Result<bool> {
    let real = poolpilot_e2e::Cluster::shared()
        .await?
        .real_node()
        .is_some();
    if real {
        eprintln!("the cluster runs the real node: this test is the local kubelet's");
    }
    Ok(real)
}

/// What the container's running instance wrote (its log file, CRI lines, as plain text).
fn pod_log(ns: &TestNamespace, pod: &str, container: &str) -> String {
    let path = ns
        .cluster()
        .kubelet_dir()
        .join("pods")
        .join(ns.name())
        .join(pod)
        .join(format!("{container}.log"));
    let raw = std::fs::read_to_string(path).unwrap_or_default();
    Query::default().render_all(&raw)
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body)
}

#[tokio::test]
async fn deployment_pods_run_on_their_own_ips_behind_a_service_and_stop_when_deleted()
-> anyhow::Result<()> {
    if on_the_real_node().await? {
        return Ok(());
    }
    with_namespace("kl-deploy", async |ns| {
        let deployments: Api<Deployment> = ns.api();
        let pods: Api<Pod> = ns.api();
        // Each replica serves its own pod name on port 8000 of its pod IP.
        let pod_spec = json!({
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "web", "image": "python",
                "command": ["python3", "-c",
                    "import http.server, os\nclass H(http.server.BaseHTTPRequestHandler):\n def do_GET(self):\n  self.send_response(200); self.end_headers(); self.wfile.write(os.environ['POD_NAME'].encode())\nhttp.server.HTTPServer((os.environ['POD_IP'], 8000), H).serve_forever()"],
                "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
            }]
        });
        ns.create_deployment("web", 2, pod_spec).await?;
        let ready = eventually("two Ready pods", WAIT, || async {
            let list = pods.list(&ListParams::default().labels("app=web")).await?;
            let ready: Vec<Pod> = list.items.into_iter().filter(is_ready).collect();
            anyhow::ensure!(ready.len() == 2, "{} ready", ready.len());
            Ok(ready)
        })
        .await?;
        let ips: Vec<String> = ready.iter().map(|p| p.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default()).collect();
        assert_ne!(ips[0], ips[1], "each pod has its own address");
        for (pod, ip) in ready.iter().zip(&ips) {
            assert!(ip.starts_with("10.244."), "pod IPs come from the pod range: {ip}");
            let body = http_get(&format!("{ip}:8000"), "/").await?;
            assert!(body.ends_with(&pod.name_any()), "{ip} answered {body:?}, expected {}", pod.name_any());
        }

        // A Service selecting them gets both addresses as ready endpoints (the apiserver refuses
        // loopback addresses there, which is why pods are not on 127.0.0.0/8).
        let services: Api<Service> = ns.api();
        services.create(&PostParams::default(), &serde_json::from_value(json!({
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 8000}]}
        }))?).await?;
        let slices: Api<EndpointSlice> = ns.api();
        eventually("the Service's EndpointSlice lists both pods", WAIT, || async {
            let mut addresses: Vec<String> = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                .await?
                .items
                .iter()
                .flat_map(|s| s.endpoints.iter().flatten())
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                .flat_map(|e| e.addresses.clone())
                .collect();
            addresses.sort();
            let mut want = ips.clone();
            want.sort();
            anyhow::ensure!(addresses == want, "endpoints {addresses:?}, pods {want:?}");
            Ok(())
        })
        .await?;

        // Scale to 3: a third process answers.
        deployments.patch("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 3}}))).await?;
        eventually("three Ready pods", WAIT, || async {
            let n = pods.list(&ListParams::default().labels("app=web")).await?.items.iter().filter(|p| is_ready(p)).count();
            anyhow::ensure!(n == 3, "{n} ready");
            Ok(())
        })
        .await?;

        // Deleting the Deployment stops the processes and removes the pods.
        deployments.delete("web", &DeleteParams::default()).await?;
        eventually("all pods gone", WAIT, || async {
            let n = pods.list(&ListParams::default().labels("app=web")).await?.items.len();
            anyhow::ensure!(n == 0, "{n} pods left");
            Ok(())
        })
        .await?;
        // The processes are gone with their addresses (a connect now fails with "No route to
        // host", as e2e/tests/cluster/hermetic.rs shows; the interface tells which).
        for ip in &ips {
            let addr: std::net::IpAddr = ip.parse()?;
            assert!(!poolpilot_local_kubelet::host_has_address(addr), "{ip} must be released from lo");
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_crashing_container_is_restarted_with_back_off() -> anyhow::Result<()> {
    if on_the_real_node().await? {
        return Ok(());
    }
    with_namespace("kl-crash", async |ns| {
        let pods: Api<Pod> = ns.api();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "crasher"},
            "spec": {"containers": [{"name": "main", "image": "sh", "command": ["sh", "-c", "echo started; sleep 0.3; exit 3"]}]}
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let seen = wait_for(&pods, "crasher", "restarted at least twice", WAIT, |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().map(|c| c.restart_count >= 2)).unwrap_or(false)
        })
        .await?
        .expect("pod exists");
        let status = seen.status.expect("status").container_statuses.expect("statuses").remove(0);
        let last = status.last_state.and_then(|s| s.terminated).expect("lastState.terminated after a crash");
        assert_eq!(last.exit_code, 3);
        assert_eq!(last.reason.as_deref(), Some("Error"));
        assert!(!status.ready, "a crashing container is not ready");
        // Back-off: the runs are spaced out (1 s, then 2 s), not restarted in a tight loop.
        let starts = pod_log(ns, "crasher", "main").matches("started").count();
        assert!(starts <= 4, "{starts} starts within the back-off window");
        // `kubectl logs --previous` shows the instance before the running one (or the last
        // one, when it is waiting to restart), each its own run.
        let previous = run(ns
            .cluster()
            .kubectl()
            .args(["logs", "-n", ns.name(), "crasher", "--previous"]))
        .await?;
        assert_eq!(previous, "started\n", "one run's output");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_pod_whose_readiness_probe_fails_is_not_ready() -> anyhow::Result<()> {
    if on_the_real_node().await? {
        return Ok(());
    }
    with_namespace("kl-ready", async |ns| {
        let pods: Api<Pod> = ns.api();
        // Serves 404 on /health: running, but never Ready.
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "unready"},
            "spec": {"containers": [{
                "name": "main", "image": "python",
                "command": ["sh", "-c", "exec python3 -m http.server --bind $POD_IP 8000"],
                "ports": [{"name": "http", "containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1},
            }]}
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let running = wait_for(&pods, "unready", "Running", WAIT, |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref()?.phase.clone()).as_deref() == Some("Running")
        })
        .await?
        .expect("pod");
        // Give the probe several periods to have run, then check it kept the pod unready.
        let ip = running.status.as_ref().and_then(|s| s.pod_ip.clone()).expect("pod IP");
        eventually("the server answers", WAIT, || async { http_get(&format!("{ip}:8000"), "/").await }).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pod = pods.get("unready").await?;
        assert!(!is_ready(&pod), "a pod whose probe gets 404 must not be Ready");
        let log = pod_log(ns, "unready", "main");
        assert!(log.contains("GET /health") && log.contains("404"), "the probe reached the process: {log}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn configmap_changes_reach_the_running_process_and_nofile_is_honoured() -> anyhow::Result<()>
{
    if on_the_real_node().await? {
        return Ok(());
    }
    with_namespace("kl-volume", async |ns| {
        let configmaps: Api<ConfigMap> = ns.api();
        let pods: Api<Pod> = ns.api();
        configmaps.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "settings"}, "data": {"value": "first"}}))?).await?;
        // The process prints the file at its mount path, and its open-files limit, every 200 ms.
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "reader", "annotations": {"poolpilot.io/nofile-limit": "321"}},
            "spec": {
                "volumes": [{"name": "settings", "configMap": {"name": "settings"}}],
                "containers": [{
                    "name": "main", "image": "sh",
                    "command": ["sh", "-c", "ulimit -n; while true; do echo \"value=$(cat /etc/poolpilot-e2e/value)\"; sleep 0.2; done"],
                    "volumeMounts": [{"name": "settings", "mountPath": "/etc/poolpilot-e2e", "readOnly": true}],
                }]
            }
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        eventually("the process reads the first value", WAIT, || async {
            anyhow::ensure!(pod_log(ns, "reader", "main").contains("value=first"), "not yet");
            Ok(())
        })
        .await?;
        assert!(pod_log(ns, "reader", "main").starts_with("321\n"), "RLIMIT_NOFILE from the annotation");
        // The mount is private to the pod: the host path stays empty.
        assert!(!std::path::Path::new("/etc/poolpilot-e2e/value").exists(), "the volume must not leak onto the host");

        configmaps.patch("settings", &PatchParams::default(), &Patch::Merge(json!({"data": {"value": "second"}}))).await?;
        eventually("the running process sees the new value", WAIT, || async {
            anyhow::ensure!(pod_log(ns, "reader", "main").contains("value=second"), "not yet");
            Ok(())
        })
        .await?;
        let pod = pods.get("reader").await?;
        let restarts = pod.status.and_then(|s| s.container_statuses).map(|c| c[0].restart_count);
        assert_eq!(restarts, Some(0), "the change arrived without a restart");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn in_cluster_credentials_work_from_inside_a_pod() -> anyhow::Result<()> {
    if on_the_real_node().await? {
        return Ok(());
    }
    with_namespace("kl-token", async |ns| {
        let pods: Api<Pod> = ns.api();
        // The ServiceAccount admission plugin adds the projected token volume; the process uses
        // it exactly as an in-cluster client does.
        let script = "curl -sS --cacert /var/run/secrets/kubernetes.io/serviceaccount/ca.crt \
            -H \"Authorization: Bearer $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)\" \
            https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/$(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)/pods; sleep 3600";
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "incluster"},
            "spec": {"containers": [{"name": "main", "image": "sh", "command": ["sh", "-c", script]}]}
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let log = eventually("the in-cluster request answered", WAIT, || async {
            let log = pod_log(ns, "incluster", "main");
            anyhow::ensure!(log.contains("\"kind\""), "no answer yet: {log}");
            Ok(log)
        })
        .await?;
        // The default ServiceAccount may not list pods: the apiserver authenticated the token and
        // RBAC refused it by name.
        assert!(log.contains("Forbidden") && log.contains(&format!("system:serviceaccount:{}:default", ns.name())), "{log}");
        Ok(())
    })
    .await
}
