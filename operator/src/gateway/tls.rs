//! HTTPS to the gateways' admin API, verified against a CA bundle (`--gateway-ca-file`, a PEM
//! file, re-read when it changes: a renewed CA is trusted without a restart, a file that no
//! longer loads keeps the bundle in force). The operator reaches each pod by its IP, which no
//! shared certificate can name, so the certificate must carry the name
//! `--gateway-server-name` gives for the pod's namespace (`poolpilot-gateway-admin.NS.svc` by
//! default), checked in place of the IP, as Prometheus' `tls_config.server_name` does. One
//! client per namespace, so that a gateway of one namespace cannot pass for another's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tracing::warn;

/// The placeholder of `--gateway-server-name` replaced by the pod's namespace.
pub const NAMESPACE_PLACEHOLDER: &str = "{namespace}";

/// Why the gateways' CA bundle or server name cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The bundle could not be read.
    #[error("reading the gateways' CA bundle {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The bundle is not PEM certificates.
    #[error("the gateways' CA bundle {path} is not PEM certificates")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The bundle holds no certificate rustls can use as a root.
    #[error("the gateways' CA bundle {path} holds no usable CA certificate")]
    NoRoots {
        /// The file.
        path: PathBuf,
    },
    /// The server name template does not give a DNS name.
    #[error(
        "--gateway-server-name {0:?} does not give a DNS name (use {NAMESPACE_PLACEHOLDER} for the namespace)"
    )]
    ServerName(String),
    /// The TLS configuration could not be built.
    #[error("building the TLS configuration failed")]
    Tls(#[source] poolpilot_tls::Error),
    /// The HTTP client could not be built.
    #[error("building the HTTPS client failed")]
    Client(#[source] reqwest::Error),
}

/// Trust in the gateways' certificates: the CA bundle in force and an HTTPS client per
/// namespace built from it.
#[derive(Debug)]
pub struct GatewayTrust {
    ca_file: PathBuf,
    server_name: String,
    timeout: Duration,
    state: Mutex<TrustState>,
}

#[derive(Debug)]
struct TrustState {
    /// The bundle's content, as last loaded.
    pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    clients: BTreeMap<String, reqwest::Client>,
}

impl GatewayTrust {
    /// Loads the bundle in `ca_file`; each namespace's gateways must present a certificate for
    /// `server_name` with [`NAMESPACE_PLACEHOLDER`] replaced by the namespace. Calls give up
    /// after `timeout`.
    pub fn load(
        ca_file: PathBuf,
        server_name: String,
        timeout: Duration,
    ) -> Result<Self, TrustError> {
        if ServerName::try_from(server_name.replace(NAMESPACE_PLACEHOLDER, "ns")).is_err() {
            return Err(TrustError::ServerName(server_name));
        }
        let pem = read(&ca_file)?;
        let roots = roots(&ca_file, &pem)?;
        Ok(Self {
            ca_file,
            server_name,
            timeout,
            state: Mutex::new(TrustState {
                pem,
                roots,
                clients: BTreeMap::new(),
            }),
        })
    }

    /// The name the gateways of `namespace` must present.
    pub fn server_name(&self, namespace: &str) -> String {
        self.server_name.replace(NAMESPACE_PLACEHOLDER, namespace)
    }

    /// The HTTPS client for the gateways of `namespace`, trusting the bundle as it is now in
    /// its file (a changed bundle that loads replaces the one in force; one that does not is
    /// logged and the one in force stays).
    pub fn client(&self, namespace: &str) -> Result<reqwest::Client, TrustError> {
        let mut state = self.state.lock();
        match std::fs::read(&self.ca_file) {
            Ok(pem) if pem != state.pem => match roots(&self.ca_file, &pem) {
                Ok(roots) => {
                    tracing::info!(path = %self.ca_file.display(), "the gateways' CA bundle changed");
                    *state = TrustState {
                        pem,
                        roots,
                        clients: BTreeMap::new(),
                    };
                }
                Err(error) => {
                    state.pem = pem;
                    warn!(error = %crate::report(&error), "the gateways' CA bundle changed and is refused; the one in force stays");
                }
            },
            Ok(_) => {}
            Err(error) => {
                warn!(path = %self.ca_file.display(), %error, "cannot read the gateways' CA bundle; the one in force stays");
            }
        }
        if let Some(client) = state.clients.get(namespace) {
            return Ok(client.clone());
        }
        let client = self.build(&state.roots, namespace)?;
        state.clients.insert(namespace.to_owned(), client.clone());
        Ok(client)
    }

    fn build(
        &self,
        roots: &Arc<RootCertStore>,
        namespace: &str,
    ) -> Result<reqwest::Client, TrustError> {
        let name = self.server_name(namespace);
        let name = ServerName::try_from(name.clone()).map_err(|_| TrustError::ServerName(name))?;
        let mut config =
            poolpilot_tls::named_server_config(roots.clone(), name).map_err(TrustError::Tls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        crate::http_client()
            .timeout(self.timeout)
            .use_preconfigured_tls(config)
            .build()
            .map_err(TrustError::Client)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TrustError> {
    std::fs::read(path).map_err(|source| TrustError::Read {
        path: path.into(),
        source,
    })
}

fn roots(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TrustError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TrustError::Pem {
            path: path.into(),
            source,
        })?;
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TrustError::NoRoots { path: path.into() });
    }
    Ok(Arc::new(roots))
}

#[cfg(test)]
mod tests;
