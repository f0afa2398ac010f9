//! Properties of the prefill planner over random prompt lengths and batch sizes.

use kvfork_core::{logits_index, plan_prefill};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn plan_covers_every_token_once(
        lens in prop::collection::vec(prop_oneof![1 => Just(0usize), 4 => 0usize..60], 0..20),
        n_batch in 1usize..40,
    ) {
        let chunks = plan_prefill(&lens, n_batch);
        let total: usize = lens.iter().sum();
        prop_assert_eq!(chunks.len(), total.div_ceil(n_batch));

        // Next expected token offset per item, and how often each item ended.
        let mut next = vec![0usize; lens.len()];
        let mut lasts = vec![0usize; lens.len()];
        let mut prev_item = 0;
        for (c, chunk) in chunks.iter().enumerate() {
            let n = chunk.n_tokens();
            prop_assert!(n > 0 && n <= n_batch);
            if c + 1 < chunks.len() {
                prop_assert_eq!(n, n_batch, "only the last chunk may be short");
            }
            let mut offset = 0;
            for (s, span) in chunk.spans.iter().enumerate() {
                prop_assert!(span.len > 0);
                prop_assert!(span.item >= prev_item, "items stay in input order");
                prev_item = span.item;
                prop_assert_eq!(span.start, next[span.item], "tokens contiguous, in order");
                next[span.item] += span.len;
                let ends = next[span.item] == lens[span.item];
                prop_assert_eq!(span.is_last, ends);
                lasts[span.item] += usize::from(span.is_last);
                offset += span.len;
                prop_assert_eq!(logits_index(chunk, s), offset - 1);
            }
        }
        prop_assert_eq!(&next, &lens);
        for (item, &len) in lens.iter().enumerate() {
            prop_assert_eq!(lasts[item], usize::from(len > 0), "item {}", item);
        }
    }
}
