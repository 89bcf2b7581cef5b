//! Compile-time half of the matcher: each pattern expands into conjunctions of field tests
//! (`$or` becomes alternatives), and every field path they mention is interned in one path
//! trie shared by all rules, which is also what the event flattener walks.
//!
//! Array consistency needs to know which tests share an object: two nested pattern objects
//! for the same field of one conjunction (possible through `$or`, e.g. `{"a": {"b": [1]},
//! "$or": [{"a": {"c": [2]}}, ...]}`) may be matched by different elements of an array, so
//! they get distinct trie nodes ("aliases") and hence independent array positions.

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::rules::pattern::{FieldTest, Matcher, ObjectPattern};

/// The trie node of the event root.
pub(crate) const ROOT: u32 = 0;

/// Every field path any pattern mentions.
#[derive(Debug, Default)]
pub(crate) struct PathTrie {
    /// Object levels; `nodes[ROOT]` is the event itself.
    pub(crate) nodes: Vec<PathNode>,
    /// Leaf fields (the paths tests look at), in sorted path order once finished.
    pub(crate) leaves: Vec<LeafInfo>,
}

/// One object level of the trie.
#[derive(Debug, Default)]
pub(crate) struct PathNode {
    /// Mentioned keys of objects at this level (parallel to `slots`).
    pub(crate) keys: Vec<Box<str>>,
    /// What each key leads to; a slot's `index` is its position here.
    pub(crate) slots: Vec<Slot>,
    /// Key to position, for levels with many keys.
    index: FxHashMap<Box<[u8]>, u32>,
    /// Whether some leaf at or below this level is tested with `exists: false` (some slot
    /// has `absence`). The flattener then records each context of this level: an object,
    /// with which of those slots' keys it holds, or a place without an object (missing,
    /// scalar, empty array), in which all of those leaves are absent.
    pub(crate) absence: bool,
    parent: u32,
    key: Box<str>,
    alias: u32,
}

/// Levels with at most this many keys are searched linearly (faster than hashing).
const LINEAR_KEYS: usize = 8;

impl PathNode {
    /// The slot of a mentioned key.
    #[inline]
    pub(crate) fn get(&self, key: &[u8]) -> Option<&Slot> {
        if self.keys.len() <= LINEAR_KEYS {
            let i = self.keys.iter().position(|k| k.as_bytes() == key)?;
            self.slots.get(i)
        } else {
            self.slots.get(*self.index.get(key)? as usize)
        }
    }

    /// Whether objects at this level need looking into at all.
    pub(crate) fn is_leafless(&self) -> bool {
        self.keys.is_empty()
    }
}

/// What a mentioned key leads to.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    /// Position among its node's keys (to detect duplicate keys while streaming).
    pub(crate) index: u32,
    /// The leaf path when tests look at this key's scalar values.
    pub(crate) leaf: Option<u32>,
    /// The object levels below this key (more than one only with aliases).
    pub(crate) nodes: SmallVec<[u32; 1]>,
    /// Whether this key leads to a leaf tested with `exists: false` (its own, or one below):
    /// the flattener notes its presence in each object context.
    pub(crate) absence: bool,
}

/// One leaf field path.
#[derive(Debug)]
pub(crate) struct LeafInfo {
    /// The object level holding the field.
    pub(crate) node: u32,
    /// The field name.
    pub(crate) key: Box<str>,
    /// Whether some test is `exists: false` (the matcher then looks for contexts lacking it).
    pub(crate) absence: bool,
    /// The object levels from the root down to `node`, sorted: the arrays whose element
    /// choice a test on this leaf depends on.
    pub(crate) chain: Box<[u32]>,
    /// For a leaf with `absence`: (object level, slot index of the key followed) from the
    /// root down to the leaf's own key. The leaf is absent in a context of one of these
    /// levels without an object, or in an object lacking the key followed from it (lacking
    /// a scalar value, for the leaf's own key). Empty for other leaves.
    pub(crate) absent_path: Box<[(u32, u32)]>,
}

/// One field test of a conjunction.
#[derive(Debug, Clone)]
pub(crate) struct Test {
    /// Leaf path id.
    pub(crate) leaf: u32,
    /// The matchers, any of which may accept (deduplicated, canonical order).
    pub(crate) matchers: Vec<Matcher>,
    /// Canonical text of the matchers: equal keys are the same test.
    pub(crate) key: String,
    /// Selectivity class (0 most selective): tests are walked in (rank, path) order.
    pub(crate) rank: u8,
}

/// A pattern without `$or`: all tests must hold, consistently across arrays.
pub(crate) type Conjunction = Vec<Test>;

/// A field test before interning: the chain of (key, pattern-object identity) above it.
#[derive(Clone)]
struct RawTest<'p> {
    chain: Vec<(&'p str, u32)>,
    leaf: &'p str,
    matchers: &'p [Matcher],
}

/// Expansion stopped: too many alternatives.
pub(crate) struct TooManyAlternatives;

fn rank(m: &Matcher) -> u8 {
    match m {
        Matcher::Exact(_) | Matcher::EqualsIgnoreCase(_) | Matcher::Cidr(_) => 0,
        Matcher::Prefix { .. }
        | Matcher::Suffix { .. }
        | Matcher::Wildcard(_)
        | Matcher::Numeric(_) => 1,
        Matcher::Exists(true) | Matcher::AnythingBut(_) => 2,
        Matcher::Exists(false) => 3,
    }
}

fn product<'p>(
    left: Vec<Vec<RawTest<'p>>>,
    right: &[Vec<RawTest<'p>>],
    limit: usize,
) -> Result<Vec<Vec<RawTest<'p>>>, TooManyAlternatives> {
    if left.len().saturating_mul(right.len()) > limit {
        return Err(TooManyAlternatives);
    }
    let mut out = Vec::with_capacity(left.len() * right.len());
    for l in &left {
        for r in right {
            let mut c = l.clone();
            c.extend(r.iter().cloned());
            out.push(c);
        }
    }
    Ok(out)
}

fn expand<'p>(
    obj: &'p ObjectPattern,
    chain: &[(&'p str, u32)],
    next_ident: &mut u32,
    limit: usize,
) -> Result<Vec<Vec<RawTest<'p>>>, TooManyAlternatives> {
    let mut out: Vec<Vec<RawTest<'p>>> = vec![Vec::new()];
    for f in &obj.fields {
        match &f.test {
            FieldTest::Matchers(ms) => {
                let t = RawTest {
                    chain: chain.to_vec(),
                    leaf: &f.name,
                    matchers: ms,
                };
                out.iter_mut().for_each(|c| c.push(t.clone()));
            }
            FieldTest::Object(inner) => {
                *next_ident += 1;
                let mut sub_chain = chain.to_vec();
                sub_chain.push((&f.name, *next_ident));
                let alts = expand(inner, &sub_chain, next_ident, limit)?;
                out = product(out, &alts, limit)?;
            }
        }
    }
    if !obj.any_of.is_empty() {
        let mut alts = Vec::new();
        for alt in &obj.any_of {
            alts.extend(expand(alt, chain, next_ident, limit)?);
            if alts.len() > limit {
                return Err(TooManyAlternatives);
            }
        }
        out = product(out, &alts, limit)?;
    }
    Ok(out)
}

impl PathTrie {
    /// A trie holding only the root.
    pub(crate) fn new() -> Self {
        PathTrie {
            nodes: vec![PathNode::default()],
            leaves: Vec::new(),
        }
    }

    fn slot(&mut self, node: u32, key: &str) -> &mut Slot {
        let n = &mut self.nodes[node as usize];
        let i = match n.index.get(key.as_bytes()) {
            Some(i) => *i as usize,
            None => {
                let i = n.slots.len();
                n.index.insert(key.as_bytes().into(), i as u32);
                n.keys.push(key.into());
                n.slots.push(Slot {
                    index: i as u32,
                    ..Slot::default()
                });
                i
            }
        };
        &mut n.slots[i]
    }

    fn child(&mut self, node: u32, key: &str, alias: u32) -> u32 {
        loop {
            let have = self.slot(node, key).nodes.len() as u32;
            if alias < have {
                return self.slot(node, key).nodes[alias as usize];
            }
            let id = self.nodes.len() as u32;
            self.nodes.push(PathNode {
                parent: node,
                key: key.into(),
                alias: have,
                ..PathNode::default()
            });
            self.slot(node, key).nodes.push(id);
        }
    }

    fn leaf(&mut self, node: u32, key: &str) -> u32 {
        if let Some(l) = self.slot(node, key).leaf {
            return l;
        }
        let id = self.leaves.len() as u32;
        self.leaves.push(LeafInfo {
            node,
            key: key.into(),
            absence: false,
            chain: Box::new([]),
            absent_path: Box::new([]),
        });
        self.slot(node, key).leaf = Some(id);
        id
    }

    /// Expands `pattern` into at most `limit` conjunctions and interns their paths.
    pub(crate) fn add_pattern(
        &mut self,
        pattern: &ObjectPattern,
        limit: usize,
    ) -> Result<Vec<Conjunction>, TooManyAlternatives> {
        let mut ident = 0;
        let raw = expand(pattern, &[], &mut ident, limit)?;
        let mut out = Vec::with_capacity(raw.len());
        for conj in raw {
            // Distinct pattern objects for the same key under the same trie node get
            // distinct aliases, in order of first appearance.
            let mut aliases: FxHashMap<(u32, &str), SmallVec<[u32; 1]>> = FxHashMap::default();
            let mut tests = Vec::with_capacity(conj.len());
            for t in conj {
                let mut node = ROOT;
                for &(key, ident) in &t.chain {
                    let list = aliases.entry((node, key)).or_default();
                    let alias = match list.iter().position(|i| *i == ident) {
                        Some(a) => a,
                        None => {
                            list.push(ident);
                            list.len() - 1
                        }
                    };
                    node = self.child(node, key, alias as u32);
                }
                let leaf = self.leaf(node, t.leaf);
                let mut keyed: Vec<(String, &Matcher)> =
                    t.matchers.iter().map(|m| (format!("{m:?}"), m)).collect();
                keyed.sort_by(|a, b| a.0.cmp(&b.0));
                keyed.dedup_by(|a, b| a.0 == b.0);
                if keyed
                    .iter()
                    .any(|(_, m)| matches!(m, Matcher::Exists(false)))
                {
                    self.leaves[leaf as usize].absence = true;
                }
                let key = keyed
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>()
                    .join("\u{1f}");
                let rank = keyed.iter().map(|(_, m)| rank(m)).max().unwrap_or(0);
                tests.push(Test {
                    leaf,
                    matchers: keyed.into_iter().map(|(_, m)| m.clone()).collect(),
                    key,
                    rank,
                });
            }
            out.push(tests);
        }
        Ok(out)
    }

    fn node_path(&self, mut node: u32) -> Vec<(&str, u32)> {
        let mut path = Vec::new();
        while node != ROOT {
            let n = &self.nodes[node as usize];
            path.push((&*n.key, n.alias));
            node = n.parent;
        }
        path.reverse();
        path
    }

    /// Renumbers leaves in sorted path order and computes what the flattener needs. Returns
    /// the map from old to new leaf ids.
    pub(crate) fn finish(&mut self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.leaves.len() as u32).collect();
        {
            // Full paths compared segment by segment (the leaf name is the last segment).
            let keys: Vec<Vec<(&str, u32)>> = self
                .leaves
                .iter()
                .map(|l| {
                    let mut p = self.node_path(l.node);
                    p.push((&*l.key, 0));
                    p
                })
                .collect();
            order.sort_by(|a, b| keys[*a as usize].cmp(&keys[*b as usize]));
        }
        let mut remap = vec![0u32; self.leaves.len()];
        for (new, old) in order.iter().enumerate() {
            remap[*old as usize] = new as u32;
        }
        let mut old_leaves: Vec<Option<LeafInfo>> = std::mem::take(&mut self.leaves)
            .into_iter()
            .map(Some)
            .collect();
        self.leaves = order
            .iter()
            .filter_map(|old| old_leaves[*old as usize].take())
            .collect();
        for n in &mut self.nodes {
            for slot in &mut n.slots {
                if let Some(l) = &mut slot.leaf {
                    *l = remap[*l as usize];
                }
            }
        }
        for i in 0..self.leaves.len() {
            let mut chain = Vec::new();
            let mut node = self.leaves[i].node;
            loop {
                chain.push(node);
                if node == ROOT {
                    break;
                }
                node = self.nodes[node as usize].parent;
            }
            chain.sort_unstable();
            self.leaves[i].chain = chain.into();
        }
        for i in 0..self.leaves.len() {
            if !self.leaves[i].absence {
                continue;
            }
            let mut path = Vec::new();
            let (mut node, mut key) = (self.leaves[i].node, self.leaves[i].key.clone());
            loop {
                let n = &self.nodes[node as usize];
                if let Some(slot) = n.get(key.as_bytes()) {
                    path.push((node, slot.index));
                }
                if node == ROOT {
                    break;
                }
                key = n.key.clone();
                node = n.parent;
            }
            path.reverse();
            self.leaves[i].absent_path = path.into();
        }
        // Children are created after their parents: a reverse sweep sees children first.
        for id in (0..self.nodes.len()).rev() {
            let node = &self.nodes[id];
            let absence: Vec<bool> = node
                .slots
                .iter()
                .map(|slot| {
                    slot.leaf.is_some_and(|l| self.leaves[l as usize].absence)
                        || slot.nodes.iter().any(|c| self.nodes[*c as usize].absence)
                })
                .collect();
            let n = &mut self.nodes[id];
            for (slot, a) in n.slots.iter_mut().zip(&absence) {
                slot.absence = *a;
            }
            n.absence = absence.contains(&true);
        }
        remap
    }

    /// The dotted name of a leaf (aliases shown as `#n`), for diagnostics.
    pub(crate) fn leaf_name(&self, leaf: u32) -> String {
        let Some(l) = self.leaves.get(leaf as usize) else {
            return String::new();
        };
        let mut parts: Vec<String> = self
            .node_path(l.node)
            .into_iter()
            .map(|(k, a)| {
                if a == 0 {
                    k.to_string()
                } else {
                    format!("{k}#{a}")
                }
            })
            .collect();
        parts.push(l.key.to_string());
        parts.join(".")
    }
}
