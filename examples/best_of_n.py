"""Best-of-N on the default model: one prefill, N forks sharing its KV, one decode per step.

usage: python examples/best_of_n.py [N] [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys

import kvfork


async def best_of_n(n: int = 4, max_tokens: int = 32) -> tuple[list[tuple[float, str]], int]:
    """N continuations of one prompt, best (lowest perplexity) first, and the decodes taken."""
    path = kvfork.default_model_path()
    async with await kvfork.create_context(path, n_ctx=2048, n_seq_max=n + 1) as ctx:
        root = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0.9, seed=7))
        await root.prefill(ctx.tokenize("The history of the printing press begins with"))
        kids = [await root.fork() for _ in range(n)]
        for i, kid in enumerate(kids):
            kid.reseed_sampler(1000 + i)
        store = kvfork.BranchStore(ctx)
        texts = {kid.handle: "" for kid in kids}
        live = list(kids)
        for _ in range(max_tokens):
            if not live:
                break
            tokens = await store.step(live)  # one decode for every live branch
            for kid, tok in zip(live, tokens):
                texts[kid.handle] += tok.text
            live = [kid for kid, tok in zip(live, tokens) if not tok.is_stop]
        ranked = sorted((kid.perplexity, texts[kid.handle]) for kid in kids)
        return ranked, int(ctx.stats()["decode_calls"])


async def main(n: int = 4, max_tokens: int = 32) -> None:
    ranked, decodes = await best_of_n(n, max_tokens)
    for ppl, text in ranked:
        print(f"ppl {ppl:6.2f} | {text!r}")
    print("decodes:", decodes)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*args))
