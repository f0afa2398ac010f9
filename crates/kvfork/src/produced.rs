//! What sampling a branch gives back: the token, the text it adds, whether it ends generation.

use crate::model::Token;

/// A sampled token with its text and whether it ends generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Produced {
    /// The token id.
    pub token: Token,
    /// Complete UTF-8 text this token adds (an unfinished character waits for the next token).
    pub text: String,
    /// Whether the token ends generation (end-of-generation per the vocabulary).
    pub is_stop: bool,
}
