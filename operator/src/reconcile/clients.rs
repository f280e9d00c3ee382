//! Step 1b, the busiest clients (the gateways' admin API, read-only): for a policy whose client
//! limits hold for the whole fleet, each of its live pods is asked for its busiest clients
//! (`GET /v1/clients`), so that the planner can divide those clients' limits by where their calls
//! arrive (`plan/clients.rs`); with a token budget, also for those that spend the most tokens
//! (`?by=tokens`), whose budgets it divides by where they spend them (`plan/tokens.rs`). A pod that does not answer keeps no report: once its last one is
//! older than two intervals the planner keeps the division in force. Never an error of the
//! reconcile: the reports only refine a division the even split already makes safe.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use kube::ResourceExt;
use poolpilot_api::ConnectionPolicy;
use poolpilot_api::policy::ClientScope;
use tracing::debug;

use super::context::Context;
use super::observe;
use crate::gateway::{ClientsReport, Gateways, Ranking};
use crate::plan::input::ClientUse;
use crate::plan::time::{Timestamp, elapsed};
use crate::plan::{FleetInput, PolicyKey};

/// Longest wait for one pod's report.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Pods asked at once.
pub const CONCURRENCY: usize = 16;

/// Asks the live pods of the policy being reconciled for their busiest clients, when its client
/// limits are fleet-wide, and keeps their reports ([`Context::client_reports`]) for the
/// namespace pass to [`fill`] the planner's input from.
pub async fn poll<G: Gateways>(ctx: &Context<G>, policy: &ConnectionPolicy, key: &PolicyKey) {
    let ns = &key.namespace;
    let Some(clients) = policy
        .spec
        .clients
        .as_ref()
        .filter(|c| c.scope == ClientScope::Fleet && policy.spec.autoscale.enabled)
    else {
        return;
    };
    let rankings: &[Ranking] = if clients.tokens.is_some() {
        &[Ranking::Demand, Ranking::Tokens]
    } else {
        &[Ranking::Demand]
    };
    let Some(token) = ctx.rollouts.lock().tokens.get(ns).map(|(t, _)| t.clone()) else {
        return;
    };
    // The policy's live pods with an address, straight from the cache: one selector to match.
    let pods: Vec<(String, std::net::SocketAddr)> = ctx
        .stores
        .pods
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .filter(|p| p.metadata.deletion_timestamp.is_none() && !observe::is_stopped(p))
        .filter(|p| crate::plan::selector::matches(&policy.spec.gateway_selector, p.labels()))
        .filter_map(|p| Some((p.name_any(), observe::admin_address(ctx, p)?)))
        .collect();
    let answers: Vec<(String, Option<ClientsReport>)> = futures::stream::iter(pods)
        .map(|(pod, addr)| {
            let token = token.clone();
            async move {
                // Both rankings within the one timeout: a pod that answers one and not the
                // other keeps no report rather than half of one.
                let asked = async {
                    let mut whole = ClientsReport::default();
                    for by in rankings {
                        whole.merge(ctx.gateways.clients(ns, addr, &token, *by).await?);
                    }
                    Ok::<_, crate::gateway::ReportError>(whole)
                };
                match tokio::time::timeout(REPORT_TIMEOUT, asked).await {
                    Ok(Ok(r)) => (pod, Some(r)),
                    Ok(Err(e)) => {
                        debug!(%pod, error = %e, "no client report");
                        (pod, None)
                    }
                    Err(_) => {
                        debug!(%pod, "no client report within {REPORT_TIMEOUT:?}");
                        (pod, None)
                    }
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let now = (ctx.clock)();
    let sent = ctx.rollouts.lock().sent.clone();
    let mut reports = ctx.client_reports.lock();
    for (pod, report) in answers {
        let Some(report) = report else { continue };
        let doc = sent
            .get(&(ns.clone(), pod.clone()))
            .and_then(|s| s.current.clone());
        let by_policy = by_policy(&report, doc.as_deref());
        reports.insert((ns.clone(), pod), (now, by_policy));
    }
    debug!(policy = %key, "client reports polled");
}

/// Fills `input.clients` with every report of its namespace `ns` younger than two intervals of
/// the policy it is about (a pod that did not answer since has no report: the planner keeps
/// the division in force), and forgets the reports of pods that are gone.
pub fn fill<G: Gateways>(ctx: &Context<G>, ns: &str, input: &mut FleetInput, now: Timestamp) {
    let intervals: BTreeMap<&PolicyKey, Duration> = input
        .policies
        .iter()
        .map(|p| (&p.key, p.spec.autoscale.interval.get()))
        .collect();
    let mut clients = BTreeMap::new();
    let mut reports = ctx.client_reports.lock();
    let pods: Vec<String> = input.pods.iter().map(|p| p.name.clone()).collect();
    reports.retain(ns, &pods);
    for ((n, pod), (at, by_policy)) in reports.iter() {
        if n != ns {
            continue;
        }
        for (key, used) in by_policy {
            let fresh = intervals
                .get(key)
                .is_some_and(|interval| elapsed(*at, now) <= *interval * 2);
            if fresh {
                clients.insert((key.clone(), pod.clone()), used.clone());
            }
        }
    }
    drop(reports);
    debug!(namespace = ns, reports = clients.len(), "client reports");
    input.clients = clients;
}

/// A report's clients per ConnectionPolicy: each client policy of the pod's document is the one
/// its backends name (`backends[].clientPolicy`), of the policy they belong to
/// (`backends[].policy`, `namespace/name`).
fn by_policy(
    report: &ClientsReport,
    doc: Option<&poolpilot_api::GatewayLimits>,
) -> BTreeMap<PolicyKey, Vec<ClientUse>> {
    let mut out = BTreeMap::new();
    let Some(doc) = doc else {
        return out;
    };
    for p in &report.policies {
        let Some(owner) = doc
            .backends
            .iter()
            .find(|b| b.client_policy.as_deref() == Some(p.name.as_str()))
            .and_then(|b| b.policy.as_deref())
            .and_then(|k| k.split_once('/'))
        else {
            continue;
        };
        let key = PolicyKey {
            namespace: owner.0.to_owned(),
            name: owner.1.to_owned(),
        };
        let clients = p
            .clients
            .iter()
            .filter(|c| {
                c.key_sha256.len() == 64 && c.key_sha256.bytes().all(|b| b.is_ascii_hexdigit())
            })
            .map(|c| {
                let rate = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
                ClientUse {
                    key_sha256: c.key_sha256.to_ascii_lowercase(),
                    in_flight: c.in_flight,
                    queued: c.queued,
                    demand: rate(c.demand),
                    input_tokens: rate(c.input_tokens_per_second),
                    output_tokens: rate(c.output_tokens_per_second),
                }
            })
            .collect();
        out.insert(key, clients);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::{PolicyClients, ReportedClient};

    #[test]
    fn a_report_is_mapped_to_policies_through_the_document_the_pod_runs() {
        let doc: poolpilot_api::GatewayLimits = serde_json::from_value(serde_json::json!({
            "generation": 1,
            "backends": [{
                "name": "model-a", "policy": "ns/models", "clientPolicy": "models",
                "endpoints": [], "match": {},
                "pool": {"maxConnectionsPerEndpoint": 1, "maxPending": 1, "leaseTimeout": "1s",
                         "idleTimeout": "1s", "maxLifetime": "1s", "connectTimeout": "1s",
                         "validateAfterIdle": "1s"},
                "timeouts": {"firstByte": "1s", "total": "1s", "streamIdle": "1s"},
            }],
        }))
        .expect("a document");
        let key = "AB".repeat(32);
        let report = ClientsReport {
            policies: vec![
                PolicyClients {
                    name: "models".into(),
                    clients: vec![
                        ReportedClient {
                            key_sha256: key.clone(),
                            in_flight: 3,
                            queued: 1,
                            demand: 3.5,
                            input_tokens_per_second: 20.0,
                            output_tokens_per_second: f64::NAN,
                        },
                        ReportedClient {
                            key_sha256: "not-a-digest".into(),
                            ..ReportedClient::default()
                        },
                    ],
                },
                PolicyClients {
                    name: "unknown".into(),
                    clients: vec![],
                },
            ],
        };
        let got = by_policy(&report, Some(&doc));
        let models = PolicyKey {
            namespace: "ns".into(),
            name: "models".into(),
        };
        assert_eq!(got.keys().collect::<Vec<_>>(), [&models]);
        assert_eq!(
            got[&models],
            [ClientUse {
                key_sha256: key.to_ascii_lowercase(),
                in_flight: 3,
                queued: 1,
                demand: 3.5,
                input_tokens: 20.0,
                output_tokens: 0.0,
            }]
        );
        assert!(
            by_policy(&report, None).is_empty(),
            "no document: no mapping"
        );
    }
}
