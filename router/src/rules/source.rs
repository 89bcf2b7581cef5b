//! Rule-file parsing for the rules loader (the config side of rule matching): YAML and JSON
//! text into a position-annotated tree, so every later check can name `file:line:col`.
//!
//! JSON files are read by a JSON parser (`jsonc-parser`, with every extension turned off), not
//! as YAML: YAML refuses JSON's UTF-16 surrogate-pair escapes (`"\ud83d\ude00"`), so a
//! pattern copied from EventBridge docs must not go through it. Numbers, in both formats,
//! become `serde_json::Number` from the text as written, so a rule's `18446744073709551615`
//! compares with an event's exactly as serde_json reads both.

use std::str::FromStr;

use jsonc_parser::CollectOptions;
use jsonc_parser::ast::{ObjectPropName, Value as JsonAst};
use jsonc_parser::common::Ranged as _;
use saphyr::{LoadableYamlNode, MarkedYamlOwned, ScalarOwned, YamlDataOwned};
use serde_json::{Map, Number, Value};

use crate::text_pos::{Lines, strict_json};

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
    /// A finite number, as serde_json reads its text (integers up to `u64` exactly).
    Number(Number),
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
            NodeKind::Number(_) => "a number",
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

    /// Converts to JSON.
    pub fn to_json(&self) -> Value {
        match &self.kind {
            NodeKind::Null => Value::Null,
            NodeKind::Bool(b) => Value::Bool(*b),
            NodeKind::Number(n) => Value::Number(n.clone()),
            NodeKind::Str(s) => Value::String(s.clone()),
            NodeKind::Seq(items) => Value::Array(items.iter().map(Node::to_json).collect()),
            NodeKind::Map(entries) => {
                let mut m = Map::new();
                for (k, v) in entries {
                    let key = k.as_str().unwrap_or_default().to_string();
                    m.insert(key, v.to_json());
                }
                Value::Object(m)
            }
        }
    }
}

/// Parses one rule file. `Ok(None)` is an empty YAML file (no document).
pub(crate) fn parse(text: &str, is_json: bool) -> Result<Option<Node>, Vec<SourceError>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if is_json {
        parse_json(text).map(Some)
    } else {
        parse_yaml(text)
    }
}

/// Strict JSON: serde_json checks the syntax first, so mistakes are reported as serde_json
/// words them, then jsonc-parser (extensions off) builds the tree with byte ranges.
fn parse_json(text: &str) -> Result<Node, Vec<SourceError>> {
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
        return Err(vec![SourceError {
            line: e.line().max(1),
            col: e.column().max(1),
            message: format!("JSON syntax error: {e}"),
        }]);
    }
    let lines = Lines::new(text);
    let parsed = jsonc_parser::parse_to_ast(text, &CollectOptions::default(), &strict_json())
        .map_err(|e| {
            let (line, col) = lines.at(e.range().start);
            vec![SourceError {
                line,
                col,
                message: format!("JSON syntax error: {}", e.kind()),
            }]
        })?;
    let Some(root) = parsed.value else {
        // serde_json already refused a text without a value.
        return Err(vec![SourceError {
            line: 1,
            col: 1,
            message: "JSON syntax error: the file holds no value".to_string(),
        }]);
    };
    let mut errors = Vec::new();
    let node = json_node(&root, &lines, &mut errors);
    if errors.is_empty() {
        Ok(node)
    } else {
        Err(errors)
    }
}

fn json_node(v: &JsonAst<'_>, lines: &Lines<'_>, errors: &mut Vec<SourceError>) -> Node {
    let (line, col) = lines.at(v.range().start);
    let kind = match v {
        JsonAst::NullKeyword(_) => NodeKind::Null,
        JsonAst::BooleanLit(b) => NodeKind::Bool(b.value),
        JsonAst::StringLit(s) => NodeKind::Str(s.value.to_string()),
        JsonAst::NumberLit(n) => match Number::from_str(n.value) {
            Ok(n) => NodeKind::Number(n),
            Err(e) => {
                errors.push(SourceError {
                    line,
                    col,
                    message: format!("{} is not a usable number: {e}", n.value),
                });
                NodeKind::Null
            }
        },
        JsonAst::Array(a) => NodeKind::Seq(
            a.elements
                .iter()
                .map(|e| json_node(e, lines, errors))
                .collect(),
        ),
        JsonAst::Object(o) => {
            let mut entries: Vec<(Node, Node)> = Vec::with_capacity(o.properties.len());
            for prop in &o.properties {
                let (name, range) = match &prop.name {
                    ObjectPropName::String(s) => (s.value.to_string(), s.range),
                    ObjectPropName::Word(w) => (w.value.to_string(), w.range),
                };
                let (kl, kc) = lines.at(range.start);
                // serde_json keeps the last of duplicated keys and YAML refuses them: refuse,
                // since either copy may be the one the author meant.
                if let Some((first, _)) = entries.iter().find(|(k, _)| k.as_str() == Some(&name)) {
                    errors.push(SourceError {
                        line: kl,
                        col: kc,
                        message: format!(
                            "duplicated key `{name}` (first at line {}, column {})",
                            first.line, first.col
                        ),
                    });
                    continue;
                }
                let key = Node {
                    line: kl,
                    col: kc,
                    kind: NodeKind::Str(name),
                };
                entries.push((key, json_node(&prop.value, lines, errors)));
            }
            NodeKind::Map(entries)
        }
    };
    Node { line, col, kind }
}

fn parse_yaml(text: &str) -> Result<Option<Node>, Vec<SourceError>> {
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
    let lines = Lines::new(text);
    let node = convert(&first, (1, 1), &lines, &mut errors);
    if errors.is_empty() {
        Ok(Some(node))
    } else {
        Err(errors)
    }
}

/// `at` is where to point when the parser gives the node no position (an empty value such as
/// `id:` is an implicit null at line 0): its key, or its parent.
fn convert(
    y: &MarkedYamlOwned,
    at: (usize, usize),
    lines: &Lines<'_>,
    errors: &mut Vec<SourceError>,
) -> Node {
    let (line, col) = if y.span.start.line() == 0 {
        at
    } else {
        (y.span.start.line(), y.span.start.col() + 1)
    };
    let kind = match &y.data {
        YamlDataOwned::Value(ScalarOwned::FloatingPoint(f)) if !f.0.is_finite() => {
            errors.push(SourceError {
                line,
                col,
                message: format!("{} is not a JSON number", f.0),
            });
            NodeKind::Null
        }
        // Numbers are read from their text as serde_json reads them: YAML rounds integers
        // past i64 to f64. Forms JSON lacks (`0x10`, `+1`, `.5`) keep YAML's value.
        YamlDataOwned::Value(s @ (ScalarOwned::Integer(_) | ScalarOwned::FloatingPoint(_))) => {
            let chars = y.span.end.index().saturating_sub(y.span.start.index());
            let written = lines
                .rest_of_line(y.span.start.line(), y.span.start.col())
                .map(|rest| rest.chars().take(chars).collect::<String>())
                .and_then(|w| Number::from_str(&w).ok());
            match written {
                Some(n) => NodeKind::Number(n),
                None => scalar(s),
            }
        }
        YamlDataOwned::Value(s) => scalar(s),
        YamlDataOwned::Representation(s, _, _) => NodeKind::Str(s.clone()),
        YamlDataOwned::Sequence(items) => NodeKind::Seq(
            items
                .iter()
                .map(|i| convert(i, (line, col), lines, errors))
                .collect(),
        ),
        YamlDataOwned::Mapping(m) => {
            let mut entries = Vec::with_capacity(m.len());
            // `<<: *anchor` entries, merged once the mapping's own keys are known.
            let mut merged = Vec::new();
            for (k, v) in m {
                let key_kind = match &k.data {
                    YamlDataOwned::Value(s) => match scalar(s) {
                        NodeKind::Str(s) => NodeKind::Str(s),
                        NodeKind::Number(n) => NodeKind::Str(n.to_string()),
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
                let value = convert(v, key_at, lines, errors);
                if key.as_str() == Some(MERGE_KEY) && is_plain(k) {
                    merged.push((key, value));
                } else {
                    entries.push((key, value));
                }
            }
            for (key, value) in merged {
                merge_into(&mut entries, &key, value, errors);
            }
            NodeKind::Map(entries)
        }
        YamlDataOwned::Tagged(_, inner) => return convert(inner, (line, col), lines, errors),
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

/// The YAML 1.1 merge key: `<<: *common` (or `<<: [*a, *b]`) copies the entries of the
/// anchored mappings that the mapping does not set itself. YAML 1.2 (the parser's) dropped
/// it, but it is how rule files share policy and target settings, and read as a plain key
/// it was refused as "unknown field `<<`".
const MERGE_KEY: &str = "<<";

/// Whether the key was written plain (`<<`), not quoted (`"<<"`, an ordinary key).
fn is_plain(k: &MarkedYamlOwned) -> bool {
    k.span.end.index().saturating_sub(k.span.start.index()) == MERGE_KEY.len()
}

/// Merges `value` (a mapping, or a list of mappings whose earlier ones win) of merge key
/// `key` into `entries`: keys already there stay as they are.
fn merge_into(
    entries: &mut Vec<(Node, Node)>,
    key: &Node,
    value: Node,
    errors: &mut Vec<SourceError>,
) {
    let sources = match value.kind {
        NodeKind::Map(m) => vec![m],
        NodeKind::Seq(items) => {
            let mut maps = Vec::with_capacity(items.len());
            for item in items {
                match item.kind {
                    NodeKind::Map(m) => maps.push(m),
                    _ => errors.push(SourceError {
                        line: item.line,
                        col: item.col,
                        message: format!(
                            "a merge key (`{MERGE_KEY}`) merges mappings, not {}",
                            item.type_name()
                        ),
                    }),
                }
            }
            maps
        }
        _ => {
            errors.push(SourceError {
                line: key.line,
                col: key.col,
                message: format!(
                    "a merge key (`{MERGE_KEY}: *anchor`) needs a mapping or a list of mappings, not {}",
                    value.type_name()
                ),
            });
            return;
        }
    };
    for source in sources {
        for (k, v) in source {
            if !entries.iter().any(|(e, _)| e.as_str() == k.as_str()) {
                entries.push((k, v));
            }
        }
    }
}

fn scalar(s: &ScalarOwned) -> NodeKind {
    match s {
        ScalarOwned::Null => NodeKind::Null,
        ScalarOwned::Boolean(b) => NodeKind::Bool(*b),
        ScalarOwned::Integer(i) => NodeKind::Number((*i).into()),
        // `convert` reports non-finite floats, which have no JSON form.
        ScalarOwned::FloatingPoint(f) => {
            Number::from_f64(f.0).map_or(NodeKind::Null, NodeKind::Number)
        }
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

    /// `<<: *common` merges the anchored mapping's entries the mapping does not set itself
    /// (YAML 1.1's merge key): it was refused as "unknown field `<<`".
    #[test]
    fn yaml_merge_keys_merge_anchored_mappings() {
        let n = must(
            "base: &base { timeout: 2s, retry: { max_attempts: 3 } }\n\
             other: &other { timeout: 9s, ordering: partitionkey }\n\
             fast:\n  timeout: 1s\n  <<: [*base, *other]\n\
             quoted: { \"<<\": x }\n",
            false,
        );
        assert_eq!(
            n.get("fast").map(Node::to_json),
            Some(
                json!({"timeout": "1s", "retry": {"max_attempts": 3}, "ordering": "partitionkey"})
            )
        );
        // A merged value points where it is written (the anchor's mapping).
        let retry = n.at_pointer("/fast/retry");
        assert_eq!((retry.line, retry.col), (1, 35));
        // A quoted `"<<"` is an ordinary key.
        assert_eq!(n.at_pointer("/quoted").to_json(), json!({"<<": "x"}));
        let e = parse("a: { <<: 5 }\n", false).expect_err("not a mapping");
        assert!(e[0].message.contains("needs a mapping"), "{e:?}");
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
        assert_eq!(n.to_json(), json!({"a": [1, {"b": null}]}));
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
        let e = parse("a: .inf\n", false).expect_err("infinite");
        assert_eq!((e[0].line, e[0].col), (1, 4));
        assert!(e[0].message.contains("not a JSON number"), "{e:?}");
        let e = parse("a: [1, 1e400]\n", false).expect_err("overflow");
        assert_eq!((e[0].line, e[0].col), (1, 8));
    }

    #[test]
    fn json_files_take_surrogate_pairs_and_refuse_duplicated_keys() {
        let n = must(r#"{"s": ["\ud83d\ude00", "caf\u00e9"]}"#, true);
        assert_eq!(n.to_json(), json!({"s": ["\u{1F600}", "café"]}));
        let e = parse("{\n  \"a\": 1,\n  \"a\": 2\n}", true).expect_err("dup");
        assert_eq!((e[0].line, e[0].col), (3, 3));
        assert!(
            e[0].message
                .contains("duplicated key `a` (first at line 2, column 3)"),
            "{e:?}"
        );
        // A lone surrogate is not a character: serde_json refuses it with a position.
        let e = parse(r#"{"s": "\ud83d"}"#, true).expect_err("lone surrogate");
        assert!(e[0].message.starts_with("JSON syntax error"), "{e:?}");
        // Columns count characters, not bytes.
        let n = must("{\"é\": {\"ü\": true}}", true);
        let inner = n.at_pointer("/é/ü");
        assert_eq!((inner.line, inner.col), (1, 13));
    }

    #[test]
    fn numbers_keep_the_value_written_in_both_formats() {
        for (text, json) in [
            (
                "a: [18446744073709551615, -9223372036854775808, 9007199254740993, 2.5, 1e2]\n",
                false,
            ),
            (
                r#"{"a": [18446744073709551615, -9223372036854775808, 9007199254740993, 2.5, 1e2]}"#,
                true,
            ),
        ] {
            let n = must(text, json);
            let want: Value = serde_json::from_str(
                "[18446744073709551615, -9223372036854775808, 9007199254740993, 2.5, 1e2]",
            )
            .expect("json");
            assert_eq!(n.at_pointer("/a").to_json(), want, "{text}");
        }
        // YAML-only spellings keep YAML's reading.
        let n = must("a: [0x10, +3, .5]\n", false);
        assert_eq!(n.at_pointer("/a").to_json(), json!([16, 3, 0.5]));
    }
}
