//! The admin API's bearer token: read from `adminTokenFile`, where a missing, empty, short
//! (under [`MIN_TOKEN_BYTES`]), malformed or published token stops the gateway at start; re-read
//! when the file changes, the previous token staying accepted for `adminTokenOverlap`. A rotated
//! Secret reaches the operator (which reads it from the API) and the pods (a mounted copy the
//! kubelet refreshes within a minute or so) at different times: during the overlap both tokens
//! open the API, so no client is locked out half-way.
//!
//! Only SHA-256 digests of tokens are kept, compared in constant time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use parking_lot::RwLock;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::observe::{AdminFile, Metrics};
use crate::reload::{FileWatch, OnChange};

/// The shortest token accepted, in bytes: 256 bits, as `head -c 32 /dev/urandom | base64`
/// gives (44 characters).
pub const MIN_TOKEN_BYTES: usize = 32;

/// Tokens that were published with poolpilot (placeholders in its manifests and examples): long
/// enough, but known to everyone, so a gateway refuses them.
const PUBLISHED_TOKENS: &[&str] = &[
    "change-me-before-deploying-to-a-real-cluster",
    "change-me-example-token",
];

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// No `adminTokenFile` in the configuration.
    #[error(
        "adminTokenFile is not set: the admin API needs a bearer token of at least {MIN_TOKEN_BYTES} bytes (create one with `head -c 32 /dev/urandom | base64 > admin-token`)"
    )]
    NotConfigured,
    /// The file could not be read.
    #[error("reading admin token file {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The file holds nothing but white space.
    #[error("admin token file {path} is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The token is shorter than [`MIN_TOKEN_BYTES`].
    #[error(
        "the admin token in {path} has {len} bytes; at least {MIN_TOKEN_BYTES} are required (create one with `head -c 32 /dev/urandom | base64`)"
    )]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The token has characters an `Authorization: Bearer` header cannot carry (RFC 6750's
    /// `b64token`).
    #[error(
        "the admin token in {path} has characters a bearer token cannot carry (allowed: letters, digits, - . _ ~ + / and trailing =)"
    )]
    Malformed {
        /// The file.
        path: PathBuf,
    },
    /// The token is a placeholder published with poolpilot.
    #[error(
        "the admin token in {path} is a placeholder published with poolpilot, known to everyone: create your own (`head -c 32 /dev/urandom | base64`)"
    )]
    Published {
        /// The file.
        path: PathBuf,
    },
}

/// Reads and checks the token in `adminTokenFile` at start: the token, and a watch of the file
/// that has seen it (for [`on_token_change`]).
pub fn load(path: Option<&Path>) -> Result<(String, FileWatch), TokenError> {
    let path = path.ok_or(TokenError::NotConfigured)?;
    let text = std::fs::read(path).map_err(|source| TokenError::Read {
        path: path.into(),
        source,
    })?;
    let token = parse_token(path, &text)?.to_owned();
    Ok((
        token,
        FileWatch::having_seen(vec![path.into()], std::slice::from_ref(&text)),
    ))
}

/// Checks a token file's content: the token, or why it cannot be used.
pub fn parse_token<'a>(path: &Path, text: &'a [u8]) -> Result<&'a str, TokenError> {
    let path = || path.to_path_buf();
    let token = std::str::from_utf8(text)
        .map_err(|_| TokenError::Malformed { path: path() })?
        .trim();
    if token.is_empty() {
        return Err(TokenError::Empty { path: path() });
    }
    if !is_b64token(token) {
        return Err(TokenError::Malformed { path: path() });
    }
    if token.len() < MIN_TOKEN_BYTES {
        return Err(TokenError::TooShort {
            path: path(),
            len: token.len(),
        });
    }
    if PUBLISHED_TOKENS.contains(&token) {
        return Err(TokenError::Published { path: path() });
    }
    Ok(token)
}

/// RFC 6750 `b64token`: `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`.
fn is_b64token(token: &str) -> bool {
    let body = token.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

type Digest32 = [u8; 32];

fn digest(token: &[u8]) -> Digest32 {
    Sha256::digest(token).into()
}

/// The tokens the admin API accepts: the current one, and the previous one until its overlap
/// ends.
pub struct AdminTokens {
    overlap: Duration,
    state: RwLock<Accepted>,
}

#[derive(Clone, Copy)]
struct Accepted {
    current: Digest32,
    previous: Option<(Digest32, Instant)>,
}

impl std::fmt::Debug for AdminTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = *self.state.read();
        f.debug_struct("AdminTokens")
            .field("overlap", &self.overlap)
            .field("in_overlap", &state.previous.is_some())
            .finish_non_exhaustive()
    }
}

impl AdminTokens {
    /// Accepts `token`; after a rotation the previous token stays accepted for `overlap`.
    pub fn new(token: &str, overlap: Duration) -> Self {
        Self {
            overlap,
            state: RwLock::new(Accepted {
                current: digest(token.as_bytes()),
                previous: None,
            }),
        }
    }

    /// Makes `token` the current one. The one it replaces stays accepted for the overlap.
    /// Returns whether the token changed.
    pub fn rotate(&self, token: &str) -> bool {
        let new = digest(token.as_bytes());
        let mut state = self.state.write();
        if state.current == new {
            return false;
        }
        state.previous = Some((state.current, Instant::now() + self.overlap));
        state.current = new;
        true
    }

    /// Whether `authorization` is `Bearer <an accepted token>`. Every accepted digest is
    /// compared, in constant time, so the time taken says nothing about how much of a guess was
    /// right nor which token matched.
    pub fn allows(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(presented) = authorization.and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        else {
            return false;
        };
        let presented = digest(presented);
        let state = *self.state.read();
        let previous = state
            .previous
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(d, _)| d);
        let matches = |expected: &Digest32| {
            presented
                .iter()
                .zip(expected)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
        };
        let current = matches(&state.current);
        let previous = previous.as_ref().is_some_and(matches);
        current | previous
    }
}

/// What a change of the token file `path` does (for [`FileWatch::poll`] of the watch [`load`]
/// returned): a valid token becomes the current one, an invalid one is refused (logged and
/// counted) and the tokens in force stay.
pub fn on_token_change(tokens: Arc<AdminTokens>, path: PathBuf, metrics: Metrics) -> OnChange {
    Box::new(move |contents| match parse_token(&path, &contents[0]) {
        Ok(token) => {
            if tokens.rotate(token) {
                metrics.admin_file_reloaded(AdminFile::Token, true);
                tracing::info!(
                    path = %path.display(),
                    overlap = ?tokens.overlap,
                    "admin token changed; the previous one stays accepted during the overlap"
                );
            }
        }
        Err(error) => {
            metrics.admin_file_reloaded(AdminFile::Token, false);
            tracing::warn!(%error, "admin token file refused; the tokens in force stay");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "q3J0bTBWcE1oS2VmYjFtWmN0dVN2R0l4cXh0b2d3PT0=";

    fn bearer(token: &str) -> HeaderValue {
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap()
    }

    #[test]
    fn only_the_exact_bearer_token_is_allowed() {
        let tokens = AdminTokens::new(TOKEN, Duration::ZERO);
        let allows = |v: &str| tokens.allows(Some(&HeaderValue::from_str(v).unwrap()));
        assert!(allows(&format!("Bearer {TOKEN}")));
        assert!(!allows(&format!("Bearer {}", &TOKEN[1..])));
        assert!(!allows(&format!("Bearer {TOKEN}x")));
        assert!(!allows(&format!("Basic {TOKEN}")));
        assert!(!allows("Bearer "));
        assert!(!tokens.allows(None));
        assert!(!format!("{tokens:?}").contains(TOKEN));
    }

    #[test]
    fn a_token_file_must_hold_a_long_well_formed_unpublished_token() {
        let path = Path::new("/etc/poolpilot/admin/token");
        let check = |text: &str| parse_token(path, text.as_bytes()).map(str::to_owned);
        assert_eq!(check(&format!("{TOKEN}\n")).unwrap(), TOKEN, "trimmed");
        assert_eq!(
            check(&"a".repeat(32)).unwrap().len(),
            32,
            "32 bytes suffice"
        );
        assert!(matches!(check(" \n"), Err(TokenError::Empty { .. })));
        assert!(matches!(
            check(&"a".repeat(31)),
            Err(TokenError::TooShort { len: 31, .. })
        ));
        for malformed in [
            "two words two words two words two words",
            "ünïcödé-ünïcödé-ünïcödé-ünïcödé-ünïcödé",
            "========================================",
            "abc=def=ghijklmnopqrstuvwxyz0123456789",
        ] {
            assert!(
                matches!(check(malformed), Err(TokenError::Malformed { .. })),
                "{malformed:?}"
            );
        }
        assert!(matches!(
            parse_token(path, &[0xff; 40]),
            Err(TokenError::Malformed { .. })
        ));
        for published in PUBLISHED_TOKENS {
            assert!(
                matches!(
                    check(published),
                    Err(TokenError::Published { .. } | TokenError::TooShort { .. })
                ),
                "{published}"
            );
        }
        let message = check("short").unwrap_err().to_string();
        assert!(
            message.contains("/etc/poolpilot/admin/token") && message.contains("at least 32"),
            "{message}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_rotation_the_previous_token_is_accepted_until_the_overlap_ends() {
        let old = TOKEN;
        let new = "bmV3LXRva2VuLW5ldy10b2tlbi1uZXctdG9rZW4tbmV3";
        let tokens = AdminTokens::new(old, Duration::from_secs(300));
        assert!(!tokens.rotate(old), "the same token is no rotation");
        assert!(tokens.rotate(new));
        assert!(tokens.allows(Some(&bearer(new))));
        assert!(tokens.allows(Some(&bearer(old))), "in the overlap");
        tokio::time::advance(Duration::from_secs(299)).await;
        assert!(tokens.allows(Some(&bearer(old))), "still in the overlap");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!tokens.allows(Some(&bearer(old))), "the overlap is over");
        assert!(tokens.allows(Some(&bearer(new))));

        // Rotating back and forth keeps only the one before the current one.
        let third = "dGhpcmQtdG9rZW4tdGhpcmQtdG9rZW4tdGhpcmQtdG9r";
        assert!(tokens.rotate(third));
        assert!(tokens.allows(Some(&bearer(new))));
        assert!(!tokens.allows(Some(&bearer(old))));
    }
}
