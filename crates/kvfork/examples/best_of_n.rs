//! Best-of-N from Rust: prefill a prompt once, fork N branches that share its KV cells,
//! advance all N with one decode per step, keep the branch with the lowest perplexity.
//!
//! cargo run --release -p kvfork --example best_of_n -- MODEL.gguf [N] [TOKENS]
#![allow(clippy::print_stdout, reason = "an example shows its results")]

use kvfork::{Branch, BranchStore, Context, ContextParams, Model, ModelParams, SamplingParams};

fn main() -> kvfork::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .or_else(|| std::env::var("KVFORK_MODEL").ok())
        .expect("usage: best_of_n MODEL.gguf [N] [TOKENS]");
    let n: u32 = args.next().map_or(4, |s| s.parse().expect("N"));
    let max_tokens: usize = args.next().map_or(24, |s| s.parse().expect("TOKENS"));

    let model = Model::load(&path, &ModelParams::default())?;
    let ctx = Context::new(
        model,
        ContextParams {
            n_seq_max: n + 1,
            ..Default::default()
        },
    )?;
    let prompt = ctx.tokenize("The history of the printing press begins with", true, false)?;

    let root = Branch::create(
        &ctx,
        0,
        &SamplingParams {
            seed: Some(1),
            ..Default::default()
        },
        None,
    )?;
    root.prefill(prompt).wait()?;
    let mut branches = Vec::new();
    for i in 0..n {
        branches.push(root.fork(Some(1000 + i)).wait()?);
    }

    let store = BranchStore::new(&ctx);
    let mut texts = vec![String::new(); branches.len()];
    let mut live: Vec<usize> = (0..branches.len()).collect();
    for _ in 0..max_tokens {
        if live.is_empty() {
            break;
        }
        let batch: Vec<Branch> = live.iter().map(|&i| branches[i].clone()).collect();
        let produced = store.step(&batch).wait()?;
        let mut still = Vec::new();
        for (&i, p) in live.iter().zip(&produced) {
            texts[i].push_str(&p.text);
            if !p.is_stop {
                still.push(i);
            }
        }
        live = still;
    }

    let mut best = 0;
    for (i, b) in branches.iter().enumerate() {
        let ppl = b.perplexity()?;
        println!("[{i}] ppl {ppl:7.3} | {}", texts[i].replace('\n', " "));
        if ppl < branches[best].perplexity()? {
            best = i;
        }
    }
    println!("best: [{best}]  decodes: {}", ctx.stats().decode_calls);
    store.retain_only(&branches[best]).wait()?;
    println!("after retain_only: {} leases free", store.available());
    Ok(())
}
