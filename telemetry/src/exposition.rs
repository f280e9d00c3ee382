//! `/metrics` content negotiation: the classic text format (`text/plain; version=0.0.4`) unless the
//! scraper accepts OpenMetrics (Prometheus does, and prefers it). `curl | promtool check metrics`
//! then reads counters as `x_total` with their help text, where OpenMetrics names the family `x`.

use std::collections::HashMap;

use prometheus_client::registry::Registry;

/// The two exposition formats a `/metrics` endpoint serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format 0.0.4: what `curl` and `promtool check metrics` get.
    Text,
    /// OpenMetrics 1.0.0: what Prometheus asks for first.
    OpenMetrics,
}

impl Format {
    /// Picks the format for an `Accept` header: OpenMetrics when an `application/openmetrics-text`
    /// range is accepted with a quality at least that of the best text range (`text/plain`,
    /// `text/*`, `*/*`); text otherwise, including when there is no header.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Self::Text;
        };
        let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default().to_ascii_lowercase();
            let quality = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, q)| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0)
                .clamp(0.0, 1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(quality),
                "text/plain" | "text/*" | "*/*" => text = text.max(quality),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Text => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Encodes a registry in the given format.
pub fn encode(registry: &Registry, format: Format) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in a collector, and a
    // partial page is still more useful to a scraper than none.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    match format {
        Format::OpenMetrics => out,
        Format::Text => openmetrics_to_text(&out),
    }
}

/// Rewrites an OpenMetrics page (as prometheus-client writes it) into the classic text format:
/// counter families take their samples' `_total` name, `info` becomes a gauge named `_info`,
/// `unknown` becomes `untyped`; `# UNIT`, `# EOF`, `_created` samples and exemplars go.
pub fn openmetrics_to_text(page: &str) -> String {
    let mut types: HashMap<&str, &str> = HashMap::new();
    for line in page.lines() {
        if let Some((name, kind)) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_once(' '))
        {
            types.insert(name, kind.trim());
        }
    }
    let family_name = |name: &str| -> String {
        match types.get(name).copied() {
            Some("counter") if !name.ends_with("_total") => format!("{name}_total"),
            Some("info") => format!("{name}_info"),
            _ => name.to_owned(),
        }
    };
    let is_created_sample = |sample: &str| {
        sample.strip_suffix("_created").is_some_and(|family| {
            matches!(
                types.get(family).copied(),
                Some("counter" | "histogram" | "summary" | "gaugehistogram")
            )
        })
    };
    let mut out = String::with_capacity(page.len());
    for line in page.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            // The text format escapes only backslash and newline in help texts.
            let help = help.replace("\\\"", "\"");
            out.push_str(&format!("# HELP {} {help}\n", family_name(name)));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind.trim() {
                "counter" => "counter",
                "gauge" | "info" | "stateset" => "gauge",
                "histogram" => "histogram",
                "summary" => "summary",
                _ => "untyped",
            };
            out.push_str(&format!("# TYPE {} {kind}\n", family_name(name)));
        } else if line.starts_with('#') || line.is_empty() {
            continue;
        } else {
            let sample_name = line.split(['{', ' ']).next().unwrap_or_default();
            if is_created_sample(sample_name) {
                continue;
            }
            // An exemplar follows " # " after the value; the text format has none.
            let sample = match line.find(" # {") {
                Some(at) => &line[..at],
                None => line,
            };
            out.push_str(sample);
            out.push('\n');
        }
    }
    out
}
