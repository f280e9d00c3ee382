//! The admin client over HTTPS with a CA bundle: names checked per namespace, a renewed bundle
//! taken without a restart, an unusable one refused at start.

use std::net::SocketAddr;

use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use poolpilot_api::GatewayLimits;
use poolpilot_tls::provider;
use tokio::net::TcpListener;

use super::*;
use crate::gateway::client::{Gateways, HttpGateways, PutError};

/// A CA that signs certificates.
struct Ca(rcgen::CertifiedIssuer<'static, rcgen::KeyPair>);

impl Ca {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        Self(rcgen::CertifiedIssuer::self_signed(params, key).unwrap())
    }

    /// A certificate and key for `name`, as PEM.
    fn leaf(&self, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &self.0)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A loopback gateway admin port over TLS that acknowledges every PUT.
async fn https_gateway((cert, key): (String, String)) -> SocketAddr {
    let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let service = service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                        bytes::Bytes::from_static(br#"{"revision":"r1","generation":1}"#),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

fn doc() -> GatewayLimits {
    serde_json::from_value(serde_json::json!({"generation": 1, "backends": []})).unwrap()
}

const TEMPLATE: &str = "poolpilot-gateway-admin.{namespace}.svc";

fn client(ca_file: &Path) -> HttpGateways {
    let trust = GatewayTrust::load(ca_file.into(), TEMPLATE.into(), Duration::from_secs(5))
        .expect("the bundle loads");
    HttpGateways::with_trust(Duration::from_secs(5), trust).unwrap()
}

#[tokio::test]
async fn puts_go_over_https_to_a_certificate_of_the_bundle_named_for_the_namespace() {
    let ca = Ca::new();
    let addr = https_gateway(ca.leaf("poolpilot-gateway-admin.ns.svc")).await;
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("ca.crt");
    std::fs::write(&bundle, ca.0.pem()).unwrap();
    let gateways = client(&bundle);
    let acked = gateways.put("ns", addr, "token", &doc()).await;
    assert_eq!(acked.map(|a| a.revision).ok().as_deref(), Some("r1"));

    // The same pod taken for a gateway of another namespace: its name does not fit.
    let other = gateways.put("other", addr, "token", &doc()).await;
    assert!(matches!(other, Err(PutError::Transport(_))), "{other:?}");

    // A bundle of another CA does not trust it.
    std::fs::write(dir.path().join("other.crt"), Ca::new().0.pem()).unwrap();
    let untrusting = client(&dir.path().join("other.crt"));
    let refused = untrusting.put("ns", addr, "token", &doc()).await;
    let why = refused
        .map(|_| String::new())
        .unwrap_or_else(|e| crate::report(&e));
    assert!(why.contains("certificate"), "{why}");

    // A plain-HTTP client gets no answer from it.
    let plain = HttpGateways::new(Duration::from_secs(5)).unwrap();
    assert!(plain.put("ns", addr, "token", &doc()).await.is_err());
}

#[tokio::test]
async fn a_changed_bundle_is_trusted_without_a_restart_and_a_broken_one_is_not_taken() {
    let (old, new) = (Ca::new(), Ca::new());
    let addr = https_gateway(new.leaf("poolpilot-gateway-admin.ns.svc")).await;
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("ca.crt");
    std::fs::write(&bundle, old.0.pem()).unwrap();
    let gateways = client(&bundle);
    assert!(gateways.put("ns", addr, "token", &doc()).await.is_err());

    // Both CAs during a CA rotation, as trust-manager writes a bundle.
    std::fs::write(&bundle, format!("{}{}", old.0.pem(), new.0.pem())).unwrap();
    assert!(gateways.put("ns", addr, "token", &doc()).await.is_ok());

    std::fs::write(&bundle, "not a certificate").unwrap();
    assert!(
        gateways.put("ns", addr, "token", &doc()).await.is_ok(),
        "the bundle in force stays"
    );
    std::fs::remove_file(&bundle).unwrap();
    assert!(gateways.put("ns", addr, "token", &doc()).await.is_ok());
}

#[test]
fn an_unusable_bundle_or_name_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let load = |file: &str, name: &str| {
        GatewayTrust::load(dir.path().join(file), name.into(), Duration::from_secs(1))
            .map(|_| ())
            .map_err(|e| crate::report(&e))
    };
    let missing = load("missing.crt", TEMPLATE).unwrap_err();
    assert!(missing.contains("missing.crt"), "{missing}");
    std::fs::write(dir.path().join("empty.crt"), "").unwrap();
    let empty = load("empty.crt", TEMPLATE).unwrap_err();
    assert!(empty.contains("no usable CA certificate"), "{empty}");
    std::fs::write(dir.path().join("ca.crt"), Ca::new().0.pem()).unwrap();
    assert_eq!(load("ca.crt", TEMPLATE), Ok(()));
    let bad = load("ca.crt", "not a name {namespace}").unwrap_err();
    assert!(bad.contains("does not give a DNS name"), "{bad}");
}
