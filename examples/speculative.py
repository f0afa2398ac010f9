"""Exact speculative decoding, two ways, on the default model with no arguments.

1. `PromptLookup`: guesses from the branch's own history — here the model copies a list
   from its prompt, so most guesses hold and a round yields many tokens per decode.
2. `DraftModel`: guesses from a second context (any model with the same vocabulary; here
   the same small model, which agrees with itself).

Both yield exactly what plain generation yields (checked below), with fewer decodes.

usage: python examples/speculative.py
"""

from __future__ import annotations

import asyncio

import kvfork

PROMPT = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine, orange, papaya\nCopy: apple, banana,"
)


async def compare(
    ctx: kvfork.Context, draft: kvfork.Drafter, n: int
) -> tuple[bool, int, int, float, str]:
    """(same tokens, decodes plain, decodes speculative, acceptance, text)."""
    root = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
    await root.prefill(ctx.tokenize(PROMPT))
    plain_branch, spec_branch = await root.fork(), await root.fork()
    calls = ctx.stats()["decode_calls"]
    plain = [t async for t in plain_branch.generate(n)]
    mid = ctx.stats()["decode_calls"]
    stream = spec_branch.generate(n, draft=draft)
    spec = [t async for t in stream]
    end = ctx.stats()["decode_calls"]
    await root.prune_subtree()
    same = [t.token for t in plain] == [t.token for t in spec]
    text = "".join(t.text for t in spec)
    return same, int(mid - calls), int(end - mid), stream.acceptance, text


async def main(n: int = 40) -> dict[str, tuple[bool, int, int, float, str]]:
    path = kvfork.default_model_path()
    results = {}
    async with kvfork.create_context(path, n_seq_max=3) as ctx:
        results["PromptLookup"] = await compare(ctx, kvfork.PromptLookup(), n)
        async with kvfork.create_context(path, n_seq_max=2) as draft_ctx:
            drafter = kvfork.DraftModel(draft_ctx, max_draft=6)
            results["DraftModel"] = await compare(ctx, drafter, n)
            drafter.close()
    for name, (same, plain, spec, acceptance, _text) in results.items():
        print(
            f"{name}: same tokens: {same}; decodes {plain} -> {spec}; acceptance {acceptance:.0%}"
        )
    print("\n" + PROMPT + results["PromptLookup"][4])
    return results


if __name__ == "__main__":
    asyncio.run(main())
