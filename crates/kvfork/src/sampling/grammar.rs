//! A branch's constraint: GBNF grammars (eager and lazy) as llama.cpp grammar samplers, built
//! through llama-cpp-sys-2's exception-catching wrappers so a bad grammar never aborts; JSON
//! schemas, regexes and Lark grammars through llguidance (`guidance.rs`).

use std::ffi::CString;

use llama_cpp_sys_2 as sys;

use super::guidance::{GuidanceKind, Guided};
use super::lazy::{skip_pattern, Awaiting, Fired, Triggers};
use super::llama_sampler::RawSampler;
use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// How a constraint was declared (kept so it can be described, saved and rebuilt).
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A GBNF grammar (llama.cpp's sampler) that constrains from the next token on.
    Eager {
        /// The grammar text; its start rule is `root`.
        gbnf: String,
    },
    /// Unconstrained until a trigger word, regex pattern or token fires.
    Lazy {
        /// The grammar text; its start rule is `root`.
        gbnf: String,
        /// Literal words whose appearance starts the grammar (at the word).
        words: Vec<String>,
        /// Regexes over the output; the grammar starts at the first capture group.
        patterns: Vec<String>,
        /// Tokens whose sampling starts the grammar.
        tokens: Vec<Token>,
    },
    /// A JSON schema (text), compiled by llguidance.
    JsonSchema {
        /// The schema as JSON text.
        schema: String,
    },
    /// A regular expression the whole output must match (llguidance).
    Regex {
        /// The regex.
        pattern: String,
    },
    /// A grammar in llguidance's Lark syntax.
    Lark {
        /// The grammar text.
        grammar: String,
    },
}

impl GrammarSpec {
    /// An eager GBNF grammar of nothing but whitespace: no constraint at all (llama.cpp reads
    /// "" as "no grammar"), so setting it removes the branch's constraint.
    pub fn is_blank(&self) -> bool {
        matches!(self, GrammarSpec::Eager { gbnf } if gbnf.trim().is_empty())
    }

    /// The llguidance front end and source text, for the constraints it reads.
    fn guidance(&self) -> Option<(GuidanceKind, &str)> {
        match self {
            GrammarSpec::JsonSchema { schema } => Some((GuidanceKind::JsonSchema, schema)),
            GrammarSpec::Regex { pattern } => Some((GuidanceKind::Regex, pattern)),
            GrammarSpec::Lark { grammar } => Some((GuidanceKind::Lark, grammar)),
            GrammarSpec::Eager { .. } | GrammarSpec::Lazy { .. } => None,
        }
    }
}

enum Engine {
    Llama(RawSampler),
    /// A lazy GBNF grammar whose trigger has not fired yet (`lazy.rs`).
    Awaiting(Box<Awaiting>),
    Guidance(Box<Guided>),
}

pub(crate) struct Grammar {
    engine: Engine,
    spec: GrammarSpec,
    /// Tells this grammar from one set later on the same branch (see `GrammarUndo`).
    id: u64,
}

impl Clone for Grammar {
    /// An independent copy (fork, or the undo point of a llama.cpp grammar).
    fn clone(&self) -> Self {
        let engine = match &self.engine {
            Engine::Llama(s) => Engine::Llama(s.clone()),
            Engine::Awaiting(a) => Engine::Awaiting(a.clone()),
            Engine::Guidance(g) => Engine::Guidance(Box::new(g.deep_clone())),
        };
        Grammar {
            engine,
            spec: self.spec.clone(),
            id: self.id,
        }
    }
}

/// How a failed commit puts a grammar back: llama.cpp's parse state can only be copied whole,
/// llguidance's rolls back by a token count.
pub(crate) enum GrammarUndo {
    Replace(Box<Grammar>),
    Rollback { id: u64, consumed: usize },
}

fn next_grammar_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn c_string(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Grammar(format!("{what} contains a NUL byte")))
}

/// The grammar's syntax, rules and left recursion, checked as llama.cpp checks them: its
/// parser prints the reason for a refusal to stderr, out of reach, where this one says where
/// and what was expected.
fn check_gbnf(gbnf: &str) -> Result<()> {
    kvfork_core::gbnf::check(gbnf)
        .map_err(|e| Error::Grammar(format!("the grammar failed to parse at {e}")))
}

/// Why llama.cpp refused a grammar that passed [`check_gbnf`], as well as it can be told
/// (llama.cpp prints the reason to stderr): what only llama.cpp can judge.
fn refused(gbnf: &str) -> Error {
    let undefined = kvfork_core::gbnf::undefined_rules(gbnf);
    let reason = if undefined.is_empty() {
        "a <token> that is not exactly one token of this model".to_string()
    } else {
        // Only if the check and llama.cpp ever disagree.
        format!("undefined rule(s): {}", undefined.join(", "))
    };
    Error::Grammar(format!("llama.cpp refused the grammar: {reason}"))
}

/// llama.cpp's grammar sampler for an eager GBNF grammar, checked first.
fn llama_grammar(model: &Model, gbnf: &str) -> Result<RawSampler> {
    if gbnf.trim().is_empty() {
        // llama.cpp takes "" as "no grammar"; pass None to remove a grammar instead.
        return Err(Error::Grammar("the grammar is empty".into()));
    }
    check_gbnf(gbnf)?;
    init_gbnf(model, gbnf, None)
}

/// llama.cpp's grammar sampler for `gbnf`: eager, or, with `skip`, lazy until the first piece
/// it is fed, which it reads from byte `skip` on (`lazy::skip_pattern`: a grammar starting
/// inside a token, which llama.cpp's API takes whole).
fn init_gbnf(model: &Model, gbnf: &str, skip: Option<usize>) -> Result<RawSampler> {
    let g = c_string(gbnf, "grammar")?;
    let raw = match skip {
        // SAFETY: the vocabulary is live (the model outlives every use of the sampler:
        // branches reach it only through their context, which holds the model); both
        // strings are NUL-terminated and alive for the call. The wrapper catches llama.cpp's
        // parse exceptions and returns NULL.
        None => unsafe {
            sys::llama_rs_sampler_init_grammar(model.vocab_ptr(), g.as_ptr(), c"root".as_ptr())
        },
        Some(skip) => {
            let pattern = c_string(&skip_pattern(skip), "trigger")?;
            let mut patterns = [pattern.as_ptr()];
            // SAFETY: as for the eager grammar; `patterns` holds one NUL-terminated pattern,
            // alive in `pattern`, and no trigger token; llama.cpp copies them during the call.
            // Its `std::regex` reads one piece only: no long search.
            unsafe {
                sys::llama_rs_sampler_init_grammar_lazy_patterns(
                    model.vocab_ptr(),
                    g.as_ptr(),
                    c"root".as_ptr(),
                    patterns.as_mut_ptr(),
                    1,
                    std::ptr::null(),
                    0,
                )
            }
        }
    };
    // SAFETY: `raw` is NULL or the new grammar sampler, owned by nothing else.
    unsafe { RawSampler::from_raw(raw) }.ok_or_else(|| refused(gbnf))
}

/// A lazy grammar, whose triggers kvfork watches (`lazy.rs`): the grammar is checked now
/// and built when a trigger fires.
fn awaiting(
    model: &Model,
    gbnf: &str,
    words: &[String],
    patterns: &[String],
    tokens: &[Token],
) -> Result<Awaiting> {
    for &t in tokens {
        model.check_token(t)?;
    }
    let triggers = Triggers::new(words, patterns, tokens)?;
    // Refused now, as an eager grammar would be, rather than when the trigger fires.
    llama_grammar(model, gbnf)?;
    Ok(Awaiting::new(triggers))
}

impl Grammar {
    pub fn new(model: &Model, spec: GrammarSpec) -> Result<Self> {
        let engine = match &spec {
            GrammarSpec::Eager { gbnf } => Engine::Llama(llama_grammar(model, gbnf)?),
            GrammarSpec::Lazy {
                gbnf,
                words,
                patterns,
                tokens,
            } => Engine::Awaiting(Box::new(awaiting(model, gbnf, words, patterns, tokens)?)),
            _ => {
                let (kind, source) = spec.guidance().expect("llguidance reads the others");
                Engine::Guidance(Box::new(Guided::new(model, kind, source)?))
            }
        };
        Ok(Grammar {
            engine,
            spec,
            id: next_grammar_id(),
        })
    }

    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// The grammar `spec` after accepting `history` (restoring a saved branch: llama.cpp's
    /// parse state cannot be read out, so it is rebuilt from the tokens it accepted).
    /// `history` holds vocabulary tokens (the caller checked them).
    pub fn replay(model: &Model, spec: GrammarSpec, history: &[Token]) -> Result<Self> {
        let mut g = Grammar::new(model, spec)?;
        history.iter().try_for_each(|&t| g.accept(model, t))?;
        Ok(g)
    }

    /// Mask candidates the grammar forbids (logit = -inf).
    pub fn apply(&mut self, candidates: &mut [sys::llama_token_data]) {
        match &mut self.engine {
            Engine::Llama(sampler) => {
                let mut cur = sys::llama_token_data_array {
                    data: candidates.as_mut_ptr(),
                    size: candidates.len(),
                    selected: -1,
                    sorted: false,
                };
                sampler.apply(&mut cur);
            }
            Engine::Awaiting(waiting) => {
                let refused = waiting.refused();
                if !refused.is_empty() {
                    candidates
                        .iter_mut()
                        .filter(|c| refused.contains(&c.id))
                        .for_each(|c| c.logit = f32::NEG_INFINITY);
                }
            }
            Engine::Guidance(g) => g.apply(candidates),
        }
    }

    /// Whether `token`, drawn now, would fire this lazy grammar's trigger on text the grammar
    /// refuses; if so it is masked from now until the next accepted token (the sampler draws
    /// again). Always false for an active grammar, which masks what it refuses already.
    pub fn trigger_refuses(&mut self, model: &Model, token: Token) -> Result<bool> {
        let fired = match &mut self.engine {
            Engine::Awaiting(waiting) => waiting.probe(model, token)?,
            Engine::Llama(_) | Engine::Guidance(_) => None,
        };
        let refused = fired.is_some_and(|fired| self.started(model, fired).is_err());
        if let (true, Engine::Awaiting(waiting)) = (refused, &mut self.engine) {
            waiting.refuse(token);
        }
        Ok(refused)
    }

    /// Whether llguidance reads this constraint.
    pub fn is_guided(&self) -> bool {
        matches!(self.engine, Engine::Guidance(_))
    }

    /// The llguidance parser, when llguidance reads this constraint (the sampler then walks
    /// candidates best first or the mask's allowed set, never the whole vocabulary).
    pub fn guided(&mut self) -> Option<&mut Guided> {
        match &mut self.engine {
            Engine::Guidance(g) => Some(g),
            Engine::Llama(_) | Engine::Awaiting(_) => None,
        }
    }

    /// Whether the grammar allows `token` now (always, for a lazy grammar not yet triggered).
    pub fn allows(&mut self, token: Token) -> bool {
        if let Engine::Guidance(g) = &mut self.engine {
            return g.allows(token);
        }
        let mut one = [sys::llama_token_data {
            id: token,
            logit: 0.0,
            p: 0.0,
        }];
        self.apply(&mut one);
        one[0].logit.is_finite()
    }

    /// Advance the grammar; fails (without aborting) when the token is not allowed.
    ///
    /// The token is checked first: llama.cpp aborts the process when an end-of-generation
    /// token reaches an incomplete grammar, and a rejected token leaves the grammar broken
    /// (its next use aborts). A lazy grammar fails when its trigger fires on text the grammar
    /// rejects (a token the caller chose; sampling never draws one, `trigger_refuses`) and
    /// is left as it was.
    pub fn accept(&mut self, model: &Model, token: Token) -> Result<()> {
        match &mut self.engine {
            Engine::Guidance(g) => return g.accept(token),
            Engine::Awaiting(waiting) => {
                return match waiting.accept(model, token)? {
                    None => Ok(()),
                    Some(fired) => self.fire(model, fired),
                }
            }
            Engine::Llama(_) => {}
        }
        let refused =
            || Error::Grammar(format!("token {token} is not allowed by the grammar here"));
        if !self.allows(token) {
            return Err(refused());
        }
        let Engine::Llama(sampler) = &self.engine else {
            unreachable!("handled above");
        };
        // SAFETY: a live grammar sampler owned by `self`; the token was allowed just above,
        // so llama.cpp's grammar cannot hit its abort on an end-of-generation token, and the
        // wrapper turns any exception into a status.
        let status = unsafe { sys::llama_rs_sampler_accept(sampler.as_ptr(), token) };
        if status == sys::LLAMA_RS_STATUS_OK {
            Ok(())
        } else {
            Err(refused())
        }
    }

    /// A trigger fired: the grammar, built and fed what it starts with (all or nothing).
    fn fire(&mut self, model: &Model, fired: Fired) -> Result<()> {
        *self = self.started(model, fired)?;
        Ok(())
    }

    /// This lazy grammar as it is once `fired`: built, and fed what it starts with.
    fn started(&self, model: &Model, fired: Fired) -> Result<Grammar> {
        let GrammarSpec::Lazy { gbnf, .. } = &self.spec else {
            unreachable!("only a lazy grammar awaits a trigger");
        };
        let (tokens, skip) = match fired {
            Fired::Token(token) => (vec![token], 0),
            Fired::Text { tokens, skip } => (tokens, skip),
        };
        let mut grammar = Grammar {
            engine: Engine::Llama(init_gbnf(model, gbnf, (skip > 0).then_some(skip))?),
            spec: self.spec.clone(),
            id: self.id,
        };
        tokens.iter().try_for_each(|&t| grammar.accept(model, t))?;
        Ok(grammar)
    }

    /// What puts this grammar back where it is now, should a commit fail.
    pub fn undo_point(&self) -> GrammarUndo {
        match &self.engine {
            Engine::Llama(_) | Engine::Awaiting(_) => GrammarUndo::Replace(Box::new(self.clone())),
            Engine::Guidance(g) => GrammarUndo::Rollback {
                id: self.id,
                consumed: g.consumed(),
            },
        }
    }

    /// Go back to `undo`, taken from the grammar in `slot`. A grammar set since the undo point
    /// is left alone. A llguidance parser that cannot roll back is left in its error state:
    /// the next sample or accept reports it.
    pub fn undo(slot: &mut Option<Grammar>, undo: GrammarUndo) {
        match undo {
            GrammarUndo::Replace(g) => {
                if slot.as_ref().is_some_and(|now| now.id == g.id) {
                    *slot = Some(*g);
                }
            }
            GrammarUndo::Rollback { id, consumed } => {
                if let Some(Grammar {
                    engine: Engine::Guidance(g),
                    id: now,
                    ..
                }) = slot
                {
                    if *now == id {
                        g.rollback_to(consumed);
                    }
                }
            }
        }
    }
}
