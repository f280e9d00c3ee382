//! Loopback tests of idle keep-alive connections parked outside hyper
//! (`src/listen/parking.rs`): a parked connection is served again when it sends its next
//! request (also when it parked with half a head pipelined), stays counted in the connection
//! metrics, and is closed by the idle timeout and by drain; many connections park eagerly and
//! are all served again.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use poolpilot_gateway::listen::{PARK_AFTER, PARK_EAGERLY_ABOVE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const GET: &[u8] = b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n";

/// Reads one response (content-length or chunked) and returns its head.
async fn read_response(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before a response head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    loop {
        let body = &buf[head_end..];
        let done = match length {
            Some(len) => body.len() >= len,
            None => body.ends_with(b"0\r\n\r\n"),
        };
        if done {
            return head;
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the end of the body");
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn open_and_serve(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(GET).await.unwrap();
    assert!(read_response(&mut s).await.starts_with("http/1.1 200"));
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_connection_is_served_again_and_stays_counted() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    let mut s = open_and_serve(gw.proxy).await;
    tokio::time::sleep(PARK_AFTER * 3).await;
    assert_eq!(gw.open_connections(), 1);
    assert_eq!(
        metric(&gw.metrics().await, "poolpilot_downstream_connections"),
        Some(1.0),
        "a parked connection is still a connection"
    );
    for _ in 0..3 {
        s.write_all(GET).await.unwrap();
        assert!(read_response(&mut s).await.starts_with("http/1.1 200"));
    }
    // Park with half a head sent: the rest completes it.
    tokio::time::sleep(PARK_AFTER * 3).await;
    s.write_all(&GET[..12]).await.unwrap();
    tokio::time::sleep(PARK_AFTER * 3).await;
    s.write_all(&GET[12..]).await.unwrap();
    assert!(read_response(&mut s).await.starts_with("http/1.1 200"));
    drop(s);
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(2),
        "a closed parked connection is uncounted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_connection_is_closed_by_the_idle_timeout() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"idleTimeout": "1500ms"}),
    ))
    .await;
    let mut s = open_and_serve(gw.proxy).await;
    let start = Instant::now();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .expect("the parked connection is closed by the gateway")
        .unwrap();
    assert!(rest.is_empty());
    let idle = start.elapsed();
    assert!(
        idle >= Duration::from_millis(1400) && idle < Duration::from_secs(4),
        "closed after {idle:?}, not at the 1.5 s idle timeout"
    );
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(1),
        "the connection is uncounted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_head_cannot_outlive_the_header_read_timeout_by_parking() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"headerReadTimeout": "2s"}),
    ))
    .await;
    let mut s = open_and_serve(gw.proxy).await;
    let start = Instant::now();
    // One byte every 700 ms: it parks between bytes, and the head never completes.
    for byte in GET.iter().take(10) {
        if s.write_all(&[*byte]).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        if start.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "cut near the 2 s header read timeout"
    );
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(2),
        "the slow connection is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_closes_parked_connections_at_once() {
    let backend = Backend::start().await;
    let mut gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    let mut s = open_and_serve(gw.proxy).await;
    tokio::time::sleep(PARK_AFTER * 3).await;
    let start = Instant::now();
    let left = gw.running.take().unwrap().shutdown().await;
    assert_eq!(left, 0, "nothing left after drain");
    assert!(start.elapsed() < Duration::from_secs(1));
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut rest))
        .await
        .expect("the parked connection is closed")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_park_eagerly_and_are_all_served_again() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 16)).await;
    let n = PARK_EAGERLY_ABOVE + 64;
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(open_and_serve(gw.proxy).await);
    }
    assert_eq!(gw.open_connections(), n);
    for s in &mut conns {
        s.write_all(GET).await.unwrap();
        assert!(read_response(s).await.starts_with("http/1.1 200"));
    }
    assert_eq!(
        metric(&gw.metrics().await, "poolpilot_downstream_connections"),
        Some(n as f64)
    );
}
