//! Admission: the concurrency slots (a batch) and the bounded FIFO queue in front of them,
//! with the in-flight and queued gauges and their peaks.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::metrics::Metrics;

/// Concurrency slots and the bounded queue in front of them.
#[derive(Debug)]
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    max_queue: i64,
    max_concurrency: f64,
}

/// A held concurrency slot; releasing it (drop) lets the next queued request in.
#[derive(Debug)]
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

/// Decrements a gauge when dropped.
#[derive(Debug)]
pub(crate) struct GaugeGuard(pub Gauge);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Admission {
    pub fn new(max_concurrency: u32, max_queue: u32) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrency as usize)),
            max_queue: i64::from(max_queue),
            max_concurrency: f64::from(max_concurrency),
        }
    }

    /// Takes a free slot, or waits in the queue (FIFO) for one, or returns `None` when the queue
    /// is full. Returns the slot and how long the request waited.
    pub async fn admit(&self, m: &Metrics) -> Option<(Slot, Duration)> {
        let start = Instant::now();
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let max_queue = self.max_queue;
                let prev = m
                    .queued
                    .inner()
                    .fetch_update(
                        std::sync::atomic::Ordering::AcqRel,
                        std::sync::atomic::Ordering::Acquire,
                        |q| (q < max_queue).then_some(q + 1),
                    )
                    .ok()?;
                Metrics::raise_peak(&m.queued_peak, prev + 1);
                let _queued = GaugeGuard(m.queued.clone());
                // The semaphore is never closed, so this only ends with a permit.
                Arc::clone(&self.slots).acquire_owned().await.ok()?
            }
        };
        let now = m.in_flight.inc() + 1;
        Metrics::raise_peak(&m.in_flight_peak, now);
        Some((
            Slot {
                _permit: permit,
                in_flight: m.in_flight.clone(),
            },
            start.elapsed(),
        ))
    }

    /// Share of slots busy, in `[0, 1]`.
    pub fn load(&self, m: &Metrics) -> f64 {
        (m.in_flight.get() as f64 / self.max_concurrency).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admission_queues_then_refuses() {
        let m = Metrics::new(2, 1);
        let admission = Admission::new(2, 1);
        let (a, _) = admission.admit(&m).await.unwrap();
        let (_b, _) = admission.admit(&m).await.unwrap();
        assert_eq!(m.in_flight.get(), 2);
        let queued = tokio::spawn({
            let m_queued = m.queued.clone();
            async move {
                // Wait until the third request is queued, then release a slot.
                while m_queued.get() == 0 {
                    tokio::task::yield_now().await;
                }
            }
        });
        let third = admission.admit(&m);
        tokio::pin!(third);
        tokio::select! {
            _ = &mut third => panic!("admitted without a free slot"),
            _ = queued => {}
        }
        assert_eq!(m.queued.get(), 1);
        assert!(
            admission.admit(&m).await.is_none(),
            "the queue of 1 is full"
        );
        drop(a);
        let (_c, _) = third.await.unwrap();
        assert_eq!(
            (
                m.in_flight.get(),
                m.queued.get(),
                m.in_flight_peak.get(),
                m.queued_peak.get()
            ),
            (2, 0, 2, 1)
        );
    }
}
