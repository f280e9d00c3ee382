//! The whole product deployed into one test namespace from `manifests/overlays/local`, as a user
//! deploys it: the admin credentials an install creates ([`crate::credentials`]: token, CA and
//! certificate, so that the operator PUTs over verified HTTPS), the operator (its own
//! ServiceAccount, bound to the shipped ClusterRole in this namespace only, never
//! cluster-admin), the gateway Deployment, the sample modelsim backends, and then the policies a
//! scenario applies with `kubectl apply`. The cluster's node runs every pod from the images of
//! `make images`; the cluster's
//! Prometheus discovers and scrapes them. The scenarios (`e2e/tests/scenarios/`) and the demo
//! drive it through processes, kubectl and the Kubernetes API only.
//!
//! ```text
//!  kubectl kustomize manifests/overlays/local
//!      │ moved into the test namespace, sized by a StackSpec
//!      ▼
//!  operator pod(s) ──PromQL──► Prometheus ◄──scrape── gateway pods, modelsim pods
//!      │ PUT /v1/limits + ConfigMap <policy>-limits          ▲
//!      └─────────────────────────────────────────────────────┘
//!  Load (load.rs) ──► gateway pods ──► modelsim pods (model-a, model-b)
//! ```
//!
//! This module deploys and drives the stack; beside it, `policies` (the policy fixtures and edits),
//! `gateway_pod` (a client of one gateway pod's proxy and admin API), `pods` (a pod's readiness
//! and address) and `prom_text` (reading `/metrics` texts). They import nothing from here.

mod gateway_pod;
mod pods;
pub mod policies;
mod prom_text;

pub use gateway_pod::{ADMIN_PORT, GatewayPod, PROXY_PORT};
pub use pods::{is_ready, pod_ip};
pub use policies::{
    client_max_concurrency, one_backend_policy, only_backend, quick_policy, sample_policy, set,
    share,
};
pub use prom_text::{
    bucket_delta, decisions_by_kind, get_text, histogram, histogram_where, metric_sum,
    operator_decisions, operator_metrics, quantile,
};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_api::limits::GatewayLimits;
use poolpilot_api::policy::BackendStatus;
use serde::Deserialize as _;
use serde_json::{Value, json};

use crate::cluster::run;
use crate::credentials::AdminCredentials;
use crate::namespace::TestNamespace;
use crate::paths::workspace_root;
use crate::wait::eventually;
use poolpilot_modelsim::Remote;

/// Deadline of the waits for pods and conditions: generous, for a loaded 2-core machine.
pub const WAIT: Duration = Duration::from_secs(120);
/// How long a test's teardown lets the operator clean its deleted policies up.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);
/// Label of the gateway pods (`manifests/gateway/deployment.yaml`).
pub const GATEWAY_LABELS: &str = "app.kubernetes.io/name=poolpilot-gateway";
/// Label of the operator pods (`manifests/operator/deployment.yaml`).
pub const OPERATOR_LABELS: &str = "app.kubernetes.io/name=poolpilot-operator";
/// Name of the gateway Deployment.
pub const GATEWAY_DEPLOYMENT: &str = "poolpilot-gateway";
/// Name of the operator Deployment.
pub const OPERATOR_DEPLOYMENT: &str = "poolpilot-operator";
/// Name of the sample policy, whose ConfigMap `models-limits` the gateway Deployment mounts.
pub const POLICY: &str = "models";
/// modelsim's uncounted admin port (`manifests/samples/modelsim.yaml`).
pub const MODELSIM_ADMIN_PORT: u16 = 8001;

/// One sample backend (`model-a` or `model-b` of `manifests/samples/modelsim.yaml`) as a scenario
/// wants it.
#[derive(Clone, Debug)]
pub struct BackendSpec {
    /// `model-a` or `model-b`.
    pub name: &'static str,
    /// modelsim instances.
    pub replicas: u32,
    /// modelsim's `--max-concurrency` (batch slots per instance).
    pub slots: u32,
    /// More modelsim flags (service time, faults), appended to the sample's.
    pub args: Vec<String>,
}

impl BackendSpec {
    /// `replicas` instances of `name` with `slots` batch slots and the given service time.
    pub fn new(name: &'static str, replicas: u32, slots: u32) -> Self {
        Self {
            name,
            replicas,
            slots,
            args: Vec::new(),
        }
    }

    /// A fixed service time of about `ms` milliseconds per call (base latency, no per-token time,
    /// little jitter, no slowdown with load), so that the in-flight demand of a closed-loop load
    /// is predictable.
    pub fn service_ms(mut self, ms: u32) -> Self {
        self.args.extend([
            format!("--base-latency-ms={ms}"),
            "--per-token-ms=0".to_owned(),
            "--jitter-sigma=0.05".to_owned(),
            "--batch-slowdown=0".to_owned(),
            "--saturation-slowdown=0".to_owned(),
        ]);
        self
    }

    /// Appends a modelsim flag (`--name=value`), replacing an earlier value of the same flag.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        let arg = arg.into();
        let flag = arg.split('=').next().unwrap_or(&arg).to_owned();
        self.args
            .retain(|a| a.split('=').next().unwrap_or(a) != flag.as_str());
        self.args.push(arg);
        self
    }
}

/// How big the deployed stack is.
#[derive(Clone, Debug)]
pub struct StackSpec {
    /// Gateway replicas.
    pub gateways: u32,
    /// Operator replicas (leader election among them).
    pub operators: u32,
    /// The backends to run; the sample's other backend gets 0 replicas.
    pub backends: Vec<BackendSpec>,
    /// The gateway pods' RLIMIT_NOFILE ([`nofile_template`]: the RuntimeClass
    /// `nofile-<limit>`); containerd's default (4096) when `None`.
    pub nofile_limit: Option<u64>,
    /// The gateways' CPU request in place of the manifest's (250m), for stacks of more gateway
    /// pods than the node's 2 CPUs hold at that request (the scheduler counts requests, not
    /// use: the loop benchmark's 30-pod rollout).
    pub gateway_cpu_request: Option<&'static str>,
    /// More operator flags, appended to the overlay's; a `--prometheus-url=` among them
    /// replaces the overlay's (clap refuses a repeated flag).
    pub operator_args: Vec<String>,
    /// Secrets created in the namespace and mounted into the operator (credentials for a
    /// Prometheus behind authentication, say).
    pub operator_secrets: Vec<TestSecret>,
    /// Secrets created in the namespace and mounted into the gateways (a provider's key for a
    /// backend's `credentials`, at `/etc/poolpilot/secrets/<name>`, where the operator's
    /// documents name its files).
    pub gateway_secrets: Vec<TestSecret>,
    /// Top-level settings of the gateways' configuration file (`manifests/gateway/gateway.yaml`)
    /// that this stack replaces, as key and YAML value: `("awaitOperator", "5s")`.
    pub gateway_settings: Vec<(&'static str, String)>,
}

/// A Secret of the test, mounted read-only into the operator's or the gateways' container.
#[derive(Clone, Debug)]
pub struct TestSecret {
    /// The Secret's name.
    pub name: String,
    /// Where its keys appear as files.
    pub mount_path: String,
    /// Its keys and values.
    pub data: BTreeMap<String, String>,
}

impl Default for StackSpec {
    fn default() -> Self {
        Self {
            gateways: 3,
            operators: 1,
            backends: vec![
                BackendSpec::new("model-a", 3, 64),
                BackendSpec::new("model-b", 3, 32),
            ],
            nofile_limit: None,
            gateway_cpu_request: None,
            operator_args: Vec::new(),
            operator_secrets: Vec::new(),
            gateway_secrets: Vec::new(),
            gateway_settings: Vec::new(),
        }
    }
}

/// The product running in a test namespace.
#[derive(Debug)]
pub struct Stack<'a> {
    ns: &'a TestNamespace,
    credentials: Arc<AdminCredentials>,
}

/// Deploys the stack into a fresh namespace, runs `test`, then removes the policies' finalizers
/// (the namespace is deleted by [`with_namespace`]).
///
/// [`with_namespace`]: crate::with_namespace
/// The pod template fields that give a pod RLIMIT_NOFILE `limit`, as a merge patch of the
/// template: the RuntimeClass `nofile-<limit>` (applied here, cluster-wide and never deleted),
/// whose containerd handler sets the limit in the container's OCI spec (`cluster up
/// --node-nofile-class <limit>`: `make cluster-up` has 512, 4096 and 8192, the loop benchmark's).
pub async fn nofile_template(cluster: &crate::Cluster, limit: u64) -> anyhow::Result<Value> {
    let class = format!("nofile-{limit}");
    cluster
        .apply_list(&[json!({
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": class}, "handler": class,
        })])
        .await?;
    Ok(json!({"spec": {"runtimeClassName": class}}))
}

/// JSON merge: `patch`'s objects into `target`'s, its other values over `target`'s.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Mounts `secrets` read-only into the first container of a Deployment.
fn mount_secrets(deployment: &mut Value, secrets: &[TestSecret]) -> anyhow::Result<()> {
    let volume = |s: &TestSecret| format!("test-{}", s.name);
    let pod = &mut deployment["spec"]["template"]["spec"];
    let mounts = pod["containers"][0]["volumeMounts"]
        .as_array_mut()
        .context("volumeMounts")?;
    for secret in secrets {
        mounts.push(
            json!({"name": volume(secret), "mountPath": secret.mount_path, "readOnly": true}),
        );
    }
    let volumes = pod["volumes"].as_array_mut().context("volumes")?;
    for secret in secrets {
        volumes.push(json!({"name": volume(secret), "secret": {"secretName": secret.name}}));
    }
    Ok(())
}

pub async fn with_stack<F>(prefix: &str, spec: StackSpec, test: F) -> anyhow::Result<()>
where
    F: AsyncFnOnce(&Stack<'_>) -> anyhow::Result<()>,
{
    crate::with_namespace(prefix, async |ns| {
        let stack = Stack {
            ns,
            credentials: Arc::new(AdminCredentials::generate(ns.name())?),
        };
        let result = match stack.deploy(&spec).await {
            Ok(()) => test(&stack).await,
            Err(e) => Err(e.context("deploying the stack")),
        };
        stack.teardown().await;
        result
    })
    .await
}

impl<'a> Stack<'a> {
    /// The test namespace.
    pub fn ns(&self) -> &'a TestNamespace {
        self.ns
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        self.ns.name()
    }

    /// The admin credentials of this install (token, CA, certificate).
    pub fn credentials(&self) -> &AdminCredentials {
        &self.credentials
    }

    /// A `kubectl` command against the cluster (add `-n` yourself).
    pub fn kubectl(&self) -> tokio::process::Command {
        self.ns.cluster().kubectl()
    }

    /// The install's Secrets and the overlay's objects, moved into this namespace and sized by
    /// `spec`, then applied.
    async fn deploy(&self, spec: &StackSpec) -> anyhow::Result<()> {
        let cluster = self.ns.cluster();
        cluster.install_crd().await?;
        let nofile = match spec.nofile_limit {
            Some(limit) => Some(nofile_template(cluster, limit).await?),
            None => None,
        };
        let yaml = run(cluster
            .kubectl()
            .arg("kustomize")
            .arg(workspace_root().join("manifests/overlays/local")))
        .await?;
        let mut objects = self.credentials.secrets(self.name());
        objects.extend(
            spec.operator_secrets
                .iter()
                .chain(&spec.gateway_secrets)
                .map(|s| {
                    json!({
                        "apiVersion": "v1", "kind": "Secret",
                        "metadata": {"name": s.name, "namespace": self.name()},
                        "stringData": s.data,
                    })
                }),
        );
        for doc in serde_norway::Deserializer::from_str(&yaml) {
            let mut object = Value::deserialize(doc)?;
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            if matches!(
                kind.as_str(),
                "Namespace" | "CustomResourceDefinition" | "ConnectionPolicy"
            ) {
                continue;
            }
            self.adapt(&mut object, &kind, spec)?;
            if let Some(template) = &nofile
                && kind == "Deployment"
                && object["metadata"]["name"] == GATEWAY_DEPLOYMENT
            {
                merge(&mut object["spec"]["template"], template);
            }
            objects.push(object);
        }
        self.ns.reserve_cpu(&objects).await?;
        cluster.apply_list(&objects).await?;
        Ok(())
    }

    /// Moves one rendered object into the namespace and applies the spec's sizes to it.
    fn adapt(&self, object: &mut Value, kind: &str, spec: &StackSpec) -> anyhow::Result<()> {
        let ns = self.name();
        match kind {
            // Cluster-scoped, shared and identical for every test: applied as they are.
            "ClusterRole" | "ValidatingAdmissionPolicy" | "ValidatingAdmissionPolicyBinding" => {}
            _ => object["metadata"]["namespace"] = json!(ns),
        }
        if kind.ends_with("Binding") {
            for subject in object["subjects"].as_array_mut().into_iter().flatten() {
                subject["namespace"] = json!(ns);
            }
        }
        if kind == "NetworkPolicy" {
            // Let this namespace's operator reach the admin port (not enforced by the local
            // kubelet, kept right for the record).
            let text = serde_json::to_string(object)?.replace("poolpilot-system", ns);
            *object = serde_json::from_str(&text)?;
        }
        if kind == "ConfigMap"
            && let Some(text) = object["data"]["gateway.yaml"].as_str()
            && !spec.gateway_settings.is_empty()
        {
            let mut config: Value = serde_norway::from_str(text)?;
            for (key, value) in &spec.gateway_settings {
                config[*key] = serde_norway::from_str(value)?;
            }
            object["data"]["gateway.yaml"] = json!(serde_norway::to_string(&config)?);
        }
        if kind != "Deployment" {
            return Ok(());
        }
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let container = &mut object["spec"]["template"]["spec"]["containers"][0];
        match name.as_str() {
            OPERATOR_DEPLOYMENT => {
                // clap refuses a repeated flag: a `--prometheus-url=` among the spec's operator
                // args (a test's relay in front of Prometheus) replaces the overlay's.
                let wanted = spec
                    .operator_args
                    .iter()
                    .find_map(|a| a.strip_prefix("--prometheus-url="));
                let prometheus = match wanted {
                    Some(url) => url.to_owned(),
                    None => self.ns.cluster().prometheus_url()?.to_owned(),
                };
                let args = container["args"].as_array_mut().context("operator args")?;
                for arg in args.iter_mut() {
                    if arg
                        .as_str()
                        .is_some_and(|a| a.starts_with("--prometheus-url="))
                    {
                        *arg = json!(format!("--prometheus-url={prometheus}"));
                    }
                }
                // Each test's operator reconciles its own namespace only, so that concurrent
                // tests never touch each other's policies.
                args.retain(|a| !a.as_str().is_some_and(|a| a.starts_with("--namespace=")));
                args.push(json!("--namespace=$(POD_NAMESPACE)"));
                args.extend(
                    spec.operator_args
                        .iter()
                        .filter(|a| !a.starts_with("--prometheus-url="))
                        .map(|a| json!(a)),
                );
                mount_secrets(object, &spec.operator_secrets)?;
                object["spec"]["replicas"] = json!(spec.operators);
            }
            GATEWAY_DEPLOYMENT => {
                if let Some(cpu) = spec.gateway_cpu_request {
                    container["resources"]["requests"]["cpu"] = json!(cpu);
                }
                mount_secrets(object, &spec.gateway_secrets)?;
                object["spec"]["replicas"] = json!(spec.gateways);
            }
            backend => {
                let wanted = spec.backends.iter().find(|b| b.name == backend);
                if let Some(b) = wanted {
                    // clap refuses a repeated flag: the spec's flags replace the sample's.
                    let ours: Vec<String> =
                        std::iter::once(format!("--max-concurrency={}", b.slots))
                            .chain(b.args.iter().cloned())
                            .collect();
                    let flag = |a: &str| a.split('=').next().unwrap_or(a).to_owned();
                    let replaced: Vec<String> = ours.iter().map(|a| flag(a)).collect();
                    let args = container["args"].as_array_mut().context("modelsim args")?;
                    args.retain(|a| !a.as_str().is_some_and(|a| replaced.contains(&flag(a))));
                    args.extend(ours.into_iter().map(|a| json!(a)));
                }
                object["spec"]["replicas"] = json!(wanted.map_or(0, |b| b.replicas));
            }
        }
        Ok(())
    }

    /// Removes what outlives the namespace: the policies, whose finalizer would otherwise hold
    /// the namespace in Terminating once the operator is deleted with it (the operator cleans
    /// them up while it runs; what is left after [`TEARDOWN_WAIT`] loses its finalizer).
    async fn teardown(&self) {
        let policies: Api<ConnectionPolicy> = self.ns.api();
        let _ = policies
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        let cleaned = eventually(
            "the operator cleans the deleted policies up",
            TEARDOWN_WAIT,
            || async {
                let left = policies.list(&ListParams::default()).await?.items.len();
                anyhow::ensure!(left == 0, "{left} policies left");
                Ok(())
            },
        )
        .await;
        if cleaned.is_err()
            && let Ok(left) = policies.list(&ListParams::default()).await
        {
            // A deleted object gets no finalizer back: the operator cannot re-add it.
            for p in left {
                let patch = Patch::Merge(json!({"metadata": {"finalizers": null}}));
                let _ = policies
                    .patch(&p.name_any(), &PatchParams::default(), &patch)
                    .await;
            }
        }
    }

    /// `kubectl apply` of a policy (or any object) into this namespace; the output on success.
    pub async fn apply(&self, object: &Value) -> anyhow::Result<String> {
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(object)?)?;
        run(self
            .kubectl()
            .args(["apply", "-n", self.name(), "-f"])
            .arg(file.path()))
        .await
    }

    /// Applies `policy` (named [`POLICY`]) so that its targets start at `autoscale.min` instead
    /// of the upper bound a new policy starts at: first with `autoscale.max` lowered to the
    /// minimum, then, once that is rolled out, as given (raising a bound leaves a target where
    /// it is until demand asks for more). A scenario whose load must find the pool at its
    /// minimum is spared the shrinking there, a scale-down stabilization window and more.
    pub async fn apply_starting_at_min(&self, policy: &Value) -> anyhow::Result<()> {
        let min = policy
            .pointer("/spec/autoscale/min")
            .cloned()
            .context("the policy has no spec.autoscale.min")?;
        let mut at_min = policy.clone();
        set(&mut at_min, "/spec/autoscale/max", min)?;
        self.apply(&at_min).await?;
        self.wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;
        self.apply(policy).await?;
        self.wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;
        Ok(())
    }

    /// The policy `name`.
    pub async fn policy(&self, name: &str) -> anyhow::Result<ConnectionPolicy> {
        let api: Api<ConnectionPolicy> = self.ns.api();
        Ok(api.get(name).await?)
    }

    /// The condition `kind` of policy `name`, if set.
    pub async fn condition(&self, name: &str, kind: &str) -> anyhow::Result<Option<Condition>> {
        Ok(self
            .policy(name)
            .await?
            .status
            .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == kind)))
    }

    /// Waits until policy `name` has condition `kind` with `status` for its current generation,
    /// and returns it.
    pub async fn wait_condition(
        &self,
        name: &str,
        kind: &str,
        status: &str,
        timeout: Duration,
    ) -> anyhow::Result<Condition> {
        eventually(&format!("{name} has {kind}={status}"), timeout, || async {
            let policy = self.policy(name).await?;
            let generation = policy.metadata.generation;
            let status_of = policy.status.unwrap_or_default();
            let c = status_of
                .conditions
                .iter()
                .find(|c| c.type_ == kind)
                .cloned()
                .with_context(|| format!("no {kind} yet: {:?}", status_of.conditions))?;
            anyhow::ensure!(
                c.status == status && c.observed_generation == generation,
                "{kind}={} ({}: {}) at generation {:?} of {generation:?}",
                c.status,
                c.reason,
                c.message,
                c.observed_generation
            );
            Ok(c)
        })
        .await
    }

    /// Ready pods with these labels.
    pub async fn ready_pods(&self, labels: &str) -> anyhow::Result<Vec<Pod>> {
        let pods: Api<Pod> = self.ns.api();
        let list = pods.list(&ListParams::default().labels(labels)).await?;
        Ok(list
            .items
            .into_iter()
            .filter(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
            .collect())
    }

    /// Waits until exactly `count` pods with these labels are Ready (and no other is left
    /// terminating), and returns them.
    pub async fn wait_ready(&self, labels: &str, count: usize) -> anyhow::Result<Vec<Pod>> {
        let pods: Api<Pod> = self.ns.api();
        eventually(&format!("{count} pods {labels} Ready"), WAIT, || async {
            let all = pods.list(&ListParams::default().labels(labels)).await?;
            let ready: Vec<Pod> = all
                .items
                .iter()
                .filter(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
                .cloned()
                .collect();
            anyhow::ensure!(
                ready.len() == count && all.items.len() == count,
                "{} Ready of {} pods, want {count}",
                ready.len(),
                all.items.len()
            );
            Ok(ready)
        })
        .await
    }

    /// The Ready gateway pods.
    pub async fn gateways(&self) -> anyhow::Result<Vec<GatewayPod>> {
        self.ready_pods(GATEWAY_LABELS)
            .await?
            .iter()
            .map(|p| GatewayPod::of(p, &self.credentials))
            .collect()
    }

    /// Waits for `count` Ready gateway pods.
    pub async fn wait_gateways(&self, count: usize) -> anyhow::Result<Vec<GatewayPod>> {
        self.wait_ready(GATEWAY_LABELS, count)
            .await?
            .iter()
            .map(|p| GatewayPod::of(p, &self.credentials))
            .collect()
    }

    /// modelsim's admin clients of backend `name`'s Ready pods.
    pub async fn backends(&self, name: &str) -> anyhow::Result<Vec<Remote>> {
        self.ready_pods(&format!("app.kubernetes.io/name={name}"))
            .await?
            .iter()
            .map(|p| {
                Ok(Remote::new(SocketAddr::new(
                    pod_ip(p)?,
                    MODELSIM_ADMIN_PORT,
                )))
            })
            .collect()
    }

    /// Backend `backend`'s status in the policy [`POLICY`].
    pub async fn backend_status(&self, backend: &str) -> anyhow::Result<BackendStatus> {
        self.policy(POLICY)
            .await?
            .status
            .context("no status yet")?
            .backends
            .into_iter()
            .find(|b| b.name == backend)
            .with_context(|| format!("no {backend} in the status yet"))
    }

    /// `backend`'s upstream p90 latency over the last `seconds` in this namespace, from
    /// Prometheus (what the gateways' duration histograms say).
    pub async fn upstream_p90(&self, backend: &str, seconds: u32) -> anyhow::Result<f64> {
        let promql = format!(
            "histogram_quantile(0.9, sum by (le) (rate(poolpilot_upstream_request_duration_seconds_bucket{{namespace=\"{}\", backend=\"{backend}\"}}[{seconds}s])))",
            self.name()
        );
        let rows = self.ns.cluster().prometheus_query(&promql).await?;
        let value = rows
            .first()
            .and_then(|r| r["value"][1].as_str())
            .with_context(|| format!("no p90 from {promql}: {rows:?}"))?;
        let p90: f64 = value.parse()?;
        anyhow::ensure!(p90.is_finite(), "p90 {value}");
        Ok(p90)
    }

    /// Waits until Prometheus holds `metric` of `backend` in this namespace from `pods` gateway
    /// pods: they have been scraped since their pools started, so what they count from now on
    /// shows as an increase (a series Prometheus first sees with counts in it does not).
    pub async fn wait_scraped(
        &self,
        metric: &str,
        backend: &str,
        pods: usize,
    ) -> anyhow::Result<()> {
        let promql = format!(
            "count({metric}{{namespace=\"{}\", backend=\"{backend}\"}})",
            self.name()
        );
        eventually(
            &format!("Prometheus scraped {metric} of {pods} pods"),
            WAIT,
            || async {
                let rows = self.ns.cluster().prometheus_query(&promql).await?;
                let n: usize = rows
                    .first()
                    .and_then(|r| r["value"][1].as_str())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                anyhow::ensure!(n >= pods, "{n} of {pods}: {promql}");
                Ok(())
            },
        )
        .await
    }

    /// The `/metrics` URL of a Ready operator pod (the first; with one replica, the leader).
    pub async fn operator_metrics_url(&self) -> anyhow::Result<String> {
        let pods = self.ready_pods(OPERATOR_LABELS).await?;
        let pod = pods.first().context("no Ready operator pod")?;
        Ok(format!("http://{}:8080/metrics", pod_ip(pod)?))
    }

    /// Waits until the operator makes its next autoscale decision (its
    /// `poolpilot_operator_decisions_total` grows), so that a load change right after it is
    /// seen alone by the decision one interval later.
    pub async fn wait_next_decision(&self, timeout: Duration) -> anyhow::Result<()> {
        let operator = self.operator_metrics_url().await?;
        let ticks = operator_decisions(&operator).await?.values().sum::<f64>();
        eventually("an autoscale decision", timeout, || async {
            let now = operator_decisions(&operator).await?.values().sum::<f64>();
            anyhow::ensure!(now > ticks, "{now} decisions");
            Ok(())
        })
        .await
    }

    /// `kubectl scale` of a Deployment of this namespace.
    pub async fn scale(&self, deployment: &str, replicas: u32) -> anyhow::Result<()> {
        run(self.kubectl().args([
            "scale",
            "-n",
            self.name(),
            &format!("deployment/{deployment}"),
            &format!("--replicas={replicas}"),
        ]))
        .await?;
        Ok(())
    }

    /// Events of this namespace about `object` (a name) with `reason`, oldest first.
    pub async fn events(&self, object: &str, reason: &str) -> anyhow::Result<Vec<Event>> {
        let api: Api<Event> = self.ns.api();
        let mut events: Vec<Event> = api
            .list(&ListParams::default().fields(&format!("involvedObject.name={object}")))
            .await?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .collect();
        events.sort_by_key(|e| e.metadata.creation_timestamp.clone());
        Ok(events)
    }

    /// Waits for an Event `reason` about `object` whose message contains `needle`.
    pub async fn wait_event(
        &self,
        object: &str,
        reason: &str,
        needle: &str,
    ) -> anyhow::Result<Event> {
        eventually(
            &format!("an Event {reason} on {object} saying {needle:?}"),
            WAIT,
            || async {
                let events = self.events(object, reason).await?;
                events
                    .iter()
                    .rev()
                    .find(|e| e.message.as_deref().unwrap_or_default().contains(needle))
                    .cloned()
                    .with_context(|| {
                        format!(
                            "events so far: {:?}",
                            events.iter().map(|e| &e.message).collect::<Vec<_>>()
                        )
                    })
            },
        )
        .await
    }

    /// Waits until every Ready gateway pod (exactly `pods` of them) serves a limits document in
    /// which `check` holds, and returns the documents.
    pub async fn wait_limits<F>(
        &self,
        what: &str,
        pods: usize,
        timeout: Duration,
        check: F,
    ) -> anyhow::Result<Vec<(GatewayPod, GatewayLimits)>>
    where
        F: Fn(&GatewayLimits) -> anyhow::Result<()>,
    {
        eventually(what, timeout, || async {
            let gateways = self.gateways().await?;
            anyhow::ensure!(
                gateways.len() == pods,
                "{} of {pods} gateways Ready",
                gateways.len()
            );
            let mut docs = Vec::new();
            for g in gateways {
                let limits = g.limits().await?;
                check(&limits).with_context(|| format!("gateway {}", g.name))?;
                docs.push((g, limits));
            }
            Ok(docs)
        })
        .await
    }
}
