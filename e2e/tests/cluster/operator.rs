//! The operator on the embedded cluster, as a user runs it: deployed as a pod from the local
//! overlay's manifests (its own ServiceAccount, bound to the ClusterRole of `manifests/operator`,
//! not cluster-admin), driven with `kubectl` only: the CRD and a sample policy applied →
//! `Accepted`, CEL rules and list-map keys refuse an invalid policy, printer columns (`-o wide`
//! too), `kubectl explain`; RBAC (no denial under the shipped role; without one
//! verb the operator fails visibly: in its log, its metrics and a `ReconcileFailed` Event on the
//! policy), and that `kubectl logs` of an operator pod works as on any cluster (the
//! kubelet serves container logs through its API).
//!
//! Each test runs its own operator in its own namespace (`--namespace`, so that operators of
//! concurrent tests never reconcile each other's policies) and names its cluster-scoped objects
//! after that namespace, deleting them at the end.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, Patch, PatchParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_e2e::cluster::{output, run};
use poolpilot_e2e::credentials::AdminCredentials;
use poolpilot_e2e::paths::workspace_root;
use poolpilot_e2e::{TestNamespace, eventually, with_namespace};
use serde::Deserialize as _;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// Deadline of every wait: generous, for a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(90);
/// The label of the operator's pods (from `manifests/operator/deployment.yaml`).
const OPERATOR_LABELS: &str = "app.kubernetes.io/name=poolpilot-operator";
/// The sample policy's name.
const SAMPLE: &str = "models";

/// The operator's objects as `kubectl kustomize manifests/overlays/local` renders them.
async fn rendered_operator(ns: &TestNamespace) -> anyhow::Result<Vec<Value>> {
    let yaml = run(ns
        .cluster()
        .kubectl()
        .arg("kustomize")
        .arg(workspace_root().join("manifests/overlays/local")))
    .await?;
    let mut objects = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&yaml) {
        let object = Value::deserialize(doc)?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        if object["kind"] != "Namespace" && name.starts_with("poolpilot-operator") {
            objects.push(object);
        }
    }
    let mut kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    kinds.sort_unstable();
    anyhow::ensure!(
        kinds
            == [
                "ClusterRole",
                "Deployment",
                "PodDisruptionBudget",
                "Role",
                "RoleBinding",
                "RoleBinding",
                "Service",
                "ServiceAccount",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding"
            ],
        "unexpected operator objects in the local overlay: {kinds:?}"
    );
    Ok(objects)
}

/// How a test deploys the operator.
struct Deploy<'a> {
    /// Replicas of the Deployment (the manifests' value when `None`).
    replicas: Option<u32>,
    /// Drops `verb` on `resource` from the ClusterRole and binds the operator to that reduced
    /// copy (named after the namespace) instead of the shipped role.
    without: Option<(&'a str, &'a str)>,
}

/// The names of the cluster-scoped objects a test created (deleted by [`teardown`]).
#[derive(Default)]
struct ClusterScoped {
    binding: Option<String>,
    role: Option<String>,
}

/// Deploys the operator's objects into the test namespace, with the CA bundle an install gives
/// it: namespaced objects move there, the RoleBinding binds the ClusterRole to the namespace's
/// ServiceAccount in this namespace only, the operator watches only this namespace. The shipped
/// ClusterRole and admission policy are applied as they are (shared with concurrent tests:
/// [`poolpilot_e2e::Cluster::apply`]).
async fn deploy_operator(
    ns: &TestNamespace,
    how: Deploy<'_>,
    created: &mut ClusterScoped,
) -> anyhow::Result<()> {
    let name = ns.name();
    let mut objects = AdminCredentials::generate(name)?.secrets(name);
    objects.extend(rendered_operator(ns).await?);
    for object in &mut objects {
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "ClusterRole" => {
                if let Some((resource, verb)) = how.without {
                    let role = format!("poolpilot-operator-{name}-without-{verb}");
                    remove_verb(object, resource, verb)?;
                    object["metadata"]["name"] = json!(role);
                    created.role = Some(role);
                }
            }
            "ValidatingAdmissionPolicy" | "ValidatingAdmissionPolicyBinding" => {}
            "RoleBinding" => {
                object["metadata"]["namespace"] = json!(name);
                if object["roleRef"]["kind"] == "ClusterRole"
                    && let Some(role) = &created.role
                {
                    object["roleRef"]["name"] = json!(role);
                }
            }
            _ => object["metadata"]["namespace"] = json!(name),
        }
        if kind.ends_with("Binding") {
            for subject in object["subjects"].as_array_mut().into_iter().flatten() {
                subject["namespace"] = json!(name);
            }
        }
        if kind == "Deployment" {
            if let Some(replicas) = how.replicas {
                object["spec"]["replicas"] = json!(replicas);
            }
            // The overlay's Prometheus is `make cluster-up`'s (port 9090); a cluster that the
            // tests started has its own port.
            let prometheus = ns.cluster().prometheus_url()?;
            let container = &mut object["spec"]["template"]["spec"]["containers"][0];
            let args = container["args"]
                .as_array_mut()
                .context("the operator container has args")?;
            for arg in args.iter_mut() {
                if arg
                    .as_str()
                    .is_some_and(|a| a.starts_with("--prometheus-url="))
                {
                    *arg = json!(format!("--prometheus-url={prometheus}"));
                }
            }
            // This namespace only, whatever the overlay's operator watches.
            args.retain(|a| !a.as_str().is_some_and(|a| a.starts_with("--namespace=")));
            args.push(json!("--namespace=$(POD_NAMESPACE)"));
        }
    }
    // The reduced role is applied before the binding that refers to it (order of the list).
    objects.sort_by_key(|o| o["kind"] != "ClusterRole");
    ns.reserve_cpu(&objects).await?;
    // Shared with the other tests' applies: a create may lose a race (see `Cluster::apply`).
    ns.cluster().apply_list(&objects).await?;
    Ok(())
}

/// Removes `verb` from the rule on `resource` (core group) of a ClusterRole; fails if the role
/// does not grant it, so the test notices when the manifests change.
fn remove_verb(role: &mut Value, resource: &str, verb: &str) -> anyhow::Result<()> {
    let rule = role["rules"]
        .as_array_mut()
        .context("rules")?
        .iter_mut()
        .find(|r| {
            r["apiGroups"] == json!([""])
                && r["resources"]
                    .as_array()
                    .is_some_and(|rs| rs.iter().any(|x| x == resource))
        })
        .with_context(|| format!("no rule on {resource} in the ClusterRole"))?;
    let verbs = rule["verbs"].as_array_mut().context("verbs")?;
    let before = verbs.len();
    verbs.retain(|v| v != verb);
    anyhow::ensure!(
        verbs.len() < before,
        "the ClusterRole does not grant {verb} on {resource}"
    );
    Ok(())
}

/// The operator's Ready pods once `count` of them are Ready; their logs are dumped if the test
/// fails.
async fn operator_pods(ns: &TestNamespace, count: usize) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = ns.api();
    let ready = eventually("the operator pods are Ready", WAIT, || async {
        let list = pods
            .list(&ListParams::default().labels(OPERATOR_LABELS))
            .await?;
        let ready: Vec<Pod> = list.items.into_iter().filter(is_ready).collect();
        anyhow::ensure!(ready.len() == count, "{} of {count} Ready", ready.len());
        Ok(ready)
    })
    .await?;
    Ok(ready)
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// An operator pod's log, where a user reads it: `kubectl logs` (the apiserver asks the
/// kubelet's API for it).
async fn operator_log(ns: &TestNamespace, pod: &Pod) -> anyhow::Result<String> {
    run(ns
        .cluster()
        .kubectl()
        .args(["logs", "-n", ns.name(), &pod.name_any()]))
    .await
}

/// The text of an operator pod's `/metrics`.
async fn scrape(pod: &Pod) -> anyhow::Result<String> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("the operator pod has no IP")?;
    Ok(reqwest::get(format!("http://{ip}:8080/metrics"))
        .await?
        .error_for_status()?
        .text()
        .await?)
}

/// `kubectl apply` of the sample policy into the test namespace.
async fn apply_sample(ns: &TestNamespace) -> anyhow::Result<()> {
    run(ns
        .cluster()
        .kubectl()
        .args(["apply", "-n", ns.name(), "-f"])
        .arg(workspace_root().join("manifests/samples/connectionpolicy.yaml")))
    .await?;
    Ok(())
}

/// Deletes the test's cluster-scoped objects, and lets go of policies whose finalizer nobody
/// will remove (the namespace could not be deleted otherwise).
async fn teardown(ns: &TestNamespace, created: &ClusterScoped) {
    let policies: Api<ConnectionPolicy> = ns.api();
    if let Ok(list) = policies.list(&ListParams::default()).await {
        for p in list {
            let patch = Patch::Merge(json!({"metadata": {"finalizers": null}}));
            let _ = policies
                .patch(&p.name_any(), &PatchParams::default(), &patch)
                .await;
        }
    }
    let mut objects: Vec<String> = Vec::new();
    if let Some(binding) = &created.binding {
        objects.push(format!("clusterrolebinding/{binding}"));
    }
    if let Some(role) = &created.role {
        objects.push(format!("clusterrole/{role}"));
    }
    if objects.is_empty() {
        return;
    }
    let mut cmd = ns.cluster().kubectl();
    cmd.args(["delete", "--ignore-not-found", "--wait=false"])
        .args(&objects);
    if let Err(e) = run(&mut cmd).await {
        eprintln!("teardown: {e:#}");
    }
}

/// Runs `scenario` in a fresh namespace named after `prefix`, then deletes the cluster-scoped
/// objects it recorded in its [`ClusterScoped`] (see [`teardown`]), whether it failed or not.
async fn with_cluster_scoped(
    prefix: &str,
    scenario: impl AsyncFnOnce(&TestNamespace, &mut ClusterScoped) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    with_namespace(prefix, async |ns| {
        let mut created = ClusterScoped::default();
        let result = scenario(ns, &mut created).await;
        teardown(ns, &created).await;
        result
    })
    .await
}

/// Collapses every run of whitespace into one space (`kubectl explain` wraps long lines).
fn words(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[tokio::test]
async fn the_operator_accepts_a_policy_under_its_cluster_role_without_rbac_denials()
-> anyhow::Result<()> {
    with_cluster_scoped("op-accept", accept_scenario).await
}

/// `kubectl apply` of `yaml` in `ns`, which the API server must refuse: its stderr.
async fn apply_refused(ns: &TestNamespace, yaml: &str) -> anyhow::Result<String> {
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), yaml)?;
    let refused = output(
        ns.cluster()
            .kubectl()
            .args(["apply", "-n", ns.name(), "-f"])
            .arg(file.path()),
    )
    .await?;
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    anyhow::ensure!(
        !refused.status.success(),
        "the policy was accepted: {stderr}"
    );
    Ok(stderr)
}

async fn accept_scenario(ns: &TestNamespace, created: &mut ClusterScoped) -> anyhow::Result<()> {
    let cluster = ns.cluster();
    ns.cluster().install_crd().await?;
    // Two replicas as shipped: one leads, the other stands by on the Lease.
    deploy_operator(
        ns,
        Deploy {
            replicas: None,
            without: None,
        },
        created,
    )
    .await?;
    let pods = operator_pods(ns, 2).await?;

    // `kubectl apply` of the sample policy → the operator accepts it.
    apply_sample(ns).await?;
    let waited = run(cluster.kubectl().args([
        "wait",
        "-n",
        ns.name(),
        "--for=condition=Accepted",
        "--timeout=90s",
        &format!("cpol/{SAMPLE}"),
    ]))
    .await?;
    assert_eq!(
        waited.trim(),
        format!("connectionpolicy.poolpilot.io/{SAMPLE} condition met")
    );

    // The accepted policy got its durable limits ConfigMap (server-side apply, which needs
    // `create` on configmaps), owned by the policy.
    let configmaps: Api<ConfigMap> = ns.api();
    let cm = eventually("the limits ConfigMap exists", WAIT, || async {
        configmaps
            .get_opt(&format!("{SAMPLE}-limits"))
            .await?
            .context("not yet")
    })
    .await?;
    let owner = cm.owner_references().first().cloned().context("an owner")?;
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("ConnectionPolicy", SAMPLE)
    );
    let doc: Value = serde_json::from_str(
        cm.data
            .as_ref()
            .and_then(|d| d.get("limits.json"))
            .context("limits.json in the ConfigMap")?,
    )?;
    let backends: Vec<&str> = doc["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["name"].as_str())
        .collect();
    assert_eq!(backends, ["model-a", "model-b"], "{doc}");

    // An invalid policy is refused by `kubectl apply` with the CEL messages.
    let sample =
        std::fs::read_to_string(workspace_root().join("manifests/samples/connectionpolicy.yaml"))?;
    let invalid = sample
        .replace("name: models", "name: too-big")
        .replace("    max: 25\n", "    max: 40\n")
        .replace(
            "timeouts: {firstByte: 15s, total: 120s",
            "timeouts: {firstByte: 150s, total: 120s",
        );
    anyhow::ensure!(
        invalid.contains("max: 40") && invalid.contains("firstByte: 150s"),
        "the sample changed; update this test's edits"
    );
    let stderr = apply_refused(ns, &invalid).await?;
    // The duration rule's message names the two values (messageExpression).
    for message in [
        "autoscale.max must not exceed capacity.maxConnectionsPerEndpoint × (1 − capacity.headroom) of any backend",
        "timeouts.firstByte must not exceed timeouts.total: 150s > 120s",
    ] {
        assert!(
            stderr.contains(message),
            "{message:?} missing from: {stderr}"
        );
    }
    assert!(stderr.contains("\"too-big\" is invalid"), "{stderr}");

    // Two backends of one name: the list map's key refuses the second, naming it.
    let twice = sample
        .replace("name: models", "name: twice")
        .replace("  - name: model-b\n", "  - name: model-a\n");
    anyhow::ensure!(
        twice.matches("- name: model-a").count() == 2,
        "the sample changed; update this test's edits"
    );
    let stderr = apply_refused(ns, &twice).await?;
    assert!(
        stderr.contains("spec.backends[1]: Duplicate value") && stderr.contains("model-a"),
        "{stderr}"
    );
    let policies: Api<ConnectionPolicy> = ns.api();
    assert!(
        policies.get_opt("too-big").await?.is_none(),
        "a refused policy must not exist"
    );

    // `kubectl get cpol`: the printer columns, with the values of the status.
    let status = eventually("the status has targets", WAIT, || async {
        let p = policies.get(SAMPLE).await?;
        let status = p.status.context("no status yet")?;
        anyhow::ensure!(status.targets.is_some(), "no targets yet");
        Ok(status)
    })
    .await?;
    let table = run(cluster.kubectl().args(["get", "cpol", "-n", ns.name()])).await?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "TARGETS", "UPDATED", "READY", "SATURATED", "AGE"],
        "{table}"
    );
    // `-o wide` adds the reasons of the other conditions.
    let wide = run(cluster
        .kubectl()
        .args(["get", "cpol", "-n", ns.name(), "-o", "wide"]))
    .await?;
    let wide_header: Vec<&str> = wide
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        wide_header,
        [
            "NAME",
            "TARGETS",
            "UPDATED",
            "READY",
            "SATURATED",
            "ACCEPTED",
            "METRICS",
            "FDBUDGET",
            "ROLLOUT",
            "AGE"
        ],
        "{wide}"
    );
    assert!(
        wide.lines()
            .nth(1)
            .unwrap_or_default()
            .contains(" Accepted "),
        "{wide}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let condition = |kind: &str| {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == kind)
            .map(|c| c.status.clone())
            .unwrap_or_else(|| "<none>".to_owned())
    };
    let targets = status.targets.clone().unwrap_or_default();
    assert!(
        targets.starts_with("model-a=") && targets.contains(",model-b="),
        "targets per backend: {targets}"
    );
    // No gateway pod selects the policy here: none ready, none updated.
    assert_eq!(status.updated.as_deref(), Some("0/0"));
    assert_eq!(row.len(), 6, "{table}");
    let (ready, saturated) = (condition("Ready"), condition("Saturated"));
    let expected = [
        SAMPLE,
        targets.as_str(),
        "0/0",
        ready.as_str(),
        saturated.as_str(),
    ];
    assert_eq!(row[..5], expected, "{table}");
    assert!(
        row[5].ends_with('s') || row[5].ends_with('m'),
        "age: {table}"
    );

    // `kubectl explain` shows the field docs of the pool.
    let explained = run(cluster
        .kubectl()
        .args(["explain", "connectionpolicy.spec.backends.pool"]))
    .await?;
    let text = words(&explained);
    for doc in [
        "The connection pool each gateway pod keeps to each endpoint.",
        "leaseTimeout <string>",
        "Longest wait for a pooled connection before failing fast with 503",
        "maxPending <integer>",
    ] {
        assert!(
            text.contains(doc),
            "{doc:?} missing from `kubectl explain`:\n{explained}"
        );
    }

    // The operator counts its policies per condition status and reason, and Prometheus has it,
    // labelled as the alerts read it (summed over reasons, max over the replicas).
    let promql = format!(
        "max(sum without (reason) (poolpilot_operator_policies{{namespace=\"{}\", condition=\"Accepted\", status=\"True\"}}))",
        ns.name()
    );
    cluster
        .wait_prometheus_value("Prometheus sees one accepted policy", &promql, "1", WAIT)
        .await?;

    // While the policy lives, the leader logs its decisions: where a user reads them.
    kubectl_logs_works_as_on_any_cluster(ns, &pods).await?;

    // Deleting the policy runs the operator's finalizer (a patch of the policy).
    run(cluster.kubectl().args([
        "delete",
        "-n",
        ns.name(),
        "--timeout=90s",
        &format!("cpol/{SAMPLE}"),
    ]))
    .await?;
    eventually(
        "the limits ConfigMap is gone with its policy",
        WAIT,
        || async {
            anyhow::ensure!(
                configmaps
                    .get_opt(&format!("{SAMPLE}-limits"))
                    .await?
                    .is_none(),
                "still there"
            );
            Ok(())
        },
    )
    .await?;

    // Under the shipped ClusterRole the operator never met an RBAC denial, on the leader nor
    // on the standby.
    let mut leaders = 0;
    for pod in &pods {
        let log = operator_log(ns, pod).await?;
        assert!(
            log.contains("watching ConnectionPolicies"),
            "the log of {} is empty or not the operator's:\n{log}",
            pod.name_any()
        );
        if log.contains("became the leader") {
            leaders += 1;
        }
        let denials: Vec<&str> = log
            .lines()
            .filter(|l| l.to_lowercase().contains("forbidden"))
            .collect();
        assert!(
            denials.is_empty(),
            "RBAC denials in the log of {}:\n{}",
            pod.name_any(),
            denials.join("\n")
        );
    }
    assert!(leaders >= 1, "no replica became the leader");
    Ok(())
}

/// `kubectl logs` of the operator as a user runs it: the last lines with their times, the
/// previous instance (there is none yet), and following the log as the leader writes it.
async fn kubectl_logs_works_as_on_any_cluster(
    ns: &TestNamespace,
    pods: &[Pod],
) -> anyhow::Result<()> {
    let mut leader = None;
    for pod in pods {
        if operator_log(ns, pod).await?.contains("became the leader") {
            leader = Some(pod.name_any());
        }
    }
    let leader = leader.context("a leader")?;
    let logs = |args: &[&str]| {
        let mut cmd = ns.cluster().kubectl();
        cmd.args(["logs", "-n", ns.name(), &leader]).args(args);
        cmd
    };
    let tail = run(&mut logs(&["--tail=1", "--timestamps"])).await?;
    assert_eq!(tail.lines().count(), 1, "--tail=1: {tail:?}");
    let stamp = tail.split(' ').next().unwrap_or_default();
    assert!(
        stamp.parse::<k8s_openapi::jiff::Timestamp>().is_ok(),
        "--timestamps: {tail:?}"
    );
    let previous = output(&mut logs(&["--previous"])).await?;
    let said = String::from_utf8_lossy(&previous.stderr);
    assert!(
        !previous.status.success() && said.contains("previous terminated container"),
        "--previous of a container that never restarted: {said}"
    );
    // The leader logs each autoscale decision (every 15 s): one arrives on a follower.
    let mut follow = logs(&["-f", "--tail=0"]);
    follow
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = follow.spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let decision = tokio::time::timeout(WAIT, async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("autoscale decision") {
                return Ok(line);
            }
        }
        anyhow::bail!("kubectl logs -f ended")
    })
    .await
    .context("no decision followed")??;
    child.kill().await?;
    assert!(
        decision.contains("backend=model-a") || decision.contains("backend=model-b"),
        "{decision}"
    );
    Ok(())
}

#[tokio::test]
async fn without_create_on_configmaps_the_operator_fails_visibly() -> anyhow::Result<()> {
    with_cluster_scoped("op-rbac", missing_verb_scenario).await
}

async fn missing_verb_scenario(
    ns: &TestNamespace,
    created: &mut ClusterScoped,
) -> anyhow::Result<()> {
    ns.cluster().install_crd().await?;
    // Server-side apply of the not-yet-existing limits ConfigMap is authorized as `create`.
    deploy_operator(
        ns,
        Deploy {
            replicas: Some(1),
            without: Some(("configmaps", "create")),
        },
        created,
    )
    .await?;
    let pod = operator_pods(ns, 1).await?.remove(0);
    apply_sample(ns).await?;

    // The log says which step failed, on which object, and the apiserver's denial.
    let user = format!("system:serviceaccount:{}:poolpilot-operator", ns.name());
    let line = eventually("the operator logs the denial", WAIT, || async {
        let log = operator_log(ns, &pod).await?;
        log.lines()
            .find(|l| l.contains("reconcile failed") && l.contains("forbidden"))
            .map(str::to_owned)
            .context("no failed reconcile in the log yet")
    })
    .await?;
    // The log is a file, not a terminal: the plain format writes no colour codes into it.
    let log = operator_log(ns, &pod).await?;
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escape codes in the operator's log file:\n{log}"
    );
    for part in [
        "WARN",
        &format!("policy={SAMPLE}"),
        "step=\"rollout\"",
        &format!("failed to apply ConfigMap {SAMPLE}-limits"),
        &format!("User \"{user}\" cannot create resource \"configmaps\""),
    ] {
        assert!(
            line.contains(part),
            "{part:?} missing from the log line:\n{line}"
        );
    }

    // ... and the operator's metrics count the failed step, which the reconcile-errors alert
    // reads.
    eventually("the rollout errors are counted", WAIT, || async {
        let metrics = scrape(&pod).await?;
        let errors = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix("poolpilot_operator_reconcile_errors_total{step=\"rollout\"} ")
            })
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        anyhow::ensure!(
            errors >= 1.0,
            "reconcile errors of the rollout step: {errors}"
        );
        Ok(())
    })
    .await?;

    // ... and a Warning Event on the policy says which step failed and why. The failure repeats
    // every few seconds, as one Event series (its count grows), never as a new Event each time.
    let events: Api<Event> = ns.api();
    let by_policy = ListParams::default().fields(&format!("involvedObject.name={SAMPLE}"));
    let event = eventually(
        "one ReconcileFailed Event, repeated in its series",
        WAIT,
        || async {
            let failed: Vec<Event> = events
                .list(&by_policy)
                .await?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("ReconcileFailed"))
                .collect();
            anyhow::ensure!(
                failed.len() == 1,
                "{} ReconcileFailed Events: {failed:?}",
                failed.len()
            );
            let event = failed.into_iter().next().context("one Event")?;
            let count = event.series.as_ref().and_then(|s| s.count).unwrap_or(1);
            anyhow::ensure!(count >= 2, "the failure was published {count} time(s)");
            Ok(event)
        },
    )
    .await?;
    assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
    assert_eq!(
        (
            event.involved_object.kind.as_deref(),
            event.involved_object.name.as_deref()
        ),
        (Some("ConnectionPolicy"), Some(SAMPLE))
    );
    assert_eq!(event.action.as_deref(), Some("RollOut"), "{event:?}");
    assert_eq!(
        event.reporting_component.as_deref(),
        Some("poolpilot-operator"),
        "{event:?}"
    );
    let note = event.message.clone().unwrap_or_default();
    for part in [
        "rollout step failed: ",
        &format!("failed to apply ConfigMap {SAMPLE}-limits"),
        "is forbidden",
        &format!("User \"{user}\" cannot create resource \"configmaps\""),
    ] {
        assert!(
            note.contains(part),
            "{part:?} missing from the Event's note:\n{note}"
        );
    }

    // Nothing was written behind the failure: no ConfigMap, and the policy is not reported as
    // accepted by this operator.
    let configmaps: Api<ConfigMap> = ns.api();
    assert!(
        configmaps
            .get_opt(&format!("{SAMPLE}-limits"))
            .await?
            .is_none()
    );
    let policies: Api<ConnectionPolicy> = ns.api();
    let policy = policies.get(SAMPLE).await?;
    let accepted = policy
        .status
        .iter()
        .flat_map(|s| &s.conditions)
        .any(|c| c.type_ == "Accepted" && c.status == "True");
    assert!(
        !accepted,
        "the policy must not look accepted: {:?}",
        policy.status
    );
    Ok(())
}

/// `kubectl` acting as the operator's ServiceAccount in `ns` (impersonation by the admin), run
/// with `args` and `object` (JSON) on its standard input when given: whether it succeeded, and
/// what it printed.
async fn as_operator(
    ns: &TestNamespace,
    args: &[&str],
    object: Option<&Value>,
) -> anyhow::Result<(bool, String)> {
    let user = format!("system:serviceaccount:{}:poolpilot-operator", ns.name());
    let mut cmd = ns.cluster().kubectl();
    cmd.arg(format!("--as={user}")).args(args);
    let file = tempfile::NamedTempFile::new()?;
    if let Some(object) = object {
        std::fs::write(file.path(), serde_json::to_vec(object)?)?;
        cmd.arg("-f").arg(file.path());
    }
    let out = output(&mut cmd).await?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

/// A ConfigMap in `ns` as the operator writes one (`operator/src/reconcile/rollout.rs`): named
/// after `policy`, labelled, controlled by the policy whose uid is `uid` (`None`: no owner).
fn limits_configmap(name: &str, policy: &str, uid: Option<&str>) -> Value {
    let owners: Vec<Value> = uid
        .map(|uid| {
            json!({"apiVersion": "poolpilot.io/v1alpha1", "kind": "ConnectionPolicy",
                   "name": policy, "uid": uid, "controller": true, "blockOwnerDeletion": true})
        })
        .into_iter()
        .collect();
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "poolpilot-operator", "poolpilot.io/policy": policy},
            "ownerReferences": owners,
        },
        "data": {"limits.json": "{}"},
    })
}

#[tokio::test]
async fn the_operators_identity_may_write_only_the_limits_configmaps_it_manages()
-> anyhow::Result<()> {
    with_cluster_scoped("op-configmaps", configmap_scenario).await
}

async fn configmap_scenario(ns: &TestNamespace, created: &mut ClusterScoped) -> anyhow::Result<()> {
    let name = ns.name();
    let cluster = ns.cluster();
    cluster.install_crd().await?;
    // The operator's identity as the base installs it, cluster-wide: its ServiceAccount, the
    // shipped ClusterRole with a ClusterRoleBinding (named after the namespace), and the
    // admission policy; no operator pod, the test acts as it.
    let binding = format!("poolpilot-operator-{name}");
    created.binding = Some(binding.clone());
    let mut objects: Vec<Value> = rendered_operator(ns)
        .await?
        .into_iter()
        .filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some(
                    "ClusterRole"
                        | "ValidatingAdmissionPolicy"
                        | "ValidatingAdmissionPolicyBinding"
                )
            )
        })
        .collect();
    objects.push(json!({"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": "poolpilot-operator", "namespace": name}}));
    objects.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": binding},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "poolpilot-operator"},
        "subjects": [{"kind": "ServiceAccount", "name": "poolpilot-operator", "namespace": name}],
    }));
    objects.push(json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "app-settings", "namespace": name},
                        "data": {"mode": "production"}}));
    objects.push(json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "team-limits", "namespace": name},
                        "data": {"quota": "10"}}));
    cluster.apply_list(&objects).await?;
    apply_sample(ns).await?;
    let policies: Api<ConnectionPolicy> = ns.api();
    let uid = policies
        .get(SAMPLE)
        .await?
        .uid()
        .context("the policy's uid")?;

    // Its own limits ConfigMap, as the operator writes it (server-side apply): allowed, once the
    // binding is in force.
    let own = limits_configmap(&format!("{SAMPLE}-limits"), SAMPLE, Some(&uid));
    let apply = [
        "apply",
        "--server-side",
        "--field-manager=poolpilot-operator",
        "-n",
        name,
    ];
    eventually(
        "the operator writes its own limits ConfigMap",
        WAIT,
        || async {
            let (ok, text) = as_operator(ns, &apply, Some(&own)).await?;
            anyhow::ensure!(ok, "{text}");
            Ok(())
        },
    )
    .await?;
    let (ok, text) = as_operator(ns, &apply, Some(&own)).await?;
    assert!(ok, "an update of its own ConfigMap: {text}");

    // The admission policy takes a moment to be in force once created: a dry run (which runs
    // admission, and changes nothing) tells when.
    let stray =
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stray"}, "data": {}});
    eventually("the admission policy is in force", WAIT, || async {
        let (ok, text) = as_operator(
            ns,
            &["create", "--dry-run=server", "-n", name],
            Some(&stray),
        )
        .await?;
        anyhow::ensure!(!ok, "a stray ConfigMap passed admission: {text}");
        Ok(())
    })
    .await?;

    // Everything else is refused by the admission policy, naming the rule.
    let apply_as_operator = vec![
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=poolpilot-operator",
        "-n",
        name,
    ];
    let refusals: [(&str, Vec<&str>, Option<Value>, &str); 5] = [
        (
            "a change of a ConfigMap it does not manage",
            apply_as_operator.clone(),
            Some(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app-settings"}, "data": {"mode": "debug"}}),
            ),
            "may write only its limits ConfigMaps",
        ),
        (
            "a new ConfigMap that is no limits ConfigMap",
            vec!["create", "-n", name],
            Some(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stray"}, "data": {}}),
            ),
            "may write only its limits ConfigMaps",
        ),
        (
            "a limits ConfigMap no policy controls",
            vec!["create", "-n", name],
            Some(limits_configmap("orphan-limits", "orphan", None)),
            "must be controlled by its ConnectionPolicy orphan",
        ),
        (
            "a limits ConfigMap under another policy's name",
            vec!["create", "-n", name],
            Some(limits_configmap("other-limits", SAMPLE, Some(&uid))),
            "may write only its limits ConfigMaps",
        ),
        (
            "taking over a ConfigMap by labelling it",
            apply_as_operator.clone(),
            Some(limits_configmap("team-limits", "team", Some(&uid))),
            "may not take over ConfigMap team-limits",
        ),
    ];
    // The embedded apiserver enforces owner-reference permissions (as OpenShift does): adding
    // an ownerReference to an existing object needs `delete` on it, which the operator lacks, so
    // that admission plugin may refuse a take-over before the admission policy sees it.
    const NO_DELETE: &str = "cannot set an ownerRef on a resource you can't delete";
    for (what, args, object, needle) in &refusals {
        let (ok, text) = as_operator(ns, args, object.as_ref()).await?;
        assert!(!ok, "{what} was allowed: {text}");
        let by_policy = text.contains("ValidatingAdmissionPolicy 'poolpilot-operator-configmaps'")
            && text.contains(needle);
        let by_owner_references = needle.contains("take over") && text.contains(NO_DELETE);
        assert!(
            by_policy || by_owner_references,
            "{what}: {needle:?} missing from: {text}"
        );
    }
    let configmaps: Api<ConfigMap> = ns.api();
    let settings = configmaps.get("app-settings").await?;
    assert_eq!(
        settings
            .data
            .and_then(|d| d.get("mode").cloned())
            .as_deref(),
        Some("production"),
        "untouched"
    );
    assert!(configmaps.get_opt("stray").await?.is_none());

    // With --namespace, the ClusterRole is bound in the watched namespace only (overlays/local):
    // a ConfigMap elsewhere is forbidden by RBAC before admission.
    run(cluster
        .kubectl()
        .args(["delete", "clusterrolebinding", &binding]))
    .await?;
    created.binding = None;
    let role_binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "poolpilot-operator", "namespace": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "poolpilot-operator"},
        "subjects": [{"kind": "ServiceAccount", "name": "poolpilot-operator", "namespace": name}],
    });
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_json::to_vec(&role_binding)?)?;
    run(cluster.kubectl().args(["apply", "-f"]).arg(file.path())).await?;
    eventually("the ClusterRoleBinding is gone from RBAC", WAIT, || async {
        let (_, text) = as_operator(
            ns,
            &["auth", "can-i", "create", "configmaps", "-n", "default"],
            None,
        )
        .await?;
        anyhow::ensure!(text.trim() == "no", "can-i: {text}");
        Ok(())
    })
    .await?;
    let elsewhere = limits_configmap(&format!("{SAMPLE}-limits"), SAMPLE, Some(&uid));
    let (ok, text) = as_operator(
        ns,
        &[
            "apply",
            "--server-side",
            "--field-manager=poolpilot-operator",
            "-n",
            "default",
        ],
        Some(&elsewhere),
    )
    .await?;
    assert!(!ok, "allowed in namespace default: {text}");
    assert!(
        text.contains("forbidden") && text.contains("in the namespace \"default\""),
        "{text}"
    );
    let (ok, text) = as_operator(ns, &apply, Some(&own)).await?;
    assert!(ok, "its own namespace, under the RoleBinding: {text}");
    Ok(())
}
