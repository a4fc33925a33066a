//! smg's class reservations as shares of the router queue's dispatch capacity.
//!
//! smg reserves concurrency *slots* for its higher classes: a class's reservation is
//! `max(reserved_floor, ceil(reserved_per_slot x capacity))`, capped at the capacity, and the
//! reservations are clamped to fit it highest class first (`system`, then `interactive`,
//! `default`, `bulk`), so under a shrink the lowest classes yield first. A request of one
//! class may not take what a higher class has reserved.
//!
//! kvroute's router queue has no slots: a request waits while every rank it may go to is
//! saturated with prefill ([`saturated`](super::saturated)). Here the reservations become
//! shares of that capacity. With `capacity` slots (smg's 64 per worker, counted per rank),
//! tier `t`'s share is its clamped reservation over `capacity`; a request of tier `t` sees a
//! rank saturated above `threshold x (1 - held)`, `held` being the sum of the shares of the
//! tiers above it. The top tier, and a request promoted there by starvation, sees the whole
//! threshold (smg's starvation override ignores reservations too).
//!
//! smg holds a reservation only while it is unused; the router does not count prefill by
//! class, so here the share is held whether or not the higher tier uses it: a lower class
//! is admitted less, never more, than in smg.

/// smg's slots per worker when a worker reports no `max_running_requests`.
pub const SLOTS_PER_RANK: u32 = 64;

/// Each tier's reservation (tier 0 the highest), as a share of `capacity` slots.
pub fn reserved_shares<const N: usize>(
    floor: &[u16; N],
    per_slot: &[f64; N],
    capacity: u32,
) -> [f64; N] {
    if capacity == 0 {
        return [0.0; N];
    }
    let mut remaining = capacity;
    std::array::from_fn(|i| (floor[i], per_slot[i])).map(|(floor, share)| {
        let share = (share * capacity as f64).ceil();
        let share = if share.is_finite() && share >= 0.0 {
            share.min(u32::MAX as f64) as u32
        } else {
            0
        };
        let give = u32::from(floor).max(share).min(capacity).min(remaining);
        remaining -= give;
        give as f64 / capacity as f64
    })
}

/// The fraction of the queue threshold that a request of `tier` may use: what the tiers
/// above it have not reserved.
pub fn usable_fraction(shares: &[f64], tier: usize) -> f64 {
    let held: f64 = shares.iter().take(tier).sum();
    (1.0 - held).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// smg 1.13's defaults by tier: system, interactive, default, bulk.
    const FLOOR: [u16; 4] = [32, 128, 0, 0];
    const PER_SLOT: [f64; 4] = [0.0, 0.25, 0.10, 0.0];

    #[test]
    fn reservations_are_the_floor_or_the_share_whichever_is_larger() {
        // 8 ranks: 512 slots. system 32, interactive max(128, 128), default ceil(51.2) = 52.
        let s = reserved_shares(&FLOOR, &PER_SLOT, 512);
        assert_eq!(s, [32.0 / 512.0, 128.0 / 512.0, 52.0 / 512.0, 0.0]);
        // 16 ranks: interactive's share (256) passes its floor.
        let s = reserved_shares(&FLOOR, &PER_SLOT, 1024);
        assert_eq!(s[1], 256.0 / 1024.0);
    }

    #[test]
    fn the_lowest_tiers_yield_first_when_reservations_exceed_the_capacity() {
        // One rank: 64 slots. system takes 32, interactive the 32 left, default nothing.
        let s = reserved_shares(&FLOOR, &PER_SLOT, 64);
        assert_eq!(s, [0.5, 0.5, 0.0, 0.0]);
        assert_eq!(usable_fraction(&s, 0), 1.0);
        assert_eq!(usable_fraction(&s, 1), 0.5);
        assert_eq!(
            usable_fraction(&s, 2),
            0.0,
            "default may use only idle ranks"
        );
        assert_eq!(usable_fraction(&s, 3), 0.0);
    }

    #[test]
    fn a_tier_uses_what_the_tiers_above_it_left() {
        let s = reserved_shares(&FLOOR, &PER_SLOT, 512);
        let f: Vec<f64> = (0..4).map(|t| usable_fraction(&s, t)).collect();
        assert_eq!(f[0], 1.0, "the top tier sees the whole threshold");
        assert_eq!(f[1], 1.0 - 32.0 / 512.0);
        assert_eq!(f[2], 1.0 - 160.0 / 512.0);
        assert_eq!(
            f[3],
            1.0 - 212.0 / 512.0,
            "bulk also leaves default's share"
        );
        assert!(f.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn no_reservation_or_no_capacity_holds_nothing_back() {
        let s = reserved_shares(&[0; 4], &[0.0; 4], 512);
        assert!((0..4).all(|t| usable_fraction(&s, t) == 1.0));
        let s = reserved_shares(&FLOOR, &PER_SLOT, 0);
        assert!((0..4).all(|t| usable_fraction(&s, t) == 1.0));
        // A pathological share (the file's check refuses it) reserves nothing.
        let s = reserved_shares(&[0; 2], &[f64::NAN, f64::INFINITY], 64);
        assert_eq!(s, [0.0, 0.0]);
    }
}
