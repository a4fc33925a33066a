//! Seeded property tests: fairness, no starvation, no credit while blocked, and a
//! differential test against a simple model.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

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

/// A queued request as the sharing model sees it.
#[derive(Debug, Clone)]
struct Held {
    id: u64,
    tier: usize,
    class: usize,
    tenant: &'static str,
    key: (u64, u64),
    time: Duration,
}

/// The O(n) model of tiers, starvation and VTC: a flat list of requests and each class's
/// counters, never forgetting a tenant.
struct SharingModel {
    held: Vec<Held>,
    counters: Vec<BTreeMap<&'static str, f64>>,
    floor: Vec<f64>,
    latest: Duration,
    starvation: Vec<Option<Duration>>,
    cfg: VtcConfig,
}

impl SharingModel {
    fn weight(&self, tenant: &str) -> f64 {
        self.cfg.tenant_weights.get(tenant).copied().unwrap_or(1.0)
    }

    fn backlogged(&self, c: usize, u: &str) -> bool {
        self.held.iter().any(|h| h.class == c && h.tenant == u)
    }

    fn virtual_time(&self, c: usize) -> f64 {
        let min = (self.counters[c].iter())
            .filter(|(u, _)| self.backlogged(c, u))
            .map(|(_, &x)| x)
            .reduce(f64::min);
        min.map_or(self.floor[c], |m| m.max(self.floor[c]))
    }

    fn counter(&self, c: usize, u: &str) -> f64 {
        let own = self.counters[c].get(u).copied();
        if self.backlogged(c, u) {
            return own.expect("a backlogged tenant has a counter");
        }
        let v = self.virtual_time(c);
        own.map_or(v, |x| x.max(v))
    }

    fn push(&mut self, h: Held) {
        let lifted = self.counter(h.class, h.tenant);
        self.counters[h.class].insert(h.tenant, lifted);
        self.held.push(h);
    }

    /// `id` leaves, its tenant charged `served`.
    fn leave(&mut self, id: u64, served: f64) -> Option<Held> {
        let i = self.held.iter().position(|h| h.id == id)?;
        let h = self.held.remove(i);
        let (c, u) = (h.class, h.tenant);
        *self.counters[c].get_mut(u).expect("counted") += served;
        if !self.backlogged(c, u) {
            let others = (self.counters[c].iter())
                .filter(|(v, _)| self.backlogged(c, v))
                .map(|(_, &x)| x)
                .reduce(f64::min);
            self.floor[c] = self.floor[c].max(others.unwrap_or(self.counters[c][u]));
        }
        Some(h)
    }

    fn charge(&mut self, c: usize, u: &'static str, tokens: u64) {
        let amount = self.cfg.output_weight * tokens as f64 / self.weight(u);
        let base = self.counter(c, u);
        self.counters[c].insert(u, base + amount);
    }

    fn promote(&mut self, now: Duration) {
        for h in &mut self.held {
            if h.tier > 0 && self.starvation[h.tier].is_some_and(|s| now.saturating_sub(h.time) > s)
            {
                h.tier = 0;
            }
        }
    }

    /// The head of a lane: the first request of the tenant with the lowest counter, the
    /// earlier first arrival among equals.
    fn head(&self, t: usize, c: usize) -> Option<&Held> {
        let lane = || self.held.iter().filter(|h| h.tier == t && h.class == c);
        let first_of = |u: &str| lane().filter(|h| h.tenant == u).min_by_key(|h| h.key);
        lane().filter_map(|h| first_of(h.tenant)).min_by(|a, b| {
            let (ca, cb) = (self.counter(c, a.tenant), self.counter(c, b.tenant));
            ca.total_cmp(&cb).then(a.key.1.cmp(&b.key.1))
        })
    }
}

const TENANTS: [&str; 4] = ["auth:a", "auth:b", "ip:10.0.0.1", "anonymous"];

fn random_sharing(rng: &mut StdRng) -> Sharing {
    let thresholds = [0, 1, 2, 3].map(|_| {
        rng.random_bool(0.6)
            .then(|| Duration::from_millis(rng.random_range(0..2_000)))
    });
    let mut cfg = VtcConfig {
        output_weight: [1.0, 2.0, 0.5][rng.random_range(0..3)],
        ..VtcConfig::default()
    };
    for u in TENANTS {
        if rng.random_bool(0.3) {
            cfg.tenant_weights
                .insert(u.into(), [0.5, 2.0, 3.0][rng.random_range(0..3)]);
        }
    }
    Sharing::smg(thresholds, Fairness::Vtc(cfg))
}

#[test]
fn random_sharing_operations_match_the_model() {
    for seed in 0..32 {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(1..=3);
        let classes: Vec<PolicyClass> = (0..n)
            .map(|i| PolicyClass {
                name: format!("c{i}"),
                weight: rng.random_range(1..=500),
                max_queued: None,
            })
            .collect();
        let sharing = random_sharing(&mut rng);
        let Fairness::Vtc(cfg) = sharing.fairness.clone() else {
            unreachable!()
        };
        let order = order_for(seed);
        let mut q = DrrQueue::with_sharing(classes, order, sharing.clone()).unwrap();
        let mut m = SharingModel {
            held: Vec::new(),
            counters: vec![BTreeMap::new(); n],
            floor: vec![0.0; n],
            latest: Duration::ZERO,
            starvation: sharing.tiers.iter().map(|t| t.starvation).collect(),
            cfg,
        };
        let mut tickets = Vec::new();
        let mut clock = Duration::ZERO;
        for step in 0..2_000u64 {
            // Mostly forward, sometimes a little back (pushes then count at the latest time).
            clock = (clock + Duration::from_millis(rng.random_range(0..60)))
                .saturating_sub(Duration::from_millis(rng.random_range(0..5)));
            let ctx = format!("seed {seed} step {step}");
            match rng.random_range(0..100) {
                0..45 => {
                    let (c, tier) = (rng.random_range(0..n), rng.random_range(0..4));
                    let tenant = TENANTS[rng.random_range(0..TENANTS.len())];
                    let cost = rng.random_range(0..2_000);
                    let arrival = Arrival {
                        class: c,
                        tier,
                        tenant,
                        cost,
                        now: clock,
                        head_start: Duration::ZERO,
                    };
                    let ticket = q.push_with(&arrival, step).unwrap();
                    m.latest = m.latest.max(clock);
                    let rank = if order == QueueOrder::Wspt { cost } else { 0 };
                    let (id, time) = (step, m.latest);
                    m.push(Held {
                        id,
                        tier,
                        class: c,
                        tenant,
                        key: (rank, step),
                        time,
                    });
                    tickets.push((ticket, cost, step));
                }
                45..55 if !tickets.is_empty() => {
                    let (ticket, _, id) = tickets[rng.random_range(0..tickets.len())];
                    let live = m.leave(id, 0.0).map(|h| h.id);
                    assert_eq!(q.remove(ticket), live, "{ctx}");
                }
                55..65 => {
                    let (c, u) = (rng.random_range(0..n), TENANTS[rng.random_range(0..4)]);
                    let tokens = rng.random_range(0..300);
                    q.charge(c, u, tokens);
                    m.charge(c, u, tokens);
                }
                _ => pop_and_check(&mut q, &mut m, &tickets, n, clock, &mut rng, &ctx),
            }
            assert_agrees(&q, &m, n, &ctx);
        }
    }
}

/// A pop with one class, and maybe the odd-numbered requests, blocked: the queue's pick must
/// be the model's first ready head, in the highest tier that has one; the pick is charged.
fn pop_and_check(
    q: &mut DrrQueue<u64>,
    m: &mut SharingModel,
    tickets: &[(Ticket, u64, u64)],
    n: usize,
    clock: Duration,
    rng: &mut StdRng,
    ctx: &str,
) {
    let blocked_class = rng.random_range(0..=n); // n: none
    let odd_blocked = rng.random_bool(0.3);
    let ready = |c: usize, id: u64| c != blocked_class && !(odd_blocked && id % 2 == 1);
    m.latest = m.latest.max(clock);
    m.promote(m.latest);
    let heads: Vec<(usize, usize, u64)> = (0..4)
        .flat_map(|t| (0..n).map(move |c| (t, c)))
        .filter_map(|(t, c)| m.head(t, c).map(|h| (t, c, h.id)))
        .collect();
    let got = q.pop_at(clock, |c, &id| {
        assert!(
            heads.contains(&(heads_tier(&heads, c, id), c, id)),
            "{ctx}: asked about a non-head"
        );
        ready(c, id)
    });
    let first_ready = heads.iter().find(|&&(_, c, id)| ready(c, id)).map(|h| h.0);
    match got {
        Some((c, id)) => {
            let &(t, _, _) = heads.iter().find(|h| h.2 == id).expect("a head");
            assert_eq!(Some(t), first_ready, "{ctx}: a higher tier was ready");
            assert!(ready(c, id));
            let cost = tickets.iter().find(|t| t.2 == id).unwrap().1;
            let tenant = m.held.iter().find(|h| h.id == id).unwrap().tenant;
            let served = cost as f64 / m.weight(tenant);
            m.leave(id, served).expect("live");
        }
        None => assert_eq!(first_ready, None, "{ctx}: a ready head was skipped"),
    }
}

/// The queue and the model hold the same requests in the same lanes, with the same counters.
fn assert_agrees(q: &DrrQueue<u64>, m: &SharingModel, n: usize, ctx: &str) {
    assert_eq!(q.len(), m.held.len(), "{ctx}");
    for c in 0..n {
        for u in TENANTS {
            assert_eq!(
                q.counter(c, u),
                m.counter(c, u),
                "{ctx}: class {c} tenant {u}"
            );
        }
        for t in 0..4 {
            let live = m
                .held
                .iter()
                .filter(|h| h.tier == t && h.class == c)
                .count();
            assert_eq!(q.lane_len(t, c), live, "{ctx}: lane ({t}, {c})");
        }
        assert!(q.known_tenants(c) <= TENANTS.len());
    }
}

/// The tier of the head `id` of class `c` in `heads` (`usize::MAX` when it is none).
fn heads_tier(heads: &[(usize, usize, u64)], c: usize, id: u64) -> usize {
    heads
        .iter()
        .find(|h| h.1 == c && h.2 == id)
        .map_or(usize::MAX, |h| h.0)
}
