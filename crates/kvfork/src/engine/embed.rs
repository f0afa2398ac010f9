//! `Context::embed` on the engine thread: texts packed into as few decodes as fit, each text
//! whole inside one batch on a temporary sequence of its own (the context has no branches
//! while it embeds), emptied after.

use super::Worker;
use crate::context_params::POOLING_NONE;
use crate::error::Result;
use crate::model::Token;
use crate::seq::Seq;

/// The vectors of one text: one when pooled, one per token without pooling
/// (`kvfork::Embedding`).
type Vectors = Vec<Vec<f32>>;

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

impl Worker {
    /// `Context::embed`: the texts in as few decodes as fit, a row (pooled) or a row per token
    /// (pooling "none") for each.
    pub(crate) fn embed(&mut self, texts: &[Vec<Token>], normalize: bool) -> Result<Vec<Vectors>> {
        let mut out = Vec::with_capacity(texts.len());
        let (n_batch, n_seq) = (self.ctx().n_batch as usize, self.ctx().n_seq_max as usize);
        for group in pack(texts, n_batch, n_seq) {
            out.extend(self.embed_group(&group, normalize)?);
        }
        Ok(out)
    }

    /// One decode for `group` (text i on sequence i), then clear those sequences.
    fn embed_group(&mut self, group: &[&[Token]], normalize: bool) -> Result<Vec<Vectors>> {
        self.use_no_adapters()?;
        let batch = self.start_batch();
        let seqs = || (0..group.len() as u32).map(Seq::new);
        for (seq, text) in seqs().zip(group) {
            for (pos, &t) in text.iter().enumerate() {
                batch.push(t, pos as i32, seq, true);
            }
        }
        let decoded = self.decode();
        let pooled = self.shared().pooling != POOLING_NONE;
        let mut rows = Vec::with_capacity(group.len());
        let mut first = 0;
        let result = decoded.and_then(|_| {
            for (seq, text) in seqs().zip(group) {
                let vectors = if pooled {
                    vec![self.ctx().embeddings_seq(seq)?.to_vec()]
                } else {
                    (first..first + text.len())
                        .map(|i| self.ctx().embeddings_ith(i).map(<[f32]>::to_vec))
                        .collect::<Result<_>>()?
                };
                first += text.len();
                rows.push(vectors);
            }
            Ok(())
        });
        for seq in seqs() {
            self.ctx_mut().seq_rm(seq, -1, -1)?;
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
