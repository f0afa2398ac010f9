//! A branch's state (everything but its KV cells) as a record of a kvfork state file.

use kvfork_core::state_file::{Reader, StateError, Writer};
use kvfork_core::{Biases, Perplexity, Utf8Carry};

use std::path::PathBuf;
use std::sync::Arc;

use super::BranchState;
use crate::adapter::{check_layers, Adapters, ControlVector, LoraAdapter, SteeringVector};
use crate::error::{Error, Result};
use crate::llama_ctx::Output;
use crate::model::{Model, Token};
use crate::sampling::chain::{DrawState, SamplerChain};
use crate::sampling::device::Drawn;
use crate::sampling::grammar::{Grammar, GrammarSpec};
use crate::sampling::SamplingParams;

fn malformed(what: &str) -> Error {
    Error::State(StateError::Malformed(what.into()).to_string())
}

pub(crate) fn state_error(e: StateError) -> Error {
    Error::State(e.to_string())
}

impl BranchState {
    /// Append this branch's record to `w`.
    pub fn write(&self, w: &mut Writer) {
        w.i32(self.position);
        // The last output: none (0), a row (1), or what the device kept of one (2).
        match (self.logits.row(), self.logits.drawn()) {
            (Some(row), _) => {
                w.u8(1).f32s(row);
            }
            (None, Some(d)) => {
                let (ids, logits): (Vec<i32>, Vec<f32>) = d.best.iter().copied().unzip();
                w.u8(2).i32s(&ids).f32s(&logits).f64(d.log_sum_exp);
            }
            (None, None) => {
                w.u8(0);
            }
        }
        write_params(w, self.sampler.params());
        let draw = self.sampler.draw_state();
        w.u32(draw.seed).f32(draw.mu);
        draw.rng.iter().for_each(|&x| {
            w.u64(x);
        });
        match &self.grammar {
            None => {
                w.u8(0);
            }
            Some(g) => {
                write_grammar(w, g.spec());
                w.u64(self.grammar_since as u64);
            }
        }
        write_pairs(w, self.logit_bias.pairs());
        write_pairs(w, self.steer.pairs());
        for ppl in [self.ppl_model, self.ppl_sampling] {
            let (sum, count) = ppl.parts();
            w.f64(sum).u64(count);
        }
        w.i32s(&self.accepted);
        w.bytes(self.utf8.pending());
        // Prefilled and accepted tokens (what `Branch::history` answers, e.g. for a
        // prompt-lookup drafter after a load).
        w.i32s(&self.history);
        write_adapters(w, &self.adapters);
    }

    /// Read a record written by `write`. Every value is checked against the model; the chain
    /// and grammar are rebuilt from their history.
    pub fn read(r: &mut Reader<'_>, model: &Arc<Model>) -> Result<BranchState> {
        let position = r.i32().map_err(state_error)?;
        if position < 0 {
            return Err(malformed("negative position"));
        }
        let output = match r.u8().map_err(state_error)? {
            0 => None,
            1 => {
                let row = r.f32s().map_err(state_error)?;
                if row.len() != model.vocab_size() {
                    return Err(malformed("the logits row does not match the vocabulary"));
                }
                Some(Output::Row(row))
            }
            2 => {
                let ids = read_tokens(r, model)?;
                let logits = r.f32s().map_err(state_error)?;
                let log_sum_exp = r.f64().map_err(state_error)?;
                if ids.len() != logits.len() || log_sum_exp.is_nan() {
                    return Err(malformed("a device draw's candidates do not match"));
                }
                let best = Drawn::best_first(&ids, &logits, model.vocab_size())
                    .ok_or_else(|| malformed("a device draw without candidates"))?;
                Some(Output::Drawn(Drawn { best, log_sum_exp }))
            }
            _ => return Err(malformed("unknown kind of last output")),
        };
        let params = read_params(r)?;
        let seed = r.u32().map_err(state_error)?;
        let mu = r.f32().map_err(state_error)?;
        if !mu.is_finite() {
            return Err(malformed("Mirostat mu is not finite"));
        }
        let mut rng = [0u64; 4];
        for x in &mut rng {
            *x = r.u64().map_err(state_error)?;
        }
        let grammar = read_grammar(r)?;
        let logit_bias = read_pairs(r, model)?;
        let steer = read_pairs(r, model)?;
        let mut ppl = [Perplexity::default(); 2];
        for p in &mut ppl {
            let sum = r.f64().map_err(state_error)?;
            let count = r.u64().map_err(state_error)?;
            *p = Perplexity::from_parts(sum, count);
        }
        let accepted = read_tokens(r, model)?;
        let utf8_carry = r.bytes().map_err(state_error)?.to_vec();
        if utf8_carry.len() > 3 {
            return Err(malformed("UTF-8 carry longer than a character"));
        }
        let history = read_tokens(r, model)?;
        let adapters = read_adapters(r, model)?;

        let sampler =
            SamplerChain::restore(&params, DrawState { seed, rng, mu }, model, &accepted)?;
        let (grammar, grammar_since) = match grammar {
            None => (None, 0),
            Some((spec, since)) => {
                let since = usize::try_from(since)
                    .ok()
                    .filter(|&s| s <= accepted.len())
                    .ok_or_else(|| malformed("the grammar starts after the last token"))?;
                (
                    Some(Grammar::replay(model, spec, &accepted[since..])?),
                    since,
                )
            }
        };
        let mut st = BranchState::new(position, sampler, grammar);
        st.grammar_since = grammar_since;
        if let Some(output) = &output {
            st.logits.set_output(output.as_ref());
        }
        st.logit_bias = Biases::new(logit_bias);
        st.steer = Biases::new(steer);
        st.ppl_model = ppl[0];
        st.ppl_sampling = ppl[1];
        st.accepted = accepted;
        st.history = history;
        st.utf8 = Utf8Carry::from_pending(utf8_carry);
        st.adapters = adapters;
        Ok(st)
    }
}

/// LoRA adapters by path, fingerprint and scale (loaded again on read, the same file or an
/// error); the control vector by value (it may have been made from an array).
fn write_adapters(w: &mut Writer, adapters: &Adapters) {
    w.u32(adapters.loras().len() as u32);
    for (a, scale) in adapters.loras() {
        w.str(&a.path().to_string_lossy())
            .u64(a.fingerprint())
            .f32(*scale);
    }
    match adapters.control_vector() {
        None => {
            w.bool(false);
        }
        Some(c) => {
            w.bool(true);
            w.f32s(c.vector.data())
                .f32(c.scale)
                .u32(c.layers.0)
                .u32(c.layers.1);
        }
    }
}

fn read_adapters(r: &mut Reader<'_>, model: &Arc<Model>) -> Result<Adapters> {
    let n = r.u32().map_err(state_error)?;
    let mut loras = Vec::new();
    for _ in 0..n {
        let path = PathBuf::from(r.str().map_err(state_error)?);
        let fingerprint = r.u64().map_err(state_error)?;
        let scale = r.f32().map_err(state_error)?;
        let adapter = LoraAdapter::load(model, &path).map_err(|e| {
            Error::State(format!(
                "the branch's LoRA adapter cannot be loaded again: {e}"
            ))
        })?;
        if adapter.fingerprint() != fingerprint {
            return Err(Error::State(format!(
                "the LoRA adapter {} changed since the branch was saved",
                path.display()
            )));
        }
        loras.push((adapter, scale));
    }
    let mut adapters =
        Adapters::from_loras(model, loras).map_err(|e| Error::State(e.to_string()))?;
    if r.bool().map_err(state_error)? {
        let data = r.f32s().map_err(state_error)?;
        let scale = r.f32().map_err(state_error)?;
        let layers = (r.u32().map_err(state_error)?, r.u32().map_err(state_error)?);
        let vector =
            ControlVector::from_rows(model, data).map_err(|e| Error::State(e.to_string()))?;
        check_layers(model, layers).map_err(|e| Error::State(e.to_string()))?;
        if !scale.is_finite() {
            return Err(malformed("the control vector's scale is not finite"));
        }
        adapters.set_cvec(Some(SteeringVector {
            vector,
            scale,
            layers,
        }));
    }
    Ok(adapters)
}

/// (token, bias) pairs as one i32 list: token, bias bits, token, bias bits, …
fn write_pairs(w: &mut Writer, pairs: &[(Token, f32)]) {
    let flat: Vec<i32> = pairs
        .iter()
        .flat_map(|&(t, b)| [t, b.to_bits() as i32])
        .collect();
    w.i32s(&flat);
}

fn read_pairs(r: &mut Reader<'_>, model: &Model) -> Result<Vec<(Token, f32)>> {
    let flat = r.i32s().map_err(state_error)?; // (token, bias bits) interleaved
    if flat.len() % 2 != 0 {
        return Err(malformed("odd bias list"));
    }
    let mut pairs = Vec::with_capacity(flat.len() / 2);
    for c in flat.chunks_exact(2) {
        model
            .check_token(c[0])
            .map_err(|_| malformed("bias for a token outside the vocabulary"))?;
        let bias = f32::from_bits(c[1] as u32);
        if bias.is_nan() || bias == f32::INFINITY {
            return Err(malformed("bias is NaN or +inf"));
        }
        pairs.push((c[0], bias));
    }
    // `Biases` order (sorted by token, one per token) is what lookups rely on.
    if pairs.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err(malformed("bias list out of order"));
    }
    Ok(pairs)
}

fn read_tokens(r: &mut Reader<'_>, model: &Model) -> Result<Vec<Token>> {
    let tokens = r.i32s().map_err(state_error)?;
    for &t in &tokens {
        model
            .check_token(t)
            .map_err(|_| malformed("token outside the vocabulary"))?;
    }
    Ok(tokens)
}

fn write_grammar(w: &mut Writer, spec: &GrammarSpec) {
    match spec {
        GrammarSpec::Eager { gbnf } => {
            w.u8(1).str(gbnf);
        }
        GrammarSpec::Lazy {
            gbnf,
            words,
            patterns,
            tokens,
        } => {
            w.u8(2).str(gbnf);
            for list in [words, patterns] {
                w.u64(list.len() as u64);
                list.iter().for_each(|s| {
                    w.str(s);
                });
            }
            w.i32s(tokens);
        }
        GrammarSpec::JsonSchema { schema } => {
            w.u8(3).str(schema);
        }
        GrammarSpec::Regex { pattern } => {
            w.u8(4).str(pattern);
        }
        GrammarSpec::Lark { grammar } => {
            w.u8(5).str(grammar);
        }
    }
}

/// A grammar's spec and the index of the first accepted token it saw.
type SavedGrammar = (GrammarSpec, u64);

fn read_grammar(r: &mut Reader<'_>) -> Result<Option<SavedGrammar>> {
    let spec = match r.u8().map_err(state_error)? {
        0 => return Ok(None),
        1 => GrammarSpec::Eager {
            gbnf: r.str().map_err(state_error)?,
        },
        2 => {
            let gbnf = r.str().map_err(state_error)?;
            let mut lists = [Vec::new(), Vec::new()];
            for list in &mut lists {
                let n = r.u64().map_err(state_error)?;
                for _ in 0..n {
                    list.push(r.str().map_err(state_error)?);
                }
            }
            let [words, patterns] = lists;
            GrammarSpec::Lazy {
                gbnf,
                words,
                patterns,
                tokens: r.i32s().map_err(state_error)?,
            }
        }
        3 => GrammarSpec::JsonSchema {
            schema: r.str().map_err(state_error)?,
        },
        4 => GrammarSpec::Regex {
            pattern: r.str().map_err(state_error)?,
        },
        5 => GrammarSpec::Lark {
            grammar: r.str().map_err(state_error)?,
        },
        _ => return Err(malformed("unknown grammar kind")),
    };
    Ok(Some((spec, r.u64().map_err(state_error)?)))
}

fn write_params(w: &mut Writer, p: &SamplingParams) {
    w.f32(p.temperature)
        .i32(p.top_k)
        .f32(p.top_p)
        .f32(p.min_p)
        .f32(p.typical_p)
        .f32(p.top_n_sigma)
        .bool(p.seed.is_some())
        .u32(p.seed.unwrap_or(0))
        .f32(p.repeat_penalty)
        .f32(p.frequency_penalty)
        .f32(p.presence_penalty)
        .i32(p.penalty_last_n)
        .i32(p.mirostat)
        .f32(p.mirostat_tau)
        .f32(p.mirostat_eta)
        .f32(p.dry_multiplier)
        .f32(p.dry_base)
        .i32(p.dry_allowed_length)
        .i32(p.dry_penalty_last_n)
        .f32(p.xtc_probability)
        .f32(p.xtc_threshold);
}

fn read_params(r: &mut Reader<'_>) -> Result<SamplingParams> {
    let e = state_error;
    let mut p = SamplingParams {
        temperature: r.f32().map_err(e)?,
        top_k: r.i32().map_err(e)?,
        top_p: r.f32().map_err(e)?,
        min_p: r.f32().map_err(e)?,
        typical_p: r.f32().map_err(e)?,
        top_n_sigma: r.f32().map_err(e)?,
        ..Default::default()
    };
    let has_seed = r.bool().map_err(e)?;
    let seed = r.u32().map_err(e)?;
    p.seed = has_seed.then_some(seed);
    p.repeat_penalty = r.f32().map_err(e)?;
    p.frequency_penalty = r.f32().map_err(e)?;
    p.presence_penalty = r.f32().map_err(e)?;
    p.penalty_last_n = r.i32().map_err(e)?;
    p.mirostat = r.i32().map_err(e)?;
    p.mirostat_tau = r.f32().map_err(e)?;
    p.mirostat_eta = r.f32().map_err(e)?;
    p.dry_multiplier = r.f32().map_err(e)?;
    p.dry_base = r.f32().map_err(e)?;
    p.dry_allowed_length = r.i32().map_err(e)?;
    p.dry_penalty_last_n = r.i32().map_err(e)?;
    p.xtc_probability = r.f32().map_err(e)?;
    p.xtc_threshold = r.f32().map_err(e)?;
    p.validate()
        .map_err(|err| malformed(&format!("sampling params: {err}")))?;
    Ok(p)
}
