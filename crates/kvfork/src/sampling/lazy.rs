//! A lazy grammar's wait for its trigger, watched here rather than by llama.cpp.
//!
//! llama.cpp searches every trigger pattern with `std::regex` over the whole output after
//! each token: quadratic in the output (the usual `[\s\S]*?(word)[\s\S]*` made 200 tokens of
//! 48 bytes 11× slower, the engine thread busy all along: BENCHMARKS §32), and
//! libstdc++'s recursive matcher exhausted the thread's stack after ~5,000 tokens (a SIGSEGV).
//! The `regex` crate's search is linear in the output (no backtracking; still a pass over the
//! whole output per token while the trigger does not come) and needs no stack, so the grammar is
//! built when a trigger fires, from the output it fires on; a pattern it does not read
//! (look-around, back-references) is refused. All patterns are searched in one pass (a
//! `RegexSet`); only the one that fires is searched again, for where it starts.
//!
//! A token whose text would fire a trigger on output the grammar refuses (the trigger fires
//! inside a token whose rest the grammar does not allow) is refused like a token an active
//! grammar masks: sampling draws again without it (`Awaiting::probe`, `refuse`), where
//! llama.cpp's lazy grammar drew it again and again, each commit failing.

use std::sync::Arc;

use regex::bytes::{Regex, RegexSet};

use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// What starts a lazy grammar (shared by a branch's forks).
pub(crate) struct Triggers {
    patterns: Vec<Regex>,
    /// The patterns together: whether any matches, in one pass over the output.
    any: RegexSet,
    tokens: Vec<Token>,
}

impl Triggers {
    /// The triggers; a pattern the `regex` crate does not read (look-around and
    /// back-references among them) is a GrammarError naming it.
    pub fn new(words: &[String], patterns: &[String], tokens: &[Token]) -> Result<Triggers> {
        if words.iter().any(String::is_empty) {
            // It would fire on the first token, whatever it is: a mistake, not a trigger.
            return Err(Error::Grammar("bad trigger \"\": an empty word".into()));
        }
        // Words first, as llama.cpp's lazy grammars order them: the first that matches fires.
        let words = words.iter().map(|w| (format!("({})", regex::escape(w)), w));
        let patterns = words
            .chain(patterns.iter().map(|p| (p.clone(), p)))
            .map(|(regex, given)| {
                Regex::new(&regex)
                    .map_err(|e| Error::Grammar(format!("bad trigger {given:?}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let any = RegexSet::new(patterns.iter().map(Regex::as_str))
            .map_err(|e| Error::Grammar(format!("the trigger patterns together: {e}")))?;
        Ok(Triggers {
            patterns,
            any,
            tokens: tokens.to_vec(),
        })
    }
}

/// Where the grammar starts once a trigger fired.
pub(crate) enum Fired {
    /// A trigger token: the grammar starts with it.
    Token(Token),
    /// A pattern matched: the grammar reads `tokens`, the first from byte `skip` of its
    /// piece on (the match starts inside it, or at it when `skip` is 0).
    Text { tokens: Vec<Token>, skip: usize },
}

/// The output since the grammar was set, while no trigger has fired.
#[derive(Clone)]
pub(crate) struct Awaiting {
    triggers: Arc<Triggers>,
    text: Vec<u8>,
    /// Each accepted token and where its piece starts in `text`.
    pieces: Vec<(Token, usize)>,
    /// Tokens that would fire a trigger here on text the grammar refuses (masked by
    /// `Grammar::apply` until the next accepted token).
    refused: Vec<Token>,
    /// The last `probe`'s token that fired nothing, at this output length: its `accept`
    /// needs no second search.
    quiet: Option<(Token, usize)>,
}

impl Awaiting {
    pub fn new(triggers: Triggers) -> Awaiting {
        Awaiting {
            triggers: Arc::new(triggers),
            text: Vec::new(),
            pieces: Vec::new(),
            refused: Vec::new(),
            quiet: None,
        }
    }

    /// Take an accepted token; Some once a trigger fires (as llama.cpp's lazy grammar: a
    /// trigger token is checked before its text, and a pattern fires from its first non-empty
    /// capture group, or from the whole match without one).
    pub fn accept(&mut self, model: &Model, token: Token) -> Result<Option<Fired>> {
        if self.triggers.tokens.contains(&token) {
            return Ok(Some(Fired::Token(token)));
        }
        let quiet = self.quiet.take() == Some((token, self.text.len()));
        self.refused.clear();
        self.push(model, token)?;
        Ok(if quiet { None } else { self.fired() })
    }

    /// What accepting `token` now would fire, the output left as it is.
    pub fn probe(&mut self, model: &Model, token: Token) -> Result<Option<Fired>> {
        if self.triggers.tokens.contains(&token) {
            return Ok(Some(Fired::Token(token)));
        }
        let (len, n_pieces) = (self.text.len(), self.pieces.len());
        self.push(model, token)?;
        let fired = self.fired();
        self.text.truncate(len);
        self.pieces.truncate(n_pieces);
        self.quiet = fired.is_none().then_some((token, len));
        Ok(fired)
    }

    /// Mask `token` until the next accepted one: it would fire a trigger on text the grammar
    /// refuses.
    pub fn refuse(&mut self, token: Token) {
        self.refused.push(token);
    }

    /// The tokens `refuse` masked at this point of the output.
    pub fn refused(&self) -> &[Token] {
        &self.refused
    }

    /// Append the token's piece as llama.cpp's grammar reads it: special tokens rendered.
    fn push(&mut self, model: &Model, token: Token) -> Result<()> {
        let piece = model.token_to_bytes(token, true)?;
        self.pieces.push((token, self.text.len()));
        self.text.extend_from_slice(&piece);
        Ok(())
    }

    /// Where the grammar starts, if a trigger matches the output now.
    fn fired(&self) -> Option<Fired> {
        let start = self.fired_at()?;
        if start == self.text.len() {
            // An empty match at the end: the grammar starts with the next token.
            return Some(Fired::Text {
                tokens: Vec::new(),
                skip: 0,
            });
        }
        // The token whose piece holds `start` (a piece ends where the next begins).
        let first = self.pieces.partition_point(|&(_, at)| at <= start) - 1;
        let skip = start - self.pieces[first].1;
        let tokens = self.pieces[first..].iter().map(|&(t, _)| t).collect();
        Some(Fired::Text { tokens, skip })
    }

    /// Where the first pattern that matches the output makes the grammar start.
    fn fired_at(&self) -> Option<usize> {
        if !self.triggers.any.is_match(&self.text) {
            return None; // the usual case: one pass, no captures
        }
        let first = self.triggers.any.matches(&self.text).iter().next()?;
        let caps = self.triggers.patterns[first].captures(&self.text)?;
        let start = caps
            .iter()
            .skip(1)
            .flatten()
            .find(|m| !m.is_empty())
            .map_or_else(|| caps.get(0).expect("group 0").start(), |m| m.start());
        Some(start)
    }
}

/// A pattern that makes llama.cpp's lazy grammar fire `skip` bytes into the first piece it is
/// fed: how a grammar starts inside a token (llama.cpp's API takes whole tokens only).
pub(crate) fn skip_pattern(skip: usize) -> String {
    format!("^[\\s\\S]{{{skip}}}([\\s\\S]+)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fired(patterns: &[&str], text: &str) -> Option<usize> {
        let patterns: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
        let mut waiting = Awaiting::new(Triggers::new(&[], &patterns, &[]).expect("valid"));
        waiting.text = text.as_bytes().to_vec();
        waiting.fired_at()
    }

    #[test]
    fn a_pattern_fires_at_its_first_non_empty_group_else_at_the_match() {
        assert_eq!(fired(&[r"[\s\S]*?(<tool>)[\s\S]*"], "say <tool>{"), Some(4));
        assert_eq!(fired(&[r"()x(y)"], "axy"), Some(2)); // an empty group is passed over
        assert_eq!(fired(&[r"x+"], "aaxx"), Some(2));
        assert_eq!(fired(&[r"^x"], "ax"), None); // anchored at the output's start
        assert_eq!(fired(&["$"], "ab"), Some(2)); // empty at the end: the next token on
        assert_eq!(fired(&["nope", "b"], "ab"), Some(1)); // the first that matches
    }

    #[test]
    fn look_around_and_back_references_are_refused_and_words_are_literal() {
        let empty = Triggers::new(&[String::new()], &[], &[])
            .err()
            .expect("refused");
        assert!(empty.to_string().contains("an empty word"), "{empty}");
        for p in [r"(?=x)", r"(a)\1", "("] {
            let refused = Triggers::new(&[], &[p.to_string()], &[]).err().expect(p);
            assert!(refused.to_string().contains("bad trigger"), "{refused}");
        }
        let words = ["a+b".to_string()];
        let t = Triggers::new(&words, &["z".to_string()], &[]).expect("escaped");
        assert!(t.patterns[0].is_match(b"xa+b") && !t.patterns[0].is_match(b"aab"));
        assert!(t.patterns[1].is_match(b"z")); // the words' patterns first
    }
}
