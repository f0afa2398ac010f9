"""BranchStore throughput against the peer, decode overhead, fork cost, KV sharing.

Prints four tables (recorded in BENCHMARKS.md):

1. aggregate generated tokens/s vs N for `store.step` (greedy and the default chain),
   for N sequential `Branch.commit`s, and for the peer's hand-written batched loop
   (`peer_batched.py`, run as a subprocess with the peer's own Python), each N
   measured back to back in the same run, same model, same threads (both thread counts
   pinned to 2, as the peer's); plus greedy with kvfork's default adaptive thread count;
2. the time inside the bare `llama_decode` of those batches and kvfork's overhead above it;
3. `fork()` time vs prefix length;
4. KV memory: 16 forks of a 1,500-token prefix, 64 tokens each, in n_ctx = 4,096;
5. a step of N branches with its output rows padded to whole tiles of the CPU's output
   matmul and without (`KVFORK_NO_OUTPUT_PADDING`), two contexts side by side;
6. (`--only device`, not in the default set) steps with `device_sampling=True` beside the
   default host rows, greedy and the default chain, and greedy with one of the N branches
   biased (its whole row comes back, and with it every output's row of that decode).

usage: python benchmarks/bench_store.py [--steps 32] [--ns 1,2,4,8,16,32]
                                        [--peer-python .venv-peer/bin/python] [--skip-peer]
                                        [--only throughput,fork,kv,padding,device]
The peer's venv: `make peer`; without it the peer column is skipped.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kvfork
from peer_batched import DEFAULT_PEER_PYTHON, peer_batched

PROMPT = "The history of the printing press begins with"
THREADS = 2
GREEDY = kvfork.SamplingParams(temperature=0.0)
DEFAULT_CHAIN = kvfork.SamplingParams(seed=1234)


def make_context(
    model: kvfork.Model,
    n_seq: int,
    n_ctx: int = 4096,
    adaptive: bool = False,
    device_sampling: bool = False,
) -> kvfork.Context:
    """A context like the peer's: both thread counts fixed (None: kvfork's adaptive default)."""
    threads = None if adaptive else THREADS
    return kvfork.create_context_sync(
        model,
        n_ctx=n_ctx,
        n_batch=512,
        n_seq_max=n_seq,
        n_threads=threads,
        n_threads_batch=threads,
        device_sampling=device_sampling,
    )


def branches_at_prompt(
    ctx: kvfork.Context, n: int, params: kvfork.SamplingParams, *, one_biased: bool = False
) -> list[kvfork.Branch]:
    """A root with the prompt prefilled plus n - 1 forks of it (n sequences, as the peer).
    `one_biased`: the last of them a root of its own with a logit bias (set before its
    prefill: a chain that needs whole rows)."""
    branches: list[kvfork.Branch] = []
    plain = n - one_biased
    if plain:
        root = kvfork.Branch.create(ctx, 0, params)
        root.prefill_sync(ctx.tokenize(PROMPT))
        kids = [root.fork_sync() for _ in range(plain - 1)]
        for i, kid in enumerate(kids):
            kid.reseed_sampler(i + 1)
        branches = [root, *kids]
    if one_biased:
        biased = kvfork.Branch.create(ctx, 0, params)
        biased.set_logit_bias({0: -1.0})
        biased.prefill_sync(ctx.tokenize(PROMPT))
        branches.append(biased)
    return branches


def timed(ctx: kvfork.Context, body: Callable[[], None]) -> tuple[float, float, int]:
    """(wall seconds, seconds inside llama_decode, tokens decoded) of `body`."""
    s0 = ctx.stats()
    t0 = time.perf_counter()
    body()
    wall = time.perf_counter() - t0
    s1 = ctx.stats()
    decode = float(s1["decode_seconds"]) - float(s0["decode_seconds"])
    tokens = int(s1["decoded_tokens"]) - int(s0["decoded_tokens"])
    return wall, decode, tokens


def run_step(
    model: kvfork.Model,
    n: int,
    steps: int,
    params: kvfork.SamplingParams,
    adaptive: bool = False,
    device_sampling: bool = False,
    one_biased: bool = False,
) -> tuple[float, float, int]:
    # Every branch's steps take cells of their own (the unified cache holds them all).
    n_ctx = max(4096, n * steps + 1024)
    with make_context(
        model, n, n_ctx=n_ctx, adaptive=adaptive, device_sampling=device_sampling
    ) as ctx:
        branches = branches_at_prompt(ctx, n, params, one_biased=one_biased)
        store = kvfork.BranchStore(ctx)

        def body() -> None:
            for _ in range(steps):
                store.step_sync(branches)

        return timed(ctx, body)


def device_sampling(args: argparse.Namespace, model: kvfork.Model) -> None:
    """Steps with `device_sampling=True` (each row's best 64 found in llama.cpp's graph, no
    row copied out) beside the default (rows lent to the host, summarized on the decode's
    threads), greedy, the default chain and greedy with one branch biased (a row for it, so
    every row of the decode copied back), the two alternating so that drift on a shared
    machine falls on both."""
    print(
        f"\n## Device sampling (store.step, steps={args.steps}, threads={THREADS}, "
        f"best of {args.repeat}, alternating)"
    )
    print(
        "| N | greedy, host rows tok/s | greedy, device | device / host "
        "| default chain, host rows | default chain, device | device / host "
        "| greedy, one biased, host rows | one biased, device | device / host |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.ns:
        cells = []
        for params, biased in ((GREEDY, False), (DEFAULT_CHAIN, False), (GREEDY, True)):
            best: dict[bool, float] = {False: 0.0, True: 0.0}
            for _ in range(args.repeat):
                for on_device in (False, True):
                    wall, _, _ = run_step(
                        model, n, args.steps, params, device_sampling=on_device, one_biased=biased
                    )
                    best[on_device] = max(best[on_device], n * args.steps / wall)
            cells += [f"{best[False]:.1f}", f"{best[True]:.1f}", f"{best[True] / best[False]:.3f}"]
        print(f"| {n} | {' | '.join(cells)} |")


def run_sequential(model: kvfork.Model, n: int, steps: int) -> tuple[float, float, int]:
    with make_context(model, n) as ctx:
        branches = branches_at_prompt(ctx, n, GREEDY)

        def body() -> None:
            for _ in range(steps):
                for b in branches:
                    b.commit_sync(b.sample())

        return timed(ctx, body)


def run_peer(python: str, model_path: str, n: int, steps: int) -> float | None:
    """The peer's batched loop for one N, in its own interpreter; tokens/s."""
    try:
        return peer_batched(python, model_path, steps, [n])[n]
    except subprocess.CalledProcessError as e:  # the peer's own failure: keep kvfork's columns
        print(f"  peer failed for N={n}: {(e.stderr or '').strip()[-300:]}", file=sys.stderr)
        return None


def throughput(args: argparse.Namespace, model: kvfork.Model) -> None:
    print(
        f"\n## 1-2. Aggregate tokens/s (steps={args.steps}, threads={THREADS}, best of {args.repeat})"
    )
    header = (
        "| N | step greedy | step default chain | step greedy, adaptive threads "
        "| N sequential commits | peer batched | greedy / peer | chain / peer "
        "| overhead above bare decode (greedy) | overhead (chain) |"
    )
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for n in args.ns:
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            runs = {
                "greedy": run_step(model, n, args.steps, GREEDY),
                "chain": run_step(model, n, args.steps, DEFAULT_CHAIN),
                "adaptive": run_step(model, n, args.steps, GREEDY, adaptive=True),
                "seq": run_sequential(model, n, max(2, args.steps // 4)),
            }
            for key, (wall, decode, tokens) in runs.items():
                rate = tokens / wall
                if key not in best or rate > best[key][0]:
                    best[key] = (rate, decode / wall)
            if not args.skip_peer:
                peer = run_peer(args.peer_python, model.path, n, args.steps)
                if peer is not None and peer > best.get("peer", (0.0, 0.0))[0]:
                    best["peer"] = (peer, math.nan)
        greedy, chain, seq = best["greedy"], best["chain"], best["seq"]
        peer_rate = best.get("peer", (math.nan, math.nan))[0]
        print(
            f"| {n} | {greedy[0]:.1f} | {chain[0]:.1f} | {best['adaptive'][0]:.1f} | {seq[0]:.1f} "
            f"| {peer_rate:.1f} | {greedy[0] / peer_rate:.2f}x | {chain[0] / peer_rate:.2f}x "
            f"| {(1 / greedy[1] - 1) * 100:.1f}% | {(1 / chain[1] - 1) * 100:.1f}% |",
            flush=True,
        )


def fork_cost(model: kvfork.Model, repeats: int = 50) -> None:
    print(f"\n## 3. fork() vs prefix length (median of {repeats}; prune timed apart)")
    print(
        "| prefix tokens | fork_sync | fork / fork at 16 | bare llama seq_cp (ctx.kv_seq_copy) | prune_sync |"
    )
    print("|---|---|---|---|---|")
    text = model_tokens(model, 2048)
    base = None
    with make_context(model, 2, n_ctx=4096) as ctx:
        for length in (16, 64, 256, 1024, 2048):
            root = kvfork.Branch.create(ctx, 0, GREEDY)
            root.prefill_sync(text[:length])
            for _ in range(5):  # warm-up
                root.fork_sync().prune_sync()
            forks, prunes, copies = [], [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                kid = root.fork_sync()
                t1 = time.perf_counter()
                kid.prune_sync()
                t2 = time.perf_counter()
                forks.append(t1 - t0)
                prunes.append(t2 - t1)
                # The bare llama.cpp call inside fork: seq_cp into the free sequence. The
                # kv_* calls are queued without waiting: one engine round trip (pos_max)
                # after the copy, minus the same round trip alone.
                free = 1 - root.seq_id
                t3 = time.perf_counter()
                ctx.kv_seq_pos_max_sync(free)
                t4 = time.perf_counter()
                ctx.kv_seq_copy(root.seq_id, free)
                ctx.kv_seq_pos_max_sync(free)
                copies.append(max(0.0, (time.perf_counter() - t4) - (t4 - t3)))
                ctx.kv_seq_remove(free)
            fork_us = statistics.median(forks) * 1e6
            base = base or fork_us
            prune_us = statistics.median(prunes) * 1e6
            copy_us = statistics.median(copies) * 1e6
            print(
                f"| {length} | {fork_us:.0f} µs | {fork_us / base:.2f}x | {copy_us:.0f} µs | {prune_us:.0f} µs |"
            )
            root.prune_sync()


def model_tokens(model: kvfork.Model, n: int) -> list[int]:
    with make_context(model, 1, n_ctx=256) as ctx:
        words = ctx.tokenize(" ".join(f"item {i} of the long list," for i in range(n)), False)
    return [int(t) for t in words[:n]]


def kv_sharing(model: kvfork.Model) -> None:
    n_forks, prefix, gen, n_ctx = 16, 1500, 64, 4096
    print(f"\n## 4. KV sharing: {n_forks} forks of a {prefix}-token prefix, {gen} tokens each")
    with make_context(model, n_forks + 1, n_ctx=n_ctx) as ctx:
        root = kvfork.Branch.create(ctx, 0, GREEDY)
        root.prefill_sync(model_tokens(model, prefix))
        kids = [root.fork_sync() for _ in range(n_forks)]
        for i, kid in enumerate(kids):
            kid.set_sampler_params(DEFAULT_CHAIN.replace(seed=i))
        store = kvfork.BranchStore(ctx)
        t0 = time.perf_counter()
        for _ in range(gen):
            store.step_sync(kids)
        wall = time.perf_counter() - t0
        cells = prefix + n_forks * gen
        unshared = n_forks * (prefix + gen)
        positions = sorted({k.position for k in kids})
        print("| n_ctx | KV cells used | without sharing | fork positions | wall |")
        print("|---|---|---|---|---|")
        print(
            f"| {n_ctx} | {cells} ({cells / n_ctx:.0%}) | {unshared} ({unshared / n_ctx:.1f}x n_ctx) "
            f"| {positions} | {wall:.1f} s |"
        )


def padding(model: kvfork.Model, rounds: int = 9) -> None:
    """Table 5: one commit of N branches (N outputs), padded and not, interleaved."""
    n_max = 24
    sides: dict[str, tuple[kvfork.Context, list[kvfork.Branch]]] = {}
    for side in ("padded", "unpadded"):
        if side == "padded":
            os.environ.pop("KVFORK_NO_OUTPUT_PADDING", None)
        else:
            os.environ["KVFORK_NO_OUTPUT_PADDING"] = "1"  # read when a context is created
        ctx = make_context(model, n_max)
        sides[side] = (ctx, branches_at_prompt(ctx, n_max, GREEDY))
    os.environ.pop("KVFORK_NO_OUTPUT_PADDING", None)
    ns = [n for n in range(5, n_max + 1) if n % 4]
    times: dict[tuple[str, int], list[float]] = {(s, n): [] for s in sides for n in ns}
    for r in range(rounds):
        for n in ns:
            for side, (ctx, branches) in sides.items():
                store = kvfork.BranchStore(ctx)
                t0 = time.perf_counter()
                store.commit_sync([(b, 1000 + r) for b in branches[:n]])
                times[(side, n)].append(time.perf_counter() - t0)
    padded_rows = sides["padded"][0].stats()["padded_rows"]
    print(
        f"\n## 5. Output rows padded to whole tiles ({padded_rows} rows padded; median of {rounds})"
    )
    print("| N outputs | padded to | padded (ms) | unpadded (ms) | padded / unpadded |")
    print("|---|---|---|---|---|")
    for n in ns:
        a = statistics.median(times[("padded", n)]) * 1e3
        b = statistics.median(times[("unpadded", n)]) * 1e3
        print(f"| {n} | {n + (-n % 4) if padded_rows else n} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
    for ctx, _ in sides.values():
        ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32]
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per cell; the best is kept")
    parser.add_argument("--peer-python", default=os.environ.get("PEER_PYTHON", DEFAULT_PEER_PYTHON))
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument(
        "--only", default="throughput,fork,kv,padding", help="also: device (device_sampling)"
    )
    args = parser.parse_args()
    if not args.skip_peer and not Path(args.peer_python).exists():
        print(
            f"peer not found ({args.peer_python}; `make peer` installs it): --skip-peer assumed",
            file=sys.stderr,
        )
        args.skip_peer = True
    kvfork.set_log_level(40)
    model = kvfork.Model.load(kvfork.default_model_path())
    info = kvfork.system_info()
    print(f"# kvfork BranchStore benchmark: {Path(model.path).name}, {THREADS} threads")
    print(f"cpu features: {info.get('cpu_features', info)}")
    sections = set(args.only.split(","))
    if "throughput" in sections:
        throughput(args, model)
    if "fork" in sections:
        fork_cost(model)
    if "kv" in sections:
        kv_sharing(model)
    if "padding" in sections:
        padding(model)
    if "device" in sections:
        device_sampling(args, model)


if __name__ == "__main__":
    main()
