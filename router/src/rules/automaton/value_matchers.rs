//! Per-field value indexes of the compiled matcher: given one scalar of the flattened event,
//! they find every automaton transition whose value test accepts it, at a cost that does not
//! grow with the number of tests sharing the field (hash maps for exact values, byte tries for
//! prefixes and suffixes, a shared-state NFA for wildcards, a segment tree for numeric ranges,
//! one hash probe per prefix length for CIDR blocks).
//!
//! Every index maps values to opaque `u32` payloads: automaton states for positive tests, or
//! `anything-but` slots for the exclusions of an `anything-but` test.
//!
//! Hash maps use rustc-hash's unkeyed hasher: the stored keys come from rule files (trusted,
//! reviewed in git), events only probe them, so a producer cannot grow a collision chain.

use std::borrow::Cow;
use std::net::IpAddr;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::rules::pattern::{AnythingBut, Cidr, Matcher, NumericRange, Wildcard};

/// Payload lists: almost always one element.
type Payloads = SmallVec<[u32; 1]>;

/// A leaf of the flattened event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scalar<'a> {
    /// A string (borrowed from the event when it had no escapes).
    Str(Cow<'a, str>),
    /// A number, as serde_json holds it.
    Num(Num),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
    /// The field has no leaf value in this context; only `exists: false` matches it.
    Absent,
}

/// A JSON number in serde_json's three representations, so equality follows the interpreter
/// exactly (integers compare exactly, anything involving a float compares as `f64`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Num {
    /// A non-negative integer.
    Pos(u64),
    /// A negative integer.
    Neg(i64),
    /// Anything else.
    Float(f64),
}

impl Num {
    /// The representation serde_json chose for `n`.
    pub(crate) fn from_number(n: &serde_json::Number) -> Num {
        if let Some(u) = n.as_u64() {
            Num::Pos(u)
        } else if let Some(i) = n.as_i64() {
            Num::Neg(i)
        } else {
            // With serde_json's `arbitrary_precision` a number may not convert; NaN then
            // matches nothing, as `as_f64() == None` does in the interpreter.
            Num::Float(n.as_f64().unwrap_or(f64::NAN))
        }
    }

    /// The exact integer this number is, whichever representation serde_json chose: `300`,
    /// `300.0` and `3e2` are all 300. `None` for a fraction, NaN, or a float past `i128`.
    ///
    /// Exact equality compares these: comparing an integer with a float as `f64` made
    /// 9007199254740993 equal to 9007199254740992.0 (the integer rounds on its way to a
    /// double). A float past 2^53 has lost the digits it was written with; patterns refuse
    /// such operands (`rules::pattern`), so an event's never meets one written alike.
    pub(crate) fn exact_int(self) -> Option<i128> {
        // 2^126: every f64 below it in magnitude converts to i128 without saturating.
        const LIMIT: f64 = 85_070_591_730_234_615_865_843_651_857_942_052_864.0;
        match self {
            Num::Pos(u) => Some(i128::from(u)),
            Num::Neg(i) => Some(i128::from(i)),
            Num::Float(x) if x.fract() == 0.0 && x.abs() < LIMIT => {
                #[allow(clippy::cast_possible_truncation)] // integral and inside i128, above
                Some(x as i128)
            }
            Num::Float(_) => None,
        }
    }

    /// The value as `f64` (what `serde_json::Number::as_f64` gives).
    pub(crate) fn f64(self) -> f64 {
        match self {
            Num::Pos(u) => u as f64,
            Num::Neg(i) => i as f64,
            Num::Float(f) => f,
        }
    }
}

/// Hash key of an `f64` under `==` (so `-0.0` and `0.0` share a key); `None` for NaN.
fn f64_key(x: f64) -> Option<u64> {
    if x.is_nan() {
        None
    } else if x == 0.0 {
        Some(0)
    } else {
        Some(x.to_bits())
    }
}

/// Case folding used by every case-insensitive matcher (the interpreter's `fold`).
pub(crate) fn fold(s: &str) -> String {
    s.chars().flat_map(char::to_lowercase).collect()
}

/// `fold(s)`, without allocating for short ASCII strings.
fn fold_bytes(s: &str) -> SmallVec<[u8; 48]> {
    if s.is_ascii() {
        s.bytes().map(|b| b.to_ascii_lowercase()).collect()
    } else {
        SmallVec::from_slice(fold(s).as_bytes())
    }
}

/// Exact numeric equality with the interpreter's `num_eq` semantics: numbers that are
/// integers (whatever their representation) compare as exact integers, fractions as `f64`.
#[derive(Debug, Default)]
struct NumEq {
    ints: FxHashMap<i128, Payloads>,
    floats: FxHashMap<u64, Payloads>,
}

impl NumEq {
    fn insert(&mut self, n: Num, p: u32) {
        match n.exact_int() {
            Some(i) => self.ints.entry(i).or_default().push(p),
            None => {
                if let Some(k) = f64_key(n.f64()) {
                    self.floats.entry(k).or_default().push(p);
                }
            }
        }
    }

    fn lookup(&self, n: Num, steps: &mut u64, f: &mut impl FnMut(u32)) {
        *steps += 1;
        match n.exact_int() {
            Some(i) => emit(self.ints.get(&i), f),
            None => {
                if let Some(k) = f64_key(n.f64()) {
                    emit(self.floats.get(&k), f);
                }
            }
        }
    }

    fn nodes(&self) -> usize {
        self.ints.len() + self.floats.len()
    }
}

fn emit(list: Option<&Payloads>, f: &mut impl FnMut(u32)) {
    if let Some(list) = list {
        list.iter().copied().for_each(f);
    }
}

/// A frozen graph of byte-labelled nodes: fixed-size node records, edges and outputs in flat
/// arrays, so a walk touches little memory (this matters once tens of thousands of keys share
/// an index and it no longer fits in the caches).
#[derive(Debug, Default)]
struct Compact {
    nodes: Vec<CompactNode>,
    edge_bytes: Vec<u8>,
    edge_next: Vec<u32>,
    outs: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
struct CompactNode {
    edges: u32,
    n_edges: u32,
    out: u32,
    n_out: u32,
}

impl Compact {
    /// Lays out build nodes given as (sorted edges, outputs).
    fn from_nodes<'n>(nodes: impl Iterator<Item = (&'n [(u8, u32)], &'n [u32])>) -> Compact {
        let mut c = Compact::default();
        for (edges, out) in nodes {
            c.nodes.push(CompactNode {
                edges: c.edge_bytes.len() as u32,
                n_edges: edges.len() as u32,
                out: c.outs.len() as u32,
                n_out: out.len() as u32,
            });
            c.edge_bytes.extend(edges.iter().map(|e| e.0));
            c.edge_next.extend(edges.iter().map(|e| e.1));
            c.outs.extend_from_slice(out);
        }
        c
    }

    #[inline]
    fn next(&self, node: u32, b: u8) -> Option<u32> {
        let n = self.nodes.get(node as usize)?;
        let (start, len) = (n.edges as usize, n.n_edges as usize);
        let bytes = self.edge_bytes.get(start..start + len)?;
        let i = if len <= 16 {
            bytes.iter().position(|&x| x == b)?
        } else {
            bytes.binary_search(&b).ok()?
        };
        self.edge_next.get(start + i).copied()
    }

    #[inline]
    fn outs(&self, node: u32) -> &[u32] {
        match self.nodes.get(node as usize) {
            Some(n) => self
                .outs
                .get(n.out as usize..(n.out + n.n_out) as usize)
                .unwrap_or(&[]),
            None => &[],
        }
    }

    fn len(&self) -> usize {
        self.nodes.len()
    }
}

/// A byte trie: prefixes (or reversed suffixes) to payloads.
#[derive(Debug, Default)]
struct ByteTrie {
    build: Vec<TrieNode>,
    frozen: Compact,
}

#[derive(Debug, Default)]
struct TrieNode {
    /// Sorted by byte.
    edges: SmallVec<[(u8, u32); 2]>,
    out: Payloads,
}

impl ByteTrie {
    fn insert(&mut self, key: impl Iterator<Item = u8>, p: u32) {
        if self.build.is_empty() {
            self.build.push(TrieNode::default());
        }
        let mut node = 0usize;
        for b in key {
            node = match self.build[node].edges.binary_search_by_key(&b, |e| e.0) {
                Ok(i) => self.build[node].edges[i].1 as usize,
                Err(i) => {
                    let next = self.build.len();
                    self.build.push(TrieNode::default());
                    self.build[node].edges.insert(i, (b, next as u32));
                    next
                }
            };
        }
        self.build[node].out.push(p);
    }

    fn freeze(&mut self) {
        let build = std::mem::take(&mut self.build);
        self.frozen = Compact::from_nodes(build.iter().map(|n| (&n.edges[..], &n.out[..])));
    }

    /// Emits the payload of every key that is a prefix of `input`.
    fn walk(&self, input: impl Iterator<Item = u8>, steps: &mut u64, f: &mut impl FnMut(u32)) {
        if self.frozen.len() == 0 {
            return;
        }
        *steps += 1;
        let mut node = 0;
        self.frozen.outs(node).iter().copied().for_each(&mut *f);
        for b in input {
            let Some(next) = self.frozen.next(node, b) else {
                return;
            };
            node = next;
            *steps += 1;
            self.frozen.outs(node).iter().copied().for_each(&mut *f);
        }
    }
}

const NO_NODE: u32 = u32::MAX;

/// All wildcards of a field as one NFA whose states are shared by common prefixes (up to and
/// across stars): a trie of literal bytes in which a star is a node looping on every byte.
///
/// A run costs, per input byte, one step per active node, so the number of nodes that can be
/// active at once is what bounds the work; [`WildcardNfa::active_bound`] computes it when the
/// set is built and the builder refuses a field over [`MAX_WILDCARD_ACTIVE_STATES`]. A trailing
/// star that nothing follows (`*error*`) never enters the active set: once reached, its
/// wildcards match whatever comes after, so they are settled at once. Without that, 20,000
/// `*-N-*` wildcards would keep up to 20,000 nodes active on a value that contains them all.
#[derive(Debug, Default)]
struct WildcardNfa {
    build: Vec<WildcardNode>,
    frozen: Compact,
    /// Per node: the star node reached without consuming input, or `NO_NODE`.
    star: Vec<u32>,
    /// Per node: whether it is a star node (loops on any byte).
    self_loop: Vec<bool>,
    /// Per node: a star node without edges or a further star (a trailing `*`), settled when
    /// reached instead of being carried along.
    sink: Vec<bool>,
    /// Most nodes that can be active at once, over every input (an upper bound).
    bound: u64,
}

#[derive(Debug)]
struct WildcardNode {
    edges: SmallVec<[(u8, u32); 2]>,
    star: u32,
    self_loop: bool,
    out: Payloads,
}

impl WildcardNode {
    fn new(self_loop: bool) -> Self {
        WildcardNode {
            edges: SmallVec::new(),
            star: NO_NODE,
            self_loop,
            out: Payloads::new(),
        }
    }
}

impl WildcardNfa {
    fn insert(&mut self, parts: &[String], p: u32) {
        if self.build.is_empty() {
            self.build.push(WildcardNode::new(false));
        }
        let mut node = 0usize;
        for (i, part) in parts.iter().enumerate() {
            for b in part.bytes() {
                node = match self.build[node].edges.binary_search_by_key(&b, |e| e.0) {
                    Ok(j) => self.build[node].edges[j].1 as usize,
                    Err(j) => {
                        let next = self.build.len();
                        self.build.push(WildcardNode::new(false));
                        self.build[node].edges.insert(j, (b, next as u32));
                        next
                    }
                };
            }
            if i + 1 < parts.len() {
                node = match self.build[node].star {
                    NO_NODE => {
                        let next = self.build.len();
                        self.build.push(WildcardNode::new(true));
                        self.build[node].star = next as u32;
                        next
                    }
                    s => s as usize,
                };
            }
        }
        self.build[node].out.push(p);
    }

    fn freeze(&mut self) {
        let build = std::mem::take(&mut self.build);
        self.bound = active_bound(&build);
        self.frozen = Compact::from_nodes(build.iter().map(|n| (&n.edges[..], &n.out[..])));
        self.star = build.iter().map(|n| n.star).collect();
        self.self_loop = build.iter().map(|n| n.self_loop).collect();
        self.sink = build.iter().map(is_sink).collect();
    }

    /// Pushes `node` and the stars it reaches without input: to `set` to be carried along, or
    /// to `done` when it is a sink (settled).
    fn add_closure(&self, mut node: u32, set: &mut SmallVec<[u32; 16]>, done: &mut Vec<u32>) {
        while node != NO_NODE {
            if self.sink.get(node as usize).copied().unwrap_or(false) {
                done.push(node);
            } else {
                set.push(node);
            }
            node = self.star.get(node as usize).copied().unwrap_or(NO_NODE);
        }
    }

    /// Emits the payload of every wildcard that matches all of `input`.
    fn run(&self, input: &[u8], steps: &mut u64, f: &mut impl FnMut(u32)) {
        self.run_observing(input, steps, f, &mut |_| {});
    }

    /// [`WildcardNfa::run`], telling `observe` the size of the active set after each byte
    /// (for the tests of [`WildcardNfa::active_bound`]).
    fn run_observing(
        &self,
        input: &[u8],
        steps: &mut u64,
        f: &mut impl FnMut(u32),
        observe: &mut impl FnMut(usize),
    ) {
        if self.frozen.len() == 0 {
            return;
        }
        let mut cur: SmallVec<[u32; 16]> = SmallVec::new();
        let mut next: SmallVec<[u32; 16]> = SmallVec::new();
        // Sinks reached so far; the same sink may be reached again and again (`*a*` on
        // "aaaa"), so the list is deduplicated whenever it has doubled.
        let mut done: Vec<u32> = Vec::new();
        let mut done_dedup = 0;
        self.add_closure(0, &mut cur, &mut done);
        for &b in input {
            if cur.is_empty() {
                break;
            }
            next.clear();
            for &n in &cur {
                *steps += 1;
                if self.self_loop.get(n as usize).copied().unwrap_or(false) {
                    next.push(n);
                }
                if let Some(child) = self.frozen.next(n, b) {
                    self.add_closure(child, &mut next, &mut done);
                }
            }
            if next.len() > 1 {
                next.sort_unstable();
                next.dedup();
            }
            std::mem::swap(&mut cur, &mut next);
            observe(cur.len());
            if done.len() > 2 * done_dedup + 16 {
                done.sort_unstable();
                done.dedup();
                done_dedup = done.len();
            }
        }
        for &n in cur.iter().chain(done.iter()) {
            self.frozen.outs(n).iter().copied().for_each(&mut *f);
        }
    }
}

fn is_sink(n: &WildcardNode) -> bool {
    n.self_loop && n.edges.is_empty() && n.star == NO_NODE
}

/// Most nodes of a wildcard NFA (given as its build nodes) that can be active at once, over
/// every input: an upper bound, exact enough to tell a few wildcards from many interleaved
/// ones. The nodes form a tree (literal edges and star links), children after parents.
///
/// * A star node, once reached, stays active, and each input byte starts a new walk down the
///   literal trie below it (up to its next stars). Walks that started at different times are
///   at different depths, so at most one node per depth is active: the trie's height (or its
///   node count, if smaller). Every star below can be reached by some walk, and stays: they
///   all count. A sink (a trailing star) is settled when reached and counts nothing.
/// * The root is active only before the first byte, so one walk goes down its literal trie,
///   reaching the stars on its path: the worst path counts.
fn active_bound(nodes: &[WildcardNode]) -> u64 {
    let n = nodes.len();
    // Per node, over its literal subtree (the node and its literal descendants, not crossing
    // star links): the height below it, the number of literal nodes below it, the summed
    // bound of the stars linked from it, and the largest such sum along one path down.
    let mut height = vec![0u64; n];
    let mut below = vec![0u64; n];
    let mut star_sum = vec![0u64; n];
    let mut path_max = vec![0u64; n];
    // Bound of a star node's whole region (0 for a sink).
    let mut region = vec![0u64; n];
    for i in (0..n).rev() {
        let node = &nodes[i];
        let linked = match node.star {
            NO_NODE => 0,
            s => region.get(s as usize).copied().unwrap_or(0),
        };
        let (mut h, mut cnt, mut sum, mut best) = (0u64, 0u64, linked, 0u64);
        for &(_, c) in &node.edges {
            let c = c as usize;
            h = h.max(1 + height[c]);
            cnt = cnt.saturating_add(1 + below[c]);
            sum = sum.saturating_add(star_sum[c]);
            best = best.max(path_max[c]);
        }
        height[i] = h;
        below[i] = cnt;
        star_sum[i] = sum;
        path_max[i] = linked.saturating_add(best);
        if node.self_loop && !is_sink(node) {
            region[i] = 1u64.saturating_add(h.min(cnt)).saturating_add(sum);
        }
    }
    match n {
        0 => 0,
        _ => 1u64.saturating_add(path_max[0]),
    }
}

/// Numeric ranges of a field. The endpoints cut the line into elementary segments (open
/// gaps and single points); a lookup finds the value's segment with a two-level binary search
/// (a small sample of every 16th endpoint, then one block) and reads the ranges covering it.
/// When ranges overlap little (the usual case) each segment's list is stored outright;
/// otherwise a segment tree stores each range in O(log n) nodes and a lookup walks from the
/// segment's leaf to the root, so memory stays O(n log n) whatever the overlap.
#[derive(Debug, Default)]
struct NumericIndex {
    pending: Vec<(NumericRange, u32)>,
    /// Sorted distinct endpoints.
    points: Vec<f64>,
    /// `points[0], points[32], ...`: the first level of the search.
    sample: Vec<f64>,
    /// Segment tree leaves (a power of two), or 0 when lists are per segment.
    tree_size: usize,
    /// CSR layout: list `i` (segment `i`, or tree node `i`) is `items[starts[i]..starts[i+1]]`.
    starts: Vec<u32>,
    items: Vec<u32>,
    /// Bit per segment: whether any range covers it. Small enough to stay cached, it answers
    /// most misses (values between narrow ranges) without touching the lists.
    covered: Vec<u64>,
}

const SAMPLE_EVERY: usize = 16;

/// Normalises `-0.0` to `0.0` (they compare equal; keep one point for both).
fn norm0(x: f64) -> f64 {
    if x == 0.0 { 0.0 } else { x }
}

impl NumericIndex {
    fn segment_of(&self, x: f64) -> usize {
        let block = self.sample.partition_point(|p| *p < x).saturating_sub(1);
        let lo = block * SAMPLE_EVERY;
        let hi = (lo + SAMPLE_EVERY + 1).min(self.points.len());
        let i = lo + self.points[lo..hi].partition_point(|p| *p < x);
        if i < self.points.len() && self.points[i] == x {
            2 * i + 1
        } else {
            2 * i
        }
    }

    fn freeze(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let mut points: Vec<f64> = pending
            .iter()
            .flat_map(|(r, _)| [r.lower, r.upper])
            .flatten()
            .map(|b| norm0(b.value))
            .filter(|v| !v.is_nan())
            .collect();
        points.sort_by(f64::total_cmp);
        points.dedup();
        self.points = points;
        self.sample = self.points.iter().step_by(SAMPLE_EVERY).copied().collect();
        let segments = 2 * self.points.len() + 1;
        // Segment span [lo, hi] of every range.
        let mut spans: Vec<(usize, usize, u32)> = Vec::with_capacity(pending.len());
        for (range, p) in &pending {
            let lo = match range.lower {
                None => 0,
                Some(b) => {
                    let s = self.segment_of(norm0(b.value));
                    if b.inclusive { s } else { s + 1 }
                }
            };
            let hi = match range.upper {
                None => segments - 1,
                Some(b) => {
                    let s = self.segment_of(norm0(b.value));
                    match (b.inclusive, s.checked_sub(1)) {
                        (true, _) => s,
                        (false, Some(s)) => s,
                        (false, None) => continue,
                    }
                }
            };
            if lo <= hi {
                spans.push((lo, hi, *p));
            }
        }
        // Covering counts by a difference array, then one bit per segment.
        let mut diff = vec![0i64; segments + 1];
        for &(lo, hi, _) in &spans {
            diff[lo] += 1;
            diff[hi + 1] -= 1;
        }
        self.covered = vec![0; segments.div_ceil(64)];
        let mut depth = 0i64;
        for (seg, d) in diff.iter().take(segments).enumerate() {
            depth += d;
            if depth > 0 {
                self.covered[seg / 64] |= 1 << (seg % 64);
            }
        }
        let covered: usize = spans.iter().map(|(lo, hi, _)| hi - lo + 1).sum();
        let mut lists: Vec<Vec<u32>>;
        if covered <= 4 * spans.len() + 4096 {
            self.tree_size = 0;
            lists = vec![Vec::new(); segments];
            for &(lo, hi, p) in &spans {
                for list in &mut lists[lo..=hi] {
                    list.push(p);
                }
            }
        } else {
            self.tree_size = segments.next_power_of_two();
            lists = vec![Vec::new(); 2 * self.tree_size];
            for &(lo, hi, p) in &spans {
                let (mut l, mut r) = (lo + self.tree_size, hi + self.tree_size + 1);
                while l < r {
                    if l & 1 == 1 {
                        lists[l].push(p);
                        l += 1;
                    }
                    if r & 1 == 1 {
                        r -= 1;
                        lists[r].push(p);
                    }
                    l >>= 1;
                    r >>= 1;
                }
            }
        }
        self.starts = Vec::with_capacity(lists.len() + 1);
        self.items.clear();
        for list in &lists {
            self.starts.push(self.items.len() as u32);
            self.items.extend_from_slice(list);
        }
        self.starts.push(self.items.len() as u32);
    }

    fn list(&self, i: usize) -> &[u32] {
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => self.items.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    fn lookup(&self, x: f64, steps: &mut u64, f: &mut impl FnMut(u32)) {
        if x.is_nan() || self.starts.is_empty() {
            return;
        }
        *steps += 1;
        let segment = self.segment_of(norm0(x));
        if self
            .covered
            .get(segment / 64)
            .is_none_or(|w| w & (1 << (segment % 64)) == 0)
        {
            return;
        }
        if self.tree_size == 0 {
            self.list(segment).iter().copied().for_each(f);
            return;
        }
        let mut node = segment + self.tree_size;
        while node >= 1 {
            self.list(node).iter().copied().for_each(&mut *f);
            node >>= 1;
        }
    }

    fn nodes(&self) -> usize {
        self.items.len() + self.points.len()
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0)
}

/// CIDR blocks of a field: one hash probe per distinct prefix length.
#[derive(Debug, Default)]
struct CidrIndex {
    v4: FxHashMap<(u8, u32), Payloads>,
    v4_lens: Vec<u8>,
    v6: FxHashMap<(u8, u128), Payloads>,
    v6_lens: Vec<u8>,
}

impl CidrIndex {
    fn insert(&mut self, c: &Cidr, p: u32) {
        let len = c.prefix_len;
        match c.network {
            IpAddr::V4(a) => {
                let net = u32::from(a) & mask32(len);
                self.v4.entry((len, net)).or_default().push(p);
                if !self.v4_lens.contains(&len) {
                    self.v4_lens.push(len);
                }
            }
            IpAddr::V6(a) => {
                let net = u128::from(a) & mask128(len);
                self.v6.entry((len, net)).or_default().push(p);
                if !self.v6_lens.contains(&len) {
                    self.v6_lens.push(len);
                }
            }
        }
    }

    fn lookup(&self, s: &str, steps: &mut u64, f: &mut impl FnMut(u32)) {
        *steps += 1;
        match s.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => {
                let a = u32::from(a);
                for &len in &self.v4_lens {
                    *steps += 1;
                    emit(self.v4.get(&(len, a & mask32(len))), f);
                }
            }
            Ok(IpAddr::V6(a)) => {
                let a = u128::from(a);
                for &len in &self.v6_lens {
                    *steps += 1;
                    emit(self.v6.get(&(len, a & mask128(len))), f);
                }
            }
            Err(_) => {}
        }
    }
}

/// Whether `w` goes to a field's wildcard NFA rather than to the exact, prefix or suffix
/// index (as [`StrIndex::wildcard`] decides).
pub(crate) fn uses_nfa(w: &Wildcard) -> bool {
    match w.parts.as_slice() {
        [_] => false,
        [first, last] => !first.is_empty() && !last.is_empty(),
        _ => true,
    }
}

/// Every string test of a field.
#[derive(Debug, Default)]
struct StrIndex {
    /// Inline: the most common family. The others are boxed so that an index holding only
    /// exact values stays small (a cold index costs a cache miss per line touched).
    exact: FxHashMap<Box<str>, Payloads>,
    fold_eq: Option<Box<FxHashMap<Box<str>, Payloads>>>,
    prefix: Option<Box<ByteTrie>>,
    prefix_fold: Option<Box<ByteTrie>>,
    suffix: Option<Box<ByteTrie>>,
    suffix_fold: Option<Box<ByteTrie>>,
    wildcard: Option<Box<WildcardNfa>>,
    cidr: Option<Box<CidrIndex>>,
}

impl StrIndex {
    fn exact(&mut self, s: &str, p: u32) {
        self.exact.entry(s.into()).or_default().push(p);
    }

    fn equals_ignore_case(&mut self, s: &str, p: u32) {
        self.fold_eq
            .get_or_insert_with(Box::default)
            .entry(fold(s).into())
            .or_default()
            .push(p);
    }

    fn prefix(&mut self, s: &str, ignore_case: bool, p: u32) {
        if ignore_case {
            let f = fold(s);
            self.prefix_fold
                .get_or_insert_with(Box::default)
                .insert(f.bytes(), p);
        } else {
            self.prefix
                .get_or_insert_with(Box::default)
                .insert(s.bytes(), p);
        }
    }

    fn suffix(&mut self, s: &str, ignore_case: bool, p: u32) {
        if ignore_case {
            let f = fold(s);
            self.suffix_fold
                .get_or_insert_with(Box::default)
                .insert(f.bytes().rev(), p);
        } else {
            self.suffix
                .get_or_insert_with(Box::default)
                .insert(s.bytes().rev(), p);
        }
    }

    /// Wildcards without stars are exact values, `x*` prefixes, `*x` suffixes (`*` is the
    /// empty prefix); only the rest go to the NFA (see [`uses_nfa`]).
    fn wildcard(&mut self, w: &Wildcard, p: u32) {
        match w.parts.as_slice() {
            [only] => self.exact(only, p),
            [first, last] if last.is_empty() => self.prefix(first, false, p),
            [first, last] if first.is_empty() => self.suffix(last, false, p),
            parts => self
                .wildcard
                .get_or_insert_with(Box::default)
                .insert(parts, p),
        }
    }

    fn cidr(&mut self, c: &Cidr, p: u32) {
        self.cidr.get_or_insert_with(Box::default).insert(c, p);
    }

    /// Most wildcard NFA nodes active at once (0 without wildcards); valid once frozen.
    fn wildcard_bound(&self) -> u64 {
        self.wildcard.as_ref().map_or(0, |w| w.bound)
    }

    fn lookup(&self, s: &str, steps: &mut u64, f: &mut impl FnMut(u32)) {
        if !self.exact.is_empty() {
            *steps += 1;
            emit(self.exact.get(s), f);
        }
        if let Some(t) = &self.prefix {
            t.walk(s.bytes(), steps, f);
        }
        if let Some(t) = &self.suffix {
            t.walk(s.bytes().rev(), steps, f);
        }
        if self.fold_eq.is_some() || self.prefix_fold.is_some() || self.suffix_fold.is_some() {
            let folded = fold_bytes(s);
            if let Some(fold_eq) = &self.fold_eq {
                *steps += 1;
                if let Ok(k) = std::str::from_utf8(&folded) {
                    emit(fold_eq.get(k), f);
                }
            }
            if let Some(t) = &self.prefix_fold {
                t.walk(folded.iter().copied(), steps, f);
            }
            if let Some(t) = &self.suffix_fold {
                t.walk(folded.iter().rev().copied(), steps, f);
            }
        }
        if let Some(nfa) = &self.wildcard {
            nfa.run(s.as_bytes(), steps, f);
        }
        if let Some(c) = &self.cidr {
            c.lookup(s, steps, f);
        }
    }

    fn freeze(&mut self) {
        for t in [
            &mut self.prefix,
            &mut self.prefix_fold,
            &mut self.suffix,
            &mut self.suffix_fold,
        ]
        .into_iter()
        .flatten()
        {
            t.freeze();
        }
        if let Some(w) = &mut self.wildcard {
            w.freeze();
        }
    }

    fn nodes(&self) -> usize {
        let trie = |t: &Option<Box<ByteTrie>>| t.as_ref().map_or(0, |t| t.frozen.len());
        self.exact.len()
            + self.fold_eq.as_ref().map_or(0, |m| m.len())
            + trie(&self.prefix)
            + trie(&self.prefix_fold)
            + trie(&self.suffix)
            + trie(&self.suffix_fold)
            + self.wildcard.as_ref().map_or(0, |w| w.frozen.len())
            + self.cidr.as_ref().map_or(0, |c| c.v4.len() + c.v6.len())
    }
}

/// `anything-but` tests of a field. Each test is a slot; a value reaches every slot except
/// those whose operands it matches. A lookup costs the number of slots, which is the size of
/// its answer: `anything-but` accepts almost every value.
#[derive(Debug, Default)]
struct AnythingButIndex {
    /// (target state, whether the operands are strings rather than numbers).
    slots: Vec<(u32, bool)>,
    strings: StrIndex,
    numbers: NumEq,
}

impl AnythingButIndex {
    fn insert(&mut self, ab: &AnythingBut, target: u32) {
        let slot = self.slots.len() as u32;
        let string_kind = !matches!(ab, AnythingBut::Numbers(_));
        self.slots.push((target, string_kind));
        match ab {
            AnythingBut::Strings(list) => list.iter().for_each(|s| self.strings.exact(s, slot)),
            AnythingBut::Numbers(list) => list
                .iter()
                .for_each(|n| self.numbers.insert(Num::from_number(n), slot)),
            AnythingBut::Prefix(list) => list
                .iter()
                .for_each(|s| self.strings.prefix(s, false, slot)),
            AnythingBut::Suffix(list) => list
                .iter()
                .for_each(|s| self.strings.suffix(s, false, slot)),
            AnythingBut::EqualsIgnoreCase(list) => list
                .iter()
                .for_each(|s| self.strings.equals_ignore_case(s, slot)),
            AnythingBut::Wildcard(list) => list.iter().for_each(|w| self.strings.wildcard(w, slot)),
        }
    }

    fn lookup(&self, v: &Scalar<'_>, steps: &mut u64, f: &mut impl FnMut(u32)) {
        *steps += 1;
        let mut excluded: SmallVec<[u32; 8]> = SmallVec::new();
        let kind = match v {
            Scalar::Absent => return,
            Scalar::Str(s) => {
                self.strings
                    .lookup(s, steps, &mut |slot| excluded.push(slot));
                Some(true)
            }
            Scalar::Num(n) => {
                self.numbers
                    .lookup(*n, steps, &mut |slot| excluded.push(slot));
                Some(false)
            }
            Scalar::Bool(_) | Scalar::Null => None,
        };
        excluded.sort_unstable();
        for (i, &(target, string_kind)) in self.slots.iter().enumerate() {
            let hit = Some(string_kind) == kind && excluded.binary_search(&(i as u32)).is_ok();
            if !hit {
                f(target);
            }
        }
    }
}

/// Every value test at one (automaton state, field) pair, each leading to its target state.
#[derive(Debug, Default)]
pub(crate) struct FieldIndex {
    strings: StrIndex,
    numbers: Option<Box<NumEq>>,
    bools: [Payloads; 2],
    null: Payloads,
    numeric: Option<Box<NumericIndex>>,
    exists: Payloads,
    absent: Payloads,
    anything_but: Option<Box<AnythingButIndex>>,
}

impl FieldIndex {
    /// Adds `m`, leading to `target`.
    pub(crate) fn insert(&mut self, m: &Matcher, target: u32) {
        match m {
            Matcher::Exact(v) => match v {
                serde_json::Value::String(s) => self.strings.exact(s, target),
                serde_json::Value::Number(n) => self
                    .numbers
                    .get_or_insert_with(Box::default)
                    .insert(Num::from_number(n), target),
                serde_json::Value::Bool(b) => self.bools[usize::from(*b)].push(target),
                serde_json::Value::Null => self.null.push(target),
                // The pattern compiler never produces arrays or objects as exact values.
                serde_json::Value::Array(_) | serde_json::Value::Object(_) => {}
            },
            Matcher::Prefix { value, ignore_case } => {
                self.strings.prefix(value, *ignore_case, target)
            }
            Matcher::Suffix { value, ignore_case } => {
                self.strings.suffix(value, *ignore_case, target)
            }
            Matcher::EqualsIgnoreCase(s) => self.strings.equals_ignore_case(s, target),
            Matcher::Wildcard(w) => self.strings.wildcard(w, target),
            Matcher::AnythingBut(ab) => self
                .anything_but
                .get_or_insert_with(Box::default)
                .insert(ab, target),
            Matcher::Numeric(r) => self
                .numeric
                .get_or_insert_with(Box::default)
                .pending
                .push((*r, target)),
            Matcher::Exists(true) => self.exists.push(target),
            Matcher::Exists(false) => self.absent.push(target),
            Matcher::Cidr(c) => self.strings.cidr(c, target),
        }
    }

    /// Finishes building (numeric ranges are indexed once all are known).
    pub(crate) fn freeze(&mut self) {
        self.strings.freeze();
        if let Some(n) = &mut self.numeric {
            n.freeze();
        }
        if let Some(ab) = &mut self.anything_but {
            ab.strings.freeze();
        }
    }

    /// Emits the target of every test that accepts `v`; targets may repeat.
    pub(crate) fn lookup(&self, v: &Scalar<'_>, steps: &mut u64, f: &mut impl FnMut(u32)) {
        match v {
            Scalar::Absent => {
                self.absent.iter().copied().for_each(f);
                return;
            }
            Scalar::Str(s) => self.strings.lookup(s, steps, f),
            Scalar::Num(n) => {
                if let Some(eq) = &self.numbers {
                    eq.lookup(*n, steps, f);
                }
                if let Some(r) = &self.numeric {
                    r.lookup(n.f64(), steps, f);
                }
            }
            Scalar::Bool(b) => self.bools[usize::from(*b)]
                .iter()
                .copied()
                .for_each(&mut *f),
            Scalar::Null => self.null.iter().copied().for_each(&mut *f),
        }
        self.exists.iter().copied().for_each(&mut *f);
        if let Some(ab) = &self.anything_but {
            ab.lookup(v, steps, f);
        }
    }

    /// Most wildcard NFA nodes that can be active at once while one value is looked up (its
    /// wildcards and its `anything-but` wildcards), over every value: the per-byte cost of
    /// the wildcards of this field. Valid once frozen.
    pub(crate) fn wildcard_bound(&self) -> u64 {
        self.strings.wildcard_bound().saturating_add(
            self.anything_but
                .as_ref()
                .map_or(0, |a| a.strings.wildcard_bound()),
        )
    }

    /// Index nodes (hash entries, trie and NFA nodes, numeric tree entries), for statistics.
    pub(crate) fn nodes(&self) -> usize {
        self.strings.nodes()
            + self.numbers.as_ref().map_or(0, |n| n.nodes())
            + self.numeric.as_ref().map_or(0, |n| n.nodes())
            + self
                .anything_but
                .as_ref()
                .map_or(0, |a| a.slots.len() + a.strings.nodes() + a.numbers.nodes())
            + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::pattern::Bound;

    fn collect(idx: &FieldIndex, v: Scalar<'_>) -> Vec<u32> {
        let mut out = Vec::new();
        let mut steps = 0;
        idx.lookup(&v, &mut steps, &mut |p| out.push(p));
        out.sort_unstable();
        out.dedup();
        out
    }

    fn s(x: &str) -> Scalar<'_> {
        Scalar::Str(Cow::Borrowed(x))
    }

    #[test]
    fn numeric_segments_respect_bounds() {
        let mut idx = FieldIndex::default();
        let b = |value: f64, inclusive: bool| Some(Bound { value, inclusive });
        idx.insert(
            &Matcher::Numeric(NumericRange {
                lower: b(0.0, false),
                upper: b(5.0, true),
            }),
            1,
        );
        idx.insert(
            &Matcher::Numeric(NumericRange {
                lower: b(5.0, true),
                upper: None,
            }),
            2,
        );
        idx.insert(
            &Matcher::Numeric(NumericRange {
                lower: None,
                upper: b(0.0, false),
            }),
            3,
        );
        idx.insert(
            &Matcher::Numeric(NumericRange {
                lower: b(-0.0, true),
                upper: b(0.0, true),
            }),
            4,
        );
        idx.freeze();
        let n = |x: f64| Scalar::Num(Num::Float(x));
        assert_eq!(collect(&idx, n(0.0)), vec![4]);
        assert_eq!(collect(&idx, n(-0.0)), vec![4]);
        assert_eq!(collect(&idx, n(0.5)), vec![1]);
        assert_eq!(collect(&idx, n(5.0)), vec![1, 2]);
        assert_eq!(collect(&idx, n(6.0)), vec![2]);
        assert_eq!(collect(&idx, n(-1.0)), vec![3]);
        assert_eq!(collect(&idx, s("5")), Vec::<u32>::new());
    }

    #[test]
    fn numeric_lists_and_tree_agree_with_contains() {
        // Narrow ranges use per-segment lists; heavily overlapping one-sided ranges use the
        // segment tree. Both must agree with `NumericRange::contains`.
        let b = |value: f64, inclusive: bool| Some(Bound { value, inclusive });
        let narrow: Vec<NumericRange> = (0..300)
            .map(|i| {
                let lo = f64::from(i) * 0.5;
                NumericRange {
                    lower: b(lo, i % 2 == 0),
                    upper: b(lo + 0.75, i % 3 == 0),
                }
            })
            .collect();
        let wide: Vec<NumericRange> = (0..300)
            .map(|i| match i % 3 {
                0 => NumericRange {
                    lower: b(f64::from(i), i % 2 == 0),
                    upper: None,
                },
                1 => NumericRange {
                    lower: None,
                    upper: b(f64::from(i), i % 2 == 0),
                },
                _ => NumericRange {
                    lower: b(-f64::from(i), true),
                    upper: b(f64::from(i), false),
                },
            })
            .collect();
        for ranges in [narrow, wide] {
            let mut idx = FieldIndex::default();
            for (i, r) in ranges.iter().enumerate() {
                idx.insert(&Matcher::Numeric(*r), i as u32);
            }
            idx.freeze();
            let tree = idx.numeric.as_ref().map_or(0, |n| n.tree_size);
            for k in -700..700 {
                let x = f64::from(k) * 0.25;
                let want: Vec<u32> = (0..ranges.len() as u32)
                    .filter(|i| ranges[*i as usize].contains(x))
                    .collect();
                assert_eq!(
                    collect(&idx, Scalar::Num(Num::Float(x))),
                    want,
                    "x = {x}, tree {tree}"
                );
            }
        }
    }

    fn nfa(wildcards: &[&str]) -> WildcardNfa {
        let mut n = WildcardNfa::default();
        for (i, w) in wildcards.iter().enumerate() {
            let w = Wildcard::parse(w).expect("valid");
            n.insert(&w.parts, i as u32);
        }
        n.freeze();
        n
    }

    /// Largest active set over every prefix of `input`, and the wildcards that matched.
    fn observe(n: &WildcardNfa, input: &[u8]) -> (usize, Vec<u32>) {
        let (mut most, mut out, mut steps) = (0, Vec::new(), 0);
        n.run_observing(input, &mut steps, &mut |p| out.push(p), &mut |len| {
            most = most.max(len)
        });
        out.sort_unstable();
        out.dedup();
        (most, out)
    }

    #[test]
    fn wildcard_bound_of_typical_and_audited_shapes() {
        // One wildcard: stars plus one literal walk each.
        assert_eq!(nfa(&["*a*b*c*"]).bound, 7);
        // Trailing stars are settled when reached: 20,000 `*-N-*` keep one walk per depth of
        // `-N-` active, not 20,000 stars.
        let many: Vec<String> = (0..20_000).map(|i| format!("*-{i}-*")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(nfa(&refs).bound, 1 + 1 + 7);
        // A literal head is one walk: a thousand buckets cost what one does.
        let arns: Vec<String> = (0..1000)
            .map(|i| format!("arn:aws:s3:::bucket-{i}/*.json"))
            .collect();
        let refs: Vec<&str> = arns.iter().map(String::as_str).collect();
        assert_eq!(nfa(&refs).bound, 1 + 1 + 5);
        // Behind a shared star they are not: a value holding every `:bucket-N/` keeps all
        // thousand second stars active.
        let arns: Vec<String> = (0..1000)
            .map(|i| format!("arn:*:bucket-{i}/*.json"))
            .collect();
        let refs: Vec<&str> = arns.iter().map(String::as_str).collect();
        let n = nfa(&refs);
        let input: String = (0..1000).map(|i| format!(":bucket-{i}/")).collect();
        let (most, _) = observe(&n, format!("arn:{input}").as_bytes());
        assert!(most > 1000 && n.bound >= most as u64, "{most} {}", n.bound);
        // The audit's set: 2,000 `*x*y*z*q` that a value using every letter half-matches
        // all at once (its active set measured ~2,700 nodes).
        let letters: Vec<char> = ('a'..='p').collect();
        let mut audit = Vec::new();
        'outer: for x in &letters {
            for y in &letters {
                for z in &letters {
                    if audit.len() == 2000 {
                        break 'outer;
                    }
                    audit.push(format!("*{x}*{y}*{z}*q"));
                }
            }
        }
        let refs: Vec<&str> = audit.iter().map(String::as_str).collect();
        let n = nfa(&refs);
        let input: Vec<u8> = letters.iter().cycle().take(64).map(|c| *c as u8).collect();
        let (most, _) = observe(&n, &input);
        assert!(most > 2000, "active set {most}");
        assert!(n.bound >= most as u64, "bound {} < {most}", n.bound);
    }

    proptest::proptest! {
        /// The bound holds for every input, and settling trailing stars early changes no
        /// answer (checked against the interpreter's `Wildcard::matches`).
        #[test]
        fn wildcard_bound_is_an_upper_bound_and_sinks_keep_answers(
            ws in proptest::collection::vec("[ab*]{1,6}", 1..8),
            input in "[ab]{0,16}",
        ) {
            let parsed: Vec<Wildcard> = ws.iter().filter_map(|w| Wildcard::parse(w).ok()).collect();
            let mut n = WildcardNfa::default();
            for (i, w) in parsed.iter().enumerate() {
                n.insert(&w.parts, i as u32);
            }
            n.freeze();
            let (most, got) = observe(&n, input.as_bytes());
            proptest::prop_assert!(most as u64 <= n.bound, "active {most} > bound {}", n.bound);
            let want: Vec<u32> = (0..parsed.len() as u32)
                .filter(|i| parsed[*i as usize].matches(&input))
                .collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn wildcard_nfa_shares_states() {
        let mut idx = FieldIndex::default();
        for (i, w) in ["a*b*c", "a*c", "*x*", "ab*"].iter().enumerate() {
            let w = Wildcard::parse(w).expect("valid");
            idx.insert(&Matcher::Wildcard(w), i as u32);
        }
        idx.freeze();
        assert_eq!(collect(&idx, s("abc")), vec![0, 1, 3]);
        assert_eq!(collect(&idx, s("axc")), vec![1, 2]);
        assert_eq!(collect(&idx, s("x")), vec![2]);
        assert_eq!(collect(&idx, s("ab")), vec![3]);
    }
}
