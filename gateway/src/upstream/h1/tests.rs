//! The HTTP/1.1 upstream connection against real sockets: exchanges end to end, reuse and its
//! refusals, the backend closing or answering early, and a differential property: over
//! generated responses (framings, chunk splits, extensions, trailers, 1xx heads, segments as
//! they arrive), the connection reads the same status, fields, body and trailers as hyper's
//! client, and fails where it fails.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt as _, Full};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::upstream::transport::Socket;

/// A connection to a fresh listener, and the backend's end.
async fn pair() -> (H1Conn, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tcp, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let socket = Socket::new(tcp.unwrap());
    let conn = H1Conn::new(Transport::plain(socket), addr, None);
    (conn, accepted.unwrap().0)
}

fn request(method: &str, body: &'static [u8], headers: &[(&str, &str)]) -> Request<RequestBody> {
    let mut req = Request::builder().method(method).uri("/v1/chat");
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    req.body(
        Full::new(Bytes::from_static(body))
            .map_err(Into::into)
            .boxed_unsync(),
    )
    .unwrap()
}

/// Reads one request head (and what came with it) off the backend's end.
async fn read_request(peer: &mut TcpStream, until: &[u8]) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(until.len()).any(|w| w == until) {
        let n = peer.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the request ended early: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// What the backend does after its answer.
#[derive(Clone, Copy, PartialEq)]
enum Then {
    Keep,
    Close,
}

/// A GET on `conn` that the backend reads to its blank line and answers with `bytes`, then
/// keeps the connection (handed back) or closes it.
async fn answer(
    conn: &mut H1Conn,
    mut peer: TcpStream,
    bytes: &'static [u8],
    then: Then,
) -> (Result<Response<()>, SendError>, Option<TcpStream>) {
    tokio::join!(conn.send(request("GET", b"", &[])), async move {
        read_request(&mut peer, b"\r\n\r\n").await;
        peer.write_all(bytes).await.unwrap();
        (then == Then::Keep).then_some(peer)
    })
}

/// Whether `conn` is seen closed within half a second (a FIN or bytes reach it in their time).
async fn closes_soon(conn: &mut H1Conn) -> bool {
    for _ in 0..100 {
        if !conn.is_open() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// The whole response body through the connection: data, trailers, or the error.
async fn drain(conn: &mut H1Conn) -> (Vec<u8>, Option<HeaderMap>, Option<String>) {
    let mut data = Vec::new();
    let mut trailers = None;
    loop {
        match poll_fn(|cx| conn.poll_frame(cx)).await {
            None => return (data, trailers, None),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            },
            Some(Err(e)) => return (data, trailers, Some(e.to_string())),
        }
    }
}

#[tokio::test]
async fn an_exchange_goes_out_in_one_write_and_the_connection_is_reused_without_buffers() {
    let (mut conn, mut peer) = pair().await;
    for round in 0..3 {
        let req = request(
            "POST",
            b"{\"prompt\":1}",
            &[("host", "model-a"), ("content-length", "12")],
        );
        let (sent, ()) = tokio::join!(conn.send(req), async {
            let got = read_request(&mut peer, b"{\"prompt\":1}").await;
            assert_eq!(
                String::from_utf8(got).unwrap(),
                "POST /v1/chat HTTP/1.1\r\nhost: model-a\r\ncontent-length: 12\r\n\r\n{\"prompt\":1}"
            );
            peer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Round: r\r\n\r\nhello")
                .await
                .unwrap();
        });
        let head = sent.unwrap();
        assert_eq!(head.status(), 200, "round {round}");
        assert_eq!(head.headers()["x-round"], "r");
        assert_eq!(conn.body_size_hint().exact(), Some(5));
        let (body, trailers, error) = drain(&mut conn).await;
        assert_eq!(
            (body.as_slice(), trailers, error),
            (&b"hello"[..], None, None)
        );
        assert!(conn.body_ended());
        assert!(conn.is_open(), "reusable after round {round}");
        assert_eq!(
            conn.read.capacity(),
            0,
            "an idle connection holds no read buffer"
        );
        assert_eq!(conn.write.capacity(), 0, "nor a write buffer");
    }
}

#[tokio::test]
async fn a_body_of_unknown_size_is_chunked_and_trailers_go_after_the_last_chunk() {
    let (mut conn, mut peer) = pair().await;
    let (tx, body) = channel_body();
    let req = Request::post("/v1/upload").body(body).unwrap();
    let backend = async {
        tx.send(Frame::data(Bytes::from_static(b"abc")))
            .await
            .unwrap();
        tx.send(Frame::data(Bytes::from_static(b"defghijklmnopq")))
            .await
            .unwrap();
        let mut trailers = HeaderMap::new();
        trailers.insert("x-sum", HeaderValue::from_static("7"));
        tx.send(Frame::trailers(trailers)).await.unwrap();
        drop(tx);
        let got = read_request(&mut peer, b"\r\n0\r\nx-sum: 7\r\n\r\n").await;
        let text = String::from_utf8(got).unwrap();
        assert!(
            text.starts_with("POST /v1/upload HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"),
            "{text}"
        );
        assert!(text.contains("3\r\nabc\r\n"), "{text}");
        assert!(text.contains("e\r\ndefghijklmnopq\r\n"), "{text}");
        peer.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            .await
            .unwrap();
    };
    let (sent, ()) = tokio::join!(conn.send(req), backend);
    assert_eq!(sent.unwrap().status(), 204);
    assert!(conn.body_ended(), "a 204 has no body");
    assert!(conn.is_open());
}

/// A request body that yields what the test sends, as it sends it.
struct Channel(tokio::sync::mpsc::Receiver<Frame<Bytes>>);

impl Body for Channel {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

fn channel_body() -> (tokio::sync::mpsc::Sender<Frame<Bytes>>, RequestBody) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    (tx, Channel(rx).boxed_unsync())
}

#[tokio::test]
async fn a_backend_closing_before_any_answer_leaves_the_request_unanswered() {
    let (mut conn, peer) = pair().await;
    let (sent, _) = answer(&mut conn, peer, b"", Then::Close).await;
    assert!(
        matches!(sent, Err(SendError::ClosedUnanswered(_))),
        "{sent:?}"
    );
    assert!(!conn.is_open());

    let (mut conn, peer) = pair().await;
    let (sent, _) = answer(&mut conn, peer, b"HTTP/1.1 200 OK\r\nContent-", Then::Close).await;
    assert!(
        matches!(sent, Err(SendError::Failed(_))),
        "a response began: not to be sent again blindly: {sent:?}"
    );

    // Closed while idle: the next request finds it so before anything is written.
    let (mut conn, peer) = pair().await;
    drop(peer);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let sent = conn.send(request("POST", b"x", &[])).await;
    assert!(matches!(sent, Err(SendError::Unsent(..))), "{sent:?}");
}

#[tokio::test]
async fn informational_heads_are_skipped_and_a_head_request_reads_no_body() {
    let (mut conn, mut peer) = pair().await;
    let (sent, ()) = tokio::join!(
        conn.send(request("POST", b"{}", &[("expect", "100-continue")])),
        async {
            read_request(&mut peer, b"{}").await;
            peer.write_all(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
            )
            .await
            .unwrap();
            peer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
        }
    );
    let head = sent.unwrap();
    assert_eq!(head.status(), 200);
    assert!(
        !head.headers().contains_key("link"),
        "the 103's fields are not the response's"
    );
    assert_eq!(drain(&mut conn).await.0, b"ok");
    assert!(conn.is_open());

    let (sent, ()) = tokio::join!(conn.send(request("HEAD", b"", &[])), async {
        read_request(&mut peer, b"\r\n\r\n").await;
        peer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n")
            .await
            .unwrap();
    });
    assert_eq!(sent.unwrap().headers()["content-length"], "5000");
    assert!(conn.body_ended(), "the answer to a HEAD has no body");
    assert!(conn.is_open(), "and the connection stays in step");
}

#[tokio::test]
async fn a_connection_is_not_reused_unless_the_exchange_ended_cleanly() {
    // Connection: close.
    let (mut conn, peer) = pair().await;
    let (sent, _peer) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\n!",
        Then::Keep,
    )
    .await;
    sent.unwrap();
    assert_eq!(drain(&mut conn).await.0, b"!");
    assert!(!conn.is_open());

    // Bytes past the response's end.
    let (mut conn, peer) = pair().await;
    let (sent, _peer) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n!HTTP/1.1 200 OK\r\n",
        Then::Keep,
    )
    .await;
    sent.unwrap();
    assert_eq!(drain(&mut conn).await.0, b"!");
    assert!(
        !conn.is_open(),
        "a second response nobody asked for is never handed to the next call"
    );

    // Read until close.
    let (mut conn, peer) = pair().await;
    let (sent, _) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        Then::Close,
    )
    .await;
    sent.unwrap();
    let (body, _, error) = drain(&mut conn).await;
    assert_eq!((body.as_slice(), error), (&b"until the end"[..], None));
    assert!(!conn.is_open());

    // Cut short.
    let (mut conn, peer) = pair().await;
    let (sent, _) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        Then::Close,
    )
    .await;
    sent.unwrap();
    let (body, _, error) = drain(&mut conn).await;
    assert_eq!(body, b"short");
    assert!(error.unwrap().contains("5 bytes before the end"));
    assert!(!conn.is_open());
}

#[tokio::test]
async fn an_early_answer_lets_the_request_body_finish_and_then_closes() {
    let (mut conn, mut peer) = pair().await;
    let (tx, body) = channel_body();
    let req = Request::post("/v1/upload")
        .header("content-length", "6")
        .body(body)
        .unwrap();
    tx.send(Frame::data(Bytes::from_static(b"abc")))
        .await
        .unwrap();
    let (sent, ()) = tokio::join!(conn.send(req), async {
        read_request(&mut peer, b"abc").await;
        peer.write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\n\r\nbig!")
            .await
            .unwrap();
    });
    assert_eq!(sent.unwrap().status(), 413);
    // The rest of the body still goes out while the response is read.
    tx.send(Frame::data(Bytes::from_static(b"def")))
        .await
        .unwrap();
    drop(tx);
    let (body, _, error) = drain(&mut conn).await;
    assert_eq!((body.as_slice(), error), (&b"big!"[..], None));
    let rest = read_request(&mut peer, b"def").await;
    assert_eq!(rest, b"def");
    assert!(
        !conn.is_open(),
        "answered before the request ended: closed after the exchange"
    );

    // A body that breaks is the client's failure, and the connection goes.
    let (mut conn, _peer) = pair().await;
    let req = Request::post("/v1/upload")
        .header("content-length", "9")
        .body(
            Full::new(Bytes::from_static(b"abc"))
                .map_err(Into::into)
                .boxed_unsync(),
        )
        .unwrap();
    let sent = conn.send(req).await;
    let Err(SendError::Failed(error)) = sent else {
        panic!("a body short of its length must fail the exchange: {sent:?}");
    };
    assert!(error.to_string().contains("6 bytes short"), "{error}");
    assert!(!conn.is_open());
}

// === the same responses read by hyper's client ===

/// One generated response: its bytes, how they are cut into writes, and whether the backend
/// closes after them.
#[derive(Clone, Debug)]
struct Scripted {
    bytes: Vec<u8>,
    cuts: Vec<usize>,
    close: bool,
    head_request: bool,
}

/// What a client read of a response.
#[derive(Debug, PartialEq)]
struct Read {
    status: Option<u16>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
    failed: bool,
}

fn fields(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// A backend that answers the first request on each connection with `script`.
async fn serve(listener: TcpListener, script: Scripted) {
    loop {
        let Ok((mut peer, _)) = listener.accept().await else {
            return;
        };
        let script = script.clone();
        tokio::spawn(async move {
            read_request(&mut peer, b"\r\n\r\n").await;
            let mut at = 0;
            for cut in script.cuts.iter().copied().chain([script.bytes.len()]) {
                let cut = cut.clamp(at, script.bytes.len());
                if peer.write_all(&script.bytes[at..cut]).await.is_err() {
                    return;
                }
                at = cut;
                tokio::task::yield_now().await;
            }
            if script.close {
                return;
            }
            // Held open until the client goes.
            let _ = peer.read(&mut [0u8; 64]).await;
        });
    }
}

async fn read_with_ours(addr: SocketAddr, head_request: bool) -> Read {
    let socket = Socket::new(TcpStream::connect(addr).await.unwrap());
    let mut conn = H1Conn::new(Transport::plain(socket), addr, None);
    let method = if head_request { "HEAD" } else { "GET" };
    match conn
        .send(request(method, b"", &[("host", "backend")]))
        .await
    {
        Err(_) => Read {
            status: None,
            headers: vec![],
            body: vec![],
            trailers: vec![],
            failed: true,
        },
        Ok(head) => {
            let (body, trailers, error) = drain(&mut conn).await;
            Read {
                status: Some(head.status().as_u16()),
                headers: fields(head.headers()),
                body,
                trailers: trailers.as_ref().map(fields).unwrap_or_default(),
                failed: error.is_some(),
            }
        }
    }
}

async fn read_with_hyper(addr: SocketAddr, head_request: bool) -> Read {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, driver) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(driver);
    let method = if head_request {
        Method::HEAD
    } else {
        Method::GET
    };
    let req = Request::builder()
        .method(method)
        .uri("/v1/chat")
        .header("host", "backend")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    match sender.send_request(req).await {
        Err(_) => Read {
            status: None,
            headers: vec![],
            body: vec![],
            trailers: vec![],
            failed: true,
        },
        Ok(response) => {
            let status = Some(response.status().as_u16());
            let headers = fields(response.headers());
            let mut body = response.into_body();
            let (mut data, mut trailers, mut failed) = (Vec::new(), Vec::new(), false);
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(frame) => match frame.into_data() {
                        Ok(d) => data.extend_from_slice(&d),
                        Err(f) => {
                            trailers = f.into_trailers().map(|t| fields(&t)).unwrap_or_default()
                        }
                    },
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            Read {
                status,
                headers,
                body: data,
                trailers,
                failed,
            }
        }
    }
}

/// Responses as a backend might frame them: a status (with 1xx heads before it, sometimes),
/// ordinary fields, then a length body (whole, or cut short by a close), a chunked one (chunks
/// of any size, extensions, trailers), or one read until close.
fn scripted() -> impl Strategy<Value = Scripted> {
    let field = ("x-[a-z]{1,8}", "[ -~]{0,20}").prop_map(|(n, v)| format!("{n}: {}\r\n", v.trim()));
    let chunk = (
        proptest::collection::vec(any::<u8>(), 1..40),
        prop::option::of("[a-z]{1,5}(=[a-z0-9]{1,5})?"),
    );
    let framing = prop_oneof![
        (
            proptest::collection::vec(any::<u8>(), 0..200),
            any::<bool>()
        )
            .prop_map(|(body, short)| (0u8, body, short, vec![], vec![])),
        (
            proptest::collection::vec(chunk, 0..6),
            proptest::collection::vec(("x-t[a-z]{1,5}", "[a-z0-9]{1,8}"), 0..3)
        )
            .prop_map(|(chunks, trailers)| (1u8, vec![], false, chunks, trailers)),
        proptest::collection::vec(any::<u8>(), 0..200).prop_map(|body| (
            2u8,
            body,
            false,
            vec![],
            vec![]
        )),
    ];
    (
        prop::sample::select(vec![200u16, 201, 204, 304, 404, 500, 503]),
        any::<bool>(),
        proptest::collection::vec(field, 0..6),
        framing,
        proptest::collection::vec(0usize..400, 0..5),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(
                status,
                informational,
                fields,
                (kind, body, short, chunks, trailers),
                mut cuts,
                close,
                head_request,
            )| {
                let mut out = Vec::new();
                if informational {
                    out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                }
                out.extend_from_slice(format!("HTTP/1.1 {status} Status\r\n").as_bytes());
                for f in &fields {
                    out.extend_from_slice(f.as_bytes());
                }
                let bodiless = head_request || matches!(status, 204 | 304);
                let mut close = close;
                match kind {
                    0 => {
                        let sent = if short && !body.is_empty() {
                            body.len() / 2
                        } else {
                            body.len()
                        };
                        out.extend_from_slice(
                            format!("content-length: {}\r\n\r\n", body.len()).as_bytes(),
                        );
                        if !bodiless {
                            out.extend_from_slice(&body[..sent]);
                            close |= sent < body.len();
                        }
                    }
                    1 => {
                        out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
                        if !bodiless {
                            for (data, ext) in &chunks {
                                let ext = ext.as_ref().map(|e| format!(";{e}")).unwrap_or_default();
                                out.extend_from_slice(
                                    format!("{:x}{ext}\r\n", data.len()).as_bytes(),
                                );
                                out.extend_from_slice(data);
                                out.extend_from_slice(b"\r\n");
                            }
                            out.extend_from_slice(b"0\r\n");
                            for (n, v) in &trailers {
                                out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
                            }
                            out.extend_from_slice(b"\r\n");
                        }
                    }
                    _ => {
                        out.extend_from_slice(b"\r\n");
                        if !bodiless {
                            out.extend_from_slice(&body);
                            close = true;
                        }
                    }
                }
                cuts.sort_unstable();
                Scripted {
                    bytes: out,
                    cuts,
                    close,
                    head_request,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Whatever the framing and however the bytes arrive, the connection reads what hyper's
    /// client reads: the same status, fields, body bytes and trailers, and fails where it fails.
    #[test]
    fn responses_read_as_hyper_reads_them(script in scripted()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (ours, theirs) = runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = tokio::spawn(serve(listener, script.clone()));
            let limit = Duration::from_secs(5);
            let ours = tokio::time::timeout(limit, read_with_ours(addr, script.head_request)).await;
            let theirs = tokio::time::timeout(limit, read_with_hyper(addr, script.head_request)).await;
            server.abort();
            (ours.expect("ours hung"), theirs.expect("hyper hung"))
        });
        prop_assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(&script.bytes));
    }
}

/// A read that empties the socket clears the readiness it saw (an idle connection's next check
/// costs no `recv`): a FIN that came with the response's last bytes, or after them, is still
/// seen, and so are bytes that arrive later.
#[tokio::test]
async fn a_fin_with_the_last_bytes_of_a_response_is_still_seen_when_idle() {
    let (mut conn, peer) = pair().await;
    let (sent, _) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        Then::Close,
    )
    .await;
    sent.unwrap();
    assert_eq!(drain(&mut conn).await.0, b"ok");
    assert!(
        closes_soon(&mut conn).await,
        "the backend's FIN must be noticed on the idle connection"
    );

    // Bytes nobody asked for, arriving after a response was read whole.
    let (mut conn, peer) = pair().await;
    let (sent, peer) = answer(
        &mut conn,
        peer,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        Then::Keep,
    )
    .await;
    let mut peer = peer.expect("kept open");
    sent.unwrap();
    assert_eq!(drain(&mut conn).await.0, b"ok");
    assert!(conn.is_open());
    peer.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
    assert!(
        closes_soon(&mut conn).await,
        "bytes after the idle check cleared the readiness must still be seen"
    );
}

// === the same requests written by hyper's client ===

/// One generated request: its method, fields, body and how the body comes.
#[derive(Clone, Debug)]
struct Outgoing {
    method: Method,
    target: String,
    fields: Vec<(String, String)>,
    body: Sent,
    /// The body's own `Content-Length` field (its true length).
    length_field: bool,
    /// Trailer fields, announced in a `Trailer` field (hyper's client sends only those).
    trailers: Vec<(String, String)>,
}

/// How a request body comes to the connection.
#[derive(Clone, Debug)]
enum Sent {
    /// No body (its end at once).
    Empty,
    /// One frame of known size.
    Whole(Vec<u8>),
    /// Frames of unknown size (empty frames among them), then the trailers.
    Stream(Vec<Vec<u8>>),
}

impl Outgoing {
    fn bytes(&self) -> Vec<u8> {
        match &self.body {
            Sent::Empty => vec![],
            Sent::Whole(b) => b.clone(),
            Sent::Stream(frames) => frames.concat(),
        }
    }

    fn request(&self) -> Request<RequestBody> {
        let mut req = Request::builder()
            .method(self.method.clone())
            .uri(&self.target);
        for (n, v) in &self.fields {
            req = req.header(n, v);
        }
        if self.length_field {
            req = req.header("content-length", self.bytes().len());
        }
        if !self.trailers.is_empty() {
            let names: Vec<&str> = self.trailers.iter().map(|(n, _)| n.as_str()).collect();
            req = req.header("trailer", names.join(", "));
        }
        let body = match &self.body {
            Sent::Empty => http_body_util::Empty::new()
                .map_err(Into::into)
                .boxed_unsync(),
            Sent::Whole(b) => Full::new(Bytes::from(b.clone()))
                .map_err(Into::into)
                .boxed_unsync(),
            Sent::Stream(frames) => {
                let mut queue: std::collections::VecDeque<_> = frames
                    .iter()
                    .map(|f| Frame::data(Bytes::from(f.clone())))
                    .collect();
                if !self.trailers.is_empty() {
                    let mut map = HeaderMap::new();
                    for (n, v) in &self.trailers {
                        map.append(
                            http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                            HeaderValue::from_str(v).unwrap(),
                        );
                    }
                    queue.push_back(Frame::trailers(map));
                }
                Frames(queue).boxed_unsync()
            }
        };
        req.body(body).unwrap()
    }
}

/// A body of unknown size that yields its frames one per poll.
struct Frames(std::collections::VecDeque<Frame<Bytes>>);

impl Body for Frames {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// A request as a backend read it: the request line, the fields in order, how the body was
/// framed (`None`: by length, else the size of each chunk), the body and the trailers.
#[derive(Debug, PartialEq)]
struct Arrived {
    line: String,
    fields: Vec<(String, Vec<u8>)>,
    chunks: Option<Vec<u64>>,
    body: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
}

/// One CRLF-ended line off `peer` (without its CRLF).
async fn line_of(peer: &mut tokio::io::BufReader<TcpStream>) -> Vec<u8> {
    use tokio::io::AsyncBufReadExt as _;
    let mut line = Vec::new();
    peer.read_until(b'\n', &mut line).await.unwrap();
    assert!(line.ends_with(b"\r\n"), "a line without CRLF: {line:?}");
    line.truncate(line.len() - 2);
    line
}

/// Field lines off `peer` up to the empty line.
async fn fields_of(peer: &mut tokio::io::BufReader<TcpStream>) -> Vec<(String, Vec<u8>)> {
    let mut fields = Vec::new();
    loop {
        let line = line_of(peer).await;
        if line.is_empty() {
            return fields;
        }
        let colon = line.iter().position(|b| *b == b':').expect("a field line");
        let name = String::from_utf8(line[..colon].to_vec()).unwrap();
        fields.push((name, request::trim(&line[colon + 1..]).to_vec()));
    }
}

/// Reads one request off `peer`, strictly (RFC 9112 §6.3 for a request), answers it 204.
async fn arrived(peer: TcpStream) -> Arrived {
    let mut peer = tokio::io::BufReader::new(peer);
    let line = String::from_utf8(line_of(&mut peer).await).unwrap();
    let fields = fields_of(&mut peer).await;
    let named = |name: &str| {
        fields
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .collect::<Vec<_>>()
    };
    let chunked = named("transfer-encoding");
    let lengths = named("content-length");
    assert!(
        chunked.is_empty() || lengths.is_empty(),
        "a request framed two ways: {fields:?}"
    );
    let (mut chunks, mut body, mut trailers) = (None, Vec::new(), Vec::new());
    if !chunked.is_empty() {
        assert_eq!(chunked, [b"chunked".to_vec()]);
        let mut sizes = Vec::new();
        loop {
            let size = line_of(&mut peer).await;
            let size = u64::from_str_radix(std::str::from_utf8(&size).unwrap(), 16).unwrap();
            if size == 0 {
                trailers = fields_of(&mut peer).await;
                break;
            }
            sizes.push(size);
            let mut data = vec![0u8; usize::try_from(size).unwrap()];
            peer.read_exact(&mut data).await.unwrap();
            body.extend_from_slice(&data);
            assert!(line_of(&mut peer).await.is_empty(), "chunk data then CRLF");
        }
        chunks = Some(sizes);
    } else if let [length] = &lengths[..] {
        let n: usize = std::str::from_utf8(length).unwrap().parse().unwrap();
        body = vec![0u8; n];
        peer.read_exact(&mut body).await.unwrap();
    }
    let mut peer = peer.into_inner();
    peer.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
        .await
        .unwrap();
    Arrived {
        line,
        fields,
        chunks,
        body,
        trailers,
    }
}

/// Sends `req` with this connection and `theirs` with hyper's client, each to a backend of its
/// own, and reads both as the backends did.
async fn written_by_both(out: &Outgoing) -> (Arrived, Arrived) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ours = async {
        let (tcp, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut conn = H1Conn::new(Transport::plain(Socket::new(tcp.unwrap())), addr, None);
        let (sent, arrived) = tokio::join!(conn.send(out.request()), arrived(accepted.unwrap().0));
        assert_eq!(sent.expect("sent").status(), 204);
        arrived
    }
    .await;
    let (tcp, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let (mut sender, driver) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp.unwrap()))
            .await
            .unwrap();
    tokio::spawn(driver);
    let (sent, theirs) = tokio::join!(
        sender.send_request(out.request()),
        arrived(accepted.unwrap().0)
    );
    assert_eq!(sent.expect("hyper sent").status(), 204);
    (ours, theirs)
}

/// Requests as the proxy hands them on (origin-form target, hop-by-hop fields gone, HTTP/1.1):
/// any method, ordinary fields, a `Host` or none, and a body that is empty, whole, or a stream
/// of frames with or without its own `Content-Length`, with trailers after a stream. Left out:
/// a `GET`, `HEAD` or `CONNECT` whose body is a stream of unknown length, which hyper's client
/// sends with no body at all and this connection chunks (the body is the client's; it goes).
fn outgoing() -> impl Strategy<Value = Outgoing> {
    let method = prop::sample::select(vec![
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
    ]);
    let field = ("x-[a-z]{1,8}", "[!-~]([ -~]{0,18}[!-~])?");
    let host = prop::option::of("[a-z]{1,10}(:[0-9]{2,5})?");
    let body = prop_oneof![
        Just(Sent::Empty),
        proptest::collection::vec(any::<u8>(), 1..300).prop_map(Sent::Whole),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 0..6)
            .prop_map(Sent::Stream),
    ];
    let trailer = (
        prop::sample::select(vec![
            "x-sum",
            "x-checksum",
            "content-length",
            "host",
            "authorization",
            "content-type",
        ]),
        "[a-z0-9]{1,8}",
    );
    (
        method,
        "/[a-z0-9/]{0,20}(\\?[a-z]=[0-9]{1,3})?",
        proptest::collection::vec(field, 0..6),
        host,
        body,
        any::<bool>(),
        proptest::collection::btree_map(trailer.0, trailer.1, 0..3),
    )
        .prop_filter(
            "hyper's client sends no body for a GET, HEAD or CONNECT of unknown length",
            |(method, _, _, _, body, length_field, _)| {
                !(matches!(body, Sent::Stream(_))
                    && !length_field
                    && matches!(*method, Method::GET | Method::HEAD | Method::CONNECT))
            },
        )
        .prop_map(
            |(method, target, fields, host, body, length_field, trailers)| {
                let mut fields: Vec<(String, String)> = fields;
                if let Some(host) = host {
                    fields.insert(0, ("host".into(), host));
                }
                let streamed = matches!(body, Sent::Stream(_));
                Outgoing {
                    method,
                    target,
                    fields,
                    body,
                    length_field,
                    trailers: if streamed {
                        trailers
                            .into_iter()
                            .map(|(n, v)| (n.to_owned(), v))
                            .collect()
                    } else {
                        vec![]
                    },
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Whatever the request, a backend reads from this connection what it reads from hyper's
    /// client: the same request line, the same fields in the same order (the framing field
    /// chosen the same way), the same chunks, body and trailers (a framing or routing field
    /// among the trailers left out by both).
    #[test]
    fn requests_go_out_as_hyper_writes_them(out in outgoing()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (ours, theirs) = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), written_by_both(&out))
                .await
                .expect("an exchange hung")
        });
        prop_assert_eq!(&ours, &theirs, "{:?}", out);
        prop_assert_eq!(&ours.body, &out.bytes());
    }
}
