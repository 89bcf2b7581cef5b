//! Contract loading helper (pipeline: contract stage, load time): maps a JSON pointer or a byte
//! offset in a contract's source text to a 1-based line and column for diagnostics.

/// 1-based (line, column) of byte `offset` in `text`; the column counts characters.
pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

/// Where the value at RFC 6901 `pointer` is written in the JSON `text`: the member's key for
/// object members, the value itself otherwise. `None` when the pointer does not resolve or the
/// text is not well-formed.
pub(crate) fn locate(text: &str, pointer: &str) -> Option<(usize, usize)> {
    let b = text.as_bytes();
    let mut pos = skip_ws(b, 0);
    let mut mark = pos;
    if !pointer.is_empty() {
        for token in pointer.strip_prefix('/')?.split('/') {
            let token = token.replace("~1", "/").replace("~0", "~");
            match b.get(pos)? {
                b'{' => {
                    pos += 1;
                    loop {
                        pos = skip_ws(b, pos);
                        if *b.get(pos)? != b'"' {
                            return None;
                        }
                        let key_start = pos;
                        let key_end = skip_string(b, pos)?;
                        let key: String =
                            serde_json::from_str(text.get(key_start..key_end)?).ok()?;
                        pos = skip_ws(b, key_end);
                        if *b.get(pos)? != b':' {
                            return None;
                        }
                        pos = skip_ws(b, pos + 1);
                        if key == token {
                            mark = key_start;
                            break;
                        }
                        pos = skip_ws(b, skip_value(b, pos)?);
                        if *b.get(pos)? != b',' {
                            return None;
                        }
                        pos += 1;
                    }
                }
                b'[' => {
                    let index: usize = token.parse().ok()?;
                    pos = skip_ws(b, pos + 1);
                    for _ in 0..index {
                        pos = skip_ws(b, skip_value(b, pos)?);
                        if *b.get(pos)? != b',' {
                            return None;
                        }
                        pos = skip_ws(b, pos + 1);
                    }
                    if matches!(b.get(pos)?, b']') {
                        return None;
                    }
                    mark = pos;
                }
                _ => return None,
            }
        }
    }
    Some(line_col(text, mark))
}

fn skip_ws(b: &[u8], mut pos: usize) -> usize {
    while matches!(b.get(pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        pos += 1;
    }
    pos
}

/// `pos` is at an opening quote; returns the index just past the closing quote.
fn skip_string(b: &[u8], pos: usize) -> Option<usize> {
    let mut i = pos + 1;
    loop {
        match b.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// Returns the index just past the value starting at `pos`.
fn skip_value(b: &[u8], pos: usize) -> Option<usize> {
    match b.get(pos)? {
        b'"' => skip_string(b, pos),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = pos;
            loop {
                match b.get(i)? {
                    b'"' => {
                        i = skip_string(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let mut i = pos;
            while let Some(c) = b.get(i) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                i += 1;
            }
            Some(i)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str =
        "{\n  \"a\": [1, {\"b~/\": \"x\"}],\n  \"c\": {\"d\": \"}\\\"\", \"e\": 2}\n}";

    #[test]
    fn locates_members_and_elements() {
        assert_eq!(locate(TEXT, ""), Some((1, 1)));
        assert_eq!(locate(TEXT, "/a"), Some((2, 3)));
        assert_eq!(locate(TEXT, "/a/0"), Some((2, 9)));
        assert_eq!(locate(TEXT, "/a/1/b~0~1"), Some((2, 13)));
        assert_eq!(locate(TEXT, "/c/e"), Some((3, 21)));
        assert_eq!(locate(TEXT, "/c/zz"), None);
        assert_eq!(locate(TEXT, "/a/5"), None);
    }

    #[test]
    fn line_col_counts_chars() {
        assert_eq!(line_col("é\néx", 5), (2, 2));
        assert_eq!(line_col("ab", 99), (1, 3));
    }
}
