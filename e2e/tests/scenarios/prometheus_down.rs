//! Scenario 6, Prometheus down for a minute: the operator queries the cluster's Prometheus
//! through a TCP relay in the test process (the real Prometheus serves every concurrent test and
//! keeps running); cutting the relay takes Prometheus away from this operator only. While it is
//! cut, demand grows, yet the targets are held (status and every gateway's `/v1/limits`), no new
//! revision is rolled out, and `MetricsAvailable` turns False after three missed decisions, with
//! a `MetricsMissing` Event. Once restored, the operator resumes after two fresh samples:
//! `MetricsAvailable=True` again, and the growth that waited is decided and rolled out.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::ConnectionPolicyStatus;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::relay::Relay;
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, OPERATOR_LABELS, POLICY, Stack, StackSpec, WAIT, operator_decisions, pod_ip,
    quick_policy, set, with_stack,
};
use poolpilot_e2e::{Cluster, eventually};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "prometheus-down";
/// The policy's decision interval (`autoscale.interval`); the operator polls Prometheus every
/// 2 s (`--metrics-interval` of the overlay).
const INTERVAL: Duration = Duration::from_secs(5);
/// How long Prometheus stays away.
const OUTAGE: Duration = Duration::from_secs(60);
/// Load before the outage (well inside the target) and during it (wants about twice the target).
const LIGHT: usize = 3;
const HEAVY: usize = 20;
/// The target before the outage: the policy starts at `autoscale.max = 10`, then the bound is
/// raised to 30, which leaves the target where it is until demand asks for more.
const START: u32 = 10;

#[tokio::test]
async fn prometheus_down_holds_targets_then_resumes_after_two_fresh_samples() -> anyhow::Result<()>
{
    let _serial = serial().await?;
    let cluster = Cluster::shared().await?;
    let upstream = prometheus_addr(cluster.prometheus_url()?).await?;
    let relay = Relay::start(upstream).await?;
    let spec = StackSpec {
        gateways: 2,
        operators: 1,
        // One model-a instance, so that the fleet target is the pool of that one endpoint.
        backends: vec![BackendSpec::new("model-a", 1, 64).service_ms(200)],
        operator_args: vec![format!("--prometheus-url={}", relay.url())],
        ..StackSpec::default()
    };
    with_stack("promdown", spec, async |stack| {
        // The quick policy, model-a only (model-b has no instance here), no shrinking for ten
        // minutes (so that the light load before the outage leaves the target alone).
        let mut policy = quick_policy()?;
        let backends = policy
            .pointer_mut("/spec/backends")
            .and_then(|b| b.as_array_mut())
            .context("backends")?;
        backends.retain(|b| b["name"] == "model-a");
        set(&mut policy, "/spec/autoscale/min", json!(4))?;
        set(&mut policy, "/spec/autoscale/max", json!(START))?;
        set(
            &mut policy,
            "/spec/autoscale/scaleDown",
            json!({"stabilizationWindow": "10m", "maxStepPercent": 20}),
        )?;
        stack.apply(&policy).await?;

        let gateways = stack.wait_gateways(2).await?;
        let load = Load::start(
            LoadSpec::one_client_per_worker(gateways.iter().map(|g| g.proxy()).collect(), "model-a", 8, HEAVY, Duration::from_secs(10)),
            LIGHT,
        )?;
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;

        // Raise the upper bound: the target stays at 10 (nothing asks for more yet), over two
        // decisions on fresh samples.
        set(&mut policy, "/spec/autoscale/max", json!(30))?;
        stack.apply(&policy).await?;
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        wait_fresh(stack).await?;
        let before = status(stack).await?;
        let target = before.backends.first().context("model-a")?.target;
        assert_eq!(
            target, START,
            "raising autoscale.max leaves the target alone: {before:?}"
        );
        let held_limits = limits_of(stack).await?;
        anyhow::ensure!(
            relay.forwarded() > 0,
            "the operator does not query Prometheus through the relay"
        );
        let baseline = Held::of(&before);
        figure(SCENARIO, "targets before the outage", &baseline.targets);

        // The operator's own count of decisions by kind (`missing_data`, `recovering`, ...).
        let operator = stack
            .ready_pods(OPERATOR_LABELS)
            .await?
            .first()
            .map(pod_ip)
            .context("the operator pod")??;
        let operator_metrics = format!("http://{operator}:8080/metrics");
        let at_cut = operator_decisions(&operator_metrics).await?;

        // === Prometheus goes away; demand doubles meanwhile ===
        relay.cut();
        let cut = Instant::now();
        load.set_workers(HEAVY);
        let mut unavailable_after = None;
        let mut misses_when_unavailable = 0.0;
        let mut checks = 0u32;
        let mut limits_checks = 0u32;
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        while cut.elapsed() < OUTAGE {
            tick.tick().await;
            let now = status(stack).await?;
            assert_eq!(
                Held::of(&now),
                baseline,
                "targets and revision held {:.1}s into the outage",
                cut.elapsed().as_secs_f64()
            );
            checks += 1;
            let metrics = now
                .conditions
                .iter()
                .find(|c| c.type_ == "MetricsAvailable")
                .context("MetricsAvailable")?;
            if metrics.status == "False" && unavailable_after.is_none() {
                unavailable_after = Some(cut.elapsed());
                // Read after the status: at least the misses that led to it.
                let now = operator_decisions(&operator_metrics).await?;
                misses_when_unavailable = since(&now, &at_cut, "missing_data");
                assert!(
                    misses_when_unavailable >= 3.0,
                    "MetricsAvailable=False after {misses_when_unavailable} missed decisions"
                );
                assert_eq!(metrics.reason, "SamplesMissing", "{metrics:?}");
                assert!(
                    metrics.message.starts_with("model-a: no usable ")
                        && metrics.message.contains("for 3 decisions or more in a row")
                        && metrics.message.contains("targets are held"),
                    "the message names the backend and what it lacks: {metrics:?}"
                );
                figure(SCENARIO, "MetricsAvailable=False message", &metrics.message);
            }
            if checks.is_multiple_of(4) {
                assert_eq!(
                    limits_of(stack).await?,
                    held_limits,
                    "every gateway keeps its limits {:.1}s into the outage",
                    cut.elapsed().as_secs_f64()
                );
                limits_checks += 1;
            }
        }
        let unavailable_after =
            unavailable_after.context("MetricsAvailable never turned False during the outage")?;
        // Three missed decisions, each at least 0.9 interval after the previous one: never
        // before two intervals have passed (and, checked above, not before three misses).
        assert!(
            unavailable_after >= INTERVAL * 8 / 5,
            "MetricsAvailable=False {unavailable_after:?} after the cut: before three misses"
        );
        let after_outage = operator_decisions(&operator_metrics).await?;
        let event = stack.wait_event(POLICY, "MetricsMissing", "").await?;
        figure(
            SCENARIO,
            "cut → MetricsAvailable=False seconds",
            format!(
                "{:.1} ({:.1} decision intervals of {}s; {misses_when_unavailable} missed decisions counted by then)",
                unavailable_after.as_secs_f64(),
                unavailable_after.as_secs_f64() / INTERVAL.as_secs_f64(),
                INTERVAL.as_secs()
            ),
        );
        figure(
            SCENARIO,
            "decisions during the outage",
            format!(
                "{} missed, {} other",
                since(&after_outage, &at_cut, "missing_data"),
                since(&after_outage, &at_cut, "") - since(&after_outage, &at_cut, "missing_data")
            ),
        );
        figure(
            SCENARIO,
            "held during the outage",
            format!(
                "{} status checks, {limits_checks} checks of both gateways' /v1/limits, targets {} revision {}",
                checks,
                baseline.targets,
                baseline.revision
            ),
        );
        figure(
            SCENARIO,
            "Prometheus connections refused during the outage",
            relay.refused(),
        );
        figure(
            SCENARIO,
            "MetricsMissing Event",
            event.message.unwrap_or_default(),
        );
        figure(
            SCENARIO,
            "load during the outage",
            format!("{HEAVY} closed-loop workers on a held target of {START}"),
        );

        // === Prometheus is back ===
        let at_restore = operator_decisions(&operator_metrics).await?;
        relay.restore();
        let restored = Instant::now();
        let available = eventually("MetricsAvailable=True again", WAIT, || async {
            let s = status(stack).await?;
            let c = s
                .conditions
                .iter()
                .find(|c| c.type_ == "MetricsAvailable")
                .context("MetricsAvailable")?;
            anyhow::ensure!(c.status == "True", "{c:?}");
            Ok(s)
        })
        .await?;
        let available_after = restored.elapsed();
        let when_available = operator_decisions(&operator_metrics).await?;
        let fresh = since(&when_available, &at_restore, "")
            - since(&when_available, &at_restore, "missing_data");
        let recovering = since(&when_available, &at_restore, "recovering");
        // Two fresh decisions, at least 0.9 interval apart; the first only says "recovering".
        assert!(
            fresh >= 2.0 && recovering >= 1.0,
            "MetricsAvailable=True after {fresh} fresh decisions ({recovering} recovering)"
        );
        assert!(
            available_after >= INTERVAL * 4 / 5,
            "MetricsAvailable=True {available_after:?} after the restore: before two fresh samples"
        );

        // The growth that waited through the outage is decided and rolled out.
        let grown = eventually("the target grows once metrics are back", WAIT, || async {
            let s = status(stack).await?;
            let b = s.backends.first().context("model-a")?;
            anyhow::ensure!(b.target > START, "target {}", b.target);
            Ok(s)
        })
        .await?;
        let grown_after = restored.elapsed();
        let b = grown.backends.first().context("model-a")?;
        let scale = b.last_scale.as_ref().context("a last scale")?;
        assert_eq!(scale.from, START, "{scale:?}");
        assert!(
            scale.to >= START * 3 / 2,
            "the held demand ({HEAVY} workers on a pool of {START}) wants far more: {scale:?}"
        );
        let new_target = b.target;
        let docs = stack
            .wait_limits("the grown target on every gateway", 2, WAIT, |l| {
                anyhow::ensure!(
                    l.revision != baseline.revision,
                    "still revision {}",
                    l.revision
                );
                Ok(())
            })
            .await?;
        let rolled_after = restored.elapsed();
        let shares: Vec<u32> = docs
            .iter()
            .map(|(_, l)| l.backends[0].pool.max_connections_per_endpoint)
            .collect();
        assert_eq!(
            shares.iter().sum::<u32>(),
            new_target,
            "the shares {shares:?} add up to the new target"
        );
        stack.wait_condition(POLICY, "Ready", "True", WAIT).await?;
        figure(
            SCENARIO,
            "restore → MetricsAvailable=True seconds",
            format!(
                "{:.1} ({fresh} fresh decisions by then, {recovering} of them recovering; message: {})",
                available_after.as_secs_f64(),
                available
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "MetricsAvailable")
                    .map(|c| c.message.as_str())
                    .unwrap_or_default()
            ),
        );
        figure(
            SCENARIO,
            "restore → scale-up decision seconds",
            format!(
                "{:.1} ({} → {}: {})",
                grown_after.as_secs_f64(),
                scale.from,
                scale.to,
                scale.reason
            ),
        );
        figure(
            SCENARIO,
            "restore → rolled out to 2/2 seconds",
            format!("{:.1} (shares {shares:?})", rolled_after.as_secs_f64()),
        );
        let outage = load.window(0, load.now());
        figure(
            SCENARIO,
            "load over the run",
            format!(
                "{} calls, error rate {:.2}% {:?}",
                outage.calls,
                outage.error_rate() * 100.0,
                outage.errors
            ),
        );
        load.stop().await;
        Ok(())
    })
    .await
}

/// Waits until the samples have been fresh for two decision intervals in a row, so that the
/// operator's miss count is back to zero (`MetricsAvailable` is also True during the first two
/// misses, e.g. while a new gateway's series do not exist yet).
async fn wait_fresh(stack: &Stack<'_>) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    let mut since: Option<Instant> = None;
    loop {
        let s = status(stack).await?;
        let fresh = s.conditions.iter().any(|c| {
            c.type_ == "MetricsAvailable"
                && c.status == "True"
                && c.message == "fresh samples for every backend"
        });
        match (fresh, since) {
            (false, _) => since = None,
            (true, None) => since = Some(Instant::now()),
            (true, Some(t)) if t.elapsed() >= INTERVAL * 2 => return Ok(()),
            (true, Some(_)) => {}
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no fresh samples for two intervals in a row within {WAIT:?}: {:?}",
            s.conditions
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Decisions of `kind` (every kind when empty) between two readings.
fn since(now: &BTreeMap<String, f64>, then: &BTreeMap<String, f64>, kind: &str) -> f64 {
    let sum = |m: &BTreeMap<String, f64>| -> f64 {
        m.iter()
            .filter(|(k, _)| kind.is_empty() || k.as_str() == kind)
            .map(|(_, v)| v)
            .sum()
    };
    sum(now) - sum(then)
}

/// What must not change while Prometheus is away.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    targets: String,
    revision: String,
    limits_generation: Option<u64>,
}

impl Held {
    fn of(s: &ConnectionPolicyStatus) -> Self {
        Self {
            targets: s.targets.clone().unwrap_or_default(),
            revision: s.revision.clone().unwrap_or_default(),
            limits_generation: s.limits_generation,
        }
    }
}

async fn status(stack: &Stack<'_>) -> anyhow::Result<ConnectionPolicyStatus> {
    stack.policy(POLICY).await?.status.context("no status yet")
}

/// Per gateway: (name, revision, generation, model-a's per-pod share).
async fn limits_of(stack: &Stack<'_>) -> anyhow::Result<Vec<(String, String, u64, u32)>> {
    let mut out = Vec::new();
    for g in stack.gateways().await? {
        let l = g.limits().await?;
        let share = l
            .backends
            .iter()
            .find(|b| b.name == "model-a")
            .map(|b| b.pool.max_connections_per_endpoint)
            .context("model-a on a gateway")?;
        out.push((g.name.clone(), l.revision, l.generation, share));
    }
    out.sort();
    Ok(out)
}

/// `http://127.0.0.1:9090` → its socket address.
async fn prometheus_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    tokio::net::lookup_host(host)
        .await?
        .next()
        .with_context(|| format!("no address for {url}"))
}
