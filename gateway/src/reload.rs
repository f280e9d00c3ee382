//! The durable limits path: the limits file (a mounted ConfigMap, or a hand-written file) is
//! loaded at start and polled for changes; a changed file is applied under the same rules as
//! `PUT /v1/limits`, until a document arrives by PUT: from then on the operator manages the
//! pod and file changes are ignored (see [`Gateway::managed_by_api`]). Polling the content (not
//! inotify) also sees ConfigMap symlink swaps.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use poolpilot_api::GatewayLimits;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::gateway::{Gateway, LimitsSource};

/// Why the limits file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LimitsFileError {
    /// Reading it failed.
    #[error("reading limits file {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// It is not a limits document.
    #[error("limits file {path} is not a limits document")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_norway::Error,
    },
}

/// Parses a limits document (YAML, or JSON, which is YAML).
pub fn parse(path: &Path, text: &[u8]) -> Result<GatewayLimits, LimitsFileError> {
    serde_norway::from_slice(text).map_err(|source| LimitsFileError::Parse {
        path: path.into(),
        source,
    })
}

/// Reads and applies the file once. Returns the content digest, so the watcher knows what it
/// has seen, whether or not it was applied.
pub fn load_once(gw: &Gateway, path: &Path) -> Result<[u8; 32], LimitsFileError> {
    let text = fs::read(path).map_err(|source| LimitsFileError::Read {
        path: path.into(),
        source,
    })?;
    let digest: [u8; 32] = Sha256::digest(&text).into();
    match parse(path, &text) {
        Ok(doc) => {
            // Refusals are logged and counted by `apply`.
            let _ = gw.apply(doc, LimitsSource::File);
        }
        Err(error) => {
            gw.metrics().limits_rejected("file");
            tracing::warn!(error = %error, source = ?std::error::Error::source(&error), "limits file refused");
        }
    }
    Ok(digest)
}

/// Polls `path` every `interval` until `shutdown`, applying it whenever its content changes.
pub async fn watch_file(
    gw: Gateway,
    path: PathBuf,
    interval: Duration,
    mut seen: Option<[u8; 32]>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let Ok(text) = fs::read(&path) else { continue };
        let digest: [u8; 32] = Sha256::digest(&text).into();
        if seen == Some(digest) {
            continue;
        }
        seen = Some(digest);
        if gw.managed_by_api() {
            tracing::info!(
                path = %path.display(),
                "limits file changed; not applied: this pod's limits come by PUT /v1/limits"
            );
            continue;
        }
        tracing::info!(path = %path.display(), "limits file changed");
        match parse(&path, &text) {
            Ok(doc) => {
                let _ = gw.apply(doc, LimitsSource::File);
            }
            Err(error) => {
                gw.metrics().limits_rejected("file");
                tracing::warn!(%error, source = ?std::error::Error::source(&error), "limits file refused");
            }
        }
    }
}
