//! Exact speculative decoding: the token a branch sampled last and a guess of the tokens after
//! it are decoded in ONE `llama_decode` with logits at every position; the branch's own chain
//! then samples position by position and keeps the guess while it agrees. The tokens come out
//! as plain generation would draw them (same chain, same order of random draws, same accepts),
//! up to the rounding of a batched decode. The engine's half is `engine/speculate.rs`.

use crate::branch::Branch;
use crate::engine::Pending;
use crate::model::Token;
use crate::produced::Produced;

/// What one round of `Branch::speculate` gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculated {
    /// Draft tokens the chain drew too, in order: accepted and decoded.
    pub accepted: Vec<Produced>,
    /// The token the chain drew after them: sampled, not accepted (the next round's pending
    /// token, or a stop token).
    pub next: Produced,
}

impl Branch {
    /// One round of speculative decoding. `pending` is the token the branch's sampler drew
    /// last (from `produce`, not committed); `draft` guesses the tokens that follow it.
    ///
    /// Accepts `pending`, decodes it with the draft in one `llama_decode`, then samples the
    /// branch's chain at each position: a sample equal to the draft's next token is accepted
    /// (it is decoded already); the first that differs, or the one after the whole draft, is
    /// returned as `next` and the KV cells of the rejected draft tokens are removed. A draft
    /// longer than fits the batch or the context is cut. If the decode fails, `pending` is
    /// not accepted and nothing changed.
    pub fn speculate(&self, pending: Token, draft: Vec<Token>) -> Pending<Speculated> {
        let model = self.context().model();
        if let Err(e) = self
            .check_live()
            .and_then(|_| model.check_token(pending))
            .and_then(|_| draft.iter().try_for_each(|&t| model.check_token(t)))
        {
            return Pending::ready(Err(e));
        }
        let cell = self.cell().clone();
        self.context().run(move |w| {
            let (accepted, next) = w.speculate(&cell, pending, draft)?;
            Ok(Speculated { accepted, next })
        })
    }
}
