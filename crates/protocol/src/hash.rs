//! The one stable 64-bit hash of kvroute: XXH3-64 with seed 0.
//!
//! Used for routing keys (session keys, prompt prefixes), ring points and worker ids.
//! It must never change: router replicas and persisted rings depend on it, and the golden
//! values in the tests pin it.

use xxhash_rust::xxh3::xxh3_64;

/// XXH3-64 (seed 0) of `bytes`. Inline, so that a caller hashing a length known when compiling
/// (the index's block hashes) gets XXH3's path for that length without its tests.
#[inline]
pub fn stable_hash(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Combines two 64-bit values into a well-mixed one (splitmix64's finaliser over `a ^ rot(b)`).
/// Used for rendezvous scores `mix64(key, worker)`, which must not be symmetric.
pub fn mix64(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.rotate_left(29).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_values_never_change() {
        // XXH3-64 reference values (seed 0).
        assert_eq!(stable_hash(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(stable_hash(b"a"), 0xE6C6_32B6_1E96_4E1F);
        assert_eq!(mix64(1, 2), mix64(1, 2));
        assert_ne!(mix64(1, 2), mix64(2, 1));
    }
}
