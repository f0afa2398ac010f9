//! GBNF grammars checked before llama.cpp sees them.
//!
//! llama.cpp's grammar parser (`llama_grammar_parser::parse` in `src/llama-grammar.cpp`)
//! reports why it refused a grammar only on stderr, out of the caller's reach: all kvfork
//! would learn is that it failed. [`check`] follows the same rules, then makes the checks
//! llama.cpp makes after parsing (undefined rules, a `root` rule, left recursion), so a
//! refusal says where (line and column) and what was expected.
//!
//! To judge left recursion and llama.cpp's limit on repetitions as llama.cpp does, the check
//! builds the same rules llama.cpp builds (groups and repetitions become rules of their own),
//! keeping only what those checks look at: terminals, rule references, alternatives.
//!
//! Where this check knowingly differs from llama.cpp:
//! - `{m,n}` with `n < m` is refused (llama.cpp would try to build about 2^64 rules);
//! - groups nested more than 256 deep are refused (llama.cpp recurses once per level and can
//!   overflow its stack, which would end the process);
//! - the text of a `<token>` reference is not looked up: only llama.cpp has the vocabulary.

use std::collections::HashMap;
use std::fmt;

/// llama.cpp's `MAX_REPETITION_THRESHOLD`: the most a repetition may count, and the most
/// rules nested repetitions may multiply into.
const MAX_REPETITIONS: u64 = 2000;

/// How deep groups may nest: far beyond any real grammar, far below a thread's stack.
const MAX_NESTING: usize = 256;

/// Stands for the end of the text: llama.cpp reads a C string, so it sees its NUL
/// terminator there (and [`check`] refuses a NUL inside the text).
const END: char = '\0';

/// Why a GBNF grammar would be refused, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    /// 1-based line of the error.
    pub line: usize,
    /// 1-based column of the error, in characters (not bytes).
    pub column: usize,
    /// What was expected and what was found instead.
    pub message: String,
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: {}",
            self.line, self.column, self.message
        )
    }
}

impl std::error::Error for SyntaxError {}

/// Checks a GBNF grammar (start rule `root`) as llama.cpp would parse and load it: `Ok` when
/// llama.cpp accepts it (a `<token>` reference may still not be a single token of the model).
pub fn check(src: &str) -> Result<(), SyntaxError> {
    let chars: Vec<char> = src.chars().collect();
    check_chars(&chars).map_err(|failure| failure.locate(&chars))
}

fn check_chars(chars: &[char]) -> Result<(), Failure> {
    if let Some(at) = chars.iter().position(|&c| c == END) {
        return Err(Failure::new(
            at,
            "a NUL character: llama.cpp reads the grammar as a C string and would stop here",
        ));
    }
    let symbols = Parser::new(chars).grammar()?;
    symbols.check_defined()?;
    symbols.check_root()?;
    symbols.check_left_recursion()
}

/// An error at a character offset, before it is told as a line and column.
struct Failure {
    at: usize,
    message: String,
}

impl Failure {
    fn new(at: usize, message: impl Into<String>) -> Self {
        Failure {
            at,
            message: message.into(),
        }
    }

    fn locate(self, chars: &[char]) -> SyntaxError {
        let (line, column) = line_and_column(chars, self.at);
        SyntaxError {
            line,
            column,
            message: self.message,
        }
    }
}

/// 1-based line and column of character offset `at` (lines end at `\n`).
fn line_and_column(chars: &[char], at: usize) -> (usize, usize) {
    let before = &chars[..at.min(chars.len())];
    let line = 1 + before.iter().filter(|&&c| c == '\n').count();
    let column = 1 + before.iter().rev().take_while(|&&c| c != '\n').count();
    (line, column)
}

/// "line L, column C" of an offset, to point back at an opening bracket or quote.
fn place(chars: &[char], at: usize) -> String {
    let (line, column) = line_and_column(chars, at);
    format!("line {line}, column {column}")
}

/// llama.cpp's `is_word_char`: rule names hold ASCII letters, digits and `-` (no `_`: the
/// rules llama.cpp makes up for groups and repetitions are named `rule_N`).
fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

/// One element of a rule, as far as the checks after parsing need to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Element {
    /// Anything that matches characters or a token: a literal, a class, `.`, `<token>`.
    Terminal,
    /// A reference to the rule with this id.
    Ref(usize),
    /// Ends one alternative; another follows.
    Alt,
    /// Ends the last alternative.
    End,
}

/// A rule name (written, or made up by llama.cpp for a group or repetition).
struct Symbol {
    /// The written name; for a made-up rule, the name of the rule it was written in.
    name: String,
    made_up: bool,
    /// Where it was first used or defined (a made-up rule: its group or repetition).
    at: usize,
    /// `None` until defined.
    body: Option<Vec<Element>>,
}

/// llama.cpp's `symbol_ids` and `rules`: every name gets an id on first sight, used or
/// defined, and its count drives the repetition limit.
#[derive(Default)]
struct Symbols {
    ids: HashMap<String, usize>,
    list: Vec<Symbol>,
}

impl Symbols {
    /// The id of a written name, new on first sight.
    fn named(&mut self, name: &str, at: usize) -> usize {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.push(name, false, at);
        self.ids.insert(name.to_string(), id);
        id
    }

    /// A new rule for a group or repetition inside the rule `owner`.
    fn made_up(&mut self, owner: &str, at: usize) -> usize {
        self.push(owner, true, at)
    }

    fn push(&mut self, name: &str, made_up: bool, at: usize) -> usize {
        self.list.push(Symbol {
            name: name.to_string(),
            made_up,
            at,
            body: None,
        });
        self.list.len() - 1
    }

    /// Sets (or, as llama.cpp does for a rule defined twice, replaces) a rule's body.
    fn define(&mut self, id: usize, body: Vec<Element>, at: usize) {
        let symbol = &mut self.list[id];
        symbol.body = Some(body);
        symbol.at = at;
    }

    fn count(&self) -> usize {
        self.list.len()
    }

    /// A name used but never defined: symbols are made in the order of the text, so the
    /// first one found is the first used.
    fn check_defined(&self) -> Result<(), Failure> {
        match self.list.iter().find(|s| s.body.is_none()) {
            Some(s) => Err(Failure::new(
                s.at,
                format!(
                    "undefined rule identifier '{0}' (expected a rule '{0} ::= ...')",
                    s.name
                ),
            )),
            None => Ok(()),
        }
    }

    /// llama.cpp starts from `root` (and refuses a grammar with no rules at all).
    fn check_root(&self) -> Result<(), Failure> {
        if self.list.is_empty() {
            return Err(Failure::new(
                0,
                "the grammar defines no rules (expected at least 'root ::= ...')",
            ));
        }
        if self.ids.contains_key("root") {
            return Ok(());
        }
        Err(Failure::new(
            0,
            "undefined rule 'root': it is where the grammar starts \
             (expected a rule 'root ::= ...')",
        ))
    }

    /// llama.cpp refuses a rule that can reach itself at its left edge: through the first
    /// reference of an alternative, or a later one when every reference before it is to a
    /// rule with an empty alternative (llama.cpp looks no deeper for emptiness).
    fn check_left_recursion(&self) -> Result<(), Failure> {
        let empty: Vec<bool> = self.list.iter().map(has_empty_alternative).collect();
        let edges: Vec<Vec<usize>> = self
            .list
            .iter()
            .map(|s| leftmost_references(s.body.as_deref().unwrap_or(&[]), &empty))
            .collect();
        match find_cycle(&edges) {
            Some(cycle) => Err(self.left_recursion(&cycle)),
            None => Ok(()),
        }
    }

    /// The error for a left-recursive cycle, told at a written rule on it when there is one.
    fn left_recursion(&self, cycle: &[usize]) -> Failure {
        let written = cycle.iter().find(|&&id| !self.list[id].made_up);
        let symbol = &self.list[*written.unwrap_or(&cycle[0])];
        let what = if symbol.made_up {
            format!(
                "a group or repetition in rule '{}' can reach itself",
                symbol.name
            )
        } else {
            format!("rule '{}' can reach itself", symbol.name)
        };
        Failure::new(
            symbol.at,
            format!(
                "left recursion: {what} again before matching any character, \
                 which llama.cpp does not support (expected something to match first)"
            ),
        )
    }
}

fn has_empty_alternative(symbol: &Symbol) -> bool {
    let mut at_start = true;
    for element in symbol.body.iter().flatten() {
        match element {
            Element::Alt | Element::End if at_start => return true,
            Element::Alt | Element::End => at_start = true,
            _ => at_start = false,
        }
    }
    false
}

/// The rules a body may start with (llama.cpp's `llama_grammar_detect_left_recursion`).
fn leftmost_references(body: &[Element], empty: &[bool]) -> Vec<usize> {
    let mut found = Vec::new();
    let mut at_left_edge = true;
    for &element in body {
        match element {
            Element::Ref(id) if at_left_edge => {
                found.push(id);
                at_left_edge = empty[id];
            }
            Element::Alt | Element::End => at_left_edge = true,
            _ => at_left_edge = false,
        }
    }
    found
}

/// A cycle in a directed graph, first node the one reached twice (an iterative depth-first
/// search: chains of made-up rules can be long).
fn find_cycle(edges: &[Vec<usize>]) -> Option<Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Visit {
        New,
        Open,
        Done,
    }
    let mut visit = vec![Visit::New; edges.len()];
    for start in 0..edges.len() {
        if visit[start] != Visit::New {
            continue;
        }
        visit[start] = Visit::Open;
        // Each open node with the index of its next edge to follow.
        let mut path = vec![(start, 0)];
        while let Some(&(node, next)) = path.last() {
            let Some(&to) = edges[node].get(next) else {
                visit[node] = Visit::Done;
                path.pop();
                continue;
            };
            if let Some(top) = path.last_mut() {
                top.1 += 1;
            }
            match visit[to] {
                Visit::Open => {
                    let from = path.iter().position(|&(n, _)| n == to).unwrap_or(0);
                    return Some(path[from..].iter().map(|&(n, _)| n).collect());
                }
                Visit::New => {
                    visit[to] = Visit::Open;
                    path.push((to, 0));
                }
                Visit::Done => {}
            }
        }
    }
    None
}

/// The last item of a sequence, the one a repetition operator repeats.
struct LastItem {
    /// Where it starts in the rule's body (`body.len()` when there is none).
    start: usize,
    /// llama.cpp's `n_prev_rules`: how many rules repeating it multiplies.
    rules: u64,
}

/// A recursive-descent parser over the characters, one method per construct of llama.cpp's.
struct Parser<'a> {
    chars: &'a [char],
    pos: usize,
    symbols: Symbols,
    depth: usize,
}

impl<'a> Parser<'a> {
    fn new(chars: &'a [char]) -> Self {
        Parser {
            chars,
            pos: 0,
            symbols: Symbols::default(),
            depth: 0,
        }
    }

    fn at(&self, i: usize) -> char {
        self.chars.get(i).copied().unwrap_or(END)
    }

    fn peek(&self) -> char {
        self.at(self.pos)
    }

    fn fail<T>(&self, at: usize, message: String) -> Result<T, Failure> {
        Err(Failure::new(at, message))
    }

    fn place(&self, at: usize) -> String {
        place(self.chars, at)
    }

    /// The input ended inside `what`, opened at `open`, where `expected` should have come.
    fn unclosed<T>(&self, open: usize, what: &str, expected: &str) -> Result<T, Failure> {
        let opened = self.place(open);
        self.fail(
            self.pos,
            format!("unexpected end of input in {what} opened at {opened} (expected {expected})"),
        )
    }

    /// What stands at `at`, for "found ...": a whole word, a character, or an end.
    fn found(&self, at: usize) -> String {
        match self.at(at) {
            END => "the end of input".into(),
            '\n' | '\r' => "the end of the line".into(),
            c if is_word_char(c) => {
                let word: String = self.chars[at..]
                    .iter()
                    .take_while(|&&c| is_word_char(c))
                    .collect();
                format!("'{word}'")
            }
            c => format!("{c:?}"),
        }
    }

    /// Spaces, tabs and `#` comments; newlines too where a rule cannot end (llama.cpp's
    /// `parse_space`): after `::=` and `|`, and inside parentheses.
    fn skip_space(&mut self, newline_ok: bool) {
        loop {
            match self.peek() {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newline_ok => self.pos += 1,
                '#' => {
                    while !matches!(self.peek(), END | '\r' | '\n') {
                        self.pos += 1;
                    }
                }
                _ => return,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while is_word_char(self.peek()) {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.chars[start..self.pos].iter().collect())
    }

    fn grammar(mut self) -> Result<Symbols, Failure> {
        self.skip_space(true);
        while self.peek() != END {
            self.rule()?;
        }
        Ok(self.symbols)
    }

    /// `name ::= alternates`, ended by a newline or the end of input.
    fn rule(&mut self) -> Result<(), Failure> {
        let start = self.pos;
        let Some(name) = self.name() else {
            let hint = if self.peek() == '|' {
                " (an alternative on a new line must follow a '|' that ends the line before, \
                 or sit inside parentheses)"
            } else {
                ""
            };
            let found = self.found(start);
            return self.fail(
                start,
                format!("expected a rule name at the start of a rule, found {found}{hint}"),
            );
        };
        let id = self.symbols.named(&name, start);
        self.skip_space(false);
        if self.chars[self.pos..].starts_with(&[':', ':', '=']) {
            self.pos += 3;
        } else {
            let found = self.found(self.pos);
            let hint = name_hint(self.peek());
            return self.fail(
                self.pos,
                format!("expected '::=' after the rule name '{name}', found {found}{hint}"),
            );
        }
        self.skip_space(true);
        let body = self.alternates(&name, false)?;
        self.symbols.define(id, body, start);
        self.end_of_rule(&name)?;
        self.skip_space(true);
        Ok(())
    }

    fn end_of_rule(&mut self, name: &str) -> Result<(), Failure> {
        match self.peek() {
            '\r' if self.at(self.pos + 1) == '\n' => self.pos += 2,
            '\r' | '\n' => self.pos += 1,
            END => {}
            c => {
                let found = self.found(self.pos);
                let hint = if c == ')' {
                    " (no group is open)"
                } else {
                    name_hint(c)
                };
                return self.fail(
                    self.pos,
                    format!(
                        "expected an item, '|' or the end of the line in rule '{name}', \
                         found {found}{hint}"
                    ),
                );
            }
        }
        Ok(())
    }

    /// Sequences separated by `|`, as one rule's body.
    fn alternates(&mut self, rule: &str, nested: bool) -> Result<Vec<Element>, Failure> {
        let mut body = Vec::new();
        self.sequence(&mut body, rule, nested)?;
        while self.peek() == '|' {
            body.push(Element::Alt);
            self.pos += 1;
            self.skip_space(true);
            self.sequence(&mut body, rule, nested)?;
        }
        body.push(Element::End);
        Ok(body)
    }

    /// Items and repetition operators, up to the first character that is neither.
    fn sequence(
        &mut self,
        body: &mut Vec<Element>,
        rule: &str,
        nested: bool,
    ) -> Result<(), Failure> {
        let mut last = LastItem {
            start: body.len(),
            rules: 1,
        };
        loop {
            let at = self.pos;
            let (min, max) = match self.peek() {
                '*' => (0, None),
                '+' => (1, None),
                '?' => (0, Some(1)),
                '{' => {
                    let (min, max) = self.braces(nested)?;
                    self.repeat(body, &mut last, min, max, rule, at)?;
                    continue;
                }
                c if starts_item(c) => {
                    let (element, rules) = self.item(rule)?;
                    last = LastItem {
                        start: body.len(),
                        rules,
                    };
                    body.extend(element);
                    self.skip_space(nested);
                    continue;
                }
                _ => return Ok(()),
            };
            self.pos += 1;
            self.skip_space(nested);
            self.repeat(body, &mut last, min, max, rule, at)?;
        }
    }

    /// One item: its element (none for `""` or `[]`, which match nothing) and how many rules
    /// repeating it multiplies.
    fn item(&mut self, rule: &str) -> Result<(Option<Element>, u64), Failure> {
        let element = match self.peek() {
            '"' => self.literal()?,
            '[' => self.class()?,
            '<' | '!' => self.token()?,
            '(' => return self.group(rule),
            '.' => {
                self.pos += 1;
                Some(Element::Terminal)
            }
            _ => Some(self.reference()),
        };
        Ok((element, 1))
    }

    /// `"..."`: any characters but an unescaped `"`, newlines included.
    fn literal(&mut self) -> Result<Option<Element>, Failure> {
        let open = self.pos;
        self.pos += 1;
        let mut empty = true;
        while self.peek() != '"' {
            if self.peek() == END {
                return self.unclosed(open, "the string literal", "a closing '\"'");
            }
            self.character()?;
            empty = false;
        }
        self.pos += 1;
        Ok((!empty).then_some(Element::Terminal))
    }

    /// `[...]` or `[^...]`: characters and ranges `a-z`; a `-` before `]` is itself.
    fn class(&mut self) -> Result<Option<Element>, Failure> {
        let open = self.pos;
        self.pos += 1;
        if self.peek() == '^' {
            self.pos += 1;
        }
        let mut empty = true;
        while self.peek() != ']' {
            if self.peek() == END {
                return self.unclosed(open, "the character class", "a closing ']'");
            }
            self.character()?;
            empty = false;
            if self.peek() == '-' && self.at(self.pos + 1) != ']' {
                self.pos += 1;
                if self.peek() == END {
                    return self.unclosed(
                        open,
                        "a range of the character class",
                        "the character that ends the range, then ']'",
                    );
                }
                self.character()?;
            }
        }
        self.pos += 1;
        Ok((!empty).then_some(Element::Terminal))
    }

    /// One character of a literal or class (not the end of input): itself or an escape.
    fn character(&mut self) -> Result<(), Failure> {
        if self.peek() != '\\' {
            self.pos += 1;
            return Ok(());
        }
        let backslash = self.pos;
        match self.at(backslash + 1) {
            'x' => self.hex_digits(backslash, 2),
            'u' => self.hex_digits(backslash, 4),
            'U' => self.hex_digits(backslash, 8),
            't' | 'r' | 'n' | '\\' | '"' | '[' | ']' | '-' => {
                self.pos += 2;
                Ok(())
            }
            other => {
                let what = match other {
                    END => "unexpected end of input after '\\'".to_string(),
                    c => format!("unknown escape '\\{c}'"),
                };
                self.fail(
                    backslash,
                    format!(
                        "{what} (expected one of \\xHH \\uHHHH \\UHHHHHHHH \\t \\r \\n \\\\ \\\" \
                         \\[ \\] \\-)"
                    ),
                )
            }
        }
    }

    /// The hex digits of `\x`, `\u` or `\U` (the escape starts at `backslash`).
    fn hex_digits(&mut self, backslash: usize, count: usize) -> Result<(), Failure> {
        let letter = self.at(backslash + 1);
        self.pos = backslash + 2;
        for _ in 0..count {
            if !self.peek().is_ascii_hexdigit() {
                let found = self.found(self.pos);
                return self.fail(
                    self.pos,
                    format!("expected {count} hex digits after '\\{letter}', found {found}"),
                );
            }
            self.pos += 1;
        }
        Ok(())
    }

    /// `<[id]>` (a token id), `<text>` (a token by its text, looked up by llama.cpp), either
    /// one after `!` to exclude it.
    fn token(&mut self) -> Result<Option<Element>, Failure> {
        if self.peek() == '!' {
            self.pos += 1;
            if self.peek() != '<' {
                let found = self.found(self.pos);
                return self.fail(
                    self.pos,
                    format!(
                        "expected '<' after '!' (a token to exclude, as in !<[13]>), found {found}"
                    ),
                );
            }
        }
        let open = self.pos;
        self.pos += 1;
        if self.peek() == '[' {
            self.pos += 1;
            self.token_id()?;
        } else {
            while !matches!(self.peek(), END | '>') {
                self.pos += 1;
            }
            if self.peek() == END {
                return self.unclosed(open, "the token", "a closing '>'");
            }
            self.pos += 1;
        }
        Ok(Some(Element::Terminal))
    }

    /// `123]>` of a `<[123]>`.
    fn token_id(&mut self) -> Result<(), Failure> {
        let digits = self.pos;
        let id = self.integer("a token id after '<['")?;
        if id > u64::from(u32::MAX) {
            return self.fail(
                digits,
                format!("token id {id} is too big (expected at most {})", u32::MAX),
            );
        }
        for close in [']', '>'] {
            if self.peek() != close {
                let found = self.found(self.pos);
                return self.fail(
                    self.pos,
                    format!("expected '{close}' to close the token id, found {found}"),
                );
            }
            self.pos += 1;
        }
        Ok(())
    }

    /// Decimal digits (at least one), as llama.cpp's `parse_int` and `stoull` read them.
    fn integer(&mut self, what: &str) -> Result<u64, Failure> {
        let start = self.pos;
        let mut value: Option<u64> = Some(0);
        while let Some(digit) = self.peek().to_digit(10) {
            value = value.and_then(|v| v.checked_mul(10)?.checked_add(u64::from(digit)));
            self.pos += 1;
        }
        if self.pos == start {
            let found = self.found(start);
            return self.fail(start, format!("expected {what}, found {found}"));
        }
        match value {
            Some(value) => Ok(value),
            None => {
                let digits: String = self.chars[start..self.pos].iter().collect();
                self.fail(start, format!("the number {digits} is too large"))
            }
        }
    }

    /// A rule reference, by name (defined later or earlier; undefined ones are found after
    /// parsing).
    fn reference(&mut self) -> Element {
        let at = self.pos;
        let name = self.name().unwrap_or_default();
        Element::Ref(self.symbols.named(&name, at))
    }

    /// `( alternates )`, where newlines do not end the rule; llama.cpp makes it a rule.
    fn group(&mut self, rule: &str) -> Result<(Option<Element>, u64), Failure> {
        let open = self.pos;
        if self.depth == MAX_NESTING {
            return self.fail(
                open,
                format!("groups nested more than {MAX_NESTING} deep (expected fewer levels)"),
            );
        }
        self.pos += 1;
        self.skip_space(true);
        let before = self.symbols.count();
        let id = self.symbols.made_up(rule, open);
        self.depth += 1;
        let body = self.alternates(rule, true)?;
        self.depth -= 1;
        self.symbols.define(id, body, open);
        if self.peek() != ')' {
            let opened = self.place(open);
            let found = self.found(self.pos);
            return self.fail(
                self.pos,
                format!("expected ')' to close the group opened at {opened}, found {found}"),
            );
        }
        self.pos += 1;
        // Repeating a group repeats every rule made inside it (names first seen there too).
        let made = (self.symbols.count() - before) as u64;
        Ok((Some(Element::Ref(id)), made))
    }

    /// `{m}`, `{m,}` or `{m,n}`: the least and most counts (`None`: no most).
    fn braces(&mut self, nested: bool) -> Result<(u64, Option<u64>), Failure> {
        let open = self.pos;
        self.pos += 1;
        self.skip_space(nested);
        let min = self.integer("a count after '{'")?;
        self.skip_space(nested);
        let max = match self.peek() {
            '}' => Some(min),
            ',' => {
                self.pos += 1;
                self.skip_space(nested);
                let max = if self.peek().is_ascii_digit() {
                    let max = self.integer("a count")?;
                    self.skip_space(nested);
                    Some(max)
                } else {
                    None
                };
                if self.peek() != '}' {
                    let found = self.found(self.pos);
                    return self.fail(
                        self.pos,
                        format!("expected '}}' to close the repetition, found {found}"),
                    );
                }
                max
            }
            _ => {
                let found = self.found(self.pos);
                return self.fail(
                    self.pos,
                    format!("expected ',' or '}}' after the count, found {found}"),
                );
            }
        };
        self.pos += 1;
        self.skip_space(nested);
        check_counts(min, max).map_err(|message| Failure::new(open, message))?;
        // llama.cpp takes a most above its limit for no most at all.
        Ok((min, max.filter(|&max| max <= MAX_REPETITIONS)))
    }

    /// Applies a repetition to the last item as llama.cpp rewrites it, `S{m,n}` into `m`
    /// copies of `S` then a chain of `n - m` optional rules (one self-referencing rule when
    /// there is no most).
    fn repeat(
        &mut self,
        body: &mut Vec<Element>,
        last: &mut LastItem,
        min: u64,
        max: Option<u64>,
        rule: &str,
        at: usize,
    ) -> Result<(), Failure> {
        let operator = self.at(at);
        if last.start == body.len() {
            return self.fail(
                at,
                format!("'{operator}' has nothing to repeat (expected an item before it)"),
            );
        }
        let made = match max {
            Some(max) if max > 0 => max,
            _ => min.max(1),
        };
        if last.rules.saturating_mul(made) > MAX_REPETITIONS {
            return self.fail(
                at,
                format!(
                    "this repetition makes llama.cpp build {} rules, over its limit of \
                     {MAX_REPETITIONS} (expected smaller counts or less nesting)",
                    last.rules.saturating_mul(made)
                ),
            );
        }
        let item = body.split_off(last.start);
        if min > 0 {
            // Copies beyond the second change nothing the checks look at (the same
            // references, already found not to be empty), so at most two are kept.
            body.extend(&item);
            if min > 1 {
                body.extend(&item);
            }
        }
        let optional = match max {
            Some(max) => max - min,
            None => 1,
        };
        let mut previous = None;
        for _ in 0..optional {
            let id = self.symbols.made_up(rule, at);
            let mut rest = item.clone();
            rest.extend(if max.is_none() { Some(id) } else { previous }.map(Element::Ref));
            rest.extend([Element::Alt, Element::End]);
            self.symbols.define(id, rest, at);
            previous = Some(id);
        }
        body.extend(previous.map(Element::Ref));
        last.rules *= made;
        Ok(())
    }
}

/// What starts an item (a repetition operator aside).
fn starts_item(c: char) -> bool {
    matches!(c, '"' | '[' | '<' | '!' | '(' | '.') || is_word_char(c)
}

/// A hint when an `_` looks like part of a rule name.
fn name_hint(c: char) -> &'static str {
    if c == '_' {
        " (rule names hold only letters, digits and '-')"
    } else {
        ""
    }
}

/// llama.cpp's limits on `{m,n}`: `m` at most 2000; `n` below `m` is refused here.
fn check_counts(min: u64, max: Option<u64>) -> Result<(), String> {
    if min > MAX_REPETITIONS {
        return Err(format!(
            "the count {min} is over llama.cpp's limit of {MAX_REPETITIONS} repetitions"
        ));
    }
    match max {
        Some(max) if max < min => Err(format!(
            "the most count {max} is below the least count {min} (expected a most of at \
             least {min})"
        )),
        _ => Ok(()),
    }
}

/// Rules a grammar references but never defines, in order of first use; plus `root` when
/// it is missing. A light scan that also reads grammars [`check`] refuses: quoted strings,
/// character classes and comments are skipped.
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
            // Repetition counts and token references hold no rule names.
            open @ ('{' | '<') => {
                let close = if open == '{' { '}' } else { '>' };
                while i < chars.len() && chars[i] != close {
                    i += 1;
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

    /// llama.cpp's `grammars/json.gbnf`.
    const JSON: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

    /// The error for `src`, as (line, column, message).
    fn error(src: &str) -> (usize, usize, String) {
        let e = check(src).expect_err(src);
        (e.line, e.column, e.message)
    }

    fn accepts(src: &str) {
        if let Err(e) = check(src) {
            panic!("refused {src:?}: {e}");
        }
    }

    #[test]
    fn accepts_llama_cpp_json_grammar() {
        accepts(JSON);
    }

    #[test]
    fn accepts_comments_groups_over_lines_and_repetitions() {
        accepts("# a comment first\n\nroot ::= item+ # trailing\n# between\nitem ::= [a-z]\n");
        accepts("root ::= (\n  \"a\" # first\n  | ( \"b\"\n      \"c\" )+\n  | [x-z]{1,3}\n)\n");
        accepts("root ::= \"a\"{3} \"b\"{2,} \"c\"{0,4} \"d\"{ 1 , 2 } (\"e\" | [f]){2}");
        accepts("root ::= \"a\" |\n  \"b\" |\n  \"c\"");
        accepts("root ::=\n  \"a\"");
        accepts("root ::= \"a\"\r\nnext ::= \"b\"\r\n");
        accepts("root ::= \"x\"{0,5000}"); // a most over 2000 is read as no most
        accepts("root ::= .* [^\\n]? [-a] [a-] []");
    }

    #[test]
    fn accepts_escapes_and_unicode() {
        accepts(r#"root ::= "\x41\u00e9\U0001F600\t\r\n\\\"\[\]\-" [\x00-\x7F\]\[-]"#);
        accepts("root ::= \"héllo 中文 😀\" [à-ÿ😀]+ \"line\nbreak\"");
    }

    #[test]
    fn accepts_what_llama_cpp_accepts_oddly() {
        // An empty alternative at the very end: "a" or nothing.
        accepts("root ::= \"a\" |");
        // A rule defined twice: the last definition wins.
        accepts("root ::= \"a\"\nroot ::= \"b\"");
        // Names may start with a digit or '-'.
        accepts("root ::= 1x -y\n1x ::= \"a\"\n-y ::= \"b\"");
        accepts("root ::= <[123]> !<[7]> <think> !<|end|>");
    }

    #[test]
    fn unterminated_string() {
        let (line, column, message) = error("root ::= \"yes");
        assert_eq!((line, column), (1, 14));
        assert_eq!(
            message,
            "unexpected end of input in the string literal opened at line 1, column 10 \
             (expected a closing '\"')"
        );
    }

    #[test]
    fn words_where_the_rule_marker_belongs() {
        let (line, column, message) = error("this is not a grammar ::= ::=");
        assert_eq!((line, column), (1, 6));
        assert_eq!(
            message,
            "expected '::=' after the rule name 'this', found 'is'"
        );
        let (line, column, message) = error("root ::= \"a\"\n  bad line");
        assert_eq!((line, column), (2, 7));
        assert_eq!(
            message,
            "expected '::=' after the rule name 'bad', found 'line'"
        );
    }

    #[test]
    fn unclosed_group_and_class() {
        let (line, column, message) = error("root ::= ((");
        assert_eq!((line, column), (1, 12));
        assert_eq!(
            message,
            "expected ')' to close the group opened at line 1, column 11, found the end of input"
        );
        let (line, column, message) = error("root ::= [a-");
        assert_eq!((line, column), (1, 13));
        assert!(message.contains("end of input in a range"), "{message}");
        let (line, column, _) = error("root ::= [abc");
        assert_eq!((line, column), (1, 14));
        let (line, column, _) = error("root ::= (\n  \"a\"\n  | \"b\"\n");
        assert_eq!((line, column), (4, 1));
    }

    #[test]
    fn trailing_bar_before_another_rule() {
        let (line, column, message) = error("root ::= \"a\" |\nnext ::= \"b\"");
        assert_eq!((line, column), (2, 6));
        assert!(message.starts_with("expected an item, '|' or the end of the line"));
        let (line, column, message) = error("root ::= \"a\"\n| \"b\"");
        assert_eq!((line, column), (2, 1));
        assert!(message.contains("must follow a '|'"), "{message}");
    }

    #[test]
    fn undefined_and_missing_rules() {
        let (line, column, message) = error("root ::= foo");
        assert_eq!((line, column), (1, 10));
        assert_eq!(
            message,
            "undefined rule identifier 'foo' (expected a rule 'foo ::= ...')"
        );
        let (line, column, message) = error("start ::= \"a\"");
        assert_eq!((line, column), (1, 1));
        assert!(message.starts_with("undefined rule 'root'"), "{message}");
        assert!(error("# only a comment\n").2.contains("defines no rules"));
        // A rule inside a group of a rule later redefined is still checked, as llama.cpp does.
        let (line, column, _) = error("root ::= (x)\nroot ::= \"a\"");
        assert_eq!((line, column), (1, 11));
    }

    #[test]
    fn names_have_no_underscore() {
        let (_, column, message) = error("root ::= a_b\na ::= \"x\"");
        assert_eq!(column, 11);
        assert!(
            message.contains("only letters, digits and '-'"),
            "{message}"
        );
        let (_, column, _) = error("my_rule ::= \"x\"");
        assert_eq!(column, 3);
    }

    #[test]
    fn escapes_must_be_known() {
        let (_, column, message) = error(r#"root ::= "a\qb""#);
        assert_eq!(column, 12);
        assert!(message.starts_with("unknown escape '\\q'"), "{message}");
        let (_, column, message) = error(r#"root ::= "\x4g""#);
        assert_eq!(column, 14);
        assert_eq!(message, "expected 2 hex digits after '\\x', found 'g'");
        let (_, column, _) = error(r#"root ::= [\u12]"#);
        assert_eq!(column, 15);
        assert!(error("root ::= \"\\").2.contains("end of input after"));
    }

    #[test]
    fn columns_count_characters() {
        let (line, column, message) = error("root ::= \"é\" \"ü");
        assert_eq!((line, column), (1, 16));
        assert!(message.contains("opened at line 1, column 14"), "{message}");
    }

    #[test]
    fn repetitions_follow_llama_cpp_limits() {
        assert!(error("root ::= *").2.contains("nothing to repeat"));
        assert!(error("root ::= \"\"+").2.contains("nothing to repeat"));
        assert!(error("root ::= \"a\" | ?").2.contains("nothing to repeat"));
        assert!(error("root ::= \"a\"{2001}").2.contains("limit"));
        assert!(error("root ::= \"a\"{10}{10}{10}{10}").2.contains("limit"));
        assert!(error("root ::= \"a\"{3,1}").2.contains("below the least"));
        assert_eq!(error("root ::= \"a\"{,3}").1, 14);
        assert_eq!(error("root ::= \"a\"{3 x").1, 16);
        assert!(error("root ::= \"a\"{99999999999999999999999}")
            .2
            .contains("too large"));
        // Inside braces a newline ends the rule unless a group is open.
        assert!(check("root ::= \"a\"{2,\n3}").is_err());
        accepts("root ::= (\"a\"{2,\n3})");
        accepts("root ::= \"a\"{10}{10}{10}");
        accepts("root ::= \"a\"{2000}");
    }

    #[test]
    fn tokens() {
        assert!(error("root ::= <[99999999999]>").2.contains("too big"));
        assert!(error("root ::= <[]>").2.contains("a token id"));
        assert!(error("root ::= <[12>").2.contains("']'"));
        assert!(error("root ::= <abc").2.contains("closing '>'"));
        assert!(error("root ::= !x").2.contains("expected '<' after '!'"));
    }

    #[test]
    fn left_recursion_as_llama_cpp_sees_it() {
        let (line, column, message) = error("root ::= \"x\"\nexpr ::= expr \"+\" \"1\" | \"1\"");
        assert_eq!((line, column), (2, 1));
        assert!(
            message.starts_with("left recursion: rule 'expr'"),
            "{message}"
        );
        assert!(check("root ::= \"b\" | root \"a\"").is_err());
        // Through a rule with an empty alternative.
        assert!(check("root ::= opt rest\nopt ::= | \"o\"\nrest ::= root \"z\" | \"y\"").is_err());
        // Repeating what may match nothing.
        assert!(error("root ::= (\"\")*")
            .2
            .contains("group or repetition in rule 'root'"));
        // Right recursion is fine.
        accepts("root ::= \"a\" root | \"b\"");
        // llama.cpp looks only for empty alternatives written in the rule itself.
        accepts("root ::= e root \"a\" | \"b\"\ne ::= f\nf ::= | \"c\"");
    }

    #[test]
    fn other_refusals() {
        assert!(error("root ::= \"a\0\"").2.contains("NUL"));
        assert_eq!(
            error("root ::= \"a\" )").2,
            "expected an item, '|' or the end of the line in rule 'root', found ')' \
             (no group is open)"
        );
        assert!(error("\"a\"").2.starts_with("expected a rule name"));
        assert!(check("").is_err());
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
        assert!(error(&deep).2.contains("nested more than"));
        let fine = format!("root ::= {}\"a\"{}", "(".repeat(200), ")".repeat(200));
        accepts(&fine);
    }

    #[test]
    fn display_names_the_place() {
        let e = check("root ::= \"yes").unwrap_err();
        assert!(e
            .to_string()
            .starts_with("line 1, column 14: unexpected end of input"));
    }

    #[test]
    fn finds_undefined_references_only() {
        assert_eq!(undefined_rules("root ::= foo"), vec!["foo"]);
        assert!(undefined_rules("root ::= item+\nitem ::= [a-z] \"x-y\" # note bar").is_empty());
        assert_eq!(undefined_rules("start ::= \"a\""), vec!["root"]);
        assert_eq!(
            undefined_rules("root ::= a | b-c\na ::= \"\\\"q\" [\\]z]"),
            vec!["b-c"]
        );
        assert!(undefined_rules("root ::= \"a\"{1,2} <think> <[12]>").is_empty());
    }
}
