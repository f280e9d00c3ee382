//! Rendering: one `GatewayLimits` document per gateway pod, merging the backends of every accepted
//! policy that selects it (oldest policy first, backends in spec order), with each pod's share of
//! the fleet targets, a content revision and a generation that only ever increases
//! ([`super::generations`] hands them out; [`super::memo`] tells which pods keep their last
//! document).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::{
    BackendLimits, ClientIdentity, ClientOverride, ClientPolicy, ClientShare, ClientTokenShare,
    CredentialScheme, Credentials, HealthCheck, ListenerLimits, OutlierDetection, PoolLimits,
    ProxyProtocol, RouteMatch, SlowCalls, SoftThrottle, Timeouts, TokenBudget, TokenCount,
    TokenWeights, TrustedProxies, UpstreamProtocol,
};
use poolpilot_api::policy::upstream::{
    CredentialSchemeSpec, CredentialsSpec, ProtocolSpec, secret_file,
};
use poolpilot_api::policy::{
    BackendSpec, ClientScope, TokenBudgetSpec, TokenCountSpec, TrustedProxyProtocol,
};
use sha2::{Digest, Sha256};

use super::budget;
use super::generations::Generations;
use super::input::{GatewayPod, PolicyInput};
use super::memo;
use super::output::PolicyPlan;
use super::tokens::TokenDivision;
use super::validate::Acceptance;

/// Renders every pod's document (pods no accepted policy selects get an empty one, which removes
/// backends of deleted policies), and stores in each accepted plan its ConfigMap's document: the
/// policies on its first selected pod (or, without pods, the policies sharing its selector) at
/// the base shares. A policy whose own document does not validate is marked invalid first.
/// `generations` knows the documents already written, acknowledged or recorded in a status, so
/// that generations keep increasing across operator restarts. `last` (the last rendering and
/// this one's inputs) lets a pod whose policies and their plans are all unchanged keep its last
/// document instead of rendering and hashing it again, a ConfigMap likewise, and a policy
/// unchanged since a rendering that accepted it skip its own document's validation (see
/// [`memo::Reuse`]): the documents and verdicts are those a rendering without it gives.
pub fn render_all(
    policies: &[PolicyInput],
    pods: &[GatewayPod],
    plans: &mut [PolicyPlan],
    mut generations: Generations,
    last: Option<(&memo::Rendered, &memo::RenderInput)>,
) -> Rendering {
    // The plans as the memo compares and records them (this run's facts left out), and which
    // policies are the same as in the last rendering.
    let mut rendered = memo::rendered_plans(plans);
    let reuse = last.map(|(last, input)| memo::Reuse::new(last, input, &rendered));
    for (i, plan) in plans.iter_mut().enumerate() {
        if plan.acceptance.is_accepted()
            && !reuse.as_ref().is_some_and(|r| r.validated(i))
            && let Err(e) = document(policies, &[(i, &*plan)], None).validate()
        {
            plan.acceptance =
                Acceptance::Invalid(e.violations.iter().map(ToString::to_string).collect());
            rendered[i].acceptance = plan.acceptance.clone();
        }
    }

    // Each pod's accepted policies, in the plans' order: gathered in one walk over what every
    // plan selects (asking every plan about every pod costs pods × policies × selected).
    let mut on_pods: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, plan) in plans.iter().enumerate() {
        if plan.acceptance.is_accepted() {
            for pod in &plan.selected {
                match on_pods.get_mut(pod.as_str()) {
                    Some(on_pod) => on_pod.push(i),
                    None => {
                        on_pods.insert(pod.clone(), vec![i]);
                    }
                }
            }
        }
    }

    // The ConfigMaps' documents first, so that a pod starting from one is never ahead of the
    // generation of the document the operator sends it next.
    // Policies on the same first pod (or, without pods, with the same selector) share one
    // document: render it once, not once per policy (many policies select the same pods).
    let mut shared: BTreeMap<PeerSet, Arc<GatewayLimits>> = BTreeMap::new();
    for i in 0..plans.len() {
        if !plans[i].acceptance.is_accepted() {
            plans[i].document = None;
            continue;
        }
        let selector = &policies[i].spec.gateway_selector;
        let set = match plans[i].selected.first() {
            Some(pod) => PeerSet::OnPod(pod.clone()),
            // The first policy without pods and with an equal selector stands for them all.
            None => PeerSet::Selector(
                (0..i)
                    .find(|&j| {
                        plans[j].selected.is_empty()
                            && &policies[j].spec.gateway_selector == selector
                    })
                    .unwrap_or(i),
            ),
        };
        if let Some(doc) = shared.get(&set) {
            plans[i].document = Some(doc.clone());
            continue;
        }
        // At the base shares: a pod that starts from this document later (a new pod, or one
        // restarted while the operator is away) never takes more than any pod's share.
        let doc = match &set {
            // The accepted policies on the pod, as its own document takes them.
            PeerSet::OnPod(pod) => {
                let on_pod = on_pods.get(pod).map_or(&[][..], Vec::as_slice);
                match reuse
                    .as_ref()
                    .and_then(|r| r.configmap_document(i, pod, on_pod))
                {
                    Some(kept) => with_generation(kept, &mut generations),
                    None => {
                        let peers: Vec<(usize, &PolicyPlan)> =
                            on_pod.iter().map(|&j| (j, &plans[j])).collect();
                        rendered_document(policies, &peers, None, &mut generations)
                    }
                }
            }
            PeerSet::Selector(_) => {
                let peers: Vec<(usize, &PolicyPlan)> = plans
                    .iter()
                    .enumerate()
                    .filter(|(j, p)| {
                        p.acceptance.is_accepted()
                            && &policies[*j].spec.gateway_selector == selector
                    })
                    .collect();
                rendered_document(policies, &peers, None, &mut generations)
            }
        };
        shared.insert(set, doc.clone());
        plans[i].document = Some(doc);
    }
    for (r, plan) in rendered.iter_mut().zip(plans.iter()) {
        r.document.clone_from(&plan.document);
    }

    let mut documents = BTreeMap::new();
    let mut indices = BTreeMap::new();
    let mut pod_names: Vec<&GatewayPod> = pods.iter().collect();
    pod_names.sort_by(|a, b| a.name.cmp(&b.name));
    for pod in pod_names {
        let on_pod_indices = on_pods.remove(pod.name.as_str()).unwrap_or_default();
        let kept = reuse
            .as_ref()
            .and_then(|r| r.document(&pod.name, &on_pod_indices));
        let doc = match kept {
            // The same content, so the same revision: only its generation is asked again, in
            // the same order as a fresh rendering asks.
            Some(kept) => with_generation(kept, &mut generations),
            None => {
                let on_pod: Vec<(usize, &PolicyPlan)> =
                    on_pod_indices.iter().map(|&i| (i, &plans[i])).collect();
                rendered_document(policies, &on_pod, Some(&pod.name), &mut generations)
            }
        };
        documents.insert(pod.name.clone(), doc);
        indices.insert(pod.name.clone(), on_pod_indices);
    }
    Rendering {
        documents,
        on_pods: indices,
        plans: rendered,
    }
}

/// A document kept from the last rendering, with the generation its revision gets now (asked
/// where a fresh rendering asks, so that every later revision gets the same generation).
fn with_generation(kept: &Arc<GatewayLimits>, generations: &mut Generations) -> Arc<GatewayLimits> {
    let generation = generations.of(&kept.revision);
    if generation == kept.generation {
        kept.clone()
    } else {
        let mut doc = GatewayLimits::clone(kept);
        doc.generation = generation;
        Arc::new(doc)
    }
}

/// The document of `plans` for `pod` ([`document`]) with its content revision and generation.
fn rendered_document(
    policies: &[PolicyInput],
    plans: &[(usize, &PolicyPlan)],
    pod: Option<&str>,
    generations: &mut Generations,
) -> Arc<GatewayLimits> {
    let mut doc = document(policies, plans, pod).with_content_revision();
    doc.generation = generations.of(&doc.revision);
    Arc::new(doc)
}

/// What [`render_all`] made.
#[derive(Debug)]
pub struct Rendering {
    /// The documents per pod.
    pub documents: BTreeMap<String, Arc<GatewayLimits>>,
    /// The policies each pod's document holds, by index into the plans.
    pub on_pods: BTreeMap<String, Vec<usize>>,
    /// The rendered plans without this run's facts ([`memo::rendered_plans`]).
    pub plans: Vec<PolicyPlan>,
}

/// Which policies a ConfigMap document holds: those on one pod, or (a policy selecting no pod)
/// those with the same selector as the policy at this index.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum PeerSet {
    OnPod(String),
    Selector(usize),
}

/// The document of a set of accepted plans (by index into `policies`), oldest policy first, for
/// `pod` (its shares depend on its rank among each policy's holders; `None`: the base share).
fn document(
    policies: &[PolicyInput],
    plans: &[(usize, &PolicyPlan)],
    pod: Option<&str>,
) -> GatewayLimits {
    let mut order: Vec<&(usize, &PolicyPlan)> = plans.iter().collect();
    order.sort_by(|a, b| {
        let (pa, pb) = (&policies[a.0], &policies[b.0]);
        (pa.created, &pa.key).cmp(&(pb.created, &pb.key))
    });

    let mut listener = ListenerLimits::default();
    listener.max_connections = order
        .iter()
        .map(|(i, _)| policies[*i].spec.listener.max_connections)
        .max()
        .unwrap_or(listener.max_connections);
    listener.max_connections_per_client = order
        .iter()
        .filter_map(|(i, _)| {
            policies[*i]
                .spec
                .clients
                .as_ref()?
                .max_connections_per_client
        })
        .max();
    // The most permissive of the policies' listener settings; the oldest policy's proxies.
    let specs = || order.iter().map(|(i, _)| &policies[*i].spec.listener);
    // A cap protects the pod: the smallest one set.
    listener.max_upstream_connections = specs().filter_map(|l| l.max_upstream_connections).min();
    if let Some(t) = specs().map(|l| l.send_timeout).max() {
        listener.send_timeout = t;
    }
    if let Some(t) = specs().map(|l| l.body_read_timeout).max() {
        listener.body_read_timeout = t;
    }
    if let Some(rate) = specs().map(|l| l.min_body_rate).min() {
        listener.min_body_rate = rate;
    }
    if let Some(streams) = specs().map(|l| l.max_concurrent_streams).max() {
        listener.http2.max_concurrent_streams = streams;
    }
    listener.trusted_proxies =
        specs()
            .find_map(|l| l.trusted_proxies.as_ref())
            .map(|t| TrustedProxies {
                // The CRD admits CIDRs only (CEL `isCIDR`).
                cidrs: t.cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
                protocol: match t.protocol {
                    TrustedProxyProtocol::ProxyV2 => ProxyProtocol::ProxyV2,
                    TrustedProxyProtocol::XForwardedFor => ProxyProtocol::XForwardedFor,
                },
            });

    let mut client_policies = Vec::new();
    let mut backends = Vec::new();
    let mut used_names = BTreeSet::new();
    for (i, plan) in order {
        let policy = &policies[*i];
        // Fleet-wide client limits: this pod's part, by its place among the holders (as the
        // backends' targets are divided: a pod turning ready changes no document).
        let rank = pod.and_then(|pod| plan.rank(pod));
        let client_policy = policy.spec.clients.as_ref().map(|c| {
            let part = |limit: u32, floor: u32| match c.scope {
                ClientScope::PerPod => limit,
                ClientScope::Fleet => budget::fleet_part(limit, plan.holders.len(), rank, floor),
            };
            let max_concurrency = part(c.max_concurrency, 1);
            let name = client_policy_name(&policy.key.name, &mut used_names);
            client_policies.push(ClientPolicy {
                name: name.clone(),
                identity: match &c.identity.header {
                    Some(h) => ClientIdentity::Header(h.clone()),
                    None => ClientIdentity::SourceIp,
                },
                max_concurrency,
                max_queue: part(c.max_queue, 0),
                queue_timeout: c.queue_timeout,
                overrides: c
                    .overrides
                    .iter()
                    .map(|o| ClientOverride {
                        name: o.name.clone(),
                        key_sha256: o.client.key_sha256.clone(),
                        max_concurrency: part(o.max_concurrency, 1),
                        class: o.class.map(super::priority::class),
                        // A named client's budget divided by where its tokens are used, on a
                        // holder's own document; else its own budget's even part.
                        tokens: match (plan.token_shares.get(&o.name), rank) {
                            (Some(d), Some(r)) => o
                                .tokens
                                .as_ref()
                                .or(c.tokens.as_ref())
                                .map(|t| divided_budget(t, d, r)),
                            _ => o
                                .tokens
                                .as_ref()
                                .map(|t| token_budget(t, c.scope, plan.holders.len(), rank)),
                        },
                        weight: o.weight,
                    })
                    .collect(),
                slow_calls: c.slow_calls.as_ref().map(|s| SlowCalls {
                    threshold: s.threshold,
                    max_ratio: s.max_ratio,
                    demoted_concurrency: part(s.demoted_concurrency, 1).min(max_concurrency),
                    cooldown: s.cooldown,
                    min_calls: s.min_calls,
                }),
                max_clients: c.max_clients,
                priority: super::priority::render(c),
                // This pod's part of the busiest clients' limits (the ConfigMap's document,
                // for pods not counted yet, has none: they get the even split).
                client_shares: match (c.scope, rank) {
                    (ClientScope::Fleet, Some(r)) => plan
                        .client_shares
                        .values()
                        .filter_map(|d| {
                            Some(ClientShare {
                                key_sha256: d.key_sha256.clone(),
                                max_concurrency: *d.concurrency.shares.get(r)?,
                                max_queue: *d.queue.get(r)?,
                            })
                        })
                        .collect(),
                    _ => Vec::new(),
                },
                tokens: c
                    .tokens
                    .as_ref()
                    .map(|t| token_budget(t, c.scope, plan.holders.len(), rank)),
                // This pod's part of the budget of the clients without an override that spend
                // the most of it (the ConfigMap's document has none, as above).
                client_token_shares: match (&c.tokens, c.scope, rank) {
                    (Some(t), ClientScope::Fleet, Some(r)) => plan
                        .client_token_shares
                        .iter()
                        .map(|(key, d)| {
                            let b = divided_budget(t, d, r);
                            ClientTokenShare {
                                key_sha256: key.clone(),
                                per_minute: b.per_minute,
                                per_day: b.per_day,
                                requests_per_minute: b.requests_per_minute,
                            }
                        })
                        .collect(),
                    _ => Vec::new(),
                },
            });
            name
        });
        for (spec, planned) in policy.spec.backends.iter().zip(&plan.backends) {
            // A pod's own document carries its share and the burst; the ConfigMap's (pods that
            // start later, not yet counted among the holders) the smallest share and no burst,
            // so that a pod the plan does not know yet stays inside the budget.
            let burst = if rank.is_some() { planned.burst } else { 0 };
            backends.push(backend(
                policy,
                spec,
                (planned.share_of(rank), burst),
                planned.idle_timeout.in_force,
                client_policy.clone(),
            ));
        }
    }
    GatewayLimits {
        revision: String::new(),
        generation: 0,
        listener,
        client_policies,
        backends,
    }
}

fn backend(
    policy: &PolicyInput,
    b: &BackendSpec,
    (per_pod, burst): (u32, u32),
    idle_timeout: std::time::Duration,
    client_policy: Option<String>,
) -> BackendLimits {
    BackendLimits {
        name: b.name.clone(),
        policy: Some(policy.key.to_string()),
        route: RouteMatch {
            path_prefix: b.route.path_prefix.clone(),
            headers: b.route.headers.clone(),
            model: b.route.model.clone(),
        },
        endpoints: policy.endpoints.get(&b.name).cloned().unwrap_or_default(),
        pool: PoolLimits {
            max_connections_per_endpoint: per_pod,
            max_pending: b.pool.max_pending,
            lease_timeout: b.pool.lease_timeout,
            // The spec's, or lower under the backend's keep-alive (`super::idle_timeout`).
            idle_timeout: idle_timeout.into(),
            max_lifetime: b.pool.max_lifetime,
            connect_timeout: b.pool.connect_timeout,
            validate_after_idle: b.pool.validate_after_idle,
            soft_throttle: b.pool.soft_throttle.as_ref().map(|t| SoftThrottle {
                per_pending: t.per_pending,
                max: t.max,
            }),
            burst_per_endpoint: burst,
        },
        timeouts: Timeouts {
            first_byte: b.timeouts.first_byte,
            total: b.timeouts.total,
            stream_idle: b.timeouts.stream_idle,
        },
        health_check: b.health_check.as_ref().map(|h| HealthCheck {
            path: h.path.clone(),
            interval: h.interval,
            timeout: h.timeout,
            unhealthy_threshold: h.unhealthy_threshold,
            healthy_threshold: h.healthy_threshold,
        }),
        outlier_detection: b.outlier_detection.as_ref().map(|o| OutlierDetection {
            consecutive_failures: o.consecutive_failures,
            base_ejection: o.base_ejection,
            max_ejected_percent: o.max_ejected_percent,
        }),
        client_policy,
        credentials: b.credentials.as_ref().map(credentials),
        protocol: match b.protocol {
            ProtocolSpec::Http1 => UpstreamProtocol::Http1,
            ProtocolSpec::Auto => UpstreamProtocol::Auto,
            ProtocolSpec::Http2 => UpstreamProtocol::Http2,
        },
        fallback: b.fallback.clone(),
        default_max_tokens: b.default_max_tokens,
    }
}

/// A backend's credentials as the gateways take them: the Secret's key as the file the gateway
/// pods mount it as (the key itself never passes through the operator).
fn credentials(c: &CredentialsSpec) -> Credentials {
    Credentials {
        key_file: secret_file(&c.secret_ref.name, &c.secret_ref.key),
        scheme: match c.scheme {
            CredentialSchemeSpec::Bearer => CredentialScheme::Bearer,
            CredentialSchemeSpec::AzureApiKey => CredentialScheme::AzureApiKey,
            CredentialSchemeSpec::Header => CredentialScheme::Header,
        },
        header: c.header.clone(),
        remove_headers: c.remove_headers.clone(),
    }
}

/// The client-policy name of a policy in the documents (the `client_policy` label of its
/// gateway metrics): its name when it fits the document's 63-character label rule, else a
/// prefix plus a short hash.
pub fn client_policy_base(policy: &str) -> String {
    if policy.len() <= 63 {
        policy.to_owned()
    } else {
        let hash = hex::encode(&Sha256::digest(policy.as_bytes())[..4]);
        format!("{}-{hash}", &policy[..54])
    }
}

/// A client-policy name for a policy: [`client_policy_base`], unique within one document.
fn client_policy_name(policy: &str, used: &mut BTreeSet<String>) -> String {
    let mut name = client_policy_base(policy);
    let base = name.clone();
    let mut n = 1;
    while !used.insert(name.clone()) {
        n += 1;
        name = format!("{}-{n}", &base[..base.len().min(60)]);
    }
    name
}

/// A token budget in the document of the holder at `rank`, its part of a division by use:
/// `perMinute` its share, `perDay` and `requestsPerMinute` in the same proportion.
fn divided_budget(t: &TokenBudgetSpec, d: &TokenDivision, rank: usize) -> TokenBudget {
    let mut budget = token_budget(t, ClientScope::PerPod, 1, Some(rank));
    budget.per_minute = d.shares.get(rank).copied().unwrap_or(1).max(1);
    budget.per_day = t.per_day.map(|day| d.part_of(day, rank));
    budget.requests_per_minute = t
        .requests_per_minute
        .map(|r| u32::try_from(d.part_of(r.into(), rank)).unwrap_or(r));
    budget
}

/// A token budget in a pod's document: with `Fleet` scope this pod's part of each bucket
/// (divided over the `pods` holders as the concurrency limits are: rounded down, one more for
/// the first ranks, at least 1), with `PerPod` the budget as written.
fn token_budget(
    t: &TokenBudgetSpec,
    scope: ClientScope,
    pods: usize,
    rank: Option<usize>,
) -> TokenBudget {
    let part = |limit: u64| match scope {
        ClientScope::PerPod => limit,
        ClientScope::Fleet => budget::fleet_part_u64(limit, pods, rank, 1),
    };
    TokenBudget {
        per_minute: part(t.per_minute),
        per_day: t.per_day.map(part),
        count: match t.count {
            TokenCountSpec::Total => TokenCount::Total,
            TokenCountSpec::Output => TokenCount::Output,
            TokenCountSpec::Weighted => TokenCount::Weighted,
        },
        weights: t.weights.map(|w| TokenWeights {
            input: w.input,
            output: w.output,
        }),
        default_max_tokens: t.default_max_tokens,
        requests_per_minute: t.requests_per_minute.map(|r| match scope {
            ClientScope::PerPod => r,
            ClientScope::Fleet => budget::fleet_part(r, pods, rank, 1),
        }),
    }
}
