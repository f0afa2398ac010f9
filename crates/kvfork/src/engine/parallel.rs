//! Per-branch work between decodes (the logits summaries after a decode, constrained or
//! full-vocabulary sampling), spread over the cores on llama.cpp's own OpenMP team.
//!
//! Right after a decode llama.cpp's OpenMP workers keep spinning on the other cores for a
//! while before they sleep. A thread of our own would compete with them (measured: +4 % step
//! overhead at N = 8 for greedy sampling); a parallel region on the same team is picked up by
//! those spinning workers at once. Where llama.cpp is built without OpenMP (no GNU libgomp:
//! macOS, MSVC), light work stays on the engine thread and heavy work gets scoped threads.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Items below which one thread does everything (a spawn costs more than the work).
const MIN_ITEMS_PER_THREAD: usize = 2;

/// The threads `for_each_mut` and `map_parallel` give `n` items when allowed `threads`.
pub(crate) fn threads_for(n: usize, threads: usize) -> usize {
    threads.min(n / MIN_ITEMS_PER_THREAD).max(1)
}

fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How much each item costs, which decides where the work runs without an OpenMP team.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Weight {
    /// Tens of microseconds an item: worth the engine thread alone, never a spawn.
    Light,
    /// Milliseconds an item: worth threads of our own.
    Heavy,
}

/// `f(&mut item)` for every item of light work, on up to `threads` threads.
pub(crate) fn for_each_mut<T: Send>(items: &mut [T], threads: usize, f: impl Fn(&mut T) + Sync) {
    // One uncontended lock per item hands each thread its items; nothing is shared.
    let cells: Vec<Mutex<&mut T>> = items.iter_mut().map(Mutex::new).collect();
    run(cells.len(), threads, Weight::Light, &|i| {
        f(&mut cells[i].lock().unwrap_or_else(|e| e.into_inner()))
    });
}

/// `items.iter().map(f)`, in order, on up to as many threads as there are cores.
pub(crate) fn map_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let out: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    run(items.len(), cores(), Weight::Heavy, &|i| {
        *out[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(f(&items[i]));
    });
    out.into_iter()
        .map(|r| {
            r.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every index runs once")
        })
        .collect()
}

/// `f(i)` for every `i` in `0..n`, each exactly once, on up to `threads` threads; a panic in
/// `f` is raised again here once every thread is done.
fn run(n: usize, threads: usize, weight: Weight, f: &(dyn Fn(usize) + Sync)) {
    let threads = threads_for(n, threads);
    if threads <= 1 {
        return (0..n).for_each(f);
    }
    let work = Work {
        next: AtomicUsize::new(0),
        n,
        f,
        panic: Mutex::new(None),
    };
    if !openmp::run(&work, threads) {
        match weight {
            Weight::Light => work.drain(),
            Weight::Heavy => std::thread::scope(|s| {
                for _ in 1..threads {
                    s.spawn(|| work.drain());
                }
                work.drain();
            }),
        }
    }
    if let Some(payload) = work.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        std::panic::resume_unwind(payload);
    }
}

/// Indices handed out one at a time to whichever thread asks next.
struct Work<'a> {
    next: AtomicUsize,
    n: usize,
    f: &'a (dyn Fn(usize) + Sync),
    /// The first panic of `f`, raised again by `run` (a panic must not unwind into C).
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Work<'_> {
    fn drain(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if let Err(payload) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (self.f)(i)))
            {
                self.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(payload);
                // Nobody takes more work after a panic.
                self.next.store(self.n, Ordering::Relaxed);
            }
        }
    }
}

/// llama.cpp's OpenMP team through GNU libgomp, which `llama-cpp-sys-2` links on GNU targets
/// when built with OpenMP (kvfork always asks for it).
#[cfg(target_env = "gnu")]
mod openmp {
    use std::ffi::{c_uint, c_void};

    use super::Work;

    extern "C" {
        /// libgomp's entry for `#pragma omp parallel num_threads(n)`: runs `f(data)` on the
        /// calling thread and `n - 1` workers of its team, and returns when all are done.
        fn GOMP_parallel(
            f: unsafe extern "C" fn(*mut c_void),
            data: *mut c_void,
            num_threads: c_uint,
            flags: c_uint,
        );
    }

    /// # Safety
    /// `data` points to a live `Work` (see `run`).
    unsafe extern "C" fn drain(data: *mut c_void) {
        // SAFETY: `run` passes a pointer to a `Work` that outlives `GOMP_parallel`, which
        // returns only after every thread has left this function. `Work` is `Sync`: its
        // fields are atomics, a mutex and a `Sync` closure.
        let work = unsafe { &*data.cast_const().cast::<Work<'_>>() };
        work.drain();
    }

    pub(super) fn run(work: &Work<'_>, threads: usize) -> bool {
        let data = std::ptr::from_ref(work).cast_mut().cast::<c_void>();
        // SAFETY: `drain` has the callback signature libgomp expects and never unwinds
        // (`Work::drain` catches panics); `data` stays valid until `GOMP_parallel` returns.
        unsafe { GOMP_parallel(drain, data, threads as c_uint, 0) };
        true
    }
}

#[cfg(not(target_env = "gnu"))]
mod openmp {
    pub(super) fn run(_: &super::Work<'_>, _: usize) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::{for_each_mut, map_parallel, run, Weight};

    #[test]
    fn keeps_order_for_every_length() {
        for n in 0..40 {
            let items: Vec<usize> = (0..n).collect();
            assert_eq!(
                map_parallel(&items, |x| x * 3),
                items.iter().map(|x| x * 3).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn visits_every_item_once() {
        for threads in 1..5 {
            let mut items = vec![0u32; 37];
            for_each_mut(&mut items, threads, |x| *x += 1);
            assert!(items.iter().all(|&x| x == 1));
            for weight in [Weight::Light, Weight::Heavy] {
                let visits: Vec<AtomicU32> = (0..37).map(|_| AtomicU32::new(0)).collect();
                run(visits.len(), threads, weight, &|i| {
                    visits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(visits.iter().all(|v| v.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn a_panic_comes_back_after_every_thread_is_done() {
        let caught = std::panic::catch_unwind(|| {
            run(16, 2, Weight::Heavy, &|i| assert!(i != 5, "item five"))
        });
        let message = caught.expect_err("the panic is raised again");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"item five"));
    }
}
