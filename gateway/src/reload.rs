//! Files the gateway follows while it runs, polled by content (`FileWatch`): the durable limits
//! path here, the admin token and certificate in `crate::admin`.
//!
//! The limits file (a mounted ConfigMap, or a hand-written file) is loaded at start and polled
//! for changes; a changed file is applied under the same rules as `PUT /v1/limits`, until a
//! document arrives by PUT: from then on the operator manages the pod and file changes are
//! ignored (see [`Gateway::managed_by_api`]).
//!
//! Polling the content rather than watching with inotify (the `notify` crate): a mounted
//! ConfigMap or Secret changes by the kubelet swapping a `..data` symlink in the parent folder,
//! which a watch on the file itself never sees, and the kubelet's own refresh (up to a minute or
//! so) dwarfs a poll every couple of seconds, which costs one read of a small file.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use poolpilot_api::GatewayLimits;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::live::{Gateway, LimitsSource};

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

/// Reads and applies the file once. Returns a watch that has seen this content, whether or not
/// it was applied, for [`on_limits_change`].
pub(crate) fn load_once(gw: &Gateway, path: &Path) -> Result<FileWatch, LimitsFileError> {
    let text = fs::read(path).map_err(|source| LimitsFileError::Read {
        path: path.into(),
        source,
    })?;
    let watch = FileWatch::having_seen(vec![path.into()], std::slice::from_ref(&text));
    apply_file(gw, path, &text);
    Ok(watch)
}

/// Applies `text`, the content of the limits file `path`; a document that does not parse is
/// counted and logged here, one that `apply` refuses is counted and logged by it.
fn apply_file(gw: &Gateway, path: &Path, text: &[u8]) {
    match parse(path, text) {
        Ok(doc) => {
            let _ = gw.apply(doc, LimitsSource::File);
        }
        Err(error) => {
            gw.metrics().limits_rejected("file");
            tracing::warn!(%error, source = ?std::error::Error::source(&error), "limits file refused");
        }
    }
}

/// What a change of the limits file `path` does (for [`FileWatch::poll`]): it is applied, until
/// the pod's limits come by PUT; from then on it is only logged.
pub(crate) fn on_limits_change(gw: Gateway, path: PathBuf) -> OnChange {
    Box::new(move |contents| {
        if gw.managed_by_api() {
            tracing::info!(
                path = %path.display(),
                "limits file changed; not applied: this pod's limits come by PUT /v1/limits"
            );
            return;
        }
        tracing::info!(path = %path.display(), "limits file changed");
        apply_file(&gw, &path, &contents[0]);
    })
}

/// What a [`FileWatch`] does with its files' new contents (in the order of its paths).
pub(crate) type OnChange = Box<dyn FnMut(Vec<Vec<u8>>) + Send>;

/// Notices when a set of files changes, by the digest of their contents: a mounted ConfigMap's
/// or Secret's symlink swap, an editor's rename or an in-place write look the same.
#[derive(Debug)]
pub(crate) struct FileWatch {
    paths: Vec<PathBuf>,
    seen: Option<[u8; 32]>,
}

impl FileWatch {
    /// Watches `paths`; nothing seen yet.
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self { paths, seen: None }
    }

    /// Watches `paths`, whose `contents` (in the same order) were read already.
    pub fn having_seen(paths: Vec<PathBuf>, contents: &[Vec<u8>]) -> Self {
        Self {
            paths,
            seen: Some(digest(contents)),
        }
    }

    /// Reads every file; returns their contents (in the order of the paths) when they differ
    /// from what was last seen. While one of them cannot be read (a swap in progress, not
    /// mounted yet), nothing changed.
    pub fn changed(&mut self) -> Option<Vec<Vec<u8>>> {
        let contents = self
            .paths
            .iter()
            .map(fs::read)
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let digest = digest(&contents);
        if self.seen == Some(digest) {
            return None;
        }
        self.seen = Some(digest);
        Some(contents)
    }

    /// Reads the files every `interval` until `shutdown`, handing their contents to `apply`
    /// whenever they changed (see [`FileWatch::changed`]).
    pub async fn poll(
        mut self,
        interval: Duration,
        shutdown: watch::Receiver<bool>,
        mut apply: impl FnMut(Vec<Vec<u8>>),
    ) {
        poll(interval, shutdown, || {
            if let Some(contents) = self.changed() {
                apply(contents);
            }
        })
        .await;
    }
}

/// One digest of several files' contents (each prefixed by its length, so that bytes moving from
/// one file to the next are a change).
fn digest(contents: &[Vec<u8>]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for c in contents {
        hash.update((c.len() as u64).to_le_bytes());
        hash.update(c);
    }
    hash.finalize().into()
}

/// Runs `check` every `interval` until `shutdown` turns true.
async fn poll(interval: Duration, mut shutdown: watch::Receiver<bool>, mut check: impl FnMut()) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => check(),
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}
