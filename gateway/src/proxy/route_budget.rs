//! The pod-wide byte budget of the routing buffers (request bodies read to find their JSON
//! `model`): many clients sending bodies that never finish must not grow the gateway's memory
//! without bound. A request whose buffer would take the pod over `routeBufferBudget` is refused
//! (503, `Retry-After`); what a request holds goes back when its buffer is handed on or dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The bytes held by routing buffers, pod-wide. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct ByteBudget {
    held: Arc<AtomicU64>,
}

/// Bytes taken from a [`ByteBudget`]; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    held: Arc<AtomicU64>,
    bytes: u64,
}

impl ByteBudget {
    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// An empty reservation, to grow.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            held: self.held.clone(),
            bytes: 0,
        }
    }
}

impl Reservation {
    /// Takes `more` bytes, unless that would put the pod over `limit` (then takes nothing).
    pub fn grow(&mut self, more: u64, limit: u64) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(more).filter(|total| *total <= limit)
            });
        if taken.is_ok() {
            self.bytes += more;
        }
        taken.is_ok()
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_stay_within_the_limit_and_give_back_on_drop() {
        let budget = ByteBudget::default();
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.grow(600, 1000));
        assert!(!b.grow(500, 1000), "over the limit: nothing taken");
        assert!(b.grow(400, 1000));
        assert_eq!(budget.held(), 1000);
        drop(a);
        assert_eq!(budget.held(), 400);
        assert!(b.grow(600, 1000));
        assert_eq!(b.bytes(), 1000);
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
