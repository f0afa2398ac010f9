//! Embeddings on a context created with `embeddings = true`: texts are packed into as few
//! decodes as fit (each text whole inside one batch, one temporary sequence per text; the
//! engine's half is `engine/embed.rs`).

use crate::context::Context;
use crate::context_params::{POOLING_NONE, POOLING_RANK};
use crate::engine::{CancelPolicy, Pending};
use crate::error::{Error, Result};
use crate::model::Token;

/// Embeddings of one text: one row when pooled, one row per token without pooling.
pub type Embedding = Vec<Vec<f32>>;

impl Context {
    /// Vector width of `embed`: the model's output width (its hidden size unless the GGUF
    /// says otherwise), or the number of scores of a reranker (rank pooling).
    pub fn embedding_dim(&self) -> usize {
        if self.shared().pooling == POOLING_RANK {
            self.model().n_cls_out()
        } else {
            self.model().n_embd_out()
        }
    }

    /// An error unless the context was made with `embeddings=True`.
    pub fn check_computes_embeddings(&self) -> Result<()> {
        if !self.shared().params.embeddings {
            return Err(Error::Other(
                "this context computes no embeddings: create it with embeddings=True".into(),
            ));
        }
        Ok(())
    }

    /// Whether `embed` pools each text into one vector (pooling other than "none").
    pub fn embeddings_pooled(&self) -> bool {
        self.shared().pooling != POOLING_NONE
    }

    /// Embed each token list. Pooled contexts give one row per text; a context with
    /// pooling "none" gives one row per token. `normalize` scales every row to unit length.
    /// Cancelled while it runs, it stops in its current decode (nothing to roll back: the
    /// texts' sequences are emptied either way), so an abandoned batch of many texts does
    /// not hold the context up.
    pub fn embed(&self, texts: Vec<Vec<Token>>, normalize: bool) -> Pending<Vec<Embedding>> {
        if let Err(e) = self.check_embed_args(&texts) {
            return Pending::ready(Err(e));
        }
        self.engine().run_with(CancelPolicy::DropOrAbort, move |w| {
            w.embed(&texts, normalize)
        })
    }

    fn check_embed_args(&self, texts: &[Vec<Token>]) -> Result<()> {
        self.shared().check_open()?;
        self.check_computes_embeddings()?;
        if !self.shared().registry().is_empty() {
            return Err(Error::Other(
                "embed borrows the context's sequences: prune its branches first".into(),
            ));
        }
        for t in texts {
            if t.is_empty() {
                return Err(Error::invalid("text", "nothing to embed (no tokens)"));
            }
            if t.len() > self.n_batch() as usize {
                return Err(Error::invalid(
                    "text",
                    format!(
                        "{} tokens do not fit one batch (n_batch = {}): raise n_batch or split the text",
                        t.len(),
                        self.n_batch()
                    ),
                ));
            }
            crate::branch::check_tokens(self, t)?;
        }
        Ok(())
    }
}
