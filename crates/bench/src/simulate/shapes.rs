//! Heterogeneous clusters: each engine's speed and KV capacity (`--worker-speed`,
//! `--num-gpu-blocks`, each a list with one value per engine, or one value for all).
//!
//! Engine `i`'s step times are divided by `speed[i]` (on top of the timing model's
//! `speedup`), and it has `num_gpu_blocks[i]` KV blocks. The router is told the capacities
//! (as the gateway reads `vllm:cache_config_info`), never the speeds: a policy that uses
//! speed must learn it from the timings it observes. With `--router-told-speeds` it is told
//! them instead ([`EngineShapes::told`]): how far learning them is from knowing them.

use kvroute_sim::engine::EngineConfig;

/// Per-engine overrides of the base engine configuration (empty: all as the base).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineShapes {
    /// A factor per engine, or one for all.
    pub speed: Vec<f64>,
    /// KV blocks per engine, or one count for all.
    pub num_gpu_blocks: Vec<usize>,
    /// Whether the router is told each engine's speed instead of learning it
    /// (`--router-told-speeds`; see [`Self::told_speeds`]).
    pub told: bool,
}

/// A list whose length does not fit the cluster, or a value out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidShapes {
    #[error("--{flag} has {given} values for {engines} engines (give one, or one per engine)")]
    Length {
        flag: &'static str,
        given: usize,
        engines: usize,
    },
    #[error("--worker-speed values must be finite and > 0, got {0}")]
    Speed(f64),
    #[error("--num-gpu-blocks values must be at least 1")]
    Blocks,
}

fn pick<T: Copy>(list: &[T], i: usize) -> Option<T> {
    match list {
        [] => None,
        [one] => Some(*one),
        many => many.get(i).copied(),
    }
}

impl EngineShapes {
    /// Whether every engine is the base's.
    pub fn is_uniform(&self) -> bool {
        self.speed.iter().all(|&s| s == 1.0) && self.num_gpu_blocks.len() <= 1
    }

    /// Checks the lists against a cluster of `engines`.
    pub fn validate(&self, engines: usize) -> Result<(), InvalidShapes> {
        for (flag, given) in [
            ("worker-speed", self.speed.len()),
            ("num-gpu-blocks", self.num_gpu_blocks.len()),
        ] {
            if given > 1 && given != engines {
                return Err(InvalidShapes::Length {
                    flag,
                    given,
                    engines,
                });
            }
        }
        if let Some(&s) = self.speed.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(InvalidShapes::Speed(s));
        }
        if self.num_gpu_blocks.contains(&0) {
            return Err(InvalidShapes::Blocks);
        }
        Ok(())
    }

    /// Engine `i`'s configuration from `base`.
    pub fn engine(&self, i: usize, base: &EngineConfig) -> EngineConfig {
        let mut e = base.clone();
        if let Some(s) = pick(&self.speed, i) {
            e.timing.speedup *= s;
        }
        if let Some(n) = pick(&self.num_gpu_blocks, i) {
            e.num_gpu_blocks = n;
        }
        e
    }

    /// What the router is told of each of `engines` engines' speed: its factor (1 where
    /// `speed` gives none), or nothing when it learns them (`told` off).
    pub fn told_speeds(&self, engines: usize) -> Option<Vec<f64>> {
        self.told.then(|| {
            (0..engines)
                .map(|i| pick(&self.speed, i).unwrap_or(1.0))
                .collect()
        })
    }

    /// The KV blocks of each of `engines` engines.
    pub fn capacities(&self, engines: usize, base: &EngineConfig) -> Vec<u64> {
        (0..engines)
            .map(|i| self.engine(i, base).num_gpu_blocks as u64)
            .collect()
    }

    /// `speeds 1,1,2 x blocks 8192,16384,...` for titles, empty when uniform.
    pub fn describe(&self) -> String {
        let list = |v: Vec<String>| v.join(",");
        let mut parts = Vec::new();
        if !self.speed.is_empty() {
            parts.push(format!(
                "speeds {}",
                list(self.speed.iter().map(|s| s.to_string()).collect())
            ));
        }
        if !self.num_gpu_blocks.is_empty() {
            parts.push(format!(
                "blocks {}",
                list(self.num_gpu_blocks.iter().map(|s| s.to_string()).collect())
            ));
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_applies_to_all_and_a_list_to_each() {
        let base = EngineConfig::default();
        let s = EngineShapes {
            speed: vec![2.0],
            num_gpu_blocks: vec![100, 200, 300],
            told: true,
        };
        assert_eq!(s.validate(3), Ok(()));
        assert_eq!(s.engine(1, &base).timing.speedup, 2.0);
        assert_eq!(s.engine(2, &base).num_gpu_blocks, 300);
        assert_eq!(s.capacities(3, &base), vec![100, 200, 300]);
        assert_eq!(s.told_speeds(3), Some(vec![2.0, 2.0, 2.0]));
        assert_eq!(EngineShapes::default().told_speeds(2), None);
        let told = EngineShapes {
            told: true,
            ..Default::default()
        };
        assert_eq!(told.told_speeds(2), Some(vec![1.0, 1.0]));
        assert_eq!(
            EngineShapes::default().engine(5, &base).num_gpu_blocks,
            base.num_gpu_blocks
        );
    }

    #[test]
    fn bad_lists_are_refused_with_the_flag() {
        let s = EngineShapes {
            speed: vec![1.0, 2.0],
            ..Default::default()
        };
        let e = s.validate(3).unwrap_err();
        assert!(e
            .to_string()
            .contains("--worker-speed has 2 values for 3 engines"));
        let s = EngineShapes {
            speed: vec![0.0],
            ..Default::default()
        };
        assert_eq!(s.validate(3), Err(InvalidShapes::Speed(0.0)));
        let s = EngineShapes {
            num_gpu_blocks: vec![0],
            ..Default::default()
        };
        assert_eq!(s.validate(1), Err(InvalidShapes::Blocks));
    }
}
