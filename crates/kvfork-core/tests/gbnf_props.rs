//! `gbnf::check` against grammars printed from random syntax trees: every construct llama.cpp
//! reads (escapes, classes, groups over several lines, repetitions, comments), laid out with
//! random spacing. Printed whole they are accepted; cut inside a string literal or character
//! class they are refused, at a place inside the text.

use kvfork_core::gbnf::{check, undefined_rules};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Item {
    /// Characters, each with how to print it (see [`Style`]).
    Literal(Vec<Char>),
    /// Characters or ranges.
    Class {
        negated: bool,
        parts: Vec<(Char, Option<Char>)>,
    },
    Any,
    /// A later rule (by an offset modulo the number of later rules), so there is no left
    /// recursion; the last rule gets a literal instead.
    Ref(u8),
    Group(Vec<Vec<Piece>>),
}

/// A character of a literal or class, and how to print it.
type Char = (char, Style);

/// How to print a character: raw where it may stand raw, else escaped.
#[derive(Debug, Clone, Copy)]
enum Style {
    Raw,
    /// `\n`, `\"`, `\]`... where the character has one, else hex.
    Named,
    /// `\xHH`, `\uHHHH` or `\UHHHHHHHH`.
    Hex,
}

#[derive(Debug, Clone, Copy)]
enum Repeat {
    Once,
    Star,
    Plus,
    Optional,
    Exactly(u8),
    AtLeast(u8),
    Between(u8, u8),
}

#[derive(Debug, Clone)]
struct Piece {
    item: Item,
    repeat: Repeat,
}

type Alternatives = Vec<Vec<Piece>>;

/// Characters that need care somewhere: quotes, backslashes, brackets, controls, non-ASCII.
const CHARS: &[char] = &[
    'a', 'Z', '0', ' ', '"', '\\', '\n', '\t', '\r', 'é', '中', '😀', ']', '[', '-', '^', '#', '|',
    '(', ')', '{', '<', '.', '*',
];

fn character() -> impl Strategy<Value = Char> {
    let style = prop_oneof![Just(Style::Raw), Just(Style::Named), Just(Style::Hex)];
    (prop::sample::select(CHARS), style)
}

fn repeat() -> impl Strategy<Value = Repeat> {
    // Never `{0}` or `{0,0}`: an item repeated zero times leaves an empty alternative, and a
    // group of one repeated with `*` is left recursion to llama.cpp.
    prop_oneof![
        3 => Just(Repeat::Once),
        1 => Just(Repeat::Star),
        1 => Just(Repeat::Plus),
        1 => Just(Repeat::Optional),
        1 => (1u8..=3).prop_map(Repeat::Exactly),
        1 => (0u8..=3).prop_map(Repeat::AtLeast),
        1 => (0u8..=2, 1u8..=2).prop_map(|(min, more)| Repeat::Between(min, min + more)),
    ]
}

fn item() -> impl Strategy<Value = Item> {
    let leaf = prop_oneof![
        prop::collection::vec(character(), 1..5).prop_map(Item::Literal),
        (
            any::<bool>(),
            prop::collection::vec((character(), prop::option::of(character())), 1..4)
        )
            .prop_map(|(negated, parts)| Item::Class { negated, parts }),
        Just(Item::Any),
        any::<u8>().prop_map(Item::Ref),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        alternatives(inner, 1..4).prop_map(Item::Group)
    })
}

fn alternatives(
    item: impl Strategy<Value = Item>,
    count: std::ops::Range<usize>,
) -> impl Strategy<Value = Alternatives> {
    let piece = (item, repeat()).prop_map(|(item, repeat)| Piece { item, repeat });
    prop::collection::vec(prop::collection::vec(piece, 1..4), count)
}

/// Rules (the first is `root`) and the layout choices the printer cycles through.
fn grammar() -> impl Strategy<Value = (Vec<Alternatives>, Vec<u8>)> {
    (
        prop::collection::vec(alternatives(item(), 1..3), 1..5),
        prop::collection::vec(any::<u8>(), 1..64),
    )
}

/// Prints a grammar, noting where each literal's and class's inside lies.
struct Printer<'a> {
    out: Vec<char>,
    layout: &'a [u8],
    next: usize,
    names: Vec<String>,
    rule: usize,
    /// Char offsets of each opening `"` or `[` and of its closing `"` or `]`.
    spans: Vec<(usize, usize)>,
}

impl<'a> Printer<'a> {
    fn print(rules: &[Alternatives], layout: &'a [u8]) -> (String, Vec<(usize, usize)>) {
        let names = (0..rules.len())
            .map(|i| match i {
                0 => "root".to_string(),
                i if i % 3 == 1 => format!("r{i}"),
                i if i % 3 == 2 => format!("{i}-n"),
                i => format!("x-{i}"),
            })
            .collect();
        let mut p = Printer {
            out: Vec::new(),
            layout,
            next: 0,
            names,
            rule: 0,
            spans: Vec::new(),
        };
        let head = p.pick(&["", "# a grammar (\"x\" | [\n\n", "\n  \n"]);
        p.text(head);
        for (i, alternatives) in rules.iter().enumerate() {
            p.rule = i;
            let name = p.names[i].clone();
            p.text(&name);
            let marker = p.pick(&[" ::= ", " ::=\n  ", "\t::=\t", "::="]);
            p.text(marker);
            p.alternatives(alternatives, false);
            let end = p.pick(&["\n", "  # done \"[(\n", "\r\n", "\n\n# between\n\n"]);
            p.text(end);
        }
        (p.out.iter().collect(), p.spans)
    }

    fn choice(&mut self) -> usize {
        let c = self.layout[self.next % self.layout.len()];
        self.next += 1;
        usize::from(c)
    }

    fn pick(&mut self, options: &[&'static str]) -> &'static str {
        options[self.choice() % options.len()]
    }

    fn text(&mut self, s: &str) {
        self.out.extend(s.chars());
    }

    /// Space between items: newlines and comments only where no rule can end.
    fn space(&mut self, nested: bool) -> &'static str {
        if nested {
            self.pick(&[" ", "\n    ", " # note (\"\n  ", "\r\n ", "\t"])
        } else {
            self.pick(&[" ", "  ", "\t"])
        }
    }

    fn alternatives(&mut self, alternatives: &[Vec<Piece>], nested: bool) {
        for (i, sequence) in alternatives.iter().enumerate() {
            if i > 0 {
                let before = self.space(nested);
                self.text(before);
                self.text("|");
                // After '|' a newline never ends the rule.
                let after = self.pick(&[" ", "\n  ", " # or\n "]);
                self.text(after);
            }
            for (j, piece) in sequence.iter().enumerate() {
                if j > 0 {
                    let space = self.space(nested);
                    self.text(space);
                }
                self.item(&piece.item);
                self.repeat(piece.repeat);
            }
        }
    }

    fn item(&mut self, item: &Item) {
        match item {
            Item::Literal(chars) => {
                let open = self.out.len();
                self.text("\"");
                for &(c, style) in chars {
                    let printed = literal_char(c, style);
                    self.text(&printed);
                }
                self.spans.push((open, self.out.len()));
                self.text("\"");
            }
            Item::Class { negated, parts } => {
                let open = self.out.len();
                self.text(if *negated { "[^" } else { "[" });
                for &((c, style), end) in parts {
                    let printed = class_char(c, style);
                    self.text(&printed);
                    if let Some((end, style)) = end {
                        let printed = format!("-{}", class_char(end, style));
                        self.text(&printed);
                    }
                }
                self.spans.push((open, self.out.len()));
                self.text("]");
            }
            Item::Any => self.text("."),
            Item::Ref(offset) => {
                let later = self.names.len() - self.rule - 1;
                if later == 0 {
                    self.item(&Item::Literal(vec![('r', Style::Raw)]));
                } else {
                    let target = self.rule + 1 + usize::from(*offset) % later;
                    let name = self.names[target].clone();
                    self.text(&name);
                }
            }
            Item::Group(alternatives) => {
                self.text("(");
                let space = self.space(true);
                self.text(space);
                self.alternatives(alternatives, true);
                let space = self.space(true);
                self.text(space);
                self.text(")");
            }
        }
    }

    fn repeat(&mut self, repeat: Repeat) {
        // Spaces may stand before the operator and inside braces.
        let s = self.pick(&["", " "]);
        let suffix = match repeat {
            Repeat::Once => return,
            Repeat::Star => "*".to_string(),
            Repeat::Plus => "+".to_string(),
            Repeat::Optional => "?".to_string(),
            Repeat::Exactly(m) => format!("{{{s}{m}{s}}}"),
            Repeat::AtLeast(m) => format!("{{{m}{s},{s}}}"),
            Repeat::Between(m, n) => format!("{{{m}{s},{s}{n}}}"),
        };
        self.text(s);
        self.text(&suffix);
    }
}

/// Any character as a hex escape, the shortest of `\x`, `\u`, `\U` that holds it.
fn hex_escape(c: char) -> String {
    match u32::from(c) {
        n if n < 0x100 => format!("\\x{n:02X}"),
        n if n < 0x10000 => format!("\\u{n:04x}"),
        n => format!("\\U{n:08X}"),
    }
}

fn named_escape(c: char) -> Option<&'static str> {
    Some(match c {
        '\n' => "\\n",
        '\t' => "\\t",
        '\r' => "\\r",
        '\\' => "\\\\",
        '"' => "\\\"",
        '[' => "\\[",
        ']' => "\\]",
        '-' => "\\-",
        _ => return None,
    })
}

fn escaped(c: char, style: Style) -> String {
    match (style, named_escape(c)) {
        (Style::Named, Some(e)) => e.to_string(),
        _ => hex_escape(c),
    }
}

/// In a literal anything but `"` and `\` may stand raw, newlines included.
fn literal_char(c: char, style: Style) -> String {
    match style {
        Style::Raw if c != '"' && c != '\\' => c.to_string(),
        _ => escaped(c, style),
    }
}

/// In a class, letters, digits, spaces and non-ASCII stand raw (`-`, `^`, `]` would not).
fn class_char(c: char, style: Style) -> String {
    match style {
        Style::Raw if c.is_alphanumeric() || c == ' ' => c.to_string(),
        _ => escaped(c, style),
    }
}

/// The char offset a 1-based line and column point at.
fn offset_of(text: &str, line: usize, column: usize) -> Option<usize> {
    let mut offset = 0;
    for (i, l) in text.split('\n').enumerate() {
        if i + 1 == line {
            return (column <= l.chars().count() + 1).then_some(offset + column - 1);
        }
        offset += l.chars().count() + 1;
    }
    None
}

proptest! {
    #[test]
    fn printed_gbnf_grammars_are_accepted((rules, layout) in grammar()) {
        let (text, _) = Printer::print(&rules, &layout);
        if let Err(e) = check(&text) {
            return Err(TestCaseError::fail(format!("refused at {e}:\n{text}")));
        }
        prop_assert!(undefined_rules(&text).is_empty(), "{}", text);
    }

    #[test]
    fn gbnf_grammars_cut_inside_a_literal_or_class_are_refused(
        (rules, layout) in grammar(),
        which in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let (text, spans) = Printer::print(&rules, &layout);
        prop_assume!(!spans.is_empty());
        let (open, close) = spans[which.index(spans.len())];
        // Keep the opening quote or bracket, drop the closing one.
        let keep = open + 1 + cut.index(close - open);
        let truncated: String = text.chars().take(keep).collect();
        let e = match check(&truncated) {
            Ok(()) => return Err(TestCaseError::fail(format!("accepted {truncated:?}"))),
            Err(e) => e,
        };
        prop_assert!(e.message.contains("end of input"), "{} for {:?}", e, truncated);
        let at = offset_of(&truncated, e.line, e.column);
        prop_assert!(
            at.is_some_and(|at| at <= keep),
            "{} is outside {:?}", e, truncated
        );
    }
}
