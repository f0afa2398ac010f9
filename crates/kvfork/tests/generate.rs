//! Generation from Rust: the token stream's stop rules and exact speculative decoding, on the
//! real default model (KVFORK_MODEL, else the Python package's cache).

mod common;

use common::root;
use kvfork::{Drafter, StopReason, Token};

/// A context of `n_ctx` cells and 4 sequences.
fn context(n_ctx: u32) -> kvfork::Context {
    common::context(n_ctx, 4)
}

const COUNTING: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

#[test]
fn a_token_stream_stops_at_max_tokens_and_commits_what_it_yields() {
    let ctx = context(512);
    let b = root(&ctx, COUNTING);
    let start = b.position().unwrap();
    let mut stream = b.generate(Some(6));
    let tokens: Vec<Token> = stream.by_ref().map(|p| p.unwrap().token).collect();
    assert_eq!(tokens.len(), 6);
    assert_eq!(stream.stop_reason(), Some(StopReason::MaxTokens));
    assert_eq!(b.position().unwrap(), start + 6);
    assert_eq!(&b.history().unwrap()[start as usize..], &tokens[..]);
}

#[test]
fn a_token_stream_stops_when_the_context_is_full() {
    let ctx = context(64);
    let b = root(&ctx, COUNTING);
    let mut stream = b.generate(None);
    let n = stream.by_ref().inspect(|p| assert!(p.is_ok())).count();
    assert!(n > 0);
    assert_eq!(stream.stop_reason(), Some(StopReason::ContextFull));
    assert_eq!(b.position().unwrap() as u32, ctx.n_ctx());
}

/// Guesses what followed the latest earlier occurrence of the history's last two tokens.
struct Lookup;

impl Drafter for Lookup {
    fn propose(&mut self, tokens: &[Token]) -> Vec<Token> {
        let n = tokens.len();
        if n < 3 {
            return Vec::new();
        }
        let tail = &tokens[n - 2..];
        (0..n - 2)
            .rev()
            .find(|&i| &tokens[i..i + 2] == tail)
            .map(|i| tokens[i + 2..].iter().take(8).copied().collect())
            .unwrap_or_default()
    }
}

const REPEATING: &str = "red green blue red green blue red green blue red green blue";

#[test]
fn speculative_generation_yields_the_tokens_of_plain_generation() {
    let ctx = context(512);
    let plain: Vec<Token> = root(&ctx, REPEATING)
        .generate(Some(24))
        .map(|p| p.unwrap().token)
        .collect();
    let b = root(&ctx, REPEATING);
    let mut stream = b.generate_with(Some(24), Lookup);
    let fast: Vec<Token> = stream.by_ref().map(|p| p.unwrap().token).collect();
    // A repeating text has clear greedy margins: batched rounding does not move the argmax.
    assert_eq!(fast, plain);
    let schedule = stream.schedule();
    assert_eq!(schedule.stop_reason(), Some(StopReason::MaxTokens));
    assert!(schedule.rounds() < 24, "guesses saved decodes");
    assert!(schedule.drafted() >= schedule.accepted());
}
