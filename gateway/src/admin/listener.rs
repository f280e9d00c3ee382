//! The admin listener's connections, bounded whatever a client does: at most
//! `adminMaxConnections` open (one more is closed at once and counted), and every wait on a client
//! ends after `adminHeaderReadTimeout`: the TLS handshake, a request's head (hyper's header-read
//! timer, which also runs between requests on a keep-alive connection), a request body (the
//! route answers 408), a response the client does not take (a socket write stalled that long
//! fails: tokio-io-timeout). HTTP/1.1 only: probes, Prometheus and the operator speak it, and a
//! smaller surface has fewer ways to hold a connection.
//!
//! The listener runs on a thread of its own ([`spawn_thread`]), as Envoy keeps its admin off the
//! worker threads: a proxy runtime saturated by clients (thousands of streams on a pod given a
//! fraction of a core) must not make the kubelet's liveness probe time out and restart the pod.
//! Probes and `/metrics` only read state and are answered on that thread; the other routes may
//! start pool tasks (health checks, reapers) that belong with the proxy, so they run on the
//! gateway's runtime ([`AdminListener::work`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, watch};
use tokio_io_timeout::TimeoutStream;

use super::tls::AdminTls;
use super::{AdminTokens, route};
use crate::live::Gateway;

/// The largest request head the admin API reads (its requests are small; hyper's floor is 8 KiB).
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// How the admin listener treats its clients.
#[derive(Clone, Debug)]
pub struct AdminListener {
    /// Longest wait on a client (handshake, head, idle keep-alive, body, stalled write).
    pub timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// HTTPS, when configured.
    pub tls: Option<AdminTls>,
    /// The gateway's runtime, where every route but the probes and `/metrics` runs (`None`:
    /// the listener's own).
    pub work: Option<Handle>,
}

/// Starts the admin thread: a single-threaded runtime that runs until `shutdown` turns true
/// (or its sender is gone). Returns its handle, to spawn the listener on.
pub fn spawn_thread(mut shutdown: watch::Receiver<bool>) -> std::io::Result<Handle> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("poolpilot-admin".into())
        .spawn(move || {
            runtime.block_on(async move {
                let _ = shutdown.wait_for(|s| *s).await;
            });
        })?;
    Ok(handle)
}

/// Whether a request only reads state and is answered on the admin thread itself.
fn read_only(req: &http::Request<Incoming>) -> bool {
    req.method() == http::Method::GET
        && matches!(req.uri().path(), "/healthz" | "/readyz" | "/metrics")
}

impl AdminListener {
    /// Serves the admin API on `listener` until `shutdown` turns true.
    pub async fn serve(
        self,
        listener: TcpListener,
        gw: Gateway,
        tokens: Arc<AdminTokens>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let open = Arc::new(Semaphore::new(self.max_connections));
        let this = Arc::new(self);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = shutdown.wait_for(|s| *s) => return,
            };
            let Ok((stream, _)) = accepted else {
                gw.metrics().accept_error();
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let Ok(permit) = open.clone().try_acquire_owned() else {
                gw.metrics().admin_connection_refused();
                drop(stream);
                continue;
            };
            let (this, gw, tokens) = (this.clone(), gw.clone(), tokens.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let _ = stream.set_nodelay(true);
                let mut stream = TimeoutStream::new(stream);
                stream.set_write_timeout(Some(this.timeout));
                let stream = Box::pin(stream);
                match &this.tls {
                    None => this.serve_http(stream, gw, tokens).await,
                    Some(tls) => {
                        let handshake = tls.acceptor().accept(stream);
                        match tokio::time::timeout(this.timeout, handshake).await {
                            Ok(Ok(stream)) => this.serve_http(stream, gw, tokens).await,
                            Ok(Err(error)) => {
                                tracing::debug!(%error, "admin TLS handshake failed");
                            }
                            Err(_) => tracing::debug!("admin TLS handshake timed out"),
                        }
                    }
                }
            });
        }
    }

    async fn serve_http<S>(&self, stream: S, gw: Gateway, tokens: Arc<AdminTokens>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let body_timeout = self.timeout;
        let work = self.work.clone();
        let service = service_fn(move |req: http::Request<Incoming>| {
            let (gw, tokens, work) = (gw.clone(), tokens.clone(), work.clone());
            async move {
                let response = match work.filter(|_| !read_only(&req)) {
                    None => route(&gw, &tokens, body_timeout, req).await,
                    Some(work) => {
                        let routed =
                            work.spawn(async move { route(&gw, &tokens, body_timeout, req).await });
                        match routed.await {
                            Ok(response) => response,
                            // The gateway's runtime is shutting down.
                            Err(_) => super::error(
                                http::StatusCode::SERVICE_UNAVAILABLE,
                                "the gateway is shutting down",
                            ),
                        }
                    }
                };
                Ok::<_, Infallible>(response)
            }
        });
        let served = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.timeout)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(TokioIo::new(stream), service)
            .await;
        if let Err(error) = served {
            tracing::debug!(%error, "admin connection ended with an error");
        }
    }
}
