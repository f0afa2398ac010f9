//! How busy the machine is, from the kernel's own counters, for the thread tuner's ceiling
//! (`kvfork_core::threads`): the CPU time of the CPUs this process may run on less its own,
//! read between decodes at most every [`READ_EVERY`]. Linux only; elsewhere every reading is
//! `None` and the tuner learns from timings alone.
//!
//! Why these counters: `/proc/stat`'s per-CPU times cover exactly the CPUs in our affinity
//! mask (a container's cpuset included), where its `procs_running` and the load average count
//! the whole host. `procs_running` serves only the very first decode, before any window
//! exists, and only when the mask holds every CPU of the machine.
//!
//! Niced processes (a background build, a batch job) do not count as busy for a process of
//! normal priority: the scheduler gives the CPU to it first (weight 1024 against 15 at nice 19).

use std::time::{Duration, Instant};

use kvfork_core::threads::{leaves_every_core, others_busy, others_running, CpuTimes};

/// Readings closer together than this are skipped (a read costs ~20 µs; a decode ~10 ms).
const READ_EVERY: Duration = Duration::from_millis(25);
/// A window longer than this is mostly time the engine sat idle: what other processes did
/// then says little about the decode about to run, and neither does an instant count taken
/// while the client that woke us is still sending. The reading is the lesser of the two.
const STALE_WINDOW: Duration = Duration::from_millis(500);
/// Counts of runnable tasks taken for the instant reading.
const INSTANT_SAMPLES: usize = 5;

/// Reads how many cores other processes keep busy.
pub(super) struct LoadMeter {
    /// CPU ids this process may run on, or empty where the counters cannot be read.
    allowed: Vec<u32>,
    /// Whether `allowed` is every CPU of the machine (then `procs_running` is ours to read).
    whole_machine: bool,
    /// Whether niced processes' time counts as busy: not when this process runs at normal
    /// priority or higher, since niced work then yields the CPU to it.
    count_niced: bool,
    /// Start of the current window.
    start: Option<CpuTimes>,
    last_read: Instant,
}

impl LoadMeter {
    pub fn new() -> Self {
        let allowed = allowed_cpus().unwrap_or_default();
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|s| parse_cpu_list(&s));
        let whole_machine = online.is_some_and(|all| all == allowed);
        let count_niced = own_nice().is_none_or(|nice| nice > 0);
        let start = read_times(&allowed, count_niced);
        LoadMeter {
            allowed,
            whole_machine,
            count_niced,
            start,
            last_read: Instant::now(),
        }
    }

    /// The CPUs the readings cover (what "cores" means for the ceiling); 0 where unknown.
    pub fn cpus(&self) -> u32 {
        self.allowed.len() as u32
    }

    /// Other processes' runnable tasks now (None off Linux or in a CPU subset): the median
    /// of a few counts a millisecond apart, since one count catches tasks between naps.
    pub fn others_now(&self) -> Option<f64> {
        if !self.whole_machine {
            return None;
        }
        let mut counts = Vec::with_capacity(INSTANT_SAMPLES);
        for i in 0..INSTANT_SAMPLES {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let stat = std::fs::read_to_string("/proc/stat").ok()?;
            let running = stat
                .lines()
                .find_map(|l| l.strip_prefix("procs_running "))?
                .trim()
                .parse()
                .ok()?;
            counts.push(others_running(running, own_running_threads()?));
        }
        counts.sort_by(f64::total_cmp);
        Some(counts[INSTANT_SAMPLES / 2])
    }

    /// Cores other processes kept busy since the window began, once the window is long
    /// enough to tell (an instant count after an idle stretch); then a new window starts.
    pub fn others_busy(&mut self) -> Option<f64> {
        let since = self.last_read.elapsed();
        if since < READ_EVERY {
            return None;
        }
        self.last_read = Instant::now();
        let now = read_times(&self.allowed, self.count_niced)?;
        if since > STALE_WINDOW && self.whole_machine {
            // Both readings must show the load: a neighbour that keeps cores busy does, where
            // a client's burst of requests (busy just now, idle while we decode) shows only in
            // the instant count, and what ran during the idle stretch only in the window.
            let window = self.start.and_then(|start| others_busy(&start, &now));
            self.start = Some(now);
            if window.is_some_and(leaves_every_core) {
                // The instant count could only lower this reading, and the ceiling is all
                // cores already: its ~5 ms of samples would only delay the first decode after
                // every idle stretch (a server's next request).
                return window;
            }
            let instant = self.others_now();
            return match (window, instant) {
                (Some(w), Some(i)) => Some(w.min(i)),
                (w, i) => w.or(i),
            };
        }
        let Some(start) = self.start else {
            self.start = Some(now);
            return None;
        };
        let others = others_busy(&start, &now)?;
        self.start = Some(now);
        Some(others)
    }
}

/// Busy and total ticks of the `allowed` CPUs (niced time as busy only with `count_niced`),
/// and this process's own.
fn read_times(allowed: &[u32], count_niced: bool) -> Option<CpuTimes> {
    if allowed.is_empty() {
        return None;
    }
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut times = CpuTimes {
        own: own_ticks()?,
        ..CpuTimes::default()
    };
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        let mut fields = rest.split_ascii_whitespace();
        let Some(Ok(id)) = fields.next().map(str::parse::<u32>) else {
            continue; // the "cpu" line of all CPUs together
        };
        if !allowed.contains(&id) {
            continue;
        }
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let v: Vec<u64> = fields.take(8).filter_map(|f| f.parse().ok()).collect();
        if v.len() < 8 {
            return None;
        }
        let niced = v[1];
        let idle = v[3] + v[4];
        let busy = v[0] + v[2] + v[5] + v[6] + v[7];
        times.busy += busy + if count_niced { niced } else { 0 };
        times.total += busy + niced + idle;
        times.cpus += 1;
    }
    (times.cpus > 0).then_some(times)
}

/// User plus system ticks of this process (fields 14 and 15 of `/proc/self/stat`).
fn own_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_ascii_whitespace().skip(11); // field 3 is the first here
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// This process's nice value (field 19 of `/proc/self/stat`).
fn own_nice() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_ascii_whitespace().nth(16)?.parse().ok()
}

/// This process's threads that are running or runnable now.
fn own_running_threads() -> Option<u32> {
    let mut n = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_ascii_whitespace().next());
        n += u32::from(state == Some("R"));
    }
    Some(n)
}

/// The CPUs in this process's affinity mask (`Cpus_allowed_list` of `/proc/self/status`).
fn allowed_cpus() -> Option<Vec<u32>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpu_list(list)
}

/// A kernel CPU list such as `0-3,8,10-11`, sorted.
fn parse_cpu_list(list: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.trim().parse::<u32>().ok()?..=b.trim().parse().ok()?),
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then_some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_counters_are_readable_here() {
        let meter = LoadMeter::new();
        assert!(meter.cpus() >= 1);
        assert!(own_ticks().is_some());
        let t = read_times(&meter.allowed, true).expect("/proc/stat");
        assert_eq!(t.cpus, meter.cpus());
        assert!(t.busy <= t.total);
        // This test's own thread is running while it counts.
        assert!(own_running_threads().is_some_and(|n| n >= 1));
        assert!(own_nice().is_some_and(|n| (-20..=19).contains(&n)));
    }
}
