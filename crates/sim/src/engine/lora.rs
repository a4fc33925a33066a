//! LoRA adapters, as vLLM v1 serves them.
//!
//! The engine has `max_loras` adapter slots on the device. A forward pass may only run
//! requests of at most `max_loras` distinct adapters: when the running batch already uses
//! that many, a waiting request of another adapter is skipped (it keeps its place in the
//! queue; requests behind it may be admitted), as vLLM's scheduler does. Before a step runs,
//! every adapter of its batch that is not resident is loaded into a slot, evicting the least
//! recently used adapter that the batch does not use; each load adds `load_time` to the
//! step. Requests without an adapter (the base model) take no slot.

use std::time::Duration;

/// An adapter's id within an engine (vLLM's `lora_int_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LoraId(pub u32);

/// How the engine serves adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraConfig {
    /// Adapter slots on the device (vLLM's `--max-loras`, at least 1).
    pub max_loras: usize,
    /// The time to load an adapter into a slot, added to the step that needs it.
    pub load_time: Duration,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            max_loras: 1,
            load_time: Duration::ZERO,
        }
    }
}

/// The adapters an engine runs, waits for and holds, as its `vllm:lora_requests_info`
/// gauge and its loader see them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraState {
    /// Distinct adapters of the running requests, ascending.
    pub running: Vec<LoraId>,
    /// Distinct adapters of the waiting requests, ascending.
    pub waiting: Vec<LoraId>,
    /// Adapters resident in the device slots, ascending.
    pub resident: Vec<LoraId>,
    pub max_loras: usize,
}

/// The device slots: resident adapters with the step that last used each.
#[derive(Debug, Clone, Default)]
pub(super) struct LoraSlots {
    resident: Vec<(LoraId, u64)>,
    steps: u64,
    /// Adapters loaded so far.
    pub(super) loads: u64,
}

impl LoraSlots {
    pub(super) fn resident(&self) -> Vec<LoraId> {
        let mut ids: Vec<LoraId> = self.resident.iter().map(|&(id, _)| id).collect();
        ids.sort_unstable();
        ids
    }

    /// Makes every adapter of `batch` (distinct, at most `max_loras`) resident, least
    /// recently used idle adapters evicted first; returns how many it loaded.
    pub(super) fn activate(&mut self, batch: &[LoraId], max_loras: usize) -> u64 {
        self.steps += 1;
        let step = self.steps;
        let mut loaded = 0;
        for &id in batch {
            if let Some(slot) = self.resident.iter_mut().find(|(r, _)| *r == id) {
                slot.1 = step;
                continue;
            }
            if self.resident.len() >= max_loras.max(1) {
                // The LRU adapter this step does not use (the batch fits the slots).
                let victim = self
                    .resident
                    .iter()
                    .enumerate()
                    .filter(|(_, (r, _))| !batch.contains(r))
                    .min_by_key(|(_, &(_, used))| used)
                    .map(|(i, _)| i);
                match victim {
                    Some(i) => {
                        self.resident.swap_remove(i);
                    }
                    None => continue,
                }
            }
            self.resident.push((id, step));
            loaded += 1;
        }
        self.loads += loaded;
        loaded
    }
}

impl super::EngineCore {
    /// The adapters it runs, waits for and holds (`vllm:lora_requests_info`).
    pub fn lora_state(&self) -> LoraState {
        let waiting = self
            .waiting
            .iter()
            .chain(self.receiving.iter().map(|r| &r.seq));
        LoraState {
            running: distinct(self.running.iter().map(|s| s.lora)),
            waiting: distinct(waiting.map(|s| s.lora)),
            resident: self.loras.resident(),
            max_loras: self.config.lora.max_loras,
        }
    }

    /// Whether a request of adapter `lora` may join the running batch: the base model always
    /// may, an adapter when the batch uses it or uses fewer than `max_loras` adapters.
    pub(super) fn lora_fits(&self, lora: Option<LoraId>) -> bool {
        let Some(id) = lora else { return true };
        let used = distinct(self.running.iter().map(|s| s.lora));
        used.contains(&id) || used.len() < self.config.lora.max_loras.max(1)
    }
}

/// Distinct adapters of `loras`, ascending.
pub(super) fn distinct(loras: impl Iterator<Item = Option<LoraId>>) -> Vec<LoraId> {
    let mut ids: Vec<LoraId> = loras.flatten().collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_evict_the_least_recently_used_idle_adapter() {
        let mut slots = LoraSlots::default();
        assert_eq!(slots.activate(&[LoraId(1), LoraId(2)], 2), 2);
        assert_eq!(slots.activate(&[LoraId(1)], 2), 0);
        // 2 is the LRU: 3 takes its slot.
        assert_eq!(slots.activate(&[LoraId(3)], 2), 1);
        assert_eq!(slots.resident(), [LoraId(1), LoraId(3)]);
        // An adapter of the batch is never evicted: 1 and 3 both run, 1 is older.
        assert_eq!(slots.activate(&[LoraId(3), LoraId(1)], 2), 0);
        assert_eq!(slots.loads, 3);
    }
}
