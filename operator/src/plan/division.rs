//! The division of a backend's fleet-wide target over the pods that hold its connections: by
//! demand, above a floor and above what each pod has in flight, adding up to the target; the
//! burst allowance beside it; and when a new division is worth a new document. Plain numbers and
//! no state: [`super::shares`] applies it to a backend, `division/tests.rs` proves its properties.
//!
//! ## The division
//!
//! Each of the `n` holders gets a *lower bound*: the larger of the floor, `max(1, ⌊target ÷ n ÷
//! 4⌋)` (an idle pod can always take a call, and a quarter of the even share keeps a pod whose
//! demand appears between two decisions from starting at 1), and the connections per endpoint it
//! has in flight (a share below them would only make the pod close connections its calls hold).
//! When the lower bounds alone exceed the target (the target shrank under calls in flight), the
//! in-flight part gives way and every pod starts from the floor.
//!
//! Above the lower bounds the target is poured by demand (water-filling): the pods get
//! `max(lower, λ × demand)` with the one `λ` that makes the shares add up to the target, so a
//! pod's share is proportional to its demand unless that is below its lower bound. Without any
//! demand the target is split evenly. Rounding hands out the remainder by the largest fractional
//! parts (the earlier pod on a tie), so the shares add up to the target exactly, unless the
//! floors of 1 alone exceed it (more pods than the target: every pod gets 1).
//!
//! Worked example: target 24 over three pods with demand 18, 3 and 0 per endpoint and nothing in
//! flight. The floor is `⌊24 ÷ 3 ÷ 4⌋ = 2`. The idle pod gets its floor 2; the other 22 go by
//! demand, 18 : 3, so `λ = 22 ÷ 21` and the shares are 18.86 and 3.14, rounded 19 and 3:
//! **[19, 3, 2]**, 24 in all. An even split would have given 8 each, and the busy pod would have
//! queued 10 calls while 11 connections sat idle elsewhere.
//!
//! ## The burst allowance
//!
//! A pod whose queue grows may open up to `share + burst` per endpoint at once, before the next
//! decision re-divides. Every pod may burst at the same moment, so the allowance is what is left
//! of the backend's `budget` (its capacity less half the headroom, from [`super::fleet`]) after
//! what the pods may hold already, split evenly: `⌊(budget − Σ max(share, held)) ÷ n⌋`. Right
//! after a re-division `held` is what a pod has in flight (its connections above a lowered share
//! close only as their calls end), so `Σ max(share, held) + n × burst ≤ budget` holds whatever the
//! pods do with it; between re-divisions the pods hold at most their shares plus the same burst,
//! so the sum is the target and the burst stays put.

/// A pod's demand queued this much (pending lease requests, averaged over the interval) counts
/// as queueing: it waits for connections its share does not give it.
pub const QUEUEING: f64 = 0.5;
/// A pod whose demand reaches this fraction of its share is pressed: it uses all of its share
/// (bursting beyond it, or about to queue), and a re-division that gives it more is worth a new
/// document. (At three quarters, a light load of one or two calls per pod flipped small shares
/// back and forth every interval.)
pub const PRESSED: f64 = 1.0;
/// Otherwise a new division goes out only when it moves more than this fraction of the target
/// between pods, and more than one connection, so that noise in the demand does not churn the
/// limits documents.
pub const DEADBAND: f64 = 0.10;

/// One holder as the division sees it (per endpoint of the backend).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Claim {
    /// Leased connections plus pending lease requests, averaged over the interval.
    pub demand: f64,
    /// Connections leased at the latest scrape, rounded up.
    pub in_flight: u32,
}

/// The floor of a share: a quarter of the even share, at least 1.
pub fn floor(target: u32, pods: usize) -> u32 {
    let pods = u32::try_from(pods).unwrap_or(u32::MAX).max(1);
    (target / pods / 4).max(1)
}

/// The even split: `target ÷ n` rounded down, one more for the first `target mod n`, at least 1.
pub fn even(target: u32, pods: usize) -> Vec<u32> {
    narrow(even_u64(u64::from(target), pods))
}

/// [`even`] of a `u64` target (a token budget).
pub fn even_u64(target: u64, pods: usize) -> Vec<u64> {
    let n = (pods as u64).max(1);
    (0..pods)
        .map(|i| (target / n + u64::from((i as u64) < target % n)).max(1))
        .collect()
}

/// Shares of a `u32` target back from the `u64` arithmetic (each is at most the target, or 1).
fn narrow(shares: Vec<u64>) -> Vec<u32> {
    shares
        .into_iter()
        .map(|s| u32::try_from(s).unwrap_or(u32::MAX))
        .collect()
}

/// Divides `target` over the holders by their claims (see the module docs): one share per
/// claim, in order.
pub fn divide(target: u32, claims: &[Claim]) -> Vec<u32> {
    let floor = floor(target, claims.len());
    narrow(divide_above(u64::from(target), claims, u64::from(floor)))
}

/// Divides `target` over the holders by their claims above a `floor` each (the division of
/// [`divide`] with a floor of the caller's: a token budget's is smaller than a quarter of the
/// even share, so that a client pinned to one pod gets nearly all of it there). Every pod at
/// the even split when the floors leave nothing to pour.
pub fn divide_above(target: u64, claims: &[Claim], floor: u64) -> Vec<u64> {
    let n = claims.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = floor.max(1);
    if u128::from(floor) * n as u128 >= u128::from(target) {
        // Nothing above the floors (or not even room for them): every pod at the floor of 1 or
        // the even split, whichever the target allows.
        return even_u64(target, n);
    }
    let mut lower: Vec<u64> = claims
        .iter()
        .map(|c| u64::from(c.in_flight).max(floor))
        .collect();
    if lower.iter().map(|&l| u128::from(l)).sum::<u128>() > u128::from(target) {
        lower = vec![floor; n];
    }
    let weight: Vec<f64> = claims
        .iter()
        .map(|c| {
            if c.demand.is_finite() {
                c.demand.max(0.0)
            } else {
                0.0
            }
        })
        .collect();
    let exact = pour(target, &lower, &weight);
    round(target, &lower, &exact)
}

/// The real-valued shares: `max(lower, λ × weight)` adding up to `target`, or the remainder above
/// the lower bounds split evenly when no pod has weight.
fn pour(target: u64, lower: &[u64], weight: &[f64]) -> Vec<f64> {
    let target = target as f64;
    let mut at_lower: Vec<bool> = weight.iter().map(|&w| w <= 0.0).collect();
    if at_lower.iter().all(|&b| b) {
        let rest = target - lower.iter().map(|&l| l as f64).sum::<f64>();
        let each = rest / lower.len() as f64;
        return lower.iter().map(|&l| l as f64 + each).collect();
    }
    loop {
        let fixed: f64 = lower
            .iter()
            .zip(&at_lower)
            .filter(|(_, a)| **a)
            .map(|(&l, _)| l as f64)
            .sum();
        let weights: f64 = weight
            .iter()
            .zip(&at_lower)
            .filter(|(_, a)| !**a)
            .map(|(w, _)| w)
            .sum();
        if weights <= 0.0 {
            // Every pod with weight fell to its lower bound (only float error gets here): the
            // rest goes evenly.
            let rest = (target - fixed) / lower.len() as f64;
            return lower.iter().map(|&l| l as f64 + rest.max(0.0)).collect();
        }
        let lambda = (target - fixed) / weights;
        let mut changed = false;
        for i in 0..lower.len() {
            if !at_lower[i] && lambda * weight[i] < lower[i] as f64 {
                at_lower[i] = true;
                changed = true;
            }
        }
        if !changed {
            return (0..lower.len())
                .map(|i| {
                    if at_lower[i] {
                        lower[i] as f64
                    } else {
                        lambda * weight[i]
                    }
                })
                .collect();
        }
    }
}

/// Rounds the real shares down (never below their lower bound) and hands the remainder out by
/// the largest fractional part, the earlier pod on a tie, so that they add up to `target`.
fn round(target: u64, lower: &[u64], exact: &[f64]) -> Vec<u64> {
    let mut shares: Vec<u64> = exact
        .iter()
        .zip(lower)
        .map(|(&x, &l)| (x.floor().min(target as f64) as u64).max(l))
        .collect();
    let mut left = i128::from(target) - shares.iter().map(|&s| i128::from(s)).sum::<i128>();
    let mut order: Vec<usize> = (0..shares.len()).collect();
    order.sort_by(|&a, &b| {
        let fa = exact[a] - exact[a].floor();
        let fb = exact[b] - exact[b].floor();
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    // Float error may leave the sum off either way: give to the largest fractions, take from
    // the smallest that stay above their lower bound.
    for &i in order.iter().cycle().take(order.len() * 2) {
        if left <= 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    while left < 0 {
        let mut took = false;
        for &i in order.iter().rev() {
            if left >= 0 {
                break;
            }
            if shares[i] > lower[i] {
                shares[i] -= 1;
                left += 1;
                took = true;
            }
        }
        if !took {
            break;
        }
    }
    shares
}

/// The burst allowance per endpoint for each of `pods` holders, given the backend's `budget` per
/// endpoint and what the holders may hold already, `held = Σ max(share, in flight)`.
pub fn burst(budget: u32, held: u64, pods: usize) -> u32 {
    let Some(room) = u64::from(budget).checked_sub(held) else {
        return 0;
    };
    let per_pod = room.checked_div(pods as u64).unwrap_or(0);
    u32::try_from(per_pod).unwrap_or(u32::MAX)
}

/// What one holder needs, as the hysteresis sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Need {
    /// It queued: pending lease requests averaged at least [`QUEUEING`].
    pub queues: bool,
    /// Its demand per endpoint, for [`PRESSED`].
    pub demand: f64,
}

impl Need {
    /// Whether it uses all of a share of `share` per endpoint: its demand reaches [`PRESSED`]
    /// of it.
    pub fn pressed(&self, share: u32) -> bool {
        self.demand >= PRESSED * f64::from(share)
    }
}

/// Whether `new` is worth sending in place of `old` (same holders, same target): a pod that
/// queues or is pressed gets more, or the division moves more than [`DEADBAND`] of the target.
pub fn moves(old: &[u32], new: &[u32], needs: &[Need], target: u32) -> bool {
    let wide = |v: &[u32]| v.iter().map(|&s| u64::from(s)).collect::<Vec<u64>>();
    moves_u64(&wide(old), &wide(new), needs, u64::from(target))
}

/// [`moves`] of `u64` shares (a token budget's).
pub fn moves_u64(old: &[u64], new: &[u64], needs: &[Need], target: u64) -> bool {
    if old.len() != new.len() || old.len() != needs.len() {
        return true;
    }
    let gains = |i: usize| new[i] > old[i];
    let pressed = |i: usize| needs[i].demand >= PRESSED * old[i] as f64;
    let wanting = (0..old.len()).any(|i| gains(i) && (needs[i].queues || pressed(i)));
    let moved: u128 = old
        .iter()
        .zip(new)
        .map(|(&a, &b)| u128::from(a.abs_diff(b)))
        .sum::<u128>()
        / 2;
    wanting || (moved > 1 && moved as f64 > DEADBAND * target as f64)
}

#[cfg(test)]
mod tests;
