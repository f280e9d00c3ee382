//! Temporary namespaces for tests: created per test, dumped (pods, events, pod logs, extra files)
//! when the test fails, deleted afterwards unless `POOLPILOT_E2E_KEEP` is set.

use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;

use futures::FutureExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::Resource;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use parking_lot::Mutex;
use rand::Rng as _;
use serde_json::Value;

use crate::Cluster;
use crate::node_cpu::{self, Reservation, requested_millicores};

/// How long a test that reserved the node's CPU waits for its pods to be gone before it gives
/// the reservation back regardless.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(90);

/// Label put on every test namespace, so leftovers are easy to find and delete.
pub const TEST_NAMESPACE_LABEL: &str = "poolpilot.io/e2e";

/// A namespace that lives for one test.
pub struct TestNamespace {
    name: String,
    client: kube::Client,
    cluster: &'static Cluster,
    extra_dumps: Mutex<Vec<(String, PathBuf)>>,
    cpu: Mutex<Option<Reservation>>,
}

impl std::fmt::Debug for TestNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNamespace")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TestNamespace {
    /// The namespace name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An admin client.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The cluster the namespace lives in.
    pub fn cluster(&self) -> &'static Cluster {
        self.cluster
    }

    /// An API handle for namespaced kind `K` in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Creates the Deployment `name` of `replicas` pods labelled `app: <name>` and running
    /// `pod_spec` (a PodSpec as JSON) in this namespace; returns it as the API server stored it.
    pub async fn create_deployment(
        &self,
        name: &str,
        replicas: u32,
        pod_spec: serde_json::Value,
    ) -> anyhow::Result<Deployment> {
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": pod_spec,
                }
            }
        }))?;
        let created = self
            .api::<Deployment>()
            .create(&PostParams::default(), &deployment)
            .await?;
        Ok(created)
    }

    /// Waits until the node's CPU has room for what the pods of `objects` request
    /// ([`requested_millicores`]) beside the other tests' reservations, and takes it until this
    /// namespace's pods are gone: call it once, before creating any of the test's pods, with
    /// everything the test will run at its largest (see [`crate::node_cpu`]). Returns the
    /// millicores reserved.
    pub async fn reserve_cpu(&self, objects: &[Value]) -> anyhow::Result<u32> {
        let millis = requested_millicores(objects)?;
        anyhow::ensure!(
            self.cpu.lock().is_none(),
            "{} reserved the node's CPU before: a test reserves all of it at once",
            self.name
        );
        let started = tokio::time::Instant::now();
        let reservation = node_cpu::reserve(&self.client, millis, TEST_NAMESPACE_LABEL).await?;
        let waited = started.elapsed();
        if waited > std::time::Duration::from_secs(1) {
            println!(
                "{}: waited {:.1} s for {millis}m of the node's CPU (other tests held it)",
                self.name,
                waited.as_secs_f64()
            );
        }
        *self.cpu.lock() = Some(reservation);
        Ok(millis)
    }

    /// Adds a file (an operator's log, say) to what is printed if the test fails.
    pub fn dump_on_failure(&self, label: impl Into<String>, path: impl Into<PathBuf>) {
        self.extra_dumps.lock().push((label.into(), path.into()));
    }

    /// Everything worth seeing about the namespace: pods with their status, events in order,
    /// the tail of every container's log (`kubectl logs`), and the extra files.
    pub async fn dump(&self) -> String {
        let mut out = format!("===== dump of namespace {} =====\n", self.name);
        let pods: Api<Pod> = self.api();
        let mut containers: Vec<(String, String)> = Vec::new();
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                for pod in list {
                    for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
                        containers.push((
                            pod.metadata.name.clone().unwrap_or_default(),
                            c.name.clone(),
                        ));
                    }
                    let status = pod.status.clone().unwrap_or_default();
                    let _ = writeln!(
                        out,
                        "pod {} phase={} node={} ip={}",
                        pod.metadata.name.as_deref().unwrap_or("?"),
                        status.phase.as_deref().unwrap_or("?"),
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.node_name.as_deref())
                            .unwrap_or("-"),
                        status.pod_ip.as_deref().unwrap_or("-"),
                    );
                    for c in status.conditions.unwrap_or_default() {
                        let _ = writeln!(
                            out,
                            "  condition {}={} {}",
                            c.type_,
                            c.status,
                            c.message.unwrap_or_default()
                        );
                    }
                    for c in status.container_statuses.unwrap_or_default() {
                        let _ = writeln!(
                            out,
                            "  container {} ready={} restarts={} state={:?}",
                            c.name, c.ready, c.restart_count, c.state
                        );
                    }
                }
            }
            Err(e) => {
                let _ = writeln!(out, "(could not list pods: {e})");
            }
        }
        let events: Api<Event> = self.api();
        match events.list(&ListParams::default()).await {
            Ok(list) => {
                let mut items = list.items;
                items.sort_by_key(|e| e.metadata.creation_timestamp.clone());
                for e in items {
                    let _ = writeln!(
                        out,
                        "event {} {} {}/{}: {}",
                        e.type_.unwrap_or_default(),
                        e.reason.unwrap_or_default(),
                        e.involved_object.kind.unwrap_or_default(),
                        e.involved_object.name.unwrap_or_default(),
                        e.message.unwrap_or_default()
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(out, "(could not list events: {e})");
            }
        }
        {
            for (pod, container) in containers {
                let logs = crate::cluster::output(self.cluster.kubectl().args([
                    "logs",
                    "-n",
                    &self.name,
                    &pod,
                    "-c",
                    &container,
                    "--tail=60",
                ]))
                .await;
                let text = match logs {
                    Ok(o) => format!(
                        "{}{}",
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    ),
                    Err(e) => format!("(kubectl logs failed: {e})"),
                };
                let _ = writeln!(
                    out,
                    "----- kubectl logs {pod} -c {container} --tail=60 -----\n{}",
                    text.trim_end()
                );
            }
        }
        let files: Vec<(String, PathBuf)> = self.extra_dumps.lock().clone();
        for (label, path) in files {
            let text =
                std::fs::read_to_string(&path).unwrap_or_else(|e| format!("(unreadable: {e})"));
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            let _ = writeln!(
                out,
                "----- {label} ({}), last {} lines -----\n{}",
                path.display(),
                tail.len(),
                tail.join("\n")
            );
        }
        out
    }
}

/// Runs `test` in a fresh namespace named `<prefix>-<random>`. If the test fails or panics, the
/// namespace is dumped to stderr; then it is deleted (unless `POOLPILOT_E2E_KEEP` is set) and the
/// failure is passed on.
pub async fn with_namespace<F>(prefix: &str, test: F) -> anyhow::Result<()>
where
    F: AsyncFnOnce(&TestNamespace) -> anyhow::Result<()>,
{
    let cluster = Cluster::shared().await?;
    let client = cluster.client().await?;
    let suffix: u32 = rand::rng().random_range(0..0xfffff);
    let name = format!("{prefix}-{suffix:05x}");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(TEST_NAMESPACE_LABEL.to_owned(), "true".to_owned())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    namespaces.create(&PostParams::default(), &ns).await?;
    let tns = TestNamespace {
        name: name.clone(),
        client,
        cluster,
        extra_dumps: Mutex::new(Vec::new()),
        cpu: Mutex::new(None),
    };

    let outcome = AssertUnwindSafe(test(&tns)).catch_unwind().await;
    let failed = !matches!(outcome, Ok(Ok(())));
    if failed {
        eprintln!("{}", tns.dump().await);
    }
    let keep = std::env::var_os("POOLPILOT_E2E_KEEP").is_some();
    if !keep {
        if let Err(e) = namespaces.delete(&name, &DeleteParams::default()).await {
            eprintln!("could not delete test namespace {name}: {e}");
        }
    } else {
        eprintln!("keeping namespace {name} (POOLPILOT_E2E_KEEP is set)");
    }
    let reserved = tns.cpu.lock().take();
    if let Some(reservation) = reserved {
        // The scheduler counts a pod's request until the pod is gone; a kept namespace's pods
        // stay, and so does its share of the node for the rest of the run.
        if keep {
            std::mem::forget(reservation);
            return finish(outcome);
        }
        let pods: Api<Pod> = tns.api();
        let gone = crate::eventually("the namespace's pods gone", RELEASE_WAIT, || async {
            let left = pods.list(&ListParams::default()).await?.items.len();
            anyhow::ensure!(left == 0, "{left} pods left");
            Ok(())
        })
        .await;
        if let Err(e) = gone {
            eprintln!(
                "{name}: {e:#}; its {}m of CPU go back anyway",
                reservation.millis
            );
        }
        drop(reservation);
    }
    finish(outcome)
}

/// The test's own outcome, its panic resumed.
fn finish(outcome: std::thread::Result<anyhow::Result<()>>) -> anyhow::Result<()> {
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
