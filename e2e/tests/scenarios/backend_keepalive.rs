//! Scenario backend keep-alive: model-a closes connections idle for 2 s (modelsim
//! `--fault-idle-close-ms=2000`, a server with a short keep-alive) while the policy's
//! `pool.idleTimeout` says 30 s, and the callers pause 2 s between calls, so pooled connections
//! sit idle around the backend's limit. The gateways find connections the backend closed and count
//! how long they had been idle (`poolpilot_pool_peer_closed_idle_seconds`); within a few
//! intervals the operator lowers the idle timeout the pods run under 2 s
//! (`status.backends[].idleTimeout`, an `IdleTimeoutLowered` Event). Once the pods run it, the
//! gateway closes first: the count of connections closed by the backend stops rising, and no call
//! fails. Before that, each gateway pod protects itself: after the first close an endpoint made,
//! it keeps connections to that endpoint idle under it (`/v1/stats`: `idleTimeoutMs`), so at
//! most that first close per endpoint and pod can meet a call on the wire.
//!
//! ```text
//!  model-a: 2 instances, 50 ms a call, closes connections idle 2 s; policy idleTimeout 30s
//!  8 callers, each pausing 2 s after every answer, through both gateways
//!    gateways find closes after ≥ 2 s idle ─► each pod at once: that endpoint's connections
//!      idle at most 0.6 × the close's idle time (/v1/stats)
//!    ─► operator: idleTimeout 30s → < 2 s (status, Event)
//!    pods run it ─► peer_closed / validate_failed closes stop; 0 failed calls
//! ```

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::limits::GatewayLimits;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, POLICY, StackSpec, WAIT, metric_sum, one_backend_policy, set,
    with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "backend-keepalive";
/// The policy's decision interval.
const INTERVAL: Duration = Duration::from_secs(5);
/// modelsim closes a connection idle this long (milliseconds).
const KEEP_ALIVE_MS: u64 = 2000;
/// Callers, and how long each pauses after an answer.
const WORKERS: usize = 8;
const PAUSE: Duration = Duration::from_secs(2);
/// Until the status shows the lowered idle timeout: the first closes come 2 s into the load;
/// then a scrape, the operator's metrics round and its next pass (each 5–15 s here).
const LOWERED_WITHIN: Duration = Duration::from_secs(90);
/// How long the load runs once every pod runs the lowered value.
const STEADY: Duration = Duration::from_secs(40);
/// Gateway pods, and model-a's instances.
const GATEWAYS: u32 = 2;
const INSTANCES: u32 = 2;

/// Per gateway pod, model-a's endpoints' `idleTimeoutMs` in `/v1/stats`.
async fn pools_idle_timeouts(gateways: &[GatewayPod]) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for g in gateways {
        let stats = g.stats().await?;
        let endpoints = stats["backends"]["model-a"]["endpoints"]
            .as_array()
            .with_context(|| format!("{}: no model-a endpoints in {stats}", g.name))?;
        for e in endpoints {
            out.push(
                e["idleTimeoutMs"]
                    .as_u64()
                    .with_context(|| format!("{}: no idleTimeoutMs in {e}", g.name))?,
            );
        }
    }
    Ok(out)
}

/// Connections of model-a the backend closed, summed over the gateways: found closed, or
/// failing the check before reuse.
async fn backend_closes(gateways: &[GatewayPod]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for g in gateways {
        let text = g.metrics().await?;
        for reason in ["reason=\"peer_closed\"", "reason=\"validate_failed\""] {
            total += metric_sum(
                &text,
                "poolpilot_pool_connections_closed_total",
                &["backend=\"model-a\"", reason],
            );
        }
    }
    Ok(total)
}

fn idle_timeout(limits: &GatewayLimits) -> Option<Duration> {
    limits
        .backends
        .iter()
        .find(|b| b.name == "model-a")
        .map(|b| b.pool.idle_timeout.get())
}

#[tokio::test]
async fn a_backend_closing_idle_connections_sooner_gets_an_idle_timeout_under_its_keep_alive()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: GATEWAYS,
        backends: vec![
            BackendSpec::new("model-a", INSTANCES, 16)
                .service_ms(50)
                .arg(format!("--fault-idle-close-ms={KEEP_ALIVE_MS}")),
        ],
        ..StackSpec::default()
    };
    with_stack("keepalive", spec, async |stack| {
        let mut policy = one_backend_policy("model-a", INTERVAL, 2, 16)?;
        set(
            &mut policy,
            "/spec/backends/0/pool/idleTimeout",
            json!("30s"),
        )?;
        stack.apply(&policy).await?;
        let gateways = stack.wait_gateways(GATEWAYS as usize).await?;
        // Prometheus has scraped both pods since their pools started: with the pools protecting
        // themselves from their first closes on, those few closes are all the operator sees,
        // and a close made before a pod's first scrape would show Prometheus no increase.
        stack
            .wait_scraped(
                "poolpilot_pool_peer_closed_idle_seconds_count",
                "model-a",
                GATEWAYS as usize,
            )
            .await?;
        let proxies = gateways.iter().map(|g| g.proxy()).collect();
        let load = Load::start(
            LoadSpec {
                pause: PAUSE,
                ..LoadSpec::one_client_per_worker(
                    proxies,
                    "model-a",
                    8,
                    WORKERS,
                    Duration::from_secs(10),
                )
            },
            WORKERS,
        )?;
        let started = Instant::now();
        let from = load.now();

        // Each pod's pools keep connections idle under the first close they find, at once.
        let protected = eventually(
            "every pod keeps model-a's connections idle under 2 s",
            LOWERED_WITHIN,
            || async {
                let timeouts = pools_idle_timeouts(&gateways).await?;
                anyhow::ensure!(
                    timeouts.len() == (GATEWAYS * INSTANCES) as usize
                        && timeouts.iter().all(|t| *t < KEEP_ALIVE_MS),
                    "{timeouts:?}"
                );
                Ok(timeouts)
            },
        )
        .await?;
        figure(
            SCENARIO,
            "load start → every pod's pools under the backend's keep-alive seconds",
            format!(
                "{:.1} (idleTimeoutMs {protected:?})",
                started.elapsed().as_secs_f64()
            ),
        );

        // The operator lowers the idle timeout under the backend's 2 s.
        let lowered = eventually(
            "idleTimeout lowered under 2 s in status",
            LOWERED_WITHIN,
            || async {
                let s = stack.backend_status("model-a").await?;
                let t = s.idle_timeout.context("no idleTimeout in status yet")?;
                anyhow::ensure!(
                    t.in_force.get() < Duration::from_millis(KEEP_ALIVE_MS),
                    "{t:?}"
                );
                Ok(t)
            },
        )
        .await?;
        let lowered_after = started.elapsed();
        assert_eq!(lowered.configured.get(), Duration::from_secs(30));
        // The closes come at 2 s idle, found then or up to a reaper's pass (1 s) later; the
        // quantile is interpolated inside its bucket (1.71–2.56 s, 2.56–3.84 s).
        assert!(
            (1.7..3.9).contains(&lowered.backend_closed_after_seconds),
            "the gateways found the closes after about 2 s idle: {lowered:?}"
        );
        let event = stack
            .wait_event(POLICY, "IdleTimeoutLowered", "model-a: idleTimeout 30s → ")
            .await?;
        figure(
            SCENARIO,
            "load start → idleTimeout lowered in status seconds",
            format!(
                "{:.1} (30s → {}, closes found after {} s)",
                lowered_after.as_secs_f64(),
                lowered.in_force,
                lowered.backend_closed_after_seconds
            ),
        );
        figure(
            SCENARIO,
            "IdleTimeoutLowered",
            event.message.unwrap_or_default(),
        );

        // Every pod runs it.
        let in_force = lowered.in_force.get();
        for g in &gateways {
            g.wait_applied(Instant::now(), Duration::from_millis(250), WAIT, |l| {
                idle_timeout(l) == Some(in_force)
            })
            .await
            .with_context(|| format!("{} runs idleTimeout {in_force:?}", g.name))?;
        }
        // A connection idle for almost 2 s when its pod took the new value may still meet the
        // backend's close before the reaper's next pass.
        tokio::time::sleep(Duration::from_millis(KEEP_ALIVE_MS + 1000)).await;
        let before = load.window(from, load.now());
        let closes_before = backend_closes(&gateways).await?;
        figure(
            SCENARIO,
            "before the pods ran it: backend closes, failed calls",
            format!(
                "{closes_before}, {} of {} {:?}",
                before.failed(),
                before.calls,
                before.errors
            ),
        );

        // The gateway closes first: the backend's closes stop, and no call fails.
        let steady_from = load.now();
        tokio::time::sleep(STEADY).await;
        let steady = load.window(steady_from, load.now());
        let closes_after = backend_closes(&gateways).await?;
        figure(
            SCENARIO,
            "with the lowered idleTimeout: backend closes, failed calls",
            format!(
                "{} over {}s, {} of {}",
                closes_after - closes_before,
                STEADY.as_secs(),
                steady.failed(),
                steady.calls
            ),
        );
        // Before the operator's value: at most the first close per endpoint and pod met a call.
        assert!(
            before.failed() <= (GATEWAYS * INSTANCES) as u64,
            "at most one failed call per endpoint and pod before the pods ran the operator's value: {before}"
        );
        assert!(steady.calls >= 60, "the load ran: {steady}");
        assert_eq!(steady.failed(), 0, "no call fails: {steady}");
        assert_eq!(
            closes_after, closes_before,
            "the backend closed no more connections once the pods ran idleTimeout {in_force:?}"
        );
        load.stop().await;
        Ok(())
    })
    .await
}
