//! The token budgets' division: its sums, the pinned client's part, the hysteresis and the
//! division kept while a pod's sample is missing.

use proptest::prelude::*;

use super::*;

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).expect("a time")
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("gw-{i}")).collect()
}

#[test]
fn with_no_use_the_budget_is_split_evenly_and_adds_up() {
    let holders = names(3);
    let d = divide(
        &holders,
        &[true; 3],
        &[Some(0.0); 3],
        60_000,
        None,
        true,
        at(0),
    );
    assert_eq!(d.shares, vec![20_000, 20_000, 20_000]);
    let odd = divide(&holders, &[true; 3], &[Some(0.0); 3], 10, None, true, at(0));
    assert_eq!(odd.shares.iter().sum::<u64>(), 10);
}

#[test]
fn a_client_pinned_to_one_pod_gets_its_budget_there_less_a_small_floor_elsewhere() {
    let holders = names(3);
    // Interval 1: even split; the client, pinned to gw-1, used all of its third there.
    let first = divide(
        &holders,
        &[true; 3],
        &[Some(0.0); 3],
        60_000,
        None,
        true,
        at(0),
    );
    assert_eq!(first.shares, vec![20_000; 3]);
    let second = divide(
        &holders,
        &[true; 3],
        &[Some(0.0), Some(19_800.0), Some(0.0)],
        60_000,
        Some(&first),
        true,
        at(15),
    );
    // The floor: 60000 ÷ 3 ÷ 100 = 200 on each other pod.
    assert_eq!(second.shares, vec![200, 59_600, 200]);
    assert!(second.shares[1] as f64 >= 0.99 * 60_000.0);
    assert_eq!(second.used[1], Some(19_800.0));
}

#[test]
fn a_small_move_is_not_sent_and_a_pressed_pod_gets_its_gain() {
    let holders = names(2);
    let old = TokenDivision {
        per_minute: 10_000,
        holders: holders.clone(),
        shares: vec![5_000, 5_000],
        used: vec![Some(0.0); 2],
        at: at(0),
    };
    // Use 52 : 48 of an even split: a 200-token move, under 10% of the budget, nobody pressed.
    let kept = divide(
        &holders,
        &[true; 2],
        &[Some(2_600.0), Some(2_400.0)],
        10_000,
        Some(&old),
        true,
        at(15),
    );
    assert_eq!(kept, old);
    // The same proportions while gw-0 uses all of its part: it gets the gain.
    let pressed = divide(
        &holders,
        &[true; 2],
        &[Some(5_200.0), Some(4_800.0)],
        10_000,
        Some(&old),
        true,
        at(30),
    );
    assert_eq!(pressed.shares, vec![5_200, 4_800]);
}

#[test]
fn a_ready_pod_without_a_sample_keeps_the_division_in_force_and_not_due_keeps_it_too() {
    let holders = names(2);
    let old = TokenDivision {
        per_minute: 10_000,
        holders: holders.clone(),
        shares: vec![9_750, 250],
        used: vec![Some(4_000.0), Some(0.0)],
        at: at(0),
    };
    let missing = divide(
        &holders,
        &[true, true],
        &[None, Some(5_000.0)],
        10_000,
        Some(&old),
        true,
        at(15),
    );
    assert_eq!(missing, old);
    let not_due = divide(
        &holders,
        &[true, true],
        &[Some(0.0), Some(5_000.0)],
        10_000,
        Some(&old),
        false,
        at(15),
    );
    assert_eq!(not_due, old);
    // Without a division in force, a missing sample gives the even split.
    let fresh = divide(
        &holders,
        &[true, true],
        &[None, Some(5_000.0)],
        10_000,
        None,
        true,
        at(15),
    );
    assert_eq!(fresh.shares, vec![5_000, 5_000]);
    // A new budget or new holders are divided anew, not kept.
    let grown = divide(
        &names(3),
        &[true; 3],
        &[Some(0.0); 3],
        10_000,
        Some(&old),
        false,
        at(15),
    );
    assert_eq!(grown.shares.iter().sum::<u64>(), 10_000);
    assert_eq!(grown.holders, names(3));
}

#[test]
fn per_day_and_requests_follow_the_minute_parts_and_never_exceed_the_limit() {
    let d = TokenDivision {
        per_minute: 60_000,
        holders: names(3),
        shares: vec![1_000, 58_000, 1_000],
        used: vec![None; 3],
        at: at(0),
    };
    let day: Vec<u64> = (0..3).map(|r| d.part_of(6_000_000, r)).collect();
    assert_eq!(day, vec![100_000, 5_800_000, 100_000]);
    let rpm: u64 = (0..3).map(|r| d.part_of(100, r)).sum();
    assert!(rpm <= 100, "{rpm}");
    // A day part is never below the minute part (the document's rule).
    for r in 0..3 {
        assert!(d.part_of(60_000, r) >= d.shares[r]);
    }
}

#[test]
fn status_lists_each_pods_part_and_restores_from_it() {
    let holders = names(2);
    let d = TokenDivision {
        per_minute: 10_000,
        holders: holders.clone(),
        shares: vec![9_750, 250],
        used: vec![Some(4_000.123), Some(0.0)],
        at: at(0),
    };
    let s = status("batch", 10_000, Some(4_000.123), Some(&d), 50);
    assert_eq!(s.used_per_minute, Some(4_000.12));
    assert_eq!(s.shares.len(), 2);
    assert_eq!(s.shares[0].per_minute, 9_750);
    let budgets = BTreeMap::from([("batch".to_owned(), 10_000)]);
    let back = restored(std::slice::from_ref(&s), &holders, &budgets, at(5));
    assert_eq!(back["batch"].shares, d.shares);
    // A changed budget or other holders: not restored.
    let other = BTreeMap::from([("batch".to_owned(), 20_000)]);
    assert!(restored(std::slice::from_ref(&s), &holders, &other, at(5)).is_empty());
    assert!(restored(&[s], &names(3), &budgets, at(5)).is_empty());
}

proptest! {
    /// However the use falls, the pods' parts add up to the fleet budget exactly (never more)
    /// when the budget covers a token per pod, and each pod keeps its floor.
    #[test]
    fn the_parts_never_add_up_to_more_than_the_budget(
        budget in 1u64..2_000_000_000_000,
        used in prop::collection::vec(prop::option::of(0.0f64..1e12), 1..12),
        last_used in prop::collection::vec(0.0f64..1e9, 12),
    ) {
        let n = used.len();
        prop_assume!(budget >= n as u64);
        let holders = names(n);
        let ready = vec![true; n];
        // A division in force, from other use, for the hysteresis to judge against.
        let before: Vec<Option<f64>> = last_used[..n].iter().copied().map(Some).collect();
        let last = divide(&holders, &ready, &before, budget, None, true, at(0));
        prop_assert_eq!(last.shares.iter().sum::<u64>(), budget);
        let d = divide(&holders, &ready, &used, budget, Some(&last), true, at(15));
        prop_assert_eq!(d.shares.iter().sum::<u64>(), budget);
        let floor = floor(budget, n);
        prop_assert!(d.shares.iter().all(|&s| s >= floor.min(budget / n as u64)));
    }

    /// A client pinned to one pod of n (2 to 10), whatever its budget and however much of its
    /// part it used, gets at least 99% of its budget on that pod after two intervals: the first
    /// divides evenly, the second by its use.
    #[test]
    fn a_pinned_client_gets_99_percent_on_its_pod_after_two_intervals(
        budget in 1_000u64..1_000_000_000_000,
        n in 2usize..10,
        pod in 0usize..10,
        fill in 0.05f64..1.0,
    ) {
        let pod = pod % n;
        let holders = names(n);
        let ready = vec![true; n];
        let idle = vec![Some(0.0); n];
        let first = divide(&holders, &ready, &idle, budget, None, true, at(0));
        let mut used = idle.clone();
        used[pod] = Some(fill * first.shares[pod] as f64);
        let second = divide(&holders, &ready, &used, budget, Some(&first), true, at(15));
        prop_assert!(
            second.shares[pod] as f64 >= 0.99 * budget as f64,
            "{:?} of {budget}", second.shares
        );
        prop_assert_eq!(second.shares.iter().sum::<u64>(), budget);
    }
}

// === the clients without an override ===

fn spend(key: &str, input: f64, output: f64) -> ClientUse {
    ClientUse {
        key_sha256: key.repeat(64 / key.len()),
        input_tokens: input,
        output_tokens: output,
        ..ClientUse::default()
    }
}

fn budget(per_minute: u64) -> TokenBudgetSpec {
    serde_json::from_value(serde_json::json!({ "perMinute": per_minute })).expect("a budget")
}

#[test]
fn a_client_without_an_override_pinned_to_one_pod_gets_the_budget_there() {
    let holders = names(3);
    let b = budget(60_000);
    // `a` spends 300 tokens a second (18,000 a minute, 90% of its even part of 20,000) on
    // gw-1 alone; `b` 30 a second spread over all three; `c` is an override.
    let gw0 = [spend("b", 5.0, 5.0), spend("c", 1000.0, 0.0)];
    let gw1 = [spend("a", 100.0, 200.0), spend("b", 5.0, 5.0)];
    let gw2 = [spend("b", 5.0, 5.0)];
    let reports = [Some(&gw0[..]), Some(&gw1[..]), Some(&gw2[..])];
    let c_key = "c".repeat(64);
    let got = divide_clients(
        &holders,
        &[true; 3],
        &reports,
        &b,
        &[c_key.as_str()],
        &BTreeMap::new(),
        true,
        at(0),
    );
    let a = "a".repeat(64);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        [&a],
        "only the client that presses its even part, never an override"
    );
    assert_eq!(got[&a].shares, vec![200, 59_600, 200]);
    assert_eq!(got[&a].used, vec![Some(0.0), Some(18_000.0), Some(0.0)]);
    assert_eq!(got[&a].shares.iter().sum::<u64>(), 60_000);
}

#[test]
fn a_clients_tokens_are_charged_as_the_budget_counts_them() {
    let output: TokenBudgetSpec =
        serde_json::from_value(serde_json::json!({"perMinute": 60, "count": "Output"})).unwrap();
    assert_eq!(charged_per_minute(&output, 10.0, 2.0), 120.0);
    let weighted: TokenBudgetSpec = serde_json::from_value(serde_json::json!({
        "perMinute": 60, "count": "Weighted", "weights": {"input": 0.5, "output": 2.0}
    }))
    .unwrap();
    assert_eq!(charged_per_minute(&weighted, 10.0, 2.0), 60.0 * 9.0);
    assert_eq!(charged_per_minute(&budget(60), 10.0, 2.0), 720.0);
    // Counting output only, a client sending long prompts and asking little presses nothing.
    let holders = names(2);
    let gw0 = [spend("a", 1000.0, 0.1)];
    let got = divide_clients(
        &holders,
        &[true; 2],
        &[Some(&gw0[..]), Some(&[][..])],
        &serde_json::from_value(serde_json::json!({"perMinute": 600, "count": "Output"})).unwrap(),
        &[],
        &BTreeMap::new(),
        true,
        at(0),
    );
    assert!(got.is_empty(), "{got:?}");
}

#[test]
fn client_divisions_are_kept_while_a_pod_has_no_report_or_nothing_is_due_and_dropped_when_the_client_is_gone()
 {
    let holders = names(2);
    let b = budget(1_200);
    let pinned = [spend("a", 5.0, 5.0)];
    let divided = divide_clients(
        &holders,
        &[true; 2],
        &[Some(&pinned[..]), Some(&[][..])],
        &b,
        &[],
        &BTreeMap::new(),
        true,
        at(0),
    );
    let a = "a".repeat(64);
    assert_eq!(divided[&a].shares, vec![1_194, 6]);
    // gw-1 serves and did not answer: the division in force stays.
    let kept = divide_clients(
        &holders,
        &[true; 2],
        &[Some(&[][..]), None],
        &b,
        &[],
        &divided,
        true,
        at(15),
    );
    assert_eq!(kept, divided);
    // Not due (no decision on fresh data): kept too.
    assert_eq!(
        divide_clients(
            &holders,
            &[true; 2],
            &[Some(&[][..]); 2],
            &b,
            &[],
            &divided,
            false,
            at(15)
        ),
        divided
    );
    // The client became an override: its budget is divided by name from then on.
    assert!(
        divide_clients(
            &holders,
            &[true; 2],
            &[Some(&pinned[..]), Some(&[][..])],
            &b,
            &[a.as_str()],
            &divided,
            false,
            at(15)
        )
        .is_empty()
    );
    // It spends nothing anywhere any more: back to the even split.
    assert!(
        divide_clients(
            &holders,
            &[true; 2],
            &[Some(&[][..]); 2],
            &b,
            &[],
            &divided,
            true,
            at(30)
        )
        .is_empty()
    );
    // A budget of another size, or other holders: the old division no longer fits.
    assert!(
        divide_clients(
            &holders,
            &[true; 2],
            &[None, None],
            &budget(600),
            &[],
            &divided,
            true,
            at(30)
        )
        .is_empty()
    );
}

#[test]
fn at_most_the_clients_that_spend_most_are_divided() {
    let holders = names(2);
    let b = budget(60_000);
    // 40 clients each spending their whole even part (30,000 a minute) on gw-0.
    let keys: Vec<String> = (0..40).map(|i| format!("{i:064x}")).collect();
    let gw0: Vec<ClientUse> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| ClientUse {
            key_sha256: k.clone(),
            input_tokens: 500.0 + i as f64,
            ..ClientUse::default()
        })
        .collect();
    let got = divide_clients(
        &holders,
        &[true; 2],
        &[Some(&gw0[..]), Some(&[][..])],
        &b,
        &[],
        &BTreeMap::new(),
        true,
        at(0),
    );
    assert_eq!(got.len(), MAX_CLIENT_SHARES);
    assert!(
        got.contains_key(&keys[39]) && !got.contains_key(&keys[0]),
        "the most first"
    );
}
