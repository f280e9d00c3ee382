//! Part 5b: how long a limit edit takes to reach every gateway pod — `kubectl apply` of the
//! policy with a changed `clients.maxConcurrency`, then every pod's `GET /v1/limits` polled until
//! it shows the new value — at 3, 10 and 30 gateway pods, several edits each.
//!
//! ```text
//!  kubectl scale gateway → N, wait RolledOut
//!  repeat: maxConcurrency 5 ↔ 6 ─ kubectl apply ─► operator ─PUT─► N pods ◄─ GET every 50 ms
//! ```

use std::time::Duration;

use poolpilot_e2e::stack::{GATEWAY_DEPLOYMENT, POLICY, Stack, WAIT, client_max_concurrency, set};
use serde_json::json;
use tokio::time::Instant;

use super::control::{Mode, policy};
use super::{Plan, median};

/// How often each pod's limits are read.
pub const POLL: Duration = Duration::from_millis(50);
/// How long one edit may take to reach every pod before the run counts it failed.
const BUDGET: Duration = Duration::from_secs(30);

/// The edits at one gateway count.
#[derive(Clone, Debug)]
pub struct RolloutRow {
    /// Gateway pods.
    pub pods: u32,
    /// Per edit: time from `kubectl apply` returning to the last pod showing the new value.
    pub from_return: Vec<Duration>,
    /// Per edit: the same from the start of `kubectl apply`.
    pub from_start: Vec<Duration>,
    /// Per edit: how long `kubectl apply` itself took.
    pub kubectl: Vec<Duration>,
}

impl RolloutRow {
    /// Median and max of a series, in milliseconds.
    pub fn median_max_ms(series: &[Duration]) -> (f64, f64) {
        let ms: Vec<f64> = series.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        (median(&ms), ms.iter().copied().fold(0.0, f64::max))
    }
}

/// Runs the edits at every gateway count of the plan, with the static-at-max policy of the
/// control part (autoscale off, so that only the edits change the documents).
pub async fn run(stack: &Stack<'_>, plan: &Plan) -> anyhow::Result<Vec<RolloutRow>> {
    let mut p = policy(Mode::StaticMax)?;
    let mut value = 8u32;
    set(&mut p, "/spec/clients/maxConcurrency", json!(value))?;
    // Every pod runs the edited value itself (not its part of it).
    set(&mut p, "/spec/clients/scope", json!("PerPod"))?;
    stack.apply(&p).await?;
    let mut rows = Vec::new();
    for &pods in &plan.rollout_pods {
        stack.scale(GATEWAY_DEPLOYMENT, pods).await?;
        stack.wait_gateways(pods as usize).await?;
        stack
            .wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;
        let settled = value;
        let gateways = stack
            .wait_limits(
                "every gateway runs the current maxConcurrency",
                pods as usize,
                WAIT,
                |l| {
                    let v = client_max_concurrency(l, "model-a");
                    anyhow::ensure!(v == Some(settled), "maxConcurrency {v:?}, want {settled}");
                    Ok(())
                },
            )
            .await?
            .into_iter()
            .map(|(g, _)| g)
            .collect::<Vec<_>>();
        let mut row = RolloutRow {
            pods,
            from_return: Vec::new(),
            from_start: Vec::new(),
            kubectl: Vec::new(),
        };
        for _ in 0..plan.rollout_reps {
            value = if value == 5 { 6 } else { 5 };
            set(&mut p, "/spec/clients/maxConcurrency", json!(value))?;
            let edited = Instant::now();
            stack.apply(&p).await?;
            let kubectl = edited.elapsed();
            let want = value;
            let times = futures::future::try_join_all(gateways.iter().map(|g| {
                g.wait_applied(edited, POLL, BUDGET, |l| {
                    client_max_concurrency(l, "model-a") == Some(want)
                })
            }))
            .await?;
            let last = times.iter().max().copied().unwrap_or_default();
            row.from_start.push(last);
            row.from_return.push(last.saturating_sub(kubectl));
            row.kubectl.push(kubectl);
            // Let the rollout's status write settle before the next edit.
            stack
                .wait_condition(POLICY, "RolledOut", "True", WAIT)
                .await?;
        }
        let (med, max) = RolloutRow::median_max_ms(&row.from_return);
        eprintln!(
            "poolpilot-loop-bench:   {pods} pods: apply return → last pod median {med:.0} ms, max {max:.0} ms"
        );
        rows.push(row);
    }
    Ok(rows)
}
