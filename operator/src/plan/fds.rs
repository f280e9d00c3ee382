//! The file-descriptor check over the fleet budget ([`super::budget`]). A backend's fleet target is
//! divided across the pods its policy selects that may hold connections, its holders, by demand
//! ([`super::division`]). Then, per pod, over every accepted policy that selects it, the pools
//! (Σ (share + burst) × endpoints), the client
//! connections and the reserve must fit in half the pod's `process_max_fds` (Envoy's advice). If
//! not, the shares are scaled down proportionally, never below the share of `autoscale.min`, and
//! the policy reports `FdBudget=False` with the numbers. The bursts give way first: a pod over its
//! budget with them loses them, and only then are its shares scaled. A pod-wide
//! `listener.maxUpstreamConnections` bounds what the pools can open: the pools then count for the
//! smaller of the two.
//!
//! The pools count slots, the descriptors count sockets: an HTTP/2 backend's share is
//! concurrent streams, many to one connection, so its pool needs ⌈(share + burst) ÷ streams⌉
//! sockets per endpoint ([`streams_per_socket`]: the smallest `SETTINGS_MAX_CONCURRENT_STREAMS`
//! the pods report, else [`DEFAULT_H2_STREAMS`]). `Auto` counts as HTTP/1.1, a socket a slot: its
//! servers may answer HTTP/1.1.

use std::collections::BTreeMap;

use poolpilot_api::policy::upstream::ProtocolSpec;

use super::budget::{FdReport, allowed, share};
use super::input::{BackendSample, PolicyInput};
use super::output::PolicyPlan;

/// Streams per HTTP/2 connection while no pod reports its servers' limit: RFC 9113's
/// recommended least `SETTINGS_MAX_CONCURRENT_STREAMS` (§5.1.2), what hyper's and most model
/// servers' HTTP/2 stacks allow or more.
pub const DEFAULT_H2_STREAMS: u32 = 100;

/// Slots one socket of a backend carries: 1 but for `Http2`, whose connections carry the
/// smallest stream limit the pods report (`h2_max_streams`), [`DEFAULT_H2_STREAMS`] until one
/// does.
pub fn streams_per_socket(protocol: ProtocolSpec, sample: &BackendSample) -> u32 {
    match protocol {
        ProtocolSpec::Http1 | ProtocolSpec::Auto => 1,
        ProtocolSpec::Http2 => sample
            .h2_max_streams
            .filter(|s| s.is_finite() && *s >= 1.0)
            .map_or(DEFAULT_H2_STREAMS, |s| s.min(f64::from(u32::MAX)) as u32),
    }
}

/// One pool on one pod, as the water-filling sees it.
#[derive(Clone, Copy, Debug)]
struct Pool {
    plan: usize,
    backend: usize,
    share: u32,
    burst: u32,
    endpoints: u32,
    min_share: u32,
    /// Slots per socket (1: HTTP/1.1).
    streams: u32,
}

impl Pool {
    fn fds(&self, with_burst: bool) -> u64 {
        let per = self.share + if with_burst { self.burst } else { 0 };
        self.sockets(per) * u64::from(self.endpoints)
    }

    /// Sockets per endpoint for `slots` slots.
    fn sockets(&self, slots: u32) -> u64 {
        u64::from(slots).div_ceil(u64::from(self.streams.max(1)))
    }
}

/// Runs the check over every pod, clamps the shares of the plans' backends on the pods where
/// they do not fit (their bursts give way first), and fills each accepted plan's [`FdReport`].
/// `limits` holds the known `process_max_fds` per pod; a pod whose limit is not known yet (it
/// just started, its first scrape is due) is held to the smallest limit known of the others, as
/// the pods of one Deployment have the same: unclamped, it would need more than its neighbours
/// are allowed until its first sample.
pub fn check(policies: &[PolicyInput], plans: &mut [PolicyPlan], limits: &BTreeMap<String, u64>) {
    // Which accepted plans select each pod.
    let mut on_pod: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, plan) in plans.iter().enumerate() {
        if plan.acceptance.is_accepted() {
            for pod in &plan.selected {
                on_pod.entry(pod.clone()).or_default().push(i);
            }
        }
    }

    // The pod-wide cap on upstream connections: the smallest any of its policies sets.
    let upstream_cap = |idxs: &[usize]| {
        idxs.iter()
            .filter_map(|&i| policies[i].spec.listener.max_upstream_connections)
            .min()
            .map(u64::from)
    };
    let capped = |pools: u64, cap: Option<u64>| cap.map_or(pools, |c| pools.min(c));
    let pools_of = |plans: &[PolicyPlan], pod: &str, idxs: &[usize]| -> Vec<Pool> {
        idxs.iter()
            .flat_map(|&i| {
                let plan = &plans[i];
                let holders = plan.holders.len() as u32;
                plan.backends.iter().enumerate().map(move |(j, b)| {
                    let own = plan.share(b, pod);
                    Pool {
                        plan: i,
                        backend: j,
                        share: own,
                        burst: b.burst,
                        endpoints: b.endpoints,
                        min_share: share(b.bounds.min, holders).min(own),
                        streams: b.streams_per_socket,
                    }
                })
            })
            .collect()
    };
    let fixed_of = |idxs: &[usize]| {
        let listener = idxs
            .iter()
            .map(|&i| policies[i].spec.listener.max_connections)
            .max()
            .unwrap_or(0);
        let reserve = idxs
            .iter()
            .map(|&i| policies[i].spec.file_descriptors.reserve)
            .max()
            .unwrap_or(0);
        u64::from(listener) + u64::from(reserve)
    };

    let smallest_known = on_pod
        .keys()
        .filter_map(|pod| limits.get(pod.as_str()))
        .min()
        .copied();
    let mut caps: BTreeMap<(usize, usize, String), u32> = BTreeMap::new();
    let mut no_burst: Vec<(usize, usize)> = Vec::new();
    let mut need_before: BTreeMap<&str, u64> = BTreeMap::new();
    for (pod, idxs) in &on_pod {
        let fixed = fixed_of(idxs);
        let pools = pools_of(plans, pod, idxs);
        let cap = upstream_cap(idxs);
        let need = |burst: bool| capped(pools.iter().map(|p| p.fds(burst)).sum(), cap) + fixed;
        need_before.insert(pod, need(false));
        let Some(limit) = limits.get(pod.as_str()).copied().or(smallest_known) else {
            continue;
        };
        let allowed = allowed(limit);
        if need(true) <= allowed {
            continue;
        }
        // Bursts give way first: they are for the seconds before a decision, the shares are
        // what the pod runs on.
        no_burst.extend(
            pools
                .iter()
                .filter(|p| p.burst > 0)
                .map(|p| (p.plan, p.backend)),
        );
        if need(false) <= allowed {
            continue;
        }
        for (p, c) in pools
            .iter()
            .zip(water_fill(&pools, allowed.saturating_sub(fixed)))
        {
            let e = caps.entry((p.plan, p.backend, pod.clone())).or_insert(c);
            *e = (*e).min(c);
        }
    }
    for (i, j) in no_burst {
        plans[i].backends[j].burst = 0;
    }
    let mut clamped_plans = Vec::new();
    for ((i, j, pod), cap) in &caps {
        let Some(rank) = plans[*i].rank(pod) else {
            continue;
        };
        let b = &mut plans[*i].backends[*j];
        if let Some(share) = b.shares.get_mut(rank)
            && *share > *cap
        {
            *share = *cap;
            b.clamped = true;
            clamped_plans.push(*i);
        }
    }
    for plan in plans.iter_mut() {
        for b in &mut plan.backends {
            b.settle_per_pod();
        }
    }

    // Needs after clamping, per pod, and the cap when it binds.
    let mut need_after: BTreeMap<&str, u64> = BTreeMap::new();
    let mut binding_cap: BTreeMap<&str, u64> = BTreeMap::new();
    for (pod, idxs) in &on_pod {
        let pools: u64 = pools_of(plans, pod, idxs).iter().map(|p| p.fds(true)).sum();
        let cap = upstream_cap(idxs);
        if let Some(cap) = cap.filter(|&c| c < pools) {
            binding_cap.insert(pod, cap);
        }
        need_after.insert(pod, capped(pools, cap) + fixed_of(idxs));
    }

    for (i, plan) in plans.iter_mut().enumerate() {
        if !plan.acceptance.is_accepted() {
            continue;
        }
        let mut report = FdReport {
            clamped: clamped_plans.contains(&i),
            ..FdReport::default()
        };
        for pod in &plan.selected {
            let after = need_after.get(pod.as_str()).copied().unwrap_or(0);
            if after >= report.needed {
                report.needed = after;
                report.worst_pod = Some(pod.clone());
                report.upstream_cap = binding_cap.get(pod.as_str()).copied();
            }
            report.needed_unclamped = report
                .needed_unclamped
                .max(need_before.get(pod.as_str()).copied().unwrap_or(0));
            if let Some(&l) = limits.get(pod) {
                report.limit = Some(report.limit.map_or(l, |m: u64| m.min(l)));
            }
        }
        report.allowed = report.limit.map(allowed);
        plan.fds = report;
    }
}

/// Largest shares, proportional to the current ones, whose pools fit in `avail` fds; a pool
/// never drops below its `min_share` (if the minima alone do not fit, every pool sits at its min).
fn water_fill(pools: &[Pool], avail: u64) -> Vec<u32> {
    let mut at_min = vec![false; pools.len()];
    loop {
        let fixed: u64 = pools
            .iter()
            .zip(&at_min)
            .filter(|(_, m)| **m)
            .map(|(p, _)| p.sockets(p.min_share) * u64::from(p.endpoints))
            .sum();
        let free: u64 = pools
            .iter()
            .zip(&at_min)
            .filter(|(_, m)| !**m)
            .map(|(p, _)| p.sockets(p.share) * u64::from(p.endpoints))
            .sum();
        let room = avail.saturating_sub(fixed);
        let mut changed = false;
        let caps: Vec<u32> = pools
            .iter()
            .zip(at_min.iter_mut())
            .map(|(p, m)| {
                if *m {
                    return p.min_share;
                }
                // share × room ÷ free, rounded down (exactly: no float rounding below a whole
                // socket), never above the share.
                let mut c = match free {
                    0 => 0,
                    free => (u64::from(p.share) * room / free).min(u64::from(p.share)) as u32,
                };
                // Whole sockets: a scaled HTTP/2 share fills the sockets it needs.
                if p.streams > 1 && c >= p.streams && c < p.share {
                    c -= c % p.streams;
                }
                if c < p.min_share {
                    *m = true;
                    changed = true;
                    p.min_share
                } else {
                    c
                }
            })
            .collect();
        if !changed {
            return caps;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(share: u32, endpoints: u32, min_share: u32) -> Pool {
        Pool {
            plan: 0,
            backend: 0,
            share,
            burst: 0,
            endpoints,
            min_share,
            streams: 1,
        }
    }

    #[test]
    fn water_fill_is_proportional_and_fits() {
        let pools = [pool(100, 4, 1), pool(50, 2, 1)];
        let caps = water_fill(&pools, 250);
        assert_eq!(caps, [50, 25]);
        assert!(u64::from(caps[0]) * 4 + u64::from(caps[1]) * 2 <= 250);
    }

    #[test]
    fn water_fill_never_goes_below_min_and_rebalances_the_rest() {
        let pools = [pool(100, 2, 40), pool(100, 2, 1)];
        let caps = water_fill(&pools, 200);
        assert_eq!(caps[0], 50, "half of 100 stays above the min");
        let pools = [pool(100, 2, 80), pool(100, 2, 1)];
        let caps = water_fill(&pools, 200);
        assert_eq!(
            caps,
            [80, 20],
            "the first pool is held at its min; the other takes the rest"
        );
    }

    #[test]
    fn streams_per_socket_is_one_but_for_http2() {
        let sample = |s: Option<f64>| BackendSample {
            h2_max_streams: s,
            ..BackendSample::default()
        };
        assert_eq!(
            streams_per_socket(ProtocolSpec::Http1, &sample(Some(8.0))),
            1
        );
        assert_eq!(
            streams_per_socket(ProtocolSpec::Auto, &sample(Some(8.0))),
            1
        );
        assert_eq!(
            streams_per_socket(ProtocolSpec::Http2, &sample(Some(8.0))),
            8
        );
        for unknown in [None, Some(0.0), Some(f64::NAN)] {
            assert_eq!(
                streams_per_socket(ProtocolSpec::Http2, &sample(unknown)),
                DEFAULT_H2_STREAMS
            );
        }
        assert_eq!(
            streams_per_socket(ProtocolSpec::Http2, &sample(Some(4294967295.0))),
            u32::MAX,
            "a server that sets no limit"
        );
    }

    #[test]
    fn water_fill_counts_sockets_of_http2_pools_and_keeps_them_whole() {
        let h2 = |share, endpoints, streams| Pool {
            streams,
            ..pool(share, endpoints, 1)
        };
        // 300 streams on 3 sockets × 2 endpoints; 6 fds fit all of it, 4 fit 2 sockets each.
        assert_eq!(water_fill(&[h2(300, 2, 100)], 6), [300]);
        let caps = water_fill(&[h2(300, 2, 100)], 4);
        assert_eq!(caps, [200]);
        // Beside an HTTP/1.1 pool: 50 + 2 sockets, scaled by 26/52.
        let pools = [pool(50, 1, 1), h2(200, 1, 100)];
        let caps = water_fill(&pools, 26);
        assert_eq!(caps, [25, 100]);
        assert!(pools[0].sockets(caps[0]) + pools[1].sockets(caps[1]) <= 26);
    }

    #[test]
    fn water_fill_with_no_room_leaves_everything_at_min() {
        let caps = water_fill(&[pool(10, 1, 3), pool(10, 1, 2)], 0);
        assert_eq!(caps, [3, 2]);
    }
}
