//! How a policy says the gateways reach a provider beyond its address: TLS to an external
//! endpoint ([`ExternalTls`]: the name to verify, a CA bundle and a client certificate from
//! Secrets), the HTTP version of its calls ([`ProtocolSpec`]) and the provider's key injected in
//! place of the client's ([`CredentialsSpec`]).
//! Secrets are named, never copied: the gateway pods mount them under [`SECRETS_DIR`] (the
//! chart's `gateway.upstreamSecrets`), and the operator renders the files' paths into the limits
//! document ([`secret_file`]), so no key ever passes through the operator, a ConfigMap or status.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where the gateway pods mount the Secrets a policy names: `<SECRETS_DIR>/<secret>/<key>`.
pub const SECRETS_DIR: &str = "/etc/poolpilot/secrets";

/// The path in a gateway pod of key `key` of Secret `secret`.
pub fn secret_file(secret: &str, key: &str) -> PathBuf {
    PathBuf::from(SECRETS_DIR).join(secret).join(key)
}

/// CEL: a server name is a lowercase DNS name.
const DNS_NAME: &str =
    r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$";

/// TLS to an external endpoint: always verified (there is no way to turn verification off),
/// ALPN as the backend's `protocol` says (`http/1.1` by default), sessions resumed on reconnect.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalTls {
    /// A Secret of the policy's namespace whose `ca.crt` holds the certificate authorities to
    /// trust (PEM); omitted: the system's roots (hosted providers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        pattern(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub ca_bundle_secret: Option<String>,
    /// A `kubernetes.io/tls` Secret of the policy's namespace (`tls.crt`, `tls.key`): the
    /// gateway's client certificate, for model servers that require mTLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        pattern(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub client_cert_secret: Option<String>,
    /// The name the server's certificate must be valid for, also sent as SNI; omitted: the
    /// endpoint's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), pattern(DNS_NAME))]
    pub server_name: Option<String>,
}

/// The HTTP version of a backend's calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ProtocolSpec {
    /// HTTP/1.1 on every endpoint: one call per connection at a time; TLS offers only
    /// `http/1.1` by ALPN.
    #[default]
    Http1,
    /// What the server picks by ALPN: TLS endpoints offer `h2` and `http/1.1`. Needs `tls` on
    /// every endpoint (a plain endpoint has no ALPN to ask with). A server that refuses `h2`
    /// is called over HTTP/1.1 and asked again only after a cooldown.
    Auto,
    /// HTTP/2 on every endpoint: many calls share one connection, `capacity` and the pool's
    /// share count concurrent streams. TLS offers only `h2` by ALPN (a server that does not
    /// pick it fails the connection); plain endpoints speak h2c with prior knowledge.
    Http2,
}

impl ProtocolSpec {
    /// Whether it is the default, `Http1` (left out of a serialized policy).
    pub fn is_default(&self) -> bool {
        *self == Self::Http1
    }
}

/// A key of a Secret in the policy's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// The Secret.
    #[schemars(
        length(min = 1, max = 253),
        pattern(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
    /// The key holding the value.
    #[schemars(length(min = 1, max = 253), pattern(r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

/// How a provider takes its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CredentialSchemeSpec {
    /// `Authorization: Bearer <key>` (OpenAI and most providers).
    Bearer,
    /// `api-key: <key>` (Azure OpenAI).
    AzureApiKey,
    /// `<header>: <key>`, the header named by `header`.
    Header,
}

/// The provider's key, set by the gateways on every call to the backend in place of the
/// client's `Authorization` (and of `removeHeaders`), re-read when the Secret rotates, never
/// logged or shown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.scheme == 'Header' ? has(self.header) : !has(self.header)",
        "message": "credentials.header is set exactly for the Header scheme",
        "fieldPath": ".header"
    }
]))]
pub struct CredentialsSpec {
    /// The Secret key holding the provider's key (mounted into the gateway pods).
    pub secret_ref: SecretKeyRef,
    /// How the key is sent: `Bearer` (`Authorization: Bearer`), `AzureApiKey` (`api-key`), or
    /// `Header` (the header named by `header`).
    pub scheme: CredentialSchemeSpec,
    /// The header the key goes in, for the `Header` scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), pattern(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"))]
    pub header: Option<String>,
    /// Client headers removed besides `Authorization` and the key's own header (the client's
    /// `x-api-key`, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(length(min = 1, max = 128), pattern(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"))
    )]
    pub remove_headers: Vec<String>,
}
