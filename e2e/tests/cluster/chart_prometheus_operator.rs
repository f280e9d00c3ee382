//! The chart's PodMonitor with the real prometheus-operator (built from the module pinned in
//! e2e/prometheus-operator) and the real Prometheus: the operator, run against the embedded
//! cluster, turns a `Prometheus` resource into a StatefulSet with its generated configuration
//! (the gzipped config Secret, the TLS-assets Secret holding the CA the PodMonitor names); its
//! pod runs our Prometheus with prometheus-operator's config reloader, and nothing else
//! configures that Prometheus. The chart installed with its PodMonitor on → the gateways are
//! scraped over HTTPS (their certificate checked against the admin CA) and the operator over
//! HTTP → the sample policy reaches `MetricsAvailable=True` and a Progressive rollout, whose
//! canary is judged on those scrapes, completes.
//!
//! The node gives each pod a network namespace of its own, so the StatefulSet runs as generated,
//! from the images of `make prometheus-images`.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::credentials::AdminCredentials;
use poolpilot_e2e::paths::{prometheus_operator_bin, prometheus_operator_crds};
use poolpilot_e2e::stack::{GatewayPod, pod_ip, quick_policy, set};
use poolpilot_e2e::{TestNamespace, eventually, with_namespace};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::chart::{
    admin_credentials, apply, call_through_every_gateway, chart_dir, deploy_backends, helm,
    local_values, ready_pods, reserve_install, wait_named_policy_ready,
};

const WAIT: Duration = Duration::from_secs(180);
/// The `Prometheus` resource; its StatefulSet is `prometheus-<name>`, its pod `prometheus-<name>-0`.
const PROMETHEUS: &str = "poolpilot-e2e";
/// The version of the Prometheus `make cluster` builds (e2e/prometheus/go.mod), which the
/// operator must know to generate a configuration for it.
const PROMETHEUS_VERSION: &str = "v3.16.0";
/// The label kube-prometheus-stack's Prometheus selects PodMonitors by, with its release name
/// (the chart's default `monitoring.podMonitor.labels`).
const STACK_LABEL: (&str, &str) = ("release", "kube-prometheus-stack");

/// Applies prometheus-operator's CRDs of what a Prometheus scrapes and waits until they serve.
async fn install_crds(ns: &TestNamespace) -> anyhow::Result<()> {
    let cluster = ns.cluster();
    let dir = prometheus_operator_crds();
    anyhow::ensure!(
        dir.join("monitoring.coreos.com_prometheuses.yaml")
            .is_file(),
        "no prometheus-operator CRDs in {}: run `make cluster`",
        dir.display()
    );
    // The CRDs the operator's Prometheus controller watches (it leaves out the controllers
    // whose CRD is missing: Alertmanager, ThanosRuler, PrometheusAgent, ScrapeConfig), applied
    // server-side (too large for the last-applied annotation); other tests apply some of them
    // at the same time, which a retry settles.
    const CRDS: [&str; 5] = [
        "prometheuses",
        "podmonitors",
        "servicemonitors",
        "probes",
        "prometheusrules",
    ];
    eventually("prometheus-operator's CRDs applied", WAIT, || async {
        let mut apply = cluster.kubectl();
        apply.args(["apply", "--server-side", "--force-conflicts"]);
        for crd in CRDS {
            apply
                .arg("-f")
                .arg(dir.join(format!("monitoring.coreos.com_{crd}.yaml")));
        }
        run(&mut apply).await
    })
    .await?;
    let mut wait = cluster.kubectl();
    wait.args(["wait", "--for=condition=Established", "--timeout=60s"]);
    for crd in CRDS {
        wait.arg(format!("crd/{crd}.monitoring.coreos.com"));
    }
    run(&mut wait).await?;
    Ok(())
}

/// What Prometheus' Kubernetes discovery needs in the namespace, as kube-prometheus-stack grants
/// it (there cluster-wide): a ServiceAccount that may read pods, Services and their endpoints.
fn prometheus_identity(ns: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "prometheus", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "prometheus", "namespace": ns},
         "rules": [
            {"apiGroups": [""], "resources": ["pods", "services", "endpoints"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "prometheus", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": ns}]},
    ]})
}

/// The images of Prometheus and the reloader that `make prometheus-images` built and `cluster
/// up` imported into the node.
const PROMETHEUS_IMAGE: &str = "docker.io/poolpilot/prometheus:local";
const RELOADER_IMAGE: &str = "docker.io/poolpilot/prometheus-config-reloader:local";

/// prometheus-operator as a process of this machine, watching only `ns`, with the admin
/// kubeconfig; its log (in the cluster's folder, which outlives the test) goes into the
/// namespace's dump.
fn start_operator(
    ns: &TestNamespace,
    reloader_image: &str,
) -> anyhow::Result<tokio::process::Child> {
    let bin = prometheus_operator_bin();
    anyhow::ensure!(
        bin.is_file(),
        "no prometheus-operator at {}: run `make cluster`",
        bin.display()
    );
    let log = ns
        .cluster()
        .dir()
        .join(format!("prometheus-operator-{}.log", ns.name()));
    let out = std::fs::File::create(&log)?;
    ns.dump_on_failure("prometheus-operator", &log);
    let mut cmd = tokio::process::Command::new(bin);
    cmd.env_clear()
        .env("KUBECONFIG", ns.cluster().kubeconfig())
        .arg(format!("--namespaces={}", ns.name()))
        .arg("--web.listen-address=127.0.0.1:0")
        .arg(format!("--prometheus-config-reloader={reloader_image}"));
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true);
    Ok(cmd.spawn()?)
}

/// The `Prometheus` resource kube-prometheus-stack would make, scaled to this test: its
/// PodMonitors by the stack's label, in its own namespace, scraping every 2 s.
fn prometheus_resource(ns: &str, image: &str, replicas: u32) -> Value {
    json!({
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": PROMETHEUS, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "image": image,
            "version": PROMETHEUS_VERSION,
            "serviceAccountName": "prometheus",
            "podMonitorSelector": {"matchLabels": {STACK_LABEL.0: STACK_LABEL.1}},
            "scrapeInterval": "2s",
            "evaluationInterval": "2s",
            "retention": "1h",
        },
    })
}

/// Creates the `Prometheus` resource and waits until its pod is Ready; returns its URL.
async fn start_prometheus(ns: &TestNamespace, image: &str) -> anyhow::Result<String> {
    apply(ns, &prometheus_resource(ns.name(), image, 1)).await?;
    let sts = format!("prometheus-{PROMETHEUS}");
    let pods: Api<Pod> = ns.api();
    let pod = format!("{sts}-0");
    let ready = eventually("the Prometheus pod Ready", WAIT, || async {
        let p = pods.get(&pod).await?;
        anyhow::ensure!(poolpilot_e2e::stack::is_ready(&p), "{:?}", p.status);
        Ok(p)
    })
    .await?;
    Ok(format!("http://{}:9090", pod_ip(&ready)?))
}

/// Prometheus' active targets of the namespace, once there are `count` of them, all up.
async fn targets_up(prometheus: &str, ns: &str, count: usize) -> anyhow::Result<Vec<Value>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    eventually("every target up", WAIT, || async {
        let body: Value = client
            .get(format!("{prometheus}/api/v1/targets"))
            .query(&[("state", "active")])
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let targets: Vec<Value> = body["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t["labels"]["namespace"] == ns)
            .collect();
        let summary: Vec<String> = targets
            .iter()
            .map(|t| {
                format!(
                    "{} {} {}",
                    t["scrapeUrl"].as_str().unwrap_or_default(),
                    t["health"].as_str().unwrap_or_default(),
                    t["lastError"].as_str().unwrap_or_default()
                )
            })
            .collect();
        anyhow::ensure!(
            targets.len() == count && targets.iter().all(|t| t["health"] == "up"),
            "{count} targets up wanted: {summary:#?}"
        );
        Ok(targets)
    })
    .await
}

/// The configuration Prometheus runs (`/api/v1/status/config`), parsed.
async fn running_config(prometheus: &str) -> anyhow::Result<Value> {
    let body: Value = reqwest::get(format!("{prometheus}/api/v1/status/config"))
        .await?
        .error_for_status()?
        .json()
        .await?;
    let yaml = body["data"]["yaml"].as_str().context("no config")?;
    Ok(serde_norway::from_str(yaml)?)
}

/// Waits until the policy has `MetricsAvailable=True` for its generation.
async fn wait_metrics_available(ns: &TestNamespace, name: &str) -> anyhow::Result<()> {
    let policies: Api<ConnectionPolicy> = ns.api();
    eventually("MetricsAvailable=True", WAIT, || async {
        let p = policies.get(name).await?;
        let status = p.status.clone().unwrap_or_default();
        let c = status
            .conditions
            .iter()
            .find(|c| c.type_ == "MetricsAvailable");
        anyhow::ensure!(
            c.is_some_and(|c| c.status == "True" && c.observed_generation == p.metadata.generation),
            "MetricsAvailable: {c:?}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn prometheus_operator_scrapes_the_charts_podmonitor_over_https_and_a_progressive_rollout_completes()
-> anyhow::Result<()> {
    with_namespace("chart-promop", async |ns| {
        let cluster = ns.cluster();
        let started = Instant::now();
        cluster.install_crd().await?;
        install_crds(ns).await?;
        apply(ns, &prometheus_identity(ns.name())).await?;
        // The chart as a kube-prometheus-stack user installs it: the PodMonitor by default (the
        // cluster serves its CRD), no scrape annotations, the operator reading the Prometheus
        // started below. The node's CPU is reserved for the release and the backends first.
        let release = ns.name().to_owned();
        let mut values = local_values(ns, &release)?;
        values["monitoring"] = json!({"podAnnotations": false});
        // Nothing aggregated into the built-in roles: no turn to wait for (see `exclusive`).
        values["rbac"] = json!({"aggregateToDefaultRoles": false});
        reserve_install(ns, &release, &values, Some(ns)).await?;

        let _operator = start_operator(ns, RELOADER_IMAGE)?;
        // The sample backends start meanwhile.
        let (prometheus, ()) =
            tokio::try_join!(start_prometheus(ns, PROMETHEUS_IMAGE), deploy_backends(ns))?;
        println!(
            "figure prometheus_operator: Prometheus of the operator Ready at {prometheus} after {:.1} s",
            started.elapsed().as_secs_f64()
        );
        values["operator"]["prometheus"]["url"] = json!(prometheus);
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(&values)?)?;
        run(helm(cluster)
            .args(["install", &release])
            .arg(chart_dir())
            .args(["-n", ns.name(), "--wait=false", "-f"])
            .arg(file.path()))
        .await?;
        let monitors = run(cluster.kubectl().args([
            "get",
            "podmonitors.monitoring.coreos.com",
            "-n",
            ns.name(),
            "-o",
            "name",
        ]))
        .await?;
        anyhow::ensure!(
            monitors.trim() == format!("podmonitor.monitoring.coreos.com/{release}"),
            "the chart's PodMonitor, rendered by default: {monitors:?}"
        );
        ready_pods(ns, "app.kubernetes.io/name=poolpilot-operator", 1).await?;
        ready_pods(ns, "app.kubernetes.io/name=model-a", 2).await?;
        let gateways = ready_pods(ns, "app.kubernetes.io/name=poolpilot-gateway", 2).await?;

        // Two gateways on their admin port over HTTPS, the operator on its metrics port.
        let targets = targets_up(&prometheus, ns.name(), 3).await?;
        let scrape_urls: Vec<&str> = targets
            .iter()
            .filter_map(|t| t["scrapeUrl"].as_str())
            .collect();
        for g in &gateways {
            let url = format!("https://{}:9901/metrics", pod_ip(g)?);
            anyhow::ensure!(scrape_urls.contains(&url.as_str()), "{url} in {scrape_urls:?}");
        }
        anyhow::ensure!(
            scrape_urls.iter().filter(|u| u.starts_with("http://")).count() == 1,
            "the operator over HTTP: {scrape_urls:?}"
        );
        // Each from the PodMonitor's endpoint, in the configuration the operator generated:
        // the admin port's job verifies the certificate against the CA the operator copied
        // from the chart's Secret into the TLS assets, for the name the certificate carries.
        for t in &targets {
            let pool = t["scrapePool"].as_str().unwrap_or_default();
            let https = t["scrapeUrl"].as_str().is_some_and(|u| u.starts_with("https://"));
            let want = format!("podMonitor/{}/{release}/{}", ns.name(), if https { 0 } else { 1 });
            anyhow::ensure!(pool == want, "scrape pool {pool:?}, wanted {want:?}");
        }
        // What a user does to look at it: `kubectl port-forward` to the Prometheus pod, through
        // the kubelet and containerd, and a query there.
        let (_forward, local) = cluster
            .port_forward(ns.name(), &format!("pod/prometheus-{PROMETHEUS}-0"), 9090)
            .await?;
        let up: Value = reqwest::Client::new()
            .get(format!("http://{local}/api/v1/query"))
            .query(&[("query", format!("up{{namespace=\"{}\"}} == 1", ns.name()))])
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let series = up["data"]["result"].as_array().map_or(0, Vec::len);
        anyhow::ensure!(series == 3, "3 targets up through kubectl port-forward: {up}");
        let config = running_config(&prometheus).await?;
        let job = config["scrape_configs"]
            .as_array()
            .and_then(|jobs| {
                let name = format!("podMonitor/{}/{release}/0", ns.name());
                jobs.iter().find(|j| j["job_name"] == name.as_str())
            })
            .with_context(|| format!("no job of the PodMonitor in {config}"))?;
        let ca_file = job["tls_config"]["ca_file"].as_str().unwrap_or_default();
        anyhow::ensure!(
            job["scheme"] == "https"
                && ca_file.starts_with("/etc/prometheus/certs/")
                && job["tls_config"]["server_name"]
                    == format!("poolpilot-gateway-admin.{}.svc", ns.name()).as_str()
                && job["tls_config"]["insecure_skip_verify"] != true,
            "the admin port's job: {job}"
        );
        // That file is the chart's CA, as the operator copied it into the TLS assets.
        let secrets: Api<Secret> = ns.api();
        let assets = secrets
            .get(&format!("prometheus-{PROMETHEUS}-tls-assets-0"))
            .await?;
        let key = ca_file.trim_start_matches("/etc/prometheus/certs/");
        let copied = assets.data.as_ref().and_then(|d| d.get(key));
        let chart_ca = secrets.get("poolpilot-gateway-admin-ca").await?;
        anyhow::ensure!(
            copied.is_some() && copied == chart_ca.data.as_ref().and_then(|d| d.get("ca.crt")),
            "{key} of the TLS assets is not the chart's CA"
        );
        println!(
            "figure prometheus_operator: targets up after {:.1} s: {scrape_urls:?}",
            started.elapsed().as_secs_f64()
        );

        // The sample policy, its rollout Progressive with its canary verified for two
        // intervals: the canary is judged on what Prometheus scraped of it.
        let mut policy = quick_policy()?;
        set(&mut policy, "/metadata/namespace", json!(ns.name()))?;
        set(
            &mut policy,
            "/spec/rollout",
            json!({"strategy": "Progressive", "canaryPods": 1, "verifyIntervals": 2}),
        )?;
        apply(ns, &policy).await?;
        wait_named_policy_ready(ns, "models", 2).await?;
        wait_metrics_available(ns, "models").await?;
        call_through_every_gateway(ns, &gateways).await?;
        println!(
            "figure prometheus_operator: MetricsAvailable=True, first document on both gateways after {:.1} s",
            started.elapsed().as_secs_f64()
        );

        // An edit: a new document, the canary first, verified, then the other gateway (each
        // gateway's document read from its admin API, with the release's credentials).
        let secrets = admin_credentials(ns).await?;
        let text = |i: usize| String::from_utf8(secrets[i].clone());
        let credentials = Arc::new(AdminCredentials {
            namespace: ns.name().to_owned(),
            token: text(0)?,
            cert_pem: text(1)?,
            key_pem: text(2)?,
            ca_pem: text(3)?,
        });
        let pods = gateways
            .iter()
            .map(|g| GatewayPod::of(g, &credentials))
            .collect::<anyhow::Result<Vec<_>>>()?;
        set(&mut policy, "/spec/backends/0/pool/maxPending", json!(200))?;
        apply(ns, &policy).await?;
        let edited = Instant::now();
        let mut took: Vec<Option<Duration>> = vec![None; pods.len()];
        while took.iter().any(Option::is_none) {
            anyhow::ensure!(
                edited.elapsed() < WAIT,
                "the edit did not reach both gateways within {WAIT:?}: {took:?}"
            );
            for (i, pod) in pods.iter().enumerate() {
                if took[i].is_none() {
                    let limits = pod.limits().await?;
                    if limits.backends.first().is_some_and(|b| b.pool.max_pending == 200) {
                        took[i] = Some(edited.elapsed());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut took: Vec<Duration> = took.into_iter().flatten().collect();
        took.sort();
        // The other gateway followed the canary only after its verification: 2 × the 5 s
        // interval, judged on what Prometheus scraped of the canary.
        anyhow::ensure!(
            took[1] >= took[0] + Duration::from_secs(9),
            "the rest did not wait for the canary's verification (10 s): {took:?}"
        );
        wait_named_policy_ready(ns, "models", 2).await?;
        wait_metrics_available(ns, "models").await?;
        println!(
            "figure prometheus_operator: the edit on the canary at {:.1} s, on the other gateway at {:.1} s; {:.1} s in all",
            took[0].as_secs_f64(),
            took[1].as_secs_f64(),
            started.elapsed().as_secs_f64()
        );

        let policies: Api<ConnectionPolicy> = ns.api();
        policies.delete("models", &DeleteParams::default()).await?;
        eventually("the policy is gone", WAIT, || async {
            anyhow::ensure!(policies.get_opt("models").await?.is_none());
            Ok(())
        })
        .await?;
        run(helm(cluster).args(["uninstall", &release, "-n", ns.name(), "--wait"])).await?;
        Ok(())
    })
    .await
}
