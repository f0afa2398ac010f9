"""`kvfork serve --ray` routing: how much of the follow-ups' prompts a cache serves, by policy,
and the cluster's throughput beside one process at the same total thread count, in one run.

Workload (default model, greedy, `/v1/completions`, TOKENS tokens each): PREAMBLES distinct
~800-token preambles, PER requests each (the preamble plus its own question). The first
request of each preamble is sent alone, one after another; then the other requests all at
once, in a shuffled (seeded) order. Servers, each started cold on 127.0.0.1:
- `--ray local --actors 2 --threads 1` with `--route affinity`, `hash` and `random`;
- one process, `--threads 2`.
Reported: the share of the follow-ups' prompt tokens served from a cache
(`usage.prompt_tokens_details.cached_tokens`), the burst's wall time and its completion
tokens per second; medians over ROUNDS (servers interleaved round by round).

    .venv/bin/python benchmarks/bench_serve_ray.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

import openai
from bench_serve import ServerSpec, preamble, start

PREAMBLES = 4
PER = 8
TOKENS = 16
CLUSTER = ["--ray", "local", "--actors", "2", "--threads", "1", "--n-ctx", "8192"]
SETUPS = {
    "2 actors × 1 thread, affinity": [*CLUSTER, "--route", "affinity"],
    "2 actors × 1 thread, hash": [*CLUSTER, "--route", "hash"],
    "2 actors × 1 thread, random": [*CLUSTER, "--route", "random"],
    "1 process × 2 threads": ["--threads", "2", "--n-ctx", "16384"],
}


@dataclass
class Result:
    cached_share: float
    wall: float
    tokens_per_s: float


def prompts() -> list[list[str]]:
    """For each preamble, its PER prompts (~800 tokens of preamble, then a question)."""
    return [
        [
            f"{preamble(560, 10 + k)}\nQuestion {j}: what does note {j} say? Answer:"
            for j in range(PER)
        ]
        for k in range(PREAMBLES)
    ]


def serve(name: str, flags: list[str]) -> ServerSpec:
    """`kvfork serve default` with `flags`, started by bench_serve's `start` (its log's tail
    says why when it fails)."""
    command = [sys.executable, "-m", "kvfork", "serve", "default"]
    return ServerSpec(name, lambda port: [*command, "--port", str(port), *flags])


async def run(url: str, order_seed: int) -> Result:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)

    async def ask(prompt: str) -> openai.types.Completion:
        return await client.completions.create(
            model="m", prompt=prompt, max_tokens=TOKENS, temperature=0
        )

    groups = prompts()
    for group in groups:  # the first of each preamble, alone
        await ask(group[0])
    rest = [p for group in groups for p in group[1:]]
    random.Random(order_seed).shuffle(rest)
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(ask(p) for p in rest))
    wall = time.perf_counter() - t0
    await client.close()
    prompt = cached = completion = 0
    for r in replies:
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        prompt += r.usage.prompt_tokens
        cached += r.usage.prompt_tokens_details.cached_tokens or 0
        completion += r.usage.completion_tokens
    return Result(cached / prompt, wall, completion / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[Result]] = {name: [] for name in SETUPS}
    for r in range(args.rounds):
        for name, flags in SETUPS.items():
            proc, url, log = start(serve(name, flags))
            try:
                results[name].append(asyncio.run(run(url, order_seed=r)))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
            last = results[name][-1]
            print(
                f"round {r + 1} {name}: cached {last.cached_share:.1%}, "
                f"wall {last.wall:.2f} s, {last.tokens_per_s:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    base = statistics.median(x.tokens_per_s for x in results["1 process × 2 threads"])
    print(
        f"\n{PREAMBLES} preambles × {PER} requests; the {PREAMBLES * (PER - 1)} follow-ups at once"
    )
    print(
        "| setup | follow-ups' prompt tokens from a cache | burst wall | tokens/s | vs 1 process |"
    )
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        tps = statistics.median(x.tokens_per_s for x in rs)
        print(
            f"| {name} | {statistics.median(x.cached_share for x in rs):.1%} "
            f"| {statistics.median(x.wall for x in rs):.2f} s | {tps:.1f} | {tps / base:.2f}× |"
        )


if __name__ == "__main__":
    main()
