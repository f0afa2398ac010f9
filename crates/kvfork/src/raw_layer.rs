//! The raw context layer (lloyal.node's low level: the Node.js library kvfork re-creates): decode into a sequence no
//! branch holds, take its cells over with a branch, capture its last output, decode without
//! accepting, release a branch but keep its cells, and the context-level metrics of the last
//! output. The work runs on the engine thread in `engine/takeover.rs`; the outputs are kept in
//! `engine/outputs.rs`.

use kvfork_core::metrics::LogBase;

use crate::branch::{check_tokens, Branch};
use crate::branch_state::{BranchState, LogitsSnapshot};
use crate::context::Context;
use crate::engine::{check_unleased, LastOutput, Pending};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::sampling::chain::SamplerChain;
use crate::sampling::grammar::{Grammar, GrammarSpec};
use crate::sampling::SamplingParams;

/// A branch made by [`Branch::create_over`], and whether it kept the sequence's cells.
#[derive(Debug, Clone)]
pub struct Created {
    /// The new root branch.
    pub branch: Branch,
    /// True when the branch took over cells ending at `position - 1`; false when its lease
    /// was emptied (then nothing is behind its position).
    pub kept_cells: bool,
}

/// The raw layer names sequences and leaves cells on them for later: a `park` context's
/// ledger moves its branches between sequences and reuses every free one, so it refuses
/// these calls (forks with `seq_id` are refused by the lease itself).
fn refuse_park(ctx: &Context, call: &str) -> Result<()> {
    if ctx.shared().park.is_some() {
        return Err(Error::Other(format!(
            "{call} is not available on a park=True context: its sequences belong to the \
             parking ledger"
        )));
    }
    Ok(())
}

impl Context {
    /// Decode `tokens` into sequence `seq_id` (which no branch may hold) from `position`, in
    /// ceil(n / n_batch) decodes, keeping the last token's logits as the sequence's output
    /// (for [`Branch::capture_logits`] and [`Context::model_entropy`]). `position` must
    /// follow the sequence's cells when it has any. All or nothing.
    pub fn decode(&self, tokens: Vec<Token>, position: i32, seq_id: i32) -> Pending<()> {
        let checked = (|| {
            self.shared().check_open()?;
            refuse_park(self, "Context.decode")?;
            let seq = self.seq_arg(seq_id)?;
            if position < 0 {
                return Err(Error::invalid(
                    "position",
                    format!("{position} is negative"),
                ));
            }
            if tokens.is_empty() {
                return Err(Error::invalid("tokens", "nothing to decode"));
            }
            check_tokens(self, &tokens)?;
            check_unleased(self.shared(), seq)?;
            Ok(seq)
        })();
        match checked {
            Ok(seq) => self.run(move |w| w.raw_decode(&tokens, position, seq)),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Entropy of the last output's distribution (softmax of its logits), in `base`: the
    /// last `decode`'s, or the snapshot of the branch whose decode ran last.
    pub fn model_entropy(&self, base: LogBase) -> Result<f64> {
        match self.last_output()? {
            Ok(row) => Ok(base.convert(row.entropy()?)),
            Err(branch) => branch.entropy(base),
        }
    }

    /// Surprisal of `token` under the last output (see [`Context::model_entropy`]), in `base`.
    pub fn model_surprisal(&self, token: Token, base: LogBase) -> Result<f64> {
        self.model().check_token(token)?;
        match self.last_output()? {
            Ok(row) => Ok(base.convert(row.surprisal(token)?)),
            Err(branch) => branch.surprisal(token, base),
        }
    }

    /// The last output: a raw row, or the branch whose snapshot it is.
    fn last_output(&self) -> Result<std::result::Result<LogitsSnapshot, Branch>> {
        self.shared().check_open()?;
        let none = || Error::Other("the context has no output yet: decode something first".into());
        // Read first: the outputs lock is not held while the registry is locked.
        let last = self.shared().outputs().last();
        match last {
            LastOutput::None => Err(none()),
            LastOutput::Raw(row) => Ok(Ok(row)),
            LastOutput::Branch(seq) => {
                let shared = self.shared();
                let holder = shared.holder_of(&shared.registry(), seq);
                let (handle, cell) = holder.ok_or_else(none)?;
                Ok(Err(Branch::from_parts(self.clone(), handle, cell)))
            }
        }
    }
}

impl Branch {
    /// A new root branch at `position` over the cells a sequence already holds (the raw
    /// layer's takeover). With `seq_id` it leases that sequence, whose cells must end at
    /// `position - 1` (`InvalidArgument` otherwise; `SeqLeased` when a branch holds it).
    /// Without, it leases the lowest free sequence and keeps its cells when they end at
    /// `position - 1`, else empties it ([`Created::kept_cells`] says which). Waits for the
    /// engine, which checks the cells after the work queued before.
    pub fn create_over(
        ctx: &Context,
        position: i32,
        params: &SamplingParams,
        grammar: Option<GrammarSpec>,
        seq_id: Option<i32>,
    ) -> Pending<Created> {
        let checked = (|| {
            ctx.shared().check_open()?;
            refuse_park(ctx, "Branch.create with a position > 0 or a seq_id")?;
            if position < 0 || position as u32 >= ctx.n_ctx() {
                return Err(Error::invalid(
                    "position",
                    format!("{position} is not in [0, n_ctx = {})", ctx.n_ctx()),
                ));
            }
            let seq = seq_id.map(|s| ctx.seq_arg(s)).transpose()?;
            let sampler = SamplerChain::new(params, ctx.model())?;
            let grammar = grammar
                .filter(|g| !g.is_blank())
                .map(|g| Grammar::new(ctx.model(), g))
                .transpose()?;
            Ok((seq, BranchState::new(position, sampler, grammar)))
        })();
        let (seq, state) = match checked {
            Ok(v) => v,
            Err(e) => return Pending::ready(Err(e)),
        };
        let ctx2 = ctx.clone();
        ctx.run(move |w| {
            let (handle, cell, kept_cells) = w.create_over(state, position, seq)?;
            Ok(Created {
                branch: Branch::from_parts(ctx2, handle, cell),
                kept_cells,
            })
        })
    }

    /// The context's last output for this branch's sequence becomes its snapshot: the row
    /// a [`Context::decode`] into the sequence left before this branch took it over (or a
    /// destroyed branch's snapshot). When the branch decoded since, its snapshot already is
    /// that output and nothing changes; with no output at all, an error.
    pub fn capture_logits(&self) -> Result<()> {
        self.check_live()?;
        let seq = self.cell().seq();
        let raw = self
            .context()
            .shared()
            .outputs()
            .row(seq)
            .and_then(LogitsSnapshot::output);
        match raw {
            Some(output) => self.set_output(&output),
            None if self.output()?.is_some() => Ok(()),
            None => Err(Error::Other(format!(
                "sequence {} has no output to capture: decode into it first \
                 (ctx.decode(tokens, position, seq_id)) or prefill the branch",
                seq.id()
            ))),
        }
    }

    /// Decode `token` at the branch's position and capture its logits, without accepting
    /// it (penalties, grammar and perplexity untouched): a one-token prefill.
    pub fn decode_and_capture_one(&self, token: Token) -> Pending<()> {
        if let Err(e) = self.context().model().check_token(token) {
            return Pending::ready(Err(e));
        }
        self.prefill(vec![token])
    }

    /// Release the handle and the lease but keep the KV cells (and the snapshot, as the
    /// sequence's output for a later takeover): the sequence goes on with the raw layer.
    /// RESTRICT like `prune`: refused while the branch has live children. A second call is a
    /// no-op.
    pub fn destroy(&self) -> Result<()> {
        if self.disposed() {
            return Ok(());
        }
        refuse_park(self.context(), "Branch.destroy")?;
        // Read first (waiting for a decode of it in flight to land): the snapshot is the
        // sequence's last output, for whoever takes its cells over next.
        let kept = self.output()?.map(|output| {
            let mut kept = LogitsSnapshot::empty();
            kept.set_output(output.as_ref());
            kept
        });
        let shared = self.context().shared();
        let mut registry = shared.registry();
        match registry.get(self.handle()) {
            None => return Ok(()),
            Some(node) if !node.children.is_empty() => {
                return Err(Error::Other(format!(
                    "branch {} has {} live children: prune them first, or use prune_subtree",
                    self.handle(),
                    node.children.len()
                )))
            }
            Some(_) => {}
        }
        self.cell().mark_disposed();
        // Kept while the lease is still held: a branch created on it next clears the row.
        if let Some(kept) = kept {
            shared.outputs().keep(self.cell().seq(), kept);
        }
        registry.prune(self.handle())?;
        Ok(())
    }
}
