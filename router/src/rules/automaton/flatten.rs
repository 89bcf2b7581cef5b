//! Event flattening for the compiled matcher: an event (a parsed `Value`, or raw JSON bytes
//! read in one streaming pass) becomes the list of (leaf path, scalar) entries for the paths
//! some pattern mentions; every other subtree is skipped without being materialised.
//!
//! Each entry carries its *trail*: for every array of objects crossed on the way (not counting
//! an array at the leaf itself), which element it came from. Two entries can serve tests of
//! the same pattern object only if their trails agree on the arrays they share (array
//! consistency).
//!
//! Absence is not flattened into entries: with many rules testing `exists: false` on
//! different fields, an entry per absent field per object would cost rules × objects even
//! when no rule gets that far. Instead, at the object levels above such fields, the flattener
//! records each *context* (an object, with which of the relevant keys it holds, or a place
//! without an object: missing, scalar, empty array, scalar array element), at a cost bounded
//! by the event. The matcher asks [`Absences`] for a field's absent contexts only when a
//! state it reached tests that field with `exists: false`; they come with the same trails
//! as the explicit entries they replace.

use std::borrow::Cow;
use std::sync::OnceLock;

use rustc_hash::FxHashMap;
use serde_json::{Map, Value};
use smallvec::SmallVec;

use super::MatchError;
use super::paths::{PathNode, PathTrie, ROOT, Slot};
use super::value_matchers::{Num, Scalar};
use crate::event::{CloudEvent, Member};

/// Element index standing for "a context without an object" inside an array (an empty array
/// or a scalar element). No other entry can share it, which is exactly right: nothing but
/// absent fields can be found there.
const NO_OBJECT: u32 = u32::MAX;

/// serde_json refuses documents nested this deep (arrays plus objects), and so do we.
const MAX_DEPTH: u32 = 128;

/// One leaf of the flattened event.
#[derive(Debug)]
pub(crate) struct Entry<'a> {
    /// Leaf path id.
    pub(crate) leaf: u32,
    /// `(start, len)` of the trail in [`Flat::trails`].
    pub(crate) trail: (u32, u32),
    /// The value.
    pub(crate) value: Scalar<'a>,
}

/// One place of an object level above some `exists: false` field (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Context {
    /// The path-trie node (object level).
    node: u32,
    /// `(start, len)` of the place's trail in [`Flat::trails`].
    trail: (u32, u32),
    /// For an object: `(start, len)` in [`Flat::present`] of the relevant keys it holds.
    /// `None`: no object here, every field at or below this level is absent.
    present: Option<(u32, u32)>,
}

/// The flattened event. Inline capacities cover typical events without allocating.
#[derive(Debug, Default)]
pub(crate) struct Flat<'a> {
    /// Entries, in document order until the matcher sorts them by leaf.
    pub(crate) entries: SmallVec<[Entry<'a>; 16]>,
    /// Trail arena: `(array id, element index)` pairs, sorted by array id within a trail.
    pub(crate) trails: SmallVec<[(u32, u32); 16]>,
    /// The path-trie node of each array id.
    pub(crate) array_node: SmallVec<[u32; 8]>,
    /// Contexts of the object levels above `exists: false` fields, in no particular order.
    contexts: SmallVec<[Context; 4]>,
    /// Present-key arena of the contexts: (slot index, whether the key's value held a
    /// scalar), sorted by slot within one object.
    present: SmallVec<[(u32, bool); 8]>,
    /// The trail of the context being visited.
    stack: SmallVec<[(u32, u32); 8]>,
}

/// The relevant keys one object holds, gathered while it is read.
type Present = SmallVec<[(u32, bool); 8]>;

impl<'a> Flat<'a> {
    /// Stores the current context's trail once; its entries all refer to it.
    fn context_trail(&mut self) -> (u32, u32) {
        if self.stack.is_empty() {
            return (0, 0);
        }
        let start = self.trails.len() as u32;
        self.trails.extend_from_slice(&self.stack);
        (start, self.stack.len() as u32)
    }

    fn push(&mut self, leaf: u32, trail: (u32, u32), value: Scalar<'a>) {
        self.entries.push(Entry { leaf, trail, value });
    }

    /// Records an object at `node` holding the relevant keys `present`, when some field at
    /// or below the level is tested with `exists: false`.
    fn object_context(&mut self, pn: &PathNode, node: u32, trail: (u32, u32), present: &Present) {
        if !pn.absence {
            return;
        }
        let start = self.present.len() as u32;
        self.present.extend_from_slice(present);
        self.present[start as usize..].sort_unstable_by_key(|p| p.0);
        self.contexts.push(Context {
            node,
            trail,
            present: Some((start, present.len() as u32)),
        });
    }

    /// `node`'s place in the current context holds no object (missing member, scalar).
    fn no_object(&mut self, trie: &PathTrie, node: u32) {
        if trie.nodes[node as usize].absence {
            let trail = self.context_trail();
            self.contexts.push(Context {
                node,
                trail,
                present: None,
            });
        }
    }

    fn new_array(&mut self, node: u32) -> u32 {
        self.array_node.push(node);
        (self.array_node.len() - 1) as u32
    }

    /// An array at `node` offered no object (empty, or had a scalar element).
    fn no_object_element(&mut self, trie: &PathTrie, node: u32, array: u32) {
        if !trie.nodes[node as usize].absence {
            return;
        }
        self.stack.push((array, NO_OBJECT));
        self.no_object(trie, node);
        self.stack.pop();
    }
}

/// Notes a mentioned key of an object: `scalars` is whether its value held a scalar (for
/// its own leaf; the levels below record their own contexts).
fn note_present(slot: &Slot, scalars: bool, present: &mut Present) {
    if slot.absence {
        present.push((slot.index, scalars));
    }
}

/// The absent contexts of `exists: false` fields, made per field on first demand from the
/// contexts the flattener recorded, so that fields no reached state tests cost nothing.
#[derive(Debug, Default)]
pub(crate) struct Absences {
    /// Context ids sorted by node (made at the first demand).
    by_node: Vec<u32>,
    /// Trails (in [`Flat::trails`]) of the contexts where a field is absent, grouped by field.
    pub(crate) trails: Vec<(u32, u32)>,
    /// Field (leaf) → its range in `trails`.
    made: FxHashMap<u32, (u32, u32)>,
}

impl Absences {
    /// The range of `trails` holding the contexts in which `leaf` has no scalar value: the
    /// places without an object at or above its level, the objects above it lacking the key
    /// that leads to it, and the objects of its level lacking a scalar under its key.
    pub(crate) fn of(&mut self, trie: &PathTrie, flat: &Flat<'_>, leaf: u32) -> (u32, u32) {
        if let Some(r) = self.made.get(&leaf) {
            return *r;
        }
        if self.by_node.len() != flat.contexts.len() {
            self.by_node = (0..flat.contexts.len() as u32).collect();
            self.by_node
                .sort_by_key(|i| flat.contexts[*i as usize].node);
        }
        let start = self.trails.len() as u32;
        let path = trie
            .leaves
            .get(leaf as usize)
            .map_or(&[][..], |l| &l.absent_path[..]);
        for (j, &(node, slot)) in path.iter().enumerate() {
            let own_key = j + 1 == path.len();
            let from = self
                .by_node
                .partition_point(|i| flat.contexts[*i as usize].node < node);
            for i in &self.by_node[from..] {
                let c = &flat.contexts[*i as usize];
                if c.node != node {
                    break;
                }
                let absent = match c.present {
                    None => true,
                    Some((a, n)) => {
                        let keys = &flat.present[a as usize..(a + n) as usize];
                        match keys.binary_search_by_key(&slot, |p| p.0) {
                            Err(_) => true,
                            Ok(k) => own_key && !keys[k].1,
                        }
                    }
                };
                if absent {
                    self.trails.push(c.trail);
                }
            }
        }
        let r = (start, self.trails.len() as u32);
        self.made.insert(leaf, r);
        r
    }
}

// ---------------------------------------------------------------------------------------
// From a parsed Value.

/// Flattens a parsed event.
pub(crate) fn flatten_value<'a>(trie: &PathTrie, event: &'a Value, flat: &mut Flat<'a>) {
    visit_node(trie, ROOT, event, flat);
}

fn visit_node<'a>(trie: &PathTrie, node: u32, v: &'a Value, flat: &mut Flat<'a>) {
    match v {
        Value::Object(m) => visit_object(trie, node, m, flat),
        Value::Array(items) => {
            let array = flat.new_array(node);
            let (mut count, mut scalar) = (0u32, false);
            visit_elements(trie, node, array, items, &mut count, &mut scalar, flat);
            if scalar || count == 0 {
                flat.no_object_element(trie, node, array);
            }
        }
        _ => flat.no_object(trie, node),
    }
}

fn visit_elements<'a>(
    trie: &PathTrie,
    node: u32,
    array: u32,
    items: &'a [Value],
    count: &mut u32,
    scalar: &mut bool,
    flat: &mut Flat<'a>,
) {
    for item in items {
        match item {
            Value::Object(m) => {
                flat.stack.push((array, *count));
                visit_object(trie, node, m, flat);
                flat.stack.pop();
            }
            // Nested arrays are flattened into the same element sequence.
            Value::Array(inner) => {
                visit_elements(trie, node, array, inner, count, scalar, flat);
                continue;
            }
            _ => *scalar = true,
        }
        *count += 1;
    }
}

fn visit_object<'a>(trie: &PathTrie, node: u32, m: &'a Map<String, Value>, flat: &mut Flat<'a>) {
    let pn = &trie.nodes[node as usize];
    if pn.is_leafless() {
        return;
    }
    let trail = flat.context_trail();
    let mut present = Present::new();
    if pn.keys.len() < m.len() {
        for (key, slot) in pn.keys.iter().zip(&pn.slots) {
            if let Some(v) = m.get(&**key) {
                visit_slot(trie, slot, v, trail, &mut present, flat);
            }
        }
    } else {
        for (k, v) in m {
            if let Some(slot) = pn.get(k.as_bytes()) {
                visit_slot(trie, slot, v, trail, &mut present, flat);
            }
        }
    }
    flat.object_context(pn, node, trail, &present);
}

/// The member under `slot` has value `val`.
fn visit_slot<'a>(
    trie: &PathTrie,
    slot: &Slot,
    val: &'a Value,
    trail: (u32, u32),
    present: &mut Present,
    flat: &mut Flat<'a>,
) {
    let scalars = slot
        .leaf
        .is_some_and(|leaf| collect_value(leaf, val, trail, flat) > 0);
    note_present(slot, scalars, present);
    for &child in &slot.nodes {
        visit_node(trie, child, val, flat);
    }
}

// ---------------------------------------------------------------------------------------
// From a parsed CloudEvent.

/// Flattens `event.to_json()` without building it: the root object's members are read from
/// the event's fields ([`CloudEvent::member`]); below them it is [`flatten_value`].
pub(crate) fn flatten_event<'a>(trie: &PathTrie, event: &'a CloudEvent, flat: &mut Flat<'a>) {
    let pn = &trie.nodes[ROOT as usize];
    if pn.is_leafless() {
        return;
    }
    let trail = flat.context_trail();
    let mut present = Present::new();
    for (key, slot) in pn.keys.iter().zip(&pn.slots) {
        match event.member(key) {
            None => {}
            Some(Member::Json(v)) => visit_slot(trie, slot, v, trail, &mut present, flat),
            Some(Member::Str(s)) => {
                if let Some(leaf) = slot.leaf {
                    flat.push(leaf, trail, Scalar::Str(Cow::Borrowed(s)));
                }
                note_present(slot, slot.leaf.is_some(), &mut present);
                for &child in &slot.nodes {
                    flat.no_object(trie, child);
                }
            }
        }
    }
    flat.object_context(pn, ROOT, trail, &present);
}

/// Pushes every scalar of `v` (arrays flattened, objects ignored); returns how many.
fn collect_value<'a>(leaf: u32, v: &'a Value, trail: (u32, u32), flat: &mut Flat<'a>) -> u32 {
    let value = match v {
        Value::String(s) => Scalar::Str(Cow::Borrowed(s)),
        Value::Number(n) => Scalar::Num(Num::from_number(n)),
        Value::Bool(b) => Scalar::Bool(*b),
        Value::Null => Scalar::Null,
        Value::Object(_) => return 0,
        Value::Array(items) => {
            return items
                .iter()
                .map(|i| collect_value(leaf, i, trail, flat))
                .sum();
        }
    };
    flat.push(leaf, trail, value);
    1
}

// ---------------------------------------------------------------------------------------
// From raw bytes.

/// Why streaming flattening stopped.
#[derive(Debug)]
pub(crate) enum BytesError {
    /// The input is not JSON.
    Syntax(MatchError),
    /// An object repeats a key some pattern mentions; the caller re-reads the document with
    /// serde_json, whose rule (the last occurrence wins) then applies.
    DuplicateKey,
}

/// Byte classes for the structural skipper.
const SKIP_PLAIN: u8 = 0;
const SKIP_QUOTE: u8 = 1;
const SKIP_OPEN: u8 = 2;
const SKIP_CLOSE: u8 = 3;

const SKIP_CLASS: [u8; 256] = {
    let mut t = [SKIP_PLAIN; 256];
    t[b'"' as usize] = SKIP_QUOTE;
    t[b'{' as usize] = SKIP_OPEN;
    t[b'[' as usize] = SKIP_OPEN;
    t[b'}' as usize] = SKIP_CLOSE;
    t[b']' as usize] = SKIP_CLOSE;
    t
};

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// High bit set in each byte of `x` equal to `c`. Only the lowest set bit is reliable (a
/// borrow may mark higher bytes), which is all the scanners below use.
#[inline]
fn bytes_equal(x: u64, c: u8) -> u64 {
    let y = x ^ (LO * u64::from(c));
    y.wrapping_sub(LO) & !y & HI
}

#[inline]
fn word(b: &[u8], i: usize) -> Option<u64> {
    let chunk: [u8; 8] = b.get(i..i + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(chunk))
}

/// Position of the first `"` or `\\` at or after `i`, eight bytes at a time.
#[inline]
fn find_quote_or_escape(b: &[u8], mut i: usize) -> Option<usize> {
    while let Some(x) = word(b, i) {
        let m = bytes_equal(x, b'"') | bytes_equal(x, b'\\');
        if m != 0 {
            return Some(i + (m.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    let rest = b.get(i..)?;
    rest.iter()
        .position(|&c| c == b'"' || c == b'\\')
        .map(|j| i + j)
}

/// Position of the first quote or bracket at or after `i`. Setting bit 5 folds `[` onto `{`
/// and `]` onto `}`, so three comparisons per word suffice; candidates are confirmed with
/// the exact class table.
#[inline]
fn find_structural(b: &[u8], mut i: usize) -> Option<usize> {
    while let Some(x) = word(b, i) {
        let x = x | (LO * 0x20);
        let m = bytes_equal(x, b'"') | bytes_equal(x, b'{') | bytes_equal(x, b'}');
        if m == 0 {
            i += 8;
            continue;
        }
        let j = i + (m.trailing_zeros() / 8) as usize;
        if SKIP_CLASS[b[j] as usize] != SKIP_PLAIN {
            return Some(j);
        }
        i = j + 1;
    }
    let rest = b.get(i..)?;
    rest.iter()
        .position(|&c| SKIP_CLASS[c as usize] != SKIP_PLAIN)
        .map(|j| i + j)
}

/// Flattens raw JSON bytes in one pass.
///
/// Everything on a mentioned path is parsed as strictly as serde_json does (strings are
/// unescaped and UTF-8-checked, numbers get serde_json's exact representation). Subtrees no
/// pattern mentions are skipped by structure only: brackets must balance and match, strings
/// must end, nesting is limited as in serde_json, but their scalars, escapes and UTF-8 are not
/// checked.
///
/// With `stop_early`, reading ends as soon as every mentioned key of every open object has
/// been seen outside any array (nothing later can add an entry, except a repeated key or
/// invalid JSON, which the caller has ruled out).
pub(crate) fn flatten_bytes<'a>(
    trie: &PathTrie,
    json: &'a [u8],
    flat: &mut Flat<'a>,
    stop_early: bool,
) -> Result<(), BytesError> {
    let mut p = Parser {
        b: json,
        i: 0,
        depth: 0,
        trie,
        stop_early,
        pending: 0,
        done: false,
    };
    p.ws();
    p.node(ROOT, flat)?;
    if p.done {
        return Ok(());
    }
    p.ws();
    if p.i < json.len() {
        return Err(p.err("trailing characters"));
    }
    Ok(())
}

struct Parser<'a, 't> {
    b: &'a [u8],
    i: usize,
    depth: u32,
    trie: &'t PathTrie,
    /// Whether to stop once nothing more can be found (see [`flatten_bytes`]).
    stop_early: bool,
    /// Mentioned keys not yet seen in the open objects, plus one per open array at an object
    /// level (it may have more elements).
    pending: usize,
    /// Reading stopped early.
    done: bool,
}

impl<'a> Parser<'a, '_> {
    fn err(&self, message: &str) -> BytesError {
        BytesError::Syntax(MatchError {
            offset: self.i,
            message: message.to_string(),
        })
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8, what: &str) -> Result<(), BytesError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else if self.i >= self.b.len() {
            Err(self.err("EOF while parsing a value"))
        } else {
            Err(self.err(what))
        }
    }

    fn enter(&mut self) -> Result<(), BytesError> {
        self.depth += 1;
        if self.depth >= MAX_DEPTH {
            return Err(self.err("recursion limit exceeded"));
        }
        self.i += 1;
        Ok(())
    }

    /// The value at a trie node: objects are contexts, arrays offer their elements.
    fn node<'f>(&mut self, node: u32, flat: &'f mut Flat<'a>) -> Result<(), BytesError> {
        match self.peek() {
            Some(b'{') => self.object(node, flat),
            Some(b'[') => {
                let array = flat.new_array(node);
                let (mut count, mut scalar) = (0u32, false);
                self.pending += 1;
                self.elements(node, array, &mut count, &mut scalar, flat)?;
                self.pending -= 1;
                if scalar || count == 0 {
                    flat.no_object_element(self.trie, node, array);
                }
                Ok(())
            }
            _ => {
                self.skip_scalar()?;
                flat.no_object(self.trie, node);
                Ok(())
            }
        }
    }

    fn elements(
        &mut self,
        node: u32,
        array: u32,
        count: &mut u32,
        scalar: &mut bool,
        flat: &mut Flat<'a>,
    ) -> Result<(), BytesError> {
        self.enter()?;
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            self.depth -= 1;
            return Ok(());
        }
        loop {
            match self.peek() {
                Some(b'{') => {
                    flat.stack.push((array, *count));
                    self.object(node, flat)?;
                    flat.stack.pop();
                    *count += 1;
                }
                Some(b'[') => self.elements(node, array, count, scalar, flat)?,
                _ => {
                    self.skip_scalar()?;
                    *scalar = true;
                    *count += 1;
                }
            }
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    self.ws();
                }
                Some(b']') => {
                    self.i += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                None => return Err(self.err("EOF while parsing a list")),
                Some(_) => return Err(self.err("expected `,` or `]`")),
            }
        }
    }

    fn object(&mut self, node: u32, flat: &mut Flat<'a>) -> Result<(), BytesError> {
        let trie = self.trie;
        let pn = &trie.nodes[node as usize];
        if pn.is_leafless() {
            return self.skip_nested();
        }
        self.enter()?;
        self.pending += pn.keys.len();
        let trail = flat.context_trail();
        let mut seen: SmallVec<[u32; 8]> = SmallVec::new();
        let mut present = Present::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
        } else {
            loop {
                if self.peek() != Some(b'"') {
                    return Err(if self.i >= self.b.len() {
                        self.err("EOF while parsing an object")
                    } else {
                        self.err("key must be a string")
                    });
                }
                let key = self.key()?;
                self.ws();
                self.expect(b':', "expected `:`")?;
                self.ws();
                match pn.get(&key) {
                    None => self.skip_value()?,
                    Some(slot) => {
                        if seen.contains(&slot.index) {
                            return Err(BytesError::DuplicateKey);
                        }
                        seen.push(slot.index);
                        // With one consumer the key counts as seen from here, so a stop can
                        // happen inside its value; several consumers re-read it, so it stays
                        // pending until the last is done.
                        let consumers = slot.nodes.len() + usize::from(slot.leaf.is_some());
                        if consumers == 1 {
                            self.pending -= 1;
                        }
                        let start = self.i;
                        let mut scalars = false;
                        if let Some(leaf) = slot.leaf {
                            scalars = self.collect(leaf, trail, flat)? > 0;
                        }
                        note_present(slot, scalars, &mut present);
                        // A value read by several consumers (a leaf and object levels, or
                        // aliases) is re-read from its start by each.
                        for &child in &slot.nodes {
                            self.i = start;
                            self.node(child, flat)?;
                            if self.done {
                                flat.object_context(pn, node, trail, &present);
                                return Ok(());
                            }
                        }
                        if consumers != 1 {
                            self.pending -= 1;
                        }
                        if self.stop_early && self.pending == 0 {
                            self.done = true;
                            flat.object_context(pn, node, trail, &present);
                            return Ok(());
                        }
                    }
                }
                self.ws();
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        self.ws();
                    }
                    Some(b'}') => {
                        self.i += 1;
                        break;
                    }
                    None => return Err(self.err("EOF while parsing an object")),
                    Some(_) => return Err(self.err("expected `,` or `}`")),
                }
            }
        }
        self.depth -= 1;
        self.pending -= pn.keys.len() - seen.len();
        flat.object_context(pn, node, trail, &present);
        Ok(())
    }

    /// Pushes every scalar of the value (arrays flattened, objects skipped).
    fn collect(
        &mut self,
        leaf: u32,
        trail: (u32, u32),
        flat: &mut Flat<'a>,
    ) -> Result<u32, BytesError> {
        let value = match self.peek() {
            Some(b'"') => Scalar::Str(self.string()?),
            Some(b'{') => {
                self.skip_nested()?;
                return Ok(0);
            }
            Some(b'[') => {
                self.enter()?;
                self.ws();
                let mut n = 0;
                if self.peek() == Some(b']') {
                    self.i += 1;
                    self.depth -= 1;
                    return Ok(0);
                }
                loop {
                    n += self.collect(leaf, trail, flat)?;
                    self.ws();
                    match self.peek() {
                        Some(b',') => {
                            self.i += 1;
                            self.ws();
                        }
                        Some(b']') => {
                            self.i += 1;
                            self.depth -= 1;
                            return Ok(n);
                        }
                        None => return Err(self.err("EOF while parsing a list")),
                        Some(_) => return Err(self.err("expected `,` or `]`")),
                    }
                }
            }
            Some(b't') => {
                self.literal(b"true")?;
                Scalar::Bool(true)
            }
            Some(b'f') => {
                self.literal(b"false")?;
                Scalar::Bool(false)
            }
            Some(b'n') => {
                self.literal(b"null")?;
                Scalar::Null
            }
            _ => Scalar::Num(self.number()?),
        };
        flat.push(leaf, trail, value);
        Ok(1)
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), BytesError> {
        if self.b[self.i..].starts_with(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.err("expected value"))
        }
    }

    fn number_token(&mut self) -> &'a [u8] {
        let start = self.i;
        while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = self.peek() {
            self.i += 1;
        }
        &self.b[start..self.i]
    }

    /// A number with exactly the representation serde_json gives it.
    fn number(&mut self) -> Result<Num, BytesError> {
        let start = self.i;
        let tok = self.number_token();
        let (neg, digits) = match tok.split_first() {
            Some((b'-', rest)) => (true, rest),
            _ => (false, tok),
        };
        let simple = !digits.is_empty()
            && digits.len() <= 19
            && digits.iter().all(u8::is_ascii_digit)
            && (digits[0] != b'0' || digits.len() == 1);
        if simple {
            let v = digits
                .iter()
                .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0'));
            if !neg {
                return Ok(Num::Pos(v));
            }
            if v != 0 && v <= i64::MAX as u64 {
                return Ok(Num::Neg(-(v as i64)));
            }
        }
        if let Some(f) = fast_float(tok) {
            return Ok(Num::Float(f));
        }
        if tok.is_empty() {
            return Err(if self.i >= self.b.len() {
                self.err("EOF while parsing a value")
            } else {
                self.err("expected value")
            });
        }
        match serde_json::from_slice::<serde_json::Number>(tok) {
            Ok(n) => Ok(Num::from_number(&n)),
            Err(e) => Err(BytesError::Syntax(MatchError {
                offset: start,
                message: format!("invalid number: {e}"),
            })),
        }
    }

    /// An object key, as bytes to look up. Keys without escapes are not copied, nor checked
    /// for UTF-8: a mentioned key equals a pattern's (valid) key, and an unmentioned one is
    /// skipped like the rest of an unmentioned subtree.
    fn key(&mut self) -> Result<Cow<'a, [u8]>, BytesError> {
        self.i += 1;
        let start = self.i;
        let Some(end) = find_quote_or_escape(self.b, start) else {
            self.i = self.b.len();
            return Err(self.err("EOF while parsing a string"));
        };
        if self.b[end] == b'"' {
            self.i = end + 1;
            return Ok(Cow::Borrowed(&self.b[start..end]));
        }
        self.string_escaped(start)
            .map(|s| Cow::Owned(s.into_bytes()))
    }

    /// A string at a mentioned position: unescaped and checked like serde_json does.
    fn string(&mut self) -> Result<Cow<'a, str>, BytesError> {
        self.i += 1;
        let start = self.i;
        let Some(end) = find_quote_or_escape(self.b, start) else {
            self.i = self.b.len();
            return Err(self.err("EOF while parsing a string"));
        };
        let rest = &self.b[start..];
        let end = end - start;
        if rest[end] == b'"' {
            let raw = &rest[..end];
            if let Some(bad) = raw.iter().position(|c| *c < 0x20) {
                self.i = start + bad;
                return Err(self.err("control character found while parsing a string"));
            }
            self.i = start + end + 1;
            return match std::str::from_utf8(raw) {
                Ok(s) => Ok(Cow::Borrowed(s)),
                Err(_) => Err(self.err("invalid unicode code point")),
            };
        }
        self.string_escaped(start).map(Cow::Owned)
    }

    fn string_escaped(&mut self, start: usize) -> Result<String, BytesError> {
        let mut out: Vec<u8> = Vec::with_capacity(16);
        self.i = start;
        loop {
            let Some(&c) = self.b.get(self.i) else {
                return Err(self.err("EOF while parsing a string"));
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.b.get(self.i) else {
                        return Err(self.err("EOF while parsing a string"));
                    };
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'b' => out.push(0x08),
                        b'f' => out.push(0x0c),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let ch = self.unicode_escape()?;
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => return Err(self.err("invalid escape")),
                    }
                }
                c if c < 0x20 => {
                    return Err(self.err("control character found while parsing a string"));
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| self.err("invalid unicode code point"))
    }

    fn hex4(&mut self) -> Result<u32, BytesError> {
        let Some(h) = self.b.get(self.i..self.i + 4) else {
            return Err(self.err("EOF while parsing a string"));
        };
        let mut v = 0u32;
        for &c in h {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return Err(self.err("invalid escape")),
            };
            v = v * 16 + u32::from(d);
        }
        self.i += 4;
        Ok(v)
    }

    fn unicode_escape(&mut self) -> Result<char, BytesError> {
        let first = self.hex4()?;
        let code = match first {
            0xD800..=0xDBFF => {
                if self.b.get(self.i..self.i + 2) != Some(b"\\u") {
                    return Err(self.err("lone leading surrogate in hex escape"));
                }
                self.i += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(self.err("lone leading surrogate in hex escape"));
                }
                0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(self.err("lone trailing surrogate in hex escape")),
            c => c,
        };
        char::from_u32(code).ok_or_else(|| self.err("invalid unicode code point"))
    }

    // --- skipping

    fn skip_value(&mut self) -> Result<(), BytesError> {
        match self.peek() {
            Some(b'{' | b'[') => self.skip_nested(),
            Some(b'"') => {
                self.i += 1;
                self.skip_string_body()
            }
            _ => self.skip_scalar(),
        }
    }

    fn skip_scalar(&mut self) -> Result<(), BytesError> {
        match self.peek() {
            Some(b'"') => {
                self.i += 1;
                self.skip_string_body()
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => {
                self.number_token();
                Ok(())
            }
            None => Err(self.err("EOF while parsing a value")),
            Some(_) => Err(self.err("expected value")),
        }
    }

    /// After the opening quote: to just past the closing quote.
    fn skip_string_body(&mut self) -> Result<(), BytesError> {
        loop {
            match find_quote_or_escape(self.b, self.i) {
                Some(j) if self.b[j] == b'"' => {
                    self.i = j + 1;
                    return Ok(());
                }
                Some(j) => self.i = j + 2,
                None => {
                    self.i = self.b.len();
                    return Err(self.err("EOF while parsing a string"));
                }
            }
            if self.i > self.b.len() {
                self.i = self.b.len();
                return Err(self.err("EOF while parsing a string"));
            }
        }
    }

    /// Skips an object or array by structure: bracket kinds are matched with a bit stack
    /// (nesting is below 128, so a `u128` holds it).
    fn skip_nested(&mut self) -> Result<(), BytesError> {
        match skip_nested_at(self.b, self.i, self.depth) {
            Ok(end) => {
                self.i = end;
                Ok(())
            }
            Err((at, message)) => {
                self.i = at;
                Err(self.err(message))
            }
        }
    }
}

/// Skips the object or array starting at `i` by structure, returning the position after
/// it. Bracket kinds are matched with a bit stack (nesting stays below 128, so a `u128`
/// holds it). One tight loop over local state: this is the hottest code when most of an event
/// is unmentioned.
fn skip_nested_at(b: &[u8], mut i: usize, base_depth: u32) -> Result<usize, (usize, &'static str)> {
    let mut kinds: u128 = 0;
    let mut depth: u32 = 0;
    loop {
        let Some(j) = find_structural(b, i) else {
            return Err((b.len(), "EOF while parsing a value"));
        };
        i = j;
        let c = b[i];
        i += 1;
        match SKIP_CLASS[c as usize] {
            SKIP_QUOTE => {
                // Most strings here are short keys: look at the next bytes before scanning.
                loop {
                    match b.get(i) {
                        Some(b'"') => {
                            i += 1;
                            break;
                        }
                        Some(b'\\') => i += 2,
                        Some(_) => i += 1,
                        None => return Err((b.len(), "EOF while parsing a string")),
                    }
                }
            }
            SKIP_OPEN => {
                if base_depth + depth + 1 >= MAX_DEPTH {
                    return Err((i - 1, "recursion limit exceeded"));
                }
                kinds = (kinds << 1) | u128::from(c == b'{');
                depth += 1;
            }
            _ => {
                if (kinds & 1 == 1) != (c == b'}') {
                    return Err((i - 1, "mismatched bracket"));
                }
                kinds >>= 1;
                depth -= 1;
                if depth == 0 {
                    return Ok(i);
                }
            }
        }
    }
}

/// serde_json's table of powers of ten: the correctly rounded `1eN` literals.
fn pow10() -> &'static [f64; 309] {
    static TABLE: OnceLock<[f64; 309]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [1.0; 309];
        for (n, v) in t.iter_mut().enumerate() {
            *v = format!("1e{n}").parse().unwrap_or(f64::INFINITY);
        }
        t
    })
}

/// Whether [`fast_float`] reproduces serde_json in this build. serde_json's default float
/// parsing (significand as `f64`, times or divided by a power of ten) is not always correctly
/// rounded, and its `float_roundtrip` feature (which any crate in the build may enable)
/// changes it; numbers must come out exactly as `serde_json::from_slice` gives them, so this
/// is checked once on inputs where the two algorithms disagree.
fn fast_floats_agree() -> bool {
    static AGREE: OnceLock<bool> = OnceLock::new();
    *AGREE.get_or_init(|| {
        [
            "90.69845785675909",
            "8.2085083252550259",
            "-122.40490679163064",
            "1.5e-7",
        ]
        .iter()
        .all(|probe| {
            let ours = fast_float_unchecked(probe.as_bytes());
            let theirs = serde_json::from_str::<f64>(probe).ok();
            ours.map(f64::to_bits) == theirs.map(f64::to_bits)
        })
    })
}

/// A float token parsed exactly as serde_json parses it, for the common shapes (at most 19
/// significant digits, a fraction and/or a short exponent); `None` leaves it to serde_json.
pub(crate) fn fast_float(tok: &[u8]) -> Option<f64> {
    if !fast_floats_agree() {
        return None;
    }
    fast_float_unchecked(tok)
}

/// Accumulates the run of ASCII digits at `b[i..]` into `acc` (wrapping: callers reject runs
/// too long to fit), eight at a time where possible. Returns (end, acc, digits read).
#[inline]
fn digit_run(b: &[u8], mut i: usize, mut acc: u64) -> (usize, u64, usize) {
    let start = i;
    while let Some(x) = word(b, i) {
        let all_digits = (x & 0xF0F0_F0F0_F0F0_F0F0)
            | (((x.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0) >> 4)
            == 0x3333_3333_3333_3333;
        if !all_digits {
            break;
        }
        // Eight digits (first in the lowest byte) to their value, in three multiplications.
        let v = x.wrapping_sub(0x3030_3030_3030_3030);
        let v = v.wrapping_mul(10).wrapping_add(v >> 8);
        let v = ((v & 0x0000_00FF_0000_00FF)
            .wrapping_mul(100 + (1_000_000 << 32))
            .wrapping_add(((v >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32))))
            >> 32;
        acc = acc.wrapping_mul(100_000_000).wrapping_add(v);
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if !c.is_ascii_digit() {
            break;
        }
        acc = acc.wrapping_mul(10).wrapping_add(u64::from(c - b'0'));
        i += 1;
    }
    (i, acc, i - start)
}

fn fast_float_unchecked(tok: &[u8]) -> Option<f64> {
    let (positive, rest) = match tok.split_first() {
        Some((b'-', rest)) => (false, rest),
        _ => (true, tok),
    };
    let (mut i, mut significand, int_len) = digit_run(rest, 0, 0);
    // JSON: at least one integer digit, and one leading zero at most.
    if int_len == 0 || (rest[0] == b'0' && int_len > 1) {
        return None;
    }
    let mut digits = int_len;
    let mut exponent: i32 = 0;
    let mut is_float = false;
    if rest.get(i) == Some(&b'.') {
        is_float = true;
        let (end, acc, frac_len) = digit_run(rest, i + 1, significand);
        if frac_len == 0 {
            return None;
        }
        significand = acc;
        digits += frac_len;
        exponent = -(frac_len.min(400) as i32);
        i = end;
    }
    // Up to 19 digits cannot overflow (serde_json's own overflow handling then never kicks in).
    if digits > 19 {
        return None;
    }
    if let Some(b'e' | b'E') = rest.get(i) {
        is_float = true;
        i += 1;
        let negative_exp = match rest.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let (end, e, exp_len) = digit_run(rest, i, 0);
        if exp_len == 0 || exp_len > 3 {
            return None;
        }
        i = end;
        let e = e as i32;
        exponent = if negative_exp {
            exponent - e
        } else {
            exponent + e
        };
    }
    if !is_float || i != rest.len() {
        return None;
    }
    let pow = *pow10().get(exponent.unsigned_abs() as usize)?;
    let mut f = significand as f64;
    if exponent >= 0 {
        f *= pow;
        if f.is_infinite() {
            return None;
        }
    } else {
        f /= pow;
    }
    Some(if positive { f } else { -f })
}
