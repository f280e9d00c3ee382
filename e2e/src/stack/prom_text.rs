//! Prometheus text expositions as the scenarios read them: fetching a pod's `/metrics` and
//! summing series, the operator's decisions by kind.

use std::collections::BTreeMap;
use std::time::Duration;

fn http_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?)
}

/// An operator pod's `/metrics` text, from its URL ([`Stack::operator_metrics_url`]).
pub async fn operator_metrics(url: &str) -> anyhow::Result<String> {
    get_text(url).await
}

/// The body of a successful `GET url`.
async fn get_text(url: &str) -> anyhow::Result<String> {
    Ok(http_client()?
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
}
