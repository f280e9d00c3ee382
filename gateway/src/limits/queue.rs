//! The two-class waiter queue of each client's queue, and the class order of the pool's
//! (`super::fair` keeps it, fair between clients within a class): interactive waiters
//! before batch ones, FIFO within a class, and aging: a batch waiter ranks as an interactive
//! waiter that arrived at its aging deadline (its arrival + `agingAfter`).
//!
//! Every waiter has a *rank*: an interactive waiter's arrival, a batch waiter's arrival plus
//! the aging bound; the waiter served next is the one of smallest rank (interactive on a tie,
//! then the earlier arrival). Within a class the rank follows arrival, so each class is a plain
//! FIFO and only the two heads are compared: O(1) per grant.
//!
//! The starvation bound that follows: once a batch waiter's aging deadline `d` has passed, the
//! only waiters ever served before it are those ranked before it: interactive waiters that
//! arrived at or before `d` and batch waiters that arrived before it. A batch waiter therefore
//! waits at most `agingAfter`, or, when longer, until the waiters ranked before it have been
//! served and the next connection frees. With a share cap on batch (`batchMaxPercent`) a batch
//! head that would take batch over its cap is passed over until a batch call ends: the bound
//! then also counts the interactive waiters served while batch held its cap.

use std::collections::VecDeque;
use std::time::Duration;

use poolpilot_api::limits::PriorityClass;
use tokio::time::Instant;

/// One waiter in a [`ClassQueue`].
#[derive(Debug)]
pub struct Entry<T> {
    /// Unique within the queue's owner, to find it again (a timeout, a dropped call).
    pub id: u64,
    /// When it arrived.
    pub since: Instant,
    /// Its class.
    pub class: PriorityClass,
    /// What it waits with (the channel its grant goes to).
    pub item: T,
}

/// Waiters of two classes. See the module doc for the order.
#[derive(Debug)]
pub struct ClassQueue<T> {
    fifo: [VecDeque<Entry<T>>; 2],
}

impl<T> Default for ClassQueue<T> {
    fn default() -> Self {
        Self {
            fifo: [VecDeque::new(), VecDeque::new()],
        }
    }
}

impl<T> ClassQueue<T> {
    /// Waiters of both classes.
    pub fn len(&self) -> usize {
        self.fifo[0].len() + self.fifo[1].len()
    }

    /// Waiters of one class.
    pub fn len_of(&self, class: PriorityClass) -> usize {
        self.fifo[class.index()].len()
    }

    /// No waiter.
    pub fn is_empty(&self) -> bool {
        self.fifo[0].is_empty() && self.fifo[1].is_empty()
    }

    /// Adds a waiter at the back of its class.
    pub fn push(&mut self, entry: Entry<T>) {
        self.fifo[entry.class.index()].push_back(entry);
    }

    /// Takes the waiter `id` out, wherever it is.
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        for fifo in &mut self.fifo {
            if let Some(at) = fifo.iter().position(|e| e.id == id) {
                return fifo.remove(at);
            }
        }
        None
    }

    /// Whether the waiter `id` is still queued.
    #[cfg(test)]
    pub fn contains(&self, id: u64) -> bool {
        self.fifo.iter().any(|f| f.iter().any(|e| e.id == id))
    }

    /// Drops every waiter.
    #[cfg(test)]
    pub fn clear(&mut self) {
        self.fifo.iter_mut().for_each(VecDeque::clear);
    }

    /// Takes the head of one class.
    pub fn pop(&mut self, class: PriorityClass) -> Option<Entry<T>> {
        self.fifo[class.index()].pop_front()
    }

    /// The class whose head is served next: the head of smallest rank (see the module doc),
    /// interactive on a tie. With `batch_allowed` false (batch holds its share cap) only an
    /// interactive head may be served: batch waits, interactive passes it.
    pub fn next(&self, aging: Duration, batch_allowed: bool) -> Option<PriorityClass> {
        let interactive = self.fifo[0].front();
        let batch = self.fifo[1].front().filter(|_| batch_allowed);
        match (interactive, batch) {
            (None, None) => None,
            (Some(_), None) => Some(PriorityClass::Interactive),
            (None, Some(_)) => Some(PriorityClass::Batch),
            (Some(i), Some(b)) => {
                if b.since + aging < i.since {
                    Some(PriorityClass::Batch)
                } else {
                    Some(PriorityClass::Interactive)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, since: Instant, class: PriorityClass) -> Entry<()> {
        Entry {
            id,
            since,
            class,
            item: (),
        }
    }

    #[test]
    fn interactive_goes_before_a_younger_batch_waiter_and_after_an_aged_one() {
        let t0 = Instant::now();
        let aging = Duration::from_millis(100);
        let mut q = ClassQueue::default();
        q.push(entry(0, t0, PriorityClass::Batch));
        q.push(entry(
            1,
            t0 + Duration::from_millis(50),
            PriorityClass::Interactive,
        ));
        assert_eq!(q.next(aging, true), Some(PriorityClass::Interactive));
        q.pop(PriorityClass::Interactive);
        // An interactive waiter arriving after the batch waiter's deadline (t0 + 100ms) ranks
        // after it; one arriving exactly at the deadline still goes first.
        q.push(entry(
            2,
            t0 + Duration::from_millis(100),
            PriorityClass::Interactive,
        ));
        assert_eq!(q.next(aging, true), Some(PriorityClass::Interactive));
        q.pop(PriorityClass::Interactive);
        q.push(entry(
            3,
            t0 + Duration::from_millis(101),
            PriorityClass::Interactive,
        ));
        assert_eq!(q.next(aging, true), Some(PriorityClass::Batch));
        assert_eq!(q.next(aging, false), Some(PriorityClass::Interactive));
    }

    #[test]
    fn a_removed_waiter_leaves_its_class_and_the_rest_keep_their_order() {
        let t0 = Instant::now();
        let mut q = ClassQueue::default();
        for id in 0..4 {
            let class = if id % 2 == 0 {
                PriorityClass::Batch
            } else {
                PriorityClass::Interactive
            };
            q.push(entry(id, t0 + Duration::from_millis(id), class));
        }
        assert_eq!((q.len(), q.len_of(PriorityClass::Batch)), (4, 2));
        assert!(q.remove(2).is_some());
        assert!(q.remove(2).is_none());
        assert!(!q.contains(2) && q.contains(0));
        assert_eq!(q.pop(PriorityClass::Batch).map(|e| e.id), Some(0));
        assert_eq!(q.pop(PriorityClass::Batch).map(|e| e.id), None);
        assert_eq!(q.pop(PriorityClass::Interactive).map(|e| e.id), Some(1));
        q.clear();
        assert!(q.is_empty() && q.next(Duration::ZERO, true).is_none());
    }
}
