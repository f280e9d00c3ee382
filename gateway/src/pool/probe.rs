//! One active health probe's exchange: `GET <path>` with `Connection: close` on a fresh
//! connection, passed by a 2xx within the timeout, over whatever stream the connector opened
//! (plain TCP by default: [`plain`]; a TLS connector runs it over its handshake).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// A probe over plain TCP to `address` (see [`exchange`]).
pub async fn plain(address: SocketAddr, path: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let Ok(Ok(stream)) = tokio::time::timeout_at(deadline, TcpStream::connect(address)).await
    else {
        return false;
    };
    exchange(stream, &address.to_string(), path, deadline, timeout).await
}

/// One probe on `stream`: whether `GET path` (with `Host: host`) answers 2xx before `deadline`.
/// It returns once
/// the connection is closed (the backend closes it after the answer, `Connection: close`), or
/// `timeout` after the answer at the latest (then it closes it), so that a slot held for it
/// frees only when the connection is gone.
pub async fn exchange<S>(
    stream: S,
    host: &str,
    path: &str,
    deadline: Instant,
    timeout: Duration,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let connect = async { http1::handshake(TokioIo::new(stream)).await.ok() };
    let Ok(Some((mut sender, conn))) = tokio::time::timeout_at(deadline, connect).await else {
        return false;
    };
    // Driven here, not spawned: dropping it closes the connection.
    tokio::pin!(conn);
    let Ok(request) = Request::get(path)
        .header(header::HOST, host)
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
