//! Fleet-wide token budgets divided by where each named client spends its tokens. A client's
//! `tokens.perMinute` (and `perDay`, `requestsPerMinute`) holds for the whole fleet
//! (`clients.scope: Fleet`); divided evenly, a client whose connections all land on one pod gets
//! a fraction of its budget there. So each override's budget (its own `tokens`, else the
//! policy's) is divided over the holders by the tokens it was charged on each pod, a minute,
//! over the metrics window (`poolpilot_client_tokens_total{client_policy, client}`, read in the
//! operator's batched Prometheus round), with [`super::division::divide_above`]: the parts add
//! up to the budget, and a pod without the client's calls keeps a floor of [`FLOOR_DIVISOR`]th
//! of the even part (at least 1 token), so that a pinned client gets at least
//! `1 − (n − 1) ÷ (100 n)` of its budget (over 99%) on its pod. Like the backends' shares and the
//! client limits the division is re-judged once per interval (with a decision made on fresh
//! data) and sent only when it moves ([`super::division::moves_u64`]); while a ready pod has
//! no fresh sample the division in force stays.
//!
//! Clients without an override are not told apart by the metric (its labels stay bounded: an
//! override's name or `other`). Their use is what each pod reports of its clients that spend the
//! most tokens (`GET /v1/clients?by=tokens`: input and output tokens a second over its last
//! 10 s, charged here as the budget counts them): a client that spends at least
//! [`TOKENS_PRESSED`] of the even part of the policy's budget on some pod ([`divide_clients`],
//! the [`MAX_CLIENT_SHARES`] that spend most) has the budget divided by where it spends it, as
//! an override's is; every other client keeps the even split. Their divisions live in memory
//! only: after a restart they are made again on the first decision.
//! `perDay` and `requestsPerMinute` are divided in the proportions of `perMinute`.

use std::collections::BTreeMap;

use poolpilot_api::policy::{PodTokens, TokenBudgetSpec, TokenBudgetStatus, TokenCountSpec};

use super::clients::MAX_CLIENT_SHARES;
use super::division::{self, Claim, Need};
use super::input::ClientUse;
use super::time::Timestamp;

/// A pod without a client's calls keeps this fraction (1 ÷ it) of the even part of its budget.
/// A hundredth: the floors of the pods a pinned client does not use are budget it cannot
/// spend, and a twentieth held back up to 5% of it (3.3% on 3 pods), all the room that a
/// minute's use within 5% of the budget has for the edges of the minute. A client that moves
/// to another pod has its budget there once its old pod's use has left the metrics window,
/// whatever the floor (a larger one only gives it a little more meanwhile).
pub const FLOOR_DIVISOR: u64 = 100;

/// The label of the clients without an override in `poolpilot_client_tokens_total`.
pub const OTHER: &str = "other";

/// The floor of a token share: the even part ÷ [`FLOOR_DIVISOR`], at least 1.
pub fn floor(budget: u64, pods: usize) -> u64 {
    (budget / (pods as u64).max(1) / FLOOR_DIVISOR).max(1)
}

/// One named client's budget divided over a policy's holders.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenDivision {
    /// The fleet-wide `perMinute` divided.
    pub per_minute: u64,
    /// The holders it was divided over, in name order.
    pub holders: Vec<String>,
    /// Each holder's part of `perMinute`.
    pub shares: Vec<u64>,
    /// The tokens a minute the client was charged on each holder then (`None`: no sample).
    pub used: Vec<Option<f64>>,
    /// When it was divided.
    pub at: Timestamp,
}

impl TokenDivision {
    /// Whether it divides `per_minute` over `holders`.
    pub fn fits(&self, per_minute: u64, holders: &[String]) -> bool {
        self.per_minute == per_minute && self.holders == holders
    }

    /// The part of a `limit` (a `perDay` or `requestsPerMinute` beside `perMinute`) of the
    /// holder at `rank`: the limit in the proportion of its `perMinute` share, rounded down, at
    /// least 1 (so the parts add up to at most the limit unless the floors of 1 exceed it).
    pub fn part_of(&self, limit: u64, rank: usize) -> u64 {
        let share = self.shares.get(rank).copied().unwrap_or(0);
        let part = u128::from(limit) * u128::from(share) / u128::from(self.per_minute.max(1));
        u64::try_from(part).unwrap_or(limit).max(1)
    }
}

/// One named client's budget over a policy's holders, this run: `budget` its fleet-wide
/// `perMinute`; `used[i]` the tokens a minute it was charged on holder `i` (`None`: no fresh
/// sample of the pod); `ready[i]` whether the holder serves traffic; `last` the division in
/// force; `due`: re-judge it.
pub fn divide(
    holders: &[String],
    ready: &[bool],
    used: &[Option<f64>],
    budget: u64,
    last: Option<&TokenDivision>,
    due: bool,
    now: Timestamp,
) -> TokenDivision {
    let last = last.filter(|d| d.fits(budget, holders));
    let even = || TokenDivision {
        per_minute: budget,
        holders: holders.to_vec(),
        shares: division::even_u64(budget, holders.len()),
        used: used.to_vec(),
        at: now,
    };
    let missing = (0..holders.len()).any(|i| ready[i] && used[i].is_none());
    if !due || missing {
        return last.cloned().unwrap_or_else(even);
    }
    let claims: Vec<Claim> = used
        .iter()
        .map(|u| Claim {
            demand: u.unwrap_or(0.0),
            in_flight: 0,
        })
        .collect();
    let fresh = TokenDivision {
        per_minute: budget,
        holders: holders.to_vec(),
        shares: division::divide_above(budget, &claims, floor(budget, holders.len())),
        used: used.to_vec(),
        at: now,
    };
    match last {
        Some(old) => {
            let needs: Vec<Need> = used
                .iter()
                .map(|u| Need {
                    queues: false,
                    demand: u.unwrap_or(0.0),
                })
                .collect();
            if division::moves_u64(&old.shares, &fresh.shares, &needs, budget) {
                fresh
            } else {
                old.clone()
            }
        }
        None => fresh,
    }
}

/// The divisions a policy's status records (`status.tokens[].shares`), for an operator that
/// starts without them in memory: those of a client in `budgets` (override name → fleet-wide
/// `perMinute`) that still divide it over `holders`.
pub fn restored(
    status: &[TokenBudgetStatus],
    holders: &[String],
    budgets: &BTreeMap<String, u64>,
    now: Timestamp,
) -> BTreeMap<String, TokenDivision> {
    status
        .iter()
        .filter(|t| budgets.get(&t.client) == Some(&t.per_minute))
        .filter(|t| !t.shares.is_empty() && t.shares.iter().map(|s| &s.pod).eq(holders.iter()))
        .map(|t| {
            let division = TokenDivision {
                per_minute: t.per_minute,
                holders: holders.to_vec(),
                shares: t.shares.iter().map(|s| s.per_minute).collect(),
                used: t.shares.iter().map(|s| s.used_per_minute).collect(),
                at: now,
            };
            (t.client.clone(), division)
        })
        .collect()
}

/// A client without an override whose tokens on some pod reach this share of the even part of
/// the policy's budget has the budget divided by where it spends it. Below the even part, as its
/// own bucket there caps what it can spend at about that part: a client held at its part reads
/// as using all of it, not more.
pub const TOKENS_PRESSED: f64 = 0.75;

/// What a client's calls cost a minute in `budget`'s units, from its tokens a second.
pub fn charged_per_minute(budget: &TokenBudgetSpec, input: f64, output: f64) -> f64 {
    let (wi, wo) = match (budget.count, budget.weights) {
        (TokenCountSpec::Total, _) | (TokenCountSpec::Weighted, None) => (1.0, 1.0),
        (TokenCountSpec::Output, _) => (0.0, 1.0),
        (TokenCountSpec::Weighted, Some(w)) => (w.input, w.output),
    };
    60.0 * (wi * input + wo * output)
}

/// The budgets of the clients without an override that spend the most of the policy's `budget`,
/// divided over its holders by where they spend it, by client key. `reports[i]` is what holder
/// `i` said of its clients (`None`: no fresh report, for a pod that serves traffic: the
/// divisions in force are kept, or none are made); `overridden` the overrides' keys (their
/// budgets are divided by name, from Prometheus); `last` the divisions in force; `due`:
/// re-judge them.
#[allow(clippy::too_many_arguments)]
pub fn divide_clients(
    holders: &[String],
    ready: &[bool],
    reports: &[Option<&[ClientUse]>],
    budget: &TokenBudgetSpec,
    overridden: &[&str],
    last: &BTreeMap<String, TokenDivision>,
    due: bool,
    now: Timestamp,
) -> BTreeMap<String, TokenDivision> {
    let per_minute = budget.per_minute;
    let kept = || {
        last.iter()
            .filter(|(k, d)| d.fits(per_minute, holders) && !overridden.contains(&k.as_str()))
            .map(|(k, d)| (k.clone(), d.clone()))
            .collect()
    };
    if !due || (0..holders.len()).any(|i| ready[i] && reports[i].is_none()) {
        return kept();
    }
    let even = per_minute as f64 / holders.len().max(1) as f64;
    let charged = |c: &ClientUse| charged_per_minute(budget, c.input_tokens, c.output_tokens);
    let mut total: BTreeMap<&str, f64> = BTreeMap::new();
    let mut pressed: BTreeMap<&str, bool> = BTreeMap::new();
    for r in reports.iter().flatten() {
        for c in r.iter() {
            let key = c.key_sha256.as_str();
            let used = charged(c);
            if overridden.contains(&key) || !used.is_finite() {
                continue;
            }
            *total.entry(key).or_default() += used.max(0.0);
            *pressed.entry(key).or_default() |= used >= TOKENS_PRESSED * even;
        }
    }
    let mut spenders: Vec<(&str, f64)> = total
        .into_iter()
        .filter(|(k, used)| *used > 0.0 && (pressed[k] || last.contains_key(*k)))
        .collect();
    spenders.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    spenders.truncate(MAX_CLIENT_SHARES);
    spenders
        .into_iter()
        .map(|(key, _)| {
            // A pod that reported and did not list the client: none spent there (as far as
            // its busiest go).
            let used: Vec<Option<f64>> = reports
                .iter()
                .map(|r| r.map(|r| r.iter().find(|c| c.key_sha256 == key).map_or(0.0, &charged)))
                .collect();
            let d = divide(holders, ready, &used, per_minute, last.get(key), true, now);
            (key.to_owned(), d)
        })
        .collect()
}

/// The status of one budget: `client` an override's name (or `other`, the clients without
/// one, each of which has the whole budget on its own), its fleet-wide `per_minute`, the tokens
/// a minute it was charged over the fleet (`None`: a ready pod without a sample), and its
/// division over the first `listed` holders when it has one.
pub fn status(
    client: &str,
    per_minute: u64,
    used: Option<f64>,
    division: Option<&TokenDivision>,
    listed: usize,
) -> TokenBudgetStatus {
    let round = |v: f64| (v * 100.0).round() / 100.0;
    TokenBudgetStatus {
        client: client.to_owned(),
        per_minute,
        used_per_minute: used.filter(|v| v.is_finite()).map(round),
        shares: division.map_or_else(Vec::new, |d| {
            d.holders
                .iter()
                .zip(&d.shares)
                .zip(d.used.iter().chain(std::iter::repeat(&None)))
                .take(listed)
                .map(|((pod, &share), used)| PodTokens {
                    pod: pod.clone(),
                    per_minute: share,
                    used_per_minute: used.filter(|v| v.is_finite()).map(round),
                })
                .collect()
        }),
    }
}

#[cfg(test)]
mod tests;
