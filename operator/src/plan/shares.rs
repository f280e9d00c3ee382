//! One backend's division of its target over its holders, between runs: the demand each pod
//! showed, the division ([`super::division`]) and its hysteresis, the division kept while a
//! serving pod's samples are missing, and the words for a re-division that moved connections to
//! a pod that needed them (a `Rebalance`, never a silent `NoChange`).

use super::division::{self, Claim, Need, QUEUEING};
use super::input::PodPool;
use super::time::Timestamp;

/// A division in force: who holds what, and the demand it was divided by.
#[derive(Clone, Debug, PartialEq)]
pub struct Divided {
    /// The holders it was divided over, in name order.
    pub holders: Vec<String>,
    /// The target it divided.
    pub target: u32,
    /// Each holder's share per endpoint.
    pub shares: Vec<u32>,
    /// Each holder's demand per endpoint then (`None`: no sample of the pod).
    pub demand: Vec<Option<f64>>,
    /// When it was divided.
    pub at: Timestamp,
}

impl Divided {
    /// Whether it divides `target` over `holders`.
    pub fn fits(&self, target: u32, holders: &[String]) -> bool {
        self.target == target && self.holders == holders
    }
}

/// What one run decides about a backend's division.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// The division in force after this run.
    pub divided: Divided,
    /// Why it re-divided the same target over the same pods, when it did (for the decision
    /// record, the Event and the metric).
    pub rebalanced: Option<String>,
}

/// One backend's holders and what the division knows of each.
#[derive(Clone, Copy, Debug)]
pub struct Holders<'a> {
    /// Their names, in name order.
    pub names: &'a [String],
    /// Whether each serves traffic (ready): a ready pod without samples makes the demand unknown.
    pub ready: &'a [bool],
    /// Each one's pool, when it has fresh samples.
    pub pools: &'a [Option<PodPool>],
}

/// The division after this run. `due`: the backend's autoscale decision ran now (a division is
/// re-judged only then, once per interval, so that the documents change at most that often).
/// A new target or a new set of holders is always divided anew; otherwise the last division
/// stays unless the new one [`division::moves`]. While a ready holder has no samples, its demand
/// is unknown: the last division stays if it still fits, else the target is split evenly.
pub fn step(
    target: u32,
    endpoints: u32,
    holders: Holders<'_>,
    last: Option<&Divided>,
    due: bool,
    now: Timestamp,
) -> Step {
    let last = last.filter(|d| d.fits(target, holders.names));
    if let Some(last) = last
        && !due
    {
        return Step {
            divided: last.clone(),
            rebalanced: None,
        };
    }
    let n = holders.names.len();
    let missing = (0..n).any(|i| holders.ready[i] && holders.pools[i].is_none());
    let demand: Vec<Option<f64>> = holders
        .pools
        .iter()
        .map(|p| p.map(|p| p.demand(endpoints)))
        .collect();
    if missing {
        let divided = match last {
            Some(last) => last.clone(),
            None => Divided {
                holders: holders.names.to_vec(),
                target,
                shares: division::even(target, n),
                demand,
                at: now,
            },
        };
        return Step {
            divided,
            rebalanced: None,
        };
    }
    let claims: Vec<Claim> = holders
        .pools
        .iter()
        .map(|p| {
            p.map_or_else(Claim::default, |p| Claim {
                demand: p.demand(endpoints),
                in_flight: p.in_flight(endpoints),
            })
        })
        .collect();
    let shares = division::divide(target, &claims);
    let divided = Divided {
        holders: holders.names.to_vec(),
        target,
        shares,
        demand,
        at: now,
    };
    let Some(last) = last else {
        return Step {
            divided,
            rebalanced: None,
        };
    };
    let needs: Vec<Need> = holders
        .pools
        .iter()
        .map(|p| {
            p.map_or_else(Need::default, |p| Need {
                queues: p.pending >= QUEUEING,
                demand: p.demand(endpoints),
            })
        })
        .collect();
    if !division::moves(&last.shares, &divided.shares, &needs, target) {
        return Step {
            divided: last.clone(),
            rebalanced: None,
        };
    }
    let reason = reason(last, &divided, &needs, holders.pools, endpoints);
    Step {
        divided,
        rebalanced: Some(reason),
    }
}

/// How many pods a reason names on each side.
const NAMED: usize = 3;

/// `gw-0 queues at share 4 with demand 12.0 per endpoint while gw-1 uses 0.0 of its 4: target
/// 8 re-divided by demand from [4, 4] to [7, 1]`.
fn reason(
    last: &Divided,
    new: &Divided,
    needs: &[Need],
    pools: &[Option<PodPool>],
    endpoints: u32,
) -> String {
    let mut gaining = Vec::new();
    let mut giving = Vec::new();
    for (i, pod) in new.holders.iter().enumerate() {
        let (was, is) = (last.shares[i], new.shares[i]);
        let demand = needs[i].demand;
        if is > was {
            // The words say which rule of [`division::moves`] the pod met: it queued, it uses all
            // of its share, or neither (the division moved by more than the deadband).
            let how = if needs[i].queues {
                "queues"
            } else if needs[i].pressed(was) {
                "is pressed"
            } else {
                "shows more demand"
            };
            gaining.push(format!(
                "{pod} {how} at share {was} with demand {demand:.1} per endpoint"
            ));
        } else if is < was {
            let used = pools[i].map_or(0.0, |p| p.leased / f64::from(endpoints.max(1)));
            giving.push(format!("{pod} uses {used:.1} of its {was}"));
        }
    }
    let named = |v: Vec<String>| {
        let more = v.len().saturating_sub(NAMED);
        let mut s = v.into_iter().take(NAMED).collect::<Vec<_>>().join(", ");
        if more > 0 {
            s.push_str(&format!(" and {more} more"));
        }
        s
    };
    let why = match (gaining.is_empty(), giving.is_empty()) {
        (false, false) => format!("{} while {}", named(gaining), named(giving)),
        (false, true) => named(gaining),
        (true, _) => format!("demand moved: {}", named(giving)),
    };
    format!(
        "{why}: target {} re-divided by demand from {:?} to {:?}",
        new.target, last.shares, new.shares
    )
}

#[cfg(test)]
mod tests;
