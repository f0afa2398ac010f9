"""Infinite context: stream 3 × n_ctx tokens through a small context.

The simple way is `generate(on_context_full="shift")`: at the end of the context the branch
keeps the first `keep` tokens and the most recent half of the rest (llama.cpp's context
shift) and goes on (`shifted`). By hand, `reseed_context` empties the KV and re-prefills the
attention sinks (the prompt's first tokens) plus the last `tail` tokens (`stream`). Either
way the sampler, penalties and perplexity trackers carry on.

usage: python examples/infinite_context.py [N_CTX] [TAIL]
"""

from __future__ import annotations

import asyncio
import sys

import kvfork


async def stream(n_ctx: int = 256, tail: int = 64) -> tuple[int, float, str]:
    """Generate 3 × n_ctx tokens; returns (tokens, perplexity, text)."""
    model = kvfork.default_model_path()
    async with await kvfork.create_context(model, n_ctx=n_ctx, n_seq_max=1) as ctx:
        params = kvfork.SamplingParams(temperature=0.7, seed=2, repeat_penalty=1.1)
        branch = kvfork.Branch.create(ctx, 0, params)
        sinks = ctx.tokenize("Chapter one. It was a cold morning in the village, and")
        await branch.prefill(sinks)
        target, produced, pieces = 3 * ctx.n_ctx, 0, []
        while True:
            room = ctx.n_ctx - 1 - branch.position
            async for tok in branch.generate(min(room, target - produced)):
                pieces.append(tok.text)
                produced += 1
            if produced >= target:
                return produced, branch.perplexity, "".join(pieces)
            # Out of room (or the model ended a text): keep the sinks and the recent tail.
            await branch.reseed_context(sinks, tail)


async def shifted(n_ctx: int = 256) -> tuple[int, int, str]:
    """Generate 3 × n_ctx tokens with automatic context shifts; returns (tokens, shifts,
    text). The end-of-generation tokens are banned so that the stream cannot stop early."""
    model = kvfork.default_model_path()
    async with await kvfork.create_context(model, n_ctx=n_ctx, n_seq_max=1) as ctx:
        params = kvfork.SamplingParams(temperature=0.7, seed=2, repeat_penalty=1.1)
        branch = kvfork.Branch.create(ctx, 0, params)
        stops = [t for t in range(ctx.vocab_size) if ctx.is_stop_token(t)]
        branch.set_logit_bias({t: float("-inf") for t in stops})
        await branch.prefill(ctx.tokenize("Chapter one. It was a cold morning in the village, and"))
        tokens = branch.generate(3 * ctx.n_ctx, on_context_full="shift", keep=4)
        pieces = [tok.text async for tok in tokens]
        return len(pieces), tokens.shifts, "".join(pieces)


def main() -> None:
    n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    tail = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    produced, ppl, text = asyncio.run(stream(n_ctx, tail))
    print(text)
    print(f"\n[{produced} tokens through n_ctx = {n_ctx}; perplexity {ppl:.2f}]")
    produced, shifts, text = asyncio.run(shifted(n_ctx))
    print(text)
    print(f"\n[{produced} tokens through n_ctx = {n_ctx} with {shifts} context shifts]")


if __name__ == "__main__":
    main()
