//! Scenario partial scrape: one of three ready gateway pods drops out of Prometheus's scrape (its
//! `prometheus.io/scrape` annotation turned off) while it carries all the load. The demand the
//! other two report is zero, yet the operator reads the fleet's demand as missing, not as that
//! zero: the target is held (no scale-down) and `MetricsAvailable` names the unscraped pod, then
//! turns False after three missed decisions. Once the pod is scraped again the samples are fresh
//! for every backend and decisions resume.

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::ConnectionPolicyStatus;
use poolpilot_api::policy::DecisionAction;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, one_backend_policy, with_stack,
};
use tokio::time::Instant;

const SCENARIO: &str = "partial-scrape";
/// The policy's decision interval.
const INTERVAL: Duration = Duration::from_secs(5);
/// Closed-loop workers, all through the pod that drops out of the scrape.
const WORKERS: usize = 12;
/// How long the pod stays unscraped: the 10 s scale-down stabilization and four decisions more
/// (`MetricsAvailable` turns False after three missed ones, 15–20 s in).
const HIDDEN: Duration = Duration::from_secs(30);
/// The bounds of the target.
const MIN: u32 = 2;
const MAX: u32 = 40;

#[tokio::test]
async fn partial_scrape_makes_demand_missing_never_smaller() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        operators: 1,
        backends: vec![BackendSpec::new("model-a", 1, 64).service_ms(200)],
        ..StackSpec::default()
    };
    with_stack("partial", spec, async |stack| {
        // Shrinks in one step after 10 s: a demand read as zero would take the target to MIN.
        let policy = one_backend_policy("model-a", INTERVAL, MIN, MAX)?;
        stack.apply(&policy).await?;
        let mut gateways = stack.wait_gateways(3).await?;
        gateways.sort_by(|a, b| a.name.cmp(&b.name));
        let hidden = gateways.first().context("a gateway")?.clone();
        let load = Load::start(
            LoadSpec::one_client_per_worker(
                vec![hidden.proxy()],
                "model-a",
                8,
                WORKERS,
                Duration::from_secs(10),
            ),
            WORKERS,
        )?;
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;

        // The load grows the target, and it settles with fresh samples.
        let settled = eventually("the target settles above the minimum", WAIT, || async {
            let s = status(stack).await?;
            let t = target(&s)?;
            anyhow::ensure!(t > MIN * 3, "target {t}");
            anyhow::ensure!(fresh(&s), "{:?}", s.conditions);
            let last = s.backends[0].last_decision.as_ref().map(|d| d.action);
            anyhow::ensure!(
                matches!(last, Some(DecisionAction::NoChange)),
                "last decision {last:?}"
            );
            Ok(t)
        })
        .await?;
        figure(
            SCENARIO,
            "target before the pod drops out of the scrape",
            format!("{settled} ({WORKERS} workers through {} only)", hidden.name),
        );

        // === the loaded pod drops out of the scrape ===
        annotate(stack, &hidden.name, "false").await?;
        let hidden_at = Instant::now();
        let named = format!("ready pods without fresh samples: {}", hidden.name);
        let mut named_after = None;
        let mut unavailable = None;
        let mut checks = 0u32;
        let mut reason = String::new();
        while hidden_at.elapsed() < HIDDEN {
            let s = status(stack).await?;
            let t = target(&s)?;
            assert_eq!(
                t,
                settled,
                "{:.1}s after the pod dropped out: the target moved ({:?})",
                hidden_at.elapsed().as_secs_f64(),
                s.backends[0].last_decision
            );
            checks += 1;
            let m = condition(&s, "MetricsAvailable")?;
            if named_after.is_none() && m.message.contains(&named) {
                named_after = Some(hidden_at.elapsed());
                if let Some(d) = &s.backends[0].last_decision {
                    reason = d.reason.clone();
                }
            }
            if unavailable.is_none() && m.status == "False" {
                assert!(m.message.contains(&named), "{m:?}");
                unavailable = Some((hidden_at.elapsed(), m.message.clone()));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let named_after = named_after.context("MetricsAvailable never named the pod")?;
        let (unavailable_after, message) =
            unavailable.context("MetricsAvailable never turned False")?;
        assert!(
            reason.contains("missing data") && reason.contains("no fresh samples"),
            "the decision says why it held: {reason}"
        );
        figure(
            SCENARIO,
            "pod out of the scrape → named in MetricsAvailable seconds",
            format!("{:.1} (decision: {reason})", named_after.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "pod out of the scrape → MetricsAvailable=False seconds",
            format!("{:.1} ({message})", unavailable_after.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "target held while the pod was unscraped",
            format!(
                "{settled} over {}s ({checks} status checks; the scraped pods' demand was 0)",
                HIDDEN.as_secs()
            ),
        );

        // === scraped again ===
        annotate(stack, &hidden.name, "true").await?;
        let back = Instant::now();
        eventually(
            "MetricsAvailable=True, fresh for every backend",
            WAIT,
            || async {
                let s = status(stack).await?;
                anyhow::ensure!(fresh(&s), "{:?}", s.conditions);
                Ok(())
            },
        )
        .await?;
        figure(
            SCENARIO,
            "scraped again → fresh samples for every backend seconds",
            format!("{:.1}", back.elapsed().as_secs_f64()),
        );
        let tally = load.window(0, load.now());
        figure(
            SCENARIO,
            "load over the run",
            format!(
                "{} calls, error rate {:.2}%",
                tally.calls,
                tally.error_rate() * 100.0
            ),
        );
        load.stop().await;
        Ok(())
    })
    .await
}

/// Sets the pod's `prometheus.io/scrape` annotation.
async fn annotate(stack: &Stack<'_>, pod: &str, scrape: &str) -> anyhow::Result<()> {
    run(stack.kubectl().args([
        "annotate",
        "--overwrite",
        "-n",
        stack.name(),
        "pod",
        pod,
        &format!("prometheus.io/scrape={scrape}"),
    ]))
    .await?;
    Ok(())
}

async fn status(stack: &Stack<'_>) -> anyhow::Result<ConnectionPolicyStatus> {
    stack.policy(POLICY).await?.status.context("no status yet")
}

fn target(s: &ConnectionPolicyStatus) -> anyhow::Result<u32> {
    Ok(s.backends.first().context("model-a")?.target)
}

fn condition<'s>(
    s: &'s ConnectionPolicyStatus,
    kind: &str,
) -> anyhow::Result<&'s k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    s.conditions
        .iter()
        .find(|c| c.type_ == kind)
        .with_context(|| format!("no {kind} condition"))
}

fn fresh(s: &ConnectionPolicyStatus) -> bool {
    s.conditions.iter().any(|c| {
        c.type_ == "MetricsAvailable"
            && c.status == "True"
            && c.message == "fresh samples for every backend"
    })
}
