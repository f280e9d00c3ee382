//! A client for the admin API of a modelsim running elsewhere (a pod on the embedded cluster's
//! node, a child process): read its stats and metrics, flip its faults, reset its peaks.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::config::Faults;
use super::stats::Stats;

/// The admin API of one modelsim, at `addr` (its admin listener, so that these calls are not
/// counted as client connections; its serving listener works too, and then they are).
#[derive(Debug, Clone)]
pub struct Remote {
    addr: SocketAddr,
    timeout: Duration,
}

impl Remote {
    /// A client for the modelsim whose admin API listens on `addr`; each call has 5 s.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            timeout: Duration::from_secs(5),
        }
    }

    /// The same client with another per-call timeout.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// The address it talks to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `GET /admin/stats`.
    pub async fn stats(&self) -> anyhow::Result<Stats> {
        self.json(Method::GET, "/admin/stats", None).await
    }

    /// `GET /admin/faults`.
    pub async fn faults(&self) -> anyhow::Result<Faults> {
        self.json(Method::GET, "/admin/faults", None).await
    }

    /// `PUT /admin/faults`: replaces the faults; returns those now in force.
    pub async fn set_faults(&self, faults: &Faults) -> anyhow::Result<Faults> {
        let body = serde_json::to_vec(faults)?;
        self.json(Method::PUT, "/admin/faults", Some(body)).await
    }

    /// `PATCH /admin/faults`: changes only the fields of `patch` (a JSON object, e.g.
    /// `{"error_ratio": 0.2}`); returns the faults now in force.
    pub async fn patch_faults(&self, patch: &serde_json::Value) -> anyhow::Result<Faults> {
        let body = serde_json::to_vec(patch)?;
        self.json(Method::PATCH, "/admin/faults", Some(body)).await
    }

    /// `POST /admin/stats/reset-peaks`; returns the stats after the reset.
    pub async fn reset_peaks(&self) -> anyhow::Result<Stats> {
        self.json(Method::POST, "/admin/stats/reset-peaks", None)
            .await
    }

    /// `GET /metrics`, the exposition text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        let (status, body) = self.call(Method::GET, "/metrics", None).await?;
        if status != StatusCode::OK {
            bail!("GET /metrics on {} answered {status}", self.addr);
        }
        String::from_utf8(body.to_vec()).context("the metrics are not UTF-8")
    }

    /// `GET /health`: whether it answers 200.
    pub async fn healthy(&self) -> anyhow::Result<bool> {
        let (status, _) = self.call(Method::GET, "/health", None).await?;
        Ok(status == StatusCode::OK)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<T> {
        let (status, body) = self.call(method.clone(), path, body).await?;
        if status != StatusCode::OK {
            bail!(
                "{method} {path} on {} answered {status}: {}",
                self.addr,
                String::from_utf8_lossy(&body)
            );
        }
        serde_json::from_slice(&body)
            .with_context(|| format!("{method} {path} on {}: unexpected answer", self.addr))
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let what = format!("{method} {path} on {}", self.addr);
        let exchange = async {
            let stream = TcpStream::connect(self.addr).await?;
            let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
            let conn = tokio::spawn(conn);
            let mut req = Request::builder()
                .method(method)
                .uri(path)
                .header(http::header::HOST, self.addr.to_string());
            if body.is_some() {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
            }
            let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
            let resp = sender.send_request(req).await?;
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            drop(sender);
            // The connection closes once the sender is gone; do not leave it to linger.
            conn.abort();
            anyhow::Ok((status, bytes))
        };
        timeout(self.timeout, exchange)
            .await
            .map_err(|_| anyhow!("{what}: no answer within {:?}", self.timeout))?
            .with_context(|| what.clone())
    }
}
