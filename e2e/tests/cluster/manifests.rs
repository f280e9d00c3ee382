//! The deployment manifests against the real thing: the local overlay passes the apiserver's
//! server-side dry run (schemas, the CRD's CEL rules, RBAC objects, every admission check), every
//! PromQL expression of the Grafana dashboard and of the alerting rules runs on the e2e
//! Prometheus, and the PrometheusRule matches the rules file it copies. (The CRD's copies are
//! checked by a unit test of the crds crate.)

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::paths::workspace_root;
use poolpilot_e2e::{Cluster, with_namespace};

use crate::exclusive::BUILT_IN_ROLE_AGGREGATION;
use serde::Deserialize as _;
use serde_json::Value;

fn read(relative: &str) -> anyhow::Result<String> {
    let path = workspace_root().join(relative);
    std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

fn yaml(relative: &str) -> anyhow::Result<Value> {
    serde_norway::from_str(&read(relative)?).with_context(|| format!("parse {relative}"))
}

const RULES: &str = "manifests/monitoring/rules/poolpilot.rules.yaml";
const PROMETHEUS_RULE: &str = "manifests/monitoring/prometheus-rule.yaml";
const DASHBOARD: &str = "manifests/monitoring/dashboards/poolpilot-saturation.json";

/// Where every alert's `runbook_url` points: a section of docs/runbooks.md (a link for people,
/// never fetched).
const RUNBOOKS: &str = "https://github.com/poolpilot/poolpilot/blob/main/docs/runbooks.md#"; // hermetic: not a destination

/// GitHub's anchor of a Markdown heading: lower case, spaces to dashes, punctuation dropped.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_has_a_runbook_section_that_says_what_to_do() -> anyhow::Result<()> {
    let rules = yaml(RULES)?;
    let runbooks = read("docs/runbooks.md")?;
    let sections: Vec<(String, String)> = runbooks
        .split("\n## ")
        .skip(1)
        .map(|s| {
            let (heading, body) = s.split_once('\n').unwrap_or((s, ""));
            (github_anchor(heading), body.to_owned())
        })
        .collect();
    let mut alerts = Vec::new();
    for group in rules["groups"].as_array().context("groups")? {
        for rule in group["rules"].as_array().context("rules")? {
            let Some(alert) = rule["alert"].as_str() else {
                continue;
            };
            alerts.push(github_anchor(alert));
            let url = rule["annotations"]["runbook_url"]
                .as_str()
                .with_context(|| format!("{alert} has no runbook_url"))?;
            let fragment = url
                .strip_prefix(RUNBOOKS)
                .with_context(|| format!("{alert}: {url} is not in docs/runbooks.md"))?;
            let (_, body) = sections
                .iter()
                .find(|(anchor, _)| anchor == fragment)
                .with_context(|| {
                    format!("{alert}: no heading of docs/runbooks.md has #{fragment}")
                })?;
            for part in ["**Meaning.**", "**Confirm.**", "**Act.**"] {
                anyhow::ensure!(body.contains(part), "{alert}: its runbook has no {part}");
            }
        }
    }
    let orphans: Vec<_> = sections
        .iter()
        .filter(|(anchor, _)| !alerts.contains(anchor))
        .map(|(anchor, _)| anchor)
        .collect();
    anyhow::ensure!(orphans.is_empty(), "runbooks of no alert: {orphans:?}");
    anyhow::ensure!(alerts.len() >= 10, "{} alerts", alerts.len());
    Ok(())
}

#[test]
fn the_prometheus_rule_carries_the_rules_file() -> anyhow::Result<()> {
    let plain = yaml(RULES)?;
    let operator = yaml(PROMETHEUS_RULE)?;
    assert_eq!(operator["kind"], "PrometheusRule");
    let groups = &plain["groups"];
    assert!(
        groups.as_array().is_some_and(|g| !g.is_empty()),
        "no rule groups in {RULES}"
    );
    assert_eq!(
        &operator["spec"]["groups"], groups,
        "{PROMETHEUS_RULE} and {RULES} differ"
    );
    Ok(())
}

/// `kubectl apply --dry-run=server -k manifests/overlays/local`, in a test namespace: a wrapper
/// kustomization moves every namespaced object of the overlay into it and drops the overlay's
/// Namespace objects (a server dry run cannot create a namespace and then fill it). The CRD is
/// installed for real first, as `kubectl apply -k manifests/crds` does, so that the sample
/// ConnectionPolicy is validated against its schema and CEL rules.
#[tokio::test]
async fn the_local_overlay_passes_a_server_side_dry_run() -> anyhow::Result<()> {
    with_namespace("manifests", async |ns| {
        let cluster = ns.cluster();
        let root = workspace_root();
        cluster.install_crd().await?;

        let wrapper = tempfile::tempdir()?;
        let overlay = root.join("manifests/overlays/local").canonicalize()?;
        // kustomize accepts only relative paths to bases.
        let up = "../".repeat(wrapper.path().canonicalize()?.components().count() - 1);
        let relative = format!("{up}{}", overlay.strip_prefix("/")?.display());
        std::fs::write(
            wrapper.path().join("kustomization.yaml"),
            format!(
                "apiVersion: kustomize.config.k8s.io/v1beta1\n\
                 kind: Kustomization\n\
                 namespace: {}\n\
                 resources:\n- {relative}\n\
                 patches:\n\
                 - patch: |\n    $patch: delete\n    apiVersion: v1\n    kind: Namespace\n    \
                 metadata:\n      name: any\n  target:\n    kind: Namespace\n",
                ns.name()
            ),
        )?;

        let out = run(cluster
            .kubectl()
            .args(["apply", "--dry-run=server", "-k"])
            .arg(wrapper.path()))
        .await?;
        let applied: Vec<&str> = out
            .lines()
            .filter(|l| l.ends_with("(server dry run)"))
            .collect();
        for expected in [
            "customresourcedefinition.apiextensions.k8s.io/connectionpolicies.poolpilot.io",
            "clusterrole.rbac.authorization.k8s.io/poolpilot-operator",
            "rolebinding.rbac.authorization.k8s.io/poolpilot-operator",
            "validatingadmissionpolicy.admissionregistration.k8s.io/poolpilot-operator-configmaps",
            "validatingadmissionpolicybinding.admissionregistration.k8s.io/poolpilot-operator-configmaps",
            "role.rbac.authorization.k8s.io/poolpilot-operator-leader-election",
            "serviceaccount/poolpilot-operator",
            "deployment.apps/poolpilot-operator",
            "poddisruptionbudget.policy/poolpilot-operator",
            "serviceaccount/poolpilot-gateway",
            "deployment.apps/poolpilot-gateway",
            "service/poolpilot-gateway",
            "networkpolicy.networking.k8s.io/poolpilot-gateway",
            "poddisruptionbudget.policy/poolpilot-gateway",
            "deployment.apps/model-a",
            "deployment.apps/model-b",
            "service/model-a",
            "service/model-b",
            "connectionpolicy.poolpilot.io/models",
        ] {
            anyhow::ensure!(
                applied
                    .iter()
                    .any(|l| l.starts_with(&format!("{expected} "))),
                "{expected} missing from the dry run:\n{out}"
            );
        }
        Ok(())
    })
    .await
}

/// What `make demo` deploys, rendered as kustomize renders it (bases included): every
/// destination it names is on this machine (the base points the operator at an in-cluster
/// Prometheus Service name that would be resolved off this machine; the overlay replaces it).
/// The CRD is left out: it is the API's schema, whose docs and CEL rules name the addresses a
/// policy may not use (cloud metadata services), never a destination.
#[tokio::test]
async fn the_rendered_local_overlay_names_no_destination_off_this_machine() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let overlay = workspace_root().join("manifests/overlays/local");
    let rendered = run(cluster.kubectl().arg("kustomize").arg(&overlay)).await?;
    anyhow::ensure!(
        rendered.contains("--prometheus-url=http://10.244.254.1:9090"),
        "the overlay no longer sets the Prometheus URL:\n{rendered}"
    );
    let mut deployed = String::new();
    for doc in serde_norway::Deserializer::from_str(&rendered) {
        let object = Value::deserialize(doc)?;
        if object["kind"] != "CustomResourceDefinition" {
            deployed.push_str(&serde_norway::to_string(&object)?);
            deployed.push_str("---\n");
        }
    }
    let offenders: Vec<_> = poolpilot_e2e::hermetic::connection_targets(&deployed)
        .into_iter()
        .filter(|t| !t.is_allowed())
        .collect();
    anyhow::ensure!(
        offenders.is_empty(),
        "destinations off this machine in manifests/overlays/local: {offenders:#?}"
    );
    Ok(())
}

/// Every `expr` in the dashboard (panels, annotations) and the variables' `label_values` queries.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    walk(&dashboard["annotations"], &mut out);
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if var["type"] != "query" {
            continue;
        }
        let query = var["query"]["query"]
            .as_str()
            .or_else(|| var["query"].as_str())
            .unwrap_or_default();
        out.push(label_values(query).unwrap_or_else(|| query.to_owned()));
    }
    out
}

/// Grafana's `label_values(expr, label)` as the PromQL it stands for.
fn label_values(query: &str) -> Option<String> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (expr, label) = inner.rsplit_once(',')?;
    Some(format!("group by ({}) ({})", label.trim(), expr.trim()))
}

/// The dashboard's variables as the "All" selection and a fixed rate window.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$cluster", ".*")
        .replace("$namespace", ".*")
        .replace("$backend", ".*")
}

#[test]
fn every_dashboard_query_can_be_narrowed_to_one_cluster() -> anyhow::Result<()> {
    // Prometheus setups that hold several clusters (Thanos, Mimir, federation) add a `cluster`
    // label: every selector of the dashboard matches it against the `cluster` variable.
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)?)?;
    let selector = regex::Regex::new(r"\b(poolpilot_[a-z_]+|process_[a-z_]+)(\{[^}]*\})?")?;
    let mut missing = Vec::new();
    for query in dashboard_queries(&dashboard) {
        for m in selector.captures_iter(&query) {
            let matchers = m.get(2).map_or("", |g| g.as_str());
            // `label_values(poolpilot_limits_info, cluster)` lists the clusters themselves.
            if !matchers.contains("cluster=~\"$cluster\"")
                && !query.starts_with("group by (cluster)")
            {
                missing.push(format!("{}: {query}", &m[0]));
            }
        }
    }
    anyhow::ensure!(
        missing.is_empty(),
        "selectors without the cluster:\n{}",
        missing.join("\n")
    );
    Ok(())
}

#[test]
fn label_values_become_promql() {
    assert_eq!(
        label_values(r#"label_values(up{job="x"}, namespace)"#).as_deref(),
        Some(r#"group by (namespace) (up{job="x"})"#)
    );
    assert_eq!(label_values("sum(up)"), None);
}

#[tokio::test]
async fn every_dashboard_and_alert_query_runs_on_prometheus() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)?)?;
    let mut queries = dashboard_queries(&dashboard);
    let dashboard_count = queries.len();
    anyhow::ensure!(
        dashboard_count >= 30,
        "only {dashboard_count} queries found in {DASHBOARD}"
    );
    let rules = yaml(RULES)?;
    for group in rules["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            let expr = rule["expr"].as_str().context("a rule without expr")?;
            queries.push(expr.to_owned());
        }
    }
    anyhow::ensure!(
        queries.len() >= dashboard_count + 7,
        "fewer than 7 alerting rules in {RULES}"
    );

    let mut failures = Vec::new();
    for query in &queries {
        let promql = substitute(query);
        if promql.contains('$') {
            failures.push(format!("{query}: an unknown dashboard variable"));
            continue;
        }
        if let Err(e) = cluster.prometheus_query(&promql).await {
            failures.push(format!("{promql}: {e:#}"));
        }
    }
    anyhow::ensure!(
        failures.is_empty(),
        "{} of {} queries failed:\n{}",
        failures.len(),
        queries.len(),
        failures.join("\n")
    );
    Ok(())
}

/// `kubectl auth can-i VERB RESOURCE -n NS --as USER [--subresource S]`: whether the API server
/// allows it.
async fn can_i(
    cluster: &Cluster,
    ns: &str,
    user: &str,
    verb: &str,
    resource: &str,
) -> anyhow::Result<bool> {
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let mut cmd = cluster.kubectl();
    cmd.args(["auth", "can-i", verb, resource, "-n", ns, "--as", user]);
    if !subresource.is_empty() {
        cmd.arg(format!("--subresource={subresource}"));
    }
    let out = poolpilot_e2e::cluster::output(&mut cmd).await?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
}

#[tokio::test]
async fn namespace_users_get_policies_through_the_built_in_view_and_edit_roles()
-> anyhow::Result<()> {
    with_namespace("aggregate", async |ns| {
        let cluster = ns.cluster();
        cluster.install_crd().await?;
        // No chart release's aggregated roles (the same rules) while this test looks.
        let _alone = BUILT_IN_ROLE_AGGREGATION.lock().await;
        let roles = workspace_root().join("manifests/operator/rbac-aggregate.yaml");
        // The stacks of other tests apply the same roles (the operator base has them).
        cluster.apply(&roles).await?;
        let checked = async {
            for (user, role) in [("jane", "view"), ("joe", "edit")] {
                run(cluster.kubectl().args([
                    "create",
                    "rolebinding",
                    user,
                    "-n",
                    ns.name(),
                    &format!("--clusterrole={role}"),
                    &format!("--user={user}"),
                ]))
                .await?;
            }
            let policies = "connectionpolicies.poolpilot.io";
            // The controller-manager aggregates the rules into view/edit/admin in a moment.
            poolpilot_e2e::eventually(
                "view and edit carry the policies",
                Duration::from_secs(60),
                || async {
                    anyhow::ensure!(
                        can_i(cluster, ns.name(), "jane", "list", policies).await?,
                        "jane cannot list"
                    );
                    anyhow::ensure!(
                        can_i(cluster, ns.name(), "joe", "create", policies).await?,
                        "joe cannot create"
                    );
                    Ok(())
                },
            )
            .await?;
            assert!(can_i(cluster, ns.name(), "jane", "get", policies).await?);
            assert!(
                !can_i(cluster, ns.name(), "jane", "create", policies).await?,
                "view only reads"
            );
            assert!(can_i(cluster, ns.name(), "joe", "delete", policies).await?);
            assert!(
                !can_i(
                    cluster,
                    ns.name(),
                    "joe",
                    "update",
                    &format!("{policies}/status")
                )
                .await?,
                "status stays the operator's"
            );
            assert!(
                !can_i(cluster, "default", "joe", "list", policies).await?,
                "only in the namespace of the binding"
            );
            anyhow::Ok(())
        }
        .await;
        // The roles stay, as every stack of the other tests leaves them (the operator base
        // has them): a delete here would pull them from under those tests' concurrent applies
        // and the overlay's dry run. The chart's release has roles of its own names.
        checked
    })
    .await
}
