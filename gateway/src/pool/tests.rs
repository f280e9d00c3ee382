//! State-machine tests of the pool with fake connections and paused time.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use poolpilot_api::Duration as ApiDuration;
use poolpilot_api::limits::{HealthCheck, OutlierDetection};

use super::*;

#[derive(Debug)]
struct FakeConn {
    id: usize,
    open: Arc<AtomicBool>,
    valid: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    /// Set when the peer holds its side after our close until the value turns true.
    peer_closes: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Poolable for FakeConn {
    fn is_open(&mut self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    fn validate(&mut self) -> bool {
        self.is_open() && self.valid.load(Ordering::SeqCst)
    }

    fn close(mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let mut peer = self.peer_closes.take()?;
        Some(async move {
            let _ = peer.wait_for(|closed| *closed).await;
            drop(self);
        })
    }
}

impl Drop for FakeConn {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct FakeConnector {
    created: AtomicUsize,
    live: Arc<AtomicUsize>,
    /// Handles of every connection made, to close or invalidate them from the test.
    handles: Mutex<Vec<(Arc<AtomicBool>, Arc<AtomicBool>)>>,
    connect_delay: Mutex<Duration>,
    refuse: AtomicBool,
    /// When set, the peer keeps each connection after the pool closed it, until this says so.
    peer_closes: Mutex<Option<tokio::sync::watch::Receiver<bool>>>,
}

impl Connect for Arc<FakeConnector> {
    type Conn = FakeConn;

    fn connect(&self, _addr: SocketAddr) -> impl Future<Output = io::Result<FakeConn>> + Send {
        let this = self.clone();
        async move {
            let delay = *this.connect_delay.lock();
            tokio::time::sleep(delay).await;
            if this.refuse.load(Ordering::SeqCst) {
                return Err(io::Error::from(io::ErrorKind::ConnectionRefused));
            }
            let id = this.created.fetch_add(1, Ordering::SeqCst);
            this.live.fetch_add(1, Ordering::SeqCst);
            let open = Arc::new(AtomicBool::new(true));
            let valid = Arc::new(AtomicBool::new(true));
            this.handles.lock().push((open.clone(), valid.clone()));
            Ok(FakeConn {
                id,
                open,
                valid,
                live: this.live.clone(),
                peer_closes: this.peer_closes.lock().clone(),
            })
        }
    }
}

fn limits(max: u32) -> PoolLimits {
    PoolLimits {
        max_connections_per_endpoint: max,
        max_pending: 4,
        lease_timeout: ApiDuration::from_millis(300),
        idle_timeout: ApiDuration::from_secs(30),
        max_lifetime: ApiDuration::from_secs(600),
        connect_timeout: ApiDuration::from_secs(1),
        validate_after_idle: ApiDuration::from_secs(2),
        soft_throttle: None,
        burst_per_endpoint: 0,
    }
}

fn endpoints(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| Endpoint {
            name: format!("ep-{i}"),
            address: SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16)),
        })
        .collect()
}

fn pool(max: u32, n: usize) -> (Pool<Arc<FakeConnector>>, Arc<FakeConnector>) {
    let connector = Arc::new(FakeConnector::default());
    let pool = Pool::new(
        "model-a",
        limits(max),
        &endpoints(n),
        connector.clone(),
        Metrics::new(),
    );
    (pool, connector)
}

/// Leases a connection and gives it back kept: the pool holds it idle afterwards.
async fn lease_and_keep(pool: &Pool<Arc<FakeConnector>>) {
    let mut lease = pool.lease().await.unwrap();
    lease.keep();
}

fn open_total(pool: &Pool<Arc<FakeConnector>>) -> u32 {
    pool.stats()
        .endpoints
        .iter()
        .map(|e| e.leased + e.idle + e.connecting + e.closing)
        .sum()
}

#[tokio::test(start_paused = true)]
async fn reuses_an_idle_connection() {
    let (pool, connector) = pool(2, 1);
    let mut first = pool.lease().await.expect("a free slot must be leased");
    assert!(!first.reused());
    first.keep();
    drop(first);
    assert_eq!(pool.stats().endpoints[0].idle, 1);

    let second = pool
        .lease()
        .await
        .expect("the idle connection must be leased");
    assert!(
        second.reused(),
        "the idle connection is reused, not a new one opened"
    );
    assert_eq!(connector.created.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_discarded_connection_is_closed_not_pooled() {
    let (pool, connector) = pool(2, 1);
    let mut lease = pool.lease().await.unwrap();
    lease.discard(CloseReason::Timeout);
    drop(lease);
    assert_eq!(open_total(&pool), 0);
    assert_eq!(
        connector.live.load(Ordering::SeqCst),
        0,
        "the connection was dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn the_cap_holds_and_waiters_are_served_in_order() {
    let (pool, connector) = pool(2, 1);
    let mut a = pool.lease().await.unwrap();
    let b = pool.lease().await.unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..3 {
        let pool = pool.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lease = pool
                .lease()
                .await
                .expect("a waiter gets a connection in time");
            tx.send((i, lease.conn().id)).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            lease.keep();
        });
        // Queue them in a known order.
        tokio::task::yield_now().await;
    }
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().pending, 3);
    assert_eq!(open_total(&pool), 2, "no connection beyond the cap");

    a.keep();
    let a_id = a.conn().id;
    drop(a);
    assert_eq!(
        rx.recv().await,
        Some((0, a_id)),
        "the oldest waiter gets the returned connection"
    );
    drop(b); // discarded: its slot goes to the next waiter, which connects
    assert_eq!(rx.recv().await.map(|(i, _)| i), Some(1));
    assert_eq!(rx.recv().await.map(|(i, _)| i), Some(2));
    assert!(connector.created.load(Ordering::SeqCst) <= 3);
    assert!(open_total(&pool) <= 2);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_gives_up_at_the_lease_timeout() {
    let (pool, _) = pool(1, 1);
    let held = pool.lease().await.unwrap();
    let start = Instant::now();
    let err = pool
        .lease()
        .await
        .expect_err("the pool is full until the lease timeout");
    assert_eq!(start.elapsed(), Duration::from_millis(300));
    match err {
        PoolError::LeaseTimeout {
            waited,
            retry_after,
            ..
        } => {
            assert_eq!(waited, Duration::from_millis(300));
            // No lease was ever released: the estimate falls back to the lease timeout → 1s.
            assert_eq!(retry_after, Duration::from_secs(1));
        }
        other => panic!("expected a lease timeout, got {other:?}"),
    }
    assert_eq!(
        pool.stats().pending,
        0,
        "the timed-out waiter left the queue"
    );
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_with_a_retry_after_from_the_drain_rate() {
    let (pool, _) = pool(1, 1);
    // Releases every 500ms: the queue drains at 2 per second.
    for _ in 0..4 {
        let mut lease = pool.lease().await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        lease.keep();
    }
    let _held = pool.lease().await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let pool = pool.clone();
        waiters.push(tokio::spawn(async move { pool.lease().await.map(|_| ()) }));
        tokio::task::yield_now().await;
    }
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().pending, 4);
    match pool.lease().await {
        Err(PoolError::QueueFull {
            pending,
            retry_after,
            ..
        }) => {
            assert_eq!(pending, 4);
            // 4 releases in the last 1.5s (2.67/s); 5 requests to drain: 1.9s, rounded up.
            assert_eq!(retry_after, Duration::from_secs(2));
        }
        other => panic!("expected a full queue, got {other:?}"),
    }
    for w in waiters {
        assert!(matches!(
            w.await.unwrap(),
            Err(PoolError::LeaseTimeout { .. })
        ));
    }
}

#[tokio::test(start_paused = true)]
async fn growing_the_cap_wakes_waiters_at_once() {
    let (pool, _) = pool(1, 1);
    let _held = pool.lease().await.unwrap();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|l| l.wait()) })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().pending, 1);
    tokio::time::sleep(Duration::from_millis(50)).await;

    pool.set_limits(limits(2));
    let wait = waiter.await.unwrap().expect("the waiter gets the new slot");
    assert_eq!(
        wait,
        Duration::from_millis(50),
        "woken by the resize, not by the timeout"
    );
}

#[tokio::test(start_paused = true)]
async fn shrinking_the_cap_closes_connections_as_they_return() {
    let (pool, connector) = pool(3, 1);
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(pool.lease().await.unwrap());
    }
    pool.set_limits(limits(1));
    assert_eq!(
        pool.stats().endpoints[0].leased,
        3,
        "in-flight leases are untouched"
    );
    assert_eq!(connector.live.load(Ordering::SeqCst), 3);
    for mut lease in leases {
        assert!(
            lease.conn().is_open(),
            "no in-flight connection is closed by a shrink"
        );
        lease.keep();
    }
    let stats = &pool.stats().endpoints[0];
    assert_eq!(
        (stats.leased, stats.idle),
        (0, 1),
        "only the new cap is kept"
    );
    assert_eq!(connector.live.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn shrinking_closes_excess_idle_connections_now() {
    let (pool, connector) = pool(3, 1);
    let leases: Vec<_> = [pool.lease().await.unwrap(), pool.lease().await.unwrap()].into();
    for mut lease in leases {
        lease.keep();
    }
    assert_eq!(pool.stats().endpoints[0].idle, 2);
    pool.set_limits(limits(1));
    assert_eq!(pool.stats().endpoints[0].idle, 1);
    assert_eq!(connector.live.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn idle_connections_are_reaped_after_the_idle_timeout() {
    let (pool, connector) = pool(2, 1);
    lease_and_keep(&pool).await;
    tokio::time::sleep(Duration::from_secs(29)).await;
    pool.reap();
    assert_eq!(pool.stats().endpoints[0].idle, 1);
    // The background reaper closes it shortly after 30s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(pool.stats().endpoints[0].idle, 0);
    assert_eq!(connector.live.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_connection_closed_by_the_peer_is_not_reused() {
    let (pool, connector) = pool(2, 1);
    lease_and_keep(&pool).await;
    connector.handles.lock()[0].0.store(false, Ordering::SeqCst);
    let lease = pool.lease().await.unwrap();
    assert!(
        !lease.reused(),
        "a closed idle connection is dropped, a new one opened"
    );
    assert_eq!(connector.created.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn connections_the_backend_closed_count_how_long_they_had_been_idle() {
    let metrics = Metrics::new();
    let connector = Arc::new(FakeConnector::default());
    let pool = Pool::new(
        "model-a",
        limits(2),
        &endpoints(1),
        connector.clone(),
        metrics.clone(),
    );
    let idle_closes = || {
        let text = metrics.encode();
        let value = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name) && l.contains("backend=\"model-a\""))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        };
        (
            value("poolpilot_pool_peer_closed_idle_seconds_count"),
            value("poolpilot_pool_peer_closed_idle_seconds_sum"),
        )
    };
    // The series is there at zero from the pool's start: Prometheus sees the first closes as an
    // increase.
    assert_eq!(idle_closes(), (Some(0.0), Some(0.0)));
    // Closed by the backend after 2.5 s idle: the next lease finds it closed.
    lease_and_keep(&pool).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    connector.handles.lock()[0].0.store(false, Ordering::SeqCst);
    let mut lease = pool.lease().await.unwrap();
    assert!(!lease.reused());
    assert_eq!(
        lease.idle_for(),
        Duration::ZERO,
        "a new connection was never idle"
    );
    assert_eq!(idle_closes(), (Some(1.0), Some(2.5)));
    // Kept, closed by the backend after 1 s idle: the reaper finds it on its pass (every
    // quarter of the idle timeout, now 1.5 s under the first close), within 375 ms.
    lease.keep();
    drop(lease);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    connector.handles.lock()[1].0.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(pool.stats().endpoints[0].idle, 0);
    let (count, sum) = idle_closes();
    assert_eq!(count, Some(2.0));
    let reaped = sum.unwrap() - 2.5;
    assert!(
        (1.0..=1.375).contains(&reaped),
        "found by the reaper after {reaped} s idle"
    );
    // A connection reused after 0.5 s idle says so; closing one the pool timed out, or one
    // that errored, is not the backend's doing.
    lease_and_keep(&pool).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut lease = pool.lease().await.unwrap();
    assert!(lease.reused());
    assert_eq!(lease.idle_for(), Duration::from_millis(500));
    lease.discard(CloseReason::Error);
    drop(lease);
    lease_and_keep(&pool).await;
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(
        pool.stats().endpoints[0].idle,
        0,
        "reaped at its idle timeout"
    );
    assert_eq!(idle_closes().0, Some(2.0));
}

/// Closes the endpoint's connection number `i` from the backend's side.
fn peer_closes(connector: &FakeConnector, i: usize) {
    connector.handles.lock()[i].0.store(false, Ordering::SeqCst);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_seen_closing_idle_connections_keeps_them_idle_for_less_at_once() {
    let (pool, connector) = pool(4, 2);
    let stats = |i: usize| {
        let ep = pool.stats().endpoints[i].clone();
        (ep.idle_timeout_ms, ep.peer_closed_idle_ms)
    };
    assert_eq!(
        stats(0),
        (30_000, None),
        "idleTimeout until a close is seen"
    );
    // Two connections to each endpoint (the choice goes to the one with more spare), idle.
    let mut leases = Vec::new();
    for _ in 0..4 {
        let mut lease = pool.lease().await.unwrap();
        lease.keep();
        leases.push(lease);
    }
    drop(leases);
    let on = |ep: &str| {
        pool.stats()
            .endpoints
            .iter()
            .find(|e| e.name == ep)
            .map(|e| e.idle)
            .unwrap()
    };
    assert_eq!((on("ep-0"), on("ep-1")), (2, 2));
    // The backend behind ep-0 closes one after 2 s idle: the reaper's pass (every second under
    // 30 s) finds it within a second, and ep-0 keeps connections idle for 0.6 × that at once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    peer_closes(&connector, 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ep = pool
        .stats()
        .endpoints
        .iter()
        .position(|e| e.peer_closed_idle_ms.is_some())
        .expect("one endpoint saw the close");
    let (timeout, seen) = stats(ep);
    let seen = seen.unwrap();
    assert!((2_000..=3_000).contains(&seen), "{seen} ms");
    assert_eq!(timeout, seen * 6 / 10, "0.6 × the close's idle time");
    // Its other idle connection, idle longer than that, closed on the same pass; the other
    // endpoint's stay: its backend closed nothing.
    assert_eq!(pool.stats().endpoints[ep].idle, 0);
    assert_eq!(pool.stats().endpoints[1 - ep].idle, 2);
    assert_eq!(stats(1 - ep), (30_000, None));

    // A connection to it now closes idle just before its backend would close it.
    let (p2, c2) = self::pool(1, 1);
    lease_and_keep(&p2).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    peer_closes(&c2, 0);
    let mut lease = p2.lease().await.unwrap();
    assert!(!lease.reused(), "found closed at the lease");
    assert_eq!(p2.stats().endpoints[0].idle_timeout_ms, 1_500);
    lease.keep();
    drop(lease);
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let mut lease = p2.lease().await.unwrap();
    assert!(lease.reused(), "idle 1.4 s, under 1.5 s: reused");
    lease.keep();
    drop(lease);
    tokio::time::sleep(Duration::from_millis(1500 + 375)).await;
    assert_eq!(
        p2.stats().endpoints[0].idle,
        0,
        "closed by the pool at 1.5 s idle, before the backend's 2 s"
    );
    // A request unanswered on a reused connection idle 0.5 s (the backend's close crossed it)
    // lowers it further.
    lease_and_keep(&p2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut lease = p2.lease().await.unwrap();
    assert!(lease.reused());
    lease.discard(CloseReason::PeerClosed);
    drop(lease);
    assert_eq!(
        (
            p2.stats().endpoints[0].idle_timeout_ms,
            p2.stats().endpoints[0].peer_closed_idle_ms
        ),
        (300, Some(500))
    );
    // New limits with the same idle timeout keep what was seen; a new idle timeout (the
    // operator's, under every gateway's findings) starts over.
    p2.set_limits(limits(2));
    assert_eq!(p2.stats().endpoints[0].idle_timeout_ms, 300);
    p2.set_limits(PoolLimits {
        idle_timeout: ApiDuration::from_millis(1200),
        ..limits(2)
    });
    assert_eq!(
        (
            p2.stats().endpoints[0].idle_timeout_ms,
            p2.stats().endpoints[0].peer_closed_idle_ms
        ),
        (1_200, None)
    );
    // Ten quiet minutes: what a close showed is forgotten (a restart closes connections of
    // every age; the shorter timeout it taught does not last).
    lease_and_keep(&p2).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut lease = p2.lease().await.unwrap();
    lease.discard(CloseReason::PeerClosed);
    drop(lease);
    assert_eq!(p2.stats().endpoints[0].idle_timeout_ms, 100, "the floor");
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        (
            p2.stats().endpoints[0].idle_timeout_ms,
            p2.stats().endpoints[0].peer_closed_idle_ms
        ),
        (1_200, None)
    );
}

#[tokio::test(start_paused = true)]
async fn validates_only_after_the_validate_after_idle_period() {
    let (pool, connector) = pool(2, 1);
    lease_and_keep(&pool).await;
    connector.handles.lock()[0].1.store(false, Ordering::SeqCst);
    // Idle 1s (< validateAfterIdle 2s): reused without validation.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut lease = pool.lease().await.unwrap();
    assert!(lease.reused());
    lease.keep();
    drop(lease);
    // Idle 3s: validated, fails, replaced.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lease = pool.lease().await.unwrap();
    assert!(
        !lease.reused(),
        "a connection failing validation is replaced"
    );
}

#[tokio::test(start_paused = true)]
async fn connections_older_than_max_lifetime_are_not_pooled() {
    let (pool, connector) = pool(2, 1);
    let mut lease = pool.lease().await.unwrap();
    tokio::time::sleep(Duration::from_secs(601)).await;
    lease.keep();
    drop(lease);
    assert_eq!(pool.stats().endpoints[0].idle, 0);
    assert_eq!(connector.live.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn connect_timeout_frees_the_slot() {
    let (pool, connector) = pool(1, 1);
    *connector.connect_delay.lock() = Duration::from_secs(5);
    let err = pool
        .lease()
        .await
        .expect_err("connect takes longer than connectTimeout");
    assert!(matches!(err, PoolError::ConnectTimeout { .. }), "{err:?}");
    assert_eq!(open_total(&pool), 0, "the reserved slot is released");
    *connector.connect_delay.lock() = Duration::ZERO;
    pool.lease().await.expect("the slot can be used again");
}

#[tokio::test(start_paused = true)]
async fn a_refused_connect_fails_the_lease() {
    let (pool, connector) = pool(1, 1);
    connector.refuse.store(true, Ordering::SeqCst);
    let err = pool.lease().await.expect_err("connect is refused");
    assert!(matches!(err, PoolError::Connect { .. }), "{err:?}");
    assert_eq!(err.endpoint(), Some("ep-0"));
    assert_eq!(open_total(&pool), 0);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_does_not_swallow_a_connection() {
    let (pool, _) = pool(1, 1);
    let mut held = pool.lease().await.unwrap();
    let cancelled = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|_| ()) })
    };
    tokio::task::yield_now().await;
    cancelled.abort();
    let _ = cancelled.await;
    held.keep();
    drop(held);
    let lease = pool
        .lease()
        .await
        .expect("the returned connection is still available");
    assert!(lease.reused());
}

#[tokio::test(start_paused = true)]
async fn a_lease_abandoned_while_connecting_gives_its_slot_back() {
    let (pool, connector) = pool(1, 1);
    *connector.connect_delay.lock() = Duration::from_millis(100);
    let abandoned = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(pool.stats().endpoints[0].connecting, 1);
    abandoned.abort();
    let _ = abandoned.await;
    assert_eq!(open_total(&pool), 0, "the reserved slot is free again");
    let lease = pool.lease().await.expect("the slot can be leased again");
    assert!(!lease.reused());
}

#[tokio::test(start_paused = true)]
async fn a_grant_sent_to_a_waiter_that_then_went_away_is_given_back() {
    for keep in [true, false] {
        let (pool, connector) = pool(1, 1);
        let mut held = pool.lease().await.unwrap();
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.lease().await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert_eq!(pool.stats().pending, 1);
        // Returned (kept: the connection; discarded: its slot) and handed to the waiter, whose
        // client goes away before the waiter runs again.
        if keep {
            held.keep();
        }
        drop(held);
        waiter.abort();
        let _ = waiter.await;
        let ep = &pool.stats().endpoints[0];
        assert_eq!(
            (ep.leased, ep.connecting, ep.idle),
            (0, 0, u32::from(keep)),
            "keep = {keep}: the grant came back"
        );
        let lease = pool.lease().await.expect("the capacity is there");
        assert_eq!(lease.reused(), keep);
        assert_eq!(
            connector.created.load(Ordering::SeqCst),
            2 - usize::from(keep)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn picks_the_endpoint_with_more_spare_capacity() {
    let (pool, _) = pool(4, 2);
    let mut leases = Vec::new();
    for _ in 0..8 {
        leases.push(pool.lease().await.unwrap());
        let stats = pool.stats();
        let (a, b) = (stats.endpoints[0].leased, stats.endpoints[1].leased);
        assert!(
            a.abs_diff(b) <= 1,
            "leases spread by spare capacity: {a} vs {b}"
        );
    }
}

fn outlier(consecutive: u32, percent: u32) -> OutlierDetection {
    OutlierDetection {
        consecutive_failures: consecutive,
        base_ejection: ApiDuration::from_secs(10),
        max_ejected_percent: percent,
    }
}

fn check() -> HealthCheck {
    HealthCheck {
        path: "/health".into(),
        interval: ApiDuration::from_secs(1),
        timeout: ApiDuration::from_secs(1),
        unhealthy_threshold: 2,
        healthy_threshold: 2,
    }
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_eject_and_probes_bring_it_back() {
    let (pool, _) = pool(4, 2);
    pool.set_health_rules(Some(check()), Some(outlier(3, 50)));
    for _ in 0..3 {
        pool.report_call("ep-0", false);
    }
    let stats = pool.stats();
    assert!(stats.endpoints[0].ejected && !stats.endpoints[0].healthy);
    for _ in 0..6 {
        let lease = pool.lease().await.unwrap();
        assert_eq!(
            &**lease.endpoint(),
            "ep-1",
            "an ejected endpoint gets no traffic"
        );
    }

    // Ejection over, but no probe has passed since: still out.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(!pool.stats().endpoints[0].healthy);
    pool.report_probe("ep-0", true);
    assert!(
        !pool.stats().endpoints[0].healthy,
        "one probe is below healthyThreshold"
    );
    pool.report_probe("ep-0", true);
    assert!(
        pool.stats().endpoints[0].healthy,
        "back after two passing probes"
    );
}

#[tokio::test(start_paused = true)]
async fn never_ejects_more_than_the_max_percent() {
    let (pool, _) = pool(4, 2);
    pool.set_health_rules(None, Some(outlier(1, 50)));
    pool.report_call("ep-0", false);
    pool.report_call("ep-1", false);
    let stats = pool.stats();
    assert_eq!(stats.endpoints.iter().filter(|e| e.ejected).count(), 1);
    pool.lease()
        .await
        .expect("the endpoint left in service takes traffic");
}

#[tokio::test(start_paused = true)]
async fn failed_probes_take_an_endpoint_out() {
    let (pool, _) = pool(4, 1);
    pool.set_health_rules(Some(check()), None);
    pool.report_probe("ep-0", false);
    assert!(
        pool.stats().endpoints[0].healthy,
        "one failure is below unhealthyThreshold"
    );
    pool.report_probe("ep-0", false);
    match pool.lease().await {
        Err(PoolError::NoHealthyEndpoint { retry_after, .. }) => {
            // Two passing probes at a 1s interval.
            assert_eq!(retry_after, Duration::from_secs(2));
        }
        other => panic!("expected no healthy endpoint, got {other:?}"),
    }
    pool.report_probe("ep-0", true);
    pool.report_probe("ep-0", true);
    pool.lease().await.expect("healthy again");
}

#[tokio::test(start_paused = true)]
async fn a_removed_endpoint_closes_its_connections_as_they_return() {
    let (pool, connector) = pool(2, 2);
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(pool.lease().await.unwrap());
    }
    pool.set_endpoints(&endpoints(1));
    assert_eq!(pool.stats().endpoints.len(), 1);
    for mut lease in leases {
        lease.keep();
    }
    assert_eq!(pool.stats().endpoints[0].idle, 2);
    assert_eq!(
        connector.live.load(Ordering::SeqCst),
        2,
        "the removed endpoint's connections closed"
    );
}

#[tokio::test(start_paused = true)]
async fn every_lease_records_its_wait() {
    let metrics = Metrics::new();
    let connector = Arc::new(FakeConnector::default());
    let pool = Pool::new(
        "model-a",
        limits(1),
        &endpoints(1),
        connector,
        metrics.clone(),
    );
    let mut held = pool.lease().await.unwrap();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    held.keep();
    drop(held);
    waiter.await.unwrap().unwrap();
    let text = metrics.encode();
    assert!(
        text.contains("poolpilot_pool_lease_wait_seconds_count{backend=\"model-a\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("poolpilot_pool_lease_wait_seconds_sum{backend=\"model-a\"} 0.1"),
        "{text}"
    );
}

/// A pool of `max` over one endpoint whose peer holds each closed connection until the returned
/// sender says it closed.
fn pool_with_lingering_peer(
    max: u32,
) -> (
    Pool<Arc<FakeConnector>>,
    Arc<FakeConnector>,
    tokio::sync::watch::Sender<bool>,
) {
    let (pool, connector) = pool(max, 1);
    let (closes, peer) = tokio::sync::watch::channel(false);
    *connector.peer_closes.lock() = Some(peer);
    (pool, connector, closes)
}

#[tokio::test(start_paused = true)]
async fn a_closed_connection_keeps_its_slot_until_the_peer_closes_its_side() {
    let (pool, connector, peer_closes) = pool_with_lingering_peer(1);
    let mut lease = pool.lease().await.unwrap();
    // The client went away mid-request: the connection is closed, not pooled.
    lease.discard(CloseReason::Error);
    drop(lease);
    let ep = &pool.stats().endpoints[0];
    assert_eq!((ep.leased, ep.idle, ep.closing), (0, 0, 1));
    assert_eq!(
        connector.live.load(Ordering::SeqCst),
        1,
        "the peer holds it"
    );

    // The backend still counts it: a new lease waits instead of opening a second connection.
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|mut l| l.conn().id) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.stats().pending, 1);
    assert_eq!(connector.created.load(Ordering::SeqCst), 1);

    peer_closes.send_replace(true);
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        1,
        "a new connection once the peer let go"
    );
    // That lease was dropped without keep: closed too, and this time the peer lets go at once.
    tokio::task::yield_now().await;
    assert_eq!(connector.live.load(Ordering::SeqCst), 0);
    assert_eq!(open_total(&pool), 0);
}

#[tokio::test(start_paused = true)]
async fn a_peer_that_never_closes_frees_the_slot_after_the_close_grace() {
    let (pool, _connector, _peer_closes) = pool_with_lingering_peer(2);
    let mut lease = pool.lease().await.unwrap();
    lease.discard(CloseReason::Error);
    drop(lease);
    tokio::time::sleep(CLOSE_GRACE - Duration::from_millis(1)).await;
    assert_eq!(pool.stats().endpoints[0].closing, 1);
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(pool.stats().endpoints[0].closing, 0);
    assert_eq!(open_total(&pool), 0);
}

#[tokio::test(start_paused = true)]
async fn shrinking_keeps_the_slots_of_closing_connections() {
    let (pool, connector, peer_closes) = pool_with_lingering_peer(3);
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(pool.lease().await.unwrap());
    }
    for mut lease in leases {
        lease.keep();
    }
    pool.set_limits(limits(1));
    let ep = &pool.stats().endpoints[0];
    assert_eq!(
        (ep.idle, ep.closing),
        (1, 2),
        "two closed, held by the peer"
    );
    pool.set_limits(limits(3));
    assert_eq!(
        open_total(&pool),
        3,
        "growing back does not count them free"
    );
    let a = pool.lease().await.unwrap();
    let b = tokio::time::timeout(Duration::from_millis(100), pool.lease()).await;
    assert!(b.is_err(), "the second lease waits for a closing slot");
    drop(a);
    peer_closes.send_replace(true);
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().endpoints[0].closing, 0);
    assert_eq!(connector.created.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn close_all_returns_once_the_peers_have_let_go() {
    let (pool, connector, peer_closes) = pool_with_lingering_peer(2);
    lease_and_keep(&pool).await;
    let closing = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.close_all().await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !closing.is_finished(),
        "the peer still holds the connection"
    );
    peer_closes.send_replace(true);
    assert!(closing.await.unwrap(), "closed on both sides");
    assert_eq!(connector.live.load(Ordering::SeqCst), 0);

    // A peer that never lets go: close_all gives up after the grace.
    let (pool, _connector, _peer_closes) = pool_with_lingering_peer(2);
    lease_and_keep(&pool).await;
    let start = Instant::now();
    assert!(!pool.close_all().await);
    assert_eq!(start.elapsed(), CLOSE_GRACE);
}

#[tokio::test(start_paused = true)]
async fn close_all_returns_when_the_last_lease_comes_back() {
    let (pool, connector) = pool(2, 1);
    let lease = pool.lease().await.unwrap();
    let start = Instant::now();
    let closing = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.close_all().await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!closing.is_finished(), "a lease is still out");
    drop(lease);
    assert!(closing.await.unwrap());
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(connector.live.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_health_probe_takes_a_slot_of_the_cap_and_gives_it_to_a_waiter() {
    let (pool, connector) = pool(2, 1);
    let first = pool.lease().await.unwrap();
    let probe = pool.probe_slot("ep-0").expect("a slot is free");
    assert!(
        pool.probe_slot("ep-0").is_none(),
        "the probe's connection counts: the endpoint is at its cap of 2"
    );
    assert!(pool.probe_slot("ep-9").is_none(), "no such endpoint");
    // A call now waits for a slot instead of opening a third connection.
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { pool.lease().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "the cap holds with the probe in it");
    assert_eq!(connector.created.load(Ordering::SeqCst), 1);
    drop(probe);
    let second = waiting
        .await
        .unwrap()
        .expect("the probe's slot goes to the waiter");
    assert_eq!(connector.created.load(Ordering::SeqCst), 2);
    assert!(
        pool.probe_slot("ep-0").is_none(),
        "both slots leased: the probe skips this round"
    );
    let (mut first, mut second) = (first, second);
    first.keep();
    second.keep();
    drop((first, second));
    assert_eq!(
        pool.stats().endpoints[0].idle,
        2,
        "the cap is full of idle connections"
    );
    assert!(
        pool.probe_slot("ep-0").is_none(),
        "this round makes room: the coldest idle connection closes"
    );
    assert_eq!(pool.stats().endpoints[0].idle, 1);
    let _probe = pool
        .probe_slot("ep-0")
        .expect("the next round finds the slot free");
    assert_eq!(connector.live.load(Ordering::SeqCst), 1);
}

// === priority classes ===

fn priority(aging_ms: u64, batch_max_percent: Option<u32>) -> Option<Priority> {
    Some(Priority {
        aging_after: Some(ApiDuration::from_millis(aging_ms)),
        batch_max_percent,
        ..Priority::default()
    })
}

/// A pool of `n` endpoints of `max` connections each that queues up to 16 calls for up to 10 s,
/// ordered by `priority`.
fn prioritized_pool(max: u32, n: usize, priority: Option<Priority>) -> Pool<Arc<FakeConnector>> {
    let (pool, _) = pool(max, n);
    pool.set_limits(PoolLimits {
        max_pending: 16,
        lease_timeout: ApiDuration::from_secs(10),
        ..limits(max)
    });
    pool.set_priority(priority);
    pool
}

/// Queues one waiter of `class` that reports `(tag, class)` once it holds a connection, keeps
/// it for `hold`, then returns it.
fn queue_waiter(
    pool: &Pool<Arc<FakeConnector>>,
    class: PriorityClass,
    tag: usize,
    hold: Duration,
    tx: &tokio::sync::mpsc::UnboundedSender<(usize, PriorityClass)>,
) {
    let (pool, tx) = (pool.clone(), tx.clone());
    tokio::spawn(async move {
        let mut lease = pool
            .lease_as(class)
            .await
            .expect("a waiter gets a connection in time");
        tx.send((tag, class)).unwrap();
        tokio::time::sleep(hold).await;
        lease.keep();
    });
}

#[tokio::test(start_paused = true)]
async fn interactive_waiters_are_served_before_batch_waiters_that_came_first() {
    let pool = prioritized_pool(1, 1, priority(1000, None));
    let held = pool.lease().await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let hold = Duration::from_millis(10);
    for (tag, class) in [
        (0, PriorityClass::Batch),
        (1, PriorityClass::Batch),
        (2, PriorityClass::Interactive),
        (3, PriorityClass::Interactive),
    ] {
        queue_waiter(&pool, class, tag, hold, &tx);
        tokio::task::yield_now().await;
    }
    let stats = pool.stats();
    assert_eq!(
        (stats.classes[0].pending, stats.classes[1].pending),
        (2, 2),
        "two waiters of each class"
    );
    drop(held);
    let mut order = Vec::new();
    for _ in 0..4 {
        order.push(rx.recv().await.unwrap().0);
    }
    assert_eq!(
        order,
        [2, 3, 0, 1],
        "interactive first, then batch, each in arrival order"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_waiter_past_its_aging_bound_goes_before_later_interactive_ones() {
    let pool = prioritized_pool(1, 1, priority(100, None));
    let held = pool.lease().await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let hold = Duration::from_millis(10);
    queue_waiter(&pool, PriorityClass::Batch, 0, hold, &tx);
    tokio::task::yield_now().await;
    // One interactive waiter before the batch waiter's aging deadline (100ms), one after.
    tokio::time::sleep(Duration::from_millis(50)).await;
    queue_waiter(&pool, PriorityClass::Interactive, 1, hold, &tx);
    tokio::time::sleep(Duration::from_millis(100)).await;
    queue_waiter(&pool, PriorityClass::Interactive, 2, hold, &tx);
    tokio::task::yield_now().await;
    drop(held);
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(rx.recv().await.unwrap().0);
    }
    assert_eq!(
        order,
        [1, 0, 2],
        "the aged batch waiter ranks as an interactive one arriving at its deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn batch_waits_at_its_share_cap_while_interactive_takes_every_connection() {
    // 2 endpoints × 4 = 8 connections; batch may hold 50%: 4.
    let pool = prioritized_pool(4, 2, priority(50, Some(50)));
    assert_eq!(pool.stats().batch_cap, Some(4));
    let mut batch = Vec::new();
    for _ in 0..4 {
        batch.push(pool.lease_as(PriorityClass::Batch).await.unwrap());
    }
    // A fifth batch call waits although 4 connections are free, and is never handed one
    // while batch holds its cap, however long it waited (aging reorders, the cap holds).
    let waiting = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease_as(PriorityClass::Batch).await })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().classes[1].pending, 1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        pool.stats().classes[1].pending,
        1,
        "still waiting, past its aging bound"
    );
    // Interactive calls take the other 4 at once, past the waiting batch call.
    let mut interactive = Vec::new();
    for _ in 0..4 {
        let lease = tokio::time::timeout(Duration::ZERO, pool.lease_as(PriorityClass::Interactive))
            .await
            .expect("an interactive call does not wait for a free connection")
            .unwrap();
        interactive.push(lease);
    }
    let stats = pool.stats();
    assert_eq!((stats.classes[0].held, stats.classes[1].held), (4, 4));
    // A batch connection coming back goes to the waiting batch call.
    let mut returned = batch.pop().unwrap();
    returned.keep();
    drop(returned);
    let lease = waiting
        .await
        .unwrap()
        .expect("served once batch is under its cap");
    assert_eq!(lease.class(), PriorityClass::Batch);
    assert_eq!(pool.stats().classes[1].held, 4);
}

#[tokio::test(start_paused = true)]
async fn lease_waits_are_counted_per_class() {
    let metrics = Metrics::new();
    let pool = Pool::new(
        "model-a",
        PoolLimits {
            lease_timeout: ApiDuration::from_secs(10),
            ..limits(1)
        },
        &endpoints(1),
        Arc::new(FakeConnector::default()),
        metrics.clone(),
    );
    pool.set_priority(priority(1000, None));
    let held = pool.lease_as(PriorityClass::Batch).await.unwrap();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease_as(PriorityClass::Batch).await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(40)).await;
    drop(held);
    waiter.await.unwrap().unwrap();
    let text = metrics.encode();
    let count = |class: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("poolpilot_pool_class_lease_wait_seconds_count")
                    && l.contains(&format!("class=\"{class}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    assert_eq!(count("batch").as_deref(), Some("2"), "{text}");
    assert_eq!(count("interactive").as_deref(), Some("0"));
    let sum = text
        .lines()
        .find(|l| {
            l.starts_with("poolpilot_pool_class_lease_wait_seconds_sum")
                && l.contains("class=\"batch\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap();
    assert!(
        (sum - 0.04).abs() < 1e-9,
        "the batch waiter waited 40ms: {sum}"
    );
}

/// One call in a simulated arrival pattern.
#[derive(Clone, Debug)]
struct Arrival {
    at_ms: u64,
    class: PriorityClass,
    hold_ms: u64,
}

fn arrival() -> impl proptest::strategy::Strategy<Value = Arrival> {
    use proptest::prelude::*;
    (0u64..400, any::<bool>(), 1u64..=40).prop_map(|(at_ms, batch, hold_ms)| Arrival {
        at_ms,
        class: if batch {
            PriorityClass::Batch
        } else {
            PriorityClass::Interactive
        },
        hold_ms,
    })
}

/// Runs `arrivals` against a pool of `cap` connections (one endpoint, no lease timeout in
/// reach) in paused time; returns each call's `(arrival, grant)` instants.
fn simulate(
    arrivals: &[Arrival],
    cap: u32,
    aging_ms: u64,
    batch_max_percent: Option<u32>,
) -> (Vec<(Instant, Instant)>, u32) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let (pool, _) = pool(cap, 1);
        pool.set_limits(PoolLimits {
            max_pending: 10_000,
            lease_timeout: ApiDuration::from_secs(3600),
            ..limits(cap)
        });
        pool.set_priority(priority(aging_ms, batch_max_percent));
        let t0 = Instant::now();
        let batch_held = Arc::new(AtomicUsize::new(0));
        let batch_peak = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for a in arrivals.iter().cloned() {
            let pool = pool.clone();
            let (held, peak) = (batch_held.clone(), batch_peak.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(t0 + Duration::from_millis(a.at_ms)).await;
                let arrived = Instant::now();
                let mut lease = pool.lease_as(a.class).await.expect("no lease timeout");
                let granted = Instant::now();
                if a.class == PriorityClass::Batch {
                    let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(a.hold_ms)).await;
                if a.class == PriorityClass::Batch {
                    held.fetch_sub(1, Ordering::SeqCst);
                }
                lease.keep();
                drop(lease);
                (arrived, granted)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        (out, batch_peak.load(Ordering::SeqCst) as u32)
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// The starvation bound, stated precisely: let batch waiter B arrive at `a`, with aging
    /// deadline `d = a + agingAfter`. (1) After `d`, only waiters ranked before B are served
    /// before it: interactive waiters that arrived at or before `d`, and batch waiters that
    /// arrived before B. (2) Hence, with `k` of those still waiting at `d`, `c` connections and
    /// every call holding its connection at most `H`, B is served by
    /// `d + ceil((k + 1) / c) × H`: its wait is at most `agingAfter + ceil((k + 1) / c) × H`.
    #[test]
    fn no_batch_waiter_waits_beyond_the_aging_bound_and_those_ranked_before_it(
        arrivals in proptest::collection::vec(arrival(), 1..40),
        cap in 1u32..4,
        aging_ms in 1u64..120,
    ) {
        let times = simulate(&arrivals, cap, aging_ms, None).0;
        let aging = Duration::from_millis(aging_ms);
        let max_hold = Duration::from_millis(arrivals.iter().map(|a| a.hold_ms).max().unwrap());
        let ranked_before = |w: usize, b: usize, deadline: Instant| match arrivals[w].class {
            PriorityClass::Interactive => times[w].0 <= deadline,
            PriorityClass::Batch => times[w].0 < times[b].0 || (times[w].0 == times[b].0 && w < b),
        };
        for b in (0..arrivals.len()).filter(|&b| arrivals[b].class == PriorityClass::Batch) {
            let (arrived, granted) = times[b];
            let deadline = arrived + aging;
            if granted <= deadline {
                continue;
            }
            for w in (0..arrivals.len()).filter(|&w| w != b) {
                let overtook = times[w].1 > deadline && times[w].1 < granted;
                proptest::prop_assert!(
                    !overtook || ranked_before(w, b, deadline),
                    "waiter {w} ({:?}, arrived {:?}) was served at {:?}, after batch waiter {b}'s deadline {:?} and before it ({:?}) without being ranked before it",
                    arrivals[w].class, times[w].0, times[w].1, deadline, granted
                );
            }
            let ahead = (0..arrivals.len())
                .filter(|&w| w != b && ranked_before(w, b, deadline) && times[w].1 > deadline)
                .count() as u32;
            let bound = aging + max_hold * (ahead + 1).div_ceil(cap);
            proptest::prop_assert!(
                granted - arrived <= bound,
                "batch waiter {b} waited {:?}, beyond {bound:?} ({ahead} ranked before it at its deadline)",
                granted - arrived
            );
        }
    }

    /// With a share cap, batch never holds more than it, whatever the arrivals; every call is
    /// still served (batch makes progress under the cap).
    #[test]
    fn batch_never_holds_more_than_its_share_cap(
        arrivals in proptest::collection::vec(arrival(), 1..40),
        cap in 1u32..6,
        percent in 1u32..=100,
    ) {
        let (times, peak) = simulate(&arrivals, cap, 20, Some(percent));
        let batch_cap = (cap * percent / 100).max(1);
        proptest::prop_assert!(peak <= batch_cap, "batch held {peak}, cap {batch_cap}");
        proptest::prop_assert_eq!(times.len(), arrivals.len());
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_takes_an_interactive_call_in_place_of_its_newest_batch_waiter() {
    let (pool, _) = pool(1, 1);
    pool.set_priority(priority(100, None));
    let held = pool.lease().await.unwrap();
    // maxPending 4: fill it with batch waiters.
    let mut batch = Vec::new();
    for _ in 0..4 {
        let pool = pool.clone();
        batch.push(tokio::spawn(async move {
            pool.lease_as(PriorityClass::Batch).await.map(drop)
        }));
        tokio::task::yield_now().await;
    }
    assert_eq!(pool.stats().classes[1].pending, 4);
    assert!(matches!(
        pool.lease_as(PriorityClass::Batch).await,
        Err(PoolError::QueueFull { pending: 4, .. })
    ));
    let interactive = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(drop) })
    };
    tokio::task::yield_now().await;
    let stats = pool.stats();
    assert_eq!((stats.classes[0].pending, stats.classes[1].pending), (1, 3));
    let newest = batch.pop().unwrap().await.unwrap();
    assert!(
        matches!(newest, Err(PoolError::QueueFull { .. })),
        "the newest batch waiter is refused as on a full queue: {newest:?}"
    );
    drop(held);
    interactive
        .await
        .unwrap()
        .expect("the interactive call is served first");
}

// === burst allowance ===

/// A pool of `n` endpoints with a share of `share` and a burst of `burst` per endpoint.
fn bursting_pool(
    share: u32,
    burst: u32,
    n: usize,
) -> (Pool<Arc<FakeConnector>>, Arc<FakeConnector>, Metrics) {
    let connector = Arc::new(FakeConnector::default());
    let metrics = Metrics::new();
    let pool = Pool::new(
        "model-a",
        PoolLimits {
            burst_per_endpoint: burst,
            ..limits(share)
        },
        &endpoints(n),
        connector.clone(),
        metrics.clone(),
    );
    (pool, connector, metrics)
}

/// A lease that must be granted at once (no wait at all).
async fn lease_now(
    pool: &Pool<Arc<FakeConnector>>,
    class: PriorityClass,
) -> Lease<Arc<FakeConnector>> {
    let lease = tokio::time::timeout(Duration::ZERO, pool.lease_as(class))
        .await
        .expect("granted at once, without waiting")
        .expect("granted");
    assert_eq!(lease.wait(), Duration::ZERO);
    lease
}

#[tokio::test(start_paused = true)]
async fn a_lease_at_the_share_gets_a_burst_connection_at_once() {
    let (pool, connector, metrics) = bursting_pool(2, 2, 1);
    let within: Vec<_> = [
        lease_now(&pool, PriorityClass::Interactive).await,
        lease_now(&pool, PriorityClass::Interactive).await,
    ]
    .into();
    assert!(within.iter().all(|l| !l.burst()), "within the share");
    assert_eq!(pool.stats().burst.bursting, 0);
    let burst = lease_now(&pool, PriorityClass::Interactive).await;
    assert!(burst.burst(), "beyond the share: a burst connection");
    let stats = pool.stats();
    assert_eq!(stats.burst.allowance, 2);
    assert_eq!(stats.burst.bursting, 1);
    assert_eq!(stats.pending, 0, "it never queued");
    assert_eq!(stats.endpoints[0].max, 2, "the share is unchanged");
    assert_eq!(connector.created.load(Ordering::SeqCst), 3);
    let text = metrics.encode();
    assert!(
        text.contains("poolpilot_pool_bursts_total{backend=\"model-a\"} 1"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_queued_behind_others_gets_a_burst_slot_in_its_turn() {
    // The queue is not empty (a batch waiter at its share cap): a new interactive call joins
    // the queue and is served from the burst at once, in its turn.
    let (pool, _, _) = bursting_pool(2, 1, 1);
    pool.set_priority(priority(1000, Some(50)));
    let _batch = lease_now(&pool, PriorityClass::Batch).await;
    let batch_waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease_as(PriorityClass::Batch).await.map(drop) })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().classes[1].pending, 1, "batch waits at its cap");
    let _within = lease_now(&pool, PriorityClass::Interactive).await;
    let burst = lease_now(&pool, PriorityClass::Interactive).await;
    assert!(burst.burst());
    assert_eq!(pool.stats().classes[1].pending, 1, "batch still waits");
    batch_waiter.abort();
}

#[tokio::test(start_paused = true)]
async fn never_more_than_share_plus_burst_per_endpoint() {
    let (pool, connector, _) = bursting_pool(2, 2, 2);
    let mut leases = Vec::new();
    for _ in 0..8 {
        leases.push(lease_now(&pool, PriorityClass::Interactive).await);
    }
    assert_eq!(leases.iter().filter(|l| l.burst()).count(), 4);
    for ep in &pool.stats().endpoints {
        assert_eq!(ep.leased, 4, "share + burst on each endpoint: {ep:?}");
    }
    assert_eq!(pool.stats().burst.bursting, 4);
    // A ninth waits, then times out: nothing beyond share + burst.
    let err = pool
        .lease()
        .await
        .expect_err("no room beyond share + burst");
    assert!(matches!(err, PoolError::LeaseTimeout { .. }), "{err:?}");
    assert_eq!(open_total(&pool), 8);
    assert_eq!(connector.created.load(Ordering::SeqCst), 8);
}

#[tokio::test(start_paused = true)]
async fn a_burst_connection_is_closed_on_return_with_no_waiter_and_kept_for_one() {
    let (pool, connector, _) = bursting_pool(2, 2, 1);
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(lease_now(&pool, PriorityClass::Interactive).await);
    }
    // A fifth call waits: share + burst are in use.
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut lease = pool.lease().await.expect("served by a returned connection");
            (lease.reused(), lease.burst(), lease.conn().id)
        })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().pending, 1);
    // A connection returned beyond the share with a waiter goes to the waiter.
    let mut first = leases.pop().unwrap();
    first.keep();
    let first_id = first.conn().id;
    drop(first);
    let (reused, burst, id) = waiter.await.unwrap();
    assert!(reused, "the returned connection is handed over, not closed");
    assert!(burst, "it is still beyond the share");
    assert_eq!(id, first_id);
    assert_eq!(connector.created.load(Ordering::SeqCst), 4);
    // With no waiter, connections returned beyond the share close; the share stays idle.
    for mut lease in leases {
        lease.keep();
    }
    let stats = pool.stats();
    assert_eq!(
        (stats.endpoints[0].leased, stats.endpoints[0].idle),
        (0, 2),
        "the share is kept idle, nothing beyond it"
    );
    assert_eq!(stats.burst.bursting, 0, "the burst is given back");
    assert_eq!(connector.live.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn without_a_burst_a_lease_at_the_share_waits_as_before() {
    let (pool, connector, metrics) = bursting_pool(2, 0, 1);
    let _a = pool.lease().await.unwrap();
    let _b = pool.lease().await.unwrap();
    let err = pool.lease().await.expect_err("the share holds");
    assert!(matches!(err, PoolError::LeaseTimeout { .. }), "{err:?}");
    assert_eq!(connector.created.load(Ordering::SeqCst), 2);
    let stats = pool.stats();
    assert_eq!((stats.burst.allowance, stats.burst.bursting), (0, 0));
    assert!(
        metrics
            .encode()
            .contains("poolpilot_pool_bursts_total{backend=\"model-a\"} 0")
    );
}

#[tokio::test(start_paused = true)]
async fn batch_calls_do_not_burst() {
    let (pool, _, _) = bursting_pool(2, 2, 1);
    pool.set_limits(PoolLimits {
        burst_per_endpoint: 2,
        lease_timeout: ApiDuration::from_secs(10),
        ..limits(2)
    });
    pool.set_priority(priority(100, None));
    let _batch = lease_now(&pool, PriorityClass::Batch).await;
    let interactive = lease_now(&pool, PriorityClass::Interactive).await;
    // At the share: a batch call waits, beside the burst room.
    let batch = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease_as(PriorityClass::Batch).await.map(|l| l.burst()) })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().classes[1].pending, 1);
    let mut burst = lease_now(&pool, PriorityClass::Interactive).await;
    assert!(burst.burst());
    // A burst connection coming back is not handed to the batch waiter: it closes, and the
    // batch call waits for the share to have room.
    burst.keep();
    drop(burst);
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().classes[1].pending, 1, "batch still waits");
    assert_eq!(pool.stats().burst.bursting, 0);
    drop(interactive);
    assert_eq!(
        batch.await.unwrap().map_err(|e| e.to_string()),
        Ok(false),
        "served within the share once it has room"
    );
}

#[tokio::test(start_paused = true)]
async fn lowering_the_burst_closes_burst_connections_as_they_come_back() {
    let (pool, connector, _) = bursting_pool(2, 2, 1);
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(lease_now(&pool, PriorityClass::Interactive).await);
    }
    pool.set_limits(limits(2));
    assert_eq!(pool.stats().burst.allowance, 0);
    assert_eq!(
        pool.stats().endpoints[0].leased,
        4,
        "in-flight burst connections are untouched"
    );
    // A waiter now: a returned burst connection is beyond share + the new burst (0), so it
    // closes rather than going to the waiter; the waiter is served once the share has room.
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|l| l.burst()) })
    };
    tokio::task::yield_now().await;
    for _ in 0..2 {
        let mut lease = leases.pop().unwrap();
        assert!(lease.conn().is_open(), "never cut in flight");
        lease.keep();
        drop(lease);
    }
    assert_eq!(pool.stats().pending, 1, "still waiting: the share is full");
    assert_eq!(connector.live.load(Ordering::SeqCst), 2);
    let mut lease = leases.pop().unwrap();
    lease.keep();
    drop(lease);
    assert_eq!(waiter.await.unwrap().map_err(|e| e.to_string()), Ok(false));
    // The waiter's call dropped its lease without keeping it: one connection is left.
    assert_eq!(connector.live.load(Ordering::SeqCst), 1);
    assert_eq!(pool.stats().burst.bursting, 0);
}

#[tokio::test(start_paused = true)]
async fn a_burst_connection_handed_to_a_waiter_that_went_away_is_closed_not_parked() {
    let (pool, connector, _) = bursting_pool(1, 1, 1);
    let _within = lease_now(&pool, PriorityClass::Interactive).await;
    let mut burst = lease_now(&pool, PriorityClass::Interactive).await;
    assert!(burst.burst());
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.lease().await.map(|_| ()) })
    };
    tokio::task::yield_now().await;
    assert_eq!(pool.stats().pending, 1);
    // Returned and handed to the waiter, whose client goes away before it runs again: the
    // grant comes back beyond the share, and closes.
    burst.keep();
    drop(burst);
    waiter.abort();
    let _ = waiter.await;
    let ep = &pool.stats().endpoints[0];
    assert_eq!(
        (ep.leased, ep.idle),
        (1, 0),
        "nothing beyond the share idles"
    );
    assert_eq!(pool.stats().burst.bursting, 0);
    assert_eq!(connector.live.load(Ordering::SeqCst), 1);
}
