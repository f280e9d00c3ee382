//! The Node object of the local kubelet: registration with this machine's capacity and where
//! its kubelet API listens, and a heartbeat that keeps its Ready condition fresh.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const FIELD_MANAGER: &str = "poolpilot-local-kubelet";

/// The labels of the local Node; pods whose `nodeSelector` asks for anything else stay Pending,
/// as the scheduler would leave them.
pub fn labels(name: &str) -> std::collections::BTreeMap<String, String> {
    [
        ("kubernetes.io/hostname", name),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", std::env::consts::ARCH),
        ("node.kubernetes.io/instance-type", "poolpilot-local"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Creates or updates the Node `name` and marks it Ready; `api` is where its kubelet API
/// listens (the InternalIP and kubelet port the apiserver calls for `kubectl logs`).
pub async fn register(
    client: &kube::Client,
    name: &str,
    api: Option<SocketAddr>,
) -> kube::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {}
    });
    nodes
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&node),
        )
        .await?;
    patch_status(&nodes, name, cpus, api).await
}

async fn patch_status(
    nodes: &Api<Node>,
    name: &str,
    cpus: usize,
    api: Option<SocketAddr>,
) -> kube::Result<()> {
    let now = Timestamp::now().to_string();
    let ip = api.map_or_else(|| "127.0.0.1".to_owned(), |a| a.ip().to_string());
    let port = api.map_or(0, |a| a.port());
    let status = json!({
        "status": {
            "capacity": {"cpu": cpus.to_string(), "memory": "24Gi", "pods": "500"},
            "allocatable": {"cpu": cpus.to_string(), "memory": "24Gi", "pods": "500"},
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "poolpilot local kubelet is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
            "nodeInfo": {
                "kubeletVersion": "v1.37.2-poolpilot-local", "kubeProxyVersion": "", "containerRuntimeVersion": "local-process://1",
                "operatingSystem": "linux", "architecture": std::env::consts::ARCH, "osImage": "local", "kernelVersion": "",
                "machineID": "", "systemUUID": "", "bootID": "",
            },
        }
    });
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// Refreshes the Ready condition every 20 seconds, forever.
pub async fn heartbeat(client: kube::Client, name: String, api: Option<SocketAddr>) {
    let nodes: Api<Node> = Api::all(client);
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    loop {
        tokio::time::sleep(Duration::from_secs(20)).await;
        if let Err(e) = patch_status(&nodes, &name, cpus, api).await {
            tracing::warn!(error = %e, "node heartbeat failed");
        }
    }
}
