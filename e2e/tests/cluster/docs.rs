//! The docs against the real components: every PromQL expression of a ```` ```promql ```` block in
//! the user docs parses and runs on the cluster's Prometheus (a renamed metric still parses, a
//! typo in the syntax does not), and the sample policies the docs walk through are accepted by
//! the apiserver (the CRD's schema and CEL rules, server-side dry run).

use anyhow::Context as _;
use poolpilot_e2e::Cluster;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::paths::workspace_root;

/// The user docs: README.md, CONTRIBUTING.md, docs/*.md and the chart README.
fn documents() -> anyhow::Result<Vec<std::path::PathBuf>> {
    let root = workspace_root();
    let mut out = vec![
        root.join("README.md"),
        root.join("charts/poolpilot/README.md"),
    ];
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|x| x == "md") {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// The expressions of the ```` ```promql ```` blocks of `markdown`: a line that starts at the
/// margin begins one, an indented line continues it, `#` lines are comments.
fn promql_expressions(markdown: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut inside = false;
    for line in markdown.lines() {
        let fence = line.trim_start();
        if fence.starts_with("```") {
            inside = !inside && fence.trim_start_matches('`').trim() == "promql";
            continue;
        }
        if !inside || line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        match out.last_mut() {
            Some(expr) if line.starts_with(char::is_whitespace) => {
                expr.push(' ');
                expr.push_str(line.trim());
            }
            _ => out.push(line.trim().to_owned()),
        }
    }
    out
}

#[test]
fn promql_blocks_split_into_expressions() {
    let md = "text\n```promql\nsum(a)\n  / sum(b)\n# a comment\nc\n```\n```sh\nnot promql\n```\n";
    assert_eq!(promql_expressions(md), ["sum(a) / sum(b)", "c"]);
}

#[tokio::test]
async fn every_promql_in_the_docs_runs_on_prometheus() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    let mut checked = 0;
    let mut failed = Vec::new();
    for doc in documents()? {
        let text = std::fs::read_to_string(&doc)?;
        for expr in promql_expressions(&text) {
            checked += 1;
            if let Err(e) = cluster.prometheus_query(&expr).await {
                failed.push(format!("{}: {expr}\n  {e:#}", doc.display()));
            }
        }
    }
    anyhow::ensure!(checked >= 15, "only {checked} PromQL expressions found");
    anyhow::ensure!(
        failed.is_empty(),
        "PromQL that Prometheus refuses:\n{}",
        failed.join("\n")
    );
    Ok(())
}

#[tokio::test]
async fn the_sample_policies_the_docs_walk_are_accepted_by_the_apiserver() -> anyhow::Result<()> {
    let cluster = Cluster::shared().await?;
    cluster.install_crd().await?;
    for sample in [
        "manifests/samples/connectionpolicy.yaml",
        "manifests/samples/vllm/connectionpolicy.yaml",
    ] {
        run(cluster
            .kubectl()
            .args([
                "apply",
                "--dry-run=server",
                "--validate=strict",
                "-n",
                "default",
                "-f",
            ])
            .arg(workspace_root().join(sample)))
        .await
        .with_context(|| format!("{sample} is refused"))?;
    }
    Ok(())
}
