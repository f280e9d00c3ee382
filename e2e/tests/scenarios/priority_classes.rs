//! Scenario priority classes: a pool held at 16 connections (8 per gateway) is saturated by
//! 24 closed-loop callers, 8 interactive clients and 16 workers of one batch client whose
//! override pins it to `Batch`. First a baseline: with `agingAfter: 1ms` a batch waiter ranks
//! as interactive at once, the queue is first come, first served, and both classes wait alike.
//! With `agingAfter: 200ms` the gateways serve the interactive calls first: their p99 lease
//! wait stays far below the 300 ms lease timeout while batch takes the wait; batch still makes
//! progress every second (a batch waiter ages after `agingAfter: 200ms`), and the operator
//! reports the demand split by class in `status.backends[].demandByClass` while the target
//! stays the total's. Then `batchMaxPercent: 50` caps batch at 4 of each gateway's 8
//! connections: batch never holds more, interactive calls hardly wait at all.
//!
//! ```text
//!  8 interactive clients ─┐                        ┌─ interactive: served first, p99 ≪ 300 ms
//!                         ├─► 2 gateways × 8 conns ┤
//!  16 batch workers ──────┘   (16 < 24 callers)    └─ batch: waits, ages at 200 ms; then ≤ 4 per gateway
//! ```

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec, Tally};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, Stack, StackSpec, WAIT, one_backend_policy, set, share, with_stack,
};
use serde_json::json;
use sha2::{Digest, Sha256};

const SCENARIO: &str = "priority-classes";
const INTERVAL: Duration = Duration::from_secs(5);
/// The fleet target per endpoint, held (min = max): 8 × 2 instances = 16 connections, 8 per
/// gateway.
const TARGET: u32 = 8;
/// Interactive clients, one worker each (4 per gateway).
const INTERACTIVE: usize = 8;
/// Workers of the batch client (8 per gateway).
const BATCH: usize = 16;
/// Service time of one call.
const SERVICE_MS: u32 = 100;
/// The lease timeout of the sample policy.
const LEASE_TIMEOUT: f64 = 0.3;
/// The aging bound.
const AGING_MS: u64 = 200;
/// Then batch may hold 50% of each gateway's 8 connections: 4.
const BATCH_PERCENT: u32 = 50;
const BATCH_CAP: f64 = 4.0;
/// How long each phase is measured.
const MEASURE: Duration = Duration::from_secs(12);
/// The baseline's aging bound: 1 ms, so that the queue is first come, first served.
const FIFO_AGING_MS: u64 = 1;

#[tokio::test]
async fn interactive_calls_are_served_first_while_batch_takes_the_wait_and_still_progresses()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 2,
        operators: 1,
        backends: vec![BackendSpec::new("model-a", 2, 64).service_ms(SERVICE_MS)],
        ..StackSpec::default()
    };
    with_stack("priority", spec, async |stack| scenario(stack).await).await
}

async fn scenario(stack: &Stack<'_>) -> anyhow::Result<()> {
    let mut policy = one_backend_policy("model-a", INTERVAL, TARGET, TARGET)?;
    let batch_key = "batch-0";
    set(
        &mut policy,
        "/spec/clients/overrides",
        json!([{
            "name": "nightly-eval",
            "match": {"keySha256": hex::encode(Sha256::digest(batch_key.as_bytes()))},
            "maxConcurrency": 64,
            "class": "Batch"
        }]),
    )?;
    set(
        &mut policy,
        "/spec/clients/priority",
        json!({"header": "x-poolpilot-priority", "agingAfter": format!("{FIFO_AGING_MS}ms")}),
    )?;
    stack.apply(&policy).await?;
    let gateways = stack.wait_gateways(2).await?;
    stack
        .wait_limits(
            "every gateway runs its share and the priority rules",
            2,
            WAIT,
            |l| {
                anyhow::ensure!(share(l, "model-a")? == TARGET / 2, "share");
                let p = l
                    .client_policies
                    .first()
                    .and_then(|c| c.priority.as_ref())
                    .context("no priority rules yet")?;
                anyhow::ensure!(p.aging_after.is_some(), "{p:?}");
                Ok(())
            },
        )
        .await?;

    let proxies: Vec<_> = gateways.iter().map(|g| g.proxy()).collect();
    let interactive = Load::start_as(
        LoadSpec::one_client_per_worker(
            proxies.clone(),
            "model-a",
            4,
            INTERACTIVE,
            Duration::from_secs(10),
        ),
        INTERACTIVE,
        "interactive",
        None,
    )?;
    let batch = Load::start_as(
        LoadSpec {
            clients: 1,
            ..LoadSpec::one_client_per_worker(proxies, "model-a", 4, BATCH, Duration::from_secs(10))
        },
        BATCH,
        "batch",
        None,
    )?;

    // === Baseline: a batch waiter ages after 1 ms, which makes the queue first come, first
    // served: both classes wait alike ===
    let from = interactive.now();
    tokio::time::sleep(MEASURE).await;
    let to = interactive.now();
    let fifo = Waits::read(stack, MEASURE - Duration::from_secs(2)).await?;
    let (i_tally, b_tally) = (interactive.window(from + 1, to), batch.window(from + 1, to));
    fifo.report("first come first served", &i_tally, &b_tally);
    assert!(
        fifo.interactive_mean > 0.5 * fifo.batch_mean,
        "without priority both classes wait alike: interactive {}s, batch {}s",
        fifo.interactive_mean,
        fifo.batch_mean
    );

    // === Phase 1: classes with aging after 200 ms, no cap ===
    set(
        &mut policy,
        "/spec/clients/priority/agingAfter",
        json!(format!("{AGING_MS}ms")),
    )?;
    stack.apply(&policy).await?;
    stack
        .wait_limits("every gateway ages batch after 200 ms", 2, WAIT, |l| {
            let p = l
                .client_policies
                .first()
                .and_then(|c| c.priority.as_ref())
                .context("no priority rules")?;
            anyhow::ensure!(
                p.aging_after == Some(poolpilot_api::Duration::from_millis(AGING_MS)),
                "{p:?}"
            );
            Ok(())
        })
        .await?;
    let from = interactive.now();
    tokio::time::sleep(MEASURE).await;
    let to = interactive.now();
    let waits = Waits::read(stack, MEASURE - Duration::from_secs(2)).await?;
    let (i_tally, b_tally) = (interactive.window(from + 1, to), batch.window(from + 1, to));
    waits.report("classes", &i_tally, &b_tally);
    // An interactive call waits at most for the next connection to come back (the closed-loop
    // calls end in bursts: about one call's time), batch calls for the interactive ones too.
    waits.assert_interactive_first("classes");
    assert!(
        waits.interactive_mean < 0.6 * fifo.interactive_mean,
        "interactive waits less than first come, first served: {}s vs {}s",
        waits.interactive_mean,
        fifo.interactive_mean
    );
    assert_eq!(i_tally.failed(), 0, "no interactive call fails: {i_tally}");
    // Batch is not starved: it completes calls every second, and its waits stay bounded by the
    // aging bound plus the calls ranked ahead of it, within the lease timeout.
    let per_second = progress(&batch, from, to);
    figure(
        SCENARIO,
        "classes: batch calls completed per second (min)",
        per_second.iter().min().copied().unwrap_or_default(),
    );
    assert!(
        per_second.iter().all(|ok| *ok > 0),
        "batch progresses every second: {per_second:?}"
    );
    // The aging bound with one connection's turn: a batch waiter past `agingAfter` is passed
    // over only by interactive waiters that arrived before its deadline, at most 4 per gateway
    // for its 8 connections, so it is served by the next call's end (about `SERVICE_MS`).
    let bound = (AGING_MS + u64::from(SERVICE_MS)) as f64 / 1000.0;
    assert!(
        waits.batch_p99 < bound.min(LEASE_TIMEOUT),
        "batch p99 {}s within agingAfter + one call ({bound}s) and the lease timeout",
        waits.batch_p99
    );
    assert!(
        b_tally.error_rate() < 0.02,
        "batch hardly ever times out: {b_tally}"
    );

    // The operator reports the demand per class: what the 8 interactive and 16 batch callers
    // ask for (leased + pending), while the target stays the total's.
    let (status, split) = eventually("the status splits the demand by class", WAIT, || async {
        let b = stack.backend_status("model-a").await?;
        let split = b.demand_by_class.clone().context("no demandByClass yet")?;
        anyhow::ensure!(
            (5.0..=9.0).contains(&split.interactive) && (12.0..=17.0).contains(&split.batch),
            "{split:?}"
        );
        Ok((b, split))
    })
    .await?;
    figure(
        SCENARIO,
        "status demandByClass",
        format!(
            "interactive {:.1}, batch {:.1} (leased + pending {:.1})",
            split.interactive,
            split.batch,
            status.leased.unwrap_or_default() + status.pending.unwrap_or_default()
        ),
    );
    assert_eq!(status.target, TARGET, "the target is the total's, held");

    // === Phase 2: batch capped at 50% of each gateway's connections ===
    set(
        &mut policy,
        "/spec/clients/priority/batchMaxPercent",
        json!(BATCH_PERCENT),
    )?;
    stack.apply(&policy).await?;
    stack
        .wait_limits("every gateway runs the batch cap", 2, WAIT, |l| {
            let p = l
                .client_policies
                .first()
                .and_then(|c| c.priority.as_ref())
                .context("no priority rules")?;
            anyhow::ensure!(p.batch_max_percent == Some(BATCH_PERCENT), "{p:?}");
            Ok(())
        })
        .await?;
    let from = interactive.now();
    tokio::time::sleep(MEASURE).await;
    let to = interactive.now();
    let window = MEASURE - Duration::from_secs(2);
    let waits = Waits::read(stack, window).await?;
    let (i_tally, b_tally) = (interactive.window(from + 1, to), batch.window(from + 1, to));
    waits.report("classes + batch cap", &i_tally, &b_tally);
    let batch_held_peak = prom_value(
        stack,
        &format!(
            "max(max_over_time(poolpilot_pool_class_leased{{namespace=\"{}\", backend=\"model-a\", class=\"batch\"}}[{}s]))",
            stack.name(),
            window.as_secs()
        ),
    )
    .await?;
    figure(
        SCENARIO,
        "classes + batch cap: batch connections held, peak per gateway",
        format!("{batch_held_peak} (cap {BATCH_CAP})"),
    );
    assert!(
        batch_held_peak <= BATCH_CAP,
        "batch held {batch_held_peak} connections on a gateway, cap {BATCH_CAP}"
    );
    waits.assert_interactive_first("classes + batch cap");
    assert_eq!(i_tally.failed(), 0, "no interactive call fails: {i_tally}");
    let per_second = progress(&batch, from, to);
    assert!(
        per_second.iter().all(|ok| *ok > 0),
        "batch progresses under its cap every second: {per_second:?}"
    );

    interactive.stop().await;
    batch.stop().await;
    Ok(())
}

/// Lease waits by class over a window, as Prometheus has them from the gateways' histograms.
struct Waits {
    interactive_mean: f64,
    interactive_p99: f64,
    batch_mean: f64,
    batch_p50: f64,
    batch_p99: f64,
}

impl Waits {
    async fn read(stack: &Stack<'_>, window: Duration) -> anyhow::Result<Self> {
        let quantile = |q: f64, class: &str| {
            format!(
                "histogram_quantile({q}, sum by (le) (rate(poolpilot_pool_class_lease_wait_seconds_bucket{{namespace=\"{}\", backend=\"model-a\", class=\"{class}\"}}[{}s])))",
                stack.name(),
                window.as_secs()
            )
        };
        let mean = |class: &str| {
            let series = |part: &str| {
                format!(
                    "sum(rate(poolpilot_pool_class_lease_wait_seconds_{part}{{namespace=\"{}\", backend=\"model-a\", class=\"{class}\"}}[{}s]))",
                    stack.name(),
                    window.as_secs()
                )
            };
            format!("{} / {}", series("sum"), series("count"))
        };
        Ok(Self {
            interactive_mean: prom_value(stack, &mean("interactive")).await?,
            batch_mean: prom_value(stack, &mean("batch")).await?,
            interactive_p99: prom_value(stack, &quantile(0.99, "interactive")).await?,
            batch_p50: prom_value(stack, &quantile(0.5, "batch")).await?,
            batch_p99: prom_value(stack, &quantile(0.99, "batch")).await?,
        })
    }

    /// Interactive calls wait well below the lease timeout while batch takes the wait.
    fn assert_interactive_first(&self, phase: &str) {
        assert!(
            self.interactive_p99 < LEASE_TIMEOUT / 2.0,
            "{phase}: interactive p99 {}s must stay well below the lease timeout",
            self.interactive_p99
        );
        assert!(
            self.batch_mean > 2.0 * self.interactive_mean,
            "{phase}: batch takes the wait: mean {}s vs interactive {}s",
            self.batch_mean,
            self.interactive_mean
        );
    }

    fn report(&self, phase: &str, interactive: &Tally, batch: &Tally) {
        let ms = |secs: f64| format!("{:.0}", secs * 1000.0);
        figure(
            SCENARIO,
            &format!("{phase}: interactive mean / p99 lease wait (ms)"),
            format!(
                "{} / {}",
                ms(self.interactive_mean),
                ms(self.interactive_p99)
            ),
        );
        figure(
            SCENARIO,
            &format!("{phase}: batch mean / p50 / p99 lease wait (ms)"),
            format!(
                "{} / {} / {}",
                ms(self.batch_mean),
                ms(self.batch_p50),
                ms(self.batch_p99)
            ),
        );
        figure(
            SCENARIO,
            &format!("{phase}: interactive calls"),
            interactive,
        );
        figure(SCENARIO, &format!("{phase}: batch calls"), batch);
    }
}

/// Batch calls completed in each whole second of `(from, to)`.
fn progress(load: &Load, from: u64, to: u64) -> Vec<u64> {
    load.seconds()
        .into_iter()
        .filter(|(s, _)| *s > from && *s < to)
        .map(|(_, t)| t.ok)
        .collect()
}

/// The first value of an instant query (`NaN` is refused: no data).
async fn prom_value(stack: &Stack<'_>, promql: &str) -> anyhow::Result<f64> {
    let rows = stack.ns().cluster().prometheus_query(promql).await?;
    let value: f64 = rows
        .first()
        .and_then(|r| r["value"][1].as_str())
        .with_context(|| format!("no value from {promql}: {rows:?}"))?
        .parse()?;
    anyhow::ensure!(value.is_finite(), "{promql} = {value}");
    Ok(value)
}
