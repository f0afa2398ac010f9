//! What the engine's integration tests share: the real default model (KVFORK_MODEL, else the
//! Python package's cache, which `make test` fills) and contexts over it.

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::sync::Arc;

use kvfork::{Branch, Context, ContextParams, Model, ModelParams, SamplingParams};

/// The default model, loaded.
pub fn model() -> Arc<Model> {
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

/// A context of `n_ctx` cells and `n_seq_max` sequences on the default model.
pub fn context(n_ctx: u32, n_seq_max: u32) -> Context {
    let params = ContextParams {
        n_ctx,
        n_seq_max,
        ..Default::default()
    };
    Context::new(model(), params).unwrap()
}

/// A greedy root branch with `text` prefilled.
pub fn root(ctx: &Context, text: &str) -> Branch {
    let b = Branch::create(ctx, 0, &SamplingParams::greedy(), None).unwrap();
    b.prefill(ctx.tokenize(text, true, false).unwrap())
        .wait()
        .unwrap();
    b
}
