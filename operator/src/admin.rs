//! The operator's own HTTP endpoint: `GET /metrics` (the classic text format, or OpenMetrics when
//! the scraper accepts it) and `GET /healthz`,
//! bounded whatever a client does: at most [`MAX_CONNECTIONS`] open, and a client that does not
//! send its request's head, or does not take its response, within [`HEADER_READ_TIMEOUT`] loses
//! its connection. HTTP/1.1 only (what Prometheus and the kubelet's probes speak).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use poolpilot_telemetry::Format;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// How long the server waits on a client: for a request's head (also between requests on a
/// keep-alive connection), and on a response it does not take (HAProxy's usual
/// `timeout http-request 10s`).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Connections open at once (Prometheus and the kubelet's probes need a few); one more is closed
/// at once.
pub const MAX_CONNECTIONS: usize = 64;

/// Answers one request; `accept` is its `Accept` header.
pub fn respond(
    registry: &Registry,
    method: &Method,
    path: &str,
    accept: Option<&str>,
) -> Response<Full<Bytes>> {
    let reply = |status, ctype: &'static str, body: String| {
        Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, ctype)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    match (method, path) {
        (&Method::GET, "/metrics") => {
            let format = Format::negotiate(accept);
            let page = poolpilot_telemetry::exposition::encode(registry, format);
            reply(StatusCode::OK, format.content_type(), page)
        }
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// Serves until `shutdown` is cancelled.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, shutdown: CancellationToken) {
    info!(addr = ?listener.local_addr().ok(), "serving /metrics and /healthz");
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            debug!(%peer, "too many connections; closed");
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = service_fn(move |req: Request<Incoming>| {
                let accept = req
                    .headers()
                    .get(http::header::ACCEPT)
                    .and_then(|v| v.to_str().ok());
                let resp = respond(&registry, req.method(), req.uri().path(), accept);
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut stream = TimeoutStream::new(stream);
            stream.set_write_timeout(Some(HEADER_READ_TIMEOUT));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(Box::pin(stream)), svc)
                .await
            {
                debug!(%peer, error = %e, "admin connection ended with an error");
            }
        });
    }
}

/// Binds `addr`.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;
    use tokio::time::Instant;

    use super::*;

    /// Serves an empty registry on loopback; the address and the token that stops it.
    async fn start() -> (SocketAddr, CancellationToken) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, Arc::new(Registry::default()), stop.clone()));
        (addr, stop)
    }

    /// Reads until the server closes the connection; `None` if it is still open after `within`.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let deadline = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => return Some(got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => return None,
            }
        }
    }

    #[tokio::test]
    async fn a_client_that_never_sends_its_head_is_cut_off() {
        let (addr, stop) = start().await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        silent
            .write_all(b"GET /metrics HTTP/1.1\r\n")
            .await
            .unwrap();
        let start = Instant::now();
        let got = closed_within(&mut silent, HEADER_READ_TIMEOUT * 2)
            .await
            .expect("closed after the header-read timeout");
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
        assert!(
            start.elapsed() >= HEADER_READ_TIMEOUT / 2,
            "{:?}",
            start.elapsed()
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_at_once() {
        let (addr, stop) = start().await;
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 12];
            c.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"HTTP/1.1 200");
            held.push(c);
        }
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let got = closed_within(&mut extra, Duration::from_secs(1))
            .await
            .expect("a connection over the cap is closed at once");
        assert!(got.is_empty());
        drop(held);
        stop.cancel();
    }

    #[tokio::test]
    async fn serves_metrics_and_health() {
        let (registry, m) = crate::metrics::registry(crate::metrics::Metrics::default());
        m.reconciles.inc();
        let body = |r: Response<Full<Bytes>>| async move {
            let ctype = r.headers()[http::header::CONTENT_TYPE].clone();
            let bytes = r.into_body().collect().await.unwrap().to_bytes();
            (ctype, String::from_utf8(bytes.to_vec()).unwrap())
        };
        // curl: the classic text format, counters named by their `_total` samples.
        let r = respond(&registry, &Method::GET, "/metrics", Some("*/*"));
        assert_eq!(r.status(), StatusCode::OK);
        let (ctype, text) = body(r).await;
        assert_eq!(ctype, Format::Text.content_type());
        assert!(
            text.contains("poolpilot_operator_reconciles_total 1\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP poolpilot_operator_reconciles_total "),
            "{text}"
        );
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
        assert!(text.contains("\npoolpilot_build_info{"), "{text}");
        // Prometheus: OpenMetrics.
        let r = respond(
            &registry,
            &Method::GET,
            "/metrics",
            Some("application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1"),
        );
        let (ctype, page) = body(r).await;
        assert_eq!(ctype, Format::OpenMetrics.content_type());
        assert!(page.ends_with("# EOF\n"), "{page}");
        assert_eq!(
            respond(&registry, &Method::GET, "/healthz", None).status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&registry, &Method::GET, "/nope", None).status(),
            StatusCode::NOT_FOUND
        );
    }
}
