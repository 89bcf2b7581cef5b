//! The compiled matcher of the rule-match stage: every pattern of a rule set compiled into one
//! shared automaton, so the cost of matching an event does not grow with the number of rules.
//!
//! # Design (in the style of aws/event-ruler and quamina)
//!
//! * **Patterns** expand into conjunctions (`$or` alternatives multiply out, capped by
//!   [`MAX_OR_EXPANSION`]); each conjunction is a list of field tests (leaf path + matcher
//!   list). Tests are walked in a canonical order, most selective family first, then by
//!   path: exact / equals-ignore-case / cidr, then prefix / suffix / wildcard / numeric, then
//!   exists / anything-but, then `exists: false`. Ordering by selectivity rather than purely
//!   by path is what keeps `anything-but` cheap: a rule `{a: [x], b: [{anything-but: y}]}` is
//!   only looked at past `a = x`.
//! * **The automaton** is a trie of states: a transition is (leaf path, test), and all tests
//!   leaving one state on one path share a `value_matchers` index (hash map of exact values,
//!   byte tries for prefixes and reversed suffixes, case-folded variants, a shared-state NFA
//!   for wildcards, elementary segments of the numeric ranges' endpoints (per-segment lists,
//!   or a segment tree when ranges overlap heavily), per-prefix-length hash maps for CIDR,
//!   complement indexes for `anything-but`). Numbers are compared as the interpreter does:
//!   integers exactly, anything involving a float as `f64`, so `300`, `3e2` and `300.0` are
//!   equal. Conjunctions with common leading tests share states. A state that ends a
//!   conjunction accepts its rule.
//! * **The event** is flattened once into (leaf path, scalar) entries, sorted by path, for
//!   the paths some pattern mentions; everything else is skipped (from raw bytes, without
//!   being parsed into values). Each entry carries the array elements it came from, and a
//!   step may only use entries consistent with those already used (array consistency, as
//!   event-ruler's `ArrayMembership`): tests under one pattern object are satisfied inside the
//!   same element. `exists: false` is matched against the field's absent contexts (objects
//!   lacking it, places without an object above it), each with its trail, so it gets the
//!   same per-element semantics. They are worked out from contexts the flattener recorded
//!   only when a reached state tests that field for absence: `exists: false` on fields no
//!   reached state tests costs nothing per rule.
//! * **From raw bytes** ([`CompiledMatcher::matches_bytes`]) the flattener is a streaming
//!   parser driven by the path trie: mentioned values are parsed exactly as serde_json would
//!   (same number representation, escapes, UTF-8 checks), unmentioned subtrees are skipped by
//!   structure, eight bytes at a time. [`CompiledMatcher::matches_bytes_trusted`] also stops
//!   reading once every mentioned field has been seen.
//! * **Matching** is a search from the start state: for each state reached (with the array
//!   elements pinned so far, restricted to the arrays later tests still depend on, and
//!   deduplicated), look up the event's entries for each outgoing path in that path's value
//!   index. The work is proportional to the transitions actually taken, not to the rules.
//!
//! The interpreter ([`Pattern::matches`]) is the reference: this matcher gives exactly its
//! answers (checked by the shared case table and property tests).
//!
//! # Caps
//!
//! * [`MAX_WILDCARD_STARS`] stars per wildcard (checked by the pattern compiler).
//! * [`MAX_OR_EXPANSION`] conjunctions per rule after multiplying out `$or`.
//! * [`MAX_TESTS_PER_RULE`] field tests per rule, summed over its conjunctions.
//! * [`MAX_TOTAL_STATES`] states plus value-index nodes for the whole set (an upper bound
//!   computed before a rule is added).
//! * [`MAX_WILDCARD_ACTIVE_STATES`] wildcard NFA nodes active at once on one field: the
//!   first caps bound the automaton's size, this one the work per byte of a string value
//!   (checked once the set is built; every rule with a wildcard on the field is named).
//!
//! A rule over a cap is rejected at build time with a message naming the cap.

mod flatten;
mod paths;
#[cfg(test)]
mod tests;
mod value_matchers;

pub(crate) use value_matchers::Num;

use std::fmt;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use serde_json::Value;
use smallvec::SmallVec;

use self::flatten::{Absences, BytesError, Flat, flatten_bytes, flatten_event, flatten_value};
use self::paths::{Conjunction, PathTrie};
use self::value_matchers::{FieldIndex, Scalar};
use crate::rules::pattern::{Matcher, Pattern};

pub use crate::rules::pattern::MAX_WILDCARD_STARS;

/// Most conjunctions one rule may expand to once its `$or`s are multiplied out.
pub const MAX_OR_EXPANSION: usize = 256;

/// Most field tests one rule may have, summed over the conjunctions it expands to.
pub const MAX_TESTS_PER_RULE: usize = 4096;

/// Most automaton states plus value-index nodes (trie/NFA nodes, hash entries) in one set,
/// counted as an upper bound before each rule is added (about 100 bytes each at most).
pub const MAX_TOTAL_STATES: usize = 4_000_000;

/// Most wildcard NFA nodes that may be active at once on one field (of one automaton state),
/// as computed when the set is built (see the module docs). Matching a string value costs up
/// to this many steps per byte, so this bounds the wildcard work per event by the event's
/// size, whatever the number of rules. EventBridge refuses such sets too ("Rule is too
/// complex"), with its own measure. A few wildcards per field stay far below it (`*a*b*c*`
/// alone needs 7; a thousand `arn:aws:s3:::bucket-N/*.json`, whose literal heads differ, 7;
/// twenty thousand `*-N-*`, whose trailing star settles them, 9; three hundred
/// `arn:*:s3:::bucket-N/*.json`, about 1,800). Many wildcards whose middle parts can all be
/// half-matched by one value are refused: a thousand `arn:*:bucket-N/*.json` need about
/// 6,000, the audit's 2,000 `*x*y*z*q` about 5,000. The bound is generous because costly
/// matching runs on the blocking pool, off the threads that answer `/healthz`; it bounds the
/// CPU one event can cost, not availability.
pub const MAX_WILDCARD_ACTIVE_STATES: u64 = 4096;

/// Raw JSON given to [`CompiledMatcher::matches_bytes`] could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {offset}: {message}")]
pub struct MatchError {
    /// Byte offset where reading stopped.
    pub offset: usize,
    /// What was wrong.
    pub message: String,
}

/// Size of a compiled matcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MatcherStats {
    /// Rules compiled in.
    pub rules: usize,
    /// Conjunctions after `$or` expansion.
    pub sub_patterns: usize,
    /// Automaton states (including the start state).
    pub states: usize,
    /// Field transitions: (state, leaf path) pairs, each with its value index.
    pub transitions: usize,
    /// Distinct leaf field paths the flattener extracts.
    pub fields: usize,
    /// Value-index nodes (hash entries, trie, NFA and range-tree nodes).
    pub value_nodes: usize,
}

/// One automaton state: ranges into the matcher's flat arrays: a small fixed-size record per state keeps a visit
/// to a cold state down to a few cache lines.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    /// (leaf path, field index) pairs in `trans`, sorted by leaf path.
    trans: (u32, u32),
    /// The pairs of `trans` whose index has an `exists: false` test, in `trans` too: they
    /// are also looked up with the leaf's absent contexts.
    absent: (u32, u32),
    /// Rules accepted here, in `accepts`.
    accepts: (u32, u32),
    /// Path-trie nodes whose array elements tests from here on depend on, in `relevant`
    /// (sorted).
    relevant: (u32, u32),
}

/// All patterns of a rule set compiled into one automaton. Immutable, `Send + Sync`.
pub struct CompiledMatcher {
    trie: PathTrie,
    states: Vec<State>,
    trans: Vec<(u32, u32)>,
    accepts: Vec<usize>,
    relevant: Vec<u32>,
    fields: Vec<FieldIndex>,
    stats: MatcherStats,
    /// Largest [`FieldIndex::wildcard_bound`] of the set (0 without wildcard NFAs).
    wildcard_bound: u64,
}

fn range<T>(v: &[T], r: (u32, u32)) -> &[T] {
    v.get(r.0 as usize..(r.0 + r.1) as usize).unwrap_or(&[])
}

impl fmt::Debug for CompiledMatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompiledMatcher")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Array elements pinned so far: (array id, element), sorted by array id.
type Pins = SmallVec<[(u32, u32); 4]>;

/// Upper bound of the states and index nodes one conjunction adds.
fn weight(conj: &Conjunction) -> usize {
    conj.iter()
        .map(|t| {
            1 + t
                .matchers
                .iter()
                .map(|m| match m {
                    Matcher::Prefix { value, .. } | Matcher::Suffix { value, .. } => {
                        2 * value.len() + 1
                    }
                    Matcher::EqualsIgnoreCase(s) => 2 * s.len() + 1,
                    Matcher::Wildcard(w) => w.source.len() + 2,
                    Matcher::AnythingBut(_) => 64,
                    Matcher::Numeric(_) => 16,
                    Matcher::Cidr(_) => 2,
                    _ => 1,
                })
                .sum::<usize>()
        })
        .sum()
}

/// Checks one pattern against the per-rule caps ([`MAX_OR_EXPANSION`],
/// [`MAX_TESTS_PER_RULE`], and [`MAX_TOTAL_STATES`] for the rule alone), as
/// [`CompiledMatcher::build`] would, without building anything.
pub fn check_pattern(pattern: &Pattern) -> Result<(), String> {
    let mut trie = PathTrie::new();
    check_rule(&mut trie, pattern, 1).map(|_| ())
}

/// Expands one rule, applying the caps; `budget` is the weight already used by the set.
fn check_rule(
    trie: &mut PathTrie,
    p: &Pattern,
    budget: usize,
) -> Result<(Vec<Conjunction>, usize), String> {
    let Ok(conjs) = trie.add_pattern(&p.root, MAX_OR_EXPANSION) else {
        return Err(format!(
            "pattern too complex: its `$or` alternatives multiply out to more than {MAX_OR_EXPANSION} combinations (the limit)"
        ));
    };
    let tests: usize = conjs.iter().map(Vec::len).sum();
    if tests > MAX_TESTS_PER_RULE {
        return Err(format!(
            "pattern too complex: {tests} field tests once `$or` is multiplied out (the limit is {MAX_TESTS_PER_RULE})"
        ));
    }
    let w: usize = conjs.iter().map(weight).sum();
    if budget + w > MAX_TOTAL_STATES {
        return Err(if budget <= 1 {
            format!(
                "pattern too complex: it alone needs about {w} automaton states (the limit for a whole rule set is {MAX_TOTAL_STATES})"
            )
        } else {
            format!(
                "rule set too large: adding this rule would exceed {MAX_TOTAL_STATES} automaton states (split the rules or simplify patterns)"
            )
        });
    }
    Ok((conjs, w))
}

impl CompiledMatcher {
    /// A matcher without rules (matches nothing).
    pub fn empty() -> Self {
        let mut b = Builder::default();
        b.new_state();
        let mut trie = PathTrie::new();
        trie.finish();
        b.finish(trie, 0, 0)
    }

    /// Compiles `(rule index, pattern)` pairs. On failure returns every rejected rule with
    /// the reason (a cap it exceeds).
    pub fn build(patterns: &[(usize, &Pattern)]) -> Result<Self, Vec<(usize, String)>> {
        let mut trie = PathTrie::new();
        let mut errors = Vec::new();
        let mut rules: Vec<(usize, Vec<Conjunction>)> = Vec::with_capacity(patterns.len());
        let mut budget = 1usize;
        for &(idx, p) in patterns {
            match check_rule(&mut trie, p, budget) {
                Ok((conjs, w)) => {
                    budget += w;
                    rules.push((idx, conjs));
                }
                Err(msg) => errors.push((idx, msg)),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let remap = trie.finish();
        let mut b = Builder::default();
        b.new_state();
        let mut sub_patterns = 0;
        for (idx, conjs) in &mut rules {
            for conj in conjs.iter_mut() {
                for t in conj.iter_mut() {
                    t.leaf = remap[t.leaf as usize];
                }
                conj.sort_by(|a, b| (a.rank, a.leaf, &a.key).cmp(&(b.rank, b.leaf, &b.key)));
                conj.dedup_by(|a, b| a.leaf == b.leaf && a.key == b.key);
                b.add(conj, *idx);
                sub_patterns += 1;
            }
        }
        let wildcard_users = std::mem::take(&mut b.wildcard_users);
        let m = b.finish(trie, rules.len(), sub_patterns);
        let errors = m.wildcard_errors(&wildcard_users);
        if errors.is_empty() {
            Ok(m)
        } else {
            Err(errors)
        }
    }

    /// Every rule with a wildcard on a field whose NFA can have more than
    /// [`MAX_WILDCARD_ACTIVE_STATES`] nodes active at once, with the reason.
    fn wildcard_errors(&self, users: &WildcardUsers) -> Vec<(usize, String)> {
        let mut errors = Vec::new();
        let mut over: Vec<(u32, u64)> = users
            .keys()
            .filter_map(|fi| {
                let bound = self.fields.get(*fi as usize)?.wildcard_bound();
                (bound > MAX_WILDCARD_ACTIVE_STATES).then_some((*fi, bound))
            })
            .collect();
        over.sort_unstable();
        for (fi, bound) in over {
            let Some((leaf, rules)) = users.get(&fi) else {
                continue;
            };
            let field = self.trie.leaf_name(*leaf);
            let mut rules = rules.clone();
            rules.sort_unstable();
            rules.dedup();
            let others = rules.len() - 1;
            for &r in &rules {
                errors.push((
                    r,
                    format!(
                        "wildcards too complex: the wildcards on `{field}` of this rule and {others} other rule(s) (each listed) can keep up to {bound} matcher states active at once, and matching a value costs that many steps per byte (the limit is {MAX_WILDCARD_ACTIVE_STATES}); use fewer `*` per wildcard, a literal start (`abc*`) instead of a leading `*`, or a distinguishing exact test on another field"
                    ),
                ));
            }
        }
        errors.sort_by_key(|(r, _)| *r);
        errors
    }

    /// Upper bound of the matching work per byte of a string value, relative to reading it:
    /// 1 plus the most wildcard NFA nodes that can be active at once on one field. What a
    /// caller weighs an event's size with to decide whether matching it may stall a thread.
    pub fn cost_per_byte(&self) -> u64 {
        1 + self.wildcard_bound
    }

    /// Indices of the rules whose pattern matches `event`, sorted and deduplicated.
    pub fn matches(&self, event: &Value) -> Vec<usize> {
        let mut steps = 0;
        self.matches_counting(event, &mut steps)
    }

    /// [`CompiledMatcher::matches`], adding to `steps` the automaton work done: one per state
    /// visited, one per (transition, event entry) pair examined, and one per value-index probe
    /// (a hash lookup, a trie node, an NFA state per input byte, a numeric-range lookup — a
    /// binary search over the endpoints plus a leaf-to-root walk of the range tree — or a CIDR
    /// prefix length). Deterministic for a given matcher and event.
    pub fn matches_counting(&self, event: &Value, steps: &mut u64) -> Vec<usize> {
        let mut flat = Flat::default();
        flatten_value(&self.trie, event, &mut flat);
        self.run(&mut flat, steps)
    }

    /// [`CompiledMatcher::matches`] on `event.to_json()`, reading the event's fields in place.
    pub fn matches_event(&self, event: &crate::event::CloudEvent) -> Vec<usize> {
        self.matches_event_counting(event, &mut 0)
    }

    /// [`CompiledMatcher::matches_event`] with step counting as in
    /// [`CompiledMatcher::matches_counting`].
    pub fn matches_event_counting(
        &self,
        event: &crate::event::CloudEvent,
        steps: &mut u64,
    ) -> Vec<usize> {
        let mut flat = Flat::default();
        flatten_event(&self.trie, event, &mut flat);
        self.run(&mut flat, steps)
    }

    /// Like [`CompiledMatcher::matches`] on `serde_json::from_slice(json)`, reading the bytes
    /// in one streaming pass that extracts only the mentioned fields. An object repeating a
    /// mentioned key is re-read with serde_json (whose rule, last occurrence wins, applies).
    /// Unmentioned subtrees are checked for structure only (balanced, matching brackets,
    /// terminated strings), not for the validity of their scalars.
    pub fn matches_bytes(&self, json: &[u8]) -> Result<Vec<usize>, MatchError> {
        let mut steps = 0;
        self.matches_bytes_counting(json, &mut steps)
    }

    /// [`CompiledMatcher::matches_bytes`] with step counting as in
    /// [`CompiledMatcher::matches_counting`].
    pub fn matches_bytes_counting(
        &self,
        json: &[u8],
        steps: &mut u64,
    ) -> Result<Vec<usize>, MatchError> {
        self.bytes(json, steps, false)
    }

    /// [`CompiledMatcher::matches_bytes`] for input the caller knows is valid JSON without
    /// repeated keys (for example what `serde_json::to_vec` produced, or an event that ingest
    /// already parsed and re-serialised): reading stops as soon as every field some pattern
    /// mentions has been seen, so the rest of the document is neither scanned nor checked.
    /// On input that breaks the promise the answer may differ from
    /// [`CompiledMatcher::matches`] (it is never a panic).
    pub fn matches_bytes_trusted(&self, json: &[u8]) -> Result<Vec<usize>, MatchError> {
        self.bytes(json, &mut 0, true)
    }

    fn bytes(
        &self,
        json: &[u8],
        steps: &mut u64,
        stop_early: bool,
    ) -> Result<Vec<usize>, MatchError> {
        let mut flat = Flat::default();
        match flatten_bytes(&self.trie, json, &mut flat, stop_early) {
            Ok(()) => Ok(self.run(&mut flat, steps)),
            Err(BytesError::Syntax(e)) => Err(e),
            Err(BytesError::DuplicateKey) => {
                let v: Value = serde_json::from_slice(json).map_err(|e| MatchError {
                    offset: 0,
                    message: e.to_string(),
                })?;
                Ok(self.matches_counting(&v, steps))
            }
        }
    }

    /// Size of the automaton.
    pub fn stats(&self) -> MatcherStats {
        self.stats
    }

    /// The leaf field paths the flattener extracts, in sorted order (dotted; a second
    /// independent pattern object for the same field shows as `name#1`).
    pub fn fields(&self) -> Vec<String> {
        (0..self.trie.leaves.len() as u32)
            .map(|l| self.trie.leaf_name(l))
            .collect()
    }

    fn run(&self, flat: &mut Flat<'_>, steps: &mut u64) -> Vec<usize> {
        let mut out = Vec::new();
        let Some(start) = self.states.first() else {
            return out;
        };
        if start.trans.1 == 0 {
            out.extend_from_slice(range(&self.accepts, start.accepts));
            return out;
        }
        flat.entries.sort_unstable_by_key(|e| e.leaf);
        // (leaf, start, end) runs of entries.
        let mut groups: SmallVec<[(u32, u32, u32); 16]> = SmallVec::new();
        for (i, e) in flat.entries.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if g.0 == e.leaf => g.2 = i as u32 + 1,
                _ => groups.push((e.leaf, i as u32, i as u32 + 1)),
            }
        }
        let flat = &*flat;
        let mut search = Search::default();
        let mut absences = Absences::default();
        search.stack.push((0, Pins::new()));
        search.visited.insert(0, &Pins::new());
        while let Some((s, pins)) = search.stack.pop() {
            *steps += 1;
            let state = self.states[s as usize];
            out.extend_from_slice(range(&self.accepts, state.accepts));
            let trans = range(&self.trans, state.trans);
            if trans.is_empty() {
                continue;
            }
            // Walk the smaller side, binary-search the other.
            let mut pairs: SmallVec<[(u32, u32, u32); 8]> = SmallVec::new();
            if trans.len() <= groups.len() {
                for &(leaf, fi) in trans {
                    if let Ok(g) = groups.binary_search_by_key(&leaf, |g| g.0) {
                        pairs.push((fi, groups[g].1, groups[g].2));
                    }
                }
            } else {
                for &(leaf, a, b) in &groups {
                    if let Ok(t) = trans.binary_search_by_key(&leaf, |t| t.0) {
                        pairs.push((trans[t].1, a, b));
                    }
                }
            }
            let step = Step {
                pins: &pins,
                array_node: &flat.array_node,
            };
            for (fi, a, b) in pairs {
                let index = &self.fields[fi as usize];
                for e in &flat.entries[a as usize..b as usize] {
                    let trail = &flat.trails[e.trail.0 as usize..(e.trail.0 + e.trail.1) as usize];
                    search.advance(self, index, &e.value, trail, &step, steps);
                }
            }
            for &(leaf, fi) in range(&self.trans, state.absent) {
                let index = &self.fields[fi as usize];
                let (a, b) = absences.of(&self.trie, flat, leaf);
                for t in &absences.trails[a as usize..b as usize] {
                    let trail = &flat.trails[t.0 as usize..(t.0 + t.1) as usize];
                    search.advance(self, index, &Scalar::Absent, trail, &step, steps);
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// What a step from one reached (state, pins) pair needs besides the entry.
struct Step<'p> {
    /// The pinned array elements of the state being left.
    pins: &'p Pins,
    /// The path-trie node of each array id (empty when the event crosses no array of
    /// objects: nothing is pinned then).
    array_node: &'p [u32],
}

/// The search's frontier and memory.
#[derive(Default)]
struct Search {
    stack: SmallVec<[(u32, Pins); 8]>,
    visited: Visited,
    targets: SmallVec<[u32; 8]>,
}

impl Search {
    /// Follows every transition of `index` that accepts `value`, found in the element
    /// context `trail`, when that context agrees with the pins.
    fn advance(
        &mut self,
        m: &CompiledMatcher,
        index: &FieldIndex,
        value: &Scalar<'_>,
        trail: &[(u32, u32)],
        step: &Step<'_>,
        steps: &mut u64,
    ) {
        *steps += 1;
        if !consistent(trail, step.pins) {
            return;
        }
        self.targets.clear();
        let targets = &mut self.targets;
        index.lookup(value, steps, &mut |t| targets.push(t));
        if self.targets.is_empty() {
            return;
        }
        self.targets.sort_unstable();
        self.targets.dedup();
        for &t in &self.targets {
            let next = if step.array_node.is_empty() {
                Pins::new()
            } else {
                pin(
                    step.pins,
                    trail,
                    range(&m.relevant, m.states[t as usize].relevant),
                    step.array_node,
                )
            };
            if self.visited.insert(t, &next) {
                self.stack.push((t, next));
            }
        }
    }
}

/// (state, pins) pairs already reached: a short list searched linearly, a hash set once
/// it grows (most events reach a handful of states).
#[derive(Default)]
struct Visited {
    few: SmallVec<[(u32, Pins); 8]>,
    many: FxHashSet<(u32, Pins)>,
}

impl Visited {
    const FEW: usize = 16;

    /// Whether the pair is new (and records it).
    fn insert(&mut self, state: u32, pins: &Pins) -> bool {
        if self.many.is_empty() {
            if self.few.iter().any(|(s, p)| *s == state && p == pins) {
                return false;
            }
            if self.few.len() < Self::FEW {
                self.few.push((state, pins.clone()));
                return true;
            }
            self.many.extend(self.few.drain(..));
        }
        self.many.insert((state, pins.clone()))
    }
}

/// Whether an entry's trail agrees with the pinned elements on every array both mention.
fn consistent(trail: &[(u32, u32)], pins: &[(u32, u32)]) -> bool {
    if trail.is_empty() || pins.is_empty() {
        return true;
    }
    let (mut i, mut j) = (0, 0);
    while i < trail.len() && j < pins.len() {
        match trail[i].0.cmp(&pins[j].0) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                if trail[i].1 != pins[j].1 {
                    return false;
                }
                i += 1;
                j += 1;
            }
        }
    }
    true
}

/// `pins` plus `trail`, keeping only arrays at trie nodes later tests depend on.
fn pin(pins: &[(u32, u32)], trail: &[(u32, u32)], relevant: &[u32], array_node: &[u32]) -> Pins {
    let keep = |p: &(u32, u32)| {
        array_node
            .get(p.0 as usize)
            .is_some_and(|n| relevant.binary_search(n).is_ok())
    };
    let mut out = Pins::new();
    let (mut i, mut j) = (0, 0);
    while i < pins.len() || j < trail.len() {
        let take_pin = match (pins.get(i), trail.get(j)) {
            (Some(p), Some(t)) => {
                if p.0 == t.0 {
                    j += 1;
                }
                p.0 <= t.0
            }
            (Some(_), None) => true,
            (None, _) => false,
        };
        let item = if take_pin {
            i += 1;
            pins[i - 1]
        } else {
            j += 1;
            trail[j - 1]
        };
        if keep(&item) {
            out.push(item);
        }
    }
    out
}

#[derive(Default)]
struct StateBuild {
    trans: FxHashMap<u32, u32>,
    /// Leaves of `trans` tested with `exists: false`.
    absent: FxHashSet<u32>,
    children: FxHashMap<u32, FxHashMap<String, u32>>,
    accepts: Vec<usize>,
}

#[derive(Default)]
struct Builder {
    states: Vec<StateBuild>,
    fields: Vec<FieldIndex>,
    /// Field index → (leaf path, rules with a wildcard there that goes to the NFA), so a
    /// field over [`MAX_WILDCARD_ACTIVE_STATES`] can name its rules.
    wildcard_users: WildcardUsers,
}

/// Field index → (leaf path, rules with a wildcard there that goes to the NFA).
type WildcardUsers = FxHashMap<u32, (u32, Vec<usize>)>;

/// Whether a matcher puts a wildcard into a field's NFA.
fn feeds_nfa(m: &Matcher) -> bool {
    match m {
        Matcher::Wildcard(w) => value_matchers::uses_nfa(w),
        Matcher::AnythingBut(crate::rules::pattern::AnythingBut::Wildcard(list)) => {
            list.iter().any(value_matchers::uses_nfa)
        }
        _ => false,
    }
}

impl Builder {
    fn new_state(&mut self) -> u32 {
        self.states.push(StateBuild::default());
        (self.states.len() - 1) as u32
    }

    fn add(&mut self, conj: &Conjunction, rule: usize) {
        let mut s = 0u32;
        for t in conj {
            let from = s;
            let existing = self.states[s as usize]
                .children
                .get(&t.leaf)
                .and_then(|m| m.get(t.key.as_str()))
                .copied();
            s = match existing {
                Some(n) => n,
                None => {
                    let n = self.new_state();
                    let next_field = self.fields.len() as u32;
                    let st = &mut self.states[s as usize];
                    st.children
                        .entry(t.leaf)
                        .or_default()
                        .insert(t.key.clone(), n);
                    let fi = *st.trans.entry(t.leaf).or_insert(next_field);
                    if fi == next_field {
                        self.fields.push(FieldIndex::default());
                    }
                    for m in &t.matchers {
                        self.fields[fi as usize].insert(m, n);
                    }
                    if t.matchers
                        .iter()
                        .any(|m| matches!(m, Matcher::Exists(false)))
                    {
                        st.absent.insert(t.leaf);
                    }
                    n
                }
            };
            if t.matchers.iter().any(feeds_nfa)
                && let Some(&fi) = self.states[from as usize].trans.get(&t.leaf)
            {
                let users = self
                    .wildcard_users
                    .entry(fi)
                    .or_insert_with(|| (t.leaf, Vec::new()));
                users.1.push(rule);
            }
        }
        self.states[s as usize].accepts.push(rule);
    }

    fn finish(mut self, trie: PathTrie, rules: usize, sub_patterns: usize) -> CompiledMatcher {
        for f in &mut self.fields {
            f.freeze();
        }
        // Children are created after their parents: a reverse sweep sees children first.
        let mut relevant: Vec<Vec<u32>> = vec![Vec::new(); self.states.len()];
        for s in (0..self.states.len()).rev() {
            let mut set: Vec<u32> = Vec::new();
            for leaf in self.states[s].trans.keys() {
                set.extend_from_slice(&trie.leaves[*leaf as usize].chain);
            }
            for m in self.states[s].children.values() {
                for c in m.values() {
                    set.extend_from_slice(&relevant[*c as usize]);
                }
            }
            set.sort_unstable();
            set.dedup();
            relevant[s] = set;
        }
        let (mut all_trans, mut all_accepts, mut all_relevant) =
            (Vec::new(), Vec::new(), Vec::new());
        fn put<T: Copy>(all: &mut Vec<T>, items: &[T]) -> (u32, u32) {
            let start = all.len() as u32;
            all.extend_from_slice(items);
            (start, items.len() as u32)
        }
        let states: Vec<State> = self
            .states
            .into_iter()
            .zip(relevant)
            .map(|(sb, rel)| {
                let mut trans: Vec<(u32, u32)> = sb.trans.into_iter().collect();
                trans.sort_unstable();
                let absent: Vec<(u32, u32)> = trans
                    .iter()
                    .copied()
                    .filter(|(leaf, _)| sb.absent.contains(leaf))
                    .collect();
                let mut accepts = sb.accepts;
                accepts.sort_unstable();
                accepts.dedup();
                State {
                    trans: put(&mut all_trans, &trans),
                    absent: put(&mut all_trans, &absent),
                    accepts: put(&mut all_accepts, &accepts),
                    // Accepting states without transitions need no pins.
                    relevant: if trans.is_empty() && rel.is_empty() {
                        (0, 0)
                    } else {
                        put(&mut all_relevant, &rel)
                    },
                }
            })
            .collect();
        let stats = MatcherStats {
            rules,
            sub_patterns,
            states: states.len(),
            transitions: all_trans.len(),
            fields: trie.leaves.len(),
            value_nodes: self.fields.iter().map(FieldIndex::nodes).sum(),
        };
        let wildcard_bound = self
            .fields
            .iter()
            .map(FieldIndex::wildcard_bound)
            .max()
            .unwrap_or(0);
        CompiledMatcher {
            trie,
            states,
            trans: all_trans,
            accepts: all_accepts,
            relevant: all_relevant,
            fields: self.fields,
            stats,
            wildcard_bound,
        }
    }
}
