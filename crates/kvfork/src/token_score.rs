//! What `Branch::score` gives for each token (a leaf: the engine builds it, `score.rs`
//! returns it).

use crate::model::Token;

/// One scored token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenScore {
    /// Natural-log probability of the token given everything before it, under the raw logits
    /// (model level: no grammar, bias or chain); -inf for a masked token.
    pub logprob: f64,
    /// The most likely tokens at its position, best first, with their log-probabilities
    /// (as many as asked for; fewer when fewer logits are finite).
    pub top: Vec<(Token, f64)>,
}
