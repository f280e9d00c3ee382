//! The one PEM parser of the gateway: certificate chains and private keys of PEM texts, read with
//! `rustls-pki-types` (the parser rustls itself ships), for the admin listener's certificate and
//! the upstream TLS clients' CA bundles and client certificates. Callers name the file in their
//! own errors; this module only says what is wrong with the text.

use rustls::pki_types::pem::{self, PemObject as _};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why a PEM text holds nothing usable.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// The text is not well-formed PEM (a broken block, bad base64).
    #[error("not well-formed PEM")]
    Malformed(#[source] pem::Error),
    /// The text is PEM but holds no certificate.
    #[error("no PEM certificate")]
    NoCertificate,
    /// The text holds no private key of a kind rustls reads (PKCS#8, PKCS#1, SEC1).
    #[error("no PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoKey(#[source] pem::Error),
}

/// Every certificate of `text`, in order (a chain: the leaf first), at least one. Blocks of
/// other kinds (a key beside the chain) are skipped.
pub fn certificates(text: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(PemError::Malformed)?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certs)
}

/// The first private key of `text` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(text: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(text).map_err(PemError::NoKey)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["example.test".into()]).unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_chain_is_read_in_order_and_other_blocks_are_skipped() {
        let (a, key) = pair();
        let (b, _) = pair();
        let text = format!("{a}{key}{b}");
        let certs = certificates(text.as_bytes()).unwrap();
        assert_eq!(certs.len(), 2);
        assert_eq!(
            certs[0].as_ref(),
            certificates(a.as_bytes()).unwrap()[0].as_ref()
        );
        assert_eq!(
            certs[1].as_ref(),
            certificates(b.as_bytes()).unwrap()[0].as_ref()
        );
    }

    #[test]
    fn a_text_without_a_certificate_or_key_is_refused_with_the_reason() {
        let (cert, key) = pair();
        assert!(matches!(
            certificates(key.as_bytes()),
            Err(PemError::NoCertificate)
        ));
        assert!(matches!(certificates(b""), Err(PemError::NoCertificate)));
        let broken = cert.replace("MII", "M!I");
        assert!(matches!(
            certificates(broken.as_bytes()),
            Err(PemError::Malformed(_))
        ));
        assert!(matches!(
            private_key(cert.as_bytes()),
            Err(PemError::NoKey(_))
        ));
        assert!(private_key(format!("{cert}{key}").as_bytes()).is_ok());
    }
}
