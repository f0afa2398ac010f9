//! GBNF grammars (eager and lazy) as llama.cpp grammar samplers, built through
//! llama-cpp-sys-2's exception-catching wrappers so a bad grammar never aborts.

use std::ffi::{c_char, CString};

use llama_cpp_sys_2 as sys;

use super::raw::RawSampler;
use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// How a grammar was declared (kept so it can be described, saved and rebuilt).
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    Eager {
        gbnf: String,
    },
    /// Unconstrained until a trigger word, regex pattern or token fires.
    Lazy {
        gbnf: String,
        words: Vec<String>,
        patterns: Vec<String>,
        tokens: Vec<Token>,
    },
}

#[derive(Clone)]
pub(crate) struct Grammar {
    sampler: RawSampler,
    spec: GrammarSpec,
}

fn c_string(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Grammar(format!("{what} contains a NUL byte")))
}

/// Regex that fires on a literal trigger word anywhere in the output (the grammar is fed from
/// the first capture group on). llama.cpp runs `regex_search` over the whole buffered output
/// after every token: the plain group is linear, where the usual `[\\s\\S]*?(word)[\\s\\S]*`
/// is quadratic and overflows the stack of libstdc++'s recursive matcher after ~20k characters.
fn word_pattern(word: &str) -> String {
    let mut escaped = String::with_capacity(word.len() * 2);
    for ch in word.chars() {
        if "\\^$.|?*+()[]{}-".contains(ch) {
            escaped.push('\\');
        }
        escaped.push(ch);
    }
    format!("({escaped})")
}

/// Why llama.cpp refused a grammar, as well as it can be told: its parser prints the reason
/// to stderr, out of reach, so undefined rules (the usual mistake) are found here.
fn refused(gbnf: &str) -> Error {
    let undefined = kvfork_core::gbnf::undefined_rules(gbnf);
    let reason = if undefined.is_empty() {
        "a syntax error or a bad trigger pattern".to_string()
    } else {
        format!("undefined rule(s): {}", undefined.join(", "))
    };
    Error::Grammar(format!("the grammar failed to parse: {reason}"))
}

impl Grammar {
    pub fn new(model: &Model, spec: GrammarSpec) -> Result<Self> {
        let (GrammarSpec::Eager { gbnf } | GrammarSpec::Lazy { gbnf, .. }) = &spec;
        if gbnf.trim().is_empty() {
            // llama.cpp takes "" as "no grammar"; pass None to remove a grammar instead.
            return Err(Error::Grammar("the grammar is empty".into()));
        }
        let raw = match &spec {
            GrammarSpec::Eager { gbnf } => {
                let g = c_string(gbnf, "grammar")?;
                unsafe {
                    sys::llama_rs_sampler_init_grammar(
                        model.vocab_ptr(),
                        g.as_ptr(),
                        c"root".as_ptr(),
                    )
                }
            }
            GrammarSpec::Lazy {
                gbnf,
                words,
                patterns,
                tokens,
            } => {
                for &t in tokens {
                    model.check_token(t)?;
                }
                let g = c_string(gbnf, "grammar")?;
                let all: Vec<String> = words
                    .iter()
                    .map(|w| word_pattern(w))
                    .chain(patterns.iter().cloned())
                    .collect();
                let owned = all
                    .iter()
                    .map(|p| c_string(p, "trigger"))
                    .collect::<Result<Vec<_>>>()?;
                let mut ptrs: Vec<*const c_char> = owned.iter().map(|p| p.as_ptr()).collect();
                unsafe {
                    sys::llama_rs_sampler_init_grammar_lazy_patterns(
                        model.vocab_ptr(),
                        g.as_ptr(),
                        c"root".as_ptr(),
                        ptrs.as_mut_ptr(),
                        ptrs.len(),
                        tokens.as_ptr(),
                        tokens.len(),
                    )
                }
            }
        };
        let sampler = RawSampler::from_raw(raw).ok_or_else(|| refused(gbnf))?;
        Ok(Grammar { sampler, spec })
    }

    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// The grammar `spec` after accepting `history` (restoring a saved branch: llama.cpp's
    /// parse state cannot be read out, so it is rebuilt from the tokens it accepted).
    /// `history` holds vocabulary tokens (the caller checked them).
    pub fn replay(model: &Model, spec: GrammarSpec, history: &[Token]) -> Result<Self> {
        let mut g = Grammar::new(model, spec)?;
        history.iter().try_for_each(|&t| g.accept(t))?;
        Ok(g)
    }

    /// Mask candidates the grammar forbids (logit = -inf).
    pub fn apply(&mut self, cur: &mut sys::llama_token_data_array) {
        self.sampler.apply(cur);
    }

    /// Whether the grammar allows `token` now (always, for a lazy grammar not yet triggered).
    pub fn allows(&mut self, token: Token) -> bool {
        let mut one = [sys::llama_token_data {
            id: token,
            logit: 0.0,
            p: 0.0,
        }];
        let mut cur = sys::llama_token_data_array {
            data: one.as_mut_ptr(),
            size: 1,
            selected: -1,
            sorted: false,
        };
        self.sampler.apply(&mut cur);
        one[0].logit.is_finite()
    }

    /// Advance the grammar; fails (without aborting) when the token is not allowed.
    ///
    /// The token is checked first: llama.cpp aborts the process when an end-of-generation
    /// token reaches an incomplete grammar, and a rejected token leaves the grammar broken
    /// (its next use aborts). A lazy grammar can still fail when its trigger fires on text the
    /// grammar rejects: callers restore a clone then.
    pub fn accept(&mut self, token: Token) -> Result<()> {
        if !self.allows(token) {
            return Err(Error::Grammar(format!(
                "token {token} is not allowed by the grammar here"
            )));
        }
        let status = unsafe { sys::llama_rs_sampler_accept(self.sampler.as_ptr(), token) };
        if status == sys::LLAMA_RS_STATUS_OK {
            Ok(())
        } else {
            Err(Error::Grammar(format!(
                "token {token} is not allowed by the grammar here"
            )))
        }
    }
}
