//! The fair queue's properties: every client waiting throughout gets at least its weighted
//! share of the tokens less the module doc's slack; a lone client is served exactly as the
//! plain class queue serves it; one client's calls stay FIFO; the aging bound between classes
//! holds with many clients in both classes; forgotten clients leave the tag table.

use std::collections::HashMap;
use std::time::Duration;

use poolpilot_api::limits::PriorityClass;
use proptest::prelude::*;
use tokio::time::Instant;

use super::*;
use crate::limits::queue::{ClassQueue, Entry};

fn entry(id: u64, since: Instant, class: PriorityClass) -> Entry<()> {
    Entry {
        id,
        since,
        class,
        item: (),
    }
}

/// One simulated call: its estimate (the cost charged at grant) and the tokens it used.
#[derive(Clone, Copy, Debug)]
struct SimCall {
    cost: u64,
    used: u64,
}

/// A run of the share property: `n` clients of `weights`, each keeping at least two waiters in
/// one class throughout, served by `slots` connections; a step either grants (when a slot is
/// free) or ends the call in flight that `ends` picks, settling it with its `used`.
#[derive(Clone, Debug)]
struct ShareRun {
    weights: Vec<u32>,
    slots: usize,
    /// Per client, the calls it sends, cycled.
    calls: Vec<Vec<SimCall>>,
    /// Which call in flight ends next (an index taken modulo the calls in flight).
    ends: Vec<usize>,
}

const C_MAX: u64 = 2_000;
const D_MAX: u64 = 500;

fn share_run(weighted: bool) -> impl Strategy<Value = ShareRun> {
    (2usize..=5, 1usize..=4).prop_flat_map(move |(n, slots)| {
        let weight = if weighted { 1u32..=6 } else { 1u32..=1 };
        let call = (1u64..=C_MAX, 0u64..=2 * D_MAX).prop_map(|(cost, d)| SimCall {
            cost,
            used: (cost + d).saturating_sub(D_MAX).max(1),
        });
        (
            proptest::collection::vec(weight, n),
            Just(slots),
            proptest::collection::vec(proptest::collection::vec(call, 1..12), n),
            proptest::collection::vec(0usize..64, 400),
        )
            .prop_map(|(weights, slots, calls, ends)| ShareRun {
                weights,
                slots,
                calls,
                ends,
            })
    })
}

/// The worst share of a run, `min over grants and clients of (R_i − (w_i/W)·T)` in tokens,
/// after checking the module doc's bound at every grant. Returns (worst slack, slack bound,
/// tokens in all, the final worst share over its weighted share).
fn run_shares(run: &ShareRun) -> Result<(f64, f64, f64, f64), TestCaseError> {
    let n = run.weights.len();
    let t0 = Instant::now();
    let mut q: FairQueue<()> = FairQueue::default();
    let mut next_id = 0u64;
    let mut sent = vec![0usize; n];
    // Per waiter id: its client and call.
    let mut waiting: HashMap<u64, (usize, SimCall)> = HashMap::new();
    let mut queued = vec![0usize; n];
    let mut inflight: Vec<(usize, SimCall, Charge)> = Vec::new();
    let mut charged = vec![0f64; n];
    let total_weight: f64 = run.weights.iter().map(|&w| f64::from(w)).sum();
    let k = run.slots as f64;
    // The slack of the module doc: Σ_j w_j·(S_ji + S_ij), per client i.
    let spread = |i: usize, j: usize| {
        let (wi, wj) = (f64::from(run.weights[i]), f64::from(run.weights[j]));
        (C_MAX as f64 + k * D_MAX as f64) / wj + k * D_MAX as f64 / wi
    };
    let slack: Vec<f64> = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&j| j != i)
                .map(|j| f64::from(run.weights[j]) * (spread(j, i) + spread(i, j)))
                .sum::<f64>()
        })
        .collect();
    let mut worst = f64::INFINITY;
    let mut ends = run.ends.iter().cycle();
    let mut grants = 0;
    while grants < 300 {
        for c in 0..n {
            while queued[c] < 2 {
                let call = run.calls[c][sent[c] % run.calls[c].len()];
                sent[c] += 1;
                let ticket = Ticket::new(c as u64 + 1, run.weights[c], call.cost);
                q.push(
                    entry(
                        next_id,
                        t0 + Duration::from_micros(next_id),
                        PriorityClass::Batch,
                    ),
                    ticket,
                );
                waiting.insert(next_id, (c, call));
                queued[c] += 1;
                next_id += 1;
            }
        }
        if inflight.len() < run.slots {
            let taken = q.pop(PriorityClass::Batch).expect("every client waits");
            let (c, call) = waiting.remove(&taken.entry.id).expect("a queued waiter");
            prop_assert_eq!(taken.charge.ticket.client, c as u64 + 1);
            queued[c] -= 1;
            charged[c] += call.cost as f64;
            inflight.push((c, call, taken.charge));
            grants += 1;
            let total: f64 = charged.iter().sum();
            for i in 0..n {
                let fair = f64::from(run.weights[i]) / total_weight;
                prop_assert!(
                    charged[i] >= fair * (total - slack[i]) - 1e-6,
                    "client {} charged {} of {}, below {}·({} − {})",
                    i,
                    charged[i],
                    total,
                    fair,
                    total,
                    slack[i]
                );
                worst = worst.min(charged[i] - fair * total);
            }
        } else {
            let at = ends.next().expect("cycled") % inflight.len();
            let (c, call, charge) = inflight.swap_remove(at);
            charged[c] += call.used as f64 - call.cost as f64;
            q.settle(charge, Some(call.used));
        }
    }
    let total: f64 = charged.iter().sum();
    let final_share = (0..n)
        .map(|i| charged[i] / total / (f64::from(run.weights[i]) / total_weight))
        .fold(f64::INFINITY, f64::min);
    let bound = slack.iter().cloned().fold(0.0, f64::max);
    Ok((worst, bound, total, final_share))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (a) Equal weights: no client waiting throughout falls below `1/n − ε` of the tokens,
    /// `ε` the module doc's slack over the tokens charged so far.
    #[test]
    fn every_waiting_client_gets_its_share_less_the_bound(run in share_run(false)) {
        let (worst, bound, total, share) = run_shares(&run)?;
        eprintln!("fair-share equal n={} slots={} tokens={total:.0} worst_slack={worst:.0} bound={bound:.0} final_min_share/(1/n)={share:.3}", run.weights.len(), run.slots);
    }

    /// (a) Weighted: client `i` gets at least `w_i/W − ε`.
    #[test]
    fn every_waiting_client_gets_its_weighted_share_less_the_bound(run in share_run(true)) {
        let (worst, bound, total, share) = run_shares(&run)?;
        eprintln!("fair-share weighted n={} slots={} weights={:?} tokens={total:.0} worst_slack={worst:.0} bound={bound:.0} final_min_share/(w/W)={share:.3}", run.weights.len(), run.slots, run.weights);
    }
}

/// One step of a queue run: a waiter arrives (its client, its class), the queue serves, or a
/// waiter leaves (an index into those waiting).
#[derive(Clone, Copy, Debug)]
enum Op {
    Push {
        client: u64,
        batch: bool,
        after_ms: u64,
    },
    Serve {
        batch_allowed: bool,
    },
    Leave(usize),
}

fn op(clients: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..clients, any::<bool>(), 0u64..40).prop_map(|(client, batch, after_ms)| Op::Push { client, batch, after_ms }),
        3 => any::<bool>().prop_map(|batch_allowed| Op::Serve { batch_allowed }),
        1 => (0usize..32).prop_map(Op::Leave),
    ]
}

fn class_of(batch: bool) -> PriorityClass {
    if batch {
        PriorityClass::Batch
    } else {
        PriorityClass::Interactive
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (b) A lone client is served exactly as the plain two-class queue serves: same class
    /// decisions, same waiters, in the same order, whatever its calls cost.
    #[test]
    fn a_lone_client_sees_plain_fifo(
        ops in proptest::collection::vec(op(1), 1..120),
        costs in proptest::collection::vec(1u64..5_000, 120),
        aging_ms in 0u64..100,
    ) {
        let aging = Duration::from_millis(aging_ms);
        let t0 = Instant::now();
        let mut now = t0;
        let mut fair: FairQueue<()> = FairQueue::default();
        let mut plain: ClassQueue<()> = ClassQueue::default();
        let mut ids: Vec<u64> = Vec::new();
        for (id, o) in ops.into_iter().enumerate() {
            let id = id as u64;
            match o {
                Op::Push { batch, after_ms, .. } => {
                    now += Duration::from_millis(after_ms);
                    let class = class_of(batch);
                    fair.push(entry(id, now, class), Ticket::new(7, 1, costs[id as usize]));
                    plain.push(entry(id, now, class));
                    ids.push(id);
                }
                Op::Serve { batch_allowed } => {
                    let class = plain.next(aging, batch_allowed);
                    prop_assert_eq!(fair.next(aging, batch_allowed), class);
                    if let Some(class) = class {
                        let a = fair.pop(class).map(|t| t.entry.id);
                        let b = plain.pop(class).map(|e| e.id);
                        prop_assert_eq!(a, b);
                        ids.retain(|&i| Some(i) != b);
                    }
                }
                Op::Leave(at) if !ids.is_empty() => {
                    let id = ids.remove(at % ids.len());
                    prop_assert_eq!(fair.remove(id).map(|e| e.id), plain.remove(id).map(|e| e.id));
                }
                Op::Leave(_) => {}
            }
            prop_assert_eq!(fair.len(), plain.len());
            prop_assert_eq!(fair.len_of(PriorityClass::Batch), plain.len_of(PriorityClass::Batch));
        }
    }

    /// (c) With several clients in both classes: every class decision follows the rank rule
    /// (interactive's fair pick against batch's oldest waiter's aging deadline); while a batch
    /// waiter waits past its deadline, the interactive grants made are at most the
    /// interactive waiters that arrived by that deadline; and each client's waiters of a class
    /// are served in arrival order.
    #[test]
    fn the_aging_bound_between_classes_and_fifo_per_client_hold(
        ops in proptest::collection::vec(op(4), 1..160),
        costs in proptest::collection::vec(1u64..5_000, 160),
        aging_ms in 0u64..100,
    ) {
        let aging = Duration::from_millis(aging_ms);
        let t0 = Instant::now();
        let mut now = t0;
        let mut q: FairQueue<()> = FairQueue::default();
        // Waiting: id → (client, class, since).
        let mut waiting: Vec<(u64, u64, PriorityClass, Instant)> = Vec::new();
        // Interactive arrivals so far, by time.
        let mut interactive_arrivals: Vec<Instant> = Vec::new();
        // Per batch waiter: interactive grants made after its deadline passed.
        let mut passed: HashMap<u64, usize> = HashMap::new();
        // Per (client, class): the arrival of its latest served waiter.
        let mut last_served: HashMap<(u64, usize), (Instant, u64)> = HashMap::new();
        for (id, o) in ops.into_iter().enumerate() {
            let id = id as u64;
            match o {
                Op::Push { client, batch, after_ms } => {
                    now += Duration::from_millis(after_ms);
                    let class = class_of(batch);
                    q.push(entry(id, now, class), Ticket::new(client, 1 + client as u32, costs[id as usize]));
                    waiting.push((id, client, class, now));
                    if !batch {
                        interactive_arrivals.push(now);
                    }
                }
                Op::Serve { batch_allowed } => {
                    let Some(class) = q.next(aging, batch_allowed) else {
                        prop_assert!(waiting.iter().all(|w| w.2 == PriorityClass::Batch && !batch_allowed));
                        continue;
                    };
                    let taken = q.pop(class).expect("the class has a waiter");
                    let at = waiting.iter().position(|w| w.0 == taken.entry.id).expect("it waited");
                    let (wid, client, wclass, since) = waiting.remove(at);
                    prop_assert_eq!(wclass, class);
                    let key = (client, class.index());
                    if let Some(prev) = last_served.get(&key) {
                        prop_assert!(*prev < (since, wid), "client {} served out of order", client);
                    }
                    last_served.insert(key, (since, wid));
                    let oldest_batch = waiting
                        .iter()
                        .filter(|w| w.2 == PriorityClass::Batch)
                        .map(|w| w.3)
                        .min();
                    if class == PriorityClass::Interactive && batch_allowed
                        && let Some(b) = oldest_batch
                    {
                        prop_assert!(since <= b + aging, "interactive {:?} served past batch deadline {:?}", since - t0, b + aging - t0);
                    }
                    if class == PriorityClass::Interactive {
                        for w in waiting.iter().filter(|w| w.2 == PriorityClass::Batch) {
                            if now > w.3 + aging && batch_allowed {
                                *passed.entry(w.0).or_default() += 1;
                                let by_deadline = interactive_arrivals.iter().filter(|&&a| a <= w.3 + aging).count();
                                prop_assert!(passed[&w.0] <= by_deadline);
                            }
                        }
                    }
                }
                Op::Leave(at) if !waiting.is_empty() => {
                    let (id, ..) = waiting.remove(at % waiting.len());
                    prop_assert!(q.remove(id).is_some());
                }
                Op::Leave(_) => {}
            }
            prop_assert_eq!(q.len(), waiting.len());
        }
    }
}

#[test]
fn the_client_with_fewer_tokens_goes_first_and_weights_scale_its_turns() {
    let t0 = Instant::now();
    let mut q: FairQueue<()> = FairQueue::default();
    let class = PriorityClass::Interactive;
    // A long caller queues three calls of 1000 tokens, then a short one a call of 10.
    for id in 0..3 {
        q.push(entry(id, t0, class), Ticket::new(1, 1, 1_000));
    }
    q.push(
        entry(3, t0 + Duration::from_millis(1), class),
        Ticket::new(2, 1, 10),
    );
    let first = q.pop(class).expect("a waiter");
    assert_eq!((first.entry.id, first.reordered), (0, false));
    // The long caller is 1000 ahead: the short one goes before its older calls.
    let second = q.pop(class).expect("a waiter");
    assert_eq!((second.entry.id, second.reordered), (3, true));
    // Weight 3 against 1: three grants of equal cost for each one.
    let mut q: FairQueue<()> = FairQueue::default();
    for id in 0..8 {
        q.push(entry(id, t0, class), Ticket::new(1, 3, 100));
        q.push(entry(100 + id, t0, class), Ticket::new(2, 1, 100));
    }
    let order: Vec<u64> = (0..8)
        .map(|_| q.pop(class).expect("a waiter").charge.ticket.client)
        .collect();
    assert_eq!(order.iter().filter(|&&c| c == 1).count(), 6, "{order:?}");
}

#[test]
fn settling_corrects_the_charge_and_idle_clients_are_forgotten() {
    let t0 = Instant::now();
    let class = PriorityClass::Batch;
    let mut q: FairQueue<()> = FairQueue::default();
    q.push(entry(0, t0, class), Ticket::new(1, 1, 1_000));
    q.push(entry(1, t0, class), Ticket::new(1, 1, 1));
    q.push(entry(2, t0, class), Ticket::new(2, 1, 500));
    q.push(entry(3, t0, class), Ticket::new(2, 1, 1));
    let a = q.pop(class).expect("a waiter");
    assert_eq!(a.entry.id, 0);
    let b = q.pop(class).expect("a waiter");
    assert_eq!(b.entry.id, 2);
    // Client 1 is charged 1000 against client 2's 500; its call used 10: it goes next.
    q.settle(a.charge, Some(10));
    let c = q.pop(class).expect("a waiter");
    assert_eq!(c.entry.id, 1, "settled at 10, client 1 is behind client 2");
    let d = q.pop(class).expect("a waiter");
    assert_eq!(d.entry.id, 3);
    assert_eq!(q.tracked(class), 2, "both have calls in flight");
    // Nobody waits: once its calls are settled a client leaves the table.
    q.settle(b.charge, None);
    q.settle(c.charge, None);
    assert_eq!(q.tracked(class), 1, "client 2 still has a call in flight");
    // A call granted at once and given back (its connect failed) is charged nothing.
    let e = q.charge_now(class, Ticket::new(3, 1, 5_000));
    assert_eq!(q.tracked(class), 2);
    q.settle(e, Some(0));
    assert_eq!(q.tracked(class), 1);
    // Many one-call clients granted at once, nobody waiting: each grant ends a busy period,
    // so they leave the table once settled.
    for id in 10..20 {
        let charge = q.charge_now(class, Ticket::new(id, 1, 1));
        q.settle(charge, None);
    }
    assert_eq!(q.tracked(class), 1, "only the call in flight stays");
    q.settle(d.charge, Some(1));
    assert_eq!(q.tracked(class), 0);
}
