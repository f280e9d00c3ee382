//! Skewed load: 80% of the callers land on one of three gateways (as an L4 load balancer leaves
//! a few clients with long-lived connections), against a fleet-wide target that is enough for
//! the total but not for the busy pod's even third. The operator divides the target by where
//! the demand is: within two intervals of the skew the busy pod holds most of it and errors stay
//! under 0.5%; the shares never add up to more than the target; when the skew moves to another
//! pod, the shares follow within two intervals. Last, one client with 6 calls at once on one pod
//! gets its fleet-wide limit (8, an even third of it per pod) divided there: its share in that
//! pod's document covers its calls.
//!
//! ```text
//!  target 12 per endpoint (min = max: no growth, and no burst: the budget is the target)
//!  30 callers, 24 on gw-a: an even split gives gw-a 4 × 3 endpoints = 12 connections for 24
//!      └─► next decision: demand 8 / 1 / 1 per endpoint → shares ≈ [10, 1, 1]: 30 for 24
//!  the skew moves to gw-c (24 callers there)
//!      └─► next decision: a pod queues at share 1 → re-divided ≈ [1, 1, 10]
//! ```
//!
//! Calls take 1 s and wait at most 300 ms for a connection, so a pod whose pool is short of its
//! callers answers lease timeouts at once: the errors measure the division directly.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_api::GatewayLimits;
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec, skewed};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, one_backend_policy, operator_decisions, share,
    with_stack,
};
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;

const SCENARIO: &str = "skewed-load";
/// The autoscale interval: each decision re-judges the division.
const INTERVAL: Duration = Duration::from_secs(5);
/// The fleet-wide target per endpoint, fixed (min = max).
const TARGET: u32 = 12;
/// Callers in all: 36 connections (12 × 3 endpoints) are enough for them.
const CALLERS: usize = 30;
/// Callers on the busy pod.
const SKEW_PERCENT: u32 = 80;
/// The acceptance bound of the error rate once the shares followed.
const FOLLOWED: f64 = 0.005;
/// How long the error rate is measured once the shares must have followed.
const MEASURE: u64 = 10;
/// Calls at once of the one client pinned to one pod (its fleet-wide limit is 8).
const PINNED: usize = 6;

#[tokio::test]
async fn skewed_load_moves_the_shares_to_the_busy_pod_and_follows_the_skew() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![BackendSpec::new("model-a", 3, 64).service_ms(1000)],
        ..StackSpec::default()
    };
    with_stack("skew", spec, async |stack| {
        stack
            .apply(&one_backend_policy("model-a", INTERVAL, TARGET, TARGET)?)
            .await?;
        let mut gateways = stack.wait_gateways(3).await?;
        gateways.sort_by(|a, b| a.name.cmp(&b.name));
        let names: Vec<String> = gateways.iter().map(|g| g.name.clone()).collect();
        let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.proxy()).collect();
        stack
            .wait_limits("every gateway runs the even split", 3, WAIT, |l| {
                let share = share(l, "model-a")?;
                anyhow::ensure!(share == TARGET / 3, "share {share}");
                Ok(())
            })
            .await?;

        // The shares as the gateways run them, twice a second: a round counts only when a second
        // read of every pod gives the same shares (a rollout between two reads is no sum).
        let most = Arc::new(AtomicU32::new(0));
        let sampler = tokio::spawn({
            let (most, gateways) = (most.clone(), gateways.clone());
            async move {
                let read = async || {
                    let mut shares = Vec::new();
                    for g in &gateways {
                        shares.push(share(&g.limits().await.ok()?, "model-a").ok()?);
                    }
                    Some(shares)
                };
                loop {
                    if let (Some(a), Some(b)) = (read().await, read().await)
                        && a == b
                    {
                        most.fetch_max(a.iter().sum(), Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        });

        let load = |onto: usize| {
            let mut spec = LoadSpec::one_client_per_worker(
                skewed(&addrs, onto, SKEW_PERCENT),
                "model-a",
                4,
                CALLERS,
                Duration::from_secs(30),
            );
            spec.clients = CALLERS;
            Load::start(spec, CALLERS)
        };

        // Phase 1: the skew lands on the first pod.
        let first = load(0)?;
        let skew = Instant::now();
        let busy = ((CALLERS as u32 * SKEW_PERCENT).div_ceil(100)).div_ceil(3);
        let followed = follow(stack, &names, 0, busy, skew).await?;
        let took = skew.elapsed();
        figure(
            SCENARIO,
            "skew to shares seconds",
            format!("{:.1} ({followed:?})", took.as_secs_f64()),
        );
        assert!(
            took <= 2 * INTERVAL + Duration::from_secs(2),
            "the shares follow the skew within two intervals: {took:?}"
        );
        let from = (took.as_secs() + 1).max(2 * INTERVAL.as_secs());
        let phase1 = measure(&first, from).await;
        figure(SCENARIO, "errors once followed", &phase1);
        figure(SCENARIO, "errors in the first 3 s", first.window(0, 3));
        assert!(
            phase1.calls >= MEASURE * 15 && phase1.error_rate() < FOLLOWED,
            "{MEASURE} s from {from} s after the skew: {phase1}"
        );

        // Phase 2: the skew moves to the last pod.
        let second = load(2)?;
        first.stop().await;
        let moved = Instant::now();
        let refollowed = follow(stack, &names, 2, busy, moved).await?;
        let took = moved.elapsed();
        figure(
            SCENARIO,
            "moved skew to shares seconds",
            format!("{:.1} ({refollowed:?})", took.as_secs_f64()),
        );
        assert!(
            took <= 2 * INTERVAL + Duration::from_secs(2),
            "the shares follow the moved skew within two intervals: {took:?}"
        );
        let from = (took.as_secs() + 1).max(2 * INTERVAL.as_secs());
        let phase2 = measure(&second, from).await;
        figure(SCENARIO, "errors once followed again", &phase2);
        assert!(
            phase2.calls >= MEASURE * 15 && phase2.error_rate() < FOLLOWED,
            "{MEASURE} s from {from} s after the moved skew: {phase2}"
        );

        // Phase 3: one client with 6 calls at once, all on the last pod (a batch job on a few
        // keep-alive connections). Its fleet-wide limit (the sample's maxConcurrency 8, an even
        // third of it per pod) follows it there: the pod's document lists its share.
        let mut pinned = LoadSpec::one_client_per_worker(
            vec![addrs[2]],
            "model-a",
            4,
            PINNED,
            Duration::from_secs(30),
        );
        pinned.clients = 1;
        // The gateways count a bearer token by its SHA-256 (`Authorization: Bearer pinned-0`).
        let key = hex::encode(Sha256::digest(b"pinned-0"));
        let share_of = |limits: &GatewayLimits| {
            limits
                .client_policies
                .iter()
                .flat_map(|c| &c.client_shares)
                .find(|s| s.key_sha256 == key)
                .map(|s| s.max_concurrency)
        };
        assert_eq!(
            share_of(&gateways[2].limits().await?),
            None,
            "no share for a client not seen yet"
        );
        let pinned = Load::start_as(pinned, PINNED, "pinned", None)?;
        let pinned_at = Instant::now();
        let followed_client = eventually(
            "the pinned client's limit follows it",
            4 * INTERVAL,
            || async {
                let limits = gateways[2].limits().await?;
                let share = share_of(&limits).unwrap_or(0);
                anyhow::ensure!(
                    share >= PINNED as u32,
                    "the pinned client's share on {}: {share}",
                    names[2]
                );
                Ok(share)
            },
        )
        .await?;
        let mut elsewhere = Vec::new();
        for g in &gateways[..2] {
            elsewhere.push(share_of(&g.limits().await?));
        }
        figure(
            SCENARIO,
            "pinned client's shares elsewhere",
            format!("{elsewhere:?}"),
        );
        figure(
            SCENARIO,
            "pinned client's share seconds",
            format!(
                "{:.1} (maxConcurrency {followed_client} of the fleet's 8 on {})",
                pinned_at.elapsed().as_secs_f64(),
                names[2]
            ),
        );
        pinned.stop().await;

        // The re-division was a decision of its own, with the pods and the numbers.
        let b = stack.backend_status("model-a").await?;
        assert_eq!(b.target, TARGET, "the target never moved: {b:?}");
        // Repeats of an Event are one series that keeps its first note: the first skew's.
        let events = stack.events(POLICY, "SharesRebalanced").await?;
        let messages: Vec<&str> = events
            .iter()
            .filter_map(|e| e.message.as_deref())
            .collect();
        assert!(
            messages
                .iter()
                .any(|m| m.contains(&format!("{} queues at share", names[0]))),
            "a SharesRebalanced Event names the pod that queued: {messages:?}"
        );
        let last = b.last_decision.clone().context("lastDecision")?;
        figure(SCENARIO, "last decision", format!("{:?}: {}", last.action, last.reason));
        let rebalances = stack.operator_metrics_url().await?;
        let kinds = operator_decisions(&rebalances).await?;
        assert!(
            kinds.get("rebalance").copied().unwrap_or(0.0) >= 2.0,
            "two re-divisions counted (poolpilot_operator_decisions_total{{kind=\"rebalance\"}}): {kinds:?}"
        );

        sampler.abort();
        let most = most.load(Ordering::Relaxed);
        figure(SCENARIO, "largest sum of shares", format!("{most} (target {TARGET})"));
        assert!(most <= TARGET, "the shares never add up to more than the target: {most}");
        assert!(most > 0, "the sampler read the gateways' shares");
        second.stop().await;
        Ok(())
    })
    .await
}

/// Waits until the status divides the target with at least `busy` per endpoint on pod `onto`
/// and every gateway runs its share; returns the shares by pod.
async fn follow(
    stack: &Stack<'_>,
    names: &[String],
    onto: usize,
    busy: u32,
    since: Instant,
) -> anyhow::Result<BTreeMap<String, u32>> {
    eventually("the shares follow the skew", 4 * INTERVAL, || async {
        let b = stack.backend_status("model-a").await?;
        let shares: BTreeMap<String, u32> =
            b.shares.iter().map(|s| (s.pod.clone(), s.share)).collect();
        let on = shares.get(&names[onto]).copied().unwrap_or(0);
        anyhow::ensure!(
            on >= busy,
            "{:.1} s: shares {shares:?}, want {busy} on {}",
            since.elapsed().as_secs_f64(),
            names[onto]
        );
        anyhow::ensure!(
            shares.values().sum::<u32>() <= TARGET,
            "shares {shares:?} over the target"
        );
        for g in stack.gateways().await? {
            let limits = g.limits().await?;
            let want = shares.get(&g.name).copied().unwrap_or(0);
            let runs = share(&limits, "model-a")?;
            anyhow::ensure!(runs == want, "{} runs {runs}, status says {want}", g.name);
        }
        Ok(shares)
    })
    .await
}

/// The load's outcomes over `MEASURE` seconds from second `from` of it.
async fn measure(load: &Load, from: u64) -> poolpilot_e2e::load::Tally {
    while load.now() <= from + MEASURE {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    load.window(from, from + MEASURE)
}
