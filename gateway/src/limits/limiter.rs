//! The per-client limiter of one client policy: max concurrency per client (with named
//! overrides, an allowlist for batch callers), a bounded per-client queue with a queue
//! timeout (interactive calls before batch ones, FIFO within a class, batch aging:
//! [`crate::limits::queue`]), the priority class of each call, and slow-call demotion for a
//! cooldown. Clients are known only by the SHA-256 of their identity (API key or source IP):
//! raw keys are never stored, logged or exported.
//!
//! A client's limits, first match wins: its override (`maxConcurrency`; the policy's
//! `maxQueue`), its share in this pod (`clientShares`: the operator's division of its
//! fleet-wide limits by where its calls arrive), the policy's `maxConcurrency` and `maxQueue`.
//! A demoted client gets the lower of `demotedConcurrency` and that. A new document changes the
//! limits of the clients in the table at once: raised ones admit queued calls, lowered ones
//! never cut a call in flight (new calls wait until the client is under the new limit).
//! Each client's recent demand (in flight + queued, averaged over 10 s: [`super::demand`]) and
//! the tokens its calls used over the same 10 s are what `GET /v1/clients` reports, ranked by
//! either ([`Ranking`]); the top clients by tokens are also a bounded gauge
//! ([`ClientLimiter::top_by_tokens`]).
//!
//! A client policy with token budgets (`tokens`, an override's own) holds its clients' token
//! buckets here too ([`crate::tokens::budget`]): a call's estimate is reserved before it joins
//! the queue ([`ClientLimiter::reserve_tokens`], 429 `rate_limit_exceeded`), and the reservation
//! rides in the call's permit until the response's end settles it.
//!
//! Memory is bounded: a client has an entry only while it has calls in flight or queued, or
//! something to remember (a demotion, slow calls in its recent window); a client with nothing
//! in flight and nothing to remember is forgotten at once, one with history after a while. The
//! table holds at most `maxClients` entries: a new client evicts the longest-idle one (counted),
//! and finds no room (503) only while every entry has calls in flight or queued.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use parking_lot::Mutex;
use poolpilot_api::limits::{ClientIdentity, ClientPolicy, PriorityClass, TokenBudget};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::limits::demand::{DemandTable, Recent};
use crate::limits::queue::{ClassQueue, Entry};
use crate::observe::Metrics;
use crate::pool::rate_whole_seconds;
use crate::tokens::budget::{TokenBudgets, TokenRejection, TokenReservation};
use crate::tokens::estimate::Estimate;

/// The label of clients without an override.
pub const OTHER: &str = "other";

/// A client's identity: the SHA-256 of its key. Never holds the raw key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientKey([u8; 32]);

impl ClientKey {
    /// Hashes an identity value (the API key, or the IP address as text).
    pub fn of(value: &[u8]) -> Self {
        Self(Sha256::digest(value).into())
    }

    /// The whole digest in hex (64 digits), as `keySha256` names clients in the limits.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The client in the pool queue's token-fair order ([`crate::limits::fair::Ticket`]):
    /// the digest's first 8 bytes.
    pub fn fair_id(&self) -> u64 {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.0[..8]);
        u64::from_be_bytes(first)
    }

    /// A short, non-reversible display form (`sha256:` and 12 hex digits).
    pub fn short(&self) -> String {
        format!("sha256:{}", hex::encode(&self.0[..6]))
    }
}

impl fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short())
    }
}

/// Why a client's request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClientRejection {
    /// Over its concurrency and its queue is full.
    #[error("client {client} is over its concurrency limit of {limit} and its queue is full")]
    Concurrency {
        /// Override name or `other`.
        client: Arc<str>,
        /// The limit in force (lower while demoted).
        limit: u32,
        /// Computed from the client's drain rate or its demotion cooldown.
        retry_after: Duration,
    },
    /// Waited `queueTimeout` in its queue.
    #[error("client {client} waited {waited:?} in its queue")]
    QueueTimeout {
        /// Override name or `other`.
        client: Arc<str>,
        /// How long it waited.
        waited: Duration,
        /// Computed from the client's drain rate or its demotion cooldown.
        retry_after: Duration,
    },
    /// A new client, and every entry of the client table has calls in flight or queued.
    #[error("the gateway tracks {max} clients with calls in flight; no room for another")]
    TableFull {
        /// `maxClients`.
        max: u32,
    },
}

impl ClientRejection {
    /// The client's override name or `other`, when the rejection names it.
    pub fn client(&self) -> Option<&Arc<str>> {
        match self {
            Self::Concurrency { client, .. } | Self::QueueTimeout { client, .. } => Some(client),
            Self::TableFull { .. } => None,
        }
    }

    /// The metric reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Concurrency { .. } => "client_concurrency",
            Self::QueueTimeout { .. } => "client_queue_timeout",
            Self::TableFull { .. } => "client_table_full",
        }
    }
}

/// A client in `/v1/stats`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ClientStats {
    /// Override name, or the short hash of the key.
    pub client: String,
    /// Calls in flight.
    pub inflight: u32,
    /// Calls queued.
    pub queued: u32,
    /// The concurrency limit in force.
    pub limit: u32,
    /// Whether slow calls demoted it.
    pub demoted: bool,
}

/// A client in `GET /v1/clients`: its key's digest, its calls now and its recent demand.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientDemand {
    /// Hex SHA-256 of the client's identity value (64 digits), as `clientShares` key it.
    pub key_sha256: String,
    /// Calls in flight now.
    pub in_flight: u32,
    /// Calls queued now.
    pub queued: u32,
    /// Calls in flight plus queued, time-weighted average over the last 10 s.
    pub demand: f64,
    /// Input (prompt) tokens a second of its calls that ended over the last 10 s.
    pub input_tokens_per_second: f64,
    /// Output (completion) tokens a second of the same.
    pub output_tokens_per_second: f64,
}

pub use poolpilot_api::admin::Ranking;

/// A client among the top by tokens ([`ClientLimiter::top_by_tokens`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenUser {
    /// Its override's name, or the short hash of its key (as `/v1/stats` names it).
    pub client: String,
    /// Input tokens a second over the last 10 s.
    pub input: f64,
    /// Output tokens a second.
    pub output: f64,
}

/// Three decimals: a smoothed rate, not a measurement to the nanosecond.
fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The limiter of one client policy. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ClientLimiter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    metrics: Metrics,
    state: Mutex<State>,
    /// The clients' token buckets.
    tokens: TokenBudgets<ClientKey>,
}

#[derive(Debug)]
struct State {
    policy: ClientPolicy,
    overrides: HashMap<ClientKey, Override>,
    /// This pod's part of its clients' fleet-wide limits (`clientShares`).
    shares: HashMap<ClientKey, Share>,
    clients: HashMap<ClientKey, Client>,
    /// The clients' recent demand, for `GET /v1/clients`.
    demand: DemandTable<ClientKey>,
    /// Clients kept while idle (they have history), in the order they went idle, with the
    /// `last_seen` they had then: a record whose client was busy since is stale and skipped.
    idle: VecDeque<(ClientKey, Instant)>,
    next_waiter: u64,
}

#[derive(Debug)]
struct Client {
    label: Arc<str>,
    inflight: u32,
    queue: ClassQueue<oneshot::Sender<()>>,
    /// Outcomes of recent calls (true = slow), newest last.
    recent: VecDeque<bool>,
    demoted_until: Option<Instant>,
    /// Mean call duration, seconds (EWMA).
    mean_call: Option<f64>,
    last_seen: Instant,
}

/// A granted call slot, held for the whole call (response body included). Dropping it ends
/// the call: its duration feeds the client's pace, its longest wait for the backend (see
/// [`ClientPermit::frame`]) its slow-call ratio, and a queued call of the same client is
/// admitted.
#[derive(Debug)]
pub struct ClientPermit {
    limiter: Arc<Inner>,
    key: ClientKey,
    label: Arc<str>,
    started: Instant,
    /// When the latest response body frame arrived (`None`: none yet).
    last_frame: Option<Instant>,
    /// The longest wait so far: to the first frame, or between two frames.
    longest_wait: Duration,
    /// The call's token reservation, until its response takes it to settle.
    tokens: Option<TokenReservation<ClientKey>>,
}

// === impl ClientLimiter ===

impl ClientLimiter {
    /// A limiter enforcing `policy`.
    pub fn new(policy: ClientPolicy, metrics: Metrics) -> Self {
        let overrides = overrides_of(&policy);
        let shares = shares_of(&policy);
        let (budget, budgets) = token_budgets_of(&policy);
        let tokens = TokenBudgets::new(budget, budgets, policy.max_clients as usize);
        Self {
            inner: Arc::new(Inner {
                tokens,
                metrics,
                state: Mutex::new(State {
                    policy,
                    overrides,
                    shares,
                    clients: HashMap::new(),
                    demand: DemandTable::new(Instant::now()),
                    idle: VecDeque::new(),
                    next_waiter: 0,
                }),
            }),
        }
    }

    /// Applies a new policy in place: clients keep their in-flight calls, queues and
    /// demotions; raised limits (the policy's, an override's, a client's share) admit queued
    /// calls at once, lowered ones cut nothing (the excess waits).
    pub fn set_policy(&self, policy: ClientPolicy) {
        let mut state = self.inner.state.lock();
        let (budget, budgets) = token_budgets_of(&policy);
        self.inner
            .tokens
            .set(budget, budgets, policy.max_clients as usize);
        state.overrides = overrides_of(&policy);
        state.shares = shares_of(&policy);
        state.policy = policy;
        let overrides = state.overrides.clone();
        for (key, client) in &mut state.clients {
            client.label = overrides
                .get(key)
                .map_or_else(|| OTHER.into(), |o| o.name.clone());
        }
        let keys: Vec<ClientKey> = state.clients.keys().copied().collect();
        let now = Instant::now();
        for key in keys {
            state.admit_queued(&key, now);
            state.note(&key, now);
        }
    }

    /// The identity rule of the policy.
    pub fn identity(&self) -> ClientIdentity {
        self.inner.state.lock().policy.identity.clone()
    }

    /// The priority class of a call of `key` with request `headers`: the override's class,
    /// else the policy's header as the policy takes it (every value of it, the lowest wins:
    /// `batch` always, `interactive` only when trusted), else the policy's default ([`poolpilot_api::limits::Priority::class_of`]).
    pub fn classify(&self, key: ClientKey, headers: &HeaderMap) -> PriorityClass {
        let state = self.inner.state.lock();
        let pinned = state.overrides.get(&key).and_then(|o| o.class);
        let Some(priority) = &state.policy.priority else {
            return pinned.unwrap_or_default();
        };
        let values = match (&priority.header, pinned) {
            (Some(name), None) => Some(headers.get_all(name.as_str())),
            _ => None,
        };
        priority.class_of(pinned, values.into_iter().flatten())
    }

    /// The weight of `key` in the pool queue's token-fair order: its override's, else 1.
    pub fn weight_of(&self, key: &ClientKey) -> u32 {
        self.inner
            .state
            .lock()
            .overrides
            .get(key)
            .map_or(crate::limits::fair::DEFAULT_WEIGHT, |o| o.weight)
    }

    /// The output tokens a call of `key` that does not say is assumed to reserve (its
    /// budget's `defaultMaxTokens`).
    pub fn default_max_tokens(&self, key: &ClientKey) -> u64 {
        self.inner
            .tokens
            .budget_of(key)
            .map_or(TokenBudget::DEFAULT_MAX_TOKENS, |b| b.default_max_tokens)
    }

    /// Reserves a call's `estimate` in the token budget of `key`, or refuses it (counted as a
    /// `client_tokens` rejection); `Ok(None)`: the client has no budget.
    pub fn reserve_tokens(
        &self,
        key: ClientKey,
        estimate: Estimate,
    ) -> Result<Option<TokenReservation<ClientKey>>, Box<TokenRejection>> {
        let (label, policy) = {
            let state = self.inner.state.lock();
            (state.label(&key), state.policy.name.clone())
        };
        let counted = |r: TokenReservation<ClientKey>| {
            r.count_in(self.inner.metrics.client_tokens(&policy, &label))
        };
        self.inner
            .tokens
            .reserve(key, &label, estimate)
            .map(|r| r.map(counted))
            .inspect_err(|_| self.inner.metrics.client_rejected(&label, "client_tokens"))
    }

    /// Admits an interactive call of `key` (see [`Self::acquire_as`]).
    #[cfg(test)]
    pub async fn acquire(&self, key: ClientKey) -> Result<ClientPermit, ClientRejection> {
        self.acquire_as(key, PriorityClass::Interactive).await
    }

    /// Admits a call of `key` of priority `class`, queueing it up to `queueTimeout` while the
    /// client is at its limit; queued calls are admitted interactive first, FIFO within a
    /// class, a batch call that waited `agingAfter` as an interactive one arriving then.
    pub async fn acquire_as(
        &self,
        key: ClientKey,
        class: PriorityClass,
    ) -> Result<ClientPermit, ClientRejection> {
        let start = Instant::now();
        let (rx, id, label, queue_timeout) = {
            let mut state = self.inner.state.lock();
            let limit = state.limit(&key, start);
            let max_queue = state.max_queue(&key) as usize;
            let queue_timeout = state.policy.queue_timeout.get();
            let label = state.label(&key);
            if !state.clients.contains_key(&key) && !state.make_room(&self.inner.metrics) {
                let err = ClientRejection::TableFull {
                    max: state.policy.max_clients,
                };
                self.inner.metrics.client_rejected(&label, err.reason());
                return Err(err);
            }
            let policy = state.policy.name.clone();
            let client = state.client(key, label.clone(), start);
            // The concurrency this client asks for, admitted or not: its calls in flight and
            // queued, and this one.
            let demand = client.inflight + client.queue.len() as u32 + 1;
            self.inner
                .metrics
                .incidents()
                .client_concurrency(&policy, demand);
            if client.inflight < limit && client.queue.is_empty() {
                client.inflight += 1;
                state.note(&key, start);
                self.inner.metrics.client_queue_wait(&label, 0.0);
                self.inner.metrics.client_class_queue_wait(class, 0.0);
                return Ok(self.permit(key, label));
            }
            if client.queue.len() >= max_queue {
                let err = ClientRejection::Concurrency {
                    client: label.clone(),
                    limit,
                    retry_after: client.retry_after(limit, start, queue_timeout),
                };
                self.inner.metrics.client_rejected(&label, err.reason());
                return Err(err);
            }
            let (tx, rx) = oneshot::channel();
            let id = state.next_waiter;
            state.next_waiter += 1;
            state
                .clients
                .get_mut(&key)
                .expect("just inserted")
                .queue
                .push(Entry {
                    id,
                    since: start,
                    class,
                    item: tx,
                });
            state.note(&key, start);
            (rx, id, label, queue_timeout)
        };
        if !matches!(tokio::time::timeout(queue_timeout, rx).await, Ok(Ok(()))) {
            {
                let mut state = self.inner.state.lock();
                let now = Instant::now();
                let limit = state.limit(&key, now);
                // Still queued: it timed out. Gone: admitted while the timer fired, the slot
                // is ours.
                if let Some(c) = state.clients.get_mut(&key)
                    && c.queue.remove(id).is_some()
                {
                    let err = ClientRejection::QueueTimeout {
                        client: label.clone(),
                        waited: start.elapsed(),
                        retry_after: c.retry_after(limit, now, queue_timeout),
                    };
                    self.inner.metrics.client_rejected(&label, err.reason());
                    state.settle(&key, now);
                    state.note(&key, now);
                    return Err(err);
                }
            }
        }
        let waited = start.elapsed().as_secs_f64();
        self.inner.metrics.client_queue_wait(&label, waited);
        self.inner.metrics.client_class_queue_wait(class, waited);
        Ok(self.permit(key, label))
    }

    fn permit(&self, key: ClientKey, label: Arc<str>) -> ClientPermit {
        ClientPermit {
            limiter: self.inner.clone(),
            key,
            label,
            started: Instant::now(),
            last_frame: None,
            longest_wait: Duration::ZERO,
            tokens: None,
        }
    }

    /// Clients by calls in flight, most first, at most `n`.
    pub fn top_clients(&self, n: usize) -> Vec<ClientStats> {
        let now = Instant::now();
        let state = self.inner.state.lock();
        let mut all: Vec<ClientStats> = state
            .clients
            .iter()
            .filter(|(_, c)| c.inflight > 0 || !c.queue.is_empty())
            .map(|(key, c)| ClientStats {
                client: match state.overrides.get(key) {
                    Some(o) => o.name.to_string(),
                    None => key.short(),
                },
                inflight: c.inflight,
                queued: c.queue.len() as u32,
                limit: state.limit(key, now),
                demoted: c.demoted_until.is_some_and(|u| now < u),
            })
            .collect();
        all.sort_by(|a, b| {
            b.inflight
                .cmp(&a.inflight)
                .then_with(|| a.client.cmp(&b.client))
        });
        all.truncate(n);
        all
    }

    /// The busiest clients by recent demand or tokens (see [`ClientDemand`]), most first, at
    /// most `n`.
    pub fn busiest(&self, n: usize, by: Ranking) -> Vec<ClientDemand> {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        let recent = state.demand.all(now);
        let mut all: Vec<ClientDemand> = recent
            .into_iter()
            .map(|(key, recent)| {
                let (in_flight, queued) = state
                    .clients
                    .get(&key)
                    .map_or((0, 0), |c| (c.inflight, c.queue.len() as u32));
                ClientDemand {
                    key_sha256: key.hex(),
                    in_flight,
                    queued,
                    demand: round3(recent.demand),
                    input_tokens_per_second: round3(recent.input),
                    output_tokens_per_second: round3(recent.output),
                }
            })
            .collect();
        let tokens = |c: &ClientDemand| c.input_tokens_per_second + c.output_tokens_per_second;
        all.sort_by(|a, b| {
            let first = match by {
                Ranking::Demand => b.demand.total_cmp(&a.demand),
                Ranking::Tokens => tokens(b).total_cmp(&tokens(a)),
            };
            first
                .then_with(|| (b.in_flight + b.queued).cmp(&(a.in_flight + a.queued)))
                .then_with(|| a.key_sha256.cmp(&b.key_sha256))
        });
        all.truncate(n);
        all
    }

    /// The `n` clients with the most tokens a second over the last 10 s (input and output,
    /// named as `/v1/stats` names them, or by rank for clients identified by their address),
    /// most first, and what the others used together.
    pub fn top_by_tokens(&self, n: usize) -> (Vec<TokenUser>, Recent) {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        let mut all: Vec<(ClientKey, Recent)> = state
            .demand
            .all(now)
            .into_iter()
            .filter(|(_, r)| r.tokens() > 0.0)
            .collect();
        all.sort_by(|a, b| {
            b.1.tokens()
                .total_cmp(&a.1.tokens())
                .then_with(|| a.0.0.cmp(&b.0.0))
        });
        let mut rest = Recent::default();
        for (_, r) in all.iter().skip(n) {
            rest.input += r.input;
            rest.output += r.output;
        }
        // A client identified by its address is not named by its digest here: the metrics
        // endpoint is open, and the digest of an IPv4 address is undone by hashing all 2³² of
        // them. It is named by its rank instead (`/v1/clients`, behind the admin token, has
        // its key).
        let by_address = matches!(state.policy.identity, ClientIdentity::SourceIp);
        let top = all
            .into_iter()
            .take(n)
            .enumerate()
            .map(|(rank, (key, r))| TokenUser {
                client: match state.overrides.get(&key) {
                    Some(o) => o.name.to_string(),
                    None if by_address => format!("rank:{}", rank + 1),
                    None => key.short(),
                },
                input: r.input,
                output: r.output,
            })
            .collect();
        (top, rest)
    }

    /// Calls in flight per client label (override names and `other`), for the gauge.
    pub fn inflight_by_label(&self) -> HashMap<Arc<str>, u32> {
        let state = self.inner.state.lock();
        let mut out: HashMap<Arc<str>, u32> = HashMap::new();
        for o in state.overrides.values() {
            out.entry(o.name.clone()).or_default();
        }
        out.entry(OTHER.into()).or_default();
        for c in state.clients.values() {
            *out.entry(c.label.clone()).or_default() += c.inflight;
        }
        out
    }

    /// Calls queued per class, interactive then batch, for the gauge.
    pub fn queued_by_class(&self) -> [u32; 2] {
        let state = self.inner.state.lock();
        let mut out = [0; 2];
        for c in state.clients.values() {
            for class in PriorityClass::ALL {
                out[class.index()] += c.queue.len_of(class) as u32;
            }
        }
        out
    }

    /// Drops entries of clients idle for longer than their history matters.
    pub fn purge(&self) {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        let keep_for = state
            .policy
            .slow_calls
            .as_ref()
            .map_or(Duration::ZERO, |s| {
                s.cooldown.get().max(s.threshold.get() * 2)
            })
            .max(Duration::from_secs(60));
        state.clients.retain(|_, c| {
            c.inflight > 0
                || !c.queue.is_empty()
                || c.demoted_until.is_some_and(|u| now < u)
                || now.duration_since(c.last_seen) < keep_for
        });
        state.compact_idle();
        state.demand.purge(now);
        drop(state);
        self.inner.tokens.purge();
    }

    /// Entries held (the `poolpilot_clients_tracked` gauge, and tests of the memory bound).
    pub fn tracked_clients(&self) -> usize {
        self.inner.state.lock().clients.len()
    }
}

/// What an override says of its client.
#[derive(Clone, Debug)]
struct Override {
    /// Its name, the client's label.
    name: Arc<str>,
    /// Its concurrency limit.
    max_concurrency: u32,
    /// The priority class it pins, if it does.
    class: Option<PriorityClass>,
    /// Its weight in the pool queue's token-fair order.
    weight: u32,
}

/// A client's part of its fleet-wide limits in this pod (`clientShares`).
#[derive(Clone, Copy, Debug)]
struct Share {
    max_concurrency: u32,
    max_queue: u32,
}

fn shares_of(policy: &ClientPolicy) -> HashMap<ClientKey, Share> {
    policy
        .client_shares
        .iter()
        .filter_map(|s| {
            let mut key = [0u8; 32];
            hex::decode_to_slice(&s.key_sha256, &mut key).ok()?;
            let share = Share {
                max_concurrency: s.max_concurrency,
                max_queue: s.max_queue,
            };
            Some((ClientKey(key), share))
        })
        .collect()
}

/// The policy's token budget, and the budgets of the clients that have their own: an
/// override's (when it has one), else this pod's part of a client's fleet-wide budget
/// (`clientTokenShares`). An override's client never takes a share: with no budget of its own
/// it has the policy's, as the operator divides it.
fn token_budgets_of(
    policy: &ClientPolicy,
) -> (Option<TokenBudget>, HashMap<ClientKey, TokenBudget>) {
    let key_of = |hex_key: &str| {
        let mut key = [0u8; 32];
        hex::decode_to_slice(hex_key, &mut key).ok()?;
        Some(ClientKey(key))
    };
    let overridden: HashSet<ClientKey> = policy
        .overrides
        .iter()
        .filter_map(|o| key_of(&o.key_sha256))
        .collect();
    let shares = policy.tokens.iter().flat_map(|budget| {
        policy.client_token_shares.iter().filter_map(|s| {
            let key = key_of(&s.key_sha256)?;
            (!overridden.contains(&key)).then(|| (key, s.budget(budget)))
        })
    });
    let overrides = policy
        .overrides
        .iter()
        .filter_map(|o| Some((key_of(&o.key_sha256)?, o.tokens.clone()?)));
    (policy.tokens.clone(), shares.chain(overrides).collect())
}

fn overrides_of(policy: &ClientPolicy) -> HashMap<ClientKey, Override> {
    policy
        .overrides
        .iter()
        .filter_map(|o| {
            let mut key = [0u8; 32];
            hex::decode_to_slice(&o.key_sha256, &mut key).ok()?;
            let entry = Override {
                name: o.name.as_str().into(),
                max_concurrency: o.max_concurrency,
                class: o.class,
                weight: o.weight.unwrap_or(crate::limits::fair::DEFAULT_WEIGHT),
            };
            Some((ClientKey(key), entry))
        })
        .collect()
}

// === impl State ===

impl State {
    fn label(&self, key: &ClientKey) -> Arc<str> {
        self.overrides
            .get(key)
            .map_or_else(|| OTHER.into(), |o| o.name.clone())
    }

    /// Makes room for one more client: true when the table has room, or had once the
    /// longest-idle client was forgotten (counted); false when every entry is busy.
    fn make_room(&mut self, metrics: &Metrics) -> bool {
        if self.clients.len() < self.policy.max_clients as usize {
            return true;
        }
        while let Some((key, went_idle)) = self.idle.pop_front() {
            let evictable = self
                .clients
                .get(&key)
                .is_some_and(|c| c.is_idle() && c.last_seen == went_idle);
            if evictable {
                self.clients.remove(&key);
                metrics.client_evicted();
                return true;
            }
        }
        false
    }

    /// After a client's call ended or left its queue: a client left idle is forgotten at once
    /// unless it has something to remember, and then queued for eviction.
    fn settle(&mut self, key: &ClientKey, now: Instant) {
        let Some(client) = self.clients.get(key) else {
            return;
        };
        if !client.is_idle() {
            return;
        }
        if client.remembers(now) {
            self.idle.push_back((*key, client.last_seen));
            if self.idle.len() > 2 * self.clients.len() + 64 {
                self.compact_idle();
            }
        } else {
            self.clients.remove(key);
        }
    }

    /// Drops the stale records of the idle queue.
    fn compact_idle(&mut self) {
        let clients = &self.clients;
        self.idle.retain(|(key, went_idle)| {
            clients
                .get(key)
                .is_some_and(|c| c.is_idle() && c.last_seen == *went_idle)
        });
    }

    fn client(&mut self, key: ClientKey, label: Arc<str>, now: Instant) -> &mut Client {
        let client = self.clients.entry(key).or_insert_with(|| Client {
            label,
            inflight: 0,
            queue: ClassQueue::default(),
            recent: VecDeque::new(),
            demoted_until: None,
            mean_call: None,
            last_seen: now,
        });
        client.last_seen = now;
        client
    }

    /// The limit of `key` now: its override's, else its share's, else the policy's; lowered
    /// while demoted.
    fn limit(&self, key: &ClientKey, now: Instant) -> u32 {
        let base = match (self.overrides.get(key), self.shares.get(key)) {
            (Some(o), _) => o.max_concurrency,
            (None, Some(share)) => share.max_concurrency,
            (None, None) => self.policy.max_concurrency,
        };
        let demoted = self
            .clients
            .get(key)
            .and_then(|c| c.demoted_until)
            .is_some_and(|until| now < until);
        match (&self.policy.slow_calls, demoted) {
            (Some(slow), true) => slow.demoted_concurrency.min(base),
            _ => base,
        }
    }

    /// The queue bound of `key`: its share's `maxQueue` unless an override names it, else the
    /// policy's.
    fn max_queue(&self, key: &ClientKey) -> u32 {
        match (self.overrides.contains_key(key), self.shares.get(key)) {
            (false, Some(share)) => share.max_queue,
            _ => self.policy.max_queue,
        }
    }

    /// Records the calls `key` has in flight and queued now in its recent demand.
    fn note(&mut self, key: &ClientKey, now: Instant) {
        let level = self
            .clients
            .get(key)
            .map_or(0, |c| c.inflight + c.queue.len() as u32);
        let bound = self.policy.max_clients as usize;
        self.demand.record(*key, level, now, bound);
    }

    /// Hands free slots of `key` to its queued calls: interactive first, FIFO within a
    /// class, a batch call aged past `agingAfter` as an interactive one arriving then.
    fn admit_queued(&mut self, key: &ClientKey, now: Instant) {
        let limit = self.limit(key, now);
        let queue_timeout = self.policy.queue_timeout.get();
        let aging = self
            .policy
            .priority
            .as_ref()
            .map_or(queue_timeout / 2, |p| p.aging_in(queue_timeout));
        let Some(client) = self.clients.get_mut(key) else {
            return;
        };
        while client.inflight < limit {
            let Some(class) = client.queue.next(aging, true) else {
                break;
            };
            let Some(waiter) = client.queue.pop(class) else {
                break;
            };
            if waiter.item.send(()).is_ok() {
                client.inflight += 1;
            }
        }
    }

    /// Records a finished call: its duration (`took`, the client's pace), and whether its
    /// longest wait for the backend (`waited`) was slow, with the demotion that may follow.
    fn finish(&mut self, key: &ClientKey, took: Duration, waited: Duration, now: Instant) {
        let slow = self.policy.slow_calls.clone();
        let Some(client) = self.clients.get_mut(key) else {
            return;
        };
        client.inflight = client.inflight.saturating_sub(1);
        client.last_seen = now;
        let secs = took.as_secs_f64();
        client.mean_call = Some(client.mean_call.map_or(secs, |m| m + 0.2 * (secs - m)));
        let Some(slow) = slow else { return };
        if client.demoted_until.is_some_and(|u| now >= u) {
            tracing::info!(client = %client.label, "client restored after its slow-call cooldown");
            client.demoted_until = None;
        }
        let window = (slow.min_calls.max(1) as usize) * 2;
        client.recent.push_back(waited > slow.threshold.get());
        while client.recent.len() > window {
            client.recent.pop_front();
        }
        if client.demoted_until.is_none() && client.recent.len() >= slow.min_calls as usize {
            let slow_calls = client.recent.iter().filter(|s| **s).count();
            let ratio = slow_calls as f64 / client.recent.len() as f64;
            if ratio > slow.max_ratio {
                tracing::warn!(
                    client = %client.label,
                    ratio,
                    cooldown = %slow.cooldown,
                    "client demoted: too many slow calls"
                );
                client.demoted_until = Some(now + slow.cooldown.get());
                client.recent.clear();
            }
        }
    }
}

// === impl Client ===

impl Client {
    /// No call in flight or queued.
    fn is_idle(&self) -> bool {
        self.inflight == 0 && self.queue.is_empty()
    }

    /// Whether forgetting it would lose something: a demotion in force, or slow calls in its
    /// recent window.
    fn remembers(&self, now: Instant) -> bool {
        self.demoted_until.is_some_and(|u| now < u) || self.recent.iter().any(|slow| *slow)
    }

    /// Retry-After: the rest of a demotion, else the time for this client's queue (and one
    /// more call) to drain at its observed pace: `limit` calls per mean call duration. Before
    /// any call of the client finished, the queue timeout (how long a queued call may wait).
    fn retry_after(&self, limit: u32, now: Instant, unobserved: Duration) -> Duration {
        if let Some(until) = self.demoted_until.filter(|u| now < *u) {
            return rate_whole_seconds(until.duration_since(now).as_secs_f64());
        }
        let ahead = self.queue.len() as f64 + 1.0;
        let secs = match self.mean_call {
            Some(mean) => mean * ahead / f64::from(limit.max(1)),
            None => unobserved.as_secs_f64(),
        };
        rate_whole_seconds(secs)
    }
}

// === impl ClientPermit ===

impl ClientPermit {
    /// The client's metric label (override name or `other`).
    pub fn label(&self) -> &Arc<str> {
        &self.label
    }

    /// The call's response ended having used `input` and `output` tokens (as counted:
    /// [`crate::tokens::Meter::finish`]): its client's recent tokens.
    pub fn used_tokens(&self, input: u64, output: u64) {
        let now = Instant::now();
        self.limiter
            .state
            .lock()
            .demand
            .used(&self.key, input, output, now);
    }

    /// Holds the call's token reservation until its response takes it.
    pub fn hold_tokens(&mut self, reservation: Option<TokenReservation<ClientKey>>) {
        self.tokens = reservation;
    }

    /// The call's token reservation, for its response to settle.
    pub fn take_tokens(&mut self) -> Option<TokenReservation<ClientKey>> {
        self.tokens.take()
    }

    /// When the call was admitted.
    #[cfg(test)]
    pub fn started(&self) -> Instant {
        self.started
    }

    /// A response body frame arrived. A call is judged slow on its longest wait for the
    /// backend: the time to its first byte or its longest stall, never its whole duration, so
    /// that a long stream that flows is not a slow call.
    pub fn frame(&mut self) {
        let now = Instant::now();
        let since = self.last_frame.unwrap_or(self.started);
        self.longest_wait = self.longest_wait.max(now.duration_since(since));
        self.last_frame = Some(now);
    }

    /// The longest wait of the call ending at `now`: to its first frame (its whole duration
    /// when none came), or between frames, or from the last frame to its end.
    pub fn longest_wait(&self, now: Instant) -> Duration {
        let since = self.last_frame.unwrap_or(self.started);
        self.longest_wait.max(now.duration_since(since))
    }
}

impl Drop for ClientPermit {
    fn drop(&mut self) {
        let now = Instant::now();
        let waited = self.longest_wait(now);
        let mut state = self.limiter.state.lock();
        state.finish(&self.key, now.duration_since(self.started), waited, now);
        state.admit_queued(&self.key, now);
        state.settle(&self.key, now);
        state.note(&self.key, now);
    }
}

#[cfg(test)]
mod tests;
