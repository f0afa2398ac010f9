"""Warm multi-turn chat against re-rendering and re-prefilling every turn (cold).

Per turn: tokens prefilled and wall time (prefill + a short greedy reply), same model, same
run. usage: python benchmarks/bench_chat.py [--turns 4] [--reply-tokens 16]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import kvfork

GREEDY = kvfork.SamplingParams(temperature=0.0)
SYSTEM = "You are a patient assistant who answers briefly and politely. " * 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply-tokens", type=int, default=16)
    args = ap.parse_args()
    model = kvfork.Model.load(kvfork.default_chat_model_path())
    questions = [f"Question {i}: name a colour, a fruit and an animal." for i in range(args.turns)]
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        chat = kvfork.Chat(ctx, params=GREEDY, system=SYSTEM)
        print(f"# warm vs cold chat turns: {model.name}, reply {args.reply_tokens} tokens")
        print(
            "| turn | warm tokens prefilled | warm time | cold tokens prefilled | cold time | saved |"
        )
        print("|---|---|---|---|---|---|")
        for turn, q in enumerate(questions, 1):
            before = chat.prefilled_tokens
            t0 = time.perf_counter()
            chat.send_sync(q, max_tokens=args.reply_tokens)
            warm = time.perf_counter() - t0
            warm_tokens = chat.prefilled_tokens - before
            cold_tokens, cold = cold_turn(ctx, chat.messages[:-1], args.reply_tokens)
            print(
                f"| {turn} | {warm_tokens} | {warm * 1e3:.0f} ms | {cold_tokens} | "
                f"{cold * 1e3:.0f} ms | {(cold - warm) * 1e3:.0f} ms |"
            )


def cold_turn(ctx: kvfork.Context, messages: list[dict[str, Any]], n: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    chat = ctx.format_chat(messages)
    toks = ctx.tokenize(chat.prompt, parse_special=True)
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(toks)
    for _ in b.generate_sync(max_tokens=n):
        pass
    elapsed = time.perf_counter() - t0
    b.prune_sync()
    return len(toks), elapsed


if __name__ == "__main__":
    main()
