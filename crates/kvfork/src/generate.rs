//! Generation policy: when a stream of tokens over one branch stops, and how speculative
//! rounds are sized. The binding only adapts these (to Python's iterators); a Rust program
//! gets the same streams ([`Branch::generate`], [`Branch::generate_with`]).
//!
//! A [`TokenStream`] asks the engine for one step at a time (sample, then commit unless it is
//! a stop token), so many streams over different branches share decodes. Speculative
//! decoding ([`SpeculativeStream`]) decodes the last sampled token plus a drafter's guess in one
//! decode; [`SpeculativeSchedule`] holds its budget and the adaptive guess length (a
//! [`GuessPolicy`] fed with each round's outcome and time). At `n_ctx` a stream stops, or
//! shifts its context and goes on ([`OnContextFull`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use kvfork_core::GuessPolicy;

use crate::branch::Branch;
use crate::engine::Pending;
use crate::error::Result;
use crate::model::Token;
use crate::produced::Produced;

/// Why a stream of tokens ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The chain drew an end-of-generation token (sampled, not committed).
    StopToken,
    /// `max_tokens` tokens were yielded.
    MaxTokens,
    /// The branch reached the context's end (`reseed_context` makes room).
    ContextFull,
}

impl StopReason {
    /// The name Python sees: "stop_token", "max_tokens" or "context_full".
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::StopToken => "stop_token",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
        }
    }
}

/// What a stream does when its branch reaches the end of the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnContextFull {
    /// End the stream ([`StopReason::ContextFull`]).
    #[default]
    Stop,
    /// Shift the context and go on ([`Branch::shift_context`]): keep the first `keep` tokens
    /// of the branch's sequence and the most recent half of the rest.
    Shift {
        /// Tokens kept at the start (e.g. a system prompt); at most `n_ctx - 2`.
        keep: usize,
    },
}

impl OnContextFull {
    /// The tokens a shift keeps by default (llama.cpp keeps the first few, where attention
    /// sinks form).
    pub const DEFAULT_KEEP: usize = 4;

    /// From Python's names: "stop", or "shift" keeping `keep` tokens; `None` for another
    /// name.
    pub fn from_name(name: &str, keep: usize) -> Option<Self> {
        match name {
            "stop" => Some(OnContextFull::Stop),
            "shift" => Some(OnContextFull::Shift { keep }),
            _ => None,
        }
    }

    /// Check that a shift leaves room in `branch`'s context (`keep` at most `n_ctx - 2`).
    pub fn check(self, branch: &Branch) -> Result<()> {
        match self {
            OnContextFull::Stop => Ok(()),
            OnContextFull::Shift { keep } => crate::branch::check_keep(branch.context(), keep),
        }
    }
}

/// Tokens left before the context is full (an error for a pruned branch).
fn room(branch: &Branch) -> Result<usize> {
    let n_ctx = branch.context().n_ctx() as usize;
    Ok(n_ctx.saturating_sub(branch.position()?.max(0) as usize))
}

/// Plain generation over one branch: commit-before-yield, ending at a stop token (not
/// committed), after `max_tokens`, or when the context is full. Shared by reference between
/// the steps of one iteration (the first stop reason set wins); steps asked for at once (two
/// consumers of one stream) each take one of the `max_tokens`, so no more are committed.
pub struct TokenStream {
    branch: Branch,
    max_tokens: Option<usize>,
    on_full: OnContextFull,
    /// Steps queued: each may commit a token (one whose await is cancelled before it runs
    /// still counts, so the stream may end a token early after a cancellation).
    queued: AtomicUsize,
    produced: AtomicUsize,
    shifts: AtomicUsize,
    stop: OnceLock<StopReason>,
}

impl TokenStream {
    /// A stream over `branch`, at most `max_tokens` tokens (None: until a stop token or the
    /// end of the context).
    pub fn new(branch: Branch, max_tokens: Option<usize>) -> Self {
        TokenStream {
            branch,
            max_tokens,
            on_full: OnContextFull::Stop,
            queued: AtomicUsize::new(0),
            produced: AtomicUsize::new(0),
            shifts: AtomicUsize::new(0),
            stop: OnceLock::new(),
        }
    }

    /// What the stream does at the end of the context (the default: stop). An error when a
    /// shift's `keep` leaves no room.
    pub fn on_context_full(mut self, on_full: OnContextFull) -> Result<Self> {
        on_full.check(&self.branch)?;
        self.on_full = on_full;
        Ok(self)
    }

    /// Context shifts so far.
    pub fn shifts(&self) -> usize {
        self.shifts.load(Ordering::Relaxed)
    }

    /// Queue the next step on the engine, or `None` when the stream is over.
    pub fn next_step(&self) -> Option<Pending<Produced>> {
        if self.stop.get().is_some() {
            return None;
        }
        if let Some(max) = self.max_tokens {
            let take = |queued: usize| (queued < max).then_some(queued + 1);
            if self
                .queued
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, take)
                .is_err()
            {
                // Every token is taken; the reason is known once the last step is recorded
                // (it may still draw a stop token).
                if self.produced.load(Ordering::Acquire) >= max {
                    self.finish(StopReason::MaxTokens);
                }
                return None;
            }
        }
        match (room(&self.branch), self.on_full) {
            (Err(e), _) => Some(Pending::ready(Err(e))), // pruned: the step says so
            (Ok(0), OnContextFull::Stop) => {
                self.finish(StopReason::ContextFull);
                None
            }
            (Ok(0), OnContextFull::Shift { keep }) => {
                self.shifts.fetch_add(1, Ordering::Relaxed);
                Some(self.branch.shift_then_step(keep))
            }
            (Ok(_), _) => Some(self.branch.step()),
        }
    }

    /// The token a finished step yields, or `None` at a stop token (the stream is over).
    pub fn record(&self, produced: Produced) -> Option<Produced> {
        if produced.is_stop {
            self.finish(StopReason::StopToken);
            return None;
        }
        self.produced.fetch_add(1, Ordering::AcqRel);
        Some(produced)
    }

    /// Why the stream ended; `None` while it runs.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop.get().copied()
    }

    fn finish(&self, reason: StopReason) {
        let _ = self.stop.set(reason);
    }
}

/// Blocking iteration: each item waits for its step.
impl Iterator for TokenStream {
    type Item = Result<Produced>;

    fn next(&mut self) -> Option<Result<Produced>> {
        let step = self.next_step()?;
        match step.wait() {
            Ok(p) => self.record(p).map(Ok),
            Err(e) => Some(Err(e)),
        }
    }
}

/// Guesses the tokens after a history, for speculative decoding.
pub trait Drafter {
    /// Guessed tokens to follow `tokens` (the branch's history, ending with the token about to
    /// be decoded); empty for no guess this round. Any length: the stream cuts what does not
    /// fit.
    fn propose(&mut self, tokens: &[Token]) -> Vec<Token>;
}

/// The budget and guess length of speculative rounds, and what the guesses earned. Each
/// round's guess length (0: no guess) comes from a [`GuessPolicy`], told every round's
/// outcome and the time of its decode (from [`guess_len`](Self::guess_len), or
/// [`proposed`](Self::proposed) when the drafter was asked, to [`took`](Self::took)).
///
/// A round asks the drafter when it guesses, and also when it does not but
/// [`shadowing`](Self::shadowing) says so: the guess's next token is then checked against the
/// token the chain draws (free evidence of the acceptance, see [`GuessPolicy::shadow`]).
#[derive(Debug, Clone)]
pub struct SpeculativeSchedule {
    max_tokens: Option<usize>,
    on_full: OnContextFull,
    yielded: usize,
    stop: Option<StopReason>,
    policy: GuessPolicy,
    round_started: Option<Instant>,
    /// Guessed tokens not decoded, still to check against the tokens drawn, one a round (a
    /// shadow guess, or the rest of a guess the chain kept whole).
    shadow: VecDeque<Token>,
    rounds: usize,
    drafted: usize,
    accepted: usize,
    shifts: usize,
}

impl SpeculativeSchedule {
    /// A schedule for at most `max_tokens` tokens (None: no limit).
    pub fn new(max_tokens: Option<usize>) -> Self {
        let mut policy = GuessPolicy::new();
        policy.offer_shadow();
        SpeculativeSchedule {
            max_tokens,
            on_full: OnContextFull::Stop,
            yielded: 0,
            stop: None,
            policy,
            round_started: None,
            shadow: VecDeque::new(),
            rounds: 0,
            drafted: 0,
            accepted: 0,
            shifts: 0,
        }
    }

    /// What the stream does at the end of the context (the default: stop). Check it with
    /// [`OnContextFull::check`] against the branch first.
    pub fn on_context_full(mut self, on_full: OnContextFull) -> Self {
        self.on_full = on_full;
        self
    }

    /// Count one token handed to the caller.
    pub fn yielded_one(&mut self) {
        self.yielded += 1;
    }

    /// Whether the stream is over before another round (setting the stop reason).
    pub fn ended(&mut self) -> bool {
        if self.stop.is_none() && self.max_tokens.is_some_and(|m| self.yielded >= m) {
            self.stop = Some(StopReason::MaxTokens);
        }
        self.stop.is_some()
    }

    /// Before a round: the `keep` of a context shift the stream must make first (`branch` is
    /// at `n_ctx` and the stream shifts; counted in [`shifts`](Self::shifts)), else `None`.
    pub fn shift_due(&mut self, branch: &Branch) -> Option<usize> {
        match self.on_full {
            OnContextFull::Shift { keep } if matches!(room(branch), Ok(0)) => {
                self.shifts += 1;
                Some(keep)
            }
            _ => None,
        }
    }

    /// How many guessed tokens this round may decode after `pending` on `branch` (0: decode
    /// it alone), or `None` when the stream ends at `pending` (a stop token, or no room left
    /// in the context).
    pub fn guess_len(&mut self, branch: &Branch, pending: &Produced) -> Option<usize> {
        if pending.is_stop {
            self.stop = Some(StopReason::StopToken);
            return None;
        }
        // A pruned branch: no guess; the round's own call reports it.
        let room = room(branch).unwrap_or(1);
        if room == 0 {
            self.stop = Some(StopReason::ContextFull);
            return None;
        }
        let left = self
            .max_tokens
            .map_or(room, |m| room.min(m.saturating_sub(self.yielded)));
        self.round_started = Some(Instant::now());
        Some(self.policy.guess_len(left.saturating_sub(1)))
    }

    /// Whether this round asks the drafter even when [`guess_len`](Self::guess_len) gave 0:
    /// its guess is checked against the tokens drawn next, not decoded (see
    /// [`GuessPolicy::shadowing`]); not while an earlier shadow guess is still being checked.
    pub fn shadowing(&self) -> bool {
        self.shadow.is_empty() && self.policy.shadowing()
    }

    /// The drafter guessed `guess` for a round of `len` guessed tokens (from
    /// [`guess_len`](Self::guess_len)): records the drafter's time, keeps the tokens after
    /// the draft for shadow checks, and starts timing the decode (its time, not the
    /// drafter's, is what a width costs). Returns the draft: `guess` cut to `len`.
    pub fn proposed(&mut self, mut guess: Vec<Token>, len: usize) -> Vec<Token> {
        if let Some(t) = self.round_started {
            self.policy.drafter_took(t.elapsed().as_secs_f64());
        }
        if len > 0 || self.shadow.is_empty() {
            self.shadow.clear();
            let rest = guess.get(len..).unwrap_or_default();
            self.shadow
                .extend(rest.iter().take(kvfork_core::speculation::MAX_GUESS));
        }
        guess.truncate(len);
        self.round_started = Some(Instant::now());
        guess
    }

    /// Record a round: `drafted` guessed tokens decoded, `accepted` of them kept, `next` the
    /// token the chain drew after them (checked against the shadow guess, if any).
    pub fn took(&mut self, drafted: usize, accepted: usize, next: Token) {
        // Counts from the caller: never more kept than decoded.
        let accepted = accepted.min(drafted);
        let seconds = self
            .round_started
            .take()
            .map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
        self.policy.record(drafted, accepted, seconds);
        if accepted < drafted {
            self.shadow.clear(); // the guess after a refused one guesses nothing drawn
        }
        if let Some(guessed) = self.shadow.pop_front() {
            let kept = guessed == next;
            self.policy.shadow(kept);
            if !kept {
                self.shadow.clear();
            }
        }
        self.rounds += 1;
        self.drafted = self.drafted.saturating_add(drafted);
        self.accepted = self.accepted.saturating_add(accepted);
    }

    /// The guess-length policy, with what it measured.
    pub fn policy(&self) -> &GuessPolicy {
        &self.policy
    }

    /// Context shifts so far.
    pub fn shifts(&self) -> usize {
        self.shifts
    }

    /// Why the stream ended; `None` while it runs.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// Rounds run (decodes of a pending token plus its guess).
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    /// Guessed tokens decoded over all rounds.
    pub fn drafted(&self) -> usize {
        self.drafted
    }

    /// Guessed tokens the chain drew too.
    pub fn accepted(&self) -> usize {
        self.accepted
    }

    /// Share of guessed tokens the chain drew too (0 before any guess).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Exact speculative decoding over one branch (blocking): the tokens plain generation draws,
/// up to the rounding of a batched decode, with fewer decodes where the drafter guesses well.
/// At the end the sampler has drawn one token past the last yielded (not committed).
pub struct SpeculativeStream<D: Drafter> {
    branch: Branch,
    drafter: D,
    schedule: SpeculativeSchedule,
    queue: VecDeque<Produced>,
    pending: Option<Produced>,
}

impl<D: Drafter> SpeculativeStream<D> {
    /// A stream over `branch` guessed by `drafter`, at most `max_tokens` tokens.
    pub fn new(branch: Branch, max_tokens: Option<usize>, drafter: D) -> Self {
        SpeculativeStream {
            branch,
            drafter,
            schedule: SpeculativeSchedule::new(max_tokens),
            queue: VecDeque::new(),
            pending: None,
        }
    }

    /// What the stream does at the end of the context (the default: stop). An error when a
    /// shift's `keep` leaves no room.
    pub fn on_context_full(mut self, on_full: OnContextFull) -> Result<Self> {
        on_full.check(&self.branch)?;
        self.schedule = self.schedule.on_context_full(on_full);
        Ok(self)
    }

    /// Its rounds, guesses and stop reason so far.
    pub fn schedule(&self) -> &SpeculativeSchedule {
        &self.schedule
    }

    fn round(&mut self) -> Result<bool> {
        if let Some(keep) = self.schedule.shift_due(&self.branch) {
            self.branch.shift_context(keep).wait()?;
            // A token drawn from the logits before the shift: drawn again from the shifted
            // context's.
            self.pending = None;
        }
        let pending = match self.pending.take() {
            Some(p) => p,
            None => self.branch.produce().wait()?,
        };
        let Some(len) = self.schedule.guess_len(&self.branch, &pending) else {
            return Ok(false);
        };
        let mut guess = Vec::new();
        if len > 0 || self.schedule.shadowing() {
            let mut history = self.branch.history()?;
            history.push(pending.token);
            let proposed = self.drafter.propose(&history);
            guess = self.schedule.proposed(proposed, len);
        }
        let drafted = guess.len();
        let done = self.branch.speculate(pending.token, guess).wait()?;
        self.schedule
            .took(drafted, done.accepted.len(), done.next.token);
        self.queue.push_back(pending);
        self.queue.extend(done.accepted);
        self.pending = Some(done.next);
        Ok(true)
    }
}

impl<D: Drafter> Iterator for SpeculativeStream<D> {
    type Item = Result<Produced>;

    fn next(&mut self) -> Option<Result<Produced>> {
        if self.queue.is_empty() {
            if self.schedule.ended() {
                return None;
            }
            match self.round() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
        let token = self.queue.pop_front()?;
        self.schedule.yielded_one();
        Some(Ok(token))
    }
}

impl Branch {
    /// Plain generation: at most `max_tokens` tokens (see [`TokenStream`]).
    pub fn generate(&self, max_tokens: Option<usize>) -> TokenStream {
        TokenStream::new(self.clone(), max_tokens)
    }

    /// Exact speculative generation guessed by `drafter` (see [`SpeculativeStream`]).
    pub fn generate_with<D: Drafter>(
        &self,
        max_tokens: Option<usize>,
        drafter: D,
    ) -> SpeculativeStream<D> {
        SpeculativeStream::new(self.clone(), max_tokens, drafter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reasons_have_the_python_names() {
        assert_eq!(StopReason::StopToken.as_str(), "stop_token");
        assert_eq!(StopReason::MaxTokens.as_str(), "max_tokens");
        assert_eq!(StopReason::ContextFull.as_str(), "context_full");
    }

    #[test]
    fn the_schedule_counts_rounds_and_feeds_the_policy() {
        let mut s = SpeculativeSchedule::new(None);
        s.took(8, 3, 1);
        s.took(0, 0, 1);
        assert_eq!((s.rounds(), s.drafted(), s.accepted()), (2, 8, 3));
        assert!(s.acceptance() > 0.0 && s.acceptance() < 1.0);
        assert!(
            (s.policy().acceptance() - 0.5).abs() > 0.1,
            "the policy saw the guess"
        );
    }

    #[test]
    fn a_shadow_guess_is_checked_token_by_token_up_to_the_first_refused() {
        let mut s = SpeculativeSchedule::new(None);
        assert!(s.shadowing(), "offered, the drafter not timed yet");
        assert_eq!(s.proposed(vec![5, 6, 7], 0), Vec::<Token>::new());
        assert!(!s.shadowing(), "its guess is being checked");
        let p0 = s.policy().acceptance();
        s.took(0, 0, 5);
        let p1 = s.policy().acceptance();
        assert!(p1 > p0, "5 was drawn");
        // A new guess while one is checked changes nothing.
        assert!(s.proposed(vec![1, 1], 0).is_empty());
        s.took(0, 0, 9);
        assert!(s.policy().acceptance() < p1, "6 was not");
        assert!(s.shadowing(), "the rest (7) is dropped");
        let mut other = s.clone();
        s.took(0, 0, 7);
        other.took(0, 0, 9);
        assert_eq!(
            s.policy().acceptance(),
            other.policy().acceptance(),
            "nothing left to check"
        );
        // A decoded guess the chain refused leaves nothing to check; one it kept whole
        // checks the drafter's next token.
        assert_eq!(s.proposed(vec![3, 4, 8], 2), vec![3, 4]);
        s.took(2, 1, 2);
        assert!(s.shadowing());
        assert_eq!(s.proposed(vec![3, 4, 8], 2), vec![3, 4]);
        let mut other = s.clone();
        s.took(2, 2, 8);
        other.took(2, 2, 9);
        assert!(
            s.policy().acceptance() > other.policy().acceptance(),
            "8 was checked"
        );
        assert!(s.shadowing());
        assert_eq!((s.rounds(), s.drafted(), s.accepted()), (5, 4, 3));
    }

    #[test]
    fn on_context_full_names() {
        assert_eq!(
            OnContextFull::from_name("shift", 7),
            Some(OnContextFull::Shift { keep: 7 })
        );
        assert_eq!(
            OnContextFull::from_name("stop", 7),
            Some(OnContextFull::Stop)
        );
        assert_eq!(OnContextFull::from_name("wrap", 7), None);
    }

    #[test]
    fn max_tokens_ends_the_schedule() {
        let mut s = SpeculativeSchedule::new(Some(2));
        assert!(!s.ended());
        s.yielded_one();
        s.yielded_one();
        assert!(s.ended());
        assert_eq!(s.stop_reason(), Some(StopReason::MaxTokens));
    }
}
