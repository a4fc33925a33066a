//! The index's maps: router block hashes by identity, other keys mixed (see
//! [`kvroute_protocol::hashers`]), and their heap size.

pub(crate) use kvroute_protocol::hashers::{fold as mix, IdentityMap, MixMap};

/// Heap bytes of a hash map of `capacity` (hashbrown: power-of-two buckets at 7/8 load, one
/// control byte per bucket plus a group's worth).
pub(crate) fn map_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(K, V)>() + 1) + 16
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn map_bytes_matches_hashbrown_growth() {
        assert_eq!(map_bytes::<u64, u64>(0), 0);
        let m: HashMap<u64, u64> = HashMap::with_capacity(1000);
        // 1000 / (7/8) → 2048 buckets of 17 bytes.
        assert_eq!(map_bytes::<u64, u64>(m.capacity()), 2048 * 17 + 16);
    }
}
