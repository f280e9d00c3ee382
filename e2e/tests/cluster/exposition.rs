//! What an engineer sees who points `curl` at the product's `/metrics`: both binaries, deployed on
//! the embedded cluster, answer in the classic text format that `promtool check metrics` reads
//! without a complaint, with the standard `process_*` metrics and `poolpilot_build_info`; asked
//! the way Prometheus asks, they answer OpenMetrics; and Prometheus itself, scraping them, has
//! the build and exactly one leading operator.

use std::process::Stdio;

use anyhow::Context as _;
use poolpilot_e2e::Cluster;
use poolpilot_e2e::credentials::server_name;
use poolpilot_e2e::paths::cache_dir;
use poolpilot_e2e::stack::{
    ADMIN_PORT, BackendSpec, StackSpec, WAIT, one_backend_policy, with_stack,
};
use tokio::io::AsyncWriteExt as _;

/// `curl -s [args] URL`: the body, with the `Content-Type` it came with.
async fn curl(args: &[&str], url: &str) -> anyhow::Result<(String, String)> {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "-w", "\n%{content_type}"])
        .args(args)
        .arg(url)
        .output()
        .await
        .context("run curl")?;
    anyhow::ensure!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let (body, ctype) = text.rsplit_once('\n').context("no content type")?;
    Ok((format!("{body}\n"), ctype.to_owned()))
}

/// `promtool check metrics` of `page`: its complaints, empty when there are none.
async fn promtool_check(page: &str) -> anyhow::Result<String> {
    let promtool = cache_dir().join("bin/promtool");
    let mut child = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("run {} (make promtool)", promtool.display()))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(page.as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        out.status.success() || !said.trim().is_empty(),
        "promtool failed silently"
    );
    Ok(said.trim().to_owned())
}

const PROMETHEUS_ACCEPT: &str = "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";

#[tokio::test]
async fn both_binaries_answer_curl_and_promtool_in_the_text_format_and_prometheus_in_openmetrics()
-> anyhow::Result<()> {
    let spec = StackSpec {
        gateways: 1,
        operators: 2,
        backends: vec![BackendSpec::new("model-a", 1, 16)],
        ..StackSpec::default()
    };
    with_stack("exposition", spec, async |stack| {
        // A gateway turns Ready once the operator sent it the limits of a policy.
        stack
            .apply(&one_backend_policy(
                "model-a",
                std::time::Duration::from_secs(10),
                4,
                12,
            )?)
            .await?;
        let gateway = stack.wait_gateways(1).await?.remove(0);
        let operator = stack.operator_metrics_url().await?;
        let ca = tempfile::NamedTempFile::new()?;
        std::fs::write(ca.path(), &stack.credentials().ca_pem)?;
        let name = server_name(stack.ns().name());
        let resolve = format!("{name}:{ADMIN_PORT}:{}", gateway.ip);
        let gateway_url = format!("https://{name}:{ADMIN_PORT}/metrics");
        let ca_path = ca.path().display().to_string();
        let tls = ["--cacert", ca_path.as_str(), "--resolve", resolve.as_str()];

        for (who, args, url) in [
            ("gateway", &tls[..], gateway_url.as_str()),
            ("operator", &[][..], operator.as_str()),
        ] {
            let (page, ctype) = curl(args, url).await?;
            assert_eq!(ctype, "text/plain; version=0.0.4; charset=utf-8", "{who}");
            let complaints = promtool_check(&page).await?;
            assert!(
                complaints.is_empty(),
                "promtool check metrics on the {who}'s /metrics:\n{complaints}"
            );
            for needle in [
                "\nprocess_open_fds ",
                "\nprocess_max_fds ",
                "\nprocess_resident_memory_bytes ",
                "\nprocess_cpu_seconds_total ",
                "\nprocess_start_time_seconds ",
                &format!(
                    "\npoolpilot_build_info{{version=\"{}\",revision=\"",
                    poolpilot_telemetry::VERSION
                ),
            ] {
                assert!(page.contains(needle), "{who}: no {needle:?} in\n{page}");
            }
            let mut with_accept = args.to_vec();
            with_accept.extend(["-H", PROMETHEUS_ACCEPT]);
            let (page, ctype) = curl(&with_accept, url).await?;
            assert_eq!(
                ctype, "application/openmetrics-text; version=1.0.0; charset=utf-8",
                "{who}"
            );
            assert!(page.trim_end().ends_with("# EOF"), "{who}:\n{page}");
        }

        // Prometheus scrapes both (its Kubernetes discovery): the build of every pod, one leader
        // among the two operator replicas.
        let cluster = Cluster::shared().await?;
        let ns = stack.ns().name();
        for (what, promql, want) in [
            (
                "one leading operator of two",
                format!("sum(poolpilot_operator_leader{{namespace=\"{ns}\"}})"),
                "1",
            ),
            (
                "two operator replicas report their leadership",
                format!("count(poolpilot_operator_leader{{namespace=\"{ns}\"}})"),
                "2",
            ),
            (
                "every pod's build",
                format!(
                    "count(poolpilot_build_info{{namespace=\"{ns}\", version=\"{}\"}} == 1) >= bool 3",
                    poolpilot_telemetry::VERSION
                ),
                "1",
            ),
        ] {
            cluster
            .wait_prometheus_value(what, &promql, want, WAIT)
            .await?;
        }
        Ok(())
    })
    .await
}
