//! A connection on loan ([`Lease`]): what its call may ask of it, and what happens to the
//! connection when the lease is dropped (back to the idle stack when kept, closed with a reason
//! otherwise: [`super::dispatch`]'s `release`).

use std::sync::Arc;
use std::time::Duration;

use poolpilot_api::limits::PriorityClass;
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

use super::connect::Connect;
use super::state::Inner;
use crate::limits::fair::Charge;
use crate::observe::CloseReason;

/// A connection on loan. Dropping it returns the connection to the pool when [`Lease::keep`]
/// was called and closes it otherwise.
#[derive(Debug)]
pub struct Lease<C: Connect> {
    pub(super) pool: Arc<Inner<C>>,
    pub(super) endpoint: u64,
    pub(super) endpoint_name: Arc<str>,
    /// Its endpoint's output tokens (`poolpilot_endpoint_output_tokens_total`).
    pub(super) output_tokens: Counter,
    pub(super) conn: Option<C::Conn>,
    pub(super) created_at: Instant,
    pub(super) leased_at: Instant,
    pub(super) reused: bool,
    /// How long its connection had been idle in the pool (zero for one opened for it).
    pub(super) idle_for: Duration,
    pub(super) burst: bool,
    pub(super) wait: Duration,
    /// What its grant charged its client in the fair queue ([`crate::limits::fair`]).
    pub(super) charge: Charge,
    /// The tokens its call used, once known ([`Lease::settle_tokens`]).
    pub(super) used: Option<u64>,
    pub(super) outcome: Outcome,
}

/// What happens to a lease's connection when it is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Keep,
    Close(CloseReason),
}

// === impl Lease ===

impl<C: Connect> Lease<C> {
    /// The connection.
    pub fn conn(&mut self) -> &mut C::Conn {
        self.conn
            .as_mut()
            .expect("a lease holds its connection until dropped")
    }

    /// The connection, to look at.
    pub fn conn_ref(&self) -> &C::Conn {
        self.conn
            .as_ref()
            .expect("a lease holds its connection until dropped")
    }

    /// Whether the connection was reused from the pool (not opened for this lease).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// How long its connection had been idle in the pool before this lease (zero when opened
    /// for it): when the backend turns out to have closed it, at most its keep-alive timeout.
    pub fn idle_for(&self) -> Duration {
        self.idle_for
    }

    /// Whether it was granted beyond the endpoint's share, on the pool's burst allowance
    /// (`pool.burstPerEndpoint`): a burst connection.
    pub fn burst(&self) -> bool {
        self.burst
    }

    /// How long the lease waited for a connection or a free slot.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The priority class it was leased for.
    pub fn class(&self) -> PriorityClass {
        self.charge.class
    }

    /// The tokens its call used (at least 1), correcting what its grant charged its client
    /// in the pool's fair queue when the lease is dropped. Not called: the charge stands.
    pub fn settle_tokens(&mut self, used: u64) {
        self.used = Some(used.max(1));
    }

    /// The endpoint's name.
    pub fn endpoint(&self) -> &Arc<str> {
        &self.endpoint_name
    }

    /// Its call produced `n` output tokens (as counted at its end): its endpoint's count.
    pub fn count_output_tokens(&self, n: u64) {
        if n > 0 {
            self.output_tokens.inc_by(n);
        }
    }

    /// Returns the connection to the pool when the lease is dropped (the exchange completed
    /// and the connection can carry another request).
    pub fn keep(&mut self) {
        self.outcome = Outcome::Keep;
    }

    /// Closes the connection when the lease is dropped, counting `reason`. A reused connection
    /// the backend closed (`PeerClosed`) also counts how long it had been idle before this
    /// lease, as the pool does for one it finds closed itself.
    pub fn discard(&mut self, reason: CloseReason) {
        if reason == CloseReason::PeerClosed && self.reused {
            let mut state = self.pool.state.lock();
            let configured = state.limits.idle_timeout.get();
            if let Some(ep) = state.endpoint_mut(self.endpoint) {
                self.pool
                    .peer_closed_after(ep, configured, self.idle_for, Instant::now());
            }
        }
        self.outcome = Outcome::Close(reason);
    }
}

impl<C: Connect> Drop for Lease<C> {
    fn drop(&mut self) {
        self.pool.release(
            self.endpoint,
            self.conn.take(),
            self.outcome,
            (self.created_at, self.leased_at),
            (self.charge, self.used),
        );
    }
}
