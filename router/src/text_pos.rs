//! Source positions for the config side of the pipeline (rule files, contracts): byte offsets
//! in a file's text to the 1-based `line:column` that diagnostics print, and JSON pointers to
//! where their value is written.

use jsonc_parser::ast::{ObjectPropName, Value as JsonAst};
use std::collections::HashMap;

use jsonc_parser::common::Ranged as _;
use jsonc_parser::{CollectOptions, ParseOptions};

/// Line starts of a text, for turning byte offsets into positions in O(log lines).
pub(crate) struct Lines<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> Lines<'a> {
    /// Indexes `text`'s line starts.
    pub fn new(text: &'a str) -> Lines<'a> {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Lines { text, starts }
    }

    /// 1-based (line, column) of byte `offset`; the column counts characters. An offset past
    /// the end, or inside a character, is moved back to the nearest character boundary.
    pub fn at(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.starts.partition_point(|&s| s <= offset).max(1);
        let start = self.starts[line - 1];
        (line, self.text[start..offset].chars().count() + 1)
    }

    /// The rest of 1-based `line` from 0-based character column `col0`.
    pub fn rest_of_line(&self, line: usize, col0: usize) -> Option<&'a str> {
        let start = *self.starts.get(line.checked_sub(1)?)?;
        let end = self.starts.get(line).map_or(self.text.len(), |&e| e);
        let l = &self.text[start..end];
        let at = l.char_indices().nth(col0).map_or(l.len(), |(i, _)| i);
        Some(&l[at..])
    }
}

/// JSON parse options with every JSONC/JSON5 extension turned off: plain RFC 8259 JSON.
pub(crate) fn strict_json() -> ParseOptions {
    ParseOptions {
        allow_comments: false,
        allow_loose_object_property_names: false,
        allow_trailing_commas: false,
        allow_missing_commas: false,
        allow_single_quoted_strings: false,
        allow_hexadecimal_numbers: false,
        allow_unary_plus_numbers: false,
        allow_bare_decimal_point_numbers: false,
        allow_non_finite_numbers: false,
        allow_extended_string_escapes: false,
    }
}

/// Where every value of a JSON text is written, indexed once by JSON pointer, to locate many
/// pointers in it (a compatibility report can name tens of thousands of places in one file).
pub(crate) struct JsonPositions<'a> {
    /// Pointer → byte offset of the member's key (object members) or of the value.
    offsets: HashMap<String, usize>,
    lines: Lines<'a>,
}

impl<'a> JsonPositions<'a> {
    /// `None` when `text` is not one well-formed JSON value.
    pub fn new(text: &'a str) -> Option<JsonPositions<'a>> {
        let parsed =
            jsonc_parser::parse_to_ast(text, &CollectOptions::default(), &strict_json()).ok()?;
        let root = parsed.value?;
        let mut offsets = HashMap::new();
        let mut pointer = String::new();
        index(&root, root.range().start, &mut pointer, &mut offsets);
        Some(JsonPositions {
            offsets,
            lines: Lines::new(text),
        })
    }

    /// Where the value at RFC 6901 `pointer` is written: the member's key for object members,
    /// the value itself otherwise. `None` when the pointer does not resolve. With duplicated
    /// keys the last one is used, as serde_json keeps the last.
    pub fn locate(&self, pointer: &str) -> Option<(usize, usize)> {
        self.offsets.get(pointer).map(|&at| self.lines.at(at))
    }
}

fn index(v: &JsonAst<'_>, at: usize, pointer: &mut String, out: &mut HashMap<String, usize>) {
    out.insert(pointer.clone(), at);
    let len = pointer.len();
    match v {
        JsonAst::Object(o) => {
            for prop in &o.properties {
                let name = match &prop.name {
                    ObjectPropName::String(s) => s.value.as_ref(),
                    ObjectPropName::Word(w) => w.value,
                };
                pointer.push('/');
                pointer.push_str(&crate::event::pointer_token(name));
                index(&prop.value, prop.range.start, pointer, out);
                pointer.truncate(len);
            }
        }
        JsonAst::Array(a) => {
            for (i, e) in a.elements.iter().enumerate() {
                pointer.push('/');
                pointer.push_str(&i.to_string());
                index(e, e.range().start, pointer, out);
                pointer.truncate(len);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str =
        "{\n  \"a\": [1, {\"b~/\": \"x\"}],\n  \"c\": {\"d\": \"}\\\"\", \"e\": 2}\n}";

    #[test]
    fn locates_members_and_elements() {
        let p = JsonPositions::new(TEXT).expect("json");
        assert_eq!(p.locate(""), Some((1, 1)));
        assert_eq!(p.locate("/a"), Some((2, 3)));
        assert_eq!(p.locate("/a/0"), Some((2, 9)));
        assert_eq!(p.locate("/a/1/b~0~1"), Some((2, 13)));
        assert_eq!(p.locate("/c/e"), Some((3, 21)));
        assert_eq!(p.locate("/c/zz"), None);
        assert_eq!(p.locate("/a/5"), None);
        assert_eq!(p.locate("/a/01"), None);
        assert!(JsonPositions::new("{\"a\": 1,}").is_none());
    }

    #[test]
    fn positions_count_characters() {
        let l = Lines::new("é\néx");
        assert_eq!(l.at(5), (2, 2));
        assert_eq!(l.at(1), (1, 1), "inside a character: moved back");
        assert_eq!(Lines::new("ab").at(99), (1, 3));
        assert_eq!(l.rest_of_line(2, 1), Some("x"));
        assert_eq!(Lines::new("a\nbc\n").rest_of_line(1, 0), Some("a\n"));
        assert_eq!(Lines::new("a").rest_of_line(3, 0), None);
    }
}
