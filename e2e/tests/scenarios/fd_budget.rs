//! Scenario 5, fd budget: gateway pods started with a low open-files limit (their
//! RuntimeClass's containerd handler sets their RLIMIT_NOFILE, `stack::nofile_template`) → `FdBudget=False` with the
//! numbers in its message, the per-pod shares in `GET /v1/limits` clamped below the unclamped
//! share, a `FdBudgetExceeded` Event; the limit raised with `kubectl patch` of the Deployment's
//! pod template (which rolls the pods) → `FdBudget=True` and the shares back to unclamped.
//!
//! The numbers (operator/src/plan/budget.rs and fds.rs): a pod may use half its `process_max_fds`;
//! it needs `listener.maxConnections + fileDescriptors.reserve` plus Σ share × endpoints. With a
//! limit of 512 (256 allowed), a listener of 200, a reserve of 32 and one backend of 3 endpoints at
//! a fleet target of 48 over 3 pods (16 each, 48 pooled fds), a pod needs 200 + 32 + 48 = 280 >
//! 256: the shares are scaled to fit the 24 fds left, 16 × 24 / 48 = 8. At 4096 (2048 allowed) 280
//! fits and every pod gets its 16 again.

use anyhow::Context as _;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::eventually;
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GATEWAY_DEPLOYMENT, POLICY, Stack, StackSpec, WAIT, metric_sum, nofile_template,
    quick_policy, set, with_stack,
};
use serde_json::{Value, json};
use tokio::time::Instant;

const SCENARIO: &str = "fd-budget";
const LOW_LIMIT: u64 = 512;
const HIGH_LIMIT: u64 = 4096;
const LISTENER: u32 = 200;
const RESERVE: u32 = 32;
const TARGET: u32 = 48;
const ENDPOINTS: u32 = 3;
const PODS: u32 = 3;
/// Unclamped: 48 / 3 pods.
const UNCLAMPED: u32 = TARGET / PODS;
/// Clamped: the pools get what is left of half the limit, proportionally.
const CLAMPED: u32 =
    UNCLAMPED * (LOW_LIMIT as u32 / 2 - LISTENER - RESERVE) / (UNCLAMPED * ENDPOINTS);
const NEEDED_UNCLAMPED: u64 = (LISTENER + RESERVE + UNCLAMPED * ENDPOINTS) as u64;
const NEEDED_CLAMPED: u64 = (LISTENER + RESERVE + CLAMPED * ENDPOINTS) as u64;

/// The quick sample with model-a only, autoscale off (the target sits at `max`), and the
/// listener and reserve above.
fn policy() -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    let backends: Vec<Value> = p["spec"]["backends"]
        .as_array()
        .context("backends")?
        .iter()
        .filter(|b| b["name"] == "model-a")
        .cloned()
        .collect();
    set(&mut p, "/spec/backends", json!(backends))?;
    set(&mut p, "/spec/autoscale/enabled", json!(false))?;
    set(&mut p, "/spec/autoscale/max", json!(TARGET))?;
    set(&mut p, "/spec/listener/maxConnections", json!(LISTENER))?;
    set(&mut p, "/spec/fileDescriptors/reserve", json!(RESERVE))?;
    Ok(p)
}

/// Each Ready gateway's share of model-a, once all `PODS` show `want`.
async fn wait_shares(stack: &Stack<'_>, want: u32) -> anyhow::Result<Vec<(String, u32)>> {
    let docs = stack
        .wait_limits(
            &format!("every gateway's model-a share is {want}"),
            PODS as usize,
            WAIT,
            |l| {
                let b = l
                    .backends
                    .iter()
                    .find(|b| b.name == "model-a")
                    .context("no model-a")?;
                anyhow::ensure!(
                    b.pool.max_connections_per_endpoint == want
                        && b.endpoints.len() == ENDPOINTS as usize,
                    "share {}, {} endpoints",
                    b.pool.max_connections_per_endpoint,
                    b.endpoints.len()
                );
                Ok(())
            },
        )
        .await?;
    Ok(docs
        .into_iter()
        .map(|(g, l)| (g.name, l.backends[0].pool.max_connections_per_endpoint))
        .collect())
}

#[tokio::test]
async fn fd_budget_clamps_shares_under_a_low_nofile_limit_and_releases_them() -> anyhow::Result<()>
{
    assert_eq!(
        (UNCLAMPED, CLAMPED),
        (16, 8),
        "the numbers of the doc comment"
    );
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: PODS,
        backends: vec![BackendSpec::new("model-a", ENDPOINTS, 64)],
        nofile_limit: Some(LOW_LIMIT),
        ..StackSpec::default()
    };
    with_stack("fds", spec, async |stack| {
        let applied = Instant::now();
        stack.apply(&policy()?).await?;
        stack.wait_gateways(PODS as usize).await?;

        // The pods really run with the low limit (their own process collector says so).
        for g in stack.gateways().await? {
            let max = metric_sum(&g.metrics().await?, "process_max_fds", &[]);
            assert_eq!(max, LOW_LIMIT as f64, "process_max_fds of {}", g.name);
        }

        // While the pods turn Ready one by one the operator divides the target over fewer pods
        // (bigger shares, a bigger need): wait for the verdict over all of them.
        let low = eventually("FdBudget=False over all the pods", WAIT, || async {
            let c = stack
                .wait_condition(POLICY, "FdBudget", "False", WAIT)
                .await?;
            anyhow::ensure!(
                c.message.contains(&format!("needs {NEEDED_UNCLAMPED} fds")),
                "{:?}",
                c.message
            );
            Ok(c)
        })
        .await?;
        figure(
            SCENARIO,
            "apply to FdBudget=False ms",
            applied.elapsed().as_millis(),
        );
        figure(SCENARIO, "FdBudget=False message", &low.message);
        assert_eq!(low.reason, "OverBudget");
        for needle in [
            format!("needs {NEEDED_UNCLAMPED} fds"),
            format!("pods allow {}", LOW_LIMIT / 2),
            format!("scaled down to need {NEEDED_CLAMPED}"),
        ] {
            assert!(
                low.message.contains(&needle),
                "{needle:?} in {:?}",
                low.message
            );
        }
        let shares = wait_shares(stack, CLAMPED).await?;
        figure(
            SCENARIO,
            "clamped per-pod shares",
            format!("{shares:?} (unclamped {UNCLAMPED})"),
        );
        let status = stack.policy(POLICY).await?.status.context("a status")?;
        let b = &status.backends[0];
        assert_eq!(
            (b.target, b.per_pod),
            (TARGET, CLAMPED),
            "status of model-a"
        );
        let pods = status.pods.context("pods in the status")?;
        assert_eq!(
            (pods.fd_limit, pods.fd_needed),
            (Some(LOW_LIMIT), NEEDED_CLAMPED),
            "status.pods fd numbers"
        );
        // The Event is recorded when the condition flips to False, which may happen while only
        // some pods are Ready (a bigger share each, a bigger need): its numbers are those of
        // that moment, over the same limit.
        let event = stack
            .wait_event(
                POLICY,
                "FdBudgetExceeded",
                &format!("pods allow {}", LOW_LIMIT / 2),
            )
            .await?;
        let text = event.message.unwrap_or_default();
        let needed: u64 = text
            .strip_prefix("needs ")
            .and_then(|t| t.split_once(' '))
            .and_then(|(n, _)| n.parse().ok())
            .with_context(|| format!("the fds needed in {text:?}"))?;
        assert!(
            needed >= NEEDED_UNCLAMPED && text.contains("scaled down"),
            "{text}"
        );
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        figure(SCENARIO, "FdBudgetExceeded Event", text);

        // Raise the limit: the pod template changes, the Deployment rolls its pods.
        let raised = Instant::now();
        let patch =
            json!({"spec": {"template": nofile_template(stack.ns().cluster(), HIGH_LIMIT).await?}});
        run(stack.kubectl().args([
            "patch",
            "-n",
            stack.name(),
            &format!("deployment/{GATEWAY_DEPLOYMENT}"),
            "--type=merge",
            "-p",
            &patch.to_string(),
        ]))
        .await?;
        let old: Vec<String> = shares.iter().map(|(n, _)| n.clone()).collect();
        let new = eventually("the gateway pods are replaced", WAIT, || async {
            let pods = stack.wait_gateways(PODS as usize).await?;
            anyhow::ensure!(
                pods.iter().all(|p| !old.contains(&p.name)),
                "old pods left: {:?}",
                pods.iter().map(|p| &p.name).collect::<Vec<_>>()
            );
            Ok(pods)
        })
        .await?;
        figure(
            SCENARIO,
            "pods rolled s",
            format!("{:.1}", raised.elapsed().as_secs_f64()),
        );
        for g in &new {
            let max = metric_sum(&g.metrics().await?, "process_max_fds", &[]);
            assert_eq!(max, HIGH_LIMIT as f64, "process_max_fds of {}", g.name);
        }

        let high = stack
            .wait_condition(POLICY, "FdBudget", "True", WAIT)
            .await?;
        figure(
            SCENARIO,
            "raise to FdBudget=True s",
            format!("{:.1}", raised.elapsed().as_secs_f64()),
        );
        figure(SCENARIO, "FdBudget=True message", &high.message);
        assert_eq!(high.reason, "WithinBudget");
        assert!(
            high.message
                .contains(&format!("needs {NEEDED_UNCLAMPED} fds"))
                && high
                    .message
                    .contains(&format!("pods allow {}", HIGH_LIMIT / 2)),
            "{:?}",
            high.message
        );
        let shares = wait_shares(stack, UNCLAMPED).await?;
        figure(SCENARIO, "released per-pod shares", format!("{shares:?}"));
        assert_eq!(
            shares.iter().map(|(_, s)| s).sum::<u32>(),
            TARGET,
            "the shares add up to the target again"
        );
        figure(
            SCENARIO,
            "raise to shares released s",
            format!("{:.1}", raised.elapsed().as_secs_f64()),
        );
        let status = stack.policy(POLICY).await?.status.context("a status")?;
        assert_eq!(status.backends[0].per_pod, UNCLAMPED);
        let pods = status.pods.context("pods in the status")?;
        assert_eq!(
            (pods.fd_limit, pods.fd_needed),
            (Some(HIGH_LIMIT), NEEDED_UNCLAMPED),
            "status.pods fd numbers"
        );
        Ok(())
    })
    .await
}
