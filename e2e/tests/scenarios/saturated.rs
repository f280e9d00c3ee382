//! Scenario 3, the saturated backend: the model-a instances run at their own concurrency limit
//! (modelsim with 4 batch slots and a queue behind them), and say so: the policy gives model-a a
//! saturation query on modelsim's queue gauge (what `vllm:num_requests_waiting` is for vLLM). The
//! queued demand asks for more connections, but the operator does NOT raise the target (a bigger
//! pool would only make a saturated backend slower): every decision holds growth naming the
//! query's value, `Saturated=True` says so, a `GrowthHeld` Event tells it once the hold lasted
//! three intervals, and the clients get 503s with `Retry-After` from the gateways instead of
//! waiting without end.
//!
//! ```text
//!  light load (3 workers, 400 ms calls, no queueing) ─► target max 51 → min 9
//!  right after a decision, 40 workers ─► 27 pooled connections, 9 per instance: 4 served,
//!      5 queued in modelsim (its saturation query reads ~5 ≥ 1); 13 requests wait for a lease
//!      └─► demand wants ~16 per endpoint, the operator holds 9; lease timeouts: 503 + Retry-After
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::policy::DecisionAction;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, StackSpec, WAIT, one_backend_policy, operator_decisions, set, share,
    with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "saturated";
/// The autoscale interval.
const INTERVAL: Duration = Duration::from_secs(5);
/// Lower bound of the target, where the saturation finds it: 9 connections per instance.
const MIN: u32 = 9;
/// Upper bound: model-a's declared capacity 64 × (1 − 0.2), far above what the instances take.
const MAX: u32 = 51;
/// modelsim's batch slots per instance: fewer than the 9 connections each instance gets.
const SLOTS: u32 = 4;
/// Service time of one call in a slot.
const SERVICE_MS: u32 = 400;
/// Workers before the saturation: one per gateway, no queueing anywhere.
const LIGHT: usize = 3;
/// Workers of the saturating load: 40 in flight against a fleet pool of 27.
const HEAVY: usize = 40;
/// Decisions the guard must hold the target through.
const HELD_DECISIONS: f64 = 4.0;

#[tokio::test]
async fn saturated_backend_blocks_growth_and_clients_get_retry_after() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![BackendSpec::new("model-a", 3, SLOTS).service_ms(SERVICE_MS)],
        ..StackSpec::default()
    };
    with_stack("saturated", spec, async |stack| {
        let mut policy = one_backend_policy("model-a", INTERVAL, MIN, MAX)?;
        let query = format!(
            "max(avg_over_time(modelsim_requests_queued{{namespace=\"{}\", app=\"model-a\"}}[4s]))",
            stack.name()
        );
        set(
            &mut policy,
            "/spec/backends/0/saturation",
            json!({"query": query, "threshold": 1}),
        )?;
        stack.apply(&policy).await?;
        let gateways = stack.wait_gateways(3).await?;
        let load = Load::start(
            LoadSpec::one_client_per_worker(
                gateways.iter().map(|g| g.proxy()).collect(),
                "model-a",
                4,
                HEAVY,
                Duration::from_secs(30),
            ),
            LIGHT,
        )?;

        // Light load: a latency baseline, and the target shrinks from max to min.
        eventually(
            "the target shrinks to min under light load",
            WAIT,
            || async {
                let b = stack.backend_status("model-a").await?;
                anyhow::ensure!(b.target == MIN, "target {} (want {MIN})", b.target);
                Ok(())
            },
        )
        .await?;
        stack
            .wait_limits("every gateway runs the min shares", 3, WAIT, |l| {
                let share = share(l, "model-a")?;
                anyhow::ensure!(share == MIN / 3, "share {share} (want {})", MIN / 3);
                Ok(())
            })
            .await?;
        stack
            .wait_condition(POLICY, "Saturated", "False", WAIT)
            .await?;
        let light_p90 = stack.upstream_p90("model-a", 10).await?;
        let light = load.last(5);
        figure(SCENARIO, "light load", &light);
        assert_eq!(light.failed(), 0, "no errors under light load: {light}");

        // Saturate the instances.
        let backends = stack.backends("model-a").await?;
        anyhow::ensure!(backends.len() == 3, "{} model-a instances", backends.len());
        for b in &backends {
            b.reset_peaks().await?;
        }
        let operator = stack.operator_metrics_url().await?;
        let kinds_before = operator_decisions(&operator).await?;
        // Right after a decision, so that the next one sees the saturation only.
        stack.wait_next_decision(INTERVAL * 3).await?;
        load.set_workers(HEAVY);
        let heavy = Instant::now();
        let heavy_second = load.now();

        let saturated = stack
            .wait_condition(POLICY, "Saturated", "True", WAIT)
            .await?;
        let to_saturated = heavy.elapsed();
        figure(
            SCENARIO,
            "Saturated message",
            format!("{}: {}", saturated.reason, saturated.message),
        );
        assert!(
            saturated
                .message
                .starts_with("model-a: the backend reports saturation: its saturation query is ")
                && saturated.message.contains("≥ threshold 1: growth to"),
            "Saturated names the backend and its signal: {}",
            saturated.message
        );

        // The guard holds the target through several decisions while the demand asks for more.
        let hold_from = operator_decisions(&operator).await?;
        let deadline = Instant::now() + WAIT;
        let mut targets = Vec::new();
        loop {
            let b = stack.backend_status("model-a").await?;
            targets.push(b.target);
            anyhow::ensure!(b.target == MIN, "the target grew under saturation: {b:?}");
            let now = operator_decisions(&operator).await?;
            let guarded = kind(&now, "backend_saturated") - kind(&hold_from, "backend_saturated");
            if guarded >= HELD_DECISIONS {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {guarded} guarded decisions in {WAIT:?}: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let held_for = heavy.elapsed();
        let end_second = load.now();
        let kinds_after = operator_decisions(&operator).await?;
        let status = stack.backend_status("model-a").await?;
        assert_eq!(status.target, MIN, "the target stays at {MIN}");
        figure(
            SCENARIO,
            "target samples under saturation",
            format!("{} polls, all {MIN}", targets.len()),
        );
        assert_eq!(
            kind(&kinds_after, "scale_up"),
            kind(&kinds_before, "scale_up"),
            "no scale-up decision under saturation: {kinds_before:?} → {kinds_after:?}"
        );
        assert!(
            stack.events(POLICY, "ScaledUp").await?.is_empty(),
            "no ScaledUp Event"
        );
        let last = status.last_decision.clone().context("lastDecision")?;
        assert_eq!(last.action, DecisionAction::Hold, "{last:?}");
        assert!(
            last.reason
                .starts_with(&format!("held at {MIN}: growth to "))
                && last.reason.contains("its saturation query is"),
            "{last:?}"
        );
        let told = stack
            .wait_event(
                POLICY,
                "GrowthHeld",
                "model-a: growth held for 3 intervals in a row",
            )
            .await?;
        figure(
            SCENARIO,
            "GrowthHeld Event",
            told.message.unwrap_or_default(),
        );
        let demand = status.leased.unwrap_or_default() + status.pending.unwrap_or_default();
        assert!(
            status.pending.unwrap_or_default() > 0.0 && demand * 1.2 / 3.0 > f64::from(MIN) * 1.1,
            "the demand asks for more than the target: {status:?}"
        );

        // The instances ran at their own limit, with a queue.
        let mut peaks = Vec::new();
        for b in &backends {
            let s = b.stats().await?;
            peaks.push((s.in_flight_peak, s.queued_peak));
            assert_eq!(
                s.in_flight_peak,
                u64::from(SLOTS),
                "{} ran at its concurrency limit",
                s.instance
            );
            assert!(s.queued_peak > 0, "{} queued requests", s.instance);
        }

        // The clients got 503/429 with Retry-After, not silence.
        let during = load.window(heavy_second + 2, end_second);
        let heavy_p90 = stack.upstream_p90("model-a", 10).await?;
        figure(SCENARIO, "saturated load", &during);
        let rejected: u64 = during.statuses.values().sum();
        assert!(
            during.failed() > 0 && rejected == during.failed(),
            "every failure is an HTTP answer: {during:?}"
        );
        assert!(
            during.statuses.keys().all(|s| *s == 503 || *s == 429),
            "503/429 only: {:?}",
            during.statuses
        );
        assert_eq!(
            during.retry_after, rejected,
            "every 503/429 carries Retry-After: {during:?}"
        );
        assert!(
            heavy_p90 > 1.25 * light_p90,
            "Prometheus sees the latency rise: p90 {heavy_p90:.3}s vs {light_p90:.3}s"
        );

        figure(
            SCENARIO,
            "target before/after",
            format!("{MIN} / {}", status.target),
        );
        figure(
            SCENARIO,
            "demand under saturation",
            format!(
                "leased {:.1} + pending {:.1} (wants {:.0} per endpoint)",
                status.leased.unwrap_or_default(),
                status.pending.unwrap_or_default(),
                (demand * 1.2 / 3.0).ceil()
            ),
        );
        figure(
            SCENARIO,
            "latency p90 light / saturated seconds",
            format!("{light_p90:.3} / {heavy_p90:.3}"),
        );
        figure(
            SCENARIO,
            "error mix",
            format!(
                "statuses {:?}, reasons {:?}, with Retry-After {}",
                during.statuses, during.errors, during.retry_after
            ),
        );
        figure(
            SCENARIO,
            "modelsim peaks (in flight, queued)",
            format!("{peaks:?}"),
        );
        figure(
            SCENARIO,
            "decisions during saturation",
            format!(
                "{:?}",
                kinds_after
                    .iter()
                    .map(|(k, v)| (k.clone(), v - kind(&kinds_before, k)))
                    .filter(|(_, v)| *v > 0.0)
                    .collect::<BTreeMap<_, _>>()
            ),
        );
        figure(
            SCENARIO,
            "load to Saturated seconds",
            format!("{:.1}", to_saturated.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "target held for seconds",
            format!("{:.1}", held_for.as_secs_f64()),
        );
        load.stop().await;
        Ok(())
    })
    .await
}

/// Decisions of one kind.
fn kind(counts: &BTreeMap<String, f64>, k: &str) -> f64 {
    counts.get(k).copied().unwrap_or(0.0)
}
