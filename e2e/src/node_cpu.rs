//! The node's CPU, shared by tests that run at the same time: a test reserves what its pods
//! request before it creates them, so that tests queue here instead of leaving pods Pending.
//!
//! The scheduler places a pod only where the CPU its containers request is still free, and the
//! embedded cluster's node has the machine's CPUs (two on CI). The cluster tests run four at a
//! time, and a few of them deploy whole installs (an operator or two, gateways at 250m each,
//! backends): together they can ask for more than the node has. Without a queue, whichever test
//! comes last sees a pod Pending "Insufficient cpu" until its readiness wait runs out, and two
//! tests each holding half of what they need could wait on each other for good. So a test takes
//! its whole share in one step ([`TestNamespace::reserve_cpu`], once per namespace: no test
//! holds a part while it waits for the rest) and gives it back when its namespace's pods are
//! gone, which is when the scheduler gives it back too.
//!
//! [`TestNamespace::reserve_cpu`]: crate::TestNamespace::reserve_cpu

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, ListParams};
use serde_json::Value;
use tokio::sync::{OnceCell, Semaphore, SemaphorePermit};

/// Millicores left out of the reservable total for pods that no test reserves for: small
/// sidecars that an operator outside the tests adds (prometheus-operator's config reloader asks
/// 10m), and what the node's own pods come to request after the total was read.
const SLACK_MILLIS: u32 = 100;

/// The reservable CPU of the node, in millicores (one permit each), and its total.
static NODE_CPU: OnceCell<(Semaphore, u32)> = OnceCell::const_new();

/// CPU reserved for one test namespace; released on drop.
pub(crate) struct Reservation {
    pub(crate) millis: u32,
    _permit: SemaphorePermit<'static>,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation({}m)", self.millis)
    }
}

/// Waits until `millis` of the node's CPU are free of other tests' reservations and takes them.
/// Fails at once when the node could never hold that much. Test namespaces carry the label
/// `tests` (their pods are the reservations'; the others are the cluster's own).
pub(crate) async fn reserve(
    client: &kube::Client,
    millis: u32,
    tests: &str,
) -> anyhow::Result<Reservation> {
    let (node, total) = NODE_CPU
        .get_or_try_init(|| async {
            let total = reservable(client, tests).await?;
            anyhow::Ok((Semaphore::new(total as usize), total))
        })
        .await?;
    anyhow::ensure!(
        millis <= *total,
        "a test whose pods request {millis}m of CPU, more than the {total}m that tests may \
         reserve on the node"
    );
    let permit = node
        .acquire_many(millis)
        .await
        .context("the node's CPU semaphore is closed")?;
    Ok(Reservation {
        millis,
        _permit: permit,
    })
}

/// What the tests may reserve: the nodes' allocatable CPU less what pods outside test namespaces
/// (labelled `tests`) request, the cluster's own, and [`SLACK_MILLIS`].
async fn reservable(client: &kube::Client, tests: &str) -> anyhow::Result<u32> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut allocatable = 0;
    for node in nodes.list(&ListParams::default()).await? {
        let cpu = node
            .status
            .and_then(|s| s.allocatable)
            .and_then(|a| a.get("cpu").map(|q| q.0.clone()))
            .context("a node without allocatable CPU")?;
        allocatable += millicores(&cpu)?;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let test_namespaces: Vec<String> = namespaces
        .list(&ListParams::default().labels(tests))
        .await?
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    let pods: Api<Pod> = Api::all(client.clone());
    let mut others = 0;
    for pod in pods.list(&ListParams::default()).await? {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let done = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| matches!(p, "Succeeded" | "Failed"));
        if test_namespaces.contains(&namespace) || done {
            continue;
        }
        if let Some(spec) = pod.spec {
            others += pod_millicores(&serde_json::to_value(spec)?)?;
        }
    }
    let reservable = allocatable.saturating_sub(others + SLACK_MILLIS);
    anyhow::ensure!(
        reservable > 0,
        "the nodes' {allocatable}m of allocatable CPU are taken by the cluster's own pods \
         ({others}m) and the slack ({SLACK_MILLIS}m)"
    );
    Ok(reservable)
}

/// The CPU that the pods of `objects` request, in millicores: each workload's pod template
/// times its replicas (a Deployment, ReplicaSet or StatefulSet without `replicas` has one; a
/// Job runs `parallelism`; a DaemonSet one pod per node, of which the embedded cluster has
/// one), bare Pods once, `List`s item by item; other kinds request nothing.
pub fn requested_millicores(objects: &[Value]) -> anyhow::Result<u32> {
    let mut sum = 0;
    for object in objects {
        let count = |field: &str| object["spec"][field].as_u64().unwrap_or(1) as u32;
        sum += match object["kind"].as_str().unwrap_or_default() {
            "List" => requested_millicores(object["items"].as_array().map_or(&[], |v| v))?,
            "Pod" => pod_millicores(&object["spec"])?,
            "Deployment" | "ReplicaSet" | "StatefulSet" => {
                count("replicas") * pod_millicores(&object["spec"]["template"]["spec"])?
            }
            "Job" => count("parallelism") * pod_millicores(&object["spec"]["template"]["spec"])?,
            "DaemonSet" => pod_millicores(&object["spec"]["template"]["spec"])?,
            _ => 0,
        };
    }
    Ok(sum)
}

/// The CPU that the scheduler counts for one pod of `spec` (a PodSpec as JSON): its containers'
/// and sidecars' (init containers that restart: `restartPolicy: Always`) requests together, or
/// the largest one-shot init container's if that is more, plus the pod's overhead.
fn pod_millicores(spec: &Value) -> anyhow::Result<u32> {
    let request = |c: &Value| match c["resources"]["requests"]["cpu"].as_str() {
        Some(q) => millicores(q),
        None => Ok(c["resources"]["requests"]["cpu"]
            .as_u64()
            .map_or(0, |cores| cores as u32 * 1000)),
    };
    let mut running = 0;
    for container in spec["containers"].as_array().into_iter().flatten() {
        running += request(container)?;
    }
    let mut largest_init = 0;
    for init in spec["initContainers"].as_array().into_iter().flatten() {
        if init["restartPolicy"] == "Always" {
            running += request(init)?;
        } else {
            largest_init = largest_init.max(request(init)?);
        }
    }
    let overhead = match spec["overhead"]["cpu"].as_str() {
        Some(q) => millicores(q)?,
        None => 0,
    };
    Ok(running.max(largest_init) + overhead)
}

/// A CPU quantity in millicores, rounded up as the scheduler does: `250m`, `1`, `0.5`, `1500m`.
fn millicores(quantity: &str) -> anyhow::Result<u32> {
    let q = quantity.trim();
    let parsed = match q.strip_suffix('m') {
        Some(millis) => millis.parse::<u32>().ok(),
        None => q
            .parse::<f64>()
            .ok()
            .filter(|cores| cores.is_finite() && *cores >= 0.0)
            .map(|cores| (cores * 1000.0).ceil() as u32),
    };
    parsed.with_context(|| format!("a CPU quantity that is not one: {quantity:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quantities_read_as_the_scheduler_counts_them() {
        assert_eq!(millicores("250m").unwrap(), 250);
        assert_eq!(millicores("1").unwrap(), 1000);
        assert_eq!(millicores("0.5").unwrap(), 500);
        assert_eq!(millicores("0.0001").unwrap(), 1);
        assert_eq!(millicores("2").unwrap(), 2000);
        assert!(millicores("lots").is_err());
        assert!(millicores("-1").is_err());
    }

    #[test]
    fn a_workload_requests_its_template_times_its_replicas() {
        let deployment = |replicas: Option<u32>| {
            let mut d = json!({
                "kind": "Deployment",
                "spec": {"template": {"spec": {"containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "250m"}}},
                    {"name": "b", "resources": {"requests": {"memory": "1Gi"}}},
                ]}}},
            });
            if let Some(r) = replicas {
                d["spec"]["replicas"] = json!(r);
            }
            d
        };
        assert_eq!(requested_millicores(&[deployment(Some(3))]).unwrap(), 750);
        assert_eq!(requested_millicores(&[deployment(None)]).unwrap(), 250);
        assert_eq!(requested_millicores(&[deployment(Some(0))]).unwrap(), 0);
        let list = json!({"kind": "List", "items": [deployment(Some(2)), {"kind": "Service"}]});
        assert_eq!(
            requested_millicores(&[list, deployment(Some(1))]).unwrap(),
            750
        );
    }

    #[test]
    fn init_containers_count_as_the_scheduler_counts_them() {
        let pod = json!({
            "kind": "Pod",
            "spec": {
                "containers": [{"resources": {"requests": {"cpu": "100m"}}}],
                "initContainers": [
                    {"resources": {"requests": {"cpu": "300m"}}},
                    {"restartPolicy": "Always", "resources": {"requests": {"cpu": "50m"}}},
                ],
                "overhead": {"cpu": "10m"},
            },
        });
        // max(100 + 50 running, 300 one-shot) + 10 overhead.
        assert_eq!(requested_millicores(&[pod]).unwrap(), 310);
    }

    #[test]
    fn a_malformed_request_is_an_error_not_zero() {
        let pod = json!({"kind": "Pod", "spec": {"containers": [
            {"resources": {"requests": {"cpu": "a lot"}}},
        ]}});
        assert!(requested_millicores(&[pod]).is_err());
    }
}
