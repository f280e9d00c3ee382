//! modelsim's listeners: the accept loops, exact connection counting from accept to close, and
//! each connection's task (HTTP/1.1 or HTTP/2, idle close, injected resets, graceful and hard
//! shutdown).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{debug, warn};

use super::conn::{ConnCtl, RequestGuard, TrackedIo};
use super::handler;
use super::shared::Shared;

/// Counts one open connection from accept until its task ends.
#[derive(Debug)]
struct ConnGuard {
    shared: Arc<Shared>,
    /// Its id among the serving connections, `None` on the admin listener.
    serving: Option<u64>,
}

impl ConnGuard {
    fn open(shared: &Arc<Shared>, ctl: &Arc<ConnCtl>, admin: bool) -> Self {
        let m = &shared.metrics;
        let serving = if admin {
            m.admin_connections_open.inc();
            None
        } else {
            Some(m.connection_opened(ctl))
        };
        Self {
            shared: Arc::clone(shared),
            serving,
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let m = &self.shared.metrics;
        match self.serving {
            Some(id) => m.connection_closed(id),
            None => {
                m.admin_connections_open.dec();
            }
        }
        self.shared.connection_closed();
    }
}

/// Accepts connections until shutdown; `admin` listeners' connections are counted apart.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, admin: bool) {
    let mut last_warning: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = shared.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Err(e) = stream.set_nodelay(true) {
                    debug!(error = %e, "cannot set TCP_NODELAY");
                }
                let ctl = Arc::new(ConnCtl::new(shared.epoch, peer));
                let guard = ConnGuard::open(&shared, &ctl, admin);
                tokio::spawn(serve_connection(Arc::clone(&shared), stream, ctl, guard));
            }
            Err(e) => {
                // Typically EMFILE under a low fd limit: back off instead of spinning (the
                // backlog keeps the clients), count it, and warn at most once a second.
                shared.metrics.accept_errors.inc();
                if last_warning.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    warn!(error = %e, total = shared.metrics.accept_errors.get(), "accept failed");
                    last_warning = Some(Instant::now());
                }
                tokio::select! {
                    () = shared.shutdown.cancelled() => break,
                    () = sleep(Duration::from_millis(20)) => {}
                }
            }
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    ctl: Arc<ConnCtl>,
    guard: ConnGuard,
) {
    let _guard = guard;
    let io = TokioIo::new(TrackedIo::new(stream, Arc::clone(&ctl)));
    let service = {
        let shared = Arc::clone(&shared);
        let ctl = Arc::clone(&ctl);
        service_fn(move |req| {
            let shared = Arc::clone(&shared);
            let ctl = Arc::clone(&ctl);
            ctl.forwarded_for(req.headers().get("x-forwarded-for"));
            let guard = RequestGuard::new(Arc::clone(&ctl));
            async move {
                let mut resp = handler::route(shared, ctl, req).await;
                resp.body_mut().attach(guard);
                Ok::<_, Infallible>(resp)
            }
        })
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // No header-read timeout: an idle keep-alive connection stays open until the client closes
    // it or the idle-close fault closes it, so connection counts only move when told to.
    builder.http1().header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut faults = shared.faults.subscribe();
    let mut closing = false;
    loop {
        let idle = if closing {
            None
        } else {
            faults
                .borrow_and_update()
                .idle_close_ms
                .map(Duration::from_millis)
        };
        let idle_deadline = idle.map(|idle| ctl.idle_deadline(idle));
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            () = ctl.killed() => {
                shared.metrics.connections_reset.inc();
                break;
            }
            () = shared.hard_stop.cancelled() => break,
            () = shared.shutdown.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            // A fault change may set or change the idle timeout: recompute it.
            _ = faults.changed(), if !closing => {}
            () = sleep_until_some(idle_deadline) => {
                if idle.is_some_and(|idle| ctl.idle_for(idle)) {
                    shared.metrics.connections_closed_idle.inc();
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}
