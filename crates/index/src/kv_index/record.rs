//! How an engine block of one replica maps to router blocks ([`Kind`]; the record holding
//! it is [`Record`](super::records::Record)).

use std::sync::Arc;

use crate::{BlockHash, EngineHash};

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Engine block size equal to the router's: one router block (its record keeps the
    /// block's place in the table, where it stays while held; see `BlockTable::inc`).
    One(BlockHash),
    /// Engine block size `k` times the router's: `k` router blocks, in chain order (boxed
    /// twice to keep `Kind` at 16 bytes: this case is the rare one).
    Many(Box<Box<[BlockHash]>>),
    /// Engine block size a `1/k` of the router's: a piece of a router block.
    Part(Box<Part>),
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Part {
    /// The engine block before this one (part of the mapping's identity).
    pub(crate) parent: Option<EngineHash>,
    /// The router block before this block's router block (`None`: the sequence's first).
    pub(crate) base: Option<BlockHash>,
    /// Tokens of this block's router block up to and including this block.
    pub(crate) filled: u32,
    /// This block's tokens.
    pub(crate) size: u32,
    /// Pieces of this block's router block up to and including this block.
    pub(crate) members: u32,
    /// While its router block is partial, that block as it stood when this piece was stored
    /// (its first `filled` tokens and `members` pieces, this piece's own in the last node);
    /// `None` once this piece completes it. A child continues from these immutable nodes,
    /// never from the other pieces' current records, which may have been stored again
    /// differently since.
    pub(crate) tail: Option<Arc<Tail>>,
    /// The router block this block completes, if it is the last piece of one.
    pub(crate) own: Option<BlockHash>,
    /// Router blocks completed later through this block (it is an earlier piece of them).
    /// Not part of the mapping's identity.
    pub(crate) members_of: Vec<BlockHash>,
}

impl Part {
    /// Writes the partial router block up to and including this piece (its tokens and
    /// pieces) into `tokens` and `members`, which must be empty; nothing once this piece
    /// completes its router block.
    pub(crate) fn partial_into(&self, tokens: &mut Vec<u32>, members: &mut Vec<EngineHash>) {
        let Some(mut node) = self.tail.as_deref() else {
            return;
        };
        let (mut filled, mut count) = (self.filled as usize, self.members as usize);
        tokens.resize(filled, 0);
        members.resize(count, EngineHash(0));
        loop {
            let (from, first) = (node.filled_before as usize, node.members_before as usize);
            tokens[from..filled].copy_from_slice(&node.tokens[..filled - from]);
            members[first..count].copy_from_slice(&node.members[..count - first]);
            match node.before.as_deref() {
                Some(before) => (node, filled, count) = (before, from, first),
                None => break,
            }
        }
    }

    /// This block's own tokens while its router block is partial (empty once it completes
    /// it).
    fn tokens(&self) -> &[u32] {
        match self.tail.as_deref() {
            Some(node) => {
                let end = (self.filled - node.filled_before) as usize;
                &node.tokens[end - self.size as usize..end]
            }
            None => &[],
        }
    }
}

/// The pieces one event added to a partial router block, shared by those pieces, after what
/// the block held before the event (`before`, the parent's node, of which the first
/// `filled_before` tokens and `members_before` pieces). Immutable, so a piece's view of its
/// router block never changes; a block of `k` pieces stored by `j` events costs `j` nodes and
/// one copy of its tokens and pieces, never a copy per piece.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Tail {
    pub(crate) before: Option<Arc<Tail>>,
    pub(crate) filled_before: u32,
    pub(crate) members_before: u32,
    /// Pieces sharing the node (the heap estimate charges each its share).
    pub(crate) sharers: u32,
    pub(crate) tokens: Box<[u32]>,
    pub(crate) members: Box<[EngineHash]>,
}

impl Tail {
    /// Heap bytes of one sharer's share of this node (nodes kept alive only by a later node,
    /// after their own pieces were stored again differently, are not counted).
    fn share_bytes(&self) -> usize {
        let total = 2 * std::mem::size_of::<usize>()
            + std::mem::size_of::<Tail>()
            + std::mem::size_of_val::<[u32]>(&self.tokens)
            + std::mem::size_of_val::<[EngineHash]>(&self.members);
        total / self.sharers.max(1) as usize
    }
}

/// Where a chain stands after a block: the last complete router block, and how many tokens
/// of the next router block are already filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Basis {
    pub(crate) base: Option<BlockHash>,
    /// `base`'s place in the block table, where the record knows it.
    pub(crate) base_at: Option<u32>,
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

    /// Whether `self` and `other` map the engine block the same way (a block's place is not
    /// part of the mapping).
    pub(crate) fn same_mapping(&self, other: &Kind) -> bool {
        match (self, other) {
            (Kind::One(a), Kind::One(b)) => a == b,
            (Kind::Part(a), Kind::Part(b)) => {
                a.parent == b.parent
                    && a.base == b.base
                    && a.filled == b.filled
                    && a.tokens() == b.tokens()
                    && a.own == b.own
            }
            (a, b) => a == b,
        }
    }

    pub(crate) fn basis(&self) -> Basis {
        match self {
            // (Its record keeps its place: `KvIndex::resolve_parent` reads that.)
            Kind::One(block) => Basis {
                base: Some(*block),
                base_at: None,
                filled: 0,
            },
            Kind::Many(blocks) => Basis {
                base: blocks.last().copied(),
                base_at: None,
                filled: 0,
            },
            Kind::Part(part) => match part.own {
                Some(block) => Basis {
                    base: Some(block),
                    base_at: None,
                    filled: 0,
                },
                None => Basis {
                    base: part.base,
                    base_at: None,
                    filled: part.filled,
                },
            },
        }
    }

    /// Heap bytes behind this value.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Kind::One(..) => 0,
            Kind::Many(blocks) => 16 + std::mem::size_of_val::<[BlockHash]>(blocks),
            Kind::Part(part) => {
                std::mem::size_of::<Part>()
                    + part.tail.as_deref().map_or(0, Tail::share_bytes)
                    + part.members_of.capacity() * std::mem::size_of::<BlockHash>()
            }
        }
    }
}

/// Iterates the tier indices set in `tiers`.
pub(crate) fn tier_bits(tiers: u8) -> impl Iterator<Item = usize> {
    (0..4).filter(move |t| tiers & (1 << t) != 0)
}
