"""kvfork.ray: requests/s with 1 and 2 actors, and the cost of a `pool.run` round trip.

- **throughput**: `--requests` best-of-`--n` requests (examples/ray_best_of_n.py's program)
  submitted at once to a pool of 1 actor and of 2 actors, each actor's context with 1 thread,
  and to one in-process context with 1 and with 2 threads;
- **round trip**: a job that does nothing (`pool.run` of an empty coroutine) against awaiting
  it in-process, and a short real job (one 16-token greedy generation) both ways, one at a
  time, mean of `--calls` (the greedy job's calls split over `--rounds` interleaved rounds).

The tables are recorded in BENCHMARKS.md §10.

usage: python benchmarks/bench_ray.py [--requests 32] [--n 4] [--tokens 24] [--calls 50]
                                      [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kvfork
import kvfork.ray as kray
import ray
from ray import cloudpickle

GREEDY = kvfork.SamplingParams(temperature=0.0)


def load_example() -> Any:
    path = Path(__file__).resolve().parent.parent / "examples" / "ray_best_of_n.py"
    spec = importlib.util.spec_from_file_location("ray_best_of_n", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_best_of_n"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # Ray workers cannot import it by name
    return module


async def nothing(ctx: kvfork.Context) -> int:
    return 0


async def greedy16(ctx: kvfork.Context) -> int:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    await b.prefill(ctx.tokenize("The history of the printing press begins with"))
    for _ in range(16):
        await b.commit(await b.produce())
    await b.prune()
    return 16


async def throughput(example: Any, args: argparse.Namespace, path: str) -> None:
    prompts = [example.PROMPTS[i % len(example.PROMPTS)] for i in range(args.requests)]
    leases = args.requests * (args.n + 1)

    async def batch(run: Any) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(run(example.best_of_n, p, args.n, args.tokens) for p in prompts))
        return args.requests / (time.perf_counter() - start)

    rows = []
    for actors in (1, 2):
        per_actor = -(-args.requests // actors) * (args.n + 1)
        async with kray.ContextPool(
            path,
            num_actors=actors,
            n_ctx=4096,
            n_seq_max=min(256, per_actor),
            n_threads=1,
            n_threads_batch=1,
        ) as pool:
            await pool.ready()
            await batch(pool.run)  # warm-up
            rates = [await batch(pool.run) for _ in range(args.repeat)]
            rows.append((f"pool, {actors} actor(s) x 1 thread", max(rates)))
    for threads in (1, 2):
        async with kvfork.create_context(
            path,
            n_ctx=4096,
            n_seq_max=min(256, leases),
            n_threads=threads,
            n_threads_batch=threads,
        ) as ctx:

            async def local(fn: Any, *a: Any) -> Any:
                return await fn(ctx, *a)

            await batch(local)
            rates = [await batch(local) for _ in range(args.repeat)]
            rows.append((f"in-process, 1 context x {threads} thread(s)", max(rates)))
    base = rows[0][1]
    print(
        f"\n{args.requests} best-of-{args.n} requests, {args.tokens} tokens, best of {args.repeat}"
    )
    print("| setup | requests/s | vs 1 actor |\n|---|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.2f} | {rate / base:.2f}x |")


async def round_trip(args: argparse.Namespace, path: str) -> None:
    async def mean_ms(call: Any, calls: int = args.calls) -> float:
        await call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await call()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.mean(times)

    one_thread = {"n_ctx": 1024, "n_threads": 1, "n_threads_batch": 1}
    async with (
        kray.ContextPool(path, num_actors=1, **one_thread) as pool,
        kvfork.create_context(path, **one_thread) as ctx,
    ):
        await pool.ready()
        local_nothing = await mean_ms(lambda: nothing(ctx))
        pool_nothing = await mean_ms(lambda: pool.run(nothing))
        # Interleaved, so that drift of this VM's speed falls on both alike.
        local_greedy = pool_greedy = 0.0
        for _ in range(args.rounds):
            per_round = max(1, args.calls // args.rounds)
            local_greedy += await mean_ms(lambda: greedy16(ctx), per_round) / args.rounds
            pool_greedy += await mean_ms(lambda: pool.run(greedy16), per_round) / args.rounds
    print(f"\nround trip, one job at a time, mean of {args.calls} (1 thread)")
    print("| job | in-process ms | pool.run ms | added ms |\n|---|---|---|---|")
    print(
        f"| empty | {local_nothing:.3f} | {pool_nothing:.2f} | {pool_nothing - local_nothing:.2f} |"
    )
    print(
        f"| 16-token greedy | {local_greedy:.1f} | {pool_greedy:.1f} | "
        f"{pool_greedy - local_greedy:.1f} ({pool_greedy / local_greedy - 1:+.1%}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    path = str(kvfork.default_model_path())
    example = load_example()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(throughput(example, args, path))
        asyncio.run(round_trip(args, path))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
