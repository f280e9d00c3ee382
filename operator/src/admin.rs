//! The operator's own HTTP endpoint: `GET /metrics` (Prometheus text format) and `GET /healthz`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// Answers one request.
pub fn respond(registry: &Registry, method: &Method, path: &str) -> Response<Full<Bytes>> {
    let reply = |status, ctype: &'static str, body: String| {
        Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, ctype)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    match (method, path) {
        (&Method::GET, "/metrics") => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, registry) {
                Ok(()) => reply(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    out,
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    e.to_string(),
                ),
            }
        }
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// Serves until `shutdown` is cancelled.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, shutdown: CancellationToken) {
    info!(addr = ?listener.local_addr().ok(), "serving /metrics and /healthz");
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
        let registry = registry.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let resp = respond(&registry, req.method(), req.uri().path());
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
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
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn serves_metrics_and_health() {
        let mut registry = Registry::with_prefix("poolpilot_operator");
        let m = crate::metrics::Metrics::default().register(&mut registry);
        m.reconciles.inc();
        let body = |r: Response<Full<Bytes>>| async move {
            r.into_body().collect().await.unwrap().to_bytes()
        };
        let r = respond(&registry, &Method::GET, "/metrics");
        assert_eq!(r.status(), StatusCode::OK);
        let text = String::from_utf8(body(r).await.to_vec()).unwrap();
        assert!(text.contains("poolpilot_operator_reconciles_total 1"));
        assert_eq!(
            respond(&registry, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&registry, &Method::GET, "/nope").status(),
            StatusCode::NOT_FOUND
        );
    }
}
