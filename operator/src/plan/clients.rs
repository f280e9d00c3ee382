//! Fleet-wide client limits divided by where each client's calls arrive. A client's
//! `maxConcurrency` and `maxQueue` hold for the whole fleet (`clients.scope: Fleet`); divided
//! evenly, a client whose connections all land on one pod (a batch job with a few keep-alive
//! connections, an SDK multiplexing over one HTTP/2 connection) gets a fraction of its limit there.
//! So the busiest clients each pod reports (`GET /v1/clients`, averaged over 10 s) that the even
//! split presses (demand on some pod at [`PRESSED`] of an even part or more) get their limits
//! divided over the pods by their demand on each ([`super::division::divide`]: the parts
//! add up to the limit, and a pod without the client's calls keeps a floor); every other client
//! keeps the even split. Like the backends' shares the division is re-judged once per interval
//! and sent only when it moves ([`super::division::moves`]).

use std::collections::BTreeMap;

use poolpilot_api::policy::ClientStatus;

use super::division::{self, Claim, Need, PRESSED, QUEUEING};
use super::input::ClientUse;
use super::shares::Divided;
use super::time::Timestamp;

/// The most clients of one policy whose limits are divided by demand.
pub const MAX_CLIENT_SHARES: usize = 32;

/// One client's limits divided over a policy's holders.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientDivision {
    /// Hex SHA-256 of its key.
    pub key_sha256: String,
    /// Its concurrency, divided (holders' order).
    pub concurrency: Divided,
    /// Its queue places, divided the same way.
    pub queue: Vec<u32>,
}

/// The busiest clients of one policy across its holders, and their divisions. `reports[i]` is
/// what holder `i` said (`None`: no report, for a pod that serves traffic: the divisions are
/// kept as they were, or none are made). `last` are the divisions in force; `due`: re-judge them.
#[allow(clippy::too_many_arguments)]
pub fn divide(
    holders: &[String],
    ready: &[bool],
    reports: &[Option<&[ClientUse]>],
    (limit, queue): (u32, u32),
    overridden: &[&str],
    last: &BTreeMap<String, ClientDivision>,
    due: bool,
    now: Timestamp,
) -> BTreeMap<String, ClientDivision> {
    let fits = |d: &ClientDivision| d.concurrency.fits(limit, holders);
    let kept = || {
        last.iter()
            .filter(|(_, d)| fits(d))
            .map(|(k, d)| (k.clone(), d.clone()))
            .collect()
    };
    if !due || (0..holders.len()).any(|i| ready[i] && reports[i].is_none()) {
        return kept();
    }
    // Total demand per client over the holders, busiest first: the clients the even split
    // presses (demand on some pod at an even part or more), and those already
    // divided while they still have demand. Others keep the even split, and the documents stay
    // small and unchanged by clients far from their limits.
    let even = f64::from(limit) / holders.len().max(1) as f64;
    let mut total: BTreeMap<&str, f64> = BTreeMap::new();
    let mut pressed: BTreeMap<&str, bool> = BTreeMap::new();
    for r in reports.iter().flatten() {
        for c in r.iter() {
            if !overridden.contains(&c.key_sha256.as_str()) && c.demand.is_finite() {
                let key = c.key_sha256.as_str();
                *total.entry(key).or_default() += c.demand.max(0.0);
                *pressed.entry(key).or_default() |= c.demand >= PRESSED * even;
            }
        }
    }
    let mut busiest: Vec<(&str, f64)> = total
        .into_iter()
        .filter(|(k, d)| *d > 0.0 && (pressed[k] || last.contains_key(*k)))
        .collect();
    busiest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    busiest.truncate(MAX_CLIENT_SHARES);

    let mut out = BTreeMap::new();
    for (key, _) in busiest {
        let uses: Vec<Option<&ClientUse>> = reports
            .iter()
            .map(|r| r.and_then(|r| r.iter().find(|c| c.key_sha256 == key)))
            .collect();
        let claims: Vec<Claim> = uses
            .iter()
            .map(|u| {
                u.map_or_else(Claim::default, |u| Claim {
                    demand: u.demand,
                    in_flight: u.in_flight,
                })
            })
            .collect();
        let shares = division::divide(limit, &claims);
        let fresh = Divided {
            holders: holders.to_vec(),
            target: limit,
            shares,
            demand: uses.iter().map(|u| u.map(|u| u.demand)).collect(),
            at: now,
        };
        let concurrency = match last.get(key).filter(|d| fits(d)) {
            Some(old) => {
                let needs: Vec<Need> = uses
                    .iter()
                    .map(|u| {
                        u.map_or_else(Need::default, |u| Need {
                            queues: f64::from(u.queued) >= QUEUEING,
                            demand: u.demand,
                        })
                    })
                    .collect();
                if division::moves(&old.concurrency.shares, &fresh.shares, &needs, limit) {
                    fresh
                } else {
                    old.concurrency.clone()
                }
            }
            None => fresh,
        };
        let queue = proportional(queue, &concurrency.shares, limit);
        out.insert(
            key.to_owned(),
            ClientDivision {
                key_sha256: key.to_owned(),
                concurrency,
                queue,
            },
        );
    }
    out
}

/// The divisions a policy's status records (`status.clients`), for an operator that starts
/// without them in memory (a restart, a new leader): those that still divide `limit` over
/// `holders` and are not overridden, with their queue places divided the same way. Until the next
/// decision re-judges them, the pods' documents stay as the last operator made them.
pub fn restored(
    status: &[ClientStatus],
    holders: &[String],
    (limit, queue): (u32, u32),
    overridden: &[&str],
    now: Timestamp,
) -> BTreeMap<String, ClientDivision> {
    status
        .iter()
        .filter(|c| c.max_concurrency == limit && !overridden.contains(&c.key_sha256.as_str()))
        .filter(|c| c.shares.iter().map(|s| &s.pod).eq(holders.iter()))
        .take(MAX_CLIENT_SHARES)
        .map(|c| {
            let shares: Vec<u32> = c.shares.iter().map(|s| s.share).collect();
            let division = ClientDivision {
                key_sha256: c.key_sha256.clone(),
                queue: proportional(queue, &shares, limit),
                concurrency: Divided {
                    holders: holders.to_vec(),
                    target: limit,
                    shares,
                    demand: c.shares.iter().map(|s| s.demand).collect(),
                    at: now,
                },
            };
            (c.key_sha256.clone(), division)
        })
        .collect()
}

/// `total` divided in the proportions of `shares` (which add up to `of`), rounded down with the
/// remainder to the first, so that the parts add up to `total`.
fn proportional(total: u32, shares: &[u32], of: u32) -> Vec<u32> {
    if of == 0 || shares.is_empty() {
        return vec![0; shares.len()];
    }
    let mut parts: Vec<u32> = shares
        .iter()
        .map(|&s| (u64::from(total) * u64::from(s) / u64::from(of)) as u32)
        .collect();
    let mut left = total.saturating_sub(parts.iter().sum());
    for p in parts.iter_mut() {
        if left == 0 {
            break;
        }
        *p += 1;
        left -= 1;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("a time")
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("gw-{i}")).collect()
    }

    fn uses(key: &str, demand: f64, queued: u32) -> ClientUse {
        ClientUse {
            key_sha256: key.into(),
            in_flight: demand.floor() as u32,
            queued,
            demand,
            ..ClientUse::default()
        }
    }

    /// A division due now, over as many ready pods as reports, of a limit of 8 calls and 32
    /// queue places, with nothing divided before.
    fn fresh(
        reports: &[Option<&[ClientUse]>],
        overridden: &[&str],
    ) -> BTreeMap<String, ClientDivision> {
        let n = reports.len();
        divide(
            &names(n),
            &vec![true; n],
            reports,
            (8, 32),
            overridden,
            &BTreeMap::new(),
            true,
            at(0),
        )
    }

    #[test]
    fn a_client_pinned_to_one_pod_gets_its_whole_limit_there_less_the_others_floor() {
        let a = "a".repeat(64);
        let report = [uses(&a, 8.0, 4)];
        let none: [ClientUse; 0] = [];
        let d = fresh(&[Some(&report), Some(&none)], &[]);
        let c = &d[&a];
        assert_eq!(c.concurrency.shares, [7, 1]);
        assert_eq!(c.queue, [28, 4], "the queue places in the same proportions");
    }

    #[test]
    fn overridden_clients_and_a_missing_report_keep_the_even_split() {
        let a = "a".repeat(64);
        let report = [uses(&a, 8.0, 4)];
        let d = fresh(&[Some(&report), Some(&report)], &[a.as_str()]);
        assert!(d.is_empty(), "an override has its own limit");
        let d = fresh(&[Some(&report), None], &[]);
        assert!(d.is_empty(), "gw-1 serves traffic and did not report");
    }

    #[test]
    fn only_the_busiest_clients_are_divided() {
        let keys: Vec<String> = (0..40).map(|i| format!("{i:064x}")).collect();
        let report: Vec<ClientUse> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| uses(k, 1.0 + i as f64, 0))
            .collect();
        let d = fresh(&[Some(&report)], &[]);
        assert_eq!(d.len(), MAX_CLIENT_SHARES);
        assert!(d.contains_key(&keys[39]) && !d.contains_key(&keys[0]));
    }

    #[test]
    fn a_client_far_from_its_even_part_keeps_the_even_split() {
        let a = "a".repeat(64);
        // Limit 8 over 2 pods: an even part of 4; demand 2 on one pod presses nothing.
        let report = [uses(&a, 2.0, 0)];
        let none: [ClientUse; 0] = [];
        let d = fresh(&[Some(&report), Some(&none)], &[]);
        assert!(d.is_empty(), "{d:?}");
    }

    #[test]
    fn proportional_parts_add_up() {
        assert_eq!(proportional(32, &[7, 1], 8), [28, 4]);
        assert_eq!(proportional(5, &[1, 1, 1], 3), [2, 2, 1]);
        assert_eq!(proportional(5, &[], 0), Vec::<u32>::new());
    }
}
