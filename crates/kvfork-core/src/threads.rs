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
//!
//! Timing alone reacts too late when the machine is already busy: the first decodes (the
//! first prefill too) would run on every core while two neighbours hold them, and a spinning
//! team then runs 10-30× slower than one thread. So the tuner also takes a *ceiling*: the
//! cores other processes leave free, read from the kernel's CPU time counters
//! ([`CpuTimes`], [`others_busy`], [`ceiling_for`]). Decodes never use more threads than the
//! ceiling, and return to the learned count as soon as the ceiling allows it again.

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
    /// The count the probes settled on (the ceiling may hold decodes below it).
    current: u32,
    /// The most threads the machine's load leaves room for (`max` until told otherwise).
    ceiling: u32,
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
            ceiling: max,
            times: BTreeMap::new(),
            since_probe: 0,
            interval: FIRST_INTERVAL,
            probe: None,
            probe_down: true,
        }
    }

    /// Threads the next decode should use.
    pub fn threads(&self) -> u32 {
        self.probe.as_ref().map_or(self.settled(), |p| p.threads)
    }

    /// The count decodes settle on (not a probe's): the learned count, under the ceiling.
    pub fn current(&self) -> u32 {
        self.settled()
    }

    fn settled(&self) -> u32 {
        self.current.min(self.ceiling)
    }

    /// The most threads the next decodes may use (from [`ceiling_for`]), clamped to
    /// `1..=max`. A probe above it ends unjudged.
    pub fn set_ceiling(&mut self, ceiling: u32) {
        self.ceiling = ceiling.clamp(1, self.max);
        if self
            .probe
            .as_ref()
            .is_some_and(|p| p.threads > self.ceiling)
        {
            self.probe = None;
        }
    }

    /// Record a decode of `tokens` tokens that took `ns` with `self.threads()` threads.
    pub fn observe(&mut self, tokens: usize, ns: f64) {
        let b = bucket(tokens);
        let settled = self.settled();
        if let Some(p) = self.probe.as_mut() {
            let first = p.left == PROBE_DECODES;
            let s = p.samples.entry(b).or_insert((0.0, 0));
            s.0 += ns;
            s.1 += 1;
            p.left -= 1;
            // Against the settled count's time for this size class, or failing that for the
            // next larger one it has timed: fewer tokens slower than more cannot win.
            let hopeless = first
                && self
                    .times
                    .range((settled, b)..=(settled, u32::MAX))
                    .next()
                    .is_some_and(|(_, &(fast, _))| ns > HOPELESS_ABOVE * fast);
            if p.left == 0 || hopeless {
                self.finish_probe();
            }
            return;
        }
        let slowed = {
            let t = self.times.entry((settled, b)).or_insert((ns, ns));
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
        let (c, max) = (self.settled(), self.ceiling);
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
        let settled = self.settled();
        for (b, (sum, count)) in &p.samples {
            if let Some(&(fast, _)) = self.times.get(&(settled, *b)) {
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

/// The kernel's CPU time counters at one moment, in clock ticks (Linux: `/proc/stat` for
/// the CPUs this process may run on, `/proc/self/stat` for the process itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTimes {
    /// Non-idle time of those CPUs, summed.
    pub busy: u64,
    /// All time of those CPUs (busy, idle and waiting), summed.
    pub total: u64,
    /// This process's own CPU time (user and system, every thread).
    pub own: u64,
    /// How many CPUs the sums cover.
    pub cpus: u32,
}

/// Fewest ticks per CPU counted between two readings for [`others_busy`] to answer (50 ms at
/// the usual 100 ticks a second): shorter windows are mostly rounding, longer ones react late
/// (a reading every 50 ms lets the count follow a change of load within a few decodes).
pub const MIN_WINDOW_TICKS_PER_CPU: u64 = 5;

/// Cores that other processes kept busy between two readings: the CPUs' busy time less this
/// process's own, as a share of their whole time, times their number. `None` when the window
/// is too short to tell ([`MIN_WINDOW_TICKS_PER_CPU`]) or the readings do not belong together.
pub fn others_busy(before: &CpuTimes, after: &CpuTimes) -> Option<f64> {
    if before.cpus != after.cpus || after.cpus == 0 {
        return None;
    }
    let total = after.total.checked_sub(before.total)?;
    if total < MIN_WINDOW_TICKS_PER_CPU * u64::from(after.cpus) {
        return None;
    }
    let busy = after.busy.saturating_sub(before.busy);
    let own = after.own.saturating_sub(before.own);
    let others = busy.saturating_sub(own) as f64 / total as f64;
    Some(others * f64::from(after.cpus))
}

/// Threads worth running when `others` cores of `cores` are kept busy by other processes: the
/// free cores, rounded to the nearest (a neighbour using half a core leaves the choice to the
/// timing probes), at least one.
pub fn ceiling_for(cores: u32, others: f64) -> u32 {
    let free = f64::from(cores) - others.max(0.0);
    // `as` saturates; free < 0.5 gives 0, hence the max.
    (free.round() as u32).max(1)
}

/// Whether a reading of `others` busy cores, or any lower one, leaves the ceiling at every
/// core ([`ceiling_for`] rounds the free cores to the nearest): then a second reading that could
/// only lower it changes nothing and need not be taken.
pub fn leaves_every_core(others: f64) -> bool {
    others <= 0.5
}

/// Runnable tasks of other processes right now, from the kernel's count of running tasks
/// (`procs_running`) less this process's own running threads: an instant reading for the
/// first decode, before any window of [`CpuTimes`] exists.
pub fn others_running(procs_running: u32, own_running: u32) -> f64 {
    f64::from(procs_running.saturating_sub(own_running))
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
    fn a_probe_in_an_untimed_size_class_slower_than_a_larger_one_ends_at_once() {
        let mut t = ThreadTuner::new(2);
        // Steps of 16 tokens (bucket 4) only, until the first probe starts.
        while t.threads() == 2 {
            t.observe(16, 100.0);
        }
        // The probe's first decode is of 13 tokens (bucket 3, never timed at 2 threads) and
        // slower than a 16-token decode at 2 threads: it cannot win.
        t.observe(13, 150.0);
        assert_eq!(t.threads(), 2, "the probe ended after one decode");
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
    fn the_ceiling_holds_decodes_down_and_lets_them_back_up() {
        let mut t = ThreadTuner::new(4);
        run(&mut t, 200, 4, 0);
        assert_eq!(t.current(), 4);
        t.set_ceiling(1);
        assert_eq!(
            (t.current(), t.threads()),
            (1, 1),
            "at once, before any timing"
        );
        run(&mut t, 300, 4, 3);
        assert!(t.threads() <= 1, "no probe above the ceiling");
        t.set_ceiling(4);
        assert_eq!(t.current(), 4, "the learned count comes back with the room");
        t.set_ceiling(0);
        assert_eq!(t.current(), 1, "clamped to one thread");
    }

    #[test]
    fn a_lowered_ceiling_cancels_a_probe_above_it() {
        let mut t = ThreadTuner::new(2);
        t.set_ceiling(1);
        run(&mut t, 100, 2, 1);
        t.set_ceiling(2);
        // Probes may start again, within the new ceiling only.
        for _ in 0..200 {
            assert!(t.threads() <= 2);
            t.observe(1, simulated(t.threads(), 2, 0));
            t.set_ceiling(1);
            assert_eq!(t.threads(), 1);
            t.set_ceiling(2);
        }
    }

    #[test]
    fn others_busy_is_the_busy_time_less_our_own() {
        let at = |busy, total, own| CpuTimes {
            busy,
            total,
            own,
            cpus: 2,
        };
        // Two neighbours spinning on two CPUs, we idle: both cores taken.
        assert_eq!(others_busy(&at(0, 0, 0), &at(100, 100, 0)), Some(2.0));
        // We use one core, a neighbour the other.
        assert_eq!(others_busy(&at(0, 0, 0), &at(100, 100, 50)), Some(1.0));
        // Quiet machine, our two threads.
        assert_eq!(others_busy(&at(10, 20, 10), &at(110, 120, 110)), Some(0.0));
        // Too short to tell, or counters that went backwards, or from other CPU sets.
        assert_eq!(others_busy(&at(0, 0, 0), &at(5, 9, 0)), None);
        assert_eq!(others_busy(&at(0, 0, 0), &at(10, 10, 5)), Some(1.0));
        assert_eq!(others_busy(&at(0, 200, 0), &at(0, 100, 0)), None);
        let other = CpuTimes {
            cpus: 4,
            ..at(100, 100, 0)
        };
        assert_eq!(others_busy(&at(0, 0, 0), &other), None);
    }

    #[test]
    fn below_the_mark_no_lower_reading_changes_the_ceiling() {
        for cores in 1..=64 {
            for w in [0.0, 0.1, 0.25, 0.4999, 0.5] {
                assert!(leaves_every_core(w));
                for i in [0.0, 0.2, 0.5, 1.0, 7.0] {
                    assert_eq!(ceiling_for(cores, w.min(i)), cores, "{cores} {w} {i}");
                }
            }
            // Just above, a reading can take a core away (where there is one to take).
            assert!(!leaves_every_core(0.51));
            assert_eq!(ceiling_for(cores, 0.51), (cores - 1).max(1));
        }
    }

    #[test]
    fn ceiling_is_the_free_cores_rounded() {
        assert_eq!(ceiling_for(2, 0.05), 2);
        assert_eq!(
            ceiling_for(2, 0.67),
            1,
            "one neighbour beside our two threads"
        );
        assert_eq!(ceiling_for(2, 1.0), 1);
        assert_eq!(ceiling_for(2, 2.0), 1, "never below one");
        assert_eq!(ceiling_for(2, 5.0), 1);
        assert_eq!(ceiling_for(8, 3.2), 5);
        assert_eq!(ceiling_for(8, -1.0), 8);
        assert_eq!(others_running(3, 1), 2.0);
        assert_eq!(others_running(0, 1), 0.0);
    }

    #[test]
    fn one_thread_max_never_probes() {
        let mut t = ThreadTuner::new(1);
        run(&mut t, 200, 1, 3);
        assert_eq!((t.current(), t.threads()), (1, 1));
    }
}
