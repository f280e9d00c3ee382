//! The scale bench's gateway fleet in one process: `N` simulated gateway pods, each an admin
//! endpoint on its own loopback address (`127.x.y.z`: Linux routes all of 127/8 to `lo`), over
//! TLS with the bearer token as the gateway's admin API (gateway/src/admin) serves it, answering
//! `PUT /v1/limits` (validated, generations checked as the gateway does, after a configurable
//! latency; a fraction of the pods slow, another failing), `GET /v1/limits`, `GET /v1/clients`
//! (what the operator reads) and `GET /healthz`; and one scrape target serving the Prometheus
//! series of all `N` pods, labelled `namespace` and `pod` themselves (scrape it with
//! `honor_labels: true`), from what each pod was last sent.
//!
//! ```text
//!  operator ── PUT /v1/limits (HTTPS, Bearer) ──► 127.1.0.1:9901 … 127.1.3.232:9901 (N pods)
//!  Prometheus ── GET /metrics ──► one scrape target: every pod's series
//! ```

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::MAX_DOCUMENT_BYTES;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What the fleet simulates.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    /// How many pods.
    pub pods: usize,
    /// The first pod's address; the others follow it (`127.1.0.1`, `127.1.0.2`, …, skipping
    /// addresses ending in `.0` and `.255`).
    pub first: Ipv4Addr,
    /// The admin port every pod listens on.
    pub port: u16,
    /// The pods' namespace (the `namespace` label of their series).
    pub namespace: String,
    /// The pods' names: this prefix and their index.
    pub prefix: String,
    /// The bearer token every pod accepts.
    pub token: String,
    /// How long a pod takes to answer a PUT.
    pub latency: Duration,
    /// The fraction of pods that answer after `slow_latency` instead (evenly spread).
    pub slow_fraction: f64,
    /// Their latency.
    pub slow_latency: Duration,
    /// The fraction of pods that answer every PUT `503` (evenly spread, after `latency`).
    pub fail_fraction: f64,
    /// Connections leased per endpoint of each backend on each pod, in the series.
    pub leased: f64,
    /// Calls completed per second per backend on each pod, in the series.
    pub calls_per_second: f64,
}

impl FleetSpec {
    /// The address of pod `i`.
    pub fn address(&self, i: usize) -> anyhow::Result<Ipv4Addr> {
        // Counted over the usable host parts (1..=254 of the last octet).
        let base = u32::from(self.first);
        let (prefix, low) = (base & !0xff, base & 0xff);
        anyhow::ensure!(
            (1..=254).contains(&low),
            "{} ends in .0 or .255",
            self.first
        );
        let index = u64::from(low - 1) + i as u64;
        let host = prefix as u64 + (index / 254) * 256 + index % 254 + 1;
        let ip = Ipv4Addr::from(u32::try_from(host).context("past 127.255.255.254")?);
        anyhow::ensure!(ip.octets()[0] == 127, "{ip} is not a loopback address");
        Ok(ip)
    }

    /// How pod `i` answers: a fraction `f` of `n` pods makes `⌊n × f⌋` of them, spread over the
    /// fleet: the pods `i` where `⌊(i + 1) × f⌋` steps are slow, counted from the first pod;
    /// the failing ones are counted the same way from the last pod (a pod both would make is
    /// slow).
    pub fn kind(&self, i: usize) -> PodKind {
        let steps = |i: usize, f: f64| (((i + 1) as f64) * f).floor() > ((i as f64) * f).floor();
        if steps(i, self.slow_fraction) {
            PodKind::Slow
        } else if steps(self.pods.saturating_sub(i + 1), self.fail_fraction) {
            PodKind::Failing
        } else {
            PodKind::Normal
        }
    }

    /// Pod `i`'s name.
    pub fn name(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }
}

/// How a simulated pod answers PUTs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodKind {
    /// After the fleet's latency.
    Normal,
    /// After the slow latency.
    Slow,
    /// `503` after the fleet's latency.
    Failing,
}

/// One simulated pod.
#[derive(Debug)]
pub struct SimPod {
    /// Its name.
    pub name: String,
    /// Its admin address.
    pub addr: SocketAddr,
    /// How it answers.
    pub kind: PodKind,
    state: Mutex<PodState>,
}

#[derive(Debug, Default)]
struct PodState {
    /// The document it runs.
    limits: Option<GatewayLimits>,
    /// PUTs it answered, by status code.
    answers: BTreeMap<u16, u64>,
}

impl SimPod {
    /// The document it runs.
    pub fn limits(&self) -> Option<GatewayLimits> {
        self.state.lock().limits.clone()
    }

    /// How many PUTs it answered with `status`.
    pub fn answered(&self, status: u16) -> u64 {
        self.state.lock().answers.get(&status).copied().unwrap_or(0)
    }
}

/// The running fleet: its pods and the tasks serving them (stopped when dropped).
#[derive(Debug)]
pub struct Fleet {
    /// Every pod, in index order.
    pub pods: Vec<Arc<SimPod>>,
    spec: FleetSpec,
    started: Instant,
    tasks: JoinSet<()>,
}

impl Fleet {
    /// Binds every pod's admin port and serves it over TLS with `tls` (a certificate for the
    /// name the operator checks, `poolpilot-gateway-admin.<namespace>.svc` by default).
    pub async fn start(spec: FleetSpec, tls: Arc<rustls::ServerConfig>) -> anyhow::Result<Self> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let mut tasks = JoinSet::new();
        let mut pods = Vec::with_capacity(spec.pods);
        for i in 0..spec.pods {
            let ip = spec.address(i)?;
            let listener = TcpListener::bind((ip, spec.port))
                .await
                .with_context(|| format!("binding {ip}:{}", spec.port))?;
            let pod = Arc::new(SimPod {
                name: spec.name(i),
                addr: listener.local_addr()?,
                kind: spec.kind(i),
                state: Mutex::default(),
            });
            pods.push(pod.clone());
            let (acceptor, spec) = (acceptor.clone(), Arc::new(spec.clone()));
            tasks.spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (acceptor, pod, spec) = (acceptor.clone(), pod.clone(), spec.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(stream).await else {
                            return;
                        };
                        let service = service_fn(move |req| {
                            let (pod, spec) = (pod.clone(), spec.clone());
                            async move {
                                Ok::<_, std::convert::Infallible>(admin(&pod, &spec, req).await)
                            }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    });
                }
            });
        }
        Ok(Self {
            pods,
            spec,
            started: Instant::now(),
            tasks,
        })
    }

    /// Serves [`Fleet::exposition`] on `GET /metrics` at `listener` until the fleet is dropped.
    pub fn serve_metrics(&mut self, listener: TcpListener) {
        let pods = self.pods.clone();
        let (spec, started) = (self.spec.clone(), self.started);
        let (spec, pods) = (Arc::new(spec), Arc::new(pods));
        self.tasks.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (spec, pods) = (spec.clone(), pods.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let (spec, pods) = (spec.clone(), pods.clone());
                        async move {
                            let response = if req.uri().path() == "/metrics" {
                                let text = exposition(&spec, &pods, started.elapsed());
                                let mut r = Response::new(Full::new(Bytes::from(text)));
                                r.headers_mut().insert(
                                    header::CONTENT_TYPE,
                                    http::HeaderValue::from_static(
                                        "text/plain; version=0.0.4; charset=utf-8",
                                    ),
                                );
                                r
                            } else {
                                answer(
                                    StatusCode::NOT_FOUND,
                                    serde_json::json!({"error": "no such path"}),
                                )
                            };
                            Ok::<_, std::convert::Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    }

    /// The Prometheus series of every pod now (the text format).
    pub fn exposition(&self) -> String {
        exposition(&self.spec, &self.pods, self.started.elapsed())
    }
}

/// The TLS configuration of the pods' admin ports: the certificate chain and key, PEM.
pub fn server_config(cert_pem: &str, key_pem: &str) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain =
        CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(chain, key)?;
    Ok(Arc::new(config))
}

/// A JSON answer.
fn answer(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// One admin request to `pod`.
async fn admin(pod: &SimPod, spec: &FleetSpec, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    if path == "/healthz" {
        return Response::new(Full::new(Bytes::from_static(b"ok\n")));
    }
    let bearer = format!("Bearer {}", spec.token);
    if req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        != Some(bearer.as_bytes())
    {
        let mut r = answer(
            StatusCode::UNAUTHORIZED,
            serde_json::json!({"error": "a valid bearer token is required"}),
        );
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    match (req.method().clone(), path.as_str()) {
        (Method::PUT, "/v1/limits") => {
            let response = put_limits(pod, spec, req).await;
            *pod.state
                .lock()
                .answers
                .entry(response.status().as_u16())
                .or_default() += 1;
            response
        }
        (Method::GET, "/v1/limits") => {
            let limits = pod.limits();
            answer(
                StatusCode::OK,
                serde_json::to_value(limits).unwrap_or_default(),
            )
        }
        (Method::GET, "/v1/clients") => {
            // No client calls in the simulation: each client policy, with no busiest clients.
            let policies: Vec<serde_json::Value> = pod
                .limits()
                .map(|l| l.client_policies)
                .unwrap_or_default()
                .iter()
                .map(|c| serde_json::json!({"name": c.name, "clients": []}))
                .collect();
            answer(StatusCode::OK, serde_json::json!({ "policies": policies }))
        }
        _ => answer(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "no such admin endpoint"}),
        ),
    }
}

/// `PUT /v1/limits` as the gateway answers it: `200 {revision, generation}`, `409` for an older
/// generation (or the same with other content), `413`, `422` for an invalid document; the slow
/// pods after their latency, the failing ones `503`.
async fn put_limits(
    pod: &SimPod,
    spec: &FleetSpec,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let body = match Limited::new(req.into_body(), MAX_DOCUMENT_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return answer(
                StatusCode::PAYLOAD_TOO_LARGE,
                serde_json::json!({"error": "document over 4 MiB"}),
            );
        }
    };
    tokio::time::sleep(match pod.kind {
        PodKind::Slow => spec.slow_latency,
        PodKind::Normal | PodKind::Failing => spec.latency,
    })
    .await;
    if pod.kind == PodKind::Failing {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"error": "simulated failure"}),
        );
    }
    let doc: GatewayLimits = match serde_json::from_slice(&body) {
        Ok(d) => d,
        Err(e) => {
            return answer(
                StatusCode::UNPROCESSABLE_ENTITY,
                serde_json::json!({"error": e.to_string()}),
            );
        }
    };
    if let Err(e) = doc.validate() {
        return answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            serde_json::json!({"error": e.to_string()}),
        );
    }
    let mut state = pod.state.lock();
    if let Some(current) = &state.limits {
        let same = current.generation == doc.generation && current.revision != doc.revision;
        if current.generation > doc.generation || same {
            return answer(
                StatusCode::CONFLICT,
                serde_json::json!({
                    "error": format!("runs generation {}", current.generation),
                    "generation": current.generation,
                }),
            );
        }
    }
    let ack = serde_json::json!({"revision": doc.revision, "generation": doc.generation});
    state.limits = Some(doc);
    answer(StatusCode::OK, ack)
}

/// The series of every pod after `elapsed`: what the operator's queries read
/// (operator/src/prom.rs), for each backend of the document each pod runs; pods that were sent
/// nothing only have their `process_*` series.
fn exposition(spec: &FleetSpec, pods: &[Arc<SimPod>], elapsed: Duration) -> String {
    use std::fmt::Write as _;
    let t = elapsed.as_secs_f64();
    let mut families: BTreeMap<&str, (&str, String)> = BTreeMap::new();
    let mut add = |family: &'static str, kind: &'static str, line: String| {
        let entry = families.entry(family).or_insert((kind, String::new()));
        entry.1.push_str(&line);
        entry.1.push('\n');
    };
    let ns = &spec.namespace;
    for pod in pods {
        let at = format!("namespace=\"{ns}\",pod=\"{}\"", pod.name);
        add(
            "process_max_fds",
            "gauge",
            format!("process_max_fds{{{at}}} 1048576"),
        );
        let Some(limits) = pod.limits() else {
            add(
                "process_open_fds",
                "gauge",
                format!("process_open_fds{{{at}}} 64"),
            );
            continue;
        };
        let endpoints: usize = limits.backends.iter().map(|b| b.endpoints.len()).sum();
        add(
            "process_open_fds",
            "gauge",
            format!("process_open_fds{{{at}}} {}", 64 + endpoints),
        );
        add(
            "poolpilot_limits_info",
            "gauge",
            format!(
                "poolpilot_limits_info{{{at},revision=\"{}\",generation=\"{}\"}} 1",
                limits.revision, limits.generation
            ),
        );
        for b in &limits.backends {
            let at = format!("{at},backend=\"{}\"", b.name);
            let share = b.pool.max_connections_per_endpoint;
            for e in &b.endpoints {
                let at = format!("{at},endpoint=\"{}\"", e.name);
                let leased = spec.leased.min(f64::from(share));
                add(
                    "poolpilot_pool_connections",
                    "gauge",
                    format!("poolpilot_pool_connections{{{at},state=\"leased\"}} {leased}"),
                );
                add(
                    "poolpilot_pool_connections",
                    "gauge",
                    format!(
                        "poolpilot_pool_connections{{{at},state=\"idle\"}} {}",
                        (f64::from(share) - leased).max(0.0)
                    ),
                );
                add(
                    "poolpilot_pool_max_connections",
                    "gauge",
                    format!("poolpilot_pool_max_connections{{{at}}} {share}"),
                );
            }
            add(
                "poolpilot_pool_pending",
                "gauge",
                format!("poolpilot_pool_pending{{{at}}} 0"),
            );
            let calls = (spec.calls_per_second * t).floor();
            add(
                "poolpilot_pool_lease_timeouts",
                "counter",
                format!("poolpilot_pool_lease_timeouts_total{{{at}}} 0"),
            );
            add(
                "poolpilot_upstream_response_bytes",
                "counter",
                format!(
                    "poolpilot_upstream_response_bytes_total{{{at}}} {}",
                    calls * 2048.0
                ),
            );
            // Every call in 0.1–0.5 s, its first byte in 0.05–0.1 s.
            for (le, share) in [("0.1", 0.0), ("0.5", 1.0), ("+Inf", 1.0)] {
                add(
                    "poolpilot_upstream_request_duration_seconds",
                    "histogram",
                    format!(
                        "poolpilot_upstream_request_duration_seconds_bucket{{{at},code_class=\"2xx\",le=\"{le}\"}} {}",
                        calls * share
                    ),
                );
            }
            add(
                "poolpilot_upstream_request_duration_seconds",
                "histogram",
                format!(
                    "poolpilot_upstream_request_duration_seconds_count{{{at},code_class=\"2xx\"}} {calls}"
                ),
            );
            add(
                "poolpilot_upstream_request_duration_seconds",
                "histogram",
                format!(
                    "poolpilot_upstream_request_duration_seconds_sum{{{at},code_class=\"2xx\"}} {}",
                    calls * 0.3
                ),
            );
            for (le, share) in [("0.05", 0.0), ("0.1", 1.0), ("+Inf", 1.0)] {
                add(
                    "poolpilot_upstream_time_to_first_byte_seconds",
                    "histogram",
                    format!(
                        "poolpilot_upstream_time_to_first_byte_seconds_bucket{{{at},le=\"{le}\"}} {}",
                        calls * share
                    ),
                );
            }
            add(
                "poolpilot_upstream_time_to_first_byte_seconds",
                "histogram",
                format!("poolpilot_upstream_time_to_first_byte_seconds_count{{{at}}} {calls}"),
            );
            add(
                "poolpilot_upstream_time_to_first_byte_seconds",
                "histogram",
                format!(
                    "poolpilot_upstream_time_to_first_byte_seconds_sum{{{at}}} {}",
                    calls * 0.075
                ),
            );
        }
    }
    let mut out = String::new();
    for (family, (kind, lines)) in families {
        let _ = writeln!(out, "# TYPE {family} {kind}");
        out.push_str(&lines);
    }
    out
}

#[cfg(test)]
mod tests;
