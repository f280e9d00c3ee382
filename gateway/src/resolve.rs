//! DNS-named endpoints (`host:port` in the limits document): each name is resolved in a task of
//! its own, in the background and never on a request's path, by a real stub resolver
//! (hickory-resolver: the system's `/etc/resolv.conf`, or the servers the gateway's config
//! names). An answer is kept for its TTL held between `ttlFloor` and `ttlCeiling`, then asked
//! for again; a failed lookup (a timeout, a refusal, no records) keeps the last good answer, is
//! counted, marks the name stale, and is tried again after `ttlFloor`.
//!
//! What the live state does with the answers (one pool endpoint per address, the name's cap
//! divided over them, departed addresses drained) is `crate::live`'s: this module only tells it
//! that an answer changed ([`Resolver::changes`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::observe::Metrics;

/// The `dns` section of the gateway's config: how DNS-named endpoints are resolved.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DnsConfig {
    /// Name servers to ask (`ip:port`); none: the system's (`/etc/resolv.conf`).
    pub servers: Vec<SocketAddr>,
    /// The shortest time an answer is kept, whatever its TTL (also the wait before a failed
    /// lookup is tried again).
    pub ttl_floor: poolpilot_api::Duration,
    /// The longest time an answer is kept, whatever its TTL.
    pub ttl_ceiling: poolpilot_api::Duration,
    /// How long one query may take.
    pub timeout: poolpilot_api::Duration,
}

impl Default for DnsConfig {
    fn default() -> Self {
        Self {
            servers: Vec::new(),
            ttl_floor: poolpilot_api::Duration::from_secs(5),
            ttl_ceiling: poolpilot_api::Duration::from_secs(300),
            timeout: poolpilot_api::Duration::from_secs(2),
        }
    }
}

impl DnsConfig {
    /// What is wrong with it, if anything.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.ttl_floor.get().is_zero() {
            out.push("dns.ttlFloor must be positive".to_owned());
        }
        if self.ttl_ceiling.get() < self.ttl_floor.get() {
            out.push("dns.ttlCeiling must not be below dns.ttlFloor".to_owned());
        }
        if self.timeout.get().is_zero() {
            out.push("dns.timeout must be positive".to_owned());
        }
        out
    }

    /// How long an answer valid for `ttl` is kept.
    pub fn hold(&self, ttl: Duration) -> Duration {
        ttl.clamp(self.ttl_floor.get(), self.ttl_ceiling.get())
    }
}

/// The names wanted, their last good answers, and the tasks that refresh them. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Resolver {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: DnsConfig,
    metrics: Metrics,
    /// Built on the first name wanted: a gateway without DNS names never reads the system's
    /// resolver configuration.
    resolver: OnceLock<Result<TokioResolver, String>>,
    names: Mutex<HashMap<String, Name>>,
    /// Bumped whenever an answer changes.
    changed: watch::Sender<u64>,
}

#[derive(Debug)]
struct Name {
    /// The last good answer, sorted; `None` until the first.
    addresses: Option<Vec<IpAddr>>,
    task: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for name in self.names.get_mut().values() {
            name.task.abort();
        }
    }
}

impl Resolver {
    /// A resolver asking as `config` says, counting in `metrics`.
    pub fn new(config: DnsConfig, metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                metrics,
                resolver: OnceLock::new(),
                names: Mutex::default(),
                changed: watch::channel(0).0,
            }),
        }
    }

    /// Wants exactly `hosts` resolved from now on: a new name is looked up at once (in the
    /// background), a name no longer wanted is forgotten. Needs a tokio runtime when a name is
    /// new.
    pub fn want<'a>(&self, hosts: impl IntoIterator<Item = &'a str>) {
        let wanted: Vec<&str> = hosts.into_iter().collect();
        let mut names = self.inner.names.lock();
        names.retain(|host, name| {
            let keep = wanted.contains(&host.as_str());
            if !keep {
                name.task.abort();
                self.inner.metrics.dns_forget(host);
            }
            keep
        });
        for host in wanted {
            if !names.contains_key(host) {
                let task = tokio::spawn(refresh(Arc::downgrade(&self.inner), host.to_owned()));
                names.insert(
                    host.to_owned(),
                    Name {
                        addresses: None,
                        task,
                    },
                );
            }
        }
    }

    /// The last good answer for `host`, sorted: `None` before the first (or for a name not
    /// wanted).
    pub fn addresses(&self, host: &str) -> Option<Vec<IpAddr>> {
        self.inner.names.lock().get(host)?.addresses.clone()
    }

    /// Changes whenever an answer changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }
}

impl Inner {
    fn resolver(&self) -> Result<&TokioResolver, &str> {
        self.resolver
            .get_or_init(|| {
                let mut builder = if self.config.servers.is_empty() {
                    TokioResolver::builder_tokio().map_err(|e| e.to_string())?
                } else {
                    let mut group = NameServerConfigGroup::new();
                    for server in &self.config.servers {
                        group.merge(NameServerConfigGroup::from_ips_clear(
                            &[server.ip()],
                            server.port(),
                            true,
                        ));
                    }
                    TokioResolver::builder_with_config(
                        ResolverConfig::from_parts(None, Vec::new(), group),
                        TokioConnectionProvider::default(),
                    )
                };
                let mut opts = ResolverOpts::default();
                opts.timeout = self.config.timeout.get();
                opts.attempts = 1;
                // This module holds answers itself, for their TTL within floor and ceiling.
                opts.cache_size = 0;
                *builder.options_mut() = opts;
                Ok(builder.build())
            })
            .as_ref()
            .map_err(String::as_str)
    }

    /// Stores a good answer; tells the live state when it differs from the last.
    fn answered(&self, host: &str, mut addresses: Vec<IpAddr>) {
        addresses.sort();
        addresses.dedup();
        let mut names = self.names.lock();
        let Some(name) = names.get_mut(host) else {
            return;
        };
        if name.addresses.as_ref() != Some(&addresses) {
            tracing::info!(%host, ?addresses, "DNS answer changed");
            self.metrics.dns_addresses(host, addresses.len());
            name.addresses = Some(addresses);
            drop(names);
            self.changed.send_modify(|n| *n += 1);
        }
    }
}

/// Looks `host` up, again and again, for as long as it is wanted.
async fn refresh(inner: Weak<Inner>, host: String) {
    loop {
        let Some(this) = inner.upgrade() else { return };
        let floor = this.config.ttl_floor.get();
        let outcome = match this.resolver() {
            Ok(resolver) => {
                let lookup = resolver.lookup_ip(host.as_str());
                match tokio::time::timeout(this.config.timeout.get() * 2, lookup).await {
                    Ok(Ok(answer)) => {
                        // The shortest TTL of the answer's records (CNAMEs included).
                        let ttl = answer
                            .as_lookup()
                            .records()
                            .iter()
                            .map(|r| r.ttl())
                            .min()
                            .map_or(Duration::ZERO, |s| Duration::from_secs(s.into()));
                        let addresses: Vec<IpAddr> = answer.iter().collect();
                        if addresses.is_empty() {
                            Err("an empty answer".to_owned())
                        } else {
                            Ok((addresses, ttl))
                        }
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("no answer in time".to_owned()),
                }
            }
            Err(e) => Err(format!("no resolver: {e}")),
        };
        let wait = match outcome {
            Ok((addresses, ttl)) => {
                this.metrics.dns_resolved(&host, true);
                this.answered(&host, addresses);
                this.config.hold(ttl)
            }
            Err(error) => {
                this.metrics.dns_resolved(&host, false);
                let kept = this
                    .names
                    .lock()
                    .get(&host)
                    .and_then(|n| n.addresses.as_ref().map(Vec::len));
                tracing::warn!(%host, %error, kept_addresses = ?kept, "DNS lookup failed; the last good answer stays");
                floor
            }
        };
        drop(this);
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_kept_for_its_ttl_within_floor_and_ceiling() {
        let config = DnsConfig::default();
        assert_eq!(config.hold(Duration::from_secs(1)), Duration::from_secs(5));
        assert_eq!(
            config.hold(Duration::from_secs(60)),
            Duration::from_secs(60)
        );
        assert_eq!(
            config.hold(Duration::from_secs(86_400)),
            Duration::from_secs(300)
        );
        assert!(config.problems().is_empty());
        let bad = DnsConfig {
            ttl_floor: poolpilot_api::Duration::from_secs(10),
            ttl_ceiling: poolpilot_api::Duration::from_secs(5),
            ..DnsConfig::default()
        };
        assert_eq!(bad.problems().len(), 1);
    }
}
