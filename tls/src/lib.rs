//! The workspace's one TLS stack, rustls with the *ring* provider (the one kube uses), and the
//! client configurations its binaries share: one that checks the server's certificate against
//! roots for a fixed name whatever address was dialed (the operator reaches gateway pods by IP),
//! and one that does not check who the server is (Prometheus' `insecure_skip_verify`, the
//! kubelet's HTTPS probes, which ask whether a pod answers, not who it is). Both check the
//! handshake's signatures, so the connection is real TLS either way.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// Why a client configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The certificate verifier could not be built (never expected with roots present).
    #[error("building the certificate verifier failed")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
    /// The TLS configuration could not be built (never expected with the ring provider).
    #[error("building the TLS configuration failed")]
    Config(#[from] rustls::Error),
}

/// The crypto provider of every TLS configuration of the workspace: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS client configuration that accepts any server certificate.
pub fn any_server_config() -> Result<ClientConfig, rustls::Error> {
    config(Identity::Any)
}

/// A TLS client configuration that verifies the server's chain against `roots` for `name`,
/// whatever address the connection went to (as Prometheus' `tls_config.server_name`).
pub fn named_server_config(
    roots: Arc<RootCertStore>,
    name: ServerName<'static>,
) -> Result<ClientConfig, Error> {
    let chain = WebPkiServerVerifier::builder_with_provider(roots, provider()).build()?;
    Ok(config(Identity::Named { chain, name })?)
}

fn config(identity: Identity) -> Result<ClientConfig, rustls::Error> {
    let provider = provider();
    let verifier = Arc::new(Verifier {
        identity,
        provider: provider.clone(),
    });
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// Who the server must be.
#[derive(Debug)]
enum Identity {
    /// Anyone.
    Any,
    /// The holder of a certificate for `name` that `chain` verifies.
    Named {
        chain: Arc<WebPkiServerVerifier>,
        name: ServerName<'static>,
    },
}

/// Checks the server's identity as [`Identity`] says, and the handshake's signatures always.
#[derive(Debug)]
struct Verifier {
    identity: Identity,
    provider: Arc<CryptoProvider>,
}

impl Verifier {
    /// The provider's signature algorithms: every handshake signature is checked with them,
    /// whatever the server's identity must be.
    fn algorithms(&self) -> &WebPkiSupportedAlgorithms {
        &self.provider.signature_verification_algorithms
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialed: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match &self.identity {
            Identity::Any => Ok(ServerCertVerified::assertion()),
            Identity::Named { chain, name } => {
                chain.verify_server_cert(end_entity, intermediates, name, ocsp_response, now)
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, self.algorithms())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, self.algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms().supported_schemes()
    }
}
