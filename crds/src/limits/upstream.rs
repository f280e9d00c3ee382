//! How the gateway talks to a backend beyond its address: TLS to an endpoint ([`EndpointTls`]:
//! the name its certificate must carry, the CAs that vouch for it, the client certificate of
//! mTLS) and the provider credentials set on every call instead of the client's
//! ([`Credentials`]), and the HTTP version of its calls ([`UpstreamProtocol`]). Secrets appear here only as the paths of files mounted into the gateway,
//! never as their content, so that `/v1/limits`, the ConfigMap and the operator's status never
//! hold a key.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// TLS to an endpoint: always verified (there is no way to turn verification off), ALPN as the
/// backend's [`UpstreamProtocol`] says, sessions resumed on reconnect.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointTls {
    /// The name the server's certificate must be valid for, sent as SNI; omitted: the
    /// endpoint's host (an `ip:port` endpoint: its IP address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// PEM file of the certificate authorities trusted for this endpoint (the `ca.crt` of a
    /// Secret mounted into the gateway); omitted: the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// The gateway's client certificate (mTLS); omitted: none is offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_certificate: Option<ClientCertificate>,
}

/// A client certificate and its key, in the layout of a `kubernetes.io/tls` Secret mounted
/// into the gateway.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientCertificate {
    /// PEM certificate, then its chain (`tls.crt`).
    pub cert_file: PathBuf,
    /// PEM private key (`tls.key`).
    pub key_file: PathBuf,
}

/// The provider's key, set on every call to a backend in place of whatever the client sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Credentials {
    /// The file holding the key (a Secret's key mounted into the gateway); surrounding
    /// whitespace is dropped. Re-read when it changes, so that a rotated Secret takes effect
    /// without a restart.
    pub key_file: PathBuf,
    /// How the key is sent.
    pub scheme: CredentialScheme,
    /// The header the key goes in, for the `Header` scheme (and only for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Client headers removed besides `Authorization` and the key's own header (e.g. the
    /// client's `x-api-key` or `api-key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_headers: Vec<String>,
}

/// How a provider takes its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CredentialScheme {
    /// `Authorization: Bearer <key>` (OpenAI and most providers).
    Bearer,
    /// `api-key: <key>` (Azure OpenAI).
    AzureApiKey,
    /// `<header>: <key>`, the header named by `header`.
    Header,
}

impl Credentials {
    /// The header the key goes in (lowercase).
    pub fn header_name(&self) -> &str {
        match self.scheme {
            CredentialScheme::Bearer => "authorization",
            CredentialScheme::AzureApiKey => "api-key",
            CredentialScheme::Header => self.header.as_deref().unwrap_or_default(),
        }
    }
}

/// The HTTP version a backend's calls go out in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 on every endpoint; TLS offers only `http/1.1` by ALPN.
    #[default]
    Http1,
    /// TLS endpoints offer `h2` and `http/1.1` by ALPN and speak what the server picks; plain
    /// endpoints speak HTTP/1.1.
    Auto,
    /// HTTP/2 on every endpoint: TLS offers only `h2` by ALPN (a server that does not pick it
    /// fails the connection), plain endpoints speak h2c with prior knowledge.
    Http2,
}

impl UpstreamProtocol {
    /// Whether it is the default, `http1` (left out of a serialized document).
    pub fn is_default(&self) -> bool {
        *self == Self::Http1
    }
}
