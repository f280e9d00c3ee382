//! Which TLS client each endpoint of a backend uses: built when a document is applied (a file
//! that does not load refuses the whole document, and the one in force stays), kept across
//! documents while its settings and files are unchanged (so that its session cache, and with it
//! resumption, survives), and rebuilt when a file changes ([`Backend::reload_tls`], a rotated
//! Secret). The backend's connector learns from [`Backend::set_tls`] which addresses take TLS:
//! an `ip:port` endpoint's address, every address of a DNS name's last answer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use poolpilot_api::limits::{
    Endpoint as DocEndpoint, EndpointAddress, PoolLimits, UpstreamProtocol,
};

use super::{Backend, EndpointTlsError, TlsClients};
use crate::observe::Metrics;
use crate::resolve::Resolver;
use crate::upstream::TlsClient;

/// The TLS clients of `endpoints` (of a `protocol` backend: what ALPN offers): `current`'s where
/// still current, new ones otherwise.
pub(crate) fn clients(
    backend: &str,
    endpoints: &[DocEndpoint],
    protocol: UpstreamProtocol,
    current: Option<&TlsClients>,
    metrics: &Metrics,
) -> Result<TlsClients, EndpointTlsError> {
    let name: Arc<str> = backend.into();
    let mut out = HashMap::new();
    for e in endpoints.iter().filter(|e| e.tls.is_some()) {
        let kept = current
            .and_then(|c| c.get(&e.name))
            .filter(|c| c.is_current(e, protocol))
            .cloned();
        let client = match kept {
            Some(client) => client,
            None => match TlsClient::load(&name, e, protocol, metrics) {
                Ok(Some(client)) => Arc::new(client),
                Ok(None) => continue,
                Err(source) => {
                    return Err(EndpointTlsError {
                        backend: backend.to_owned(),
                        endpoint: e.name.clone(),
                        source: Box::new(source),
                    });
                }
            },
        };
        out.insert(e.name.clone(), client);
    }
    Ok(out)
}

impl Backend {
    /// Tells the connector which addresses take TLS, with which client, from the document's
    /// endpoints and the resolver's answers; each client keeps sessions for as many connections
    /// as its endpoint may open at once (`limits`' cap and burst).
    pub(super) fn set_tls(
        &self,
        endpoints: &[DocEndpoint],
        limits: &PoolLimits,
        resolver: &Resolver,
    ) {
        let clients = self.tls.lock();
        let at_once = limits
            .max_connections_per_endpoint
            .saturating_add(limits.burst_per_endpoint);
        for client in clients.values() {
            client.keep_sessions_for(at_once as usize);
        }
        let mut by_address: HashMap<SocketAddr, Arc<TlsClient>> = HashMap::new();
        for e in endpoints {
            let Some(client) = clients.get(&e.name) else {
                continue;
            };
            match &e.address {
                EndpointAddress::Ip(addr) => {
                    by_address.insert(*addr, client.clone());
                }
                EndpointAddress::Host { host, port } => {
                    for ip in resolver.addresses(host).unwrap_or_default() {
                        by_address.insert(SocketAddr::new(ip, *port), client.clone());
                    }
                }
            }
        }
        self.connector.set_tls(by_address);
    }

    /// Rebuilds the TLS clients whose files changed (a rotated Secret); a file that no longer
    /// loads keeps the client in force, and says so.
    pub(super) fn reload_tls(&self, resolver: &Resolver, metrics: &Metrics) {
        let (endpoints, limits) = self.document.lock().clone();
        if endpoints.iter().all(|e| e.tls.is_none()) {
            return;
        }
        let current = self.tls.lock().clone();
        let protocol = self.connector.protocol();
        let stale = endpoints.iter().filter(|e| e.tls.is_some()).any(|e| {
            !current
                .get(&e.name)
                .is_some_and(|c| c.is_current(e, protocol))
        });
        if !stale {
            return;
        }
        match clients(&self.name, &endpoints, protocol, Some(&current), metrics) {
            Ok(fresh) => {
                tracing::info!(backend = %self.name, "upstream TLS files changed; new connections use them");
                *self.tls.lock() = fresh;
                self.set_tls(&endpoints, &limits, resolver);
            }
            Err(error) => {
                tracing::warn!(%error, "upstream TLS files changed and do not load; the ones in force stay");
            }
        }
    }
}
