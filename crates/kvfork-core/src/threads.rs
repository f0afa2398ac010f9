//! How many threads a decode should use, learned from the decodes themselves.
//!
//! On a machine whose cores are shared (a busy neighbour process, a second model), ggml's
//! workers spin at their barriers waiting for a partner the OS has descheduled, and more
//! threads make a decode slower, not faster. Which count is best depends on load that comes
//! and goes, so it is measured: now and then a few decodes run with a neighbouring count
//! (a *probe*), and the faster count is kept. A probe also starts at once when decodes
//! suddenly get slower than usual (load appeared).
//!
//! Decode times are compared only between decodes of the same size class (`bucket`): a
//! 512-token prefill and a one-token step are different work.

use std::collections::BTreeMap;

/// Decodes a probe runs with the candidate count.
const PROBE_DECODES: u32 = 4;
/// A candidate must be this much faster to be adopted (noise margin).
const ADOPT_BELOW: f64 = 0.9;
/// A probe whose first decode ran this much slower than the current count cannot win: it ends
/// there (on a quiet machine a probe of fewer threads then costs one slow decode, not four).
const HOPELESS_ABOVE: f64 = 1.3;
/// Decodes between probes: starts here, doubles after each probe that changes nothing.
const FIRST_INTERVAL: u32 = 16;
const MAX_INTERVAL: u32 = 1024;
/// A probe starts early when the recent time of the current count exceeds its settled
/// baseline by this factor.
const SLOWDOWN: f64 = 1.4;

/// The thread-count controller of one context.
#[derive(Debug, Clone)]
pub struct ThreadTuner {
    max: u32,
    current: u32,
    /// Per (threads, bucket): (fast EWMA, slow EWMA) of nanoseconds per decode.
    times: BTreeMap<(u32, u32), (f64, f64)>,
    since_probe: u32,
    interval: u32,
    probe: Option<Probe>,
    /// Alternates the direction of probes (fewer, then more threads).
    probe_down: bool,
}

#[derive(Debug, Clone)]
struct Probe {
    threads: u32,
    left: u32,
    /// Per bucket: sum of ns and count, for the candidate.
    samples: BTreeMap<u32, (f64, u32)>,
}

/// Size class of a decode: ⌊log2(tokens)⌋.
pub fn bucket(tokens: usize) -> u32 {
    usize::BITS - 1 - tokens.max(1).leading_zeros()
}

impl ThreadTuner {
    /// Start at `max` threads (the most a decode may use).
    pub fn new(max: u32) -> Self {
        let max = max.max(1);
        ThreadTuner {
            max,
            current: max,
            times: BTreeMap::new(),
            since_probe: 0,
            interval: FIRST_INTERVAL,
            probe: None,
            probe_down: true,
        }
    }

    /// Threads the next decode should use.
    pub fn threads(&self) -> u32 {
        self.probe.as_ref().map_or(self.current, |p| p.threads)
    }

    /// The count decodes settle on (not a probe's).
    pub fn current(&self) -> u32 {
        self.current
    }

    /// Record a decode of `tokens` tokens that took `ns` with `self.threads()` threads.
    pub fn observe(&mut self, tokens: usize, ns: f64) {
        let b = bucket(tokens);
        if let Some(p) = self.probe.as_mut() {
            let first = p.left == PROBE_DECODES;
            let s = p.samples.entry(b).or_insert((0.0, 0));
            s.0 += ns;
            s.1 += 1;
            p.left -= 1;
            let hopeless = first
                && self
                    .times
                    .get(&(self.current, b))
                    .is_some_and(|&(fast, _)| ns > HOPELESS_ABOVE * fast);
            if p.left == 0 || hopeless {
                self.finish_probe();
            }
            return;
        }
        let slowed = {
            let t = self.times.entry((self.current, b)).or_insert((ns, ns));
            t.0 = 0.5 * t.0 + 0.5 * ns;
            t.1 = 0.95 * t.1 + 0.05 * ns;
            t.0 > SLOWDOWN * t.1
        };
        self.since_probe += 1;
        if self.since_probe >= self.interval || slowed {
            self.start_probe(slowed);
        }
    }

    fn candidate(&self, down: bool) -> Option<u32> {
        let (c, max) = (self.current, self.max);
        let step = |x: u32| if x <= 4 { 1 } else { x / 2 };
        if down && c > 1 {
            Some(c - step(c).min(c - 1))
        } else if !down && c < max {
            Some((c + step(c)).min(max))
        } else {
            None
        }
    }

    fn start_probe(&mut self, slowed: bool) {
        self.since_probe = 0;
        let threads = if slowed {
            // Load appeared: fewer threads is the only cure worth trying. (Probing more
            // threads now would load the machine further: two adapting processes would
            // set each other off.)
            let down = self.candidate(true);
            if down.is_none() {
                self.accept_slowdown();
            }
            down
        } else {
            let down = self.probe_down;
            self.probe_down = !self.probe_down;
            self.candidate(down).or_else(|| self.candidate(!down))
        };
        if let Some(threads) = threads {
            self.probe = Some(Probe {
                threads,
                left: PROBE_DECODES,
                samples: BTreeMap::new(),
            });
        }
    }

    fn finish_probe(&mut self) {
        let Some(p) = self.probe.take() else { return };
        // Candidate mean against the current count's recent time, bucket by bucket.
        let mut ratio_sum = 0.0;
        let mut n = 0;
        for (b, (sum, count)) in &p.samples {
            if let Some(&(fast, _)) = self.times.get(&(self.current, *b)) {
                ratio_sum += (sum / f64::from(*count)) / fast;
                n += 1;
            }
        }
        if n > 0 && ratio_sum / f64::from(n) < ADOPT_BELOW {
            self.current = p.threads;
            self.interval = FIRST_INTERVAL;
            // Baselines of the new count start from the probe's own times.
            for (b, (sum, count)) in p.samples {
                let mean = sum / f64::from(count);
                self.times.insert((self.current, b), (mean, mean));
            }
        } else {
            self.interval = (self.interval * 2).min(MAX_INTERVAL);
            self.accept_slowdown();
        }
    }

    /// The slowdown seen is the new normal for the current count (no alarm for it again).
    fn accept_slowdown(&mut self) {
        for t in self.times.values_mut() {
            t.1 = t.1.max(t.0 / SLOWDOWN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decode time for `threads` under `busy` neighbour processes on `cores` cores: linear
    /// speed-up until the cores run out, then each extra thread waits for the scheduler.
    fn simulated(threads: u32, cores: u32, busy: u32) -> f64 {
        let free = cores.saturating_sub(busy).max(1);
        if threads <= free {
            1000.0 / f64::from(threads)
        } else {
            1000.0 / f64::from(free) * (1.0 + 1.5 * f64::from(threads - free))
        }
    }

    fn run(t: &mut ThreadTuner, steps: u32, cores: u32, busy: u32) {
        for _ in 0..steps {
            let ns = simulated(t.threads(), cores, busy);
            t.observe(1, ns);
        }
    }

    #[test]
    fn buckets_by_power_of_two() {
        assert_eq!([0, 1, 2, 3, 4, 511, 512].map(bucket), [0, 0, 1, 1, 2, 8, 9]);
    }

    #[test]
    fn stays_at_max_on_a_quiet_machine_and_backs_off_under_load() {
        let mut t = ThreadTuner::new(2);
        run(&mut t, 500, 2, 0);
        assert_eq!(t.current(), 2);
        run(&mut t, 100, 2, 1);
        assert_eq!(t.current(), 1, "one busy neighbour on two cores");
        run(&mut t, 3000, 2, 0);
        assert_eq!(t.current(), 2, "the load went away");
    }

    #[test]
    fn finds_the_free_cores_on_a_larger_machine() {
        let mut t = ThreadTuner::new(8);
        run(&mut t, 3000, 8, 4);
        assert_eq!(t.current(), 4);
    }

    #[test]
    fn probes_cost_little_when_nothing_changes() {
        let mut t = ThreadTuner::new(2);
        let mut off_max = 0;
        for _ in 0..5000 {
            off_max += u32::from(t.threads() != 2);
            t.observe(1, simulated(t.threads(), 2, 0));
        }
        assert!(off_max < 100, "{off_max} of 5000 decodes ran probes");
    }

    #[test]
    fn a_hopeless_probe_ends_after_one_decode() {
        let mut t = ThreadTuner::new(2);
        // The first probe comes after FIRST_INTERVAL decodes at 2 threads; 1 thread is slower.
        let mut off_max = 0;
        for _ in 0..FIRST_INTERVAL * 2 {
            off_max += u32::from(t.threads() != 2);
            t.observe(1, simulated(t.threads(), 2, 0));
        }
        assert_eq!(off_max, 1, "one decode of the probe, not {PROBE_DECODES}");
        assert_eq!(t.current(), 2);
    }

    #[test]
    fn two_adapting_processes_settle_on_sharing_the_cores() {
        let (mut a, mut b) = (ThreadTuner::new(2), ThreadTuner::new(2));
        let mut off_one = 0;
        for step in 0..4000 {
            let (ta, tb) = (a.threads(), b.threads());
            a.observe(1, simulated(ta, 2, tb));
            b.observe(1, simulated(tb, 2, ta));
            if step >= 1000 {
                off_one += u32::from(ta != 1) + u32::from(tb != 1);
            }
        }
        assert_eq!((a.current(), b.current()), (1, 1));
        assert!(
            off_one < 120,
            "{off_one} of 6000 decodes ran on two threads"
        );
    }

    #[test]
    fn one_thread_max_never_probes() {
        let mut t = ThreadTuner::new(1);
        run(&mut t, 200, 1, 3);
        assert_eq!((t.current(), t.threads()), (1, 1));
    }
}
