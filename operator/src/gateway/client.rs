//! The gateway admin API as the operator calls it: `PUT https://<podIP>:<adminPort>/v1/limits`
//! (verified as [`super::tls`] says; plain `http` without a CA bundle) with a bearer token. The gateway
//! answers `200 {revision, generation}`, `422 {error}` (invalid, the old limits stay), `409` (it
//! runs a newer generation) or `401` (bad token); an answer longer than
//! [`MAX_ANSWER_BYTES`] is not read. `GET /v1/clients` reads a pod's busiest clients (for the
//! division of fleet-wide client limits, `plan/clients.rs`); `GET /v1/limits` the document a pod
//! runs (what an operator that just took over knows of no PUT of its own).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use poolpilot_api::GatewayLimits;
pub use poolpilot_api::admin::Ranking;
use poolpilot_api::limits::MAX_DOCUMENT_BYTES;
use serde::Deserialize;

use super::tls::{GatewayTrust, TrustError};
use crate::plan::Acked;

/// The longest answer read from a gateway but its document: its answers are a few hundred
/// bytes, a refusal lists every violation of a document in a few kilobytes.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Why a pod did not take a document.
#[derive(Debug, thiserror::Error)]
pub enum PutError {
    /// The gateway refused the document as invalid (422); it keeps its old limits.
    #[error("refused: {0}")]
    Refused(String),
    /// The gateway runs a newer generation (409); `generation` is the one it runs, when it says.
    #[error("runs a newer generation: {message}")]
    Older {
        /// The gateway's explanation.
        message: String,
        /// The generation it runs, if the answer carries it.
        generation: Option<u64>,
    },
    /// The token was not accepted (401).
    #[error("the admin token was not accepted")]
    Unauthorized,
    /// Any other answer.
    #[error("unexpected answer {status}: {body}")]
    Unexpected {
        /// HTTP status.
        status: u16,
        /// Body, truncated.
        body: String,
    },
    /// No answer.
    #[error("request failed")]
    Transport(#[source] reqwest::Error),
    /// No HTTPS client for the pod's namespace.
    #[error("no HTTPS client for the gateways")]
    Trust(#[source] TrustError),
    /// The answer was longer than any the gateway sends.
    #[error("answer {status} longer than {limit} bytes; not read")]
    TooLarge {
        /// HTTP status.
        status: u16,
        /// The most read.
        limit: usize,
    },
}

impl PutError {
    /// Whether the pod looked at the document and said no (a NACK stops a rollout). A 409 that
    /// names the generation the pod runs is no NACK: the next document simply goes above it.
    pub fn is_nack(&self) -> bool {
        matches!(
            self,
            Self::Refused(_)
                | Self::Older {
                    generation: None,
                    ..
                }
        )
    }
}

/// Why a pod's report (its busiest clients, the document it runs) could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The token was not accepted (401).
    #[error("the admin token was not accepted")]
    Unauthorized,
    /// Any other answer than 200 (a gateway too old to serve `/v1/clients` answers 404).
    #[error("unexpected answer {status}: {body}")]
    Unexpected {
        /// HTTP status.
        status: u16,
        /// Body, truncated.
        body: String,
    },
    /// The answer is not what was asked for.
    #[error("not the report asked for: {0}")]
    Invalid(String),
    /// No answer.
    #[error("request failed")]
    Transport(#[source] reqwest::Error),
    /// No HTTPS client for the pod's namespace.
    #[error("no HTTPS client for the gateways")]
    Trust(#[source] TrustError),
    /// The answer was longer than any the gateway sends.
    #[error("answer longer than {0} bytes; not read")]
    TooLarge(usize),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// A pod's busiest clients per client policy (`GET /v1/clients`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ClientsReport {
    /// Per client policy of the pod's document.
    pub policies: Vec<PolicyClients>,
}

impl ClientsReport {
    /// Adds the clients of `other` (the same pod's answer to another ranking) that this report
    /// does not have yet, policy by policy.
    pub fn merge(&mut self, other: ClientsReport) {
        for p in other.policies {
            match self.policies.iter_mut().find(|q| q.name == p.name) {
                Some(q) => {
                    for c in p.clients {
                        if !q.clients.iter().any(|d| d.key_sha256 == c.key_sha256) {
                            q.clients.push(c);
                        }
                    }
                }
                None => self.policies.push(p),
            }
        }
    }
}

/// The busiest clients of one client policy in one pod.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct PolicyClients {
    /// The client policy's name in the pod's document.
    pub name: String,
    /// Its busiest clients.
    #[serde(default)]
    pub clients: Vec<ReportedClient>,
}

/// One client as a pod reports it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportedClient {
    /// Hex SHA-256 of its key.
    pub key_sha256: String,
    /// Calls in flight now.
    #[serde(default)]
    pub in_flight: u32,
    /// Calls waiting now.
    #[serde(default)]
    pub queued: u32,
    /// In flight + queued, averaged over the last 10 s.
    #[serde(default)]
    pub demand: f64,
    /// Input tokens a second of its calls that ended in the last 10 s.
    #[serde(default)]
    pub input_tokens_per_second: f64,
    /// Output tokens a second of the same.
    #[serde(default)]
    pub output_tokens_per_second: f64,
}

/// Sends limits documents to gateway pods and reads their client reports.
pub trait Gateways: Send + Sync + 'static {
    /// PUTs `doc` to the admin API at `addr` of a pod in `namespace` with `token`.
    fn put(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        doc: &GatewayLimits,
    ) -> impl Future<Output = Result<Acked, PutError>> + Send;

    /// GETs the busiest clients, ranked `by`, from the admin API at `addr` of a pod in
    /// `namespace`.
    fn clients(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        by: Ranking,
    ) -> impl Future<Output = Result<ClientsReport, ReportError>> + Send;

    /// GETs the limits document the pod at `addr` in `namespace` runs from its admin API.
    fn limits(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
    ) -> impl Future<Output = Result<GatewayLimits, ReportError>> + Send;
}

/// The real client.
#[derive(Clone, Debug)]
pub struct HttpGateways {
    /// Plain HTTP, without a CA bundle.
    plain: reqwest::Client,
    /// HTTPS verified against the bundle, when there is one.
    trust: Option<Arc<GatewayTrust>>,
}

impl HttpGateways {
    /// A plain-HTTP client whose calls give up after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, reqwest::Error> {
        Ok(Self {
            plain: crate::http_client().timeout(timeout).build()?,
            trust: None,
        })
    }

    /// An HTTPS client trusting `trust`.
    pub fn with_trust(timeout: Duration, trust: GatewayTrust) -> Result<Self, reqwest::Error> {
        Ok(Self {
            trust: Some(Arc::new(trust)),
            ..Self::new(timeout)?
        })
    }
}

#[derive(Deserialize)]
struct AckBody {
    revision: String,
    generation: u64,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
    #[serde(default)]
    generation: Option<u64>,
}

impl HttpGateways {
    /// The client and URL of `path` on the admin API at `addr` of a pod in `namespace`: HTTPS
    /// verified against the bundle when there is one, else plain HTTP.
    fn endpoint(
        &self,
        namespace: &str,
        addr: SocketAddr,
        path: &str,
    ) -> Result<(reqwest::Client, String), TrustError> {
        Ok(match &self.trust {
            Some(trust) => (trust.client(namespace)?, format!("https://{addr}{path}")),
            None => (self.plain.clone(), format!("http://{addr}{path}")),
        })
    }
}

/// The body of an answer, `None` when it is (or says it will be) longer than `limit`: reading
/// stops there.
async fn read_capped(
    mut resp: reqwest::Response,
    limit: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

impl Gateways for HttpGateways {
    async fn put(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        doc: &GatewayLimits,
    ) -> Result<Acked, PutError> {
        let (client, url) = self
            .endpoint(namespace, addr, "/v1/limits")
            .map_err(PutError::Trust)?;
        let resp = client
            .put(url)
            .bearer_auth(token)
            .json(doc)
            .send()
            .await
            .map_err(PutError::Transport)?;
        let status = resp.status().as_u16();
        let Some(body) = read_capped(resp, MAX_ANSWER_BYTES)
            .await
            .map_err(PutError::Transport)?
        else {
            return Err(PutError::TooLarge {
                status,
                limit: MAX_ANSWER_BYTES,
            });
        };
        classify(status, &body)
    }

    async fn clients(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        by: Ranking,
    ) -> Result<ClientsReport, ReportError> {
        self.get(namespace, addr, token, by.path(), MAX_ANSWER_BYTES)
            .await
    }

    async fn limits(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
    ) -> Result<GatewayLimits, ReportError> {
        self.get(namespace, addr, token, "/v1/limits", MAX_DOCUMENT_BYTES)
            .await
    }
}

impl HttpGateways {
    /// `GET path` from the admin API at `addr` of a pod in `namespace`, its answer read (at most
    /// `limit` bytes) and parsed: 200 with a `T`, or why not.
    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        namespace: &str,
        addr: SocketAddr,
        token: &str,
        path: &str,
        limit: usize,
    ) -> Result<T, ReportError> {
        let (client, url) = self
            .endpoint(namespace, addr, path)
            .map_err(ReportError::Trust)?;
        let resp = client
            .get(url)
            .bearer_auth(token)
            .send()
            .await
            .map_err(ReportError::Transport)?;
        report(resp, limit).await
    }
}

/// A `GET`'s answer read (at most `limit` bytes) and parsed: 200 with a `T`, or why not.
async fn report<T: serde::de::DeserializeOwned>(
    resp: reqwest::Response,
    limit: usize,
) -> Result<T, ReportError> {
    let status = resp.status().as_u16();
    let Some(body) = read_capped(resp, limit)
        .await
        .map_err(ReportError::Transport)?
    else {
        return Err(ReportError::TooLarge(limit));
    };
    match status {
        200 => serde_json::from_slice(&body).map_err(|e| ReportError::Invalid(e.to_string())),
        401 => Err(ReportError::Unauthorized),
        _ => Err(ReportError::Unexpected {
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        }),
    }
}

/// Maps an answer to its outcome.
pub fn classify(status: u16, body: &[u8]) -> Result<Acked, PutError> {
    let text = || String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
    let error = || serde_json::from_slice::<ErrorBody>(body).map_or_else(|_| text(), |e| e.error);
    match status {
        200 => serde_json::from_slice::<AckBody>(body)
            .map(|a| Acked {
                revision: a.revision,
                generation: a.generation,
            })
            .map_err(|_| PutError::Unexpected {
                status,
                body: text(),
            }),
        422 => Err(PutError::Refused(error())),
        409 => Err(PutError::Older {
            message: error(),
            generation: serde_json::from_slice::<ErrorBody>(body)
                .ok()
                .and_then(|e| e.generation),
        }),
        401 => Err(PutError::Unauthorized),
        _ => Err(PutError::Unexpected {
            status,
            body: text(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    use super::*;

    /// A limits document to send.
    fn doc() -> GatewayLimits {
        serde_json::from_value(serde_json::json!({"generation": 1, "backends": []})).unwrap()
    }

    /// A loopback "gateway" that answers every request with `head` then streams `body_chunk`
    /// forever; the address and how many body bytes it managed to send.
    async fn endless_gateway(head: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = sent.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let _ = stream.read(&mut buf).await;
                    if stream.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    let chunk = format!("{:x}\r\n{}\r\n", 16 * 1024, "x".repeat(16 * 1024));
                    while stream.write_all(chunk.as_bytes()).await.is_ok() {
                        counter.fetch_add(16 * 1024, Ordering::Relaxed);
                    }
                });
            }
        });
        (addr, sent)
    }

    #[tokio::test]
    async fn a_reply_over_the_size_cap_is_refused_without_reading_it_all() {
        let (addr, sent) = endless_gateway(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await;
        let gateways = HttpGateways::new(Duration::from_secs(10)).unwrap();
        let started = tokio::time::Instant::now();
        let error = gateways
            .put("ns", addr, "token", &doc())
            .await
            .expect_err("an endless reply is no acknowledgement");
        assert!(
            matches!(error, PutError::TooLarge { status: 200, .. }),
            "{error:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "gave up after {:?}",
            started.elapsed()
        );
        assert!(
            sent.load(Ordering::Relaxed) < 16 * 1024 * 1024,
            "{} bytes read",
            sent.load(Ordering::Relaxed)
        );
    }

    /// A loopback "gateway" answering every request with `answer` (head and body).
    async fn answering_gateway(answer: String) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let _ = stream.read(&mut buf).await;
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        addr
    }

    /// The document a pod runs may be far longer than any other answer: it is read up to the
    /// largest document a gateway takes, and no further.
    #[tokio::test]
    async fn the_document_a_pod_runs_is_read_up_to_the_largest_a_gateway_takes() {
        let gateways = HttpGateways::new(Duration::from_secs(10)).unwrap();
        let mut long = doc();
        long.revision = "r".repeat(2 * MAX_ANSWER_BYTES);
        let body = serde_json::to_string(&long).unwrap();
        let addr = answering_gateway(format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ))
        .await;
        assert_eq!(gateways.limits("ns", addr, "token").await.unwrap(), long);

        let addr =
            answering_gateway("HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n".to_owned())
                .await;
        let error = gateways.limits("ns", addr, "token").await.unwrap_err();
        assert!(matches!(error, ReportError::Unauthorized), "{error:?}");

        let (addr, sent) = endless_gateway(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await;
        let error = gateways.limits("ns", addr, "token").await.unwrap_err();
        assert!(
            matches!(error, ReportError::TooLarge(MAX_DOCUMENT_BYTES)),
            "{error:?}"
        );
        // What the socket buffers took beyond it, as in the test of the PUTs' cap.
        assert!(
            sent.load(Ordering::Relaxed) < MAX_DOCUMENT_BYTES + 16 * 1024 * 1024,
            "{} bytes read",
            sent.load(Ordering::Relaxed)
        );
    }

    #[test]
    fn answers_map_to_outcomes() {
        let ok = classify(200, br#"{"revision":"9f2c1e","generation":7}"#).unwrap();
        assert_eq!(
            ok,
            Acked {
                revision: "9f2c1e".into(),
                generation: 7
            }
        );
        let nack = classify(422, br#"{"error":"backends[0].pool: bad"}"#).unwrap_err();
        assert!(nack.is_nack());
        assert_eq!(nack.to_string(), "refused: backends[0].pool: bad");
        assert!(
            classify(409, br#"{"error":"runs generation 9"}"#)
                .unwrap_err()
                .is_nack()
        );
        assert!(matches!(classify(401, b""), Err(PutError::Unauthorized)));
        assert!(!classify(401, b"").unwrap_err().is_nack());
        assert!(matches!(
            classify(200, b"not json"),
            Err(PutError::Unexpected { status: 200, .. })
        ));
        assert!(matches!(
            classify(503, b"busy"),
            Err(PutError::Unexpected { status: 503, .. })
        ));
    }

    #[test]
    fn a_pods_two_rankings_merge_into_one_report_each_client_once() {
        let client = |key: &str, demand: f64, tokens: f64| ReportedClient {
            key_sha256: key.into(),
            demand,
            input_tokens_per_second: tokens,
            ..ReportedClient::default()
        };
        let report = |name: &str, clients: Vec<ReportedClient>| PolicyClients {
            name: name.into(),
            clients,
        };
        let mut by_demand = ClientsReport {
            policies: vec![report(
                "a",
                vec![client("busy", 5.0, 1.0), client("both", 3.0, 90.0)],
            )],
        };
        by_demand.merge(ClientsReport {
            policies: vec![
                report(
                    "a",
                    vec![client("both", 3.0, 90.0), client("spender", 0.2, 400.0)],
                ),
                report("b", vec![client("other", 0.0, 5.0)]),
            ],
        });
        let keys = |p: &PolicyClients| -> Vec<String> {
            p.clients.iter().map(|c| c.key_sha256.clone()).collect()
        };
        assert_eq!(keys(&by_demand.policies[0]), ["busy", "both", "spender"]);
        assert_eq!(keys(&by_demand.policies[1]), ["other"]);
    }
}
