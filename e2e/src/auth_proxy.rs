//! An authenticating proxy in front of the cluster's Prometheus, as teams run it (a Mimir or
//! Thanos gateway, oauth2-proxy, a cloud's managed Prometheus): a request passes only with the
//! expected `Authorization` and the required headers (a tenant's `X-Scope-OrgID`), else 401; it
//! can serve HTTPS with a certificate of the test's CA. It counts what it passed and refused, and
//! remembers the refusals' reasons.
//!
//! ```text
//!  operator ──► 127.0.0.1:<port> (http or https; 401 unless credentials + headers) ──► Prometheus
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What a request must carry to pass.
#[derive(Clone, Debug, Default)]
pub struct Requirements {
    /// The exact `Authorization` value (`Bearer …`, `Basic …`), if any is required.
    pub authorization: Option<String>,
    /// Headers that must be present with exactly these values.
    pub headers: Vec<(String, String)>,
}

/// A running proxy; it stops when dropped.
#[derive(Debug)]
pub struct AuthProxy {
    addr: SocketAddr,
    https: bool,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    upstream: String,
    requirements: Mutex<Requirements>,
    http: reqwest::Client,
    passed: AtomicU64,
    refused: AtomicU64,
    reasons: Mutex<Vec<String>>,
}

impl AuthProxy {
    /// Listens on an ephemeral port of `upstream`'s address (`http://IP:port`: reachable from
    /// the pods wherever the upstream is: the node link's address, 10.244.254.1, for the
    /// cluster's Prometheus) and forwards what passes to `upstream`. With `tls` (a PEM
    /// certificate chain and key), it speaks HTTPS only, on 127.0.0.1.
    pub async fn start(
        upstream: &str,
        requirements: Requirements,
        tls: Option<(&str, &str)>,
    ) -> anyhow::Result<Self> {
        crate::install_crypto_provider();
        // Over HTTPS it is `localhost` (its certificate's name), so on 127.0.0.1, for the test
        // process; over HTTP on the upstream's address, for pods too.
        let host: std::net::IpAddr = upstream
            .split("://")
            .nth(1)
            .and_then(|rest| rest.split(['/', ':']).next())
            .and_then(|h| h.parse().ok())
            .filter(|_| tls.is_none())
            .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        let listener = TcpListener::bind((host, 0)).await?;
        let addr = listener.local_addr()?;
        let acceptor = tls.map(|(cert, key)| acceptor(cert, key)).transpose()?;
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            requirements: Mutex::new(requirements),
            http: reqwest::Client::builder().build()?,
            passed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            reasons: Mutex::new(Vec::new()),
        });
        let https = acceptor.is_some();
        let accept = tokio::spawn(accept_loop(listener, acceptor, shared.clone()));
        Ok(Self {
            addr,
            https,
            shared,
            accept,
        })
    }

    /// `http://IP:PORT` or `https://localhost:PORT` (the name its certificate carries).
    pub fn url(&self) -> String {
        if self.https {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    /// Requests forwarded so far.
    pub fn passed(&self) -> u64 {
        self.shared.passed.load(Ordering::Relaxed)
    }

    /// Requests refused with 401 so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Why requests were refused, the latest last.
    pub fn refusals(&self) -> Vec<String> {
        self.shared.reasons.lock().clone()
    }

    /// Replaces what requests must carry (a rotated token).
    pub fn require(&self, requirements: Requirements) {
        *self.shared.requirements.lock() = requirements;
    }
}

impl Drop for AuthProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn acceptor(cert: &str, key: &str) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes())?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(chain, key)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
) {
    while let Ok((socket, _)) = listener.accept().await {
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(handle(&shared, req).await) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            match acceptor {
                Some(acceptor) => {
                    if let Ok(tls) = acceptor.accept(socket).await {
                        let _ = builder.serve_connection(TokioIo::new(tls), service).await;
                    }
                }
                None => {
                    let _ = builder
                        .serve_connection(TokioIo::new(socket), service)
                        .await;
                }
            }
        });
    }
}

async fn handle(shared: &Shared, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if let Some(why) = refusal(&shared.requirements.lock(), &req) {
        shared.refused.fetch_add(1, Ordering::Relaxed);
        shared.reasons.lock().push(why.clone());
        return Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .body(Full::new(Bytes::from(why)))
            .expect("a valid response");
    }
    shared.passed.fetch_add(1, Ordering::Relaxed);
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let method = req.method().clone();
    let content_type = req.headers().get(http::header::CONTENT_TYPE).cloned();
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let forwarded = async {
        let mut upstream = shared
            .http
            .request(method, format!("{}{path}", shared.upstream))
            .body(body?);
        if let Some(ct) = content_type {
            upstream = upstream.header(http::header::CONTENT_TYPE, ct);
        }
        let answer = upstream.send().await?;
        let status = answer.status();
        let bytes = answer.bytes().await?;
        anyhow::Ok((status, bytes))
    };
    match forwarded.await {
        Ok((status, bytes)) => Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))
            .expect("a valid response"),
        Err(e) => Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(Full::new(Bytes::from(e.to_string())))
            .expect("a valid response"),
    }
}

/// Why `req` does not pass, if it does not.
fn refusal<B>(want: &Requirements, req: &Request<B>) -> Option<String> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(expected) = &want.authorization {
        match header("authorization") {
            None => return Some("no Authorization header".into()),
            Some(got) if &got != expected => return Some("wrong credentials".into()),
            Some(_) => {}
        }
    }
    for (name, value) in &want.headers {
        match header(name) {
            None => return Some(format!("no {name} header")),
            Some(got) if &got != value => return Some(format!("{name}: {got}, want {value}")),
            Some(_) => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_pass_only_with_the_credentials_and_headers_required() {
        let want = Requirements {
            authorization: Some("Bearer t".into()),
            headers: vec![("X-Scope-OrgID".into(), "team-a".into())],
        };
        let req = |headers: &[(&str, &str)]| {
            let mut r = Request::builder().uri("/api/v1/query");
            for (n, v) in headers {
                r = r.header(*n, *v);
            }
            r.body(()).unwrap()
        };
        assert_eq!(
            refusal(&want, &req(&[])).as_deref(),
            Some("no Authorization header")
        );
        assert_eq!(
            refusal(&want, &req(&[("authorization", "Bearer x")])).as_deref(),
            Some("wrong credentials")
        );
        assert_eq!(
            refusal(&want, &req(&[("authorization", "Bearer t")])).as_deref(),
            Some("no X-Scope-OrgID header")
        );
        assert_eq!(
            refusal(
                &want,
                &req(&[("authorization", "Bearer t"), ("x-scope-orgid", "team-a")])
            ),
            None
        );
    }
}
