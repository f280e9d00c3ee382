//! The run's own certificate authority and the upstream's certificate it signs (rcgen), written
//! into the run directory for the TLS upstream and for every proxy to verify it against: no
//! proxy is told to skip verification, so each pays for a real one.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The name the upstream's certificate is valid for, sent as SNI by every proxy. Under
/// `.invalid` (RFC 2606): it is never resolved; every proxy dials 127.0.0.1.
pub const SERVER_NAME: &str = "upstream.bench.invalid";

/// The files of one run's PKI.
#[derive(Clone, Debug)]
pub struct Pki {
    /// The CA certificate (PEM) the proxies verify the upstream against.
    pub ca_file: PathBuf,
    /// The upstream's certificate chain (PEM).
    pub cert_file: PathBuf,
    /// The upstream's private key (PEM).
    pub key_file: PathBuf,
}

impl Pki {
    /// A new CA and a certificate for [`SERVER_NAME`] it signs, written into `dir`.
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "poolpilot-bench CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
        let key = rcgen::KeyPair::generate()?;
        let cert =
            rcgen::CertificateParams::new(vec![SERVER_NAME.to_owned()])?.signed_by(&key, &ca)?;
        let pki = Self {
            ca_file: dir.join("bench-ca.pem"),
            cert_file: dir.join("upstream.pem"),
            key_file: dir.join("upstream-key.pem"),
        };
        for (path, pem) in [
            (&pki.ca_file, ca.pem()),
            (&pki.cert_file, cert.pem()),
            (&pki.key_file, key.serialize_pem()),
        ] {
            std::fs::write(path, pem).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(pki)
    }
}
