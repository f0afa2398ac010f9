"""A warm-up before the first request: the decode shapes a server meets, run once on a
throwaway branch so that the first burst of requests does not pay for the device's first use.

On a GPU the first decode of each shape loads its kernels (CUDA loads them lazily) and sets up
the math libraries, which llama-server also pays before it reports ready (its warm-up run). On
the CPU there is nothing to gain (BENCHMARKS §25): `kvfork serve --warmup auto` warms only when
the model's layers are offloaded.
"""

from __future__ import annotations

import time

from .._native import Branch, BranchStore, Context, SamplingParams, system_info

#: Branches stepped together in the warm-up: the size class of a burst of streams.
STEP_BRANCHES = 16


def wanted(choice: str) -> bool:
    """Whether `--warmup CHOICE` (auto, on, off) warms: auto only with a GPU backend."""
    if choice == "auto":
        return bool(system_info()["gpu_offload"])
    return choice == "on"


async def warm_up(ctx: Context) -> float:
    """Prefill one full batch, step a few forks together, then step one alone, on branches
    pruned afterwards (every lease and cell back); the seconds it took."""
    t0 = time.perf_counter()
    prompt = _tokens(ctx, min(ctx.n_batch, ctx.n_ctx // 2))
    greedy = SamplingParams(temperature=0.0)
    root = Branch.create(ctx, 0, greedy)
    try:
        await root.prefill(prompt)
        # Each fork holds a lease and a cell per step: stay within both.
        room = ctx.n_ctx - len(prompt) - 2
        forks = [await root.fork() for _ in range(min(STEP_BRANCHES, ctx.n_seq_max, room) - 1)]
        store = BranchStore(ctx)
        if forks:
            await store.step([root, *forks])
        await store.step([root])
    finally:
        await root.prune_subtree()
    return time.perf_counter() - t0


def _tokens(ctx: Context, n: int) -> list[int]:
    """`n` tokens of ordinary text (never empty)."""
    text = "The river carried salt and music past the bridges of the market town. "
    once = ctx.tokenize(text, add_special=False) or ctx.tokenize(text)
    return (once * (n // len(once) + 1))[: max(n, 1)]
