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

/// Continuous prefill: prompts decoded chunk after chunk under rooms that change (streams
/// riding along take tokens and outputs), prompts joining the queue on the way.
mod continuous {
    use kvfork_core::{plan_chunk, ChunkRoom, Progress};
    use proptest::prelude::*;

    fn room() -> impl Strategy<Value = ChunkRoom> {
        (0usize..40, 0usize..4, 0usize..5).prop_map(|(tokens, outputs, spans)| ChunkRoom {
            tokens,
            outputs,
            spans,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn chunks_respect_their_room_and_finish_prompts_in_order(
            lens in prop::collection::vec(1usize..60, 1..12),
            joins in prop::collection::vec(0usize..12, 0..4),
            rooms in prop::collection::vec(room(), 1..40),
        ) {
            // Prompts queued so far; `joins[k]`: after which chunk the k-th extra one comes.
            let mut prompts: Vec<Progress> = vec![Progress { done: 0, len: lens[0] }];
            let mut waiting: Vec<usize> = lens[1..].to_vec();
            let mut finished = Vec::new();
            for (c, &room) in rooms.iter().cycle().take(400).enumerate() {
                if joins.contains(&c) || c % 3 == 0 {
                    if let Some(len) = waiting.pop() {
                        prompts.push(Progress { done: 0, len });
                    }
                }
                let chunk = plan_chunk(&prompts, room);
                prop_assert!(chunk.n_tokens() <= room.tokens);
                prop_assert!(chunk.spans.len() <= room.spans);
                let ends = chunk.spans.iter().filter(|s| s.is_last).count();
                prop_assert!(ends <= room.outputs);
                for (k, span) in chunk.spans.iter().enumerate() {
                    let p = prompts[span.item];
                    prop_assert!(span.len > 0);
                    prop_assert_eq!(span.start, p.done, "a prompt resumes where it stopped");
                    prop_assert_eq!(span.is_last, span.start + span.len == p.len);
                    if k + 1 < chunk.spans.len() {
                        prop_assert!(span.is_last, "only the chunk's last span is cut");
                    }
                    // Every prompt before it in the queue is finished (queue order).
                    prop_assert!(prompts[..span.item].iter().all(|q| q.done == q.len));
                    prompts[span.item].done += span.len;
                    if span.is_last {
                        finished.push(span.item);
                    }
                }
                // A room that holds a token, an output and a span always makes progress.
                let left = prompts.iter().any(|p| p.done < p.len);
                if left && room.tokens > 0 && room.outputs > 0 && room.spans > 0 {
                    prop_assert!(!chunk.spans.is_empty());
                }
            }
            // Finished in queue order, each once.
            let mut sorted = finished.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(&sorted, &finished);
        }
    }

    #[test]
    fn a_prompt_whose_output_is_not_free_keeps_its_last_token() {
        let prompts = [Progress { done: 0, len: 5 }, Progress { done: 0, len: 3 }];
        let full = ChunkRoom {
            tokens: 16,
            outputs: 1,
            spans: 8,
        };
        let chunk = plan_chunk(&prompts, full);
        // The first finishes; the second may not (no output left): all but its last token.
        assert_eq!(chunk.spans.len(), 2);
        assert!(chunk.spans[0].is_last && !chunk.spans[1].is_last);
        assert_eq!(chunk.spans[1].len, 2);
        let none = ChunkRoom { outputs: 0, ..full };
        assert_eq!(
            plan_chunk(&[Progress { done: 4, len: 5 }], none)
                .spans
                .len(),
            0
        );
    }
}
