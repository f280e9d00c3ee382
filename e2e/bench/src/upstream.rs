//! The benchmark's upstream: one small hyper HTTP/1.1 server, the same binary behind every proxy.
//!
//! - `/v1/fast` (and any unknown path): 200 with a 64-byte JSON body at once;
//! - `/v1/slow?ms=N`: the same after an `N` ms service time;
//! - `/v1/close`: the same with `connection: close`, so that no proxy keeps the upstream
//!   connection (part 4's idle connections without pooled upstream connections);
//! - `/v1/headers`: the same, echoing the `x-forwarded-for` and `via` the request arrived with
//!   in `x-seen-xff` and `x-seen-via` (every proxy must add both: the start check);
//! - `/v1/tls-stats`: the TLS listener's counters (below);
//! - `/v1/sse?n=N&ms=M`: a server-sent-event stream of `N` events, one every `M` ms, each
//!   carrying the monotonic time (µs) at which it was written, so the client can compute the
//!   delay each proxy adds to every chunk.
//!
//! Every response carries `x-recv-us`, the monotonic time (µs) at which the request arrived, so a
//! client on the same machine can tell queueing in a proxy apart from service time.
//!
//! With `--tls`, the same paths are also served over TLS on a second address (rustls, TLS 1.2
//! and 1.3, HTTP/1.1, stateless session tickets and TLS 1.2 session IDs, so that a proxy that
//! keeps sessions can resume them), closing each TLS connection after
//! `--tls-requests-per-connection` requests as a provider's front end does: every proxy must
//! reconnect at the same rate, and what the reconnects cost shows. The TLS listener counts its
//! connections, handshakes (full, resumed, failed) and requests; `GET /v1/tls-stats` on the
//! plain address answers them as JSON ([`TlsStats`]), so that a run reads what it caused.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::HandshakeKind;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::clock::mono_us;

/// The small body of `/v1/fast` and `/v1/slow`: 64 bytes.
pub const SMALL_BODY: &[u8] =
    b"{\"id\":\"bench\",\"object\":\"chat.completion\",\"choices\":[],\"ok\":1}\n";

type RespBody = BoxBody<Bytes, Infallible>;

/// The TLS listener of the upstream.
#[derive(Clone, Debug)]
pub struct TlsListener {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The certificate chain (PEM).
    pub cert_file: PathBuf,
    /// Its key (PEM).
    pub key_file: PathBuf,
    /// Requests served on one connection before it is closed (`connection: close` on the last).
    pub requests_per_connection: u64,
}

/// What the TLS listener has seen since it started: `GET /v1/tls-stats` on the plain address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsStats {
    /// TCP connections accepted.
    pub connections: u64,
    /// Handshakes that established a new session.
    pub full: u64,
    /// Handshakes that resumed a session of an earlier connection.
    pub resumed: u64,
    /// Handshakes that failed (a client that did not verify the certificate, or went away).
    pub failed: u64,
    /// Requests answered.
    pub requests: u64,
}

impl TlsStats {
    /// What happened between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            connections: self.connections.saturating_sub(earlier.connections),
            full: self.full.saturating_sub(earlier.full),
            resumed: self.resumed.saturating_sub(earlier.resumed),
            failed: self.failed.saturating_sub(earlier.failed),
            requests: self.requests.saturating_sub(earlier.requests),
        }
    }
}

/// The TLS listener's counters (one listener per process).
struct TlsCounters {
    connections: AtomicU64,
    full: AtomicU64,
    resumed: AtomicU64,
    failed: AtomicU64,
    requests: AtomicU64,
}

static TLS_COUNTERS: TlsCounters = TlsCounters {
    connections: AtomicU64::new(0),
    full: AtomicU64::new(0),
    resumed: AtomicU64::new(0),
    failed: AtomicU64::new(0),
    requests: AtomicU64::new(0),
};

impl TlsCounters {
    fn read(&self) -> TlsStats {
        TlsStats {
            connections: self.connections.load(Ordering::Relaxed),
            full: self.full.load(Ordering::Relaxed),
            resumed: self.resumed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }
}

/// Serves until the process is killed, on a single-threaded runtime (the caller pins it): plain
/// HTTP on `addr`, and over TLS on `tls.addr` when given.
pub fn serve(addr: SocketAddr, tls: Option<TlsListener>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(addr).await?;
        if let Some(tls) = tls {
            let acceptor = tls_acceptor(&tls)?;
            let tls_listener = TcpListener::bind(tls.addr).await?;
            tokio::spawn(serve_tls(
                tls_listener,
                acceptor,
                tls.requests_per_connection,
            ));
        }
        loop {
            let stream = accept(&listener).await;
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service_fn(handle))
                    .await;
            });
        }
    })
}

/// The next accepted connection, with `TCP_NODELAY`; accept errors (out of fds) are logged and
/// retried.
async fn accept(listener: &TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                return stream;
            }
            Err(error) => {
                eprintln!("upstream accept: {error}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// rustls with the workspace's provider: TLS 1.2 and 1.3, HTTP/1.1 by ALPN, stateless tickets
/// (TLS 1.3, and TLS 1.2's RFC 5077) and a cache of TLS 1.2 session IDs.
fn tls_acceptor(tls: &TlsListener) -> anyhow::Result<TlsAcceptor> {
    let chain = CertificateDer::pem_file_iter(&tls.cert_file)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file)?;
    let mut config = rustls::ServerConfig::builder_with_provider(poolpilot_tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.ticketer = rustls::crypto::ring::Ticketer::new()?;
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(16_384);
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Accepts TLS connections: counts each handshake by kind, serves `handle` and closes the
/// connection after its `requests_per_connection`-th request.
async fn serve_tls(listener: TcpListener, acceptor: TlsAcceptor, requests_per_connection: u64) {
    let c = &TLS_COUNTERS;
    loop {
        let stream = accept(&listener).await;
        c.connections.fetch_add(1, Ordering::Relaxed);
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(error) => {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                    eprintln!("upstream TLS handshake: {error}");
                    return;
                }
            };
            let counter = match tls.get_ref().1.handshake_kind() {
                Some(HandshakeKind::Resumed) => &c.resumed,
                _ => &c.full,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let served = Arc::new(AtomicU64::new(0));
            let service = service_fn(move |req| {
                let served = served.clone();
                async move {
                    c.requests.fetch_add(1, Ordering::Relaxed);
                    let mut response = handle(req).await?;
                    if served.fetch_add(1, Ordering::Relaxed) + 1 >= requests_per_connection {
                        response.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}

/// The value of query parameter `key`, parsed.
fn query_param(req: &Request<Incoming>, key: &str) -> Option<u64> {
    req.uri().query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == key).then(|| v.parse().ok()).flatten()
    })
}

async fn handle(req: Request<Incoming>) -> Result<Response<RespBody>, Infallible> {
    let recv = mono_us();
    let path = req.uri().path();
    if path == "/v1/tls-stats" {
        let stats = serde_json::to_vec(&TLS_COUNTERS.read()).unwrap_or_default();
        let response = Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(stats)).boxed())
            .unwrap_or_default();
        return Ok(response);
    }
    let body: RespBody = if path.starts_with("/v1/sse") {
        let n = query_param(&req, "n").unwrap_or(200);
        let every = Duration::from_millis(query_param(&req, "ms").unwrap_or(20));
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let events = futures::stream::unfold((0u64, ticks), move |(i, mut ticks)| async move {
            if i >= n {
                return None;
            }
            ticks.tick().await;
            let event = format!("data: {{\"i\":{i},\"t\":{}}}\n\n", mono_us());
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(event))),
                (i + 1, ticks),
            ))
        });
        let response = Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .header("x-recv-us", recv.to_string())
            .body(StreamBody::new(events).boxed())
            .unwrap_or_default();
        return Ok(response);
    } else {
        if path.starts_with("/v1/slow") {
            let ms = query_param(&req, "ms").unwrap_or(50);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Full::new(Bytes::from_static(SMALL_BODY)).boxed()
    };
    let mut response = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("x-recv-us", recv.to_string());
    if path.starts_with("/v1/close") {
        response = response.header("connection", "close");
    } else if path.starts_with("/v1/headers") {
        for (seen, name) in [("x-seen-xff", "x-forwarded-for"), ("x-seen-via", "via")] {
            if let Some(value) = req.headers().get(name) {
                response = response.header(seen, value);
            }
        }
    }
    Ok(response.body(body).unwrap_or_default())
}
