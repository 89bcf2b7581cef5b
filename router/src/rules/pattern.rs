//! Event patterns: the rule-match stage (after ingest and contract checks, before durable
//! fan-out) decides which rules an event satisfies with these.
//!
//! This is a direct interpreter of the complete Amazon EventBridge event-pattern language and
//! the reference semantics for any faster matcher (an automaton built from many patterns must
//! give exactly the answers of [`Pattern::matches`]).
//!
//! # Semantics
//!
//! * A pattern is a non-empty JSON object. Each key names a field of the event; its value is
//!   either a nested pattern object (for an object-valued field) or a non-empty array of
//!   matchers. All keys must match (AND); within an array any matcher may match (OR). A bare
//!   scalar, an empty array and an empty object are errors. Field names are plain names: a
//!   dot in a name is just a character.
//! * `"$or": [p1, p2, ...]` (at least two non-empty objects) may appear at any object level:
//!   the object matches when its other keys match and at least one alternative matches at the
//!   same level. Inside `$or` alternatives, matcher names (`prefix`, `numeric`, ...) and the
//!   words EventBridge reserves there (`regex`, `exactly`, `>=`, ...) cannot be used as field
//!   names (as in EventBridge, this catches misplaced matchers).
//! * At the top level of a pattern (including inside top-level `$or` alternatives),
//!   `detail-type` is read as `type` and `detail` as `data`, so EventBridge patterns work on
//!   CloudEvents.
//! * Leaf values: the values of a field are its scalar values; an array contributes all its
//!   scalar elements (nested arrays are flattened), an object contributes none. A matcher
//!   list matches when some matcher matches some value. `exists: true` matches when the field
//!   has at least one value (`null` counts); `exists: false` when it has none (missing field,
//!   object, empty array) — existence works on leaves only, as in EventBridge.
//! * Arrays of objects are matched per element (array consistency, as EventBridge's
//!   `rulesForJSONEvent`): a nested pattern matches an array when it matches at least one
//!   element, so two fields can only be matched from the same element. A non-object element
//!   (or an empty array) is an object without fields, so `exists: false` inside a nested
//!   pattern holds for it.
//! * Exact values: strings match equal strings, numbers match numerically equal numbers
//!   (`300`, `3e2` and `300.0` are equal; integers are compared exactly, also against a
//!   float: 9007199254740993 does not equal 9007199254740992.0), `true`/`false` and `null`
//!   match themselves. A string never matches a number and vice versa. A number operand
//!   (exact or in `anything-but`) past ±2^53 - 1 must be a 64-bit integer: others were read
//!   as rounded doubles and are refused.
//! * `prefix`, `suffix`, `equals-ignore-case`, `wildcard` and `cidr` match string values only;
//!   `numeric` matches number values only (compared as `f64`). Case-insensitive comparisons
//!   map every character to its Unicode lowercase (`char::to_lowercase`) on both sides.
//! * `anything-but` matches a value that none of its operands matches: string operands
//!   (values, `prefix`, `suffix`, `wildcard`, `equals-ignore-case`) only ever exclude strings
//!   and number operands only exclude (numerically equal) numbers, so e.g.
//!   `{"anything-but": "x"}` matches `5`, `true` and `null` (as in EventBridge). A missing
//!   field has no value, so `anything-but` never matches it.
//! * `wildcard`: `*` matches any run of characters (including none), `\*` is a literal star,
//!   `\\` a literal backslash; any other escape, a trailing backslash, two consecutive
//!   unescaped `*` and more than [`MAX_WILDCARD_STARS`] stars are errors.
//! * `numeric`: `[op, n]` with `op` one of `=`, `<`, `<=`, `>`, `>=`, or a lower bound then
//!   an upper bound (`[">", 0, "<=", 5]`); an empty range is an error, and so is an operand
//!   outside ±[`MAX_NUMERIC_OPERAND`] (2^53 - 1), where `f64` comparison would give inexact
//!   answers (EventBridge allows only ±5e9).
//! * `cidr`: `addr/len`, IPv4 or IPv6 (via `std::net`); host bits are ignored. Event values
//!   are parsed as IP addresses of the same family.

use std::fmt;
use std::net::IpAddr;

use serde_json::{Map, Number, Value};

/// Most unescaped `*` allowed in one wildcard. Each star multiplies the work of an automaton
/// matcher (EventBridge also limits wildcard complexity), and real patterns need few.
pub const MAX_WILDCARD_STARS: usize = 5;

/// Largest magnitude of a `numeric` operand: 2^53 - 1, up to which every integer is exact as
/// an `f64`. Ranges compare as `f64`; with operands inside this bound the answer for any
/// integer event value, however large, is the exact one (rounding is monotone, and an
/// integer on the other side of an operand inside the bound rounds to the other side of it
/// or onto a representable neighbour that still is), so `numeric: ["=", n]` and the exact
/// matcher `[n]` agree. Past it, 9007199254740993 and 9007199254740992 compare equal.
pub const MAX_NUMERIC_OPERAND: f64 = 9_007_199_254_740_991.0;

/// Matcher names; they (and [`RESERVED_IN_OR`]) cannot be field names inside `$or`
/// alternatives.
const OPERATORS: &[&str] = &[
    "prefix",
    "suffix",
    "equals-ignore-case",
    "wildcard",
    "anything-but",
    "numeric",
    "exists",
    "cidr",
];

/// Names that cannot be field names inside `$or` alternatives: the matchers, plus the words
/// aws/event-ruler reserves there (its numeric comparison signs, and operators it keeps for
/// later), so a pattern refused by EventBridge is refused here too.
const RESERVED_IN_OR: &[&str] = &[
    "exactly",
    "=",
    "<",
    "<=",
    ">",
    ">=",
    "regex",
    "not-wildcard",
    "not-equals-ignore-case",
    "date-after",
    "date-on-or-after",
    "date-before",
    "date-on-or-before",
    "in-date-range",
    "ip-address-in-range",
    "ip-address-not-in-range",
];

/// A problem in a pattern, located by a JSON pointer (RFC 6901) into the pattern as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    /// JSON pointer to the offending value inside the pattern (empty for the pattern itself).
    pub pointer: String,
    /// Human-readable explanation, naming the operator involved.
    pub message: String,
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pointer.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "at {}: {}", self.pointer, self.message)
        }
    }
}

impl std::error::Error for PatternError {}

/// A compiled event pattern (see the module docs for the semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct Pattern {
    /// The top-level object pattern, with `detail-type`/`detail` already mapped.
    pub root: ObjectPattern,
}

/// The pattern for one JSON object level.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectPattern {
    /// Field tests, all of which must hold (in pattern order).
    pub fields: Vec<FieldPattern>,
    /// The `$or` alternatives at this level (empty when there is no `$or`); when present, at
    /// least one must match the same object.
    pub any_of: Vec<ObjectPattern>,
}

/// The test on one named field of an object.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldPattern {
    /// Field name in the event (after alias mapping at the top level).
    pub name: String,
    /// What the field must satisfy.
    pub test: FieldTest,
}

/// How a field is tested.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldTest {
    /// A list of matchers, any of which may match one of the field's leaf values.
    Matchers(Vec<Matcher>),
    /// A nested pattern for an object-valued field (or array of objects).
    Object(ObjectPattern),
}

/// One matcher in a field's matcher list.
#[derive(Debug, Clone, PartialEq)]
pub enum Matcher {
    /// An exact string, number (compared numerically), boolean or `null`.
    Exact(Value),
    /// `{"prefix": "x"}` or `{"prefix": {"equals-ignore-case": "x"}}`.
    Prefix {
        /// The prefix.
        value: String,
        /// Whether the comparison ignores case.
        ignore_case: bool,
    },
    /// `{"suffix": "x"}` or `{"suffix": {"equals-ignore-case": "x"}}`.
    Suffix {
        /// The suffix.
        value: String,
        /// Whether the comparison ignores case.
        ignore_case: bool,
    },
    /// `{"equals-ignore-case": "x"}`.
    EqualsIgnoreCase(String),
    /// `{"wildcard": "a*b"}`.
    Wildcard(Wildcard),
    /// `{"anything-but": ...}`.
    AnythingBut(AnythingBut),
    /// `{"numeric": [...]}`.
    Numeric(NumericRange),
    /// `{"exists": true|false}`.
    Exists(bool),
    /// `{"cidr": "10.0.0.0/24"}`.
    Cidr(Cidr),
}

/// The operand of `anything-but`: what a value must NOT match.
#[derive(Debug, Clone, PartialEq)]
pub enum AnythingBut {
    /// One string or a list of strings (excludes equal strings).
    Strings(Vec<String>),
    /// One number or a list of numbers (excludes numerically equal numbers).
    Numbers(Vec<Number>),
    /// `{"prefix": "x" | [...]}` (excludes strings starting with any of them).
    Prefix(Vec<String>),
    /// `{"suffix": "x" | [...]}` (excludes strings ending with any of them).
    Suffix(Vec<String>),
    /// `{"equals-ignore-case": "x" | [...]}`.
    EqualsIgnoreCase(Vec<String>),
    /// `{"wildcard": "a*" | [...]}`.
    Wildcard(Vec<Wildcard>),
}

/// A parsed wildcard: literal parts between unescaped stars.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    /// The wildcard as written.
    pub source: String,
    /// Unescaped literal parts; `parts.len()` is the number of stars plus one.
    pub parts: Vec<String>,
}

/// One end of a numeric range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// The limit.
    pub value: f64,
    /// Whether the limit itself is in the range.
    pub inclusive: bool,
}

/// A numeric range; `=` is a range whose bounds are both inclusive and equal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NumericRange {
    /// Lower bound, if any.
    pub lower: Option<Bound>,
    /// Upper bound, if any.
    pub upper: Option<Bound>,
}

/// An IP network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// Network address (host bits cleared).
    pub network: IpAddr,
    /// Prefix length (0..=32 for IPv4, 0..=128 for IPv6).
    pub prefix_len: u8,
}

/// Compiles `pattern` and matches it against `event` in one go.
pub fn simple_match(pattern: &Value, event: &Value) -> Result<bool, Vec<PatternError>> {
    Ok(Pattern::compile(pattern)?.matches(event))
}

impl Pattern {
    /// Compiles a pattern, reporting every problem found (not just the first).
    pub fn compile(pattern: &Value) -> Result<Pattern, Vec<PatternError>> {
        let mut c = Compiler { errors: Vec::new() };
        let root = match pattern {
            Value::Object(map) => c.object(map, "", true, false),
            other => {
                c.err(
                    "",
                    format!("a pattern must be a JSON object, not {}", kind(other)),
                );
                ObjectPattern {
                    fields: Vec::new(),
                    any_of: Vec::new(),
                }
            }
        };
        if c.errors.is_empty() {
            Ok(Pattern { root })
        } else {
            Err(c.errors)
        }
    }

    /// Whether `event` (a structured CloudEvent, or any JSON value) matches.
    pub fn matches(&self, event: &Value) -> bool {
        match_object(&self.root, Some(event))
    }
}

impl ObjectPattern {
    /// Whether this object pattern matches `node` (an absent field is `None`).
    pub fn matches(&self, node: Option<&Value>) -> bool {
        match_object(self, node)
    }
}

impl Matcher {
    /// Whether this matcher accepts the scalar `value`. For `exists`, which tests the field
    /// rather than one value, this is `true` for `exists: true` and `false` otherwise.
    pub fn matches_value(&self, value: &Value) -> bool {
        match self {
            Matcher::Exact(want) => exact_eq(want, value),
            Matcher::Prefix {
                value: p,
                ignore_case,
            } => value.as_str().is_some_and(|s| {
                if *ignore_case {
                    fold(s).starts_with(&fold(p))
                } else {
                    s.starts_with(p.as_str())
                }
            }),
            Matcher::Suffix {
                value: p,
                ignore_case,
            } => value.as_str().is_some_and(|s| {
                if *ignore_case {
                    fold(s).ends_with(&fold(p))
                } else {
                    s.ends_with(p.as_str())
                }
            }),
            Matcher::EqualsIgnoreCase(p) => value.as_str().is_some_and(|s| fold(s) == fold(p)),
            Matcher::Wildcard(w) => value.as_str().is_some_and(|s| w.matches(s)),
            Matcher::AnythingBut(ab) => ab.matches_value(value),
            Matcher::Numeric(r) => value.as_f64().is_some_and(|n| r.contains(n)),
            Matcher::Exists(e) => *e,
            Matcher::Cidr(c) => value
                .as_str()
                .and_then(|s| s.parse::<IpAddr>().ok())
                .is_some_and(|ip| c.contains(ip)),
        }
    }
}

impl AnythingBut {
    /// Whether the scalar `value` is NOT excluded.
    pub fn matches_value(&self, value: &Value) -> bool {
        match (self, value) {
            (AnythingBut::Numbers(ns), Value::Number(v)) => !ns.iter().any(|n| num_eq(n, v)),
            (AnythingBut::Numbers(_), _) => true,
            (_, Value::String(s)) => match self {
                AnythingBut::Strings(list) => !list.iter().any(|x| x == s),
                AnythingBut::Prefix(list) => !list.iter().any(|p| s.starts_with(p.as_str())),
                AnythingBut::Suffix(list) => !list.iter().any(|p| s.ends_with(p.as_str())),
                AnythingBut::EqualsIgnoreCase(list) => {
                    let f = fold(s);
                    !list.iter().any(|x| fold(x) == f)
                }
                AnythingBut::Wildcard(list) => !list.iter().any(|w| w.matches(s)),
                AnythingBut::Numbers(_) => true,
            },
            // String operands never exclude numbers, booleans or null.
            _ => true,
        }
    }
}

impl Wildcard {
    /// Parses a wildcard (`*` any run, `\*` literal star, `\\` literal backslash).
    pub fn parse(source: &str) -> Result<Wildcard, String> {
        let mut parts = vec![String::new()];
        let mut chars = source.chars();
        let mut last_was_star = false;
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    match chars.next() {
                        Some(e @ ('*' | '\\')) => {
                            if let Some(p) = parts.last_mut() {
                                p.push(e);
                            }
                        }
                        Some(other) => {
                            return Err(format!(
                                "wildcard `{source}`: invalid escape `\\{other}` (only `\\*` and `\\\\` are allowed)"
                            ));
                        }
                        None => {
                            return Err(format!(
                                "wildcard `{source}`: a trailing backslash must be escaped as `\\\\`"
                            ));
                        }
                    }
                    last_was_star = false;
                }
                '*' => {
                    if last_was_star {
                        return Err(format!(
                            "wildcard `{source}`: consecutive `*` are not allowed"
                        ));
                    }
                    parts.push(String::new());
                    last_was_star = true;
                }
                other => {
                    if let Some(p) = parts.last_mut() {
                        p.push(other);
                    }
                    last_was_star = false;
                }
            }
        }
        if parts.len() - 1 > MAX_WILDCARD_STARS {
            return Err(format!(
                "wildcard `{source}`: at most {MAX_WILDCARD_STARS} `*` are allowed"
            ));
        }
        Ok(Wildcard {
            source: source.to_string(),
            parts,
        })
    }

    /// Whether `s` matches this wildcard.
    pub fn matches(&self, s: &str) -> bool {
        let Some((first, rest)) = self.parts.split_first() else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return s == first;
        };
        if s.len() < first.len() + last.len() || !s.starts_with(first.as_str()) {
            return false;
        }
        if !s.ends_with(last.as_str()) {
            return false;
        }
        // Both ends fit without overlapping; the middle parts are found greedily, leftmost
        // first, which is optimal for literals separated by stars.
        let mut window = &s[first.len()..s.len() - last.len()];
        for part in middle {
            match window.find(part.as_str()) {
                Some(i) => window = &window[i + part.len()..],
                None => return false,
            }
        }
        true
    }
}

impl NumericRange {
    /// Whether `n` lies in the range.
    pub fn contains(&self, n: f64) -> bool {
        let lower_ok = self.lower.is_none_or(|b| {
            if b.inclusive {
                n >= b.value
            } else {
                n > b.value
            }
        });
        let upper_ok = self.upper.is_none_or(|b| {
            if b.inclusive {
                n <= b.value
            } else {
                n < b.value
            }
        });
        lower_ok && upper_ok
    }
}

impl Cidr {
    /// Parses `addr/len` (IPv4 or IPv6); host bits are cleared.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let Some((addr, len)) = s.split_once('/') else {
            return Err(format!(
                "cidr `{s}` must be `address/prefix-length`, e.g. 10.0.0.0/24"
            ));
        };
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| format!("cidr `{s}`: `{addr}` is not an IP address"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let prefix_len: u8 = match len.parse::<u8>() {
            Ok(l) if l <= max && !len.starts_with('+') => l,
            _ => {
                return Err(format!(
                    "cidr `{s}`: prefix length must be a number from 0 to {max}"
                ));
            }
        };
        let network = match ip {
            IpAddr::V4(a) => IpAddr::V4((u32::from(a) & mask32(prefix_len)).into()),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) & mask128(prefix_len)).into()),
        };
        Ok(Cidr {
            network,
            prefix_len,
        })
    }

    /// Whether `ip` is inside the network (families must agree).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                u32::from(a) & mask32(self.prefix_len) == u32::from(n)
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                u128::from(a) & mask128(self.prefix_len) == u128::from(n)
            }
            _ => false,
        }
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0)
}

/// Case folding used by every case-insensitive matcher.
fn fold(s: &str) -> String {
    s.chars().flat_map(char::to_lowercase).collect()
}

/// Numbers that are integers compare as exact integers, whichever representation they were
/// read into (`300`, `300.0`, `3e2`); fractions compare as `f64`.
fn num_eq(a: &Number, b: &Number) -> bool {
    use crate::rules::automaton::Num;
    match (
        Num::from_number(a).exact_int(),
        Num::from_number(b).exact_int(),
    ) {
        (Some(x), Some(y)) => x == y,
        (None, None) => matches!((a.as_f64(), b.as_f64()), (Some(x), Some(y)) if x == y),
        _ => false,
    }
}

fn exact_eq(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Number(a), Value::Number(b)) => num_eq(a, b),
        (Value::String(a), Value::String(b)) => a == b,
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        _ => false,
    }
}

fn match_object(p: &ObjectPattern, node: Option<&Value>) -> bool {
    match node {
        Some(Value::Array(items)) => {
            let mut elements = Vec::new();
            flatten(items, &mut elements);
            if elements.is_empty() {
                return match_fields(p, None);
            }
            elements.into_iter().any(|e| match e {
                Value::Object(m) => match_fields(p, Some(m)),
                _ => match_fields(p, None),
            })
        }
        Some(Value::Object(m)) => match_fields(p, Some(m)),
        _ => match_fields(p, None),
    }
}

fn flatten<'a>(items: &'a [Value], out: &mut Vec<&'a Value>) {
    for item in items {
        match item {
            Value::Array(inner) => flatten(inner, out),
            other => out.push(other),
        }
    }
}

fn match_fields(p: &ObjectPattern, obj: Option<&Map<String, Value>>) -> bool {
    let fields_ok = p.fields.iter().all(|f| {
        let v = obj.and_then(|m| m.get(&f.name));
        match &f.test {
            FieldTest::Object(inner) => match_object(inner, v),
            FieldTest::Matchers(ms) => match_leaf(ms, v),
        }
    });
    fields_ok && (p.any_of.is_empty() || p.any_of.iter().any(|alt| match_fields(alt, obj)))
}

fn collect_leaves<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    match v {
        Value::Array(items) => items.iter().for_each(|i| collect_leaves(i, out)),
        Value::Object(_) => {}
        scalar => out.push(scalar),
    }
}

fn match_leaf(ms: &[Matcher], v: Option<&Value>) -> bool {
    let mut leaves = Vec::new();
    if let Some(v) = v {
        collect_leaves(v, &mut leaves);
    }
    ms.iter().any(|m| match m {
        Matcher::Exists(want) => *want != leaves.is_empty(),
        other => leaves.iter().any(|l| other.matches_value(l)),
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Appends one reference token to a JSON pointer.
/// What to say of a matcher written as a field name, `{"state": {"anything-but": "init"}}`
/// (`ptr` is the pointer of the object holding it): the matcher object belongs in the
/// field's list. Telling the writer to wrap the operand instead (`{"anything-but":
/// ["init"]}`) led to a pattern that is valid and tests a field named `anything-but`.
fn misplaced_matcher(ptr: &str, key: &str, value: &Value) -> String {
    let field = ptr
        .rsplit('/')
        .next()
        .filter(|f| !f.is_empty())
        .map_or_else(
            || "<field>".to_string(),
            |f| f.replace("~1", "/").replace("~0", "~"),
        );
    let mut matcher = Map::new();
    matcher.insert(key.to_string(), value.clone());
    format!(
        "`{key}` is a matcher, not a field name: a matcher object goes in the field's list, write {}: [{}]",
        Value::String(field),
        Value::Object(matcher)
    )
}

/// Warnings about a pattern that compiles: a matcher's name used as a field name outside
/// `$or` (`{"n": {"numeric": [">", 0]}}`). EventBridge reads it as a field name too, so it
/// is valid, but it tests a field called `numeric` and matches nothing its writer meant.
/// (Inside `$or` it is an error, as in EventBridge.)
pub fn warnings(pattern: &Value) -> Vec<PatternError> {
    fn walk(v: &Value, ptr: &str, out: &mut Vec<PatternError>) {
        let Value::Object(map) = v else { return };
        for (key, value) in map {
            // Under `$or` a matcher's name is already an error.
            if key == "$or" {
                continue;
            }
            let p = pointer_push(ptr, key);
            if OPERATORS.contains(&key.as_str()) {
                out.push(PatternError {
                    pointer: p.clone(),
                    message: format!(
                        "{} (as written, this tests a field named `{key}`)",
                        misplaced_matcher(ptr, key, value)
                    ),
                });
            }
            walk(value, &p, out);
        }
    }
    let mut out = Vec::new();
    walk(pattern, "", &mut out);
    out
}

pub(crate) fn pointer_push(base: &str, token: &str) -> String {
    format!("{base}/{}", crate::event::pointer_token(token))
}

struct Compiler {
    errors: Vec<PatternError>,
}

impl Compiler {
    fn err(&mut self, pointer: &str, message: impl Into<String>) {
        self.errors.push(PatternError {
            pointer: pointer.to_string(),
            message: message.into(),
        });
    }

    fn object(
        &mut self,
        map: &Map<String, Value>,
        ptr: &str,
        top: bool,
        in_or: bool,
    ) -> ObjectPattern {
        let mut out = ObjectPattern {
            fields: Vec::new(),
            any_of: Vec::new(),
        };
        if map.is_empty() {
            self.err(ptr, "an empty object is not allowed in a pattern");
        }
        for (key, value) in map {
            let p = pointer_push(ptr, key);
            if key == "$or" {
                out.any_of = self.or(value, &p, top);
                continue;
            }
            let reserved = if OPERATORS.contains(&key.as_str()) {
                "is a matcher and cannot be a field name inside `$or`; put it in a field's matcher list"
            } else if RESERVED_IN_OR.contains(&key.as_str()) {
                "is a reserved word and cannot be a field name inside `$or` (EventBridge refuses it too)"
            } else {
                ""
            };
            if in_or && !reserved.is_empty() {
                self.err(&p, format!("`{key}` {reserved}"));
                continue;
            }
            let name = match (top, key.as_str()) {
                (true, "detail-type") => "type".to_string(),
                (true, "detail") => "data".to_string(),
                _ => key.clone(),
            };
            let test = match value {
                Value::Object(inner) => FieldTest::Object(self.object(inner, &p, false, in_or)),
                Value::Array(items) => FieldTest::Matchers(self.matchers(items, &p)),
                other if OPERATORS.contains(&key.as_str()) => {
                    self.err(&p, misplaced_matcher(ptr, key, other));
                    continue;
                }
                other => {
                    self.err(
                        &p,
                        format!(
                            "field `{key}` must be a nested pattern object or an array of matchers, not {} (write [{}])",
                            kind(other),
                            other
                        ),
                    );
                    continue;
                }
            };
            out.fields.push(FieldPattern { name, test });
        }
        out
    }

    fn or(&mut self, value: &Value, ptr: &str, top: bool) -> Vec<ObjectPattern> {
        let Value::Array(alts) = value else {
            self.err(
                ptr,
                format!(
                    "`$or` needs an array of at least 2 pattern objects, not {}",
                    kind(value)
                ),
            );
            return Vec::new();
        };
        if alts.len() < 2 {
            self.err(ptr, "`$or` needs at least 2 pattern objects");
        }
        let mut out = Vec::new();
        for (i, alt) in alts.iter().enumerate() {
            let p = pointer_push(ptr, &i.to_string());
            match alt {
                Value::Object(m) => out.push(self.object(m, &p, top, true)),
                other => self.err(
                    &p,
                    format!(
                        "`$or` alternatives must be pattern objects, not {}",
                        kind(other)
                    ),
                ),
            }
        }
        out
    }

    fn matchers(&mut self, items: &[Value], ptr: &str) -> Vec<Matcher> {
        if items.is_empty() {
            self.err(ptr, "an empty matcher array is not allowed");
        }
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let p = pointer_push(ptr, &i.to_string());
            match item {
                Value::Array(_) => self.err(&p, "a matcher cannot be an array"),
                Value::Object(m) => {
                    if let Some(matcher) = self.matcher_object(m, &p) {
                        out.push(matcher);
                    }
                }
                Value::Number(n) if !self.exact_number(n, &p) => {}
                scalar => out.push(Matcher::Exact(scalar.clone())),
            }
        }
        out
    }

    /// Whether `n` can be matched exactly; refuses it where it is written when not: a
    /// number past ±2^53 - 1 that is not a 64-bit integer was read as a rounded double, so
    /// it would equal the numbers near it (123456789012345678901234567890 would match
    /// ...891, and an `anything-but` of it would drop that one). EventBridge compares such
    /// numbers by their digits.
    fn exact_number(&mut self, n: &Number, ptr: &str) -> bool {
        let too_large = matches!(
            crate::rules::automaton::Num::from_number(n),
            crate::rules::automaton::Num::Float(x) if x.abs() > MAX_NUMERIC_OPERAND
        );
        if too_large {
            self.err(
                ptr,
                format!(
                    "this number cannot be matched exactly (it reads as the double {n}): past ±{MAX_NUMERIC_OPERAND} (2^53 - 1) only 64-bit integers (from -9223372036854775808 to 18446744073709551615) keep their digits, other numbers are rounded and would equal their neighbours; send such values as strings and match them as strings"
                ),
            );
        }
        !too_large
    }

    fn matcher_object(&mut self, m: &Map<String, Value>, ptr: &str) -> Option<Matcher> {
        let mut entries = m.iter();
        let (Some((op, arg)), None) = (entries.next(), entries.next()) else {
            let keys: Vec<&str> = m.keys().map(String::as_str).collect();
            self.err(
                ptr,
                format!(
                    "a matcher object must have exactly one key (an operator), found {} ({})",
                    m.len(),
                    keys.join(", ")
                ),
            );
            return None;
        };
        let p = pointer_push(ptr, op);
        let res = match op.as_str() {
            "prefix" | "suffix" => self.affix(op, arg, &p),
            "equals-ignore-case" => match arg {
                Value::String(s) => Ok(Matcher::EqualsIgnoreCase(s.clone())),
                other => Err(format!(
                    "`equals-ignore-case` needs a string, not {}",
                    kind(other)
                )),
            },
            "wildcard" => match arg {
                Value::String(s) => Wildcard::parse(s).map(Matcher::Wildcard),
                other => Err(format!("`wildcard` needs a string, not {}", kind(other))),
            },
            "anything-but" => self.anything_but(arg, &p).map(Matcher::AnythingBut),
            "numeric" => self.numeric(arg, &p).map(Matcher::Numeric),
            "exists" => match arg {
                Value::Bool(b) => Ok(Matcher::Exists(*b)),
                other => Err(format!("`exists` needs true or false, not {}", kind(other))),
            },
            "cidr" => match arg {
                Value::String(s) => Cidr::parse(s).map(Matcher::Cidr),
                other => Err(format!("`cidr` needs a string, not {}", kind(other))),
            },
            other => Err(format!(
                "unknown operator `{other}` (expected one of: {})",
                OPERATORS.join(", ")
            )),
        };
        match res {
            Ok(m) => Some(m),
            Err(msg) => {
                // Errors inside the operand were already reported with a finer pointer.
                if !msg.is_empty() {
                    self.err(&p, msg);
                }
                None
            }
        }
    }

    /// `prefix` / `suffix`: a string or `{"equals-ignore-case": string}`.
    fn affix(&mut self, op: &str, arg: &Value, ptr: &str) -> Result<Matcher, String> {
        let (value, ignore_case) = match arg {
            Value::String(s) => (s.clone(), false),
            Value::Object(m) if m.len() == 1 => match m.get("equals-ignore-case") {
                Some(Value::String(s)) => (s.clone(), true),
                Some(other) => {
                    self.err(
                        &pointer_push(ptr, "equals-ignore-case"),
                        format!(
                            "`{op}` / `equals-ignore-case` needs a string, not {}",
                            kind(other)
                        ),
                    );
                    return Err(String::new());
                }
                None => {
                    let key = m.keys().next().map(String::as_str).unwrap_or_default();
                    return Err(format!(
                        "`{op}` supports only `equals-ignore-case` inside an object, not `{key}`"
                    ));
                }
            },
            other => {
                return Err(format!(
                    "`{op}` needs a string or {{\"equals-ignore-case\": string}}, not {}",
                    kind(other)
                ));
            }
        };
        Ok(if op == "prefix" {
            Matcher::Prefix { value, ignore_case }
        } else {
            Matcher::Suffix { value, ignore_case }
        })
    }

    fn anything_but(&mut self, arg: &Value, ptr: &str) -> Result<AnythingBut, String> {
        match arg {
            Value::String(s) => Ok(AnythingBut::Strings(vec![s.clone()])),
            Value::Number(n) if !self.exact_number(n, ptr) => Err(String::new()),
            Value::Number(n) => Ok(AnythingBut::Numbers(vec![n.clone()])),
            Value::Array(items) => {
                if items.is_empty() {
                    return Err("`anything-but` needs a non-empty list".to_string());
                }
                let mut strings = Vec::new();
                let mut numbers = Vec::new();
                let mut bad = false;
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) => strings.push(s.clone()),
                        Value::Number(n) => {
                            bad |= !self.exact_number(n, &pointer_push(ptr, &i.to_string()));
                            numbers.push(n.clone());
                        }
                        other => {
                            self.err(
                                &pointer_push(ptr, &i.to_string()),
                                format!(
                                    "`anything-but` lists may hold only strings or only numbers, not {}",
                                    kind(other)
                                ),
                            );
                            bad = true;
                        }
                    }
                }
                if bad {
                    return Err(String::new());
                }
                match (strings.is_empty(), numbers.is_empty()) {
                    (false, true) => Ok(AnythingBut::Strings(strings)),
                    (true, false) => Ok(AnythingBut::Numbers(numbers)),
                    _ => Err(
                        "`anything-but` list mixes strings and numbers; use one type".to_string(),
                    ),
                }
            }
            Value::Object(m) => {
                let mut entries = m.iter();
                let (Some((op, inner)), None) = (entries.next(), entries.next()) else {
                    return Err(format!(
                        "`anything-but` object must have exactly one key (prefix, suffix, wildcard or equals-ignore-case), found {}",
                        m.len()
                    ));
                };
                let p = pointer_push(ptr, op);
                let res = match (op.as_str(), inner) {
                    ("prefix" | "suffix", _) => self
                        .string_list(&format!("anything-but` / `{op}"), inner, &p)
                        .and_then(|list| {
                            if list.iter().any(String::is_empty) {
                                return Err(format!("`anything-but` / `{op}` must not be empty"));
                            }
                            Ok(if op == "prefix" {
                                AnythingBut::Prefix(list)
                            } else {
                                AnythingBut::Suffix(list)
                            })
                        }),
                    ("equals-ignore-case", _) => self
                        .string_list("anything-but` / `equals-ignore-case", inner, &p)
                        .map(AnythingBut::EqualsIgnoreCase),
                    ("wildcard", _) => self
                        .string_list("anything-but` / `wildcard", inner, &p)
                        .and_then(|list| {
                            let mut out = Vec::new();
                            for s in &list {
                                out.push(Wildcard::parse(s)?);
                            }
                            Ok(AnythingBut::Wildcard(out))
                        }),
                    (other, _) => Err(format!(
                        "unknown `anything-but` operator `{other}` (expected prefix, suffix, wildcard or equals-ignore-case)"
                    )),
                };
                res.map_err(|msg| {
                    if !msg.is_empty() {
                        self.err(&p, msg);
                    }
                    String::new()
                })
            }
            other => Err(format!(
                "`anything-but` needs a string, a number, a list of strings or numbers, or an object with prefix, suffix, wildcard or equals-ignore-case; not {}",
                kind(other)
            )),
        }
    }

    /// A string or a non-empty list of strings.
    fn string_list(&mut self, what: &str, v: &Value, ptr: &str) -> Result<Vec<String>, String> {
        match v {
            Value::String(s) => Ok(vec![s.clone()]),
            Value::Array(items) if !items.is_empty() => {
                let mut out = Vec::new();
                let mut bad = false;
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) => out.push(s.clone()),
                        other => {
                            self.err(
                                &pointer_push(ptr, &i.to_string()),
                                format!("`{what}` list may hold only strings, not {}", kind(other)),
                            );
                            bad = true;
                        }
                    }
                }
                if bad { Err(String::new()) } else { Ok(out) }
            }
            Value::Array(_) => Err(format!("`{what}` needs a non-empty list")),
            other => Err(format!(
                "`{what}` needs a string or a list of strings, not {}",
                kind(other)
            )),
        }
    }

    fn numeric(&mut self, arg: &Value, ptr: &str) -> Result<NumericRange, String> {
        const USAGE: &str = "`numeric` needs [op, number] or [\">\"|\">=\", number, \"<\"|\"<=\", number], with op one of =, <, <=, >, >=";
        let Value::Array(items) = arg else {
            return Err(format!("{USAGE}; got {}", kind(arg)));
        };
        if items.len() != 2 && items.len() != 4 {
            return Err(format!("{USAGE}; got {} elements", items.len()));
        }
        let mut bad = false;
        let mut comparisons = Vec::new();
        for (i, pair) in items.chunks(2).enumerate() {
            let op_ptr = pointer_push(ptr, &(2 * i).to_string());
            let val_ptr = pointer_push(ptr, &(2 * i + 1).to_string());
            let op = match &pair[0] {
                Value::String(s) if matches!(s.as_str(), "=" | "<" | "<=" | ">" | ">=") => {
                    Some(s.as_str())
                }
                Value::String(s) => {
                    self.err(
                        &op_ptr,
                        format!("`numeric`: unknown comparison `{s}` (expected =, <, <=, >, >=)"),
                    );
                    None
                }
                other => {
                    self.err(
                        &op_ptr,
                        format!(
                            "`numeric`: expected a comparison operator string, not {}",
                            kind(other)
                        ),
                    );
                    None
                }
            };
            let value = match pair.get(1).and_then(Value::as_f64) {
                Some(v) if v.abs() > MAX_NUMERIC_OPERAND => {
                    self.err(
                        &val_ptr,
                        format!(
                            "`numeric`: {} is outside ±{MAX_NUMERIC_OPERAND} (2^53 - 1): beyond it numbers are compared as rounded doubles, and 9007199254740993 would equal 9007199254740992 (EventBridge allows ±5e9); match such values exactly, e.g. [9007199254740993]",
                            pair.get(1).map(Value::to_string).unwrap_or_default()
                        ),
                    );
                    None
                }
                Some(v) => Some(v),
                None => {
                    let got = pair.get(1).map_or("nothing", kind);
                    self.err(
                        &val_ptr,
                        format!(
                            "`numeric`: the value after `{}` must be a number, not {got}",
                            op.unwrap_or("the operator")
                        ),
                    );
                    None
                }
            };
            match (op, value) {
                (Some(op), Some(v)) => comparisons.push((op, v, op_ptr)),
                _ => bad = true,
            }
        }
        if bad {
            return Err(String::new());
        }
        let bound = |v: f64, inclusive: bool| {
            Some(Bound {
                value: v,
                inclusive,
            })
        };
        let mut range = NumericRange {
            lower: None,
            upper: None,
        };
        match comparisons.as_slice() {
            [("=", v, _)] => {
                range.lower = bound(*v, true);
                range.upper = bound(*v, true);
            }
            [(op @ ("<" | "<="), v, _)] => range.upper = bound(*v, *op == "<="),
            [(op @ (">" | ">="), v, _)] => range.lower = bound(*v, *op == ">="),
            [(lo @ (">" | ">="), a, _), (hi @ ("<" | "<="), b, _)] => {
                range.lower = bound(*a, *lo == ">=");
                range.upper = bound(*b, *hi == "<=");
                let empty = a > b || (a == b && (*lo == ">" || *hi == "<"));
                if empty {
                    return Err(format!("`numeric` range [{lo} {a}, {hi} {b}] is empty"));
                }
            }
            [(first, _, p), _] if !matches!(*first, ">" | ">=") => {
                self.err(
                    p,
                    format!(
                        "`numeric`: a two-sided range starts with the lower bound (`>` or `>=`), not `{first}`"
                    ),
                );
                return Err(String::new());
            }
            [_, (second, _, p)] => {
                self.err(
                    p,
                    format!(
                        "`numeric`: the second comparison must be an upper bound (`<` or `<=`), not `{second}`"
                    ),
                );
                return Err(String::new());
            }
            _ => return Err(USAGE.to_string()),
        }
        Ok(range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn parse(s: &str) -> Value {
        match serde_json::from_str(s) {
            Ok(v) => v,
            Err(e) => panic!("bad JSON in test table: {s}: {e}"),
        }
    }

    /// The audit's inexact answers came from operands past 2^53; they are refused where they
    /// are written, and the largest exact operands still compile.
    #[test]
    fn numeric_operands_past_2_pow_53_are_refused_with_their_pointer() {
        for (pattern, pointer) in [
            (
                json!({"n": [{"numeric": ["=", 9_007_199_254_740_993u64]}]}),
                "/n/0/numeric/1",
            ),
            (
                json!({"n": [{"numeric": [">", 9_007_199_254_740_992u64]}]}),
                "/n/0/numeric/1",
            ),
            (
                json!({"n": [{"numeric": ["=", 1_234_567_890_123_456_789u64]}]}),
                "/n/0/numeric/1",
            ),
            (
                json!({"n": [{"numeric": [">", 0, "<", 1e300]}]}),
                "/n/0/numeric/3",
            ),
            (
                json!({"n": [{"numeric": ["<", -9_007_199_254_740_992i64]}]}),
                "/n/0/numeric/1",
            ),
        ] {
            let errors = Pattern::compile(&pattern).expect_err("refused");
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].pointer, pointer);
            assert!(errors[0].message.contains("2^53"), "{}", errors[0].message);
        }
        for ok in [
            json!({"n": [{"numeric": ["=", 9_007_199_254_740_991u64]}]}),
            json!({"n": [{"numeric": [">=", -9_007_199_254_740_991i64, "<", 9.0e15]}]}),
            json!({"n": [{"numeric": [">", 1.7e12]}]}),
        ] {
            assert!(Pattern::compile(&ok).is_ok(), "{ok}");
        }
    }

    /// An exact number past 2^53 that is not a 64-bit integer was read as a rounded double:
    /// refused where it is written (exact and `anything-but`), as the audit's
    /// `[123456789012345678901234567890]` matched ...891. 64-bit integers stay exact.
    #[test]
    fn exact_numbers_that_lost_their_digits_are_refused() {
        for (pattern, pointer) in [
            (r#"{"n": [123456789012345678901234567890]}"#, "/n/0"),
            (r#"{"n": ["a", 1e20]}"#, "/n/1"),
            (r#"{"n": [-9223372036854775809]}"#, "/n/0"),
            (
                r#"{"n": [{"anything-but": 18446744073709551616}]}"#,
                "/n/0/anything-but",
            ),
            (
                r#"{"n": [{"anything-but": [1, 9007199254740993.0]}]}"#,
                "/n/0/anything-but/1",
            ),
        ] {
            let errors = Pattern::compile(&parse(pattern)).expect_err(pattern);
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].pointer, pointer, "{pattern}");
            assert!(
                errors[0].message.contains("cannot be matched exactly"),
                "{}",
                errors[0].message
            );
        }
        for ok in [
            r#"{"n": [18446744073709551615, -9223372036854775808, 9007199254740991.0]}"#,
            r#"{"n": [{"anything-but": [9007199254740993, 1.5e15, -2.5]}]}"#,
            r#"{"n": [{"numeric": [">", 0]}, 1e-300]}"#,
        ] {
            assert!(Pattern::compile(&parse(ok)).is_ok(), "{ok}");
        }
    }

    /// A matcher written as a field name: the error shows the matcher object inside the
    /// field's list (it showed the operand wrapped, a valid pattern testing a field named
    /// `anything-but`), and where the form is valid (an array or object under it) a warning
    /// says what it tests. Inside `$or` it stays an error (not a warning as well).
    #[test]
    fn a_matcher_written_as_a_field_name_is_explained() {
        let errors = Pattern::compile(&json!({"data": {"state": {"anything-but": "init"}}}))
            .expect_err("refused");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].pointer, "/data/state/anything-but");
        assert!(
            errors[0]
                .message
                .contains(r#"write "state": [{"anything-but":"init"}]"#),
            "{}",
            errors[0].message
        );
        let errors = Pattern::compile(&json!({"exists": true})).expect_err("refused at the top");
        assert!(
            errors[0]
                .message
                .contains(r#""<field>": [{"exists":true}]"#),
            "{}",
            errors[0].message
        );

        let valid = json!({"data": {"n": {"numeric": [">", 0]}, "s": {"anything-but": ["a"]}},
                           "$or": [{"a": ["x"]}, {"b": ["y"]}], "exists": {"x": ["y"]}});
        assert!(Pattern::compile(&valid).is_ok());
        let w = warnings(&valid);
        let pointers: Vec<&str> = w.iter().map(|w| w.pointer.as_str()).collect();
        assert_eq!(
            pointers,
            ["/data/n/numeric", "/data/s/anything-but", "/exists"]
        );
        assert!(
            w[0].message.contains(r#"write "n": [{"numeric":[">",0]}]"#),
            "{}",
            w[0].message
        );
        assert!(
            w[2].message
                .contains(r#"write "<field>": [{"exists":{"x":["y"]}}]"#),
            "{}",
            w[2].message
        );
        assert!(warnings(&json!({"data": {"n": [{"numeric": [">", 0]}]}})).is_empty());
        let in_or = json!({"$or": [{"a": ["x"]}, {"b": {"prefix": {"x": ["y"]}}}]});
        assert_eq!(
            Pattern::compile(&in_or).expect_err("an error in $or").len(),
            1
        );
    }

    #[test]
    fn table() {
        let cases = crate::rules::cases::CASES;
        assert!(cases.len() >= 200, "{} cases", cases.len());
        let mut failures = Vec::new();
        for (i, (p, e, want)) in crate::rules::cases::CASES.iter().enumerate() {
            let pattern = match Pattern::compile(&parse(p)) {
                Ok(pattern) => pattern,
                Err(errs) => {
                    failures.push(format!("#{i} {p}: does not compile: {errs:?}"));
                    continue;
                }
            };
            let got = pattern.matches(&parse(e));
            if got != *want {
                failures.push(format!("#{i} {p} vs {e}: got {got}, want {want}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// (pattern, pointer of the first error, fragment of its message)
    #[rustfmt::skip]
    const ERRORS: &[(&str, &str, &str)] = &[
        (r#"[]"#, "", "must be a JSON object"),
        (r#"{}"#, "", "empty object"),
        (r#"{"type":"a"}"#, "/type", "must be a nested pattern object or an array"),
        (r#"{"type":5}"#, "/type", "not a number"),
        (r#"{"type":[]}"#, "/type", "empty matcher array"),
        (r#"{"data":{}}"#, "/data", "empty object"),
        (r#"{"type":[["a"]]}"#, "/type/0", "cannot be an array"),
        (r#"{"type":[{}]}"#, "/type/0", "exactly one key"),
        (r#"{"type":[{"prefix":"a","suffix":"b"}]}"#, "/type/0", "exactly one key"),
        (r#"{"type":[{"prefx":"a"}]}"#, "/type/0/prefx", "unknown operator `prefx`"),
        (r#"{"type":[{"exactly":"a"}]}"#, "/type/0/exactly", "unknown operator"),
        (r#"{"type":[{"prefix":5}]}"#, "/type/0/prefix", "`prefix` needs a string"),
        (r#"{"type":[{"prefix":{"equals-ignore-case":1}}]}"#, "/type/0/prefix/equals-ignore-case", "needs a string"),
        (r#"{"type":[{"suffix":{"wildcard":"x"}}]}"#, "/type/0/suffix", "only `equals-ignore-case`"),
        (r#"{"type":[{"equals-ignore-case":["a"]}]}"#, "/type/0/equals-ignore-case", "needs a string"),
        (r#"{"type":[{"wildcard":"a**b"}]}"#, "/type/0/wildcard", "consecutive"),
        (r#"{"type":[{"wildcard":"a\\b"}]}"#, "/type/0/wildcard", "invalid escape"),
        (r#"{"type":[{"wildcard":"ab\\"}]}"#, "/type/0/wildcard", "trailing backslash"),
        (r#"{"type":[{"wildcard":"*a*b*c*d*e*"}]}"#, "/type/0/wildcard", "at most 5"),
        (r#"{"type":[{"wildcard":7}]}"#, "/type/0/wildcard", "needs a string"),
        (r#"{"type":[{"anything-but":true}]}"#, "/type/0/anything-but", "not a boolean"),
        (r#"{"type":[{"anything-but":null}]}"#, "/type/0/anything-but", "not null"),
        (r#"{"type":[{"anything-but":[]}]}"#, "/type/0/anything-but", "non-empty"),
        (r#"{"type":[{"anything-but":["a",1]}]}"#, "/type/0/anything-but", "mixes strings and numbers"),
        (r#"{"type":[{"anything-but":["a",null]}]}"#, "/type/0/anything-but/1", "only strings or only numbers"),
        (r#"{"type":[{"anything-but":{"prefix":""}}]}"#, "/type/0/anything-but/prefix", "must not be empty"),
        (r#"{"type":[{"anything-but":{"prefix":[]}}]}"#, "/type/0/anything-but/prefix", "non-empty list"),
        (r#"{"type":[{"anything-but":{"prefix":["a",""]}}]}"#, "/type/0/anything-but/prefix", "must not be empty"),
        (r#"{"type":[{"anything-but":{"suffix":["a",1]}}]}"#, "/type/0/anything-but/suffix/1", "only strings"),
        (r#"{"type":[{"anything-but":{"prefix":1}}]}"#, "/type/0/anything-but/prefix", "needs a string"),
        (r#"{"type":[{"anything-but":{"numeric":[">",1]}}]}"#, "/type/0/anything-but/numeric", "unknown `anything-but` operator"),
        (r#"{"type":[{"anything-but":{"wildcard":["a**"]}}]}"#, "/type/0/anything-but/wildcard", "consecutive"),
        (r#"{"type":[{"anything-but":{"equals-ignore-case":[1]}}]}"#, "/type/0/anything-but/equals-ignore-case/0", "only strings"),
        (r#"{"type":[{"anything-but":{"prefix":"a","suffix":"b"}}]}"#, "/type/0/anything-but", "exactly one key"),
        (r#"{"n":[{"numeric":">"}]}"#, "/n/0/numeric", "`numeric` needs"),
        (r#"{"n":[{"numeric":[">"]}]}"#, "/n/0/numeric", "1 elements"),
        (r#"{"n":[{"numeric":[">",1,"<"]}]}"#, "/n/0/numeric", "3 elements"),
        (r#"{"n":[{"numeric":["=>",1]}]}"#, "/n/0/numeric/0", "unknown comparison `=>`"),
        (r#"{"n":[{"numeric":[">","1"]}]}"#, "/n/0/numeric/1", "must be a number"),
        (r#"{"n":[{"numeric":[1,">"]}]}"#, "/n/0/numeric/0", "operator string"),
        (r#"{"n":[{"numeric":["<",5,">",0]}]}"#, "/n/0/numeric/0", "lower bound"),
        (r#"{"n":[{"numeric":[">",0,">",5]}]}"#, "/n/0/numeric/2", "upper bound"),
        (r#"{"n":[{"numeric":["=",0,"<",5]}]}"#, "/n/0/numeric/0", "lower bound"),
        (r#"{"n":[{"numeric":[">",5,"<",1]}]}"#, "/n/0/numeric", "is empty"),
        (r#"{"n":[{"numeric":[">",5,"<=",5]}]}"#, "/n/0/numeric", "is empty"),
        (r#"{"n":[{"exists":"yes"}]}"#, "/n/0/exists", "true or false"),
        (r#"{"ip":[{"cidr":"10.0.0.0"}]}"#, "/ip/0/cidr", "address/prefix-length"),
        (r#"{"ip":[{"cidr":"10.0.0.0/33"}]}"#, "/ip/0/cidr", "0 to 32"),
        (r#"{"ip":[{"cidr":"::/129"}]}"#, "/ip/0/cidr", "0 to 128"),
        (r#"{"ip":[{"cidr":"10.0.0/8"}]}"#, "/ip/0/cidr", "not an IP address"),
        (r#"{"ip":[{"cidr":1}]}"#, "/ip/0/cidr", "needs a string"),
        (r#"{"$or":[{"type":["a"]}]}"#, "/$or", "at least 2"),
        (r#"{"$or":{"type":["a"]}}"#, "/$or", "needs an array"),
        (r#"{"$or":[{"type":["a"]},"b"]}"#, "/$or/1", "must be pattern objects"),
        (r#"{"$or":[{"type":["a"]},{}]}"#, "/$or/1", "empty object"),
        (r#"{"$or":[{"prefix":["a"]},{"type":["b"]}]}"#, "/$or/0/prefix", "cannot be a field name inside `$or`"),
        (r#"{"$or":[{"regex":["a"]},{"type":["b"]}]}"#, "/$or/0/regex", "reserved word"),
        (r#"{"$or":[{"type":["a"]},{"d":{">=":[1]}}]}"#, "/$or/1/d/>=", "reserved word"),
        (r#"{"data":{"$or":[{"exactly":["a"]},{"b":[1]}]}}"#, "/data/$or/0/exactly", "reserved word"),
        (r#"{"a/b~c":"x"}"#, "/a~1b~0c", "must be a nested pattern"),
    ];

    #[test]
    fn compile_errors_have_pointers_and_operator_names() {
        let mut failures = Vec::new();
        for (p, ptr, msg) in ERRORS {
            match Pattern::compile(&parse(p)) {
                Ok(_) => failures.push(format!("{p}: compiled, expected error")),
                Err(errs) => {
                    let first = &errs[0];
                    if first.pointer != *ptr || !first.message.contains(msg) {
                        failures.push(format!("{p}: got {errs:?}, want {ptr} / {msg}"));
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn all_errors_are_reported() {
        let p = json!({
            "type": "bare",
            "data": { "a": [], "b": [{ "numerc": [">", 1] }], "c": [{ "wildcard": "**" }] }
        });
        let errs = Pattern::compile(&p).expect_err("invalid");
        let ptrs: Vec<&str> = errs.iter().map(|e| e.pointer.as_str()).collect();
        assert_eq!(
            ptrs,
            vec!["/type", "/data/a", "/data/b/0/numerc", "/data/c/0/wildcard"]
        );
    }

    #[test]
    fn simple_match_and_display() {
        assert_eq!(
            simple_match(&json!({"type": ["a"]}), &json!({"type": "a"})),
            Ok(true)
        );
        let errs = simple_match(&json!({"type": "a"}), &json!({})).expect_err("bad pattern");
        assert!(errs[0].to_string().starts_with("at /type: "));
    }

    #[test]
    fn wildcard_parts() {
        let w = Wildcard::parse(r"a\*b*c\\").expect("valid");
        assert_eq!(w.parts, vec!["a*b".to_string(), "c\\".to_string()]);
        assert!(w.matches("a*bXYc\\"));
        assert!(!w.matches("axbXYc\\"));
        let star = Wildcard::parse("*").expect("valid");
        assert!(star.matches("") && star.matches("anything"));
    }

    proptest! {
        #[test]
        fn prefix_agrees_with_starts_with(p in "[ab]{0,3}", s in "[ab]{0,6}") {
            let pat = Pattern::compile(&json!({"k": [{"prefix": p.clone()}]})).expect("valid");
            prop_assert_eq!(pat.matches(&json!({"k": s.clone()})), s.starts_with(&p));
        }

        #[test]
        fn suffix_agrees_with_ends_with(p in "[ab]{0,3}", s in "[ab]{0,6}") {
            let pat = Pattern::compile(&json!({"k": [{"suffix": p.clone()}]})).expect("valid");
            prop_assert_eq!(pat.matches(&json!({"k": s.clone()})), s.ends_with(&p));
        }

        #[test]
        fn numeric_agrees_with_f64(lo in -1e6f64..1e6, width in 0f64..1e6, x in -2e6f64..2e6,
                                   lo_inc in any::<bool>(), hi_inc in any::<bool>()) {
            let hi = lo + width + 1.0;
            let ops = (if lo_inc { ">=" } else { ">" }, if hi_inc { "<=" } else { "<" });
            let pat = Pattern::compile(&json!({"k": [{"numeric": [ops.0, lo, ops.1, hi]}]}))
                .expect("valid");
            let want = (if lo_inc { x >= lo } else { x > lo }) && (if hi_inc { x <= hi } else { x < hi });
            prop_assert_eq!(pat.matches(&json!({"k": x})), want);
        }

        /// Integer event values, however large, get the exact answer from `numeric` with an
        /// operand inside the bound; `=` agrees with the exact matcher; the compiled matcher
        /// agrees with both. (Before, operands past 2^53 were taken rounded:
        /// `["=", 1234567890123456789]` matched 1234567890123456788.)
        #[test]
        fn numeric_on_integers_is_exact_and_agrees_with_exact(
            op in prop::sample::select(vec!["=", "<", "<=", ">", ">="]),
            c in prop_oneof![
                -9_007_199_254_740_991i64..=9_007_199_254_740_991,
                9_007_199_254_740_980i64..=9_007_199_254_740_991,
                -9_007_199_254_740_991i64..=-9_007_199_254_740_980,
                -1000i64..1000,
            ],
            v in prop_oneof![
                any::<i64>().prop_map(i128::from),
                any::<u64>().prop_map(i128::from),
                -4i128..4,
            ],
            near in any::<bool>(),
        ) {
            // Half the time the event value sits next to the operand, where rounding bites.
            let v = if near { i128::from(c) + v.rem_euclid(7) - 3 } else { v };
            let value = if v >= 0 {
                json!(u64::try_from(v).unwrap_or(u64::MAX))
            } else {
                json!(i64::try_from(v).unwrap_or(i64::MIN))
            };
            let v = value.as_i64().map(i128::from).or(value.as_u64().map(i128::from)).unwrap_or(0);
            let c128 = i128::from(c);
            let want = match op {
                "=" => v == c128,
                "<" => v < c128,
                "<=" => v <= c128,
                ">" => v > c128,
                _ => v >= c128,
            };
            let numeric = Pattern::compile(&json!({"n": [{"numeric": [op, c]}]})).expect("in range");
            let event = json!({"n": value});
            prop_assert_eq!(numeric.matches(&event), want, "{} {} vs {}", op, c, v);
            if op == "=" {
                let exact = Pattern::compile(&json!({"n": [c]})).expect("valid");
                prop_assert_eq!(exact.matches(&event), want);
            }
            let m = crate::rules::automaton::CompiledMatcher::build(&[(0, &numeric)]).expect("builds");
            prop_assert_eq!(m.matches(&event) == vec![0], want);
        }

        #[test]
        fn wildcard_without_stars_is_equality(w in "[a-c]{0,4}", s in "[a-c]{0,4}") {
            let pat = Pattern::compile(&json!({"k": [{"wildcard": w.clone()}]})).expect("valid");
            prop_assert_eq!(pat.matches(&json!({"k": s.clone()})), w == s);
        }

        #[test]
        fn wildcard_agrees_with_naive_matcher(w in "[ab*]{0,6}", s in "[ab]{0,6}") {
            prop_assume!(!w.contains("**"));
            prop_assume!(w.matches('*').count() <= MAX_WILDCARD_STARS);
            let pat = Pattern::compile(&json!({"k": [{"wildcard": w.clone()}]})).expect("valid");
            prop_assert_eq!(pat.matches(&json!({"k": s.clone()})), naive_glob(w.as_bytes(), s.as_bytes()));
        }

        #[test]
        fn anything_but_is_negation_of_exact(list in proptest::collection::vec("[ab]{0,2}", 1..4), s in "[ab]{0,2}") {
            let pat = Pattern::compile(&json!({"k": [{"anything-but": list.clone()}]})).expect("valid");
            prop_assert_eq!(pat.matches(&json!({"k": s.clone()})), !list.contains(&s));
        }
    }

    fn naive_glob(p: &[u8], s: &[u8]) -> bool {
        match (p.split_first(), s.split_first()) {
            (None, None) => true,
            (None, Some(_)) => false,
            (Some((b'*', rest)), _) => {
                naive_glob(rest, s) || (!s.is_empty() && naive_glob(p, &s[1..]))
            }
            (Some((c, rest)), Some((d, srest))) => c == d && naive_glob(rest, srest),
            (Some(_), None) => false,
        }
    }
}
