//! Hashers for maps keyed by hashes. Router block hashes are XXH3 outputs, already uniform,
//! so their maps hash by identity ([`IdentityMap`]); engine hashes and composite keys go
//! through one folded multiply ([`MixMap`]), which spreads any input over all 64 bits.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Passes a single `u64` through (other writes are folded in as by [`MixHasher`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = fold(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A folded multiply per written word (as in foldhash and ahash's fallback).
#[derive(Debug, Default, Clone, Copy)]
pub struct MixHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// One folded multiply: spreads a word of any value (small ones too) over all 64 bits.
#[inline]
pub fn fold(x: u64) -> u64 {
    let m = u128::from(x ^ 0x243F_6A88_85A3_08D3) * u128::from(K);
    (m as u64) ^ ((m >> 64) as u64)
}

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = fold(self.0 ^ u64::from(b));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.0 = fold(self.0 ^ u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = fold(self.0 ^ u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = fold(self.0.rotate_left(23) ^ n);
    }
}

pub type IdentityMap<K, V> = HashMap<K, V, BuildHasherDefault<IdentityHasher>>;
pub type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn identity_passes_u64_and_mix_spreads_small_ints() {
        let id = BuildHasherDefault::<IdentityHasher>::default();
        assert_eq!(id.hash_one(0xABCDu64), 0xABCD);
        let mix = BuildHasherDefault::<MixHasher>::default();
        let (a, b) = (mix.hash_one(1u64), mix.hash_one(2u64));
        assert_ne!(a, b);
        assert!((a >> 57) != (b >> 57) || (a & 0xFFFF) != (b & 0xFFFF));
    }
}
