//! A cheap scan of JSON text, for limits checked before the text reaches a recursive parser.

/// The deepest nesting of `{}` / `[]` in `text`, ignoring brackets inside strings. Malformed
/// text is scanned all the same (the parser that follows reports it).
pub fn max_depth(text: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::max_depth;

    #[test]
    fn counts_objects_and_arrays() {
        assert_eq!(max_depth("1"), 0);
        assert_eq!(max_depth("{}"), 1);
        assert_eq!(max_depth(r#"{"a": [1, {"b": []}]}"#), 4);
        assert_eq!(max_depth("[[[]], []]"), 3);
    }

    #[test]
    fn ignores_brackets_in_strings() {
        assert_eq!(max_depth(r#"{"a": "[[[{{{"}"#), 1);
        assert_eq!(max_depth(r#"{"a": "\"[[[", "b": {}}"#), 2);
        assert_eq!(max_depth(r#"["\\", [1]]"#), 2);
    }

    #[test]
    fn survives_malformed_text() {
        assert_eq!(max_depth("]]]}}}"), 0);
        assert_eq!(max_depth("[[[\"unterminated"), 3);
    }
}
