//! The client connections the proxy listener holds: counted in total and per source (an IPv4
//! address or an IPv6 /64), admitted under `maxConnectionsPerClient`, uncounted when they close
//! ([`ConnGuard`]), and the token bucket of the `429` answers to refused connections
//! ([`REFUSAL_ANSWERS_PER_SEC`] after a burst of [`REFUSAL_ANSWER_BURST`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::live::Gateway;

/// Answers to connections over their source's cap, at most this many a second sustained: each
/// costs a connection for up to [`super::accept::REFUSAL_GRACE`], so a source opening
/// connections in a loop cannot make refusing them expensive. Beyond it they are closed
/// unanswered (HAProxy and nginx close them all unanswered; clients such as the OpenAI SDKs then
/// report a connection error instead of backing off).
pub const REFUSAL_ANSWERS_PER_SEC: f64 = 100.0;

/// Answers that may go out at once, above the sustained rate: an SDK sending a burst of a few
/// hundred calls opens as many connections in the same instant (the OpenAI SDKs allow up to
/// 1000), and each must get its 429 to back off instead of failing; a loop still gets at most
/// [`REFUSAL_ANSWERS_PER_SEC`] once the burst is spent.
pub const REFUSAL_ANSWER_BURST: f64 = 1000.0;

/// Open client connections, in total and per source (an IPv4 address or an IPv6 /64).
#[derive(Debug, Default)]
pub struct Connections {
    total: AtomicUsize,
    by_ip: Mutex<HashMap<IpAddr, u32>>,
    pub(super) closed: Notify,
    refusals: Mutex<Option<AnswerBudget>>,
}

/// A token bucket of refusal answers.
#[derive(Debug)]
struct AnswerBudget {
    tokens: f64,
    at: Instant,
}

impl Connections {
    /// Whether a refused connection may get an answer now.
    pub(super) fn may_answer(&self) -> bool {
        let now = Instant::now();
        let mut refusals = self.refusals.lock();
        let budget = refusals.get_or_insert(AnswerBudget {
            tokens: REFUSAL_ANSWER_BURST,
            at: now,
        });
        let refill = now.duration_since(budget.at).as_secs_f64() * REFUSAL_ANSWERS_PER_SEC;
        budget.tokens = (budget.tokens + refill).min(REFUSAL_ANSWER_BURST);
        budget.at = now;
        if budget.tokens >= 1.0 {
            budget.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// One counted client connection; uncounts itself when dropped.
#[derive(Debug)]
pub(super) struct ConnGuard {
    pub(super) conns: Arc<Connections>,
    ip: IpAddr,
    gw: Gateway,
    opened: Instant,
}

impl Connections {
    /// Open client connections now.
    pub fn open(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    /// Waits until every connection closed.
    pub async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self.open() == 0 {
                return;
            }
            closed.await;
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        {
            let mut by_ip = self.conns.by_ip.lock();
            if let Some(n) = by_ip.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    by_ip.remove(&self.ip);
                }
            }
        }
        self.conns.total.fetch_sub(1, Ordering::AcqRel);
        self.gw.metrics().downstream_connections().dec();
        self.gw
            .metrics()
            .incidents()
            .downstream_closed(self.opened.elapsed());
        self.conns.closed.notify_waiters();
    }
}

/// Counts a connection from `source` (by its [`super::source::group`]), unless it would take
/// the source over `maxConnectionsPerClient` (when `capped`).
pub(super) fn admit(
    gw: &Gateway,
    conns: &Arc<Connections>,
    source: IpAddr,
    capped: bool,
) -> Option<ConnGuard> {
    let ip = super::source::group(source);
    let per_client = gw
        .snapshot()
        .limits
        .listener
        .max_connections_per_client
        .filter(|_| capped);
    {
        let mut by_ip = conns.by_ip.lock();
        let n = by_ip.entry(ip).or_default();
        if per_client.is_some_and(|max| *n >= max) {
            if *n == 0 {
                by_ip.remove(&ip);
            }
            return None;
        }
        *n += 1;
    }
    conns.total.fetch_add(1, Ordering::AcqRel);
    gw.metrics().downstream_connections().inc();
    Some(ConnGuard {
        conns: conns.clone(),
        ip,
        gw: gw.clone(),
        opened: Instant::now(),
    })
}
