//! Loopback tests of modelsim (the simulated model backend) over real sockets on 127.0.0.1:
//! saturation (batching and full-batch slowdown, queueing, refusals) and its metrics, SSE
//! streaming chunk by chunk, every fault, exact connection accounting, graceful shutdown, and
//! the binary with SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use poolpilot_modelsim::{Config, Faults, Jitter, Modelsim, RateLimit, Remote, ServiceTime, Stats};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};

const WAIT: Duration = Duration::from_secs(10);

/// One client HTTP/1.1 connection.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    task: JoinHandle<Result<(), hyper::Error>>,
}

async fn connect(addr: SocketAddr) -> Conn {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    Conn {
        sender,
        task: tokio::spawn(conn),
    }
}

fn request(method: Method, path: &str, body: Option<&Value>) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "modelsim");
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    builder.body(Full::new(body)).expect("request")
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
    elapsed: Duration,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

impl Conn {
    async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<Reply, hyper::Error> {
        let start = Instant::now();
        self.sender.ready().await?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            headers,
            body,
            elapsed: start.elapsed(),
        })
    }
}

/// A request on a fresh connection, closed afterwards.
async fn call(addr: SocketAddr, method: Method, path: &str, body: Option<&Value>) -> Reply {
    let mut conn = connect(addr).await;
    conn.send(request(method, path, body))
        .await
        .expect("request failed")
}

fn chat(max_tokens: Option<u32>, stream: bool) -> Value {
    let mut body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "How many connections does a pool need?"}],
        "stream": stream,
    });
    if let Some(n) = max_tokens {
        body["max_tokens"] = json!(n);
    }
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// An HTTP/1.1 POST with a JSON body, as raw bytes for a plain TCP stream.
fn raw_request(path: &str, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nhost: modelsim\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// The value of an unlabelled sample (or a sample given with its labels) in exposition text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

/// A non-streaming chat completion request for `max_tokens` tokens.
fn chat_request(max_tokens: u32) -> Request<Full<Bytes>> {
    request(
        Method::POST,
        "/v1/chat/completions",
        Some(&chat(Some(max_tokens), false)),
    )
}

/// A non-streaming chat completion of `max_tokens` tokens on a fresh connection.
async fn call_chat(addr: SocketAddr, max_tokens: u32) -> Reply {
    call(
        addr,
        Method::POST,
        "/v1/chat/completions",
        Some(&chat(Some(max_tokens), false)),
    )
    .await
}

/// The stats once `condition` holds; fails the test, naming `what`, if that takes over [`WAIT`].
async fn wait_until(sim: &Modelsim, what: &str, condition: impl Fn(&Stats) -> bool) -> Stats {
    sim.wait_for(what, WAIT, condition).await.unwrap()
}

async fn start(config: Config) -> Modelsim {
    Modelsim::start(config).await.expect("modelsim starts")
}

fn fast() -> ServiceTime {
    ServiceTime::fixed(Duration::from_millis(1), Duration::from_millis(1), 4)
}

/// Modelsim with the default configuration but the [`fast`] service time.
async fn start_fast() -> Modelsim {
    start(Config {
        service: fast(),
        ..Config::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_openai_shapes() {
    let sim = start(Config {
        instance: "pod-a".to_owned(),
        models: vec!["sim-model".to_owned(), "other".to_owned()],
        service: fast(),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();

    let reply = call_chat(addr, 3).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-modelsim-instance"], "pod-a");
    assert_eq!(reply.headers["content-type"], "application/json");
    let v = reply.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        3
    );
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);

    let completion = json!({"model": "other", "prompt": "Once upon a time"});
    let v = call(addr, Method::POST, "/v1/completions", Some(&completion))
        .await
        .json();
    assert_eq!(
        (v["object"].as_str(), v["model"].as_str()),
        (Some("text_completion"), Some("other"))
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 4, "default tokens");

    let models = call(addr, Method::GET, "/v1/models", None).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-model", "other"]);

    let unknown = call(
        addr,
        Method::POST,
        "/v1/chat/completions",
        Some(&json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(unknown.json()["error"]["code"], "model_not_found");
    let bad = call(
        addr,
        Method::POST,
        "/v1/chat/completions",
        Some(&json!({"model": "sim-model"})),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages")
    );

    assert_eq!(
        call(addr, Method::GET, "/health", None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        call(addr, Method::GET, "/nope", None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(addr, Method::GET, "/v1/chat/completions", None)
            .await
            .status,
        StatusCode::METHOD_NOT_ALLOWED
    );

    let stats = sim.stats();
    assert_eq!(
        (
            stats.requests_received,
            stats.served,
            stats.rejected_invalid
        ),
        (4, 2, 2)
    );
    assert_eq!(stats.tokens_generated, 7);
    let text = sim.metrics_text();
    assert_eq!(
        metric(
            &text,
            "modelsim_responses_total{endpoint=\"/v1/chat/completions\",code=\"200\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "modelsim_responses_total{endpoint=\"/v1/chat/completions\",code=\"404\"}"
        ),
        1.0
    );
}

/// Sends `n` chat requests at once, each on its own connection; returns (status, latency).
async fn burst(addr: SocketAddr, n: usize) -> Vec<(StatusCode, Duration, Option<String>)> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let reply = call(
                    addr,
                    Method::POST,
                    "/v1/chat/completions",
                    Some(&chat(None, false)),
                )
                .await;
                let retry_after = reply
                    .headers
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                (reply.status, reply.elapsed, retry_after)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for task in tasks {
        out.push(task.await.expect("request task"));
    }
    out
}

/// The median latency of three calls made one at a time.
async fn alone(addr: SocketAddr) -> Duration {
    let mut alone = Vec::new();
    for _ in 0..3 {
        let r = burst(addr, 1).await;
        assert_eq!(r[0].0, StatusCode::OK);
        alone.push(r[0].1);
    }
    alone.sort();
    alone[1]
}

/// Sends a [`burst`] of `n` calls, asserts that every one was served (`when` names the moment in
/// the failure message) and returns their latencies.
async fn served_burst(addr: SocketAddr, n: usize, when: &str) -> Vec<Duration> {
    let replies = burst(addr, n).await;
    assert!(
        replies.iter().all(|r| r.0 == StatusCode::OK),
        "{when}: {replies:?}"
    );
    replies.iter().map(|r| r.1).collect()
}

fn mean(latencies: &[Duration]) -> Duration {
    latencies.iter().sum::<Duration>() / u32::try_from(latencies.len()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_raises_latency_then_refuses_and_metrics_say_so() {
    // 10 tokens × 15 ms = 150 ms alone; twice as slow per token with all 4 slots busy.
    let sim = start(Config {
        service: ServiceTime {
            base_latency: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            per_token: Duration::from_millis(15),
            jitter: Jitter::None,
            batch_slowdown: 0.0,
            saturation_slowdown: 1.0,
            default_tokens: 10,
            max_tokens: 10,
        },
        max_concurrency: 4,
        max_queue: 8,
        admin_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        seed: Some(1),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();

    // Alone.
    let alone = alone(addr).await;
    assert!(
        alone >= Duration::from_millis(140),
        "10 tokens of 15 ms took {alone:?}"
    );

    // At the concurrency limit: no queue, but decoding slows down.
    let at_limit = served_burst(addr, 4, "at the concurrency limit").await;
    assert!(
        mean(&at_limit) > alone.mul_f64(1.3),
        "saturated {at_limit:?} vs alone {alone:?}"
    );

    // Concurrency + full queue: everyone is served, the queued ones much later.
    let queued = served_burst(addr, 12, "nobody beyond the queue yet").await;
    let slowest = *queued.iter().max().unwrap();
    assert!(
        mean(&queued) > mean(&at_limit).mul_f64(1.4),
        "queued {queued:?} vs at limit {at_limit:?}"
    );
    assert!(
        slowest > mean(&at_limit).mul_f64(2.0),
        "the last of 3 waves: {slowest:?} vs {at_limit:?}"
    );
    // The queue never exceeds its bound; it nearly fills unless arrivals spread over a wave.
    let stats = sim.stats();
    assert_eq!((stats.in_flight_peak, stats.refused), (4, 0), "{stats:?}");
    assert!((5..=8).contains(&stats.queued_peak), "{stats:?}");

    // Beyond the queue: refusals, fast, with Retry-After.
    let overloaded = burst(addr, 24).await;
    let ok = overloaded.iter().filter(|r| r.0 == StatusCode::OK).count();
    let refused: Vec<_> = overloaded
        .iter()
        .filter(|r| r.0 == StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    assert_eq!(ok + refused.len(), 24, "{overloaded:?}");
    assert!(
        ok >= 12,
        "4 slots + 8 queue places are served: {overloaded:?}"
    );
    assert!(
        !refused.is_empty(),
        "some requests are refused: {overloaded:?}"
    );
    assert!(
        refused.iter().all(|r| r.2.as_deref() == Some("1")),
        "Retry-After on refusals"
    );
    let fastest_refusal = refused.iter().map(|r| r.1).min().unwrap();
    assert!(
        fastest_refusal < alone,
        "refusals do not wait: {fastest_refusal:?}"
    );

    // The metrics say so, as Prometheus would scrape them (admin listener).
    let stats = sim.stats();
    assert_eq!(stats.refused, refused.len() as u64);
    assert_eq!(stats.served, 3 + 4 + 12 + ok as u64);
    assert_eq!((stats.in_flight, stats.queued), (0, 0));
    let scrape = call(sim.admin_addr().unwrap(), Method::GET, "/metrics", None).await;
    assert_eq!(scrape.status, StatusCode::OK);
    let text = String::from_utf8(scrape.body.to_vec()).unwrap();
    assert_eq!(
        metric(&text, "modelsim_requests_refused_total"),
        refused.len() as f64
    );
    assert_eq!(
        metric(&text, "modelsim_requests_served_total"),
        stats.served as f64
    );
    assert_eq!(metric(&text, "modelsim_requests_in_flight_peak"), 4.0);
    assert_eq!(metric(&text, "modelsim_requests_queued_peak"), 8.0);
    assert_eq!(metric(&text, "modelsim_requests_in_flight"), 0.0);
    assert_eq!(metric(&text, "modelsim_max_concurrency"), 4.0);
    assert_eq!(
        metric(&text, "modelsim_request_duration_seconds_count"),
        stats.served as f64
    );
    let waited = metric(&text, "modelsim_queue_wait_seconds_sum");
    assert!(waited > 0.5, "queue wait sum {waited}");
    // The slowest served request (the third wave of the queued burst) took several service times.
    let slow_bucket = metric(
        &text,
        "modelsim_request_duration_seconds_bucket{le=\"0.256\"}",
    );
    assert!(
        slow_bucket < stats.served as f64,
        "some requests took more than 256 ms"
    );
    assert_eq!(
        metric(
            &text,
            "modelsim_responses_total{endpoint=\"/v1/chat/completions\",code=\"503\"}"
        ),
        refused.len() as f64
    );
    assert!(metric(&text, "process_open_fds") >= 3.0);
    assert!(metric(&text, "process_max_fds") >= metric(&text, "process_open_fds"));
}

/// A model server batches the calls in flight: with a batch slowdown every call gets slower as
/// more run beside it, long before the slots run out and with nothing queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_slows_calls_down_long_before_the_slots_run_out() {
    // 10 tokens × 20 ms alone; about 1.5× as long with 16 of 32 slots busy.
    let sim = start(Config {
        service: ServiceTime {
            base_latency: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            per_token: Duration::from_millis(20),
            jitter: Jitter::None,
            batch_slowdown: 1.0,
            saturation_slowdown: 0.0,
            default_tokens: 10,
            max_tokens: 10,
        },
        max_concurrency: 32,
        max_queue: 0,
        seed: Some(1),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let alone = alone(addr).await;
    let half = served_burst(addr, 16, "16 of 32 slots busy").await;
    assert!(
        mean(&half) > alone.mul_f64(1.25),
        "16 of 32 slots busy: {half:?} vs alone {alone:?}"
    );
    let stats = sim.stats();
    assert_eq!(
        (stats.in_flight_peak, stats.queued_peak, stats.refused),
        (16, 0, 0),
        "slower without queueing: {stats:?}"
    );
}

/// One SSE event and when it arrived.
#[derive(Debug)]
struct Event {
    at: Duration,
    data: String,
}

/// Sends a streaming request and reads the answer frame by frame, timestamping every event.
async fn stream(
    addr: SocketAddr,
    path: &str,
    body: &Value,
) -> (StatusCode, http::HeaderMap, Duration, Vec<Event>) {
    let mut conn = connect(addr).await;
    let start = Instant::now();
    let resp = conn
        .sender
        .send_request(request(Method::POST, path, Some(body)))
        .await
        .expect("stream head");
    let head_at = start.elapsed();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let mut body = resp.into_body();
    let mut pending = String::new();
    let mut events = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("stream frame");
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.push_str(std::str::from_utf8(data).expect("utf-8"));
        let at = start.elapsed();
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let data = event
                .trim_end()
                .strip_prefix("data: ")
                .expect("an SSE data line")
                .to_owned();
            events.push(Event { at, data });
        }
    }
    assert!(pending.is_empty(), "trailing bytes {pending:?}");
    (status, headers, head_at, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_responses_arrive_chunk_by_chunk() {
    let per_token = Duration::from_millis(40);
    let sim = start(Config {
        service: ServiceTime::fixed(Duration::from_millis(5), per_token, 6),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();

    let (status, headers, head_at, events) =
        stream(addr, "/v1/chat/completions", &chat(Some(6), true)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/event-stream");
    // 6 tokens, the finish chunk, the usage chunk, [DONE].
    assert_eq!(events.len(), 9, "{events:?}");
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..8]
        .iter()
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks[..6]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(content.split_whitespace().count(), 6);
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[7]["usage"]["completion_tokens"], 6);
    assert_eq!(chunks[7]["usage"]["prompt_tokens"], 10);
    assert_eq!(chunks[7]["choices"], json!([]));
    // Asked for usage, every chunk before it says `"usage": null` (as OpenAI's and vLLM's do).
    assert!(
        chunks[..7]
            .iter()
            .all(|c| c.get("usage") == Some(&Value::Null)),
        "{chunks:?}"
    );

    // Chunk by chunk: the head comes first, then one token every ~40 ms, not in one burst.
    let token_times: Vec<Duration> = events[..6].iter().map(|e| e.at).collect();
    assert!(
        head_at < token_times[0],
        "head {head_at:?} before the first token {:?}",
        token_times[0]
    );
    let spread = token_times[5] - token_times[0];
    assert!(
        spread >= per_token.mul_f64(5.0 * 0.75),
        "6 tokens spread over {spread:?}"
    );
    let gaps: Vec<Duration> = token_times.windows(2).map(|w| w[1] - w[0]).collect();
    let separate = gaps.iter().filter(|g| **g >= per_token / 2).count();
    assert!(separate >= 3, "inter-chunk gaps {gaps:?}");

    // The same text as a complete answer; the legacy completions endpoint streams too.
    let full = call_chat(addr, 6).await.json();
    assert_eq!(full["choices"][0]["message"]["content"], content.as_str());
    let (status, _, _, events) = stream(
        addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(events.len(), 5, "3 tokens, finish, [DONE]: {events:?}");
    let first: Value = serde_json::from_str(&events[0].data).unwrap();
    assert_eq!(first["object"], "text_completion");
    // Not asked for usage: no usage chunk, and no `usage` field in the chunks.
    assert!(
        events[..4].iter().all(|e| !e.data.contains("usage")),
        "{events:?}"
    );
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty());
    assert!(
        events[2].at - events[0].at >= per_token,
        "completions stream per token too"
    );

    let text = sim.metrics_text();
    assert_eq!(metric(&text, "modelsim_requests_served_total"), 3.0);
    assert_eq!(
        metric(&text, "modelsim_time_to_first_token_seconds_count"),
        3.0
    );
    assert_eq!(metric(&text, "modelsim_tokens_generated_total"), 15.0);
}

/// A chat with a long system prompt (`system` characters) shared between calls, and a short
/// question of its own; streamed (with usage) or not, one output token.
fn with_system_prompt(system: usize, question: &str, stream: bool) -> Value {
    let mut body = json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": "You answer questions about connection pools. ".repeat(system / 45 + 1)[..system]},
            {"role": "user", "content": question},
        ],
        "max_tokens": 1,
        "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_prefix_is_served_from_the_prefix_cache_and_costs_less_prefill() {
    // 0.5 ms of prefill per prompt token not cached: a 1,600-character system prompt (400
    // tokens) takes 200 ms cold.
    let sim = start(Config {
        service: ServiceTime {
            prefill_per_token: Duration::from_micros(500),
            ..ServiceTime::fixed(Duration::ZERO, Duration::ZERO, 1)
        },
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let timed = |body: Value| async move {
        let started = Instant::now();
        let v = call(addr, Method::POST, "/v1/chat/completions", Some(&body))
            .await
            .json();
        (v, started.elapsed())
    };

    // 1,600 + 20 characters: 405 tokens, 25 full blocks.
    let (cold, cold_took) = timed(with_system_prompt(1600, "What is a lease, 1?", false)).await;
    assert_eq!(cold["usage"]["prompt_tokens"], 405);
    assert_eq!(
        cold["usage"].get("prompt_tokens_details"),
        None,
        "nothing cached: absent, as vLLM writes it"
    );
    assert!(cold_took >= Duration::from_millis(200), "{cold_took:?}");

    // Another question after the same system prompt: the 25 blocks up to the question's start
    // (1,600 characters), which holds the blocks' end, are cached.
    let (warm, warm_took) = timed(with_system_prompt(1600, "What is a lease, 2?", false)).await;
    assert_eq!(warm["usage"]["prompt_tokens"], 405);
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"], 400,
        "{warm}"
    );
    assert!(
        warm_took < cold_took / 2,
        "5 uncached tokens of prefill ({warm_took:?}) against 405 ({cold_took:?})"
    );

    // A stream reports it in its usage chunk.
    let (_, _, _, events) = stream(
        addr,
        "/v1/chat/completions",
        &with_system_prompt(1600, "What is a lease, 3?", true),
    )
    .await;
    let usage: Value = serde_json::from_str(&events[events.len() - 2].data).unwrap();
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        400
    );

    // A system prompt one character shorter shares its first 24 blocks (1,536 characters) and
    // no more: the cache hits whole blocks.
    let (shorter, _) = timed(with_system_prompt(1599, "What is a lease, 4?", false)).await;
    assert_eq!(shorter["usage"]["prompt_tokens"], 405);
    assert_eq!(
        shorter["usage"]["prompt_tokens_details"]["cached_tokens"],
        384
    );

    // vLLM's counters, in prompt tokens: four queries of 405, three hits.
    let text = sim.metrics_text();
    assert_eq!(
        metric(&text, "vllm:prefix_cache_queries_total"),
        4.0 * 405.0
    );
    assert_eq!(metric(&text, "vllm:prefix_cache_hits_total"), 1184.0);
    let stats = sim.stats();
    assert_eq!(
        (stats.prefix_cache_queries, stats.prefix_cache_hits),
        (1620, 1184)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cache_of_zero_blocks_caches_nothing_and_counts_nothing() {
    let sim = start(Config {
        service: fast(),
        prefix_cache_blocks: 0,
        ..Config::default()
    })
    .await;
    for _ in 0..2 {
        let v = call(
            sim.addr(),
            Method::POST,
            "/v1/chat/completions",
            Some(&with_system_prompt(1600, "Again?", false)),
        )
        .await
        .json();
        assert_eq!(v["usage"].get("prompt_tokens_details"), None, "{v}");
    }
    let text = sim.metrics_text();
    assert_eq!(metric(&text, "vllm:prefix_cache_queries_total"), 0.0);
    assert_eq!(metric(&text, "vllm:prefix_cache_hits_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_flip_at_runtime_through_the_admin_api() {
    let sim = start(Config {
        service: fast(),
        faults: Faults {
            error_ratio: 1.0,
            error_status: 502,
            ..Faults::default()
        },
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let body = chat(Some(2), false);

    let reply = call(addr, Method::POST, "/v1/chat/completions", Some(&body)).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_eq!(reply.json()["error"]["code"], "modelsim_fault");

    let patched = call(
        addr,
        Method::PATCH,
        "/admin/faults",
        Some(&json!({"error_ratio": 0.0})),
    )
    .await;
    assert_eq!(patched.status, StatusCode::OK);
    assert_eq!(
        patched.json()["error_status"],
        502,
        "PATCH keeps the other fields"
    );
    assert_eq!(
        call(addr, Method::POST, "/v1/chat/completions", Some(&body))
            .await
            .status,
        StatusCode::OK
    );

    // A ratio of one half, with a seed-independent check: both outcomes show up.
    sim.set_faults(Faults {
        error_ratio: 0.5,
        ..Faults::default()
    })
    .unwrap();
    let mut statuses = Vec::new();
    let mut conn = connect(addr).await;
    for _ in 0..40 {
        statuses.push(
            conn.send(request(Method::POST, "/v1/chat/completions", Some(&body)))
                .await
                .unwrap()
                .status,
        );
    }
    let errors = statuses
        .iter()
        .filter(|s| **s == StatusCode::INTERNAL_SERVER_ERROR)
        .count();
    assert!(
        (5..=35).contains(&errors),
        "{errors} errors of 40 at ratio 0.5"
    );

    let put = call(
        addr,
        Method::PUT,
        "/admin/faults",
        Some(&json!({"health_failing": true})),
    )
    .await;
    assert_eq!(put.status, StatusCode::OK);
    assert_eq!(put.json()["error_ratio"], 0.0, "PUT replaces everything");
    assert_eq!(
        call(addr, Method::GET, "/health", None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(metric(&sim.metrics_text(), "modelsim_health_failing"), 1.0);

    for invalid in [
        json!({"error_ratio": 2.0}),
        json!({"no_such_fault": 1}),
        json!([1]),
    ] {
        let reply = call(addr, Method::PATCH, "/admin/faults", Some(&invalid)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{invalid}");
    }
    assert!(
        sim.faults().health_failing,
        "a rejected update keeps the faults in force"
    );
    let cleared = call(addr, Method::PUT, "/admin/faults", Some(&json!({}))).await;
    assert_eq!(cleared.status, StatusCode::OK);
    assert_eq!(sim.faults(), Faults::default());
    assert_eq!(
        call(addr, Method::GET, "/health", None).await.status,
        StatusCode::OK
    );
    assert!(sim.stats().errors_injected >= 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_reset_sends_a_tcp_reset() {
    let sim = start_fast().await;
    sim.set_faults(Faults {
        reset_ratio: 1.0,
        ..Faults::default()
    })
    .unwrap();
    let mut raw = TcpStream::connect(sim.addr()).await.unwrap();
    raw.write_all(raw_request("/v1/chat/completions", &chat(Some(2), false)).as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let read = timeout(WAIT, raw.read(&mut buf))
        .await
        .expect("the server acts");
    let err = read.expect_err("a reset, not an answer or a clean close");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    let stats = wait_until(&sim, "the reset connection is gone", |s| {
        s.connections_open == 0
    })
    .await;
    assert_eq!(
        (stats.resets_injected, stats.connections_reset, stats.served),
        (1, 1, 0)
    );

    // Cleared: answers again.
    sim.set_faults(Faults::default()).unwrap();
    let reply = call_chat(sim.addr(), 2).await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_stall_hangs_until_the_client_gives_up() {
    let sim = start(Config {
        service: ServiceTime::fixed(Duration::ZERO, Duration::from_millis(10), 8),
        faults: Faults {
            stall_ratio: 1.0,
            ..Faults::default()
        },
        ..Config::default()
    })
    .await;
    let addr = sim.addr();

    // Before the head: no answer at all, no slot held, for as long as the client waits.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(raw_request("/v1/chat/completions", &chat(Some(2), false)).as_bytes())
        .await
        .unwrap();
    let stats = wait_until(&sim, "one stalled request", |s| s.stalled == 1).await;
    assert_eq!(
        (
            stats.in_flight,
            stats.stalls_injected,
            stats.connections_open
        ),
        (0, 1, 1)
    );
    let mut buf = [0u8; 64];
    assert!(
        timeout(Duration::from_millis(300), raw.read(&mut buf))
            .await
            .is_err(),
        "a stalled request is never answered"
    );
    assert_eq!(sim.stats().stalled, 1);
    drop(raw);
    let stats = wait_until(
        &sim,
        "the stalled request dropped with its connection",
        |s| s.stalled == 0 && s.connections_open == 0,
    )
    .await;
    assert_eq!(stats.cancelled, 1);

    // Mid-stream: two tokens, then silence while holding the slot.
    sim.set_faults(Faults {
        stall_ratio: 1.0,
        stall_after_tokens: Some(2),
        ..Faults::default()
    })
    .unwrap();
    let mut conn = connect(addr).await;
    let resp = timeout(
        WAIT,
        conn.sender.send_request(request(
            Method::POST,
            "/v1/chat/completions",
            Some(&chat(Some(8), true)),
        )),
    )
    .await
    .expect("the head comes")
    .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut received = String::new();
    loop {
        match timeout(Duration::from_millis(300), body.frame()).await {
            Ok(Some(frame)) => {
                received.push_str(std::str::from_utf8(frame.unwrap().data_ref().unwrap()).unwrap())
            }
            Ok(None) => panic!("the stream ended instead of stalling: {received}"),
            Err(_) => break,
        }
    }
    assert_eq!(received.matches("data: ").count(), 2, "{received}");
    assert!(!received.contains("[DONE]"));
    assert_eq!(
        sim.stats().in_flight,
        1,
        "a request hanging mid-stream holds its slot"
    );
    drop(body);
    drop(conn);
    let stats = wait_until(&sim, "the hung stream released", |s| {
        s.in_flight == 0 && s.connections_open == 0
    })
    .await;
    assert_eq!(
        (stats.stalls_injected, stats.cancelled, stats.served),
        (2, 2, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_slow_headers_delays_the_response_head() {
    let sim = start_fast().await;
    let addr = sim.addr();
    sim.set_faults(Faults {
        slow_headers_ms: 400,
        ..Faults::default()
    })
    .unwrap();
    let (status, _, head_at, events) =
        stream(addr, "/v1/chat/completions", &chat(Some(2), true)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        head_at >= Duration::from_millis(380),
        "head after {head_at:?}"
    );
    assert_eq!(events.last().unwrap().data, "[DONE]");
    sim.set_faults(Faults::default()).unwrap();
    let (_, _, head_at, _) = stream(addr, "/v1/chat/completions", &chat(Some(2), true)).await;
    assert!(
        head_at < Duration::from_millis(300),
        "head after {head_at:?} without the fault"
    );
    assert_eq!(
        metric(
            &sim.metrics_text(),
            "modelsim_faults_injected_total{kind=\"slow_headers\"}"
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_idle_close_drops_idle_keep_alive_connections_only() {
    let sim = start(Config {
        service: ServiceTime::fixed(Duration::from_millis(400), Duration::ZERO, 1),
        faults: Faults {
            idle_close_ms: Some(150),
            ..Faults::default()
        },
        ..Config::default()
    })
    .await;
    let addr = sim.addr();

    // A request longer than the idle timeout is not cut, and the connection closes after it.
    let mut conn = connect(addr).await;
    let reply = conn.send(chat_request(1)).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    let ended = timeout(WAIT, conn.task)
        .await
        .expect("the server closes the idle connection");
    ended.unwrap().expect("a clean close");
    // A connection that never sends anything is idle too.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let n = timeout(WAIT, raw.read(&mut buf))
        .await
        .expect("closed by the server")
        .unwrap();
    assert_eq!(n, 0, "a clean close (FIN)");
    let stats = wait_until(&sim, "both connections closed", |s| s.connections_open == 0).await;
    assert_eq!((stats.connections_closed_idle, stats.served), (2, 1));

    // Without the fault, idle connections stay.
    sim.set_faults(Faults::default()).unwrap();
    let _raw = TcpStream::connect(addr).await.unwrap();
    wait_until(&sim, "a new connection", |s| s.connections_open == 1).await;
    sleep(Duration::from_millis(400)).await;
    assert_eq!(sim.stats().connections_open, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_count_is_exact() {
    let sim = start(Config {
        service: fast(),
        admin_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let admin = sim.admin_addr().unwrap();

    let mut raw = Vec::new();
    for _ in 0..30 {
        raw.push(TcpStream::connect(addr).await.unwrap());
    }
    let stats = wait_until(&sim, "30 connections", |s| s.connections_open == 30).await;
    assert_eq!(
        (stats.connections_peak, stats.connections_accepted),
        (30, 30)
    );

    // Keep-alive connections that carry requests count once each, however many requests.
    let mut http = Vec::new();
    for _ in 0..5 {
        let mut conn = connect(addr).await;
        for _ in 0..3 {
            let reply = conn.send(chat_request(1)).await.unwrap();
            assert_eq!(reply.status, StatusCode::OK);
        }
        http.push(conn);
    }
    let stats = wait_until(&sim, "35 connections", |s| s.connections_open == 35).await;
    assert_eq!(
        (
            stats.connections_peak,
            stats.connections_accepted,
            stats.served
        ),
        (35, 35, 15)
    );

    // The admin listener reports without being counted.
    let reported: Stats =
        serde_json::from_value(call(admin, Method::GET, "/admin/stats", None).await.json())
            .unwrap();
    assert_eq!(
        (
            reported.connections_open,
            reported.connections_peak,
            reported.admin_connections_open
        ),
        (35, 35, 1)
    );

    raw.truncate(20);
    wait_until(&sim, "25 connections", |s| s.connections_open == 25).await;
    drop(http);
    drop(raw);
    let stats = wait_until(&sim, "no connection", |s| {
        s.connections_open == 0 && s.admin_connections_open == 0
    })
    .await;
    assert_eq!(
        (stats.connections_peak, stats.connections_accepted),
        (35, 35)
    );
    let text = String::from_utf8(
        call(admin, Method::GET, "/metrics", None)
            .await
            .body
            .to_vec(),
    )
    .unwrap();
    assert_eq!(metric(&text, "modelsim_connections_open"), 0.0);
    assert_eq!(metric(&text, "modelsim_connections_peak"), 35.0);
    assert_eq!(metric(&text, "modelsim_connections_accepted_total"), 35.0);
    assert_eq!(metric(&text, "modelsim_admin_connections_open"), 1.0);

    // Peaks reset to the current value, over HTTP.
    let reset = call(admin, Method::POST, "/admin/stats/reset-peaks", None)
        .await
        .json();
    assert_eq!(reset["connections_peak"], 0);
    assert_eq!(sim.stats().connections_peak, 0);
}

/// A connection to `addr` from the loopback address `from`.
async fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(addr).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_peak_names_who_held_it() {
    let sim = start_fast().await;
    let addr = sim.addr();
    let peers = |s: &Stats| -> BTreeMap<String, usize> {
        let mut by_ip = BTreeMap::new();
        for c in &s.connections_at_peak {
            let ip = c
                .peer
                .rsplit_once(':')
                .map_or(c.peer.as_str(), |(ip, _)| ip);
            *by_ip.entry(ip.to_owned()).or_default() += 1;
        }
        by_ip
    };
    let mut first = Vec::new();
    for _ in 0..3 {
        first.push(connect_from([127, 0, 0, 1], addr).await);
    }
    // One connection carries a request from behind a proxy.
    let mut proxied = connect_from([127, 0, 0, 2], addr).await;
    proxied
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: sim\r\nx-forwarded-for: 10.244.0.9\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    proxied.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let mut second = vec![proxied, connect_from([127, 0, 0, 2], addr).await];
    wait_until(&sim, "5 connections", |s| s.connections_open == 5).await;

    // Fewer connections than the peak: the detail stays the peak's.
    first.truncate(1);
    wait_until(&sim, "3 connections", |s| s.connections_open == 3).await;
    second.push(connect_from([127, 0, 0, 2], addr).await);
    let stats = wait_until(&sim, "4 connections", |s| s.connections_open == 4).await;
    assert_eq!(stats.connections_peak, 5);
    assert_eq!(
        peers(&stats),
        BTreeMap::from([("127.0.0.1".to_owned(), 3), ("127.0.0.2".to_owned(), 2)])
    );
    let forwarded: Vec<_> = stats
        .connections_at_peak
        .iter()
        .filter_map(|c| c.forwarded_for.as_deref())
        .collect();
    assert_eq!(forwarded, ["10.244.0.9"]);
    assert!(stats.connections_at_peak.iter().all(|c| !c.in_request));

    // A reset takes the connections open now; a new peak replaces them.
    sim.reset_peaks();
    assert_eq!(
        peers(&sim.stats()),
        BTreeMap::from([("127.0.0.1".to_owned(), 1), ("127.0.0.2".to_owned(), 3)])
    );
    second.push(connect_from([127, 0, 0, 3], addr).await);
    let stats = wait_until(&sim, "5 connections", |s| s.connections_open == 5).await;
    assert_eq!(stats.connections_peak, 5);
    assert_eq!(
        peers(&stats),
        BTreeMap::from([
            ("127.0.0.1".to_owned(), 1),
            ("127.0.0.2".to_owned(), 3),
            ("127.0.0.3".to_owned(), 1),
        ])
    );
    drop((first, second));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_requests_in_progress() {
    let sim = start(Config {
        service: ServiceTime::fixed(Duration::from_millis(300), Duration::ZERO, 1),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let requests: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { call_chat(addr, 1).await }))
        .collect();
    let idle = TcpStream::connect(addr).await.unwrap();
    wait_until(&sim, "2 requests in flight", |s| s.in_flight == 2).await;
    let stats = timeout(WAIT, sim.shutdown(Duration::from_secs(5)))
        .await
        .expect("drains in time");
    assert!(stats.draining);
    assert_eq!((stats.served, stats.connections_open), (2, 0));
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    drop(idle);
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_honours_env_and_stops_on_sigterm() {
    let (mut child, addr, admin) = start_process(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_modelsim"))
            .env("POD_IP", "127.0.0.1")
            .env("POD_NAME", "modelsim-7f9c-abcde")
            .env("MODELSIM_PORT", "0")
            .env("MODELSIM_ADMIN_PORT", "0")
            .env("MODELSIM_MODELS", "llama,mistral")
            .env("MODELSIM_MAX_CONCURRENCY", "3")
            .env("RUST_LOG", "warn")
            .args([
                "--per-token-ms",
                "1",
                "--base-latency-ms",
                "1",
                "--max-queue",
                "5",
                "--fault-error-ratio",
                "1",
            ]),
    )
    .await;
    assert!(addr.ip().is_loopback() && admin.ip().is_loopback() && addr.port() != admin.port());

    let models = call(addr, Method::GET, "/v1/models", None).await.json();
    assert_eq!(models["data"][1]["id"], "mistral");
    let reply = call(
        addr,
        Method::POST,
        "/v1/chat/completions",
        Some(&json!({"model": "llama", "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "--fault-error-ratio 1"
    );
    assert_eq!(reply.headers["x-modelsim-instance"], "modelsim-7f9c-abcde");
    let remote = Remote::new(admin);
    let stats = remote.stats().await.unwrap();
    assert_eq!(
        (
            stats.instance.as_str(),
            stats.max_concurrency,
            stats.max_queue
        ),
        ("modelsim-7f9c-abcde", 3, 5)
    );
    assert_eq!((stats.errors_injected, stats.connections_accepted), (1, 2));
    let text = remote.metrics().await.unwrap();
    assert!(metric(&text, "process_max_fds") >= 64.0);

    // Faults flip on the running process.
    let faults = remote
        .patch_faults(&json!({"error_ratio": 0.0, "health_failing": true}))
        .await
        .unwrap();
    assert_eq!((faults.error_ratio, faults.health_failing), (0.0, true));
    assert!(!remote.healthy().await.unwrap());
    let body = json!({"model": "llama", "messages": [{"role": "user", "content": "x"}]});
    let reply = call(addr, Method::POST, "/v1/chat/completions", Some(&body)).await;
    assert_eq!(reply.status, StatusCode::OK);
    remote.set_faults(&Faults::default()).await.unwrap();
    assert!(remote.healthy().await.unwrap());
    assert_eq!(remote.faults().await.unwrap(), Faults::default());
    let stats = remote.reset_peaks().await.unwrap();
    assert_eq!((stats.connections_open, stats.connections_peak), (0, 0));

    let pid = child.id().expect("running").to_string();
    let kill = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(kill.success());
    let status = timeout(WAIT, child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// Starts the binary under `sh -c 'ulimit -n LIMIT; exec modelsim …'`; returns it with its
/// serving and admin addresses.
async fn spawn_binary_with_fd_limit(limit: u32) -> (tokio::process::Child, SocketAddr, SocketAddr) {
    start_process(
        tokio::process::Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -n {limit} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_modelsim"))
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--base-latency-ms", "1", "--per-token-ms", "1"])
            .env("RUST_LOG", "error"),
    )
    .await
}

/// Starts `command` (the modelsim binary) and reads its first line, `modelsim listening on ADDR
/// admin ADDR`: the process (killed when dropped), its serving and its admin address.
async fn start_process(
    command: &mut tokio::process::Command,
) -> (tokio::process::Child, SocketAddr, SocketAddr) {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn modelsim");
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = timeout(WAIT, stdout.next_line())
        .await
        .expect("modelsim starts")
        .unwrap()
        .expect("a first line");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[..3], ["modelsim", "listening", "on"], "{line}");
    (child, words[3].parse().unwrap(), words[5].parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_reports_its_fd_limit_and_survives_running_out() {
    let (mut child, addr, admin) = spawn_binary_with_fd_limit(48).await;
    let remote = Remote::new(admin);
    let text = remote.metrics().await.unwrap();
    assert_eq!(metric(&text, "process_max_fds"), 48.0);
    let baseline = metric(&text, "process_open_fds");
    assert!(baseline < 40.0, "{baseline} fds open at start");

    // More clients than fds: the process accepts what it can, the rest wait in the backlog.
    let mut clients = Vec::new();
    for _ in 0..80 {
        clients.push(TcpStream::connect(addr).await.unwrap());
    }
    sleep(Duration::from_millis(300)).await;
    drop(clients);

    // Once the clients are gone it recovers: every backlogged connection is accepted and closed.
    let deadline = Instant::now() + WAIT;
    let stats = loop {
        let stats = remote.stats().await.unwrap();
        if stats.connections_accepted == 80 && stats.connections_open == 0 {
            break stats;
        }
        assert!(Instant::now() < deadline, "never recovered: {stats:?}");
        sleep(Duration::from_millis(20)).await;
    };
    assert!(stats.accept_errors >= 1, "{stats:?}");
    assert!(stats.connections_peak < 48, "{stats:?}");
    let reply = call_chat(addr, 2).await;
    assert_eq!(reply.status, StatusCode::OK);
    child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_http2_with_prior_knowledge_on_one_connection() {
    let sim = start(Config {
        service: ServiceTime::fixed(Duration::from_millis(100), Duration::ZERO, 1),
        ..Config::default()
    })
    .await;
    let stream = TcpStream::connect(sim.addr()).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let mut sender = sender.clone();
            tokio::spawn(async move {
                let req = Request::builder()
                    .method(Method::POST)
                    .uri("http://modelsim/v1/chat/completions")
                    .body(Full::new(Bytes::from(chat(Some(1), false).to_string())))
                    .unwrap();
                let resp = sender.send_request(req).await.expect("h2 response");
                assert_eq!(resp.version(), http::Version::HTTP_2);
                resp.status()
            })
        })
        .collect();
    let stats = wait_until(&sim, "3 concurrent h2 streams", |s| s.in_flight == 3).await;
    assert_eq!(stats.connections_open, 1, "three streams, one connection");
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    drop(sender);
    wait_until(&sim, "the h2 connection closed", |s| {
        s.connections_open == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_rate_limit_refuses_past_its_window_and_says_when_to_come_back() {
    let sim = start(Config {
        service: fast(),
        rate_limit: Some(RateLimit {
            requests: 3,
            window: Duration::from_secs(2),
        }),
        ..Config::default()
    })
    .await;
    let addr = sim.addr();
    let started = Instant::now();
    for _ in 0..3 {
        assert_eq!(call_chat(addr, 2).await.status, StatusCode::OK);
    }
    let refused = call_chat(addr, 2).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["error"]["code"], "rate_limit_exceeded");
    let secs: u64 = refused.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&secs), "{secs}");
    assert_eq!(refused.headers["x-ratelimit-limit-requests"], "3");
    assert_eq!(refused.headers["x-ratelimit-remaining-requests"], "0");
    let stats = sim.stats();
    assert_eq!((stats.served, stats.rate_limited), (3, 1), "{stats:?}");
    let text = call(addr, Method::GET, "/metrics", None).await.body;
    let text = String::from_utf8_lossy(&text);
    assert_eq!(metric(&text, "modelsim_requests_rate_limited_total"), 1.0);
    // The next window admits again.
    tokio::time::sleep_until(started + Duration::from_millis(2100)).await;
    assert_eq!(call_chat(addr, 2).await.status, StatusCode::OK);
}
