//! Test support for loopback integration tests: a scriptable model backend that counts its
//! concurrent connections and requests (and can stall, stream SSE, fail, close idle
//! connections, or speak h2c and send `GOAWAY`), the gateway started in-process on 127.0.0.1:0, and small HTTP clients.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use poolpilot_api::GatewayLimits;
use poolpilot_gateway::config::{GatewayConfig, Listeners};
use poolpilot_gateway::{Running, start};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Retries `$cond` every 10ms until it holds or `$within` passes.
macro_rules! assert_eventually {
    ($cond:expr, $within:expr, $($msg:tt)+) => {{
        let deadline = tokio::time::Instant::now() + $within;
        loop {
            if $cond {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                panic!($($msg)+);
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}

/// What the backend does, changeable while it runs.
#[derive(Debug, Default)]
pub struct Script {
    /// Delay before the response head, in ms.
    pub delay_ms: AtomicU64,
    /// Status of model calls (0 = 200).
    pub status: AtomicU16,
    /// Status of `/health` (0 = 200).
    pub health_status: AtomicU16,
    /// SSE: chunks to send (0 = a plain JSON body).
    pub sse_chunks: AtomicUsize,
    /// SSE: time between chunks, ms.
    pub sse_interval_ms: AtomicU64,
    /// SSE: stall forever after this many chunks (0 = never).
    pub sse_stall_after: AtomicUsize,
    /// SSE: pad each chunk to at least this many bytes (a fast producer of large chunks).
    pub sse_chunk_bytes: AtomicUsize,
    /// Close a keep-alive connection idle this long, ms (0 = never).
    pub idle_close_ms: AtomicU64,
    /// Raised by one: every connection open then shuts down gracefully (HTTP/2: a `GOAWAY`,
    /// its streams in flight finish).
    pub goaway: AtomicU64,
}

/// What the backend saw.
#[derive(Debug, Default)]
pub struct Seen {
    pub connections: AtomicUsize,
    pub max_connections: AtomicUsize,
    pub accepted: AtomicUsize,
    pub requests: AtomicUsize,
    pub health_requests: AtomicUsize,
    pub inflight: AtomicUsize,
    pub max_inflight: AtomicUsize,
    /// The most calls one connection carried at once (HTTP/2: streams).
    pub max_per_connection: AtomicUsize,
}

/// A model backend on 127.0.0.1.
#[derive(Clone, Debug)]
pub struct Backend {
    pub addr: SocketAddr,
    pub script: Arc<Script>,
    pub seen: Arc<Seen>,
    /// h2c with this `SETTINGS_MAX_CONCURRENT_STREAMS` (`None`: HTTP/1.1).
    h2_streams: Option<u32>,
}

impl Backend {
    pub async fn start() -> Self {
        Self::start_at("127.0.0.1:0".parse().unwrap()).await
    }

    /// A backend listening on `addr` (port 0: one the kernel picks).
    pub async fn start_at(addr: SocketAddr) -> Self {
        Self::listen(addr, None).await
    }

    /// A backend on 127.0.0.1 speaking h2c (HTTP/2 with prior knowledge), at most `streams`
    /// streams a connection.
    pub async fn start_h2(streams: u32) -> Self {
        Self::listen("127.0.0.1:0".parse().unwrap(), Some(streams)).await
    }

    async fn listen(addr: SocketAddr, h2_streams: Option<u32>) -> Self {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backend = Self {
            addr,
            script: Arc::default(),
            seen: Arc::default(),
            h2_streams,
        };
        let b = backend.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(b.clone().serve(stream));
            }
        });
        backend
    }

    /// How many model calls (everything but `/health`) the backend has received so far.
    pub fn requests(&self) -> usize {
        self.seen.requests.load(Ordering::SeqCst)
    }

    async fn serve(self, stream: TcpStream) {
        let seen = self.seen.clone();
        let now = seen.connections.fetch_add(1, Ordering::SeqCst) + 1;
        let stream = Counted {
            inner: stream,
            seen: Some(seen.clone()),
        };
        seen.max_connections.fetch_max(now, Ordering::SeqCst);
        seen.accepted.fetch_add(1, Ordering::SeqCst);
        let last_end = Arc::new(AtomicU64::new(0));
        let busy = Arc::new(AtomicUsize::new(0));
        let base = Instant::now();
        let service = {
            let (this, last_end, busy) = (self.clone(), last_end.clone(), busy.clone());
            service_fn(move |req| {
                let (this, last_end, busy) = (this.clone(), last_end.clone(), busy.clone());
                async move {
                    let on_it = busy.fetch_add(1, Ordering::SeqCst) + 1;
                    this.seen
                        .max_per_connection
                        .fetch_max(on_it, Ordering::SeqCst);
                    let response = this.respond(req).await;
                    busy.fetch_sub(1, Ordering::SeqCst);
                    last_end.store(base.elapsed().as_millis() as u64, Ordering::SeqCst);
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let goaway_at = self.script.goaway.load(Ordering::SeqCst);
        // Shuts the connection down gracefully when its idle timer fires or a GOAWAY is asked.
        macro_rules! serve {
            ($conn:expr) => {{
                let conn = $conn;
                tokio::pin!(conn);
                let mut shut = false;
                loop {
                    tokio::select! {
                        _ = conn.as_mut() => break,
                        _ = tokio::time::sleep(Duration::from_millis(10)) => {
                            let idle_close = self.script.idle_close_ms.load(Ordering::SeqCst);
                            let idle_ms = base.elapsed().as_millis() as u64 - last_end.load(Ordering::SeqCst);
                            let idle = idle_close > 0 && busy.load(Ordering::SeqCst) == 0 && idle_ms >= idle_close;
                            let goaway = self.script.goaway.load(Ordering::SeqCst) > goaway_at;
                            if (idle || goaway) && !shut {
                                shut = goaway;
                                conn.as_mut().graceful_shutdown();
                            }
                        }
                    }
                }
            }};
        }
        match self.h2_streams {
            None => serve!(
                hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service)
            ),
            Some(streams) => serve!(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .timer(TokioTimer::new())
                    .max_concurrent_streams(streams)
                    .serve_connection(TokioIo::new(stream), service)
            ),
        }
    }

    async fn respond(&self, req: Request<Incoming>) -> Response<Body> {
        if req.uri().path() == "/health" {
            self.seen.health_requests.fetch_add(1, Ordering::SeqCst);
            let status = self.script.health_status.load(Ordering::SeqCst);
            return plain(if status == 0 { 200 } else { status }, "ok");
        }
        self.seen.requests.fetch_add(1, Ordering::SeqCst);
        let now = self.seen.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        self.seen.max_inflight.fetch_max(now, Ordering::SeqCst);
        let echo_headers = format!("{:?}", req.headers());
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let delay = self.script.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        self.seen.inflight.fetch_sub(1, Ordering::SeqCst);
        let status = self.script.status.load(Ordering::SeqCst);
        let chunks = self.script.sse_chunks.load(Ordering::SeqCst);
        if chunks > 0 {
            let interval =
                Duration::from_millis(self.script.sse_interval_ms.load(Ordering::SeqCst));
            let stall_after = self.script.sse_stall_after.load(Ordering::SeqCst);
            let pad = self.script.sse_chunk_bytes.load(Ordering::SeqCst);
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
            tokio::spawn(async move {
                for i in 0..chunks {
                    if stall_after > 0 && i == stall_after {
                        // Stall: hold the stream open without sending.
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    let mut chunk = format!("data: {{\"token\":{i}}}");
                    if chunk.len() < pad {
                        chunk.push_str(&" ".repeat(pad - chunk.len()));
                    }
                    chunk.push_str("\n\n");
                    let chunk = Bytes::from(chunk);
                    if tx.send(chunk).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(interval).await;
                }
            });
            return Response::builder()
                .header("content-type", "text/event-stream")
                .body(ChannelBody(rx).boxed_unsync())
                .unwrap();
        }
        let text = serde_json::json!({
            "ok": true,
            "bodyBytes": body.len(),
            "headers": echo_headers,
        });
        plain(if status == 0 { 200 } else { status }, &text.to_string())
    }
}

/// An SSE body fed by a channel: each message is one chunk on the wire.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

fn plain(status: u16, text: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(text.to_owned())).boxed_unsync())
        .unwrap()
}

// === the gateway ===

/// The gateway, started in-process on loopback.
pub struct Gw {
    pub running: Option<Running>,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub token: String,
    pub dir: tempfile::TempDir,
}

impl Gw {
    /// Starts a gateway and applies `limits` to it.
    pub async fn start(limits: GatewayLimits) -> Self {
        let gw = Self::start_with(None, Duration::from_secs(5)).await;
        gw.running
            .as_ref()
            .unwrap()
            .gateway
            .apply(limits, poolpilot_gateway::LimitsSource::Api)
            .expect("test limits are valid");
        gw
    }

    /// Starts a gateway with an optional limits file (polled every 50ms) and drain grace.
    pub async fn start_with(limits_file: Option<&str>, drain_grace: Duration) -> Self {
        Self::start_configured(limits_file, drain_grace, Duration::ZERO).await
    }

    /// [`Gw::start_with`], waiting up to `await_operator` for a PUT before turning ready.
    pub async fn start_configured(
        limits_file: Option<&str>,
        drain_grace: Duration,
        await_operator: Duration,
    ) -> Self {
        Self::start_edited(limits_file, drain_grace, await_operator, |_, _| {}).await
    }

    /// [`Gw::start_configured`], with `edit` changing the configuration (given the gateway's
    /// temporary folder, which holds the token file) before the gateway starts.
    pub async fn start_edited(
        limits_file: Option<&str>,
        drain_grace: Duration,
        await_operator: Duration,
        edit: impl FnOnce(&mut GatewayConfig, &std::path::Path),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let token = TEST_TOKEN.to_owned();
        std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
        let limits_path = dir.path().join("limits.yaml");
        if let Some(text) = limits_file {
            std::fs::write(&limits_path, text).unwrap();
        }
        let mut config = GatewayConfig {
            listeners: Listeners {
                proxy: "127.0.0.1:0".parse().unwrap(),
                admin: "127.0.0.1:0".parse().unwrap(),
            },
            admin_token_file: Some(dir.path().join("token")),
            admin_token_overlap: poolpilot_api::Duration::from_secs(300),
            admin_tls: None,
            admin_header_read_timeout: poolpilot_api::Duration::from_secs(10),
            admin_max_connections: 64,
            limits_file: limits_file.map(|_| limits_path),
            limits_poll_interval: poolpilot_api::Duration::from_millis(50),
            drain_grace: drain_grace.into(),
            await_operator: await_operator.into(),
            // Tests shut down at once unless they test the delay.
            shutdown_delay: poolpilot_api::Duration::ZERO,
            // Tests read the log of the calls they make from a file.
            access_log: poolpilot_gateway::config::AccessLogConfig {
                file: Some(dir.path().join("access.log")),
                ..Default::default()
            },
            metrics: Default::default(),
            upstream_keepalive: Default::default(),
            early_retries: Default::default(),
            dns: Default::default(),
        };
        edit(&mut config, dir.path());
        let running = start(config).await.expect("the gateway starts");
        Self {
            proxy: running.proxy_addr,
            admin: running.admin_addr,
            running: Some(running),
            token,
            dir,
        }
    }

    pub fn gateway(&self) -> &poolpilot_gateway::Gateway {
        &self.running.as_ref().unwrap().gateway
    }

    /// How many client connections the gateway's proxy listener counts as open.
    pub fn open_connections(&self) -> usize {
        self.running.as_ref().unwrap().open_connections()
    }

    /// Applies limits directly (as a PUT would).
    pub fn apply(&self, limits: GatewayLimits) {
        self.gateway()
            .apply(limits, poolpilot_gateway::LimitsSource::Api)
            .expect("test limits are valid");
    }

    pub async fn metrics(&self) -> String {
        get(self.admin, "/metrics", &[]).await.2
    }

    /// The access log lines written so far, parsed.
    pub fn access_lines(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("access.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("every access log line is JSON"))
            .collect()
    }

    /// `PUT /v1/limits` of `limits` with the token: `(status, body)` (for documents a test
    /// expects to be refused; [`Gw::apply`] applies valid ones directly).
    pub async fn put_limits(&self, limits: &GatewayLimits) -> (StatusCode, String) {
        let body = serde_json::to_string(limits).expect("limits serialize");
        self.admin_call("PUT", "/v1/limits", &body).await
    }

    /// An admin request with the token: `(status, body)`.
    pub async fn admin_call(&self, method: &str, path: &str, body: &str) -> (StatusCode, String) {
        let bearer = self.bearer();
        let (status, _, body) = connect(self.admin)
            .await
            .call(request(
                method,
                path,
                &[("authorization", bearer.as_str())],
                body,
            ))
            .await;
        (status, body)
    }

    /// `Authorization: Bearer <the admin token>`, for `/v1/*` of the admin API.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.token)
    }

    /// `GET` of an admin `/v1/*` path with the token.
    pub async fn admin_get(&self, path: &str) -> (StatusCode, http::HeaderMap, String) {
        let bearer = self.bearer();
        get(self.admin, path, &[("authorization", bearer.as_str())]).await
    }
}

/// The admin token of test gateways (32 bytes or more, as the gateway demands).
pub const TEST_TOKEN: &str = "dGVzdC1hZG1pbi10b2tlbi10ZXN0LWFkbWluLXRva2Vu";

// === limits builders ===

/// Limits with one backend per `(name, endpoints)`, each matching `/<name>/` or, for the
/// first, everything else too.
pub fn limits(name: &str, endpoints: &[SocketAddr], max_per_endpoint: u32) -> GatewayLimits {
    let doc = serde_json::json!({
        "generation": 1,
        "listener": {"idleTimeout": "30s", "headerReadTimeout": "2s"},
        "backends": [backend_json(name, endpoints, max_per_endpoint)],
    });
    serde_json::from_value(doc).expect("valid test limits")
}

/// [`limits`] for one backend with 4 connections per endpoint, and `listener` as the
/// listener's limits.
pub fn with_listener(backend: SocketAddr, listener: serde_json::Value) -> GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], 4)).unwrap();
    doc["listener"] = listener;
    from_json(doc)
}

/// One backend's limits as JSON, with short timeouts suited to tests.
pub fn backend_json(
    name: &str,
    endpoints: &[SocketAddr],
    max_per_endpoint: u32,
) -> serde_json::Value {
    let endpoints: Vec<_> = endpoints
        .iter()
        .enumerate()
        .map(|(i, a)| serde_json::json!({"name": format!("{name}-{i}"), "address": a.to_string()}))
        .collect();
    serde_json::json!({
        "name": name,
        "endpoints": endpoints,
        "pool": {
            "maxConnectionsPerEndpoint": max_per_endpoint,
            "maxPending": 1000,
            "leaseTimeout": "5s",
            "idleTimeout": "30s",
            "maxLifetime": "10m",
            "connectTimeout": "1s",
            "validateAfterIdle": "2s"
        },
        "timeouts": {"firstByte": "5s", "total": "30s", "streamIdle": "5s"}
    })
}

/// The client policy `default`, telling clients apart by their `x-api-key` header: each may make
/// `max_concurrency` calls at once and queue `max_queue` more for up to `queue_timeout`, but for
/// the `overrides` (see [`client_override`]).
pub fn client_policy(
    max_concurrency: u32,
    max_queue: u32,
    queue_timeout: &str,
    overrides: &[serde_json::Value],
) -> serde_json::Value {
    serde_json::json!({
        "name": "default",
        "identity": {"header": "x-api-key"},
        "maxConcurrency": max_concurrency,
        "maxQueue": max_queue,
        "queueTimeout": queue_timeout,
        "overrides": overrides,
    })
}

/// An override of a client policy: the client `name`, known by the `x-api-key` value `key`, may
/// make `max_concurrency` calls at once.
pub fn client_override(name: &str, key: &str, max_concurrency: u32) -> serde_json::Value {
    serde_json::json!({"name": name, "keySha256": sha256_hex(key), "maxConcurrency": max_concurrency})
}

/// Turns edited JSON back into limits.
pub fn from_json(v: serde_json::Value) -> GatewayLimits {
    serde_json::from_value(v).expect("valid test limits")
}

pub fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

// === clients ===

/// One client connection (HTTP/1.1 keep-alive).
pub struct Conn {
    pub sender: http1::SendRequest<Body>,
}

pub async fn connect(addr: SocketAddr) -> Conn {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    Conn { sender }
}

impl Conn {
    pub async fn send(&mut self, req: Request<Body>) -> hyper::Result<Response<Incoming>> {
        self.sender.ready().await?;
        self.sender.send_request(req).await
    }

    /// Sends and reads the whole response.
    pub async fn call(&mut self, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
        let response = self.send(req).await.expect("a response");
        let (parts, body) = response.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }
}

pub fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "gateway.test");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let body = if body.is_empty() {
        Empty::new().boxed_unsync()
    } else {
        Full::new(Bytes::from(body.to_owned())).boxed_unsync()
    };
    b.body(body).unwrap()
}

/// GET on a fresh connection.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, String) {
    connect(addr)
        .await
        .call(request("GET", path, headers, ""))
        .await
}

/// POST on a fresh connection.
pub async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, http::HeaderMap, String) {
    connect(addr)
        .await
        .call(request("POST", path, headers, body))
        .await
}

/// A POST of `body` to `path` with `headers` on a fresh connection, in a task of its own that
/// yields the response's status.
pub fn spawn_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> tokio::task::JoinHandle<StatusCode> {
    let (path, body) = (path.to_owned(), body.to_owned());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        post(addr, &path, &headers, &body).await.0
    })
}

/// Sends the raw `bytes` on a fresh connection to `addr` and reads until the peer closes it or
/// `wait` passes: what arrived (as lossy UTF-8), and whether the peer closed the connection.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8], wait: Duration) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let closed = tokio::time::timeout(wait, s.read_to_end(&mut out))
        .await
        .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// A metric's value: the first sample line starting with `series` (name and labels).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

/// The pool's `poolpilot_pool_connections_closed_total` for endpoint `model-a-0` of backend
/// `model-a` and `reason`, in the metrics `text`.
pub fn closed_connections(text: &str, reason: &str) -> Option<f64> {
    metric(
        text,
        &format!(
            r#"poolpilot_pool_connections_closed_total{{backend="model-a",endpoint="model-a-0",reason="{reason}"}}"#
        ),
    )
}

/// The gateway's `poolpilot_upstream_timeouts_total` of backend `model-a` for `kind`
/// (`first_byte`, `stream_idle`, `total`), in the metrics `text`.
pub fn upstream_timeouts(text: &str, kind: &str) -> Option<f64> {
    metric(
        text,
        &format!(r#"poolpilot_upstream_timeouts_total{{backend="model-a",kind="{kind}"}}"#),
    )
}

/// A GET that reports failure instead of panicking, for polling: `None` when it fails or gets
/// no answer within 2 s. A poll must end for [`assert_eventually`]'s deadline to be checked:
/// against a connection the gateway closes at once (the admin listener over its connection
/// cap), hyper's client sometimes never resolves the call (1 run in 5 of
/// `a_client_that_does_not_read_its_responses_loses_its_connection` alone, before this bound:
/// the test then hung for good).
pub async fn try_get(addr: SocketAddr, path: &str) -> Option<u16> {
    let probe = async {
        let stream = TcpStream::connect(addr).await.ok()?;
        let (mut sender, conn) = http1::handshake::<_, Body>(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(conn);
        let response = sender
            .send_request(request("GET", path, &[], ""))
            .await
            .ok()?;
        Some(response.status().as_u16())
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .unwrap_or_else(|_| {
            eprintln!("try_get {addr}{path}: no answer within 2 s");
            None
        })
}

/// A backend connection's socket that stops counting in [`Seen::connections`] the moment its
/// side closes: before its FIN goes out (at the shutdown of its write side, or when it is
/// dropped), so that a gateway that waited for that FIN always finds the count already down.
/// (Counted after the connection's task ended, a gateway that had rightly waited could look
/// before the count moved.)
struct Counted {
    inner: TcpStream,
    seen: Option<Arc<Seen>>,
}

impl Counted {
    fn uncount(&mut self) {
        if let Some(seen) = self.seen.take() {
            seen.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.uncount();
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.uncount();
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
