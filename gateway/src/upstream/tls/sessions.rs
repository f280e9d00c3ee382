//! The session store of one endpoint's TLS client: what rustls's in-memory cache keeps per
//! server (the key-exchange group it chose, its last TLS 1.2 session, TLS 1.3 tickets), with
//! room for as many TLS 1.3 tickets as the endpoint may open connections at once.
//!
//! A TLS 1.3 ticket resumes one connection only (rustls, like RFC 8446 asks, never uses one
//! twice), and a server sends a few with every handshake. rustls's own cache keeps 8 per server:
//! when more than 8 connections to an endpoint open at once (a pool refilling after the server
//! closed many connections together, a burst of load, a restart) the 9th and later make full
//! handshakes although the server would have resumed them. This store keeps up to the
//! endpoint's connection cap (and burst) in tickets, newest used first, oldest dropped first:
//! a burst the pool may open resumes as a single reconnect does. Its memory is bounded by that
//! cap (a ticket is a few hundred bytes; the server's certificate chain is shared by the
//! tickets of one handshake).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use rustls::NamedGroup;
use rustls::client::{ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue};
use rustls::pki_types::ServerName;

/// Tickets kept per server at least: rustls's own number.
pub const MIN_TICKETS: usize = 8;

/// Servers remembered: a client verifies one name, so one is the rule; a few more cost nothing.
const MAX_SERVERS: usize = 4;

/// The sessions of one endpoint's TLS client.
pub struct SessionStore {
    /// Tickets kept per server.
    tickets: AtomicUsize,
    servers: Mutex<HashMap<ServerName<'static>, Server>>,
}

#[derive(Default)]
struct Server {
    kx_hint: Option<NamedGroup>,
    tls12: Option<Tls12ClientSessionValue>,
    /// Oldest first.
    tls13: VecDeque<Tls13ClientSessionValue>,
}

impl SessionStore {
    /// A store keeping up to `tickets` TLS 1.3 tickets per server (at least [`MIN_TICKETS`]).
    pub fn new(tickets: usize) -> Self {
        Self {
            tickets: AtomicUsize::new(tickets.max(MIN_TICKETS)),
            servers: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps up to `tickets` per server from now on (at least [`MIN_TICKETS`]): the connections
    /// the endpoint may open at once, which a new document may change. Tickets above it go, the
    /// oldest first.
    pub fn keep(&self, tickets: usize) {
        let tickets = tickets.max(MIN_TICKETS);
        self.tickets.store(tickets, Ordering::Relaxed);
        for server in self.servers.lock().values_mut() {
            let excess = server.tls13.len().saturating_sub(tickets);
            server.tls13.drain(..excess);
        }
    }

    /// TLS 1.3 tickets held for `server_name`.
    #[cfg(test)]
    pub fn tickets_held(&self, server_name: &ServerName<'_>) -> usize {
        self.servers
            .lock()
            .get(server_name)
            .map_or(0, |s| s.tls13.len())
    }

    /// Edits `server_name`'s entry, made when missing (forgetting another server's when
    /// [`MAX_SERVERS`] are held).
    fn edit(&self, server_name: ServerName<'static>, edit: impl FnOnce(&mut Server, usize)) {
        let tickets = self.tickets.load(Ordering::Relaxed);
        let mut servers = self.servers.lock();
        if !servers.contains_key(&server_name)
            && servers.len() >= MAX_SERVERS
            && let Some(other) = servers.keys().next().cloned()
        {
            servers.remove(&other);
        }
        edit(servers.entry(server_name).or_default(), tickets);
    }
}

impl ClientSessionStore for SessionStore {
    fn set_kx_hint(&self, server_name: ServerName<'static>, group: NamedGroup) {
        self.edit(server_name, |s, _| s.kx_hint = Some(group));
    }

    fn kx_hint(&self, server_name: &ServerName<'_>) -> Option<NamedGroup> {
        self.servers.lock().get(server_name).and_then(|s| s.kx_hint)
    }

    fn set_tls12_session(&self, server_name: ServerName<'static>, value: Tls12ClientSessionValue) {
        self.edit(server_name, |s, _| s.tls12 = Some(value));
    }

    fn tls12_session(&self, server_name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        self.servers
            .lock()
            .get(server_name)
            .and_then(|s| s.tls12.clone())
    }

    fn remove_tls12_session(&self, server_name: &ServerName<'static>) {
        if let Some(s) = self.servers.lock().get_mut(server_name) {
            s.tls12 = None;
        }
    }

    fn insert_tls13_ticket(
        &self,
        server_name: ServerName<'static>,
        value: Tls13ClientSessionValue,
    ) {
        self.edit(server_name, |s, tickets| {
            if s.tls13.len() >= tickets {
                s.tls13.pop_front();
            }
            s.tls13.push_back(value);
        });
    }

    fn take_tls13_ticket(
        &self,
        server_name: &ServerName<'static>,
    ) -> Option<Tls13ClientSessionValue> {
        self.servers
            .lock()
            .get_mut(server_name)
            .and_then(|s| s.tls13.pop_back())
    }
}

impl fmt::Debug for SessionStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the sessions themselves: they hold key material.
        f.debug_struct("SessionStore")
            .field("tickets", &self.tickets.load(Ordering::Relaxed))
            .field("servers", &self.servers.lock().len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::client::Resumption;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use rustls::{ClientConfig, HandshakeKind, RootCertStore, ServerConfig};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;

    const NAME: &str = "model.test";

    /// A TLS 1.3 server for [`NAME`] sending two stateless tickets per handshake (rustls's
    /// default), and the roots that verify it.
    fn server() -> (TlsAcceptor, Arc<RootCertStore>) {
        let cert = rcgen::generate_simple_self_signed(vec![NAME.to_owned()]).unwrap();
        let der = CertificateDer::from(cert.cert.der().to_vec());
        let mut roots = RootCertStore::empty();
        roots.add(der.clone()).unwrap();
        let key = PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
        let mut config = ServerConfig::builder_with_provider(poolpilot_tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der], key)
            .unwrap();
        config.ticketer = rustls::crypto::ring::Ticketer::new().unwrap();
        config.send_tls13_tickets = 2;
        (TlsAcceptor::from(Arc::new(config)), Arc::new(roots))
    }

    fn client(roots: Arc<RootCertStore>, resumption: Resumption) -> TlsConnector {
        let mut config = ClientConfig::builder_with_provider(poolpilot_tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.resumption = resumption;
        TlsConnector::from(Arc::new(config))
    }

    /// Opens `n` connections at once (every ClientHello, and the ticket it resumes with, is
    /// made before any handshake completes), reads a byte on each so that the server's tickets
    /// arrive, and says how many resumed.
    async fn burst(client: &TlsConnector, acceptor: &TlsAcceptor, n: usize) -> usize {
        let name = ServerName::try_from(NAME).unwrap();
        let mut pending = Vec::new();
        for _ in 0..n {
            let (c, s) = tokio::io::duplex(64 * 1024);
            pending.push((client.connect(name.clone(), c), acceptor.accept(s)));
        }
        let mut resumed = 0;
        for (connect, accept) in pending {
            let (client, server) = tokio::join!(connect, accept);
            let (mut client, mut server) = (client.unwrap(), server.unwrap());
            server.write_all(b"x").await.unwrap();
            server.flush().await.unwrap();
            let mut byte = [0u8; 1];
            client.read_exact(&mut byte).await.unwrap();
            if client.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed) {
                resumed += 1;
            }
        }
        resumed
    }

    #[tokio::test]
    async fn a_burst_of_as_many_connections_as_tickets_held_all_resume() {
        let (acceptor, roots) = server();
        let store = Arc::new(SessionStore::new(32));
        let connector = client(roots, Resumption::store(store.clone()));
        let name = ServerName::try_from(NAME).unwrap();

        assert_eq!(
            burst(&connector, &acceptor, 8).await,
            0,
            "nothing to resume yet"
        );
        assert_eq!(store.tickets_held(&name), 16, "two tickets per handshake");
        assert_eq!(burst(&connector, &acceptor, 16).await, 16);
        assert_eq!(
            store.tickets_held(&name),
            32,
            "refilled, up to what it keeps"
        );
    }

    #[tokio::test]
    async fn rustls_own_cache_resumes_only_eight_of_such_a_burst() {
        // Why the store exists: the same bursts against rustls's cache (8 tickets per server).
        let (acceptor, roots) = server();
        let connector = client(roots, Resumption::in_memory_sessions(256));
        assert_eq!(burst(&connector, &acceptor, 8).await, 0);
        assert_eq!(burst(&connector, &acceptor, 16).await, 8);
    }

    #[tokio::test]
    async fn keeping_fewer_drops_the_oldest_tickets_and_never_goes_below_rustls_own_number() {
        let (acceptor, roots) = server();
        let store = Arc::new(SessionStore::new(32));
        let connector = client(roots, Resumption::store(store.clone()));
        let name = ServerName::try_from(NAME).unwrap();
        burst(&connector, &acceptor, 12).await;
        assert_eq!(store.tickets_held(&name), 24);
        store.keep(10);
        assert_eq!(store.tickets_held(&name), 10);
        store.keep(1);
        assert_eq!(store.tickets_held(&name), MIN_TICKETS);
        burst(&connector, &acceptor, 1).await;
        assert_eq!(
            store.tickets_held(&name),
            MIN_TICKETS,
            "one taken, two arrived, the oldest dropped"
        );
        assert_eq!(burst(&connector, &acceptor, 8).await, 8);
    }

    #[test]
    fn its_debug_output_shows_no_session() {
        let store = SessionStore::new(3);
        assert_eq!(
            format!("{store:?}"),
            "SessionStore { tickets: 8, servers: 0 }"
        );
    }
}
