//! `BranchStore`: many branches advanced together in as few decodes as possible.

use std::sync::Arc;

use crate::branch::{check_tokens, Branch};
use crate::context::Context;
use crate::engine::{BranchCell, CancelPolicy, Pending};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::produced::Produced;

/// Batched operations over the branches of one context.
#[derive(Clone)]
pub struct BranchStore {
    ctx: Context,
}

impl BranchStore {
    /// A store over the branches of `ctx`.
    pub fn new(ctx: &Context) -> Self {
        BranchStore { ctx: ctx.clone() }
    }

    /// The context whose branches the store advances.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Leases free now.
    pub fn available(&self) -> u32 {
        self.ctx.available()
    }

    /// Every branch must be live, of this context, and appear once.
    fn cells<'a>(
        &self,
        branches: impl Iterator<Item = &'a Branch>,
    ) -> Result<Vec<Arc<BranchCell>>> {
        self.ctx.shared().check_open()?;
        let mut cells: Vec<Arc<BranchCell>> = Vec::new();
        for b in branches {
            b.check_on(&self.ctx, "branches")?;
            b.check_live()?;
            if cells.iter().any(|c| Arc::ptr_eq(c, b.cell())) {
                return Err(Error::invalid(
                    "branches",
                    format!("branch {} appears twice", b.handle()),
                ));
            }
            cells.push(b.cell().clone());
        }
        Ok(cells)
    }

    /// Accept every token, then ONE llama_decode for all; full rollback if it fails.
    pub fn commit(&self, entries: &[(Branch, Token)]) -> Pending<()> {
        let prepared = self
            .cells(entries.iter().map(|(b, _)| b))
            .and_then(|cells| {
                for (_, t) in entries {
                    self.ctx.model().check_token(*t)?;
                }
                Ok(cells
                    .into_iter()
                    .zip(entries.iter().map(|(_, t)| *t))
                    .collect::<Vec<_>>())
            });
        match prepared {
            Ok(items) if items.is_empty() => Pending::ready(Ok(())),
            Ok(items) => self.ctx.engine().commit(items),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Decode variable-length token runs into their branches, packed into ceil(total/n_batch) decodes.
    pub fn prefill(&self, entries: Vec<(Branch, Vec<Token>)>) -> Pending<()> {
        match self.prefill_items(entries) {
            Ok(items) if items.is_empty() => Pending::ready(Ok(())),
            Ok(items) => self.ctx.engine().prefill(items),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// `(branch, tokens)` entries as the engine's items, checked (`cells`, token ids).
    pub(crate) fn prefill_items(
        &self,
        entries: Vec<(Branch, Vec<Token>)>,
    ) -> Result<Vec<(Arc<BranchCell>, Vec<Token>)>> {
        let cells = self.cells(entries.iter().map(|(b, _)| b))?;
        for (_, toks) in &entries {
            check_tokens(&self.ctx, toks)?;
        }
        Ok(cells
            .into_iter()
            .zip(entries.into_iter().map(|(_, t)| t))
            .collect())
    }

    /// Keep only `winner`'s KV; every other lease is freed and its branch disposed.
    pub fn retain_only(&self, winner: &Branch) -> Pending<()> {
        if let Err(e) = self.cells(std::iter::once(winner)) {
            return Pending::ready(Err(e));
        }
        for (_, node) in self.ctx.shared().registry().iter() {
            if !Arc::ptr_eq(&node.data, winner.cell()) {
                node.data.mark_disposed();
            }
        }
        let handle = winner.handle();
        // The losers are already disposed: the rest always happens, even if cancelled.
        self.ctx
            .engine()
            .run_with(CancelPolicy::Never, move |w| w.retain_only(handle))
    }

    /// Sample every branch (in Rust, in parallel), commit all non-stop tokens in one decode.
    pub fn step(&self, branches: &[Branch]) -> Pending<Vec<Produced>> {
        match self.cells(branches.iter()) {
            Ok(cells) if cells.is_empty() => Pending::ready(Ok(Vec::new())),
            Ok(cells) => self.ctx.engine().step(cells),
            Err(e) => Pending::ready(Err(e)),
        }
    }
}
