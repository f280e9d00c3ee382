//! A connection whose first bytes are the HTTP/2 preface, served by hyper-util's auto
//! connection for its whole life (no parking): `maxConcurrentStreams`, pings and their
//! timeout, the idle timeout counted from the end of its last stream (pings do not keep it
//! open), drain at shutdown, and each stream's task cut (the stream reset) when its response
//! passes a deadline, whether or not the client gives it flow-control window
//! ([`StreamExecutor`]).

use std::future::{Future, poll_fn};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Sleep;

use super::activity::{Activity, ConnIo};
use super::conn_limits::ConnLimits;
use super::h1::H1Watch;
use super::service::Service;
use crate::live::Gateway;
use crate::observe::{NO_CLIENT, Reclaim};
use crate::proxy::deadline::{Cuttable, DeadlineSlot};

/// Serves an HTTP/2 (or undecided) connection with hyper-util's auto connection, as one
/// piece: no parking.
pub(super) async fn serve_auto(
    stream: TcpStream,
    source: IpAddr,
    gw: Gateway,
    limits: &ConnLimits,
    mut timer: Pin<&mut Sleep>,
    shutdown: &mut watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::streams_only());
    let io = TokioIo::new(ConnIo {
        inner: stream,
        prefix: Bytes::new(),
        activity: activity.clone(),
    });
    let service = Service::new(gw.clone(), source, activity.clone());
    let mut builder = auto::Builder::new(StreamExecutor {
        next: service.next_stream.clone(),
    });
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_buf_size);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_list_size)
        .max_concurrent_streams(limits.h2_max_streams)
        .keep_alive_interval(limits.h2_ping_interval)
        .keep_alive_timeout(limits.h2_ping_timeout);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let idle_timeout = limits.idle_timeout;
    let mut draining = false;
    // HTTP/2 streams are cut in their own tasks (`StreamExecutor`); this watches the
    // connection only when it turned out to be HTTP/1.
    let mut watch = H1Watch::default();
    loop {
        timer.as_mut().reset(activity.idle_check_at(idle_timeout));
        tokio::select! {
            biased;
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "client connection ended with an error");
                }
                break;
            }
            cut = poll_fn(|cx| watch.poll_cut(cx, &activity, limits.send_timeout)) => {
                cut.count(&gw, &activity);
                break;
            }
            _ = timer.as_mut(), if !draining => {
                if activity.idle_for(idle_timeout) {
                    tracing::debug!("closing an idle client connection");
                    let client = activity.client.lock().clone();
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::IdleTimeout, client.as_deref().unwrap_or(NO_CLIENT));
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
            _ = shutdown.wait_for(|s| *s), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    }
}

/// Spawns hyper's HTTP/2 stream tasks, each cut (its stream reset) when its response passes a
/// deadline, whether or not the client gives it flow-control window.
#[derive(Clone, Debug)]
struct StreamExecutor {
    next: Arc<Mutex<Option<Arc<DeadlineSlot>>>>,
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let slot = self.next.lock().take();
        tokio::spawn(Cuttable::new(fut, slot));
    }
}
