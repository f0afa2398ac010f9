//! Adapters per branch. llama.cpp applies LoRA adapters and a control vector to the whole
//! context, so every decode runs with one set applied: that of the branches in it. Commits and
//! prefills over branches of different sets are split into one group per distinct set
//! (`commit.rs`, `prefill.rs`), in the order of [`AdapterKey`].

use std::sync::Arc;

use super::shared::BranchCell;
use super::Worker;
use crate::adapter::{AdapterKey, Adapters};
use crate::error::Result;

impl Worker {
    /// Apply `adapters` to the context unless it holds them already.
    pub(super) fn use_adapters(&mut self, adapters: &Adapters) -> Result<()> {
        let key = adapters.key();
        let applied = self.applied_adapters();
        if key == applied {
            return Ok(());
        }
        // The LoRA part and the control vector apart: changing one need not touch the other.
        let (loras_changed, cvec_changed) = key.differs_from(applied);
        if loras_changed {
            let loras: Vec<_> = adapters.loras().iter().map(|(a, s)| (&**a, *s)).collect();
            self.ctx_mut().set_loras(&loras)?;
        }
        if cvec_changed {
            match adapters.control_vector() {
                None => self.ctx_mut().set_control_vector(None)?,
                Some(c) => {
                    let rows: Vec<f32> = c.vector.data().iter().map(|v| v * c.scale).collect();
                    // Rows start..end hold llama.cpp's layers start+1..=end.
                    self.ctx_mut().set_control_vector(Some((
                        &rows,
                        c.layers.0 as i32 + 1,
                        c.layers.1 as i32,
                    )))?;
                }
            }
        }
        self.set_applied_adapters(key.clone());
        Ok(())
    }

    /// Apply the set of no adapter (raw decodes, embeddings).
    pub(super) fn use_no_adapters(&mut self) -> Result<()> {
        self.use_adapters(&Adapters::default())
    }
}

/// The groups of indices into `cells` with one adapter set each, with that set (in key
/// order). The common case, every cell without adapters, allocates nothing but the one group.
pub(super) fn group_by_adapters(cells: &[&Arc<BranchCell>]) -> Vec<(Adapters, Vec<usize>)> {
    let keys: Vec<AdapterKey> = cells
        .iter()
        .map(|c| c.lock().adapters().key().clone())
        .collect();
    if keys.windows(2).all(|w| w[0] == w[1]) {
        let set = match cells.first() {
            Some(c) if !keys[0].is_empty() => c.lock().adapters().clone(),
            _ => Adapters::default(),
        };
        return vec![(set, (0..cells.len()).collect())];
    }
    let mut order: Vec<usize> = (0..cells.len()).collect();
    order.sort_by(|&a, &b| keys[a].cmp(&keys[b]));
    let mut groups: Vec<(Adapters, Vec<usize>)> = Vec::new();
    for i in order {
        match groups.last_mut() {
            Some((_, members)) if keys[members[0]] == keys[i] => members.push(i),
            _ => groups.push((cells[i].lock().adapters().clone(), vec![i])),
        }
    }
    groups
}
