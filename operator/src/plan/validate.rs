//! The validate step: what the CRD schema cannot express (or what an apiserver without CEL would
//! let through), and conflicts between policies that select the same pods. A duplicate backend
//! name is resolved oldest-first, as Gateway API does: the newer policy is not accepted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use poolpilot_api::ConnectionPolicySpec;
use poolpilot_api::limits::EndpointAddress;
use poolpilot_api::policy::Mode;
use poolpilot_api::policy::upstream::ProtocolSpec;

use super::input::PolicyInput;

/// Whether a policy is accepted, and if not why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acceptance {
    /// Valid and free of conflicts.
    Accepted,
    /// The spec breaks a rule; every broken rule is listed.
    Invalid(Vec<String>),
    /// An older policy already defines a backend of the same name on a shared pod.
    Conflicted(String),
}

impl Acceptance {
    /// Whether the policy is in force.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Self::Accepted)
    }
}

/// Validates every policy, then resolves conflicts oldest-first. `selection[i]` is the sorted
/// list of pods policy `i` selects.
pub fn accept(policies: &[PolicyInput], selection: &[Vec<String>]) -> Vec<Acceptance> {
    let mut out: Vec<Acceptance> = policies
        .iter()
        .map(|p| match validate_spec(&p.spec) {
            Ok(()) => Acceptance::Accepted,
            Err(errors) => Acceptance::Invalid(errors),
        })
        .collect();

    // Oldest first; ties broken by name so that the outcome never depends on list order.
    let mut order: Vec<usize> = (0..policies.len()).collect();
    order.sort_by(|&a, &b| {
        (policies[a].created, &policies[a].key).cmp(&(policies[b].created, &policies[b].key))
    });

    // Backend names claimed so far: per pod, and per selector (by its canonical JSON) for
    // policies without pods yet. A name has one owner per pod and per selector: a later policy
    // claiming it again is Conflicted and claims nothing.
    let mut by_pod: BTreeMap<&str, BTreeMap<&str, usize>> = BTreeMap::new();
    let mut by_selector: BTreeMap<String, BTreeMap<&str, usize>> = BTreeMap::new();
    let mut place = vec![0; policies.len()];
    for (n, &i) in order.iter().enumerate() {
        place[i] = n;
    }
    for &i in &order {
        if !out[i].is_accepted() {
            continue;
        }
        let p = &policies[i];
        let names: BTreeSet<&str> = p.spec.backends.iter().map(|b| b.name.as_str()).collect();
        let mut clash = None;
        'find: for pod in &selection[i] {
            if let Some(claimed) = by_pod.get(pod.as_str()) {
                for name in &names {
                    if let Some(&owner) = claimed.get(name) {
                        clash = Some((owner, *name, Some(pod.as_str())));
                        break 'find;
                    }
                }
            }
        }
        let selector = serde_json::to_string(&p.spec.gateway_selector).unwrap_or_default();
        if clash.is_none()
            && let Some(claimed) = by_selector.get(&selector)
        {
            // Same selector: they will share pods as soon as any exist. The oldest owner is
            // named, with its first backend (in its spec's order) that this policy repeats.
            clash = names
                .iter()
                .filter_map(|name| claimed.get(name).map(|&owner| (owner, *name)))
                .min_by_key(|&(owner, name)| {
                    let position = policies[owner]
                        .spec
                        .backends
                        .iter()
                        .position(|b| b.name == name);
                    (place[owner], position)
                })
                .map(|(owner, name)| (owner, name, None));
        }
        match clash {
            Some((owner, name, pod)) => {
                let place = pod.map_or_else(
                    || "the same gateway selector".to_owned(),
                    |p| format!("pod {p}"),
                );
                out[i] = Acceptance::Conflicted(format!(
                    "backend {name:?} is already defined by the older policy {} on {place}",
                    policies[owner].key
                ));
            }
            None => {
                for pod in &selection[i] {
                    let claimed = by_pod.entry(pod.as_str()).or_default();
                    for name in &names {
                        claimed.insert(name, i);
                    }
                }
                let claimed = by_selector.entry(selector).or_default();
                for name in &names {
                    claimed.insert(name, i);
                }
            }
        }
    }

    // A pod runs one document with every policy's backends: a Recommend policy on pods an
    // Enforce policy also selects would have its targets rolled out with the other's documents.
    for &i in &order {
        if !out[i].is_accepted() || policies[i].spec.mode != Mode::Recommend {
            continue;
        }
        let enforcing = order.iter().find_map(|&j| {
            let shared = selection[i].iter().find(|p| selection[j].contains(p))?;
            (j != i && out[j].is_accepted() && policies[j].spec.mode == Mode::Enforce)
                .then_some((j, shared))
        });
        if let Some((j, pod)) = enforcing {
            out[i] = Acceptance::Conflicted(format!(
                "mode Recommend on pod {pod}, which policy {} enforces: its documents would roll \
                 this policy's targets out; give this policy pods of its own, or the same mode",
                policies[j].key
            ));
        }
    }
    out
}

/// Every rule of one spec that the schema may not have enforced. Mirrors the CEL rules (an
/// apiserver older than 1.25, or a policy written before a rule existed, skips them) and adds
/// what CEL cannot check, such as `ip:port` syntax.
pub fn validate_spec(spec: &ConnectionPolicySpec) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();
    let mut err = |field: String, msg: String| errors.push(format!("{field}: {msg}"));

    if spec.backends.is_empty() {
        err(
            "spec.backends".into(),
            "at least one backend is required".into(),
        );
    }
    let a = &spec.autoscale;
    if let Some(max) = a.max
        && a.min > max
    {
        err(
            "spec.autoscale.min".into(),
            format!("{} exceeds autoscale.max {max}", a.min),
        );
    }
    if !(0.0..=4.0).contains(&a.margin) {
        err(
            "spec.autoscale.margin".into(),
            format!("{} is outside [0, 4]", a.margin),
        );
    }
    positive(&mut err, "spec.autoscale.interval", a.interval);
    positive(
        &mut err,
        "spec.autoscale.scaleDown.stabilizationWindow",
        a.scale_down.stabilization_window,
    );
    if !(1..=100).contains(&a.scale_down.max_step_percent) {
        err(
            "spec.autoscale.scaleDown.maxStepPercent".into(),
            "must be between 1 and 100".into(),
        );
    }

    let mut names = BTreeSet::new();
    for (i, b) in spec.backends.iter().enumerate() {
        let at = |f: &str| format!("spec.backends[{i}].{f}");
        if !names.insert(b.name.as_str()) {
            err(at("name"), format!("duplicate backend name {:?}", b.name));
        }
        // The CRD's rule says so too; a policy stored under an older CRD still gets the message
        // here rather than a limits document every gateway refuses.
        for (j, f) in b.fallback.iter().enumerate() {
            if *f == b.name || !spec.backends.iter().any(|o| o.name == *f) {
                err(
                    at(&format!("fallback[{j}]")),
                    format!("{f:?} is not another backend of this policy"),
                );
            }
        }
        let c = &b.capacity;
        if c.max_connections_per_endpoint == 0 {
            err(
                at("capacity.maxConnectionsPerEndpoint"),
                "must be at least 1".into(),
            );
        }
        if !(0.0..=0.9).contains(&c.headroom) {
            err(
                at("capacity.headroom"),
                format!("{} is outside [0, 0.9]", c.headroom),
            );
        }
        let budget = f64::from(c.max_connections_per_endpoint) * (1.0 - c.headroom);
        if f64::from(a.min) > budget {
            err(
                "spec.autoscale.min".into(),
                format!(
                    "{} exceeds backend {:?} capacity × (1 − headroom) = {budget}",
                    a.min, b.name
                ),
            );
        }
        if let Some(max) = a.max
            && f64::from(max) > budget
        {
            err(
                "spec.autoscale.max".into(),
                format!(
                    "{max} exceeds backend {:?} capacity × (1 − headroom) = {budget}",
                    b.name
                ),
            );
        }
        match (
            &b.endpoints.service,
            &b.endpoints.addresses,
            &b.endpoints.external,
        ) {
            (Some(_), None, None) => {}
            (None, None, Some(external)) => {
                for (j, e) in external.iter().enumerate() {
                    let address = format!("{}:{}", e.host, e.port);
                    if address.parse::<EndpointAddress>().is_err() || e.port == 0 {
                        err(
                            at(&format!("endpoints.external[{j}]")),
                            format!("{address:?} is not a DNS name and port"),
                        );
                    }
                }
            }
            (None, Some(addrs), None) => {
                let mut seen = BTreeSet::new();
                for (j, e) in addrs.iter().enumerate() {
                    match e.address.parse::<SocketAddr>() {
                        Err(_) => err(
                            at(&format!("endpoints.addresses[{j}].address")),
                            format!("{:?} is not ip:port", e.address),
                        ),
                        Ok(a)
                            if !b.endpoints.allow_private_addresses
                                && !is_backend_address(a.ip()) =>
                        {
                            err(
                                at(&format!("endpoints.addresses[{j}].address")),
                                format!(
                                    "{:?} is a loopback, link-local, metadata or other non-unicast address; set endpoints.allowPrivateAddresses to use it",
                                    e.address
                                ),
                            );
                        }
                        Ok(_) => {}
                    }
                    let name = e.name.as_deref().unwrap_or(&e.address);
                    if !seen.insert(name) {
                        err(
                            at(&format!("endpoints.addresses[{j}].name")),
                            format!("duplicate endpoint {name:?}"),
                        );
                    }
                }
            }
            _ => err(
                at("endpoints"),
                "set exactly one of service, addresses and external".into(),
            ),
        }
        if b.protocol == ProtocolSpec::Auto
            && !b
                .endpoints
                .external
                .as_ref()
                .is_some_and(|e| e.iter().all(|e| e.tls.is_some()))
        {
            err(
                at("protocol"),
                "Auto negotiates by ALPN, over TLS only: set tls on every endpoints.external, or say Http1 or Http2 (h2c) for plain endpoints".into(),
            );
        }
        let p = &b.pool;
        positive(&mut err, &at("pool.leaseTimeout"), p.lease_timeout);
        positive(&mut err, &at("pool.idleTimeout"), p.idle_timeout);
        positive(&mut err, &at("pool.maxLifetime"), p.max_lifetime);
        positive(&mut err, &at("pool.connectTimeout"), p.connect_timeout);
        positive(
            &mut err,
            &at("pool.validateAfterIdle"),
            p.validate_after_idle,
        );
        let t = &b.timeouts;
        positive(&mut err, &at("timeouts.firstByte"), t.first_byte);
        positive(&mut err, &at("timeouts.total"), t.total);
        positive(&mut err, &at("timeouts.streamIdle"), t.stream_idle);
        if t.first_byte > t.total {
            err(
                at("timeouts.firstByte"),
                format!("{} exceeds timeouts.total {}", t.first_byte, t.total),
            );
        }
        if let Some(h) = &b.health_check {
            positive(&mut err, &at("healthCheck.interval"), h.interval);
            if h.timeout > h.interval {
                err(
                    at("healthCheck.timeout"),
                    format!("{} exceeds healthCheck.interval {}", h.timeout, h.interval),
                );
            }
        }
    }

    if let Some(c) = &spec.clients {
        if c.identity.header.is_some() == c.identity.source_ip.is_some() {
            err(
                "spec.clients.identity".into(),
                "set exactly one of header and sourceIP".into(),
            );
        }
        let mut seen = BTreeSet::new();
        for (j, o) in c.overrides.iter().enumerate() {
            if o.name == "other" {
                err(
                    format!("spec.clients.overrides[{j}].name"),
                    "\"other\" is reserved".into(),
                );
            }
            if !seen.insert(o.name.as_str()) {
                err(
                    format!("spec.clients.overrides[{j}].name"),
                    format!("duplicate override {:?}", o.name),
                );
            }
        }
        if let Some(aging) = c.priority.as_ref().and_then(|p| p.aging_after) {
            if aging >= c.queue_timeout {
                err(
                    "spec.clients.priority.agingAfter".into(),
                    format!(
                        "{aging} is not shorter than clients.queueTimeout {}",
                        c.queue_timeout
                    ),
                );
            }
            for (i, b) in spec.backends.iter().enumerate() {
                if aging >= b.pool.lease_timeout {
                    err(
                        "spec.clients.priority.agingAfter".into(),
                        format!(
                            "{aging} is not shorter than backends[{i}].pool.leaseTimeout {}",
                            b.pool.lease_timeout
                        ),
                    );
                }
            }
        }
        if let Some(s) = &c.slow_calls
            && s.demoted_concurrency > c.max_concurrency
        {
            err(
                "spec.clients.slowCalls.demotedConcurrency".into(),
                "exceeds clients.maxConcurrency".into(),
            );
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Cloud metadata services at addresses no other rule catches (`169.254.169.254` is link-local):
/// Alibaba Cloud's, and AWS's over IPv6.
const METADATA_ADDRESSES: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
];

/// Whether a static endpoint may be at `ip` without `allowPrivateAddresses`: a unicast address
/// that leads out of the gateway pod. Not loopback nor unspecified (the pod itself: its admin
/// port would be reachable through the proxy port), not link-local nor a metadata service (the
/// node's credentials), not multicast nor broadcast; IPv4-mapped IPv6 is judged as IPv4. The
/// CRD's CEL rule on `endpoints` says the same (where Kubernetes' `ip()` refuses mapped IPv6).
pub fn is_backend_address(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    if METADATA_ADDRESSES.contains(&ip) {
        return false;
    }
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_unspecified()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_unicast_link_local()
                || v6.is_multicast())
        }
    }
}

fn positive(err: &mut impl FnMut(String, String), field: &str, d: poolpilot_api::Duration) {
    if d.is_zero() {
        err(field.to_owned(), "must be longer than 0s".into());
    }
}
