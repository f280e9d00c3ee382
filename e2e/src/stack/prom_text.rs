//! Prometheus text expositions as the scenarios read them: fetching a pod's `/metrics` and
//! summing series, the operator's decisions by kind, histograms' buckets and quantiles.

use std::collections::BTreeMap;
use std::time::Duration;

/// How long a scenario's read of a `/metrics` text may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// An operator pod's `/metrics` text, from its URL ([`Stack::operator_metrics_url`]).
pub async fn operator_metrics(url: &str) -> anyhow::Result<String> {
    get_text(url, READ_TIMEOUT).await
}

/// The body of a successful `GET url`, answered within `timeout`.
pub async fn get_text(url: &str, timeout: Duration) -> anyhow::Result<String> {
    Ok(reqwest::Client::builder()
        .timeout(timeout)
        .build()?
        .get(url)
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?)
}

/// The operator's autoscale decisions so far by kind (`poolpilot_operator_decisions_total`),
/// from an operator pod's `/metrics` URL ([`Stack::operator_metrics_url`]).
pub async fn operator_decisions(url: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    Ok(decisions_by_kind(&operator_metrics(url).await?))
}

/// The decisions by kind in an operator's `/metrics` text (`poolpilot_operator_decisions_total`,
/// summed over its other labels).
pub fn decisions_by_kind(text: &str) -> BTreeMap<String, f64> {
    let mut kinds = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("poolpilot_operator_decisions_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let kind = labels
            .split(',')
            .find_map(|l| l.strip_prefix("kind=\""))
            .map(|k| k.trim_end_matches('"'));
        if let (Some(kind), Ok(value)) = (kind, value.trim().parse::<f64>()) {
            *kinds.entry(kind.to_owned()).or_default() += value;
        }
    }
    kinds
}

/// The value of a sample's series in a Prometheus text exposition: the sum over every line of
/// `metric` whose labels contain all of `labels` (`name="value"` pairs).
pub fn metric_sum(text: &str, metric: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, rest) = series.split_once('{').unwrap_or((series, ""));
            (name == metric && labels.iter().all(|want| rest.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// The cumulative buckets `(le, count)` of histogram `name` in an exposition, by `le` (`+Inf`
/// last).
pub fn histogram(text: &str, name: &str) -> Vec<(f64, f64)> {
    histogram_where(text, name, &[])
}

/// [`histogram`], of the series whose labels contain each of `labels` (`step="plan"`).
pub fn histogram_where(text: &str, name: &str, labels: &[&str]) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut out: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (series, value) = rest.rsplit_once("} ")?;
            if !labels.iter().all(|want| series.contains(want)) {
                return None;
            }
            let le = series
                .split(',')
                .find_map(|kv| kv.strip_prefix("le=\""))?
                .trim_end_matches('"');
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, value.trim().parse().ok()?))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// `after − before`, bucket by bucket (buckets missing before count from zero).
pub fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, n)| {
            let was = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, n)| *n);
            (le, n - was)
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolated linearly inside its bucket as
/// Prometheus' `histogram_quantile` does; `None` without observations. A quantile in the `+Inf`
/// bucket is the highest finite bound.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let inside = n - lower.1;
            let frac = if inside > 0.0 {
                (rank - lower.1) / inside
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * frac);
        }
        lower = (le, n);
    }
    Some(lower.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_adds_the_matching_series_only() {
        let text = "# HELP x\n\
                    poolpilot_pool_connections{backend=\"a\",endpoint=\"e1\",state=\"leased\"} 3\n\
                    poolpilot_pool_connections{backend=\"a\",endpoint=\"e2\",state=\"leased\"} 4\n\
                    poolpilot_pool_connections{backend=\"a\",endpoint=\"e2\",state=\"idle\"} 9\n\
                    poolpilot_pool_connections_total 100\n";
        assert_eq!(
            metric_sum(text, "poolpilot_pool_connections", &["state=\"leased\""]),
            7.0
        );
        assert_eq!(metric_sum(text, "poolpilot_pool_connections", &[]), 16.0);
        assert_eq!(
            metric_sum(text, "poolpilot_pool_connections_total", &[]),
            100.0
        );
        assert_eq!(metric_sum(text, "missing", &[]), 0.0);
    }

    #[test]
    fn decisions_are_summed_by_kind_over_the_other_labels() {
        let text = "# TYPE poolpilot_operator_decisions_total counter\n\
                    poolpilot_operator_decisions_total{kind=\"hold\",policy=\"a\"} 3\n\
                    poolpilot_operator_decisions_total{policy=\"b\",kind=\"hold\"} 2\n\
                    poolpilot_operator_decisions_total{kind=\"scale_up\",policy=\"a\"} 1\n\
                    poolpilot_operator_decisions_total{policy=\"a\"} 7\n\
                    poolpilot_operator_decisions_seconds{kind=\"hold\"} 9\n";
        assert_eq!(
            decisions_by_kind(text),
            BTreeMap::from([("hold".to_owned(), 5.0), ("scale_up".to_owned(), 1.0)])
        );
    }
    const TEXT: &str = "# TYPE x histogram\n\
        x_bucket{le=\"0.001\"} 10\n\
        x_bucket{le=\"0.002\"} 30\n\
        x_bucket{le=\"+Inf\"} 40\n\
        x_sum 1.0\n\
        x_count 40\n";

    #[test]
    fn histograms_parse_subtract_and_interpolate() {
        let h = histogram(TEXT, "x");
        assert_eq!(h, vec![(0.001, 10.0), (0.002, 30.0), (f64::INFINITY, 40.0)]);
        let before = vec![(0.001, 10.0), (0.002, 10.0), (f64::INFINITY, 10.0)];
        let d = bucket_delta(&before, &h);
        assert_eq!(d, vec![(0.001, 0.0), (0.002, 20.0), (f64::INFINITY, 30.0)]);
        // 15 of 30 observations: halfway into (0.001, 0.002].
        let p50 = quantile(&d, 0.5).unwrap();
        assert!((p50 - 0.00175).abs() < 1e-9, "{p50}");
        assert_eq!(
            quantile(&d, 0.99),
            Some(0.002),
            "in +Inf: the last finite bound"
        );
        assert_eq!(quantile(&bucket_delta(&h, &h), 0.5), None);
    }

    #[test]
    fn a_labelled_histogram_is_read_apart_from_its_siblings() {
        let text = "\
            s_bucket{step=\"plan\",le=\"0.1\"} 3\n\
            s_bucket{step=\"plan\",le=\"+Inf\"} 4\n\
            s_bucket{step=\"status\",le=\"0.1\"} 7\n\
            s_bucket{step=\"status\",le=\"+Inf\"} 9\n";
        assert_eq!(
            histogram_where(text, "s", &["step=\"plan\""]),
            vec![(0.1, 3.0), (f64::INFINITY, 4.0)]
        );
        assert_eq!(
            histogram_where(text, "s", &["step=\"status\""]),
            vec![(0.1, 7.0), (f64::INFINITY, 9.0)]
        );
        assert!(histogram_where(text, "s", &["step=\"rollout\""]).is_empty());
    }
}
