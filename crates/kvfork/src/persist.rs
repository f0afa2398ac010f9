//! Saving and loading branches and whole contexts: the calls, queued on the engine thread,
//! whose work (file format included) is in `engine/persist.rs`.

use std::path::PathBuf;

use crate::branch::Branch;
use crate::context::Context;
use crate::engine::Pending;

impl Branch {
    /// Save the branch (KV cells, position, sampler params and RNG, grammar, biases, metrics)
    /// to `path`, after the work already queued on it.
    pub fn save(&self, path: impl Into<PathBuf>) -> Pending<()> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        let (cell, path) = (self.cell().clone(), path.into());
        self.context().run(move |w| w.save_branch(&cell, &path))
    }

    /// A new root branch on a fresh lease of `ctx`, restored from a file `save` wrote (with
    /// any context of the same model). It continues exactly as the saved branch would have.
    pub fn load(ctx: &Context, path: impl Into<PathBuf>) -> Pending<Branch> {
        if let Err(e) = ctx.shared().check_open() {
            return Pending::ready(Err(e));
        }
        let (ctx2, path) = (ctx.clone(), path.into());
        ctx.run(move |w| {
            let (handle, cell) = w.load_branch(&path)?;
            Ok(Branch::from_parts(ctx2, handle, cell))
        })
    }
}

impl Context {
    /// Save every live branch and the whole KV cache to `path` (shared prefixes once).
    pub fn save_state(&self, path: impl Into<PathBuf>) -> Pending<()> {
        if let Err(e) = self.shared().check_open() {
            return Pending::ready(Err(e));
        }
        let path = path.into();
        self.run(move |w| w.save_context(&path))
    }

    /// Restore a file `save_state` wrote into this context, which must have no live branch.
    /// Returns the restored branches, each after its parent, on the sequences they had.
    pub fn load_state(&self, path: impl Into<PathBuf>) -> Pending<Vec<Branch>> {
        if let Err(e) = self.shared().check_open() {
            return Pending::ready(Err(e));
        }
        let (ctx, path) = (self.clone(), path.into());
        self.run(move |w| {
            let restored = w.load_context(&path)?;
            Ok(restored
                .into_iter()
                .map(|(h, cell)| Branch::from_parts(ctx.clone(), h, cell))
                .collect())
        })
    }
}
