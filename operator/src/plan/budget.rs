//! The budget's arithmetic: a fleet-wide target divided across its holders, the part of
//! `process_max_fds` the pools may use, and the fd check's verdict as one policy sees it. Plain
//! numbers: the plan types ([`super::output`]) and the check ([`super::fds`]) both build on it.

/// Part of `process_max_fds` the pools, clients and reserve may use.
pub const FD_FRACTION: f64 = 0.5;

/// One pod's share of a fleet-wide target: `target / holders` rounded down, at least 1. With no
/// holder the first pod to appear may take the whole target.
pub fn share(target: u32, holders: u32) -> u32 {
    target.checked_div(holders).unwrap_or(target).max(1)
}

/// The part of a fleet-wide `limit` for the pod at `rank` among `pods` holders (the pods a
/// backend's target is divided over): the limit divided, rounded down, plus one for the first
/// `limit mod pods` ranks, so that the parts add up to the limit; at least `floor`. `rank`
/// `None` (the ConfigMap's document, for pods that start later) gets the rounded-down part.
/// With no holder, the first pod to appear may take the whole limit.
pub fn fleet_part(limit: u32, pods: usize, rank: Option<usize>, floor: u32) -> u32 {
    let Ok(n) = u32::try_from(pods) else {
        return floor;
    };
    let Some(base) = limit.checked_div(n) else {
        return limit.max(floor);
    };
    let extra = rank.is_some_and(|r| u32::try_from(r).is_ok_and(|r| r < limit % n));
    (base + u32::from(extra)).max(floor)
}

/// [`fleet_part`] of a `u64` limit (a token budget).
pub fn fleet_part_u64(limit: u64, pods: usize, rank: Option<usize>, floor: u64) -> u64 {
    let Ok(n) = u64::try_from(pods) else {
        return floor;
    };
    let Some(base) = limit.checked_div(n) else {
        return limit.max(floor);
    };
    let extra = rank.is_some_and(|r| u64::try_from(r).is_ok_and(|r| r < limit % n));
    (base + u64::from(extra)).max(floor)
}

/// The fd check as one policy sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FdReport {
    /// The smallest `process_max_fds` of the selected pods (`None`: not known).
    pub limit: Option<u64>,
    /// What the pools, clients and reserve may use: half of that.
    pub allowed: Option<u64>,
    /// Fds the busiest selected pod would need at the unclamped shares.
    pub needed_unclamped: u64,
    /// Fds the busiest selected pod needs at the rendered shares.
    pub needed: u64,
    /// The busiest pod.
    pub worst_pod: Option<String>,
    /// Whether any share was scaled down.
    pub clamped: bool,
    /// `listener.maxUpstreamConnections` of the busiest pod, when it bounds its pools.
    pub upstream_cap: Option<u64>,
}

impl FdReport {
    /// `Some(true)` within budget, `Some(false)` over it (shares clamped), `None` unknown.
    pub fn within(&self) -> Option<bool> {
        let allowed = self.allowed?;
        Some(!self.clamped && self.needed <= allowed)
    }

    /// The numbers, for the condition and the Event.
    pub fn message(&self) -> String {
        let Some(allowed) = self.allowed else {
            return "process_max_fds of the selected pods is not known yet".to_owned();
        };
        let pod = self
            .worst_pod
            .as_deref()
            .map(|p| format!(" (pod {p})"))
            .unwrap_or_default();
        let cap = self
            .upstream_cap
            .map(|c| format!(", pools capped at {c} by listener.maxUpstreamConnections"))
            .unwrap_or_default();
        if !self.clamped {
            return format!("needs {} fds, pods allow {allowed}{pod}{cap}", self.needed);
        }
        let after = if self.needed <= allowed {
            format!("pool shares scaled down to need {}", self.needed)
        } else {
            format!("even at autoscale.min the pools need {}", self.needed)
        };
        format!(
            "needs {} fds, pods allow {allowed}{pod}; {after}",
            self.needed_unclamped
        )
    }
}

/// The fds a pod with this `process_max_fds` lets the pools, clients and reserve use.
pub fn allowed(limit: u64) -> u64 {
    (limit as f64 * FD_FRACTION).floor() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_round_down_and_never_reach_zero() {
        assert_eq!(share(150, 3), 50);
        assert_eq!(share(50, 3), 16);
        assert_eq!(share(2, 3), 1);
        assert_eq!(share(40, 0), 40);
    }

    #[test]
    fn a_u64_limit_is_divided_as_a_u32_one_and_its_parts_add_up() {
        for (limit, pods) in [(0u32, 3), (7, 3), (600, 4), (5, 0), (1, 5)] {
            for rank in [None, Some(0), Some(1), Some(2), Some(4)] {
                assert_eq!(
                    fleet_part_u64(limit.into(), pods, rank, 1),
                    u64::from(fleet_part(limit, pods, rank, 1)),
                    "{limit} over {pods}, rank {rank:?}"
                );
            }
        }
        let big = 3 * u64::from(u32::MAX) + 2;
        let parts: u64 = (0..3).map(|r| fleet_part_u64(big, 3, Some(r), 1)).sum();
        assert_eq!(parts, big);
    }
}
