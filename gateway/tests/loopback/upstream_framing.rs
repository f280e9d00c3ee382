//! A backend that frames its responses badly, through the whole gateway: a head the gateway's
//! HTTP/1.1 client (`src/upstream/h1/`) refuses (lengths that disagree, `chunked` twice, line
//! folding, a head past its size or field count, an upgrade nobody asked for) is a 502 with the
//! reason `upstream_error`; a body whose chunk framing breaks (a size that overflows, a bare LF,
//! junk or a bare CR after the size, data longer than its size, folded or LF-ended trailers)
//! cuts the client's response; a response framed by both a length and `chunked` is read by its
//! chunks, and reaches the client without the length. In every case the connection it came on carries no other request: a raw backend
//! counts the requests that arrive on a connection after such an answer, and there are none.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// The answer to a request for `/ok`: a clean response, after which the connection is fit for
/// the next request.
const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

/// Response heads the gateway must refuse: 502, and the connection goes.
fn bad_heads() -> Vec<(&'static str, Vec<u8>)> {
    let mut oversize = b"HTTP/1.1 200 OK\r\n".to_vec();
    while oversize.len() < 70 * 1024 {
        oversize
            .extend_from_slice(b"x-filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    oversize.extend_from_slice(b"content-length: 2\r\n\r\nok");
    let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
    for i in 0..101 {
        many.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
    }
    many.extend_from_slice(b"content-length: 2\r\n\r\nok");
    vec![
        (
            "two lengths",
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd".to_vec(),
        ),
        (
            "a list of two lengths",
            b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\nabcd".to_vec(),
        ),
        (
            "a signed length",
            b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok".to_vec(),
        ),
        (
            "a length that overflows",
            b"HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551616\r\n\r\nok".to_vec(),
        ),
        (
            "a length beside chunked applied twice",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked, chunked\r\n\r\n\
              2\r\nok\r\n0\r\n\r\n"
                .to_vec(),
        ),
        (
            "obs-fold",
            b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        ),
        (
            "whitespace before the colon",
            b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok".to_vec(),
        ),
        (
            "a bare CR in a field",
            b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        ),
        (
            "a two-digit status",
            b"HTTP/1.1 20 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        ),
        (
            "an upgrade nobody asked for",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
                .to_vec(),
        ),
        ("a head past 64 KiB", oversize),
        ("101 fields", many),
    ]
}

/// Chunked bodies whose framing breaks after a good head: the client's response is cut, and
/// the connection goes.
fn bad_bodies() -> Vec<(&'static str, &'static [u8])> {
    vec![
        (
            "a chunk size that overflows",
            b"10000000000000000\r\nhello\r\n0\r\n\r\n",
        ),
        ("a bare LF after the size", b"5\nhello\r\n0\r\n\r\n"),
        ("junk after the size", b"5 x\r\nhello\r\n0\r\n\r\n"),
        ("a bare CR in an extension", b"5;a\rb\r\nhello\r\n0\r\n\r\n"),
        ("a NUL in an extension", b"5;a\0b\r\nhello\r\n0\r\n\r\n"),
        ("a signed size", b"-5\r\nhello\r\n0\r\n\r\n"),
        ("data longer than its size", b"5\r\nhelloXX\r\n0\r\n\r\n"),
        (
            "folded trailers",
            b"5\r\nhello\r\n0\r\nx-a: 1\r\n b\r\n\r\n",
        ),
        (
            "LF-ended trailers",
            b"5\r\nhello\r\n0\r\nx-a: 1\nx-b: 2\r\n\r\n",
        ),
    ]
}

/// Responses that are read whole but leave the connection unfit for another request.
fn unfit_after() -> Vec<(&'static str, &'static [u8], &'static str)> {
    vec![
        (
            "a length beside chunked (the chunks win)",
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n0\r\n\r\n",
            "hello",
        ),
        (
            "bytes past the end of the response",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n",
            "hello",
        ),
        (
            "Connection: close",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
            "hello",
        ),
    ]
}

/// What the raw backend saw.
#[derive(Debug, Default)]
struct Seen {
    connections: AtomicUsize,
    /// Requests that arrived on a connection after an answer that left it unfit.
    after_unfit: AtomicUsize,
}

/// A raw HTTP/1.1 backend on 127.0.0.1 that answers `/ok` with [`OK`] and `/case/N` with
/// `cases[N]`, keeping every connection open until the gateway closes it.
async fn scripted_backend(cases: Vec<Vec<u8>>) -> (SocketAddr, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let cases = Arc::new(cases);
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            s.connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream, cases.clone(), s.clone()));
        }
    });
    (addr, seen)
}

async fn serve(mut stream: TcpStream, cases: Arc<Vec<Vec<u8>>>, seen: Arc<Seen>) {
    let mut unfit = false;
    while let Some(target) = read_head(&mut stream).await {
        if unfit {
            seen.after_unfit.fetch_add(1, Ordering::SeqCst);
        }
        let answer = match target.strip_prefix("/case/") {
            Some(n) => {
                unfit = true;
                &cases[n.parse::<usize>().unwrap()][..]
            }
            None => OK,
        };
        if stream.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// Reads one request head (the gateway's GETs have no body): its target, `None` once the peer
/// closed the connection.
async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    Some(text.split(' ').nth(1)?.to_owned())
}

/// A GET of `path` through the gateway: its status (`None`: the gateway closed the connection
/// before a head) and its body, or `Err` when the body broke.
async fn call(gw: &Gw, path: &str) -> (Option<u16>, Result<String, String>) {
    let response = match connect(gw.proxy)
        .await
        .send(request("GET", path, &[], ""))
        .await
    {
        Ok(response) => response,
        Err(e) => return (None, Err(e.to_string())),
    };
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .map_err(|e| e.to_string());
    (Some(status), body)
}

/// Each case between two clean calls; the backend's connections are fit before it.
async fn run_cases(
    gw: &Gw,
    names: &[&str],
    check: impl Fn(&str, Option<u16>, Result<String, String>),
) {
    let ok = (Some(200), Ok("ok".to_owned()));
    for (i, name) in names.iter().enumerate() {
        assert_eq!(call(gw, "/ok").await, ok, "before {name}");
        let (status, body) = call(gw, &format!("/case/{i}")).await;
        check(name, status, body);
        assert_eq!(call(gw, "/ok").await, ok, "after {name}");
    }
}

#[tokio::test]
async fn a_malformed_response_head_is_a_502_and_its_connection_carries_nothing_else() {
    let cases = bad_heads();
    let names: Vec<_> = cases.iter().map(|(n, _)| *n).collect();
    let (addr, seen) = scripted_backend(cases.into_iter().map(|(_, b)| b).collect()).await;
    let gw = Gw::start(limits("model-a", &[addr], 4)).await;
    run_cases(&gw, &names, |name, status, body| {
        assert_eq!(status, Some(502), "{name}: {body:?}");
        let body = body.unwrap_or_else(|e| panic!("{name}: the 502's body broke: {e}"));
        assert!(body.contains("upstream_error"), "{name}: {body}");
    })
    .await;
    assert_eq!(seen.after_unfit.load(Ordering::SeqCst), 0);
    assert!(
        seen.connections.load(Ordering::SeqCst) > names.len(),
        "a new connection after each refused head"
    );
}

#[tokio::test]
async fn a_chunked_body_that_breaks_cuts_the_response_and_its_connection_goes() {
    let cases = bad_bodies();
    let names: Vec<_> = cases.iter().map(|(n, _)| *n).collect();
    let scripts = cases
        .iter()
        .map(|(_, body)| {
            let mut bytes = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            bytes.extend_from_slice(body);
            bytes
        })
        .collect();
    let (addr, seen) = scripted_backend(scripts).await;
    let gw = Gw::start(limits("model-a", &[addr], 4)).await;
    run_cases(&gw, &names, |name, status, body| {
        // The head was good, but the chunk that broke may come with it, before the gateway
        // wrote a byte to the client: the client gets the head and a cut body, or nothing.
        assert!(matches!(status, None | Some(200)), "{name}: {status:?}");
        assert!(
            body.is_err(),
            "{name}: a broken body must not end cleanly: {body:?}"
        );
    })
    .await;
    assert_eq!(seen.after_unfit.load(Ordering::SeqCst), 0);
    let text = gw.metrics().await;
    assert!(
        closed_connections(&text, "error").unwrap_or(0.0) >= names.len() as f64,
        "each broken body's connection closed as an error: {text}"
    );
}

#[tokio::test]
async fn a_response_read_whole_that_leaves_its_connection_unfit_is_the_connections_last() {
    let cases = unfit_after();
    let names: Vec<_> = cases.iter().map(|(n, _, _)| *n).collect();
    let (addr, seen) = scripted_backend(cases.iter().map(|(_, b, _)| b.to_vec()).collect()).await;
    let gw = Gw::start(limits("model-a", &[addr], 4)).await;
    run_cases(&gw, &names, |name, status, body| {
        let want = cases.iter().find(|(n, _, _)| *n == name).unwrap().2;
        assert_eq!((status, body), (Some(200), Ok(want.to_owned())), "{name}");
    })
    .await;
    assert_eq!(seen.after_unfit.load(Ordering::SeqCst), 0);
}
