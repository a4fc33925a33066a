//! Which ranks a sampled kv_aware decision reads: the gateway's `--router-sample-ranks N`
//! (`routing/lean.rs`) and the simulator's `--sample-ranks N` both call [`sample_ranks`], so
//! that the simulator studies the decision the router makes.

use std::cmp::Reverse;

/// Pools of this many ranks or more sample by default (`--router-sample-ranks` unset).
pub const AUTO_SAMPLE_FROM_RANKS: usize = 256;
/// The `N` of a sampled decision by default, in pools of [`AUTO_SAMPLE_FROM_RANKS`] or more:
/// in virtual time, 16 to 64 routed within 1% of the exact decision on six workloads at 256
/// to 1,024 workers (TTFT p99s within their seed-to-seed spread), and a decision at 1,024
/// costs ~0.25x reading every rank (BENCHMARKS.md, "A kv_aware decision at 16, 256 and
/// 1,024 workers").
pub const AUTO_SAMPLE_RANKS: usize = 64;

/// The `N` a pool of `ranks` ranks samples with (0: every rank read), from the setting
/// (`None`: unset, [`AUTO_SAMPLE_RANKS`] from [`AUTO_SAMPLE_FROM_RANKS`] ranks on; `Some(0)`:
/// never; `Some(n)`: always `n`).
pub fn sample_size(setting: Option<usize>, ranks: usize) -> usize {
    match setting {
        Some(n) => n,
        None if ranks >= AUTO_SAMPLE_FROM_RANKS => AUTO_SAMPLE_RANKS,
        None => 0,
    }
}

use rand::seq::SliceRandom;
use rand::{Rng, RngCore};

/// Reads, through `take`, the ranks of a sampled decision among ranks `0..total`:
///
/// 1. the `n` of `cached` (each rank's cached prefix in blocks, and the rank) with the longest
///    prefix, ties in an order drawn for this decision;
/// 2. `n` of `active` (the ranks running a request that starts with the prompt's first block),
///    drawn at random;
/// 3. `n` more drawn uniformly from all the ranks, with at most `4n` draws.
///
/// `take(i)` reads rank `i` and says whether it counts: `false` for a rank already read or
/// one that cannot take the request, so that each step reads `n` ranks that count while
/// there are that many.
pub fn sample_ranks(
    mut cached: Vec<(u32, usize)>,
    mut active: Vec<usize>,
    total: usize,
    n: usize,
    rng: &mut dyn RngCore,
    mut take: impl FnMut(usize) -> bool,
) {
    let seed = rng.next_u64();
    let tie = |i: usize| (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    if cached.len() > n && n > 0 {
        cached.select_nth_unstable_by_key(n - 1, |&(depth, i)| Reverse((depth, tie(i))));
    }
    active.shuffle(rng);
    for holders in [cached.into_iter().map(|(_, i)| i).collect(), active] {
        let mut kept = 0;
        for i in holders {
            if kept == n {
                break;
            }
            kept += usize::from(take(i));
        }
    }
    let (mut kept, mut draws) = (0, 4 * n);
    while kept < n && draws > 0 && total > 0 {
        draws -= 1;
        kept += usize::from(take(rng.random_range(0..total)));
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn unset_samples_large_pools_only() {
        assert_eq!(sample_size(None, AUTO_SAMPLE_FROM_RANKS - 1), 0);
        assert_eq!(sample_size(None, AUTO_SAMPLE_FROM_RANKS), AUTO_SAMPLE_RANKS);
        assert_eq!(sample_size(Some(0), 4096), 0, "0 turns it off");
        assert_eq!(sample_size(Some(8), 16), 8, "a set N applies at any size");
    }

    #[test]
    fn the_longest_holders_the_active_ones_then_others_at_random() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut drawn = [0u32; 100];
        for _ in 0..500 {
            let mut read = Vec::new();
            let cached = vec![(3, 10), (9, 11), (9, 12), (1, 13)];
            sample_ranks(cached, vec![20, 21, 22], 100, 2, &mut rng, |i| {
                let new = !read.contains(&i);
                if new {
                    read.push(i);
                }
                new
            });
            // The two longest (9 blocks), two of the three active, two others.
            let mut holders = read[..2].to_vec();
            holders.sort();
            assert_eq!(holders, [11, 12]);
            assert!(read[2..4].iter().all(|i| (20..23).contains(i)), "{read:?}");
            assert_eq!(read.len(), 6, "{read:?}");
            for &i in &read[4..] {
                drawn[i] += 1;
            }
        }
        // 1,000 draws over 100 ranks: every rank some, none far above its share.
        assert!(drawn
            .iter()
            .enumerate()
            .all(|(i, &n)| (11..13).contains(&i) || n < 30));
        assert!(drawn.iter().filter(|&&n| n > 0).count() > 90);
    }

    #[test]
    fn ranks_that_do_not_count_are_replaced_and_draws_are_bounded() {
        let mut rng = SmallRng::seed_from_u64(4);
        let mut read = Vec::new();
        // Rank 0 cannot take it: the next holder is read instead.
        sample_ranks(vec![(5, 0), (4, 1), (3, 2)], vec![], 3, 1, &mut rng, |i| {
            read.push(i);
            i != 0
        });
        assert_eq!(&read[..2], [0, 1]);
        // No rank counts: 4n draws, then it stops.
        let mut calls = 0;
        sample_ranks(vec![], vec![], 10, 3, &mut rng, |_| {
            calls += 1;
            false
        });
        assert_eq!(calls, 12);
    }
}
