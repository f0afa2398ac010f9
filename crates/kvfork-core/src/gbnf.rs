//! A light scan of GBNF grammars, used only to explain a grammar llama.cpp refused (its
//! parser prints the reason to stderr, out of reach of the caller).

/// Rules a grammar references but never defines, in order of first use; plus `root` when
/// it is missing. Quoted strings, character classes and comments are skipped.
pub fn undefined_rules(src: &str) -> Vec<String> {
    let chars: Vec<char> = src.chars().collect();
    let mut defined = Vec::new();
    let mut used = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            open @ ('"' | '[') => {
                let close = if open == '"' { '"' } else { ']' };
                i += 1;
                while i < chars.len() && chars[i] != close {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c if is_name(c) => {
                let start = i;
                while i < chars.len() && is_name(chars[i]) {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let defines = chars[j..].starts_with(&[':', ':', '=']);
                let list = if defines { &mut defined } else { &mut used };
                if !list.contains(&name) {
                    list.push(name);
                }
            }
            _ => i += 1,
        }
    }
    let mut missing: Vec<String> = used.into_iter().filter(|u| !defined.contains(u)).collect();
    if !defined.iter().any(|d| d == "root") && !missing.iter().any(|m| m == "root") {
        missing.push("root".into());
    }
    missing
}

fn is_name(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_undefined_references_only() {
        assert_eq!(undefined_rules("root ::= foo"), vec!["foo"]);
        assert!(undefined_rules("root ::= item+\nitem ::= [a-z] \"x-y\" # note bar").is_empty());
        assert_eq!(undefined_rules("start ::= \"a\""), vec!["root"]);
        assert_eq!(
            undefined_rules("root ::= a | b-c\na ::= \"\\\"q\" [\\]z]"),
            vec!["b-c"]
        );
    }
}
