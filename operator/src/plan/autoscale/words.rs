//! Numbers in the autoscaler's reasons, for people: at most two decimals, ratios, bytes.

/// Numbers in reasons: at most two decimals, no trailing zeros.
pub(super) fn round(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// Bytes per second for people: `830 B`, `52.4 kB`, `1.2 MB`.
pub(super) fn bytes_text(b: f64) -> String {
    if b >= 1e6 {
        format!("{} MB", round(b / 1e6))
    } else if b >= 1e3 {
        format!("{} kB", round(b / 1e3))
    } else {
        format!("{} B", round(b))
    }
}
