//! Automatic prefix reuse: a new branch for a token sequence is made by sharing the longest
//! prefix already in the KV cache — a cached entry's, or that of a branch still generating —
//! and prefilling only the rest. Concurrent requests that share a system prompt or a document
//! (`kvfork serve`) then prefill it once.
//!
//! The cache knows the branches it made (live ones, handed out: `branch` and `fork`) and the
//! ones handed back (`release`: entries, evicted least recently used when a lease or KV cells
//! are needed). So it is one account of the sequences its users hold: `stats().live` are
//! handed out, `stats().entries` kept. Which holder shares the longest prefix is the token
//! trie's job (`kvfork_core::prefix_trie`); here are the leases, the KV copy and the eviction.
//!
//! An eviction prunes the entry alone (`prune_keep_children`): forks of it (the `n` choices
//! of one request, or a user's own) keep their cells and become roots.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kvfork_core::prefix_trie::PrefixTrie;
use kvfork_core::Handle;

use crate::adapter::{AdapterKey, Adapters};
use crate::branch::Branch;
use crate::context::Context;
use crate::engine::{CancelPolicy, Pending, Relay};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::prefix_spill::{
    pack, unpack, DiskWrite, LevelStats, Settled, Spill, SpillConfig, SpilledCheckpoints, Taken,
    Unpacked,
};
use crate::sampling::SamplingParams;

/// A spilled entry taken out for a request, and how many of its tokens the prompt shares.
/// Dropped, it is settled (`Spill::settle`) as `settled` says: `Restored` once its cells are a
/// branch's, `Corrupt`, or else given back: a request that refuses it, runs out of room or
/// is cancelled loses no entry.
struct Restoring {
    cache: PrefixCache,
    taken: Option<Taken>,
    len: usize,
    settled: Cell<Settled>,
}

impl Restoring {
    fn taken(&self) -> &Taken {
        self.taken.as_ref().expect("taken until dropped")
    }
}

impl Drop for Restoring {
    fn drop(&mut self) {
        if let Some(taken) = self.taken.take() {
            let how = self.settled.get();
            self.cache.settle_taken(taken, how);
        }
    }
}

/// What the cache has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Branches handed out.
    pub branches: u64,
    /// Prompt tokens that came from the KV cache (shared, not prefilled).
    pub hit_tokens: u64,
    /// Prompt tokens prefilled.
    pub prefilled_tokens: u64,
    /// Entries evicted to free a lease, KV cells or cache room.
    pub evictions: u64,
    /// Entries held now (released branches).
    pub entries: usize,
    /// KV cells only the entries hold (shared prefixes counted once).
    pub cached_tokens: usize,
    /// Branches the cache made that are still handed out.
    pub live: usize,
    /// Evicted entries kept in host memory (`PrefixCache::with_spill`).
    pub host: LevelStats,
    /// Evicted entries kept on disk.
    pub disk: LevelStats,
}

/// One branch the cache made: handed out (`live`) or handed back (an entry).
struct Holder {
    /// The cache's own handle (once an entry, the only one that may use it).
    branch: Branch,
    /// Its adapter set's token in the trie (None: no adapter), see [`State::sentinel`].
    sentinel: Option<Token>,
    /// The tokens its KV holds, as far as the cache has seen (refreshed from its history).
    tokens: Vec<Token>,
    live: bool,
    /// Prompt tokens it got from the KV cache when it was made.
    shared: usize,
    /// Its KV is no longer all of the adapter set the trie keys it by (its adapters changed
    /// after it was made): never shared again, evicted when it is handed back.
    mixed: bool,
}

impl Holder {
    /// Its branch's position, and whether it may be shared: all of its KV is of the adapter
    /// set the trie keys it by (`sets`: the registered sets); its adapters may have changed
    /// since it was made, even back again. An error for a branch pruned behind the cache's
    /// back.
    fn shareable(&self, sets: &[AdapterKey]) -> Result<(i32, bool)> {
        let (position, adapters, one_set) = self.branch.kv_under_one_set()?;
        let shareable = !self.mixed && one_set && keyed_as(sets, &adapters) == Some(self.sentinel);
        Ok((position, shareable))
    }
}

/// A prompt being prefilled now: requests that share a long prefix with it wait for it and
/// fork, rather than prefill the same tokens at the same time.
struct Prefilling {
    /// As the trie keys them (the adapter set's sentinel first).
    tokens: Vec<Token>,
    done: Done,
}

/// A prefill's completion, for the requests that wait for it.
type Done = Arc<(Mutex<bool>, Condvar)>;

/// What `turn_to_prefill` decided.
enum Turn {
    /// Prefill now; others may wait for this.
    Mine(Done),
    /// Wait for this other prefill, then look again.
    WaitFor(Done),
}

/// A shared prefix worth waiting for another request's prefill: this many tokens, or half
/// the prompt (a system prompt or document, not a common first word) — and at least half of
/// what that prefill decodes (a chat template's first tokens are not worth waiting for a
/// long document's prefill: the short prompt after it would wait all of it).
const WORTH_WAITING: usize = 64;

/// The shortest prefix worth sharing, unless it is half the prompt: a few common first
/// tokens (`<bos>Note`) save next to nothing, and a prompt that starts its own sequence may
/// be prefilled apart from a busy cache (`engine/scratch.rs`), twice as fast.
const WORTH_SHARING: usize = 16;

struct State {
    holders: HashMap<Handle, Holder>,
    /// Adapter sets seen so far: set `i` is keyed in the trie by the token `-(i + 1)` before
    /// its prompt, so branches under different adapters never share a prefix (their KV
    /// differs). Branches without adapters have no such token.
    adapter_sets: Vec<AdapterKey>,
    prefilling: Vec<Prefilling>,
    trie: PrefixTrie<Handle>,
    stats: PrefixCacheStats,
    /// Entries evicted from the KV cache, kept as snapshots (None: evictions drop them).
    spill: Option<Spill>,
    /// Evicted entries whose snapshot is being taken (in neither trie meanwhile): a request
    /// that would share theirs waits for them.
    spilling: Vec<Prefilling>,
    /// Evictions queued without waiting (`release`'s), not yet pruned: their leases are about
    /// to come back, so a request that finds no lease and no entry left waits for them.
    evicting: Vec<Done>,
}

/// Hands out branches that share the longest prefix already in the KV cache.
///
/// Cheap to clone (clones share the cache). [`PrefixCache::branch`] hands out roots,
/// [`PrefixCache::fork`] forks of them; hand either back with [`PrefixCache::release`] to
/// keep its KV as an entry for later requests.
#[derive(Clone)]
pub struct PrefixCache {
    ctx: Context,
    max_cached_tokens: Option<usize>,
    state: Arc<Mutex<State>>,
}

impl PrefixCache {
    /// A cache over `ctx`. Entries beyond `max_cached_tokens` tokens (None: no limit but the
    /// context's leases and cells) are evicted least recently used first.
    pub fn new(ctx: &Context, max_cached_tokens: Option<usize>) -> Self {
        PrefixCache {
            ctx: ctx.clone(),
            max_cached_tokens,
            state: Arc::new(Mutex::new(State {
                holders: HashMap::new(),
                prefilling: Vec::new(),
                trie: PrefixTrie::new(),
                adapter_sets: Vec::new(),
                stats: PrefixCacheStats::default(),
                spill: None,
                spilling: Vec::new(),
                evicting: Vec::new(),
            })),
        }
    }

    /// [`PrefixCache::new`] whose evicted entries (those without adapters) are kept as
    /// snapshots in host memory and on disk (`prefix_spill.rs`) and restored when a prompt
    /// matches one, instead of prefilled. With a directory, the entries a previous run left
    /// there are found again.
    pub fn with_spill(
        ctx: &Context,
        max_cached_tokens: Option<usize>,
        spill: SpillConfig,
    ) -> Result<Self> {
        let cache = PrefixCache::new(ctx, max_cached_tokens);
        if spill.spills() {
            let p = &ctx.shared().params;
            // The model and the cache's element types: a file of another model (or types) on
            // the same directory is not this cache's to load, count or remove.
            let mut key = kvfork_core::state_file::Writer::new();
            key.u64(ctx.model().identity())
                .u32(p.type_k.ggml())
                .u32(p.type_v.ggml());
            let layout = kvfork_core::state_file::checksum(&key.into_bytes());
            cache.lock().spill = Some(Spill::open(spill, layout)?);
        }
        Ok(cache)
    }

    /// The context it hands out branches of.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new root branch positioned at the end of `tokens` with fresh logits: the longest
    /// prefix any branch of the cache holds is shared (no copy of tensors), the rest
    /// prefilled (at least one token). Waits for leases and cells freed by evicting entries;
    /// LeaseExhaustedError when every lease is held by live branches.
    pub fn branch(&self, tokens: Vec<Token>, params: SamplingParams) -> Pending<Branch> {
        self.branch_under(tokens, params, Adapters::default())
    }

    /// [`PrefixCache::branch`] for a branch that decodes under `adapters`: only prefixes
    /// computed under the same set are shared.
    pub fn branch_under(
        &self,
        tokens: Vec<Token>,
        params: SamplingParams,
        adapters: Adapters,
    ) -> Pending<Branch> {
        if tokens.is_empty() {
            return Pending::ready(Err(Error::invalid("tokens", "at least one token")));
        }
        if tokens.len() >= self.ctx.n_ctx() as usize {
            return Pending::ready(Err(Error::invalid(
                "tokens",
                format!(
                    "{} tokens leave no room in n_ctx = {}",
                    tokens.len(),
                    self.ctx.n_ctx()
                ),
            )));
        }
        if let Err(e) = tokens
            .iter()
            .try_for_each(|&t| self.ctx.model().check_token(t))
        {
            return Pending::ready(Err(e));
        }
        let cache = self.clone();
        // Cancelled (a client gone), it stops: its prefill aborted and rolled back, or before
        // its next step.
        Pending::spawn_relayed("kvfork-prefix", move |relay| {
            cache.branch_blocking(&tokens, &params, &adapters, relay)
        })
    }

    fn branch_blocking(
        &self,
        tokens: &[Token],
        params: &SamplingParams,
        adapters: &Adapters,
        relay: &Relay,
    ) -> Result<Branch> {
        let sentinel = self.lock().sentinel(adapters.key());
        // A spilled entry being brought back: kept across a retry for room; given up (and back
        // to the spill) when no entry is left to evict for its cells.
        let mut restoring: Option<Restoring> = None;
        let mut may_restore = sentinel.is_none();
        loop {
            relay.check()?;
            let (source, shared) = self.lookup(sentinel, tokens)?;
            if self.out_of_leases(1) {
                self.evict_one(source.as_ref().map(Branch::handle))?;
                continue;
            }
            let done = match self.turn_to_prefill(sentinel, tokens, shared) {
                Turn::Mine(done) => done,
                Turn::WaitFor(other) => {
                    wait_done_unless_cancelled(&other, relay)?;
                    continue;
                }
            };
            // A spilled entry sharing more: copied into the new branch's own sequence.
            if restoring.is_none() && may_restore {
                self.wait_for_spilling(tokens);
                restoring = self.take_spilled(tokens, shared);
            }
            let made = self.make(
                (source.as_ref(), shared),
                restoring.as_ref(),
                tokens,
                params,
                adapters,
                relay,
            );
            // Out of cells, or another request took the lease seen free above (requests
            // woken together by one prefill race for it): evict an entry and look again. A
            // restore with no entry left to evict gives up (the prompt is prefilled).
            let retry = match &made {
                Err(Error::KvCacheFull(_)) => {
                    self.evict_one(None).is_ok() || {
                        may_restore = false;
                        restoring.take().is_some()
                    }
                }
                Err(Error::LeaseExhausted { .. }) => {
                    self.evict_one(source.as_ref().map(Branch::handle)).is_ok()
                }
                _ => false,
            };
            let made =
                made.map(|(branch, shared)| (self.hold(branch, sentinel, tokens, shared), shared));
            if !retry {
                restoring = None;
            }
            // Who waits for this prefill looks again, and finds the new holder.
            self.finished(&done);
            if retry {
                continue;
            }
            return made.map(|(branch, _)| branch);
        }
    }

    /// A fork of `source` (a branch of this cache's context, usually one it handed out) on a
    /// lease made free by evicting entries when none is: the `n` choices of one request. The
    /// fork is handed out like a branch of [`PrefixCache::branch`] (`release` keeps it as an
    /// entry). LeaseExhaustedError when branches handed out hold every lease.
    pub fn fork(&self, source: &Branch, seed: Option<u32>) -> Pending<Branch> {
        if let Err(e) = self.check_ours(source).and_then(|_| source.check_live()) {
            return Pending::ready(Err(e));
        }
        let (cache, source) = (self.clone(), source.clone());
        Pending::spawn("kvfork-prefix", move || cache.fork_blocking(&source, seed))
    }

    fn fork_blocking(&self, source: &Branch, seed: Option<u32>) -> Result<Branch> {
        let keep = Some(source.handle());
        loop {
            if self.out_of_leases(1) {
                self.evict_one_but(keep)?;
                continue;
            }
            match source.fork(seed).wait() {
                // Another request took the lease seen free: make room again.
                Err(Error::LeaseExhausted { .. }) => {
                    self.evict_one_but(keep)?;
                }
                Err(e) => return Err(e),
                Ok(branch) => {
                    // The fork's own tokens and adapters: `source` may have moved on since.
                    let made = branch.history().and_then(|h| Ok((h, branch.adapters()?)));
                    let (tokens, adapters) = match made {
                        Ok(made) => made,
                        Err(e) => {
                            drop(branch.prune()); // queued; always completes
                            return Err(e);
                        }
                    };
                    let sentinel = self.lock().sentinel(adapters.key());
                    return Ok(self.hold(branch, sentinel, &tokens, tokens.len()));
                }
            }
        }
    }

    /// Whether `n` new branches need entries evicted first: fewer than `n` leases are free, on
    /// a context that does not park branches (one that does parks the least recently used
    /// branches, the user's too, to make them room: nothing to evict).
    fn out_of_leases(&self, n: u32) -> bool {
        !self.ctx.parks() && self.ctx.available() < n
    }

    /// Evict entries, least recently used first, until `n` leases are free (room for a
    /// request's `n` branches); how many were evicted. LeaseExhaustedError when the entries
    /// are not enough: branches handed out (or made outside the cache) hold the rest. On a
    /// `park` context there is always room (branches are parked to make it): 0.
    pub fn make_room(&self, n: u32) -> Pending<usize> {
        if n > self.ctx.n_seq_max() {
            return Pending::ready(Err(Error::invalid(
                "n",
                format!(
                    "{n} is more than the context's {} sequences",
                    self.ctx.n_seq_max()
                ),
            )));
        }
        let cache = self.clone();
        Pending::spawn("kvfork-prefix", move || {
            cache.ctx.shared().check_open()?; // Closed: not "nothing left"
            let mut evicted = 0;
            while cache.out_of_leases(n) {
                if cache.evict_one_but(None)? {
                    evicted += 1;
                }
            }
            Ok(evicted)
        })
    }

    /// Evict the least recently used entry: the cells no other branch shares go back to the
    /// KV (room for a decode of a branch handed out that found none). False when no entry is
    /// left.
    pub fn evict_oldest(&self) -> Pending<bool> {
        let cache = self.clone();
        Pending::spawn("kvfork-prefix", move || {
            cache.ctx.shared().check_open()?; // Closed: not "nothing left"
            match cache.take_victim(None, true) {
                Some(holder) => cache.evict(Some(holder)),
                None => Ok(false),
            }
        })
    }

    /// Refuse a branch of another context (its handle could equal one of ours).
    fn check_ours(&self, branch: &Branch) -> Result<()> {
        branch.check_on(&self.ctx, "branch")
    }

    /// Record a branch just made as a live holder of `tokens`; the handle to hand out (spent
    /// once handed back, see [`PrefixCache::release`]; the holder keeps the cache's own).
    fn hold(
        &self,
        branch: Branch,
        sentinel: Option<Token>,
        tokens: &[Token],
        shared: usize,
    ) -> Branch {
        let mut st = self.lock();
        let handle = branch.handle();
        st.trie.insert(handle, &keyed(sentinel, tokens));
        st.holders.insert(
            handle,
            Holder {
                branch: branch.owned_by_cache(),
                sentinel,
                tokens: tokens.to_vec(),
                live: true,
                shared,
                mixed: false,
            },
        );
        st.stats.branches += 1;
        branch
    }

    /// Whether to prefill `tokens` now (announced, for others to wait for) or to wait for
    /// another request's prefill that shares more of them than the KV holds already
    /// (`shared`), by enough to be worth it. One lock: two requests never both decide to
    /// prefill the same long prefix.
    fn turn_to_prefill(&self, sentinel: Option<Token>, tokens: &[Token], shared: usize) -> Turn {
        let mut st = self.lock();
        let worth = WORTH_WAITING.min(tokens.len() / 2).max(1);
        let keyed_tokens = keyed(sentinel, tokens);
        let skip = usize::from(sentinel.is_some());
        let other = st
            .prefilling
            .iter()
            .map(|p| {
                (
                    common_prefix(&p.tokens, &keyed_tokens).saturating_sub(skip),
                    p,
                )
            })
            .filter(|&(len, p)| {
                let gain = len.saturating_sub(shared);
                gain >= worth && 2 * gain >= p.tokens.len().saturating_sub(skip + shared)
            })
            .max_by_key(|&(len, _)| len)
            .map(|(_, p)| p.done.clone());
        if let Some(other) = other {
            return Turn::WaitFor(other);
        }
        let done = new_done();
        st.prefilling.push(Prefilling {
            tokens: keyed_tokens,
            done: done.clone(),
        });
        Turn::Mine(done)
    }

    /// The prefill announced with `done` is over (its branch is a holder now, or it failed):
    /// wake who waits for it.
    fn finished(&self, done: &Done) {
        self.lock()
            .prefilling
            .retain(|p| !Arc::ptr_eq(&p.done, done));
        signal_done(done);
    }

    /// The holder sharing the longest prefix with `tokens`, and how many tokens to share
    /// (at most all but the last: the new branch needs fresh logits).
    fn lookup(&self, sentinel: Option<Token>, tokens: &[Token]) -> Result<(Option<Branch>, usize)> {
        let mut st = self.lock();
        st.refresh();
        // All but the last token: the new branch prefills at least one, for fresh logits.
        let keyed_tokens = keyed(sentinel, &tokens[..tokens.len() - 1]);
        let Some(found) = st.trie.longest_prefix(&keyed_tokens) else {
            return Ok((None, 0));
        };
        let shared = found.len - usize::from(sentinel.is_some());
        if shared == 0 || (shared < WORTH_SHARING && 2 * shared < tokens.len()) {
            return Ok((None, 0));
        }
        st.trie.touch(found.key);
        Ok((st.holders.get(&found.key).map(|h| h.branch.clone()), shared))
    }

    /// A branch at the end of `tokens`: `shared` tokens from `source`'s cells (`found`), the
    /// rest prefilled (everything when the source lost its cells meanwhile); its prefill is
    /// aborted if `relay` is cancelled.
    fn make(
        &self,
        found: (Option<&Branch>, usize),
        spilled: Option<&Restoring>,
        tokens: &[Token],
        params: &SamplingParams,
        adapters: &Adapters,
        relay: &Relay,
    ) -> Result<(Branch, usize)> {
        let (source, shared) = found;
        let branch = Branch::create(&self.ctx, 0, params, None)?;
        if let Err(e) = branch.set_all_adapters(adapters.clone()) {
            let _ = branch.prune().wait();
            return Err(e);
        }
        let asked = shared;
        let restored = match spilled {
            Some(restoring) => match self.restore_into(&branch, restoring) {
                Ok(n) => n,
                Err(e) => {
                    let _ = branch.prune().wait();
                    return Err(e); // no room for its cells: the caller makes some
                }
            },
            None => 0,
        };
        // An entry restored because the source was evicted meanwhile: settled, like `spilled`,
        // only once the prefill after it succeeds.
        let mut late: Option<Restoring> = None;
        let shared = match source {
            _ if restored > 0 => restored,
            Some(source) if shared > 0 => {
                // Fewer than asked on a recurrent state (from its last checkpoint), none when
                // the source was pruned or rewritten meanwhile: the rest is prefilled.
                match branch.share_prefix(source, &tokens[..shared]).wait() {
                    // Evicted meanwhile (by another request making room): it may have been
                    // spilled, and come back from there.
                    Ok(0) if adapters.key().is_empty() => {
                        let (n, restoring) = self.restore_evicted(&branch, tokens);
                        late = restoring.filter(|_| n > 0);
                        n
                    }
                    Ok(n) => n,
                    Err(e) => {
                        let _ = branch.prune().wait();
                        return Err(e);
                    }
                }
            }
            _ => 0,
        };
        // A recurrent state shared fewer tokens than the prefix (the source had no checkpoint
        // at its end): the prefix's rest is prefilled apart, so that a checkpoint marks where
        // this prompt and the source part (a shared preamble's end), here and in the source.
        let split = match source {
            Some(source) if restored == 0 && shared < asked && self.ctx.model().is_recurrent() => {
                Some((source, asked))
            }
            _ => None,
        };
        let prefilled = match split {
            Some((source, at)) => relay
                .wait(branch.prefill(tokens[shared..at].to_vec()))
                .map(|()| share_checkpoint(&branch, source, &tokens[..at]))
                .and_then(|()| relay.wait(branch.prefill(tokens[at..].to_vec()))),
            None => relay.wait(branch.prefill(tokens[shared..].to_vec())),
        };
        if let Err(e) = prefilled {
            let _ = branch.prune().wait();
            return Err(e); // a restored entry goes back to the spill
        }
        for restoring in spilled.filter(|_| restored > 0).into_iter().chain(&late) {
            restoring.settled.set(Settled::Restored); // its cells are this branch's now
        }
        self.count(shared, tokens.len() - shared);
        Ok((branch, shared))
    }

    fn count(&self, hit: usize, prefilled: usize) {
        let mut st = self.lock();
        st.stats.hit_tokens += hit as u64;
        st.stats.prefilled_tokens += prefilled as u64;
    }

    /// Prune the least recently used entry (not `keep`, the source about to be shared, when
    /// another entry can go) and wait until its lease is free, or, with none, wait for the
    /// evictions under way ([`PrefixCache::evict`]). LeaseExhaustedError when there is none.
    fn evict_one(&self, keep: Option<Handle>) -> Result<bool> {
        self.evict(self.take_victim(keep, false))
    }

    /// [`PrefixCache::evict_one`] that never takes `keep` (a branch about to be forked).
    fn evict_one_but(&self, keep: Option<Handle>) -> Result<bool> {
        self.evict(self.take_victim(keep, true))
    }

    /// Evict `victim` (true), or, with none, wait for the evictions under way (false; their
    /// leases and cells are free then: the caller looks again); LeaseExhausted when there
    /// are none either.
    fn evict(&self, victim: Option<Holder>) -> Result<bool> {
        match victim {
            Some(holder) => {
                let (pruned, keep) = self.start_eviction(holder);
                if let Some(keep) = keep {
                    keep();
                }
                pruned.wait().map(|()| true)
            }
            // `release` does not wait for the evictions it queues.
            None if self.wait_for_evictions() => Ok(false),
            None => Err(Error::LeaseExhausted {
                n_seq_max: self.ctx.n_seq_max(),
            }),
        }
    }

    /// Wait for the evictions queued without waiting; false when there were none.
    fn wait_for_evictions(&self) -> bool {
        let waits: Vec<Done> = self.lock().evicting.clone();
        waits.iter().for_each(|done| wait_done(done));
        !waits.is_empty()
    }

    /// Evict `holder` without waiting (`release` must not block): the engine takes its
    /// snapshot (when spilling) and prunes it, and a thread of its own keeps the snapshot.
    /// Until the prune is done the eviction is listed in `evicting`.
    fn evict_in_background(&self, holder: Holder) {
        let (pruned, keep) = self.start_eviction(holder);
        let done = new_done();
        self.lock().evicting.push(done.clone());
        // Signalled when dropped: also when the thread could not start (the closure is
        // dropped unrun), so that no request waits for it forever.
        let evicted = Evicted {
            cache: self.clone(),
            done,
        };
        drop(Pending::spawn("kvfork-evict", move || {
            let _ = pruned.wait(); // a prune always completes once queued
            drop(evicted);
            if let Some(keep) = keep {
                keep();
            }
            Ok(())
        }));
    }

    /// Queue `holder`'s prune (it always completes once queued). With spilling, its snapshot
    /// is queued first (the engine takes it before the prune) and announced to the requests
    /// that share its tokens (`wait_for_spilling`); the second half keeps it in the spill
    /// levels once taken, for the caller to run now or on a thread of its own.
    fn start_eviction(&self, holder: Holder) -> (Pending<()>, Option<impl FnOnce() + Send>) {
        let snapshot = self.spills(&holder).then(|| {
            let checkpoints: SpilledCheckpoints = holder
                .branch
                .cell()
                .lock()
                .checkpoints_upto(u32::MAX)
                .iter()
                .map(|c| (c.pos, c.state.clone()))
                .collect();
            let anchor = self.anchor_of(&holder);
            (holder.branch.spill_snapshot(anchor), checkpoints)
        });
        let pruned = holder.branch.prune_keep_children();
        let keep = snapshot.map(|(snapshot, checkpoints)| {
            let done = self.announce_spilling(&holder.tokens);
            let cache = self.clone();
            move || {
                let entry = snapshot
                    .wait()
                    .map(|(s, anchor)| (pack(s, anchor, &checkpoints), anchor));
                cache.keep_spilled(holder.tokens, entry);
                cache.spilled(&done);
            }
        });
        (pruned, keep)
    }

    /// The prefix an evicted entry got from the KV when it was made, with a branch of the
    /// cache that holds it now: its spilled snapshot leaves those cells out. None on a
    /// recurrent state (its snapshot is whole) or a prefix not worth it.
    fn anchor_of(&self, holder: &Holder) -> Option<(usize, Branch)> {
        let from = holder.shared;
        if from < WORTH_SHARING || holder.sentinel.is_some() || self.ctx.model().is_recurrent() {
            return None;
        }
        self.holder_of(&holder.tokens[..from]).map(|b| (from, b))
    }

    /// A branch of the cache (no adapters) whose KV holds `prefix`.
    fn holder_of(&self, prefix: &[Token]) -> Option<Branch> {
        holder_in(&self.lock(), prefix)
    }

    /// Whether an evicted entry is kept as a snapshot: the cache spills, and the entry has
    /// no adapters (a snapshot does not carry them).
    fn spills(&self, holder: &Holder) -> bool {
        holder.sentinel.is_none() && !holder.live && self.lock().spill.is_some()
    }

    /// The spilled entry to restore for `tokens`, taken out of its level: one sharing a
    /// prefix worth sharing beyond the `shared` tokens the KV cache holds, and how many of
    /// its tokens the prompt shares (all but the prompt's last at most).
    ///
    /// An entry spilled without its anchor's cells comes back only while a branch of the cache
    /// holds them; else the entry that holds them, if one was spilled, comes back instead.
    fn take_spilled(&self, tokens: &[Token], shared: usize) -> Option<Restoring> {
        let mut st = self.lock();
        let prompt = &tokens[..tokens.len() - 1];
        let (mut id, mut len, anchor) = st.spill.as_ref()?.best(prompt)?;
        if anchor > 0 && (len <= anchor || holder_in(&st, &prompt[..anchor]).is_none()) {
            let spill = st.spill.as_ref()?;
            (id, len) = match spill.best(&prompt[..anchor.min(len)])? {
                (id, len, 0) => (id, len),
                _ => return None,
            };
        }
        if len < shared + WORTH_SHARING {
            return None;
        }
        let taking = st.spill.as_mut()?.take(id)?;
        drop(st); // a file is read without the lock
        match taking.read() {
            Ok(taken) => Some(Restoring {
                cache: self.clone(),
                taken: Some(taken),
                len,
                settled: Cell::new(Settled::NotRestored),
            }),
            Err(_) => {
                if let Some(spill) = self.lock().spill.as_mut() {
                    spill.drop_entry(id); // its file is not the entry
                }
                None
            }
        }
    }

    /// Copy a spilled entry's first `restoring.len` tokens into `branch`'s empty sequence; how
    /// many it holds then (0: refused here, or corrupt: then marked so, the spill drops it).
    /// KvCacheFullError when its cells find no room (the caller evicts and tries again).
    fn restore_into(&self, branch: &Branch, restoring: &Restoring) -> Result<usize> {
        let taken = restoring.taken();
        let restored = unpack(&taken.entry).and_then(|parts| {
            let anchor = match parts.anchor {
                0 => None,
                n => self.holder_of(&taken.tokens[..n.min(taken.tokens.len())]),
            };
            let prefix = taken.tokens[..restoring.len].to_vec();
            branch
                .restore_prefix(taken.entry.clone(), parts, prefix, anchor)
                .wait()
        });
        let n = match restored {
            Ok(n) => n,
            Err(e @ Error::KvCacheFull(_)) => return Err(e),
            Err(_) => {
                restoring.settled.set(Settled::Corrupt); // another model's, or not as indexed
                0
            }
        };
        if let Some(spill) = self.lock().spill.as_mut() {
            if n > 0 {
                spill.restored(taken.from_disk, n);
            }
        }
        Ok(n)
    }

    /// A taken entry done with (`Spill::settle`); files the spill hands out are written.
    fn settle_taken(&self, taken: Taken, how: Settled) {
        let writes = match self.lock().spill.as_mut() {
            Some(spill) => {
                spill.settle(taken, how);
                spill.take_writes()
            }
            None => return,
        };
        self.write_out(writes);
    }

    /// An entry's snapshot is being taken: requests sharing its tokens wait for it.
    fn announce_spilling(&self, tokens: &[Token]) -> Done {
        let done = new_done();
        self.lock().spilling.push(Prefilling {
            tokens: tokens.to_vec(),
            done: done.clone(),
        });
        done
    }

    fn spilled(&self, done: &Done) {
        self.lock().spilling.retain(|p| !Arc::ptr_eq(&p.done, done));
        signal_done(done);
    }

    /// Wait for the snapshots being taken of evicted entries that share a prefix worth
    /// sharing with `tokens` (they are in the spill levels then).
    fn wait_for_spilling(&self, tokens: &[Token]) {
        let waits: Vec<Done> = self
            .lock()
            .spilling
            .iter()
            .filter(|p| common_prefix(&p.tokens, tokens) >= WORTH_SHARING)
            .map(|p| p.done.clone())
            .collect();
        waits.iter().for_each(|done| wait_done(done));
    }

    /// [`PrefixCache::restore_into`] of the spilled entry sharing the most with `tokens`, if
    /// one is worth it: how many tokens it holds (0 when none is, or it could not be restored
    /// here), and the entry taken out, for the caller to mark restored once its prefill is
    /// done (dropped before, it goes back to its level: a cancelled request loses nothing).
    fn restore_evicted(&self, branch: &Branch, tokens: &[Token]) -> (usize, Option<Restoring>) {
        self.wait_for_spilling(tokens);
        let Some(restoring) = self.take_spilled(tokens, 0) else {
            return (0, None);
        };
        let n = self.restore_into(branch, &restoring).unwrap_or(0);
        (n, Some(restoring))
    }

    /// Keep an evicted entry (`pack`ed, without its first `anchor` tokens' cells; nothing
    /// when taking its snapshot failed: it is only lost).
    fn keep_spilled(&self, tokens: Vec<Token>, entry: Result<(Vec<u8>, usize)>) {
        let writes = match (entry, self.lock().spill.as_mut()) {
            (Ok((entry, anchor)), Some(spill)) => {
                spill.keep(tokens, entry, anchor);
                spill.take_writes()
            }
            _ => return,
        };
        self.write_out(writes);
    }

    /// Write the spill's files without the lock (a disk does not hold up requests), then
    /// tell the spill how each went.
    fn write_out(&self, writes: Vec<DiskWrite>) {
        for write in writes {
            let ok = write.run().is_ok();
            if let Some(spill) = self.lock().spill.as_mut() {
                spill.written(&write, ok);
            }
        }
    }

    /// Take the least recently used entry out of the cache (not `keep` while another can
    /// go; never `keep` when `strict`). Its prune is the caller's.
    fn take_victim(&self, keep: Option<Handle>, strict: bool) -> Option<Holder> {
        let mut st = self.lock();
        st.refresh();
        let order = st.trie.evict_order();
        let mut others = order.iter().copied().filter(|&h| Some(h) != keep);
        let pick = match others.next() {
            Some(h) => Some(h),
            None if strict => None,
            None => order.first().copied(),
        }?;
        st.trie.remove(pick);
        st.stats.evictions += 1;
        st.holders.remove(&pick)
    }

    /// Hand a branch the cache made back: its KV stays as an entry for later requests
    /// (evicted least recently used), and the handle handed out is spent (disposed, to its
    /// holders: a use would change an entry others share). A branch the cache did not make is
    /// refused. Never waits (an async caller may call it from a cancelled task's clean-up):
    /// prunes it needs are queued, and always happen.
    pub fn release(&self, branch: &Branch) -> Result<()> {
        self.check_ours(branch)?;
        let over = {
            let mut st = self.lock();
            let handle = branch.handle();
            let Some(holder) = st.holders.get_mut(&handle) else {
                return Err(Error::invalid(
                    "branch",
                    "not a live branch of this cache (made by PrefixCache.branch)",
                ));
            };
            if !holder.live {
                return Err(Error::invalid("branch", "already released"));
            }
            if branch.disposed() {
                st.holders.remove(&handle);
                st.trie.remove(handle);
                return Err(Error::invalid(
                    "branch",
                    "pruned already: it holds no KV to keep",
                ));
            }
            let shareable = {
                let st: &State = &st;
                st.holders[&handle]
                    .shareable(&st.adapter_sets)
                    .is_ok_and(|(_, shareable)| shareable)
            };
            if !shareable {
                // Its adapters changed since it was made (even if back again): its KV is not
                // (all) what the trie says.
                let holder = st.holders.remove(&handle).expect("found above");
                st.trie.remove(handle);
                drop(st);
                self.evict_in_background(holder);
                return Ok(());
            }
            let holder = st.holders.get_mut(&handle).expect("found above");
            holder.live = false;
            holder.branch.cell().mark_entry();
            st.refresh();
            st.trie.set_evictable(handle, true);
            st.trie.touch(handle);
            st.cached_tokens() > self.max_cached_tokens.unwrap_or(usize::MAX)
        };
        if over {
            self.trim();
        }
        Ok(())
    }

    /// Evict entries until the cached tokens fit `max_cached_tokens` (without waiting).
    fn trim(&self) {
        let limit = self.max_cached_tokens.unwrap_or(usize::MAX);
        while self.lock().cached_tokens() > limit {
            match self.take_victim(None, false) {
                Some(holder) => self.evict_in_background(holder),
                None => break,
            }
        }
    }

    /// How many of `branch`'s prompt tokens came from the KV cache when the cache made it
    /// (None for a branch it did not make or no longer holds).
    pub fn shared_tokens(&self, branch: &Branch) -> Option<usize> {
        // The handle alone is not enough: another context's branch may have the same number,
        // and a released branch's holder stays on as an entry.
        self.lock()
            .holders
            .get(&branch.handle())
            .filter(|h| h.live && h.branch == *branch)
            .map(|h| h.shared)
    }

    /// Prune every entry (live branches stay).
    pub fn clear(&self) -> Result<()> {
        loop {
            {
                // Entries whose branch was disposed elsewhere (a `prune_subtree` above them,
                // `retain_only`) are forgotten first: evicting them is "nothing to evict".
                let mut st = self.lock();
                st.refresh();
                if st.trie.least_recently_used().is_none() {
                    return Ok(());
                }
            }
            self.evict_one(None)?;
        }
    }

    /// Evict every entry into the spill levels, then write those in host memory to disk, so
    /// that a cache opened later on the same directory finds them (a server's shutdown). How
    /// many entries are on disk then. Without spilling, the same as [`PrefixCache::clear`].
    pub fn spill_all(&self) -> Result<usize> {
        self.clear()?;
        let writes = match self.lock().spill.as_mut() {
            Some(spill) => {
                spill.flush_to_disk();
                spill.take_writes()
            }
            None => return Ok(0),
        };
        self.write_out(writes);
        let mut st = self.lock();
        Ok(st.spill.as_mut().map_or(0, |s| {
            s.forget_missing_files(); // what is on disk, not what was once written
            s.stats().1.entries
        }))
    }

    /// Counts so far, and the entries now.
    pub fn stats(&self) -> PrefixCacheStats {
        let mut st = self.lock();
        st.refresh();
        let mut stats = st.stats;
        stats.entries = st.holders.values().filter(|h| !h.live).count();
        stats.cached_tokens = st.cached_tokens();
        stats.live = st.holders.values().filter(|h| h.live).count();
        if let Some(spill) = st.spill.as_ref() {
            (stats.host, stats.disk) = spill.stats();
        }
        stats
    }
}

/// An eviction of `evict_in_background` under way: dropped once its prune is done, it
/// leaves `evicting` and wakes the requests waiting for it.
struct Evicted {
    cache: PrefixCache,
    done: Done,
}

impl Drop for Evicted {
    fn drop(&mut self) {
        self.cache
            .lock()
            .evicting
            .retain(|d| !Arc::ptr_eq(d, &self.done));
        signal_done(&self.done);
    }
}

/// A branch of the cache (no adapters) whose KV holds `prefix`.
fn holder_in(st: &State, prefix: &[Token]) -> Option<Branch> {
    let found = st.trie.longest_prefix(prefix)?;
    let holder = st.holders.get(&found.key)?;
    (found.len >= prefix.len() && holder.sentinel.is_none() && !holder.mixed)
        .then(|| holder.branch.clone())
}

/// The trie token of adapter set `key` among the registered `sets` (`State::sentinel`):
/// `Some(None)` for no adapter, None for a set never registered.
fn keyed_as(sets: &[AdapterKey], key: &AdapterKey) -> Option<Option<Token>> {
    if key.is_empty() {
        return Some(None);
    }
    sets.iter()
        .position(|k| k == key)
        .map(|i| Some(sentinel_of(i)))
}

/// The trie token of the `i`th registered adapter set: negative, never a vocabulary token.
fn sentinel_of(i: usize) -> Token {
    -(i as Token) - 1
}

/// `tokens` as the trie keys them: the adapter set's sentinel first, if any.
fn keyed(sentinel: Option<Token>, tokens: &[Token]) -> Vec<Token> {
    sentinel.into_iter().chain(tokens.iter().copied()).collect()
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Give `source` the recurrent-state checkpoint `branch` holds at the end of `prefix`, which
/// both hold: later prompts sharing that prefix with `source` fork there. Nothing when
/// either lacks it (the budget thinned it away, `source` was cut back meanwhile).
fn share_checkpoint(branch: &Branch, source: &Branch, prefix: &[Token]) {
    let at = prefix.len() as u32;
    let Some((pos, state)) = branch.cell().lock().checkpoint_at_or_before(at) else {
        return;
    };
    if pos != at {
        return;
    }
    let budget = source.context().shared().params.checkpoint_budget();
    let mut src = source.cell().lock();
    if src.history().starts_with(prefix) {
        src.keep_checkpoint(at, state, budget);
    }
}

/// A piece of work others may wait for ([`wait_done`]) until it is over ([`signal_done`]).
fn new_done() -> Done {
    Arc::new((Mutex::new(false), Condvar::new()))
}

/// The work of `done` is over: wake who waits for it.
fn signal_done(done: &(Mutex<bool>, Condvar)) {
    *done.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
    done.1.notify_all();
}

fn wait_done(done: &(Mutex<bool>, Condvar)) {
    let mut finished = done.0.lock().unwrap_or_else(|e| e.into_inner());
    while !*finished {
        finished = done.1.wait(finished).unwrap_or_else(|e| e.into_inner());
    }
}

/// [`wait_done`], looking every few milliseconds whether the waiting work was cancelled.
fn wait_done_unless_cancelled(done: &(Mutex<bool>, Condvar), relay: &Relay) -> Result<()> {
    let mut finished = done.0.lock().unwrap_or_else(|e| e.into_inner());
    while !*finished {
        relay.check()?;
        let tick = std::time::Duration::from_millis(10);
        (finished, _) = done
            .1
            .wait_timeout(finished, tick)
            .unwrap_or_else(|e| e.into_inner());
    }
    Ok(())
}

impl Branch {
    /// Fill this branch's empty sequence with the cells of `prefix`, the first tokens of a
    /// spilled entry (`prefix_spill::pack`: a `Branch::snapshot`, its KV cells and tokens
    /// checked against this model, then its recurrent-state checkpoints). How many it holds
    /// then: all; on a recurrent or hybrid model with the prefix inside the snapshot, up to its
    /// last checkpoint in the prefix, where the state is known (the caller prefills the rest);
    /// 0 when no checkpoint helps, the window's cells are missing, or this branch is not
    /// empty. An error for a snapshot of another model, cache layout or tokens, or a malformed
    /// entry. `parts` is what
    /// `unpack` found in `entry`; a snapshot spilled without its first cells (see
    /// `spill_snapshot`) gets them from `anchor`, and is refused (0) when it no longer holds
    /// them.
    pub(crate) fn restore_prefix(
        &self,
        entry: Arc<Vec<u8>>,
        parts: Unpacked,
        prefix: Vec<Token>,
        anchor: Option<Branch>,
    ) -> Pending<usize> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        let cell = self.cell().clone();
        let anchor = (parts.anchor, anchor.map(|b| b.cell().clone()));
        // It decodes nothing and changes only this branch's own sequence: a continuous
        // prefill runs it in passing (a conversation's next turn does not wait for the
        // prompts decoding meanwhile).
        let reads = anchor.1.iter().cloned().collect();
        self.context()
            .engine()
            .run_light(CancelPolicy::Drop, reads, vec![cell.clone()], move |w| {
                let snapshot = &entry[..parts.snapshot_len];
                w.restore_prefix(&cell, snapshot, &prefix, parts.checkpoints, anchor)
            })
    }

    /// The snapshot a spilled entry keeps (`prefix_spill`): with `anchor` (its first tokens,
    /// and a branch of the cache holding them), of its cells after those only, when the
    /// branch still holds them as the engine takes it. The bytes, and the tokens left out.
    pub(crate) fn spill_snapshot(
        &self,
        anchor: Option<(usize, Branch)>,
    ) -> Pending<(Vec<u8>, usize)> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        let cell = self.cell().clone();
        let (from, anchor) = match anchor {
            Some((from, b)) => (from, Some(b.cell().clone())),
            None => (0, None),
        };
        // It decodes nothing, changes only this entry's own sequence (its prefix taken out and
        // put back) and reads the anchor: a continuous prefill runs it in passing.
        let (reads, writes) = (anchor.iter().cloned().collect(), vec![cell.clone()]);
        self.context()
            .engine()
            .run_light(CancelPolicy::Drop, reads, writes, move |w| {
                w.spill_bytes(&cell, from, anchor.as_ref())
            })
    }

    /// Take over `source`'s first cells, those of `prefix`, into this branch's empty sequence
    /// (created at position 0, nothing decoded yet): a fork at a position inside `source`,
    /// which may be generating meanwhile. How many tokens of `prefix` it took: all of them,
    /// except on a recurrent or hybrid model, where a fork inside the source's sequence
    /// starts at its last recurrent-state checkpoint in the prefix (the caller prefills the
    /// rest). 0 when `source` was pruned or no longer holds `prefix`, or this branch is not
    /// empty; nothing happened then.
    pub fn share_prefix(&self, source: &Branch, prefix: &[Token]) -> Pending<usize> {
        if let Err(e) = self
            .check_live()
            .and_then(|()| source.check_on(self.context(), "source"))
        {
            return Pending::ready(Err(e));
        }
        let (source, target, prefix) =
            (source.cell().clone(), self.cell().clone(), prefix.to_vec());
        let (reads, writes) = (vec![source.clone()], vec![target.clone()]);
        self.context()
            .engine()
            .run_light(CancelPolicy::Drop, reads, writes, move |w| {
                w.share_prefix(&source, &target, &prefix)
            })
    }
}

impl State {
    /// Forget branches pruned behind the cache's back; bring the others' tokens up to date
    /// with what they decoded since (a live branch generating extends its prefix).
    fn refresh(&mut self) {
        let mut gone = Vec::new();
        for (&handle, holder) in self.holders.iter_mut() {
            if holder.mixed {
                continue;
            }
            let Ok((position, shareable)) = holder.shareable(&self.adapter_sets) else {
                gone.push(handle);
                continue;
            };
            if !shareable {
                // Decoded under other adapters since it was made: shared no more.
                holder.mixed = true;
                self.trie.remove(handle);
                continue;
            }
            // Unchanged since the last look (the common case): no copy of its history.
            if position == holder.tokens.len() as i32 {
                continue;
            }
            match holder.branch.history() {
                Ok(history) if history.starts_with(&holder.tokens) => {
                    if history.len() > holder.tokens.len() {
                        self.trie.extend(handle, &history[holder.tokens.len()..]);
                        holder.tokens = history;
                    }
                }
                Ok(history) => {
                    // Rewritten (reseeded): index what it holds now.
                    self.trie.remove(handle);
                    self.trie.insert(handle, &keyed(holder.sentinel, &history));
                    self.trie.set_evictable(handle, !holder.live);
                    holder.tokens = history;
                }
                Err(_) => gone.push(handle),
            }
        }
        for handle in gone {
            self.trie.remove(handle);
            self.holders.remove(&handle);
        }
    }

    /// The trie token of an adapter set (None for no adapter), registered on first use.
    fn sentinel(&mut self, key: &AdapterKey) -> Option<Token> {
        if let Some(known) = keyed_as(&self.adapter_sets, key) {
            return known;
        }
        self.adapter_sets.push(key.clone());
        Some(sentinel_of(self.adapter_sets.len() - 1))
    }

    /// KV cells only entries hold (what evicting them all would free; shared cells once).
    fn cached_tokens(&self) -> usize {
        self.trie.cached_tokens()
    }
}
