//! Part 5b: how long a limit edit takes to reach every gateway pod — `kubectl apply` of the
//! policy with a changed `clients.maxConcurrency`, then every pod's `GET /v1/limits` polled until
//! it shows the new value — at 3, 10 and 30 gateway pods, several edits each, on the fast path
//! (`verifyIntervals: 0`); then, at the largest count, under the default rollout (Progressive, one
//! canary verified for two 15 s intervals), when the canary and when the last pod take the edit.
//!
//! ```text
//!  kubectl scale gateway → N, wait RolledOut
//!  repeat: maxConcurrency 5 ↔ 6 ─ kubectl apply ─► operator ─PUT─► N pods ◄─ GET every 50 ms
//!  then the policy's rollout and interval back to their defaults, the same edits again
//! ```

use std::time::Duration;

use poolpilot_e2e::stack::{
    GATEWAY_DEPLOYMENT, GatewayPod, POLICY, Stack, WAIT, client_max_concurrency, set,
};
use serde_json::json;
use tokio::time::Instant;

use super::control::{Mode, policy};
use super::{Plan, median};

/// How often each pod's limits are read.
pub const POLL: Duration = Duration::from_millis(50);
/// How long one edit may take to reach every pod before the run counts it failed.
const BUDGET: Duration = Duration::from_secs(30);
/// The default rollout: the policy's interval and verification intervals left at their defaults.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);
/// Default `rollout.verifyIntervals`.
pub const DEFAULT_VERIFY_INTERVALS: u32 = 2;
/// How long one edit may take under the default rollout (the verification period, two more
/// intervals for the judgement to land).
const DEFAULT_BUDGET: Duration =
    Duration::from_secs(DEFAULT_INTERVAL.as_secs() * (DEFAULT_VERIFY_INTERVALS as u64 + 2));

/// What the rollout part measured.
#[derive(Clone, Debug)]
pub struct RolloutTimes {
    /// The fast path (`verifyIntervals: 0`), per gateway count.
    pub fast: Vec<RolloutRow>,
    /// The default rollout at the largest gateway count.
    pub default: DefaultRolloutRow,
}

/// Edits under the default rollout.
#[derive(Clone, Debug)]
pub struct DefaultRolloutRow {
    /// Gateway pods.
    pub pods: u32,
    /// Per edit: from `kubectl apply` returning to the first pod (the canary) on the new value.
    pub canary: Vec<Duration>,
    /// Per edit: from `kubectl apply` returning to the last pod on it.
    pub last: Vec<Duration>,
}

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
pub async fn run(stack: &Stack<'_>, plan: &Plan) -> anyhow::Result<RolloutTimes> {
    let mut p = policy(Mode::StaticMax)?;
    let mut value = 8u32;
    set(&mut p, "/spec/clients/maxConcurrency", json!(value))?;
    // Every pod runs the edited value itself (not its part of it).
    set(&mut p, "/spec/clients/scope", json!("PerPod"))?;
    stack.apply(&p).await?;
    let mut rows = Vec::new();
    let mut gateways = Vec::new();
    for &pods in &plan.rollout_pods {
        stack.scale(GATEWAY_DEPLOYMENT, pods).await?;
        stack.wait_gateways(pods as usize).await?;
        gateways = settled_gateways(stack, pods, value).await?;
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
            let times = wait_every_pod(&gateways, edited, BUDGET, want).await?;
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
    let default = default_rollout(stack, plan, &mut p, &mut value, gateways).await?;
    Ok(RolloutTimes {
        fast: rows,
        default,
    })
}

/// The same edits with the policy's rollout and interval at their defaults, on the gateways of
/// the largest count.
async fn default_rollout(
    stack: &Stack<'_>,
    plan: &Plan,
    p: &mut serde_json::Value,
    value: &mut u32,
    gateways: Vec<GatewayPod>,
) -> anyhow::Result<DefaultRolloutRow> {
    set(
        p,
        "/spec/autoscale/interval",
        json!(format!("{}s", DEFAULT_INTERVAL.as_secs())),
    )?;
    set(
        p,
        "/spec/rollout",
        json!({"strategy": "Progressive", "canaryPods": 1, "verifyIntervals": DEFAULT_VERIFY_INTERVALS}),
    )?;
    stack.apply(p).await?;
    stack
        .wait_condition(POLICY, "RolledOut", "True", WAIT)
        .await?;
    let pods = gateways.len() as u32;
    let mut row = DefaultRolloutRow {
        pods,
        canary: Vec::new(),
        last: Vec::new(),
    };
    for _ in 0..plan.default_rollout_reps {
        *value = if *value == 5 { 6 } else { 5 };
        set(p, "/spec/clients/maxConcurrency", json!(*value))?;
        let edited = Instant::now();
        stack.apply(p).await?;
        let kubectl = edited.elapsed();
        let times = wait_every_pod(&gateways, edited, DEFAULT_BUDGET, *value).await?;
        let first = times.iter().min().copied().unwrap_or_default();
        let last = times.iter().max().copied().unwrap_or_default();
        row.canary.push(first.saturating_sub(kubectl));
        row.last.push(last.saturating_sub(kubectl));
        stack
            .wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;
    }
    let (canary, _) = RolloutRow::median_max_ms(&row.canary);
    let (med, max) = RolloutRow::median_max_ms(&row.last);
    eprintln!(
        "poolpilot-loop-bench:   {pods} pods, default rollout: canary median {canary:.0} ms, \
         last pod median {med:.0} ms, max {max:.0} ms"
    );
    Ok(row)
}

/// Waits until every gateway pod runs `value` and the rollout is done; returns the pods.
async fn settled_gateways(
    stack: &Stack<'_>,
    pods: u32,
    value: u32,
) -> anyhow::Result<Vec<GatewayPod>> {
    stack
        .wait_condition(POLICY, "RolledOut", "True", WAIT)
        .await?;
    Ok(stack
        .wait_limits(
            "every gateway runs the current maxConcurrency",
            pods as usize,
            WAIT,
            |l| {
                let v = client_max_concurrency(l, "model-a");
                anyhow::ensure!(v == Some(value), "maxConcurrency {v:?}, want {value}");
                Ok(())
            },
        )
        .await?
        .into_iter()
        .map(|(g, _)| g)
        .collect())
}

/// Per pod, the time from `edited` until it shows `value` as model-a's `maxConcurrency`.
async fn wait_every_pod(
    gateways: &[GatewayPod],
    edited: Instant,
    budget: Duration,
    value: u32,
) -> anyhow::Result<Vec<Duration>> {
    futures::future::try_join_all(gateways.iter().map(|g| {
        g.wait_applied(edited, POLL, budget, |l| {
            client_max_concurrency(l, "model-a") == Some(value)
        })
    }))
    .await
}
