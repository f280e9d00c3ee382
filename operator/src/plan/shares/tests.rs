//! The division between runs: divided anew for a new target or new holders, re-judged only when
//! a decision is due, re-divided for a queueing pod with the pods and numbers in the reason, kept
//! through noise and while a serving pod's samples are missing.

use super::*;
use crate::plan::tests::at;

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("gw-{i}")).collect()
}

fn pool(leased: f64, pending: f64) -> Option<PodPool> {
    Some(PodPool {
        leased,
        pending,
        leased_now: leased,
    })
}

fn divided(shares: &[u32]) -> Divided {
    Divided {
        holders: names(shares.len()),
        target: shares.iter().sum(),
        shares: shares.to_vec(),
        demand: vec![None; shares.len()],
        at: at(0),
    }
}

fn run(target: u32, pools: &[Option<PodPool>], last: Option<&Divided>, due: bool) -> Step {
    let names = names(pools.len());
    let ready = vec![true; pools.len()];
    step(
        target,
        2,
        Holders {
            names: &names,
            ready: &ready,
            pools,
        },
        last,
        due,
        at(10),
    )
}

#[test]
fn a_starving_pod_is_a_rebalance_with_the_pods_and_numbers() {
    // The demo's crowd: 24 calls on gw-0 (16 leased + 8 pending over 2 endpoints), gw-1 idle,
    // target 8 split evenly before.
    let last = divided(&[4, 4]);
    let s = run(8, &[pool(8.0, 16.0), pool(0.0, 0.0)], Some(&last), true);
    assert_eq!(s.divided.shares, [7, 1]);
    assert_eq!(
        s.rebalanced.as_deref(),
        Some(
            "gw-0 queues at share 4 with demand 12.0 per endpoint while gw-1 uses 0.0 of its 4: \
             target 8 re-divided by demand from [4, 4] to [7, 1]"
        )
    );
}

#[test]
fn a_move_past_the_deadband_without_pressure_does_not_call_the_pod_pressed() {
    // A light load (every pod well inside its share) whose demand moved: the new division moves
    // more than the deadband, so it goes out, but no pod is short of connections.
    let last = divided(&[3, 2, 1]);
    let s = run(
        6,
        &[pool(0.4, 0.0), pool(1.0, 0.0), pool(1.0, 0.0)],
        Some(&last),
        true,
    );
    let reason = s
        .rebalanced
        .expect("a move past the deadband is a rebalance");
    assert!(
        reason.contains("shows more demand") && !reason.contains("pressed"),
        "{reason}"
    );
}

#[test]
fn between_decisions_the_division_stays() {
    let last = divided(&[4, 4]);
    let s = run(8, &[pool(8.0, 16.0), pool(0.0, 0.0)], Some(&last), false);
    assert_eq!((s.divided, s.rebalanced), (last, None));
}

#[test]
fn a_new_target_is_divided_by_demand_at_once_without_a_rebalance_record() {
    let last = divided(&[4, 4]);
    let s = run(16, &[pool(8.0, 16.0), pool(0.0, 0.0)], Some(&last), false);
    assert_eq!(s.divided.shares, [14, 2]);
    assert_eq!(s.rebalanced, None, "the target's own decision says why");
}

#[test]
fn noise_in_the_demand_keeps_the_division() {
    let last = divided(&[20, 20]);
    let s = run(40, &[pool(10.0, 0.0), pool(9.0, 0.0)], Some(&last), true);
    assert_eq!((s.divided.shares, s.rebalanced), (vec![20, 20], None));
}

#[test]
fn a_serving_pod_without_samples_keeps_the_last_division_or_gets_the_even_split() {
    let last = divided(&[7, 1]);
    let s = run(8, &[None, pool(10.0, 10.0)], Some(&last), true);
    assert_eq!((s.divided.shares, s.rebalanced), (vec![7, 1], None));
    let s = run(9, &[None, pool(10.0, 10.0)], Some(&last), true);
    assert_eq!(
        s.divided.shares,
        [5, 4],
        "the last division does not fit target 9"
    );
}

#[test]
fn a_pod_that_is_not_ready_yet_counts_as_idle() {
    let names = names(2);
    let s = step(
        8,
        2,
        Holders {
            names: &names,
            ready: &[true, false],
            pools: &[pool(8.0, 8.0), None],
        },
        None,
        true,
        at(0),
    );
    assert_eq!(s.divided.shares, [7, 1]);
}
