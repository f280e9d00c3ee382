//! Upstream connections: HTTP/1.1 client connections to backend endpoints (hyper's low-level
//! `client::conn`), the pooled unit of [`crate::pool`].
//!
//! A connection's IO is driven by whoever holds it, inside that task: the proxied call that
//! leased it drives it while it sends, waits for the head and streams the body (no task of its
//! own, so no hand-off through a channel and a wake-up between tasks for each request and
//! response); the pool drives it (with a no-op waker, no syscall unless the socket became
//! readable) when it checks whether an idle connection is still open, which is how a backend
//! closing an idle connection is noticed.
//!
//! Closing is a handshake: the gateway's FIN, then whatever the backend still sends is read
//! and dropped until the backend closes its side, so the pool knows when the backend has let
//! go of the connection.

use std::future::{Future, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::{TrySendError, http1};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::body::RequestBody;
use crate::pool::{Connect, Poolable};

/// Opens plain-TCP HTTP/1.1 connections.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpConnector;

type Driver = http1::Connection<TokioIo<TcpStream>, RequestBody>;

/// One HTTP/1.1 connection to an endpoint: the request handle and the connection's IO state
/// machine, driven by [`UpstreamConn::drive`].
pub struct UpstreamConn {
    sender: http1::SendRequest<RequestBody>,
    /// `None` once the connection ended (closed by either side, or failed).
    driver: Option<Pin<Box<Driver>>>,
    addr: SocketAddr,
    opened: Instant,
}

impl std::fmt::Debug for UpstreamConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConn")
            .field("addr", &self.addr)
            .field("open", &self.driver.is_some())
            .finish()
    }
}

impl UpstreamConn {
    /// Moves the connection's IO as far as it can go now (writes the queued request, reads the
    /// response, hands both over); `cx` is woken when it can go further. Returns whether the
    /// connection is still open.
    pub fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = self.driver.as_mut()
            && let Poll::Ready(result) = driver.as_mut().poll(cx)
        {
            if let Err(error) = result {
                tracing::debug!(addr = %self.addr, %error, "upstream connection ended with an error");
            }
            self.driver = None;
        }
        self.driver.is_some()
    }

    /// Drives the connection without anyone to wake: for connections nobody is waiting on.
    fn drive_idle(&mut self) -> bool {
        self.drive(&mut Context::from_waker(Waker::noop()))
    }

    /// Waits until the connection can take a request.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        poll_fn(|cx| {
            self.drive(cx);
            self.sender.poll_ready(cx)
        })
        .await
    }

    /// Sends `req` and waits for the response head, driving the connection meanwhile. A
    /// request that was not written comes back in the error.
    pub async fn send(
        &mut self,
        req: Request<RequestBody>,
    ) -> Result<Response<Incoming>, TrySendError<Request<RequestBody>>> {
        let mut response = pin!(self.sender.try_send_request(req));
        poll_fn(|cx| {
            if let Poll::Ready(result) = response.as_mut().poll(cx) {
                return Poll::Ready(result);
            }
            self.drive(cx);
            response.as_mut().poll(cx)
        })
        .await
    }
}

impl Poolable for UpstreamConn {
    fn opened_at(&self) -> Option<Instant> {
        Some(self.opened)
    }

    fn is_open(&mut self) -> bool {
        self.drive_idle() && !self.sender.is_closed()
    }

    fn validate(&mut self) -> bool {
        self.is_open() && self.sender.is_ready()
    }

    fn close(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let Self { sender, driver, .. } = self;
        drop(sender);
        // No driver: the connection ended, its socket is closed on both sides already.
        let mut stream = Pin::into_inner(driver?).into_parts().io.into_inner();
        Some(async move {
            if stream.shutdown().await.is_ok() {
                // Until the peer's FIN (0) or an error (a reset): the rest of a response the
                // client gave up on is dropped.
                let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
            }
        })
    }
}

impl Connect for HttpConnector {
    type Conn = UpstreamConn;

    async fn connect(&self, addr: SocketAddr) -> io::Result<UpstreamConn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, driver) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        Ok(UpstreamConn {
            sender,
            driver: Some(Box::pin(driver)),
            addr,
            opened: Instant::now(),
        })
    }
}
