//! Scenario 2, the flash crowd (the incident poolpilot comes from, scaled to this machine): a closed-loop load raises the
//! in-flight demand ~50% above the pooled capacity while the backends have room to spare → each
//! gateway opens connections beyond its share on its burst allowance at once, so the error rate
//! the load generator measures stays under 0.5% from a second after the crowd, before the
//! operator's first decision; the operator then raises model-a's target in ONE decision, within
//! two intervals of the crowd, and rolls it out to the 3 gateways; the status records the
//! decision and its reason, and a `ScaledUp` Event tells it. The run is drawn (pool cap, leased,
//! pending, errors, the decision) into `<cache>/plots/e2e-flash-crowd.svg`.
//!
//! The backends batch like model servers (modelsim `--batch-slowdown=2`: each call slows down as
//! more run beside it), so the crowd's calls take ~1.4× as long as the light load's, far below
//! the 64 slots of each instance. A rule holding growth on latency (p90 above 1.25× its light-load
//! value) held such crowds for minutes; the operator judges growth by the throughput it buys.
//!
//! ```text
//!  light load (3 workers) ──► target shrinks from max 51 to min 9 (per pod 3, fleet pool 27),
//!      burst (51 − 9) ÷ 3 = 14 per endpoint per pod beside it
//!  wait for a decision tick, then 42 workers (1 s calls, 300 ms lease timeout)
//!      └─► 14 per gateway against a share of 9: 5 burst connections each, opened at once
//!  next decision: demand (leased + pending) ≈ 42 × 1.2 / 3 endpoints → ~17 per endpoint,
//!      shares ≈ 6 + 6 + 5: every gateway's pool ≥ 15 for its 14 workers, bursts given back
//! ```
//!
//! A closed-loop worker holds one call in flight, so the demand at the gateways is the number of
//! active workers. With a 1 s service time and a 300 ms lease timeout, a request that finds the
//! pool busy waits for one of the pool's releases (every 1 s / 9 per gateway) and times out when
//! more than two are queued ahead of it: without the burst, 14 workers per gateway against a
//! pool of 9 would fail often (they did, 10–60% of calls, before the burst allowance).
//! The crowd starts right after a decision, so that the next one, an interval later, averages
//! demand over the crowd only (the operator averages gauges over 4 s, read up to 2 s late).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::policy::DecisionAction;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::pool_view::{PoolRecorder, plot_path, pool_view};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, StackSpec, WAIT, one_backend_policy, operator_decisions, share, with_stack,
};
use tokio::time::Instant;

const SCENARIO: &str = "flash-crowd";
/// The autoscale interval: long enough that a decision an interval after the crowd starts sees
/// only the crowd (4 s averages, up to 2 s old).
const INTERVAL: Duration = Duration::from_secs(10);
/// Lower bound of the target, where the crowd finds it: 3 per pod per endpoint.
const MIN: u32 = 9;
/// Upper bound: model-a's capacity 64 × (1 − 0.2).
const MAX: u32 = 51;
/// Workers before the crowd: one per gateway, enough for a latency baseline.
const LIGHT: usize = 3;
/// Workers of the crowd: 42 in flight against a fleet pool of 9 × 3 endpoints = 27 (+56%).
const CROWD: usize = 42;
/// Service time of one call alone.
const SERVICE_MS: u32 = 1000;
/// modelsim's batch slowdown: 3× as slow with all 64 slots busy, ~1.4× at the crowd's 14.
const BATCH_SLOWDOWN: &str = "--batch-slowdown=2";
/// The acceptance bound of the error rate after the rollout.
const RECOVERED: f64 = 0.005;
/// How long the error rate is measured once it must have recovered.
const MEASURE: u64 = 15;

#[tokio::test]
async fn flash_crowd_raises_the_target_in_one_decision_and_lease_timeouts_stop()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![
            BackendSpec::new("model-a", 3, 64)
                .service_ms(SERVICE_MS)
                .arg(BATCH_SLOWDOWN),
        ],
        ..StackSpec::default()
    };
    with_stack("flash", spec, async |stack| {
        stack.apply(&one_backend_policy("model-a", INTERVAL, MIN, MAX)?).await?;
        let gateways = stack.wait_gateways(3).await?;
        let load = Load::start(
            LoadSpec::one_client_per_worker(gateways.iter().map(|g| g.proxy()).collect(), "model-a", 4, CROWD, Duration::from_secs(30)),
            LIGHT,
        )?;
        let started = Instant::now();

        // A new policy starts at its upper bound; under the light load it shrinks to `min` in
        // one step (maxStepPercent 100) once the 10 s stabilization window has passed.
        let shrunk = Instant::now();
        let shrunk_to = eventually("the target shrinks to min under light load", WAIT, || async {
            let b = stack.backend_status("model-a").await?;
            anyhow::ensure!(b.target == MIN, "target {} (want {MIN})", b.target);
            let shares: Vec<u32> = b.shares.iter().map(|s| s.share).collect();
            anyhow::ensure!(shares.len() == 3, "shares {shares:?}");
            Ok(shares)
        })
        .await?;
        assert_eq!(shrunk_to.iter().sum::<u32>(), MIN, "the shares divide min: {shrunk_to:?}");
        stack
            .wait_limits("every gateway runs its min share", 3, WAIT, |l| {
                let share = share(l, "model-a")?;
                anyhow::ensure!(shrunk_to.contains(&share), "share {share} (want one of {shrunk_to:?})");
                Ok(())
            })
            .await?;
        figure(
            SCENARIO,
            "shrink to min seconds",
            format!("{:.1}", shrunk.elapsed().as_secs_f64()),
        );
        let before = stack.backend_status("model-a").await?;
        let light = load.last(5);
        figure(SCENARIO, "light load", &light);
        let light_p90 = stack.upstream_p90("model-a", 10).await?;

        // Start the crowd right after a decision, so that the next decision sees the crowd only.
        let operator = stack.operator_metrics_url().await?;
        let ticks = operator_decisions(&operator).await?.values().sum::<f64>();
        eventually("an autoscale decision", INTERVAL * 3, || async {
            let now = operator_decisions(&operator).await?.values().sum::<f64>();
            anyhow::ensure!(now > ticks, "{now} decisions");
            Ok(())
        })
        .await?;
        // The pool as the gateways hold it, once a second from a few seconds before the crowd.
        let recorder = Arc::new(parking_lot::Mutex::new(PoolRecorder::default()));
        let sampler = tokio::spawn({
            let (recorder, gateways) = (recorder.clone(), gateways.clone());
            async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    if let Some(view) = pool_view(&gateways, "model-a").await {
                        recorder.lock().record(started.elapsed().as_secs_f64(), view);
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        load.set_workers(CROWD);
        let crowd = Instant::now();
        let crowd_second = load.now();

        // ONE decision raises the target above the crowd's demand.
        let raised = eventually("the operator raises the target", INTERVAL * 4, || async {
            let b = stack.backend_status("model-a").await?;
            let last = b.last_scale.clone().context("no lastScale yet")?;
            anyhow::ensure!(
                last.from == MIN && last.to > MIN,
                "target {}, lastScale {last:?}",
                b.target
            );
            Ok(b)
        })
        .await?;
        let decided = crowd.elapsed();
        let decided_second = load.now();
        assert!(
            decided <= INTERVAL * 2 + Duration::from_secs(1),
            "the decision lands within two intervals of the crowd: {decided:?}"
        );
        let scale = raised.last_scale.clone().context("lastScale")?;
        let last = raised.last_decision.clone().context("lastDecision")?;
        assert_eq!(
            (last.action, last.reason.clone()),
            (
                DecisionAction::ScaleUp,
                format!("{} → {}: {}", scale.from, scale.to, scale.reason)
            ),
            "status explains the decision"
        );
        figure(
            SCENARIO,
            "decision",
            format!("{} → {}: {}", scale.from, scale.to, scale.reason),
        );
        assert!(
            scale.reason.starts_with("demand ") && scale.reason.contains("pending"),
            "the reason gives the demand it saw: {}",
            scale.reason
        );
        // Rolled out to every gateway: the target divided by their demand, about evenly (worker
        // i calls gateway i % 3).
        let docs = eventually("every gateway runs its raised share", WAIT, || async {
            let planned: Vec<u32> = stack
                .backend_status("model-a")
                .await?
                .shares
                .iter()
                .map(|s| s.share)
                .collect();
            anyhow::ensure!(
                planned.iter().sum::<u32>() == scale.to,
                "shares {planned:?} (want {} in all)",
                scale.to
            );
            stack
                .wait_limits("the raised shares", 3, Duration::from_secs(1), |l| {
                    let share = share(l, "model-a")?;
                    anyhow::ensure!(planned.contains(&share), "share {share} of {planned:?}");
                    Ok(())
                })
                .await
        })
        .await?;
        let shares: Vec<u32> = docs
            .iter()
            .map(|(_, l)| share(l, "model-a"))
            .collect::<anyhow::Result<_>>()?;
        assert_eq!(shares.iter().sum::<u32>(), scale.to, "shares {shares:?}");
        // Worker i calls gateway i % 3: the busiest gateway takes ⌈42 / 3⌉ = 14 workers, which
        // its smallest share (per endpoint, × 3 endpoints) must hold.
        let busiest = CROWD.div_ceil(3);
        let smallest = shares.iter().min().copied().unwrap_or_default() as usize * 3;
        assert!(
            smallest >= busiest,
            "one step covers the crowd: target {} → shares {shares:?}, a pool of {smallest} for {busiest} workers per gateway",
            scale.to
        );
        let fleet_pool = scale.to * 3;
        let rolled = crowd.elapsed();
        let rolled_second = load.now();
        figure(SCENARIO, "raised shares", format!("{shares:?}"));
        stack
            .wait_condition(POLICY, "RolledOut", "True", WAIT)
            .await?;

        // Errors during the crowd, from a second after it to the decision: the bursts hold it.
        let during = load.window(crowd_second + 1, decided_second.max(crowd_second + 2));
        figure(SCENARIO, "crowd before the decision", &during);
        figure(SCENARIO, "crowd's first second", load.window(crowd_second, crowd_second + 1));
        assert!(
            during.calls >= 30 && during.error_rate() < RECOVERED,
            "the burst allowance holds the crowd before the operator's decision: {during}"
        );

        // Within two intervals of the rollout the error rate is below 0.5%, and stays there.
        let deadline = rolled_second + 2 * INTERVAL.as_secs();
        let end = deadline + MEASURE;
        while load.now() <= end {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let after = load.window(deadline, end);
        figure(SCENARIO, "after 2 intervals", &after);
        // The crowd's calls are much slower than the light load's: a latency rule would have
        // held this growth.
        let crowd_p90 = stack.upstream_p90("model-a", 10).await?;
        figure(
            SCENARIO,
            "latency p90 light / crowd seconds",
            format!(
                "{light_p90:.3} / {crowd_p90:.3} (×{:.2})",
                crowd_p90 / light_p90
            ),
        );
        assert!(
            crowd_p90 > 1.25 * light_p90,
            "the backends slow down with the crowd: p90 {crowd_p90:.3}s vs {light_p90:.3}s"
        );
        assert!(
            after.calls >= MEASURE * 20 && after.error_rate() < RECOVERED,
            "{MEASURE} s from two intervals after the rollout: {after}"
        );
        // Recovery: the first second from which every later 5 s window stays below 0.5%.
        let seconds = load.seconds();
        let recovered_second = (crowd_second..end)
            .find(|&s| {
                (s..end.saturating_sub(4)).all(|w| load.window(w, w + 5).error_rate() < RECOVERED)
            })
            .context("no recovery")?;
        let recovery = Duration::from_secs(recovered_second.saturating_sub(crowd_second));
        assert!(
            recovered_second <= deadline,
            "errors fall below 0.5% within two intervals of the rollout (second {rolled_second}): from second {recovered_second}"
        );
        for (s, t) in &seconds[crowd_second.saturating_sub(2) as usize..] {
            println!("second {s:>3}: {t}");
        }
        sampler.abort();
        let picture = plot_path("e2e-flash-crowd");
        {
            let mut recorder = recorder.lock();
            recorder.decision(
                (crowd + decided - started).as_secs_f64(),
                format!("{} → {} per endpoint", scale.from, scale.to),
            );
            let views = recorder.views();
            let peak = views.iter().map(|(_, v)| v.bursting).fold(0.0, f64::max);
            figure(SCENARIO, "peak burst connections", peak);
            anyhow::ensure!(
                peak > 0.0 && views.iter().any(|(_, v)| v.pooled >= f64::from(scale.to) * 3.0),
                "the recorded pool shows the bursts and the raised cap: {views:?}"
            );
            recorder.draw(
                &picture,
                &format!("flash crowd: {CROWD} callers against a pool of {} (e2e scenario)", MIN * 3),
                &seconds,
            )?;
        }
        figure(SCENARIO, "picture", picture.display());

        // One decision only: the target held, one ScaledUp Event, which names the numbers.
        let end_status = stack.backend_status("model-a").await?;
        assert_eq!(
            end_status.target, scale.to,
            "the target held after the one decision: {end_status:?}"
        );
        let events = stack.events(POLICY, "ScaledUp").await?;
        let messages: Vec<&str> = events
            .iter()
            .filter_map(|e| e.message.as_deref())
            .collect();
        assert_eq!(
            messages,
            [format!("model-a: target {} → {}: {}", scale.from, scale.to, scale.reason).as_str()],
            "one ScaledUp Event for the one decision"
        );
        let down = stack.events(POLICY, "ScaledDown").await?;
        assert_eq!(
            down.len(),
            1,
            "only the shrink to min before the crowd: {:?}",
            down.iter().map(|e| &e.message).collect::<Vec<_>>()
        );

        figure(
            SCENARIO,
            "target",
            format!(
                "{} → {} (fleet pool {} → {fleet_pool} for {CROWD} workers)",
                before.target,
                scale.to,
                before.target * 3
            ),
        );
        figure(
            SCENARIO,
            "crowd to decision seconds",
            format!("{:.1}", decided.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "crowd to rollout seconds",
            format!("{:.1}", rolled.as_secs_f64()),
        );
        figure(
            SCENARIO,
            "decision to rollout seconds",
            format!("{:.1}", (rolled - decided).as_secs_f64()),
        );
        figure(
            SCENARIO,
            "crowd to recovery seconds",
            format!(
                "{} (rollout at +{}, decision seen at +{}, bound +{})",
                recovery.as_secs(),
                rolled_second - crowd_second,
                decided_second - crowd_second,
                deadline - crowd_second
            ),
        );
        load.stop().await;
        Ok(())
    })
    .await
}
