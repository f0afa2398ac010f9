//! How long a speculative round's guess should be, and whether to guess at all, learned from
//! the rounds themselves.
//!
//! A round decodes the pending token plus `k` guessed tokens in one decode; the chain keeps
//! the guess while it agrees. With a per-position acceptance `p` (the chance that the chain
//! draws the next guessed token, given it drew the ones before), a round yields on average
//! `1 + p + p² + … + pᵏ` tokens. It costs what a decode of `1 + k` rows costs, which depends
//! on the hardware: on a GPU a few more rows are almost free, on a CPU each row adds a good
//! share of a one-token decode. So both are measured: `p` from the guesses the chain kept
//! or refused (a decayed count, so a stream that starts copying its input is noticed), and
//! the cost of each width from the rounds' own times. The guess length is the `k` that
//! yields the most tokens per second; `k = 0` (decode the pending token alone) when no
//! guess pays.
//!
//! While it does not pay, the policy *rests*, and now and then *probes* with a short guess:
//! the acceptance may have changed (the output started quoting its input). A probe that
//! does not win doubles the rest; one that does ends it.
//!
//! A stream whose drafter is cheap (a lookup in the history: microseconds against a decode's
//! milliseconds) *shadows* instead: it asks for a guess even when it decodes none, and
//! checks the guess against the tokens the chain then draws, one a round, up to the first
//! that differs ([`GuessPolicy::shadow`]; a dearer drafter, above [`SHADOW_SHARE`] of a
//! one-token round, is not asked). That measures the acceptance for free, so a shadowing policy
//! never guesses before it has timed a one-token round, guesses wider than it has timed
//! (assumed cheap, to be measured) only once the acceptance reaches [`EXPLORE_ACCEPTANCE`],
//! and probes only from that acceptance on, to time again its widest guess (one round that
//! waited for a busy core can make it look too dear), until it has a few times of it: on
//! text the drafter does not predict it decodes one token a round, as plain generation
//! does.

/// Longest guess a round decodes.
pub const MAX_GUESS: usize = 64;

/// Weight of a new round in the acceptance counts (older rounds fade by `1 - DECAY`):
/// about the last 8 rounds matter.
const DECAY: f64 = 0.125;
/// Rounds without a guess fade the acceptance counts too, more slowly: after a long rest a
/// probe's outcome outweighs what was measured before it.
const REST_DECAY: f64 = 0.02;
/// Times kept per width; its cost is their median (a round that waited for a busy core
/// now and then does not make a width look dear, or one-token rounds look cheap to beat).
const TIMES_KEPT: usize = 8;
/// A guess must promise this many more tokens per second than no guess (timing noise).
const GAIN_MARGIN: f64 = 1.05;
/// Guess length of a probe.
const PROBE_GUESS: usize = 2;
/// A shadowing policy probes (times again) its widest guess until it has this many times
/// of it: then their median is not one round that waited for a busy core.
const RETIMED: usize = 3;
/// Rounds of rest before the first probe; doubles after each probe that changes nothing.
const FIRST_REST: u32 = 8;
const MAX_REST: u32 = 256;
/// Rounds that guess before a one-token decode is timed (with no timed one-token decode,
/// guessing cannot be compared with not guessing).
const UNTIMED_GUESSES: u32 = 2;
/// Longest first guess (a guess wider than any timed one at most doubles the widest).
pub const FIRST_GUESS: usize = 8;
/// A shadowing policy guesses wider than it has timed only from this acceptance on (such a
/// guess is costed as free until timed; refused on a CPU, it costs a few tokens' time).
pub const EXPLORE_ACCEPTANCE: f64 = 0.9;
/// Shadow checks are asked of a drafter that costs at most this share of a one-token round
/// (each round pays it).
pub const SHADOW_SHARE: f64 = 0.02;

/// The guess-length controller of one speculative stream. Pure: the caller times the rounds
/// and reports them with [`GuessPolicy::record`].
#[derive(Debug, Clone)]
pub struct GuessPolicy {
    /// Decayed counts of guessed tokens kept and of refusals (the geometric model's successes
    /// and failures).
    kept: f64,
    refused: f64,
    /// The last seconds of a round by width (`times[w]`: a decode of `w` rows).
    times: Vec<Recent>,
    /// Guessing rounds in a row without a timed one-token round.
    guesses_untimed: u32,
    /// Guessing does not pay: rounds left before the next probe, and the rest after it.
    resting: bool,
    rest_left: u32,
    rest: u32,
    /// The stream checks guesses it does not decode ([`GuessPolicy::offer_shadow`]), and
    /// its drafter's decayed mean seconds.
    shadow_offered: bool,
    drafter: Option<f64>,
}

impl Default for GuessPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl GuessPolicy {
    /// A policy with no measurements: it guesses in full until it knows better (an even
    /// prior on acceptance).
    pub fn new() -> Self {
        GuessPolicy {
            kept: 1.0,
            refused: 1.0,
            times: vec![Recent::default(); MAX_GUESS + 2],
            guesses_untimed: 0,
            resting: false,
            rest_left: 0,
            rest: FIRST_REST,
            shadow_offered: false,
            drafter: None,
        }
    }

    /// The stream offers shadow checks: it will ask its drafter for a guess even when it
    /// decodes none, and report each guessed token it did not decode, checked against the
    /// token drawn there, with [`shadow`](Self::shadow), as long as
    /// [`shadowing`](Self::shadowing) says so.
    pub fn offer_shadow(&mut self) {
        self.shadow_offered = true;
    }

    /// Record what the drafter took to guess, in seconds (not finite or negative: ignored).
    /// A drafter dearer than [`SHADOW_SHARE`] of a one-token round is not asked for shadow
    /// guesses: the policy probes instead.
    pub fn drafter_took(&mut self, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.drafter = Some(self.drafter.map_or(seconds, |d| 0.75 * d + 0.25 * seconds));
        }
    }

    /// Whether the stream should ask its drafter even for no guess, and check the guess
    /// (shadow checks were offered and the drafter is cheap, or not timed yet). A shadowing
    /// policy never guesses blind, and probes only where the guesses would be kept.
    pub fn shadowing(&self) -> bool {
        self.shadow_offered
            && match (self.drafter, self.cost(1)) {
                (Some(d), Some(one)) => d <= SHADOW_SHARE * one,
                _ => true,
            }
    }

    /// A guessed token that was not decoded, checked against the token the chain drew there:
    /// one trial of the acceptance, as if it had been decoded (no time: nothing was).
    pub fn shadow(&mut self, kept: bool) {
        let (kept, refused) = if kept { (1.0, 0.0) } else { (0.0, 1.0) };
        self.trial(kept, refused);
    }

    /// One guess's evidence: old evidence fades by the same factor per round whatever its
    /// size.
    fn trial(&mut self, kept: f64, refused: f64) {
        self.kept = self.kept * (1.0 - DECAY) + kept;
        self.refused = self.refused * (1.0 - DECAY) + refused;
    }

    /// Estimated per-position acceptance (a faint even prior keeps it defined when all the
    /// evidence has faded).
    pub fn acceptance(&self) -> f64 {
        (self.kept + 0.05) / (self.kept + self.refused + 0.1)
    }

    /// Mean tokens a round with a `k`-token guess yields, at acceptance `p`.
    pub fn expected_tokens(p: f64, k: usize) -> f64 {
        (0..=k).map(|i| p.powi(i as i32)).sum()
    }

    /// The measured or estimated seconds of a decode of `width` rows; `None` before any
    /// one-token round was timed. Between two timed widths the cost is interpolated; past
    /// the widest it grows along the line from one row to the widest (decodes get cheaper
    /// per row as they widen, so this errs on the dear side).
    pub fn cost(&self, width: usize) -> Option<f64> {
        let timed = |w: usize| self.times[w].median();
        let last = self.times.len() - 1;
        let width = width.clamp(1, last);
        let one = timed(1)?;
        if let Some(c) = timed(width) {
            return Some(c);
        }
        let below = (1..width).rev().find(|&w| timed(w).is_some()).unwrap_or(1);
        let (lo, hi) = match (width + 1..=last).find(|&w| timed(w).is_some()) {
            Some(hi) => (below, hi),
            None => match self.widest() {
                Some(w) => (1, w),
                // No wider decode timed yet: assume a wider one is free, so that the first
                // guesses are tried and timed.
                None => return Some(one),
            },
        };
        let (c_lo, c_hi) = (timed(lo)?, timed(hi)?);
        let slope = ((c_hi - c_lo) / (hi - lo) as f64).max(0.0);
        Some(c_lo + slope * (width - lo) as f64)
    }

    /// The widest decode timed (more than one row).
    fn widest(&self) -> Option<usize> {
        (2..self.times.len())
            .rev()
            .find(|&w| self.times[w].median().is_some())
    }

    /// The guess length that yields the most tokens per second, at most `cap`, and the
    /// gain over no guess (tokens per second relative to a one-token round); `None` while
    /// a one-token round has not been timed. A shadowing policy below
    /// [`EXPLORE_ACCEPTANCE`] considers only the widths up to the widest it has timed.
    pub fn best(&self, cap: usize) -> Option<(usize, f64)> {
        let one = self.cost(1)?;
        let p = self.acceptance();
        let mut cap = cap.min(MAX_GUESS);
        if p < EXPLORE_ACCEPTANCE && self.shadowing() {
            cap = cap.min(self.widest().map_or(0, |w| w - 1));
        }
        let mut best = (0, 1.0);
        for k in 1..=cap {
            let rate = Self::expected_tokens(p, k) / self.cost(k + 1)? * one;
            if rate > best.1 {
                best = (k, rate);
            }
        }
        Some(best)
    }

    /// How many tokens to guess this round, at most `cap` (what the budget, the context and
    /// the stream's own limit allow). 0: decode the pending token alone.
    pub fn guess_len(&mut self, cap: usize) -> usize {
        // Wider than ever timed: at most double the widest guess so far, so that a dear
        // machine pays for one long refused guess at most.
        let explore = self
            .widest()
            .map_or(FIRST_GUESS, |w| (2 * (w - 1)).max(FIRST_GUESS));
        let cap = cap.min(MAX_GUESS).min(explore);
        if cap == 0 {
            return 0;
        }
        let Some((k, gain)) = self.best(cap) else {
            // Nothing to compare with yet: guess (unless shadow checks will tell whether to),
            // but time a one-token round soon (it yields a token at plain generation's cost:
            // it loses nothing).
            if self.shadowing() || self.guesses_untimed >= UNTIMED_GUESSES {
                return 0;
            }
            return cap;
        };
        if k > 0 && gain >= GAIN_MARGIN {
            self.resting = false;
            self.rest = FIRST_REST;
            return k;
        }
        if !self.resting {
            self.resting = true;
            self.rest_left = self.rest;
        }
        // Shadow checks follow the acceptance without probing, unless they say the guesses
        // would be kept: then it is a width's cost that says no (one round that waited for a
        // busy core can make it look dear), so it is timed again now and then.
        let probe = if self.shadowing() {
            match self.widest() {
                Some(w)
                    if self.acceptance() >= EXPLORE_ACCEPTANCE && self.times[w].len < RETIMED =>
                {
                    (w - 1).min(cap)
                }
                _ => return 0,
            }
        } else {
            PROBE_GUESS.min(cap)
        };
        if self.rest_left > 0 {
            self.rest_left -= 1;
            return 0;
        }
        // Rested long enough: probe, and rest longer if the probe changes nothing.
        self.rest = (self.rest * 2).min(MAX_REST);
        self.rest_left = self.rest;
        probe
    }

    /// Whether the policy found that guessing does not pay (it only probes now and then).
    pub fn resting(&self) -> bool {
        self.resting
    }

    /// Record a round: `guessed` tokens decoded after the pending one, `kept` of them kept
    /// by the chain, in `seconds` (the round's whole cost; not finite or not positive: the
    /// time is ignored).
    pub fn record(&mut self, guessed: usize, kept: usize, seconds: f64) {
        let guessed = guessed.min(MAX_GUESS);
        let kept = kept.min(guessed);
        if guessed > 0 {
            let refused = if kept < guessed { 1.0 } else { 0.0 };
            self.trial(kept as f64, refused);
            self.guesses_untimed += 1;
        } else {
            self.kept *= 1.0 - REST_DECAY;
            self.refused *= 1.0 - REST_DECAY;
            self.guesses_untimed = 0;
        }
        if seconds.is_finite() && seconds > 0.0 {
            self.times[guessed + 1].push(seconds);
        }
    }
}

/// The last [`TIMES_KEPT`] times of one width.
#[derive(Debug, Clone, Default)]
struct Recent {
    times: [f64; TIMES_KEPT],
    len: usize,
    next: usize,
}

impl Recent {
    fn push(&mut self, seconds: f64) {
        self.times[self.next] = seconds;
        self.next = (self.next + 1) % TIMES_KEPT;
        self.len = (self.len + 1).min(TIMES_KEPT);
    }

    /// The median (the lower one of an even count: the dearer rounds waited on others).
    fn median(&self) -> Option<f64> {
        if self.len == 0 {
            return None;
        }
        let mut times = self.times;
        let times = &mut times[..self.len];
        times.sort_by(f64::total_cmp);
        Some(times[(self.len - 1) / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Seconds of a decode of `w` rows on a machine where one row costs 1 and each more row
    /// costs `per_row`.
    /// A guessed token kept with probability `keep_pct` %, drawn by a xorshift from `seed`.
    fn coin(seed: u64, keep_pct: u32) -> impl FnMut() -> bool {
        let mut state = seed | 1;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 100) < u64::from(keep_pct)
        }
    }

    fn linear(per_row: f64) -> impl Fn(usize) -> f64 {
        move |w| 1.0 + per_row * (w - 1) as f64
    }

    /// Run `rounds` rounds where the chain keeps each guessed token with `keep(i)` (i: the
    /// guessed token's place in the round); returns the tokens and the seconds.
    fn simulate(
        policy: &mut GuessPolicy,
        rounds: usize,
        cap: usize,
        cost: impl Fn(usize) -> f64,
        mut keeps: impl FnMut() -> bool,
    ) -> (f64, f64) {
        let (mut tokens, mut seconds) = (0.0, 0.0);
        for _ in 0..rounds {
            let k = policy.guess_len(cap);
            let kept = (0..k).take_while(|_| keeps()).count();
            let t = cost(k + 1);
            policy.record(k, kept, t);
            tokens += 1.0 + kept as f64;
            seconds += t;
        }
        (tokens, seconds)
    }

    /// `simulate` for a shadowing stream: a round that decodes no guess (or keeps all of
    /// it) checks the drafter's next guessed token against the next drawn one. Returns the
    /// tokens, the seconds and the guessed tokens decoded.
    fn simulate_shadowed(
        policy: &mut GuessPolicy,
        rounds: usize,
        cap: usize,
        cost: impl Fn(usize) -> f64,
        mut keeps: impl FnMut() -> bool,
    ) -> (f64, f64, usize) {
        policy.offer_shadow();
        let (mut tokens, mut seconds, mut decoded) = (0.0, 0.0, 0);
        for _ in 0..rounds {
            let k = policy.guess_len(cap);
            let asks = k > 0 || policy.shadowing();
            let kept = (0..k).take_while(|_| keeps()).count();
            let t = cost(k + 1);
            policy.drafter_took(t / 1000.0);
            policy.record(k, kept, t);
            if asks && kept == k {
                policy.shadow(keeps());
            }
            tokens += 1.0 + kept as f64;
            seconds += t;
            decoded += k;
        }
        (tokens, seconds, decoded)
    }

    /// Seconds of a decode of `w` rows on the 2-core CPU of the benchmarks (Gemma 3 270M:
    /// its 262,144-token output layer makes every row dear; 9 rows cost about 4.5 one-row
    /// decodes).
    fn cpu(w: usize) -> f64 {
        [0.0, 1.0, 1.7, 1.9, 2.6, 3.4, 3.7, 4.0, 4.3, 4.5][w.min(9)]
            + 0.4 * w.saturating_sub(9) as f64
    }

    #[test]
    fn a_shadowing_policy_never_guesses_on_text_the_drafter_does_not_predict() {
        for keep_pct in [0u64, 20, 35, 50, 65, 75] {
            let mut p = GuessPolicy::new();
            let mut state = 7u64;
            let (tokens, seconds, decoded) = simulate_shadowed(&mut p, 300, 8, cpu, || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) % 100 < keep_pct
            });
            if keep_pct < 50 {
                assert_eq!(decoded, 0, "{keep_pct} %: no guess decoded");
                assert_eq!(tokens / seconds, 1.0);
            } else {
                // A streak of kept shadow guesses may tempt one exploring guess.
                assert!(
                    tokens / seconds > 0.97,
                    "{keep_pct} %: {}",
                    tokens / seconds
                );
            }
        }
    }

    #[test]
    fn a_shadowing_policy_guesses_in_full_once_its_shadow_guesses_are_kept() {
        let mut p = GuessPolicy::new();
        p.offer_shadow();
        assert_eq!(p.guess_len(8), 0, "no blind first guess");
        p.record(0, 0, 1.0);
        // Six shadow guesses kept in a row: the acceptance reaches the explore threshold.
        for _ in 0..5 {
            p.shadow(true);
            assert!(p.acceptance() < EXPLORE_ACCEPTANCE);
            assert_eq!(p.guess_len(8), 0);
            p.record(0, 0, 1.0);
        }
        p.shadow(true);
        assert_eq!(p.guess_len(8), 8, "explores at {}", p.acceptance());
        let (tokens, seconds, _) = simulate_shadowed(&mut p, 60, 8, cpu, || true);
        assert!(tokens / seconds > 1.8, "{}", tokens / seconds);
    }

    #[test]
    fn a_width_timed_too_dear_once_is_timed_again_while_guesses_would_be_kept() {
        let mut p = GuessPolicy::new();
        p.offer_shadow();
        p.record(0, 0, 1.0);
        p.record(8, 8, 20.0); // a 9-row round that waited for a busy core
        for _ in 0..8 {
            p.shadow(true);
        }
        assert_eq!(
            p.guess_len(8),
            0,
            "9 tokens in 20 one-token times do not pay"
        );
        let guesses: Vec<usize> = (0..FIRST_REST as usize + 1)
            .map(|_| {
                let k = p.guess_len(8);
                p.record(k, k, if k > 0 { 4.5 } else { 1.0 });
                p.shadow(true);
                k
            })
            .collect();
        // A probe after the rest, then (its time the median now) guesses that pay.
        assert_eq!(guesses, [0, 0, 0, 0, 0, 0, 0, 8, 8]);
        // Refused shadow guesses: no probe, whatever the rest.
        let mut q = GuessPolicy::new();
        q.offer_shadow();
        q.record(0, 0, 1.0);
        q.record(8, 8, 20.0);
        for _ in 0..1000 {
            q.shadow(false);
            assert_eq!(q.guess_len(8), 0);
            q.record(0, 0, 1.0);
        }
    }

    #[test]
    fn a_dear_drafter_is_not_asked_for_shadow_guesses() {
        let mut p = GuessPolicy::new();
        assert!(!p.shadowing(), "not offered");
        p.offer_shadow();
        assert!(p.shadowing(), "the drafter's cost is not known yet");
        p.record(0, 0, 1.0);
        p.drafter_took(0.001);
        assert!(p.shadowing());
        for _ in 0..20 {
            p.drafter_took(0.5);
        }
        assert!(!p.shadowing(), "half a round per guess");
        p.drafter_took(f64::NAN);
        assert!(!p.shadowing());
    }

    #[test]
    fn a_policy_whose_drafter_is_dear_probes_again() {
        let mut p = GuessPolicy::new();
        p.offer_shadow();
        p.record(0, 0, 1.0);
        for _ in 0..20 {
            p.drafter_took(0.5);
        }
        // Guesses refused: it rests, then probes without shadow checks.
        let mut n = 0u32;
        simulate(&mut p, 200, 8, linear(0.5), || {
            n += 1;
            n.is_multiple_of(10)
        });
        assert!(p.resting());
        let guesses: usize = (0..600).map(|_| p.guess_len(8)).filter(|&k| k > 0).count();
        assert!(guesses > 0, "probes while resting");
    }

    #[test]
    fn expected_tokens_is_the_geometric_sum() {
        assert_eq!(GuessPolicy::expected_tokens(1.0, 8), 9.0);
        assert_eq!(GuessPolicy::expected_tokens(0.0, 8), 1.0);
        assert!((GuessPolicy::expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
    }

    #[test]
    fn guesses_in_full_before_anything_is_known() {
        let mut p = GuessPolicy::new();
        assert_eq!(p.guess_len(8), 8);
        assert_eq!(p.guess_len(0), 0);
        assert_eq!(
            p.guess_len(1000),
            FIRST_GUESS,
            "no wider guess before one was timed"
        );
        p.record(0, 0, 1.0);
        for _ in 0..10 {
            p.record(8, 8, 2.0);
        }
        assert_eq!(
            p.guess_len(1000),
            16,
            "at most double the widest timed guess"
        );
    }

    #[test]
    fn the_cost_is_interpolated_between_timed_widths_and_extended_past_them() {
        let mut p = GuessPolicy::new();
        assert_eq!(p.cost(3), None, "no one-token round timed");
        p.record(0, 0, 1.0);
        assert_eq!(p.cost(5), Some(1.0), "nothing wider timed: assumed free");
        p.record(4, 4, 3.0); // width 5
        assert_eq!(p.cost(3), Some(2.0));
        assert_eq!(p.cost(9), Some(5.0));
        p.record(0, 0, f64::NAN); // ignored
        assert_eq!(p.cost(1), Some(1.0));
    }

    #[test]
    fn a_round_that_waited_for_a_busy_core_does_not_move_the_cost() {
        let mut p = GuessPolicy::new();
        for t in [1.0, 1.2, 0.9, 30.0, 1.1] {
            p.record(0, 0, t);
        }
        assert_eq!(p.cost(1), Some(1.1));
        for _ in 0..TIMES_KEPT {
            p.record(0, 0, 2.0);
        }
        assert_eq!(p.cost(1), Some(2.0), "only the last times count");
    }

    #[test]
    fn stops_guessing_when_guesses_are_refused_on_a_dear_machine() {
        let mut p = GuessPolicy::new();
        let mut n = 0u32;
        // 20 % of guessed tokens kept; each more row costs half a one-token decode.
        let (tokens, seconds) = simulate(&mut p, 400, 8, linear(0.5), || {
            n += 1;
            n.is_multiple_of(5)
        });
        assert!(tokens / seconds > 0.95, "{}", tokens / seconds);
        assert!(p.acceptance() < 0.5);
    }

    #[test]
    fn guesses_long_when_guesses_are_kept() {
        let mut p = GuessPolicy::new();
        let (tokens, seconds) = simulate(&mut p, 100, 8, linear(0.3), || true);
        assert!(tokens / seconds > 2.5, "{}", tokens / seconds);
        assert_eq!(p.guess_len(8), 8);
    }

    #[test]
    fn a_probe_notices_that_guesses_started_to_be_kept() {
        let mut p = GuessPolicy::new();
        let mut n = 0u32;
        simulate(&mut p, 200, 8, linear(0.5), || {
            n += 1;
            n.is_multiple_of(10)
        });
        assert_eq!(p.guess_len(8), 0, "resting");
        // The output now copies its input: a probe finds it within the longest rest.
        let (tokens, seconds) = simulate(&mut p, 400, 8, linear(0.5), || true);
        assert_eq!(p.guess_len(8), 8);
        assert!(tokens / seconds > 1.5, "{}", tokens / seconds);
    }

    #[test]
    fn a_guess_is_timed_against_a_one_token_round_soon() {
        let mut p = GuessPolicy::new();
        p.record(8, 1, 4.0);
        p.record(8, 2, 4.0);
        assert_eq!(p.guess_len(8), 0, "time a one-token round");
        p.record(0, 0, 1.0);
        assert!(p.best(8).is_some());
    }

    proptest! {
        /// Whatever the costs and acceptances, the guess stays within the cap, and over a
        /// long stream the policy keeps at least 90 % of the rate of never guessing (the
        /// rest pays for the first guess and the probes).
        #[test]
        fn never_much_slower_than_no_guess(
            per_row in 0.0f64..1.5,
            keep_pct in 0u32..=100,
            cap in 0usize..80,
            seed in any::<u64>(),
        ) {
            let mut p = GuessPolicy::new();
            let (tokens, seconds) = simulate(&mut p, 600, cap, linear(per_row), coin(seed, keep_pct));
            prop_assert!(tokens / seconds > 0.9, "rate {}", tokens / seconds);
            for c in [0, 1, cap, 1000] {
                prop_assert!(p.guess_len(c) <= c.min(MAX_GUESS));
            }
        }

        /// A shadowing policy pays for no blind guess, and probes only while the shadow
        /// guesses are kept, a few times at most: it keeps 93 % of the rate of never
        /// guessing however dear the rows, and its guesses stay within the cap.
        #[test]
        fn a_shadowing_policy_is_never_much_slower_than_no_guess(
            per_row in 0.0f64..1.5,
            keep_pct in 0u32..=100,
            cap in 0usize..80,
            seed in any::<u64>(),
        ) {
            let mut p = GuessPolicy::new();
            let (tokens, seconds, _) =
                simulate_shadowed(&mut p, 600, cap, linear(per_row), coin(seed, keep_pct));
            prop_assert!(tokens / seconds > 0.93, "rate {}", tokens / seconds);
            for c in [0, 1, cap, 1000] {
                prop_assert!(p.guess_len(c) <= c.min(MAX_GUESS));
            }
        }
    }
}
