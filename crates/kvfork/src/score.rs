//! Scoring: how likely the model finds given tokens. `Branch::score` prefills them as
//! `prefill` does, with logits at every position, and returns each token's log-probability
//! given everything before it (the log-likelihood of a continuation, a prompt's
//! `echo` + `logprobs` in the server). The engine's half is `engine/score.rs`.

use crate::branch::{check_tokens, Branch};
use crate::engine::Pending;
use crate::model::Token;
use crate::store::BranchStore;
use crate::token_score::TokenScore;

impl Branch {
    /// Decode `tokens` at the branch's position, as `prefill` does (no accept: penalties,
    /// grammar and perplexity are untouched; the last logits become the snapshot), and score
    /// each: its log-probability given the branch's tokens and those before it, with the
    /// `top` most likely tokens at its position. The first token is scored from the branch's
    /// snapshot, so the branch needs one (an error before its first prefill or commit: a
    /// text's first token, BOS, has nothing to predict it; prefill it, then score the rest).
    /// Costs about a prefill plus the model's output layer at every position. On failure
    /// nothing changed.
    pub fn score(&self, tokens: Vec<Token>, top: usize) -> Pending<Vec<TokenScore>> {
        if let Err(e) = self
            .check_live()
            .and_then(|_| check_tokens(self.context(), &tokens))
        {
            return Pending::ready(Err(e));
        }
        let item = (self.cell().clone(), tokens);
        self.context().run(move |w| {
            let mut scores = w.score(std::slice::from_ref(&item), top)?;
            Ok(scores.pop().unwrap_or_default())
        })
    }
}

impl BranchStore {
    /// `Branch::score` for many branches at once: each `(branch, tokens)` run scored as that
    /// call scores it, the runs packed together into the same decodes (a handful of short
    /// continuations in one). All or nothing; one list of scores per entry, in order.
    pub fn score(
        &self,
        entries: Vec<(Branch, Vec<Token>)>,
        top: usize,
    ) -> Pending<Vec<Vec<TokenScore>>> {
        let items = match self.prefill_items(entries) {
            Ok(items) => items,
            Err(e) => return Pending::ready(Err(e)),
        };
        self.context().run(move |w| w.score(&items, top))
    }
}
