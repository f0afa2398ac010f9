//! The summaries of a few long rows (`LogitsSnapshot::lend`), each row cut in segments that
//! the decode's thread team shares (`kvfork_core::metrics::summarize_part`), then merged.
//!
//! With fewer rows than threads, one row a thread leaves the team idle, and at N = 1 the
//! step waits for one core to sweep the row: about 150 µs for Gemma 3's 262,144 logits here,
//! a tenth of a step on a GPU. The merged summary is the one a single pass gives, to the bit.

use kvfork_core::metrics::{self, RowPart, RowSummary};

use super::parallel;

/// Threads each row needs before it is cut in parts: a part keeping a top `k` of its own
/// starts its threshold from nothing, so parts with a top cost about 3× a single pass
/// (`cargo bench -p kvfork-core --bench metrics`: 500 µs against 165 µs, 16 parts), and
/// pay from four threads; parts without one cost what the single pass does.
const THREADS_PER_ROW: usize = 2;
const THREADS_PER_ROW_WITH_TOP: usize = 4;

/// Whether `rows` (each a row and the top `k` it keeps) are better summarized in parts on
/// `threads` threads than a row a thread.
pub(super) fn in_parts(rows: &[(&[f32], usize)], threads: usize) -> bool {
    let long = rows.iter().any(|(row, _)| metrics::segments(row.len()) > 1);
    let per_row = if rows.iter().any(|&(_, k)| k > 0) {
        THREADS_PER_ROW_WITH_TOP
    } else {
        THREADS_PER_ROW
    };
    long && !rows.is_empty() && threads >= rows.len() * per_row
}

/// The summary of each row, and its best `k` logits best first, its segments spread over up
/// to `threads` threads.
pub(super) fn summarize(rows: &[(&[f32], usize)], threads: usize) -> Vec<(RowSummary, Vec<u32>)> {
    let mut parts: Vec<(usize, usize, RowPart)> = rows
        .iter()
        .enumerate()
        .flat_map(|(r, (row, _))| {
            (0..metrics::segments(row.len())).map(move |s| (r, s, RowPart::default()))
        })
        .collect();
    parallel::for_each_mut(&mut parts, threads, |(r, s, part)| {
        let (row, k) = rows[*r];
        *part = metrics::summarize_part(row, *s, k);
    });
    let mut parts = parts.into_iter().map(|(_, _, part)| part);
    rows.iter()
        .map(|&(row, k)| {
            let own: Vec<RowPart> = parts.by_ref().take(metrics::segments(row.len())).collect();
            let mut top = Vec::with_capacity(k);
            let summary = metrics::merge_parts(row, &own, k, &mut top);
            (summary, top)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i ^ seed).wrapping_mul(2_654_435_761) >> 8) as f32 / 1e6 % 30.0 - 15.0)
            .collect()
    }

    #[test]
    fn parts_on_many_threads_give_the_single_pass_summary() {
        let rows = [row(262_144, 1), row(49_152, 2), row(100, 3)];
        let ks = [40, 0, 5];
        let input: Vec<(&[f32], usize)> = rows.iter().map(Vec::as_slice).zip(ks).collect();
        for threads in [1, 2, 7] {
            for ((got, top), &(row, k)) in summarize(&input, threads).into_iter().zip(&input) {
                let mut expect_top = Vec::new();
                assert_eq!(got, metrics::summarize(row, k, &mut expect_top));
                assert_eq!(top, expect_top);
            }
        }
    }

    #[test]
    fn only_few_long_rows_are_cut() {
        let long = vec![0.0f32; 262_144];
        let short = vec![0.0f32; 1_000];
        assert!(in_parts(&[(&long, 0)], 2));
        assert!(!in_parts(&[(&long, 40)], 2));
        assert!(in_parts(&[(&long, 40)], 4));
        assert!(!in_parts(&[(&long, 0), (&long, 0)], 3));
        assert!(!in_parts(&[(&short, 0)], 16));
        assert!(!in_parts(&[], 16));
    }
}
