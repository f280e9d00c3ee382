//! One call through the gateway: what the forward phase borrows from the pipeline
//! ([`CallContext`]), and, once its response head arrived, the call in progress ([`Call`]) and
//! what its end settles ([`Call::finish`]): the upstream duration and timeout metrics, the
//! connection kept for the pool or discarded, the endpoint's outcome for outlier detection, the
//! lease hold, the call's tokens (counted, its output on its endpoint's count, and its token
//! reservation settled: [`Meter`]), and
//! the client's permit released. A call that ends by the client's doing is
//! never held against the backend.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use poolpilot_api::limits::PriorityClass;
use tokio::time::Instant;

use super::body::BodyProgress;
use super::deadline::{Cut, DeadlineSlot};
use crate::limits::fair::Ticket;
use crate::limits::limiter::{ClientKey, ClientPermit};
use crate::live::{Backend, Route};
use crate::observe::access::Record;
use crate::observe::{CloseReason, DownstreamTimeout, Metrics, NO_CLIENT, Reclaim, TimeoutKind};
use crate::pool::Lease;
use crate::tokens::Meter;
use crate::tokens::estimate::Estimate;
use crate::upstream::HttpConnector;

/// What a call needs besides its request and permit.
pub(super) struct CallContext<'a> {
    pub(super) metrics: &'a Metrics,
    pub(super) route: &'a Route,
    /// The call's priority class, in the pool queue.
    pub(super) priority: PriorityClass,
    /// The request body's progress: when it was sent in full, how the client failed it.
    pub(super) body: &'a BodyProgress,
    pub(super) send_timeout: Duration,
    pub(super) slot: &'a DeadlineSlot,
    /// The call's access log record.
    pub(super) record: &'a Record,
    /// Its tokens as estimated before it was sent.
    pub(super) estimate: Estimate,
    /// What its pool lease charges its client in the pool's fair queue
    /// ([`crate::limits::fair`]).
    pub(super) ticket: Ticket,
    /// Whether the ticket's cost is the estimate, corrected by the tokens counted at the
    /// call's end (else 1 per call, kept).
    pub(super) settle_fair: bool,
}

/// One call in progress: what must happen when its response ends.
pub(super) struct Call {
    pub(super) metrics: Metrics,
    pub(super) backend: Arc<Backend>,
    pub(super) lease: Lease<HttpConnector>,
    /// The client's slot: released when the call ends; told of each frame (slow calls are
    /// judged on the waits between them).
    pub(super) permit: Option<ClientPermit>,
    pub(super) status: u16,
    pub(super) sent_at: Instant,
    /// Whether the body's first byte arrived (and its time was observed).
    pub(super) first_byte: bool,
    /// Its tokens, read from the response as it passes.
    pub(super) meter: Meter<ClientKey>,
    /// Whether its tokens as counted settle its lease's fair-queue charge.
    pub(super) settle_fair: bool,
}

/// How a response body ended.
#[derive(Clone, Copy, Debug)]
pub(super) enum End {
    /// The backend sent all of it.
    Complete,
    /// Reading it failed.
    Failed,
    /// A deadline cut it.
    Cut(Cut),
    /// The client went away first.
    Abandoned,
}

impl Call {
    /// `data` of the response body arrived; its first byte is the time to first byte.
    pub(super) fn received(&mut self, data: &Bytes) {
        let n = data.len();
        if n == 0 {
            return;
        }
        self.meter.received(data);
        if let Some(permit) = &mut self.permit {
            permit.frame();
        }
        if !self.first_byte {
            self.first_byte = true;
            self.backend
                .signals
                .first_byte(self.sent_at.elapsed().as_secs_f64());
        }
        // Response body bytes of this backend, counted as they arrive.
        self.backend.signals.response_bytes().inc_by(n as u64);
    }

    pub(super) fn finish(mut self, end: End) {
        let name = &self.backend.name;
        let client = self.permit.as_ref().map_or(NO_CLIENT, |p| p.label());
        let signals = &self.backend.signals;
        // One clock read for everything the end measures.
        let held = self.sent_at.elapsed();
        let took = held.as_secs_f64();
        match &self.permit {
            Some(_) => self.metrics.incidents().lease_held(name, client, held),
            None => signals.held_without_client(held),
        }
        if !self.first_byte && matches!(end, End::Complete) {
            // A response without a body: its end is its first byte.
            signals.first_byte(took);
        }
        let endpoint = self.lease.endpoint().clone();
        // Counted and settled before the permit goes: a client's next call sees its budget
        // settled.
        let (input, output) = self.meter.finish(
            &self.metrics,
            name,
            self.status,
            matches!(end, End::Complete),
        );
        if let Some(permit) = &self.permit
            && input + output > 0
        {
            permit.used_tokens(input, output);
        }
        self.lease.count_output_tokens(output);
        if self.settle_fair {
            self.lease.settle_tokens(input + output);
        }
        match end {
            End::Complete => {
                signals.duration(self.status, took);
                self.lease.keep();
                self.backend.pool.report_call(&endpoint, self.status < 500);
            }
            End::Failed => {
                signals.duration(502, took);
                self.lease.discard(CloseReason::Error);
                self.backend.pool.report_call(&endpoint, false);
            }
            End::Cut(cut) => {
                tracing::debug!(backend = %name, %endpoint, ?cut, "response cut by a deadline");
                self.lease.discard(CloseReason::Timeout);
                match cut {
                    Cut::Total | Cut::StreamIdle => {
                        let kind = if cut == Cut::Total {
                            TimeoutKind::Total
                        } else {
                            TimeoutKind::StreamIdle
                        };
                        signals.duration(504, took);
                        self.metrics.upstream_timeout(name, kind);
                        self.backend.pool.report_call(&endpoint, false);
                    }
                    Cut::Send => {
                        self.metrics.downstream_timeout(DownstreamTimeout::Send);
                        self.metrics
                            .incidents()
                            .reclaimed(Reclaim::SendStall, client);
                    }
                    Cut::TotalClientStalled => {
                        self.metrics.downstream_timeout(DownstreamTimeout::Total);
                        self.metrics
                            .incidents()
                            .reclaimed(Reclaim::ClientStalled, client);
                    }
                }
            }
            // The client's doing: nothing is held against the backend.
            End::Abandoned => self.lease.discard(CloseReason::Error),
        }
        // The lease goes back to the pool and the client permit is released here.
    }
}
