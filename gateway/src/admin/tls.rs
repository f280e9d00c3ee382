//! HTTPS on the admin listener, so that the bearer token never crosses the pod network in clear
//! text. The certificate chain and its key come from files, in the layout of a
//! `kubernetes.io/tls` Secret as cert-manager writes it (`tls.crt`: the certificate then its
//! chain, `tls.key`: the key, PEM); they are re-read when they change (cert-manager renews
//! before expiry), a pair that does not load or whose key does not match is refused and the one
//! in force stays. rustls with the *ring* provider, the one crypto stack of the workspace;
//! HTTP/1.1 only, announced by ALPN.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use poolpilot_tls::provider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use crate::config::AdminTlsFiles;
use crate::observe::{AdminFile, Metrics};
use crate::pem::{self, PemError};
use crate::reload::{FileWatch, OnChange};

/// Why the admin certificate could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The certificate file holds no PEM certificate chain.
    #[error("{path} is not a PEM certificate chain")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: PemError,
    },
    /// The key file holds no usable private key.
    #[error("{path} holds no usable private key")]
    Key {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: PemError,
    },
    /// The key is of a kind the provider cannot sign with, or does not belong to the
    /// certificate.
    #[error("the key in {key} does not fit the certificate in {cert}")]
    Mismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
    /// The TLS configuration could not be built (never expected with the ring provider).
    #[error("building the TLS configuration failed")]
    Config(#[source] rustls::Error),
}

/// The admin listener's TLS: an acceptor whose certificate can be swapped while it serves.
#[derive(Clone)]
pub struct AdminTls {
    files: AdminTlsFiles,
    resolver: Arc<CurrentCertificate>,
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for AdminTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// The certificate handed to every handshake, replaced on reload.
#[derive(Debug)]
struct CurrentCertificate(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for CurrentCertificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().clone())
    }
}

impl AdminTls {
    /// Loads the certificate and key; also returns a watch of the two files that has seen them
    /// (for [`on_certificate_change`]).
    pub fn load(files: &AdminTlsFiles) -> Result<(Self, FileWatch), TlsError> {
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                path: path.clone(),
                source,
            })
        };
        let contents = vec![read(&files.cert_file)?, read(&files.key_file)?];
        let key = certified_key(files, &contents[0], &contents[1])?;
        let resolver = Arc::new(CurrentCertificate(RwLock::new(Arc::new(key))));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = Self {
            files: files.clone(),
            resolver,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        };
        let watch = FileWatch::having_seen(
            vec![files.cert_file.clone(), files.key_file.clone()],
            &contents,
        );
        Ok((tls, watch))
    }

    /// The acceptor for new connections.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Serves `cert_pem` / `key_pem` (the files' new contents) from the next handshake on, if
    /// they load and belong together.
    pub fn replace(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<(), TlsError> {
        let key = certified_key(&self.files, cert_pem, key_pem)?;
        *self.resolver.0.write() = Arc::new(key);
        Ok(())
    }
}

/// The chain and key of PEM texts, checked to belong together.
fn certified_key(
    files: &AdminTlsFiles,
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<CertifiedKey, TlsError> {
    let chain = pem::certificates(cert_pem).map_err(|source| TlsError::Certificate {
        path: files.cert_file.clone(),
        source,
    })?;
    let key = pem::private_key(key_pem).map_err(|source| TlsError::Key {
        path: files.key_file.clone(),
        source,
    })?;
    let mismatch = |source| TlsError::Mismatch {
        cert: files.cert_file.clone(),
        key: files.key_file.clone(),
        source,
    };
    let key = CertifiedKey::from_der(chain, key, &provider()).map_err(mismatch)?;
    Ok(key)
}

/// What a change of the certificate or key file does (for [`FileWatch::poll`] of the watch
/// [`AdminTls::load`] returned): a pair that loads is served from the next handshake on, one that
/// does not is refused (logged and counted) and the pair in force stays.
pub fn on_certificate_change(tls: AdminTls, metrics: Metrics) -> OnChange {
    Box::new(
        move |contents| match tls.replace(&contents[0], &contents[1]) {
            Ok(()) => {
                metrics.admin_file_reloaded(AdminFile::Certificate, true);
                tracing::info!(cert = %tls.files.cert_file.display(), "admin certificate changed");
            }
            Err(error) => {
                metrics.admin_file_reloaded(AdminFile::Certificate, false);
                tracing::warn!(%error, source = ?std::error::Error::source(&error), "admin certificate refused; the one in force stays");
            }
        },
    )
}
