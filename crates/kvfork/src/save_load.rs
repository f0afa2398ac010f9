//! Saving and loading branches and whole contexts, to files or in-memory snapshots (the same
//! bytes): the calls, queued on the engine thread, whose work (format included) is in
//! `engine/state_io.rs`.

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

impl Branch {
    /// The branch as bytes, after the work already queued on it: exactly what `save` writes
    /// to a file (the same framing and checks), kept in memory.
    pub fn snapshot(&self) -> Pending<Vec<u8>> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        let cell = self.cell().clone();
        self.context().run(move |w| w.branch_bytes(&cell))
    }

    /// A new root branch on a fresh lease of `ctx`, restored from `snapshot` bytes (or a
    /// file's contents): `load` without the file.
    pub fn restore(ctx: &Context, data: impl AsRef<[u8]> + Send + 'static) -> Pending<Branch> {
        if let Err(e) = ctx.shared().check_open() {
            return Pending::ready(Err(e));
        }
        let ctx2 = ctx.clone();
        ctx.run(move |w| {
            let (handle, cell) = w.restore_branch(data.as_ref())?;
            Ok(Branch::from_parts(ctx2, handle, cell))
        })
    }
}

impl Context {
    /// Every live branch and the whole KV cache as bytes, after the work already queued:
    /// exactly what `save_state` writes to a file, kept in memory.
    pub fn snapshot(&self) -> Pending<Vec<u8>> {
        if let Err(e) = self.shared().check_open() {
            return Pending::ready(Err(e));
        }
        self.run(|w| w.context_bytes())
    }

    /// Return to a `snapshot` (or a `save_state` file's contents): the bytes are checked
    /// first (a bad snapshot changes nothing); then every live branch is disposed, the whole
    /// cache replaced, and the snapshot's branches come back as new branches, each after its
    /// parent, on the sequences they had. Should llama.cpp refuse the cells after all, the
    /// context is left empty.
    pub fn restore(&self, data: impl AsRef<[u8]> + Send + 'static) -> Pending<Vec<Branch>> {
        if let Err(e) = self.shared().check_open() {
            return Pending::ready(Err(e));
        }
        let ctx = self.clone();
        self.run(move |w| {
            let restored = w.restore_context(data.as_ref())?;
            Ok(restored
                .into_iter()
                .map(|(h, cell)| Branch::from_parts(ctx.clone(), h, cell))
                .collect())
        })
    }

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
