//! Test-only views of the tree: an invariant check and each tenant's leaves.

use super::{Tenant, Tree, ROOT};

impl Tree {
    /// Checks the invariants listed in the module docs.
    pub fn check(&self) {
        let mut sizes = vec![0usize; self.sizes.len()];
        let mut total = 0;
        let mut stack = vec![ROOT];
        let mut live = 0;
        while let Some(p) = stack.pop() {
            let parent = &self.nodes[p as usize];
            assert!(parent.children.windows(2).all(|w| w[0].0 < w[1].0));
            for &(c, ix) in &parent.children {
                let n = &self.nodes[ix as usize];
                live += 1;
                assert_eq!(n.parent, p);
                assert_eq!(n.label.chars().next(), Some(c));
                assert_eq!(n.chars as usize, n.label.chars().count());
                assert!(!n.holders.is_empty(), "a live node without holders");
                for h in &n.holders {
                    if p != ROOT {
                        let up = parent.tick_of(h.tenant).expect("holder's parent held");
                        assert!(up >= h.tick, "a parent older than its child");
                    }
                    sizes[h.tenant as usize] += n.chars as usize;
                }
                total += n.chars as usize;
                stack.push(ix);
            }
        }
        assert_eq!(sizes, self.sizes);
        assert_eq!(total, self.total_chars);
        assert_eq!(live + 1 + self.free.len(), self.nodes.len());
    }

    /// The full texts of `tenant`'s leaves, with its tick on each.
    pub fn leaves_of(&self, tenant: Tenant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut stack = vec![(ROOT, String::new())];
        while let Some((n, text)) = stack.pop() {
            let node = &self.nodes[n as usize];
            if n != ROOT && !self.has_child_held_by(n, tenant) {
                out.push((text.clone(), node.tick_of(tenant).expect("held")));
            }
            for &(_, c) in &node.children {
                let child = &self.nodes[c as usize];
                if child.holds(tenant) {
                    stack.push((c, format!("{text}{}", child.label)));
                }
            }
        }
        out
    }
}
