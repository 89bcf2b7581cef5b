//! Contract stage, authoring time: compares a new version of a type's `data` schema with the
//! previous one (`router contracts check`, and on upload). Only adding optional properties is
//! compatible; a change the checker cannot prove compatible is reported as breaking.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

/// One incompatibility, with where it shows in the new schema (a JSON pointer into it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Issue {
    pub pointer: String,
    pub message: String,
}

/// Compares schema `new` against the previous version `old` and returns one message per
/// incompatible change, each naming the property path (`customer.address.zip`, `lines[].sku`;
/// `(root)` for the top level). An empty list means compatible.
///
/// Local `$ref`s (`#/$defs/…`, `#/definitions/…`, any JSON pointer into the document) are
/// expanded first, so a change inside a definition counts where it is used. Then `type`,
/// `properties`, `required`, `items` (also tuple `items` arrays and `prefixItems`) are walked
/// recursively. Incompatible: a property removed, a `type` changed (any change of the set of
/// types, including adding or dropping the keyword), an optional property made required, a new
/// property that is required, a new property the old schema already constrained through
/// `additionalProperties` or `patternProperties`, a schema that became `false`. Every other
/// keyword that constrains values (`enum`, `const`, bounds, lengths, `pattern`, `format`,
/// `additionalProperties`, `allOf`/`anyOf`/`oneOf`/`not`, conditionals, …) may be dropped
/// (every old value still passes, as when a required property becomes optional, or an array's
/// `items` goes) but not added or changed: the checker does not prove such changes safe, so
/// they need a new version. Annotations (`title`, `description`, `examples`, `default`, …) may
/// change freely.
pub fn check_compatibility(old: &Value, new: &Value) -> Vec<String> {
    compat_issues(old, new)
        .into_iter()
        .map(|i| i.message)
        .collect()
}

/// Keywords that only annotate: changing them changes no validation result.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "examples",
    "default",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$schema",
    "$id",
    "$anchor",
    "$defs",
    "definitions",
    "contentMediaType",
    "contentEncoding",
];

/// Keywords the walk compares itself.
const WALKED: &[&str] = &["type", "properties", "required", "items", "prefixItems"];

/// Most schema nodes expanding `$ref`s may produce per side: a schema whose references
/// multiply past this is reported as too large to check rather than expanded without bound.
const MAX_EXPANDED_NODES: usize = 200_000;

/// `schema` with its local `$ref`s replaced by what they point at (the reference's sibling
/// keywords kept beside the target's), a reference already being expanded on the way down
/// (a recursive schema) left as it is. `None` past [`MAX_EXPANDED_NODES`].
fn expand(root: &Value) -> Option<Value> {
    fn go(
        root: &Value,
        node: &Value,
        stack: &mut Vec<String>,
        budget: &mut usize,
    ) -> Option<Value> {
        *budget = budget.checked_sub(1)?;
        let Value::Object(map) = node else {
            return Some(match node {
                Value::Array(items) => Value::Array(
                    items
                        .iter()
                        .map(|v| go(root, v, stack, budget))
                        .collect::<Option<_>>()?,
                ),
                other => other.clone(),
            });
        };
        let target = map
            .get("$ref")
            .and_then(Value::as_str)
            .filter(|r| r.starts_with('#') && !stack.iter().any(|s| s == r))
            .and_then(|r| {
                let pointer = percent_decode(&r[1..]);
                root.pointer(&pointer).map(|t| (r.to_owned(), t))
            });
        let mut out = Map::new();
        if let Some((r, target)) = target {
            stack.push(r);
            let expanded = go(root, target, stack, budget);
            stack.pop();
            match expanded? {
                Value::Object(t) => out.extend(t),
                // A boolean schema: `false` stays decisive whatever the siblings say.
                Value::Bool(false) => return Some(Value::Bool(false)),
                _ => {}
            }
        }
        for (k, v) in map {
            if k == "$ref" && !out.is_empty() {
                continue;
            }
            if k == "$defs" || k == "definitions" {
                continue;
            }
            out.insert(k.clone(), go(root, v, stack, budget)?);
        }
        Some(Value::Object(out))
    }
    let mut budget = MAX_EXPANDED_NODES;
    go(root, root, &mut Vec::new(), &mut budget)
}

/// A JSON pointer taken from a URI fragment (`%25` → `%`, …).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn compat_issues(old: &Value, new: &Value) -> Vec<Issue> {
    let mut out = Vec::new();
    let (Some(old), Some(new)) = (expand(old), expand(new)) else {
        out.push(Issue {
            pointer: String::new(),
            message: format!(
                "the schema's `$ref`s expand past {MAX_EXPANDED_NODES} nodes: too large to check \
                 for compatibility"
            ),
        });
        return out;
    };
    walk(&old, &new, "", "", &mut out);
    out
}

/// A boolean schema as the object it stands for (`true` is `{}`); `None` for `false`.
fn as_object_schema(schema: &Value) -> Option<Value> {
    match schema {
        Value::Bool(true) => Some(Value::Object(Map::new())),
        Value::Bool(false) => None,
        other => Some(other.clone()),
    }
}

fn display(path: &str) -> &str {
    if path.is_empty() { "(root)" } else { path }
}

fn child(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

fn type_set(schema: &Value) -> Option<BTreeSet<String>> {
    match schema.get("type")? {
        Value::String(s) => Some(BTreeSet::from([s.clone()])),
        Value::Array(a) => Some(
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
        ),
        _ => None,
    }
}

fn fmt_types(t: Option<&BTreeSet<String>>) -> String {
    match t {
        None => "(any)".to_owned(),
        Some(set) if set.len() == 1 => set.iter().map(|s| format!("\"{s}\"")).collect(),
        Some(set) => {
            let items: Vec<String> = set.iter().map(|s| format!("\"{s}\"")).collect();
            format!("[{}]", items.join(", "))
        }
    }
}

fn required(schema: &Value) -> BTreeSet<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn properties(schema: &Value) -> Option<&Map<String, Value>> {
    schema.get("properties").and_then(Value::as_object)
}

fn walk(old: &Value, new: &Value, path: &str, ptr: &str, out: &mut Vec<Issue>) {
    let (old, new) = match (as_object_schema(old), as_object_schema(new)) {
        (_, None) if *old != Value::Bool(false) => {
            out.push(Issue {
                pointer: ptr.to_owned(),
                message: format!(
                    "property `{}`: the schema became `false`, which no value satisfies",
                    display(path)
                ),
            });
            return;
        }
        // Forbidden before (`false`): nothing was sent, so anything now is an addition.
        (None, _) | (_, None) => return,
        (Some(o), Some(n)) => (o, n),
    };
    let (old, new) = (&old, &new);
    other_keywords(old, new, path, ptr, out);
    let (ot, nt) = (type_set(old), type_set(new));
    if ot != nt {
        let pointer = if new.get("type").is_some() {
            format!("{ptr}/type")
        } else {
            ptr.to_owned()
        };
        out.push(Issue {
            pointer,
            message: format!(
                "property `{}`: type changed from {} to {}",
                display(path),
                fmt_types(ot.as_ref()),
                fmt_types(nt.as_ref())
            ),
        });
    }

    let empty = Map::new();
    let old_props = properties(old).unwrap_or(&empty);
    let new_props = properties(new).unwrap_or(&empty);
    let (old_req, new_req) = (required(old), required(new));

    for (name, old_sub) in old_props {
        let path = child(path, name);
        match new_props.get(name) {
            None => out.push(Issue {
                pointer: if properties(new).is_some() {
                    format!("{ptr}/properties")
                } else {
                    ptr.to_owned()
                },
                message: format!("property `{path}` was removed"),
            }),
            Some(new_sub) => walk(
                old_sub,
                new_sub,
                &path,
                &format!("{ptr}/properties/{}", escape(name)),
                out,
            ),
        }
    }
    // A property the old schema did not name but still constrained (an open content model
    // with a schema, or a matching pattern): naming it now may change what it accepts.
    for name in new_props.keys().filter(|n| !old_props.contains_key(*n)) {
        let covered = old.get("additionalProperties").is_some_and(|a| {
            // `false` forbade it: allowing it now is an addition.
            ![
                Value::Bool(true),
                Value::Bool(false),
                Value::Object(Map::new()),
            ]
            .contains(a)
        }) || old
            .get("patternProperties")
            .and_then(Value::as_object)
            .is_some_and(|p| {
                p.keys()
                    .any(|pat| regex::Regex::new(pat).map_or(true, |re| re.is_match(name)))
            });
        if covered {
            out.push(Issue {
                pointer: format!("{ptr}/properties/{}", escape(name)),
                message: format!(
                    "new property `{}` was already constrained by `additionalProperties` or \
                     `patternProperties`: naming it may change what it accepts",
                    child(path, name)
                ),
            });
        }
    }
    for name in new_req.difference(&old_req) {
        let path = child(path, name);
        let message = if old_props.contains_key(*name) {
            format!("property `{path}` became required")
        } else {
            format!("new property `{path}` is required (only optional properties may be added)")
        };
        out.push(Issue {
            pointer: format!("{ptr}/required"),
            message,
        });
    }

    let items_path = format!("{path}[]");
    let any = Value::Object(Map::new());
    match (old.get("items"), new.get("items")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple(o, n, path, &format!("{ptr}/items"), out);
        }
        (Some(o), Some(n)) => walk(o, n, &items_path, &format!("{ptr}/items"), out),
        (None, Some(n)) => walk(&any, n, &items_path, &format!("{ptr}/items"), out),
        // The constraint dropped: every old array still passes.
        (Some(_), None) | (None, None) => {}
    }
    match (old.get("prefixItems"), new.get("prefixItems")) {
        (Some(Value::Array(o)), Some(Value::Array(n))) => {
            tuple(o, n, path, &format!("{ptr}/prefixItems"), out);
        }
        (None, None) => {}
        _ => out.push(Issue {
            pointer: ptr.to_owned(),
            message: format!("property `{}`: `prefixItems` changed", display(path)),
        }),
    }
}

fn tuple(old: &[Value], new: &[Value], path: &str, ptr: &str, out: &mut Vec<Issue>) {
    if old.len() != new.len() {
        out.push(Issue {
            pointer: ptr.to_owned(),
            message: format!(
                "property `{}`: the tuple went from {} to {} positions",
                display(path),
                old.len(),
                new.len()
            ),
        });
    }
    for (i, (o, n)) in old.iter().zip(new).enumerate() {
        walk(o, n, &format!("{path}[{i}]"), &format!("{ptr}/{i}"), out);
    }
}

/// Every keyword other than those the walk compares and the annotations must be unchanged
/// (compared after `$ref`s are expanded, so a change in a definition they use counts).
fn other_keywords(old: &Value, new: &Value, path: &str, ptr: &str, out: &mut Vec<Issue>) {
    let (Some(o), Some(n)) = (old.as_object(), new.as_object()) else {
        return;
    };
    let keys: BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    for key in keys {
        if WALKED.contains(&key.as_str()) || ANNOTATIONS.contains(&key.as_str()) {
            continue;
        }
        if o.get(key) == n.get(key) {
            continue;
        }
        let what = match (o.get(key), n.get(key)) {
            (None, _) => "was added",
            // Dropping a constraint lets every old value through still (as a required
            // property made optional does), except patternProperties, whose properties then
            // fall to `additionalProperties`.
            (_, None) if key != "patternProperties" => continue,
            (_, None) => "was removed",
            _ => "changed",
        };
        out.push(Issue {
            pointer: if n.contains_key(key) {
                format!("{ptr}/{}", escape(key))
            } else {
                ptr.to_owned()
            },
            message: format!(
                "property `{}`: `{key}` {what}; the checker cannot prove that compatible, so it \
                 needs a new version",
                display(path)
            ),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v1() -> Value {
        json!({
            "type": "object",
            "required": ["id"],
            "properties": {
                "id": {"type": "string"},
                "total": {"type": "number"},
                "customer": {
                    "type": "object",
                    "properties": {"email": {"type": "string"}, "zip": {"type": "string"}}
                },
                "lines": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"sku": {"type": "string"}}}
                }
            }
        })
    }

    #[test]
    fn identical_is_compatible() {
        assert!(check_compatibility(&v1(), &v1()).is_empty());
    }

    #[test]
    fn adding_optional_property_is_compatible() {
        let mut v2 = v1();
        v2["properties"]["note"] = json!({"type": "string"});
        v2["properties"]["customer"]["properties"]["phone"] = json!({"type": "string"});
        assert_eq!(check_compatibility(&v1(), &v2), Vec::<String>::new());
    }

    #[test]
    fn removing_a_property_is_flagged() {
        let mut v2 = v1();
        v2["properties"].as_object_mut().unwrap().remove("total");
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total` was removed"]
        );
    }

    #[test]
    fn retyping_is_flagged() {
        let mut v2 = v1();
        v2["properties"]["total"]["type"] = json!("string");
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total`: type changed from \"number\" to \"string\""]
        );
    }

    #[test]
    fn type_array_order_does_not_matter() {
        let old = json!({"type": ["string", "null"]});
        let new = json!({"type": ["null", "string"]});
        assert!(check_compatibility(&old, &new).is_empty());
        let issues = check_compatibility(&json!({"type": "object"}), &json!({"type": "array"}));
        assert_eq!(
            issues,
            ["property `(root)`: type changed from \"object\" to \"array\""]
        );
    }

    #[test]
    fn optional_becoming_required_is_flagged() {
        let mut v2 = v1();
        v2["required"] = json!(["id", "total"]);
        assert_eq!(
            check_compatibility(&v1(), &v2),
            ["property `total` became required"]
        );
    }

    #[test]
    fn new_required_property_is_flagged() {
        let mut v2 = v1();
        v2["properties"]["currency"] = json!({"type": "string"});
        v2["required"] = json!(["id", "currency"]);
        let issues = check_compatibility(&v1(), &v2);
        assert_eq!(issues.len(), 1);
        assert!(
            issues[0].starts_with("new property `currency` is required"),
            "{issues:?}"
        );
    }

    #[test]
    fn required_becoming_optional_is_allowed() {
        let mut v2 = v1();
        v2["required"] = json!([]);
        assert!(check_compatibility(&v1(), &v2).is_empty());
    }

    #[test]
    fn nested_and_items_changes_are_flagged_with_paths() {
        let mut v2 = v1();
        let cust = &mut v2["properties"]["customer"];
        cust["properties"].as_object_mut().unwrap().remove("email");
        cust["properties"]["zip"]["type"] = json!("integer");
        cust["required"] = json!(["zip"]);
        v2["properties"]["lines"]["items"]["properties"]["sku"]["type"] = json!("number");
        let issues = compat_issues(&v1(), &v2);
        let messages: Vec<&str> = issues.iter().map(|i| i.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "property `customer.email` was removed",
                "property `customer.zip`: type changed from \"string\" to \"integer\"",
                "property `customer.zip` became required",
                "property `lines[].sku`: type changed from \"string\" to \"number\"",
            ]
        );
        assert_eq!(
            issues[1].pointer,
            "/properties/customer/properties/zip/type"
        );
        assert_eq!(
            issues[3].pointer,
            "/properties/lines/items/properties/sku/type"
        );
    }

    #[test]
    fn tuple_items() {
        let old = json!({"prefixItems": [{"type": "string"}, {"type": "number"}]});
        let new = json!({"prefixItems": [{"type": "string"}, {"type": "string"}]});
        assert_eq!(
            check_compatibility(&old, &new),
            ["property `[1]`: type changed from \"number\" to \"string\""]
        );
    }

    fn flagged(old: Value, new: Value) -> Vec<String> {
        check_compatibility(&old, &new)
    }

    #[test]
    fn changes_inside_referenced_definitions_count_where_they_are_used() {
        let with_zip = |t: &str| {
            json!({"type": "object", "properties": {"c": {"$ref": "#/$defs/C"}},
                   "$defs": {"C": {"type": "object", "properties": {"zip": {"type": t}}}}})
        };
        let issues = flagged(with_zip("string"), with_zip("integer"));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert!(issues[0].contains("c.zip"), "{issues:?}");
        // A root reference, draft 7 `definitions`.
        let root = |t: &str| {
            json!({"$ref": "#/definitions/O",
                   "definitions": {"O": {"type": "object", "properties": {"id": {"type": t}}}}})
        };
        assert_eq!(flagged(root("string"), root("integer")).len(), 1);
        // The same schema written inline or through a reference: nothing changed.
        let inline = json!({"properties": {"c": {"type": "string"}}});
        let by_ref =
            json!({"properties": {"c": {"$ref": "#/$defs/S"}}, "$defs": {"S": {"type": "string"}}});
        assert!(flagged(inline, by_ref).is_empty());
    }

    #[test]
    fn recursive_references_are_compared_without_looping() {
        let tree = |t: &str| {
            json!({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
                "properties": {"v": {"type": t}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}})
        };
        assert!(flagged(tree("string"), tree("string")).is_empty());
        assert!(!flagged(tree("string"), tree("integer")).is_empty());
    }

    #[test]
    fn constraints_may_be_dropped_but_not_added_or_changed() {
        let s = |extra: Value| {
            let mut base = json!({"type": "object", "properties": {"a": {"type": "string"}}});
            base["properties"]["a"]
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            base
        };
        for (old, new) in [
            (json!({"enum": ["a", "b"]}), json!({"enum": ["a"]})),
            (
                json!({"enum": ["a", "b"]}),
                json!({"enum": ["a", "b", "c"]}),
            ),
            (json!({"maxLength": 255}), json!({"maxLength": 8})),
            (json!({}), json!({"format": "email"})),
            (json!({}), json!({"pattern": "^[A-Z]+$"})),
            (json!({"const": "x"}), json!({"const": "y"})),
            (json!({}), json!({"not": {"const": ""}})),
        ] {
            assert!(
                !flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
        for (old, new) in [
            (json!({"maxLength": 255}), json!({})),
            (
                json!({"title": "A"}),
                json!({"title": "B", "description": "d"}),
            ),
        ] {
            assert!(
                flagged(s(old.clone()), s(new.clone())).is_empty(),
                "{old} -> {new}"
            );
        }
        // At the object level: closing it, or a conditional requirement.
        let open = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let mut closed = open.clone();
        closed["additionalProperties"] = json!(false);
        assert!(!flagged(open.clone(), closed.clone()).is_empty());
        assert!(flagged(closed, open.clone()).is_empty());
        let mut conditional = open.clone();
        conditional["dependentRequired"] = json!({"a": ["b"]});
        assert!(!flagged(open.clone(), conditional).is_empty());
        let mut wrapped = open.clone();
        wrapped["allOf"] = json!([{"properties": {"a": {"type": "string", "minLength": 1}}}]);
        assert!(!flagged(open, wrapped).is_empty());
    }

    #[test]
    fn false_schemas_and_covered_new_properties_are_flagged() {
        let a = |s: Value| json!({"properties": {"a": s}});
        assert!(!flagged(a(json!({})), a(json!(false))).is_empty());
        assert!(!flagged(json!(true), json!(false)).is_empty());
        assert!(flagged(a(json!(false)), a(json!({"type": "string"}))).is_empty());
        // `n` was allowed as a string through additionalProperties; naming it may change that.
        let old = json!({"type": "object", "additionalProperties": {"type": "string"}});
        let mut new = old.clone();
        new["properties"] = json!({"n": {"type": "integer"}});
        assert!(!flagged(old, new).is_empty());
        let old = json!({"type": "object", "patternProperties": {"^x_": {"type": "string"}}});
        let mut covered = old.clone();
        covered["properties"] = json!({"x_n": {"type": "integer"}});
        assert!(!flagged(old.clone(), covered).is_empty());
        let mut not_covered = old.clone();
        not_covered["properties"] = json!({"n": {"type": "integer"}});
        assert!(flagged(old, not_covered).is_empty());
        // A closed model: the property was forbidden, so adding it optional is an addition.
        let closed =
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": false});
        let mut added = closed.clone();
        added["properties"]["b"] = json!({"type": "integer"});
        assert!(flagged(closed, added).is_empty());
    }

    #[test]
    fn tuples_that_change_length_are_flagged() {
        let t = |items: Value| json!({"type": "array", "prefixItems": items});
        assert!(
            !flagged(
                t(json!([{"type": "string"}])),
                t(json!([{"type": "string"}, {"type": "boolean"}]))
            )
            .is_empty()
        );
        assert!(!flagged(t(json!([{"type": "string"}])), json!({"type": "array"})).is_empty());
    }
}
