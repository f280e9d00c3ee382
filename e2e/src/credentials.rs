//! The admin API's credentials as an install creates them, for the e2e stack and the demo: a
//! random bearer token (Secret `poolpilot-admin-token`), a CA made for the install and the
//! gateways' certificate for `poolpilot-gateway-admin.<namespace>.svc` (Secret
//! `poolpilot-gateway-admin-tls`, cert-manager's layout: `tls.crt`, `tls.key`, `ca.crt`), and the
//! CA bundle the operator verifies them with (Secret `poolpilot-gateway-admin-ca`, `ca.crt`);
//! and HTTPS clients of a gateway pod's admin port that trust that CA only.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use rand::RngCore as _;
use serde_json::{Value, json};

/// The Secret holding the admin token (the operator's `--token-secret`), key `token`.
pub const TOKEN_SECRET: &str = "poolpilot-admin-token";
/// The gateways' admin certificate (`manifests/gateway/deployment.yaml`).
pub const TLS_SECRET: &str = "poolpilot-gateway-admin-tls";
/// The CA bundle of the operator (`manifests/operator/deployment.yaml`), key `ca.crt`.
pub const CA_SECRET: &str = "poolpilot-gateway-admin-ca";

/// The name the gateways' admin certificate carries in `namespace` (the operator's default
/// `--gateway-server-name`).
pub fn server_name(namespace: &str) -> String {
    format!("poolpilot-gateway-admin.{namespace}.svc")
}

/// A CA and one server certificate it signs, all PEM.
#[derive(Clone)]
pub struct Pki {
    /// The CA certificate.
    pub ca_pem: String,
    /// The server certificate.
    pub cert_pem: String,
    /// Its key.
    pub key_pem: String,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

impl Pki {
    /// A new CA called `ca_name` and a certificate for the DNS name `server`.
    pub fn generate(ca_name: &str, server: &str) -> anyhow::Result<Self> {
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, ca_name);
        let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate()?)?;
        let key = rcgen::KeyPair::generate()?;
        let mut leaf = rcgen::CertificateParams::new(vec![server.to_owned()])?;
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, server);
        let cert = leaf.signed_by(&key, &ca)?;
        Ok(Self {
            ca_pem: ca.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// One install's admin credentials.
#[derive(Clone)]
pub struct AdminCredentials {
    /// The gateways' namespace.
    pub namespace: String,
    /// The bearer token.
    pub token: String,
    /// The CA certificate (PEM).
    pub ca_pem: String,
    /// The gateways' certificate (PEM).
    pub cert_pem: String,
    /// Its key (PEM).
    pub key_pem: String,
}

impl std::fmt::Debug for AdminCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminCredentials")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl AdminCredentials {
    /// New credentials for gateways in `namespace`: 32 random bytes of token (hex), a CA and a
    /// certificate it signs for [`server_name`].
    pub fn generate(namespace: &str) -> anyhow::Result<Self> {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let token = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let pki = Pki::generate("poolpilot gateway admin CA", &server_name(namespace))?;
        Ok(Self {
            namespace: namespace.to_owned(),
            token,
            ca_pem: pki.ca_pem,
            cert_pem: pki.cert_pem,
            key_pem: pki.key_pem,
        })
    }

    /// The three Secrets: the token and the certificate in the gateways' namespace, the CA
    /// bundle in `operator_namespace`.
    pub fn secrets(&self, operator_namespace: &str) -> Vec<Value> {
        vec![
            json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": TOKEN_SECRET, "namespace": self.namespace},
                "stringData": {"token": self.token},
            }),
            json!({
                "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": TLS_SECRET, "namespace": self.namespace},
                "stringData": {"tls.crt": self.cert_pem, "tls.key": self.key_pem, "ca.crt": self.ca_pem},
            }),
            json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": CA_SECRET, "namespace": operator_namespace},
                "stringData": {"ca.crt": self.ca_pem},
            }),
        ]
    }

    /// The credentials already in the cluster (a demo run before this one made them), or new
    /// ones, created there.
    pub async fn ensure(
        client: &kube::Client,
        namespace: &str,
        operator_namespace: &str,
    ) -> anyhow::Result<Self> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        if let (Some(token), Some(tls)) = (
            secrets.get_opt(TOKEN_SECRET).await?,
            secrets.get_opt(TLS_SECRET).await?,
        ) {
            let text = |s: &Secret, key: &str| -> anyhow::Result<String> {
                let bytes = s.data.as_ref().and_then(|d| d.get(key)).with_context(|| {
                    format!(
                        "no {key} in Secret {}",
                        s.metadata.name.clone().unwrap_or_default()
                    )
                })?;
                Ok(String::from_utf8(bytes.0.clone())?.trim().to_owned())
            };
            return Ok(Self {
                namespace: namespace.to_owned(),
                token: text(&token, "token")?,
                ca_pem: text(&tls, "ca.crt")?,
                cert_pem: text(&tls, "tls.crt")?,
                key_pem: text(&tls, "tls.key")?,
            });
        }
        let made = Self::generate(namespace)?;
        for secret in made.secrets(operator_namespace) {
            let ns = secret["metadata"]["namespace"]
                .as_str()
                .unwrap_or(namespace);
            let api: Api<Secret> = Api::namespaced(client.clone(), ns);
            let secret: Secret = serde_json::from_value(secret)?;
            match api.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                // Another half of an earlier run: keep what is there.
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(made)
    }

    /// An HTTPS client of the admin port at `addr` (a gateway pod), trusting this CA only and
    /// checking the certificate names [`server_name`]; use [`AdminCredentials::url`].
    pub fn client(&self, addr: SocketAddr) -> anyhow::Result<reqwest::Client> {
        Ok(reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .tls_certs_only([reqwest::Certificate::from_pem(self.ca_pem.as_bytes())?])
            .resolve(&server_name(&self.namespace), addr)
            .build()?)
    }

    /// The URL of `path` on the admin port `port`, for a [`AdminCredentials::client`].
    pub fn url(&self, port: u16, path: &str) -> String {
        format!("https://{}:{port}{path}", server_name(&self.namespace))
    }

    /// `Authorization: Bearer <token>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.token)
    }
}
