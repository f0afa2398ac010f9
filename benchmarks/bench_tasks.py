"""Independent asyncio tasks against one store loop: do tasks share decodes as well?

For each N (tasks) and chain (greedy, the default chain at temperature 0.8), the same work
is run two ways, back to back in the same process, on a context with `n_seq_max = N`:

- **tasks**: N asyncio tasks, each with its own branch and prompt: `prefill`, then
  `steps` × (`produce` + `commit`), or the same through `generate()` (`--style generate`);
- **store**: one `store.prefill` of the N prompts, then `steps` × `store.step`.

Prints decodes per step (prefills included; the store loop needs steps + 1 in all) and the
tasks' speed as a fraction of the store loop's (generated tokens per second, best of
`--repeat`). The table is recorded in BENCHMARKS.md §8.

usage: python benchmarks/bench_tasks.py [--ns 4,8,16,32,64] [--steps 32] [--repeat 3]
                                        [--style produce|generate] [--model GGUF]
                                        [--per-token-us 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import kvfork

THREADS = 2
PROMPTS = [
    "The history of the printing press begins with",
    "A recipe for bread needs flour, water and",
    "The largest planets of the solar system are",
    "In the morning the harbour was",
    "Rivers of Europe include the Danube, the",
    "The rules of chess say that a pawn",
]
CHAINS = {
    "greedy": lambda seed: kvfork.SamplingParams(temperature=0.0),
    "default chain": lambda seed: kvfork.SamplingParams(seed=seed),
}


def prompts(ctx: kvfork.Context, n: int) -> list[list[int]]:
    return [ctx.tokenize(f"{PROMPTS[i % len(PROMPTS)]} ({i})") for i in range(n)]


def busy(seconds: float) -> None:
    """Hold the event loop as a server does sending a token to its client."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def run_tasks(
    ctx: kvfork.Context, n: int, steps: int, chain: str, style: str, per_token: float = 0.0
) -> tuple[float, int, int]:
    """(seconds, decodes, tokens generated) for N independent tasks, each holding the event
    loop `per_token` seconds after each token."""
    toks = prompts(ctx, n)

    async def one(i: int) -> int:
        b = kvfork.Branch.create(ctx, 0, CHAINS[chain](i + 1))
        await b.prefill(toks[i])
        made = 0
        if style == "generate":
            async for _ in b.generate(max_tokens=steps):
                busy(per_token)
                made += 1
        else:
            for _ in range(steps):
                t = await b.produce()
                if t.is_stop:
                    break
                await b.commit(t)
                busy(per_token)
                made += 1
        await b.prune()
        return made

    d0 = int(ctx.stats()["decode_calls"])
    t0 = time.perf_counter()
    made = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return wall, int(ctx.stats()["decode_calls"]) - d0, sum(made)


def run_store(ctx: kvfork.Context, n: int, steps: int, chain: str) -> tuple[float, int, int]:
    """(seconds, decodes, tokens generated) for the same work as one store loop."""
    toks = prompts(ctx, n)
    store = kvfork.BranchStore(ctx)
    d0 = int(ctx.stats()["decode_calls"])
    t0 = time.perf_counter()
    live = [kvfork.Branch.create(ctx, 0, CHAINS[chain](i + 1)) for i in range(n)]
    store.prefill_sync(list(zip(live, toks, strict=True)))
    made = 0
    for _ in range(steps):
        out = store.step_sync(live)
        for b, t in zip(live, out, strict=True):
            if t.is_stop:
                b.prune_sync()
        made += sum(not t.is_stop for t in out)
        live = [b for b, t in zip(live, out, strict=True) if not t.is_stop]
        if not live:
            break
    wall = time.perf_counter() - t0
    decodes = int(ctx.stats()["decode_calls"]) - d0
    for b in live:
        b.prune_sync()
    return wall, decodes, made


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="4,8,16,32,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--style", choices=["produce", "generate"], default="produce")
    # A tiny model's decodes take about what a GPU's do: the regime where callers coming back
    # late split a step in two.
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument(
        "--per-token-us", type=float, default=0.0, help="each task's own work after a token"
    )
    args = ap.parse_args()
    model = kvfork.Model.load(args.model or kvfork.default_model_path())
    print(f"## tasks vs store loop ({args.style}, steps={args.steps}, best of {args.repeat})")
    print(
        "| tasks | chain | tasks: decodes/step | store: decodes/step "
        "| tasks tok/s | store tok/s | tasks / store |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.ns.split(",")):
        for chain in CHAINS:
            with kvfork.create_context_sync(
                model, n_ctx=max(2048, n * (args.steps + 24)), n_seq_max=n, n_threads=THREADS
            ) as ctx:
                best_t: tuple[float, int, int] | None = None
                best_s: tuple[float, int, int] | None = None
                for _ in range(args.repeat):
                    t = asyncio.run(
                        run_tasks(ctx, n, args.steps, chain, args.style, args.per_token_us / 1e6)
                    )
                    s = run_store(ctx, n, args.steps, chain)
                    if best_t is None or t[2] / t[0] > best_t[2] / best_t[0]:
                        best_t = t
                    if best_s is None or s[2] / s[0] > best_s[2] / best_s[0]:
                        best_s = s
            assert best_t is not None and best_s is not None
            rate_t, rate_s = best_t[2] / best_t[0], best_s[2] / best_s[0]
            print(
                f"| {n} | {chain} | {best_t[1] / args.steps:.2f} | {best_s[1] / args.steps:.2f} "
                f"| {rate_t:.0f} | {rate_s:.0f} | {rate_t / rate_s:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
