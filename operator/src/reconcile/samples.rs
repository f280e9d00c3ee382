//! The planner's samples of a namespace, read out of the Prometheus snapshot once per round
//! for each policy instead of at every pass.
//!
//! A snapshot changes once per `--metrics-interval`, while a namespace with thousands of
//! policies plans many passes in that time (every decision due, every change). Reading one
//! policy's samples looks up each of its backends on each of its pods in a dozen of the
//! snapshot's maps; [`SamplesMemo`] keeps each policy's part of the result for the round and
//! reads it again only when the snapshot is a new round or what it is read for (the policy's
//! pods, which of them are ready, its backends and their saturation queries) changed. A part
//! depends on nothing else, so the samples a pass gets are those a reading of every policy at
//! once would give (`Snapshot::samples`); the tests check that.

use std::collections::HashMap;
use std::time::Duration;

use crate::plan::time::elapsed;
use crate::plan::{PolicyKey, Samples, Timestamp};
use crate::prom::{Selection, Snapshot};

/// Each policy's samples as read from one snapshot, per namespace.
#[derive(Debug, Default)]
pub struct SamplesMemo {
    /// The round they were read from (`Snapshot::at`).
    at: Option<Timestamp>,
    /// Per policy: what its samples were read for, and what was read.
    parts: HashMap<PolicyKey, (Selection, Samples)>,
    /// Policies read (not taken from the memo) so far, for the tests.
    #[cfg(test)]
    read: u64,
}

impl SamplesMemo {
    /// The samples of namespace `ns`'s `selection` in `snapshot`, as
    /// [`Snapshot::samples`] reads them: each policy's part kept from an earlier call on the
    /// same round when it was read for the same selection, read anew otherwise. Forgets the
    /// policies not in `selection`.
    pub fn samples(
        &mut self,
        snapshot: &Snapshot,
        ns: &str,
        selection: &[Selection],
        now: Timestamp,
        max_age: Duration,
    ) -> Samples {
        if snapshot.at != self.at {
            self.parts.clear();
            self.at = snapshot.at;
        }
        // A stale snapshot is all missing (no part of it is kept).
        if snapshot.at.is_none_or(|t| elapsed(t, now) > max_age) {
            self.parts.clear();
            return Samples::default();
        }
        let mut out = Samples::default();
        let mut parts = HashMap::with_capacity(selection.len());
        for s in selection {
            let part = match self.parts.remove(&s.policy) {
                Some((read_for, part)) if read_for == *s => part,
                _ => {
                    #[cfg(test)]
                    {
                        self.read += 1;
                    }
                    snapshot.samples(ns, std::slice::from_ref(s), now, max_age)
                }
            };
            merge(&mut out, &part);
            parts.insert(s.policy.clone(), (s.clone(), part));
        }
        self.parts = parts;
        out
    }

    /// How many policies' samples were read out of a snapshot (not taken from the memo).
    #[cfg(test)]
    pub(crate) fn read(&self) -> u64 {
        self.read
    }
}

/// Adds one policy's part to `out` (the per-pod samples are the same in every part).
fn merge(out: &mut Samples, part: &Samples) {
    out.backends
        .extend(part.backends.iter().map(|(k, v)| (k.clone(), *v)));
    out.pools
        .extend(part.pools.iter().map(|(k, v)| (k.clone(), *v)));
    for (pod, sample) in &part.pods {
        if !out.pods.contains_key(pod) {
            out.pods.insert(pod.clone(), *sample);
        }
    }
    out.token_use
        .extend(part.token_use.iter().map(|(k, v)| (k.clone(), v.clone())));
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
}
