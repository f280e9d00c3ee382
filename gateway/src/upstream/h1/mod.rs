//! An HTTP/1.1 upstream connection, written for the one exchange a proxy makes on it: a request
//! (head written in one pass from the request's parts, body streamed in its framing:
//! [`request`]), then its response (head parsed into a stack array: [`response`]; body read in
//! its framing and handed out as slices of the read buffer: [`body`]). No task, no channel, no
//! wake-up between tasks: whoever holds the connection drives it, the proxied call while it
//! sends, waits for the head and streams the body, the pool while it is idle.
//!
//! The exchange, in order:
//! 1. **Send**: the head goes into the write buffer with as much of the body as is ready (up to
//!    [`COALESCE`]), so a small request is one write; the rest of the body follows as it comes.
//! 2. **Head**: bytes are read until a whole response head is there; informational heads (1xx)
//!    are skipped. The backend may answer before the request body is all sent (a refusal, say):
//!    the body keeps going out while the response streams, and the connection is closed after
//!    the exchange.
//! 3. **Body**: frames are decoded from the read buffer as the response body is polled; the
//!    exchange ends with the body's last byte.
//! 4. **Idle**: the connection holds no buffer; the pool's checks read it with a no-op waker
//!    (a FIN, a reset or bytes nobody asked for close it).
//!
//! A connection carries another request only when the exchange ended cleanly: the whole
//! request written, the whole response read, nothing read past it, and the backend keeping it
//! open ([`response`] says when it does not). Anything else closes it, so that no byte of one
//! exchange is ever read as part of the next.

use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::time::Instant;

use self::body::{Decoded, Decoder};
use self::request::{BodyEncoder, FramingError};
use self::response::HeadReader;
use super::send_error::{SendError, UpstreamError};
use super::transport::{Peek, Transport, peek};
use crate::proxy::body::RequestBody;

mod body;
mod request;
mod response;
#[cfg(test)]
mod tests;

/// How much of a request body is gathered behind the head (and between writes) before it is
/// written: a typical model request is one write.
const COALESCE: usize = 64 * 1024;

/// How much the read buffer grows by when it runs out of room.
const READ_CHUNK: usize = 8 * 1024;

/// One HTTP/1.1 connection to an endpoint.
pub(crate) struct H1Conn {
    io: Transport,
    pub(super) addr: SocketAddr,
    pub(super) opened: Instant,
    /// Over TLS: the `Host` of every request (the server name), when it is a DNS name.
    authority: Option<HeaderValue>,
    /// Bytes read and not yet taken (empty, without capacity, between exchanges).
    read: BytesMut,
    /// Bytes to write from `written` on (empty, without capacity, between exchanges).
    write: Vec<u8>,
    written: usize,
    state: State,
}

#[derive(Debug)]
enum State {
    /// Ready for a request.
    Idle,
    /// An exchange in progress.
    Busy(Exchange),
    /// Closed, or unfit for another request: it is closed when the pool next looks at it.
    Done,
}

#[derive(Debug)]
struct Exchange {
    /// The request body still going out (`None` once it is all written, or failed).
    tx: Option<Tx>,
    /// Whether the request went out whole (a failed body leaves the connection unfit).
    tx_whole: bool,
    rx: Rx,
    heads: HeadReader,
    /// A `HEAD` request: its response has no body.
    head_request: bool,
    /// A byte of a response arrived (a `1xx` counts).
    answered: bool,
    /// The backend keeps the connection open after the response (and answered only after the
    /// whole request).
    keep_alive: bool,
}

struct Tx {
    body: RequestBody,
    encoder: BodyEncoder,
    trailers: Option<HeaderMap>,
    /// The body's end was encoded (the write buffer holds the rest of the request).
    ended: bool,
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("encoder", &self.encoder)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl Tx {
    /// Encodes the body frames that are ready behind what `write` holds (up to [`COALESCE`])
    /// and writes `write[written..]` to `io`, until the request is all written (`Ready(Ok)`),
    /// something fails, or the body or the socket must be waited for.
    fn pump(
        &mut self,
        io: &mut Transport,
        write: &mut Vec<u8>,
        written: &mut usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), TxError>> {
        loop {
            while !self.ended && write.len() - *written < COALESCE {
                match Pin::new(&mut self.body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => self.encoder.data(write, &data).map_err(TxError::Framing)?,
                        Err(frame) => {
                            if let Ok(trailers) = frame.into_trailers() {
                                self.trailers = Some(trailers);
                            }
                        }
                    },
                    Poll::Ready(None) => {
                        self.encoder
                            .end(write, self.trailers.as_ref())
                            .map_err(TxError::Framing)?;
                        self.ended = true;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(TxError::Body(e))),
                    Poll::Pending => break,
                }
            }
            if *written < write.len() {
                let n = ready!(Pin::new(&mut *io).poll_write(cx, &write[*written..]))
                    .map_err(TxError::Io)?;
                if n == 0 {
                    return Poll::Ready(Err(TxError::Io(io::ErrorKind::WriteZero.into())));
                }
                *written += n;
                continue;
            }
            write.clear();
            *written = 0;
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            // The body has nothing ready: its poll registered the waker.
            return Poll::Pending;
        }
    }
}

#[derive(Debug)]
enum Rx {
    Head,
    Body(Decoder),
}

/// Why the request could not go out.
#[derive(Debug)]
enum TxError {
    /// The client's body failed (its error: the client's doing).
    Body(UpstreamError),
    Framing(FramingError),
    Io(io::Error),
}

impl std::fmt::Debug for H1Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H1Conn")
            .field("addr", &self.addr)
            .field("tls", &self.io.is_tls())
            .field("state", &self.state)
            .finish()
    }
}

impl H1Conn {
    /// A connection over `io` (its TLS handshake done), to `addr`.
    pub(super) fn new(io: Transport, addr: SocketAddr, authority: Option<HeaderValue>) -> Self {
        Self {
            io,
            addr,
            opened: Instant::now(),
            authority,
            read: BytesMut::new(),
            write: Vec::new(),
            written: 0,
            state: State::Idle,
        }
    }

    /// The socket.
    #[cfg(test)]
    pub(super) fn socket(&self) -> &super::transport::Socket {
        self.io.socket()
    }

    /// Whether the connection can take a request now: idle (an exchange that ended cleanly
    /// counts), and the backend has not closed it or sent bytes nobody asked for (read with a
    /// no-op waker: no syscall unless the socket became readable).
    pub(super) fn is_open(&mut self) -> bool {
        self.settle();
        if !matches!(self.state, State::Idle) {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        match Pin::new(&mut self.io).poll_read(&mut cx, &mut buf) {
            Poll::Pending => true,
            Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                self.state = State::Done;
                false
            }
            Poll::Ready(_) => {
                tracing::debug!(addr = %self.addr, "idle upstream connection closed or sent unasked bytes");
                self.state = State::Done;
                false
            }
        }
    }

    /// [`Self::is_open`], then asks the kernel whether the peer sent a FIN or a reset (for a
    /// connection idle long enough that the runtime's view may be stale).
    pub(super) fn validate(&mut self) -> bool {
        if !self.is_open() {
            return false;
        }
        match peek(&self.io.socket().tcp) {
            Peek::Quiet => true,
            // TLS records the connection has not read yet: a ticket, a key update.
            Peek::Unexpected if self.io.is_tls() => true,
            found => {
                tracing::debug!(addr = %self.addr, ?found, "idle upstream connection found dead before reuse");
                self.state = State::Done;
                false
            }
        }
    }

    /// Sends `req` and waits for the response head, driving the connection. A request that
    /// finds the connection unfit comes back in the error; one that was (maybe in part)
    /// written says whether the backend closed the connection before any byte of a response.
    pub(super) async fn send(
        &mut self,
        req: Request<RequestBody>,
    ) -> Result<Response<()>, SendError> {
        if !self.is_open() {
            return Err(SendError::Unsent(
                Box::new(req),
                "the upstream connection is closed".into(),
            ));
        }
        let (parts, body) = req.into_parts();
        let (framing, extra) = match request::framing(
            &parts.headers,
            body.is_end_stream(),
            body.size_hint().exact(),
        ) {
            Ok(framing) => framing,
            Err(e) => return Err(SendError::Failed(e.into())),
        };
        self.write.clear();
        self.written = 0;
        request::write_head(
            &mut self.write,
            &parts,
            extra.as_ref(),
            self.authority.as_ref(),
        );
        self.state = State::Busy(Exchange {
            tx: Some(Tx {
                body,
                encoder: BodyEncoder::new(framing),
                trailers: None,
                ended: false,
            }),
            tx_whole: false,
            rx: Rx::Head,
            heads: HeadReader::default(),
            head_request: parts.method == Method::HEAD,
            answered: false,
            keep_alive: false,
        });
        poll_fn(|cx| self.poll_head(cx)).await
    }

    /// Step 1 and 2: the request out, the response head in.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<()>, SendError>> {
        let mut tx_failed = None;
        if let Poll::Ready(Err(e)) = self.poll_tx(cx) {
            match e {
                TxError::Body(e) => {
                    self.state = State::Done;
                    return Poll::Ready(Err(SendError::Failed(e)));
                }
                TxError::Framing(e) => {
                    self.state = State::Done;
                    return Poll::Ready(Err(SendError::Failed(e.into())));
                }
                // The backend may have answered before it closed (a refusal of the body).
                TxError::Io(e) => tx_failed = Some(e),
            }
        }
        loop {
            let State::Busy(exchange) = &mut self.state else {
                return Poll::Ready(Err(SendError::Failed(
                    "the upstream connection ended".into(),
                )));
            };
            match exchange.heads.read(&mut self.read, exchange.head_request) {
                Ok(Some(head)) if head.status.is_informational() => continue,
                Ok(Some(head)) => {
                    // An answer before the whole request: the backend may not read the rest,
                    // and the connection's two directions no longer agree on where a message
                    // starts. It carries no other exchange.
                    exchange.keep_alive = head.keep_alive && exchange.tx.is_none();
                    exchange.rx = Rx::Body(Decoder::new(head.body));
                    let mut response = Response::new(());
                    *response.status_mut() = head.status;
                    *response.version_mut() = head.version;
                    *response.headers_mut() = head.headers;
                    return Poll::Ready(Ok(response));
                }
                Ok(None) => {}
                Err(e) => {
                    self.state = State::Done;
                    return Poll::Ready(Err(SendError::Failed(e.into())));
                }
            }
            let answered = exchange.answered;
            match self.poll_read(cx) {
                Poll::Ready(Ok(0)) => {
                    let error = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the backend closed the connection before a whole response head",
                    );
                    return Poll::Ready(Err(self.failed(answered, error)));
                }
                Poll::Ready(Ok(_)) => {
                    if let State::Busy(exchange) = &mut self.state {
                        exchange.answered = true;
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(self.failed(answered, e))),
                Poll::Pending => {
                    return match tx_failed {
                        Some(e) => Poll::Ready(Err(self.failed(answered, e))),
                        None => Poll::Pending,
                    };
                }
            }
        }
    }

    /// The error of an exchange whose connection failed under it: the backend closing it
    /// before any byte of a response leaves the request unanswered (it may go again).
    fn failed(&mut self, answered: bool, error: io::Error) -> SendError {
        self.state = State::Done;
        let by_peer = matches!(
            error.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
        );
        if by_peer && !answered {
            SendError::ClosedUnanswered(error.into())
        } else {
            SendError::Failed(error.into())
        }
    }

    /// Moves the request out as far as it can go now: body frames that are ready are encoded
    /// behind what is buffered (up to [`COALESCE`]), the buffer is written. `Ready(Ok)` once
    /// the whole request is written (or there is none going out).
    fn poll_tx(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TxError>> {
        let State::Busy(exchange) = &mut self.state else {
            return Poll::Ready(Ok(()));
        };
        let Some(tx) = exchange.tx.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let polled = tx.pump(&mut self.io, &mut self.write, &mut self.written, cx);
        if let Poll::Ready(result) = &polled {
            // Sent whole, or failed: nothing more goes out on this exchange.
            exchange.tx = None;
            exchange.tx_whole = result.is_ok();
            self.write = Vec::new();
            self.written = 0;
        }
        polled
    }

    /// Reads more bytes into the read buffer: `Ok(0)` at the connection's end of stream.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.read.capacity() - self.read.len() < READ_CHUNK / 4 {
            self.read.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// Step 3: the next frame of the response body, read off the connection (the rest of the
    /// request body goes out meanwhile, when the backend answered before it had it all).
    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        if let Poll::Ready(Err(e)) = self.poll_tx(cx) {
            // The backend answered and stopped reading: the connection goes after this.
            tracing::debug!(addr = %self.addr, error = ?e, "request body not sent whole before the response");
        }
        loop {
            let State::Busy(Exchange {
                rx: Rx::Body(decoder),
                ..
            }) = &mut self.state
            else {
                return Poll::Ready(None);
            };
            match decoder.decode(&mut self.read) {
                Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(Decoded::Trailers(trailers)) => {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                Ok(Decoded::End) => {
                    self.settle();
                    return Poll::Ready(None);
                }
                Ok(Decoded::Need) => {}
                Err(e) => {
                    self.state = State::Done;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
            match self.poll_read(cx) {
                Poll::Ready(Ok(0)) => {
                    let State::Busy(exchange) = &mut self.state else {
                        return Poll::Ready(None);
                    };
                    let Rx::Body(decoder) = &mut exchange.rx else {
                        return Poll::Ready(None);
                    };
                    // Read until close: complete, and the connection is gone.
                    exchange.keep_alive = false;
                    return match decoder.eof() {
                        Ok(_) => Poll::Ready(None),
                        Err(e) => {
                            self.state = State::Done;
                            Poll::Ready(Some(Err(e.into())))
                        }
                    };
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    self.state = State::Done;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Whether the response body is complete.
    pub(super) fn body_ended(&self) -> bool {
        match &self.state {
            State::Busy(Exchange {
                rx: Rx::Body(decoder),
                ..
            }) => decoder.is_done(),
            _ => true,
        }
    }

    /// The response body's size, as far as its framing tells.
    pub(super) fn body_size_hint(&self) -> SizeHint {
        match &self.state {
            State::Busy(Exchange {
                rx: Rx::Body(decoder),
                ..
            }) => decoder
                .remaining()
                .map_or_else(SizeHint::default, SizeHint::with_exact),
            _ => SizeHint::with_exact(0),
        }
    }

    /// Step 4: an exchange that is over becomes idle (both bodies whole, nothing read past the
    /// response, the backend keeping the connection) or done; buffers are let go.
    fn settle(&mut self) {
        let State::Busy(exchange) = &self.state else {
            return;
        };
        let Rx::Body(decoder) = &exchange.rx else {
            return;
        };
        if !decoder.is_done() {
            return;
        }
        let reusable = exchange.keep_alive
            && exchange.tx_whole
            && exchange.tx.is_none()
            && self.read.is_empty();
        if !reusable && !self.read.is_empty() {
            tracing::debug!(addr = %self.addr, extra = self.read.len(), "the backend sent bytes past the response; closing the connection");
        }
        self.state = if reusable { State::Idle } else { State::Done };
        self.read = BytesMut::new();
        self.write = Vec::new();
        self.written = 0;
    }

    /// Closes the connection: the gateway's FIN (plain) or `close_notify` and FIN (TLS), then
    /// whatever the backend still sends is read and dropped until it closes its side.
    pub(super) fn close(self) -> impl Future<Output = ()> + Send + 'static {
        let Self { mut io, .. } = self;
        // Plain: the FIN at once, whether or not the future runs.
        let shut = (!io.is_tls())
            .then(|| socket2::SockRef::from(&io.socket().tcp).shutdown(std::net::Shutdown::Write));
        async move {
            let shut = match shut {
                Some(done) => done,
                None => io.shutdown().await,
            };
            if shut.is_ok() {
                // Until the peer's FIN (0) or an error (a reset): the rest of a response the
                // client gave up on is dropped.
                let _ = tokio::io::copy(&mut io, &mut tokio::io::sink()).await;
            }
        }
    }
}
