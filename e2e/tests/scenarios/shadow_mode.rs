//! Scenario shadow mode: a policy enforced at its minimum is switched to `mode: Recommend`, then a
//! load arrives that wants more connections. The operator decides as it would (status targets,
//! a `WouldScaleUp` Event "would scale model-a 4 → N", the rendered document in the
//! `models-recommended` ConfigMap), while every gateway keeps the limits it runs and the limits
//! ConfigMap keeps its revision. Switched back to `Enforce`, the recommendation is rolled out,
//! and `status.pods.items` lists each pod on it.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use poolpilot_api::ConnectionPolicyStatus;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, one_backend_policy, set, share, with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "shadow-mode";
const INTERVAL: Duration = Duration::from_secs(5);
const MIN: u32 = 4;
const MAX: u32 = 40;
/// Closed-loop workers: far more than a pool of 4 holds.
const WORKERS: usize = 16;
/// How long the recommendation is watched while nothing may change on the pods.
const WATCH: Duration = Duration::from_secs(20);

#[tokio::test]
async fn shadow_mode_publishes_the_decision_and_changes_nothing_until_enforced()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 2,
        operators: 1,
        backends: vec![BackendSpec::new("model-a", 1, 64).service_ms(200)],
        ..StackSpec::default()
    };
    with_stack("shadow", spec, async |stack| {
        // Enforced first, starting at the minimum: every gateway runs a share of 4.
        let mut policy = one_backend_policy("model-a", INTERVAL, MIN, MAX)?;
        set(&mut policy, "/spec/autoscale/startFrom", json!("Min"))?;
        stack.apply(&policy).await?;
        stack.wait_gateways(2).await?;
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        stack
            .wait_limits("the enforced minimum on both gateways", 2, WAIT, |l| {
                anyhow::ensure!(
                    share(l, "model-a")? == MIN / 2,
                    "share {}",
                    share(l, "model-a")?
                );
                Ok(())
            })
            .await?;

        // === Recommend ===
        set(&mut policy, "/spec/mode", json!("Recommend"))?;
        stack.apply(&policy).await?;
        let switched = Instant::now();
        stack
            .wait_condition(POLICY, "Ready", "True", WAIT)
            .await
            .and_then(|c| {
                anyhow::ensure!(c.reason == "Recommending", "{c:?}");
                Ok(())
            })?;
        // From the status saying so, the operator runs this policy in Recommend only (its
        // reconciles of one policy never overlap): what the pods and the limits ConfigMap hold
        // now stays. Taken here, not at the enforced minimum: an enforced pass may still re-size
        // the pods' bursts on its first fresh samples up to the switch.
        let mut running: Vec<(String, String, u32)> = Vec::new();
        for g in stack.gateways().await? {
            let l = g.limits().await?;
            running.push((g.name.clone(), l.revision.clone(), share(&l, "model-a")?));
        }
        anyhow::ensure!(
            running.iter().all(|r| r.2 == MIN / 2),
            "the enforced minimum still runs at the switch: {running:?}"
        );
        let limits_cm = configmap(stack, &format!("{POLICY}-limits")).await?;
        let gateways = stack.gateways().await?;
        let load = Load::start(
            LoadSpec::one_client_per_worker(
                gateways.iter().map(|g| g.proxy()).collect(),
                "model-a",
                8,
                WORKERS,
                Duration::from_secs(10),
            ),
            WORKERS,
        )?;
        let recommended = eventually("a recommendation above the minimum", WAIT, || async {
            let s = status(stack).await?;
            let t = s.backends.first().context("model-a")?.target;
            anyhow::ensure!(t > MIN, "target {t}");
            Ok(s)
        })
        .await?;
        let decided_after = switched.elapsed();
        let event = stack
            .wait_event(POLICY, "WouldScaleUp", "would scale model-a 4 → ")
            .await?;
        let note = event.message.clone().unwrap_or_default();
        let rolled = recommended
            .conditions
            .iter()
            .find(|c| c.type_ == "RolledOut")
            .context("RolledOut")?;
        assert_eq!(rolled.reason, "Recommending", "{rolled:?}");
        assert!(
            rolled.message.contains("ConfigMap models-recommended"),
            "{rolled:?}"
        );

        // Nothing changes on the pods, nor in the limits ConfigMap, while the recommendation
        // stands (and keeps being decided).
        let watch = Instant::now();
        let mut checks = 0;
        while watch.elapsed() < WATCH {
            let mut now: Vec<(String, String, u32)> = Vec::new();
            for g in stack.gateways().await? {
                let l = g.limits().await?;
                now.push((g.name.clone(), l.revision.clone(), share(&l, "model-a")?));
            }
            now.sort();
            let mut before = running.clone();
            before.sort();
            assert_eq!(
                now,
                before,
                "{:.1}s into Recommend the pods' limits moved",
                watch.elapsed().as_secs_f64()
            );
            let cm = configmap(stack, &format!("{POLICY}-limits")).await?;
            assert_eq!(
                cm.data, limits_cm.data,
                "the limits ConfigMap is left alone"
            );
            checks += 1;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let shown = status(stack).await?;
        let shown_target = shown.backends.first().context("model-a")?.target;
        let shown_revision = shown.revision.clone().context("a recommended revision")?;
        let cm = configmap(stack, &format!("{POLICY}-recommended")).await?;
        let doc = cm
            .data
            .as_ref()
            .and_then(|d| d.get("limits.json"))
            .context("the recommended document")?;
        let doc: poolpilot_api::GatewayLimits = serde_json::from_str(doc)?;
        assert_eq!(doc.revision, shown_revision, "status and ConfigMap agree");
        figure(
            SCENARIO,
            "Recommend: decision seconds after the switch",
            format!("{:.1} ({note})", decided_after.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "Recommend: pods unchanged",
            format!(
                "{checks} checks over {}s: shares {:?} while the recommendation was {shown_target}",
                WATCH.as_secs(),
                running.iter().map(|r| r.2).collect::<Vec<_>>()
            ),
        );

        // === Enforce: the recommendation is rolled out ===
        set(&mut policy, "/spec/mode", json!("Enforce"))?;
        stack.apply(&policy).await?;
        let enforced_at = Instant::now();
        let docs = eventually("the recommendation on both gateways", WAIT, || async {
            let s = status(stack).await?;
            let target = s.backends.first().context("model-a")?.target;
            let docs = stack
                .wait_limits("both gateways", 2, Duration::from_secs(1), |_| Ok(()))
                .await?;
            let shares: Vec<u32> = docs
                .iter()
                .map(|(_, l)| share(l, "model-a"))
                .collect::<anyhow::Result<_>>()?;
            anyhow::ensure!(
                shares.iter().sum::<u32>() == target && target > MIN,
                "shares {shares:?}, target {target}"
            );
            Ok((shares, target))
        })
        .await?;
        let rolled_after = enforced_at.elapsed();
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        // Per pod: what it runs and since when.
        let items = eventually(
            "status.pods.items lists both pods on their revisions",
            WAIT,
            || async {
                let s = status(stack).await?;
                let pods = s.pods.context("status.pods")?;
                // Each pod on its own document (its share of the target divided by demand, its
                // part of the busiest clients' limits): current, and the revision it serves.
                let mut serves = BTreeMap::new();
                for g in stack.gateways().await? {
                    serves.insert(g.name.clone(), g.limits().await?.revision);
                }
                anyhow::ensure!(
                    pods.items.len() == 2
                        && pods.items.iter().all(|i| i.current
                            && i.revision.as_ref() == serves.get(&i.name)
                            && i.generation.is_some()
                            && i.since.is_some()
                            && i.last_error.is_none()),
                    "{:?}",
                    pods.items
                );
                Ok(pods.items)
            },
        )
        .await?;
        figure(
            SCENARIO,
            "status.pods.items after Enforce",
            items
                .iter()
                .map(|i| {
                    format!(
                        "{} revision {} generation {}",
                        i.name,
                        i.revision.as_deref().unwrap_or_default(),
                        i.generation.unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        );
        figure(
            SCENARIO,
            "Enforce: recommendation rolled out seconds",
            format!(
                "{:.1} (shares {:?} = target {}; recommended {shown_target} before the switch)",
                rolled_after.as_secs_f64(),
                docs.0,
                docs.1
            ),
        );
        load.stop().await;
        Ok(())
    })
    .await
}

async fn status(stack: &Stack<'_>) -> anyhow::Result<ConnectionPolicyStatus> {
    stack.policy(POLICY).await?.status.context("no status yet")
}

async fn configmap(stack: &Stack<'_>, name: &str) -> anyhow::Result<ConfigMap> {
    let api: Api<ConfigMap> = stack.ns().api();
    Ok(api.get(name).await?)
}
