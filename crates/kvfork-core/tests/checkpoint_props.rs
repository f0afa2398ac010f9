//! Properties of the checkpoint budget over random inserts and cuts.

use kvfork_core::{Budget, Checkpoints};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Insert { pos: u32, bytes: usize },
    Truncate(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..500, 1usize..40).prop_map(|(pos, bytes)| Op::Insert { pos, bytes }),
        1 => (0u32..500).prop_map(Op::Truncate),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn kept_checkpoints_are_ordered_within_budget_and_findable(
        ops in prop::collection::vec(op(), 0..60),
        count in 0usize..6,
        bytes in 0usize..120,
    ) {
        let budget = Budget { count, bytes };
        let mut c: Checkpoints<u32> = Checkpoints::default();
        for op in ops {
            match op {
                Op::Insert { pos, bytes: b } => {
                    let kept = c.insert(pos, b, pos, budget);
                    prop_assert_eq!(kept, count > 0 && b <= bytes);
                    if kept {
                        // The newest is never the one thinned away, and holds its own state.
                        let found = c.at_or_before(pos).unwrap();
                        prop_assert_eq!((found.pos, found.state, found.bytes), (pos, pos, b));
                    }
                }
                Op::Truncate(pos) => {
                    c.truncate(pos);
                    prop_assert!(c.positions().all(|p| p <= pos));
                }
            }
            let kept: Vec<u32> = c.positions().collect();
            prop_assert!(kept.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(c.len() <= count && c.bytes() <= bytes);
            for q in [0u32, 7, 99, 250, 499] {
                let want = kept.iter().copied().filter(|&p| p <= q).max();
                prop_assert_eq!(c.at_or_before(q).map(|x| x.pos), want);
            }
        }
    }
}
