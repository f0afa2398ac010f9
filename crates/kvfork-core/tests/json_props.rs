//! `json::max_depth` against the depth of generated JSON values.

use kvfork_core::json::max_depth;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Value {
    Leaf(String),
    Array(Vec<Value>),
    Object(Vec<(String, Value)>),
}

impl Value {
    fn depth(&self) -> usize {
        match self {
            Value::Leaf(_) => 0,
            Value::Array(v) => 1 + v.iter().map(Value::depth).max().unwrap_or(0),
            Value::Object(v) => 1 + v.iter().map(|(_, x)| x.depth()).max().unwrap_or(0),
        }
    }

    fn render(&self) -> String {
        match self {
            Value::Leaf(s) => s.clone(),
            Value::Array(v) => format!(
                "[{}]",
                v.iter().map(Value::render).collect::<Vec<_>>().join(",")
            ),
            Value::Object(v) => format!(
                "{{{}}}",
                v.iter()
                    .map(|(k, x)| format!("{}:{}", quote(k), x.render()))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn value() -> impl Strategy<Value = Value> {
    // Strings full of brackets, quotes and backslashes: they must not count.
    let leaf = prop_oneof![
        "[0-9]{1,3}".prop_map(Value::Leaf),
        "[\\[\\]{}\"\\\\a ]{0,8}".prop_map(|s| Value::Leaf(quote(&s))),
    ];
    leaf.prop_recursive(8, 64, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[\\[{\"a]{0,4}", inner), 0..4).prop_map(Value::Object),
        ]
    })
}

proptest! {
    #[test]
    fn depth_of_rendered_values(v in value()) {
        prop_assert_eq!(max_depth(&v.render()), v.depth());
    }
}
