//! Prometheus: one batched set of PromQL queries per interval for every policy in the cluster
//! (not one per policy per pod), plus each backend's own saturation query where a policy
//! declares one, folded into a [`Snapshot`], and the pure aggregation of that snapshot into
//! each namespace's planner [`Samples`]. A query error, an empty result, NaN or a sample older
//! than two scrape intervals is missing data, never zero.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use prometheus_http_query::response::Data;

use poolpilot_api::limits::PriorityClass;

use crate::plan::input::{ClassSample, PodPool, TokenRates};
use crate::plan::time::{Timestamp, elapsed};
use crate::plan::waves::PodRates;
use crate::plan::{Acked, BackendSample, PodSample, PolicyKey, Samples, SaturationSignal};

/// Why a Prometheus query failed.
#[derive(Debug, thiserror::Error)]
pub enum PromError {
    /// The round's credentials could not be read (a token or password file): every query of
    /// the round is missing.
    #[error("Prometheus credentials unreadable")]
    Credentials(#[source] crate::prom_connection::ConnectionError),
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

/// How many rate windows the backends' rare events are read over: the idle closes (evidence
/// for the idle timeout), the provider's refusals and the failed certificate checks (for
/// status). The closes are rare by design: each gateway pod meets about one per endpoint before
/// it keeps that endpoint's connections idle for less, so a pod makes a handful in all, within
/// a second or two. A rate over one window sees them only while two of its scrapes straddle
/// them (one or two rounds, and none when a late scrape leaves a single sample in the window);
/// over ten windows every round of the next ten sees them (five minutes with the default 15 s
/// scrapes). Reading the same closes again lowers nothing further (`plan/idle_timeout.rs`).
pub const FINDINGS_WINDOWS: u32 = 10;

/// The queries, with the windows they use.
#[derive(Clone, Debug)]
pub struct Queries {
    /// Averaging window of demand and throughput (the metrics interval, at least two scrape
    /// intervals).
    pub window: Duration,
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
    /// The window rates and averages are taken over.
    pub fn rate_window(&self) -> Duration {
        self.window.max(self.freshness)
    }

    /// The window the backends' rare events are read over: [`FINDINGS_WINDOWS`] rate windows.
    pub fn findings_window(&self) -> Duration {
        findings_window(self.rate_window())
    }

    /// Every query of one round. Ranges bound staleness: a range selector only sees samples
    /// inside its window, unlike an instant selector's five-minute lookback.
    pub fn all(&self) -> Vec<Query> {
        let w = prom_duration(self.rate_window());
        let findings = prom_duration(self.findings_window());
        let fresh = prom_duration(self.freshness);
        let q = |name, promql: String| Query { name, promql };
        vec![
            q(
                "leased",
                format!(
                    "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_connections{{state=\"leased\"}}[{w}]))"
                ),
            ),
            q(
                "pending",
                format!(
                    "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_pending[{w}]))"
                ),
            ),
            q(
                "leased_now",
                format!(
                    "sum by (namespace, pod, backend) (last_over_time(poolpilot_pool_connections{{state=\"leased\"}}[{fresh}]))"
                ),
            ),
            q(
                "pending_now",
                format!(
                    "sum by (namespace, pod, backend) (last_over_time(poolpilot_pool_pending[{fresh}]))"
                ),
            ),
            q(
                "class_leased",
                format!(
                    "sum by (namespace, pod, backend, class) (avg_over_time(poolpilot_pool_class_leased[{w}]))"
                ),
            ),
            q(
                "class_pending",
                format!(
                    "sum by (namespace, pod, backend, class) (avg_over_time(poolpilot_pool_class_pending[{w}]))"
                ),
            ),
            q(
                "max_connections",
                format!(
                    "sum by (namespace, pod, backend) (last_over_time(poolpilot_pool_max_connections[{fresh}]))"
                ),
            ),
            q(
                "completed",
                format!(
                    "sum by (namespace, pod, backend) (rate(poolpilot_upstream_request_duration_seconds_count{{code_class!=\"5xx\"}}[{w}]))"
                ),
            ),
            q(
                "bytes",
                format!(
                    "sum by (namespace, pod, backend) (rate(poolpilot_upstream_response_bytes_total[{w}]))"
                ),
            ),
            q(
                "tokens",
                format!(
                    "sum by (namespace, pod, backend, direction) (rate(poolpilot_tokens_total{{direction=~\"input|output\"}}[{w}]))"
                ),
            ),
            q(
                "busy",
                format!(
                    "sum by (namespace, pod, backend) (rate(poolpilot_upstream_request_duration_seconds_sum{{code_class!=\"5xx\"}}[{w}]))"
                ),
            ),
            q(
                "h2_max_streams",
                format!(
                    "min by (namespace, backend) (last_over_time(poolpilot_upstream_h2_max_concurrent_streams[{fresh}]))"
                ),
            ),
            q(
                "h2_fallback",
                format!(
                    "sum by (namespace, backend) (last_over_time(poolpilot_upstream_h2_fallback[{fresh}]))"
                ),
            ),
            q(
                "peer_idle_close",
                format!(
                    "histogram_quantile(0.05, sum by (namespace, backend, le) (rate(poolpilot_pool_peer_closed_idle_seconds_bucket[{findings}])))"
                ),
            ),
            q(
                "provider_refusals",
                format!(
                    "sum by (namespace, backend) (increase(poolpilot_upstream_cooldowns_total[{findings}]))"
                ),
            ),
            q(
                "cooldown_refused",
                format!(
                    "sum by (namespace, backend) (increase(poolpilot_upstream_cooldown_refused_total[{findings}]))"
                ),
            ),
            q(
                "fallbacks",
                format!(
                    "sum by (namespace, backend) (increase(poolpilot_upstream_fallbacks_total[{findings}]))"
                ),
            ),
            q(
                "tls_verification_failures",
                format!(
                    "sum by (namespace, backend) (increase(poolpilot_upstream_tls_failures_total{{reason=\"certificate\"}}[{findings}]))"
                ),
            ),
            q(
                "ttfb",
                format!(
                    "histogram_quantile(0.5, sum by (namespace, backend, le) (rate(poolpilot_upstream_time_to_first_byte_seconds_bucket[{w}])))"
                ),
            ),
            q(
                "max_fds",
                format!("max by (namespace, pod) (last_over_time(process_max_fds[{fresh}]))"),
            ),
            q(
                "open_fds",
                format!("max by (namespace, pod) (last_over_time(process_open_fds[{fresh}]))"),
            ),
            q(
                "limits_info",
                format!(
                    "max by (namespace, pod, revision, generation) (last_over_time(poolpilot_limits_info[{fresh}]))"
                ),
            ),
            q(
                "requests",
                format!(
                    "sum by (namespace, pod) (rate(poolpilot_upstream_request_duration_seconds_count[{w}]))"
                ),
            ),
            q(
                "lease_timeouts",
                format!("sum by (namespace, pod) (rate(poolpilot_pool_lease_timeouts_total[{w}]))"),
            ),
            q(
                "upstream_5xx",
                format!(
                    "sum by (namespace, pod) (rate(poolpilot_upstream_request_duration_seconds_count{{code_class=\"5xx\"}}[{w}]))"
                ),
            ),
            q(
                "client_tokens",
                format!(
                    "60 * sum by (namespace, pod, client_policy, client) (rate(poolpilot_client_tokens_total[{w}]))"
                ),
            ),
            q(
                "p90",
                format!(
                    "histogram_quantile(0.9, sum by (namespace, pod, le) (rate(poolpilot_upstream_request_duration_seconds_bucket[{w}])))"
                ),
            ),
        ]
    }
}

/// (namespace, policy, backend) of a saturation query.
pub type SaturationKey = (String, String, String);

/// The backends' own saturation queries (`spec.backends[].saturation.query`): each reconcile
/// sets its policy's, the poller runs them all with the other queries every round. Cheap to
/// clone; clones share the map.
#[derive(Clone, Debug, Default)]
pub struct SaturationQueries(Arc<RwLock<BTreeMap<SaturationKey, String>>>);

impl SaturationQueries {
    /// Makes `queries` (backend, PromQL) the saturation queries of `policy`, dropping the ones
    /// its spec no longer has.
    pub fn set(&self, policy: &PolicyKey, queries: impl IntoIterator<Item = (String, String)>) {
        let mut map = self.0.write();
        map.retain(|(ns, name, _), _| !(ns == &policy.namespace && name == &policy.name));
        for (backend, promql) in queries {
            map.insert(
                (policy.namespace.clone(), policy.name.clone(), backend),
                promql,
            );
        }
    }

    /// Every query, for one round.
    pub fn all(&self) -> Vec<(SaturationKey, String)> {
        self.0
            .read()
            .iter()
            .map(|(k, q)| (k.clone(), q.clone()))
            .collect()
    }
}

/// Seconds as a PromQL duration (`15s`).
fn prom_duration(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

/// Values per (namespace, pod, backend, priority class).
pub type ByClass = BTreeMap<(String, String, String, String), f64>;

/// One query's rows: labels and a finite value. `None`: the query failed.
pub type Rows = Option<Vec<(HashMap<String, String>, f64)>>;

/// What one round of queries returned, keyed by Kubernetes names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// When the round ran.
    pub at: Option<Timestamp>,
    /// The window its averages and rates are taken over.
    pub window: Duration,
    /// Leased connections per (namespace, pod, backend); `None` when the query failed.
    pub leased: Option<BTreeMap<(String, String, String), f64>>,
    /// Pending lease requests per (namespace, pod, backend).
    pub pending: Option<BTreeMap<(String, String, String), f64>>,
    /// Leased connections at the latest scrape, per (namespace, pod, backend).
    pub leased_now: Option<BTreeMap<(String, String, String), f64>>,
    /// Pending lease requests at the latest scrape, per (namespace, pod, backend).
    pub pending_now: Option<BTreeMap<(String, String, String), f64>>,
    /// Connections held per (namespace, pod, backend, class), averaged over the window.
    pub class_leased: Option<ByClass>,
    /// Pending lease requests per (namespace, pod, backend, class), averaged over the window.
    pub class_pending: Option<ByClass>,
    /// The pools' caps (per endpoint) at the latest scrape, per (namespace, pod, backend).
    pub max_connections: Option<BTreeMap<(String, String, String), f64>>,
    /// Calls completed without a 5xx per second, per (namespace, pod, backend).
    pub completed: Option<BTreeMap<(String, String, String), f64>>,
    /// Response body bytes per second, per (namespace, pod, backend).
    pub bytes: Option<BTreeMap<(String, String, String), f64>>,
    /// Input model tokens per second, per (namespace, pod, backend).
    pub input_tokens: Option<BTreeMap<(String, String, String), f64>>,
    /// Output model tokens per second, per (namespace, pod, backend).
    pub output_tokens: Option<BTreeMap<(String, String, String), f64>>,
    /// Seconds of calls completed without a 5xx, per second, per (namespace, pod, backend).
    pub busy: Option<BTreeMap<(String, String, String), f64>>,
    /// Median time to first byte per (namespace, backend).
    pub ttfb: Option<BTreeMap<(String, String), f64>>,
    /// The smallest HTTP/2 stream limit a backend's servers sent, per (namespace, backend).
    pub h2_max_streams: Option<BTreeMap<(String, String), f64>>,
    /// Addresses on the HTTP/1.1 fallback of `auto`, summed over the pods, per (namespace, backend).
    pub h2_fallback: Option<BTreeMap<(String, String), f64>>,
    /// The 5th percentile of the idle times at which the pods found connections closed by the
    /// backend, per (namespace, backend); absent (NaN) when they found none.
    pub peer_idle_close: Option<BTreeMap<(String, String), f64>>,
    /// The provider's refusals with a time to come back, summed over the pods over the findings
    /// window, per (namespace, backend).
    pub provider_refusals: Option<BTreeMap<(String, String), f64>>,
    /// Calls the gateways refused meanwhile, per (namespace, backend), over the same window.
    pub cooldown_refused: Option<BTreeMap<(String, String), f64>>,
    /// Calls sent meanwhile to a fallback, per (namespace, backend), over the same window.
    pub fallbacks: Option<BTreeMap<(String, String), f64>>,
    /// Calls whose TLS handshake failed verification of the backend's certificate, per
    /// (namespace, backend), over the same window.
    pub tls_verification_failures: Option<BTreeMap<(String, String), f64>>,
    /// Each saturation query as it ran and its value (`None`: failed, empty or NaN).
    pub saturation: BTreeMap<SaturationKey, (String, Option<f64>)>,
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
    /// Upstream calls answered 5xx per second per (namespace, pod).
    pub upstream_5xx: Option<BTreeMap<(String, String), f64>>,
    /// p90 of upstream call duration per (namespace, pod); absent (NaN) without calls.
    pub p90: Option<BTreeMap<(String, String), f64>>,
    /// Tokens a minute charged to clients' budgets per (namespace, pod, client policy, client).
    pub client_tokens: Option<ByClass>,
}

/// The finite samples of `rows` by the key `key` reads from their labels; rows without it, and
/// NaN or infinite values (missing data), are left out.
fn keyed<K: Ord>(
    rows: Rows,
    key: impl Fn(&HashMap<String, String>) -> Option<K>,
) -> Option<BTreeMap<K, f64>> {
    rows.map(|r| {
        r.into_iter()
            .filter(|(_, v)| v.is_finite())
            .filter_map(|(l, v)| Some((key(&l)?, v)))
            .collect()
    })
}

/// The findings window of a round whose rates are taken over `rate_window`.
fn findings_window(rate_window: Duration) -> Duration {
    rate_window * FINDINGS_WINDOWS
}

/// The (namespace, pod, backend) of a row.
fn pod_backend(labels: &HashMap<String, String>) -> Option<(String, String, String)> {
    Some((
        label(labels, "namespace")?,
        label(labels, "pod")?,
        label(labels, "backend")?,
    ))
}

/// The value of one label.
fn label(labels: &HashMap<String, String>, name: &str) -> Option<String> {
    labels.get(name).cloned()
}

impl Snapshot {
    /// Folds the rows of one round (in [`Queries::all`] order, by name) into a snapshot. NaN
    /// and infinite values are dropped: they are missing data.
    pub fn fold(at: Timestamp, window: Duration, rows: &BTreeMap<&'static str, Rows>) -> Self {
        let get = |name: &str| rows.get(name).cloned().flatten();
        let by_pod_backend = |name: &str| keyed(get(name), pod_backend);
        let by_class = |name: &str| {
            keyed(get(name), |l| {
                Some((
                    label(l, "namespace")?,
                    label(l, "pod")?,
                    label(l, "backend")?,
                    label(l, "class")?,
                ))
            })
        };
        // One query answers both directions: its rows of one direction.
        let tokens = |direction: &str| {
            keyed(get("tokens"), |l| {
                (l.get("direction")? == direction).then(|| pod_backend(l))?
            })
        };
        let by = |name: &str, key: &str| {
            keyed(get(name), |l| {
                Some((label(l, "namespace")?, label(l, key)?))
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
            window,
            leased: by_pod_backend("leased"),
            pending: by_pod_backend("pending"),
            leased_now: by_pod_backend("leased_now"),
            pending_now: by_pod_backend("pending_now"),
            class_leased: by_class("class_leased"),
            class_pending: by_class("class_pending"),
            max_connections: by_pod_backend("max_connections"),
            completed: by_pod_backend("completed"),
            bytes: by_pod_backend("bytes"),
            input_tokens: tokens("input"),
            output_tokens: tokens("output"),
            busy: by_pod_backend("busy"),
            ttfb: by("ttfb", "backend"),
            h2_max_streams: by("h2_max_streams", "backend"),
            h2_fallback: by("h2_fallback", "backend"),
            peer_idle_close: by("peer_idle_close", "backend"),
            provider_refusals: by("provider_refusals", "backend"),
            cooldown_refused: by("cooldown_refused", "backend"),
            fallbacks: by("fallbacks", "backend"),
            tls_verification_failures: by("tls_verification_failures", "backend"),
            saturation: BTreeMap::new(),
            max_fds: by("max_fds", "pod"),
            open_fds: by("open_fds", "pod"),
            limits_info,
            requests: by("requests", "pod"),
            lease_timeouts: by("lease_timeouts", "pod"),
            upstream_5xx: by("upstream_5xx", "pod"),
            p90: by("p90", "pod"),
            client_tokens: keyed(get("client_tokens"), |l| {
                Some((
                    label(l, "namespace")?,
                    label(l, "pod")?,
                    label(l, "client_policy")?,
                    label(l, "client")?,
                ))
            }),
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
            upstream_5xx: get(&self.upstream_5xx)?,
            // A failed query or no calls: latency is not compared.
            p90: self.p90.as_ref().and_then(|m| m.get(&key).copied()),
        })
    }

    /// The planner's samples for one namespace. `selection` maps each policy to the pods it
    /// selects and the backends it declares, each with its saturation query if it has one. A
    /// snapshot older than `max_age` is all missing.
    pub fn samples(
        &self,
        namespace: &str,
        selection: &[Selection],
        now: Timestamp,
        max_age: Duration,
    ) -> Samples {
        let mut out = Samples::default();
        if self.at.is_none_or(|t| elapsed(t, now) > max_age) {
            return out;
        }
        let ns = namespace.to_owned();
        for Selection {
            policy: key,
            pods,
            ready,
            backends,
        } in selection
        {
            let is_scraped = |p: &String| {
                self.max_fds
                    .as_ref()
                    .is_some_and(|m| m.contains_key(&(ns.clone(), p.clone())))
            };
            // Counters appear with their first increment: for a pod that is scraped (it has a
            // fresh `process_max_fds`), an absent series is no calls yet, which is zero.
            let scraped = pods.iter().any(is_scraped);
            // A ready pod serves traffic: if it is not scraped, the fleet's demand is not the
            // sum of the others' (it would be too small), it is missing.
            let unscraped = ready.iter().filter(|p| !is_scraped(p)).count() as u32;
            for (backend, saturation_query) in backends {
                let values = |m: &Option<BTreeMap<(String, String, String), f64>>| {
                    let m = m.as_ref()?;
                    let vals: Vec<f64> = pods
                        .iter()
                        .filter_map(|p| m.get(&(ns.clone(), p.clone(), backend.clone())).copied())
                        .collect();
                    Some(vals)
                };
                let gauge = |m| {
                    values(m)
                        .filter(|v| unscraped == 0 && !v.is_empty())
                        .map(|v| v.iter().sum())
                };
                let counter = |m| {
                    values(m)
                        .filter(|v| unscraped == 0 && (scraped || !v.is_empty()))
                        .map(|v| v.iter().sum())
                };
                // A class's demand: summed over the pods like the totals; missing when any
                // pod lacks it (a gateway too old to report classes) or one is unscraped.
                let class_gauge = |m: &Option<ByClass>, class: &str| {
                    let m = m.as_ref()?;
                    let vals: Vec<f64> = pods
                        .iter()
                        .filter_map(|p| {
                            m.get(&(ns.clone(), p.clone(), backend.clone(), class.to_owned()))
                                .copied()
                        })
                        .collect();
                    (unscraped == 0 && !vals.is_empty()).then(|| vals.iter().sum())
                };
                let classes = PriorityClass::ALL.map(|c| ClassSample {
                    leased: class_gauge(&self.class_leased, c.as_str()),
                    pending: class_gauge(&self.class_pending, c.as_str()),
                });
                let fleet = |m: &Option<BTreeMap<(String, String), f64>>| {
                    m.as_ref()?.get(&(ns.clone(), backend.clone())).copied()
                };
                // Tokens are counted only for model calls: a backend none of the pods counted
                // any for has no token throughput to report (missing, not zero). Once one has,
                // a direction without series is none yet.
                let tokens = values(&self.input_tokens)
                    .zip(values(&self.output_tokens))
                    .filter(|(i, o)| unscraped == 0 && !(i.is_empty() && o.is_empty()))
                    .map(|(i, o)| TokenRates {
                        input: i.iter().sum(),
                        output: o.iter().sum(),
                    });
                let saturation = match saturation_query {
                    None => SaturationSignal::NotConfigured,
                    Some(q) => {
                        match self
                            .saturation
                            .get(&(ns.clone(), key.name.clone(), backend.clone()))
                        {
                            Some((ran, value)) if ran == q => {
                                value.map_or(SaturationSignal::Missing, SaturationSignal::Value)
                            }
                            _ => SaturationSignal::Pending,
                        }
                    }
                };
                out.backends.insert(
                    (key.clone(), backend.clone()),
                    BackendSample {
                        leased: gauge(&self.leased),
                        pending: gauge(&self.pending),
                        leased_now: gauge(&self.leased_now),
                        pending_now: gauge(&self.pending_now),
                        completed: counter(&self.completed),
                        bytes: counter(&self.bytes),
                        busy: counter(&self.busy),
                        ttfb: fleet(&self.ttfb),
                        h2_max_streams: fleet(&self.h2_max_streams),
                        h2_fallback: fleet(&self.h2_fallback),
                        peer_idle_close: fleet(&self.peer_idle_close),
                        provider_refusals: fleet(&self.provider_refusals),
                        cooldown_refused: fleet(&self.cooldown_refused),
                        fallbacks: fleet(&self.fallbacks),
                        tls_verification_failures: fleet(&self.tls_verification_failures),
                        findings_window: findings_window(self.window),
                        window: self.window,
                        saturation,
                        unscraped,
                        // What the pods run is known only when every ready one is scraped.
                        current: values(&self.max_connections)
                            .filter(|v| unscraped == 0 && !v.is_empty())
                            .map(|v| v.iter().sum()),
                        classes,
                        tokens,
                    },
                );
            }
            // Each scraped pod's own pool, for the division: a series it does not report (no
            // pool for the backend yet) is zero, since the pod is scraped.
            for pod in pods.iter().filter(|p| is_scraped(p)) {
                for (backend, _) in backends {
                    let at = (ns.clone(), pod.clone(), backend.clone());
                    let get = |m: &Option<BTreeMap<(String, String, String), f64>>| {
                        m.as_ref().map(|m| m.get(&at).copied().unwrap_or(0.0))
                    };
                    if let (Some(leased), Some(pending), Some(leased_now)) =
                        (get(&self.leased), get(&self.pending), get(&self.leased_now))
                    {
                        out.pools.insert(
                            (key.clone(), backend.clone(), pod.clone()),
                            PodPool {
                                leased,
                                pending,
                                leased_now,
                            },
                        );
                    }
                }
            }
            // Each scraped pod's token use per client of the policy (its client policy in the
            // documents is named after it): a series it does not report is no use yet.
            if let Some(m) = &self.client_tokens {
                let name = crate::plan::render::client_policy_base(&key.name);
                for pod in pods.iter().filter(|p| is_scraped(p)) {
                    let used: BTreeMap<String, f64> = m
                        .range(
                            (ns.clone(), pod.clone(), name.clone(), String::new())
                                ..(ns.clone(), pod.clone(), format!("{name}\0"), String::new()),
                        )
                        .filter(|((.., policy, _), _)| policy == &name)
                        .map(|((.., client), v)| (client.clone(), v.max(0.0)))
                        .collect();
                    out.token_use.insert((key.clone(), pod.clone()), used);
                }
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

/// One policy as [`Snapshot::samples`] reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// The policy.
    pub policy: PolicyKey,
    /// The pods it selects.
    pub pods: Vec<String>,
    /// Of those, the ready ones (they serve traffic, so their samples must be there).
    pub ready: Vec<String>,
    /// Its backends, each with its saturation query if it has one.
    pub backends: Vec<(String, Option<String>)>,
}

/// The value of a saturation query's answer: the largest finite value (`None`: no value).
pub fn saturation_value(rows: &[(HashMap<String, String>, f64)]) -> Option<f64> {
    rows.iter()
        .map(|(_, v)| *v)
        .filter(|v| v.is_finite())
        .reduce(f64::max)
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

/// The distinct PromQL of the saturation queries, in order: backends of many policies that
/// declare the same query (a templated policy per tenant) share one query per round.
pub fn distinct_saturation(saturation: &[(SaturationKey, String)]) -> Vec<&str> {
    saturation
        .iter()
        .map(|(_, q)| q.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The saturation queries of one round: every backend's, and the distinct PromQL among them
/// ([`distinct_saturation`], computed once: the round sends each once, the poller counts them).
#[derive(Debug)]
pub struct SaturationRound<'a> {
    /// Each backend's query.
    pub backends: &'a [(SaturationKey, String)],
    /// The distinct PromQL of `backends`, in order.
    pub distinct: Vec<&'a str>,
}

impl<'a> SaturationRound<'a> {
    /// The round of `backends`' queries.
    pub fn new(backends: &'a [(SaturationKey, String)]) -> Self {
        Self {
            backends,
            distinct: distinct_saturation(backends),
        }
    }
}

/// Runs one round of queries (the fixed set and each distinct saturation query once),
/// concurrently, each bounded by `timeout` (a query that runs out of time is cancelled), and
/// folds it into a snapshot taken at `at` with the saturation queries' values. A failed query
/// leaves its rows `None`; the errors come back too, for logs and the query-error metric.
pub async fn query_round(
    client: &prometheus_http_query::Client,
    headers: &http::HeaderMap,
    queries: &Queries,
    saturation: &SaturationRound<'_>,
    timeout: Duration,
    at: impl FnOnce() -> Timestamp,
) -> (Snapshot, Vec<PromError>) {
    let fixed = queries.all();
    let distinct = &saturation.distinct;
    let all = fixed
        .iter()
        .map(|q| (q.name, q.promql.as_str()))
        .chain(distinct.iter().map(|q| ("saturation", *q)));
    let answers = futures::future::join_all(all.map(|(name, promql)| async move {
        let mut query = client.query(promql);
        for (header, value) in headers {
            query = query.header(header.clone(), value.clone());
        }
        match tokio::time::timeout(timeout, query.get()).await {
            Ok(answer) => answer
                .map(|r| rows(r.data()))
                .map_err(|source| PromError::Query { name, source }),
            Err(_) => Err(PromError::Timeout {
                name,
                after: timeout,
            }),
        }
    }))
    .await;
    let mut errors = Vec::new();
    let mut answers = answers
        .into_iter()
        .map(|a| a.map_err(|e| errors.push(e)).ok());
    let by_name: BTreeMap<&'static str, Rows> = fixed
        .iter()
        .map(|q| (q.name, answers.next().flatten()))
        .collect();
    // Each distinct PromQL ran once; every backend that declares it reads the same answer.
    let by_promql: BTreeMap<&str, Option<f64>> = distinct
        .iter()
        .map(|q| {
            let value = answers.next().flatten().and_then(|r| saturation_value(&r));
            (*q, value)
        })
        .collect();
    let values: BTreeMap<SaturationKey, (String, Option<f64>)> = saturation
        .backends
        .iter()
        .map(|(key, q)| {
            let value = by_promql.get(q.as_str()).copied().flatten();
            (key.clone(), (q.clone(), value))
        })
        .collect();
    let mut snapshot = Snapshot::fold(at(), queries.rate_window(), &by_name);
    snapshot.saturation = values;
    (snapshot, errors)
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

    fn selection() -> Vec<Selection> {
        vec![Selection {
            policy: key(),
            pods: vec!["gw-0".into(), "gw-1".into()],
            ready: vec![],
            backends: vec![("model-a".into(), None)],
        }]
    }

    fn fold(r: &BTreeMap<&'static str, Rows>) -> Snapshot {
        Snapshot::fold(at(0), Duration::from_secs(30), r)
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
            ("completed", Some(vec![pb("gw-0", 20.0), pb("gw-9", 500.0)])),
            ("bytes", Some(vec![pb("gw-0", 4000.0), pb("gw-1", 6000.0)])),
            (
                "ttfb",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    0.25,
                )]),
            ),
            (
                "h2_max_streams",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    250.0,
                )]),
            ),
            (
                "h2_fallback",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    2.0,
                )]),
            ),
            (
                "provider_refusals",
                Some(vec![row(
                    &[("namespace", "ns"), ("backend", "model-a")],
                    23.4,
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
            freshness: Duration::from_secs(30),
        };
        let all = q.all();
        assert_eq!(all.len(), 27, "one round for every policy in the cluster");
        let sizing = include_str!("../../docs/operating.md");
        assert!(
            sizing.contains(&format!("a fixed round of {} queries", all.len())),
            "docs/operating.md's sizing table names another count of queries per round"
        );
        let promql = |name| &all.iter().find(|q| q.name == name).unwrap().promql;
        assert_eq!(
            promql("leased"),
            "sum by (namespace, pod, backend) (avg_over_time(poolpilot_pool_connections{state=\"leased\"}[30s]))"
        );
        assert_eq!(
            promql("pending_now"),
            "sum by (namespace, pod, backend) (last_over_time(poolpilot_pool_pending[30s]))"
        );
        assert_eq!(
            promql("completed"),
            "sum by (namespace, pod, backend) (rate(poolpilot_upstream_request_duration_seconds_count{code_class!=\"5xx\"}[30s]))",
            "a backend refusing with 503 completes nothing"
        );
        assert_eq!(
            promql("tokens"),
            "sum by (namespace, pod, backend, direction) (rate(poolpilot_tokens_total{direction=~\"input|output\"}[30s]))",
            "one query for both directions, whatever the counts' source"
        );
        assert_eq!(
            promql("busy"),
            "sum by (namespace, pod, backend) (rate(poolpilot_upstream_request_duration_seconds_sum{code_class!=\"5xx\"}[30s]))",
            "the seconds of the calls counted in `completed`"
        );
        assert!(
            include_str!("../../docs/autoscaling.md")
                .contains(&promql("busy").replace("[30s]", "[1m]")),
            "docs/autoscaling.md shows another query for the calls' time"
        );
        assert_eq!(
            promql("ttfb"),
            "histogram_quantile(0.5, sum by (namespace, backend, le) (rate(poolpilot_upstream_time_to_first_byte_seconds_bucket[30s])))"
        );
        assert_eq!(
            promql("h2_max_streams"),
            "min by (namespace, backend) (last_over_time(poolpilot_upstream_h2_max_concurrent_streams[30s]))",
            "the smallest limit any pod's connections carry"
        );
        assert_eq!(
            promql("h2_fallback"),
            "sum by (namespace, backend) (last_over_time(poolpilot_upstream_h2_fallback[30s]))"
        );
        assert_eq!(
            promql("peer_idle_close"),
            "histogram_quantile(0.05, sum by (namespace, backend, le) (rate(poolpilot_pool_peer_closed_idle_seconds_bucket[300s])))",
            "the least idle times at which the pods found the backend's closes, over ten windows"
        );
        assert!(
            include_str!("../../docs/autoscaling.md")
                .contains(&promql("peer_idle_close").replace("[300s]", "[10W]")),
            "docs/autoscaling.md shows another query for the backend's idle closes"
        );
        assert_eq!(
            promql("provider_refusals"),
            "sum by (namespace, backend) (increase(poolpilot_upstream_cooldowns_total[300s]))"
        );
        assert_eq!(
            promql("cooldown_refused"),
            "sum by (namespace, backend) (increase(poolpilot_upstream_cooldown_refused_total[300s]))"
        );
        assert_eq!(
            promql("fallbacks"),
            "sum by (namespace, backend) (increase(poolpilot_upstream_fallbacks_total[300s]))"
        );
        assert_eq!(
            promql("tls_verification_failures"),
            "sum by (namespace, backend) (increase(poolpilot_upstream_tls_failures_total{reason=\"certificate\"}[300s]))"
        );
        assert_eq!(
            promql("max_fds"),
            "max by (namespace, pod) (last_over_time(process_max_fds[30s]))"
        );
        assert_eq!(
            promql("client_tokens"),
            "60 * sum by (namespace, pod, client_policy, client) (rate(poolpilot_client_tokens_total[30s]))"
        );
    }

    #[test]
    fn token_use_is_read_per_scraped_pod_and_client_of_the_policy_only() {
        let mut r = round();
        let used = |pod, policy, client, v| {
            row(
                &[
                    ("namespace", "ns"),
                    ("pod", pod),
                    ("client_policy", policy),
                    ("client", client),
                ],
                v,
            )
        };
        r.insert(
            "client_tokens",
            Some(vec![
                used("gw-0", "p", "batch", 1200.0),
                used("gw-0", "p", "other", 30.0),
                used("gw-0", "p2", "batch", 999.0),
                used("gw-9", "p", "batch", 5.0),
                used("gw-1", "p", "batch", 7.0),
            ]),
        );
        let s = fold(&r).samples("ns", &selection(), at(5), Duration::from_secs(30));
        let gw0 = &s.token_use[&(key(), "gw-0".into())];
        assert_eq!(
            gw0,
            &BTreeMap::from([("batch".to_owned(), 1200.0), ("other".to_owned(), 30.0)]),
            "another policy's series are not this one's"
        );
        assert!(
            !s.token_use.contains_key(&(key(), "gw-1".into())),
            "gw-1 is not scraped: its use is missing, not its series' value"
        );
        // A scraped pod without a series used nothing; a failed query is missing.
        r.insert("client_tokens", Some(vec![]));
        let s = fold(&r).samples("ns", &selection(), at(5), Duration::from_secs(30));
        assert_eq!(s.token_use[&(key(), "gw-0".into())], BTreeMap::new());
        r.insert("client_tokens", None);
        let s = fold(&r).samples("ns", &selection(), at(5), Duration::from_secs(30));
        assert!(s.token_use.is_empty());
    }

    #[test]
    fn fleet_demand_sums_the_selected_pods_only() {
        let snap = fold(&round());
        let s = snap.samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(b.leased, Some(300.0), "gw-9 is not selected");
        assert_eq!(b.pending, Some(150.0));
        assert_eq!(b.completed, Some(20.0), "gw-1 completed nothing yet");
        assert_eq!(b.bytes, Some(10_000.0));
        assert_eq!(b.ttfb, Some(0.25));
        assert_eq!(b.h2_max_streams, Some(250.0));
        assert_eq!(b.h2_fallback, Some(2.0));
        assert_eq!(b.provider_refusals, Some(23.4));
        assert_eq!(b.cooldown_refused, None, "not in this round");
        assert_eq!(b.findings_window, Duration::from_secs(300));
        assert_eq!(b.window, Duration::from_secs(30));
        assert_eq!(b.saturation, SaturationSignal::NotConfigured);
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
    fn token_rates_are_summed_over_the_selected_pods_and_missing_when_none_counted_any() {
        let tokens = |pod, backend, direction, v| {
            row(
                &[
                    ("namespace", "ns"),
                    ("pod", pod),
                    ("backend", backend),
                    ("direction", direction),
                ],
                v,
            )
        };
        let mut r = round();
        r.insert(
            "tokens",
            Some(vec![
                tokens("gw-0", "model-a", "input", 1200.5),
                tokens("gw-0", "model-a", "output", 300.0),
                tokens("gw-0", "model-a", "cached_input", 800.0),
                tokens("gw-1", "model-a", "input", 100.0),
                tokens("gw-9", "model-a", "output", 5000.0),
                tokens("gw-0", "model-b", "output", 70.0),
            ]),
        );
        let tokens_of = |r: &BTreeMap<&'static str, Rows>, sel: &[Selection]| {
            fold(r)
                .samples("ns", sel, at(5), Duration::from_secs(30))
                .backends[&(key(), "model-a".into())]
                .tokens
        };
        assert_eq!(
            tokens_of(&r, &selection()),
            Some(TokenRates {
                input: 1300.5,
                output: 300.0
            }),
            "gw-9 is not selected, model-b is another backend, cached input is already in input"
        );
        let mut sel = selection();
        sel[0].ready = vec!["gw-0".into(), "gw-1".into()];
        assert_eq!(
            tokens_of(&r, &sel),
            None,
            "gw-1 is ready and unscraped: the sum would be too small"
        );
        r.insert(
            "tokens",
            Some(vec![tokens("gw-9", "model-a", "input", 10.0)]),
        );
        assert_eq!(
            tokens_of(&r, &selection()),
            None,
            "no selected pod counted tokens for the backend: none to report, not zero"
        );
        r.insert("tokens", None);
        assert_eq!(
            tokens_of(&r, &selection()),
            None,
            "a failed query is missing"
        );
    }

    #[test]
    fn failed_empty_and_nan_answers_are_missing_never_zero() {
        let mut r = round();
        r.insert("leased", None); // query error
        r.insert("pending", Some(vec![])); // empty result
        r.insert(
            "ttfb",
            Some(vec![row(
                &[("namespace", "ns"), ("backend", "model-a")],
                f64::NAN,
            )]),
        );
        r.insert("completed", None);
        let snap = fold(&r);
        let s = snap.samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!((b.leased, b.pending, b.ttfb), (None, None, None));
        assert_eq!(b.completed, None, "a failed query is missing");
        assert_eq!(b.bytes, Some(10_000.0));
    }

    #[test]
    fn throughput_of_scraped_pods_without_calls_is_zero_and_of_unscraped_pods_missing() {
        let mut r = round();
        r.insert("completed", Some(vec![]));
        r.insert("bytes", Some(vec![]));
        let s = fold(&r).samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(
            (b.completed, b.bytes),
            (Some(0.0), Some(0.0)),
            "gw-0 is scraped: its counters appear with their first call"
        );
        r.insert("max_fds", Some(vec![]));
        let s = fold(&r).samples("ns", &selection(), at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(
            (b.completed, b.bytes),
            (None, None),
            "no selected pod is scraped"
        );
    }

    #[test]
    fn saturation_queries_are_per_policy_and_read_only_when_they_ran_as_configured() {
        let queries = SaturationQueries::default();
        let other = PolicyKey {
            namespace: "ns".into(),
            name: "q".into(),
        };
        queries.set(&key(), [("model-a".to_owned(), "up".to_owned())]);
        queries.set(&other, [("model-b".to_owned(), "up2".to_owned())]);
        queries.set(&key(), [("model-a".to_owned(), "waiting".to_owned())]);
        assert_eq!(
            queries.all(),
            [
                (
                    ("ns".into(), "p".into(), "model-a".into()),
                    "waiting".into()
                ),
                (("ns".into(), "q".into(), "model-b".into()), "up2".into()),
            ]
        );
        queries.set(&other, []);
        assert_eq!(queries.all().len(), 1, "a policy's queries can all go");

        let selection = |q: &str| -> Vec<Selection> {
            vec![Selection {
                policy: key(),
                pods: vec!["gw-0".into()],
                ready: vec!["gw-0".into()],
                backends: vec![("model-a".into(), Some(q.to_owned()))],
            }]
        };
        let mut snap = fold(&round());
        let sat = |snap: &Snapshot, q: &str| {
            snap.samples("ns", &selection(q), at(5), Duration::from_secs(30))
                .backends[&(key(), "model-a".into())]
                .saturation
        };
        assert_eq!(
            sat(&snap, "waiting"),
            SaturationSignal::Pending,
            "not run yet"
        );
        let k: SaturationKey = ("ns".into(), "p".into(), "model-a".into());
        snap.saturation
            .insert(k.clone(), ("waiting".into(), Some(3.0)));
        assert_eq!(sat(&snap, "waiting"), SaturationSignal::Value(3.0));
        assert_eq!(
            sat(&snap, "edited"),
            SaturationSignal::Pending,
            "an edited query waits for its own answer"
        );
        snap.saturation.insert(k, ("waiting".into(), None));
        assert_eq!(sat(&snap, "waiting"), SaturationSignal::Missing);
        assert_eq!(
            saturation_value(&[row(&[], 1.0), row(&[], f64::NAN), row(&[], 4.0)]),
            Some(4.0),
            "the largest series counts"
        );
        assert_eq!(saturation_value(&[]), None, "empty is missing, never zero");
    }

    #[test]
    fn pod_rates_need_a_scraped_pod_and_default_absent_counters_to_zero() {
        let mut r = round();
        r.insert(
            "requests",
            Some(vec![row(&[("namespace", "ns"), ("pod", "gw-0")], 50.0)]),
        );
        r.insert("lease_timeouts", Some(vec![]));
        r.insert(
            "upstream_5xx",
            Some(vec![row(&[("namespace", "ns"), ("pod", "gw-0")], 5.0)]),
        );
        r.insert(
            "p90",
            Some(vec![
                row(&[("namespace", "ns"), ("pod", "gw-0")], 1.25),
                row(&[("namespace", "ns"), ("pod", "gw-1")], f64::NAN),
            ]),
        );
        let snap = fold(&r);
        let max_age = Duration::from_secs(30);
        let gw0 = snap
            .rates("ns", "gw-0", at(5), max_age)
            .expect("gw-0 is scraped");
        assert_eq!(
            (gw0.requests, gw0.lease_timeouts, gw0.upstream_5xx, gw0.p90),
            (50.0, 0.0, 5.0, Some(1.25))
        );
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
        let failed = fold(&r);
        assert_eq!(
            failed.rates("ns", "gw-0", at(5), max_age),
            None,
            "a failed query is missing"
        );
    }

    #[test]
    fn a_ready_pod_without_fresh_samples_makes_demand_missing_not_smaller() {
        let snap = fold(&round());
        let mut sel = selection();
        sel[0].ready = vec!["gw-0".into()];
        let s = snap.samples("ns", &sel, at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(
            (b.leased, b.unscraped),
            (Some(300.0), 0),
            "gw-1 is not ready: it serves nothing, its absence is not a hole"
        );
        sel[0].ready = vec!["gw-0".into(), "gw-1".into()];
        let s = snap.samples("ns", &sel, at(5), Duration::from_secs(30));
        let b = s.backends[&(key(), "model-a".into())];
        assert_eq!(b.unscraped, 1, "gw-1 is ready and has no process_max_fds");
        assert_eq!(
            (b.leased, b.pending, b.leased_now, b.pending_now),
            (None, None, None, None),
            "the demand of the scraped pods alone would be too small"
        );
        assert_eq!((b.completed, b.bytes), (None, None));
        assert_eq!(b.ttfb, Some(0.25), "a fleet quantile, not a sum: it stays");
    }

    proptest::proptest! {
        /// Whatever pods are selected, ready and scraped: the demand is the sum over the
        /// selected pods when every ready one is scraped, and missing otherwise.
        #[test]
        fn demand_is_the_whole_sum_or_missing(
            pods in proptest::collection::vec(
                (proptest::bool::ANY, proptest::bool::ANY, proptest::option::of(0u32..1000)),
                1..12,
            )
        ) {
            let name = |i: usize| format!("gw-{i}");
            let mut rows: BTreeMap<&'static str, Rows> = BTreeMap::new();
            let mut leased = Vec::new();
            let mut max_fds = Vec::new();
            for (i, (_, scraped, value)) in pods.iter().enumerate() {
                let n = name(i);
                if *scraped {
                    max_fds.push(row(&[("namespace", "ns"), ("pod", &n)], 1024.0));
                    if let Some(v) = value {
                        leased.push(row(
                            &[("namespace", "ns"), ("pod", &n), ("backend", "model-a")],
                            f64::from(*v),
                        ));
                    }
                }
            }
            rows.insert("leased", Some(leased));
            rows.insert("max_fds", Some(max_fds));
            let sel = vec![Selection {
                policy: key(),
                pods: (0..pods.len()).map(name).collect(),
                ready: pods
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.0)
                    .map(|(i, _)| name(i))
                    .collect(),
                backends: vec![("model-a".into(), None)],
            }];
            let s = fold(&rows).samples("ns", &sel, at(5), Duration::from_secs(30));
            let b = s.backends[&(key(), "model-a".into())];
            let holes = pods.iter().filter(|(ready, scraped, _)| *ready && !*scraped).count();
            proptest::prop_assert_eq!(b.unscraped as usize, holes);
            let present: Vec<f64> = pods
                .iter()
                .filter(|(_, scraped, _)| *scraped)
                .filter_map(|(_, _, v)| v.map(f64::from))
                .collect();
            if holes > 0 || present.is_empty() {
                proptest::prop_assert_eq!(b.leased, None);
            } else {
                proptest::prop_assert_eq!(b.leased, Some(present.iter().sum::<f64>()));
            }
        }
    }

    #[test]
    fn a_stale_snapshot_is_all_missing() {
        let snap = fold(&round());
        let s = snap.samples("ns", &selection(), at(31), Duration::from_secs(30));
        assert!(s.backends.is_empty() && s.pods.is_empty());
        assert!(
            Snapshot::default()
                .samples("ns", &selection(), at(0), Duration::from_secs(30))
                .backends
                .is_empty()
        );
    }

    /// A client of the Prometheus at `url`, and the queries of a 30 s window it is sent.
    fn prometheus_at(url: &str) -> (prometheus_http_query::Client, Queries) {
        let client =
            prometheus_http_query::Client::from(crate::http_client().build().unwrap(), url)
                .unwrap();
        let queries = Queries {
            window: Duration::from_secs(30),
            freshness: Duration::from_secs(30),
        };
        (client, queries)
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
        let (client, queries) = prometheus_at(&url);
        let saturation = [(
            ("ns".to_owned(), "p".to_owned(), "model-a".to_owned()),
            "vllm:num_requests_waiting".to_owned(),
        )];
        let timeout = Duration::from_millis(300);
        let start = tokio::time::Instant::now();
        let (snapshot, errors) = query_round(
            &client,
            &http::HeaderMap::new(),
            &queries,
            &SaturationRound::new(&saturation),
            timeout,
            || at(0),
        )
        .await;
        let took = start.elapsed();
        held.abort();
        assert!(
            took >= timeout && took < timeout * 10,
            "the round ended after {took:?}"
        );
        assert_eq!(snapshot.leased, None);
        assert_eq!(snapshot.max_fds, None);
        assert_eq!(
            snapshot.saturation.values().collect::<Vec<_>>(),
            [&("vllm:num_requests_waiting".to_owned(), None)]
        );
        assert_eq!(errors.len(), queries.all().len() + 1);
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

    /// A Prometheus on loopback that answers every query with one sample of 2 (or an error
    /// for PromQL containing `broken`) and counts the queries it was sent.
    #[tokio::test]
    async fn a_round_for_many_policies_sends_each_distinct_query_once() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        let server = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let line = String::from_utf8_lossy(&request);
                    let (status, body) = if line.lines().next().unwrap_or("").contains("broken") {
                        (
                            "400 Bad Request",
                            r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#,
                        )
                    } else {
                        (
                            "200 OK",
                            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1800000000,"2"]}]}}"#,
                        )
                    };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        let (client, queries) = prometheus_at(&url);
        // 200 policies of one template (the same saturation query), and one with a broken one.
        let policies = 200;
        let mut saturation: Vec<(SaturationKey, String)> = (0..policies)
            .map(|i| {
                (
                    ("ns".to_owned(), format!("p{i}"), "model-a".to_owned()),
                    "vllm:num_requests_waiting".to_owned(),
                )
            })
            .collect();
        saturation.push((
            ("ns".to_owned(), "odd".to_owned(), "model-a".to_owned()),
            "broken(".to_owned(),
        ));
        let (snapshot, errors) = query_round(
            &client,
            &http::HeaderMap::new(),
            &queries,
            &SaturationRound::new(&saturation),
            Duration::from_secs(10),
            || at(0),
        )
        .await;
        server.abort();
        assert_eq!(
            sent.load(std::sync::atomic::Ordering::SeqCst),
            queries.all().len() + 2,
            "the fixed set plus one per distinct saturation query, not one per policy"
        );
        assert_eq!(
            snapshot.saturation.len(),
            policies + 1,
            "every backend has its answer"
        );
        for i in 0..policies {
            let k = ("ns".to_owned(), format!("p{i}"), "model-a".to_owned());
            assert_eq!(
                snapshot.saturation[&k],
                ("vllm:num_requests_waiting".to_owned(), Some(2.0))
            );
        }
        let odd = ("ns".to_owned(), "odd".to_owned(), "model-a".to_owned());
        assert_eq!(
            snapshot.saturation[&odd],
            ("broken(".to_owned(), None),
            "a failed query is missing for its own backends only"
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(matches!(
            errors[0],
            PromError::Query {
                name: "saturation",
                ..
            }
        ));
    }

    #[test]
    fn demand_per_class_is_summed_over_the_selected_pods_and_missing_when_a_pod_lacks_it() {
        // Per pod and class: connections leased, and calls pending (none reported by gw-9).
        let samples = [
            ("gw-0", "interactive", 6.0, Some(0.0)),
            ("gw-0", "batch", 4.0, Some(2.0)),
            ("gw-1", "interactive", 1.0, Some(0.5)),
            ("gw-1", "batch", 9.0, Some(3.0)),
            ("gw-9", "batch", 500.0, None),
        ];
        let (mut leased, mut pending) = (Vec::new(), Vec::new());
        for (pod, class, leased_now, pending_now) in samples {
            let labels = [
                ("namespace", "ns"),
                ("pod", pod),
                ("backend", "model-a"),
                ("class", class),
            ];
            leased.push(row(&labels, leased_now));
            pending.extend(pending_now.map(|v| row(&labels, v)));
        }
        let mut r = round();
        r.insert("class_leased", Some(leased));
        r.insert("class_pending", Some(pending));
        let samples = fold(&r).samples("ns", &selection(), at(0), Duration::from_secs(60));
        let classes = samples.backends[&(key(), "model-a".to_owned())].classes;
        assert_eq!(
            crate::plan::priority::demand_by_class(&classes),
            Some([7.5, 18.0]),
            "gw-9 is not selected"
        );

        // A query that failed: the split is missing, the totals are not.
        r.insert("class_pending", None);
        let samples = fold(&r).samples("ns", &selection(), at(0), Duration::from_secs(60));
        let b = &samples.backends[&(key(), "model-a".to_owned())];
        assert_eq!(crate::plan::priority::demand_by_class(&b.classes), None);
        assert_eq!(b.leased, Some(300.0));
    }
}
