//! What the index remembers of one engine block of one replica.

use crate::{BlockHash, EngineHash};

/// One engine block of one replica: the router blocks it maps to, and the tiers holding it
/// (24 bytes).
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) kind: Kind,
    /// `stamp << 4 | tiers`: when it was last stored (a global counter, for the capacity
    /// bound), and bit `t` set when held in tier `t`.
    meta: u64,
}

impl Record {
    pub(crate) fn new(kind: Kind, stamp: u64, tiers: u8) -> Self {
        Self {
            kind,
            meta: stamp << 4 | u64::from(tiers),
        }
    }

    pub(crate) fn tiers(&self) -> u8 {
        (self.meta & 0xF) as u8
    }

    pub(crate) fn set_tiers(&mut self, tiers: u8) {
        self.meta = self.meta & !0xF | u64::from(tiers);
    }

    pub(crate) fn stamp(&self) -> u64 {
        self.meta >> 4
    }

    pub(crate) fn set_stamp(&mut self, stamp: u64) {
        self.meta = stamp << 4 | self.meta & 0xF;
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Engine block size equal to the router's: one router block.
    One(BlockHash),
    /// Engine block size `k` times the router's: `k` router blocks, in chain order (boxed
    /// twice to keep `Kind` at 16 bytes: this case is the rare one).
    Many(Box<Box<[BlockHash]>>),
    /// Engine block size a `1/k` of the router's: a piece of a router block.
    Part(Box<Part>),
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Part {
    /// The engine block before this one (the walk back through a partial router block).
    pub(crate) parent: Option<EngineHash>,
    /// The router block before this block's router block (`None`: the sequence's first).
    pub(crate) base: Option<BlockHash>,
    /// Tokens of this block's router block up to and including this block.
    pub(crate) filled: u32,
    /// This block's tokens while its router block is partial (empty once it completes it).
    pub(crate) tokens: Box<[u32]>,
    /// The router block this block completes, if it is the last piece of one.
    pub(crate) own: Option<BlockHash>,
    /// Router blocks completed later through this block (it is an earlier piece of them).
    /// Not part of the mapping's identity.
    pub(crate) members_of: Vec<BlockHash>,
}

/// Where a chain stands after a block: the last complete router block, and how many tokens
/// of the next router block are already filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Basis {
    pub(crate) base: Option<BlockHash>,
    pub(crate) filled: u32,
}

impl Kind {
    /// The router blocks this engine block stores (a holding is counted for each).
    pub(crate) fn own(&self) -> &[BlockHash] {
        match self {
            Kind::One(block) => std::slice::from_ref(block),
            Kind::Many(blocks) => blocks,
            Kind::Part(part) => part.own.as_slice(),
        }
    }

    /// The router blocks its removal removes: its own and those it is an earlier piece of.
    pub(crate) fn covered(&self) -> impl Iterator<Item = BlockHash> + '_ {
        let members: &[BlockHash] = match self {
            Kind::Part(part) => &part.members_of,
            _ => &[],
        };
        self.own().iter().chain(members).copied()
    }

    /// Whether `self` and `other` map the engine block the same way.
    pub(crate) fn same_mapping(&self, other: &Kind) -> bool {
        match (self, other) {
            (Kind::Part(a), Kind::Part(b)) => {
                a.parent == b.parent
                    && a.base == b.base
                    && a.filled == b.filled
                    && a.tokens == b.tokens
                    && a.own == b.own
            }
            (a, b) => a == b,
        }
    }

    pub(crate) fn basis(&self) -> Basis {
        match self {
            Kind::One(block) => Basis {
                base: Some(*block),
                filled: 0,
            },
            Kind::Many(blocks) => Basis {
                base: blocks.last().copied(),
                filled: 0,
            },
            Kind::Part(part) => match part.own {
                Some(block) => Basis {
                    base: Some(block),
                    filled: 0,
                },
                None => Basis {
                    base: part.base,
                    filled: part.filled,
                },
            },
        }
    }

    /// Heap bytes behind this value.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Kind::One(_) => 0,
            Kind::Many(blocks) => 16 + std::mem::size_of_val::<[BlockHash]>(blocks),
            Kind::Part(part) => {
                std::mem::size_of::<Part>()
                    + std::mem::size_of_val::<[u32]>(&part.tokens)
                    + part.members_of.capacity() * std::mem::size_of::<BlockHash>()
            }
        }
    }
}

/// Iterates the tier indices set in `tiers`.
pub(crate) fn tier_bits(tiers: u8) -> impl Iterator<Item = usize> {
    (0..4).filter(move |t| tiers & (1 << t) != 0)
}
