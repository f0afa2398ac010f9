//! A decode's outputs lent to the branches that made them, the rows' summaries (log-partition,
//! argmax, best k) computed on the decode's thread team: a row a thread, or, where that would
//! leave the team waiting on a few rows, each row cut in segments the team shares
//! (`kvfork_core::metrics::summarize_part`), then merged.
//!
//! With few rows for the team, a row a thread leaves threads idle (at N = 1 the step waits for
//! one core to sweep the row: about 150 µs for Gemma 3's 262,144 logits here, a tenth of a
//! step on a GPU). The merged summary is the one a single pass gives, to the bit.

use kvfork_core::metrics::{self, RowPart, RowSummary};

use super::parallel;
use crate::branch_state::BranchState;
use crate::llama_ctx::OutputRef;

/// A row and the number of its best logits to keep.
type Row<'a> = (&'a [f32], usize);
/// A row's summary and its best logits, best first.
type Summarized = (RowSummary, Vec<u32>);

/// Lend `outputs[i]` to `states[i]`, each row summarized for the best `top_hint()` logits its
/// sampler reads, across up to `threads` threads.
///
/// # Safety
/// As for `BranchState::lend_row`, for every row among `outputs`.
pub(super) unsafe fn lend(
    states: &mut [&mut BranchState],
    outputs: Vec<OutputRef<'_>>,
    threads: usize,
) {
    let top_ks: Vec<usize> = states.iter_mut().map(|st| st.top_hint()).collect();
    let rows: Vec<Row<'_>> = outputs
        .iter()
        .zip(&top_ks)
        .filter_map(|(output, &k)| match output {
            OutputRef::Row(row) => Some((*row, k)),
            OutputRef::Drawn(_) => None,
        })
        .collect();
    let mut summaries = summarize(&rows, threads).into_iter();
    for ((st, output), top_k) in states.iter_mut().zip(outputs).zip(top_ks) {
        match output {
            OutputRef::Row(row) => {
                let (summary, top) = summaries.next().expect("a summary per row");
                // SAFETY: the caller's contract.
                unsafe { st.lend_row(row, top_k, summary, top) };
            }
            // A device draw: nothing to summarize, nothing lent.
            drawn => st.set_output(drawn),
        }
    }
}

/// What a row's parts cost together when each keeps a top `k` of its own, against one pass:
/// a part's top starts its threshold from nothing (`cargo bench -p kvfork-core --bench
/// metrics`, 16 parts of 262,144 logits: 497-524 µs with the best 40 against 159-166 µs for
/// one pass; without a top k the parts cost what one pass does, 147-153 µs).
const PARTS_WITH_TOP_COST: f64 = 3.0;

/// Whether `rows` (each a row and the top `k` it keeps) are sooner summarized in parts on
/// `threads` threads than a row a thread: in units of one row's pass, a row a thread takes
/// the rows each thread gets (`parallel` gives a thread two at least), parts take every
/// row's parts spread evenly.
fn in_parts(rows: &[Row<'_>], threads: usize) -> bool {
    if !rows.iter().any(|(row, _)| metrics::segments(row.len()) > 1) {
        return false;
    }
    let by_rows = rows
        .len()
        .div_ceil(parallel::threads_for(rows.len(), threads)) as f64;
    let cost = if rows.iter().any(|&(_, k)| k > 0) {
        PARTS_WITH_TOP_COST
    } else {
        1.0
    };
    let by_parts = rows.len() as f64 * cost / threads.max(1) as f64;
    by_parts < by_rows
}

/// The summary of each row and its best `k` logits, best first, on up to `threads` threads.
fn summarize(rows: &[Row<'_>], threads: usize) -> Vec<Summarized> {
    if !in_parts(rows, threads) {
        // A row a thread.
        let mut work: Vec<(Row<'_>, Option<Summarized>)> =
            rows.iter().map(|&row| (row, None)).collect();
        parallel::for_each_mut(&mut work, threads, |((row, k), out)| {
            let mut top = Vec::with_capacity(*k);
            *out = Some((metrics::summarize(row, *k, &mut top), top));
        });
        return work
            .into_iter()
            .map(|(_, out)| out.expect("every row summarized"))
            .collect();
    }
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
    fn rows_are_cut_where_the_team_would_wait_on_them() {
        let long = vec![0.0f32; 262_144];
        let short = vec![0.0f32; 1_000];
        let rows = |n: usize, k: usize| vec![(long.as_slice(), k); n];
        // Two threads: one row, or two or three (a thread takes two rows at least).
        assert!(in_parts(&rows(1, 0), 2));
        assert!(in_parts(&rows(2, 0), 2) && in_parts(&rows(3, 0), 2));
        assert!(!in_parts(&rows(4, 0), 2), "a row a thread already");
        // A top k makes the parts dearer: one row needs four threads.
        assert!(!in_parts(&rows(1, 40), 2) && in_parts(&rows(1, 40), 4));
        // Sixteen threads: N = 8 gets 4 threads a row a thread, parts get all 16.
        assert!(in_parts(&rows(8, 0), 16) && in_parts(&rows(8, 40), 16));
        assert!(!in_parts(&rows(32, 0), 16) && !in_parts(&rows(16, 40), 16));
        assert!(!in_parts(&rows(1, 0), 1), "one thread");
        assert!(!in_parts(&[(&short, 0)], 16), "a row of one segment");
        assert!(!in_parts(&[], 16));
    }
}
