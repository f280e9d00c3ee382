//! `poolpilot-gateway validate --config F [--limits F]`: checks a configuration before it is
//! applied, the way `nginx -t` and `haproxy -c` do. Nothing is bound or started: the file is
//! loaded, its admin token and certificate read and checked, its access log settings checked,
//! and the limits document (`--limits`, or the file's `limitsFile`) parsed and validated with
//! the same rules a running gateway applies. One line per check; exit status 0 when all pass,
//! 1 when one fails (2 for a command-line error, from clap).

use std::io::Write;
use std::path::Path;

use crate::config::GatewayConfig;

/// The prefix of every line, as `nginx -t` prints its own name.
const PREFIX: &str = "poolpilot-gateway:";

/// Checks `config` and the limits document (`limits`, or the one the config names); writes
/// one line per check to `out`. Returns whether everything passed.
pub fn run(config: &Path, limits: Option<&Path>, out: &mut impl Write) -> bool {
    let mut failed = false;
    let mut say = |ok: bool, line: String| {
        let level = if ok { "" } else { "[emerg] " };
        failed |= !ok;
        let _ = writeln!(out, "{PREFIX} {level}{line}");
    };
    let loaded = GatewayConfig::load(config);
    let file = config.display();
    match &loaded {
        Ok(_) => say(true, format!("the configuration file {file} syntax is ok")),
        Err(error) => say(false, chain(error)),
    }
    if let Ok(config) = &loaded {
        if let Err(message) = config.access_log.validate() {
            say(false, format!("{file}: {message}"));
        }
        match crate::admin::token::load(config.admin_token_file.as_deref()) {
            Ok(_) => say(true, "the admin token is fit for use".to_owned()),
            Err(error) => say(false, chain(&error)),
        }
        if let Some(tls) = &config.admin_tls {
            match crate::admin::tls::AdminTls::load(tls) {
                Ok(_) => say(
                    true,
                    format!("the admin certificate {} loads", tls.cert_file.display()),
                ),
                Err(error) => say(false, chain(&error)),
            }
        }
    }
    let limits = limits
        .map(Path::to_path_buf)
        .or_else(|| loaded.as_ref().ok().and_then(|c| c.limits_file.clone()));
    if let Some(path) = limits {
        check_limits(&path, &mut say);
    }
    let outcome = if failed { "failed" } else { "is successful" };
    let _ = writeln!(out, "{PREFIX} configuration file {file} test {outcome}");
    !failed
}

fn check_limits(path: &Path, say: &mut impl FnMut(bool, String)) {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(error) => {
            return say(
                false,
                format!("reading the limits file {} failed: {error}", path.display()),
            );
        }
    };
    let doc = match crate::reload::parse(path, &text) {
        Ok(doc) => doc,
        Err(error) => return say(false, chain(&error)),
    };
    match doc.validate() {
        Ok(()) => say(
            true,
            format!(
                "the limits file {} is valid (generation {}, {}, {})",
                path.display(),
                doc.generation,
                count(doc.backends.len(), "backend", "backends"),
                count(
                    doc.client_policies.len(),
                    "client policy",
                    "client policies"
                ),
            ),
        ),
        Err(invalid) => {
            for violation in &invalid.violations {
                say(false, format!("{}: {violation}", path.display()));
            }
        }
    }
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// An error with its causes, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
