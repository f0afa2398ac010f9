//! The Rust API on the real default model (no Python). The model path comes from
//! KVFORK_MODEL, else the cache used by the Python package (`make test` sets it).

mod common;

use common::model;
use kvfork::{Branch, BranchStore, Context, ContextParams, Error, SamplingParams};

fn context(n_seq_max: u32) -> Context {
    common::context(1024, n_seq_max)
}

fn greedy_root(ctx: &Context) -> Branch {
    common::root(ctx, "The history of the printing press begins with")
}

fn continue_greedy(b: &Branch, n: usize) -> Vec<i32> {
    (0..n)
        .map(|_| {
            let t = b.sample().unwrap();
            b.commit(t).wait().unwrap();
            t
        })
        .collect()
}

#[test]
fn greedy_generation_is_deterministic() {
    let (a, b) = (context(2), context(4));
    assert_eq!(
        continue_greedy(&greedy_root(&a), 16),
        continue_greedy(&greedy_root(&b), 16)
    );
}

#[test]
fn fork_shares_prefix_and_continues_like_parent() {
    let ctx = context(4);
    let root = greedy_root(&ctx);
    let child = root.fork(None).wait().unwrap();
    assert_eq!(child.position().unwrap(), root.position().unwrap());
    assert_eq!(child.fork_head().unwrap() as i32, root.position().unwrap());
    assert_eq!(child.parent().unwrap(), root);
    let expected = continue_greedy(&root, 8);
    assert_eq!(continue_greedy(&child, 8), expected);
}

#[test]
fn store_commit_is_one_decode() {
    let ctx = context(8);
    let root = greedy_root(&ctx);
    let kids: Vec<Branch> = (0..6).map(|_| root.fork(None).wait().unwrap()).collect();
    let store = BranchStore::new(&ctx);
    let before = ctx.stats().decode_calls;
    let entries: Vec<(Branch, i32)> = kids
        .iter()
        .map(|b| (b.clone(), b.sample().unwrap()))
        .collect();
    store.commit(&entries).wait().unwrap();
    assert_eq!(ctx.stats().decode_calls - before, 1);
    for b in &kids {
        assert_eq!(b.position().unwrap(), root.position().unwrap() + 1);
    }
}

#[test]
fn leases_exhaust_and_recycle() {
    let ctx = context(2);
    let a = greedy_root(&ctx);
    let b = a.fork(None).wait().unwrap();
    assert!(matches!(
        a.fork(None).wait(),
        Err(Error::LeaseExhausted { n_seq_max: 2 })
    ));
    b.prune().wait().unwrap();
    assert!(matches!(a.prune().wait(), Ok(())));
    assert_eq!(ctx.available(), 2);
}

#[test]
fn commits_over_n_batch_split_into_one_rollback_unit() {
    let ctx = Context::new(
        model(),
        ContextParams {
            n_ctx: 1024,
            n_batch: 4,
            n_seq_max: 11,
            ..Default::default()
        },
    )
    .unwrap();
    let root = greedy_root(&ctx);
    let kids: Vec<Branch> = (0..9).map(|_| root.fork(None).wait().unwrap()).collect();
    let expected = continue_greedy(&root.fork(None).wait().unwrap(), 1)[0];
    let before = ctx.stats().decode_calls;
    let produced = BranchStore::new(&ctx).step(&kids).wait().unwrap();
    assert_eq!(ctx.stats().decode_calls - before, 3); // ceil(9 / 4)
    assert!(produced.iter().all(|p| p.token == expected));
}

#[test]
fn a_queued_job_cancelled_never_runs() {
    let ctx = context(4);
    let a = greedy_root(&ctx);
    let b = Branch::create(&ctx, 0, &SamplingParams::greedy(), None).unwrap();
    let long: Vec<i32> = std::iter::repeat_n(9259, 600).collect();
    let busy = b.prefill(long);
    let commit = a.commit(a.sample().unwrap());
    assert_eq!(commit.cancel(), kvfork::Cancel::Prevented);
    busy.wait().unwrap();
    assert!(matches!(commit.wait(), Err(Error::Cancelled(_))));
    let position = a.position().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(a.position().unwrap(), position);
}

#[test]
fn a_running_prefill_is_aborted_and_rolled_back() {
    let ctx = context(2);
    let b = Branch::create(&ctx, 0, &SamplingParams::greedy(), None).unwrap();
    let long: Vec<i32> = std::iter::repeat_n(9259, 1000).collect();
    let prefill = b.prefill(long);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(prefill.cancel(), kvfork::Cancel::Aborting);
    assert!(matches!(prefill.wait(), Err(Error::Cancelled(_))));
    assert_eq!(b.position().unwrap(), 0);
    assert_eq!(ctx.kv_seq_pos_max(b.seq_id().unwrap()).wait().unwrap(), -1);
}

#[test]
fn an_engine_panic_is_reported_and_closes_the_context() {
    let ctx = context(2);
    let b = greedy_root(&ctx);
    let err = ctx.debug_panic().wait().unwrap_err();
    assert!(
        matches!(&err, Error::Internal(m) if m.contains("debug_panic")),
        "{err}"
    );
    assert!(ctx.is_closed());
    assert!(matches!(b.commit(1).wait(), Err(Error::Internal(m)) if m.contains("panic")));
}

#[test]
fn scores_match_the_snapshot_logprobs_and_a_store_packs_runs_into_one_decode() {
    let ctx = context(6);
    let root = greedy_root(&ctx);
    let answer = ctx.tokenize(" a new way to print", false, false).unwrap();
    let alone = root.fork(None).wait().unwrap();
    let first = alone.logprob(answer[0]).unwrap();
    let scores = alone.score(answer.clone(), 2).wait().unwrap();
    assert_eq!(scores.len(), answer.len());
    assert!((scores[0].logprob - first).abs() < 1e-6);
    assert!(scores.iter().all(|s| s.logprob <= 0.0 && s.top.len() == 2));
    assert!(scores.iter().all(|s| s.top[0].1 >= s.logprob));
    assert_eq!(alone.history().unwrap(), {
        let mut h = root.history().unwrap();
        h.extend(&answer);
        h
    });

    let forks: Vec<Branch> = (0..3).map(|_| root.fork(None).wait().unwrap()).collect();
    let before = ctx.stats().decode_calls;
    let entries = forks.iter().map(|b| (b.clone(), answer.clone())).collect();
    let packed = BranchStore::new(&ctx).score(entries, 0).wait().unwrap();
    assert_eq!(ctx.stats().decode_calls - before, 1);
    for run in &packed {
        for (p, s) in run.iter().zip(&scores) {
            assert!((p.logprob - s.logprob).abs() < 0.5, "{p:?} vs {s:?}");
        }
    }

    // Nothing to score a fresh branch's first token from.
    let fresh = Branch::create(&ctx, 0, &SamplingParams::greedy(), None).unwrap();
    assert!(fresh.score(answer, 0).wait().is_err());
    assert_eq!(fresh.position().unwrap(), 0);
}
