//! Scenario 1, the happy path: CRD, operator, 3 gateways, 2 backends of 3 modelsim instances
//! each, the sample policy → `Ready=True`, `RolledOut` 3/3, and every gateway's `GET /v1/limits`
//! holds the rendered per-pod shares, which add up to the fleet target; a request through each
//! gateway reaches the model it names, with its request id sent back; `GET /v1/models` lists the
//! policy's models; and the gateways' incident signals (the lease SLO's share, the runtime lag,
//! lease holds) reach the cluster's Prometheus.

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::eventually;
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{BackendSpec, POLICY, StackSpec, WAIT, sample_policy, with_stack};
use serde_json::json;
use tokio::time::Instant;

#[tokio::test]
async fn happy_path_policy_ready_and_rolled_out_to_every_gateway() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![
            BackendSpec::new("model-a", 3, 64),
            BackendSpec::new("model-b", 3, 32),
        ],
        ..StackSpec::default()
    };
    with_stack("happy", spec, async |stack| {
        let started = Instant::now();
        // The sample as shipped: a new policy starts at its upper bound, autoscale.max = 25.
        let policy = sample_policy()?;
        stack.apply(&policy).await?;
        let applied = Instant::now();

        // The gateways start unready (no limits yet), load the ConfigMap the operator writes,
        // turn Ready, and get their shares by PUT once the operator sees all three.
        stack.wait_gateways(3).await?;
        let status = eventually("the policy is Ready and rolled out to 3/3", WAIT, || async {
            let status = stack.policy(POLICY).await?.status.context("a status")?;
            let is = |kind: &str| {
                status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == kind && c.status == "True")
            };
            anyhow::ensure!(
                is("Ready") && is("RolledOut") && status.updated.as_deref() == Some("3/3"),
                "updated {:?}, conditions {:?}",
                status.updated,
                status.conditions
            );
            Ok(status)
        })
        .await?;
        let ready_after = applied.elapsed();
        let targets: Vec<(String, u32, u32, u32)> = status
            .backends
            .iter()
            .map(|b| (b.name.clone(), b.target, b.per_pod, b.endpoints))
            .collect();
        assert_eq!(
            targets,
            [
                ("model-a".to_owned(), 25, 8, 3),
                ("model-b".to_owned(), 25, 8, 3)
            ],
            "targets at autoscale.max, 25 / 3 pods = 8 rounded down, 3 endpoints each"
        );

        let docs = stack
            .wait_limits("every gateway runs both backends", 3, WAIT, |l| {
                anyhow::ensure!(l.backends.len() == 2, "backends {:?}", l.backends);
                Ok(())
            })
            .await?;
        for backend in &status.backends {
            let shares: Vec<u32> = docs
                .iter()
                .map(|(g, l)| {
                    let b = l
                        .backends
                        .iter()
                        .find(|b| b.name == backend.name)
                        .with_context(|| format!("{} on {}", backend.name, g.name))?;
                    anyhow::ensure!(
                        b.endpoints.len() == 3,
                        "{} on {} has endpoints {:?}",
                        backend.name,
                        g.name,
                        b.endpoints
                    );
                    Ok(b.pool.max_connections_per_endpoint)
                })
                .collect::<anyhow::Result<_>>()?;
            assert_eq!(
                shares.iter().sum::<u32>(),
                backend.target,
                "the per-pod shares of {} {shares:?} add up to the fleet target",
                backend.name
            );
            figure(
                "happy-path",
                &format!("{} per-pod shares", backend.name),
                format!("{shares:?} = {}", backend.target),
            );
        }

        // The gateways route by model to the right backend.
        let client = reqwest::Client::new();
        for (gateway, _) in &docs {
            for model in ["model-a", "model-b"] {
                let id = format!("happy-{}-{model}", gateway.name);
                let response = client
                    .post(format!("http://{}/v1/chat/completions", gateway.proxy()))
                    .bearer_auth("happy-path")
                    .header("x-request-id", &id)
                    .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await?;
                assert_eq!(response.status(), 200, "{model} through {}", gateway.name);
                assert_eq!(
                    response.headers().get("x-request-id").and_then(|v| v.to_str().ok()),
                    Some(id.as_str()),
                    "the request id comes back"
                );
                let instance = response
                    .headers()
                    .get("x-modelsim-instance")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                assert!(
                    instance.starts_with(model),
                    "{model} served by {instance:?}"
                );
            }
        }

        // The models of the policy's routes, listed by the gateway itself.
        let (gateway, _) = &docs[0];
        let models: serde_json::Value = client
            .get(format!("http://{}/v1/models", gateway.proxy()))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .json()
            .await?;
        let ids: Vec<&str> = models["data"]
            .as_array()
            .context("a model list")?
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert_eq!(ids, ["model-a", "model-b"], "{models}");

        // The incident signals, as the dashboard and the alerts query them.
        let ns = stack.name();
        let cluster = stack.ns().cluster();
        for (what, promql) in [
            (
                "the share of leases within 50ms of both backends",
                format!("count(sum by (backend) (poolpilot_pool_lease_wait_seconds_bucket{{namespace=\"{ns}\", le=\"0.05\"}}) / sum by (backend) (poolpilot_pool_lease_wait_seconds_count{{namespace=\"{ns}\"}}) > 0)"),
            ),
            (
                "the runtime lag of every gateway",
                format!("count(poolpilot_runtime_lag_seconds_count{{namespace=\"{ns}\"}} > 0)"),
            ),
            (
                "lease holds of both backends",
                format!("count(sum by (backend) (poolpilot_pool_lease_hold_seconds_count{{namespace=\"{ns}\"}}) > 0)"),
            ),
        ] {
            let want = if what.contains("gateway") { "3" } else { "2" };
            cluster
            .wait_prometheus_value(what, &promql, want, WAIT)
            .await?;
        }

        // `kubectl get cpol` shows it as a user sees it.
        let table = poolpilot_e2e::cluster::run(stack.kubectl().args([
            "get",
            "cpol",
            "-n",
            stack.name(),
        ]))
        .await?;
        assert!(
            table.contains("model-a=25,model-b=25") && table.contains("3/3"),
            "{table}"
        );
        println!("{table}");
        figure("happy-path", "apply-to-Ready seconds", format!("{:.1}", ready_after.as_secs_f64()));
        figure(
            "happy-path",
            "deploy-to-Ready seconds",
            format!("{:.1}", started.elapsed().as_secs_f64()),
        );
        Ok(())
    })
    .await
}
