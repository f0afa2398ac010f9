"""How long `Context.snapshot()` and `Context.restore(data)` hold up the event loop.

A ticker task sleeps 1 ms at a time while the call is awaited; the longest gap between its
ticks is how long the loop could run nothing else. Side by side in one process, each several
times: an idle loop (the baseline), a snapshot of the whole context (its bytes made into a
Python `bytes` object), and a restore of those bytes. The state is the default model's KV in
f32 for `--tokens` prompt tokens (about 45 MB at 1,200).

usage: python benchmarks/bench_snapshot_loop.py [--tokens 1200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import kvfork


async def longest_gap(work: Callable[[], Awaitable[object]]) -> float:
    """The longest gap (seconds) between 1 ms ticks of the loop while `work` is awaited."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.02)
    await work()
    await asyncio.sleep(0.02)
    done.set()
    await ticker
    return max(gaps)


async def run(tokens: int, repeat: int) -> None:
    model = kvfork.Model.load(kvfork.default_model_path())
    async with kvfork.create_context(
        model, n_ctx=tokens + 256, n_seq_max=2, type_k="f32", type_v="f32"
    ) as ctx:
        branch = kvfork.Branch.create(ctx)
        prompt = ctx.tokenize("The history of the printing press. " * 200)[:tokens]
        await branch.prefill(prompt)
        data = await ctx.snapshot()
        print(f"state: {len(data) / 1e6:.1f} MB ({len(prompt)} tokens, f32 KV)")
        rows: dict[str, Callable[[], Awaitable[object]]] = {
            "idle": lambda: asyncio.sleep(0.2),
            "snapshot": ctx.snapshot,
            "restore": lambda: ctx.restore(data),
        }
        print("| call | longest loop gap, ms (each run) |\n|---|---|")
        for name, work in rows.items():
            gaps = [await longest_gap(work) for _ in range(repeat)]
            print(f"| {name} | {', '.join(f'{1e3 * g:.1f}' for g in gaps)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.tokens, args.repeat))


if __name__ == "__main__":
    main()
