//! TLS to a backend endpoint: the client configuration an endpoint's `tls` asks for (rustls
//! with the workspace's one provider, `poolpilot_tls::provider`), and the handshake on a fresh
//! connection with what it reports.
//!
//! - **Verification, always**: the server's chain against the endpoint's CA bundle (`caFile`)
//!   or the system's roots, for the server name (`serverName`, else the endpoint's host, else
//!   its IP), which also goes out as SNI. There is no switch to turn it off, and a failed
//!   verification fails the connection ([`TlsError::Verification`], a 502 naming the cause):
//!   nothing ever falls back to plain text.
//! - **mTLS**: the client certificate and key of `clientCertificate`, offered when asked; its
//!   `notAfter` is read (x509-parser) for the expiry gauge of the backend.
//! - **ALPN** as the backend's `protocol` says: `http/1.1` alone (the default: a server that
//!   speaks HTTP/1.1 only is not made to guess), `h2` then `http/1.1` (`auto`: the server
//!   picks; an address in its HTTP/2 fallback cooldown is offered `http/1.1` alone, with the
//!   same session cache), or `h2` alone (`http2`).
//! - **Resumption**: one in-memory session store per endpoint's configuration (tickets and
//!   TLS 1.2 session IDs; [`sessions`]: as many TLS 1.3 tickets as the endpoint may open
//!   connections at once), kept for as long as the configuration stays the same, so that a
//!   reconnect, or a burst of them, skips the full handshake.
//! - **Metrics**: the handshake's duration by kind (`full`, `resumed`), failures by reason.
//!
//! The files are read when a document is applied and checked again for changes by the
//! backend's refresh ([`TlsClient::is_current`]): a rotated Secret takes effect on the next new
//! connection.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use http::HeaderValue;
use poolpilot_api::limits::{
    Endpoint as DocEndpoint, EndpointAddress, EndpointTls, UpstreamProtocol,
};
use poolpilot_tls::provider;
use rustls::client::Resumption;

mod sessions;

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, HandshakeKind, RootCertStore};
use sessions::{MIN_TICKETS, SessionStore};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::observe::{Metrics, TlsFailure, TlsHandshake};
use crate::pem::{self, PemError};

/// Why an endpoint's TLS could not be set up, or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file of the endpoint's `tls` could not be read.
    #[error("reading {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// A PEM file holds nothing usable.
    #[error("{path}: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: PemError,
    },
    /// The server name is not a DNS name or an IP address.
    #[error("{0:?} is not a valid TLS server name")]
    ServerName(String),
    /// No root certificate could be loaded (no `caFile`, and the system has none).
    #[error(
        "no CA certificate to verify the server with (set caFile, or install the system's roots)"
    )]
    NoRoots,
    /// The configuration could not be built (a client key that does not fit its certificate).
    #[error("building the TLS configuration failed")]
    Config(#[source] rustls::Error),
    /// The server's certificate did not verify: the connection is refused.
    #[error("the certificate of {server_name} failed verification: {cause}")]
    Verification {
        /// The name it was checked for.
        server_name: String,
        /// What rustls found.
        cause: rustls::Error,
    },
    /// The handshake failed otherwise (an alert from the server, a protocol error).
    #[error("the TLS handshake with {server_name} failed: {cause}")]
    Handshake {
        /// The server name.
        server_name: String,
        /// What happened.
        #[source]
        cause: io::Error,
    },
}

impl TlsError {
    /// What the client may be told: the cause, without the endpoint's name.
    pub fn public_message(&self) -> String {
        match self {
            Self::Verification { cause, .. } => {
                format!("the backend's TLS certificate failed verification: {cause}")
            }
            Self::Handshake { cause, .. } => {
                format!("the TLS handshake with the backend failed: {cause}")
            }
            other => format!("the backend's TLS settings could not be used: {other}"),
        }
    }

    /// Whether the server's certificate was refused.
    pub fn is_verification(&self) -> bool {
        matches!(self, Self::Verification { .. })
    }
}

/// One endpoint's TLS client: its configuration (with its session cache), the name it verifies
/// and sends as SNI, and the `Host` calls carry to it. Shared by every address of the endpoint.
pub struct TlsClient {
    /// What it was built from, to tell whether a new document or a file changed it.
    settings: EndpointTls,
    protocol: UpstreamProtocol,
    default_name: String,
    files: [u8; 32],
    name: String,
    server_name: ServerName<'static>,
    authority: Option<HeaderValue>,
    /// The client certificate's `notAfter`, unix seconds (none: no client certificate, or one
    /// whose validity could not be read).
    client_expiry: Option<i64>,
    connector: TlsConnector,
    /// `auto`: the same configuration (and session cache) offering `http/1.1` alone, for an
    /// address in its HTTP/2 fallback cooldown.
    http1_connector: Option<TlsConnector>,
    /// The sessions both connectors resume.
    sessions: Arc<SessionStore>,
    backend: Arc<str>,
    metrics: Metrics,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.name)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// The client of `endpoint`'s `tls` (none: plain), for `backend`'s metrics, offering by
    /// ALPN what `protocol` allows.
    pub fn load(
        backend: &Arc<str>,
        endpoint: &DocEndpoint,
        protocol: UpstreamProtocol,
        metrics: &Metrics,
    ) -> Result<Option<Self>, TlsError> {
        let Some(tls) = &endpoint.tls else {
            return Ok(None);
        };
        let default_name = default_name(&endpoint.address);
        let name = tls
            .server_name
            .clone()
            .unwrap_or_else(|| default_name.clone());
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName(name.clone()))?;
        let (contents, files) = read_files(tls)?;
        let roots = match &tls.ca_file {
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates(path, &contents[0])? {
                    roots.add(cert).map_err(TlsError::Config)?;
                }
                Arc::new(roots)
            }
            None => system_roots()?,
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_root_certificates(roots);
        let mut client_expiry = None;
        let mut config = match &tls.client_certificate {
            Some(c) => {
                let i = usize::from(tls.ca_file.is_some());
                let chain = certificates(&c.cert_file, &contents[i])?;
                client_expiry = not_after(&chain[0]);
                if client_expiry.is_none() {
                    tracing::warn!(%backend, cert = %c.cert_file.display(), "the client certificate's validity could not be read; its expiry is not exported");
                }
                let key = pem::private_key(&contents[i + 1]).map_err(|source| TlsError::Pem {
                    path: c.key_file.clone(),
                    source,
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(TlsError::Config)?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = match protocol {
            UpstreamProtocol::Http1 => vec![b"http/1.1".to_vec()],
            UpstreamProtocol::Auto => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            UpstreamProtocol::Http2 => vec![b"h2".to_vec()],
        };
        let sessions = Arc::new(SessionStore::new(MIN_TICKETS));
        config.resumption = Resumption::store(sessions.clone());
        let http1_connector = (protocol == UpstreamProtocol::Auto).then(|| {
            let mut http1 = config.clone();
            http1.alpn_protocols = vec![b"http/1.1".to_vec()];
            TlsConnector::from(Arc::new(http1))
        });
        let authority = match &server_name {
            ServerName::DnsName(_) => {
                let port = endpoint.address.port();
                let host = if port == 443 {
                    name.clone()
                } else {
                    format!("{name}:{port}")
                };
                HeaderValue::from_str(&host).ok()
            }
            _ => None,
        };
        Ok(Some(Self {
            settings: tls.clone(),
            protocol,
            default_name,
            files,
            name,
            server_name,
            authority,
            client_expiry,
            connector: TlsConnector::from(Arc::new(config)),
            sessions,
            http1_connector,
            backend: backend.clone(),
            metrics: metrics.clone(),
        }))
    }

    /// Whether this client is still the one `endpoint` of a `protocol` backend asks for: the
    /// same settings, name and ALPN, and files with the same content (a rotated Secret makes it
    /// stale).
    pub fn is_current(&self, endpoint: &DocEndpoint, protocol: UpstreamProtocol) -> bool {
        endpoint.tls.as_ref() == Some(&self.settings)
            && protocol == self.protocol
            && default_name(&endpoint.address) == self.default_name
            && read_files(&self.settings).is_ok_and(|(_, digest)| digest == self.files)
    }

    /// Keeps sessions for `connections` opened at once (the endpoint's cap and burst): that
    /// many TLS 1.3 tickets, so that a burst of reconnects resumes.
    pub fn keep_sessions_for(&self, connections: usize) {
        self.sessions.keep(connections);
    }

    /// The name the server's certificate is checked for.
    pub fn server_name(&self) -> &str {
        &self.name
    }

    /// When the client certificate expires (its `notAfter`, unix seconds), if one is offered.
    pub fn client_cert_expiry(&self) -> Option<i64> {
        self.client_expiry
    }

    /// The `Host` of calls through this client: the server name (with the port unless 443)
    /// when it is a DNS name; `None` for an IP (the client's `Host` stays).
    pub fn authority(&self) -> Option<&HeaderValue> {
        self.authority.as_ref()
    }

    /// Counts an address of this endpoint going to HTTP/1.1 for the `auto` fallback cooldown.
    pub(crate) fn count_h2_fallback(&self, reason: &'static str) {
        self.metrics.h2_fallback(&self.backend, reason);
    }

    /// The handshake on a fresh connection, timed and counted. A certificate that does not
    /// verify is [`TlsError::Verification`].
    pub async fn handshake<S>(&self, stream: S) -> Result<TlsStream<S>, TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.handshake_offering(stream, false).await
    }

    /// [`Self::handshake`], offering `http/1.1` alone by ALPN when `http1_only` (an `auto`
    /// client's fallback; other clients offer what they always do).
    pub(crate) async fn handshake_offering<S>(
        &self,
        stream: S,
        http1_only: bool,
    ) -> Result<TlsStream<S>, TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let start = Instant::now();
        let connector = match &self.http1_connector {
            Some(http1) if http1_only => http1,
            _ => &self.connector,
        };
        match connector.connect(self.server_name.clone(), stream).await {
            Ok(tls) => {
                let kind = match tls.get_ref().1.handshake_kind() {
                    Some(HandshakeKind::Resumed) => TlsHandshake::Resumed,
                    _ => TlsHandshake::Full,
                };
                self.metrics
                    .tls_handshake(&self.backend, kind, start.elapsed().as_secs_f64());
                Ok(tls)
            }
            Err(error) => {
                let rustls_error = error
                    .get_ref()
                    .and_then(|e| e.downcast_ref::<rustls::Error>())
                    .cloned();
                let (reason, error) = match rustls_error {
                    Some(
                        cause @ (rustls::Error::InvalidCertificate(_)
                        | rustls::Error::NoCertificatesPresented),
                    ) => (
                        TlsFailure::Certificate,
                        TlsError::Verification {
                            server_name: self.name.clone(),
                            cause,
                        },
                    ),
                    Some(rustls::Error::AlertReceived(_)) => (
                        TlsFailure::Alert,
                        TlsError::Handshake {
                            server_name: self.name.clone(),
                            cause: error,
                        },
                    ),
                    _ => (
                        TlsFailure::Handshake,
                        TlsError::Handshake {
                            server_name: self.name.clone(),
                            cause: error,
                        },
                    ),
                };
                self.metrics.tls_failure(&self.backend, reason);
                tracing::warn!(backend = %self.backend, %error, "upstream TLS handshake failed");
                Err(error)
            }
        }
    }
}

/// The server name of an endpoint without `serverName`: its host, or its IP address.
fn default_name(address: &EndpointAddress) -> String {
    match address {
        EndpointAddress::Ip(addr) => addr.ip().to_string(),
        EndpointAddress::Host { host, .. } => host.clone(),
    }
}

/// The contents of `tls`'s files (CA bundle, client certificate, client key, those given) and
/// their digest.
fn read_files(tls: &EndpointTls) -> Result<(Vec<Vec<u8>>, [u8; 32]), TlsError> {
    let mut paths: Vec<&Path> = Vec::new();
    paths.extend(tls.ca_file.as_deref());
    if let Some(c) = &tls.client_certificate {
        paths.extend([c.cert_file.as_path(), c.key_file.as_path()]);
    }
    let mut digest = Sha256::new();
    let mut contents = Vec::with_capacity(paths.len());
    for path in paths {
        let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?;
        digest.update((bytes.len() as u64).to_be_bytes());
        digest.update(&bytes);
        contents.push(bytes);
    }
    Ok((contents, digest.finalize().into()))
}

/// The PEM certificates of the file at `path`, its contents `text` (at least one).
fn certificates(path: &Path, text: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    pem::certificates(text).map_err(|source| TlsError::Pem {
        path: path.to_owned(),
        source,
    })
}

/// The `notAfter` of a DER certificate, unix seconds.
fn not_after(cert: &CertificateDer<'_>) -> Option<i64> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(parsed.validity().not_after.timestamp())
}

/// The system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR`, else the distribution's bundle), read
/// once per process.
fn system_roots() -> Result<Arc<RootCertStore>, TlsError> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    let roots = ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::warn!(%error, "a system root certificate could not be read");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        tracing::debug!(added, ignored, "system root certificates loaded");
        Arc::new(roots)
    });
    if roots.is_empty() {
        return Err(TlsError::NoRoots);
    }
    Ok(roots.clone())
}
