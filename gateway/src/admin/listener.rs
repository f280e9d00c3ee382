//! The admin listener's connections, bounded whatever a client does: at most
//! `adminMaxConnections` open (one more is closed at once and counted), and every wait on a client
//! ends after `adminHeaderReadTimeout`: the TLS handshake, a request's head (hyper's header-read
//! timer, which also runs between requests on a keep-alive connection), a request body (the
//! route answers 408), a response the client does not take (a socket write stalled that long
//! fails: tokio-io-timeout). HTTP/1.1 only: probes, Prometheus and the operator speak it, and a
//! smaller surface has fewer ways to hold a connection.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_io_timeout::TimeoutStream;

use super::tls::AdminTls;
use super::{AdminTokens, route};
use crate::gateway::Gateway;

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
        let service = service_fn(move |req: http::Request<Incoming>| {
            let (gw, tokens) = (gw.clone(), tokens.clone());
            async move { Ok::<_, Infallible>(route(&gw, &tokens, body_timeout, req).await) }
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
