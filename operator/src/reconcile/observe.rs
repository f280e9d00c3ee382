//! Step 1, observe (reads caches, no API calls): the policy's namespace as the planner sees it —
//! every policy, the gateway pods they select, resolved backend endpoints (EndpointSlices or
//! static addresses), documents already published (ConfigMaps), what each pod acknowledged, and
//! the latest Prometheus samples.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use poolpilot_api::limits::{ClientCertificate, Endpoint, EndpointAddress, EndpointTls};
use poolpilot_api::policy::BackendSpec;
use poolpilot_api::policy::upstream::{ExternalTls, secret_file};
use poolpilot_api::{ConnectionPolicy, GatewayLimits};

use super::context::Context;
use super::observed::Observed;
use crate::gateway::Gateways;
use crate::plan::{Acked, FleetInput, GatewayPod, PolicyInput, PolicyKey, Timestamp};
use crate::prom::Selection;

/// The label EndpointSlices carry with their Service's name.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The ConfigMap key holding the limits document.
pub const DOCUMENT_KEY: &str = "limits.json";
/// ConfigMap annotations repeating the document's revision and generation, so that observing a
/// namespace reads them without parsing every document (with many policies on the same pods
/// each ConfigMap holds a document of every backend).
pub const REVISION_ANNOTATION: &str = "poolpilot.io/revision";
/// See [`REVISION_ANNOTATION`].
pub const GENERATION_ANNOTATION: &str = "poolpilot.io/generation";
/// The label on every ConfigMap the operator writes.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "poolpilot-operator");
/// Pod annotation overriding the admin port.
pub const ADMIN_PORT_ANNOTATION: &str = "poolpilot.io/admin-port";

/// Why observing failed.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// The policy has no namespace (it is namespaced, so the object is malformed).
    #[error("policy {0} has no namespace")]
    NoNamespace(String),
}

/// `policy`'s key (its namespace and name).
pub fn key(policy: &ConnectionPolicy) -> Result<PolicyKey, ObserveError> {
    Ok(PolicyKey {
        namespace: policy
            .namespace()
            .ok_or_else(|| ObserveError::NoNamespace(policy.name_any()))?,
        name: policy.name_any(),
    })
}

/// Observes `policy`'s namespace as its own reconcile sees it: the policy as handed over (which
/// may be newer than the cache) and the cache's others. With `removing`, the policy is left out
/// of the fleet (its backends disappear from the documents) but its pods stay in it.
pub fn observe<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    removing: bool,
    now: Timestamp,
) -> Result<Observed, ObserveError> {
    let focus = key(policy)?;
    let others = ctx.stores.policies.state();
    let mut objects: Vec<&ConnectionPolicy> = in_force(ctx, &others, &focus.namespace)
        .filter(|p| p.name_any() != focus.name)
        .collect();
    if !removing {
        objects.push(policy);
    }
    let extra = removing.then_some(&policy.spec.gateway_selector);
    Ok(observe_policies(ctx, &focus.namespace, objects, extra, now))
}

/// Observes namespace `ns` with every policy of the cache that is in force there: what the
/// namespace pass plans.
pub fn namespace<G: Gateways>(ctx: &Context<G>, ns: &str, now: Timestamp) -> Observed {
    let all = ctx.stores.policies.state();
    let objects = in_force(ctx, &all, ns).collect();
    observe_policies(ctx, ns, objects, None, now)
}

/// The cached policies of `ns` in force: readable, not being deleted, and not refused for a
/// backend namespace (their own reconciles say so).
fn in_force<'a, G: Gateways>(
    ctx: &'a Context<G>,
    all: &'a [std::sync::Arc<kube::core::DeserializeGuard<ConnectionPolicy>>],
    ns: &'a str,
) -> impl Iterator<Item = &'a ConnectionPolicy> + 'a {
    all.iter()
        .filter_map(|p| p.0.as_ref().ok())
        .filter(move |p| p.namespace().as_deref() == Some(ns))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| refused_namespaces(&ctx.config.backend_namespaces, p).is_empty())
}

/// The admin address of `pod`: its IP and the admin port (its annotation's, or the operator's
/// `--admin-port`). `None` before it has an IP.
pub fn admin_address<G: Gateways>(ctx: &Context<G>, pod: &Pod) -> Option<SocketAddr> {
    let ip: IpAddr = pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?;
    let port = pod
        .annotations()
        .get(ADMIN_PORT_ANNOTATION)
        .and_then(|p| p.parse().ok())
        .unwrap_or(ctx.config.admin_port);
    Some(SocketAddr::new(ip, port))
}

/// Observes `ns` with `objects` as its policies; `extra`, a removed policy's selector, keeps
/// its pods in the fleet.
fn observe_policies<G: Gateways>(
    ctx: &Context<G>,
    ns: &str,
    mut objects: Vec<&ConnectionPolicy>,
    extra: Option<&LabelSelector>,
    now: Timestamp,
) -> Observed {
    // The cached objects, not copies of them (with their managed fields and last-applied
    // annotations they are far larger than what planning takes from them).
    objects.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));

    // The namespace's slices and those of the namespaces the operator may read backends from.
    let allowed = &ctx.config.backend_namespaces;
    let slices: Vec<_> = ctx
        .stores
        .slices
        .iter()
        .flat_map(Store::state)
        .filter(|s| {
            s.namespace()
                .is_some_and(|n| n == ns || allowed.contains(&n))
        })
        .collect();
    let policies: Vec<PolicyInput> = objects
        .iter()
        .map(|p| policy_input(ns, p, &slices))
        .collect();

    // Pods any policy selects, plus the removed policy's own pods.
    let mut pods: Vec<_> = ctx
        .stores
        .pods
        .state()
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
        .collect();
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    // Which of the namespace's pods each policy selects (and, when removing, the removed
    // policy): each distinct selector matched once while the pods stay the same.
    let keys: Vec<(String, &BTreeMap<String, String>)> =
        pods.iter().map(|p| (p.name_any(), p.labels())).collect();
    let keyed: Vec<(&str, &BTreeMap<String, String>)> =
        keys.iter().map(|(n, l)| (n.as_str(), *l)).collect();
    let mut selectors: Vec<&LabelSelector> = policies.iter().map(PolicyInput::selector).collect();
    selectors.extend(extra);
    let by_policy = {
        let mut memos = ctx.selections.lock();
        let memo = memos.entry(ns.to_owned()).or_default();
        let by_policy = memo.select(&keyed, &selectors);
        if keyed.is_empty() {
            memos.remove(ns);
        }
        by_policy
    };
    let mut selected = vec![false; pods.len()];
    for i in by_policy.iter().flat_map(|s| s.iter()) {
        selected[*i] = true;
    }
    let (acks, seen) = {
        let rollouts = ctx.rollouts.lock();
        (
            rollouts.acked.clone(),
            rollouts.seen_generation.get(ns).copied(),
        )
    };
    // Read in place (a copy of the snapshot is a copy of every series the round returned); the
    // poller's next write waits for this pass to be done with it.
    let snapshot = ctx.snapshot.read();
    let mut gateway_pods = Vec::new();
    let mut admin = BTreeMap::new();
    for (_, pod) in pods.iter().enumerate().filter(|(i, _)| selected[*i]) {
        let name = pod.name_any();
        let acked = acks
            .get(&(ns.to_owned(), name.clone(), instance(pod)))
            .cloned()
            .or_else(|| {
                snapshot
                    .limits_info
                    .get(&(ns.to_owned(), name.clone()))
                    .cloned()
            });
        let address = admin_address(ctx, pod);
        if let Some(address) = address {
            admin.insert(name.clone(), address);
        }
        gateway_pods.push(GatewayPod {
            name,
            labels: pod.labels().clone(),
            ip: address.map(|a| a.ip()),
            ready: is_ready(pod),
            terminating: pod.metadata.deletion_timestamp.is_some(),
            stopped: is_stopped(pod),
            acked,
        });
    }

    let published: Vec<Acked> = ctx
        .stores
        .configmaps
        .state()
        .iter()
        .filter(|cm| cm.namespace().as_deref() == Some(ns))
        .filter_map(|cm| published_document(cm))
        .collect();

    let ready_pods: HashSet<&str> = gateway_pods
        .iter()
        .filter(|g| g.ready)
        .map(|g| g.name.as_str())
        .collect();
    // The pods are in name order, so each selection is too.
    let selection: Vec<Selection> = by_policy
        .iter()
        .zip(&policies)
        .map(|(indexes, p)| {
            let pods: Vec<String> = indexes.iter().map(|i| keys[*i].0.clone()).collect();
            let backends = p
                .spec
                .backends
                .iter()
                .map(|b| {
                    let query = b.saturation.as_ref().map(|s| s.query.clone());
                    (b.name.clone(), query)
                })
                .collect();
            let ready = pods
                .iter()
                .filter(|name| ready_pods.contains(name.as_str()))
                .cloned()
                .collect();
            Selection {
                policy: p.key.clone(),
                pods,
                ready,
                backends,
            }
        })
        .collect();
    let samples = ctx
        .samples
        .lock()
        .entry(ns.to_owned())
        .or_default()
        .samples(&snapshot, ns, &selection, now, ctx.config.snapshot_max_age);
    drop(snapshot);

    Observed {
        namespace: ns.to_owned(),
        input: FleetInput {
            policies,
            pods: gateway_pods,
            samples,
            published,
            // A generation a pod reported running (409): every document must go above it.
            generation_floor: seen.unwrap_or_default(),
            samples_horizon: ctx.config.snapshot_max_age,
            // Filled by the next step, from the gateways' reports.
            clients: BTreeMap::new(),
            focus: None,
        },
        selected: selection.into_iter().map(|s| s.pods).collect(),
        admin,
    }
}

/// The revision and generation of the document a ConfigMap holds: from its annotations, or
/// from the document itself when they are missing (a ConfigMap written before they existed).
pub fn published_document(cm: &ConfigMap) -> Option<Acked> {
    let annotations = cm.annotations();
    let annotated = annotations.get(REVISION_ANNOTATION).zip(
        annotations
            .get(GENERATION_ANNOTATION)
            .and_then(|g| g.parse().ok()),
    );
    if let Some((revision, generation)) = annotated {
        return Some(Acked {
            revision: revision.clone(),
            generation,
        });
    }
    let doc: GatewayLimits = serde_json::from_str(cm.data.as_ref()?.get(DOCUMENT_KEY)?).ok()?;
    Some(Acked {
        revision: doc.revision,
        generation: doc.generation,
    })
}

/// Which run of a pod's processes this is: its uid and its containers' restarts. A gateway
/// whose container restarted starts over from the ConfigMap's document and waits for its own:
/// what it acknowledged before the restart no longer holds.
pub fn instance(pod: &Pod) -> String {
    let restarts: i32 = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |cs| cs.iter().map(|c| c.restart_count).sum());
    format!("{}/{restarts}", pod.uid().unwrap_or_default())
}

/// A pod counts as ready when its Ready condition is True and it is not terminating.
pub fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A pod whose containers stopped for good (phase Succeeded or Failed) holds no connections.
pub fn is_stopped(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| matches!(phase, "Succeeded" | "Failed"))
}

pub(crate) fn policy_input(
    ns: &str,
    p: &ConnectionPolicy,
    slices: &[std::sync::Arc<EndpointSlice>],
) -> PolicyInput {
    let endpoints = p
        .spec
        .backends
        .iter()
        .map(|b| {
            // The Service's own namespace (the policy's unless it names one).
            let service_ns = b
                .endpoints
                .service
                .as_ref()
                .and_then(|s| s.namespace.as_deref())
                .unwrap_or(ns);
            let theirs: Vec<_> = slices
                .iter()
                .filter(|s| s.namespace().as_deref().unwrap_or(ns) == service_ns)
                .cloned()
                .collect();
            (b.name.clone(), resolve(b, &theirs))
        })
        .collect();
    PolicyInput {
        key: PolicyKey {
            namespace: ns.to_owned(),
            name: p.name_any(),
        },
        generation: p.metadata.generation.unwrap_or_default(),
        created: p
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(Timestamp::UNIX_EPOCH, |t| t.0),
        spec: p.spec.clone(),
        status: p.status.clone(),
        endpoints,
    }
}

/// The backends of `policy` whose Service lies in a namespace the operator may not read backends
/// from: neither the policy's own nor one of `allowed` (`--backend-namespaces`). One message
/// per backend, naming it and the namespace; empty: none.
pub fn refused_namespaces(allowed: &[String], policy: &ConnectionPolicy) -> Vec<String> {
    let own = policy.namespace().unwrap_or_default();
    policy
        .spec
        .backends
        .iter()
        .enumerate()
        .filter_map(|(i, b)| {
            let wanted = b.endpoints.service.as_ref()?.namespace.as_ref()?;
            (wanted != &own && !allowed.contains(wanted)).then(|| {
                format!(
                    "backends[{i}] ({}): endpoints.service.namespace {wanted:?} {} (its --backend-namespaces: {})",
                    b.name,
                    crate::plan::status::NAMESPACE_REFUSAL,
                    if allowed.is_empty() {
                        "none, only the policy's own".to_owned()
                    } else {
                        allowed.join(", ")
                    }
                )
            })
        })
        .collect()
}

/// An external endpoint's TLS as the gateways take it: the Secrets as the files the gateway
/// pods mount them as.
fn endpoint_tls(tls: &ExternalTls) -> EndpointTls {
    EndpointTls {
        server_name: tls.server_name.clone(),
        ca_file: tls
            .ca_bundle_secret
            .as_deref()
            .map(|s| secret_file(s, "ca.crt")),
        client_certificate: tls
            .client_cert_secret
            .as_deref()
            .map(|s| ClientCertificate {
                cert_file: secret_file(s, "tls.crt"),
                key_file: secret_file(s, "tls.key"),
            }),
    }
}

/// The backend's endpoints: ready addresses of its Service's EndpointSlices on its port, its
/// static addresses (unparsable ones are left out; validation reports them), or its external
/// DNS names as `host:port` endpoints (each gateway resolves them).
pub fn resolve(b: &BackendSpec, slices: &[std::sync::Arc<EndpointSlice>]) -> Vec<Endpoint> {
    if let Some(addrs) = &b.endpoints.addresses {
        return addrs
            .iter()
            .filter_map(|a| {
                let address: SocketAddr = a.address.parse().ok()?;
                Some(Endpoint {
                    name: a.name.clone().unwrap_or_else(|| a.address.clone()),
                    address: address.into(),
                    tls: None,
                })
            })
            .collect();
    }
    if let Some(external) = &b.endpoints.external {
        return external
            .iter()
            .map(|e| {
                let address = EndpointAddress::Host {
                    host: e.host.clone(),
                    port: e.port,
                };
                Endpoint {
                    name: e.name.clone().unwrap_or_else(|| address.to_string()),
                    address,
                    tls: e.tls.as_ref().map(endpoint_tls),
                }
            })
            .collect();
    }
    let Some(svc) = &b.endpoints.service else {
        return Vec::new();
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for slice in slices
        .iter()
        .filter(|s| s.labels().get(SERVICE_NAME_LABEL) == Some(&svc.name))
    {
        let has_port = slice
            .ports
            .iter()
            .flatten()
            .any(|p| p.port == Some(i32::from(svc.port)));
        if !has_port {
            continue;
        }
        for e in slice.endpoints.iter().flatten() {
            if e.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            let Some(ip) = e.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            let address = SocketAddr::new(ip, svc.port);
            let name = e
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| address.to_string());
            if seen.insert(address) {
                out.push(Endpoint {
                    name,
                    address: address.into(),
                    tls: None,
                });
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use poolpilot_api::policy::BackendSpec;
    use serde_json::json;

    use super::*;

    fn backend(endpoints: serde_json::Value) -> BackendSpec {
        serde_json::from_value(json!({
            "name": "model-a", "endpoints": endpoints, "capacity": {"maxConnectionsPerEndpoint": 10},
        }))
        .unwrap()
    }

    fn slice(service: &str, port: i32, endpoints: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{service}-x"), "labels": {SERVICE_NAME_LABEL: service}},
                "addressType": "IPv4",
                "ports": [{"port": port}],
                "endpoints": endpoints,
            }))
            .unwrap(),
        )
    }

    #[test]
    fn external_tls_names_the_files_the_gateway_pods_mount_its_secrets_as() {
        let b = backend(json!({"external": [
            {"host": "api.openai.com", "port": 443, "tls": {}},
            {"name": "internal", "host": "models.example.com", "port": 8443, "tls": {
                "caBundleSecret": "models-ca", "clientCertSecret": "gateway-client",
                "serverName": "vllm.example.com"
            }},
        ]}));
        let got = resolve(&b, &[]);
        assert_eq!(
            got[0].tls,
            Some(EndpointTls::default()),
            "system roots, the host's name"
        );
        let tls = got[1].tls.as_ref().unwrap();
        assert_eq!(tls.server_name.as_deref(), Some("vllm.example.com"));
        assert_eq!(
            tls.ca_file.as_deref(),
            Some(std::path::Path::new(
                "/etc/poolpilot/secrets/models-ca/ca.crt"
            ))
        );
        let client = tls.client_certificate.as_ref().unwrap();
        assert_eq!(
            client.cert_file,
            std::path::Path::new("/etc/poolpilot/secrets/gateway-client/tls.crt")
        );
        assert_eq!(
            client.key_file,
            std::path::Path::new("/etc/poolpilot/secrets/gateway-client/tls.key")
        );
    }

    #[test]
    fn external_names_are_host_port_endpoints_for_the_gateways_to_resolve() {
        let b = backend(json!({"external": [
            {"host": "api.openai.com", "port": 443},
            {"name": "azure", "host": "res.openai.azure.com", "port": 443},
        ]}));
        let got = resolve(&b, &[]);
        let names: Vec<(&str, String)> = got
            .iter()
            .map(|e| (e.name.as_str(), e.address.to_string()))
            .collect();
        assert_eq!(
            names,
            [
                ("api.openai.com:443", "api.openai.com:443".into()),
                ("azure", "res.openai.azure.com:443".into())
            ]
        );
        assert!(got.iter().all(|e| e.address.ip().is_none()));
    }

    #[test]
    fn service_endpoints_come_from_ready_endpoint_slice_addresses_on_the_port() {
        let b = backend(json!({"service": {"name": "model-a", "port": 8000}}));
        let slices = [
            slice(
                "model-a",
                8000,
                json!([
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": "model-a-1"}},
                    {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "model-a-0"}},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},
                ]),
            ),
            slice("model-a", 9000, json!([{"addresses": ["10.0.0.9"]}])),
            slice("model-b", 8000, json!([{"addresses": ["10.0.0.8"]}])),
        ];
        let got = resolve(&b, &slices);
        let names: Vec<(&str, String)> = got
            .iter()
            .map(|e| (e.name.as_str(), e.address.to_string()))
            .collect();
        assert_eq!(
            names,
            [
                ("model-a-0", "10.0.0.1:8000".into()),
                ("model-a-1", "10.0.0.2:8000".into())
            ]
        );
    }

    #[test]
    fn static_addresses_are_taken_as_written() {
        let b = backend(
            json!({"addresses": [{"address": "10.0.0.5:80"}, {"name": "x", "address": "10.0.0.6:80"}, {"address": "bad"}]}),
        );
        let got = resolve(&b, &[]);
        let names: Vec<&str> = got.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["10.0.0.5:80", "x"],
            "unparsable addresses are left to validation"
        );
    }

    fn configmap(annotations: serde_json::Value, doc: &str) -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": "models-limits", "annotations": annotations},
            "data": {DOCUMENT_KEY: doc},
        }))
        .unwrap()
    }

    #[test]
    fn a_published_document_is_read_from_the_annotations_or_else_from_the_document() {
        let doc = r#"{"revision": "from-doc", "generation": 3, "backends": []}"#;
        let annotated = configmap(
            json!({REVISION_ANNOTATION: "r7", GENERATION_ANNOTATION: "7"}),
            "not even JSON: the annotations are enough",
        );
        assert_eq!(
            published_document(&annotated),
            Some(Acked {
                revision: "r7".into(),
                generation: 7
            })
        );
        let older = configmap(json!({}), doc);
        assert_eq!(
            published_document(&older),
            Some(Acked {
                revision: "from-doc".into(),
                generation: 3
            }),
            "a ConfigMap written before the annotations existed"
        );
        let bad = configmap(
            json!({REVISION_ANNOTATION: "r7", GENERATION_ANNOTATION: "x"}),
            doc,
        );
        assert_eq!(
            published_document(&bad).map(|a| a.generation),
            Some(3),
            "an unparsable generation annotation falls back to the document"
        );
        assert_eq!(published_document(&configmap(json!({}), "{")), None);
    }
}
