//! Fan heavy per-branch work (grammar-constrained or full-vocabulary sampling) out over the
//! cores between decodes. Light work stays on the engine thread: right after a decode
//! llama.cpp's OpenMP workers still spin on the other cores, and a spawned thread would
//! compete with them (measured: +4% step overhead at N = 8 for greedy sampling).

use std::sync::OnceLock;

/// Items below which one thread does everything (a spawn costs more than the work).
const MIN_ITEMS_PER_THREAD: usize = 2;

fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `items.iter().map(f)`, in order, split into contiguous runs over the cores.
pub(crate) fn map_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = cores().min(items.len() / MIN_ITEMS_PER_THREAD).max(1);
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut runs = items.chunks(per);
    let mine = runs.next().unwrap_or_default();
    std::thread::scope(|s| {
        let f = &f;
        let others: Vec<_> = runs
            .map(|run| s.spawn(move || run.iter().map(f).collect::<Vec<_>>()))
            .collect();
        let mut out: Vec<R> = mine.iter().map(f).collect();
        for h in others {
            out.extend(h.join().expect("a kvfork worker thread panicked"));
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::map_parallel;

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
}
