//! JSON Schema, regex and Lark constraints through llguidance: a token mask computed from a
//! trie of the vocabulary (tens of microseconds) where llama.cpp's grammar sampler decodes
//! every token of the vocabulary (tens of milliseconds for 262k tokens).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// Whitespace allowed between JSON tokens unless a schema's `x-guidance` says otherwise.
const JSON_SPACE: &str = r"(\x20|\x0A{1,2}[\x20\x09]{0,20})";

/// Marks a control token in llguidance's vocabulary: grammar text never matches it.
const SPECIAL: u8 = TokTrie::SPECIAL_TOKEN_MARKER;

/// One model's vocabulary as llguidance sees it, built once per model (`GuidanceVocab::of`).
pub(crate) struct GuidanceVocab {
    factory: ParserFactory,
    /// End-of-generation tokens (llguidance's "EOS" set), sorted.
    eog: Vec<u32>,
}

impl GuidanceVocab {
    /// Token bytes from llama.cpp; end-of-generation tokens are all "EOS" to the grammar.
    fn build(model: &Model) -> Result<Self> {
        let n_vocab = model.vocab_size();
        let mut words = Vec::with_capacity(n_vocab);
        let mut eog = Vec::new();
        for t in 0..n_vocab as Token {
            let text = model.token_to_bytes(t, false)?;
            words.push(if text.is_empty() {
                // Control tokens render as nothing unless asked: name them, behind the marker.
                let mut special = vec![SPECIAL];
                special.extend(model.token_to_bytes(t, true)?);
                special
            } else {
                text
            });
            if model.is_eog(t) {
                eog.push(t as u32);
            }
        }
        let eos = model
            .eos()
            .map(|t| t as u32)
            .or_else(|| eog.first().copied())
            .unwrap_or(u32::MAX);
        let info = TokRxInfo::new(n_vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if !eog.is_empty() {
            trie = trie.with_eos_tokens(&eog);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| {
            Error::Grammar(format!("llguidance could not index the vocabulary: {e}"))
        })?;
        factory.quiet();
        Ok(GuidanceVocab { factory, eog })
    }

    /// The vocabulary of `model` as llguidance reads it: indexed once per model, on first use,
    /// and kept with the model (a failure too).
    fn of(model: &Model) -> Result<Arc<GuidanceVocab>> {
        let built = model.derived(|model| {
            GuidanceVocab::build(model)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
        (*built).clone().map_err(Error::Grammar)
    }
}

/// Which llguidance front end reads the constraint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuidanceKind {
    JsonSchema,
    Regex,
    Lark,
}

impl GuidanceKind {
    /// What a message calls a source of this kind.
    fn what(self) -> &'static str {
        match self {
            GuidanceKind::JsonSchema => "JSON schema",
            GuidanceKind::Regex => "regex",
            GuidanceKind::Lark => "Lark grammar",
        }
    }
}

/// A branch's llguidance parser plus the mask of its current state (computed once per state:
/// `sample` and the `accept` that follows share it).
pub(crate) struct Guided {
    vocab: Arc<GuidanceVocab>,
    matcher: Matcher,
    mask: Option<SimpleVob>,
    /// The last token the parser found legal in the current state (the sampled token is
    /// checked while sampling and again by `accept`: the second check is free).
    legal: Option<u32>,
    /// Tokens consumed so far (a commit that fails rolls back to a mark).
    consumed: usize,
}

impl Guided {
    pub fn new(model: &Model, kind: GuidanceKind, source: &str) -> Result<Self> {
        let vocab = GuidanceVocab::of(model)?;
        if source.len() > MAX_SOURCE_BYTES {
            return Err(Error::Grammar(format!(
                "the {} is {} bytes: at most {MAX_SOURCE_BYTES}",
                kind.what(),
                source.len()
            )));
        }
        // On a thread of its own, with a stack for the deepest chain a bounded source holds.
        let parser = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("kvfork-grammar".into())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || compile(&vocab.factory, kind, source))
                .map_err(|e| Error::Grammar(format!("no thread to compile the grammar on: {e}")))?
                .join()
                .map_err(|_| Error::Grammar(format!("the {} could not be compiled", kind.what())))?
        })?;
        Ok(Guided {
            vocab,
            matcher: Matcher::new(Ok(parser)),
            mask: None,
            legal: None,
            consumed: 0,
        })
    }

    /// An independent copy (a fork): lexer caches are not shared across threads.
    pub fn deep_clone(&self) -> Self {
        Guided {
            vocab: self.vocab.clone(),
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
            legal: self.legal,
            consumed: self.consumed,
        }
    }

    /// The mask of the current state, computed once per state.
    fn mask(&mut self) -> &SimpleVob {
        if self.mask.is_none() {
            // A parser in an error state allows nothing; `accept` reports the error.
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .unwrap_or_else(|_| SimpleVob::alloc(0));
            self.mask = Some(mask);
        }
        self.mask.as_ref().expect("set above")
    }

    /// Whether the constraint allows `token` now: from the mask when it is at hand, else by
    /// running the token through the parser (microseconds, where a mask over a large
    /// vocabulary can take milliseconds).
    pub fn allows(&mut self, token: Token) -> bool {
        if let Some(mask) = &self.mask {
            return token >= 0 && (token as usize) < mask.len() && mask.is_allowed(token as u32);
        }
        if token < 0 || token as usize >= self.vocab.factory.tok_env().tok_trie().vocab_size() {
            return false;
        }
        let t = token as u32;
        if self.legal == Some(t) {
            return true;
        }
        let legal = if self.vocab.eog.binary_search(&t).is_ok() {
            self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
        } else {
            !self.matcher.is_stopped() && self.matcher.validate_tokens(&[t]).unwrap_or(0) == 1
        };
        if legal {
            self.legal = Some(t);
        }
        legal
    }

    /// The parser moved: what was known of its state is stale.
    fn moved(&mut self) {
        self.mask = None;
        self.legal = None;
    }

    /// Every token the constraint allows now, in token order.
    pub fn allowed(&mut self, mut each: impl FnMut(Token)) {
        self.mask().iter_set_entries(|i| each(i as Token));
    }

    /// Mask candidates the constraint forbids (logit = -inf).
    pub fn apply(&mut self, candidates: &mut [llama_cpp_sys_2::llama_token_data]) {
        let mask = self.mask();
        for c in candidates {
            if c.id < 0 || c.id as usize >= mask.len() || !mask.is_allowed(c.id as u32) {
                c.logit = f32::NEG_INFINITY;
            }
        }
    }

    /// Advance by one token the mask allows.
    pub fn accept(&mut self, token: Token) -> Result<()> {
        if !self.allows(token) {
            return Err(not_allowed(token, self.matcher.get_error()));
        }
        if self.matcher.is_stopped() {
            // Complete: only end-of-generation tokens are allowed, and they change nothing.
            return Ok(());
        }
        self.matcher
            .consume_token(token as u32)
            .map_err(|e| not_allowed(token, Some(e.to_string())))?;
        self.consumed += 1;
        self.moved();
        Ok(())
    }

    /// How many tokens it has consumed (a mark for `rollback_to`).
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Undo the tokens consumed since `mark`. On failure the matcher keeps its error, which
    /// the next `accept` reports (and its mask allows nothing).
    pub fn rollback_to(&mut self, mark: usize) {
        if mark < self.consumed {
            let _ = self.matcher.rollback(self.consumed - mark);
            self.consumed = mark;
            self.moved();
        }
    }
}

/// The largest grammar source `Guided::new` takes (JSON schemas, regexes, Lark grammars).
/// llguidance compiles a chain of `$ref`s or of Lark rules recursively, a few KiB of stack a
/// link: a 3,000-link chain (150 KB of schema) overflowed a thread's 8 MiB, a SIGSEGV. A
/// source this size holds at most ~90,000 links, which [`COMPILE_STACK_BYTES`] holds.
const MAX_SOURCE_BYTES: usize = 1 << 20;

/// The stack of the thread a grammar is compiled on (virtual memory: pages are only touched
/// as deep as the compile goes).
const COMPILE_STACK_BYTES: usize = 512 << 20;

/// The parser of `source`, compiled for `factory`'s vocabulary.
fn compile(
    factory: &ParserFactory,
    kind: GuidanceKind,
    source: &str,
) -> Result<llguidance::TokenParser> {
    let grammar = match kind {
        GuidanceKind::JsonSchema => {
            let mut value: serde_json::Value = serde_json::from_str(source)
                .map_err(|e| Error::Grammar(format!("the JSON schema is not valid JSON: {e}")))?;
            if let Some(schema) = value.as_object_mut() {
                // llguidance allows any whitespace between JSON tokens, and small models then
                // fill objects with newlines. Bound it as llama.cpp's GBNF does (a space, or
                // one or two newlines and an indent) unless the schema says.
                schema
                    .entry("x-guidance")
                    .or_insert_with(|| serde_json::json!({ "whitespace_pattern": JSON_SPACE }));
            }
            TopLevelGrammar::from_json_schema(value)
        }
        GuidanceKind::Regex => TopLevelGrammar::from_regex(source),
        GuidanceKind::Lark => TopLevelGrammar::from_lark(source.to_string()),
    };
    factory
        .create_parser(grammar)
        .map_err(|e| Error::Grammar(format!("the {} was refused: {e}", kind.what())))
}

fn not_allowed(token: Token, why: Option<String>) -> Error {
    match why {
        Some(why) => Error::Grammar(format!(
            "token {token} is not allowed by the constraint here ({why})"
        )),
        None => Error::Grammar(format!(
            "token {token} is not allowed by the constraint here"
        )),
    }
}
