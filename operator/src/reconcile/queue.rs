//! The reconcile queue: every reason to reconcile a policy waits here, and goes to the Controller
//! only into a reconcile slot left free, changes first (in the order they came), then the
//! periodic reconciles whose time came (oldest first). The Controller never holds more waiting
//! than its slots, so that a first reconcile or an edit never queues behind thousands of periodic
//! ones, and no policy's periodic reconcile is passed over for another's.
//!
//! The Controller's own queue hands everything over at its time: with more due than it runs, the
//! ones waiting were taken in the order of a hash set, so that some policies went unreconciled
//! for minutes while others ran every interval, and a new policy or an edit waited behind them
//! all (2,000 policies at a 15 s interval ask 133 reconciles a second).
//!
//! The bound: reconciles handed over and not started yet never exceed the slots left free by
//! those running, `handed ≤ slots − running` when each is handed over (a reconcile that starts
//! moves from `handed` to `running`; one that ends frees its slot). So the Controller holds at
//! most `slots` waiting, whatever the number of policies. One handed over that never starts (its
//! policy went away meanwhile) stops counting after [`HANDED_FOR`]. A change of a policy already
//! waiting for a change is one entry; one whose periodic reconcile waits takes its place (the
//! reconcile that follows plans the next). When more periodic reconciles are due than the slots
//! take, every policy's comes late by about the same time, which
//! `poolpilot_operator_requeue_lag_seconds` shows.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use kube::ResourceExt;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A policy: (namespace, name).
pub type PolicyRef = (String, String);

/// `object` as the queue knows it.
pub fn policy_ref(object: &impl ResourceExt) -> PolicyRef {
    (object.namespace().unwrap_or_default(), object.name_any())
}

/// How long a reconcile handed over counts as waiting for its slot.
pub const HANDED_FOR: Duration = Duration::from_secs(30);

/// The changes waiting, the next periodic reconcile of every policy, and the slots they take.
#[derive(Debug)]
pub struct ReconcileQueue {
    slots: usize,
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Policies that changed (or whose pods, EndpointSlices or ConfigMap did), in that order.
    changed: VecDeque<PolicyRef>,
    /// The same, to find one.
    changed_set: HashSet<PolicyRef>,
    /// Each policy's next periodic reconcile: when, and the wait its last reconcile asked for.
    next: HashMap<PolicyRef, (Instant, Duration)>,
    /// The same, in the order they come due.
    due: BTreeSet<(Instant, PolicyRef)>,
    /// Handed to the Controller and not started yet, with when.
    handed: HashMap<PolicyRef, Instant>,
    /// Reconciles running (periodic or not).
    running: usize,
}

/// What the queue does next.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Hand this policy over now: a change (`None`), or a periodic reconcile this late.
    Hand(PolicyRef, Option<Duration>),
    /// Nothing before this time (or a change).
    At(Instant),
    /// Nothing before a change.
    Idle,
}

impl State {
    fn next(&mut self, slots: usize, now: Instant) -> Next {
        self.handed
            .retain(|_, at| now.duration_since(*at) < HANDED_FOR);
        let lapse = self.handed.values().min().map(|at| *at + HANDED_FOR);
        let busy = self.running + self.handed.len();
        if busy < slots
            && let Some(policy) = self.changed.pop_front()
        {
            self.changed_set.remove(&policy);
            // Its reconcile plans the next periodic one.
            self.remove(&policy);
            self.handed.insert(policy.clone(), now);
            return Next::Hand(policy, None);
        }
        let first = self.due.first().cloned();
        match first {
            Some((at, policy)) if at <= now && busy < slots => {
                self.due.remove(&(at, policy.clone()));
                self.next.remove(&policy);
                self.handed.insert(policy.clone(), now);
                Next::Hand(policy, Some(now.duration_since(at)))
            }
            // Full: the next chance is a slot freed (a change) or a handed one lapsing.
            _ if busy >= slots => lapse.map_or(Next::Idle, Next::At),
            Some((at, _)) => Next::At(lapse.map_or(at, |l| l.min(at))),
            None => lapse.map_or(Next::Idle, Next::At),
        }
    }

    fn remove(&mut self, policy: &PolicyRef) {
        if let Some((at, _)) = self.next.remove(policy) {
            self.due.remove(&(at, policy.clone()));
        }
    }
}

impl ReconcileQueue {
    /// A queue for a Controller that runs `slots` reconciles at once (at least 1).
    pub fn new(slots: usize) -> Self {
        Self {
            slots: slots.max(1),
            state: Mutex::default(),
            wake: Notify::new(),
        }
    }

    /// `policy` (or what it reads) changed: it is reconciled once a slot is free, before any
    /// periodic reconcile.
    pub fn changed(&self, policy: PolicyRef) {
        let mut state = self.state.lock();
        if state.changed_set.insert(policy.clone()) {
            state.changed.push_back(policy);
        }
        drop(state);
        self.wake.notify_one();
    }

    /// `policy`'s next periodic reconcile is `after` from now (in place of the one planned).
    pub fn schedule(&self, policy: PolicyRef, after: Duration) {
        let at = Instant::now() + after;
        let mut state = self.state.lock();
        state.remove(&policy);
        state.due.insert((at, policy.clone()));
        state.next.insert(policy, (at, after));
        drop(state);
        self.wake.notify_one();
    }

    /// `policy` needs no periodic reconcile (it is gone, or waits for a change).
    pub fn forget(&self, policy: &PolicyRef) {
        let mut state = self.state.lock();
        state.remove(policy);
        drop(state);
        self.wake.notify_one();
    }

    /// `policy` was handed over but the Controller will not run it (it is gone from the cache):
    /// its slot is free again.
    pub fn gone(&self, policy: &PolicyRef) {
        let mut state = self.state.lock();
        state.handed.remove(policy);
        drop(state);
        self.wake.notify_one();
    }

    /// Whether a change of `policy` waits to be handed over.
    pub fn change_waits(&self, policy: &PolicyRef) -> bool {
        self.state.lock().changed_set.contains(policy)
    }

    /// The wait `policy`'s last reconcile asked for before the next, while it waits.
    pub fn asked(&self, policy: &PolicyRef) -> Option<Duration> {
        self.state.lock().next.get(policy).map(|(_, after)| *after)
    }

    /// A reconcile of `policy` starts (periodic or not): it holds a slot until the guard drops.
    #[must_use = "the slot is freed when the guard drops"]
    pub fn start(&self, policy: &PolicyRef) -> Running<'_> {
        let mut state = self.state.lock();
        state.handed.remove(policy);
        state.running += 1;
        Running(self)
    }

    /// The reconciles as they are handed over, each with how late it is when periodic. The
    /// stream never ends: the Controller's shutdown drops it.
    pub fn handed_over(
        self: Arc<Self>,
    ) -> impl Stream<Item = (PolicyRef, Option<Duration>)> + Send {
        futures::stream::unfold(self, |queue| async move {
            loop {
                let handed = {
                    // Registered before looking, so that a change meanwhile is not missed.
                    let changed = queue.wake.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    let next = queue.state.lock().next(queue.slots, Instant::now());
                    match next {
                        Next::Hand(policy, late) => Some((policy, late)),
                        Next::At(at) => {
                            tokio::select! {
                                () = changed => {}
                                () = tokio::time::sleep_until(at) => {}
                            }
                            None
                        }
                        Next::Idle => {
                            changed.await;
                            None
                        }
                    }
                };
                if let Some(handed) = handed {
                    return Some((handed, queue));
                }
            }
        })
    }
}

/// A running reconcile's slot ([`ReconcileQueue::start`]).
#[derive(Debug)]
pub struct Running<'a>(&'a ReconcileQueue);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.running = state.running.saturating_sub(1);
        drop(state);
        self.0.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    fn p(name: &str) -> PolicyRef {
        ("ns".into(), name.into())
    }

    type Handed = (PolicyRef, Option<Duration>);

    /// The next policy handed over within `within`, if any.
    async fn next_within(
        stream: &mut (impl Stream<Item = Handed> + Unpin),
        within: Duration,
    ) -> Option<Handed> {
        tokio::time::timeout(within, stream.next()).await.ok()?
    }

    #[tokio::test(start_paused = true)]
    async fn each_periodic_reconcile_is_handed_over_at_its_time_oldest_first() {
        let queue = Arc::new(ReconcileQueue::new(8));
        queue.schedule(p("late"), Duration::from_secs(20));
        queue.schedule(p("early"), Duration::from_secs(5));
        queue.schedule(p("middle"), Duration::from_secs(10));
        let mut stream = Box::pin(queue.clone().handed_over());
        let start = Instant::now();
        let mut order = Vec::new();
        for _ in 0..3 {
            let (policy, late) = stream.next().await.unwrap();
            order.push((policy.1, start.elapsed().as_secs(), late));
        }
        let on_time = Some(Duration::ZERO);
        assert_eq!(
            order,
            [
                ("early".to_owned(), 5, on_time),
                ("middle".to_owned(), 10, on_time),
                ("late".to_owned(), 20, on_time)
            ]
        );
        assert_eq!(
            next_within(&mut stream, Duration::from_secs(600)).await,
            None
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_schedule_replaces_the_one_planned_and_a_forgotten_policy_is_never_handed() {
        let queue = Arc::new(ReconcileQueue::new(8));
        queue.schedule(p("a"), Duration::from_secs(5));
        queue.schedule(p("a"), Duration::from_secs(30));
        assert_eq!(queue.asked(&p("a")), Some(Duration::from_secs(30)));
        queue.schedule(p("gone"), Duration::from_secs(1));
        queue.forget(&p("gone"));
        assert_eq!(queue.asked(&p("gone")), None);
        let mut stream = Box::pin(queue.clone().handed_over());
        let start = Instant::now();
        let (policy, _) = stream.next().await.unwrap();
        assert_eq!((policy, start.elapsed().as_secs()), (p("a"), 30));
        assert_eq!(queue.asked(&p("a")), None, "handed over: nothing planned");
    }

    #[tokio::test(start_paused = true)]
    async fn changes_go_first_in_their_order_each_once_and_take_a_waiting_periodic_ones_place() {
        let queue = Arc::new(ReconcileQueue::new(8));
        for name in ["x", "y", "z"] {
            queue.schedule(p(name), Duration::ZERO);
        }
        queue.schedule(p("b"), Duration::from_secs(15));
        tokio::time::sleep(Duration::from_secs(1)).await;
        for name in ["a", "b", "a", "c"] {
            queue.changed(p(name));
        }
        let mut stream = Box::pin(queue.clone().handed_over());
        let mut order = Vec::new();
        while let Some((policy, late)) = next_within(&mut stream, Duration::from_secs(60)).await {
            order.push((policy.1, late.is_some()));
        }
        let names: Vec<(&str, bool)> = order.iter().map(|(n, p)| (n.as_str(), *p)).collect();
        assert_eq!(
            names,
            [
                ("a", false),
                ("b", false),
                ("c", false),
                ("x", true),
                ("y", true),
                ("z", true)
            ],
            "the changes, each once, then the periodic ones due; b's periodic reconcile went \
             with its change"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_are_handed_over_than_the_slots_left_free_and_each_slot_freed_takes_the_next() {
        let queue = Arc::new(ReconcileQueue::new(2));
        // Five due at once, from the oldest.
        for (i, name) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            queue.schedule(p(name), Duration::from_millis(10 * i as u64));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut stream = Box::pin(queue.clone().handed_over());
        let first = stream.next().await.unwrap();
        let second = stream.next().await.unwrap();
        assert_eq!((&first.0, &second.0), (&p("a"), &p("b")));
        assert!(first.1 > second.1, "the oldest is the latest");
        assert_eq!(
            next_within(&mut stream, Duration::from_secs(5)).await,
            None,
            "both slots promised"
        );
        // A change waits for a slot too, and takes the first one freed.
        queue.changed(p("edited"));
        let running = queue.start(&p("a"));
        assert_eq!(next_within(&mut stream, Duration::from_secs(5)).await, None);
        drop(running);
        assert_eq!(
            next_within(&mut stream, Duration::from_secs(5)).await,
            Some((p("edited"), None))
        );
        let _b = queue.start(&p("b"));
        let edited = queue.start(&p("edited"));
        assert_eq!(next_within(&mut stream, Duration::from_secs(5)).await, None);
        drop(edited);
        assert_eq!(
            next_within(&mut stream, Duration::from_secs(5))
                .await
                .map(|x| x.0),
            Some(p("c"))
        );
        // A reconcile the Controller started on its own (a retry) takes a slot too.
        let _c = queue.start(&p("c"));
        let _retry = queue.start(&p("other"));
        assert_eq!(next_within(&mut stream, Duration::from_secs(5)).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn one_handed_over_that_never_starts_stops_holding_its_slot() {
        let queue = Arc::new(ReconcileQueue::new(1));
        queue.schedule(p("lost"), Duration::ZERO);
        queue.schedule(p("next"), Duration::from_secs(1));
        let mut stream = Box::pin(queue.clone().handed_over());
        let start = Instant::now();
        assert_eq!(stream.next().await.unwrap().0, p("lost"));
        // No reconcile of it ever starts (the Controller skipped it).
        let (policy, late) = stream.next().await.unwrap();
        assert_eq!(policy, p("next"));
        assert_eq!(start.elapsed(), HANDED_FOR);
        assert_eq!(late, Some(HANDED_FOR - Duration::from_secs(1)));
        // One the Controller will not run (its policy is gone) is given back at once.
        queue.changed(p("deleted"));
        assert_eq!(stream.next().await.unwrap().0, p("deleted"));
        queue.gone(&p("deleted"));
        queue.changed(p("after"));
        assert_eq!(
            next_within(&mut stream, Duration::from_secs(1))
                .await
                .map(|x| x.0),
            Some(p("after")),
            "its slot is free again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn many_policies_due_together_run_late_by_turns_none_passed_over() {
        // 40 policies due every 10 s through 4 slots, each reconcile taking 2 s: a slot serves
        // 5 in 10 s, so 4 serve 20 of the 40 due. Every policy still runs, by turns: none is
        // passed over for one that just ran.
        let queue = Arc::new(ReconcileQueue::new(4));
        let names: Vec<String> = (0..40).map(|i| format!("p{i:02}")).collect();
        for n in &names {
            queue.schedule(p(n), Duration::from_secs(10));
        }
        let mut runs: HashMap<String, u32> = HashMap::new();
        let mut stream = Box::pin(queue.clone().handed_over());
        let end = Instant::now() + Duration::from_secs(200);
        let mut running = tokio::task::JoinSet::new();
        while Instant::now() < end {
            let Some(((ns, name), _)) = next_within(&mut stream, end - Instant::now()).await else {
                break;
            };
            *runs.entry(name.clone()).or_default() += 1;
            let queue = queue.clone();
            running.spawn(async move {
                let slot = queue.start(&(ns.clone(), name.clone()));
                tokio::time::sleep(Duration::from_secs(2)).await;
                queue.schedule((ns, name), Duration::from_secs(10));
                drop(slot);
            });
        }
        let counts: Vec<u32> = names
            .iter()
            .map(|n| runs.get(n).copied().unwrap_or(0))
            .collect();
        let (least, most) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*least >= 8, "every policy ran, by turns: {counts:?}");
        assert!(most - least <= 1, "none passed over: {counts:?}");
    }
}
