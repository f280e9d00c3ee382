//! The operator at fleet scale on the embedded cluster's API server: `N` simulated gateway pods
//! ([`crate::fleet_sim`], in this process, on 127/8 addresses) as Pod objects whose status this
//! run writes as a kubelet would, a private Prometheus scraping the fleet's one target with
//! `honor_labels`, `P` ConnectionPolicies, and the operator as a process of this machine against
//! the API server. Measures the cold start (operator start → every policy settled), reconcile
//! latency from the operator's own histogram, PromQL queries per metric per round from both the
//! operator's counters and Prometheus' own, API requests, a rollout to every pod, and the
//! operator's memory and CPU from `/proc`. The objects and numbers are decided in `objects.rs`.
//!
//! ```text
//!  this process: Fleet (N × HTTPS admin on 127.x.y.z) + /metrics of all N ◄── Prometheus (private)
//!        ▲ PUT /v1/limits                                                        ▲ PromQL
//!        └──────────── poolpilot-operator (host process, --namespace NS) ────────┘
//!                               │ list/watch pods, policies; status, ConfigMaps
//!                               ▼
//!                      kube-apiserver: N Pods (gated off the node, status written here), P policies
//! ```
//!
//! Why a host process: the node runs its pods in network namespaces of their own, where 127/8 is
//! the pod's own loopback, so an operator pod could not reach the simulated pods; the operator on
//! this machine reaches them and the API server alike.

mod objects;

pub use objects::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use poolpilot_api::ConnectionPolicy;
use serde_json::json;
use tokio::process::Child;
use tokio::time::Instant;

use crate::TestNamespace;
use crate::credentials::{AdminCredentials, TOKEN_SECRET};
use crate::fleet_sim::{Fleet, server_config};
use crate::stack::{bucket_delta, get_text, histogram, histogram_where, metric_sum, quantile};

/// API calls in flight at once while the run creates its objects.
const CREATE_CONCURRENCY: usize = 16;

/// Makes one API call per item, at most [`CREATE_CONCURRENCY`] at once, and waits for all of
/// them; the first error among their results, if any.
async fn bounded<T, F, Fut>(items: impl IntoIterator<Item = T>, call: F) -> anyhow::Result<()>
where
    F: FnMut(T) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    futures::stream::iter(items)
        .map(call)
        .buffer_unordered(CREATE_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}
/// The reconcile-duration histogram.
const RECONCILE_HISTOGRAM: &str = "poolpilot_operator_reconcile_duration_seconds";

/// What one run measured.
#[derive(Clone, Debug)]
pub struct FleetResult {
    /// The plan it ran.
    pub plan: FleetPlan,
    /// The operator binary it ran.
    pub operator_bin: PathBuf,
    /// Seconds to create the pods (with their status) and the policies, before the operator.
    pub setup: f64,
    /// Seconds from the operator's start until every policy settled and every pod ran its
    /// document (`None`: not within the plan's settle timeout).
    pub settle: Option<f64>,
    /// Policies settled when the wait ended.
    pub settled: usize,
    /// Pods not running the backends they should when the wait ended, and the first of them.
    pub pods_wrong: (usize, Vec<String>),
    /// Reconcile latency p50 and p99 over the cold start (operator start → settled), seconds.
    pub cold_reconcile: (Option<f64>, Option<f64>),
    /// Reconciles during the cold start.
    pub cold_reconciles: f64,
    /// Kubernetes API requests per second during the cold start, by verb.
    pub cold_api: BTreeMap<String, f64>,
    /// Where the cold start's reconciles spent their time: each step of the pipeline.
    pub cold_steps: Vec<StepTimes>,
    /// The cold start's namespace passes by outcome (`reused`, `planned`, `private`).
    pub cold_passes: BTreeMap<String, f64>,
    /// Reconcile latency p50 and p99 in the steady window, seconds.
    pub steady_reconcile: (Option<f64>, Option<f64>),
    /// Reconcile latency p99 over the operator's whole run, seconds.
    pub run_p99: Option<f64>,
    /// Reconciles in the steady window, per interval.
    pub steady_reconciles_per_interval: f64,
    /// Kubernetes API requests per second in the steady window, by verb.
    pub steady_api: BTreeMap<String, f64>,
    /// The steady window measured.
    pub window: Duration,
    /// Queries the operator sent per round in the steady window, by query.
    pub queries_per_round: BTreeMap<String, f64>,
    /// Rounds in the steady window.
    pub rounds: f64,
    /// Instant queries Prometheus served from the operator's start to the steady window's end
    /// (its count before the operator subtracted), and the operator's rounds by then
    /// (Prometheus read first: every query it served was counted by then).
    pub served: (f64, f64),
    /// Seconds from the fleet-wide edit's API write to the last pod running it (`None`: not
    /// within the plan's rollout timeout).
    pub rollout: Option<f64>,
    /// Pods running the edit when that wait ended.
    pub rollout_reached: usize,
    /// PUTs the operator sent during the rollout.
    pub rollout_puts: f64,
    /// A change of every group policy (their backends' `pool.maxPending`): seconds the API
    /// writes took, and seconds from the first write until every policy settled on its new
    /// generation and every pod ran the change (`None`: not within the settle timeout).
    pub change_all: (f64, Option<f64>),
    /// Policies settled when that wait ended.
    pub change_settled: usize,
    /// Reconcile latency p50 and p99 from the first write of that change to the end of its
    /// wait, seconds.
    pub change_reconcile: (Option<f64>, Option<f64>),
    /// Where that change's reconciles spent their time: each step of the pipeline.
    pub change_steps: Vec<StepTimes>,
    /// The operator's resident memory: highest sample (every 500 ms) and its own peak (`VmHWM`).
    pub rss: (u64, Option<u64>),
    /// The operator's CPU seconds by the settle, and by the end.
    pub cpu: (Option<f64>, Option<f64>),
}

/// One step of the reconcile pipeline over a stretch of the run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    /// The step (`poolpilot_operator_step_duration_seconds{step}`).
    pub step: String,
    /// How often it ran.
    pub count: f64,
    /// Its p50 and p99, seconds.
    pub p50_p99: (Option<f64>, Option<f64>),
}

/// The steps of the pipeline, as the operator labels them.
const STEPS: [&str; 4] = ["clients", "plan", "rollout", "status"];

/// The steps' times in one operator `/metrics` text (counted from the operator's start).
pub fn step_times(text: &str) -> Vec<StepTimes> {
    step_times_between("", text)
}

/// The steps' times between two operator `/metrics` texts (`before` empty: from the start).
pub fn step_times_between(before: &str, after: &str) -> Vec<StepTimes> {
    STEPS
        .iter()
        .map(|step| {
            let label = format!("step=\"{step}\"");
            let of = |text: &str| {
                histogram_where(text, "poolpilot_operator_step_duration_seconds", &[&label])
            };
            let h = if before.is_empty() {
                of(after)
            } else {
                bucket_delta(&of(before), &of(after))
            };
            StepTimes {
                step: (*step).to_owned(),
                count: h.last().map_or(0.0, |b| b.1),
                p50_p99: (quantile(&h, 0.5), quantile(&h, 0.99)),
            }
        })
        .collect()
}

/// Namespace passes by outcome in one operator `/metrics` text.
pub fn passes(text: &str) -> BTreeMap<String, f64> {
    ["reused", "planned", "private"]
        .iter()
        .map(|o| {
            let label = format!("outcome=\"{o}\"");
            // An empty sum is −0.0: `+ 0.0` makes it print as 0.
            let n = metric_sum(text, "poolpilot_operator_namespace_passes_total", &[&label]) + 0.0;
            ((*o).to_owned(), n)
        })
        .collect()
}

impl FleetResult {
    /// The highest queries per round of any one query (metric) in the steady window.
    pub fn max_queries_per_metric(&self) -> f64 {
        self.queries_per_round.values().copied().fold(0.0, f64::max)
    }

    /// Queries Prometheus served per round per metric over the whole run.
    pub fn served_per_metric_round(&self) -> Option<f64> {
        let (served, rounds) = self.served;
        let metrics = self.queries_per_round.len();
        (rounds > 0.0 && metrics > 0).then(|| served / rounds / metrics as f64)
    }
}

/// A child process killed when dropped, with its pid.
struct Process {
    child: Child,
    pid: u32,
}

impl Process {
    fn spawn(mut cmd: tokio::process::Command, log: &Path) -> anyhow::Result<Self> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true);
        let child = cmd.spawn()?;
        let pid = child.id().context("the child has no pid")?;
        Ok(Self { child, pid })
    }

    fn proc_file(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(format!("/proc/{}/{name}", self.pid)).ok()
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A free TCP port on 127.0.0.1 (bound and released: the next bind is very likely to get it).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Raises this process' soft fd limit to its hard limit: the fleet holds one listener per pod
/// and the operator, a child, inherits the limit for its connections to them.
fn raise_fd_limit() -> anyhow::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(hard)
}

/// How long a read of Prometheus' or the operator's `/metrics`, or of a query, may take (a
/// fleet's exposition is large).
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Policies that did not settle told one by one (with their conditions) when the wait ends.
const UNSETTLED_TOLD: usize = 10;

/// Runs `plan` in `ns` with the operator at `operator_bin`, telling its progress through
/// `progress`. The simulated Pod objects are deleted before it returns, whatever happened (a
/// failing run's namespace dump would otherwise ask `kubectl logs` of each of them), and the
/// policies lose the operator's finalizer: the operator is gone, and the namespace's deletion
/// would otherwise wait on thousands of them until the cluster stops, loading every run after.
pub async fn run(
    ns: &TestNamespace,
    plan: &FleetPlan,
    operator_bin: &Path,
    progress: &(dyn Fn(&str) + Sync),
) -> anyhow::Result<FleetResult> {
    anyhow::ensure!(
        operator_bin.is_file(),
        "no operator at {}: cargo build -p poolpilot-operator",
        operator_bin.display()
    );
    let outcome = run_inner(ns, plan, operator_bin, progress).await;
    let pods: Api<Pod> = ns.api();
    let _ = pods
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(GROUP_LABEL),
        )
        .await;
    let policies: Api<ConnectionPolicy> = ns.api();
    if let Ok(list) = policies.list_metadata(&ListParams::default()).await {
        let names = list.items.into_iter().filter_map(|p| p.metadata.name);
        let released = bounded(names, |name| {
            let policies = policies.clone();
            async move {
                let patch = Patch::Merge(json!({"metadata": {"finalizers": null}}));
                policies
                    .patch_metadata(&name, &PatchParams::default(), &patch)
                    .await?;
                Ok(())
            }
        })
        .await;
        if let Err(e) = released {
            progress(&format!(
                "could not release every policy's finalizer: {e:#}"
            ));
        }
    }
    outcome
}

async fn run_inner(
    ns: &TestNamespace,
    plan: &FleetPlan,
    operator_bin: &Path,
    progress: &(dyn Fn(&str) + Sync),
) -> anyhow::Result<FleetResult> {
    let limit = raise_fd_limit()?;
    anyhow::ensure!(
        limit as usize > plan.pods + 1024,
        "the fd limit {limit} is too low for {} listeners and the operator's connections",
        plan.pods
    );
    let cluster = ns.cluster();
    cluster.install_crd().await?;
    let dir = tempfile::Builder::new().prefix("fleet-bench-").tempdir()?;
    // The run's logs go where the cluster's do: they outlive the run, and a failure's dump
    // prints them.
    let logs = cluster.dir().join(format!("fleet-bench-{}", ns.name()));
    std::fs::create_dir_all(&logs)?;

    // Credentials as an install makes them: a token in the namespace's Secret, a CA and the
    // pods' certificate for the name the operator checks.
    let credentials = AdminCredentials::generate(ns.name())?;
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, &credentials.ca_pem)?;
    let secrets: Api<Secret> = ns.api();
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": TOKEN_SECRET},
                "stringData": {"token": credentials.token},
            }))?,
        )
        .await?;

    // The fleet, serving before its pods exist in the API.
    let port = free_port()?;
    let spec = plan.fleet_spec(ns.name(), &credentials.token, port);
    let tls = server_config(&credentials.cert_pem, &credentials.key_pem)?;
    let mut fleet = Fleet::start(spec.clone(), tls)
        .await
        .context("starting the simulated fleet")?;
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = metrics.local_addr()?;
    fleet.serve_metrics(metrics);
    progress(&format!(
        "{} simulated pods {} … {}, their series on http://{target}/metrics",
        fleet.pods.len(),
        fleet.pods[0].addr,
        fleet.pods[fleet.pods.len() - 1].addr
    ));

    let setup_start = Instant::now();
    create_pods(ns, plan, &spec).await?;
    progress(&format!(
        "{} Pod objects created and ready in {:.1} s",
        plan.pods,
        setup_start.elapsed().as_secs_f64()
    ));

    let prometheus = start_prometheus(dir.path(), &logs, target, plan.interval).await?;
    ns.dump_on_failure("prometheus", logs.join("prometheus.log"));
    progress(&format!("Prometheus at {} scrapes the fleet", prometheus.1));

    let policies: Api<ConnectionPolicy> = ns.api();
    let all = all_policies(plan)?;
    bounded(all, |p| {
        let policies = policies.clone();
        async move {
            let p: ConnectionPolicy = serde_json::from_value(p)?;
            policies.create(&PostParams::default(), &p).await?;
            anyhow::Ok(())
        }
    })
    .await
    .context("creating the policies")?;
    let setup = setup_start.elapsed().as_secs_f64();
    progress(&format!(
        "{} policies created ({setup:.1} s with the pods)",
        plan.policies
    ));

    // The cold start.
    let listen = format!("127.0.0.1:{}", free_port()?);
    let operator_log = logs.join("operator.log");
    ns.dump_on_failure("operator (host process)", &operator_log);
    let mut cmd = tokio::process::Command::new(operator_bin);
    let interval = format!("{}s", plan.interval.as_secs().max(1));
    cmd.env_clear()
        .env("KUBECONFIG", cluster.kubeconfig())
        .args(["--prometheus-url", &prometheus.1])
        .args(["--metrics-interval", &interval])
        .args(["--scrape-interval", &interval])
        .args(["--admin-port", &port.to_string()])
        .arg("--gateway-ca-file")
        .arg(&ca_file)
        .args(["--namespace", ns.name()])
        .args(["--listen", &listen])
        .args(["--leader-election", "false"])
        .args(["--identity", "fleet-bench"]);
    // The caller's log filter, for a closer look at a run (`RUST_LOG=…,poolpilot_operator=debug`).
    if let Ok(filter) = std::env::var("RUST_LOG") {
        cmd.env("RUST_LOG", filter);
    }
    if let Some(n) = plan.rollout_concurrency {
        cmd.args(["--rollout-concurrency", &n.to_string()]);
    }
    if let Some(n) = plan.concurrent_reconciles {
        cmd.args(["--concurrent-reconciles", &n.to_string()]);
    }
    // The queries Prometheus served before the operator (this run's own readiness checks).
    let served_before =
        served_queries(&get_text(&format!("{}/metrics", prometheus.1), READ_TIMEOUT).await?);
    let start = Instant::now();
    let operator = Arc::new(Process::spawn(cmd, &operator_log)?);
    let rss_max = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (operator, rss_max) = (operator.clone(), rss_max.clone());
        tokio::spawn(async move {
            loop {
                if let Some(rss) = operator
                    .proc_file("status")
                    .and_then(|s| status_bytes(&s, "VmRSS"))
                {
                    rss_max.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let metrics_url = format!("http://{listen}/metrics");
    let outcome = measure(
        plan,
        &fleet,
        &policies,
        &metrics_url,
        &prometheus.1,
        &operator,
        &logs,
        (start, served_before),
        progress,
    )
    .await;
    sampler.abort();
    let _ = sampler.await;
    let hwm = operator
        .proc_file("status")
        .and_then(|s| status_bytes(&s, "VmHWM"));
    if let Ok(op) = Arc::try_unwrap(operator) {
        op.stop().await;
    }
    prometheus.0.stop().await;
    let mut m = outcome?;
    m.setup = setup;
    m.operator_bin = operator_bin.to_owned();
    m.rss = (rss_max.load(Ordering::Relaxed), hwm);
    Ok(m)
}

/// Creates the pods and writes each one's status, then waits until the API lists every one
/// ready with its address.
async fn create_pods(
    ns: &TestNamespace,
    plan: &FleetPlan,
    spec: &crate::fleet_sim::FleetSpec,
) -> anyhow::Result<()> {
    // The ServiceAccount admission refuses pods until the namespace's `default` account exists.
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> = ns.api();
    crate::eventually(
        "the namespace's default ServiceAccount",
        Duration::from_secs(60),
        || async { Ok(accounts.get("default").await?) },
    )
    .await?;
    let pods: Api<Pod> = ns.api();
    bounded(0..plan.pods, |i| {
        let pods = pods.clone();
        async move {
            let pod: Pod = serde_json::from_value(pod_object(plan, spec, i))?;
            let name = spec.name(i);
            pods.create(&PostParams::default(), &pod)
                .await
                .with_context(|| format!("creating pod {name}"))?;
            pods.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Strategic(pod_status(spec.address(i)?)),
            )
            .await
            .with_context(|| format!("writing pod {name}'s status"))?;
            anyhow::Ok(())
        }
    })
    .await?;
    crate::eventually(
        "every simulated pod listed ready with its address",
        Duration::from_secs(60),
        || async {
            let list = pods
                .list(&ListParams::default().labels(GROUP_LABEL))
                .await?;
            let ready = list
                .items
                .iter()
                .filter(|p| {
                    p.status.as_ref().is_some_and(|s| {
                        s.pod_ip.is_some()
                            && s.conditions
                                .iter()
                                .flatten()
                                .any(|c| c.type_ == "Ready" && c.status == "True")
                    })
                })
                .count();
            anyhow::ensure!(ready == plan.pods, "{ready} of {} ready", plan.pods);
            Ok(())
        },
    )
    .await
}

/// Starts the private Prometheus scraping `target`, and waits until it has scraped it once.
/// Returns it and its URL.
async fn start_prometheus(
    dir: &Path,
    logs: &Path,
    target: std::net::SocketAddr,
    interval: Duration,
) -> anyhow::Result<(Process, String)> {
    let bin = crate::paths::prometheus_bin();
    anyhow::ensure!(
        bin.is_file(),
        "no Prometheus at {}: run `make cluster`",
        bin.display()
    );
    let config = dir.join("prometheus.yml");
    std::fs::write(&config, prometheus_config(target, interval))?;
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("prometheus-data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--storage.tsdb.retention.time=2h")
        .arg("--log.level=warn");
    let process = Process::spawn(cmd, &logs.join("prometheus.log"))?;
    let up = format!("{url}/api/v1/query?query=up");
    crate::eventually(
        "Prometheus scraped the fleet",
        Duration::from_secs(60) + interval * 2,
        || async {
            let body: serde_json::Value =
                serde_json::from_str(&get_text(&up, READ_TIMEOUT).await?)?;
            let result = body["data"]["result"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            anyhow::ensure!(
                result.iter().any(|r| r["value"][1] == "1"),
                "fleet target not up yet: {result:?}"
            );
            Ok(())
        },
    )
    .await?;
    Ok((process, url))
}

/// Pods of `fleet` not running exactly the backends `plan` gives their group, by name.
pub fn wrong_pods(plan: &FleetPlan, fleet: &Fleet) -> Vec<String> {
    let expected: Vec<_> = (0..plan.groups())
        .map(|g| plan.expected_backends(g))
        .collect();
    fleet
        .pods
        .iter()
        .enumerate()
        .filter(|(i, pod)| {
            let running = pod
                .limits()
                .map(|l| l.backends.into_iter().map(|b| b.name).collect())
                .unwrap_or_default();
            expected.get(plan.group_of_pod(*i)) != Some(&running)
        })
        .map(|(_, pod)| pod.name.clone())
        .collect()
}

/// Pods of `fleet` whose fleet-wide backend has `pool.maxPending` `max_pending`.
fn pods_with_max_pending(fleet: &Fleet, max_pending: u32) -> usize {
    fleet
        .pods
        .iter()
        .filter(|p| {
            p.limits().is_some_and(|l| {
                l.backends
                    .iter()
                    .any(|b| b.name == FLEET_BACKEND && b.pool.max_pending == max_pending)
            })
        })
        .count()
}

/// Pods of `fleet` each of whose group backends has `pool.maxPending` `max_pending`.
fn pods_with_group_pending(fleet: &Fleet, max_pending: u32) -> usize {
    fleet
        .pods
        .iter()
        .filter(|p| {
            p.limits().is_some_and(|l| {
                l.backends
                    .iter()
                    .filter(|b| b.name != FLEET_BACKEND)
                    .all(|b| b.pool.max_pending == max_pending)
            })
        })
        .count()
}

/// Kubernetes API requests per second by verb between two operator `/metrics` texts.
fn api_rates(before: &str, after: &str, seconds: f64) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for verb in [
        "get", "list", "watch", "create", "update", "patch", "delete", "other",
    ] {
        let label = format!("verb=\"{verb}\"");
        let n = metric_sum(after, "poolpilot_operator_kube_requests_total", &[&label])
            - metric_sum(before, "poolpilot_operator_kube_requests_total", &[&label]);
        if n > 0.0 && seconds > 0.0 {
            out.insert(verb.to_owned(), n / seconds);
        }
    }
    out
}

/// Keeps an operator `/metrics` text with the run's logs, for a closer look afterwards (a
/// failure to write it is only said: the run goes on).
fn keep(logs: &Path, name: &str, text: &str) {
    if let Err(e) = std::fs::write(logs.join(name), text) {
        eprintln!("cannot keep {name} in {}: {e}", logs.display());
    }
}

/// The operator's `/metrics`, retried while it starts.
async fn scrape(url: &str) -> anyhow::Result<String> {
    crate::eventually("the operator's /metrics", Duration::from_secs(30), || {
        get_text(url, READ_TIMEOUT)
    })
    .await
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    plan: &FleetPlan,
    fleet: &Fleet,
    policies: &Api<ConnectionPolicy>,
    metrics_url: &str,
    prometheus_url: &str,
    operator: &Process,
    logs: &Path,
    (start, served_before): (Instant, f64),
    progress: &(dyn Fn(&str) + Sync),
) -> anyhow::Result<FleetResult> {
    // Cold start: every policy settled and every pod on its document.
    let mut settle = None;
    let mut settled = 0;
    let mut wrong = Vec::new();
    let mut last_told = Instant::now();
    let mut unsettled = Vec::new();
    while start.elapsed() < plan.settle_timeout {
        wrong = wrong_pods(plan, fleet);
        if let Ok(list) = policies.list(&ListParams::default()).await {
            unsettled = list
                .items
                .iter()
                .filter_map(|p| objects::unsettled_why(plan, p))
                .collect();
            settled = list.items.len() - unsettled.len();
        }
        if wrong.is_empty() && settled == plan.policies {
            settle = Some(start.elapsed().as_secs_f64());
            break;
        }
        if last_told.elapsed() >= Duration::from_secs(10) {
            progress(&format!(
                "{:.0} s: {settled} of {} policies settled, {} of {} pods not on their document",
                start.elapsed().as_secs_f64(),
                plan.policies,
                wrong.len(),
                plan.pods
            ));
            last_told = Instant::now();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cold_seconds = start.elapsed().as_secs_f64();
    let at_settle = scrape(metrics_url).await?;
    keep(logs, "operator-metrics-settled.txt", &at_settle);
    let cpu_settle = operator
        .proc_file("stat")
        .and_then(|s| stat_cpu_seconds(&s));
    let cold_hist = histogram(&at_settle, RECONCILE_HISTOGRAM);
    progress(&format!(
        "cold start: {} ({settled} of {} policies settled, {} pods not on their document)",
        settle.map_or("not settled".to_owned(), |s| format!("settled in {s:.1} s")),
        plan.policies,
        wrong.len()
    ));
    for why in unsettled.iter().take(UNSETTLED_TOLD) {
        progress(&format!("not settled: {why}"));
    }

    // The steady window. At its end Prometheus is read first, so that every query it served
    // was counted by the operator's read that follows.
    let prom_metrics = format!("{prometheus_url}/metrics");
    let before = scrape(metrics_url).await?;
    let window_start = Instant::now();
    tokio::time::sleep(plan.window).await;
    let prom_after = get_text(&prom_metrics, READ_TIMEOUT).await?;
    let after = scrape(metrics_url).await?;
    let window = window_start.elapsed();
    let (queries_per_round, rounds) = queries_per_round(&before, &after);
    let served_total = served_queries(&prom_after) - served_before;
    let rounds_total = metric_sum(&after, "poolpilot_operator_prometheus_rounds_total", &[]);
    let steady_hist = bucket_delta(
        &histogram(&before, RECONCILE_HISTOGRAM),
        &histogram(&after, RECONCILE_HISTOGRAM),
    );
    let reconciles = |t: &str| metric_sum(t, "poolpilot_operator_reconciles_total", &[]);
    let intervals = window.as_secs_f64() / plan.interval.as_secs_f64();
    progress(&format!(
        "steady window {:.0} s: {rounds} rounds, queries per round by metric {queries_per_round:?}",
        window.as_secs_f64()
    ));

    // The rollout of an edit of the fleet-wide policy to every pod.
    let edited = FLEET_MAX_PENDING + 1;
    let backends = fleet_policy(plan, edited)?["spec"]["backends"].clone();
    let puts = |t: &str| metric_sum(t, "poolpilot_operator_gateway_puts_total", &[]);
    let before_rollout = scrape(metrics_url).await?;
    policies
        .patch(
            FLEET_POLICY,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"backends": backends}})),
        )
        .await
        .context("editing the fleet-wide policy")?;
    let edit = Instant::now();
    let mut rollout = None;
    let mut reached = 0;
    while edit.elapsed() < plan.rollout_timeout {
        reached = pods_with_max_pending(fleet, edited);
        if reached == plan.pods {
            rollout = Some(edit.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let end_rollout = scrape(metrics_url).await?;
    progress(&format!(
        "rollout of the fleet-wide edit: {} ({reached} of {} pods)",
        rollout.map_or("not within the timeout".to_owned(), |s| format!("{s:.2} s")),
        plan.pods
    ));

    // A change of every group policy at once.
    let changed = GROUP_MAX_PENDING + 1;
    let change = Instant::now();
    bounded(0..plan.group_policies(), |k| async move {
        let backends = group_policy_with(plan, k, changed)?["spec"]["backends"].clone();
        policies
            .patch(
                &policy_name(k),
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"backends": backends}})),
            )
            .await?;
        anyhow::Ok(())
    })
    .await
    .context("changing every group policy")?;
    let writes = change.elapsed().as_secs_f64();
    let mut change_settle = None;
    let mut change_settled = 0;
    let mut unsettled = Vec::new();
    while change.elapsed() < plan.settle_timeout {
        let on_it = pods_with_group_pending(fleet, changed);
        if let Ok(list) = policies.list(&ListParams::default()).await {
            unsettled = list
                .items
                .iter()
                .filter_map(|p| objects::unsettled_why(plan, p))
                .collect();
            change_settled = list.items.len() - unsettled.len();
        }
        if on_it == plan.pods && change_settled == plan.policies {
            change_settle = Some(change.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    progress(&format!(
        "change of every group policy: written in {writes:.1} s, {}",
        change_settle.map_or(
            format!(
                "{change_settled} of {} settled within the timeout",
                plan.policies
            ),
            |s| format!("settled in {s:.1} s")
        )
    ));
    for why in unsettled.iter().take(UNSETTLED_TOLD) {
        progress(&format!("not settled after the change: {why}"));
    }

    let end = scrape(metrics_url).await?;
    keep(logs, "operator-metrics-end.txt", &end);
    let change_hist = bucket_delta(
        &histogram(&end_rollout, RECONCILE_HISTOGRAM),
        &histogram(&end, RECONCILE_HISTOGRAM),
    );
    let cpu_end = operator
        .proc_file("stat")
        .and_then(|s| stat_cpu_seconds(&s));

    Ok(FleetResult {
        plan: plan.clone(),
        operator_bin: PathBuf::new(),
        setup: 0.0,
        settle,
        settled,
        pods_wrong: (wrong.len(), wrong.into_iter().take(5).collect()),
        cold_reconcile: (quantile(&cold_hist, 0.5), quantile(&cold_hist, 0.99)),
        cold_reconciles: reconciles(&at_settle),
        cold_api: api_rates("", &at_settle, cold_seconds),
        cold_steps: step_times(&at_settle),
        cold_passes: passes(&at_settle),
        steady_reconcile: (quantile(&steady_hist, 0.5), quantile(&steady_hist, 0.99)),
        run_p99: quantile(&histogram(&end, RECONCILE_HISTOGRAM), 0.99),
        steady_reconciles_per_interval: (reconciles(&after) - reconciles(&before)) / intervals,
        steady_api: api_rates(&before, &after, window.as_secs_f64()),
        window,
        queries_per_round,
        rounds,
        served: (served_total, rounds_total),
        rollout,
        rollout_reached: reached,
        rollout_puts: puts(&end_rollout) - puts(&before_rollout),
        change_all: (writes, change_settle),
        change_settled,
        change_reconcile: (quantile(&change_hist, 0.5), quantile(&change_hist, 0.99)),
        change_steps: step_times_between(&end_rollout, &end),
        rss: (0, None),
        cpu: (cpu_settle, cpu_end),
    })
}

#[cfg(test)]
mod tests;
