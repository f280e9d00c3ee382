//! What the chart's values render (charts/poolpilot, `helm template` with the real `helm`), and
//! that its prometheus-operator objects are what the real prometheus-operator's CRDs accept: the
//! CRDs of the module pinned in e2e/prometheus-operator, applied to the embedded cluster, and
//! the chart's PodMonitor and PrometheusRule server-side applied against them with strict field
//! validation (a field the CRD does not know fails the apply instead of being dropped).

use anyhow::Context as _;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::paths::{helm_bin, prometheus_operator_crds};
use poolpilot_e2e::{TestNamespace, with_namespace};
use serde_json::Value;

use crate::chart::{chart_dir, documents};

/// `helm template <release>` of the chart in namespace `ns` with `args` (`--set ...`), as JSON
/// documents.
pub(crate) async fn render(release: &str, ns: &str, args: &[&str]) -> anyhow::Result<Vec<Value>> {
    let mut cmd = tokio::process::Command::new(helm_bin());
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    cmd.args(["template", release])
        .arg(chart_dir())
        .args(["-n", ns, "--kube-version", "1.37.2"])
        .args(args);
    documents(&run(&mut cmd).await?)
}

/// The rendered object of `kind`, if there is one.
fn find<'a>(objects: &'a [Value], kind: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind)
}

/// Whether every field of `rendered` is in `stored` with the same value (the apiserver may add
/// defaults, never drop a field: a structural schema prunes the fields it does not know).
fn contained(rendered: &Value, stored: &Value) -> bool {
    match (rendered, stored) {
        (Value::Object(a), Value::Object(b)) => a
            .iter()
            .all(|(k, v)| b.get(k).is_some_and(|w| contained(v, w))),
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(v, w)| contained(v, w))
        }
        (a, b) => a == b,
    }
}

/// Applies prometheus-operator's CRDs as its release documents (server-side: they are too large
/// for the last-applied annotation) and waits until PodMonitor and PrometheusRule serve.
async fn install_prometheus_operator_crds(ns: &TestNamespace) -> anyhow::Result<()> {
    let cluster = ns.cluster();
    let dir = prometheus_operator_crds();
    anyhow::ensure!(
        dir.join("monitoring.coreos.com_podmonitors.yaml").is_file(),
        "no prometheus-operator CRDs in {}: run `make cluster`",
        dir.display()
    );
    for crd in ["podmonitors", "prometheusrules"] {
        let file = dir.join(format!("monitoring.coreos.com_{crd}.yaml"));
        poolpilot_e2e::eventually(
            "prometheus-operator's CRD applied",
            std::time::Duration::from_secs(60),
            || async {
                run(cluster
                    .kubectl()
                    .args(["apply", "--server-side", "--force-conflicts", "-f"])
                    .arg(&file))
                .await
            },
        )
        .await?;
        run(cluster.kubectl().args([
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &format!("crd/{crd}.monitoring.coreos.com"),
        ]))
        .await?;
    }
    Ok(())
}

#[tokio::test]
async fn the_podmonitor_scrapes_the_admin_port_over_https_and_prometheus_operator_accepts_it()
-> anyhow::Result<()> {
    with_namespace("chart-monitoring", async |ns| {
        install_prometheus_operator_crds(ns).await?;
        let objects = render(
            "poolpilot",
            ns.name(),
            &[
                "--set",
                "monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true",
                "--set",
                "monitoring.podMonitor.relabelings[0].targetLabel=cluster",
                "--set",
                "monitoring.podMonitor.relabelings[0].replacement=test",
            ],
        )
        .await?;
        let monitor = find(&objects, "PodMonitor").context("no PodMonitor rendered")?;
        let endpoints = monitor["spec"]["podMetricsEndpoints"]
            .as_array()
            .context("podMetricsEndpoints")?;
        let admin = endpoints
            .iter()
            .find(|e| e["port"] == "admin")
            .context("no admin endpoint")?;
        // The admin port speaks only HTTPS; its certificate is for the Service name, not the
        // pod IP Prometheus dials, and is checked against the chart's CA Secret.
        assert_eq!(admin["scheme"], "https", "{admin}");
        assert_eq!(
            admin["tlsConfig"]["ca"]["secret"],
            serde_json::json!({"name": "poolpilot-gateway-admin-ca", "key": "ca.crt"}),
            "{admin}"
        );
        assert_eq!(
            admin["tlsConfig"]["serverName"],
            format!("poolpilot-gateway-admin.{}.svc", ns.name()),
        );
        assert_eq!(admin["relabelings"][0]["targetLabel"], "cluster");
        // The operator's interval is the PodMonitor's (samples older than two count as missing).
        for e in endpoints {
            assert_eq!(e["interval"], "15s", "{e}");
        }
        let operator = endpoints
            .iter()
            .find(|e| e["port"] == "metrics")
            .context("no operator endpoint")?;
        assert!(operator["scheme"].is_null(), "the operator's port is HTTP");

        // The real CRDs accept both objects field for field.
        for kind in ["PodMonitor", "PrometheusRule"] {
            let object = find(&objects, kind).with_context(|| format!("no {kind}"))?;
            let file = tempfile::NamedTempFile::new()?;
            std::fs::write(file.path(), serde_json::to_vec(object)?)?;
            run(ns
                .cluster()
                .kubectl()
                .args([
                    "apply",
                    "--server-side",
                    "--validate=strict",
                    "--field-manager=helm",
                    "-n",
                    ns.name(),
                    "-f",
                ])
                .arg(file.path()))
            .await
            .with_context(|| format!("prometheus-operator's CRD refuses the chart's {kind}"))?;
            let name = object["metadata"]["name"].as_str().unwrap_or_default();
            let stored: Value = serde_json::from_str(
                &run(ns.cluster().kubectl().args([
                    "get",
                    "-n",
                    ns.name(),
                    &format!("{}.monitoring.coreos.com/{name}", kind.to_lowercase()),
                    "-o",
                    "json",
                ]))
                .await?,
            )?;
            anyhow::ensure!(
                contained(&object["spec"], &stored["spec"]),
                "{kind}: the CRD pruned fields of {}\nstored: {}",
                object["spec"],
                stored["spec"]
            );
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_podmonitor_is_rendered_by_default_where_prometheus_operator_runs() -> anyhow::Result<()>
{
    let has = |objects: &[Value]| find(objects, "PodMonitor").is_some();
    let plain = render("poolpilot", "poolpilot", &[]).await?;
    assert!(
        !has(&plain),
        "no PodMonitor without prometheus-operator's CRD"
    );
    let stack = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"];
    assert!(has(&render("poolpilot", "poolpilot", &stack).await?));
    let off = [
        "--api-versions",
        "monitoring.coreos.com/v1/PodMonitor",
        "--set",
        "monitoring.podMonitor.enabled=false",
    ];
    assert!(!has(&render("poolpilot", "poolpilot", &off).await?));
    // The interval follows the operator's scrape interval unless set.
    let objects = render(
        "poolpilot",
        "poolpilot",
        &[
            "--api-versions",
            "monitoring.coreos.com/v1/PodMonitor",
            "--set",
            "operator.prometheus.scrapeInterval=30s",
        ],
    )
    .await?;
    let monitor = find(&objects, "PodMonitor").context("PodMonitor")?;
    assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["interval"], "30s");
    // A TLS configuration of one's own replaces the CA check.
    let objects = render(
        "poolpilot",
        "poolpilot",
        &[
            "--set",
            "monitoring.podMonitor.enabled=true,monitoring.podMonitor.tlsConfig.insecureSkipVerify=true",
        ],
    )
    .await?;
    let monitor = find(&objects, "PodMonitor").context("PodMonitor")?;
    assert_eq!(
        monitor["spec"]["podMetricsEndpoints"][0]["tlsConfig"],
        serde_json::json!({"insecureSkipVerify": true})
    );
    Ok(())
}

/// What `helm template` (Argo CD) renders with the credentials managed outside the chart
/// (`adminToken.existingSecret`, `adminTls.existingSecrets`): the same objects every time, no
/// Secret, and the pods pointing at the Secrets named. With generated credentials each
/// `helm template` renders new ones (there is no cluster to look up): only the Secrets differ.
#[tokio::test]
async fn helm_template_is_stable_with_existing_secrets() -> anyhow::Result<()> {
    let gitops = [
        "--set",
        "adminToken.existingSecret=true,adminToken.secretName=gw-token",
        "--set",
        "adminTls.existingSecrets=true,adminTls.secretName=gw-admin-tls,adminTls.caSecretName=gw-admin-ca",
    ];
    let first = render("poolpilot", "poolpilot", &gitops).await?;
    let second = render("poolpilot", "poolpilot", &gitops).await?;
    assert_eq!(
        first, second,
        "helm template renders the same objects twice"
    );
    assert!(
        find(&first, "Secret").is_none(),
        "no Secret rendered: {:?}",
        first
            .iter()
            .filter(|o| o["kind"] == "Secret")
            .map(|o| &o["metadata"]["name"])
            .collect::<Vec<_>>()
    );
    let gateway = first
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "poolpilot-gateway")
        .context("the gateway Deployment")?;
    let volumes = gateway["spec"]["template"]["spec"]["volumes"].to_string();
    for secret in ["gw-token", "gw-admin-tls"] {
        assert!(volumes.contains(secret), "{secret} in {volumes}");
    }
    let operator = first
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "poolpilot-operator")
        .context("the operator Deployment")?;
    assert!(
        operator.to_string().contains("--token-secret=gw-token"),
        "the operator reads the token Secret named"
    );
    assert!(operator.to_string().contains("gw-admin-ca"));

    let generated = render("poolpilot", "poolpilot", &[]).await?;
    let again = render("poolpilot", "poolpilot", &[]).await?;
    let without_secrets = |objects: &[Value]| -> Vec<Value> {
        objects
            .iter()
            .filter(|o| o["kind"] != "Secret")
            .cloned()
            .collect()
    };
    assert_eq!(without_secrets(&generated), without_secrets(&again));
    assert_ne!(generated, again, "generated credentials differ per render");
    Ok(())
}

/// The values a cloud install needs: Service and ServiceAccount annotations, extra containers
/// and volumes, NetworkPolicy peers, the readiness mode and the fleet's limits ConfigMap.
#[tokio::test]
async fn the_cloud_install_values_render_where_they_belong() -> anyhow::Result<()> {
    let objects = render(
        "poolpilot",
        "poolpilot",
        &[
            "--set-json",
            r#"gateway.service={"type":"LoadBalancer","port":80,"annotations":{"service.beta.kubernetes.io/aws-load-balancer-proxy-protocol":"*"},"loadBalancerClass":"service.k8s.aws/nlb","externalTrafficPolicy":"Local"}"#,
            "--set-json",
            r#"gateway.serviceAccount={"annotations":{"eks.amazonaws.com/role-arn":"arn:aws:iam::1:role/gw"}}"#,
            "--set-json",
            r#"operator.serviceAccount={"annotations":{"iam.gke.io/gcp-service-account":"op@p.iam.gserviceaccount.com"}}"#,
            "--set-json",
            r#"gateway.extraContainers=[{"name":"sigv4","image":"example/sigv4:1"}]"#,
            "--set-json",
            r#"gateway.extraVolumes=[{"name":"scratch","emptyDir":{}}]"#,
            "--set-json",
            r#"gateway.extraVolumeMounts=[{"name":"scratch","mountPath":"/scratch"}]"#,
            "--set-json",
            r#"gateway.networkPolicy.adminFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"observability"}}}]"#,
            "--set-json",
            r#"gateway.networkPolicy.proxyFrom=[{"namespaceSelector":{"matchLabels":{"team":"ml"}}}]"#,
            "--set",
            "gateway.readiness.requireLimits=true",
        ],
    )
    .await?;
    let named = |kind: &str, name: &str| -> anyhow::Result<&Value> {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .with_context(|| format!("no {kind} {name}"))
    };
    let service = named("Service", "poolpilot-gateway")?;
    assert_eq!(
        service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-proxy-protocol"],
        "*"
    );
    assert_eq!(service["spec"]["loadBalancerClass"], "service.k8s.aws/nlb");
    assert_eq!(service["spec"]["externalTrafficPolicy"], "Local");
    assert_eq!(
        named("ServiceAccount", "poolpilot-gateway")?["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::1:role/gw"
    );
    assert_eq!(
        named("ServiceAccount", "poolpilot-operator")?["metadata"]["annotations"]["iam.gke.io/gcp-service-account"],
        "op@p.iam.gserviceaccount.com"
    );
    let pod = &named("Deployment", "poolpilot-gateway")?["spec"]["template"];
    let containers = pod["spec"]["containers"].as_array().context("containers")?;
    assert_eq!(containers.len(), 2);
    assert_eq!(containers[1]["name"], "sigv4");
    assert!(pod["spec"]["volumes"].to_string().contains("scratch"));
    assert!(
        containers[0]["volumeMounts"]
            .to_string()
            .contains("/scratch")
    );
    assert_eq!(
        containers[0]["readinessProbe"]["httpGet"]["path"],
        "/readyz?requireLimits=true"
    );
    // The fleet's durable limits: the ConfigMap the pods mount is the one their annotation
    // names for the operator.
    assert_eq!(
        pod["metadata"]["annotations"]["poolpilot.io/limits-configmap"],
        "poolpilot-gateway-limits"
    );
    assert!(
        pod["spec"]["volumes"]
            .to_string()
            .contains(r#""name":"poolpilot-gateway-limits""#)
    );
    let np = named("NetworkPolicy", "poolpilot-gateway")?;
    assert_eq!(
        np["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]["team"],
        "ml"
    );
    assert!(
        np["spec"]["ingress"][1]["from"]
            .to_string()
            .contains("observability")
    );
    // The defaults: ready without limits, no peers on the proxy port.
    let defaults = render("poolpilot", "poolpilot", &[]).await?;
    let gateway = defaults
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "poolpilot-gateway")
        .context("gateway")?;
    assert_eq!(
        gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"],
        "/readyz"
    );
    Ok(())
}
