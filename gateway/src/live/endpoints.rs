//! A backend's endpoints as its pool sees them: an `ip:port` endpoint of the document is one
//! pool endpoint; a DNS-named one (`host:port`) is one pool endpoint per address of its last
//! good answer ([`crate::resolve`]), named `<name>/<ip>`, with the name's cap divided over them
//! (a provider's limit is per account, not per IP: all of a name's addresses together stay
//! within `maxConnectionsPerEndpoint`, and its burst likewise). The pool has one cap for all
//! its endpoints, so a backend's cap per address is the lowest of its names' shares; a backend
//! mixing `ip:port` endpoints with names gets it for all of them. Addresses that left an answer
//! leave the pool as removed endpoints: no new leases, their connections close as they return.

use std::net::{IpAddr, SocketAddr};

use poolpilot_api::limits::{Endpoint as DocEndpoint, EndpointAddress, PoolLimits};

use super::Backend;
use crate::pool::Endpoint;
use crate::resolve::Resolver;

/// The pool endpoints of `endpoints`, and `limits` with the cap and burst per address, given
/// each name's last good answer (`answer`; `None`: none yet, the name has no pool endpoint).
pub(crate) fn expand(
    endpoints: &[DocEndpoint],
    limits: &PoolLimits,
    answer: impl Fn(&str) -> Option<Vec<IpAddr>>,
) -> (Vec<Endpoint>, PoolLimits) {
    let cap = limits.max_connections_per_endpoint.max(1);
    let mut divisor = 1;
    let mut out = Vec::new();
    for e in endpoints {
        match &e.address {
            EndpointAddress::Ip(address) => out.push(Endpoint {
                name: e.name.clone(),
                address: *address,
            }),
            EndpointAddress::Host { host, port } => {
                let addresses = answer(host).unwrap_or_default();
                // No more addresses than connections the name may hold: one each at least.
                let used = addresses.len().min(cap as usize);
                divisor = divisor.max(used as u32);
                out.extend(addresses.into_iter().take(used).map(|ip| Endpoint {
                    name: format!("{}/{ip}", e.name),
                    address: SocketAddr::new(ip, *port),
                }));
            }
        }
    }
    let mut limits = limits.clone();
    limits.max_connections_per_endpoint = cap / divisor;
    limits.burst_per_endpoint /= divisor;
    (out, limits)
}

/// The DNS names of `endpoints`.
pub(crate) fn hosts(endpoints: &[DocEndpoint]) -> impl Iterator<Item = &str> {
    endpoints.iter().filter_map(|e| match &e.address {
        EndpointAddress::Host { host, .. } => Some(host.as_str()),
        EndpointAddress::Ip(_) => None,
    })
}

impl Backend {
    /// Takes the document's endpoints and pool limits (its cap and burst after the pod-wide
    /// share) and sets the pool's endpoints and limits from them and `resolver`'s answers.
    pub(super) fn configure(
        &self,
        endpoints: &[DocEndpoint],
        limits: PoolLimits,
        resolver: &Resolver,
    ) {
        *self.document.lock() = (endpoints.to_vec(), limits);
        self.refresh(resolver);
    }

    /// Sets the pool's endpoints and limits again from the document's and the resolver's
    /// answers (after an answer changed).
    pub(super) fn refresh(&self, resolver: &Resolver) {
        let (endpoints, limits) = {
            let document = self.document.lock();
            self.set_tls(&document.0, &document.1, resolver);
            expand(&document.0, &document.1, |host| resolver.addresses(host))
        };
        self.pool.set_endpoints(&endpoints);
        self.pool.set_limits(limits);
    }

    /// Whether any of its endpoints is a DNS name.
    pub(super) fn has_hosts(&self) -> bool {
        hosts(&self.document.lock().0).next().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(cap: u32, burst: u32) -> PoolLimits {
        let mut l: PoolLimits = serde_json::from_value(serde_json::json!({
            "maxConnectionsPerEndpoint": cap, "maxPending": 10, "leaseTimeout": "1s",
            "idleTimeout": "30s", "maxLifetime": "10m", "connectTimeout": "1s",
            "validateAfterIdle": "2s"
        }))
        .unwrap();
        l.burst_per_endpoint = burst;
        l
    }

    fn doc(name: &str, address: &str) -> DocEndpoint {
        DocEndpoint {
            name: name.into(),
            address: address.parse().unwrap(),
            tls: None,
        }
    }

    #[test]
    fn a_name_is_one_pool_endpoint_per_address_under_one_cap() {
        let ips: Vec<IpAddr> = vec![[127, 0, 0, 21].into(), [127, 0, 0, 22].into()];
        let answer = |host: &str| (host == "api.model.test").then(|| ips.clone());
        let (eps, l) = expand(
            &[doc("provider", "api.model.test:443")],
            &limits(9, 4),
            answer,
        );
        assert_eq!(
            eps,
            [
                Endpoint {
                    name: "provider/127.0.0.21".into(),
                    address: "127.0.0.21:443".parse().unwrap()
                },
                Endpoint {
                    name: "provider/127.0.0.22".into(),
                    address: "127.0.0.22:443".parse().unwrap()
                },
            ]
        );
        // 9 over 2 addresses: 4 each (never more than 9 in all), burst 4 → 2 each.
        assert_eq!(
            (l.max_connections_per_endpoint, l.burst_per_endpoint),
            (4, 2)
        );

        // A cap below the answer's size: as many addresses as connections, one each.
        let (eps, l) = expand(
            &[doc("provider", "api.model.test:443")],
            &limits(1, 0),
            answer,
        );
        assert_eq!(eps.len(), 1);
        assert_eq!(l.max_connections_per_endpoint, 1);

        // No answer yet: no endpoint; an IP endpoint beside it keeps its own.
        let (eps, l) = expand(
            &[doc("a", "127.0.0.9:80"), doc("b", "other.model.test:80")],
            &limits(5, 0),
            answer,
        );
        assert_eq!(eps.len(), 1);
        assert_eq!(l.max_connections_per_endpoint, 5);
    }
}
