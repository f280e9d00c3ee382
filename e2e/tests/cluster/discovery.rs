//! Pods run by the node are what Prometheus sees: a Deployment of modelsim replicas
//! with the usual scrape annotations becomes one `up == 1` target per pod (found through
//! Kubernetes service discovery against our apiserver), follows a scale-up, and disappears with
//! the Deployment.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use poolpilot_e2e::{TestNamespace, eventually, with_namespace};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

fn modelsim_deployment(replicas: i32) -> anyhow::Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": "modelsim"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "modelsim"}},
            "template": {
                "metadata": {
                    "labels": {"app.kubernetes.io/name": "modelsim"},
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8001", "prometheus.io/path": "/metrics"}
                },
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "modelsim", "image": "poolpilot/modelsim:local",
                        "args": ["--admin-port=8001", "--max-concurrency=4"],
                        // Its instance name (what each pod answers as): the pod's.
                        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "ports": [{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": 8001}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 1},
                    }]
                }
            }
        }
    }))?)
}

async fn ready_pods(ns: &TestNamespace, n: usize) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = ns.api();
    eventually(&format!("{n} Ready modelsim pods"), WAIT, || async {
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/name=modelsim"))
            .await?;
        let ready: Vec<Pod> = list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .collect();
        anyhow::ensure!(ready.len() == n, "{} Ready", ready.len());
        Ok(ready)
    })
    .await
}

/// Waits until Prometheus reports exactly `pods` as up targets of this namespace.
async fn wait_for_targets(ns: &TestNamespace, pods: &BTreeSet<String>) -> anyhow::Result<()> {
    let promql = format!("up{{namespace=\"{}\"}} == 1", ns.name());
    eventually(&format!("Prometheus sees {pods:?} up"), WAIT, || async {
        let result = ns.cluster().prometheus_query(&promql).await?;
        let seen: BTreeSet<String> = result
            .iter()
            .filter_map(|s| s["metric"]["pod"].as_str().map(str::to_owned))
            .collect();
        anyhow::ensure!(&seen == pods, "Prometheus sees {seen:?}");
        Ok(())
    })
    .await
}

fn names(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().map(|p| p.name_any()).collect()
}

#[tokio::test]
async fn prometheus_discovers_modelsim_pods_through_the_apiserver() -> anyhow::Result<()> {
    with_namespace("disc", async |ns| {
        let deployments: Api<Deployment> = ns.api();
        deployments
            .create(&PostParams::default(), &modelsim_deployment(2)?)
            .await?;
        let pods = ready_pods(ns, 2).await?;

        // Two processes, two loopback addresses, each answering as itself.
        let ips: BTreeSet<String> = pods
            .iter()
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .collect();
        assert_eq!(ips.len(), 2, "distinct pod IPs: {ips:?}");
        for pod in &pods {
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .expect("pod IP");
            let response = reqwest::get(format!("http://{ip}:8000/v1/models")).await?;
            assert!(response.status().is_success());
            let instance = response
                .headers()
                .get("x-modelsim-instance")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            assert_eq!(
                instance.as_deref(),
                Some(pod.name_any().as_str()),
                "{ip} answers as its own pod"
            );
        }
        wait_for_targets(ns, &names(&pods)).await?;

        // Scale to three: a third process and a third target.
        deployments
            .patch(
                "modelsim",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 3}})),
            )
            .await?;
        let pods = ready_pods(ns, 3).await?;
        wait_for_targets(ns, &names(&pods)).await?;

        // Delete: processes gone, ReplicaSet garbage-collected, targets gone.
        let all_ips: Vec<String> = pods
            .iter()
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .collect();
        deployments
            .delete("modelsim", &DeleteParams::default())
            .await?;
        let replicasets: Api<ReplicaSet> = ns.api();
        eventually("pods and ReplicaSet gone", WAIT, || async {
            let pods = ns
                .api::<Pod>()
                .list(&ListParams::default())
                .await?
                .items
                .len();
            let rs = replicasets.list(&ListParams::default()).await?.items.len();
            anyhow::ensure!(pods == 0 && rs == 0, "{pods} pods, {rs} ReplicaSets left");
            Ok(())
        })
        .await?;
        // The pods' addresses are released with their sandboxes: no route leads to them any
        // more (a connect fails with "No route to host", as e2e/tests/cluster/hermetic.rs shows).
        for ip in &all_ips {
            let route = std::process::Command::new("ip")
                .args(["-4", "route", "get", ip])
                .output()?;
            assert!(
                !route.status.success()
                    && String::from_utf8_lossy(&route.stderr).contains("No route to host"),
                "modelsim on {ip} must have stopped and its address been unrouted: {}",
                String::from_utf8_lossy(&route.stdout)
            );
        }
        wait_for_targets(ns, &BTreeSet::new()).await?;
        Ok(())
    })
    .await
}
