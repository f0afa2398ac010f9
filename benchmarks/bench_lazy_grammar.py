"""Cost of a lazy grammar waiting for its trigger, beside no grammar.

A branch generates `--tokens` tokens of a long piece (a bias forces it: ~48 bytes a token, so
the output grows fast) while a lazy grammar waits for a trigger that never comes. Side by side
in one process, seconds for the whole generation:
- no grammar;
- a trigger word (kvfork watches it);
- the usual pattern `[\\s\\S]*?(NEVER)[\\s\\S]*` (kvfork's `regex` matcher);
- 64 such patterns (all searched in one pass).
Before kvfork watched the triggers, llama.cpp searched them with `std::regex` over the whole
output after every token (BENCHMARKS §32 has that row, measured at commit 143fa03).

usage: python benchmarks/bench_lazy_grammar.py [--tokens 200]
"""

from __future__ import annotations

import argparse
import time

import kvfork

PATTERN = r"[\s\S]*?(NEVER)[\s\S]*"
VARIANTS: dict[str, tuple[list[str], list[str]] | None] = {
    "no grammar": None,
    "trigger word": (["NEVER"], []),
    "pattern": ([], [PATTERN]),
    # Many tool names, each its own trigger: searched in one pass (a RegexSet).
    "64 patterns": ([], [PATTERN.replace("NEVER", f"NEVER{i}x") for i in range(64)]),
}


def seconds(
    ctx: kvfork.Context, piece: int, tokens: int, lazy: tuple[list[str], list[str]] | None
) -> float:
    b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0.0))
    b.prefill_sync(ctx.tokenize("x"))
    if lazy is not None:
        words, patterns = lazy
        b.set_grammar_lazy('root ::= "a"', words, patterns=patterns)
    b.set_logit_bias({piece: 1000.0})
    start = time.perf_counter()
    n = sum(1 for _ in b.generate_sync(tokens))
    elapsed = time.perf_counter() - start
    b.prune_sync()
    assert n == tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    model = kvfork.Model.load(kvfork.default_model_path())
    with kvfork.create_context_sync(model, n_ctx=max(1024, args.tokens + 64), n_seq_max=1) as ctx:
        piece = max(range(ctx.vocab_size), key=lambda t: len(ctx.token_to_bytes(t)))
        size = len(ctx.token_to_bytes(piece))
        print(f"{args.tokens} tokens of a {size}-byte piece ({args.tokens * size} bytes of output)")
        base = None
        for name, lazy in VARIANTS.items():
            s = seconds(ctx, piece, args.tokens, lazy)
            base = base or s
            print(f"  {name:30} {s:7.2f} s  {s / base:6.2f}x")


if __name__ == "__main__":
    main()
