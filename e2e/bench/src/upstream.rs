//! The benchmark's upstream: one small hyper HTTP/1.1 server, the same binary behind every proxy.
//!
//! - `/v1/fast` (and any unknown path): 200 with a 64-byte JSON body at once;
//! - `/v1/slow?ms=N`: the same after an `N` ms service time;
//! - `/v1/close`: the same with `connection: close`, so that no proxy keeps the upstream
//!   connection (part 4's idle connections without pooled upstream connections);
//! - `/v1/headers`: the same, echoing the `x-forwarded-for` and `via` the request arrived with
//!   in `x-seen-xff` and `x-seen-via` (every proxy must add both: the start check);
//! - `/v1/sse?n=N&ms=M`: a server-sent-event stream of `N` events, one every `M` ms, each
//!   carrying the monotonic time (µs) at which it was written, so the client can compute the
//!   delay each proxy adds to every chunk.
//!
//! Every response carries `x-recv-us`, the monotonic time (µs) at which the request arrived, so a
//! client on the same machine can tell queueing in a proxy apart from service time.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::clock::mono_us;

/// The small body of `/v1/fast` and `/v1/slow`: 64 bytes.
pub const SMALL_BODY: &[u8] =
    b"{\"id\":\"bench\",\"object\":\"chat.completion\",\"choices\":[],\"ok\":1}\n";

type RespBody = BoxBody<Bytes, Infallible>;

/// Serves until the process is killed, on a single-threaded runtime (the caller pins it).
pub fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(addr).await?;
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    eprintln!("upstream accept: {error}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service_fn(handle))
                    .await;
            });
        }
    })
}

/// The value of query parameter `key`, parsed.
fn query_param(req: &Request<Incoming>, key: &str) -> Option<u64> {
    req.uri().query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == key).then(|| v.parse().ok()).flatten()
    })
}

async fn handle(req: Request<Incoming>) -> Result<Response<RespBody>, Infallible> {
    let recv = mono_us();
    let path = req.uri().path();
    let body: RespBody = if path.starts_with("/v1/sse") {
        let n = query_param(&req, "n").unwrap_or(200);
        let every = Duration::from_millis(query_param(&req, "ms").unwrap_or(20));
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let events = futures::stream::unfold((0u64, ticks), move |(i, mut ticks)| async move {
            if i >= n {
                return None;
            }
            ticks.tick().await;
            let event = format!("data: {{\"i\":{i},\"t\":{}}}\n\n", mono_us());
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(event))),
                (i + 1, ticks),
            ))
        });
        let response = Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .header("x-recv-us", recv.to_string())
            .body(StreamBody::new(events).boxed())
            .unwrap_or_default();
        return Ok(response);
    } else {
        if path.starts_with("/v1/slow") {
            let ms = query_param(&req, "ms").unwrap_or(50);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Full::new(Bytes::from_static(SMALL_BODY)).boxed()
    };
    let mut response = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("x-recv-us", recv.to_string());
    if path.starts_with("/v1/close") {
        response = response.header("connection", "close");
    } else if path.starts_with("/v1/headers") {
        for (seen, name) in [("x-seen-xff", "x-forwarded-for"), ("x-seen-via", "via")] {
            if let Some(value) = req.headers().get(name) {
                response = response.header(seen, value);
            }
        }
    }
    Ok(response.body(body).unwrap_or_default())
}
