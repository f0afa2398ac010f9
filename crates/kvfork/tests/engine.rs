//! The Rust API on the real default model (no Python). The model path comes from
//! KVFORK_MODEL, else the cache used by the Python package (`make test` sets it).

use std::path::PathBuf;
use std::sync::Arc;

use kvfork::{
    Branch, BranchStore, Context, ContextParams, Error, Model, ModelParams, SamplingParams,
};

fn model() -> Arc<Model> {
    let path = std::env::var_os("KVFORK_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/kvfork/gemma-3-270m-q4_k_m.gguf")
        });
    assert!(
        path.exists(),
        "model {path:?} not found: run `make setup` or set KVFORK_MODEL"
    );
    Model::load(&path, &ModelParams::default()).expect("load model")
}

fn context(n_seq_max: u32) -> Context {
    Context::new(
        model(),
        ContextParams {
            n_ctx: 1024,
            n_seq_max,
            ..Default::default()
        },
    )
    .unwrap()
}

fn greedy_root(ctx: &Context) -> Branch {
    let b = Branch::create(ctx, 0, &SamplingParams::greedy(), None).unwrap();
    b.prefill(
        ctx.tokenize("The history of the printing press begins with", true, false)
            .unwrap(),
    )
    .wait()
    .unwrap();
    b
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
