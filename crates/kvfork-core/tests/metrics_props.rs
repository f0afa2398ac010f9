//! `summarize` and `copy_and_summarize` against the separate passes they replace.

use kvfork_core::metrics::{
    argmax, copy_and_summarize, log_sum_exp, merge_parts, segments, summarize, summarize_part,
    top_k_indices, top_k_sorted, RowPart, SEGMENT,
};
use proptest::prelude::*;

/// Rows of logits with masked (-inf) entries and ties, across block boundaries.
fn row() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            8 => -40.0f32..40.0,
            1 => Just(f32::NEG_INFINITY),
            1 => Just(7.5f32),
        ],
        1..2_000,
    )
}

proptest! {
    #[test]
    fn matches_separate_passes(src in row()) {
        let mut dst = vec![0.0f32; src.len()];
        let s = copy_and_summarize(&src, &mut dst);
        prop_assert_eq!(&dst, &src);
        prop_assert_eq!(s.argmax, argmax(&src));
        let lse = log_sum_exp(&src);
        if lse == f64::NEG_INFINITY {
            prop_assert_eq!(s.log_sum_exp, lse);
        } else {
            prop_assert!((s.log_sum_exp - lse).abs() <= 1e-5 * lse.abs().max(1.0), "{} vs {}", s.log_sum_exp, lse);
        }
    }
}

/// The best `k` finite entries by a full sort: higher first, the lower index on ties.
fn sorted_top(src: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..src.len() as u32)
        .filter(|&i| src[i as usize].is_finite())
        .collect();
    idx.sort_by(|&a, &b| src[b as usize].total_cmp(&src[a as usize]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

proptest! {
    #[test]
    fn summarize_is_copy_and_summarize_plus_a_sorted_top_k(src in row(), k in 0usize..80) {
        let mut dst = vec![0.0f32; src.len()];
        let copied = copy_and_summarize(&src, &mut dst);
        let mut top = vec![7, 7, 7]; // stale content is replaced
        let s = summarize(&src, k, &mut top);
        prop_assert_eq!(s, copied);
        prop_assert_eq!(&top, &sorted_top(&src, k));
        let mut again = Vec::new();
        top_k_sorted(&src, k, &mut again);
        prop_assert_eq!(&again, &top);
    }

    #[test]
    fn a_prefix_of_the_sorted_top_k_is_the_top_j(src in row(), k in 1usize..80, j in 0usize..80) {
        let j = j.min(k);
        let (mut big, mut small) = (Vec::new(), Vec::new());
        top_k_sorted(&src, k, &mut big);
        top_k_sorted(&src, j, &mut small);
        prop_assert_eq!(&big[..j.min(big.len())], &small[..]);
        let mut unordered = Vec::new();
        top_k_indices(&src, k, &mut unordered);
        unordered.sort_unstable();
        let mut expect = big.clone();
        expect.sort_unstable();
        prop_assert_eq!(unordered, expect);
    }
}

#[test]
fn summarize_a_gemma_sized_row() {
    // 262,144 logits with ties at the top spread over many blocks.
    let src: Vec<f32> = (0..262_144u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 4_000) as f32 / 100.0 - 20.0)
        .collect();
    let mut top = Vec::new();
    let s = summarize(&src, 40, &mut top);
    assert_eq!(top, sorted_top(&src, 40));
    assert_eq!(s.argmax, argmax(&src));
    assert!((s.log_sum_exp - log_sum_exp(&src)).abs() < 1e-6 * s.log_sum_exp.abs());
}

#[test]
fn rising_maxima_rescale_the_running_sum() {
    // Every block raises the max: the earlier sums must be rescaled each time.
    let src: Vec<f32> = (0..5_000).map(|i| i as f32 * 0.01).collect();
    let mut dst = vec![0.0; src.len()];
    let s = copy_and_summarize(&src, &mut dst);
    let exact = {
        let m = 49.99f64;
        m + src
            .iter()
            .map(|&x| (f64::from(x) - m).exp())
            .sum::<f64>()
            .ln()
    };
    assert!(
        (s.log_sum_exp - exact).abs() < 1e-5,
        "{} vs {exact}",
        s.log_sum_exp
    );
    assert_eq!(s.argmax, 4_999);
}

#[test]
fn fully_masked_row() {
    let src = vec![f32::NEG_INFINITY; 300];
    let mut dst = vec![0.0; 300];
    let s = copy_and_summarize(&src, &mut dst);
    assert_eq!(s.log_sum_exp, f64::NEG_INFINITY);
    assert_eq!(s.argmax, 0);
}

/// Rows of several segments: runs of one kind (ordinary logits, masked, a repeated maximum)
/// so whole segments can be masked and the best logit can tie across segments.
fn long_row() -> impl Strategy<Value = Vec<f32>> {
    let run = (
        prop_oneof![
            4 => (-30.0f32..30.0).prop_map(Some),
            1 => Just(None),
            1 => Just(Some(f32::NAN)), // the repeated maximum below
        ],
        1usize..SEGMENT,
    );
    (prop::collection::vec(run, 1..6), any::<u64>()).prop_map(|(runs, seed)| {
        let mut s = seed | 1;
        let mut row = Vec::new();
        for (kind, len) in runs {
            for _ in 0..len {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                row.push(match kind {
                    None => f32::NEG_INFINITY,
                    Some(x) if x.is_nan() => 31.0,
                    Some(x) => x + (s >> 40) as f32 / (1u64 << 24) as f32 * 8.0,
                });
            }
        }
        row
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn parts_taken_in_any_order_merge_to_the_summary_to_the_bit(src in long_row(), k in 0usize..50) {
        let n = segments(src.len());
        prop_assert_eq!(n, src.len().div_ceil(SEGMENT));
        // Parts taken last first, as threads may take them: nothing depends on the order.
        let mut parts: Vec<RowPart> = (0..n).rev().map(|s| summarize_part(&src, s, k)).collect();
        parts.reverse();
        let (mut merged_top, mut top) = (vec![1, 2], Vec::new());
        let merged = merge_parts(&src, &parts, k, &mut merged_top);
        let s = summarize(&src, k, &mut top);
        prop_assert_eq!(merged, s);
        prop_assert_eq!(&merged_top, &top);
        let mut dst = vec![0.0f32; src.len()];
        prop_assert_eq!(copy_and_summarize(&src, &mut dst), s);
        prop_assert!(dst.iter().zip(&src).all(|(a, b)| a.to_bits() == b.to_bits()));
        // And the summary is the row's: first argmax, sorted best k, log-sum-exp.
        prop_assert_eq!(s.argmax, argmax(&src));
        prop_assert_eq!(&top, &sorted_top(&src, k));
        let lse = log_sum_exp(&src);
        if lse == f64::NEG_INFINITY {
            prop_assert_eq!(s.log_sum_exp, lse);
        } else {
            prop_assert!((s.log_sum_exp - lse).abs() <= 1e-6 * lse.abs().max(1.0), "{} vs {}", s.log_sum_exp, lse);
        }
    }
}

#[test]
#[should_panic(expected = "one part per segment")]
fn merging_too_few_parts_is_refused() {
    let src = vec![0.5f32; SEGMENT + 1];
    merge_parts(&src, &[summarize_part(&src, 0, 3)], 3, &mut Vec::new());
}
