//! Upstream connections: HTTP/1.1 client connections to backend endpoints (hyper's low-level
//! `client::conn`), the pooled unit of [`crate::pool`].

use std::io;
use std::net::SocketAddr;

use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::body::RequestBody;
use crate::pool::{Connect, Poolable};

/// Opens plain-TCP HTTP/1.1 connections.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpConnector;

/// One HTTP/1.1 connection to an endpoint. Its IO is driven by a background task, which also
/// notices when the backend closes it while idle (hyper keeps reading idle keep-alive
/// connections), so `is_open` needs no IO.
#[derive(Debug)]
pub struct UpstreamConn {
    /// The request handle.
    pub sender: http1::SendRequest<RequestBody>,
}

impl Poolable for UpstreamConn {
    fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }

    fn validate(&mut self) -> bool {
        !self.sender.is_closed() && self.sender.is_ready()
    }
}

impl Connect for HttpConnector {
    type Conn = UpstreamConn;

    async fn connect(&self, addr: SocketAddr) -> io::Result<UpstreamConn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%addr, %error, "upstream connection ended with an error");
            }
        });
        Ok(UpstreamConn { sender })
    }
}
