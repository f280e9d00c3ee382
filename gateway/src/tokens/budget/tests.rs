//! Tests of the token budgets: reservation, settlement, refusal and its wait, debts, the
//! requests and day buckets, a new policy applied in place, the memory bound, and the bound on
//! what a client gets admitted over any window (a property).

use std::collections::HashMap;
use std::time::Duration;

use poolpilot_api::limits::{TokenBudget, TokenCount};
use proptest::prelude::*;

use super::*;

fn budget(per_minute: u64) -> TokenBudget {
    serde_json::from_value(serde_json::json!({"perMinute": per_minute})).unwrap()
}

fn budgets(b: TokenBudget) -> TokenBudgets<u8> {
    TokenBudgets::new(Some(b), HashMap::new(), 16)
}

fn est(prompt: u64, output: u64) -> Estimate {
    Estimate { prompt, output }
}

fn key(n: u8) -> u8 {
    n
}

fn label() -> Arc<str> {
    "other".into()
}

#[tokio::test(start_paused = true)]
async fn remaining_falls_call_by_call_and_a_call_over_it_is_refused() {
    let b = budgets(budget(600));
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let r = b.reserve(key(1), &label(), est(20, 80)).unwrap().unwrap();
        remaining.push(r.quote().remaining_tokens);
        r.settle(20, 80);
    }
    assert_eq!(remaining, vec![500, 400, 300, 200, 100]);
    let r = b.reserve(key(1), &label(), est(20, 80)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 0);
    assert_eq!(r.quote().reset_tokens, Duration::from_secs(60));
    let refused = b.reserve(key(1), &label(), est(0, 50)).unwrap_err();
    assert_eq!(refused.exhausted, Exhausted::TokensPerMinute);
    // 50 tokens at 10 a second.
    assert_eq!(refused.retry_after, Duration::from_secs(5));
    assert_eq!(
        (refused.limit, refused.remaining, refused.requested),
        (600, 0, 50)
    );
    // Another client has its own bucket.
    assert!(b.reserve(key(2), &label(), est(0, 50)).unwrap().is_some());
    drop(r);
    // The unsettled reservation was given back whole.
    let again = b.reserve(key(1), &label(), est(0, 50)).unwrap().unwrap();
    assert_eq!(again.quote().remaining_tokens, 50);
}

#[tokio::test(start_paused = true)]
async fn settlement_gives_back_what_the_call_did_not_use_and_takes_what_it_used_beyond() {
    let b = budgets(budget(600));
    let r = b.reserve(key(1), &label(), est(10, 500)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 90);
    r.settle(10, 40);
    let r = b.reserve(key(1), &label(), est(0, 0)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 550);
    // Used more than estimated: the bucket goes into debt and refuses until it refills.
    r.settle(0, 1000);
    let refused = b.reserve(key(1), &label(), est(0, 1)).unwrap_err();
    assert_eq!(refused.remaining, 0);
    // From −450 to 1 at 10 a second: 45.1 s, rounded up.
    assert_eq!(refused.retry_after, Duration::from_secs(46));
    tokio::time::advance(Duration::from_secs(46)).await;
    assert!(b.reserve(key(1), &label(), est(0, 1)).unwrap().is_some());
}

#[tokio::test(start_paused = true)]
async fn a_call_larger_than_the_bucket_waits_for_a_full_bucket_not_for_ever() {
    let b = budgets(budget(600));
    let r = b.reserve(key(1), &label(), est(0, 1000)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 0);
    r.settle(0, 1000);
    let refused = b.reserve(key(1), &label(), est(0, 1000)).unwrap_err();
    // From −400 to a full 600.
    assert_eq!(refused.retry_after, Duration::from_secs(100));
}

#[tokio::test(start_paused = true)]
async fn count_decides_what_a_call_costs() {
    let mut output = budget(600);
    output.count = TokenCount::Output;
    let b = budgets(output);
    let r = b.reserve(key(1), &label(), est(500, 100)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 500);
    let mut weighted = budget(600);
    weighted.count = TokenCount::Weighted;
    weighted.weights = Some(poolpilot_api::limits::TokenWeights {
        input: 0.5,
        output: 2.0,
    });
    let b = budgets(weighted);
    let r = b.reserve(key(1), &label(), est(100, 100)).unwrap().unwrap();
    assert_eq!(r.quote().remaining_tokens, 350);
}

#[tokio::test(start_paused = true)]
async fn requests_and_days_have_buckets_of_their_own() {
    let mut rpm = budget(1_000_000);
    rpm.requests_per_minute = Some(2);
    let b = budgets(rpm);
    let first = b.reserve(key(1), &label(), est(1, 1)).unwrap().unwrap();
    assert_eq!(first.quote().requests.map(|r| (r.0, r.1)), Some((2, 1)));
    first.settle(1, 1);
    b.reserve(key(1), &label(), est(1, 1))
        .unwrap()
        .unwrap()
        .settle(1, 1);
    let refused = b.reserve(key(1), &label(), est(1, 1)).unwrap_err();
    assert_eq!(refused.exhausted, Exhausted::RequestsPerMinute);
    assert_eq!(refused.exhausted.error_type(), "requests");
    assert_eq!(refused.retry_after, Duration::from_secs(30));

    let mut day = budget(1000);
    day.per_day = Some(1500);
    let b = budgets(day);
    b.reserve(key(1), &label(), est(0, 1000))
        .unwrap()
        .unwrap()
        .settle(0, 1000);
    tokio::time::advance(Duration::from_secs(60)).await;
    let refused = b.reserve(key(1), &label(), est(0, 600)).unwrap_err();
    assert_eq!(refused.exhausted, Exhausted::TokensPerDay);
    assert_eq!(refused.exhausted.error_type(), "tokens");
    assert!(refused.retry_after > Duration::from_secs(3600), "{refused}");
}

#[tokio::test(start_paused = true)]
async fn an_override_has_its_own_budget_and_a_new_policy_keeps_what_was_used() {
    let mut overrides = HashMap::new();
    overrides.insert(key(9), budget(6000));
    let b = TokenBudgets::new(Some(budget(600)), overrides, 16);
    let big = b.reserve(key(9), &label(), est(0, 1000)).unwrap().unwrap();
    assert_eq!(big.quote().limit_tokens, 6000);
    big.settle(0, 1000);
    b.reserve(key(1), &label(), est(0, 100))
        .unwrap()
        .unwrap()
        .settle(0, 100);
    b.set(Some(budget(1200)), HashMap::new(), 16);
    let r = b.reserve(key(1), &label(), est(0, 100)).unwrap().unwrap();
    assert_eq!(
        (r.quote().limit_tokens, r.quote().remaining_tokens),
        (1200, 1000)
    );
    // The override is gone: its client has the policy's budget now.
    let r = b.reserve(key(9), &label(), est(0, 0)).unwrap().unwrap();
    assert_eq!(r.quote().limit_tokens, 1200);
    b.set(None, HashMap::new(), 16);
    assert!(b.reserve(key(1), &label(), est(0, 100)).unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn memory_holds_only_clients_whose_buckets_are_not_full_and_is_bounded() {
    let b = TokenBudgets::new(Some(budget(600)), HashMap::new(), 4);
    for n in 0..10 {
        b.reserve(key(n), &label(), est(0, 60))
            .unwrap()
            .unwrap()
            .settle(0, 60);
        assert!(b.tracked() <= 4);
    }
    tokio::time::advance(Duration::from_secs(6)).await;
    b.purge();
    assert_eq!(b.tracked(), 0);
}

proptest! {
    /// Over any sequence of calls (each settled with at most its estimate), what one client
    /// gets admitted in the first `t` seconds is at most a full bucket, its refill over `t`,
    /// and one call's cost beyond (the debt a call larger than what is left may run up).
    #[test]
    fn admitted_tokens_never_exceed_the_bucket_and_its_refill(
        calls in proptest::collection::vec((0u64..3000, 1u64..400, 0u64..100), 1..60)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let b = budgets(budget(600));
            let start = Instant::now();
            let mut admitted = 0u64;
            let mut largest = 0u64;
            for (gap_ms, output, used_percent) in &calls {
                tokio::time::advance(Duration::from_millis(*gap_ms)).await;
                if let Ok(Some(r)) = b.reserve(key(1), &label(), est(0, *output)) {
                    let used = output * used_percent / 100;
                    admitted += used;
                    largest = largest.max(*output);
                    r.settle(0, used);
                }
            }
            let t = start.elapsed().as_secs_f64();
            let bound = 600.0 + 10.0 * t + largest as f64;
            prop_assert!(admitted as f64 <= bound, "{admitted} > {bound}");
            Ok(())
        })?;
    }
}
