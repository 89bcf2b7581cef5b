//! Part of contract compilation: a static check that refuses schemas whose subschemas fan out
//! multiplicatively, so that one small value is checked by exponentially many of them.
//!
//! Deciding whether data is valid has no step budget (the error listing has one, see
//! `bounded_errors`): a 1.5 KB schema whose `$defs` each hold an `allOf` of two `$ref`s to the
//! next checks a 70-byte event's data 4 million times. Such a schema is refused at load and
//! upload instead, naming the subschema that is reached too many ways.
//!
//! The measure: the schema is a graph whose edges either stay on the same value (`allOf`,
//! `anyOf`, `oneOf`, `not`, `if`/`then`/`else`, `dependentSchemas`, `$ref`) or descend into a
//! member or item (`properties`, `items`, `additionalProperties`, …). Level by level of the
//! value's depth, it counts the ways each subschema is reached on one value; members with
//! different names are different values, so at each descent the names are followed apart and
//! a subschema keeps the largest count any one name gives it (plus what applies to every
//! member): an upper bound for every value of the level. A schema is
//! refused when one subschema is reached more than [`MAX_PATHS`] ways at one level. Ordinary
//! schemas, however wide (10,000 properties, a `oneOf` of 200 variants sharing `$defs`), or
//! recursive (trees), stay at a handful; doubling fan-out passes the bound at about the 14th
//! level. A heuristic bound on the common blow-up, not on all work: the error listing's budget
//! stays.

use std::collections::HashMap;

use serde_json::Value;

use crate::event::pointer_token as token;

/// Most ways one subschema may be reached on one value.
pub(super) const MAX_PATHS: u64 = 10_000;

/// Value depths followed (the ingest bound on JSON nesting is 64 by default).
const MAX_LEVELS: usize = 64;

/// A subschema reached too many ways: its pointer in the schema, and the count (at least
/// [`MAX_PATHS`] + 1, saturated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FanOut {
    pub pointer: String,
    pub paths: u64,
}

/// Applies to which member of the value below: a named property, or any.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Label {
    Named(String),
    Any,
}

#[derive(Default)]
struct Node {
    pointer: String,
    /// Subschemas applied to the same value (references resolved).
    same: Vec<usize>,
    /// Subschemas applied to a member or item.
    down: Vec<(Label, usize)>,
    /// `$ref` targets, resolved after the walk.
    refs: Vec<String>,
}

struct Graph {
    nodes: Vec<Node>,
    by_pointer: HashMap<String, usize>,
    /// Plain-name fragments (`$anchor`, `$dynamicAnchor`, draft 7's `"$id": "#name"`): every
    /// subschema that declares the name, since embedded resources may each have one (all are
    /// followed: an upper bound).
    by_anchor: HashMap<String, Vec<usize>>,
}

impl Graph {
    fn add(&mut self, schema: &Value, pointer: String) -> usize {
        let id = self.nodes.len();
        self.nodes.push(Node {
            pointer: pointer.clone(),
            ..Node::default()
        });
        self.by_pointer.insert(pointer.clone(), id);
        let Value::Object(map) = schema else {
            return id; // `true` / `false`: a leaf.
        };
        for (key, value) in map {
            let at = format!("{pointer}/{}", token(key));
            match key.as_str() {
                "$ref" | "$dynamicRef" => {
                    if let Value::String(r) = value {
                        self.nodes[id].refs.push(r.clone());
                    }
                }
                "$anchor" | "$dynamicAnchor" => {
                    if let Value::String(name) = value {
                        self.by_anchor.entry(name.clone()).or_default().push(id);
                    }
                }
                "$id" => {
                    if let Some(name) = value.as_str().and_then(|v| v.strip_prefix('#')) {
                        self.by_anchor.entry(name.to_string()).or_default().push(id);
                    }
                }
                "not" | "if" | "then" | "else" => {
                    let c = self.add(value, at);
                    self.nodes[id].same.push(c);
                }
                "allOf" | "anyOf" | "oneOf" => {
                    if let Value::Array(list) = value {
                        for (i, s) in list.iter().enumerate() {
                            let c = self.add(s, format!("{at}/{i}"));
                            self.nodes[id].same.push(c);
                        }
                    }
                }
                "dependentSchemas" | "dependencies" => {
                    if let Value::Object(named) = value {
                        for (name, s) in named.iter().filter(|(_, s)| !s.is_array()) {
                            let c = self.add(s, format!("{at}/{}", token(name)));
                            self.nodes[id].same.push(c);
                        }
                    }
                }
                "properties" => {
                    if let Value::Object(named) = value {
                        for (name, s) in named {
                            let c = self.add(s, format!("{at}/{}", token(name)));
                            self.nodes[id].down.push((Label::Named(name.clone()), c));
                        }
                    }
                }
                "patternProperties" => {
                    if let Value::Object(named) = value {
                        for (name, s) in named {
                            let c = self.add(s, format!("{at}/{}", token(name)));
                            self.nodes[id].down.push((Label::Any, c));
                        }
                    }
                }
                "items" | "prefixItems" => match value {
                    Value::Array(list) => {
                        for (i, s) in list.iter().enumerate() {
                            let c = self.add(s, format!("{at}/{i}"));
                            self.nodes[id].down.push((Label::Any, c));
                        }
                    }
                    s => {
                        let c = self.add(s, at);
                        self.nodes[id].down.push((Label::Any, c));
                    }
                },
                "additionalProperties"
                | "additionalItems"
                | "unevaluatedProperties"
                | "unevaluatedItems"
                | "contains"
                | "propertyNames" => {
                    let c = self.add(value, at);
                    self.nodes[id].down.push((Label::Any, c));
                }
                "$defs" | "definitions" => {
                    // Reached through references only.
                    if let Value::Object(named) = value {
                        for (name, s) in named {
                            self.add(s, format!("{at}/{}", token(name)));
                        }
                    }
                }
                _ => {}
            }
        }
        id
    }

    /// Resolves the document-local references (`#`, `#/json/pointer`, `#name` of an anchor);
    /// others are not followed (contracts allow no other document; a reference through an
    /// embedded resource's `$id` URI is not resolved either).
    fn resolve(&mut self) {
        for id in 0..self.nodes.len() {
            let refs = std::mem::take(&mut self.nodes[id].refs);
            for r in refs {
                let Some(fragment) = r.strip_prefix('#') else {
                    continue;
                };
                let pointer = percent_encoding::percent_decode_str(fragment).decode_utf8_lossy();
                if pointer.is_empty() || pointer.starts_with('/') {
                    if let Some(&target) = self.by_pointer.get(pointer.as_ref()) {
                        self.nodes[id].same.push(target);
                    }
                } else if let Some(targets) = self.by_anchor.get(pointer.as_ref()) {
                    let targets = targets.clone();
                    self.nodes[id].same.extend(targets);
                }
            }
        }
    }

    /// The same-value edges without the ones that close a cycle, in an order where every
    /// node comes before the nodes it leads to (a cycle on one value is the validator's own
    /// infinite recursion, which it refuses or bounds; it adds no ways here).
    fn acyclic_order(&mut self) -> Vec<usize> {
        #[derive(Clone, Copy, PartialEq)]
        enum Mark {
            New,
            Open,
            Done,
        }
        let n = self.nodes.len();
        let mut mark = vec![Mark::New; n];
        let mut post = Vec::with_capacity(n);
        for start in 0..n {
            if mark[start] != Mark::New {
                continue;
            }
            // Iterative depth-first walk: (node, index of its next edge).
            let mut stack = vec![(start, 0usize)];
            mark[start] = Mark::Open;
            while let Some(&(v, next)) = stack.last() {
                if let Some(&c) = self.nodes[v].same.get(next) {
                    if mark[c] == Mark::Open {
                        // Closes a cycle: dropped (the next edge moves into this index).
                        self.nodes[v].same.remove(next);
                        continue;
                    }
                    if let Some(top) = stack.last_mut() {
                        top.1 += 1;
                    }
                    if mark[c] == Mark::New {
                        mark[c] = Mark::Open;
                        stack.push((c, 0));
                    }
                } else {
                    mark[v] = Mark::Done;
                    post.push(v);
                    stack.pop();
                }
            }
        }
        post.reverse();
        post
    }
}

/// The first subschema of `schema` reached more than [`MAX_PATHS`] ways on one value, if any.
pub(super) fn excessive_fan_out(schema: &Value) -> Option<FanOut> {
    let mut g = Graph {
        nodes: Vec::new(),
        by_pointer: HashMap::new(),
        by_anchor: HashMap::new(),
    };
    let root = g.add(schema, String::new());
    g.resolve();
    let order = g.acyclic_order();
    let mut rank = vec![0usize; g.nodes.len()];
    for (i, &v) in order.iter().enumerate() {
        rank[v] = i;
    }
    // Ways each subschema is reached on one value of the current level (at most: an upper
    // bound over the values of the level).
    let mut ways = g.spread(&rank, HashMap::from([(root, 1)]));
    for _ in 0..MAX_LEVELS {
        if let Some((&v, &w)) = ways.iter().max_by_key(|(_, w)| **w)
            && w > MAX_PATHS
        {
            return Some(FanOut {
                pointer: g.nodes[v].pointer.clone(),
                paths: w,
            });
        }
        // One member below. What applies to any member reaches every one of them; what a
        // `properties` name leads to reaches only the member of that name, so the names are
        // spread apart and the level keeps, per subschema, the most any one name gives it.
        // (Linear in the seeds: a member's ways are those of `any` plus those of its name.)
        let mut any: HashMap<usize, u64> = HashMap::new();
        let mut named: HashMap<&str, HashMap<usize, u64>> = HashMap::new();
        for (&v, &w) in &ways {
            for (label, c) in &g.nodes[v].down {
                let seeds = match label {
                    Label::Any => &mut any,
                    Label::Named(name) => named.entry(name.as_str()).or_default(),
                };
                let s = seeds.entry(*c).or_default();
                *s = s.saturating_add(w);
            }
        }
        if any.is_empty() && named.is_empty() {
            return None;
        }
        let mut next = g.spread(&rank, any);
        let mut most: HashMap<usize, u64> = HashMap::new();
        for seeds in named.into_values() {
            for (v, w) in g.spread(&rank, seeds) {
                let m = most.entry(v).or_default();
                *m = (*m).max(w);
            }
        }
        for (v, w) in most {
            let n = next.entry(v).or_default();
            *n = n.saturating_add(w);
        }
        ways = next;
    }
    None
}

impl Graph {
    /// The ways each subschema is reached on one value from `seeds` (subschema → ways),
    /// following the same-value edges in `rank` order (every node after those leading to it).
    fn spread(&self, rank: &[usize], mut ways: HashMap<usize, u64>) -> HashMap<usize, u64> {
        let mut reached: Vec<usize> = ways.keys().copied().collect();
        let mut seen: std::collections::HashSet<usize> = reached.iter().copied().collect();
        let mut i = 0;
        while let Some(&v) = reached.get(i) {
            i += 1;
            for &c in &self.nodes[v].same {
                if seen.insert(c) {
                    reached.push(c);
                }
            }
        }
        reached.sort_unstable_by_key(|&v| rank[v]);
        for v in reached {
            let w = ways.get(&v).copied().unwrap_or(0);
            for &c in &self.nodes[v].same {
                let to = ways.entry(c).or_default();
                *to = to.saturating_add(w);
            }
        }
        ways
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `$defs` D0..D{levels-1}, each an `allOf` of `refs` references to the next.
    fn doubling(levels: usize, refs: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..levels {
            let next = json!({"$ref": format!("#/$defs/D{}", i + 1)});
            defs.insert(format!("D{i}"), json!({"allOf": vec![next; refs]}));
        }
        defs.insert(format!("D{levels}"), json!({"type": "integer"}));
        json!({"$ref": "#/$defs/D0", "$defs": defs})
    }

    #[test]
    fn doubling_references_on_one_value_are_refused() {
        // The audit's schema: 22 levels, 4 million checks of one value.
        let f = excessive_fan_out(&doubling(22, 2)).expect("refused");
        assert!(f.paths > MAX_PATHS, "{f:?}");
        assert!(f.pointer.starts_with("/$defs/D"), "{f:?}");
        // A few levels are fine: 2^10 = 1,024 ways.
        assert_eq!(excessive_fan_out(&doubling(10, 2)), None);
        // A chain of single references is one way however long.
        assert_eq!(excessive_fan_out(&doubling(60, 1)), None);
    }

    /// The same doubling through anchors (`"$ref": "#d3"`) instead of pointers: before, the
    /// check followed pointers only and let it through.
    #[test]
    fn doubling_through_anchors_is_refused_too() {
        let by_anchor = |levels: usize, key: &str| {
            let mut defs = serde_json::Map::new();
            for i in 0..levels {
                let next = json!({"$ref": format!("#d{}", i + 1)});
                let mut d = json!({"allOf": [next.clone(), next]});
                d[key] = json!(if key == "$id" {
                    format!("#d{i}")
                } else {
                    format!("d{i}")
                });
                defs.insert(format!("D{i}"), d);
            }
            let mut last = json!({"type": "integer"});
            last[key] = json!(if key == "$id" {
                format!("#d{levels}")
            } else {
                format!("d{levels}")
            });
            defs.insert(format!("D{levels}"), last);
            json!({"$ref": "#d0", "$defs": defs})
        };
        for key in ["$anchor", "$dynamicAnchor", "$id"] {
            let f = excessive_fan_out(&by_anchor(22, key)).expect(key);
            assert!(f.paths > MAX_PATHS, "{key}: {f:?}");
            assert_eq!(excessive_fan_out(&by_anchor(10, key)), None, "{key}");
        }
    }

    #[test]
    fn fan_out_through_items_is_counted_per_level() {
        // Each level checks the items twice (two allOf branches with the same items).
        let mut defs = serde_json::Map::new();
        for i in 0..20 {
            let items = json!({"items": {"$ref": format!("#/$defs/L{}", i + 1)}});
            defs.insert(format!("L{i}"), json!({"allOf": [items.clone(), items]}));
        }
        defs.insert("L20".into(), json!({"type": "integer"}));
        let schema = json!({"$ref": "#/$defs/L0", "$defs": defs});
        assert!(excessive_fan_out(&schema).is_some());
    }

    #[test]
    fn wide_recursive_and_shared_schemas_pass() {
        // A binary tree: two named members lead to one node, but not on one value.
        let tree = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "left": {"$ref": "#/$defs/node"}, "right": {"$ref": "#/$defs/node"},
                "value": {"type": "integer"}}}},
            "$ref": "#/$defs/node"
        });
        assert_eq!(excessive_fan_out(&tree), None);
        // 10,000 properties each an object of 10.
        let inner: serde_json::Map<String, Value> = (0..10)
            .map(|i| (format!("f{i}"), json!({"$ref": "#/$defs/base"})))
            .collect();
        let props: serde_json::Map<String, Value> = (0..10_000)
            .map(|i| {
                (
                    format!("p{i}"),
                    json!({"type": "object", "properties": inner}),
                )
            })
            .collect();
        let wide =
            json!({"type": "object", "properties": props, "$defs": {"base": {"type": "string"}}});
        assert_eq!(excessive_fan_out(&wide), None);
        // A oneOf of 200 variants, each allOf a shared base and its own part.
        let variants: Vec<Value> = (0..200)
            .map(|i| json!({"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"kind": {"const": i}}}]}))
            .collect();
        let shared = json!({"oneOf": variants, "$defs": {"base": {"required": ["kind"]}}});
        assert_eq!(excessive_fan_out(&shared), None);
        // A reference to the root from inside (recursion on members) and on the same value
        // (a cycle the validator handles) add nothing.
        let cyclic = json!({"anyOf": [{"$ref": "#"}, {"type": "null"}],
            "properties": {"child": {"$ref": "#"}}});
        assert_eq!(excessive_fan_out(&cyclic), None);
    }
}
