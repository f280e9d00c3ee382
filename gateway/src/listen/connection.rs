//! One client connection, from its accept to its close: its first bytes tell HTTP/2 prior
//! knowledge ([`super::h2`], for its whole life) from HTTP/1, which alternates between served by
//! hyper ([`super::h1`]) and parked outside it ([`super::parking`]) until it closes, idles out,
//! or drains at shutdown.

use std::future::poll_fn;
use std::net::IpAddr;
use std::task::Poll;

use bytes::Bytes;
use tokio::io::ReadBuf;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::conn_limits::ConnLimits;
use super::h1::serve_h1;
use super::h2::serve_auto;
use super::parking::Parked;
use super::registry::ConnGuard;
use crate::live::Gateway;
use crate::observe::{NO_CLIENT, Reclaim};

/// The first bytes of an HTTP/2 connection with prior knowledge.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one client connection until it closes, its keep-alive idle timeout passes, or
/// shutdown asks it to finish its in-flight requests and close.
///
/// An HTTP/1 connection alternates between two states:
///
/// ```text
///  parked: a bare socket, an idle deadline,   readable   active: a hyper HTTP/1 connection
///  no buffers (a few hundred bytes) ─────────────────────► (read/write buffers, state)
///        ▲                                                    │
///        └──── no request in flight for PARK_AFTER: ──────────┘
///              hyper closes its (idle) side, hands back the socket and unparsed bytes
/// ```
///
/// so that thousands of idle keep-alive clients cost little memory. A connection whose
/// first bytes are the HTTP/2 preface is served by hyper-util's auto connection for its whole
/// life.
pub(super) async fn serve_connection(
    stream: TcpStream,
    source: IpAddr,
    gw: Gateway,
    guard: ConnGuard,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let limits = ConnLimits::of(&gw);
    let mut conn = Parked {
        stream,
        prefix: Bytes::new(),
        idle_since: Instant::now(),
        head_since: Instant::now(),
        served: false,
    };
    let timer = tokio::time::sleep(limits.idle_timeout);
    tokio::pin!(timer);
    let mut first = true;
    loop {
        if conn.prefix.is_empty() && !conn.wait(&gw, &limits, timer.as_mut(), &mut shutdown).await {
            conn.close().await;
            break;
        }
        if first {
            match first_bytes(&conn.stream).await {
                First::Pending => continue,
                First::Closed => {
                    conn.close().await;
                    break;
                }
                First::H2 => {
                    // Boxed: inline, its state (2 KiB) would be part of every connection's
                    // task, idle HTTP/1 ones included.
                    Box::pin(serve_auto(
                        conn.stream,
                        source,
                        gw,
                        &limits,
                        timer.as_mut(),
                        &mut shutdown,
                    ))
                    .await;
                    break;
                }
                First::H1 => first = false,
            }
        }
        let header_read_timeout = if conn.prefix.is_empty() {
            limits.header_read_timeout
        } else {
            // A partial head was pending when the connection parked: its time counts.
            match limits
                .header_read_timeout
                .checked_sub(conn.head_since.elapsed())
            {
                Some(left) if !left.is_zero() => left,
                _ => {
                    tracing::debug!("read header from client timeout");
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::HeaderTimeout, NO_CLIENT);
                    break;
                }
            }
        };
        // Boxed, like `serve_auto`: a parked connection's task then holds only what parking
        // needs, not the serving state (one allocation per return from parking).
        match Box::pin(serve_h1(
            conn,
            source,
            &gw,
            &guard.conns,
            &limits,
            header_read_timeout,
            timer.as_mut(),
            &mut shutdown,
        ))
        .await
        {
            Some(parked) => conn = parked,
            None => break,
        }
    }
    drop(guard);
}

/// What a new connection's first bytes say.
enum First {
    /// Nothing to read yet (a spurious wake-up).
    Pending,
    /// The client closed (or the socket failed) before sending anything.
    Closed,
    /// (The start of) the HTTP/2 preface.
    H2,
    /// Anything else: HTTP/1.
    H1,
}

/// Peeks at a new connection's first bytes.
async fn first_bytes(stream: &TcpStream) -> First {
    let mut bytes = [0u8; 24];
    let mut buf = ReadBuf::new(&mut bytes);
    match poll_fn(|cx| Poll::Ready(stream.poll_peek(cx, &mut buf))).await {
        Poll::Pending => First::Pending,
        Poll::Ready(Ok(0) | Err(_)) => First::Closed,
        Poll::Ready(Ok(n)) if buf.filled()[..n] == H2_PREFACE[..n] => First::H2,
        Poll::Ready(Ok(_)) => First::H1,
    }
}
