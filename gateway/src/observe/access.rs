//! The access log: one JSON line per call on the proxy port, written when its response ends
//! (so that it carries the bytes sent and whether the response completed), and the request id
//! that ties the line to the client's and the backend's logs.
//!
//! ```text
//!  server: request id (the client's x-request-id, or a new one) ─► Record (shared)
//!  proxy:  route → backend, limiter → client name and class, lease → endpoint + wait, head → upstream_ms
//!  server: response body ends or is dropped ─► AccessLog::finish: a line, unless a sampled-out
//!          success (every refusal, error and cut response is written)
//! ```
//!
//! A client appears by its override name (or `other`) and the short hash of its identity,
//! never by its key.

use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use parking_lot::Mutex;
use poolpilot_api::limits::PriorityClass;
use serde::Deserialize;
use tokio::time::Instant;

use super::labels::Timing;
use crate::limits::limiter::ClientKey;
use crate::proxy::body::BodyProgress;

/// `X-Request-Id`: taken from the client when it sends a usable one, else generated; sent to
/// the backend and returned to the client.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client-given request id kept; a longer (or non-printable) one is replaced.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// The request id of a call: the client's `X-Request-Id` when it is 1 to
/// [`MAX_REQUEST_ID_BYTES`] visible ASCII characters, else 32 random hex digits.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(given) = headers.get(&X_REQUEST_ID) {
        let bytes = given.as_bytes();
        if !bytes.is_empty()
            && bytes.len() <= MAX_REQUEST_ID_BYTES
            && bytes.iter().all(|b| b.is_ascii_graphic())
        {
            return given.clone();
        }
    }
    let id: [u8; 16] = rand::random();
    HeaderValue::from_str(&hex::encode(id)).expect("hex is a header value")
}

/// The `accessLog` section of the gateway configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccessLogConfig {
    /// Whether calls are logged at all.
    #[serde(default = "AccessLogConfig::default_enabled")]
    pub enabled: bool,
    /// The share of successful calls (2xx and 3xx answers of a backend, complete) that are
    /// logged, from 0 to 1; refusals, errors and cut responses are always logged.
    #[serde(default = "AccessLogConfig::default_sample")]
    pub success_sample_rate: f64,
    /// Where the lines go: a file (appended to), or standard output when omitted.
    #[serde(default)]
    pub file: Option<PathBuf>,
}

impl AccessLogConfig {
    fn default_enabled() -> bool {
        true
    }

    fn default_sample() -> f64 {
        1.0
    }

    /// Checks the sample rate.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.success_sample_rate) {
            return Err(format!(
                "accessLog.successSampleRate must be between 0 and 1, not {}",
                self.success_sample_rate
            ));
        }
        Ok(())
    }
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        Self {
            enabled: Self::default_enabled(),
            success_sample_rate: Self::default_sample(),
            file: None,
        }
    }
}

/// Where access lines go.
#[derive(Debug)]
enum Sink {
    Off,
    Stdout,
    File(Mutex<File>),
}

/// The access log of a gateway. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AccessLog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    sink: Sink,
    sample: f64,
}

impl AccessLog {
    /// No access log.
    pub fn off() -> Self {
        Self {
            inner: Arc::new(Inner {
                sink: Sink::Off,
                sample: 0.0,
            }),
        }
    }

    /// The access log `config` asks for.
    pub fn open(config: &AccessLogConfig) -> io::Result<Self> {
        let sink = match (&config.file, config.enabled) {
            (_, false) => Sink::Off,
            (None, true) => Sink::Stdout,
            (Some(path), true) => Sink::File(Mutex::new(
                OpenOptions::new().create(true).append(true).open(path)?,
            )),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                sink,
                sample: config.success_sample_rate.clamp(0.0, 1.0),
            }),
        })
    }

    /// Whether calls are logged.
    pub fn enabled(&self) -> bool {
        !matches!(self.inner.sink, Sink::Off)
    }

    /// Writes the line of a finished call, unless it is a success sampled out.
    fn finish(&self, record: &Record, bytes_out: u64, complete: bool) {
        let line = {
            let fields = record.fields.lock();
            let failed = fields.status >= 400 || fields.reason.is_some() || !complete;
            let logged =
                failed || self.inner.sample >= 1.0 || rand::random::<f64>() < self.inner.sample;
            if !logged {
                return;
            }
            let bytes_in = fields.body.as_ref().map_or(0, |b| b.received());
            let path: String = fields.uri.path().chars().take(256).collect();
            let mut line = serde_json::to_vec(&Line {
                ts: jiff::Timestamp::now().to_string(),
                request_id: fields.request_id.to_str().unwrap_or_default(),
                method: fields.method.as_str(),
                path: &path,
                protocol: fields.protocol,
                client: fields.client.as_deref(),
                client_id: fields.client_id.as_deref(),
                class: fields.class.map(PriorityClass::as_str),
                backend: fields.backend.as_deref(),
                endpoint: fields.endpoint.as_deref(),
                status: fields.status,
                reason: fields.reason,
                complete,
                retry: fields.retry.map(Timing::as_str),
                retries: fields.retries,
                lease_wait_ms: fields.lease_wait.map(|d| d.as_secs_f64() * 1e3),
                burst: fields.burst,
                upstream_ms: fields.upstream.map(|d| d.as_secs_f64() * 1e3),
                duration_ms: record.started.elapsed().as_secs_f64() * 1e3,
                bytes_in,
                bytes_out,
            })
            .unwrap_or_default();
            line.push(b'\n');
            line
        };
        let written = match &self.inner.sink {
            Sink::Off => Ok(()),
            Sink::Stdout => io::stdout().lock().write_all(&line),
            Sink::File(file) => file.lock().write_all(&line),
        };
        if let Err(error) = written {
            tracing::debug!(%error, "writing an access log line failed");
        }
    }
}

/// One line, in the order its fields are written.
#[derive(serde::Serialize)]
struct Line<'a> {
    ts: String,
    request_id: &'a str,
    method: &'a str,
    path: &'a str,
    protocol: &'a str,
    client: Option<&'a str>,
    client_id: Option<&'a str>,
    /// The call's priority class (`interactive`, `batch`), once its client is known.
    class: Option<&'static str>,
    backend: Option<&'a str>,
    endpoint: Option<&'a str>,
    status: u16,
    reason: Option<&'static str>,
    complete: bool,
    retry: Option<&'static str>,
    retries: u32,
    lease_wait_ms: Option<f64>,
    /// Whether the call ran on a burst connection (beyond the pool's share).
    burst: bool,
    upstream_ms: Option<f64>,
    duration_ms: f64,
    bytes_in: u64,
    bytes_out: u64,
}

/// What is known of a call so far; filled in along the request path.
#[derive(Debug)]
pub struct Record {
    started: Instant,
    fields: Mutex<Fields>,
}

#[derive(Debug)]
struct Fields {
    request_id: HeaderValue,
    /// The method and target as they came (cheap clones: a line is made of them only when
    /// one is written).
    method: http::Method,
    uri: http::Uri,
    protocol: &'static str,
    client: Option<Arc<str>>,
    client_id: Option<String>,
    class: Option<PriorityClass>,
    backend: Option<Arc<str>>,
    endpoint: Option<Arc<str>>,
    status: u16,
    reason: Option<&'static str>,
    retries: u32,
    lease_wait: Option<std::time::Duration>,
    burst: bool,
    upstream: Option<std::time::Duration>,
    body: Option<Arc<BodyProgress>>,
    /// The client's identity, hashed (never logged: for the memory of refusals).
    key: Option<ClientKey>,
    /// Whether the call came back after a refusal, and how.
    retry: Option<Timing>,
}

impl Record {
    /// The record of a call whose head arrived now.
    pub fn new<B>(request_id: HeaderValue, req: &http::Request<B>) -> Self {
        let protocol = match req.version() {
            http::Version::HTTP_2 => "HTTP/2",
            http::Version::HTTP_10 => "HTTP/1.0",
            _ => "HTTP/1.1",
        };
        Self {
            started: Instant::now(),
            fields: Mutex::new(Fields {
                request_id,
                method: req.method().clone(),
                uri: req.uri().clone(),
                protocol,
                client: None,
                client_id: None,
                class: None,
                backend: None,
                endpoint: None,
                status: 0,
                reason: None,
                retries: 0,
                lease_wait: None,
                burst: false,
                upstream: None,
                body: None,
                key: None,
                retry: None,
            }),
        }
    }

    /// The call's request id.
    pub fn request_id(&self) -> HeaderValue {
        self.fields.lock().request_id.clone()
    }

    /// The client's override name or `other`, once known.
    pub fn client_name(&self) -> Option<Arc<str>> {
        self.fields.lock().client.clone()
    }

    /// The client's hashed identity, to remember its refusals.
    pub fn key(&self, key: ClientKey) {
        self.fields.lock().key = Some(key);
    }

    /// The client's hashed identity, if known.
    pub fn client_key(&self) -> Option<ClientKey> {
        self.fields.lock().key
    }

    /// The call came back after a refusal, early or on time.
    pub fn retry(&self, timing: Timing) {
        self.fields.lock().retry = Some(timing);
    }

    /// Whether the call came back before its `Retry-After`.
    pub fn early_retry(&self) -> bool {
        self.fields.lock().retry == Some(Timing::Early)
    }

    /// The route chose `backend`.
    pub fn backend(&self, backend: &Arc<str>) {
        self.fields.lock().backend = Some(backend.clone());
    }

    /// The client, by its short hash and (once known) its override name or `other`.
    pub fn client(&self, name: Option<&Arc<str>>, id: String) {
        let mut fields = self.fields.lock();
        fields.client_id = Some(id);
        if let Some(name) = name {
            fields.client = Some(name.clone());
        }
    }

    /// The call's priority class.
    pub fn class(&self, class: PriorityClass) {
        self.fields.lock().class = Some(class);
    }

    /// The request body on its way (its bytes read so far are `bytes_in`).
    pub fn body(&self, progress: Arc<BodyProgress>) {
        self.fields.lock().body = Some(progress);
    }

    /// A lease on `endpoint` after waiting `wait`; `burst`: on a burst connection.
    pub fn leased(&self, endpoint: &Arc<str>, wait: std::time::Duration, burst: bool) {
        let mut fields = self.fields.lock();
        fields.endpoint = Some(endpoint.clone());
        fields.lease_wait = Some(wait);
        fields.burst = burst;
    }

    /// A reused connection failed before sending; the call goes on another.
    pub fn retried(&self) {
        self.fields.lock().retries += 1;
    }

    /// The backend's response head arrived `after` the send.
    pub fn upstream_head(&self, after: std::time::Duration) {
        self.fields.lock().upstream = Some(after);
    }

    /// The gateway refused or failed the call for `reason`.
    pub fn rejected(&self, reason: &'static str) {
        self.fields.lock().reason = Some(reason);
    }

    /// The status sent to the client.
    pub fn status(&self, status: http::StatusCode) {
        self.fields.lock().status = status.as_u16();
    }
}

/// Writes a call's line when its response body ends or is dropped.
#[derive(Debug)]
pub struct Finisher {
    log: AccessLog,
    record: Arc<Record>,
    bytes_out: u64,
    complete: bool,
    failed: bool,
}

impl Finisher {
    /// Logs `record` to `log` when dropped.
    pub fn new(log: AccessLog, record: Arc<Record>) -> Self {
        Self {
            log,
            record,
            bytes_out: 0,
            complete: false,
            failed: false,
        }
    }

    /// `n` bytes of the response body went to the client.
    pub fn sent(&mut self, n: usize) {
        self.bytes_out += n as u64;
    }

    /// The response body ended in full.
    pub fn completed(&mut self) {
        self.complete = true;
    }

    /// Reading the response body from the backend failed.
    pub fn failed(&mut self) {
        self.failed = true;
    }
}

impl Drop for Finisher {
    fn drop(&mut self) {
        let complete = self.complete && !self.failed;
        self.log.finish(&self.record, self.bytes_out, complete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_client_request_id_is_kept_and_any_other_replaced() {
        let mut headers = HeaderMap::new();
        let fresh = request_id(&headers);
        assert_eq!(fresh.len(), 32);
        assert!(fresh.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(request_id(&headers), fresh, "every generated id is new");

        headers.insert(&X_REQUEST_ID, HeaderValue::from_static("req-42/abc"));
        assert_eq!(request_id(&headers), "req-42/abc");

        for bad in ["", "has space", &"x".repeat(MAX_REQUEST_ID_BYTES + 1)] {
            headers.insert(&X_REQUEST_ID, HeaderValue::from_str(bad).unwrap());
            let id = request_id(&headers);
            assert_ne!(id, bad, "{bad:?} is replaced");
            assert_eq!(id.len(), 32);
        }
    }

    #[test]
    fn the_sample_rate_must_be_a_share() {
        for (rate, ok) in [
            (0.0, true),
            (0.25, true),
            (1.0, true),
            (-0.1, false),
            (1.5, false),
        ] {
            let config = AccessLogConfig {
                success_sample_rate: rate,
                ..AccessLogConfig::default()
            };
            assert_eq!(config.validate().is_ok(), ok, "{rate}");
        }
    }
}
