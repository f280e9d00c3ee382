//! The lock-held core of the pool: every change of its state, made under the backend's lock and
//! never across an `.await`. A lease begins ([`Inner::begin`]: an idle connection, a reserved
//! slot, a place in the queue, or a refusal) and completes ([`Inner::complete`]: connecting on
//! a reserved slot, outside the lock); returned connections come back ([`Inner::release`]);
//! freed capacity goes to waiters in the queue's order ([`Inner::dispatch`]); idle connections
//! expire ([`Inner::reap`]); closed ones keep their slot until the peer lets go
//! ([`Inner::closed`]). A lease abandoned while it waits or connects gives back what it held
//! ([`Unsettled`]).

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::MutexGuard;
use poolpilot_api::limits::PriorityClass;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::connect::{CLOSE_GRACE, Connect, Poolable};
use super::error::PoolError;
use super::lease::{Lease, Outcome};
use super::select;
use super::state::{EndpointState, Grant, IdleConn, Inner, State};
use crate::limits::fair::{Charge, Ticket};
use crate::limits::queue::Entry;
use crate::observe::CloseReason;

/// What `lease()` does next, decided under the lock.
pub(super) enum Step<T> {
    Ready(Grant<T>),
    Wait(oneshot::Receiver<Grant<T>>, u64),
}

/// What a lease in progress holds while `lease()` waits or connects: given back if the lease is
/// dropped meanwhile (its client went away) before it was settled, because a grant lost with
/// its channel, or a reservation lost with its connect, would keep a slot (or a connection)
/// taken for good.
pub(super) struct Unsettled<C: Connect, H: Holding<C::Conn>> {
    pub(super) pool: Arc<Inner<C>>,
    /// The class and ticket of the lease: what a grant given back is refunded.
    pub(super) charge: Charge,
    pub(super) held: H,
    /// The wait or the connect ended and `lease()` (or `complete()`) took over.
    pub(super) settled: bool,
}

/// What an [`Unsettled`] lease may hold.
pub(super) trait Holding<T> {
    /// Once the lease was dropped unsettled (under the pool's lock): the grant to give back,
    /// if it holds one.
    fn grant_to_undo(&mut self, state: &mut State<T>) -> Option<Grant<T>>;
}

/// A place in the waiter queue: the place leaves the queue, or a grant already sent to it is
/// given back.
pub(super) struct QueuePlace<T> {
    pub(super) rx: oneshot::Receiver<Grant<T>>,
    pub(super) id: u64,
}

impl<T> Holding<T> for QueuePlace<T> {
    fn grant_to_undo(&mut self, state: &mut State<T>) -> Option<Grant<T>> {
        if state.waiters.remove(self.id).is_some() {
            return None;
        }
        self.rx.try_recv().ok()
    }
}

/// A slot of `endpoint` reserved for a connect.
pub(super) struct ReservedSlot {
    pub(super) endpoint: u64,
}

impl<T> Holding<T> for ReservedSlot {
    fn grant_to_undo(&mut self, _: &mut State<T>) -> Option<Grant<T>> {
        Some(Grant::Slot {
            endpoint: self.endpoint,
            burst: false,
        })
    }
}

impl<C: Connect, H: Holding<C::Conn>> Drop for Unsettled<C, H> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let now = Instant::now();
        let mut state = self.pool.state.lock();
        if let Some(grant) = self.held.grant_to_undo(&mut state) {
            self.pool.undo(&mut state, grant, self.charge);
            self.pool.freed(state, now);
        }
    }
}

/// Reaps the pool every quarter of its idle timeout (10 ms to 1 s) until the pool is retired or
/// dropped.
pub(super) async fn reap_loop<C: Connect>(pool: Weak<Inner<C>>) {
    loop {
        let period = {
            let Some(inner) = pool.upgrade() else { return };
            let state = inner.state.lock();
            if state.retired {
                return;
            }
            let now = Instant::now();
            let idle_timeout = state
                .endpoints
                .iter()
                .map(|ep| ep.idle_timeout(&state.limits, now))
                .min()
                .unwrap_or(state.limits.idle_timeout.get());
            (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
        };
        tokio::time::sleep(period).await;
        let Some(inner) = pool.upgrade() else { return };
        inner.reap(Instant::now());
    }
}

// === impl Inner ===

impl<C: Connect> Inner<C> {
    /// Decides under the lock: take an idle connection, reserve a slot, queue, or refuse.
    pub(super) fn begin(
        self: &Arc<Self>,
        state: &mut State<C::Conn>,
        now: Instant,
        class: PriorityClass,
        ticket: Ticket,
    ) -> Result<Step<C::Conn>, PoolError> {
        if state.retired {
            return Err(PoolError::Retired {
                backend: self.backend.clone(),
            });
        }
        // Waiters go first: a newcomer must not overtake the queue.
        if state.waiters.is_empty()
            && state.may_serve(class)
            && let Some(grant) = self.find_grant(state, now, class == PriorityClass::Interactive)
        {
            state.held[class.index()] += 1;
            state.waiters.charge_now(class, ticket);
            self.lease_wait.observe(0.0);
            self.class_wait[class.index()].observe(0.0);
            return Ok(Step::Ready(grant));
        }
        if !state.endpoints.iter().any(|ep| state.eligible(ep, now)) {
            return Err(PoolError::NoHealthyEndpoint {
                backend: self.backend.clone(),
                retry_after: state.recovery_hint(now),
            });
        }
        if state.waiters.len() >= state.limits.max_pending as usize {
            // A full queue takes an interactive call in place of its newest batch waiter, which
            // is refused as if it had found the queue full (its sender dropped: see `lease_as`):
            // batch callers cannot fill the queue against interactive ones.
            let bumped = class == PriorityClass::Interactive
                && state.waiters.pop_back(PriorityClass::Batch).is_some();
            if !bumped {
                return Err(PoolError::QueueFull {
                    backend: self.backend.clone(),
                    pending: state.waiters.len(),
                    retry_after: state.retry_after(now),
                });
            }
        }
        let (tx, mut rx) = oneshot::channel();
        let id = state.next_waiter_id;
        state.next_waiter_id += 1;
        state.waiters.push(
            Entry {
                id,
                since: now,
                class,
                item: tx,
            },
            ticket,
        );
        // The waiters ahead may be batch held by its share cap while a connection is free: an
        // interactive newcomer is served at once.
        self.dispatch(state, now);
        match rx.try_recv() {
            Ok(grant) => Ok(Step::Ready(grant)),
            Err(_) => Ok(Step::Wait(rx, id)),
        }
    }

    /// Finds a connection or a free slot on an eligible endpoint, choosing between two random
    /// candidates the one with more spare capacity ([`super::select`]). Marks the result
    /// leased/connecting. Within the share first (an idle connection of an endpoint below it,
    /// or room under it); when every eligible endpoint is at its share and `may_burst` (an
    /// interactive call), beyond it, up to share + `burstPerEndpoint`: a *burst* grant.
    pub(super) fn find_grant(
        self: &Arc<Self>,
        state: &mut State<C::Conn>,
        now: Instant,
        may_burst: bool,
    ) -> Option<Grant<C::Conn>> {
        if let Some(grant) = self.find_grant_under(state, now, false) {
            return Some(grant);
        }
        if may_burst && state.limits.burst_per_endpoint > 0 {
            return self.find_grant_under(state, now, true);
        }
        None
    }

    /// [`Self::find_grant`] under one bound: the share, or (`burst`) share + burst.
    fn find_grant_under(
        self: &Arc<Self>,
        state: &mut State<C::Conn>,
        now: Instant,
        burst: bool,
    ) -> Option<Grant<C::Conn>> {
        let share = state.limits.max_connections_per_endpoint;
        let max = if burst {
            share.saturating_add(state.limits.burst_per_endpoint)
        } else {
            share
        };
        loop {
            // Candidates: eligible endpoints with an idle connection that keeps the calls in
            // flight under the bound, or room for a new one under it. Counted, then the k-th
            // found again: no allocation on the lease path.
            let candidate = |ep: &EndpointState<C::Conn>| {
                state.eligible(ep, now)
                    && ((!ep.idle.is_empty() && ep.busy() < max) || ep.open() < max)
            };
            let nth = |k: usize| {
                state
                    .endpoints
                    .iter()
                    .enumerate()
                    .filter(|(_, ep)| candidate(ep))
                    .nth(k)
                    .map(|(i, _)| i)
            };
            let chosen = match state.endpoints.iter().filter(|ep| candidate(ep)).count() {
                0 => return None,
                1 => nth(0)?,
                n => {
                    let (i, j) = select::gen_pair(&mut rand::rng(), n);
                    let (a, b) = (nth(i)?, nth(j)?);
                    let spare = |k: usize| max.saturating_sub(state.endpoints[k].busy());
                    select::more_spare((a, spare(a)), (b, spare(b)))
                }
            };
            let limits = state.limits.clone();
            let ep = &mut state.endpoints[chosen];
            if ep.busy() < max
                && let Some(mut idle) = ep.idle.pop()
            {
                let idle_timeout = ep.idle_timeout(&limits, now);
                let reason = idle.expired(&limits, idle_timeout, now).or_else(|| {
                    let check =
                        now.duration_since(idle.idle_since) > limits.validate_after_idle.get();
                    (check && !idle.conn.validate()).then_some(CloseReason::ValidateFailed)
                });
                match reason {
                    Some(reason) => {
                        self.closed_idle(ep, reason, idle, limits.idle_timeout.get(), now);
                        continue;
                    }
                    None => {
                        ep.leased += 1;
                        ep.reused.inc();
                        return Some(Grant::Conn {
                            endpoint: ep.id,
                            idle,
                            burst: burst && ep.open() > share,
                        });
                    }
                }
            }
            ep.connecting += 1;
            return Some(Grant::Slot {
                endpoint: ep.id,
                burst: burst && ep.open() > share,
            });
        }
    }

    /// Hands idle connections and free slots to waiters, in the queue's order: interactive
    /// first, aged batch as interactive (see [`crate::limits::queue`]), within a class the
    /// client that received the fewest tokens lately, FIFO for one client
    /// ([`crate::limits::fair`]); a
    /// batch waiter only while batch is under its share cap. Only the waiter the queue serves
    /// next may burst, and only when it is interactive: the burst never reorders the queue
    /// (an aged batch head is not passed by bursting interactive calls). Then closes the idle
    /// connections beyond the share that no waiter took ([`Self::trim_bursts`]).
    pub(super) fn dispatch(self: &Arc<Self>, state: &mut State<C::Conn>, now: Instant) {
        self.serve_waiters(state, now);
        self.trim_bursts(state);
    }

    fn serve_waiters(self: &Arc<Self>, state: &mut State<C::Conn>, now: Instant) {
        let aging = state.priority.aging_in(state.limits.lease_timeout.get());
        loop {
            let batch_allowed = state.may_serve(PriorityClass::Batch);
            let Some(class) = state.waiters.next(aging, batch_allowed) else {
                return;
            };
            if state
                .waiters
                .front(class)
                .is_some_and(|w| w.item.is_closed())
            {
                state.waiters.pop_uncharged(class);
                continue;
            }
            let may_burst = class == PriorityClass::Interactive;
            let Some(grant) = self.find_grant(state, now, may_burst) else {
                return;
            };
            let Some(taken) = state.waiters.pop(class) else {
                return;
            };
            let wait = now.duration_since(taken.entry.since);
            state.held[class.index()] += 1;
            match taken.entry.item.send(grant) {
                Ok(()) => {
                    self.lease_wait.observe(wait.as_secs_f64());
                    self.class_wait[class.index()].observe(wait.as_secs_f64());
                    if taken.reordered {
                        self.fair_reordered.inc();
                    }
                }
                Err(grant) => self.undo(state, grant, taken.charge),
            }
        }
    }

    /// Closes idle connections beyond the share: a burst connection is never parked idle, so
    /// the pod gives its burst back as soon as no waiter takes it.
    fn trim_bursts(self: &Arc<Self>, state: &mut State<C::Conn>) {
        let share = state.limits.max_connections_per_endpoint;
        for ep in &mut state.endpoints {
            while ep.usable() > share && !ep.idle.is_empty() {
                let idle = ep.idle.remove(0);
                self.closed(ep, CloseReason::Burst, idle.conn);
            }
        }
    }

    /// Gives back a grant nobody took (charged `charge`, refunded).
    pub(super) fn undo(&self, state: &mut State<C::Conn>, grant: Grant<C::Conn>, charge: Charge) {
        state.held[charge.class.index()] -= 1;
        state.waiters.settle(charge, Some(0));
        match grant {
            Grant::Conn { endpoint, idle, .. } => {
                if let Some(ep) = state.endpoint_mut(endpoint) {
                    ep.leased -= 1;
                    ep.idle.push(idle);
                }
            }
            Grant::Slot { endpoint, .. } => {
                if let Some(ep) = state.endpoint_mut(endpoint) {
                    ep.connecting -= 1;
                }
            }
        }
    }

    /// Turns a grant into a lease, connecting when it is a slot.
    pub(super) async fn complete(
        self: Arc<Self>,
        grant: Grant<C::Conn>,
        start: Instant,
        charge: Charge,
    ) -> Result<Lease<C>, PoolError> {
        let now = Instant::now();
        let class = charge.class;
        match grant {
            Grant::Conn {
                endpoint,
                idle,
                burst,
            } => {
                let (name, output_tokens) = self.endpoint_handles(endpoint);
                Ok(Lease {
                    pool: self,
                    endpoint,
                    endpoint_name: name,
                    output_tokens,
                    conn: Some(idle.conn),
                    created_at: idle.created_at,
                    leased_at: now,
                    reused: true,
                    idle_for: now.duration_since(idle.idle_since),
                    burst,
                    wait: now.duration_since(start),
                    charge,
                    used: None,
                    outcome: Outcome::Close(CloseReason::Error),
                })
            }
            Grant::Slot { endpoint, burst } => {
                let (name, output_tokens, address, timeout) = {
                    let state = self.state.lock();
                    let ep = state
                        .endpoint(endpoint)
                        .expect("a reserved endpoint stays listed");
                    (
                        ep.name.clone(),
                        ep.output_tokens.clone(),
                        ep.address,
                        state.limits.connect_timeout.get(),
                    )
                };
                let mut reservation = Unsettled {
                    pool: Arc::clone(&self),
                    charge,
                    held: ReservedSlot { endpoint },
                    settled: false,
                };
                let result = tokio::time::timeout(timeout, self.connector.connect(address)).await;
                reservation.settled = true;
                drop(reservation);
                let mut state = self.state.lock();
                let ep = state
                    .endpoint_mut(endpoint)
                    .expect("a reserved endpoint stays listed");
                ep.connecting -= 1;
                let error = match result {
                    Ok(Ok(conn)) => {
                        // A slot on a connection open before: a reuse of that connection.
                        let shared = conn.shares_connection();
                        ep.leased += 1;
                        if shared {
                            ep.reused.inc();
                        } else {
                            ep.created.inc();
                        }
                        if burst {
                            self.bursts.inc();
                        }
                        drop(state);
                        let leased_at = Instant::now();
                        let created_at = match conn.opened_at() {
                            Some(opened) if shared => opened,
                            _ => leased_at,
                        };
                        return Ok(Lease {
                            pool: self,
                            endpoint,
                            endpoint_name: name,
                            output_tokens,
                            conn: Some(conn),
                            created_at,
                            leased_at,
                            reused: shared,
                            idle_for: Duration::ZERO,
                            burst,
                            wait: now.duration_since(start),
                            charge,
                            used: None,
                            outcome: Outcome::Close(CloseReason::Error),
                        });
                    }
                    Ok(Err(source)) => PoolError::Connect {
                        endpoint: name,
                        address,
                        source,
                    },
                    Err(_elapsed) => PoolError::ConnectTimeout {
                        endpoint: name,
                        address,
                        timeout,
                    },
                };
                // The reserved slot is free again, and the call it was for is charged nothing.
                state.held[class.index()] -= 1;
                state.waiters.settle(charge, Some(0));
                self.freed(state, Instant::now());
                Err(error)
            }
        }
    }

    /// Takes a leased connection back (`times`: when it was opened, and leased); `fair` is its
    /// grant's charge and the tokens its call used, if known, to settle in the fair queue.
    pub(super) fn release(
        self: &Arc<Self>,
        endpoint: u64,
        conn: Option<C::Conn>,
        outcome: Outcome,
        times: (Instant, Instant),
        fair: (Charge, Option<u64>),
    ) {
        let (charge, used) = fair;
        let (created_at, leased_at) = times;
        let now = Instant::now();
        let held = now.duration_since(leased_at);
        let mut state = self.state.lock();
        state.held[charge.class.index()] -= 1;
        state.waiters.settle(charge, used);
        state.releases.record(now);
        state.hold.record(held);
        // Kept up to share + burst: a connection beyond the share stays only for a waiter that
        // `dispatch` hands it to, else `trim_bursts` closes it.
        let max = state
            .limits
            .max_connections_per_endpoint
            .saturating_add(state.limits.burst_per_endpoint);
        let lifetime = state.limits.max_lifetime.get();
        let retired = state.retired;
        if let Some(ep) = state.endpoint_mut(endpoint) {
            ep.leased -= 1;
            if let Some(mut conn) = conn {
                let reason = match outcome {
                    Outcome::Close(reason) => Some(reason),
                    Outcome::Keep if ep.removed || retired => Some(CloseReason::Removed),
                    Outcome::Keep if ep.drained => Some(CloseReason::Drained),
                    Outcome::Keep if ep.usable() >= max => Some(CloseReason::Shrink),
                    Outcome::Keep if now.duration_since(created_at) >= lifetime => {
                        Some(CloseReason::Lifetime)
                    }
                    Outcome::Keep if !conn.is_open() => Some(CloseReason::PeerClosed),
                    Outcome::Keep => None,
                };
                match reason {
                    Some(reason) => self.closed(ep, reason, conn),
                    None => ep.idle.push(IdleConn {
                        conn,
                        created_at,
                        idle_since: now,
                    }),
                }
            }
        }
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
        self.dispatch(&mut state, now);
        drop(state);
        if retired {
            self.slot_freed.notify_waiters();
        }
    }

    pub(super) fn reap(self: &Arc<Self>, now: Instant) {
        let mut state = self.state.lock();
        let limits = state.limits.clone();
        for ep in &mut state.endpoints {
            let mut idle_timeout = ep.idle_timeout(&limits, now);
            let mut i = 0;
            while i < ep.idle.len() {
                let idle = &mut ep.idle[i];
                let reason = idle.expired(&limits, idle_timeout, now);
                match reason {
                    Some(reason) => {
                        let idle = ep.idle.remove(i);
                        if let Some(lowered) =
                            self.closed_idle(ep, reason, idle, limits.idle_timeout.get(), now)
                        {
                            // The rest of the pass, and the connections already passed, go
                            // under the lowered timeout.
                            idle_timeout = lowered;
                            i = 0;
                        }
                    }
                    None => i += 1,
                }
            }
        }
        self.dispatch(&mut state, now);
    }

    /// Closes an idle connection for `reason` ([`Self::closed`]). One the backend closed (found
    /// closed, or failing its validation) is noted with how long it had been idle
    /// ([`Self::peer_closed_after`], under `configured`, the pool's `idleTimeout`); returns the
    /// endpoint's idle timeout when that lowered it.
    fn closed_idle(
        self: &Arc<Self>,
        ep: &mut EndpointState<C::Conn>,
        reason: CloseReason,
        idle: IdleConn<C::Conn>,
        configured: Duration,
        now: Instant,
    ) -> Option<Duration> {
        let lowered = matches!(
            reason,
            CloseReason::PeerClosed | CloseReason::ValidateFailed
        )
        .then(|| self.peer_closed_after(ep, configured, now.duration_since(idle.idle_since), now))
        .flatten();
        self.closed(ep, reason, idle.conn);
        lowered
    }

    /// Notes a connection to `ep` found closed by it after `idle` without a call: counted
    /// (`poolpilot_pool_peer_closed_idle_seconds`: the backend's keep-alive is at most that, and
    /// the operator keeps `idleTimeout` below it) and kept by the endpoint
    /// ([`super::keep_alive::KeepAlive::found`], under `configured`, the pool's `idleTimeout`),
    /// said when that lowered its idle timeout; returns the lowered timeout.
    pub(super) fn peer_closed_after(
        &self,
        ep: &mut EndpointState<C::Conn>,
        configured: Duration,
        idle: Duration,
        now: Instant,
    ) -> Option<Duration> {
        self.peer_closed_idle.observe(idle.as_secs_f64());
        let lowered = ep.keep_alive.found(idle, configured, now)?;
        tracing::info!(
            backend = %self.backend,
            endpoint = %ep.name,
            closed_after_ms = idle.as_millis() as u64,
            idle_timeout_ms = lowered.as_millis() as u64,
            configured_ms = configured.as_millis() as u64,
            "the backend closes idle connections sooner than idleTimeout: keeping them idle for less until the operator lowers it"
        );
        Some(lowered)
    }

    /// Closes a connection and counts why. Its slot stays taken (`closing`) until the peer has
    /// closed its side, at most [`CLOSE_GRACE`].
    pub(super) fn closed(
        self: &Arc<Self>,
        ep: &mut EndpointState<C::Conn>,
        reason: CloseReason,
        conn: C::Conn,
    ) {
        self.metrics
            .connection_closed(&self.backend, &ep.name, reason);
        if let Some(opened) = conn.opened_at() {
            let age = opened.elapsed();
            self.metrics
                .incidents()
                .connection_aged(&self.backend, reason, age);
            tracing::debug!(backend = %self.backend, endpoint = %ep.name, reason = reason.as_str(), ?age, "upstream connection closed");
        }
        let Some(peer_closed) = conn.close() else {
            return;
        };
        // Outside a runtime (a pool dropped at exit) nothing can wait: the socket just closes.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        ep.closing += 1;
        let (pool, endpoint) = (Arc::downgrade(self), ep.id);
        runtime.spawn(async move {
            let _ = tokio::time::timeout(CLOSE_GRACE, peer_closed).await;
            if let Some(pool) = pool.upgrade() {
                pool.close_done(endpoint);
            }
        });
    }

    /// Frees the slot of a closed connection whose peer let go of it (or whose grace ran out).
    pub(super) fn close_done(self: &Arc<Self>, endpoint: u64) {
        self.give_back(endpoint, |ep| &mut ep.closing);
    }

    /// Gives back one slot of `endpoint`'s cap, of those `slots` counts (connects in progress,
    /// probes, closes waiting for the peer), then [`Self::freed`].
    pub(super) fn give_back(
        self: &Arc<Self>,
        endpoint: u64,
        slots: fn(&mut EndpointState<C::Conn>) -> &mut u32,
    ) {
        let now = Instant::now();
        let mut state = self.state.lock();
        if let Some(ep) = state.endpoint_mut(endpoint) {
            *slots(ep) -= 1;
        }
        self.freed(state, now);
    }

    /// After a slot freed other than by a lease returning: forgets removed endpoints left with
    /// nothing open, hands the capacity to waiters, and wakes [`super::Pool::close_all`].
    pub(super) fn freed(self: &Arc<Self>, mut state: MutexGuard<'_, State<C::Conn>>, now: Instant) {
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
        self.dispatch(&mut state, now);
        drop(state);
        self.slot_freed.notify_waiters();
    }

    /// A leased endpoint's name and output-token counter, for its lease.
    pub(super) fn endpoint_handles(&self, endpoint: u64) -> (Arc<str>, Counter) {
        let state = self.state.lock();
        state
            .endpoint(endpoint)
            .map(|ep| (ep.name.clone(), ep.output_tokens.clone()))
            .expect("a leased endpoint stays listed")
    }
}
