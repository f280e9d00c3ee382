//! The cluster's node (`make cluster-up`: the kubelet, containerd with runc, the CNI bridge
//! and kube-proxy in a network namespace of their own): the images of `make images` run as pods
//! as a user deploys them (non-root, read-only root file system), on addresses of the CNI
//! bridge that this machine reaches through the node's link; a Service routes through
//! kube-proxy from a pod; `kubectl logs`, `exec` and `port-forward` work through the kubelet;
//! a ConfigMap volume update reaches the gateway by the kubelet's swap; the fd limit is the one
//! containerd's runtime spec gives (a RuntimeClass picks another); a gateway over its memory
//! limit is OOMKilled and its restart resumes the tuned limits of its file; a deleted gateway pod
//! finishes its calls in flight and exits on SIGTERM long before the grace period ends.

use std::time::Duration;

use anyhow::Context as _;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use poolpilot_e2e::cluster::{output, run};
use poolpilot_e2e::hermetic::UNHELD_POD_ADDRESS;
use poolpilot_e2e::{Cluster, TestNamespace, eventually, with_namespace};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const WAIT: Duration = Duration::from_secs(90);
const TOKEN: &str = "node-test-admin-token-at-least-32-bytes";

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The Ready pods labelled `app=<app>`, once there are `n`.
async fn ready_pods(ns: &TestNamespace, app: &str, n: usize) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = ns.api();
    eventually(&format!("{n} Ready {app} pods"), WAIT, || async {
        let list = pods
            .list(&ListParams::default().labels(&format!("app={app}")))
            .await?;
        let ready: Vec<Pod> = list.items.into_iter().filter(is_ready).collect();
        anyhow::ensure!(ready.len() == n, "{} ready", ready.len());
        Ok(ready)
    })
    .await
}

fn pod_ip(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

/// One HTTP/1.0 exchange: the status code and the body.
async fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await??;
    stream
        .write_all(
            format!(
                "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.read_to_string(&mut response),
    )
    .await??;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `process_max_fds` of a `/metrics` text.
fn max_fds(metrics: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("process_max_fds "))
        .and_then(|v| v.trim().parse().ok())
}

/// The security context every poolpilot pod runs with (the manifests' and the chart's).
fn hardened() -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "runAsNonRoot": true,
        "runAsUser": 65532,
        "capabilities": {"drop": ["ALL"]},
    })
}

fn modelsim_spec(runtime_class: Option<&str>) -> Value {
    let mut spec = json!({
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": "modelsim",
            "image": "poolpilot/modelsim:local",
            "imagePullPolicy": "Never",
            "args": ["--port=8000", "--admin-port=8001", "--model=model-a"],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": 8001}, "periodSeconds": 1},
            "securityContext": hardened(),
        }]
    });
    if let Some(class) = runtime_class {
        spec["runtimeClassName"] = json!(class);
    }
    spec
}

/// The limits document of the gateway: one backend, model-a, at `address` (the Service's
/// ClusterIP), `max` connections.
fn limits(generation: u64, address: &str, max: u32) -> String {
    json!({
        "generation": generation,
        "backends": [{
            "name": "model-a",
            "match": {"model": "model-a"},
            "endpoints": [{"name": "model-a-service", "address": address}],
            "pool": {
                "maxConnectionsPerEndpoint": max, "maxPending": 16, "leaseTimeout": "2s",
                "idleTimeout": "30s", "maxLifetime": "5m", "connectTimeout": "2s", "validateAfterIdle": "10s",
            },
        }],
    })
    .to_string()
}

#[tokio::test]
async fn the_images_run_as_pods_on_the_node() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    // The Node is the real kubelet's, on containerd.
    let wide = run(cluster
        .kubectl()
        .args(["get", "nodes", "-o", "wide", "--no-headers"]))
    .await?;
    assert!(
        wide.contains(cluster.version()),
        "kubectl get nodes -o wide: {wide}"
    );
    assert!(
        wide.contains("containerd://"),
        "kubectl get nodes -o wide: {wide}"
    );

    with_namespace("node", async |ns| {
        // modelsim: two pods of its image, on the bridge's addresses, reached from here.
        ns.create_deployment("backend", 2, modelsim_spec(None)).await?;
        let backends = ready_pods(ns, "backend", 2).await?;
        for pod in &backends {
            let ip = pod_ip(pod);
            assert!(ip.starts_with("10.244.0."), "a pod address of the node's bridge: {ip}");
            let (status, metrics) = http(&format!("{ip}:8001"), "GET", "/metrics", "", "").await?;
            assert_eq!(status, 200, "{ip}:8001/metrics");
            // containerd's runtime spec for every container: `cluster up --node-nofile`, 4096.
            assert_eq!(max_fds(&metrics), Some(4096.0), "the default fd limit of the node's containers");
        }

        // A Service over them, and the gateway (its image, config and limits from a ConfigMap
        // volume) proxying to the Service's ClusterIP: a pod's call routed by kube-proxy.
        let services: Api<Service> = ns.api();
        let svc = services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "backend"},
                    "spec": {"selector": {"app": "backend"}, "ports": [{"port": 8000, "targetPort": 8000}]}
                }))?,
            )
            .await?;
        let cluster_ip = svc.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
        assert!(cluster_ip.starts_with("10.96."), "ClusterIP {cluster_ip}");
        let config = "listeners: {proxy: '0.0.0.0:8080', admin: '0.0.0.0:9901'}\n\
                      adminTokenFile: /etc/poolpilot/config/token\n\
                      limitsFile: /etc/poolpilot/config/limits.json\n\
                      limitsPollInterval: 1s\nshutdownDelay: 1s\ndrainGrace: 3s\n";
        let configmaps: Api<ConfigMap> = ns.api();
        configmaps
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "gateway"},
                    "data": {
                        "gateway.yaml": config,
                        "token": TOKEN,
                        "limits.json": limits(1, &format!("{cluster_ip}:8000"), 4),
                    }
                }))?,
            )
            .await?;
        ns.create_deployment(
            "gateway",
            1,
            json!({
                "terminationGracePeriodSeconds": 10,
                "containers": [{
                    "name": "gateway",
                    "image": "poolpilot/gateway:local",
                    "imagePullPolicy": "Never",
                    "args": ["--config=/etc/poolpilot/config/gateway.yaml"],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9901}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/poolpilot/config", "readOnly": true}],
                    "securityContext": hardened(),
                }],
                "volumes": [{"name": "config", "configMap": {"name": "gateway"}}],
            }),
        )
        .await?;
        let gateway = ready_pods(ns, "gateway", 1).await?.remove(0);
        let gw_name = gateway.name_any();
        let gw = format!("{}:8080", pod_ip(&gateway));
        let call = r#"{"model":"model-a","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
        eventually("a call through the gateway to the Service's ClusterIP answers 200", WAIT, || async {
            let (status, body) = http(&gw, "POST", "/v1/chat/completions", "Content-Type: application/json\r\n", call).await?;
            anyhow::ensure!(status == 200, "{status}: {body}");
            Ok(())
        })
        .await?;

        // `kubectl logs` through the kubelet's API: the gateway said it loaded its limits.
        let logs = run(ns.cluster().kubectl().args(["logs", "-n", ns.name(), &gw_name])).await?;
        assert!(!logs.trim().is_empty(), "kubectl logs of the gateway printed nothing");

        // `kubectl exec` into the scratch image: the binary under its own name.
        let validate = output(ns.cluster().kubectl().args([
            "exec", "-n", ns.name(), &gw_name, "--", "poolpilot-gateway", "validate",
            "--config=/etc/poolpilot/config/gateway.yaml",
        ]))
        .await?;
        assert!(
            validate.status.success(),
            "kubectl exec ... poolpilot-gateway validate: {}{}",
            String::from_utf8_lossy(&validate.stdout),
            String::from_utf8_lossy(&validate.stderr)
        );

        // A ConfigMap update reaches the mounted file by the kubelet's atomic swap, and the
        // gateway loads it (generation 2, 7 connections).
        configmaps
            .patch(
                "gateway",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"limits.json": limits(2, &format!("{cluster_ip}:8000"), 7)}})),
            )
            .await?;
        let admin = format!("{}:9901", pod_ip(&gateway));
        let auth = format!("Authorization: Bearer {TOKEN}\r\n");
        let started = tokio::time::Instant::now();
        eventually("the gateway runs generation 2 of the ConfigMap", WAIT, || async {
            let (status, body) = http(&admin, "GET", "/v1/limits", &auth, "").await?;
            anyhow::ensure!(status == 200, "{status}: {body}");
            let doc: Value = serde_json::from_str(&body)?;
            anyhow::ensure!(doc["generation"] == json!(2), "generation {}", doc["generation"]);
            Ok(())
        })
        .await?;
        println!("figure: ConfigMap update → gateway on generation 2 in {:.1} s", started.elapsed().as_secs_f64());

        // `kubectl port-forward` to the gateway's admin port, through the kubelet and containerd.
        let (mut forward, local) = ns
            .cluster()
            .port_forward(ns.name(), &format!("pod/{gw_name}"), 9901)
            .await?;
        let (status, body) = http(&local, "GET", "/healthz", "", "").await?;
        assert_eq!((status, body.trim()), (200, "ok"), "/healthz through kubectl port-forward");
        forward.start_kill()?;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_runtime_class_gives_containers_another_fd_limit() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    // The RuntimeClass naming containerd's handler nofile-512 (`cluster up --node-nofile-class
    // 512`): cluster-scoped, shared by every test that wants it, so applied, never deleted.
    let class = std::env::temp_dir().join(format!(
        "poolpilot-runtimeclass-{}.json",
        std::process::id()
    ));
    std::fs::write(
        &class,
        json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nofile-512"}, "handler": "nofile-512"})
            .to_string(),
    )?;
    cluster.apply(&class).await?;
    let _ = std::fs::remove_file(&class);
    with_namespace("node-fds", async |ns| {
        ns.create_deployment("small", 1, modelsim_spec(Some("nofile-512")))
            .await?;
        let pod = ready_pods(ns, "small", 1).await?.remove(0);
        let (status, metrics) =
            http(&format!("{}:8001", pod_ip(&pod)), "GET", "/metrics", "", "").await?;
        assert_eq!(status, 200);
        assert_eq!(
            max_fds(&metrics),
            Some(512.0),
            "the fd limit of runtime handler nofile-512"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_deleted_gateway_pod_drains_its_calls_and_exits_on_sigterm_within_the_grace()
-> anyhow::Result<()> {
    let _cluster = Cluster::shared().await?;
    with_namespace("node-drain", async |ns| {
        // One slow backend: a call of 40 tokens at 50 ms each takes about 2 s.
        let mut backend = modelsim_spec(None);
        backend["containers"][0]["args"]
            .as_array_mut()
            .expect("modelsim args")
            .push(json!("--per-token-ms=50"));
        ns.create_deployment("slow", 1, backend).await?;
        let backend = ready_pods(ns, "slow", 1).await?.remove(0);
        let config = "listeners: {proxy: '0.0.0.0:8080', admin: '0.0.0.0:9901'}\n\
                      adminTokenFile: /etc/poolpilot/config/token\n\
                      limitsFile: /etc/poolpilot/config/limits.json\n\
                      shutdownDelay: 1s\ndrainGrace: 10s\n";
        let configmaps: Api<ConfigMap> = ns.api();
        configmaps
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "gateway"},
                    "data": {
                        "gateway.yaml": config,
                        "token": TOKEN,
                        "limits.json": limits(1, &format!("{}:8000", pod_ip(&backend)), 4),
                    }
                }))?,
            )
            .await?;
        // The grace the kubelet gives before SIGKILL: well above what the drain needs.
        const GRACE: Duration = Duration::from_secs(30);
        ns.create_deployment(
            "gateway",
            1,
            json!({
                "terminationGracePeriodSeconds": GRACE.as_secs(),
                "containers": [{
                    "name": "gateway",
                    "image": "poolpilot/gateway:local",
                    "imagePullPolicy": "Never",
                    "args": ["--config=/etc/poolpilot/config/gateway.yaml"],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9901}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/poolpilot/config", "readOnly": true}],
                    "securityContext": hardened(),
                }],
                "volumes": [{"name": "config", "configMap": {"name": "gateway"}}],
            }),
        )
        .await?;
        let gateway = ready_pods(ns, "gateway", 1).await?.remove(0);
        let name = gateway.name_any();
        let gw = format!("{}:8080", pod_ip(&gateway));
        let call = r#"{"model":"model-a","messages":[{"role":"user","content":"hi"}],"max_tokens":40}"#;
        // The backend answers through the gateway before the drain starts.
        let (status, body) = http(&gw, "POST", "/v1/chat/completions", "Content-Type: application/json\r\n", call).await?;
        anyhow::ensure!(status == 200, "a call before the delete: {status}: {body}");

        // A call in flight, then the pod deleted: the kubelet sends SIGTERM to PID 1.
        let in_flight = {
            let gw = gw.clone();
            tokio::spawn(async move {
                http(&gw, "POST", "/v1/chat/completions", "Content-Type: application/json\r\n", call).await
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let pods: Api<Pod> = ns.api();
        let deleted = tokio::time::Instant::now();
        pods.delete(&name, &Default::default()).await?;

        // The call in flight is answered in full.
        let (status, body) = in_flight.await??;
        assert_eq!(status, 200, "the call in flight during the drain: {body}");
        let answer: Value = serde_json::from_str(&body)?;
        assert_eq!(
            answer["usage"]["completion_tokens"],
            json!(40),
            "the call in flight was answered in full: {body}"
        );

        // The container exits by itself (code 0) once drained, long before the kubelet would
        // kill it at the grace's end; the pod is then gone.
        let exit_code = std::cell::Cell::new(None);
        eventually("the drained pod is gone", GRACE, || async {
            match pods.get_opt(&name).await? {
                Some(pod) => {
                    if let Some(code) = pod
                        .status
                        .as_ref()
                        .and_then(|s| s.container_statuses.as_ref())
                        .and_then(|cs| cs.first()?.state.as_ref()?.terminated.as_ref())
                        .map(|t| t.exit_code)
                    {
                        exit_code.set(Some(code));
                    }
                    anyhow::bail!("still there")
                }
                None => Ok(()),
            }
        })
        .await?;
        let took = deleted.elapsed();
        let exit_code = exit_code.get();
        println!(
            "figure: a gateway pod deleted with a call in flight: gone {:.1} s later (grace {} s), exit code {exit_code:?}",
            took.as_secs_f64(),
            GRACE.as_secs()
        );
        assert!(
            took < GRACE - Duration::from_secs(10),
            "the pod took {took:?} to go: it was killed at the grace's end, not drained on SIGTERM"
        );
        if let Some(code) = exit_code {
            assert_eq!(code, 0, "the gateway's exit code after SIGTERM");
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_gateway_over_its_memory_limit_is_oom_killed_and_resumes_its_tuned_limits()
-> anyhow::Result<()> {
    let _cluster = Cluster::shared().await?;
    with_namespace("node-oom", async |ns| {
        // Tuned limits (generation 7) with room for large request heads: each connection may
        // make the gateway buffer up to 256 KiB of an unfinished head for 60 s.
        let mut doc: Value = serde_json::from_str(&limits(7, &format!("{UNHELD_POD_ADDRESS}:8000"), 5))?;
        doc["listener"] = json!({"maxHeaderBytes": 262_144, "headerReadTimeout": "60s"});
        let config = "listeners: {proxy: '0.0.0.0:8080', admin: '0.0.0.0:9901'}\n\
                      adminTokenFile: /etc/poolpilot/config/token\n\
                      limitsFile: /etc/poolpilot/config/limits.json\n";
        let configmaps: Api<ConfigMap> = ns.api();
        configmaps
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "gateway"},
                    "data": {"gateway.yaml": config, "token": TOKEN, "limits.json": doc.to_string()}
                }))?,
            )
            .await?;
        const MEMORY_LIMIT: &str = "64Mi";
        ns.create_deployment(
            "gateway",
            1,
            json!({
                "terminationGracePeriodSeconds": 2,
                "containers": [{
                    "name": "gateway",
                    "image": "poolpilot/gateway:local",
                    "imagePullPolicy": "Never",
                    "args": ["--config=/etc/poolpilot/config/gateway.yaml"],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9901}, "periodSeconds": 1},
                    "resources": {"requests": {"memory": MEMORY_LIMIT}, "limits": {"memory": MEMORY_LIMIT}},
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/poolpilot/config", "readOnly": true}],
                    "securityContext": hardened(),
                }],
                "volumes": [{"name": "config", "configMap": {"name": "gateway"}}],
            }),
        )
        .await?;
        let gateway = ready_pods(ns, "gateway", 1).await?.remove(0);
        let name = gateway.name_any();
        let ip = pod_ip(&gateway);
        let auth = format!("Authorization: Bearer {TOKEN}\r\n");
        let (status, body) = http(&format!("{ip}:9901"), "GET", "/v1/limits", &auth, "").await?;
        anyhow::ensure!(status == 200, "{status}: {body}");

        // Unfinished request heads of 200 KiB each, on connection after connection, until the
        // kernel kills the process for going over the container's memory limit.
        let proxy = format!("{ip}:8080");
        let flood = tokio::spawn(async move {
            let pad = vec![b'a'; 200 * 1024];
            let mut open = Vec::new();
            for _ in 0..2_000 {
                let Ok(Ok(mut s)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio::net::TcpStream::connect(proxy.as_str()),
                )
                .await
                else {
                    break;
                };
                let head = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Pad: ";
                let sent = tokio::time::timeout(Duration::from_secs(2), async {
                    s.write_all(head).await?;
                    s.write_all(&pad).await
                })
                .await;
                if !matches!(sent, Ok(Ok(()))) {
                    break;
                }
                open.push(s);
            }
            open.len()
        });
        let pods: Api<Pod> = ns.api();
        let started = tokio::time::Instant::now();
        let terminated = eventually("the gateway is OOMKilled and restarted", WAIT, || async {
            let pod = pods.get(&name).await?;
            let status = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|cs| cs.first().cloned())
                .context("no container status")?;
            let last = status
                .last_state
                .and_then(|s| s.terminated)
                .context("no earlier instance yet")?;
            anyhow::ensure!(status.restart_count >= 1, "restarts {}", status.restart_count);
            Ok(last)
        })
        .await?;
        let opened = flood.await?;
        println!(
            "figure: a gateway with a {MEMORY_LIMIT} memory limit: {} (exit {}) {:.1} s into a flood of unfinished 200 KiB heads, {opened} connections open",
            terminated.reason.clone().unwrap_or_default(),
            terminated.exit_code,
            started.elapsed().as_secs_f64()
        );
        assert_eq!(terminated.reason.as_deref(), Some("OOMKilled"), "{terminated:?}");
        assert_eq!(terminated.exit_code, 137, "SIGKILL by the kernel's OOM killer");

        // The restarted gateway serves the tuned limits again, from its limits file.
        eventually("the restarted gateway runs generation 7", WAIT, || async {
            let (status, body) = http(&format!("{ip}:9901"), "GET", "/v1/limits", &auth, "").await?;
            anyhow::ensure!(status == 200, "{status}: {body}");
            let doc: Value = serde_json::from_str(&body)?;
            anyhow::ensure!(doc["generation"] == json!(7), "generation {}", doc["generation"]);
            anyhow::ensure!(
                doc["listener"]["maxHeaderBytes"] == json!(262_144),
                "listener {}",
                doc["listener"]
            );
            Ok(())
        })
        .await?;
        // The killed instance's log, through the API: `kubectl logs --previous`.
        let previous = run(ns.cluster().kubectl().args(["logs", "--previous", "-n", ns.name(), &name])).await?;
        assert!(!previous.trim().is_empty(), "kubectl logs --previous printed nothing");
        Ok(())
    })
    .await
}
