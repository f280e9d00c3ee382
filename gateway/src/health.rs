//! Active health checking: every `interval`, one `GET <path>` per endpoint on a fresh
//! connection (outside the pool, so a probe never waits behind traffic), a 2xx within
//! `timeout` passes. Results go to the pool, which applies the thresholds.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use poolpilot_api::limits::HealthCheck;
use tokio::net::TcpStream;
use tokio::task::{JoinHandle, JoinSet};

use crate::pool::Pool;
use crate::upstream::HttpConnector;

/// Spawns the probe loop of one backend; abort the handle to stop it.
pub(crate) fn spawn(pool: Pool<HttpConnector>, check: HealthCheck) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(check.interval.get());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut probes = JoinSet::new();
            for (name, address) in pool.probe_targets() {
                let path = check.path.clone();
                let timeout = check.timeout.get();
                probes.spawn(async move { (name, probe(address, &path, timeout).await) });
            }
            while let Some(result) = probes.join_next().await {
                if let Ok((name, passed)) = result {
                    tracing::trace!(backend = %pool.backend(), endpoint = %name, passed, "probe");
                    pool.report_probe(&name, passed);
                }
            }
        }
    })
}

/// One probe: whether `GET path` on `address` answers 2xx within `timeout`.
pub async fn probe(address: SocketAddr, path: &str, timeout: Duration) -> bool {
    let attempt = async {
        let stream = TcpStream::connect(address).await.ok()?;
        let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await.ok()?;
        let driver = tokio::spawn(conn);
        let request = Request::get(path)
            .header(header::HOST, address.to_string())
            .header(header::CONNECTION, "close")
            .header(header::USER_AGENT, "poolpilot-gateway-probe")
            .body(Empty::<Bytes>::new())
            .ok()?;
        let response = sender.send_request(request).await.ok()?;
        let ok = response.status().is_success();
        // Drain the (small) body so the backend sees a complete exchange.
        let _ = response.into_body().collect().await;
        driver.abort();
        Some(ok)
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}
