//! TLS upstreams against a real TLS model server on 127.0.0.x (rustls, with a private CA the
//! test generates with rcgen): the server's certificate verified against the policy's CA bundle
//! for the server name, sent as SNI; `Host` set to that name; ALPN `http/1.1`; a reconnect
//! resumed (the server says so, and the gateway's histogram counts it); a certificate that does
//! not verify is a 502 naming the cause, counted, and no byte of plain text ever reaches the
//! server; mTLS and the client certificate's expiry gauge; health probes over TLS; files that do not load refuse the document; a rotated
//! CA bundle is used for new connections; and nginx as a TLS upstream (`make upstream-peers`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpListener;

use crate::support::*;

/// A CA, and certificates it signs.
pub struct Pki {
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        Self {
            ca: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    /// `(certificate PEM, key PEM)` for `name`.
    pub fn leaf(&self, name: &str) -> (String, String) {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        self.sign(params)
    }

    /// [`Pki::leaf`], valid until `(year, month, day)` at midnight UTC; also returns that time
    /// as unix seconds.
    pub fn leaf_until(&self, name: &str, (y, m, d): (i32, u8, u8)) -> ((String, String), i64) {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.not_after = rcgen::date_time_ymd(y, m, d);
        let not_after = params.not_after.unix_timestamp();
        (self.sign(params), not_after)
    }

    fn sign(&self, params: rcgen::CertificateParams) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// Writes the CA's PEM to `dir/name`.
    pub fn write_ca(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.ca_pem()).unwrap();
        path
    }
}

/// One connection as the TLS server saw it.
#[derive(Clone, Debug, Default)]
pub struct SeenConn {
    /// The first byte on the wire (0x16: a TLS handshake record).
    pub first_byte: Option<u8>,
    /// Whether the handshake completed.
    pub handshake: bool,
    pub sni: Option<String>,
    pub alpn: Option<String>,
    pub resumed: bool,
    pub client_cert: bool,
}

/// A scripted answer: status and headers.
pub type Answer = (u16, Vec<(&'static str, &'static str)>);

/// What the TLS server saw: its connections, and the headers of each request.
#[derive(Debug, Default)]
pub struct TlsSeen {
    pub conns: Mutex<Vec<SeenConn>>,
    pub requests: Mutex<Vec<http::HeaderMap>>,
    /// The next answers, as `(status, headers)`; when none is left: 200.
    pub answers: Mutex<std::collections::VecDeque<Answer>>,
    /// Close every connection whose ALPN chose `h2` right after the TLS handshake (a server
    /// whose HTTP/2 is broken), before any HTTP/2 frame.
    pub refuse_h2: std::sync::atomic::AtomicBool,
}

/// A TLS model server: answers every request 200 with a small JSON body, `Connection: close`
/// when `close` (every call then takes a new connection); HTTP/2 when the client's ALPN offers
/// it, else HTTP/1.1.
pub struct TlsBackend {
    pub addr: SocketAddr,
    pub seen: Arc<TlsSeen>,
}

impl TlsBackend {
    /// Serves `(cert, key)` on `ip` (a port the kernel picks); with `client_ca`, asks for and
    /// requires a client certificate that CA signed.
    pub async fn start(
        ip: [u8; 4],
        leaf: &(String, String),
        client_ca: Option<&str>,
        close: bool,
    ) -> Self {
        Self::start_offering(ip, leaf, client_ca, close, &[b"h2", b"http/1.1"]).await
    }

    /// [`TlsBackend::start`], its ALPN choosing among `alpn` (in its order of preference).
    pub async fn start_offering(
        ip: [u8; 4],
        (cert, key): &(String, String),
        client_ca: Option<&str>,
        close: bool,
        alpn: &[&[u8]],
    ) -> Self {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
            .map(Result::unwrap)
            .collect();
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                    roots.add(c.unwrap()).unwrap();
                }
                builder.with_client_cert_verifier(
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .unwrap(),
                )
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind(SocketAddr::from((ip, 0))).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(TlsSeen::default());
        let s = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, seen) = (acceptor.clone(), s.clone());
                tokio::spawn(async move {
                    let mut first = [0u8; 1];
                    let first_byte = match tcp.peek(&mut first).await {
                        Ok(1) => Some(first[0]),
                        _ => None,
                    };
                    let index = {
                        let mut conns = seen.conns.lock();
                        conns.push(SeenConn {
                            first_byte,
                            ..SeenConn::default()
                        });
                        conns.len() - 1
                    };
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    {
                        let (_, conn) = tls.get_ref();
                        let mut conns = seen.conns.lock();
                        let c = &mut conns[index];
                        c.handshake = true;
                        c.sni = conn.server_name().map(str::to_owned);
                        c.alpn = conn
                            .alpn_protocol()
                            .map(|p| String::from_utf8_lossy(p).into_owned());
                        c.resumed = conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
                        c.client_cert = conn.peer_certificates().is_some_and(|c| !c.is_empty());
                    }
                    if h2 && seen.refuse_h2.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let mut headers = req.headers().clone();
                            // HTTP/2 names the authority in the request's URI.
                            if let Some(authority) = req.uri().authority()
                                && !headers.contains_key("host")
                            {
                                headers.insert("host", authority.as_str().parse().unwrap());
                            }
                            seen.requests.lock().push(headers);
                            let _ = req.into_body().collect().await;
                            let (status, headers) =
                                seen.answers.lock().pop_front().unwrap_or((200, Vec::new()));
                            let mut response = http::Response::builder()
                                .status(status)
                                .header("content-type", "application/json");
                            for (name, value) in headers {
                                response = response.header(name, value);
                            }
                            if close {
                                response = response.header("connection", "close");
                            }
                            Ok::<_, std::convert::Infallible>(
                                response
                                    .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
                                    .unwrap(),
                            )
                        }
                    });
                    if h2 {
                        let _ = hyper::server::conn::http2::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    }
                });
            }
        });
        Self { addr, seen }
    }

    pub fn conns(&self) -> Vec<SeenConn> {
        self.seen.conns.lock().clone()
    }

    pub fn requests(&self) -> Vec<http::HeaderMap> {
        self.seen.requests.lock().clone()
    }
}

/// Limits with one backend `model-a` whose one endpoint `addr` takes TLS as `tls` says.
pub fn tls_limits(addr: SocketAddr, tls: serde_json::Value) -> poolpilot_api::GatewayLimits {
    let mut backend = backend_json("model-a", &[addr], 4);
    backend["endpoints"][0]["tls"] = tls;
    from_json(serde_json::json!({
        "generation": 1,
        "listener": {"idleTimeout": "30s", "headerReadTimeout": "2s"},
        "backends": [backend],
    }))
}

fn series(name: &str, labels: &str) -> String {
    format!("{name}{{backend=\"model-a\",{labels}}}")
}

/// `poolpilot_upstream_tls_handshake_seconds_count` of `kind` (0 when absent).
pub fn handshakes(metrics: &str, kind: &str) -> f64 {
    metric(
        metrics,
        &series(
            "poolpilot_upstream_tls_handshake_seconds_count",
            &format!("kind=\"{kind}\""),
        ),
    )
    .unwrap_or(0.0)
}

fn tls_failures(metrics: &str, reason: &str) -> f64 {
    metric(
        metrics,
        &series(
            "poolpilot_upstream_tls_failures_total",
            &format!("reason=\"{reason}\""),
        ),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn a_tls_upstream_is_verified_against_the_policys_ca_for_its_server_name() {
    let pki = Pki::new("model CA");
    let backend = TlsBackend::start([127, 0, 0, 31], &pki.leaf("model.test"), None, false).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let gw = Gw::start(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .await;

    for _ in 0..5 {
        let (status, _, body) = get(gw.proxy, "/v1/models/x", &[]).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"ok\":true"), "{body}");
    }
    let conns = backend.conns();
    assert_eq!(conns.len(), 1, "one kept-alive connection: {conns:?}");
    let c = &conns[0];
    assert_eq!(c.first_byte, Some(0x16), "a TLS handshake opens it");
    assert_eq!(c.sni.as_deref(), Some("model.test"));
    assert_eq!(
        c.alpn.as_deref(),
        Some("http/1.1"),
        "HTTP/1.1 asked for by ALPN"
    );
    assert!(!c.resumed && !c.client_cert);
    let host = format!("model.test:{}", backend.addr.port());
    for headers in backend.requests() {
        assert_eq!(headers["host"], host.as_str(), "the server's name as Host");
    }
    let m = gw.metrics().await;
    assert_eq!(handshakes(&m, "full"), 1.0, "{m}");
    assert_eq!(handshakes(&m, "resumed"), 0.0);
    // Five leases, one connection: four reused.
    assert_eq!(
        metric(&m, r#"poolpilot_pool_reuse_ratio{backend="model-a"}"#),
        Some(0.8),
        "{m}"
    );
}

#[tokio::test]
async fn a_reconnect_resumes_the_tls_session() {
    let pki = Pki::new("model CA");
    // Every answer closes its connection: every call opens a new one.
    let backend = TlsBackend::start([127, 0, 0, 32], &pki.leaf("model.test"), None, true).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let gw = Gw::start(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .await;
    let calls = 6;
    for _ in 0..calls {
        let (status, _, body) = get(gw.proxy, "/", &[]).await;
        assert_eq!(status, 200, "{body}");
        // The connection the server closed is gone from the pool before the next call.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let conns = backend.conns();
    assert_eq!(conns.len(), calls, "a connection per call: {conns:?}");
    assert!(!conns[0].resumed, "the first handshake is a full one");
    let resumed = conns.iter().filter(|c| c.resumed).count();
    assert_eq!(resumed, calls - 1, "every reconnect resumed: {conns:?}");
    let m = gw.metrics().await;
    assert_eq!(handshakes(&m, "full"), 1.0, "{m}");
    assert_eq!(handshakes(&m, "resumed"), (calls - 1) as f64, "{m}");
}

#[tokio::test]
async fn a_certificate_that_does_not_verify_is_a_502_naming_the_cause_and_never_plain_text() {
    let ours = Pki::new("our CA");
    let theirs = Pki::new("someone else's CA");
    let dir = tempfile::tempdir().unwrap();
    let ca = ours.write_ca(dir.path(), "ca.crt");

    // Signed by a CA the policy does not trust.
    let stranger =
        TlsBackend::start([127, 0, 0, 33], &theirs.leaf("model.test"), None, false).await;
    let gw = Gw::start(tls_limits(
        stranger.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .await;
    let (status, headers, body) = get(gw.proxy, "/", &[]).await;
    assert_eq!(status, 502, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        error["error"]["code"], "upstream_tls_verification_failed",
        "{body}"
    );
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("UnknownIssuer"), "the cause: {message}");
    assert!(
        !message.contains("127.0.0.33"),
        "no internal address: {message}"
    );
    assert!(
        headers.get("retry-after").is_none(),
        "a retry will not cure it"
    );

    // Trusted CA, certificate for another name.
    let wrong_name =
        TlsBackend::start([127, 0, 0, 34], &ours.leaf("other.test"), None, false).await;
    let mut doc = tls_limits(
        wrong_name.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    );
    doc.generation = 2;
    gw.apply(doc);
    let (status, _, body) = get(gw.proxy, "/", &[]).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("upstream_tls_verification_failed"), "{body}");
    assert!(body.contains("not valid for name"), "{body}");

    let m = gw.metrics().await;
    assert_eq!(tls_failures(&m, "certificate"), 2.0, "{m}");
    for server in [&stranger, &wrong_name] {
        let conns = server.conns();
        assert!(!conns.is_empty());
        for c in conns {
            assert_eq!(c.first_byte, Some(0x16), "only TLS on the wire: {c:?}");
            assert!(!c.handshake, "the gateway gave up in the handshake: {c:?}");
        }
        assert!(server.requests().is_empty(), "no request reached it");
    }
}

#[tokio::test]
async fn mtls_offers_the_client_certificate_the_server_asks_for() {
    let server_pki = Pki::new("model CA");
    let client_pki = Pki::new("gateway client CA");
    let backend = TlsBackend::start(
        [127, 0, 0, 35],
        &server_pki.leaf("model.internal"),
        Some(&client_pki.ca_pem()),
        false,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let ca = server_pki.write_ca(dir.path(), "ca.crt");
    let (cert, key) = client_pki.leaf("poolpilot-gateway");
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), key).unwrap();

    // Without a client certificate the server refuses the connection.
    let gw = Gw::start(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.internal", "caFile": ca}),
    ))
    .await;
    let (status, _, body) = get(gw.proxy, "/", &[]).await;
    assert_eq!(status, 502, "{body}");
    assert!(backend.requests().is_empty());

    let mut doc = tls_limits(
        backend.addr,
        serde_json::json!({
            "serverName": "model.internal",
            "caFile": ca,
            "clientCertificate": {
                "certFile": dir.path().join("tls.crt"),
                "keyFile": dir.path().join("tls.key"),
            },
        }),
    );
    doc.generation = 2;
    gw.apply(doc);
    let (status, _, body) = get(gw.proxy, "/", &[]).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        backend.conns().iter().any(|c| c.handshake && c.client_cert),
        "{:?}",
        backend.conns()
    );
}

/// `poolpilot_upstream_client_cert_expiry_seconds` of `model-a`.
fn client_cert_expiry(metrics: &str) -> Option<f64> {
    metric(
        metrics,
        r#"poolpilot_upstream_client_cert_expiry_seconds{backend="model-a"}"#,
    )
}

#[tokio::test]
async fn the_client_certificates_expiry_is_a_gauge_that_follows_a_rotated_secret() {
    let server_pki = Pki::new("model CA");
    let client_pki = Pki::new("gateway client CA");
    let servers = [[127, 0, 0, 60], [127, 0, 0, 61]];
    let mut addrs = Vec::new();
    for ip in servers {
        let leaf = server_pki.leaf("model.internal");
        let server = TlsBackend::start(ip, &leaf, Some(&client_pki.ca_pem()), false).await;
        addrs.push(server.addr);
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = server_pki.write_ca(dir.path(), "ca.crt");
    // Each endpoint its own certificate: the backend's gauge is the one that expires first.
    let ((cert, key), early) = client_pki.leaf_until("gateway-0", (2031, 5, 17));
    let ((cert1, key1), late) = client_pki.leaf_until("gateway-1", (2032, 1, 2));
    assert!(early < late);
    for (name, text) in [
        ("0.crt", cert),
        ("0.key", key),
        ("1.crt", cert1),
        ("1.key", key1),
    ] {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let mut backend = backend_json("model-a", &addrs, 4);
    for i in 0..2 {
        backend["endpoints"][i]["tls"] = serde_json::json!({
            "serverName": "model.internal",
            "caFile": ca,
            "clientCertificate": {
                "certFile": dir.path().join(format!("{i}.crt")),
                "keyFile": dir.path().join(format!("{i}.key")),
            },
        });
    }
    let gw = Gw::start(from_json(
        serde_json::json!({"generation": 1, "backends": [backend]}),
    ))
    .await;
    let m = gw.metrics().await;
    assert_eq!(client_cert_expiry(&m), Some(early as f64), "{m}");
    assert_eq!(
        get(gw.proxy, "/", &[]).await.0,
        200,
        "the certificates work"
    );

    // The first endpoint's Secret is renewed: the gauge moves to the new earliest expiry.
    let ((cert, key), renewed) = client_pki.leaf_until("gateway-0", (2033, 3, 4));
    std::fs::write(dir.path().join("0.key"), key).unwrap();
    std::fs::write(dir.path().join("0.crt"), cert).unwrap();
    assert!(late < renewed);
    assert_eventually!(
        client_cert_expiry(&gw.metrics().await) == Some(late as f64),
        Duration::from_secs(5),
        "the renewed certificate is read"
    );

    // A backend without a client certificate has no such series.
    let plain = Backend::start().await;
    let mut doc = limits("model-a", &[plain.addr], 4);
    doc.generation = 2;
    gw.apply(doc);
    let m = gw.metrics().await;
    assert_eq!(client_cert_expiry(&m), None, "{m}");
}

#[tokio::test]
async fn health_probes_of_a_tls_endpoint_run_over_tls() {
    let pki = Pki::new("model CA");
    let backend = TlsBackend::start([127, 0, 0, 36], &pki.leaf("model.test"), None, false).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let mut doc = serde_json::to_value(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .unwrap();
    doc["backends"][0]["healthCheck"] = serde_json::json!({
        "path": "/health", "interval": "100ms", "timeout": "1s",
        "unhealthyThreshold": 1, "healthyThreshold": 1
    });
    let gw = Gw::start(from_json(doc)).await;
    assert_eventually!(
        backend.requests().len() >= 3,
        Duration::from_secs(5),
        "probes arrive: {:?}",
        backend.conns()
    );
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_endpoint_healthy{backend="model-a",endpoint="model-a-0"}"#
        ),
        Some(1.0),
        "{m}"
    );
    for c in backend.conns() {
        assert_eq!(c.first_byte, Some(0x16), "probes speak TLS: {c:?}");
    }
}

#[tokio::test]
async fn tls_files_that_do_not_load_refuse_the_document_and_a_rotated_ca_takes_over() {
    let old = Pki::new("old CA");
    let new = Pki::new("new CA");
    let dir = tempfile::tempdir().unwrap();
    let ca = old.write_ca(dir.path(), "ca.crt");
    // Every call on a new connection: each one verifies the certificate again.
    let backend = TlsBackend::start([127, 0, 0, 37], &old.leaf("model.test"), None, true).await;
    let gw = Gw::start(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .await;
    assert_eq!(get(gw.proxy, "/", &[]).await.0, 200);

    let mut missing = tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "model.test", "caFile": dir.path().join("nope.crt")}),
    );
    missing.generation = 2;
    let (status, body) = gw.put_limits(&missing).await;
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("nope.crt"), "names the file: {body}");
    assert_eq!(
        get(gw.proxy, "/", &[]).await.0,
        200,
        "the limits in force stay"
    );

    // The Secret rotates to a new CA, with no new document: the next new connection verifies
    // against it, and the old server's certificate no longer passes.
    new.write_ca(dir.path(), "ca.crt");
    assert_eventually!(
        get(gw.proxy, "/", &[]).await.0 == 502,
        Duration::from_secs(5),
        "the rotated CA bundle is in force"
    );
    let (_, _, body) = get(gw.proxy, "/", &[]).await;
    assert!(body.contains("UnknownIssuer"), "{body}");
}

#[tokio::test]
async fn plain_endpoints_beside_tls_ones_stay_plain() {
    let pki = Pki::new("model CA");
    let tls = TlsBackend::start([127, 0, 0, 39], &pki.leaf("model.test"), None, false).await;
    let plain = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let mut backend = backend_json("model-a", &[tls.addr, plain.addr], 4);
    backend["endpoints"][0]["tls"] = serde_json::json!({"serverName": "model.test", "caFile": ca});
    let gw = Gw::start(from_json(serde_json::json!({
        "generation": 1,
        "backends": [backend],
    })))
    .await;
    for _ in 0..20 {
        assert_eq!(get(gw.proxy, "/", &[]).await.0, 200);
    }
    assert!(!tls.requests().is_empty() && plain.requests() > 0);
    assert!(tls.conns().iter().all(|c| c.first_byte == Some(0x16)));
}

#[tokio::test]
#[ignore = "needs nginx (make upstream-peers)"]
async fn nginx_as_a_tls_upstream_resumes_the_gateways_sessions() {
    let pki = Pki::new("model CA");
    // `keepalive_requests 1`: nginx closes every connection after its answer, so every call
    // takes a new one and a handshake.
    let server = crate::peers::nginx_tls(1, &pki.leaf("model.test")).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let gw = Gw::start(tls_limits(
        server.addr,
        serde_json::json!({"serverName": "model.test", "caFile": ca}),
    ))
    .await;
    let calls = 20;
    for _ in 0..calls {
        let (status, _, body) = get(gw.proxy, "/", &[]).await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = gw.metrics().await;
    let (full, resumed) = (handshakes(&m, "full"), handshakes(&m, "resumed"));
    let log = server.log("access.log");
    let lines: Vec<&str> = log.lines().collect();
    let nginx_resumed = lines.iter().filter(|l| l.starts_with("r ")).count();
    eprintln!(
        "nginx, keepalive_requests 1: {calls} calls, {full} full and {resumed} resumed handshakes; nginx saw {nginx_resumed} of {} requests on a resumed session",
        lines.len()
    );
    assert_eq!(lines.len(), calls);
    assert!(
        lines.iter().all(|l| l.contains(" model.test ")),
        "SNI: {log}"
    );
    assert_eq!(full, 1.0, "{m}");
    assert_eq!(resumed, (calls - 1) as f64, "{m}");
    assert_eq!(nginx_resumed, calls - 1, "{log}");
}
