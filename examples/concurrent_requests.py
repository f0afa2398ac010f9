"""Serve many requests at once: one asyncio task per request, each with its own branch.

The tasks know nothing of each other, yet the engine packs their prefills together and
gathers one token from every task into each `llama_decode`, so N requests cost about one
decode per generated token, as a hand-written batched loop would. Each task gets exactly the
tokens it would get alone (its own seeded sampler), and a request that fails (here: a prompt
too long for the context) fails alone.

usage: python examples/concurrent_requests.py [N] [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys

import kvfork

TOPICS = ["the printing press", "bread", "the solar system", "harbours", "rivers", "chess"]


async def answer(ctx: kvfork.Context, i: int, prompt: str, max_tokens: int) -> str:
    """One request: its own branch, prefilled, then streamed until a stop or max_tokens."""
    branch = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0.7, seed=i))
    try:
        await branch.prefill(ctx.tokenize(prompt))
        return "".join([tok.text async for tok in branch.generate(max_tokens=max_tokens)])
    finally:
        await branch.prune()


async def serve(n: int = 8, max_tokens: int = 24) -> tuple[list[str | BaseException], float]:
    """Answer n requests concurrently (plus one that is too long); (replies, decodes/token)."""
    path = kvfork.default_model_path()
    async with kvfork.create_context(path, n_ctx=1024, n_seq_max=n + 1) as ctx:
        prompts = [f"A short note about {TOPICS[i % len(TOPICS)]}:" for i in range(n)]
        prompts.append("word " * 2000)  # longer than n_ctx: only this request fails
        before = int(ctx.stats()["decode_calls"])
        replies = await asyncio.gather(
            *(answer(ctx, i, p, max_tokens) for i, p in enumerate(prompts)),
            return_exceptions=True,
        )
        decodes = int(ctx.stats()["decode_calls"]) - before
    return replies, decodes / max_tokens


async def main(n: int = 8, max_tokens: int = 24) -> None:
    replies, per_token = await serve(n, max_tokens)
    for i, reply in enumerate(replies):
        shown = f"{type(reply).__name__}: {reply}" if isinstance(reply, BaseException) else reply
        print(f"[{i}] {shown!r}"[:110])
    print(f"{n} requests: {per_token:.2f} decodes per generated token (1.0 is one per step)")


if __name__ == "__main__":
    asyncio.run(main(*(int(a) for a in sys.argv[1:3])))
