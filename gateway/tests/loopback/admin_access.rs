//! Loopback tests of who may use the admin API and for how long, whatever a client does: the
//! token on every `/v1/*` endpoint and none on the probes; no start without a usable token;
//! the token file followed, with an overlap of old and new; the connection cap and the
//! timeouts on silent, slow and non-reading clients; HTTPS from a certificate that is re-read
//! when it changes.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use http_body_util::BodyExt as _;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use poolpilot_gateway::config::{AdminTlsFiles, GatewayConfig, Listeners};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The name the test certificates carry.
const SERVER_NAME: &str = "poolpilot-gateway-admin.test.svc";

/// Replaces `path`'s content the way the kubelet does (a new file renamed over the old one).
fn replace_file(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Reads from `stream` until the peer closes it (or `within` passes: `None`); what was read.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_v1_endpoint_needs_the_token_and_the_probes_do_not() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    let wrong = format!("Bearer {}", TEST_TOKEN.replace('d', "e"));
    for path in ["/v1/limits", "/v1/stats", "/v1/nothing-here"] {
        for headers in [vec![], vec![("authorization", wrong.as_str())]] {
            let (status, head, body) = get(gw.admin, path, &headers).await;
            assert_eq!(status, 401, "GET {path} with {headers:?}: {body}");
            assert_eq!(head["www-authenticate"], "Bearer", "{path}");
            assert!(!body.contains("backends"), "nothing leaks: {body}");
        }
    }
    assert_eq!(gw.admin_get("/v1/limits").await.0, 200);
    assert_eq!(gw.admin_get("/v1/stats").await.0, 200);
    assert_eq!(gw.admin_get("/v1/nothing-here").await.0, 404);
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(get(gw.admin, path, &[]).await.0, 200, "{path}");
    }
}

/// A configuration of the gateway on loopback with the given token file.
fn config_with_token(token_file: Option<&Path>) -> GatewayConfig {
    GatewayConfig {
        listeners: Listeners {
            proxy: "127.0.0.1:0".parse().unwrap(),
            admin: "127.0.0.1:0".parse().unwrap(),
        },
        admin_token_file: token_file.map(Path::to_path_buf),
        admin_token_overlap: poolpilot_api::Duration::from_secs(300),
        admin_tls: None,
        admin_header_read_timeout: poolpilot_api::Duration::from_secs(10),
        admin_max_connections: 64,
        limits_file: None,
        limits_poll_interval: poolpilot_api::Duration::from_millis(50),
        drain_grace: poolpilot_api::Duration::from_secs(1),
        await_operator: poolpilot_api::Duration::ZERO,
        shutdown_delay: poolpilot_api::Duration::ZERO,
        access_log: Default::default(),
        metrics: Default::default(),
        upstream_keepalive: Default::default(),
        early_retries: Default::default(),
        dns: Default::default(),
    }
}

#[tokio::test]
async fn the_gateway_does_not_start_without_a_long_private_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let refused = |content: Option<&'static str>, why: &'static str| {
        let token = token.clone();
        async move {
            let _ = std::fs::remove_file(&token);
            if let Some(text) = content {
                std::fs::write(&token, text).unwrap();
            }
            let error = poolpilot_gateway::start(config_with_token(Some(&token)))
                .await
                .expect_err(why);
            format!("{error}")
        }
    };
    let message = refused(None, "a missing file").await;
    assert!(message.contains("reading admin token file"), "{message}");
    let message = refused(Some("\n"), "an empty file").await;
    assert!(message.contains("is empty"), "{message}");
    let message = refused(Some("0123456789abcdef0123456789abcde\n"), "31 bytes").await;
    assert!(message.contains("has 31 bytes; at least 32"), "{message}");
    let message = refused(
        Some("a token with spaces is no bearer token at all"),
        "spaces",
    )
    .await;
    assert!(message.contains("cannot carry"), "{message}");
    // The placeholder the manifests once shipped.
    let message = refused(
        Some("change-me-before-deploying-to-a-real-cluster\n"),
        "the published placeholder",
    )
    .await;
    assert!(message.contains("published with poolpilot"), "{message}");

    let error = poolpilot_gateway::start(config_with_token(None))
        .await
        .expect_err("no adminTokenFile");
    assert!(
        error.to_string().contains("adminTokenFile is not set"),
        "{error}"
    );

    std::fs::write(&token, "0123456789abcdef0123456789abcdef\n").unwrap();
    let running = poolpilot_gateway::start(config_with_token(Some(&token)))
        .await
        .expect("32 bytes start");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_token_file_is_followed_and_the_old_token_works_during_the_overlap() {
    let overlap = Duration::from_millis(1500);
    let gw = Gw::start_edited(None, Duration::from_secs(1), Duration::ZERO, |c, _| {
        c.admin_token_overlap = overlap.into();
    })
    .await;
    let token_file = gw.dir.path().join("token");
    let status = |token: String| async move {
        let bearer = format!("Bearer {token}");
        get(
            gw.admin,
            "/v1/limits",
            &[("authorization", bearer.as_str())],
        )
        .await
        .0
        .as_u16()
    };
    let (old, new) = (
        TEST_TOKEN.to_owned(),
        "bmV3LWFkbWluLXRva2VuLW5ldy1hZG1pbi10b2tlbg==",
    );

    // A file that no longer holds a usable token is refused; the token in force stays.
    replace_file(&token_file, "short\n");
    assert_eventually!(
        metric(
            &gw.metrics().await,
            "poolpilot_admin_reloads_total{file=\"token\",outcome=\"refused\"}"
        ) == Some(1.0),
        Duration::from_secs(5),
        "the short token was not refused"
    );
    assert_eq!(status(old.clone()).await, 200);
    assert_eq!(status("short".into()).await, 401);

    replace_file(&token_file, &format!("{new}\n"));
    let rotated = Instant::now();
    assert_eventually!(
        status(new.to_owned()).await == 200,
        Duration::from_secs(5),
        "the new token was never accepted"
    );
    assert_eq!(
        status(old.clone()).await,
        200,
        "the old token works during the overlap"
    );
    assert!(
        rotated.elapsed() < overlap,
        "the test ran too slowly to check the overlap"
    );
    tokio::time::sleep_until(rotated + overlap + Duration::from_millis(200)).await;
    assert_eq!(status(old).await, 401, "the overlap is over");
    assert_eq!(status(new.to_owned()).await, 200);
    assert_eq!(
        metric(
            &gw.metrics().await,
            "poolpilot_admin_reloads_total{file=\"token\",outcome=\"applied\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_nothing_or_dribble_are_cut_off_after_the_header_read_timeout() {
    let timeout = Duration::from_millis(400);
    let backend = Backend::start().await;
    let gw = Gw::start_edited(None, Duration::from_secs(1), Duration::ZERO, |c, _| {
        c.admin_header_read_timeout = timeout.into();
    })
    .await;
    gw.apply(limits("model-a", &[backend.addr], 4));

    // Connected, silent.
    let start = Instant::now();
    let mut silent = TcpStream::connect(gw.admin).await.unwrap();
    let got = read_until_closed(&mut silent, Duration::from_secs(5))
        .await
        .expect("a silent connection is closed");
    let took = start.elapsed();
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(
        took >= timeout && took < timeout * 5,
        "closed after {took:?} (timeout {timeout:?})"
    );

    // A head sent one byte every 50 ms, never finished.
    let start = Instant::now();
    let mut slow = TcpStream::connect(gw.admin).await.unwrap();
    let dribble = async {
        for b in b"GET /metrics HTTP/1.1\r\nhost: x\r\nx-padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        {
            if slow.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    dribble.await;
    let took = start.elapsed();
    let got = read_until_closed(&mut slow, Duration::from_secs(5))
        .await
        .expect("a dribbling head is cut off");
    assert!(
        start.elapsed() < timeout * 5,
        "closed after {:?} (the head dribbled for {took:?})",
        start.elapsed()
    );
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains(" 200 "), "{text}");

    // Idle between two requests of a keep-alive connection.
    let mut idle = TcpStream::connect(gw.admin).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let got = read_until_closed(&mut idle, Duration::from_secs(5))
        .await
        .expect("an idle keep-alive connection is closed");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert!(start.elapsed() < timeout * 5, "{:?}", start.elapsed());

    // A PUT whose body never finishes is answered 408, and the connection closed.
    let mut stalled = TcpStream::connect(gw.admin).await.unwrap();
    let head = format!(
        "PUT /v1/limits HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"generation\":",
        gw.bearer()
    );
    stalled.write_all(head.as_bytes()).await.unwrap();
    let start = Instant::now();
    let got = read_until_closed(&mut stalled, Duration::from_secs(5))
        .await
        .expect("a stalled body is answered and closed");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(start.elapsed() < timeout * 5, "{:?}", start.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_once_and_counted() {
    let cap = 3;
    let gw = Gw::start_edited(None, Duration::from_secs(1), Duration::ZERO, |c, _| {
        c.admin_max_connections = cap;
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..cap {
        let mut c = connect(gw.admin).await;
        let (status, _, _) = c.call(request("GET", "/healthz", &[], "")).await;
        assert_eq!(status, 200);
        held.push(c);
    }
    for _ in 0..5 {
        let start = Instant::now();
        let mut extra = TcpStream::connect(gw.admin).await.unwrap();
        let _ = extra
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        let got = read_until_closed(&mut extra, Duration::from_secs(2))
            .await
            .expect("a connection over the cap is closed at once");
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }
    held.pop();
    assert_eventually!(
        try_get(gw.admin, "/healthz").await == Some(200),
        Duration::from_secs(5),
        "a closed connection frees its slot"
    );
    drop(held);
    let mut refused = None;
    assert_eventually!(
        {
            if let Some(c) = try_get(gw.admin, "/healthz").await {
                assert_eq!(c, 200);
                refused = metric(
                    &gw.metrics().await,
                    "poolpilot_admin_connections_refused_total",
                );
                true
            } else {
                false
            }
        },
        Duration::from_secs(5),
        "the slots were not freed"
    );
    // The five above, and any poll made while a closed connection's slot was not free yet.
    assert!(refused.is_some_and(|n| n >= 5.0), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_responses_loses_its_connection() {
    let timeout = Duration::from_millis(500);
    let gw = Gw::start_edited(None, Duration::from_secs(1), Duration::ZERO, |c, _| {
        c.admin_header_read_timeout = timeout.into();
        c.admin_max_connections = 1;
    })
    .await;
    // Pipelined requests for /metrics, never reading: the answers fill both socket buffers and
    // the gateway's write stalls.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(gw.admin).await.unwrap();
    let (_read_half, mut write_half) = stream.into_split();
    let writer = tokio::spawn(async move {
        let request = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n";
        for _ in 0..100_000 {
            if write_half.write_all(request).await.is_err() {
                return;
            }
        }
    });
    // While it holds the only slot, other clients are turned away...
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        try_get(gw.admin, "/healthz").await,
        None,
        "the slot is held"
    );
    // ... until its stalled write times out and the slot is free again.
    let start = Instant::now();
    assert_eventually!(
        try_get(gw.admin, "/healthz").await == Some(200),
        Duration::from_secs(10),
        "the non-reading client kept its connection"
    );
    assert!(start.elapsed() < timeout * 10, "{:?}", start.elapsed());
    writer.abort();
}

// === HTTPS ===

/// A CA, and certificates it signs.
struct Pki {
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "poolpilot test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        Self {
            ca: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    /// `(tls.crt, tls.key)` for `name`.
    fn leaf(&self, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &self.ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }
}

/// A TLS client trusting `ca_pem` only. Each call is a new client: a reused one would resume
/// its earlier sessions and skip verifying the certificate.
fn tls_client(ca_pem: &str) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// `GET path` over TLS as `SERVER_NAME`, with the token; the status, or why there is none.
async fn https_get(
    addr: SocketAddr,
    client: &tokio_rustls::TlsConnector,
    path: &str,
) -> Result<u16, String> {
    https_call(addr, client, path)
        .await
        .map(|(status, _)| status)
}

/// [`https_get`], with the body.
async fn https_call(
    addr: SocketAddr,
    client: &tokio_rustls::TlsConnector,
    path: &str,
) -> Result<(u16, String), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(SERVER_NAME).unwrap();
    let tls = client
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]), "HTTP/1.1 only");
    let (mut sender, conn) = http1::handshake::<_, Body>(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let bearer = format!("Bearer {TEST_TOKEN}");
    let response = sender
        .send_request(request(
            "GET",
            path,
            &[("authorization", bearer.as_str())],
            "",
        ))
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Puts `(tls.crt, tls.key)` in `dir/tls/` the way the kubelet updates a mounted Secret: both
/// files in a new folder, then the `tls` symlink swapped to it at once.
fn mount_certificate(dir: &Path, version: u32, (crt, key): &(String, String)) {
    let folder = dir.join(format!("tls-{version}"));
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("tls.crt"), crt).unwrap();
    std::fs::write(folder.join("tls.key"), key).unwrap();
    let link = dir.join("tls.new");
    std::os::unix::fs::symlink(&folder, &link).unwrap();
    std::fs::rename(&link, dir.join("tls")).unwrap();
}

/// A gateway serving HTTPS on its admin port from `tls/tls.crt` / `tls/tls.key` in its folder.
async fn tls_gateway(cert: &(String, String), timeout: Duration) -> Gw {
    Gw::start_edited(None, Duration::from_secs(1), Duration::ZERO, |c, dir| {
        mount_certificate(dir, 1, cert);
        c.admin_tls = Some(AdminTlsFiles {
            cert_file: dir.join("tls/tls.crt"),
            key_file: dir.join("tls/tls.key"),
        });
        c.admin_header_read_timeout = timeout.into();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_serves_https_from_a_certificate_it_follows() {
    // Long enough for a handshake on a loaded machine, short beside the silent client's bound.
    let timeout = Duration::from_secs(2);
    let first = Pki::new();
    let gw = tls_gateway(&first.leaf(SERVER_NAME), timeout).await;
    let trusts_first = || tls_client(&first.ca_pem());
    assert_eq!(
        https_get(gw.admin, &trusts_first(), "/v1/stats").await,
        Ok(200)
    );
    assert_eq!(
        https_get(gw.admin, &trusts_first(), "/readyz?requireLimits=true").await,
        Ok(503),
        "no limits yet"
    );
    assert_eq!(
        https_get(gw.admin, &trusts_first(), "/readyz").await,
        Ok(200)
    );

    // Plain HTTP gets no answer: no token ever travels in clear text.
    assert_eq!(try_get(gw.admin, "/healthz").await, None);
    // A client trusting another CA refuses the certificate.
    let other = Pki::new();
    let trusts_other = || tls_client(&other.ca_pem());
    let refused = https_get(gw.admin, &trusts_other(), "/healthz").await;
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("handshake")),
        "{refused:?}"
    );
    // A silent client does not hold a handshake open.
    let mut silent = TcpStream::connect(gw.admin).await.unwrap();
    let start = Instant::now();
    read_until_closed(&mut silent, timeout * 10)
        .await
        .expect("a silent TLS client is cut off");
    assert!(
        start.elapsed() >= timeout / 2,
        "cut at its timeout: {:?}",
        start.elapsed()
    );

    // A renewed pair (here from another CA) is served from the next handshake on.
    mount_certificate(gw.dir.path(), 2, &other.leaf(SERVER_NAME));
    assert_eventually!(
        https_get(gw.admin, &trusts_other(), "/healthz").await == Ok(200),
        Duration::from_secs(5),
        "the renewed certificate was never served"
    );
    assert!(
        https_get(gw.admin, &trusts_first(), "/healthz")
            .await
            .is_err()
    );

    // A certificate whose key is not the one beside it is refused; the pair in force stays.
    let (crt, _) = first.leaf(SERVER_NAME);
    let (_, key) = other.leaf(SERVER_NAME);
    mount_certificate(gw.dir.path(), 3, &(crt, key));
    let reloads = |outcome: &str| {
        format!("poolpilot_admin_reloads_total{{file=\"certificate\",outcome=\"{outcome}\"}}")
    };
    let metrics = || async {
        https_call(gw.admin, &trusts_other(), "/metrics")
            .await
            .map(|(_, text)| text)
            .unwrap_or_default()
    };
    assert_eventually!(
        metric(&metrics().await, &reloads("refused")) == Some(1.0),
        Duration::from_secs(5),
        "the mismatched pair was not refused"
    );
    assert_eq!(
        https_get(gw.admin, &trusts_other(), "/healthz").await,
        Ok(200)
    );
    assert_eq!(metric(&metrics().await, &reloads("applied")), Some(1.0));
}

#[tokio::test]
async fn the_gateway_does_not_start_with_an_unusable_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TEST_TOKEN).unwrap();
    let pki = Pki::new();
    let (crt, key) = pki.leaf(SERVER_NAME);
    let (_, other_key) = pki.leaf(SERVER_NAME);
    let files = AdminTlsFiles {
        cert_file: dir.path().join("tls.crt"),
        key_file: dir.path().join("tls.key"),
    };
    let start = |crt: Option<&str>, key: Option<&str>| {
        let (config, files) = (config_with_token(Some(&token)), files.clone());
        let (crt, key) = (crt.map(str::to_owned), key.map(str::to_owned));
        async move {
            for (path, text) in [(&files.cert_file, crt), (&files.key_file, key)] {
                let _ = std::fs::remove_file(path);
                if let Some(text) = text {
                    std::fs::write(path, text).unwrap();
                }
            }
            let config = GatewayConfig {
                admin_tls: Some(files),
                ..config
            };
            poolpilot_gateway::start(config).await
        }
    };
    let report = |e: poolpilot_gateway::StartError| {
        let mut s = e.to_string();
        let mut cur = std::error::Error::source(&e);
        while let Some(c) = cur {
            s.push_str(": ");
            s.push_str(&c.to_string());
            cur = c.source();
        }
        s
    };
    let missing = report(start(None, Some(&key)).await.unwrap_err());
    assert!(missing.contains("tls.crt"), "{missing}");
    let garbage = report(start(Some("not PEM"), Some(&key)).await.unwrap_err());
    assert!(garbage.contains("no PEM certificate"), "{garbage}");
    let mismatch = report(start(Some(&crt), Some(&other_key)).await.unwrap_err());
    assert!(
        mismatch.contains("does not fit the certificate"),
        "{mismatch}"
    );
    let running = start(Some(&crt), Some(&key))
        .await
        .expect("a good pair starts");
    running.shutdown().await;
}
