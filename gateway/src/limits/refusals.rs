//! The memory of refusals ([`RefusalMemory`]), for `Retry-After` compliance: which clients come
//! back before the time a refusal told them. A bounded memory of recent refusals (429 and 503
//! with `Retry-After`) per client (the hashed identity of its client policy, or its source
//! address on a route without one): the client's next call is counted as early (before
//! `Retry-After` passed) or on time, per client class. Optionally, an early call that is
//! refused again is told to wait longer.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;
use tokio::time::Instant;

use crate::limits::limiter::ClientKey;
use crate::observe::Timing;

/// Refusals remembered at most; beyond it the oldest is forgotten.
pub const MEMORY: usize = 10_000;

/// A refusal is forgotten this long after its `Retry-After` passed: a call later than that is
/// a new call, not a retry.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);

/// The `earlyRetries` section of the gateway's configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EarlyRetryConfig {
    /// Multiply the `Retry-After` of a call refused again after coming back early by this
    /// factor (1: no penalty).
    #[serde(default = "EarlyRetryConfig::default_factor")]
    pub penalty_factor: u32,
}

impl EarlyRetryConfig {
    fn default_factor() -> u32 {
        1
    }
}

impl Default for EarlyRetryConfig {
    fn default() -> Self {
        Self {
            penalty_factor: Self::default_factor(),
        }
    }
}

#[derive(Debug)]
struct Refusal {
    class: Arc<str>,
    until: Instant,
    /// Its place in [`State::order`].
    seq: u64,
}

/// Early and on-time retries of one client class.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Compliance {
    /// Calls that came back before their `Retry-After`.
    pub early: u64,
    /// Calls that came back after it.
    pub on_time: u64,
}

/// The memory of recent refusals. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct RefusalMemory {
    inner: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// `state.refused.len()`, kept beside it so that a call finds an empty memory (the usual
    /// case: nobody was refused lately) without the lock, the hash or a clock read.
    remembered: AtomicUsize,
}

#[derive(Debug, Default)]
struct State {
    refused: HashMap<ClientKey, Refusal>,
    /// Keys in the order they were refused, with the sequence number of that refusal (a stale
    /// record, whose key was refused again since, is skipped).
    order: VecDeque<(ClientKey, u64)>,
    next_seq: u64,
    by_class: HashMap<Arc<str>, Compliance>,
}

impl RefusalMemory {
    /// A call of `key` arrived at `now`: whether it is a retry of a remembered refusal, early or
    /// on time, and its class then. The refusal is forgotten either way.
    pub fn arrived(&self, key: &ClientKey, now: Instant) -> Option<(Timing, Arc<str>)> {
        if self.is_empty() {
            return None;
        }
        let mut state = self.inner.state.lock();
        let refusal = state.refused.remove(key)?;
        self.inner
            .remembered
            .store(state.refused.len(), Ordering::Relaxed);
        if now > refusal.until + FORGET_AFTER {
            return None;
        }
        let timing = if now < refusal.until {
            Timing::Early
        } else {
            Timing::OnTime
        };
        let counts = state.by_class.entry(refusal.class.clone()).or_default();
        match timing {
            Timing::Early => counts.early += 1,
            Timing::OnTime => counts.on_time += 1,
        }
        Some((timing, refusal.class))
    }

    /// `key`, of client class `class`, was refused at `now` and told to come back after
    /// `retry_after`.
    pub fn refused(&self, key: ClientKey, class: Arc<str>, retry_after: Duration, now: Instant) {
        let mut state = self.inner.state.lock();
        let until = now + retry_after;
        let seq = state.next_seq;
        state.next_seq += 1;
        state.refused.insert(key, Refusal { class, until, seq });
        state.order.push_back((key, seq));
        while state.refused.len() > MEMORY || state.order.len() > 2 * MEMORY {
            let Some((old, at)) = state.order.pop_front() else {
                break;
            };
            if state.refused.get(&old).is_some_and(|r| r.seq == at) {
                state.refused.remove(&old);
            }
        }
        self.inner
            .remembered
            .store(state.refused.len(), Ordering::Relaxed);
    }

    /// Refusals remembered now.
    pub fn len(&self) -> usize {
        self.inner.remembered.load(Ordering::Relaxed)
    }

    /// Whether no refusal is remembered (without the lock: a refusal being remembered at this
    /// instant may not show yet).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Early and on-time retries per client class so far.
    pub fn compliance(&self) -> Vec<(Arc<str>, Compliance)> {
        let state = self.inner.state.lock();
        let mut all: Vec<_> = state
            .by_class
            .iter()
            .map(|(class, c)| (class.clone(), c.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_call_before_its_retry_after_is_early_and_after_it_on_time() {
        let memory = RefusalMemory::default();
        let (alice, bob) = (ClientKey::of(b"alice"), ClientKey::of(b"bob"));
        let class: Arc<str> = "other".into();
        assert_eq!(
            memory.arrived(&alice, Instant::now()),
            None,
            "no refusal yet"
        );

        memory.refused(alice, class.clone(), Duration::from_secs(2), Instant::now());
        memory.refused(bob, class.clone(), Duration::from_secs(2), Instant::now());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(
            memory.arrived(&alice, Instant::now()),
            Some((Timing::Early, class.clone()))
        );
        assert_eq!(memory.arrived(&alice, Instant::now()), None, "counted once");
        assert_eq!(memory.len(), 1, "bob's refusal is still remembered");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            memory.arrived(&bob, Instant::now()),
            Some((Timing::OnTime, class.clone()))
        );
        assert!(memory.is_empty(), "both refusals were answered");
        assert_eq!(
            memory.compliance(),
            [(
                class.clone(),
                Compliance {
                    early: 1,
                    on_time: 1
                }
            )]
        );

        // Much later: a new call, not a retry.
        memory.refused(alice, class.clone(), Duration::from_secs(1), Instant::now());
        tokio::time::advance(FORGET_AFTER + Duration::from_secs(2)).await;
        assert_eq!(memory.arrived(&alice, Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_memory_is_bounded_and_forgets_the_oldest_first() {
        let memory = RefusalMemory::default();
        let class: Arc<str> = "other".into();
        let now = Instant::now();
        for i in 0..MEMORY + 10 {
            let key = ClientKey::of(&i.to_le_bytes());
            memory.refused(key, class.clone(), Duration::from_secs(5), now);
        }
        assert_eq!(memory.len(), MEMORY);
        assert_eq!(
            memory.arrived(&ClientKey::of(&0usize.to_le_bytes()), now),
            None
        );
        let last = ClientKey::of(&(MEMORY + 9).to_le_bytes());
        assert_eq!(memory.arrived(&last, now), Some((Timing::Early, class)));
        // One client refused again and again takes one entry.
        let again = ClientKey::of(b"again");
        let memory = RefusalMemory::default();
        for _ in 0..3 * MEMORY {
            memory.refused(again, "other".into(), Duration::from_secs(5), now);
        }
        assert_eq!(memory.len(), 1);
    }
}
