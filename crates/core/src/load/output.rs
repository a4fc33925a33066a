//! Output blocks (`--router-track-output-blocks`, Dynamo's semantics): a request's KV grows
//! as it generates, and with an expected output length its exclusive blocks fade out.
//!
//! A request of `I` prompt tokens holds `ceil(I / B)` blocks when routed (its full blocks by
//! hash, its partial last block as its own). Each time `I + g` (g: tokens generated so far)
//! needs another block, `ceil((I + g) / B)` grows and the rank counts one more *output block*,
//! held by this request only. Without an expected output length every block weighs 1.
//!
//! With an expected output length `osl` (`nvext.agent_hints.osl`; Dynamo reads no other field,
//! not `max_tokens`), each time an output block is added the request's *exclusive* blocks all
//! take the weight
//!
//! ```text
//! w = max(0, 1 - g / max(osl, 1))
//! ```
//!
//! the share of its expected output still to come: a request near its end is about to free
//! them. Its exclusive blocks are its output blocks, its own partial prompt block and the
//! trailing run of its prompt blocks that no other active request on the rank holds (hashes
//! are chained, so what others share is a leading run). Blocks shared with another request
//! keep their full weight. A prompt block keeps its weight until the last request holding it
//! ends, as Dynamo's block tracker keeps it on its tree's node; a later request that shares a
//! decayed block does not restore it. The rank's decode blocks are the weighted sum, rounded.

/// One request's output-block progress, carried in its [`super::RequestLoad`].
#[derive(Debug, Clone, PartialEq)]
pub struct OutputBlocks {
    block_size: u64,
    prompt_tokens: u64,
    generated: u64,
    expected: Option<u64>,
    /// Output blocks counted on the rank.
    blocks: u64,
    /// The weight of each of its exclusive blocks (1 until an expected length decays it).
    weight: f64,
}

/// A change to apply to the rank: `added` output blocks, the request's exclusive weight
/// going from `from` to `to`, and whether its exclusive prompt suffix takes `to`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputStep {
    pub added: u64,
    /// Output blocks before this step.
    pub before: u64,
    pub from: f64,
    pub to: f64,
    pub decays: bool,
}

/// Dynamo's decay fraction: the share of the expected output still to come, `g` tokens in.
pub fn decay_fraction(generated: u64, expected: u64) -> f64 {
    (1.0 - generated as f64 / expected.max(1) as f64).max(0.0)
}

impl OutputBlocks {
    /// A request of `prompt_tokens` that expects `expected` output tokens, if it said so.
    pub fn new(prompt_tokens: usize, block_size: usize, expected: Option<u32>) -> Self {
        Self {
            block_size: block_size.max(1) as u64,
            prompt_tokens: prompt_tokens as u64,
            generated: 0,
            expected: expected.map(u64::from),
            blocks: 0,
            weight: 1.0,
        }
    }

    /// Output blocks counted so far.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The weight of the request's exclusive blocks now.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// `tokens` more were generated: the change to the rank, when another block is needed.
    pub fn advance(&mut self, tokens: u64) -> Option<OutputStep> {
        self.generated += tokens;
        let bs = self.block_size;
        let now = (self.prompt_tokens + self.generated).div_ceil(bs);
        let held = self.prompt_tokens.div_ceil(bs) + self.blocks;
        if now <= held {
            return None;
        }
        let from = self.weight;
        if let Some(osl) = self.expected {
            self.weight = decay_fraction(self.generated, osl);
        }
        let step = OutputStep {
            added: now - held,
            before: self.blocks,
            from,
            to: self.weight,
            decays: self.expected.is_some(),
        };
        self.blocks += step.added;
        Some(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_each_time_the_sequence_needs_one() {
        // 20 prompt tokens in blocks of 16: two blocks held; the 13th token starts a third.
        let mut o = OutputBlocks::new(20, 16, None);
        assert_eq!(o.advance(12), None);
        let step = o.advance(1).expect("block 3");
        assert_eq!((step.added, step.before, step.decays), (1, 0, false));
        assert_eq!((step.from, step.to), (1.0, 1.0));
        assert_eq!(o.advance(15), None);
        // Tokens that arrive together past two boundaries count both blocks.
        assert_eq!(o.advance(32).map(|s| (s.added, s.before)), Some((2, 1)));
        assert_eq!(o.blocks(), 3);
        // A prompt of whole blocks: the first token needs a new one.
        let mut o = OutputBlocks::new(32, 16, None);
        assert_eq!(o.advance(1).map(|s| s.added), Some(1));
    }

    #[test]
    fn the_weight_is_the_share_of_the_expected_output_to_come() {
        assert_eq!(decay_fraction(0, 100), 1.0);
        assert_eq!(decay_fraction(25, 100), 0.75);
        assert_eq!(
            decay_fraction(150, 100),
            0.0,
            "past its estimate: nothing left"
        );
        assert_eq!(decay_fraction(3, 0), 0.0, "osl 0 counts as 1");
        let mut o = OutputBlocks::new(16, 16, Some(64));
        let step = o.advance(1).expect("a block");
        assert!(step.decays);
        assert_eq!((step.from, step.to), (1.0, 1.0 - 1.0 / 64.0));
        let step = o.advance(16).expect("another");
        assert_eq!((step.from, step.to), (1.0 - 1.0 / 64.0, 1.0 - 17.0 / 64.0));
        // Between boundaries the weight stays (Dynamo decays only as a block is added).
        assert_eq!(o.advance(10), None);
        assert_eq!(o.weight(), 1.0 - 17.0 / 64.0);
    }
}
