//! Real handshakes on loopback: the client configurations against a rustls server whose
//! certificate comes from a test CA.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

/// A CA and a server certificate it signed for `name`: (CA certificate, server config).
fn server_for(name: &str) -> (CertificateDer<'static>, Arc<ServerConfig>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca =
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let config = ServerConfig::builder_with_provider(poolpilot_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap(),
        )
        .unwrap();
    (ca.der().clone(), Arc::new(config))
}

/// One exchange over TLS on loopback, the client dialing `dialed`: what the server said, or
/// the client's error.
fn exchange(
    server: Arc<ServerConfig>,
    client: ClientConfig,
    dialed: &str,
) -> Result<String, String> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = std::thread::spawn(move || {
        let (tcp, _) = listener.accept().unwrap();
        let mut tls = rustls::StreamOwned::new(ServerConnection::new(server).unwrap(), tcp);
        let mut ask = [0u8; 4];
        if tls.read_exact(&mut ask).is_ok() {
            let _ = tls.write_all(b"pong");
            let _ = tls.flush();
        }
    });
    let name = ServerName::try_from(dialed.to_owned()).unwrap();
    let connection = ClientConnection::new(Arc::new(client), name).unwrap();
    let mut tls = rustls::StreamOwned::new(connection, TcpStream::connect(addr).unwrap());
    let answer = tls
        .write_all(b"ping")
        .and_then(|()| {
            let mut buf = [0u8; 4];
            tls.read_exact(&mut buf).map(|()| buf)
        })
        .map(|buf| String::from_utf8_lossy(&buf).into_owned())
        .map_err(|e| e.to_string());
    drop(tls);
    serving.join().unwrap();
    answer
}

#[test]
fn any_server_config_talks_to_a_server_whatever_its_certificate_names() {
    let (_, server) = server_for("gateway.ns.svc");
    let client = poolpilot_tls::any_server_config().unwrap();
    assert_eq!(exchange(server, client, "127.0.0.1"), Ok("pong".into()));
}

#[test]
fn named_server_config_checks_the_name_and_the_roots_not_the_dialed_address() {
    let (ca, server) = server_for("gateway.ns.svc");
    let mut roots = RootCertStore::empty();
    roots.add(ca).unwrap();
    let roots = Arc::new(roots);
    let named = |name: &str| {
        poolpilot_tls::named_server_config(
            roots.clone(),
            ServerName::try_from(name.to_owned()).unwrap(),
        )
        .unwrap()
    };
    assert_eq!(
        exchange(server.clone(), named("gateway.ns.svc"), "127.0.0.1"),
        Ok("pong".into())
    );
    let other_name = exchange(server.clone(), named("gateway.other.svc"), "127.0.0.1");
    assert!(
        other_name
            .as_ref()
            .is_err_and(|e| e.contains("certificate")),
        "{other_name:?}"
    );

    let (other_ca, _) = server_for("gateway.ns.svc");
    let mut other_roots = RootCertStore::empty();
    other_roots.add(other_ca).unwrap();
    let untrusting = poolpilot_tls::named_server_config(
        Arc::new(other_roots),
        ServerName::try_from("gateway.ns.svc").unwrap(),
    )
    .unwrap();
    let refused = exchange(server, untrusting, "127.0.0.1");
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("certificate")),
        "{refused:?}"
    );
}
