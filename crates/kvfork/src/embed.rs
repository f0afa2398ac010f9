//! Embeddings on a context created with `embeddings = true`: texts are packed into as few
//! decodes as fit (each text whole inside one batch, one temporary sequence per text).

use crate::context::Context;
use crate::engine::{Pending, Worker};
use crate::error::{Error, Result};
use crate::model::Token;

/// llama.cpp's `LLAMA_POOLING_TYPE_NONE`: one vector per token.
const POOLING_NONE: i32 = 0;
/// llama.cpp's `LLAMA_POOLING_TYPE_RANK`: a reranker's scores per text.
const POOLING_RANK: i32 = 4;

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

    /// Whether `embed` pools each text into one vector (pooling other than "none").
    pub fn embeddings_pooled(&self) -> bool {
        self.shared().pooling != POOLING_NONE
    }

    /// Embed each token list. Pooled contexts give one row per text; a context with
    /// pooling "none" gives one row per token. `normalize` scales every row to unit length.
    pub fn embed(&self, texts: Vec<Vec<Token>>, normalize: bool) -> Pending<Vec<Embedding>> {
        if let Err(e) = self.check_embed_args(&texts) {
            return Pending::ready(Err(e));
        }
        self.run(move |w| w.embed(&texts, normalize))
    }

    fn check_embed_args(&self, texts: &[Vec<Token>]) -> Result<()> {
        self.shared().check_open()?;
        if !self.shared().params.embeddings {
            return Err(Error::Other(
                "this context computes no embeddings: create it with embeddings=True".into(),
            ));
        }
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

/// Consecutive texts grouped so each group fits one batch and one sequence per text.
fn pack(texts: &[Vec<Token>], n_batch: usize, n_seq: usize) -> Vec<Vec<&[Token]>> {
    let mut groups: Vec<Vec<&[Token]>> = Vec::new();
    let mut used = usize::MAX;
    for t in texts {
        let full = groups.last().is_none_or(|g| g.len() == n_seq) || used + t.len() > n_batch;
        if full {
            groups.push(Vec::new());
            used = 0;
        }
        groups.last_mut().expect("pushed above").push(t);
        used += t.len();
    }
    groups
}

/// One decode for `group` (text i on sequence i), then clear those sequences.
/// The engine-thread half of embedding.
impl Worker {
    fn embed(&mut self, texts: &[Vec<Token>], normalize: bool) -> Result<Vec<Embedding>> {
        let mut out = Vec::with_capacity(texts.len());
        for group in pack(
            texts,
            self.ctx.n_batch as usize,
            self.ctx.n_seq_max as usize,
        ) {
            out.extend(self.embed_group(&group, normalize)?);
        }
        Ok(out)
    }

    fn embed_group(&mut self, group: &[&[Token]], normalize: bool) -> Result<Vec<Embedding>> {
        self.batch.clear();
        for (seq, text) in group.iter().enumerate() {
            for (pos, &t) in text.iter().enumerate() {
                self.batch.push(t, pos as i32, seq as i32, true);
            }
        }
        let decoded = self.decode();
        let pooled = self.shared.pooling != POOLING_NONE;
        let mut rows = Vec::with_capacity(group.len());
        let mut first = 0;
        let result = decoded.and_then(|_| {
            for (seq, text) in group.iter().enumerate() {
                let vectors = if pooled {
                    vec![self.ctx.embeddings_seq(seq as i32)?.to_vec()]
                } else {
                    (first..first + text.len())
                        .map(|i| self.ctx.embeddings_ith(i).map(<[f32]>::to_vec))
                        .collect::<Result<_>>()?
                };
                first += text.len();
                rows.push(vectors);
            }
            Ok(())
        });
        for seq in 0..group.len() {
            self.ctx.seq_rm(seq as i32, -1, -1)?;
        }
        result?;
        if normalize {
            rows.iter_mut().flatten().for_each(|v| unit_length(v));
        }
        Ok(rows)
    }
}

fn unit_length(v: &mut [f32]) {
    let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_respects_batch_and_sequences() {
        let texts: Vec<Vec<Token>> = [3, 3, 2, 5, 1, 1, 1].iter().map(|&n| vec![0; n]).collect();
        let sizes = |g: &Vec<Vec<&[Token]>>| -> Vec<Vec<usize>> {
            g.iter()
                .map(|g| g.iter().map(|t| t.len()).collect())
                .collect()
        };
        assert_eq!(
            sizes(&pack(&texts, 8, 8)),
            vec![vec![3, 3, 2], vec![5, 1, 1, 1]]
        );
        assert_eq!(
            sizes(&pack(&texts, 100, 3)),
            vec![vec![3, 3, 2], vec![5, 1, 1], vec![1]]
        );
    }

    #[test]
    fn unit_length_scales_and_keeps_zero() {
        let mut v = vec![3.0, 4.0];
        unit_length(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut z = vec![0.0; 3];
        unit_length(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }
}
