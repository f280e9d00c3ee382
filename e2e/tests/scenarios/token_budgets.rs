//! Scenario token budgets: two clients on one backend behind 3 gateways, `long` sending
//! 200-token completions and `short` 4-token ones. First `long` has a fleet-wide budget of
//! 24,000 tokens a minute and every call of it lands on one gateway (as an L4 load balancer
//! pins a client with a few keep-alive connections): the operator divides its budget by where
//! its tokens are used, so within a few intervals that gateway holds over 95% of it, the parts
//! of the three never add up to more than the budget, and over a minute the tokens charged to
//! it across the fleet are within 5% of the budget (an even third would have given it 8,000).
//! Then `long` loses its budget and saturates the pool with twice as many callers as it has
//! connections: token-fair queueing keeps `short`'s p99 call time within 2× of what it was
//! alone on the same pool. Last, `long` gets `weight: 100`, which hands it the pool as a queue
//! blind to tokens would: the figure of what `short` pays without token fairness.
//!
//! ```text
//!  long (8 workers, budget 24000/min) ──► gw-0 ──┐
//!                                                ├─► model-a (2 instances, 8 connections a gateway)
//!  short (16 workers, 4 tokens a call) ─► gw-0 ──┘
//!  parts of long's budget: [8000, 8000, 8000] ──(its use on gw-0)──► [23200, 400, 400]
//! ```
//!
//! The lease wait is not exported per client (its histogram is per backend and class, and the
//! two clients share both), so `short` is judged by its calls' p99 duration at the client: its
//! lease wait plus a 28 ms call.

use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::GatewayLimits;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, POLICY, Stack, StackSpec, WAIT, metric_sum, one_backend_policy, set,
    share, with_stack,
};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;

const SCENARIO: &str = "token-budgets";
/// The autoscale interval: each decision re-judges the division of the budgets.
const INTERVAL: Duration = Duration::from_secs(5);
/// The fleet target per endpoint, held (min = max): 12 × 2 instances over 3 gateways, 8
/// connections a gateway.
const TARGET: u32 = 12;
/// `long`'s budget, tokens a minute across the fleet.
const BUDGET: u64 = 24_000;
/// Output tokens of a call of each client.
const LONG_TOKENS: u32 = 200;
const SHORT_TOKENS: u32 = 4;
/// modelsim: 20 ms to the first token, then 2 ms a token (a long call 420 ms, a short 28 ms).
const BASE_MS: u32 = 20;
const PER_TOKEN_MS: u32 = 2;
/// `long`'s callers while it has a budget (unbounded they would use ~7 times as much).
const LONG_BUDGETED: usize = 8;
/// `long`'s callers when it saturates the pool: twice gw-0's 8 connections.
const LONG_SATURATING: usize = 16;
/// `short`'s callers: twice the pool too, so that it queues alone already.
const SHORT_WORKERS: usize = 16;
/// The bound of the budget's use over a minute.
const HOLDS: f64 = 0.05;
/// The bound of `short`'s p99 with `long` saturating, over its p99 alone.
const FAIR: f64 = 2.0;
/// How long each fairness phase is measured.
const MEASURE: Duration = Duration::from_secs(15);

#[tokio::test]
async fn a_pinned_clients_fleet_budget_holds_on_its_pod_and_token_fair_queueing_shields_short_calls()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        operators: 1,
        backends: vec![
            BackendSpec::new("model-a", 2, 64)
                .service_ms(BASE_MS)
                .arg(format!("--per-token-ms={PER_TOKEN_MS}")),
        ],
        ..StackSpec::default()
    };
    with_stack("tokens", spec, async |stack| scenario(stack).await).await
}

/// The overrides of the two clients (`long-0` and `short-0`, the load's first keys), `long`
/// with `tokens` and `weight` when given.
fn overrides(tokens: Option<Value>, weight: Option<u32>) -> Value {
    let sha = |key: &str| hex::encode(Sha256::digest(key.as_bytes()));
    let mut long = json!({
        "name": "long",
        "match": {"keySha256": sha("long-0")},
        "maxConcurrency": 64
    });
    if let Some(t) = tokens {
        long["tokens"] = t;
    }
    if let Some(w) = weight {
        long["weight"] = json!(w);
    }
    json!([long, {"name": "short", "match": {"keySha256": sha("short-0")}, "maxConcurrency": 64}])
}

/// `long`'s part of its budget, tokens a minute, in a gateway's document.
fn long_part(limits: &GatewayLimits) -> Option<u64> {
    limits
        .client_policies
        .iter()
        .flat_map(|c| &c.overrides)
        .find(|o| o.name == "long")?
        .tokens
        .as_ref()
        .map(|t| t.per_minute)
}

/// The tokens charged to `long`'s budget so far, summed over the gateways' own counters.
async fn long_charged(gateways: &[GatewayPod]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for g in gateways {
        let text = g.metrics().await?;
        total += metric_sum(&text, "poolpilot_client_tokens_total", &["client=\"long\""]);
    }
    Ok(total)
}

async fn scenario(stack: &Stack<'_>) -> anyhow::Result<()> {
    let mut policy = one_backend_policy("model-a", INTERVAL, TARGET, TARGET)?;
    set(
        &mut policy,
        "/spec/clients/overrides",
        overrides(Some(json!({"perMinute": BUDGET})), None),
    )?;
    stack.apply(&policy).await?;
    let mut gateways = stack.wait_gateways(3).await?;
    gateways.sort_by(|a, b| a.name.cmp(&b.name));
    let pinned = &gateways[0];
    let even = BUDGET / 3;
    stack
        .wait_limits(
            "every gateway runs its share and long's even part",
            3,
            WAIT,
            |l| {
                anyhow::ensure!(share(l, "model-a")? == TARGET / 3, "share");
                anyhow::ensure!(long_part(l) == Some(even), "long: {:?}", long_part(l));
                Ok(())
            },
        )
        .await?;

    // === Phase 1: long pinned to gw-0 with its fleet-wide budget ===
    let long = Load::start_as(
        LoadSpec {
            clients: 1,
            honour_retry_after: true,
            ..LoadSpec::one_client_per_worker(
                vec![pinned.proxy()],
                "model-a",
                LONG_TOKENS,
                LONG_BUDGETED,
                Duration::from_secs(30),
            )
        },
        LONG_BUDGETED,
        "long",
        None,
    )?;
    let started = Instant::now();
    let parts = eventually(
        "long's budget follows it to its pod",
        8 * INTERVAL,
        || async {
            let mut parts = Vec::new();
            for g in &gateways {
                parts.push(long_part(&g.limits().await?).context("no part for long")?);
            }
            anyhow::ensure!(
                parts[0] as f64 >= 0.95 * BUDGET as f64,
                "long's parts {parts:?} of {BUDGET}"
            );
            Ok(parts)
        },
    )
    .await?;
    figure(
        SCENARIO,
        "pinned budget: parts after",
        format!("{:.1} s: {parts:?}", started.elapsed().as_secs_f64()),
    );
    let sum: u64 = parts.iter().sum();
    assert!(
        sum <= BUDGET,
        "the parts {parts:?} add up to more than {BUDGET}"
    );

    // The part grew under a bucket that kept what it had used: let the client spend the grown
    // room, then count a minute of what it is charged across the three gateways.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let before = long_charged(&gateways).await?;
    let calls_from = long.now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let used = long_charged(&gateways).await? - before;
    let tally = long.window(calls_from, long.now());
    figure(
        SCENARIO,
        "pinned budget: tokens charged in a minute",
        format!(
            "{used:.0} of {BUDGET} ({:+.1}%), {tally}",
            (used / BUDGET as f64 - 1.0) * 100.0
        ),
    );
    assert!(
        (used - BUDGET as f64).abs() <= HOLDS * BUDGET as f64,
        "the fleet-wide budget holds within 5% over a minute on the pinned client's pod: \
         {used:.0} of {BUDGET}"
    );
    assert!(
        tally.errors_of("rate_limit_exceeded") > 0,
        "long asked for more than its budget: {tally}"
    );
    let status = stack.policy(POLICY).await?.status.unwrap_or_default();
    let shown = status
        .tokens
        .iter()
        .find(|t| t.client == "long")
        .context("no status.tokens for long")?;
    figure(
        SCENARIO,
        "pinned budget: status",
        format!(
            "used {:?} a minute, parts {:?}",
            shown.used_per_minute,
            shown
                .shares
                .iter()
                .map(|s| s.per_minute)
                .collect::<Vec<_>>()
        ),
    );
    assert_eq!(shown.per_minute, BUDGET);
    assert!(
        shown
            .used_per_minute
            .is_some_and(|u| u > 0.5 * BUDGET as f64),
        "status shows the budget's use: {shown:?}"
    );
    long.stop().await;

    // === Phase 2: short alone, then with long saturating the pool (no budget) ===
    set(
        &mut policy,
        "/spec/clients/overrides",
        overrides(None, None),
    )?;
    stack.apply(&policy).await?;
    stack
        .wait_limits("long has no budget", 3, WAIT, |l| {
            anyhow::ensure!(long_part(l).is_none(), "long: {:?}", long_part(l));
            Ok(())
        })
        .await?;
    let short = Load::start_as(
        LoadSpec {
            clients: 1,
            ..LoadSpec::one_client_per_worker(
                vec![pinned.proxy()],
                "model-a",
                SHORT_TOKENS,
                SHORT_WORKERS,
                Duration::from_secs(10),
            )
        },
        SHORT_WORKERS,
        "short",
        None,
    )?;
    let solo = p99(&short, "short alone", true).await?;
    let long = Load::start_as(
        LoadSpec {
            clients: 1,
            ..LoadSpec::one_client_per_worker(
                vec![pinned.proxy()],
                "model-a",
                LONG_TOKENS,
                LONG_SATURATING,
                Duration::from_secs(30),
            )
        },
        LONG_SATURATING,
        "long",
        None,
    )?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let long_from = long.now();
    let fair = p99(&short, "short beside long, token-fair", true).await?;
    let long_tally = long.window(long_from, long.now());
    figure(SCENARIO, "token-fair: long's calls meanwhile", &long_tally);
    assert!(
        long_tally.ok > 0,
        "long is served too: token fairness shares the pool, it does not starve: {long_tally}"
    );
    let ratio = fair.as_secs_f64() / solo.as_secs_f64();
    figure(
        SCENARIO,
        "token-fair: short's p99 over its p99 alone",
        format!("{ratio:.2}"),
    );
    assert!(
        ratio <= FAIR,
        "short's p99 {fair:?} beside long is within {FAIR}× its p99 alone ({solo:?})"
    );

    // === Phase 3: long weighted 100: the queue hands it the pool, as one blind to tokens ===
    set(
        &mut policy,
        "/spec/clients/overrides",
        overrides(None, Some(100)),
    )?;
    stack.apply(&policy).await?;
    stack
        .wait_limits("long weighs 100", 3, WAIT, |l| {
            let weight = l
                .client_policies
                .iter()
                .flat_map(|c| &c.overrides)
                .find(|o| o.name == "long")
                .and_then(|o| o.weight);
            anyhow::ensure!(weight == Some(100), "long's weight {weight:?}");
            Ok(())
        })
        .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // A figure only: short may now wait past the lease timeout and fail.
    let weighted = p99(&short, "short beside long weighted 100", false).await?;
    figure(
        SCENARIO,
        "long weighted 100: short's p99 over its p99 alone",
        format!("{:.2}", weighted.as_secs_f64() / solo.as_secs_f64()),
    );
    short.stop().await;
    long.stop().await;
    Ok(())
}

/// `short`'s p99 call duration over the next [`MEASURE`], printed as a figure of `phase`;
/// `strict`: its calls must not fail either.
async fn p99(short: &Load, phase: &str, strict: bool) -> anyhow::Result<Duration> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let from = short.now();
    tokio::time::sleep(MEASURE).await;
    let to = short.now();
    let tally = short.window(from, to);
    let p50 = short.latency_quantile(from, to, 0.5);
    let p99 = short
        .latency_quantile(from, to, 0.99)
        .with_context(|| format!("{phase}: no call of short ended: {tally}"))?;
    figure(
        SCENARIO,
        &format!("{phase}: short's p50 / p99 call (ms)"),
        format!(
            "{:.0} / {:.0}, {tally}",
            p50.unwrap_or_default().as_secs_f64() * 1000.0,
            p99.as_secs_f64() * 1000.0
        ),
    );
    anyhow::ensure!(
        !strict || tally.error_rate() < 0.01,
        "{phase}: short's calls fail: {tally}"
    );
    Ok(p99)
}
