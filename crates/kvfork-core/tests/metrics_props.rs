//! `copy_and_summarize` against the separate passes it replaces.

use kvfork_core::metrics::{argmax, copy_and_summarize, log_sum_exp};
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
