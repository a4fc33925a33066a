//! The approximate radix tree of `cache_aware`: request text per tenant, characters as the
//! unit.
//!
//! Nodes live in an arena (`Vec<Node>` with a free list) and are named by their index; the
//! root is node 0 and holds no text. Each other node holds a non-empty edge label (UTF-8,
//! so ASCII text costs one byte a character) and the tenants that have sent text through
//! it, each with the tick (nanoseconds since the tree's first request) of its last use.
//!
//! Invariants (checked by `check` in the tests):
//! - a node's children start with distinct characters, sorted, and `children[i].0` is the
//!   first character of child `i`'s label;
//! - a tenant holding a node holds its parent (the nodes a tenant holds form a subtree
//!   rooted at the root), and its tick there is at most its tick on the parent, so a
//!   tenant's least recently used nodes are always found among its leaves;
//! - every live node other than the root has at least one holder (a node nobody holds is
//!   freed at once), hence at most one live node per stored character;
//! - `sizes[t]` is the sum of the label lengths (in characters) of the nodes `t` holds, and
//!   `total_chars` the sum over all live nodes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::mem::size_of;

#[cfg(test)]
mod checks;

/// A tenant's index in the tree (the policy maps (worker, dp_rank) pairs onto these).
pub(super) type Tenant = u32;

/// A node's index in the arena.
pub(super) type NodeIx = u32;

const ROOT: NodeIx = 0;

#[derive(Debug, Clone, Copy)]
struct Holder {
    tenant: Tenant,
    tick: u64,
}

#[derive(Debug, Default)]
struct Node {
    label: Box<str>,
    /// Characters in `label`.
    chars: u32,
    parent: NodeIx,
    /// (first character of the child's label, child), sorted by character.
    children: Vec<(char, NodeIx)>,
    holders: Vec<Holder>,
}

impl Node {
    fn holds(&self, tenant: Tenant) -> bool {
        self.holders.iter().any(|h| h.tenant == tenant)
    }

    fn tick_of(&self, tenant: Tenant) -> Option<u64> {
        self.holders
            .iter()
            .find(|h| h.tenant == tenant)
            .map(|h| h.tick)
    }

    fn child(&self, c: char) -> Option<NodeIx> {
        self.children
            .binary_search_by_key(&c, |&(k, _)| k)
            .ok()
            .map(|i| self.children[i].1)
    }
}

/// Where the longest match of a text ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Match {
    /// Characters of the text matched.
    pub chars: usize,
    /// The deepest node reached (the root when nothing matched); its allowed holders are
    /// exactly the tenants that matched `chars` characters.
    pub node: NodeIx,
}

#[derive(Debug)]
pub(super) struct Tree {
    nodes: Vec<Node>,
    free: Vec<NodeIx>,
    sizes: Vec<usize>,
    total_chars: usize,
}

impl Default for Tree {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            sizes: Vec::new(),
            total_chars: 0,
        }
    }
}

impl Tree {
    /// Characters held by `tenant` (0 for a tenant never seen).
    pub fn size(&self, tenant: Tenant) -> usize {
        self.sizes.get(tenant as usize).copied().unwrap_or(0)
    }

    /// Characters stored in the tree (shared prefixes counted once).
    pub fn total_chars(&self) -> usize {
        self.total_chars
    }

    /// The tenants holding `node`.
    pub fn holders(&self, node: NodeIx) -> impl Iterator<Item = Tenant> + '_ {
        self.nodes[node as usize].holders.iter().map(|h| h.tenant)
    }

    /// The longest prefix of `text` held by a tenant `t` with `allowed[t]`.
    pub fn match_prefix(&self, text: &str, allowed: &[bool]) -> Match {
        let ok = |t: Tenant| allowed.get(t as usize).copied().unwrap_or(false);
        let (mut node, mut rest, mut chars) = (ROOT, text, 0);
        while let Some(c) = rest.chars().next() {
            let Some(child) = self.nodes[node as usize].child(c) else {
                break;
            };
            let n = &self.nodes[child as usize];
            if !n.holders.iter().any(|h| ok(h.tenant)) {
                break;
            }
            node = child;
            let k = common_prefix(&n.label, rest);
            if k < n.label.len() {
                chars += rest[..k].chars().count();
                break;
            }
            chars += n.chars as usize;
            rest = &rest[k..];
        }
        Match { chars, node }
    }

    /// Records that `tenant` served `text` at `tick`: every node on the path is marked as
    /// held by it, with tick `max(old, tick)`, splitting and adding nodes as needed.
    pub fn insert(&mut self, text: &str, tenant: Tenant, tick: u64) {
        if self.sizes.len() <= tenant as usize {
            self.sizes.resize(tenant as usize + 1, 0);
        }
        let (mut node, mut rest) = (ROOT, text);
        while let Some(c) = rest.chars().next() {
            let Some(child) = self.nodes[node as usize].child(c) else {
                let leaf = self.alloc(Node {
                    label: rest.into(),
                    chars: count_u32(rest),
                    parent: node,
                    children: Vec::new(),
                    holders: Vec::new(),
                });
                let kids = &mut self.nodes[node as usize].children;
                let at = kids.partition_point(|&(k, _)| k < c);
                kids.insert(at, (c, leaf));
                self.total_chars += rest.chars().count();
                self.touch(leaf, tenant, tick);
                return;
            };
            let k = common_prefix(&self.nodes[child as usize].label, rest);
            let next = if k < self.nodes[child as usize].label.len() {
                self.split(child, k)
            } else {
                child
            };
            self.touch(next, tenant, tick);
            node = next;
            rest = &rest[k..];
        }
    }

    /// Removes `tenant`'s least recently used leaves until it holds at most `max_chars`
    /// characters. Returns the largest tick removed (`None` when nothing was).
    pub fn evict(&mut self, tenant: Tenant, max_chars: usize) -> Option<u64> {
        if self.size(tenant) <= max_chars {
            return None;
        }
        let mut heap: BinaryHeap<Reverse<(u64, NodeIx)>> = self
            .held_by(tenant)
            .into_iter()
            .filter(|&n| !self.has_child_held_by(n, tenant))
            .filter_map(|n| Some(Reverse((self.nodes[n as usize].tick_of(tenant)?, n))))
            .collect();
        let mut last = None;
        while self.size(tenant) > max_chars {
            let Some(Reverse((tick, n))) = heap.pop() else {
                break;
            };
            let parent = self.nodes[n as usize].parent;
            self.release(n, tenant);
            last = Some(tick);
            if parent != ROOT && !self.has_child_held_by(parent, tenant) {
                if let Some(t) = self.nodes[parent as usize].tick_of(tenant) {
                    heap.push(Reverse((t, parent)));
                }
            }
        }
        last
    }

    /// Removes `tenant` from every node, freeing the nodes nobody else holds.
    pub fn remove_tenant(&mut self, tenant: Tenant) {
        // Children come after their parent in `held_by`: release in reverse.
        for n in self.held_by(tenant).into_iter().rev() {
            self.release(n, tenant);
        }
        debug_assert_eq!(self.size(tenant), 0);
    }

    /// An estimate of the heap and inline bytes the tree uses, counting each allocation
    /// as glibc's malloc rounds it (8 bytes of header, 16-byte steps, 32 at least).
    pub fn memory_bytes(&self) -> usize {
        let nodes: usize = self
            .nodes
            .iter()
            .map(|n| {
                alloc_bytes(n.label.len())
                    + alloc_bytes(n.children.capacity() * size_of::<(char, NodeIx)>())
                    + alloc_bytes(n.holders.capacity() * size_of::<Holder>())
            })
            .sum();
        size_of::<Self>()
            + nodes
            + alloc_bytes(self.nodes.capacity() * size_of::<Node>())
            + alloc_bytes(self.free.capacity() * size_of::<NodeIx>())
            + alloc_bytes(self.sizes.capacity() * size_of::<usize>())
    }

    /// The nodes whose path text, inserted for `tenant` oldest first, rebuilds what it
    /// holds with the same ticks: its leaves, and every node it used more recently than
    /// any child it holds (a text that ended there). With their ticks.
    pub fn ends(&self, tenant: Tenant) -> Vec<(u64, NodeIx)> {
        self.held_by(tenant)
            .into_iter()
            .filter_map(|n| {
                let node = &self.nodes[n as usize];
                let tick = node.tick_of(tenant)?;
                let below = node
                    .children
                    .iter()
                    .filter_map(|&(_, c)| self.nodes[c as usize].tick_of(tenant))
                    .max();
                below.is_none_or(|b| tick > b).then_some((tick, n))
            })
            .collect()
    }

    /// The text from the root to the end of `node`.
    pub fn text_of(&self, node: NodeIx) -> String {
        let mut labels = Vec::new();
        let mut at = node;
        while at != ROOT {
            let n = &self.nodes[at as usize];
            labels.push(&*n.label);
            at = n.parent;
        }
        labels.iter().rev().copied().collect()
    }

    /// The nodes `tenant` holds, each after its parent (pre-order).
    fn held_by(&self, tenant: Tenant) -> Vec<NodeIx> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            for &(_, child) in &self.nodes[n as usize].children {
                if self.nodes[child as usize].holds(tenant) {
                    out.push(child);
                    stack.push(child);
                }
            }
        }
        out
    }

    fn has_child_held_by(&self, node: NodeIx, tenant: Tenant) -> bool {
        self.nodes[node as usize]
            .children
            .iter()
            .any(|&(_, c)| self.nodes[c as usize].holds(tenant))
    }

    fn touch(&mut self, node: NodeIx, tenant: Tenant, tick: u64) {
        let n = &mut self.nodes[node as usize];
        match n.holders.iter_mut().find(|h| h.tenant == tenant) {
            Some(h) => h.tick = h.tick.max(tick),
            None => {
                n.holders.push(Holder { tenant, tick });
                self.sizes[tenant as usize] += n.chars as usize;
            }
        }
    }

    /// Removes `tenant` from `node`, which holds no child of it; frees the node if that was
    /// its last holder (it then has no children: their holders would hold it too).
    fn release(&mut self, node: NodeIx, tenant: Tenant) {
        let n = &mut self.nodes[node as usize];
        let Some(i) = n.holders.iter().position(|h| h.tenant == tenant) else {
            return;
        };
        n.holders.swap_remove(i);
        let chars = n.chars as usize;
        self.sizes[tenant as usize] -= chars;
        if !n.holders.is_empty() {
            return;
        }
        debug_assert!(n.children.is_empty());
        let gone = std::mem::take(n);
        let first = gone
            .label
            .chars()
            .next()
            .expect("non-root labels are non-empty");
        let kids = &mut self.nodes[gone.parent as usize].children;
        if let Ok(i) = kids.binary_search_by_key(&first, |&(k, _)| k) {
            kids.remove(i);
        }
        self.total_chars -= chars;
        self.free.push(node);
    }

    /// Splits `node` after byte `at` of its label (a character boundary inside it) and
    /// returns the new upper half, which takes the node's place under its parent.
    fn split(&mut self, node: NodeIx, at: usize) -> NodeIx {
        let n = &self.nodes[node as usize];
        let (head, tail) = n.label.split_at(at);
        let first_of_tail = tail.chars().next().expect("split inside the label");
        let head_chars = count_u32(head);
        let upper = Node {
            label: head.into(),
            chars: head_chars,
            parent: n.parent,
            children: vec![(first_of_tail, node)],
            holders: n.holders.clone(),
        };
        let tail: Box<str> = tail.into();
        let parent = n.parent;
        let upper = self.alloc(upper);
        let n = &mut self.nodes[node as usize];
        n.label = tail;
        n.chars -= head_chars;
        n.parent = upper;
        for (_, child) in &mut self.nodes[parent as usize].children {
            if *child == node {
                *child = upper;
            }
        }
        upper
    }

    fn alloc(&mut self, node: Node) -> NodeIx {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                NodeIx::try_from(self.nodes.len() - 1).expect("fewer than 2^32 nodes")
            }
        }
    }
}

/// Bytes of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let n = x.len().min(y.len());
    // Slice equality is a vectorised memcmp: the whole shorter string first (an edge
    // matched to its end is the common case), then blocks, then words.
    if x[..n] == y[..n] {
        return floor_boundary(b, n);
    }
    let mut i = 0;
    while i + 256 <= n && x[i..i + 256] == y[i..i + 256] {
        i += 256;
    }
    while i + 8 <= n {
        let diff = u64::from_le_bytes(x[i..i + 8].try_into().expect("8 bytes"))
            ^ u64::from_le_bytes(y[i..i + 8].try_into().expect("8 bytes"));
        if diff != 0 {
            i += (diff.trailing_zeros() / 8) as usize;
            return floor_boundary(b, i);
        }
        i += 8;
    }
    while i < n && x[i] == y[i] {
        i += 1;
    }
    floor_boundary(b, i)
}

/// The largest character boundary of `s` at or before byte `i`. The bytes before `i` are
/// shared by both strings, so it is a boundary of both.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn count_u32(s: &str) -> u32 {
    u32::try_from(s.chars().count()).expect("a label under 4G characters")
}

fn alloc_bytes(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (n + 8).next_multiple_of(16).max(32)
    }
}
