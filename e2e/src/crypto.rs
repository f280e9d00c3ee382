//! The process's TLS crypto provider.

/// Makes ring the process's TLS crypto provider. Needed by every binary and test before it
/// builds a kube or reqwest client: reqwest is built without a provider of its own (the
/// workspace links one TLS stack, rustls with ring) and takes the process default. Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
