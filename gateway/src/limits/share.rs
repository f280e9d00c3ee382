//! `listener.maxUpstreamConnections`: the pod-wide cap on upstream connections, divided across
//! the backends max-min fairly. Each backend may hold up to its pool's own cap (per endpoint cap
//! × endpoints); while those add up to more than the pod-wide cap, every backend gets an equal
//! part, and a backend that needs less than its part leaves the rest to the others. A backend's
//! part is then spread over its endpoints (rounded down, at least one each).
//!
//! The burst allowances (`pool.burstPerEndpoint`) come after the shares: they get only what the
//! shares leave of the cap, water-filled the same way but without a floor (a backend may get no
//! burst at all), so that shares and bursts together stay under the cap even when every pool
//! bursts at once.

/// The per-endpoint cap of each backend under a pod-wide `cap`, for backends given as
/// `(per-endpoint cap, endpoints)`. Without a cap, or when the pools fit under it, the pools'
/// own caps.
pub fn per_endpoint_caps(cap: Option<u32>, pools: &[(u32, u32)]) -> Vec<u32> {
    let own: Vec<u32> = pools.iter().map(|&(max, _)| max).collect();
    let Some(cap) = cap else { return own };
    let demand = |&(max, endpoints): &(u32, u32)| u64::from(max) * u64::from(endpoints);
    if pools.iter().map(demand).sum::<u64>() <= u64::from(cap) {
        return own;
    }
    // Every endpoint keeps one connection; what is left of the cap is water-filled over what
    // the backends want beyond that, smallest first.
    let floor = |&(max, endpoints): &(u32, u32)| u64::from(endpoints) * u64::from(max.min(1));
    let mut order: Vec<usize> = (0..pools.len()).collect();
    order.sort_by_key(|&i| demand(&pools[i]) - floor(&pools[i]));
    let mut totals: Vec<u64> = pools.iter().map(floor).collect();
    let mut left = u64::from(cap).saturating_sub(totals.iter().sum());
    for (k, &i) in order.iter().enumerate() {
        let part = left / (order.len() - k) as u64;
        let extra = (demand(&pools[i]) - totals[i]).min(part);
        totals[i] += extra;
        left -= extra;
    }
    pools
        .iter()
        .zip(totals)
        .map(|(&(max, endpoints), total)| match endpoints {
            0 => max,
            e => ((total / u64::from(e)) as u32).clamp(1, max.max(1)),
        })
        .collect()
}

/// The burst per endpoint of each backend under a pod-wide `cap`, for backends given as
/// `(per-endpoint cap in force, endpoints, burst asked for)`, the caps being what
/// [`per_endpoint_caps`] gave. Without a cap, the bursts asked for; with one, what the caps leave
/// of it, shared max-min fairly (rounded down to endpoints, possibly 0).
pub fn per_endpoint_bursts(cap: Option<u32>, pools: &[(u32, u32, u32)]) -> Vec<u32> {
    let asked: Vec<u32> = pools.iter().map(|&(_, _, burst)| burst).collect();
    let Some(cap) = cap else { return asked };
    let held: u64 = pools
        .iter()
        .map(|&(max, endpoints, _)| u64::from(max) * u64::from(endpoints))
        .sum();
    let mut left = u64::from(cap).saturating_sub(held);
    let demand = |&(_, endpoints, burst): &(u32, u32, u32)| u64::from(burst) * u64::from(endpoints);
    let mut order: Vec<usize> = (0..pools.len()).collect();
    order.sort_by_key(|&i| demand(&pools[i]));
    let mut totals = vec![0u64; pools.len()];
    for (k, &i) in order.iter().enumerate() {
        let part = left / (order.len() - k) as u64;
        let extra = demand(&pools[i]).min(part);
        totals[i] = extra;
        left -= extra;
    }
    pools
        .iter()
        .zip(totals)
        .map(|(&(_, endpoints, burst), total)| match endpoints {
            0 => burst,
            e => ((total / u64::from(e)) as u32).min(burst),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_cap_is_shared_equally_and_a_small_pool_leaves_its_rest_to_the_others() {
        assert_eq!(per_endpoint_caps(None, &[(64, 2), (8, 1)]), [64, 8]);
        assert_eq!(
            per_endpoint_caps(Some(1000), &[(64, 2), (8, 1)]),
            [64, 8],
            "the pools fit"
        );
        // 100 for three backends: one connection per endpoint first (4), then b (7 more
        // wanted) takes its 7, and a and c share the other 89: 45 and 44 more.
        assert_eq!(
            per_endpoint_caps(Some(100), &[(64, 2), (8, 1), (50, 1)]),
            [23, 8, 45]
        );
        // Every endpoint keeps one connection, even under a cap too small for that.
        assert_eq!(per_endpoint_caps(Some(2), &[(8, 3), (8, 1)]), [1, 1]);
    }

    #[test]
    fn bursts_get_what_the_shares_leave_of_the_cap() {
        assert_eq!(
            per_endpoint_bursts(None, &[(4, 2, 3), (8, 1, 0)]),
            [3, 0],
            "no cap: the bursts asked for"
        );
        assert_eq!(
            per_endpoint_bursts(Some(100), &[(4, 2, 3), (8, 1, 2)]),
            [3, 2],
            "they fit"
        );
        // 20 - (8 + 8) = 4 left: a asks 6 (3 × 2), b asks 2; b takes its 2, a the other 2:
        // 1 per endpoint.
        assert_eq!(
            per_endpoint_bursts(Some(20), &[(4, 2, 3), (8, 1, 2)]),
            [1, 2]
        );
        assert_eq!(
            per_endpoint_bursts(Some(16), &[(4, 2, 3), (8, 1, 2)]),
            [0, 0],
            "the shares use the whole cap: no burst"
        );
    }

    proptest! {
        #[test]
        fn shares_and_bursts_together_stay_under_the_cap(
            cap in 1u32..2000,
            pools in proptest::collection::vec((1u32..200, 1u32..6, 0u32..50), 1..6),
        ) {
            let own: Vec<(u32, u32)> = pools.iter().map(|&(max, e, _)| (max, e)).collect();
            let caps = per_endpoint_caps(Some(cap), &own);
            let with_caps: Vec<(u32, u32, u32)> = pools
                .iter()
                .zip(&caps)
                .map(|(&(_, e, burst), &max)| (max, e, burst))
                .collect();
            let bursts = per_endpoint_bursts(Some(cap), &with_caps);
            let shares: u64 = with_caps.iter().map(|&(m, e, _)| u64::from(m) * u64::from(e)).sum();
            let total: u64 = with_caps
                .iter()
                .zip(&bursts)
                .map(|(&(m, e, _), &b)| (u64::from(m) + u64::from(b)) * u64::from(e))
                .sum();
            for (i, &(_, _, asked)) in pools.iter().enumerate() {
                prop_assert!(bursts[i] <= asked, "never more burst than asked");
            }
            if shares <= u64::from(cap) {
                prop_assert!(total <= u64::from(cap), "{total} over the cap {cap}");
            } else {
                prop_assert!(bursts.iter().all(|&b| b == 0), "no room, no burst");
            }
        }

        #[test]
        fn shares_stay_under_the_cap_and_are_max_min_fair(
            cap in 1u32..2000,
            pools in proptest::collection::vec((1u32..200, 1u32..6), 1..6),
        ) {
            let caps = per_endpoint_caps(Some(cap), &pools);
            let total = |i: usize| u64::from(caps[i]) * u64::from(pools[i].1);
            let endpoints: u64 = pools.iter().map(|p| u64::from(p.1)).sum();
            let held: u64 = (0..pools.len()).map(total).sum();
            for (i, &(max, _)) in pools.iter().enumerate() {
                prop_assert!(caps[i] >= 1 && caps[i] <= max, "within the pool's own cap");
            }
            if u64::from(cap) >= endpoints {
                prop_assert!(held <= u64::from(cap), "{held} over the cap {cap}");
            }
            // Max-min: no backend holds more than one held below its own cap, but for the one
            // connection each endpoint keeps and the rounding down to endpoints.
            for (i, &(max, e)) in pools.iter().enumerate() {
                if caps[i] < max {
                    for (j, &(_, ej)) in pools.iter().enumerate() {
                        prop_assert!(
                            total(j) <= total(i) + u64::from(e) + u64::from(ej),
                            "backend {i} ({}) starved beside {j} ({})", total(i), total(j)
                        );
                    }
                }
            }
        }
    }
}
