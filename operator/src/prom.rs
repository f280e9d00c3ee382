//! Prometheus: one batched set of PromQL queries per interval for every policy in the cluster
//! (not one per policy per pod), folded into a [`Snapshot`], and the pure aggregation of that
//! snapshot into each namespace's planner [`Samples`]. A query error, an empty result, NaN or a
//! sample older than two scrape intervals is missing data, never zero.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use prometheus_http_query::response::Data;

use crate::plan::waves::PodRates;
use crate::plan::{Acked, BackendSample, PodSample, PolicyKey, Samples, Timestamp, elapsed};

/// Why a Prometheus query failed.
#[derive(Debug, thiserror::Error)]
pub enum PromError {
    /// The server URL could not be used.
    #[error("invalid Prometheus URL {url:?}")]
    Url {
        /// The URL given.
        url: String,
        /// Why.
        #[source]
        source: prometheus_http_query::Error,
    },
    /// A query failed (transport, HTTP or PromQL error).
    #[error("Prometheus query {name} failed")]
    Query {
        /// Which query.
        name: &'static str,
        /// Why.
        #[source]
        source: prometheus_http_query::Error,
    },
    /// A query got no answer in time (a Prometheus that accepts connections but does not
    /// answer, or a network that drops packets). Without this bound one hung request would
    /// stall every later round.
    #[error("Prometheus query {name} got no answer within {after:?}")]
    Timeout {
        /// Which query.
        name: &'static str,
        /// The bound.
        after: Duration,
    },
}

/// The queries, with the windows they use.
#[derive(Clone, Debug)]
pub struct Queries {
    /// Averaging window of demand (the autoscale interval, at least two scrape intervals).
    pub window: Duration,
    /// Window over which the lowest p90 is the latency baseline.
    pub baseline_window: Duration,
    /// Gauges older than this are stale: two scrape intervals.
    pub freshness: Duration,
}

/// One query's name and PromQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    /// Stable name (metric label, logs).
    pub name: &'static str,
    /// The PromQL.
    pub promql: String,
}

impl Queries {
    /// Every query of one round. Ranges bound staleness: a range selector only sees samples
    /// inside its window, unlike an instant selector's five-minute lookback.
    pub fn all(&self) -> Vec<Query> {
        let w = prom_duration(self.window.max(self.freshness));
        let fresh = prom_duration(self.freshness);
        let base = prom_duration(self.baseline_window);
        let p90 = |range: &str| {
            format!(
                "histogram_quantile(0.9, sum by (namespace, backend, le) (rate(poolpilot_upstream_request_duration_seconds_bucket[{range}])))"
            )
        };
        vec![
            Query {
                name: "leased",
                promql: format!(
                    "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_connections{{state=\"leased\"}}[{w}]))"
                ),
            },
            Query {
                name: "pending",
                promql: format!(
                    "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_pending[{w}]))"
                ),
            },
            Query {
                name: "latency_p90",
                promql: p90(&w),
            },
            Query {
                name: "latency_baseline",
                promql: format!("min_over_time(({})[{base}:{w}])", p90(&w)),
            },
            Query {
                name: "max_fds",
                promql: format!(
                    "max by (namespace, pod) (last_over_time(process_max_fds[{fresh}]))"
                ),
            },
            Query {
                name: "open_fds",
                promql: format!(
                    "max by (namespace, pod) (last_over_time(process_open_fds[{fresh}]))"
                ),
            },
            Query {
                name: "limits_info",
                promql: format!(
                    "max by (namespace, pod, revision, generation) (last_over_time(poolpilot_limits_info[{fresh}]))"
                ),
            },
            Query {
                name: "requests",
                promql: format!(
                    "sum by (namespace, pod) (rate(poolpilot_upstream_request_duration_seconds_count[{w}]))"
                ),
            },
            Query {
                name: "lease_timeouts",
                promql: format!(
                    "sum by (namespace, pod) (rate(poolpilot_pool_lease_timeouts_total[{w}]))"
                ),
            },
        ]
    }
}

/// Seconds as a PromQL duration (`15s`).
fn prom_duration(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

/// One query's rows: labels and a finite value. `None`: the query failed.
pub type Rows = Option<Vec<(HashMap<String, String>, f64)>>;

/// What one round of queries returned, keyed by Kubernetes names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// When the round ran.
    pub at: Option<Timestamp>,
    /// Leased connections per (namespace, pod, backend); `None` when the query failed.
    pub leased: Option<BTreeMap<(String, String, String), f64>>,
    /// Pending lease requests per (namespace, pod, backend).
    pub pending: Option<BTreeMap<(String, String, String), f64>>,
    /// p90 upstream latency per (namespace, backend).
    pub latency_p90: Option<BTreeMap<(String, String), f64>>,
    /// Its baseline per (namespace, backend).
    pub latency_baseline: Option<BTreeMap<(String, String), f64>>,
    /// `process_max_fds` per (namespace, pod).
    pub max_fds: Option<BTreeMap<(String, String), f64>>,
    /// `process_open_fds` per (namespace, pod).
    pub open_fds: Option<BTreeMap<(String, String), f64>>,
    /// The limits each pod reports running, per (namespace, pod).
    pub limits_info: BTreeMap<(String, String), Acked>,
    /// Upstream calls per second per (namespace, pod).
    pub requests: Option<BTreeMap<(String, String), f64>>,
    /// Lease timeouts per second per (namespace, pod).
    pub lease_timeouts: Option<BTreeMap<(String, String), f64>>,
}

impl Snapshot {
    /// Folds the rows of one round (in [`Queries::all`] order, by name) into a snapshot. NaN
    /// and infinite values are dropped: they are missing data.
    pub fn fold(at: Timestamp, rows: &BTreeMap<&'static str, Rows>) -> Self {
        let get = |name: &str| rows.get(name).cloned().flatten();
        let finite =
            |r: Vec<(HashMap<String, String>, f64)>| r.into_iter().filter(|(_, v)| v.is_finite());
        let by_pod_backend = |name: &str| {
            get(name).map(|r| {
                finite(r)
                    .filter_map(|(l, v)| {
                        Some((
                            (
                                l.get("namespace")?.clone(),
                                l.get("pod")?.clone(),
                                l.get("backend")?.clone(),
                            ),
                            v,
                        ))
                    })
                    .collect()
            })
        };
        let by = |name: &str, key: &str| {
            get(name).map(|r| {
                finite(r)
                    .filter_map(|(l, v)| {
                        Some(((l.get("namespace")?.clone(), l.get(key)?.clone()), v))
                    })
                    .collect()
            })
        };
        let limits_info = get("limits_info")
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(l, _)| {
                let generation = l.get("generation")?.parse().ok()?;
                let key = (l.get("namespace")?.clone(), l.get("pod")?.clone());
                Some((
                    key,
                    Acked {
                        revision: l.get("revision")?.clone(),
                        generation,
                    },
                ))
            })
            .collect();
        Self {
            at: Some(at),
            leased: by_pod_backend("leased"),
            pending: by_pod_backend("pending"),
            latency_p90: by("latency_p90", "backend"),
            latency_baseline: by("latency_baseline", "backend"),
            max_fds: by("max_fds", "pod"),
            open_fds: by("open_fds", "pod"),
            limits_info,
            requests: by("requests", "pod"),
            lease_timeouts: by("lease_timeouts", "pod"),
        }
    }

    /// A pod's call and lease-timeout rates. `None` when the pod is not scraped (no fresh
    /// `process_max_fds`) or the snapshot is stale; a scraped pod without those series has had
    /// no calls or no timeouts, which is zero (counters appear with their first increment).
    pub fn rates(
        &self,
        namespace: &str,
        pod: &str,
        now: Timestamp,
        max_age: Duration,
    ) -> Option<PodRates> {
        if self.at.is_none_or(|t| elapsed(t, now) > max_age) {
            return None;
        }
        let key = (namespace.to_owned(), pod.to_owned());
        self.max_fds.as_ref()?.get(&key)?;
        let get = |m: &Option<BTreeMap<(String, String), f64>>| {
            Some(m.as_ref()?.get(&key).copied().unwrap_or(0.0))
        };
        Some(PodRates {
            requests: get(&self.requests)?,
            lease_timeouts: get(&self.lease_timeouts)?,
        })
    }

    /// The planner's samples for one namespace. `selection` maps each policy to the pods it
    /// selects and the backends it declares. A snapshot older than `max_age` is all missing.
    pub fn samples(
        &self,
        namespace: &str,
        selection: &[(PolicyKey, Vec<String>, Vec<String>)],
        now: Timestamp,
        max_age: Duration,
    ) -> Samples {
        let mut out = Samples::default();
        if self.at.is_none_or(|t| elapsed(t, now) > max_age) {
            return out;
        }
        let ns = namespace.to_owned();
        for (key, pods, backends) in selection {
            for backend in backends {
                let sum = |m: &Option<BTreeMap<(String, String, String), f64>>| {
                    let m = m.as_ref()?;
                    let vals: Vec<f64> = pods
                        .iter()
                        .filter_map(|p| m.get(&(ns.clone(), p.clone(), backend.clone())).copied())
                        .collect();
                    (!vals.is_empty()).then(|| vals.iter().sum())
                };
                let fleet = |m: &Option<BTreeMap<(String, String), f64>>| {
                    m.as_ref()?.get(&(ns.clone(), backend.clone())).copied()
                };
                out.backends.insert(
                    (key.clone(), backend.clone()),
                    BackendSample {
                        leased: sum(&self.leased),
                        pending: sum(&self.pending),
                        latency_p90: fleet(&self.latency_p90),
                        latency_baseline: fleet(&self.latency_baseline),
                    },
                );
            }
            for pod in pods {
                let get = |m: &Option<BTreeMap<(String, String), f64>>| {
                    m.as_ref()?
                        .get(&(ns.clone(), pod.clone()))
                        .map(|v| v.max(0.0) as u64)
                };
                out.pods.insert(
                    pod.clone(),
                    PodSample {
                        max_fds: get(&self.max_fds),
                        open_fds: get(&self.open_fds),
                    },
                );
            }
        }
        out
    }
}

/// The rows of a query answer: an instant vector's labels and values, a scalar as one unlabelled
/// row. A range vector is not expected from these queries and counts as an empty answer.
pub fn rows(data: &Data) -> Vec<(HashMap<String, String>, f64)> {
    match data {
        Data::Vector(v) => v
            .iter()
            .map(|iv| (iv.metric().clone(), iv.sample().value()))
            .collect(),
        Data::Scalar(s) => vec![(HashMap::new(), s.value())],
        Data::Matrix(_) => Vec::new(),
    }
}

/// Runs one round of queries, concurrently, each bounded by `timeout` (a query that runs out of
/// time is cancelled). A failed query leaves its rows `None`; the errors come back too, for logs
/// and the query-error metric.
pub async fn query_round(
    client: &prometheus_http_query::Client,
    queries: &[Query],
    timeout: Duration,
) -> (BTreeMap<&'static str, Rows>, Vec<PromError>) {
    let answers = futures::future::join_all(queries.iter().map(|q| async move {
        let answer = match tokio::time::timeout(timeout, client.query(&q.promql).get()).await {
            Ok(answer) => answer.map_err(|source| PromError::Query {
                name: q.name,
                source,
            }),
            Err(_) => Err(PromError::Timeout {
                name: q.name,
                after: timeout,
            }),
        };
        (q.name, answer)
    }))
    .await;
    let mut rows_by_name = BTreeMap::new();
    let mut errors = Vec::new();
    for (name, answer) in answers {
        match answer {
            Ok(r) => {
                rows_by_name.insert(name, Some(rows(r.data())));
            }
            Err(e) => {
                rows_by_name.insert(name, None);
                errors.push(e);
            }
        }
    }
    (rows_by_name, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn row(labels: &[(&str, &str)], v: f64) -> (HashMap<String, String>, f64) {
        (
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            v,
        )
    }

    fn key() -> PolicyKey {
        PolicyKey {
            namespace: "ns".into(),
            name: "p".into(),
        }
    }

    fn selection() -> Vec<(PolicyKey, Vec<String>, Vec<String>)> {
        vec![(
            key(),
            vec!["gw-0".into(), "gw-1".into()],
            vec!["model-a".into()],
        )]
    }

    fn round() -> BTreeMap<&'static str, Rows> {
        let pb = |pod, v| {
            row(
                &[("namespace", "ns"), ("pod", pod), ("backend", "model-a")],
                v,
            )
        };
        BTreeMap::from([
            (
                "leased",
                Some(vec![
                    pb("gw-0", 100.0),
                    pb("gw-1", 200.0),
                    pb("gw-9", 1000.0),
                ]),
            ),
            ("pending", Some(vec![pb("gw-0", 50.0), pb("gw-1", 100.0)])),
            (
                "latency_p90",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    0.3,
                )]),
            ),
            (
                "latency_baseline",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    0.25,
                )]),
            ),
            (
                "max_fds",
                Some(vec![row(&[("namespace", "ns"), ("pod", "gw-0")], 1024.0)]),
            ),
            (
                "open_fds",
                Some(vec![row(&[("namespace", "ns"), ("pod", "gw-0")], 99.0)]),
            ),
            (
                "limits_info",
                Some(vec![row(
                    &[
                        ("namespace", "ns"),
                        ("pod", "gw-0"),
                        ("revision", "abc"),
                        ("generation", "7"),
                    ],
                    1.0,
                )]),
            ),
        ])
    }

    #[test]
    fn queries_are_batched_and_bounded_in_time() {
        let q = Queries {
            window: Duration::from_secs(15),
            baseline_window: Duration::from_secs(6 * 3600),
            freshness: Duration::from_secs(30),
        };
        let all = q.all();
        assert_eq!(all.len(), 9, "one round for every policy in the cluster");
        assert_eq!(
            all[0].promql,
            "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_connections{state=\"leased\"}[30s]))"
        );
        assert_eq!(
            all[4].promql,
            "max by (namespace, pod) (last_over_time(process_max_fds[30s]))"
        );
        assert!(
            all[3]
                .promql
                .starts_with("min_over_time((histogram_quantile(0.9, ")
        );
        assert!(all[3].promql.ends_with("[21600s:30s])"));
    }

    #[test]
    fn fleet_demand_sums_the_selected_pods_only() {
        let snap = Snapshot::fold(at(0), &round());
        let s = snap.samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(b.leased, Some(300.0), "gw-9 is not selected");
        assert_eq!(b.pending, Some(150.0));
        assert_eq!((b.latency_p90, b.latency_baseline), (Some(0.3), Some(0.25)));
        assert_eq!(
            s.pods["gw-0"],
            PodSample {
                max_fds: Some(1024),
                open_fds: Some(99)
            }
        );
        assert_eq!(
            s.pods["gw-1"],
            PodSample::default(),
            "no sample is missing, not zero"
        );
        assert_eq!(
            snap.limits_info[&("ns".into(), "gw-0".into())],
            Acked {
                revision: "abc".into(),
                generation: 7
            }
        );
    }

    #[test]
    fn failed_empty_and_nan_answers_are_missing_never_zero() {
        let mut r = round();
        r.insert("leased", None); // query error
        r.insert("pending", Some(vec![])); // empty result
        r.insert(
            "latency_p90",
            Some(vec![row(
                &[("namespace", "ns"), ("backend", "model-a")],
                f64::NAN,
            )]),
        );
        let snap = Snapshot::fold(at(0), &r);
        let s = snap.samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!((b.leased, b.pending, b.latency_p90), (None, None, None));
        assert_eq!(b.latency_baseline, Some(0.25));
    }

    #[test]
    fn pod_rates_need_a_scraped_pod_and_default_absent_counters_to_zero() {
        let mut r = round();
        r.insert(
            "requests",
            Some(vec![row(&[("namespace", "ns"), ("pod", "gw-0")], 50.0)]),
        );
        r.insert("lease_timeouts", Some(vec![]));
        let snap = Snapshot::fold(at(0), &r);
        let max_age = Duration::from_secs(30);
        let gw0 = snap
            .rates("ns", "gw-0", at(5), max_age)
            .expect("gw-0 is scraped");
        assert_eq!((gw0.requests, gw0.lease_timeouts), (50.0, 0.0));
        assert_eq!(
            snap.rates("ns", "gw-1", at(5), max_age),
            None,
            "gw-1 has no process_max_fds"
        );
        assert_eq!(
            snap.rates("ns", "gw-0", at(60), max_age),
            None,
            "stale snapshot"
        );
        r.insert("requests", None);
        let failed = Snapshot::fold(at(0), &r);
        assert_eq!(
            failed.rates("ns", "gw-0", at(5), max_age),
            None,
            "a failed query is missing"
        );
    }

    #[test]
    fn a_stale_snapshot_is_all_missing() {
        let snap = Snapshot::fold(at(0), &round());
        let s = snap.samples("ns", &selection(), at(31), Duration::from_secs(30));
        assert!(s.backends.is_empty() && s.pods.is_empty());
        assert!(
            Snapshot::default()
                .samples("ns", &selection(), at(0), Duration::from_secs(30))
                .backends
                .is_empty()
        );
    }

    /// A Prometheus that accepts connections and never answers (a hung server, or packets
    /// dropped after the handshake): every query of the round fails by its deadline instead of
    /// stalling the poller for good.
    #[tokio::test]
    async fn a_round_against_a_silent_server_ends_at_its_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                open.push(socket);
            }
        });
        let client = prometheus_http_query::Client::try_from(url.as_str()).unwrap();
        let queries = Queries {
            window: Duration::from_secs(30),
            baseline_window: Duration::from_secs(3600),
            freshness: Duration::from_secs(30),
        }
        .all();
        let timeout = Duration::from_millis(300);
        let start = tokio::time::Instant::now();
        let (rows, errors) = query_round(&client, &queries, timeout).await;
        let took = start.elapsed();
        held.abort();
        assert!(
            took >= timeout && took < timeout * 10,
            "the round ended after {took:?}"
        );
        assert_eq!(rows.len(), queries.len());
        assert!(rows.values().all(Option::is_none), "{rows:?}");
        assert_eq!(errors.len(), queries.len());
        for e in &errors {
            assert!(
                matches!(e, PromError::Timeout { after, .. } if *after == timeout),
                "{e:?}"
            );
        }
        assert!(
            errors[0].to_string().contains("no answer within 300ms"),
            "{}",
            errors[0]
        );
    }
}
