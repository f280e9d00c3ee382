//! A TCP relay that a test puts between a client and a shared server, to take the server away
//! from that one client without stopping it for everybody else (the cluster's Prometheus serves
//! every concurrent test): [`Relay::cut`] resets every open connection and every new one, as a
//! crashed server behind a load balancer would; [`Relay::restore`] forwards again.
//!
//! ```text
//!  operator ──► 10.244.254.1:<relay port> ──(cut: RST)──► upstream (Prometheus 10.244.254.1:9090)
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;

/// A running relay; it stops when dropped.
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    cut: AtomicBool,
    /// The forwarding tasks of open connections (finished ones are pruned on each accept).
    open: Mutex<Vec<AbortHandle>>,
    forwarded: AtomicU64,
    refused: AtomicU64,
    /// When the last connection was refused while cut, or forwarded while not.
    last_refused: Mutex<Option<Instant>>,
    last_forwarded: Mutex<Option<Instant>>,
}

impl Relay {
    /// Listens on an ephemeral port of `upstream`'s address (reachable from the pods wherever
    /// the upstream is: the node link's address, 10.244.254.1, for the cluster's Prometheus) and
    /// forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(upstream.ip(), 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            cut: AtomicBool::new(false),
            open: Mutex::new(Vec::new()),
            forwarded: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_refused: Mutex::new(None),
            last_forwarded: Mutex::new(None),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            addr,
            shared,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Takes the upstream away: open connections are reset, new ones are accepted and reset at
    /// once (the client sees "connection reset by peer").
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        for task in self.shared.open.lock().drain(..) {
            task.abort();
        }
    }

    /// Forwards new connections again.
    pub fn restore(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }

    /// Connections forwarded so far.
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::SeqCst)
    }

    /// Connections reset while cut so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// When a connection was last reset while cut.
    pub fn last_refused(&self) -> Option<Instant> {
        *self.shared.last_refused.lock()
    }

    /// When a connection was last forwarded.
    pub fn last_forwarded(&self) -> Option<Instant> {
        *self.shared.last_forwarded.lock()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if shared.cut.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            *shared.last_refused.lock() = Some(Instant::now());
            // A reset, not an orderly close: the client fails at once instead of reading EOF.
            let _ = client.set_zero_linger();
            drop(client);
            continue;
        }
        shared.forwarded.fetch_add(1, Ordering::SeqCst);
        *shared.last_forwarded.lock() = Some(Instant::now());
        let upstream = shared.upstream;
        let task = tokio::spawn(async move {
            let _ = forward(client, upstream).await;
        });
        let mut open = shared.open.lock();
        open.retain(|t| !t.is_finished());
        open.push(task.abort_handle());
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr) -> std::io::Result<()> {
    let _ = client.set_nodelay(true);
    let mut server = TcpStream::connect(upstream).await?;
    let _ = server.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// An echo server on an ephemeral port.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(addr: SocketAddr) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok(buf.to_vec())
    }

    #[tokio::test]
    async fn forwards_resets_while_cut_and_forwards_again() {
        let relay = Relay::start(echo().await).await.unwrap();
        assert_eq!(round_trip(relay.addr()).await.unwrap(), b"ping");

        // An open connection is reset by the cut.
        let mut open = TcpStream::connect(relay.addr()).await.unwrap();
        open.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        open.read_exact(&mut buf).await.unwrap();
        relay.cut();
        let mut rest = Vec::new();
        let _ = open.write_all(b"more").await;
        let read = open.read_to_end(&mut rest).await;
        assert!(
            read.is_err() || rest.is_empty(),
            "nothing comes back through a cut relay"
        );

        assert!(round_trip(relay.addr()).await.is_err());
        assert!(relay.refused() >= 1);

        relay.restore();
        assert_eq!(round_trip(relay.addr()).await.unwrap(), b"ping");
        assert!(relay.forwarded() >= 3);
    }
}
