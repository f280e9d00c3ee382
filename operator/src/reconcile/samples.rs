//! The planner's samples of a namespace, read out of the Prometheus snapshot once per round
//! for each policy instead of at every pass, and shared by the passes.
//!
//! A snapshot changes once per `--metrics-interval`, while a namespace with thousands of
//! policies plans many passes in that time (every decision due, every change). Reading one
//! policy's samples looks up each of its backends on each of its pods in a dozen of the
//! snapshot's maps; [`SamplesMemo`] keeps the namespace's samples of the round, every policy's
//! part in one [`Samples`] that every pass of the round shares (an `Arc`, not a copy per pass
//! nor a copy per policy), and reads a policy's part again only when the snapshot is a new
//! round or what it is read for (the policy's pods, which of them are ready, its backends and
//! their saturation queries) changed. A part depends on nothing else, so the samples a pass
//! gets are those a reading of every policy at once would give (`Snapshot::samples`); the
//! tests check that.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::plan::time::elapsed;
use crate::plan::{PolicyKey, Samples, Timestamp};
use crate::prom::{Selection, Snapshot};

/// The namespace's samples as read from one snapshot.
#[derive(Debug, Default)]
pub struct SamplesMemo {
    /// The round they were read from (`Snapshot::at`).
    at: Option<Timestamp>,
    /// Per policy: what its part of `samples` was read for.
    read_for: HashMap<PolicyKey, Selection>,
    /// Every policy's part, as one reading of them all gives it.
    samples: Arc<Samples>,
    /// Policies read (not taken from the memo) so far, for the tests.
    #[cfg(test)]
    read: u64,
}

impl SamplesMemo {
    /// The samples of namespace `ns`'s `selection` in `snapshot`, as
    /// [`Snapshot::samples`] reads them: each policy's part kept from an earlier call on the
    /// same round when it was read for the same selection, read anew otherwise. Forgets the
    /// policies not in `selection`. Unchanged, the result is the one the last call returned
    /// (the same allocation).
    pub fn samples(
        &mut self,
        snapshot: &Snapshot,
        ns: &str,
        selection: &[Selection],
        now: Timestamp,
        max_age: Duration,
    ) -> Arc<Samples> {
        if snapshot.at != self.at {
            self.forget();
            self.at = snapshot.at;
        }
        // A stale snapshot is all missing (no part of it is kept).
        if snapshot.at.is_none_or(|t| elapsed(t, now) > max_age) {
            self.forget();
            return self.samples.clone();
        }
        let fresh: Vec<Selection> = selection
            .iter()
            .filter(|s| self.read_for.get(&s.policy) != Some(*s))
            .cloned()
            .collect();
        let wanted: HashSet<&PolicyKey> = selection.iter().map(|s| &s.policy).collect();
        let dropped: HashSet<PolicyKey> = self
            .read_for
            .keys()
            .filter(|k| !wanted.contains(k))
            .cloned()
            .chain(fresh.iter().map(|s| s.policy.clone()))
            .collect();
        if dropped.is_empty() && fresh.is_empty() {
            return self.samples.clone();
        }
        // A copy only when a pass still holds the last result.
        let samples = Arc::make_mut(&mut self.samples);
        if !dropped.is_empty() {
            samples.backends.retain(|(k, _), _| !dropped.contains(k));
            samples.pools.retain(|(k, ..), _| !dropped.contains(k));
            samples.token_use.retain(|(k, _), _| !dropped.contains(k));
        }
        #[cfg(test)]
        {
            self.read += fresh.len() as u64;
        }
        let part = snapshot.samples(ns, &fresh, now, max_age);
        samples.backends.extend(part.backends);
        samples.pools.extend(part.pools);
        samples.token_use.extend(part.token_use);
        // The per-pod samples are the same in every part: those of the pods some policy
        // selects.
        let selected: HashSet<&String> = selection.iter().flat_map(|s| &s.pods).collect();
        samples.pods.retain(|pod, _| selected.contains(pod));
        for (pod, sample) in part.pods {
            samples.pods.entry(pod).or_insert(sample);
        }
        for k in &dropped {
            self.read_for.remove(k);
        }
        self.read_for
            .extend(fresh.into_iter().map(|s| (s.policy.clone(), s)));
        self.samples.clone()
    }

    /// Forgets every part.
    fn forget(&mut self) {
        self.read_for.clear();
        self.samples = Arc::default();
    }

    /// How many policies' samples were read out of a snapshot (not taken from the memo).
    #[cfg(test)]
    pub(crate) fn read(&self) -> u64 {
        self.read
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use crate::prom::Rows;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    const MAX_AGE: Duration = Duration::from_secs(30);

    /// A round in which every pod of `pods` reports each metric for each backend, and its own
    /// file descriptors (so it counts as scraped).
    fn snapshot(taken: i64, pods: &[&str], backends: &[&str]) -> Snapshot {
        let mut rows: BTreeMap<&'static str, Rows> = BTreeMap::new();
        for (i, metric) in ["leased", "pending", "leased_now", "completed", "bytes"]
            .into_iter()
            .enumerate()
        {
            let mut r = Vec::new();
            for (p, pod) in pods.iter().enumerate() {
                for (b, backend) in backends.iter().enumerate() {
                    let labels = HashMap::from([
                        ("namespace".to_owned(), "ns".to_owned()),
                        ("pod".to_owned(), (*pod).to_owned()),
                        ("backend".to_owned(), (*backend).to_owned()),
                    ]);
                    r.push((labels, (taken + (i * 100 + p * 10 + b) as i64) as f64));
                }
            }
            rows.insert(metric, Some(r));
        }
        let fds = pods
            .iter()
            .map(|pod| {
                let labels = HashMap::from([
                    ("namespace".to_owned(), "ns".to_owned()),
                    ("pod".to_owned(), (*pod).to_owned()),
                ]);
                (labels, 1024.0)
            })
            .collect();
        rows.insert("max_fds", Some(fds));
        Snapshot::fold(at(taken), Duration::from_secs(15), &rows)
    }

    fn selection(policy: &str, pods: &[&str], backend: &str) -> Selection {
        let pods: Vec<String> = pods.iter().map(|p| (*p).to_owned()).collect();
        Selection {
            policy: PolicyKey {
                namespace: "ns".into(),
                name: policy.into(),
            },
            ready: pods.clone(),
            pods,
            backends: vec![(backend.to_owned(), None)],
        }
    }

    /// What the planner reads of the samples, comparable (the samples' types have no
    /// equality of their own).
    fn seen(s: &Samples) -> String {
        format!("{:?}", (&s.backends, &s.pools, &s.pods, &s.token_use))
    }

    #[test]
    fn within_a_round_only_the_policies_whose_selection_changed_are_read_again() {
        let snap = snapshot(0, &["gw-0", "gw-1", "gw-2"], &["a", "b"]);
        let mut selections = vec![
            selection("p", &["gw-0", "gw-1"], "a"),
            selection("q", &["gw-1", "gw-2"], "b"),
            selection("r", &["gw-0", "gw-1", "gw-2"], "a"),
        ];
        let mut memo = SamplesMemo::default();
        let first = memo.samples(&snap, "ns", &selections, at(1), MAX_AGE);
        assert_eq!(
            seen(&first),
            seen(&snap.samples("ns", &selections, at(1), MAX_AGE))
        );
        assert!(!first.backends.is_empty() && !first.pools.is_empty());
        assert_eq!(memo.read(), 3);

        let again = memo.samples(&snap, "ns", &selections, at(2), MAX_AGE);
        assert_eq!(
            seen(&again),
            seen(&first),
            "the same round, nothing changed"
        );
        assert_eq!(memo.read(), 3, "nothing read again");

        selections[1] = selection("q", &["gw-2"], "b");
        let changed = memo.samples(&snap, "ns", &selections, at(3), MAX_AGE);
        assert_eq!(
            seen(&changed),
            seen(&snap.samples("ns", &selections, at(3), MAX_AGE))
        );
        assert_eq!(memo.read(), 4, "only the policy whose pods changed");

        selections.remove(0);
        let fewer = memo.samples(&snap, "ns", &selections, at(4), MAX_AGE);
        assert_eq!(
            seen(&fewer),
            seen(&snap.samples("ns", &selections, at(4), MAX_AGE)),
            "a policy gone takes its samples with it"
        );
        assert_eq!(memo.read(), 4);
    }

    #[test]
    fn a_new_round_is_read_anew_and_a_stale_one_is_all_missing() {
        let selections = vec![
            selection("p", &["gw-0"], "a"),
            selection("q", &["gw-1"], "a"),
        ];
        let mut memo = SamplesMemo::default();
        let old = snapshot(0, &["gw-0", "gw-1"], &["a"]);
        memo.samples(&old, "ns", &selections, at(1), MAX_AGE);
        let new = snapshot(15, &["gw-0", "gw-1"], &["a"]);
        let got = memo.samples(&new, "ns", &selections, at(16), MAX_AGE);
        assert_eq!(
            seen(&got),
            seen(&new.samples("ns", &selections, at(16), MAX_AGE))
        );
        assert_eq!(memo.read(), 4, "every policy read again from the new round");

        let stale = memo.samples(&new, "ns", &selections, at(60), MAX_AGE);
        assert!(stale.backends.is_empty() && stale.pods.is_empty());
        assert_eq!(
            seen(&stale),
            seen(&new.samples("ns", &selections, at(60), MAX_AGE))
        );
    }

    /// One policy's selection in a generated step: which of the pods `gw-0..gw-3` it
    /// selects and which of those are ready (bit masks), and its backend.
    fn generated(policy: usize, pods: u8, ready: u8, backend: bool) -> Selection {
        let all = ["gw-0", "gw-1", "gw-2", "gw-3"];
        let chosen: Vec<&str> = (0..4)
            .filter(|i| pods & (1 << i) != 0)
            .map(|i| all[i])
            .collect();
        let mut s = selection(
            &format!("p{policy}"),
            &chosen,
            if backend { "b" } else { "a" },
        );
        s.ready = (0..4)
            .filter(|i| pods & ready & (1 << i) != 0)
            .map(|i| all[i].to_owned())
            .collect();
        s
    }

    proptest::proptest! {
        /// Whatever the sequence of rounds and selections (policies coming, going, changing
        /// pods, readiness or backend), the memo gives what reading every policy afresh gives.
        #[test]
        fn the_memo_reads_what_a_fresh_reading_reads(
            steps in proptest::collection::vec(
                (
                    0..3i64,
                    proptest::collection::vec(
                        proptest::option::of((0..16u8, 0..16u8, proptest::bool::ANY)),
                        5,
                    ),
                ),
                1..12,
            )
        ) {
            // Pod gw-3 is never scraped: a policy that selects it ready has missing samples.
            let rounds: Vec<Snapshot> = (0..3)
                .map(|r| snapshot(r * 15, &["gw-0", "gw-1", "gw-2"], &["a", "b"]))
                .collect();
            let mut memo = SamplesMemo::default();
            for (i, (round, policies)) in steps.into_iter().enumerate() {
                let selections: Vec<Selection> = policies
                    .into_iter()
                    .enumerate()
                    .filter_map(|(p, s)| s.map(|(pods, ready, b)| generated(p, pods, ready, b)))
                    .collect();
                let snap = &rounds[round as usize];
                // Now and then the round has gone stale.
                let now = at(round * 15 + if i % 5 == 4 { 60 } else { 1 });
                let got = memo.samples(snap, "ns", &selections, now, MAX_AGE);
                let fresh = snap.samples("ns", &selections, now, MAX_AGE);
                proptest::prop_assert_eq!(seen(&got), seen(&fresh));
            }
        }
    }
}
