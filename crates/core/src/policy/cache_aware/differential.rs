//! The radix tree against a naive reference: every text each tenant sent, kept whole, with
//! brute-force longest common prefixes, on seeded random sequences of inserts, matches,
//! evictions and removals.

use std::collections::BTreeSet;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::tree::{Tenant, Tree};

const TENANTS: u32 = 4;
/// Multi-byte characters included, so byte and character counts differ.
const ALPHABET: [char; 5] = ['a', 'b', 'c', 'é', '日'];

/// What the tree should hold: (tenant, text, tick of that insert).
#[derive(Default)]
struct Reference {
    entries: Vec<(Tenant, Vec<char>, u64)>,
}

impl Reference {
    fn insert(&mut self, tenant: Tenant, text: Vec<char>, tick: u64) {
        match self
            .entries
            .iter_mut()
            .find(|e| e.0 == tenant && e.1 == text)
        {
            Some(e) => e.2 = e.2.max(tick),
            None => self.entries.push((tenant, text, tick)),
        }
    }

    /// The longest prefix of `text` held by an allowed tenant, and the tenants holding it.
    fn matched(&self, text: &[char], allowed: &[bool]) -> (usize, BTreeSet<Tenant>) {
        let ok = |t: Tenant| allowed.get(t as usize).copied().unwrap_or(false);
        let best = self
            .entries
            .iter()
            .filter(|e| ok(e.0))
            .map(|e| lcp(&e.1, text))
            .max()
            .unwrap_or(0);
        let who = self
            .entries
            .iter()
            .filter(|e| ok(e.0) && lcp(&e.1, text) == best)
            .map(|e| e.0)
            .collect();
        (best, who)
    }

    /// Each tenant's count of distinct non-empty prefixes of its texts, and the count over
    /// all tenants: over the sorted texts, each one's length less its common prefix with
    /// the one before.
    fn sizes(&self) -> (Vec<usize>, usize) {
        let distinct_prefixes = |mut texts: Vec<&[char]>| {
            texts.sort_unstable();
            let mut prev: &[char] = &[];
            let mut n = 0;
            for t in texts {
                n += t.len() - lcp(t, prev);
                prev = t;
            }
            n
        };
        let sizes = (0..TENANTS)
            .map(|t| {
                let texts = self.entries.iter().filter(|e| e.0 == t);
                distinct_prefixes(texts.map(|e| &e.1[..]).collect())
            })
            .collect();
        let all = distinct_prefixes(self.entries.iter().map(|e| &e.1[..]).collect());
        (sizes, all)
    }
}

fn lcp(a: &[char], b: &[char]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn random_text(rng: &mut SmallRng) -> String {
    let len = rng.random_range(0..10);
    // A small alphabet, weighted to its first letter, so texts share prefixes often.
    (0..len)
        .map(|_| ALPHABET[rng.random_range(0..8).min(ALPHABET.len() - 1) * rng.random_range(0..2)])
        .collect()
}

fn run(seed: u64, steps: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tree = Tree::default();
    let mut reference = Reference::default();
    for step in 0..steps {
        let tenant = rng.random_range(0..TENANTS);
        // Ticks mostly increase, with some requests arriving late.
        let tick = (step * 4).saturating_sub(rng.random_range(0..10));
        match rng.random_range(0..100) {
            0..50 => {
                let text = random_text(&mut rng);
                tree.insert(&text, tenant, tick);
                reference.insert(tenant, text.chars().collect(), tick);
            }
            50..85 => {
                let text = random_text(&mut rng);
                let len = rng.random_range(0..=TENANTS as usize);
                let allowed: Vec<bool> = (0..len).map(|_| rng.random_bool(0.6)).collect();
                let m = tree.match_prefix(&text, &allowed);
                let chars: Vec<char> = text.chars().collect();
                let (best, who) = reference.matched(&chars, &allowed);
                assert_eq!(
                    m.chars, best,
                    "seed {seed} step {step}: {text:?} {allowed:?}"
                );
                if best > 0 {
                    let got: BTreeSet<Tenant> = tree
                        .holders(m.node)
                        .filter(|&t| allowed.get(t as usize) == Some(&true))
                        .collect();
                    assert_eq!(got, who, "seed {seed} step {step}: {text:?}");
                }
            }
            85..95 => {
                let max = rng.random_range(0..30);
                tree.evict(tenant, max);
                assert!(tree.size(tenant) <= max);
                let leaves = tree.leaves_of(tenant);
                let newest_left = leaves.iter().map(|l| l.1).min();
                for (t, text, at) in &reference.entries {
                    let text: String = text.iter().collect();
                    let kept = tree.match_prefix(&text, &only(*t)).chars == text.chars().count();
                    if *t == tenant && !kept {
                        assert!(
                            newest_left.is_none_or(|left| left >= *at),
                            "seed {seed} step {step}: evicted {text:?} (tick {at}) before \
                             an older leaf (tick {newest_left:?})"
                        );
                    }
                }
                reference.entries.retain(|e| e.0 != tenant);
                for (text, at) in leaves {
                    reference.insert(tenant, text.chars().collect(), at);
                }
            }
            _ => {
                tree.remove_tenant(tenant);
                reference.entries.retain(|e| e.0 != tenant);
            }
        }
        tree.check();
        let (sizes, total) = reference.sizes();
        let got: Vec<usize> = (0..TENANTS).map(|t| tree.size(t)).collect();
        assert_eq!(got, sizes, "seed {seed} step {step}");
        assert_eq!(tree.total_chars(), total, "seed {seed} step {step}");
    }
}

fn only(tenant: Tenant) -> Vec<bool> {
    (0..TENANTS).map(|t| t == tenant).collect()
}

#[test]
fn tree_matches_the_reference_on_random_sequences() {
    for seed in 0..200 {
        run(seed, 300);
    }
}

#[test]
fn tree_survives_long_random_sequences() {
    run(u64::MAX, 5_000);
}
