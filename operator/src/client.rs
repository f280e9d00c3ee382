//! The operator's HTTP clients (to the gateways' admin APIs, to Prometheus): one builder, one
//! TLS stack.

/// The builder of every HTTP client the operator makes (to gateways, to Prometheus): reqwest on
/// rustls with ring, the workspace's one TLS stack. reqwest is built without a crypto provider
/// of its own, so ring becomes the process default here (idempotent) before any client is built.
pub fn http_client() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}
