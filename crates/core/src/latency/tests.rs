use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// A worker `slow` times slower than the prior's: TTFT = slow * (20 + 22 W/1000 + 8 D/100).
fn ttft(slow: f64, f: &PrefillFeatures) -> f64 {
    slow * (20.0 + 22.0 * f.tokens / 1000.0 + 8.0 * f.decoding / 100.0)
}

fn features(rng: &mut SmallRng) -> PrefillFeatures {
    PrefillFeatures {
        tokens: rng.random_range(100.0..30_000.0),
        decoding: rng.random_range(0.0..200.0),
        kv_after: rng.random_range(0.0..0.7),
        adapter_loads: 0.0,
    }
}

#[test]
fn the_prior_is_the_timing_models_engine() {
    let s = LatencyModel::default().speed();
    let f = PrefillFeatures {
        tokens: 1000.0,
        ..Default::default()
    };
    // One thousand tokens on an idle engine: ~16.5 + 15 ms in the timing model.
    let t = s.ttft_ms(&f);
    assert!((30.0..60.0).contains(&t), "{t}");
    assert_eq!(s.prefill_observations, 0);
    let step = s.step_ms(&DecodeFeatures {
        running: 10.0,
        kv_usage: 0.1,
    });
    assert!((5.0..15.0).contains(&step), "{step}");
}

#[test]
fn converges_on_noisy_synthetic_data() {
    let mut rng = SmallRng::seed_from_u64(1);
    for slow in [0.5, 1.0, 3.0] {
        let mut m = LatencyModel::default();
        for _ in 0..2000 {
            let f = features(&mut rng);
            let noise = rng.random_range(-0.05..0.05);
            m.observe_ttft(&f, ttft(slow, &f) * (1.0 + noise));
        }
        let a = m.speed().prefill;
        assert!(
            (a[1] - 22.0 * slow).abs() < 0.05 * 22.0 * slow,
            "{slow}: {a:?}"
        );
        let f = PrefillFeatures {
            tokens: 8000.0,
            decoding: 50.0,
            kv_after: 0.3,
            adapter_loads: 0.0,
        };
        let p = m.speed().ttft_ms(&f);
        assert!((p / ttft(slow, &f) - 1.0).abs() < 0.05, "{slow}: {p}");
    }
}

#[test]
fn decode_steps_converge_even_when_batch_and_memory_rise_together() {
    let mut rng = SmallRng::seed_from_u64(2);
    let mut m = LatencyModel::default();
    let mut running: f64 = 10.0;
    for i in 0..8000 {
        // A batch that drifts, its KV use following it; a third of the steps carry a
        // prefill chunk (much longer).
        running = (running + rng.random_range(-2.0..2.0)).clamp(1.0, 200.0);
        let f = DecodeFeatures {
            running,
            kv_usage: (running / 250.0 + rng.random_range(-0.02..0.02)).clamp(0.0, 1.0),
        };
        let chunk = if i % 3 == 0 {
            rng.random_range(50.0..200.0)
        } else {
            0.0
        };
        m.observe_gap(&f, 2.0 * f.reference_step_ms() + chunk);
        let b = m.speed().decode;
        assert!((0.5..10.0).contains(&b), "{i}: {b}");
    }
    // Twice as slow, plus the chunks' share on average.
    let b = m.speed().decode;
    assert!((2.0..6.0).contains(&b), "{b}");
    let f = DecodeFeatures {
        running: 50.0,
        kv_usage: 0.2,
    };
    assert!((m.speed().step_ms(&f) / f.reference_step_ms() - b).abs() < 1e-9);
}

#[test]
fn outliers_move_the_fit_little() {
    let mut rng = SmallRng::seed_from_u64(3);
    let mut clean = LatencyModel::default();
    let mut dirty = LatencyModel::default();
    for i in 0..3000 {
        let f = features(&mut rng);
        let y = ttft(1.0, &f);
        clean.observe_ttft(&f, y);
        // One in twenty is a stalled stream: a hundred times the true TTFT.
        let y = if i % 20 == 7 { 100.0 * y } else { y };
        dirty.observe_ttft(&f, y);
    }
    let f = PrefillFeatures {
        tokens: 4000.0,
        decoding: 20.0,
        kv_after: 0.2,
        adapter_loads: 0.0,
    };
    let (c, d) = (clean.speed().ttft_ms(&f), dirty.speed().ttft_ms(&f));
    assert!((d / c - 1.0).abs() < 0.15, "clean {c}, with outliers {d}");
}

#[test]
fn a_worker_that_slows_down_is_followed() {
    let mut rng = SmallRng::seed_from_u64(4);
    let mut m = LatencyModel::default();
    for _ in 0..1000 {
        let f = features(&mut rng);
        m.observe_ttft(&f, ttft(1.0, &f));
    }
    for _ in 0..1000 {
        let f = features(&mut rng);
        m.observe_ttft(&f, ttft(4.0, &f));
    }
    let a = m.speed().prefill;
    assert!((a[1] / 88.0 - 1.0).abs() < 0.1, "{a:?}");
}

#[test]
fn coefficients_stay_in_bounds() {
    let mut m = LatencyModel::default();
    let f = PrefillFeatures {
        tokens: 1000.0,
        decoding: 10.0,
        kv_after: 0.0,
        adapter_loads: 0.0,
    };
    // Negative and absurd timings, and no excitation at all.
    for i in 0..5000 {
        let y = if i % 2 == 0 { -1e9 } else { 1e12 };
        m.observe_ttft(&f, y);
        m.observe_ttft(&f, f64::NAN);
    }
    let a = m.speed().prefill;
    assert!(a.iter().all(|v| v.is_finite()), "{a:?}");
    assert!(a[1] >= 0.05 && a[1] <= 10_000.0, "{a:?}");
    assert!(a.iter().all(|&v| v >= 0.0), "{a:?}");
    assert!(m.speed().ttft_ms(&f) >= 0.0);
    // The fit still learns afterwards.
    let mut rng = SmallRng::seed_from_u64(5);
    for _ in 0..3000 {
        let f = features(&mut rng);
        m.observe_ttft(&f, ttft(1.0, &f));
    }
    let a = m.speed().prefill;
    assert!((a[1] - 22.0).abs() < 3.0, "{a:?}");
}

/// A request of `features`' shape that expects `loads` adapter loads of `load_ms` each.
fn with_loads(rng: &mut SmallRng, loads: f64) -> PrefillFeatures {
    PrefillFeatures {
        adapter_loads: loads,
        ..features(rng)
    }
}

/// Three requests in ten expect loads (one, or two where every slot is taken), the rest
/// none; each TTFT is the prefill's plus the loads', with 5% noise.
fn observe_mixed(m: &mut LatencyModel, rng: &mut SmallRng, load_ms: f64, n: usize) {
    for i in 0..n {
        let loads = match i % 10 {
            0 | 1 => 1.0,
            2 => 2.0,
            _ => 0.0,
        };
        let f = with_loads(rng, loads);
        let noise = rng.random_range(-0.05..0.05);
        m.observe_ttft(&f, ttft(1.0, &f) * (1.0 + noise) + loads * load_ms);
    }
}

#[test]
fn the_adapter_load_time_starts_at_its_prior() {
    let s = LatencyModel::default().speed();
    assert_eq!(s.adapter_load_ms, ADAPTER_LOAD_PRIOR_MS);
    assert_eq!(s.adapter_load_observations, 0);
    // A request without loads teaches the load model nothing.
    let mut m = LatencyModel::default();
    m.observe_ttft(&with_loads(&mut SmallRng::seed_from_u64(6), 0.0), 500.0);
    assert_eq!(m.speed().adapter_load_observations, 0);
}

#[test]
fn the_adapter_load_time_converges_to_the_engines() {
    let mut rng = SmallRng::seed_from_u64(7);
    for load_ms in [10.0, 200.0, 1500.0] {
        let mut m = LatencyModel::default();
        observe_mixed(&mut m, &mut rng, load_ms, 3000);
        let s = m.speed();
        assert!(
            (s.adapter_load_ms / load_ms - 1.0).abs() < 0.05
                || (s.adapter_load_ms - load_ms).abs() < 2.0,
            "{load_ms}: {}",
            s.adapter_load_ms
        );
        assert_eq!(s.adapter_load_observations, 900);
        // The loads do not leak into the prefill model.
        assert!(
            (s.prefill[1] / 22.0 - 1.0).abs() < 0.05,
            "{load_ms}: {:?}",
            s.prefill
        );
        assert!(s.prefill[0] < 40.0, "{load_ms}: {:?}", s.prefill);
    }
}

#[test]
fn speed_factors_find_each_ranks_speed_and_ignore_outliers() {
    let mut rng = SmallRng::seed_from_u64(7);
    for slow in [0.5, 1.0, 2.0] {
        let mut m = LatencyModel::default();
        for i in 0..2000 {
            let f = features(&mut rng);
            // Every 10th TTFT waited in a queue for 30 s: the median ignores it.
            let queued = if i % 10 == 0 { 30_000.0 } else { 0.0 };
            let noise = rng.random_range(0.8..1.2);
            m.observe_ttft(&f, slow * noise * dot(&PREFILL_PRIOR, &f.x()) + queued);
            let d = DecodeFeatures {
                running: rng.random_range(1.0..100.0),
                kv_usage: rng.random_range(0.0..0.9),
            };
            // Two steps in three carry a prefill chunk of up to 150 ms: the low quantile
            // reads the others.
            let chunk = if i % 3 == 0 {
                0.0
            } else {
                rng.random_range(20.0..150.0)
            };
            m.observe_gap(&d, slow * (d.reference_step_ms() + chunk));
        }
        let s = m.speed();
        let within = |got: f64| (got / slow - 1.0).abs() < 0.2;
        assert!(within(s.prefill_factor), "{slow}: {}", s.prefill_factor);
        assert!(within(s.decode_factor), "{slow}: {}", s.decode_factor);
    }
}

#[test]
fn adapter_load_outliers_move_it_little() {
    let mut rng = SmallRng::seed_from_u64(8);
    let (mut clean, mut dirty) = (LatencyModel::default(), LatencyModel::default());
    for i in 0..4000 {
        let f = with_loads(&mut rng, f64::from(u8::from(i % 3 == 0)));
        let y = ttft(1.0, &f) + 200.0 * f.adapter_loads;
        clean.observe_ttft(&f, y);
        // One load in twenty stalls: a hundred times its TTFT (or answers at once).
        let y = match i % 60 {
            0 => 100.0 * y,
            30 => 0.0,
            _ => y,
        };
        dirty.observe_ttft(&f, y);
    }
    let (c, d) = (clean.speed().adapter_load_ms, dirty.speed().adapter_load_ms);
    assert!((c / 200.0 - 1.0).abs() < 0.05, "clean {c}");
    assert!((d / c - 1.0).abs() < 0.05, "clean {c}, with outliers {d}");
}

#[test]
fn the_adapter_load_time_stays_in_its_box_and_recovers() {
    let mut rng = SmallRng::seed_from_u64(9);
    let mut m = LatencyModel::default();
    for i in 0..3000 {
        let f = with_loads(&mut rng, 1.0);
        let y = if i % 2 == 0 { -1e9 } else { 1e12 };
        m.observe_ttft(&f, y);
        m.observe_ttft(&f, f64::INFINITY);
        let c = m.speed().adapter_load_ms;
        assert!((0.0..=ADAPTER_LOAD_MAX_MS).contains(&c), "{i}: {c}");
    }
    // Timings that only fall: clamped at 0, not below.
    for _ in 0..500 {
        let f = with_loads(&mut rng, 2.0);
        m.observe_ttft(&f, 0.0);
    }
    assert_eq!(m.speed().adapter_load_ms, 0.0);
    // Sane timings again: it learns afterwards.
    observe_mixed(&mut m, &mut rng, 200.0, 6000);
    let c = m.speed().adapter_load_ms;
    assert!((c / 200.0 - 1.0).abs() < 0.05, "{c}");
}

#[test]
fn speed_factors_start_at_one_are_bounded_and_follow_a_change() {
    let mut m = LatencyModel::default();
    assert_eq!(m.speed().prefill_factor, 1.0);
    assert_eq!(m.speed().decode_factor, 1.0);
    let d = DecodeFeatures {
        running: 10.0,
        kv_usage: 0.5,
    };
    // Garbage is ignored; absurd values stop at the bound.
    for gap in [f64::NAN, -1.0, 0.0, f64::INFINITY] {
        m.observe_gap(&d, gap);
    }
    assert_eq!(m.speed().decode_factor, 1.0);
    for _ in 0..1000 {
        m.observe_gap(&d, 1e12);
    }
    assert!((m.speed().decode_factor - 3f64.exp()).abs() < 1e-9);
    // The rank recovers to twice the reference within a few hundred steps.
    for _ in 0..400 {
        m.observe_gap(&d, 2.0 * d.reference_step_ms());
    }
    assert!((m.speed().decode_factor / 2.0 - 1.0).abs() < 0.1);
}

#[test]
fn a_ranks_factor_does_not_depend_on_how_much_it_served() {
    // Twenty times faster than the reference (kvroute-sim at --speedup 20): ranks that
    // served 20, 40 and 400 requests' worth read the same speed, within the noise band.
    // Stepped from the prior, the busier rank read ~2x faster than the one that had just
    // started to count, and took the cluster's new prefixes.
    let mut rng = SmallRng::seed_from_u64(11);
    let d = DecodeFeatures {
        running: 8.0,
        kv_usage: 0.3,
    };
    let factors: Vec<(f64, f64)> = [FACTOR_WARMUP, 2 * FACTOR_WARMUP, 20 * FACTOR_WARMUP]
        .into_iter()
        .map(|n| {
            let mut m = LatencyModel::default();
            for _ in 0..n {
                let f = features(&mut rng);
                let noise = rng.random_range(0.95..1.05);
                m.observe_ttft(&f, noise * dot(&PREFILL_PRIOR, &f.x()) / 20.0);
                m.observe_gap(&d, noise * d.reference_step_ms() / 20.0);
            }
            let s = m.speed();
            (s.prefill_factor, s.decode_factor)
        })
        .collect();
    let band = crate::policy::SPEED_NOISE.exp();
    for (prefill, decode) in &factors {
        for got in [prefill, decode] {
            assert!((got * 20.0 - 1.0).abs() < 0.1, "{factors:?}");
        }
        let (p0, d0) = factors[0];
        assert!(prefill / p0 < band && p0 / prefill < band, "{factors:?}");
        assert!(decode / d0 < band && d0 / decode < band, "{factors:?}");
    }
}

#[test]
fn a_first_reading_counts_from_a_few_observations() {
    let mut rng = SmallRng::seed_from_u64(11);
    let mut m = LatencyModel::default();
    let mut factors = Vec::new();
    for _ in 0..FACTOR_WARMUP {
        let f = features(&mut rng);
        m.observe_ttft(&f, 3.0 * dot(&PREFILL_PRIOR, &f.x()));
        factors.push(m.speed().prefill_factor);
    }
    // Before FACTOR_EARLY observations the factor is the stepped one, a few steps from 1;
    // from then on, the quantile of what was seen: the rank is three times the prior.
    for (i, f) in factors.iter().enumerate() {
        let seen = i + 1;
        if seen < FACTOR_EARLY {
            assert!((f - 1.0).abs() < 0.1, "{seen}: {f}");
        } else {
            assert!((f / 3.0 - 1.0).abs() < 1e-6, "{seen}: {f}");
        }
    }
}
