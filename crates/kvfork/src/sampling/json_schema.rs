//! JSON schemas into GBNF grammars (llama.cpp's converter), with the problems its converter
//! would only report as a bare exception (or a stack overflow) found first, with a message
//! that says where.

use crate::backend;
use crate::error::{Error, Result};

/// Deepest JSON nesting accepted by [`json_schema_to_grammar`]: llama.cpp's converter recurses
/// once per level and overflows a thread's stack at ~1,500 schema levels (2 MiB).
pub const MAX_SCHEMA_DEPTH: usize = 256;

/// GBNF grammar for a JSON schema (llama.cpp's converter).
pub fn json_schema_to_grammar(schema_json: &str) -> Result<String> {
    let depth = kvfork_core::json::max_depth(schema_json);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(Error::Grammar(format!(
            "the schema nests {depth} levels deep (at most {MAX_SCHEMA_DEPTH})"
        )));
    }
    let schema: serde_json::Value = serde_json::from_str(schema_json)
        .map_err(|e| Error::Grammar(format!("the schema is not valid JSON: {e}")))?;
    if let Some(problem) = schema_problem(&schema, &schema, "#") {
        return Err(Error::Grammar(format!("bad JSON schema: {problem}")));
    }
    backend::ensure_backend()?;
    llama_cpp_2::json_schema_to_grammar(schema_json).map_err(|_| {
        Error::Grammar(
            "llama.cpp's converter rejected the JSON schema (an unsupported keyword or \
             combination; see llama.cpp's json-schema-to-grammar for what it supports)"
                .into(),
        )
    })
}

const JSON_TYPES: [&str; 7] = [
    "string", "number", "integer", "boolean", "object", "array", "null",
];

/// The first problem llama.cpp's converter would only report as a bare exception: a schema
/// that is not an object, an unknown `type`, a local `$ref` that resolves to nothing.
/// `at` is the JSON pointer of `node`, for the message.
fn schema_problem(root: &serde_json::Value, node: &serde_json::Value, at: &str) -> Option<String> {
    use serde_json::Value;
    let obj = match node {
        Value::Bool(_) => return None,
        Value::Object(o) => o,
        _ => return Some(format!("{at} must be an object (a schema), not {node}")),
    };
    let types: Vec<&Value> = match obj.get("type") {
        Some(Value::Array(ts)) => ts.iter().collect(),
        Some(t) => vec![t],
        None => vec![],
    };
    for t in types {
        if !t.as_str().is_some_and(|t| JSON_TYPES.contains(&t)) {
            return Some(format!(
                "{at}: unknown type {t} (one of {})",
                JSON_TYPES.join(", ")
            ));
        }
    }
    if let Some(Value::String(r)) = obj.get("$ref") {
        if let Some(pointer) = r.strip_prefix('#') {
            if root.pointer(pointer).is_none() {
                return Some(format!("{at}: $ref {r:?} points to nothing in the schema"));
            }
        }
    }
    let children: Vec<(String, &Value)> = obj
        .iter()
        .flat_map(|(k, v)| match (k.as_str(), v) {
            ("properties" | "$defs" | "definitions" | "patternProperties", Value::Object(m)) => m
                .iter()
                .map(|(name, s)| (format!("{at}/{k}/{name}"), s))
                .collect::<Vec<_>>(),
            ("items" | "additionalProperties" | "not", s @ Value::Object(_)) => {
                vec![(format!("{at}/{k}"), s)]
            }
            ("anyOf" | "oneOf" | "allOf" | "prefixItems", Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("{at}/{k}/{i}"), s))
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    children
        .into_iter()
        .find_map(|(path, s)| schema_problem(root, s, &path))
}
