//! The Helm chart (charts/poolpilot) with a real `helm` against the real apiserver: it renders
//! objects the apiserver accepts, installs a working operator and gateway fleet that serves a
//! policy end to end, upgrades in place keeping its admin credentials, and uninstalls without leaving
//! an object behind but the CRD. Its objects agree with the kustomize bases in manifests/.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::paths::{helm_bin, workspace_root};
use poolpilot_e2e::stack::{PROXY_PORT, is_ready, pod_ip, quick_policy, set};
use poolpilot_e2e::{Cluster, TestNamespace, eventually, with_namespace};
use serde::Deserialize as _;
use serde_json::{Value, json};

use crate::exclusive::BUILT_IN_ROLE_AGGREGATION;

const WAIT: Duration = Duration::from_secs(180);

/// `helm` with the cluster's admin kubeconfig.
pub(crate) fn helm(cluster: &Cluster) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(helm_bin());
    cmd.arg("--kubeconfig").arg(cluster.kubeconfig());
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    cmd
}

/// Every document of a YAML stream, as JSON values (empty documents dropped).
pub(crate) fn documents(yaml: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(yaml) {
        let v = Value::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

pub(crate) fn chart_dir() -> std::path::PathBuf {
    workspace_root().join("charts/poolpilot")
}

/// The values that run the chart on the embedded cluster: the images of `make images` (the local
/// overlay's names, which `cluster up` imported into the node), every pod listening on its own pod
/// IP (`listenOnPodIP`, as a user whose pods share a network namespace would set it).
pub(crate) fn local_values(ns: &TestNamespace, release: &str) -> anyhow::Result<Value> {
    Ok(json!({
        "fullnameOverride": release,
        "image": {"repository": "poolpilot", "tag": "local"},
        "operator": {
            "replicas": 1,
            "listenOnPodIP": true,
            "watchNamespace": ns.name(),
            "prometheus": {
                "url": ns.cluster().prometheus_url()?,
                "scrapeInterval": "2s",
                "metricsInterval": "2s",
            },
        },
        "gateway": {"replicas": 2, "listenOnPodIP": true, "awaitOperator": "5s"},
    }))
}

/// Reserves the node's CPU ([`TestNamespace::reserve_cpu`]) for an install of the chart with
/// `values` as release `release` in `ns` and, when given, for the sample backends of
/// [`deploy_backends`] in `backends`: before any of them is created.
pub(crate) async fn reserve_install(
    ns: &TestNamespace,
    release: &str,
    values: &Value,
    backends: Option<&TestNamespace>,
) -> anyhow::Result<()> {
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_json::to_vec(values)?)?;
    let rendered = run(helm(ns.cluster())
        .args(["template", release])
        .arg(chart_dir())
        .args(["-n", ns.name(), "--kube-version", "1.37.2", "-f"])
        .arg(file.path()))
    .await?;
    let mut objects = documents(&rendered)?;
    if let Some(backends) = backends {
        objects.extend(backend_objects(backends).await?);
    }
    ns.reserve_cpu(&objects).await?;
    Ok(())
}

/// The sample backends (modelsim) of the local overlay, moved into `ns`: model-a with two
/// replicas, model-b with none.
pub(crate) async fn deploy_backends(ns: &TestNamespace) -> anyhow::Result<()> {
    let items = backend_objects(ns).await?;
    apply(
        ns,
        &json!({"apiVersion": "v1", "kind": "List", "items": items}),
    )
    .await?;
    Ok(())
}

/// The objects of [`deploy_backends`].
async fn backend_objects(ns: &TestNamespace) -> anyhow::Result<Vec<Value>> {
    let cluster = ns.cluster();
    let yaml = run(cluster
        .kubectl()
        .arg("kustomize")
        .arg(workspace_root().join("manifests/overlays/local")))
    .await?;
    let mut items = Vec::new();
    for mut object in documents(&yaml)? {
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        if !matches!(name, "model-a" | "model-b") || !matches!(kind, "Deployment" | "Service") {
            continue;
        }
        if kind == "Deployment" {
            let replicas = if name == "model-a" { 2 } else { 0 };
            object["spec"]["replicas"] = json!(replicas);
        }
        object["metadata"]["namespace"] = json!(ns.name());
        items.push(object);
    }
    anyhow::ensure!(items.len() == 4, "the overlay's backends: {items:#?}");
    Ok(items)
}

pub(crate) async fn apply(ns: &TestNamespace, object: &Value) -> anyhow::Result<String> {
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_json::to_vec(object)?)?;
    run(ns
        .cluster()
        .kubectl()
        .args(["apply", "-n", ns.name(), "-f"])
        .arg(file.path()))
    .await
}

/// Waits for `count` Ready pods with `labels` and returns them.
pub(crate) async fn ready_pods(
    ns: &TestNamespace,
    labels: &str,
    count: usize,
) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = ns.api();
    eventually(&format!("{count} Ready pods {labels}"), WAIT, || async {
        let ready: Vec<Pod> = pods
            .list(&ListParams::default().labels(labels))
            .await?
            .items
            .into_iter()
            .filter(is_ready)
            .collect();
        anyhow::ensure!(ready.len() == count, "{} Ready", ready.len());
        Ok(ready)
    })
    .await
}

/// Waits until the policy `models` has `Ready=True` for its generation and every gateway pod
/// updated: the chart's operator reconciles and rolls out.
async fn wait_policy_ready(ns: &TestNamespace, gateways: u32) -> anyhow::Result<()> {
    wait_named_policy_ready(ns, "models", gateways).await
}

/// [`wait_policy_ready`] for the policy `name`.
pub(crate) async fn wait_named_policy_ready(
    ns: &TestNamespace,
    name: &str,
    gateways: u32,
) -> anyhow::Result<()> {
    let policies: Api<ConnectionPolicy> = ns.api();
    eventually(
        &format!("policy {name} Ready on every gateway"),
        WAIT,
        || async {
            let p = policies.get(name).await?;
            let status = p.status.clone().unwrap_or_default();
            let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
            anyhow::ensure!(
                ready.is_some_and(
                    |c| c.status == "True" && c.observed_generation == p.metadata.generation
                ),
                "Ready: {ready:?}"
            );
            let pods = status.pods.clone().unwrap_or_default();
            anyhow::ensure!(
                pods.updated == gateways && pods.selected == gateways,
                "pods {pods:?}"
            );
            Ok(())
        },
    )
    .await
}

/// A chat completion for model-a through `pod`: its status and body.
async fn call_model_a(pod: &Pod) -> anyhow::Result<(u16, http::HeaderMap, Value)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let url = format!("http://{}:{PROXY_PORT}/v1/chat/completions", pod_ip(pod)?);
    let body = json!({"model": "model-a", "messages": [{"role": "user", "content": "hi"}]});
    let resp = client
        .post(&url)
        .header("x-api-key", "chart-test")
        .json(&body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json().await.unwrap_or(Value::Null);
    Ok((status, headers, body))
}

/// A chat completion for model-a through each gateway pod answers 200 from a model-a backend.
pub(crate) async fn call_through_every_gateway(
    ns: &TestNamespace,
    gateways: &[Pod],
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    for pod in gateways {
        let url = format!("http://{}:{PROXY_PORT}/v1/chat/completions", pod_ip(pod)?);
        let body = json!({"model": "model-a", "messages": [{"role": "user", "content": "hi"}]});
        let answer = eventually(
            "a call routed to model-a",
            Duration::from_secs(30),
            || async {
                let resp = client
                    .post(&url)
                    .header("x-api-key", "chart-test")
                    .json(&body)
                    .send()
                    .await?;
                let status = resp.status();
                let text = resp.text().await?;
                anyhow::ensure!(status == 200, "{status}: {text}");
                Ok(text)
            },
        )
        .await
        .with_context(|| format!("through {}", ns.name()))?;
        anyhow::ensure!(answer.contains("chat.completion"), "{answer}");
    }
    Ok(())
}

/// The admin credentials the release generated: the token, the admin certificate and key, and
/// the CA the operator trusts.
pub(crate) async fn admin_credentials(ns: &TestNamespace) -> anyhow::Result<Vec<Vec<u8>>> {
    let secrets: Api<Secret> = ns.api();
    let mut out = Vec::new();
    for (name, key) in [
        ("poolpilot-admin-token", "token"),
        ("poolpilot-gateway-admin-tls", "tls.crt"),
        ("poolpilot-gateway-admin-tls", "tls.key"),
        ("poolpilot-gateway-admin-ca", "ca.crt"),
    ] {
        let s = secrets.get(name).await?;
        let value = s.data.and_then(|d| d.get(key).cloned());
        out.push(
            value
                .with_context(|| format!("no {key} in Secret {name}"))?
                .0,
        );
    }
    Ok(out)
}

/// Everything of the release's instance label that is left in the namespace and the cluster.
async fn leftovers(ns: &TestNamespace, release: &str) -> anyhow::Result<Vec<String>> {
    let selector = format!("app.kubernetes.io/instance={release}");
    let namespaced = run(ns.cluster().kubectl().args([
        "get",
        "-n",
        ns.name(),
        "deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,poddisruptionbudgets",
        "-l",
        &selector,
        "-o",
        "name",
    ]))
    .await?;
    let cluster_scoped = run(ns.cluster().kubectl().args([
        "get",
        "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings",
        "-l",
        &selector,
        "-o",
        "name",
    ]))
    .await?;
    Ok(namespaced
        .lines()
        .chain(cluster_scoped.lines())
        .map(str::to_owned)
        .collect())
}

#[tokio::test]
async fn the_chart_installs_serves_upgrades_and_uninstalls_cleanly() -> anyhow::Result<()> {
    with_namespace("chart", async |ns| {
        let cluster = ns.cluster();
        cluster.install_crd().await?;
        // Unique per test namespace: the cluster-scoped RBAC of the chart must not meet that of
        // the kustomize base other tests apply.
        let release = ns.name().to_owned();
        let values = tempfile::NamedTempFile::new()?;
        std::fs::write(
            values.path(),
            serde_json::to_vec(&local_values(ns, &release)?)?,
        )?;
        // The node's CPU for the install at its largest: after the upgrade to three gateways.
        let mut largest = local_values(ns, &release)?;
        largest["gateway"]["replicas"] = json!(3);
        reserve_install(ns, &release, &largest, Some(ns)).await?;

        // What the chart renders, the apiserver accepts.
        let rendered = run(helm(cluster)
            .args(["template", &release])
            .arg(chart_dir())
            .args(["-n", ns.name(), "--kube-version", "1.37.2", "-f"])
            .arg(values.path()))
        .await?;
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), &rendered)?;
        run(cluster
            .kubectl()
            .args(["apply", "--dry-run=server", "-n", ns.name(), "-f"])
            .arg(file.path()))
        .await?;

        // Install: the operator and two gateways run, the sample policy is served end to end.
        // The release's roles aggregated into the built-in ones have the rules of the
        // manifests' (see `exclusive`): held until the uninstall has removed them.
        let _aggregation = BUILT_IN_ROLE_AGGREGATION.lock().await;
        deploy_backends(ns).await?;
        run(helm(cluster)
            .args(["install", &release])
            .arg(chart_dir())
            .args(["-n", ns.name(), "--wait=false", "-f"])
            .arg(values.path()))
        .await?;
        ready_pods(ns, "app.kubernetes.io/name=poolpilot-operator", 1).await?;
        ready_pods(ns, "app.kubernetes.io/name=model-a", 2).await?;
        let mut policy = quick_policy()?;
        set(&mut policy, "/metadata/namespace", json!(ns.name()))?;
        apply(ns, &policy).await?;
        wait_policy_ready(ns, 2).await?;
        let gateways = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 2).await?;
        call_through_every_gateway(ns, &gateways).await?;
        let credentials = admin_credentials(ns).await?;
        anyhow::ensure!(
            credentials[0].len() >= 32,
            "a generated token of {} bytes",
            credentials[0].len()
        );

        // Upgrade: a third gateway joins and gets its share (over HTTPS checked against the
        // generated CA); the generated token, certificate and CA are kept.
        run(helm(cluster)
            .args(["upgrade", &release])
            .arg(chart_dir())
            .args([
                "-n",
                ns.name(),
                "--reuse-values",
                "--set",
                "gateway.replicas=3",
            ]))
        .await?;
        wait_policy_ready(ns, 3).await?;
        let gateways = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 3).await?;
        call_through_every_gateway(ns, &gateways).await?;
        anyhow::ensure!(
            admin_credentials(ns).await? == credentials,
            "the upgrade replaced the admin credentials"
        );

        // Uninstall, after the policy (whose finalizer the operator removes): nothing of the
        // release is left, the CRD stays.
        let policies: Api<ConnectionPolicy> = ns.api();
        policies.delete("models", &DeleteParams::default()).await?;
        eventually("the policy is gone", WAIT, || async {
            anyhow::ensure!(
                policies
                    .list(&ListParams::default())
                    .await?
                    .items
                    .is_empty()
            );
            Ok(())
        })
        .await?;
        run(helm(cluster).args(["uninstall", &release, "-n", ns.name(), "--wait"])).await?;
        eventually("nothing of the release is left", WAIT, || async {
            let left = leftovers(ns, &release).await?;
            anyhow::ensure!(left.is_empty(), "left: {left:?}");
            Ok(())
        })
        .await?;
        run(cluster
            .kubectl()
            .args(["get", "crd", "connectionpolicies.poolpilot.io"]))
        .await
        .context("the CRD must outlive the release")?;
        Ok(())
    })
    .await
}

/// The objects of the chart's default rendering and of the kustomize bases, by kind and name
/// (the chart's names are the bases' with the default fullname "poolpilot").
async fn chart_and_bases() -> anyhow::Result<(BTreeMap<String, Value>, BTreeMap<String, Value>)> {
    let cluster = Cluster::shared().await?;
    let by_key = |objects: Vec<Value>| -> BTreeMap<String, Value> {
        objects
            .into_iter()
            .map(|o| {
                let key = format!(
                    "{}/{}",
                    o["kind"].as_str().unwrap_or_default(),
                    o["metadata"]["name"].as_str().unwrap_or_default()
                );
                (key, o)
            })
            .collect()
    };
    let chart = run(helm(cluster)
        .args(["template", "poolpilot"])
        .arg(chart_dir())
        .args(["--kube-version", "1.37.2"]))
    .await?;
    let mut bases = Vec::new();
    for base in ["operator", "gateway"] {
        let dir = workspace_root().join("manifests").join(base);
        bases.extend(documents(
            &run(cluster.kubectl().arg("kustomize").arg(dir)).await?,
        )?);
    }
    Ok((by_key(documents(&chart)?), by_key(bases)))
}

/// The parts of a Deployment that decide how its pods behave.
fn pod_behaviour(deployment: &Value) -> Value {
    let spec = &deployment["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    let args: BTreeSet<String> = c["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect();
    json!({
        "replicas": deployment["spec"]["replicas"],
        "strategy": deployment["spec"]["strategy"],
        "podLabel": deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
        "adminPort": deployment["spec"]["template"]["metadata"]["annotations"]["poolpilot.io/admin-port"],
        "scrape": deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"],
        "grace": spec["terminationGracePeriodSeconds"],
        "automount": spec["automountServiceAccountToken"],
        "podSecurity": spec["securityContext"],
        "args": args,
        "env": c["env"],
        "ports": c["ports"],
        "resources": c["resources"],
        "security": c["securityContext"],
        "probes": [c["startupProbe"], c["livenessProbe"], c["readinessProbe"]],
        "mounts": c["volumeMounts"],
    })
}

#[tokio::test]
async fn the_chart_and_the_kustomize_bases_deploy_the_same_thing() -> anyhow::Result<()> {
    let (chart, bases) = chart_and_bases().await?;
    // Flags the chart spells out although the bases leave them at the binary's default (that
    // these are the defaults is the operator's unit test
    // `the_charts_default_values_are_the_binarys_defaults`).
    let explicit_defaults = [
        "--concurrent-reconciles=8",
        "--rollout-concurrency=32",
        "--put-timeout=5s",
        "--status-refresh-rate=20",
        "--token-secret=poolpilot-admin-token",
        "--leader-election=true",
    ];
    for (key, base) in &bases {
        let kind = base["kind"].as_str().unwrap_or_default();
        if kind == "Namespace" {
            continue; // the chart installs into the release namespace
        }
        // kustomize hashes the config ConfigMap's name; the chart names it plainly.
        let chart_key = key
            .split_once("poolpilot-gateway-config-")
            .map_or(key.clone(), |(k, _)| format!("{k}poolpilot-gateway-config"));
        let ours = chart
            .get(&chart_key)
            .with_context(|| format!("the chart has no {chart_key}"))?;
        match kind {
            "ClusterRole" | "Role" => {
                assert_eq!(ours["rules"], base["rules"], "{key}: rules differ")
            }
            "Deployment" => {
                let mut a = pod_behaviour(ours);
                let b = pod_behaviour(base);
                let args = a["args"].as_array_mut().context("args")?;
                args.retain(|x| !explicit_defaults.contains(&x.as_str().unwrap_or_default()));
                assert_eq!(a, b, "{key}: pods differ");
            }
            "Service" => assert_eq!(ours["spec"]["ports"], base["spec"]["ports"], "{key}"),
            "PodDisruptionBudget" => {
                for field in ["minAvailable", "maxUnavailable"] {
                    assert_eq!(ours["spec"][field], base["spec"][field], "{key}: {field}");
                }
            }
            "NetworkPolicy" => {
                let ports = |np: &Value| -> Vec<Value> {
                    np["spec"]["ingress"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|rule| rule["ports"].clone())
                        .collect()
                };
                assert_eq!(ports(ours), ports(base), "{key}: ingress ports");
            }
            "ConfigMap" => {
                let parse = |cm: &Value| -> anyhow::Result<Value> {
                    Ok(serde_norway::from_str(
                        cm["data"]["gateway.yaml"].as_str().unwrap_or_default(),
                    )?)
                };
                assert_eq!(parse(ours)?, parse(base)?, "{key}: gateway.yaml");
            }
            "Secret" => {
                let keys = |s: &Value| -> Vec<String> {
                    s["data"]
                        .as_object()
                        .map(|d| d.keys().cloned().collect())
                        .unwrap_or_default()
                };
                assert_eq!(keys(ours), keys(base), "{key}: keys");
            }
            "ValidatingAdmissionPolicy" => {
                // The same rules; the chart matches its own ServiceAccount, the base any
                // ServiceAccount named poolpilot-operator.
                for field in [
                    "matchConstraints",
                    "variables",
                    "validations",
                    "failurePolicy",
                ] {
                    assert_eq!(ours["spec"][field], base["spec"][field], "{key}: {field}");
                }
            }
            "ValidatingAdmissionPolicyBinding" => {
                assert_eq!(
                    ours["spec"]["validationActions"], base["spec"]["validationActions"],
                    "{key}"
                )
            }
            "ServiceAccount" | "ClusterRoleBinding" | "RoleBinding" => {}
            other => anyhow::bail!("{key}: no comparison for a {other} yet"),
        }
    }
    // And nothing the bases lack, but what the chart adds on purpose: the admin credentials,
    // which a kustomize install creates by hand (docs/deploying.md) and the chart generates once.
    let on_purpose = [
        "Secret/poolpilot-admin-token",
        "Secret/poolpilot-gateway-admin-tls",
        "Secret/poolpilot-gateway-admin-ca",
    ];
    let extra: Vec<&String> = chart
        .keys()
        .filter(|k| !bases.keys().any(|b| b.starts_with(k.as_str())))
        .filter(|k| !on_purpose.contains(&k.as_str()))
        .collect();
    anyhow::ensure!(extra.is_empty(), "only the chart has {extra:?}");
    Ok(())
}

/// The chart carries copies of files kept elsewhere (a chart cannot read outside its folder); its
/// CRD copy is checked by a unit test of the crds crate.
#[test]
fn the_charts_copies_match_their_sources() -> anyhow::Result<()> {
    let root = workspace_root();
    for (copy, source) in [
        (
            "charts/poolpilot/files/poolpilot.rules.yaml",
            "manifests/monitoring/rules/poolpilot.rules.yaml",
        ),
        (
            "charts/poolpilot/files/poolpilot-saturation.json",
            "manifests/monitoring/dashboards/poolpilot-saturation.json",
        ),
    ] {
        let read = |p: &str| std::fs::read_to_string(root.join(p)).with_context(|| p.to_owned());
        anyhow::ensure!(
            read(copy)? == read(source)?,
            "{copy} differs from {source}: run `make crds` (it refreshes the chart's copies)"
        );
    }
    Ok(())
}

/// A fresh install with no policy passes `helm install --wait`: the gateways are Ready and say
/// why they cannot route (503 `no_backends`). A policy of any name then reaches them, and its
/// tuned limits land in the ConfigMap the gateways mount (named by their pods' annotation, not
/// by the policy): a gateway restarted while the operator is down serves them.
#[tokio::test]
async fn a_fresh_install_is_ready_and_any_policy_survives_a_restart_without_the_operator()
-> anyhow::Result<()> {
    with_namespace("chart-fresh", async |ns| {
        let cluster = ns.cluster();
        cluster.install_crd().await?;
        let release = ns.name().to_owned();
        let mut values = local_values(ns, &release)?;
        values["gateway"]["replicas"] = json!(1);
        values["gateway"]["awaitOperator"] = json!("3s");
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(&values)?)?;
        reserve_install(ns, &release, &values, Some(ns)).await?;
        let _aggregation = BUILT_IN_ROLE_AGGREGATION.lock().await;
        deploy_backends(ns).await?;
        // No policy exists: `--wait` waits for every Deployment to be Ready, gateways included.
        run(helm(cluster)
            .args(["install", &release])
            .arg(chart_dir())
            .args(["-n", ns.name(), "--wait", "--timeout=150s", "-f"])
            .arg(file.path()))
        .await
        .context("helm install --wait with no policy")?;
        let gateways = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 1).await?;
        let (status, headers, body) = call_model_a(&gateways[0]).await?;
        anyhow::ensure!(
            status == 503 && body["error"]["code"] == "no_backends",
            "{status}: {body}"
        );
        anyhow::ensure!(headers.contains_key("retry-after"), "{headers:?}");

        // A policy not named after the sample.
        ready_pods(ns, "app.kubernetes.io/name=model-a", 2).await?;
        let mut policy = quick_policy()?;
        set(&mut policy, "/metadata/namespace", json!(ns.name()))?;
        set(&mut policy, "/metadata/name", json!("chat"))?;
        apply(ns, &policy).await?;
        wait_named_policy_ready(ns, "chat", 1).await?;
        call_through_every_gateway(ns, &gateways).await?;
        let fleet_map = format!("{release}-gateway-limits");
        let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> = ns.api();
        let durable = eventually("the fleet's limits ConfigMap", WAIT, || async {
            let cm = configmaps.get(&fleet_map).await?;
            let doc = cm
                .data
                .as_ref()
                .and_then(|d| d.get("limits.json"))
                .context("no limits.json")?;
            let doc: Value = serde_json::from_str(doc)?;
            anyhow::ensure!(
                doc["backends"].as_array().is_some_and(|b| !b.is_empty()),
                "{doc}"
            );
            Ok(cm)
        })
        .await?;
        anyhow::ensure!(
            durable
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.name == "chat" && o.controller == Some(true)),
            "owned by the policy: {:?}",
            durable.metadata.owner_references
        );

        // The operator goes away; a gateway restarts and serves the ConfigMap's limits.
        run(cluster.kubectl().args([
            "scale",
            "-n",
            ns.name(),
            &format!("deployment/{release}-operator"),
            "--replicas=0",
        ]))
        .await?;
        eventually("the operator is gone", WAIT, || async {
            let pods: Api<Pod> = ns.api();
            let left = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=poolpilot-operator"))
                .await?
                .items;
            anyhow::ensure!(left.is_empty(), "{} operator pods", left.len());
            Ok(())
        })
        .await?;
        let pods: Api<Pod> = ns.api();
        let old = gateways[0].metadata.name.clone().context("a name")?;
        pods.delete(&old, &DeleteParams::default()).await?;
        let restarted = eventually("a new gateway pod Ready", WAIT, || async {
            let ready = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 1).await?;
            anyhow::ensure!(ready[0].metadata.name.as_deref() != Some(old.as_str()));
            Ok(ready)
        })
        .await?;
        call_through_every_gateway(ns, &restarted).await?;

        let policies: Api<ConnectionPolicy> = ns.api();
        // The operator back, the policy goes; then the release.
        run(cluster.kubectl().args([
            "scale",
            "-n",
            ns.name(),
            &format!("deployment/{release}-operator"),
            "--replicas=1",
        ]))
        .await?;
        policies.delete("chat", &DeleteParams::default()).await?;
        eventually("the policy is gone", WAIT, || async {
            anyhow::ensure!(policies.get_opt("chat").await?.is_none());
            Ok(())
        })
        .await?;
        run(helm(cluster).args(["uninstall", &release, "-n", ns.name(), "--wait"])).await?;
        Ok(())
    })
    .await
}

/// A backend whose Service lives in another namespace: allowed by `operator.backendNamespaces`,
/// its pods are the endpoints (each its own cap) and calls reach them; a namespace not listed
/// is refused in status (`Accepted=False`, reason `NamespaceNotAllowed`) and nothing of that
/// policy reaches the gateways.
#[tokio::test]
async fn a_backend_in_another_namespace_is_served_when_allowed_and_refused_when_not()
-> anyhow::Result<()> {
    with_namespace("chart-xns", async |ns| {
        with_namespace("chart-xns-llm", async |backends| {
            let cluster = ns.cluster();
            cluster.install_crd().await?;
            let release = ns.name().to_owned();
            let mut values = local_values(ns, &release)?;
            values["gateway"]["replicas"] = json!(1);
            values["operator"]["backendNamespaces"] = json!([backends.name()]);
            let file = tempfile::NamedTempFile::new()?;
            std::fs::write(file.path(), serde_json::to_vec(&values)?)?;
            reserve_install(ns, &release, &values, Some(backends)).await?;
            let _aggregation = BUILT_IN_ROLE_AGGREGATION.lock().await;
            deploy_backends(backends).await?;
            run(helm(cluster)
                .args(["install", &release])
                .arg(chart_dir())
                .args(["-n", ns.name(), "--wait=false", "-f"])
                .arg(file.path()))
            .await?;
            ready_pods(ns, "app.kubernetes.io/name=poolpilot-operator", 1).await?;
            ready_pods(backends, "app.kubernetes.io/name=model-a", 2).await?;

            let mut policy = quick_policy()?;
            set(&mut policy, "/metadata/namespace", json!(ns.name()))?;
            // Only model-a, in the other namespace.
            let mut model_a = policy["spec"]["backends"][0].clone();
            model_a["endpoints"]["service"]["namespace"] = json!(backends.name());
            set(&mut policy, "/spec/backends", json!([model_a]))?;
            apply(ns, &policy).await?;
            wait_policy_ready(ns, 1).await?;
            let gateways = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 1).await?;
            call_through_every_gateway(ns, &gateways).await?;
            let policies: Api<ConnectionPolicy> = ns.api();
            let status = policies.get("models").await?.status.unwrap_or_default();
            let endpoints: Vec<u32> = status.backends.iter().map(|b| b.endpoints).collect();
            anyhow::ensure!(
                endpoints == [2],
                "two model-a pods as endpoints: {endpoints:?}"
            );

            // A namespace not listed: refused, with the reason and the namespace named.
            let mut other = quick_policy()?;
            set(&mut other, "/metadata/namespace", json!(ns.name()))?;
            set(&mut other, "/metadata/name", json!("elsewhere"))?;
            let mut model_z = other["spec"]["backends"][0].clone();
            model_z["name"] = json!("model-z");
            model_z["match"] = json!({"pathPrefix": "/v1/", "model": "model-z"});
            model_z["endpoints"]["service"]["namespace"] = json!("kube-system");
            set(&mut other, "/spec/backends", json!([model_z]))?;
            apply(ns, &other).await?;
            eventually("elsewhere refused", WAIT, || async {
                let p = policies.get("elsewhere").await?;
                let status = p.status.clone().unwrap_or_default();
                let accepted = status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Accepted")
                    .context("no Accepted condition")?;
                anyhow::ensure!(
                    accepted.status == "False"
                        && accepted.reason == "NamespaceNotAllowed"
                        && accepted.message.contains("kube-system"),
                    "{accepted:?}"
                );
                Ok(())
            })
            .await?;
            // The allowed policy is untouched.
            call_through_every_gateway(ns, &gateways).await?;

            for name in ["models", "elsewhere"] {
                policies.delete(name, &DeleteParams::default()).await?;
            }
            eventually("the policies are gone", WAIT, || async {
                anyhow::ensure!(
                    policies
                        .list(&ListParams::default())
                        .await?
                        .items
                        .is_empty()
                );
                Ok(())
            })
            .await?;
            run(helm(cluster).args(["uninstall", &release, "-n", ns.name(), "--wait"])).await?;
            Ok(())
        })
        .await
    })
    .await
}
