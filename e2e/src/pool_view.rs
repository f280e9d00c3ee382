//! One backend's pool as the gateways hold it (leased, pending, pooled, summed over pods, read
//! from their `/metrics`), recorded second by second beside the load's outcome and drawn as the
//! flash-crowd picture: connections over time, the error rate, and the operator's decisions.

use std::path::{Path, PathBuf};

use poolpilot_plot::{Marker, Series, TimeChart};

use crate::load::Tally;
use crate::stack::{GatewayPod, metric_sum};

/// One backend's pool summed over the gateway pods at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolView {
    /// Connections lent to calls.
    pub leased: f64,
    /// Calls waiting for a connection.
    pub pending: f64,
    /// The pool's cap: the sum of every endpoint's `max_connections` (the shares).
    pub pooled: f64,
    /// Connections open beyond the shares, on the pods' burst allowance.
    pub bursting: f64,
}

/// Reads `backend`'s pool from every gateway; `None` when a gateway did not answer (a partial
/// sum would draw a dip that did not happen).
pub async fn pool_view(gateways: &[GatewayPod], backend: &str) -> Option<PoolView> {
    let label = format!("backend=\"{backend}\"");
    let mut view = PoolView::default();
    for g in gateways {
        let text = g.metrics().await.ok()?;
        view.leased += metric_sum(
            &text,
            "poolpilot_pool_connections",
            &[&label, "state=\"leased\""],
        );
        view.pending += metric_sum(&text, "poolpilot_pool_pending", &[&label]);
        view.pooled += metric_sum(&text, "poolpilot_pool_max_connections", &[&label]);
        view.bursting += metric_sum(&text, "poolpilot_pool_burst_connections", &[&label]);
    }
    Some(view)
}

/// Pool readings and decisions over a run, in seconds since the load started.
#[derive(Clone, Debug, Default)]
pub struct PoolRecorder {
    views: Vec<(f64, PoolView)>,
    decisions: Vec<Marker>,
}

impl PoolRecorder {
    /// Records a reading taken `at` seconds into the run.
    pub fn record(&mut self, at: f64, view: PoolView) {
        self.views.push((at, view));
    }

    /// Records a decision of the operator (`8 → 15`) taken `at` seconds into the run.
    pub fn decision(&mut self, at: f64, label: impl Into<String>) {
        self.decisions.push(Marker {
            x: at,
            label: label.into(),
        });
    }

    /// The readings so far.
    pub fn views(&self) -> &[(f64, PoolView)] {
        &self.views
    }

    /// Draws the run: pool cap, leased and pending connections on the left axis, the error rate
    /// of each second's calls (from the load's tally) on the right, the decisions as lines.
    pub fn draw(&self, path: &Path, title: &str, seconds: &[(u64, Tally)]) -> anyhow::Result<()> {
        let series = |name: &str, pick: fn(&PoolView) -> f64| Series {
            name: name.into(),
            points: self.views.iter().map(|(t, v)| (*t, pick(v))).collect(),
        };
        let errors = Series {
            name: "errors %".into(),
            points: seconds
                .iter()
                .filter(|(_, t)| t.calls > 0)
                .map(|(s, t)| (*s as f64 + 0.5, t.error_rate() * 100.0))
                .collect(),
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        poolpilot_plot::time_chart(
            path,
            &TimeChart {
                title: title.into(),
                left_label: "connections (all gateways)".into(),
                left: vec![
                    series("pool cap", |v| v.pooled),
                    series("leased", |v| v.leased),
                    series("pending", |v| v.pending),
                ],
                right_label: "calls failed in the second (%)".into(),
                right: vec![errors],
                markers: self.decisions.clone(),
            },
        )
    }
}

/// Where a run's picture goes: `<cache>/plots/<name>.svg` (outside the clone: runs write it,
/// `docs/plots/` holds the copies the docs show).
pub fn plot_path(name: &str) -> PathBuf {
    crate::paths::cache_dir()
        .join("plots")
        .join(format!("{name}.svg"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_picture_has_the_pool_the_errors_and_the_decision() {
        let mut rec = PoolRecorder::default();
        for s in 0..20 {
            let grown = s >= 10;
            rec.record(
                s as f64,
                PoolView {
                    leased: if grown { 24.0 } else { 16.0 },
                    pending: if grown { 0.0 } else { 8.0 },
                    pooled: if grown { 30.0 } else { 16.0 },
                    bursting: 0.0,
                },
            );
        }
        rec.decision(10.0, "8 → 15");
        let seconds: Vec<(u64, Tally)> = (0..20)
            .map(|s| {
                let failed = if s < 10 { 10 } else { 0 };
                let tally = Tally {
                    calls: 20,
                    ok: 20 - failed,
                    errors: [("lease_timeout".to_owned(), failed)].into(),
                    ..Tally::default()
                };
                (s, tally)
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plots/crowd.svg");
        rec.draw(&path, "flash crowd on model-a", &seconds).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "flash crowd on model-a",
            "pool cap",
            "leased",
            "pending",
            "errors % (right axis)",
            "8 → 15",
        ] {
            assert!(svg.contains(text), "no {text:?} in the picture");
        }
        assert_eq!(rec.views().len(), 20);
    }
}
