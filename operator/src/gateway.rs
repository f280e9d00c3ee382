//! The gateway admin API as the operator calls it: `PUT http://<podIP>:<adminPort>/v1/limits`
//! with a bearer token. The gateway answers `200 {revision, generation}`, `422 {error}` (invalid,
//! the old limits stay), `409` (it runs a newer generation) or `401` (bad token).

use std::net::SocketAddr;
use std::time::Duration;

use poolpilot_api::GatewayLimits;
use serde::Deserialize;

use crate::plan::Acked;

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

/// Sends limits documents to gateway pods.
pub trait Gateways: Send + Sync + 'static {
    /// PUTs `doc` to the admin API at `addr` with `token`.
    fn put(
        &self,
        addr: SocketAddr,
        token: &str,
        doc: &GatewayLimits,
    ) -> impl Future<Output = Result<Acked, PutError>> + Send;
}

/// The real client.
#[derive(Clone, Debug)]
pub struct HttpGateways {
    client: reqwest::Client,
}

impl HttpGateways {
    /// A client whose calls give up after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, reqwest::Error> {
        Ok(Self {
            client: reqwest::Client::builder().timeout(timeout).build()?,
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

impl Gateways for HttpGateways {
    async fn put(
        &self,
        addr: SocketAddr,
        token: &str,
        doc: &GatewayLimits,
    ) -> Result<Acked, PutError> {
        let url = format!("http://{addr}/v1/limits");
        let resp = self
            .client
            .put(url)
            .bearer_auth(token)
            .json(doc)
            .send()
            .await
            .map_err(PutError::Transport)?;
        let status = resp.status().as_u16();
        let body = resp.bytes().await.map_err(PutError::Transport)?;
        classify(status, &body)
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
    use super::*;

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
}
