"""Beam search and diverse beam search on the default model, with no arguments.

Each step advances every beam with one decode; a beam kept twice is forked (no tensor
copy), a dropped one pruned. Diverse groups pay a penalty for a token an earlier group
already chose at the same step, so their beams start differently.

usage: python examples/beam_search.py
"""

from __future__ import annotations

import asyncio

import kvfork
from kvfork.patterns import Beam, beam_search

PROMPT = "The best thing about living near the sea is"


async def search(width: int = 4, max_tokens: int = 12) -> tuple[list[Beam], list[Beam], int]:
    """(plain beams, diverse beams, decodes the plain search took)."""
    async with kvfork.create_context(kvfork.default_model_path(), n_seq_max=width + 2) as ctx:
        start = kvfork.Branch.create(ctx)
        await start.prefill(ctx.tokenize(PROMPT))
        before = ctx.stats()["decode_calls"]
        plain = await beam_search(start, width, max_tokens, length_penalty=1.0)
        decodes = int(ctx.stats()["decode_calls"] - before)
        diverse = await beam_search(
            start, width, max_tokens, length_penalty=1.0, groups=width, diversity=5.0
        )
        await start.prune()
        return plain, diverse, decodes


def show(title: str, beams: list[Beam]) -> None:
    print(title)
    for b in beams:
        print(f"  {b.score:7.3f}  {PROMPT}{b.text!r}")


async def main() -> None:
    plain, diverse, decodes = await search()
    show(f"beam search, width {len(plain)} ({decodes} decodes for 12 steps):", plain)
    show("diverse beam search, one beam per group:", diverse)


if __name__ == "__main__":
    asyncio.run(main())
