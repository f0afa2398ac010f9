//! When running streams step apart from a continuous prefill's scratch decodes.
//!
//! Prompts decoded in a scratch context (the engine's `scratch.rs`) share no decode with the
//! streams of the main context: those streams' steps are held and decoded apart, in one decode
//! of their own. Stepping them after every prompt chunk costs a decode each time, and puts
//! many short waits between a stream's tokens; stepping them seldom makes each wait long. The
//! bound is llama.cpp's server's (a stream waits for at most [`STEP_EVERY`] prompt tokens,
//! its default `n_batch`), and a time bound beside it, [`STEP_WAIT`]: on a slow machine, or
//! a busy one whose queue of prompts never empties, 2,048 tokens of prefill take seconds
//! (6.4 s on a 2-core AVX2 VM) and the streams stalled that long, again and again.

use std::time::{Duration, Instant};

/// Prompt tokens decoded in a scratch between two steps of the streams held meanwhile: llama.cpp's
/// server decodes up to 2,048 prompt tokens (its default `n_batch`) between two of a stream's
/// tokens. Fewer, longer waits cost the streams no more time in all, and save the steps' own
/// decodes: on the steady workload of `bench_serve.py`, stepping them after every 512-token
/// decode put 6 % of the gaps between tokens at a decode's length (p95 0.32 s against
/// llama-server's 0.10 s).
pub const STEP_EVERY: usize = 2048;

/// The longest the held streams wait before they step apart, whatever the tokens (checked
/// before each scratch decode, so a wait may last one decode longer). On the steady workload
/// of `bench_serve.py` on a 2-core AVX2 VM (a 512-token decode 1.6 s) at 0.5 requests a
/// second, it took the p95 of the time between a stream's tokens from 7.9 s to 2.8 s at the
/// same throughput (BENCHMARKS.md §28).
pub const STEP_WAIT: Duration = Duration::from_secs(1);

/// The account of one continuous prefill's scratch decodes since the held streams last stepped.
#[derive(Debug, Clone)]
pub struct StepsApart {
    /// Prompt tokens decoded in a scratch since then (at least [`STEP_EVERY`]: due at once).
    tokens: usize,
    since: Instant,
}

impl StepsApart {
    /// A run's start: streams that are held at its first scratch decode step at once.
    pub fn new(now: Instant) -> Self {
        StepsApart {
            tokens: STEP_EVERY,
            since: now,
        }
    }

    /// Whether the held streams step apart before the next scratch decode.
    pub fn due(&self, now: Instant) -> bool {
        self.tokens >= STEP_EVERY || now.saturating_duration_since(self.since) >= STEP_WAIT
    }

    /// The held streams stepped apart at `now`.
    pub fn stepped(&mut self, now: Instant) {
        self.tokens = 0;
        self.since = now;
    }

    /// A scratch decode of `n_tokens` prompt tokens.
    pub fn decoded(&mut self, n_tokens: usize) {
        self.tokens = self.tokens.saturating_add(n_tokens);
    }

    /// The streams rode a main-context decode: any held at the next scratch decode came after
    /// it, and step at once.
    pub fn rode(&mut self, now: Instant) {
        self.tokens = STEP_EVERY;
        self.since = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CHUNK: usize = 512;

    #[test]
    fn held_streams_step_at_a_runs_first_scratch_decode() {
        let t0 = Instant::now();
        assert!(StepsApart::new(t0).due(t0));
    }

    #[test]
    fn on_a_fast_machine_they_step_every_step_every_tokens() {
        let t0 = Instant::now();
        let mut steps = StepsApart::new(t0);
        steps.stepped(t0);
        let decode = Duration::from_millis(100); // 4 chunks well within STEP_WAIT
        let mut due_after = Vec::new();
        for i in 1..=8usize {
            steps.decoded(CHUNK);
            let now = t0 + decode * i as u32;
            if steps.due(now) {
                due_after.push(i);
                steps.stepped(now);
            }
        }
        assert_eq!(due_after, [STEP_EVERY / CHUNK, 2 * STEP_EVERY / CHUNK]);
    }

    #[test]
    fn on_a_slow_machine_they_step_once_step_wait_went_by() {
        let t0 = Instant::now();
        let mut steps = StepsApart::new(t0);
        steps.stepped(t0);
        steps.decoded(CHUNK);
        assert!(!steps.due(t0 + STEP_WAIT - Duration::from_millis(1)));
        assert!(steps.due(t0 + STEP_WAIT));
        steps.stepped(t0 + STEP_WAIT);
        assert!(!steps.due(t0 + STEP_WAIT));
    }

    #[test]
    fn after_riding_a_main_decode_they_step_at_once() {
        let t0 = Instant::now();
        let mut steps = StepsApart::new(t0);
        steps.stepped(t0);
        steps.rode(t0);
        assert!(steps.due(t0));
    }

    proptest! {
        /// Whatever the decode times and sizes, a decode begins with the streams held only
        /// while neither bound was reached since they last stepped: no wait outlasts a bound
        /// by more than the one decode after it.
        #[test]
        fn a_wait_never_outlasts_a_bound_by_more_than_a_decode(
            decodes in prop::collection::vec((1usize..=CHUNK, 1u64..3_000), 1..64),
        ) {
            let t0 = Instant::now();
            let mut steps = StepsApart::new(t0);
            let (mut now, mut last_step, mut tokens) = (t0, t0, 0usize);
            for (n, ms) in decodes {
                if steps.due(now) {
                    steps.stepped(now);
                    last_step = now;
                    tokens = 0;
                }
                let decode = Duration::from_millis(ms);
                prop_assert!(tokens < STEP_EVERY);
                prop_assert!(now - last_step < STEP_WAIT);
                steps.decoded(n);
                tokens += n;
                now += decode;
            }
        }
    }
}
