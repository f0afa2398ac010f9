"""Best-of-N requests served by a pool of Ray actors, against one in-process context.

Each request is a whole branch program (prefill, N seeded forks, one decode per step for all
of them, the best by perplexity) and runs inside an actor, where its KV lives; only the
prompt goes in and only the winning text comes back. Concurrent requests on one actor share
its decodes, as tasks in one process do.

usage: python examples/ray_best_of_n.py [REQUESTS] [ACTORS] [N] [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import kvfork
import kvfork.ray as kray
import ray

PROMPTS = [
    "The history of the printing press begins with",
    "A good cup of coffee needs",
    "The first thing to know about volcanoes is",
    "In the middle of the ocean there is",
]


async def ranked(
    ctx: kvfork.Context, prompt: str, n: int, max_tokens: int
) -> list[tuple[str, float]]:
    """N forks of the prompt (seeds 0..N-1), each continuation with its perplexity, best
    first."""
    root = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0.8, top_k=40))
    await root.prefill(ctx.tokenize(prompt))
    kids = [await root.fork(seed=seed) for seed in range(n)]
    store = kvfork.BranchStore(ctx)
    texts = {kid.handle: "" for kid in kids}
    live = list(kids)
    for _ in range(max_tokens):
        if not live:
            break
        tokens = await store.step(live)
        for kid, tok in zip(live, tokens):
            texts[kid.handle] += tok.text
        live = [kid for kid, tok in zip(live, tokens) if not tok.is_stop]
    out = sorted(((texts[k.handle], k.perplexity) for k in kids), key=lambda r: r[1])
    await root.prune_subtree()
    return out


async def best_of_n(ctx: kvfork.Context, prompt: str, n: int, max_tokens: int) -> str:
    """One request: the lowest-perplexity continuation of N."""
    return (await ranked(ctx, prompt, n, max_tokens))[0][0]


async def serve(
    requests: int = 32, actors: int = 2, n: int = 4, max_tokens: int = 24
) -> tuple[list[str], float, float]:
    """Run `requests` best-of-`n` requests on a pool of `actors` actors (one thread each), then
    on one in-process context; the pool's answers and both throughputs in requests/s."""
    path = kvfork.default_model_path()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    # Room for every request a context may hold at once: each takes n + 1 leases.
    per_actor = -(-requests // actors)
    pool_options: dict[str, Any] = {
        "n_ctx": 4096,
        "n_seq_max": min(256, per_actor * (n + 1)),
        "n_threads": 1,  # one core per actor: batched steps too
        "n_threads_batch": 1,
    }
    local_options: dict[str, Any] = {"n_ctx": 4096, "n_seq_max": min(256, requests * (n + 1))}
    if not ray.is_initialized():
        ray.init(num_cpus=actors, include_dashboard=False, log_to_driver=False)
    async with kray.ContextPool(path, num_actors=actors, **pool_options) as pool:
        await pool.ready()  # model loads are not part of the throughput
        start = time.perf_counter()
        answers = await asyncio.gather(*(pool.run(best_of_n, p, n, max_tokens) for p in prompts))
        pool_rate = requests / (time.perf_counter() - start)

    async with kvfork.create_context(path, **local_options) as ctx:
        start = time.perf_counter()
        await asyncio.gather(*(best_of_n(ctx, p, n, max_tokens) for p in prompts))
        local_rate = requests / (time.perf_counter() - start)
    return answers, pool_rate, local_rate


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:5]]
    answers, pool_rate, local_rate = asyncio.run(serve(*args))
    for prompt, answer in list(zip(PROMPTS, answers))[:4]:
        print(f"{prompt!r} -> {answer!r}")
    print(f"pool: {pool_rate:.2f} requests/s   one in-process context: {local_rate:.2f} requests/s")
