//! The token budgets of one client policy's clients in this pod: a token bucket per client
//! (`perMinute` tokens, refilled continuously over a minute; `perDay` over a day when set; and
//! `requestsPerMinute` calls when set), the call's [`Estimate`] reserved before it is sent and
//! the reservation settled with what the call used once it ended ([`TokenReservation::settle`];
//! dropped unsettled, a call that never reached a backend gives all of it back).
//!
//! A call is admitted when every bucket holds its cost (the estimate's, in the units `count`
//! says), or, for a call costing more than a bucket holds at all, when that bucket is full: it
//! is never refused for ever, and its excess is a debt the bucket refills first. Settlement may
//! take the bucket below zero (a call that used more than its estimate); the client is then
//! refused until the bucket has refilled. A refusal costs nothing.
//!
//! Memory is bounded as the client table is: a client has an entry only while its buckets are
//! not full or a reservation of it is open; at `maxClients` entries the fullest is forgotten
//! (forgetting a full bucket loses nothing).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use poolpilot_api::limits::TokenBudget;
use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::AtomicU64;
use tokio::time::Instant;

use super::estimate::Estimate;

const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(86_400);

/// What a client's budget says of it now, for OpenAI's `x-ratelimit-*` headers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quote {
    /// `perMinute`.
    pub limit_tokens: u64,
    /// Tokens left in the minute bucket (0 while it is in debt).
    pub remaining_tokens: u64,
    /// Until the minute bucket is full again.
    pub reset_tokens: Duration,
    /// `requestsPerMinute`, calls left, and until its bucket is full, when it is set.
    pub requests: Option<(u32, u64, Duration)>,
}

/// Which bucket refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exhausted {
    /// `perMinute`.
    TokensPerMinute,
    /// `perDay`.
    TokensPerDay,
    /// `requestsPerMinute`.
    RequestsPerMinute,
}

impl Exhausted {
    /// OpenAI's `error.type` of the refusal: `tokens` or `requests`.
    pub fn error_type(self) -> &'static str {
        match self {
            Self::TokensPerMinute | Self::TokensPerDay => "tokens",
            Self::RequestsPerMinute => "requests",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::TokensPerMinute => "tokens per minute",
            Self::TokensPerDay => "tokens per day",
            Self::RequestsPerMinute => "requests per minute",
        }
    }
}

/// A call refused by its client's token budget (429).
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "rate limit reached for client {client} on {}: limit {limit}, remaining {remaining}, requested {requested}; try again in {}s",
    exhausted.describe(),
    retry_after.as_secs()
)]
pub struct TokenRejection {
    /// Override name or `other`.
    pub client: Arc<str>,
    /// The bucket that refused it.
    pub exhausted: Exhausted,
    /// That bucket's size.
    pub limit: u64,
    /// What is left in it.
    pub remaining: u64,
    /// What the call would cost in it.
    pub requested: u64,
    /// When that much will be there (whole seconds, rounded up: `Retry-After`).
    pub retry_after: Duration,
    /// The same, exactly (to the millisecond in `retry-after-ms`).
    pub wait: Duration,
    /// The client's budget now, for the headers.
    pub quote: Quote,
}

/// The token budgets of one client policy, its clients known by `K` (their key's digest).
/// Cheap to clone.
#[derive(Debug)]
pub struct TokenBudgets<K> {
    table: Arc<Mutex<Table<K>>>,
}

impl<K> Clone for TokenBudgets<K> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
        }
    }
}

#[derive(Debug)]
struct Table<K> {
    /// The policy's budget, if it has one.
    policy: Option<TokenBudget>,
    /// The overrides' own budgets.
    overrides: HashMap<K, TokenBudget>,
    clients: HashMap<K, Buckets>,
    max_clients: usize,
}

#[derive(Debug)]
struct Buckets {
    tokens: Bucket,
    day: Option<Bucket>,
    requests: Option<Bucket>,
    /// Reservations not settled yet.
    open: u32,
}

/// A token bucket: `capacity`, refilled at `capacity / period`, its level possibly below zero
/// (a debt).
#[derive(Clone, Copy, Debug)]
struct Bucket {
    level: f64,
    capacity: f64,
    per_sec: f64,
    at: Instant,
}

impl Bucket {
    fn full(capacity: u64, period: Duration, now: Instant) -> Self {
        let capacity = capacity as f64;
        Self {
            level: capacity,
            capacity,
            per_sec: capacity / period.as_secs_f64(),
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_sec).min(self.capacity);
        self.at = now;
    }

    /// What a call costing `cost` needs in the bucket: all of it, or a full bucket.
    fn need(&self, cost: f64) -> f64 {
        cost.min(self.capacity)
    }

    /// How long until it holds `need` (zero when it does).
    fn wait_for(&self, need: f64) -> Duration {
        if self.level >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.level) / self.per_sec)
        }
    }

    fn remaining(&self) -> u64 {
        self.level.max(0.0).floor() as u64
    }

    fn reset(&self) -> Duration {
        Duration::from_secs_f64((self.capacity - self.level).max(0.0) / self.per_sec)
    }

    fn is_full(&self) -> bool {
        self.level >= self.capacity
    }

    /// Takes `n` (negative: gives back, up to full).
    fn charge(&mut self, n: f64) {
        self.level = (self.level - n).min(self.capacity);
    }

    /// A new size: the level keeps what was used of the old one.
    fn resize(&mut self, capacity: u64, period: Duration) {
        let used = self.capacity - self.level;
        let capacity = capacity as f64;
        self.capacity = capacity;
        self.per_sec = capacity / period.as_secs_f64();
        self.level = capacity - used;
    }
}

impl Buckets {
    fn new(budget: &TokenBudget, now: Instant) -> Self {
        Self {
            tokens: Bucket::full(budget.per_minute, MINUTE, now),
            day: budget.per_day.map(|d| Bucket::full(d, DAY, now)),
            requests: budget
                .requests_per_minute
                .map(|r| Bucket::full(r.into(), MINUTE, now)),
            open: 0,
        }
    }

    fn refill(&mut self, now: Instant) {
        self.tokens.refill(now);
        for b in [&mut self.day, &mut self.requests].into_iter().flatten() {
            b.refill(now);
        }
    }

    fn reshape(&mut self, budget: &TokenBudget, now: Instant) {
        self.refill(now);
        self.tokens.resize(budget.per_minute, MINUTE);
        self.day = match (self.day, budget.per_day) {
            (Some(mut b), Some(d)) => {
                b.resize(d, DAY);
                Some(b)
            }
            (None, Some(d)) => Some(Bucket::full(d, DAY, now)),
            (_, None) => None,
        };
        self.requests = match (self.requests, budget.requests_per_minute) {
            (Some(mut b), Some(r)) => {
                b.resize(r.into(), MINUTE);
                Some(b)
            }
            (None, Some(r)) => Some(Bucket::full(r.into(), MINUTE, now)),
            (_, None) => None,
        };
    }

    fn is_forgettable(&self) -> bool {
        self.open == 0
            && self.tokens.is_full()
            && [&self.day, &self.requests]
                .into_iter()
                .flatten()
                .all(Bucket::is_full)
    }

    /// How full it is, 0 to 1 (the fullest is forgotten first).
    fn fill(&self) -> f64 {
        self.tokens.level / self.tokens.capacity
    }

    fn quote(&self, budget: &TokenBudget) -> Quote {
        Quote {
            limit_tokens: budget.per_minute,
            remaining_tokens: self.tokens.remaining(),
            reset_tokens: self.tokens.reset(),
            requests: budget
                .requests_per_minute
                .zip(self.requests)
                .map(|(limit, b)| (limit, b.remaining(), b.reset())),
        }
    }
}

/// Whole seconds, rounded up, at least 1: a client told to come back then finds room.
fn whole_seconds(d: Duration) -> Duration {
    Duration::from_secs((d.as_secs_f64().ceil() as u64).max(1))
}

impl<K: Copy + Eq + Hash> TokenBudgets<K> {
    /// The budgets of a policy whose budget is `policy`, whose overrides have `overrides`, and
    /// which keeps at most `max_clients` clients.
    pub fn new(
        policy: Option<TokenBudget>,
        overrides: HashMap<K, TokenBudget>,
        max_clients: usize,
    ) -> Self {
        Self {
            table: Arc::new(Mutex::new(Table {
                policy,
                overrides,
                clients: HashMap::new(),
                max_clients: max_clients.max(1),
            })),
        }
    }

    /// Applies a new policy in place: clients keep what they used of their buckets, resized.
    pub fn set(
        &self,
        policy: Option<TokenBudget>,
        overrides: HashMap<K, TokenBudget>,
        max_clients: usize,
    ) {
        let now = Instant::now();
        let mut table = self.table.lock();
        table.policy = policy;
        table.overrides = overrides;
        table.max_clients = max_clients.max(1);
        let Table {
            policy,
            overrides,
            clients,
            ..
        } = &mut *table;
        clients.retain(
            |key, buckets| match overrides.get(key).or(policy.as_ref()) {
                Some(budget) => {
                    buckets.reshape(budget, now);
                    true
                }
                None => false,
            },
        );
    }

    /// The budget of `key`, if it has one: its override's, else the policy's.
    pub fn budget_of(&self, key: &K) -> Option<TokenBudget> {
        let table = self.table.lock();
        table.overrides.get(key).or(table.policy.as_ref()).cloned()
    }

    /// Reserves the estimate of a call of `key` (labelled `label`) in its buckets, or refuses
    /// it (boxed: a refusal is large, and rare next to the calls admitted); `Ok(None)`: the
    /// client has no budget.
    pub fn reserve(
        &self,
        key: K,
        label: &Arc<str>,
        estimate: Estimate,
    ) -> Result<Option<TokenReservation<K>>, Box<TokenRejection>> {
        let now = Instant::now();
        let mut table = self.table.lock();
        let Some(budget) = table.overrides.get(&key).or(table.policy.as_ref()).cloned() else {
            return Ok(None);
        };
        let cost = budget.cost(estimate.prompt, estimate.output);
        if !table.clients.contains_key(&key) {
            table.make_room();
        }
        let buckets = table
            .clients
            .entry(key)
            .or_insert_with(|| Buckets::new(&budget, now));
        buckets.refill(now);
        let checks = [
            (Exhausted::TokensPerMinute, Some(&buckets.tokens), cost),
            (Exhausted::TokensPerDay, buckets.day.as_ref(), cost),
            (Exhausted::RequestsPerMinute, buckets.requests.as_ref(), 1.0),
        ];
        let refused = checks
            .into_iter()
            .filter_map(|(which, bucket, cost)| {
                let bucket = bucket?;
                let wait = bucket.wait_for(bucket.need(cost));
                (!wait.is_zero()).then_some((which, bucket, cost, wait))
            })
            .max_by_key(|(.., wait)| *wait);
        if let Some((exhausted, bucket, cost, wait)) = refused {
            return Err(Box::new(TokenRejection {
                client: label.clone(),
                exhausted,
                limit: bucket.capacity as u64,
                remaining: bucket.remaining(),
                requested: cost.ceil() as u64,
                retry_after: whole_seconds(wait),
                wait,
                quote: buckets.quote(&budget),
            }));
        }
        buckets.tokens.charge(cost);
        if let Some(day) = &mut buckets.day {
            day.charge(cost);
        }
        if let Some(requests) = &mut buckets.requests {
            requests.charge(1.0);
        }
        buckets.open += 1;
        let quote = buckets.quote(&budget);
        Ok(Some(TokenReservation {
            table: self.table.clone(),
            key,
            budget,
            reserved: cost,
            quote,
            settled: false,
            used: None,
        }))
    }

    /// Forgets the clients whose buckets are full again with nothing reserved.
    pub fn purge(&self) {
        let now = Instant::now();
        self.table.lock().clients.retain(|_, b| {
            b.refill(now);
            !b.is_forgettable()
        });
    }

    /// Clients with an entry.
    #[cfg(test)]
    pub fn tracked(&self) -> usize {
        self.table.lock().clients.len()
    }
}

impl<K: Copy + Eq + Hash> Table<K> {
    /// Room for one more client: the forgettable ones go, and at the bound the fullest.
    fn make_room(&mut self) {
        if self.clients.len() < self.max_clients {
            return;
        }
        let now = Instant::now();
        self.clients.retain(|_, b| {
            b.refill(now);
            !b.is_forgettable()
        });
        if self.clients.len() < self.max_clients {
            return;
        }
        let fullest = self
            .clients
            .iter()
            .max_by(|a, b| a.1.fill().total_cmp(&b.1.fill()))
            .map(|(k, _)| *k);
        if let Some(key) = fullest {
            self.clients.remove(&key);
        }
    }
}

/// A call's reservation in its client's buckets, from admission to the end of its response.
/// Settle it with what the call used; dropped unsettled (the call never reached a backend), it
/// gives back all it took.
#[derive(Debug)]
pub struct TokenReservation<K: Copy + Eq + Hash> {
    table: Arc<Mutex<Table<K>>>,
    key: K,
    budget: TokenBudget,
    reserved: f64,
    quote: Quote,
    settled: bool,
    /// Where its settled cost is counted (`poolpilot_client_tokens_total`), if anywhere.
    used: Option<Counter<f64, AtomicU64>>,
}

impl<K: Copy + Eq + Hash> TokenReservation<K> {
    /// The client's budget just after this reservation, for the response's headers.
    pub fn quote(&self) -> Quote {
        self.quote
    }

    /// Counts its settled cost in `counter` too.
    pub fn count_in(mut self, counter: Counter<f64, AtomicU64>) -> Self {
        self.used = Some(counter);
        self
    }

    /// Settles the call: `prompt` and `completion` tokens used, in the budget's units; the
    /// difference with the reservation is given back or taken, and the cost counted.
    pub fn settle(mut self, prompt: u64, completion: u64) {
        let cost = self.budget.cost(prompt, completion);
        self.adjust(cost - self.reserved, false);
        if let Some(used) = &self.used
            && cost > 0.0
        {
            used.inc_by(cost);
        }
        self.settled = true;
    }

    fn adjust(&self, more: f64, refund_request: bool) {
        let now = Instant::now();
        let mut table = self.table.lock();
        let Some(buckets) = table.clients.get_mut(&self.key) else {
            return;
        };
        buckets.refill(now);
        buckets.tokens.charge(more);
        if let Some(day) = &mut buckets.day {
            day.charge(more);
        }
        if refund_request && let Some(requests) = &mut buckets.requests {
            requests.charge(-1.0);
        }
        buckets.open = buckets.open.saturating_sub(1);
    }
}

impl<K: Copy + Eq + Hash> Drop for TokenReservation<K> {
    fn drop(&mut self) {
        if !self.settled {
            self.adjust(-self.reserved, true);
        }
    }
}

#[cfg(test)]
mod tests;
