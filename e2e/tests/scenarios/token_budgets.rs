//! Scenario token budgets: two clients on one backend behind 3 gateways, `long` sending
//! 200-token completions and `short` 4-token ones. First `long` has a fleet-wide budget of
//! 24,000 tokens a minute and every call of it lands on one gateway (as an L4 load balancer
//! pins a client with a few keep-alive connections): the operator divides its budget by where
//! its tokens are used, so within a few intervals that gateway holds over 99% of it (the other
//! two keep a hundredth of the even part each), the parts of the three never add up to more
//! than the budget, and over a minute the tokens charged to it across the fleet are within 5%
//! of the budget (an even third would have given it 8,000). Beside it `pinned`, a client
//! without an override, has the policy's own fleet-wide budget (the same 24,000) and every
//! call on another gateway: the pods report it among the clients that spend the most tokens,
//! the operator divides its budget by where it spends (`clientTokenShares`), and the same
//! holds of it. The minute is counted in slices, with the parts seen meanwhile, so that a
//! minute that falls short shows when and why.
//! Then `long` loses its budget, model-a's target is held at 6 per endpoint, of which gw-0, the
//! only pod with calls, holds all but the other pods' floors (the operator divides the target by
//! demand: 4 per endpoint, 8 connections, checked at every turn's ends), and `short` (24 callers,
//! three times those, so that it queues alone already) runs in turns alone and beside `long`
//! saturating the pool with 16 callers of its own, three of each, every condition's windows pooled
//! so that a machine busier in one part of the run weighs on both alike: token-fair queueing keeps
//! `short`'s p99 lease wait (and its p99 call time) within 2× of its value alone, same client, same
//! pod. The load's shape sets the ratio: the fair queue gives the two clients about the same tokens
//! a second, on these calls 5.5 of the 8 connections to `short`, whose N callers then wait
//! N ÷ 5.5 − 1 calls instead of N ÷ 8 − 1: 1.9× with 16 callers (p99 ratios of 1.84–2.10, one
//! fresh-clone CI run over 2), 1.68× with 24 (the runs are in e2e/README.md). Last,
//! `long` gets `weight: 100`, which hands it the pool as a queue blind to tokens would: the figures
//! of what `short` pays without token fairness.
//!
//! ```text
//!  long (8 workers, budget 24000/min) ──► gw-0 ──┐
//!  pinned (8 workers, no override) ─────► gw-1 ──┼─► model-a (2 instances, 8 connections a gateway)
//!  short (24 workers, 4 tokens a call) ─► gw-0 ──┘
//!  parts of long's budget: [8000, 8000, 8000] ──(its use on gw-0)──► [23840, 80, 80]
//!  parts of pinned's:      [8000, 8000, 8000] ──(its use on gw-1)──► [80, 23840, 80]
//! ```
//!
//! The lease wait is not exported per client (its histogram is per backend and class, and the
//! two clients share both), so `short`'s come from gw-0's access log (`lease_wait_ms` of its
//! lines), read once at the end and cut into the turns by each line's `ts`: every call, since
//! the node rotates a container's log only past 256 MiB (e2e/cluster/node.go); each turn's
//! lines are checked against the calls its load counted.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::GatewayLimits;
use poolpilot_e2e::cluster::run;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec, Tally, nearest_rank};
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
/// The budgets of phase 1, tokens a minute across the fleet: `long`'s own, and the policy's,
/// which `pinned` has.
const BUDGET: u64 = 24_000;
/// Output tokens of a call of each client.
const LONG_TOKENS: u32 = 200;
const SHORT_TOKENS: u32 = 4;
/// modelsim: 20 ms to the first token, then 2 ms a token (a long call 420 ms, a short 28 ms).
const BASE_MS: u32 = 20;
const PER_TOKEN_MS: u32 = 2;
/// The callers of each budgeted client (unbounded they would use ~7 times their budget).
const LONG_BUDGETED: usize = 8;
/// `long`'s gateway and `pinned`'s, in name order.
const LONG_POD: usize = 0;
const PINNED_POD: usize = 1;
/// The least part of its budget a pinned client's pod holds once the division followed it:
/// all but the floors of the other two pods, a hundredth of the even part each.
const PINNED_PART: f64 = 0.99;
/// The slices of the measured minute.
const SLICE: Duration = Duration::from_secs(5);
/// model-a's fleet target per endpoint from phase 2 on, held: the operator divides it by
/// demand, so gw-0, the only pod with calls, holds all of it but the other two pods' floors
/// of 1 ([`TURNS_SHARE`]) whether `short` is alone or beside `long`: the same pool in every
/// turn.
const TURNS_TARGET: u32 = 6;
/// gw-0's share per endpoint then: 8 connections over the two instances.
const TURNS_SHARE: u32 = TURNS_TARGET - 2;
/// `long`'s callers when it saturates the pool: twice gw-0's 8 connections.
const LONG_SATURATING: usize = 16;
/// `short`'s callers: three times the pool, so that it queues alone already (alone with more
/// connections than callers its lease wait would be nothing, and no wait beside `long` within
/// 2× of it), and so that its fair share of the pool (5.5 of 8 connections) puts its wait beside
/// `long` at 1.68× its wait alone (24 ÷ 5.5 − 1 calls against 24 ÷ 8 − 1); with 16 callers that
/// was 1.9×, and a run's tails crossed 2.
const SHORT_WORKERS: usize = 24;
/// The bound of the budget's use over a minute.
const HOLDS: f64 = 0.05;
/// The bound of `short`'s p99 lease wait (and call) with `long` saturating, over its p99 alone.
const FAIR: f64 = 2.0;
/// The turns of `short` alone and beside `long`, each condition's windows pooled: a machine
/// busier in one part of the run weighs on both alike.
const ROUNDS: usize = 3;
/// How long each turn is measured, after [`SETTLE`].
const MEASURE: Duration = Duration::from_secs(10);
/// From a change of `long`'s callers to its turn's window: its calls of 420 ms have ended or
/// begun.
const SETTLE: Duration = Duration::from_secs(3);

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

/// `pinned`'s part of the policy's budget, tokens a minute, in a gateway's document: its
/// `clientTokenShares` entry when the operator divided the budget by where it spends, else the
/// policy's (even) part.
fn pinned_part(limits: &GatewayLimits) -> Option<u64> {
    let sha = hex::encode(Sha256::digest(b"pinned-0"));
    let policy = limits.client_policies.iter().find(|c| c.tokens.is_some())?;
    let share = policy
        .client_token_shares
        .iter()
        .find(|s| s.key_sha256 == sha)
        .map(|s| s.per_minute);
    share.or(policy.tokens.as_ref().map(|t| t.per_minute))
}

/// A client pinned to one gateway with a fleet-wide budget.
struct Pinned<'a> {
    name: &'static str,
    /// Its gateway, in name order.
    pod: usize,
    /// Its part of its budget in a gateway's document.
    part: fn(&GatewayLimits) -> Option<u64>,
    /// Its series of `poolpilot_client_tokens_total` (an override's name, or `other`).
    label: &'static str,
    load: &'a Load,
}

/// A minute of one pinned client: the tokens charged to it over the fleet at each slice's edge,
/// the parts its pod held at them, and its load's seconds.
struct Minute {
    charged: Vec<f64>,
    parts_seen: BTreeSet<u64>,
    calls_from: u64,
    calls_to: u64,
}

impl Minute {
    fn used(&self) -> f64 {
        self.charged.last().unwrap_or(&0.0) - self.charged.first().unwrap_or(&0.0)
    }

    fn slices(&self) -> Vec<f64> {
        self.charged.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Counts a minute of `clients`: the tokens charged to each, summed over the gateways' own
/// counters, and its pod's part of its budget, every [`SLICE`]: a minute that falls short shows
/// when (a slice), and whether its part moved meanwhile.
async fn measure_minute(
    gateways: &[GatewayPod],
    clients: &[Pinned<'_>],
) -> anyhow::Result<Vec<Minute>> {
    let mut minutes: Vec<Minute> = clients
        .iter()
        .map(|c| Minute {
            charged: Vec::new(),
            parts_seen: BTreeSet::new(),
            calls_from: c.load.now(),
            calls_to: 0,
        })
        .collect();
    let start = Instant::now();
    let slices = (Duration::from_secs(60).as_secs() / SLICE.as_secs()) as u32;
    for k in 0..=slices {
        tokio::time::sleep_until(start + SLICE * k).await;
        let mut texts = Vec::new();
        for g in gateways {
            texts.push(g.metrics().await?);
        }
        for (c, m) in clients.iter().zip(&mut minutes) {
            let charged = texts
                .iter()
                .map(|t| metric_sum(t, "poolpilot_client_tokens_total", &[c.label]))
                .sum();
            m.charged.push(charged);
            if let Some(part) = (c.part)(&gateways[c.pod].limits().await?) {
                m.parts_seen.insert(part);
            }
        }
    }
    for (c, m) in clients.iter().zip(&mut minutes) {
        m.calls_to = c.load.now();
    }
    Ok(minutes)
}

async fn scenario(stack: &Stack<'_>) -> anyhow::Result<()> {
    let mut policy = one_backend_policy("model-a", INTERVAL, TARGET, TARGET)?;
    set(
        &mut policy,
        "/spec/clients/overrides",
        overrides(Some(json!({"perMinute": BUDGET})), None),
    )?;
    // The policy's own budget, the one `pinned` (no override) has; its concurrency out of the
    // way of the budget's (the sample's 8 a client, divided over 3 pods).
    set(
        &mut policy,
        "/spec/clients/tokens",
        json!({"perMinute": BUDGET}),
    )?;
    set(&mut policy, "/spec/clients/maxConcurrency", json!(64))?;
    stack.apply(&policy).await?;
    let mut gateways = stack.wait_gateways(3).await?;
    gateways.sort_by(|a, b| a.name.cmp(&b.name));
    let even = BUDGET / 3;
    stack
        .wait_limits(
            "every gateway runs its share and the budgets' even parts",
            3,
            WAIT,
            |l| {
                anyhow::ensure!(share(l, "model-a")? == TARGET / 3, "share");
                anyhow::ensure!(long_part(l) == Some(even), "long: {:?}", long_part(l));
                anyhow::ensure!(pinned_part(l) == Some(even), "pinned: {:?}", pinned_part(l));
                Ok(())
            },
        )
        .await?;

    // === Phase 1: long pinned to gw-0, pinned (no override) to gw-1, fleet-wide budgets ===
    let budgeted = |gateway: &GatewayPod, key_prefix: &str| {
        Load::start_as(
            LoadSpec {
                clients: 1,
                honour_retry_after: true,
                ..LoadSpec::one_client_per_worker(
                    vec![gateway.proxy()],
                    "model-a",
                    LONG_TOKENS,
                    LONG_BUDGETED,
                    Duration::from_secs(30),
                )
            },
            LONG_BUDGETED,
            key_prefix,
            None,
        )
    };
    let long = budgeted(&gateways[LONG_POD], "long")?;
    let pinned = budgeted(&gateways[PINNED_POD], "pinned")?;
    let started = Instant::now();
    let clients = [
        Pinned {
            name: "long",
            pod: LONG_POD,
            part: long_part,
            label: "client=\"long\"",
            load: &long,
        },
        Pinned {
            name: "pinned",
            pod: PINNED_POD,
            part: pinned_part,
            label: "client=\"other\"",
            load: &pinned,
        },
    ];
    let parts = eventually(
        "each client's budget follows it to its pod",
        8 * INTERVAL,
        || async {
            let mut limits = Vec::new();
            for g in &gateways {
                limits.push(g.limits().await?);
            }
            let mut all = Vec::new();
            for c in &clients {
                let parts = limits
                    .iter()
                    .map(|l| (c.part)(l).with_context(|| format!("no part for {}", c.name)))
                    .collect::<anyhow::Result<Vec<u64>>>()?;
                anyhow::ensure!(
                    parts[c.pod] as f64 >= PINNED_PART * BUDGET as f64,
                    "{}'s parts {parts:?} of {BUDGET}",
                    c.name
                );
                all.push(parts);
            }
            Ok(all)
        },
    )
    .await?;
    let after = started.elapsed().as_secs_f64();
    for (c, parts) in clients.iter().zip(&parts) {
        figure(
            SCENARIO,
            &format!("{} budget: parts after", c.name),
            format!("{after:.1} s: {parts:?}"),
        );
        let sum: u64 = parts.iter().sum();
        assert!(
            sum <= BUDGET,
            "{}'s parts {parts:?} add up to more than {BUDGET}",
            c.name
        );
    }

    // The part grew under a bucket that kept what it had used: let the clients spend the grown
    // room, then count a minute of what each is charged across the three gateways, in slices.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let minute = measure_minute(&gateways, &clients).await?;
    for (c, m) in clients.iter().zip(&minute) {
        let used = m.used();
        let tally = c.load.window(m.calls_from, m.calls_to);
        figure(
            SCENARIO,
            &format!("{} budget: tokens charged in a minute", c.name),
            format!(
                "{used:.0} of {BUDGET} ({:+.1}%), {tally}",
                (used / BUDGET as f64 - 1.0) * 100.0
            ),
        );
        figure(
            SCENARIO,
            &format!(
                "{} budget: charged each {} s, parts seen",
                c.name,
                SLICE.as_secs()
            ),
            format!(
                "{:?}, {:?}",
                m.slices()
                    .iter()
                    .map(|v| v.round() as u64)
                    .collect::<Vec<_>>(),
                m.parts_seen
            ),
        );
        figure(
            SCENARIO,
            &format!(
                "{} budget: Retry-After (reason, s) → calls; p50 / p99 ok call (ms)",
                c.name
            ),
            format!(
                "{:?}; {:.0} / {:.0}",
                tally.retry_after_secs,
                c.load
                    .latency_quantile(m.calls_from, m.calls_to, 0.5)
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1000.0,
                c.load
                    .latency_quantile(m.calls_from, m.calls_to, 0.99)
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1000.0
            ),
        );
    }
    for (c, m) in clients.iter().zip(&minute) {
        let used = m.used();
        let tally = c.load.window(m.calls_from, m.calls_to);
        assert!(
            (used - BUDGET as f64).abs() <= HOLDS * BUDGET as f64,
            "the fleet-wide budget holds within 5% over a minute on {}'s pod: {used:.0} of \
             {BUDGET}",
            c.name
        );
        assert!(
            tally.errors_of("rate_limit_exceeded") > 0,
            "{} asked for more than its budget: {tally}",
            c.name
        );
    }
    let status = stack.policy(POLICY).await?.status.unwrap_or_default();
    let shown = status
        .tokens
        .iter()
        .find(|t| t.client == "long")
        .context("no status.tokens for long")?;
    figure(
        SCENARIO,
        "long budget: status",
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
    pinned.stop().await;

    // === Phase 2: short alone and beside long saturating the pool (no budget), in turns ===
    set(
        &mut policy,
        "/spec/clients/overrides",
        overrides(None, None),
    )?;
    set(&mut policy, "/spec/autoscale/min", json!(TURNS_TARGET))?;
    set(&mut policy, "/spec/autoscale/max", json!(TURNS_TARGET))?;
    if let Some(clients) = policy
        .pointer_mut("/spec/clients")
        .and_then(Value::as_object_mut)
    {
        clients.remove("tokens");
    }
    stack.apply(&policy).await?;
    stack
        .wait_limits("nobody has a budget", 3, WAIT, |l| {
            anyhow::ensure!(long_part(l).is_none(), "long: {:?}", long_part(l));
            anyhow::ensure!(
                l.client_policies.iter().all(|c| c.tokens.is_none()),
                "the policy's budget is still in force"
            );
            anyhow::ensure!(share(l, "model-a")? <= TURNS_SHARE, "share");
            Ok(())
        })
        .await?;
    let on_gw0 = |tokens: u32, workers: usize, timeout: u64| LoadSpec {
        clients: 1,
        ..LoadSpec::one_client_per_worker(
            vec![gateways[LONG_POD].proxy()],
            "model-a",
            tokens,
            workers,
            Duration::from_secs(timeout),
        )
    };
    // The wall clock at short's start: where its seconds fall in the access log.
    let short_began = jiff::Timestamp::now();
    let short = Load::start_as(
        on_gw0(SHORT_TOKENS, SHORT_WORKERS, 10),
        SHORT_WORKERS,
        "short",
        None,
    )?;
    // Idle until a turn beside short: each turn's callers finish their call and idle after it.
    let long = Load::start_as(on_gw0(LONG_TOKENS, LONG_SATURATING, 30), 0, "long", None)?;
    let gw0 = &gateways[LONG_POD];
    eventually(
        "gw-0, the pod with short's calls, holds model-a's target but the floors",
        8 * INTERVAL,
        || async {
            let held = share(&gw0.limits().await?, "model-a")?;
            anyhow::ensure!(held == TURNS_SHARE, "gw-0's share {held}");
            Ok(())
        },
    )
    .await?;
    let mut alone = Vec::new();
    let mut fair = Vec::new();
    let mut long_tally = Tally::default();
    for _ in 0..ROUNDS {
        alone.push(measure(&short, gw0).await?);
        long.set_workers(LONG_SATURATING);
        let long_from = long.now();
        fair.push(measure(&short, gw0).await?);
        long_tally.add(&long.window(long_from, long.now()));
        long.set_workers(0);
    }
    figure(SCENARIO, "token-fair: long's calls meanwhile", &long_tally);
    assert!(
        long_tally.ok > 0,
        "long is served too: token fairness shares the pool, it does not starve: {long_tally}"
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
    long.set_workers(LONG_SATURATING);
    let weighted = measure(&short, gw0).await?;
    long.stop().await;
    short.set_workers(0);

    // Every call of every turn from gw-0's access log, read once at the end (the node keeps a
    // container's log whole up to 256 MiB: e2e/cluster/node.go).
    let log =
        run(stack
            .kubectl()
            .args(["logs", "-n", stack.ns().name(), &gateways[LONG_POD].name]))
        .await?;
    let waits = short_waits(&log);
    let turn = |w: &Window| w.read(&short, short_began, &waits);
    let alone: Vec<Turn> = alone.iter().map(turn).collect::<anyhow::Result<_>>()?;
    let fair: Vec<Turn> = fair.iter().map(turn).collect::<anyhow::Result<_>>()?;
    let weighted = turn(&weighted)?;
    for (k, (a, f)) in alone.iter().zip(&fair).enumerate() {
        figure(
            SCENARIO,
            &format!(
                "turn {}: short's p99 lease wait alone / token-fair (ms)",
                k + 1
            ),
            format!("{} / {}", a.lease_p99_ms(), f.lease_p99_ms()),
        );
    }
    let solo = Turn::pooled(&alone);
    let beside = Turn::pooled(&fair);
    solo.figures("short alone");
    beside.figures("short beside long, token-fair");
    weighted.figures("short beside long weighted 100");
    for t in alone.iter().chain(&fair) {
        anyhow::ensure!(
            t.tally.error_rate() < 0.01,
            "short's calls fail: {}",
            t.tally
        );
    }
    let lease_ratio = Turn::ratio(&beside.lease, &solo.lease);
    let call_ratio = Turn::ratio(&beside.calls, &solo.calls);
    figure(
        SCENARIO,
        "token-fair: short's p99 lease wait / call over alone",
        format!("{lease_ratio:.2} / {call_ratio:.2}"),
    );
    figure(
        SCENARIO,
        "long weighted 100: short's p99 lease wait / call over alone",
        format!(
            "{:.2} / {:.2}",
            Turn::ratio(&weighted.lease, &solo.lease),
            Turn::ratio(&weighted.calls, &solo.calls)
        ),
    );
    assert!(
        lease_ratio <= FAIR,
        "short's p99 lease wait beside long ({} ms) is within {FAIR}× its p99 alone ({} ms)",
        beside.lease_p99_ms(),
        solo.lease_p99_ms()
    );
    assert!(
        call_ratio <= FAIR,
        "short's p99 call beside long is within {FAIR}× its p99 alone: {call_ratio:.2}"
    );
    short.stop().await;
    Ok(())
}

/// A window of `short`'s load: its seconds `[from, to)`.
struct Window {
    from: u64,
    to: u64,
}

/// Waits [`SETTLE`], then the next [`MEASURE`] of whole seconds of `load`, with `gateway`'s
/// share of model-a at [`TURNS_SHARE`] at both ends: the same pool as every other turn.
async fn measure(load: &Load, gateway: &GatewayPod) -> anyhow::Result<Window> {
    tokio::time::sleep(SETTLE).await;
    let from = load.now() + 1;
    let to = from + MEASURE.as_secs();
    let before = share(&gateway.limits().await?, "model-a")?;
    while load.now() < to {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = share(&gateway.limits().await?, "model-a")?;
    anyhow::ensure!(
        before == TURNS_SHARE && after == TURNS_SHARE,
        "gw-0's pool moved in seconds {from}..{to}: a share of {before}, then {after}"
    );
    Ok(Window { from, to })
}

/// `short`'s successful calls in gw-0's access log: when each ended (its line's `ts`) and its
/// lease wait.
fn short_waits(log: &str) -> Vec<(jiff::Timestamp, Duration)> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["client"] == "short" && v["status"] == 200)
        .filter_map(|v| {
            let ts = v["ts"].as_str()?.parse::<jiff::Timestamp>().ok()?;
            let ms = v["lease_wait_ms"]
                .as_f64()
                .filter(|ms| ms.is_finite() && *ms >= 0.0)?;
            Some((ts, Duration::from_secs_f64(ms / 1000.0)))
        })
        .collect()
}

impl Window {
    /// The turn this window saw: `short`'s calls as its load counted them, and the lease waits
    /// of the access log's lines that ended within it (`began`: the wall clock at its load's
    /// start), which must be all of them.
    fn read(
        &self,
        short: &Load,
        began: jiff::Timestamp,
        waits: &[(jiff::Timestamp, Duration)],
    ) -> anyhow::Result<Turn> {
        let wall = |s: u64| began.checked_add(Duration::from_secs(s));
        let (from, to) = (wall(self.from)?, wall(self.to)?);
        let lease: Vec<Duration> = waits
            .iter()
            .filter(|(ts, _)| (from..to).contains(ts))
            .map(|(_, w)| *w)
            .collect();
        let tally = short.window(self.from, self.to);
        // A call ends at the gateway a moment before its client sees it: a window's edges may
        // put a call or two on the other side.
        anyhow::ensure!(
            lease.len() as u64 + 2 + tally.ok / 100 >= tally.ok,
            "the access log has {} of short's {} calls of seconds {}..{}: it lost lines",
            lease.len(),
            tally.ok,
            self.from,
            self.to
        );
        Ok(Turn {
            lease,
            calls: short.latencies(self.from, self.to),
            tally,
        })
    }
}

/// What `short` saw over one or more windows: its lease waits (gw-0's access log), its calls'
/// durations at the client, and its outcomes.
struct Turn {
    lease: Vec<Duration>,
    calls: Vec<Duration>,
    tally: Tally,
}

impl Turn {
    /// The turns as one sample.
    fn pooled(turns: &[Turn]) -> Turn {
        let mut tally = Tally::default();
        for t in turns {
            tally.add(&t.tally);
        }
        Turn {
            lease: turns.iter().flat_map(|t| t.lease.iter().copied()).collect(),
            calls: turns.iter().flat_map(|t| t.calls.iter().copied()).collect(),
            tally,
        }
    }

    fn quantile(sample: &[Duration], q: f64) -> Duration {
        let mut sorted = sample.to_vec();
        sorted.sort_unstable();
        nearest_rank(&sorted, q).unwrap_or_default()
    }

    fn lease_p99_ms(&self) -> String {
        format!(
            "{:.1}",
            Self::quantile(&self.lease, 0.99).as_secs_f64() * 1000.0
        )
    }

    /// The p99 of `loaded` over the p99 of `alone`.
    fn ratio(loaded: &[Duration], alone: &[Duration]) -> f64 {
        Self::quantile(loaded, 0.99).as_secs_f64()
            / Self::quantile(alone, 0.99).as_secs_f64().max(1e-6)
    }

    /// Prints the p50 and p99 of the lease waits and of the calls as figures of `phase`.
    fn figures(&self, phase: &str) {
        let ms = |sample: &[Duration], q: f64| Self::quantile(sample, q).as_secs_f64() * 1000.0;
        figure(
            SCENARIO,
            &format!("{phase}: short's p50 / p99 lease wait (ms, access log)"),
            format!(
                "{:.1} / {:.1} of {} calls",
                ms(&self.lease, 0.5),
                ms(&self.lease, 0.99),
                self.lease.len()
            ),
        );
        figure(
            SCENARIO,
            &format!("{phase}: short's p50 / p99 call (ms)"),
            format!(
                "{:.0} / {:.0}, {}",
                ms(&self.calls, 0.5),
                ms(&self.calls, 0.99),
                self.tally
            ),
        );
    }
}
