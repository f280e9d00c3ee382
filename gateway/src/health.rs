//! Active health checking: every `interval`, one `GET <path>` per endpoint on a fresh
//! connection that takes a slot of the endpoint's cap (a probe never waits behind traffic, and
//! never takes an endpoint over its cap: when every slot is taken the endpoint is skipped that
//! round, its pooled calls report to outlier detection). A 2xx within `timeout` passes. Results
//! go to the pool, which applies the thresholds.

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
                let Some(slot) = pool.probe_slot(&name) else {
                    tracing::trace!(backend = %pool.backend(), endpoint = %name, "probe skipped: every slot taken");
                    continue;
                };
                let path = check.path.clone();
                let timeout = check.timeout.get();
                probes.spawn(async move {
                    let passed = probe(address, &path, timeout).await;
                    // The probe's connection is closed: its slot frees.
                    drop(slot);
                    (name, passed)
                });
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

/// One probe: whether `GET path` on `address` answers 2xx within `timeout`. It returns once
/// the connection is closed (the backend closes it after the answer, `Connection: close`), or
/// `timeout` after the answer at the latest (then it closes it), so that a slot held for it
/// frees only when the connection is gone.
pub async fn probe(address: SocketAddr, path: &str, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    let connect = async {
        let stream = TcpStream::connect(address).await.ok()?;
        http1::handshake(TokioIo::new(stream)).await.ok()
    };
    let Ok(Some((mut sender, conn))) = tokio::time::timeout_at(deadline, connect).await else {
        return false;
    };
    // Driven here, not spawned: dropping it closes the connection.
    tokio::pin!(conn);
    let Ok(request) = Request::get(path)
        .header(header::HOST, address.to_string())
        .header(header::CONNECTION, "close")
        .header(header::USER_AGENT, "poolpilot-gateway-probe")
        .body(Empty::<Bytes>::new())
    else {
        return false;
    };
    let exchange = async move {
        let response = sender.send_request(request).await.ok()?;
        let ok = response.status().is_success();
        // Drain the (small) body so the backend sees a complete exchange.
        let _ = response.into_body().collect().await;
        Some(ok)
    };
    // The connection is driven until the answer is read; it may end first (the backend closes
    // it right after the answer), and then the exchange ends too. The exchange, and with it
    // the sender, is gone after this block.
    let mut closed = false;
    let passed = {
        let exchange = tokio::time::timeout_at(deadline, exchange);
        tokio::pin!(exchange);
        let answer = loop {
            tokio::select! {
                biased;
                answer = &mut exchange => break answer,
                _ = conn.as_mut(), if !closed => closed = true,
            }
        };
        matches!(answer, Ok(Some(true)))
    };
    if !closed {
        // Wait for the backend to close its side, so the slot is free for real.
        let _ = tokio::time::timeout(timeout, conn).await;
    }
    passed
}
