//! Commits on the real default model, from Rust: a failed commit rolls every member back,
//! and commits issued at the same time from several threads are gathered into one decode.

mod common;

use std::sync::{Arc, Barrier};

use common::{context, root};
use kvfork::{Branch, BranchStore, Error};

/// What a rollback must restore: position, history, both perplexities and the snapshot.
fn state(b: &Branch) -> (i32, Vec<i32>, String, Option<Vec<f32>>) {
    let ppl = format!(
        "{:?}",
        (b.perplexity().unwrap(), b.sampling_perplexity().unwrap())
    );
    (
        b.position().unwrap(),
        b.history().unwrap(),
        ppl,
        b.logits().unwrap(),
    )
}

#[test]
fn a_commit_that_fails_rolls_every_member_back() {
    let ctx = context(64, 4);
    let full = root(&ctx, "one two three four five six seven eight nine ten");
    let a = full.fork(None).wait().unwrap();
    let b = full.fork(None).wait().unwrap();
    // `full` takes every KV cell left: a decode of `a` and `b` then finds none.
    while full.position().unwrap() < ctx.n_ctx() as i32 {
        let t = full.sample().unwrap();
        full.commit(t).wait().unwrap();
    }
    let (ta, tb) = (a.sample().unwrap(), b.sample().unwrap());
    let before = [state(&a), state(&b)];
    let result = BranchStore::new(&ctx)
        .commit(&[(a.clone(), ta), (b.clone(), tb)])
        .wait();
    assert!(matches!(result, Err(Error::KvCacheFull(_))), "{result:?}");
    assert_eq!([state(&a), state(&b)], before, "all or nothing");
    // Cells freed, the same commit succeeds: nothing was left half done.
    full.prune_keep_children().wait().unwrap();
    BranchStore::new(&ctx)
        .commit(&[(a.clone(), ta), (b.clone(), tb)])
        .wait()
        .unwrap();
    assert_eq!(a.position().unwrap(), before[0].0 + 1);
    assert_eq!(b.history().unwrap().last(), Some(&tb));
}

#[test]
fn commits_from_many_threads_at_once_share_decodes() {
    let n = 8;
    let ctx = context(1024, n as u32 + 1);
    let base = root(&ctx, "The history of the printing press begins with");
    let branches: Vec<Branch> = (0..n).map(|_| base.fork(None).wait().unwrap()).collect();
    let steps = 6;
    let before = ctx.stats();
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = branches
        .into_iter()
        .map(|b| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                for _ in 0..steps {
                    barrier.wait();
                    let t = b.sample().unwrap();
                    b.commit(t).wait().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let after = ctx.stats();
    assert_eq!(
        after.commit_requests - before.commit_requests,
        (n * steps) as u64
    );
    let decodes = after.decode_calls - before.decode_calls;
    // One decode per step when every thread's commit joins the group; some slack for a thread
    // that arrives after its group left.
    assert!(
        decodes <= (2 * steps) as u64,
        "{decodes} decodes for {steps} steps of {n} commits"
    );
}
