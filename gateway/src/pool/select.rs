//! Endpoint choice, pure (no state, no clock, nothing of the crate imported: the module graph
//! test in `e2e/src/module_graph.rs` holds it to that): the power of two choices (P2C) on spare
//! capacity. Of the endpoints that may take a lease now (eligible, with an idle connection or
//! room under the cap: see `dispatch`), two distinct ones are drawn uniformly at random and the
//! one with more spare capacity (the cap minus its leased and connecting connections) wins, the
//! first drawn on a tie. As linkerd2-proxy's balancer does: two random candidates spread load
//! almost as well as scanning every endpoint for the least loaded, without its herding (every
//! lease going to the same endpoint until its counts catch up) and at a constant cost.

use rand::Rng;

/// Two distinct candidates of `n` (at least 2), each ordered pair equally likely: the first
/// uniformly of `0..n`, the second uniformly of the others (linkerd2-proxy's `gen_pair`).
pub(super) fn gen_pair(rng: &mut impl Rng, n: usize) -> (usize, usize) {
    debug_assert!(n >= 2, "a pair needs two candidates, not {n}");
    let i = rng.random_range(0..n);
    let mut j = rng.random_range(0..n - 1);
    if j >= i {
        j += 1;
    }
    (i, j)
}

/// Of two candidates `(endpoint, spare capacity)`, the endpoint with more spare capacity; the
/// first on a tie.
pub(super) fn more_spare<T>(a: (T, u32), b: (T, u32)) -> T {
    if b.1 > a.1 { b.0 } else { a.0 }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    proptest! {
        #[test]
        fn a_pair_is_two_distinct_candidates(n in 2usize..1024, seed: u64) {
            let mut rng = StdRng::seed_from_u64(seed);
            for _ in 0..64 {
                let (i, j) = gen_pair(&mut rng, n);
                prop_assert!(i < n && j < n, "({i}, {j}) of {n}");
                prop_assert_ne!(i, j);
            }
        }

        #[test]
        fn every_ordered_pair_can_be_drawn(n in 2usize..6, seed: u64) {
            // n ≤ 5: at most 20 ordered pairs, each drawn with probability 1/20 per draw; the
            // chance that one is missing from 2,000 draws is below 20 × (19/20)^2000 ≈ 1e-43.
            let mut rng = StdRng::seed_from_u64(seed);
            let mut seen = vec![vec![false; n]; n];
            for _ in 0..2000 {
                let (i, j) = gen_pair(&mut rng, n);
                seen[i][j] = true;
            }
            for (i, row) in seen.iter().enumerate() {
                for (j, drawn) in row.iter().enumerate() {
                    prop_assert_eq!(*drawn, i != j, "pair ({}, {}) of {}", i, j, n);
                }
            }
        }

        #[test]
        fn the_endpoint_with_the_least_spare_capacity_is_never_chosen(
            spare in proptest::collection::vec(0u32..64, 2..16),
            seed: u64,
        ) {
            let least = *spare.iter().min().unwrap();
            let unique_least = spare.iter().filter(|s| **s == least).count() == 1;
            let mut rng = StdRng::seed_from_u64(seed);
            for _ in 0..64 {
                let (i, j) = gen_pair(&mut rng, spare.len());
                let chosen = more_spare((i, spare[i]), (j, spare[j]));
                prop_assert!(chosen == i || chosen == j);
                prop_assert_eq!(spare[chosen], spare[i].max(spare[j]));
                if unique_least {
                    prop_assert_ne!(spare[chosen], least, "spare {:?}", spare);
                }
            }
        }
    }

    #[test]
    fn a_tie_goes_to_the_first_drawn() {
        assert_eq!(more_spare(("a", 3), ("b", 3)), "a");
        assert_eq!(more_spare(("a", 3), ("b", 4)), "b");
        assert_eq!(more_spare(("a", 5), ("b", 4)), "a");
    }
}
