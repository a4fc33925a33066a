//! Seeded property tests: fairness, no starvation, no credit while blocked, and a
//! differential test against a simple model.

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const MAX_COST: u64 = 4096;

/// Even seeds test FCFS, odd seeds WSPT.
fn order_for(seed: u64) -> QueueOrder {
    [QueueOrder::Fcfs, QueueOrder::Wspt][(seed % 2) as usize]
}

fn random_queue(rng: &mut StdRng, seed: u64) -> DrrQueue<u64> {
    let n = rng.random_range(2..=5);
    let classes = (0..n)
        .map(|i| PolicyClass {
            name: format!("c{i}"),
            weight: rng.random_range(100..=2000),
            max_queued: None,
        })
        .collect();
    DrrQueue::new(classes, order_for(seed)).unwrap()
}

/// Pushes items with random costs in `costs` until every class holds four.
fn refill(q: &mut DrrQueue<u64>, rng: &mut StdRng, costs: &std::ops::RangeInclusive<u64>) {
    for c in 0..q.classes().len() {
        while q.class_len(c) < 4 {
            let cost = rng.random_range(costs.clone());
            q.push(c, cost, cost).unwrap();
        }
    }
}

#[test]
fn backlogged_classes_share_cost_by_weight() {
    for seed in 0..16 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut q = random_queue(&mut rng, seed);
        let costs = 1..=MAX_COST;
        let n = q.classes().len();
        let mut served = vec![0u64; n];
        for _ in 0..50_000 {
            refill(&mut q, &mut rng, &costs);
            let (c, cost) = q.pop(|_, _| true).unwrap();
            served[c] += cost;
        }
        let total: u64 = served.iter().sum();
        let weights: u64 = q.classes().iter().map(|c| c.weight).sum();
        for (c, class) in q.classes().iter().enumerate() {
            let share = served[c] as f64 / total as f64;
            let want = class.weight as f64 / weights as f64;
            assert!(
                (share - want).abs() <= 0.05 * want,
                "seed {seed} class {c}: share {share:.4}, weight share {want:.4}"
            );
        }
    }
}

#[test]
fn no_backlogged_class_starves() {
    for seed in 0..16 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut q = random_queue(&mut rng, seed);
        let min_cost = 512;
        let costs = min_cost..=MAX_COST;
        let n = q.classes().len();
        // Class i needs at most ceil(MAX_COST / w_i) visits; between two of its visits (and
        // before the first) every other class j has one visit, dispatching less than
        // MAX_COST + w_j, so at most that / min_cost heads.
        let bound: Vec<u64> = (0..n)
            .map(|i| {
                let others: u64 = (0..n)
                    .filter(|&j| j != i)
                    .map(|j| (MAX_COST + q.classes()[j].weight).div_ceil(min_cost))
                    .sum();
                (MAX_COST.div_ceil(q.classes()[i].weight) + 1) * others + 1
            })
            .collect();
        let mut last = vec![0u64; n];
        for pop in 1..=50_000u64 {
            refill(&mut q, &mut rng, &costs);
            let (c, _) = q.pop(|_, _| true).unwrap();
            last[c] = pop;
            for i in 0..n {
                assert!(
                    pop - last[i] <= bound[i],
                    "seed {seed}: class {i} waited {} pops (bound {})",
                    pop - last[i],
                    bound[i]
                );
            }
        }
    }
}

#[test]
fn blocked_class_does_not_accumulate_credit() {
    for seed in 0..16 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut q = random_queue(&mut rng, seed);
        let costs = 1..=MAX_COST;
        let n = q.classes().len();
        let mut blocked = vec![false; n];
        let mut at_block = vec![0u64; n];
        for _ in 0..20_000 {
            if rng.random_bool(0.02) {
                let c = rng.random_range(0..n);
                if blocked[c] {
                    // It comes back with no more credit than it had when it was blocked.
                    assert!(q.deficit(c) <= at_block[c], "seed {seed}: class {c}");
                } else {
                    at_block[c] = q.deficit(c);
                }
                blocked[c] = !blocked[c];
            }
            refill(&mut q, &mut rng, &costs);
            let before: Vec<u64> = (0..n).map(|c| q.deficit(c)).collect();
            let got = q.pop(|c, _| !blocked[c]);
            assert_eq!(got.is_none(), blocked.iter().all(|&b| b), "seed {seed}");
            for c in 0..n {
                let after = q.deficit(c);
                if blocked[c] {
                    assert_eq!(after, before[c], "seed {seed}: blocked class {c} earned");
                } else {
                    // A visit credits only the quanta that cover the head.
                    let spent = match got {
                        Some((d, cost)) if d == c => cost,
                        _ => 0,
                    };
                    let cap = before[c].max(MAX_COST) + q.classes()[c].weight;
                    assert!(after + spent <= cap, "seed {seed}: class {c} over-credited");
                }
            }
        }
    }
}

/// The model: per class, the live items as `(order key, id)`; the head is the smallest.
#[derive(Debug, Default)]
struct Model {
    classes: Vec<Vec<((u64, u64), u64)>>,
}

impl Model {
    fn head(&self, c: usize) -> Option<u64> {
        self.classes[c].iter().min().map(|&(_, id)| id)
    }

    fn take(&mut self, id: u64) -> bool {
        for items in &mut self.classes {
            if let Some(i) = items.iter().position(|&(_, x)| x == id) {
                items.remove(i);
                return true;
            }
        }
        false
    }
}

/// Everything a `None` pop must leave alone.
fn state(q: &DrrQueue<u64>) -> (usize, bool, Vec<u64>) {
    let level = &q.levels[0];
    let deficits = level.lanes.iter().map(|l| l.deficit).collect();
    (level.cursor, level.in_turn, deficits)
}

#[test]
fn random_operations_match_the_model() {
    for seed in 0..64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(1..=4);
        let classes: Vec<PolicyClass> = (0..n)
            .map(|i| PolicyClass {
                name: format!("c{i}"),
                weight: rng.random_range(1..=500),
                max_queued: rng.random_bool(0.5).then(|| rng.random_range(0..=8)),
            })
            .collect();
        let order = order_for(seed);
        let mut q = DrrQueue::new(classes.clone(), order).unwrap();
        let mut model = Model {
            classes: vec![Vec::new(); n],
        };
        let mut tickets: Vec<(Ticket, u64)> = Vec::new();
        let mut left = HashSet::new();
        let mut next_id = 0u64;
        for step in 0..3_000 {
            match rng.random_range(0..100) {
                0..50 => {
                    let c = rng.random_range(0..=n); // n: an unknown class
                    let cost = rng.random_range(0..=2_000);
                    let id = next_id;
                    next_id += 1;
                    let got = q.push(c, id, cost);
                    if c == n {
                        assert_eq!(got, Err(QueueError::UnknownClass { class: c }));
                    } else if classes[c]
                        .max_queued
                        .is_some_and(|m| model.classes[c].len() >= m)
                    {
                        assert_eq!(got, Err(QueueError::Full { class: c }));
                    } else {
                        let rank = if order == QueueOrder::Wspt { cost } else { 0 };
                        model.classes[c].push(((rank, id), id));
                        tickets.push((got.unwrap(), id));
                    }
                }
                50..65 if !tickets.is_empty() => {
                    let (ticket, id) = tickets[rng.random_range(0..tickets.len())];
                    let live = model.take(id);
                    assert_eq!(
                        q.remove(ticket),
                        live.then_some(id),
                        "seed {seed} step {step}"
                    );
                    if live {
                        assert!(left.insert(id));
                    }
                }
                _ => {
                    let blocked: Vec<bool> = (0..n).map(|_| rng.random_bool(0.3)).collect();
                    let before = state(&q);
                    let mut asked = Vec::new();
                    let got = q.pop(|c, &id| {
                        asked.push(c);
                        assert_eq!(model.head(c), Some(id), "asked about a non-head");
                        !blocked[c]
                    });
                    let mut unique = asked.clone();
                    unique.sort();
                    unique.dedup();
                    assert_eq!(unique.len(), asked.len(), "a class asked twice");
                    match got {
                        Some((c, id)) => {
                            assert!(!blocked[c]);
                            assert_eq!(model.head(c), Some(id), "seed {seed} step {step}");
                            assert!(model.take(id) && left.insert(id));
                        }
                        None => {
                            let ready = (0..n).any(|c| !blocked[c] && model.head(c).is_some());
                            assert!(!ready, "seed {seed} step {step}: a ready class was skipped");
                            assert_eq!(before, state(&q), "a None pop changed state");
                        }
                    }
                }
            }
            let live: usize = model.classes.iter().map(Vec::len).sum();
            assert_eq!(q.len(), live);
            for c in 0..n {
                assert_eq!(q.class_len(c), model.classes[c].len());
                if model.classes[c].is_empty() {
                    assert_eq!(q.deficit(c), 0, "empty class {c} holds a deficit");
                }
            }
        }
        while let Some((c, id)) = q.pop(|_, _| true) {
            assert_eq!(model.head(c), Some(id));
            assert!(model.take(id) && left.insert(id));
        }
        assert!(q.is_empty() && model.classes.iter().all(Vec::is_empty));
        let accepted: HashSet<u64> = tickets.iter().map(|&(_, id)| id).collect();
        assert_eq!(left, accepted, "seed {seed}: lost or duplicated items");
    }
}
