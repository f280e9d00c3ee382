//! An HTTP/1 connection served by hyper: the head limits and header-read timeout of its
//! [`ConnLimits`], the keep-alive idle timeout, parking once it has had no request in flight
//! for [`PARK_AFTER`] (or at once with many connections open: [`PARK_EAGERLY_ABOVE`]), drain
//! at shutdown, and the cut of a response past its deadlines or of a client that accepts no
//! bytes for `sendTimeout` ([`H1Watch`]).

use std::future::{Future, poll_fn};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::time::Sleep;

use super::activity::{Activity, ConnIo};
use super::conn_limits::ConnLimits;
use super::parking::{PARK_AFTER, PARK_EAGERLY_ABOVE, Parked, unparsed};
use super::registry::Connections;
use super::service::Service;
use crate::live::Gateway;
use crate::observe::{DownstreamTimeout, NO_CLIENT, Reclaim};
use crate::proxy::deadline::{Cut, Watcher};

/// Serves HTTP/1 requests with hyper until the connection closes (None) or has had no request
/// in flight for [`PARK_AFTER`] (the parked connection).
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_h1(
    parked: Parked,
    source: IpAddr,
    gw: &Gateway,
    conns: &Connections,
    limits: &ConnLimits,
    header_read_timeout: Duration,
    mut timer: Pin<&mut Sleep>,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Parked> {
    let served = parked.served;
    // A pending partial head keeps the time its wait began; otherwise the wait begins now.
    let activity = Arc::new(if parked.prefix.is_empty() {
        Activity::new()
    } else {
        Activity::waiting_since(parked.head_since)
    });
    let io = TokioIo::new(ConnIo {
        inner: parked.stream,
        prefix: parked.prefix,
        activity: activity.clone(),
    });
    let service = Service::new(gw.clone(), source, activity.clone());
    let mut watch = H1Watch::default();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .max_buf_size(limits.max_buf_size);
    if let Some(max) = limits.h1_max_headers {
        builder.max_headers(max);
    }
    let mut conn = Box::new(builder.serve_connection(io, service));
    // Flags shared by the branches below (atomics only because the future must be `Send`).
    let draining = AtomicBool::new(false);
    let parking = AtomicBool::new(false);
    loop {
        let idle_for = limits.idle_timeout.min(PARK_AFTER);
        timer.as_mut().reset(activity.idle_check_at(idle_for));
        tokio::select! {
            // The connection first: the watch then sees what its response body just reported.
            biased;
            result = poll_fn(|cx| {
                let result = conn.poll_without_shutdown(cx);
                // Many connections open: park as soon as hyper waits for a next request
                // with everything written, instead of after PARK_AFTER.
                if result.is_pending()
                    && !parking.load(Ordering::Relaxed)
                    && !draining.load(Ordering::Relaxed)
                    && activity.waiting_for_request()
                    && conns.open() > PARK_EAGERLY_ABOVE
                {
                    Pin::new(&mut *conn).graceful_shutdown();
                    parking.store(true, Ordering::Relaxed);
                    return conn.poll_without_shutdown(cx);
                }
                result
            }) => {
                if let Err(error) = result {
                    tracing::debug!(%error, "client connection ended with an error");
                    if error.is_timeout() {
                        // hyper's header-read timeout: on a kept-alive connection that sent
                        // nothing since its last response, an idle close.
                        let idle =
                            activity.served() && !activity.head_bytes.load(Ordering::Relaxed);
                        let reason = if idle {
                            Reclaim::IdleTimeout
                        } else {
                            Reclaim::HeaderTimeout
                        };
                        let client = activity.client.lock().clone();
                        gw.metrics()
                            .incidents()
                            .reclaimed(reason, client.as_deref().unwrap_or(NO_CLIENT));
                    }
                    return None;
                }
                break;
            }
            cut = poll_fn(|cx| watch.poll_cut(cx, &activity, limits.send_timeout)) => {
                // Dropping the connection drops the response body: its lease and permit go
                // back now, and the client sees the connection close mid-response.
                cut.count(gw, &activity);
                return None;
            }
            _ = timer.as_mut(), if !draining.load(Ordering::Relaxed) && !parking.load(Ordering::Relaxed) => {
                if activity.idle_for(limits.idle_timeout) {
                    tracing::debug!("closing an idle client connection");
                    let client = activity.client.lock().clone();
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::IdleTimeout, client.as_deref().unwrap_or(NO_CLIENT));
                    Pin::new(&mut *conn).graceful_shutdown();
                    draining.store(true, Ordering::Relaxed);
                } else if activity.idle_for(PARK_AFTER) && !activity.write_blocked() {
                    // hyper is between requests with everything written: it closes its side
                    // at once and hands the socket back.
                    Pin::new(&mut *conn).graceful_shutdown();
                    parking.store(true, Ordering::Relaxed);
                }
            }
            _ = shutdown.wait_for(|s| *s), if !draining.load(Ordering::Relaxed) => {
                Pin::new(&mut *conn).graceful_shutdown();
                draining.store(true, Ordering::Relaxed);
            }
        }
    }
    let (draining, parking) = (draining.into_inner(), parking.into_inner());
    let parts = conn.into_parts();
    let ConnIo {
        inner: mut stream,
        prefix,
        ..
    } = parts.io.into_inner();
    if draining || !parking {
        // Closed by the client, the idle timeout or drain.
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
        return None;
    }
    Some(Parked {
        stream,
        prefix: unparsed(&parts.read_buf, &prefix),
        idle_since: activity.idle_since(),
        head_since: activity.head_since(),
        served: served || activity.served(),
    })
}

/// Why an HTTP/1 connection is being cut.
#[derive(Clone, Copy, Debug)]
pub(super) enum H1Cut {
    /// Its response passed a deadline (counted where the response ends).
    Response(Cut),
    /// Its client accepted no bytes for `sendTimeout` (after its response left the gateway's
    /// hands, or of an answer the gateway wrote itself).
    Stalled,
}

impl H1Cut {
    pub(super) fn count(self, gw: &Gateway, activity: &Activity) {
        match self {
            Self::Response(cut) => tracing::debug!(?cut, "cutting a client connection"),
            Self::Stalled => {
                tracing::debug!("cutting a client connection that accepts no bytes");
                gw.metrics().downstream_timeout(DownstreamTimeout::Send);
                let client = activity.client.lock().clone();
                gw.metrics()
                    .incidents()
                    .reclaimed(Reclaim::SendStall, client.as_deref().unwrap_or(NO_CLIENT));
            }
        }
    }
}

/// Watches an HTTP/1 connection's request in flight and its writes.
#[derive(Debug)]
pub(super) struct H1Watch {
    response: Watcher,
    stall: Pin<Box<Sleep>>,
}

impl Default for H1Watch {
    fn default() -> Self {
        Self {
            response: Watcher::default(),
            stall: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

impl H1Watch {
    pub(super) fn poll_cut(
        &mut self,
        cx: &mut Context<'_>,
        activity: &Activity,
        send_timeout: Duration,
    ) -> Poll<H1Cut> {
        let current = activity.current.lock().clone();
        if let Some(slot) = current
            && let Poll::Ready(cut) = self.response.poll_cut(cx, &slot)
        {
            return Poll::Ready(H1Cut::Response(cut));
        }
        let Some(since) = activity.stalled_since() else {
            return Poll::Pending;
        };
        let at = since + send_timeout;
        if self.stall.deadline() != at {
            self.stall.as_mut().reset(at);
        }
        self.stall.as_mut().poll(cx).map(|()| H1Cut::Stalled)
    }
}
