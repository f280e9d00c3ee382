//! The division's worked examples and its properties: the shares add up to the target, a pod
//! with all the demand gets the target less the others' floors, equal demand splits evenly,
//! nobody drops below what it has in flight, and the burst allowance keeps the fleet inside its
//! budget through any sequence of pod counts, shares and burst uses.

use proptest::prelude::*;

use super::*;

fn claims(demand: &[f64]) -> Vec<Claim> {
    demand
        .iter()
        .map(|&d| Claim {
            demand: d,
            in_flight: 0,
        })
        .collect()
}

#[test]
fn the_worked_example_of_the_module_docs() {
    assert_eq!(divide(24, &claims(&[18.0, 3.0, 0.0])), [19, 3, 2]);
}

#[test]
fn the_demo_crowd_on_one_of_two_pods_gets_all_but_the_idle_pods_floor() {
    // Target 8 per endpoint; one pod has 24 calls' demand over 2 endpoints, the other none.
    assert_eq!(divide(8, &claims(&[12.0, 0.0])), [7, 1]);
    assert_eq!(divide(16, &claims(&[12.0, 0.0])), [14, 2]);
}

#[test]
fn without_demand_the_target_is_split_evenly() {
    assert_eq!(divide(10, &claims(&[0.0, 0.0, 0.0])), [4, 3, 3]);
    assert_eq!(divide(10, &claims(&[f64::NAN, -1.0, 0.0])), [4, 3, 3]);
}

#[test]
fn more_pods_than_the_target_get_one_each() {
    assert_eq!(divide(2, &claims(&[5.0, 0.0, 0.0])), [1, 1, 1]);
    assert_eq!(divide(0, &claims(&[1.0])), [1]);
    assert!(divide(9, &[]).is_empty());
}

#[test]
fn calls_in_flight_hold_a_share_up_until_they_exceed_the_target() {
    let c = [
        Claim {
            demand: 20.0,
            in_flight: 2,
        },
        Claim {
            demand: 0.0,
            in_flight: 6,
        },
    ];
    assert_eq!(
        divide(16, &c),
        [10, 6],
        "the idle pod keeps its 6 in flight"
    );
    // The target shrank under them: 4 + 6 > 8, so both start from the floor, ⌊8 ÷ 2 ÷ 4⌋ = 1.
    let c = [
        Claim {
            demand: 8.0,
            in_flight: 4,
        },
        Claim {
            demand: 0.0,
            in_flight: 6,
        },
    ];
    assert_eq!(divide(8, &c), [7, 1]);
}

#[test]
fn burst_is_what_the_budget_leaves_split_evenly() {
    assert_eq!(burst(20, 8, 2), 6);
    assert_eq!(burst(20, 21, 2), 0, "over the budget already: no burst");
    assert_eq!(burst(20, 8, 0), 0);
}

#[test]
fn a_division_moves_for_a_queueing_or_pressed_pod_and_not_for_noise() {
    let idle = Need::default();
    let queues = Need {
        queues: true,
        demand: 12.0,
    };
    assert!(moves(&[4, 4], &[7, 1], &[queues, idle], 8));
    let pressed = Need {
        queues: false,
        demand: 4.5,
    };
    assert!(
        moves(&[4, 4], &[5, 3], &[pressed, idle], 8),
        "bursting beyond its share"
    );
    let busy = Need {
        queues: false,
        demand: 3.5,
    };
    assert!(
        !moves(&[4, 4], &[5, 3], &[busy, idle], 8),
        "using most of its share is no reason: one connection moved"
    );
    // Light load on small shares: one connection moved is noise, whatever the target.
    let light = Need {
        queues: false,
        demand: 1.0,
    };
    assert!(!moves(&[2, 2, 2], &[3, 2, 1], &[light, light, light], 6));
    // 21 vs 20 of 40 moved by demand noise: under the 10% deadband, nobody short.
    let calm = Need {
        queues: false,
        demand: 5.0,
    };
    assert!(!moves(&[20, 20], &[21, 19], &[calm, calm], 40));
    // A large move goes out even when nobody is short of connections.
    assert!(moves(&[20, 20], &[30, 10], &[calm, calm], 40));
}

fn demand() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), 0.0..200.0f64]
}

proptest! {
    #[test]
    fn shares_add_up_to_the_target_unless_every_pod_is_at_one(
        target in 0u32..5_000,
        pods in proptest::collection::vec((demand(), 0u32..300), 1..40),
    ) {
        let c: Vec<Claim> = pods.iter().map(|&(demand, in_flight)| Claim { demand, in_flight }).collect();
        let shares = divide(target, &c);
        prop_assert_eq!(shares.len(), c.len());
        let sum: u64 = shares.iter().map(|&s| u64::from(s)).sum();
        if (c.len() as u64) <= u64::from(target) {
            prop_assert_eq!(sum, u64::from(target));
        } else {
            prop_assert!(shares.iter().all(|&s| s == 1));
        }
        prop_assert!(shares.iter().all(|&s| s >= 1));
    }

    #[test]
    fn a_pod_with_all_the_demand_gets_the_target_less_the_others_floors(
        target in 1u32..5_000,
        pods in 1usize..40,
        which in 0usize..40,
        demand in 0.1f64..500.0,
    ) {
        let which = which % pods;
        let mut c = vec![Claim::default(); pods];
        c[which].demand = demand;
        let shares = divide(target, &c);
        let floor = floor(target, pods);
        if u64::from(floor) * (pods as u64) < u64::from(target) {
            prop_assert_eq!(shares[which], target - floor * (pods as u32 - 1));
            for (i, &s) in shares.iter().enumerate() {
                if i != which {
                    prop_assert_eq!(s, floor);
                }
            }
        }
    }

    #[test]
    fn equal_demand_gives_the_even_split_within_one(
        target in 0u32..5_000,
        pods in 1usize..40,
        demand in demand(),
    ) {
        let shares = divide(target, &vec![Claim { demand, in_flight: 0 }; pods]);
        let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
        prop_assert!(hi - lo <= 1, "{shares:?}");
    }

    #[test]
    fn a_share_never_drops_below_what_the_pod_has_in_flight(
        target in 1u32..5_000,
        pods in proptest::collection::vec((demand(), 0u32..300), 1..40),
    ) {
        let c: Vec<Claim> = pods.iter().map(|&(demand, in_flight)| Claim { demand, in_flight }).collect();
        let floor = floor(target, c.len());
        let lower: u64 = c.iter().map(|x| u64::from(x.in_flight.max(floor))).sum();
        let shares = divide(target, &c);
        if lower <= u64::from(target) && (c.len() as u64) * u64::from(floor) < u64::from(target) {
            for (s, x) in shares.iter().zip(&c) {
                prop_assert!(*s >= x.in_flight, "{shares:?} vs {c:?}");
            }
        }
    }

    #[test]
    fn more_demand_never_means_a_smaller_share(
        target in 1u32..2_000,
        pods in proptest::collection::vec(demand(), 2..20),
        which in 0usize..20,
        more in 0.0f64..100.0,
    ) {
        let which = which % pods.len();
        let before = divide(target, &claims(&pods));
        let mut raised = pods.clone();
        raised[which] += more;
        let after = divide(target, &claims(&raised));
        // Rounding may move one connection between pods with equal fractions.
        prop_assert!(after[which] + 1 >= before[which], "{before:?} → {after:?}");
    }

    /// The fleet's bound through any sequence: each step the pods hold up to
    /// `max(share, in flight)` and may open their burst on top; the planner divides and sizes
    /// the burst from what they hold then. Whatever they do with it, the connections they may
    /// open together never exceed the budget (when the shares themselves fit in it).
    #[test]
    fn the_burst_budget_holds_through_any_sequence(
        budget in 1u32..2_000,
        steps in proptest::collection::vec(
            (1usize..12, 0u32..2_000, proptest::collection::vec((demand(), 0.0f64..=1.0), 12)),
            1..20,
        ),
    ) {
        let mut held: Vec<u32> = Vec::new();
        for (pods, target, uses) in steps {
            let target = target.min(budget);
            held.resize(pods, 0);
            let c: Vec<Claim> = (0..pods)
                .map(|i| Claim { demand: uses[i].0, in_flight: held[i] })
                .collect();
            let shares = divide(target, &c);
            let holding: u64 = shares
                .iter()
                .zip(&held)
                .map(|(&s, &h)| u64::from(s.max(h)))
                .sum();
            let b = burst(budget, holding, pods);
            // What each pod may have open before the next step: what it still holds, or its
            // share with the burst on top.
            let may_open: u64 = shares
                .iter()
                .zip(&held)
                .map(|(&s, &h)| u64::from(h.max(s + b)))
                .sum();
            if holding <= u64::from(budget) {
                prop_assert!(may_open <= u64::from(budget), "{shares:?} + {b} with {held:?}");
            } else {
                prop_assert_eq!(b, 0);
            }
            // The pods use some of what they may: up to share + burst, and what they held
            // above a lowered share drains only as calls end.
            for i in 0..pods {
                let cap = shares[i] + b;
                let used = (f64::from(cap) * uses[i].1).round() as u32;
                held[i] = used.max(held[i].min(shares[i].max(held[i]) / 2));
            }
        }
    }
}
