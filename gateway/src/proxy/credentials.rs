//! Provider credentials injected, never forwarded: a backend with `credentials` gets every call
//! without the client's `Authorization`, the key's own header and the configured
//! `removeHeaders`, and with the provider's key from its file (`Authorization: Bearer`, Azure's
//! `api-key`, or a named header). The key is read from the file when the document is applied
//! and again whenever its content changes ([`ProviderKey::reload`]: a rotated Secret), and is
//! held only as a sensitive header value: it is never logged, never in `Debug`, never in
//! `/v1/limits` (the document names the file, not the key) nor in `/v1/stats`.

use std::path::PathBuf;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use parking_lot::RwLock;
use poolpilot_api::limits::{CredentialScheme, Credentials};
use sha2::{Digest, Sha256};

/// Why a provider key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The key file could not be read.
    #[error("reading the key file {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The file is empty, or holds what no header may carry (a line break, a control
    /// character).
    #[error("the key file {path} holds no key a header can carry")]
    Unusable {
        /// The file.
        path: PathBuf,
    },
    /// The header named for the key is not a header name.
    #[error("{0:?} is not a valid header name")]
    Header(String),
}

/// What a call to the backend carries instead of the client's credentials.
struct Key {
    value: HeaderValue,
    digest: [u8; 32],
}

/// One backend's provider key and how it is set.
pub struct ProviderKey {
    settings: Credentials,
    header: HeaderName,
    removed: Vec<HeaderName>,
    key: RwLock<Key>,
}

impl std::fmt::Debug for ProviderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderKey")
            .field("key_file", &self.settings.key_file)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl ProviderKey {
    /// Reads the key of `settings`.
    pub fn load(settings: &Credentials) -> Result<Self, CredentialsError> {
        let header = HeaderName::from_bytes(settings.header_name().as_bytes())
            .map_err(|_| CredentialsError::Header(settings.header_name().to_owned()))?;
        let removed = settings
            .remove_headers
            .iter()
            .map(|h| {
                HeaderName::from_bytes(h.as_bytes())
                    .map_err(|_| CredentialsError::Header(h.clone()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            key: RwLock::new(read(settings)?),
            settings: settings.clone(),
            header,
            removed,
        })
    }

    /// Whether it was loaded from exactly `settings`.
    pub fn is_for(&self, settings: &Credentials) -> bool {
        self.settings == *settings
    }

    /// Reads the key file again; a changed key is used from the next call on. Returns whether
    /// it changed. A file that no longer loads keeps the key in force (the error says why).
    pub fn reload(&self) -> Result<bool, CredentialsError> {
        let fresh = read(&self.settings)?;
        if fresh.digest == self.key.read().digest {
            return Ok(false);
        }
        *self.key.write() = fresh;
        Ok(true)
    }

    /// Takes the client's credentials out of `headers` and puts the provider's in.
    pub fn apply(&self, headers: &mut HeaderMap) {
        headers.remove(header::AUTHORIZATION);
        headers.remove(&self.header);
        for name in &self.removed {
            headers.remove(name);
        }
        headers.insert(self.header.clone(), self.key.read().value.clone());
    }
}

/// The key of `settings`' file, as its header's value (marked sensitive: HPACK never indexes
/// it, `Debug` never shows it).
fn read(settings: &Credentials) -> Result<Key, CredentialsError> {
    let path = &settings.key_file;
    let bytes = std::fs::read(path).map_err(|source| CredentialsError::Read {
        path: path.clone(),
        source,
    })?;
    let digest: [u8; 32] = Sha256::digest(&bytes).into();
    let unusable = || CredentialsError::Unusable { path: path.clone() };
    let key = std::str::from_utf8(&bytes).map_err(|_| unusable())?.trim();
    if key.is_empty() {
        return Err(unusable());
    }
    let text = match settings.scheme {
        CredentialScheme::Bearer => format!("Bearer {key}"),
        CredentialScheme::AzureApiKey | CredentialScheme::Header => key.to_owned(),
    };
    let mut value = HeaderValue::from_str(&text).map_err(|_| unusable())?;
    value.set_sensitive(true);
    Ok(Key { value, digest })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credentials(
        dir: &tempfile::TempDir,
        scheme: CredentialScheme,
        header: Option<&str>,
    ) -> Credentials {
        Credentials {
            key_file: dir.path().join("key"),
            scheme,
            header: header.map(str::to_owned),
            remove_headers: vec!["x-api-key".into()],
        }
    }

    fn client_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_static("Bearer client-key"),
        );
        h.insert("api-key", HeaderValue::from_static("client-azure-key"));
        h.insert("x-api-key", HeaderValue::from_static("client-x-key"));
        h.insert("x-trace", HeaderValue::from_static("kept"));
        h
    }

    #[test]
    fn the_client_credentials_go_and_the_provider_key_comes_in_each_scheme() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key"), "sk-provider\n").unwrap();

        let bearer = ProviderKey::load(&credentials(&dir, CredentialScheme::Bearer, None)).unwrap();
        let mut h = client_headers();
        bearer.apply(&mut h);
        assert_eq!(h["authorization"], "Bearer sk-provider");
        assert!(!h.contains_key("x-api-key"), "a configured header goes");
        assert_eq!(h["api-key"], "client-azure-key", "not named: kept");
        assert_eq!(h["x-trace"], "kept");
        assert!(h["authorization"].is_sensitive());

        let azure =
            ProviderKey::load(&credentials(&dir, CredentialScheme::AzureApiKey, None)).unwrap();
        let mut h = client_headers();
        azure.apply(&mut h);
        assert_eq!(h["api-key"], "sk-provider");
        assert!(
            !h.contains_key("authorization"),
            "the client's Authorization always goes"
        );

        let named = ProviderKey::load(&credentials(
            &dir,
            CredentialScheme::Header,
            Some("x-goog-api-key"),
        ))
        .unwrap();
        let mut h = client_headers();
        h.insert("x-goog-api-key", HeaderValue::from_static("client"));
        named.apply(&mut h);
        assert_eq!(h.get_all("x-goog-api-key").iter().count(), 1);
        assert_eq!(h["x-goog-api-key"], "sk-provider");
        assert!(!h.contains_key("authorization"));

        assert!(
            !format!("{bearer:?}").contains("sk-provider"),
            "Debug shows no key"
        );
    }

    #[test]
    fn a_rotated_key_is_used_and_a_broken_file_keeps_the_one_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "first").unwrap();
        let key = ProviderKey::load(&credentials(&dir, CredentialScheme::Bearer, None)).unwrap();
        assert!(!key.reload().unwrap(), "unchanged");
        std::fs::write(&path, "second").unwrap();
        assert!(key.reload().unwrap());
        let mut h = HeaderMap::new();
        key.apply(&mut h);
        assert_eq!(h["authorization"], "Bearer second");

        std::fs::write(&path, "  \n").unwrap();
        assert!(matches!(
            key.reload(),
            Err(CredentialsError::Unusable { .. })
        ));
        std::fs::write(&path, "line\nbreak").unwrap();
        assert!(key.reload().is_err());
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(key.reload(), Err(CredentialsError::Read { .. })));
        let mut h = HeaderMap::new();
        key.apply(&mut h);
        assert_eq!(
            h["authorization"], "Bearer second",
            "the key in force stays"
        );
    }
}
