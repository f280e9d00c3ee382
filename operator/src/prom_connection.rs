//! How the operator reaches Prometheus the way people run it: behind a bearer token (a file, re-read
//! every round so that rotated tokens are picked up, as Prometheus' own `bearer_token_file`), or
//! basic auth, with extra headers (`X-Scope-OrgID` for Mimir, Cortex and Thanos tenants), over
//! HTTPS checked against a CA file or, when asked, not checked at all. One reqwest client on rustls
//! with ring, the process's one TLS stack.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

/// Why the connection to Prometheus could not be set up or a round's credentials not read.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// A file named by a flag could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The CA file holds no usable certificate.
    #[error("{path} holds no PEM certificate")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A `--prometheus-header` is not `Name: value`, or not a valid header.
    #[error("--prometheus-header {0:?}: want `Name: value` with a valid header name and value")]
    Header(String),
    /// A credential read from a file cannot be sent as a header value.
    #[error("the credential in {path} is not a valid header value (control characters?)")]
    Credential {
        /// The file.
        path: PathBuf,
    },
    /// The TLS configuration was refused.
    #[error("TLS configuration")]
    Tls(#[source] rustls::Error),
    /// The HTTP client could not be built.
    #[error("HTTP client")]
    Client(#[source] reqwest::Error),
    /// The URL is not usable.
    #[error("invalid Prometheus URL {url:?}")]
    Url {
        /// The URL given.
        url: String,
        /// Why.
        #[source]
        source: prometheus_http_query::Error,
    },
}

/// How requests authenticate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Auth {
    /// No credentials.
    None,
    /// `Authorization: Bearer <the file's content, trimmed>`.
    BearerTokenFile(PathBuf),
    /// `Authorization: Basic …` with this user and the file's content as the password.
    Basic {
        /// The user name.
        username: String,
        /// The file holding the password.
        password_file: PathBuf,
    },
}

/// How server certificates are checked over HTTPS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// The platform's trust store.
    System,
    /// Only the CAs of this PEM file (Prometheus' `ca_file`).
    CaFile(PathBuf),
    /// Not at all (`insecure_skip_verify`): for a test or a self-signed endpoint behind a
    /// trusted network only.
    InsecureSkipVerify,
}

/// Everything needed to talk to Prometheus, from the flags.
#[derive(Clone, Debug)]
pub struct ConnectionSpec {
    /// The base URL.
    pub url: String,
    /// Credentials.
    pub auth: Auth,
    /// Certificate checks.
    pub trust: Trust,
    /// Extra headers sent with every query, as `Name: value`.
    pub headers: Vec<String>,
}

/// A ready connection: the client, and the headers of each round.
#[derive(Clone)]
pub struct Connection {
    /// The client the queries go through.
    pub client: prometheus_http_query::Client,
    auth: Auth,
    headers: HeaderMap,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values may be credentials: only their names are shown.
        f.debug_struct("Connection")
            .field("auth", &self.auth)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Builds the client and checks everything that can be checked before the first round (the
    /// CA file, the headers, that the credential files are readable), so that a mistake stops
    /// the operator at start with a clear message instead of failing every round.
    pub fn new(spec: &ConnectionSpec, timeout: Duration) -> Result<Self, ConnectionError> {
        let headers = parse_headers(&spec.headers)?;
        let mut builder = crate::http_client().timeout(timeout);
        match &spec.trust {
            Trust::System => {}
            Trust::CaFile(path) => builder = builder.use_preconfigured_tls(ca_config(path)?),
            Trust::InsecureSkipVerify => {
                builder = builder.use_preconfigured_tls(
                    poolpilot_tls::any_server_config().map_err(ConnectionError::Tls)?,
                )
            }
        }
        let http = builder.build().map_err(ConnectionError::Client)?;
        let client = prometheus_http_query::Client::from(http, &spec.url).map_err(|source| {
            ConnectionError::Url {
                url: spec.url.clone(),
                source,
            }
        })?;
        let connection = Self {
            client,
            auth: spec.auth.clone(),
            headers,
        };
        connection.round_headers()?;
        Ok(connection)
    }

    /// The headers of one round: the extra headers, and the credentials read now from their
    /// files (a rotated token or password is used from the next round on).
    pub fn round_headers(&self) -> Result<HeaderMap, ConnectionError> {
        let mut headers = self.headers.clone();
        let credential = match &self.auth {
            Auth::None => None,
            Auth::BearerTokenFile(path) => Some((format!("Bearer {}", read_trimmed(path)?), path)),
            Auth::Basic {
                username,
                password_file,
            } => {
                use base64::Engine as _;
                let pair = format!("{username}:{}", read_trimmed(password_file)?);
                let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
                Some((format!("Basic {encoded}"), password_file))
            }
        };
        if let Some((value, path)) = credential {
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| ConnectionError::Credential { path: path.clone() })?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        Ok(headers)
    }
}

fn read_trimmed(path: &Path) -> Result<String, ConnectionError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| ConnectionError::Read {
            path: path.into(),
            source,
        })
}

/// `Name: value` pairs as a header map.
fn parse_headers(pairs: &[String]) -> Result<HeaderMap, ConnectionError> {
    let mut map = HeaderMap::new();
    for pair in pairs {
        let bad = || ConnectionError::Header(pair.clone());
        let (name, value) = pair.split_once(':').ok_or_else(bad)?;
        let name = HeaderName::try_from(name.trim()).map_err(|_| bad())?;
        let value = HeaderValue::from_str(value.trim()).map_err(|_| bad())?;
        if name == AUTHORIZATION {
            // Credentials come from files, never from a flag visible in `ps` and the pod spec.
            return Err(bad());
        }
        map.append(name, value);
    }
    Ok(map)
}

/// A TLS client configuration trusting only the CAs of `path`.
fn ca_config(path: &Path) -> Result<rustls::ClientConfig, ConnectionError> {
    let pem = std::fs::read(path).map_err(|source| ConnectionError::Read {
        path: path.into(),
        source,
    })?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem).flatten() {
        roots.add(cert).map_err(ConnectionError::Tls)?;
    }
    if roots.is_empty() {
        return Err(ConnectionError::NoCertificate { path: path.into() });
    }
    Ok(
        rustls::ClientConfig::builder_with_provider(poolpilot_tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(ConnectionError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(auth: Auth, headers: &[&str]) -> ConnectionSpec {
        ConnectionSpec {
            url: "http://127.0.0.1:9090".into(),
            auth,
            trust: Trust::System,
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
        }
    }

    fn connect(spec: &ConnectionSpec) -> Result<Connection, ConnectionError> {
        Connection::new(spec, Duration::from_secs(5))
    }

    #[test]
    fn extra_headers_are_sent_every_round_and_authorization_is_refused_as_a_flag() {
        let c = connect(&spec(
            Auth::None,
            &["X-Scope-OrgID: team-a", "x-extra:  1 "],
        ))
        .unwrap();
        let h = c.round_headers().unwrap();
        assert_eq!(h["x-scope-orgid"], "team-a");
        assert_eq!(h["x-extra"], "1");
        assert!(!h.contains_key(AUTHORIZATION));
        for bad in ["no colon", "bad name: x", "Authorization: Bearer secret"] {
            let err = connect(&spec(Auth::None, &[bad])).unwrap_err();
            assert!(matches!(err, ConnectionError::Header(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn a_bearer_token_is_read_from_its_file_every_round() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "first\n").unwrap();
        let c = connect(&spec(Auth::BearerTokenFile(file.clone()), &[])).unwrap();
        assert_eq!(c.round_headers().unwrap()[AUTHORIZATION], "Bearer first");
        assert!(c.round_headers().unwrap()[AUTHORIZATION].is_sensitive());
        std::fs::write(&file, "rotated").unwrap();
        assert_eq!(c.round_headers().unwrap()[AUTHORIZATION], "Bearer rotated");
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(
            c.round_headers(),
            Err(ConnectionError::Read { .. })
        ));
    }

    #[test]
    fn basic_auth_encodes_user_and_password_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("password");
        std::fs::write(&file, "s3cret\n").unwrap();
        let c = connect(&spec(
            Auth::Basic {
                username: "operator".into(),
                password_file: file,
            },
            &[],
        ))
        .unwrap();
        // base64("operator:s3cret")
        assert_eq!(
            c.round_headers().unwrap()[AUTHORIZATION],
            "Basic b3BlcmF0b3I6czNjcmV0"
        );
    }

    #[test]
    fn a_missing_credential_or_ca_file_stops_the_start_with_its_name() {
        let missing = PathBuf::from("/nonexistent/poolpilot/token");
        let err = connect(&spec(Auth::BearerTokenFile(missing.clone()), &[])).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/poolpilot/token"),
            "{err}"
        );
        let mut s = spec(Auth::None, &[]);
        s.trust = Trust::CaFile(missing);
        assert!(matches!(connect(&s), Err(ConnectionError::Read { .. })));
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("ca.crt");
        std::fs::write(&empty, "not a certificate").unwrap();
        s.trust = Trust::CaFile(empty);
        assert!(matches!(
            connect(&s),
            Err(ConnectionError::NoCertificate { .. })
        ));
    }
}
