//! Load: `wrk` for fixed concurrency, and small purpose-built clients for the fixed-rate row
//! (open loop, corrected for coordinated omission), the pool-contention, streaming and
//! idle-connection parts (which need per-client shares, per-chunk timing and connections that
//! stay open, none of which `wrk` reports).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use crate::clock::mono_us;

/// What one closed-loop or fixed-rate run measured.
#[derive(Clone, Debug, Default)]
pub struct LoadResult {
    /// Requests completed.
    pub requests: u64,
    /// Requests that failed (socket errors, timeouts, non-2xx).
    pub errors: u64,
    /// Completed requests per second.
    pub rps: f64,
    /// Latency percentiles, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
}

/// The `wrk` script that prints the summary as one JSON line.
pub const WRK_SCRIPT: &str = r#"done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "JSON {\"requests\":%d,\"duration_us\":%d,\"errors\":%d,\"p50\":%d,\"p99\":%d,\"p999\":%d}\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
"#;

/// The `wrk` command line for one run.
pub fn wrk_args(script: &Path, conns: u32, secs: f64, url: &str) -> Vec<String> {
    vec![
        "-t1".into(),
        format!("-c{conns}"),
        format!("-d{}s", secs.ceil() as u64),
        "--timeout".into(),
        "5s".into(),
        "-s".into(),
        script.display().to_string(),
        url.into(),
    ]
}

/// Runs `wrk` pinned to `cpus`.
pub async fn wrk(cpus: &str, args: &[String]) -> anyhow::Result<LoadResult> {
    let out = tokio::process::Command::new("taskset")
        .arg("-c")
        .arg(cpus)
        .arg("wrk")
        .args(args)
        .output()
        .await
        .context("running wrk")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("JSON "))
        .with_context(|| {
            format!(
                "no summary from wrk: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let num = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let secs = num("duration_us") / 1e6;
    Ok(LoadResult {
        requests: num("requests") as u64,
        errors: num("errors") as u64,
        rps: if secs > 0.0 {
            num("requests") / secs
        } else {
            0.0
        },
        p50_us: num("p50"),
        p99_us: num("p99"),
        p999_us: num("p999"),
    })
}

/// Open loop at a fixed rate: request `k` is due at `start + k / rate` and goes out on
/// connection `k mod conns` (each connection sends its own requests in order). Latency counts
/// from the request's due time when the connection was still busy with the previous one then
/// (so a stall is not hidden by coordinated omission), else from when it was written (so the
/// runtime's millisecond timer granularity adds nothing).
pub async fn fixed_rate(
    addr: SocketAddr,
    path: &str,
    rate: u32,
    conns: u32,
    secs: f64,
) -> anyhow::Result<LoadResult> {
    let start = mono_us() + 10_000;
    let total = (f64::from(rate) * secs) as u64;
    let interval_us = 1e6 / f64::from(rate);
    let mut tasks = Vec::new();
    for j in 0..u64::from(conns) {
        let path = path.to_string();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut sender = client_conn(addr).await?;
            let mut prev_done = 0u64;
            let origin = tokio::time::Instant::now();
            let base = mono_us();
            let mut k = j;
            while k < total {
                let due = start + (k as f64 * interval_us) as u64;
                if due > mono_us() {
                    tokio::time::sleep_until(origin + Duration::from_micros(due - base)).await;
                }
                let sent = mono_us();
                let from = if prev_done > due { due } else { sent };
                let outcome = async {
                    sender.ready().await?;
                    let resp = sender.send_request(get(&path, 0)?).await?;
                    let ok = resp.status().is_success();
                    resp.into_body().collect().await?;
                    anyhow::Ok(ok)
                }
                .await;
                prev_done = mono_us();
                match outcome {
                    Ok(true) => latencies.push(prev_done - from),
                    Ok(false) => errors += 1,
                    Err(_) => {
                        errors += 1;
                        sender = client_conn(addr).await?;
                    }
                }
                k += u64::from(conns);
            }
            anyhow::Ok((latencies, errors, prev_done))
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut last = start;
    for task in tasks {
        let (l, e, done) = task.await??;
        latencies.extend(l);
        errors += e;
        last = last.max(done);
    }
    let elapsed = (last - start) as f64 / 1e6;
    let requests = latencies.len() as u64;
    Ok(LoadResult {
        requests,
        errors,
        rps: requests as f64 / elapsed.max(1e-9),
        p50_us: crate::stats::percentile(&mut latencies, 50.0),
        p99_us: crate::stats::percentile(&mut latencies, 99.0),
        p999_us: crate::stats::percentile(&mut latencies, 99.9),
    })
}

/// One HTTP/1.1 keep-alive client connection.
async fn client_conn(addr: SocketAddr) -> anyhow::Result<http1::SendRequest<Empty<Bytes>>> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

fn get(path: &str, client: usize) -> anyhow::Result<Request<Empty<Bytes>>> {
    Ok(Request::get(path)
        .header("host", "bench")
        .header("x-api-key", format!("client-{client}"))
        .body(Empty::new())?)
}

/// One call of the contention part.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Which of the clients made it.
    pub client: usize,
    /// 2xx?
    pub ok: bool,
    /// From send to the end of the response, µs.
    pub latency_us: u64,
    /// From send to the upstream receiving it (queueing in the proxy plus its own work), µs.
    pub queue_us: Option<u64>,
}

/// Closed loop: `clients` × `per_client` connections each sending `path` back to back for
/// `secs`; calls finishing after the window are not counted.
pub async fn contention(
    addr: SocketAddr,
    path: &str,
    clients: usize,
    per_client: usize,
    secs: f64,
) -> anyhow::Result<Vec<Call>> {
    let start = mono_us();
    let end = start + (secs * 1e6) as u64;
    let mut tasks = Vec::new();
    for client in 0..clients {
        for _ in 0..per_client {
            let path = path.to_string();
            tasks.push(tokio::spawn(async move {
                let mut calls = Vec::new();
                let mut sender = None;
                while mono_us() < end {
                    let s = match sender.take() {
                        Some(s) => s,
                        None => match client_conn(addr).await {
                            Ok(s) => s,
                            Err(_) => {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                continue;
                            }
                        },
                    };
                    let mut s: http1::SendRequest<Empty<Bytes>> = s;
                    let t0 = mono_us();
                    let Ok(req) = get(&path, client) else { break };
                    let outcome = async {
                        s.ready().await?;
                        let resp = s.send_request(req).await?;
                        let recv = resp
                            .headers()
                            .get("x-recv-us")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<u64>().ok());
                        let ok = resp.status().is_success();
                        resp.into_body().collect().await?;
                        anyhow::Ok((ok, recv))
                    }
                    .await;
                    let t1 = mono_us();
                    if t1 > end {
                        break;
                    }
                    match outcome {
                        Ok((ok, recv)) => {
                            calls.push(Call {
                                client,
                                ok,
                                latency_us: t1 - t0,
                                queue_us: recv.map(|r| r.saturating_sub(t0)),
                            });
                            sender = Some(s);
                        }
                        Err(_) => calls.push(Call {
                            client,
                            ok: false,
                            latency_us: t1 - t0,
                            queue_us: None,
                        }),
                    }
                }
                calls
            }));
        }
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await?);
    }
    Ok(all)
}

/// One SSE stream as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Stream {
    /// From sending the request to the first complete event, µs.
    pub ttfb_us: u64,
    /// Per event: arrival at the client minus the time the upstream wrote it, µs.
    pub transit_us: Vec<u64>,
    /// Events received.
    pub events: usize,
    /// Did it end with every event and a 200?
    pub complete: bool,
}

/// `streams` concurrent SSE streams of `n` events every `ms` ms.
pub async fn sse(addr: SocketAddr, streams: usize, n: u32, ms: u32) -> anyhow::Result<Vec<Stream>> {
    let mut tasks = Vec::new();
    for i in 0..streams {
        tasks.push(tokio::spawn(async move {
            let path = format!("/v1/sse?n={n}&ms={ms}");
            let mut s = client_conn(addr).await?;
            let t0 = mono_us();
            let resp = s.send_request(get(&path, i)?).await?;
            let status_ok = resp.status().is_success();
            let mut body = resp.into_body();
            let mut out = Stream::default();
            let mut buf: Vec<u8> = Vec::new();
            while let Some(frame) = body.frame().await {
                let now = mono_us();
                let Ok(data) = frame?.into_data() else {
                    continue;
                };
                buf.extend_from_slice(&data);
                while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                    let event: Vec<u8> = buf.drain(..pos + 2).collect();
                    let text = String::from_utf8_lossy(&event);
                    if out.events == 0 {
                        out.ttfb_us = now - t0;
                    }
                    out.events += 1;
                    if let Some(t) = text
                        .split("\"t\":")
                        .nth(1)
                        .and_then(|r| r.trim_end_matches(['}', '\n']).parse::<u64>().ok())
                    {
                        out.transit_us.push(now.saturating_sub(t));
                    }
                }
            }
            out.complete = status_ok && out.events == n as usize;
            anyhow::Ok(out)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.push(task.await??);
    }
    Ok(all)
}

/// Opens `count` connections to `addr` from source address `from`, makes one keep-alive request
/// for `path` on each (so every proxy holds a parsed, idle HTTP session), and returns them still
/// open.
pub async fn open_idle(
    addr: SocketAddr,
    from: IpAddr,
    path: &'static str,
    count: usize,
) -> anyhow::Result<Vec<TcpStream>> {
    let opening = std::sync::Arc::new(tokio::sync::Semaphore::new(128));
    let mut tasks = Vec::with_capacity(count);
    for _ in 0..count {
        let opening = opening.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = opening.acquire_owned().await?;
            let socket = TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(from, 0))?;
            let mut stream = socket.connect(addr).await?;
            let request = format!("GET {path} HTTP/1.1\r\nhost: bench\r\n\r\n");
            stream.write_all(request.as_bytes()).await?;
            read_response(&mut stream).await?;
            anyhow::Ok(stream)
        }));
    }
    let mut open = Vec::with_capacity(count);
    for task in tasks {
        open.push(task.await??);
    }
    Ok(open)
}

/// Reads one response with a `content-length` body.
async fn read_response(stream: &mut TcpStream) -> anyhow::Result<()> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await??;
        if n == 0 {
            bail!("closed before a response");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                bail!("not a 200: {}", head.lines().next().unwrap_or(""));
            }
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .context("no content-length")?;
            if buf.len() >= end + 4 + len {
                return Ok(());
            }
        }
    }
}

/// How many of `streams` the peer has not closed (a non-blocking read finds no EOF).
pub fn still_open(streams: &[TcpStream]) -> usize {
    let mut buf = [0u8; 1];
    streams
        .iter()
        .filter(|s| match s.try_read(&mut buf) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        })
        .count()
}
