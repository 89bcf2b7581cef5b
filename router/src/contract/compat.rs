//! Contract stage, authoring time: compares a new version of a type's `data` schema with the
//! previous one (`router contracts check`, and on upload). Only adding optional properties is
//! compatible.

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
/// Walks `type`, `properties`, `required` and `items` (also tuple `items` arrays and
/// `prefixItems`) recursively. Incompatible: a property removed, a `type` changed (any change of
/// the set of types, including adding or dropping the keyword), an optional property made
/// required, a new property that is required. `$ref`s are not followed.
pub fn check_compatibility(old: &Value, new: &Value) -> Vec<String> {
    compat_issues(old, new)
        .into_iter()
        .map(|i| i.message)
        .collect()
}

pub(crate) fn compat_issues(old: &Value, new: &Value) -> Vec<Issue> {
    let mut out = Vec::new();
    walk(old, new, "", "", &mut out);
    out
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
        (None, Some(n)) if n.is_object() => {
            walk(&any, n, &items_path, &format!("{ptr}/items"), out)
        }
        _ => {}
    }
    if let (Some(Value::Array(o)), Some(Value::Array(n))) =
        (old.get("prefixItems"), new.get("prefixItems"))
    {
        tuple(o, n, path, &format!("{ptr}/prefixItems"), out);
    }
}

fn tuple(old: &[Value], new: &[Value], path: &str, ptr: &str, out: &mut Vec<Issue>) {
    for (i, (o, n)) in old.iter().zip(new).enumerate() {
        walk(o, n, &format!("{path}[{i}]"), &format!("{ptr}/{i}"), out);
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
}
