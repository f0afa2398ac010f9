"""Demo: stream a greedy continuation of a prompt from the default model.

usage: python -m kvfork [PROMPT] [--max-tokens N] [--temperature T] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import kvfork


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfork", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="The history of the printing press begins with")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    args = ap.parse_args(argv)

    path = args.model or kvfork.default_model_path()
    async with await kvfork.create_context(path, n_ctx=2048, n_seq_max=1) as ctx:
        branch = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=args.temperature))
        await branch.prefill(ctx.tokenize(args.prompt))
        print(args.prompt, end="", flush=True)
        start, n = time.perf_counter(), 0
        async for tok in branch.generate(max_tokens=args.max_tokens):
            print(tok.text, end="", flush=True)
            n += 1
        elapsed = time.perf_counter() - start
        print(
            f"\n\n[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, perplexity {branch.perplexity:.2f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
