//! The socket under an upstream connection: shared between the connection, which reads and
//! writes it (through [`Transport`], plain or TLS, counting the bytes of responses read), and its
//! checks ([`peek`]: what the kernel holds for an idle socket).

use std::io;
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::frames::FrameWatch;

/// The upstream socket, shared by the connection's reads and writes and its checks.
#[derive(Debug)]
pub(super) struct Socket {
    pub(super) tcp: TcpStream,
}

impl Socket {
    /// A socket over `tcp`.
    pub(super) fn new(tcp: TcpStream) -> Arc<Self> {
        Arc::new(Self { tcp })
    }
}

/// What a connection reads and writes (the gateway's own HTTP/1.1 one, hyper's HTTP/2 one): the
/// shared socket itself, or TLS over it. Over HTTP/2 it shows the bytes read to the
/// connection's [`FrameWatch`].
#[derive(Debug)]
pub(super) struct Transport {
    io: Io,
    socket: Arc<Socket>,
    frames: Option<FrameWatch>,
}

#[derive(Debug)]
enum Io {
    Plain(SharedStream),
    Tls(Box<TlsStream<SharedStream>>),
}

impl Transport {
    /// The socket in plain text.
    pub(super) fn plain(socket: Arc<Socket>) -> Self {
        Self {
            io: Io::Plain(SharedStream(socket.clone())),
            socket,
            frames: None,
        }
    }

    /// TLS over the socket, after its handshake.
    pub(super) fn tls(tls: TlsStream<SharedStream>, socket: Arc<Socket>) -> Self {
        Self {
            io: Io::Tls(Box::new(tls)),
            socket,
            frames: None,
        }
    }

    /// Shows every byte read from now on to `frames` (an HTTP/2 connection's).
    pub(super) fn watched(mut self, frames: FrameWatch) -> Self {
        self.frames = Some(frames);
        self
    }

    /// Whether it is TLS.
    pub(super) fn is_tls(&self) -> bool {
        matches!(self.io, Io::Tls(_))
    }

    /// The socket.
    pub(super) fn socket(&self) -> &Arc<Socket> {
        &self.socket
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let result = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        if let Some(frames) = &mut this.frames {
            frames.feed(&buf.filled()[before..]);
        }
        result
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// Plain: the write side's FIN. TLS: a `close_notify`, then the FIN.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The upstream socket, shared by the connection (which reads and writes it through this) and
/// its checks.
#[derive(Debug)]
pub(super) struct SharedStream(pub(super) Arc<Socket>);

impl AsyncRead for SharedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let tcp = &self.0.tcp;
        loop {
            ready!(tcp.poll_read_ready(cx))?;
            let room = buf.remaining();
            let mut read = None;
            // Into the buffer's uninitialised part as it is (a read buffer is large and fresh
            // on every read: zeroing it first would cost a memset per read). A read shorter
            // than the room emptied the socket: the readiness seen before it is cleared (as a
            // `WouldBlock` would), so that the next look at an idle connection costs no
            // `recv` that can only say `EAGAIN`. Readiness that arrived after the read is newer
            // and stays, and so does a peer's FIN (tokio never clears a closed side).
            let outcome = tcp.try_io(Interest::READABLE, || {
                let n = tcp.try_read_buf(buf)?;
                read = Some(n);
                if n > 0 && n < room {
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Ok(n)
                }
            });
            match (read, outcome) {
                (Some(_), _) => return Poll::Ready(Ok(())),
                // Readiness was stale (the read cleared it): wait again.
                (None, Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
                (None, Err(e)) => return Poll::Ready(Err(e)),
                (None, Ok(_)) => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.tcp.poll_write_ready(cx))?;
            match self.0.tcp.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.tcp.poll_write_ready(cx))?;
            match self.0.tcp.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&self.0.tcp).shutdown(Shutdown::Write))
    }
}

/// What the kernel says of an idle connection's socket, without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peek {
    /// Nothing to read: the peer has not closed it.
    Quiet,
    /// The peer closed its side (FIN).
    Closed,
    /// The connection was reset, or failed.
    Failed,
    /// The peer sent bytes nobody asked for: the connection cannot carry a request.
    Unexpected,
}

/// Asks the kernel (a non-blocking `MSG_PEEK` of one byte) what an idle socket holds.
pub fn peek(stream: &TcpStream) -> Peek {
    let mut byte = [MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(stream).peek(&mut byte) {
        Ok(0) => Peek::Closed,
        Ok(_) => Peek::Unexpected,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Peek::Quiet,
        Err(_) => Peek::Failed,
    }
}
