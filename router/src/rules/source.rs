//! Rule-file parsing for the rules loader (the config side of rule matching): YAML and JSON
//! text into a position-annotated tree, so every later check can name `file:line:col`.

use saphyr::{LoadableYamlNode, MarkedYamlOwned, ScalarOwned, YamlDataOwned};
use serde_json::{Map, Number, Value};

/// A YAML/JSON value with the 1-based position of its first character.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Node {
    pub line: usize,
    pub col: usize,
    pub kind: NodeKind,
}

/// The value of a [`Node`]. Mapping keys are string nodes (scalar keys are stringified).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NodeKind {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

/// A located problem found while parsing (line and column are 1-based).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SourceError {
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl Node {
    /// Short description of the node's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self.kind {
            NodeKind::Null => "null",
            NodeKind::Bool(_) => "a boolean",
            NodeKind::Int(_) | NodeKind::Float(_) => "a number",
            NodeKind::Str(_) => "a string",
            NodeKind::Seq(_) => "a list",
            NodeKind::Map(_) => "a mapping",
        }
    }

    /// The string value, if this is a string node.
    pub fn as_str(&self) -> Option<&str> {
        match &self.kind {
            NodeKind::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The entries, if this is a mapping.
    pub fn as_map(&self) -> Option<&[(Node, Node)]> {
        match &self.kind {
            NodeKind::Map(m) => Some(m),
            _ => None,
        }
    }

    /// The value under `key`, if this is a mapping holding it.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }

    /// The key node of `key`, if this is a mapping holding it.
    pub fn key_node(&self, key: &str) -> Option<&Node> {
        self.as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(k, _)| k)
    }

    /// The deepest node along a JSON pointer (RFC 6901); stops at the last node that exists.
    pub fn at_pointer(&self, pointer: &str) -> &Node {
        let mut cur = self;
        for raw in pointer.split('/').skip(1) {
            let token = raw.replace("~1", "/").replace("~0", "~");
            let next = match &cur.kind {
                NodeKind::Map(_) => cur.get(&token),
                NodeKind::Seq(items) => token.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            };
            match next {
                Some(n) => cur = n,
                None => break,
            }
        }
        cur
    }

    /// Converts to JSON; non-finite floats (`.inf`, `.nan`) are reported and become null.
    pub fn to_json(&self, errors: &mut Vec<SourceError>) -> Value {
        match &self.kind {
            NodeKind::Null => Value::Null,
            NodeKind::Bool(b) => Value::Bool(*b),
            NodeKind::Int(i) => Value::Number((*i).into()),
            NodeKind::Float(f) => match Number::from_f64(*f) {
                Some(n) => Value::Number(n),
                None => {
                    errors.push(SourceError {
                        line: self.line,
                        col: self.col,
                        message: format!("{f} is not a JSON number"),
                    });
                    Value::Null
                }
            },
            NodeKind::Str(s) => Value::String(s.clone()),
            NodeKind::Seq(items) => Value::Array(items.iter().map(|i| i.to_json(errors)).collect()),
            NodeKind::Map(entries) => {
                let mut m = Map::new();
                for (k, v) in entries {
                    let key = k.as_str().unwrap_or_default().to_string();
                    m.insert(key, v.to_json(errors));
                }
                Value::Object(m)
            }
        }
    }
}

/// Parses one rule file. `Ok(None)` is an empty file (no document). `.json` files are first
/// checked as strict JSON (so JSON-only mistakes are reported with serde_json's position),
/// then read with the YAML parser, of which JSON is a subset, to keep positions.
pub(crate) fn parse(text: &str, is_json: bool) -> Result<Option<Node>, Vec<SourceError>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if is_json && let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
        return Err(vec![SourceError {
            line: e.line().max(1),
            col: e.column().max(1),
            message: format!("JSON syntax error: {e}"),
        }]);
    }
    let docs = MarkedYamlOwned::load_from_str(text).map_err(|e| {
        vec![SourceError {
            line: e.marker().line().max(1),
            col: e.marker().col() + 1,
            message: format!("YAML syntax error: {}", e.info()),
        }]
    })?;
    let mut docs = docs.into_iter();
    let Some(first) = docs.next() else {
        return Ok(None);
    };
    let mut errors = Vec::new();
    if let Some(second) = docs.next() {
        errors.push(SourceError {
            line: second.span.start.line(),
            col: second.span.start.col() + 1,
            message:
                "a rule file holds one YAML document; split further documents into their own files"
                    .to_string(),
        });
    }
    if matches!(first.data, YamlDataOwned::BadValue) {
        return if errors.is_empty() {
            Ok(None)
        } else {
            Err(errors)
        };
    }
    let node = convert(&first, (1, 1), &mut errors);
    if errors.is_empty() {
        Ok(Some(node))
    } else {
        Err(errors)
    }
}

/// `at` is where to point when the parser gives the node no position (an empty value such as
/// `id:` is an implicit null at line 0): its key, or its parent.
fn convert(y: &MarkedYamlOwned, at: (usize, usize), errors: &mut Vec<SourceError>) -> Node {
    let (line, col) = if y.span.start.line() == 0 {
        at
    } else {
        (y.span.start.line(), y.span.start.col() + 1)
    };
    let kind = match &y.data {
        YamlDataOwned::Value(s) => scalar(s),
        YamlDataOwned::Representation(s, _, _) => NodeKind::Str(s.clone()),
        YamlDataOwned::Sequence(items) => NodeKind::Seq(
            items
                .iter()
                .map(|i| convert(i, (line, col), errors))
                .collect(),
        ),
        YamlDataOwned::Mapping(m) => {
            let mut entries = Vec::with_capacity(m.len());
            for (k, v) in m {
                let key_kind = match &k.data {
                    YamlDataOwned::Value(s) => match scalar(s) {
                        NodeKind::Str(s) => NodeKind::Str(s),
                        NodeKind::Int(i) => NodeKind::Str(i.to_string()),
                        NodeKind::Float(f) => NodeKind::Str(f.to_string()),
                        NodeKind::Bool(b) => NodeKind::Str(b.to_string()),
                        _ => NodeKind::Str("null".to_string()),
                    },
                    _ => {
                        errors.push(SourceError {
                            line: k.span.start.line(),
                            col: k.span.start.col() + 1,
                            message: "mapping keys must be plain strings".to_string(),
                        });
                        NodeKind::Str(String::new())
                    }
                };
                let key = Node {
                    line: if k.span.start.line() == 0 {
                        line
                    } else {
                        k.span.start.line()
                    },
                    col: if k.span.start.line() == 0 {
                        col
                    } else {
                        k.span.start.col() + 1
                    },
                    kind: key_kind,
                };
                let key_at = (key.line, key.col);
                entries.push((key, convert(v, key_at, errors)));
            }
            NodeKind::Map(entries)
        }
        YamlDataOwned::Tagged(_, inner) => return convert(inner, (line, col), errors),
        YamlDataOwned::Alias(_) | YamlDataOwned::BadValue => {
            errors.push(SourceError {
                line,
                col,
                message: "invalid value (unknown alias or a value that does not fit its tag)"
                    .to_string(),
            });
            NodeKind::Null
        }
    };
    Node { line, col, kind }
}

fn scalar(s: &ScalarOwned) -> NodeKind {
    match s {
        ScalarOwned::Null => NodeKind::Null,
        ScalarOwned::Boolean(b) => NodeKind::Bool(*b),
        ScalarOwned::Integer(i) => NodeKind::Int(*i),
        ScalarOwned::FloatingPoint(f) => NodeKind::Float(f.0),
        ScalarOwned::String(s) => NodeKind::Str(s.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn must(text: &str, json: bool) -> Node {
        match parse(text, json) {
            Ok(Some(n)) => n,
            other => panic!("{text:?}: {other:?}"),
        }
    }

    #[test]
    fn yaml_positions_are_one_based() {
        let n = must("a:\n  b: [1, 'x']\n", false);
        assert_eq!((n.line, n.col), (1, 1));
        let b = n.at_pointer("/a/b");
        assert_eq!((b.line, b.col), (2, 6));
        let x = n.at_pointer("/a/b/1");
        assert_eq!((x.line, x.col), (2, 10));
        assert_eq!(x.as_str(), Some("x"));
        let key = n
            .get("a")
            .and_then(|a| a.key_node("b"))
            .map(|k| (k.line, k.col));
        assert_eq!(key, Some((2, 3)));
        // Unknown pointer tokens stop at the deepest existing node.
        let stop = n.at_pointer("/a/zz/0");
        assert_eq!((stop.line, stop.col), (2, 3));
    }

    #[test]
    fn json_is_read_with_positions_and_checked_strictly() {
        let n = must("{\n\t\"a\": [1, {\"b\": null}]\n}\n", true);
        let b = n.at_pointer("/a/1/b");
        assert_eq!((b.line, b.col, &b.kind), (2, 17, &NodeKind::Null));
        let mut errs = Vec::new();
        assert_eq!(n.to_json(&mut errs), json!({"a": [1, {"b": null}]}));
        // Valid YAML, invalid JSON: trailing comma.
        let e = parse("{\"a\": [1,]}", true).expect_err("invalid JSON");
        assert_eq!((e[0].line, e[0].col), (1, 10));
        assert!(e[0].message.starts_with("JSON syntax error"));
    }

    #[test]
    fn yaml_errors_are_located() {
        let e = parse("a: [1\n", false).expect_err("bad");
        assert_eq!(e[0].line, 2);
        let e = parse("a: 1\na: 2\n", false).expect_err("dup");
        assert_eq!((e[0].line, e[0].col), (2, 1));
        assert!(e[0].message.contains("duplicated key"));
        let e = parse("a: 1\n---\nb: 2\n", false).expect_err("two docs");
        assert_eq!(e[0].line, 3);
        let e = parse("x: !!int abc\n", false).expect_err("bad tag");
        assert_eq!((e[0].line, e[0].col), (1, 4));
    }

    #[test]
    fn empty_files_and_non_finite_numbers() {
        assert_eq!(parse("", false), Ok(None));
        assert_eq!(parse("# only a comment\n", false), Ok(None));
        let n = must("a: .inf\n", false);
        let mut errs = Vec::new();
        let _ = n.to_json(&mut errs);
        assert_eq!((errs[0].line, errs[0].col), (1, 4));
    }
}
