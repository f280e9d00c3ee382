//! The gateway's logs: text or JSON lines, filtered by `RUST_LOG`-style directives that the
//! admin API can change at run time (`GET`/`PUT /v1/log-level`) without a restart.

use std::io::IsTerminal as _;
use std::sync::OnceLock;

use parking_lot::Mutex;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Registry, reload};

use crate::config::LogFormat;

/// The filter in force when `RUST_LOG` is not set.
pub const DEFAULT_DIRECTIVES: &str = "info";

/// Why the log level was not changed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LogLevelError {
    /// The directives do not parse.
    #[error("not a log filter ({directives:?}): {message}")]
    Invalid {
        /// What was asked.
        directives: String,
        /// Why it does not parse.
        message: String,
    },
    /// This process's logs were not set up by [`init`] (an embedding program's own logging).
    #[error("the log level of this process cannot be changed at run time")]
    Unavailable,
}

/// The filter of the installed subscriber.
struct Control {
    handle: reload::Handle<EnvFilter, Registry>,
    current: Mutex<String>,
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// Installs the process's logger writing to standard output: `RUST_LOG`, or
/// [`DEFAULT_DIRECTIVES`]; colours only on a terminal.
pub fn init(format: LogFormat) {
    let directives = std::env::var("RUST_LOG").unwrap_or_else(|_| DEFAULT_DIRECTIVES.to_owned());
    init_with(
        format,
        &directives,
        std::io::stdout,
        std::io::stdout().is_terminal(),
    );
}

/// Installs the process's logger writing to `writer`, filtered by `directives` (falling back
/// to [`DEFAULT_DIRECTIVES`] when they do not parse). Only the first call of a process installs
/// anything.
pub fn init_with<W>(format: LogFormat, directives: &str, writer: W, ansi: bool)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let (filter, directives) = match EnvFilter::try_new(directives) {
        Ok(filter) => (filter, directives.to_owned()),
        Err(_) => (
            EnvFilter::new(DEFAULT_DIRECTIVES),
            DEFAULT_DIRECTIVES.to_owned(),
        ),
    };
    let (filter, handle) = reload::Layer::new(filter);
    let base = tracing_subscriber::registry().with(filter);
    let installed = match format {
        LogFormat::Json => base
            .with(tracing_subscriber::fmt::layer().json().with_writer(writer))
            .try_init(),
        LogFormat::Text => base
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(writer),
            )
            .try_init(),
    };
    if installed.is_ok() {
        let _ = CONTROL.set(Control {
            handle,
            current: Mutex::new(directives),
        });
    }
}

/// The filter directives in force.
pub(crate) fn level() -> Result<String, LogLevelError> {
    let control = CONTROL.get().ok_or(LogLevelError::Unavailable)?;
    Ok(control.current.lock().clone())
}

/// Replaces the filter with `directives` (a level such as `debug`, or `RUST_LOG` syntax such as
/// `info,poolpilot_gateway::pool=trace`); returns the directives it replaced.
pub(crate) fn set_level(directives: &str) -> Result<String, LogLevelError> {
    let control = CONTROL.get().ok_or(LogLevelError::Unavailable)?;
    let invalid = |message: String| LogLevelError::Invalid {
        directives: directives.to_owned(),
        message,
    };
    let directives = directives.trim();
    if directives.is_empty() {
        return Err(invalid("empty".to_owned()));
    }
    let filter = EnvFilter::builder()
        .parse(directives)
        .map_err(|e| invalid(e.to_string()))?;
    let mut current = control.current.lock();
    control
        .handle
        .reload(filter)
        .map_err(|e| invalid(e.to_string()))?;
    let previous = std::mem::replace(&mut *current, directives.to_owned());
    tracing::info!(%previous, now = directives, "log level changed");
    Ok(previous)
}
