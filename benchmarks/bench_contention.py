"""Speed when the CPU is shared: kvfork's adaptive thread count against fixed counts, with 0,
1 and 2 busy neighbours (processes spinning on a core each), in one run.

Each measurement opens a fresh context (so the first prefill runs before any decode was
timed), then times: the first prefill (PROMPT, ~60 tokens), one greedy branch generating
TOKENS tokens, and a BranchStore step over 8 forks (STEPS steps). The configurations are
interleaved within each load and the median of REPEATS is kept; the "adaptive / best" columns
divide the default's result by the best fixed count's for that load and measure.

A second part changes the load in the middle of a generation (two neighbours start after
QUIET decodes, then stop) and reports how many decodes the default needed to settle on the
count the new load calls for. A third runs two adapting kvfork processes at once.

usage: python benchmarks/bench_contention.py [--tokens 32] [--steps 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import kvfork

PROMPT = (
    "The history of the printing press begins with the invention of movable type in East Asia, "
    "long before Gutenberg built his press in Mainz around 1440 and printed the Bible that "
    "made him famous across Europe within a few decades of its first copies"
)
SPIN = "while True: pass"
CONFIGS = ["adaptive", "1", "2"]
MEASURES = ["first prefill (s)", "N = 1 (tok/s)", "N = 8 step (tok/s)"]


@contextmanager
def neighbours(n: int) -> Iterator[None]:
    """`n` processes spinning on a core each, for the duration of the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        time.sleep(0.3 if n else 0.0)
        yield
    finally:
        for s in spinners:
            s.kill()
            s.wait()


def threads_of(config: str) -> int | None:
    return None if config == "adaptive" else int(config)


def measure(config: str, tokens: int, steps: int) -> list[float]:
    """[first prefill seconds, N = 1 tokens/s, N = 8 step tokens/s] on a fresh context."""
    n = threads_of(config)
    model = kvfork.default_model_path()
    with kvfork.create_context_sync(
        model, n_ctx=1024, n_seq_max=9, n_threads=n, n_threads_batch=n
    ) as ctx:
        prompt = ctx.tokenize(PROMPT)
        root = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        t0 = time.perf_counter()
        root.prefill_sync(prompt)
        prefill = time.perf_counter() - t0
        one = root.fork_sync()
        t0 = time.perf_counter()
        made = sum(1 for _ in one.generate_sync(tokens))
        single = made / (time.perf_counter() - t0)
        one.prune_sync()
        forks = [root.fork_sync() for _ in range(8)]
        store = kvfork.BranchStore(ctx)
        t0 = time.perf_counter()
        for _ in range(steps):
            store.step_sync(forks)
        step = 8 * steps / (time.perf_counter() - t0)
        return [prefill, single, step]


def table(args: argparse.Namespace) -> None:
    print(
        f"{len(os.sched_getaffinity(0))} cores; median of {args.repeats}, configurations "
        "interleaved; adaptive / best fixed count in the last columns (prefill: best time / "
        "adaptive time)\n"
    )
    head = ["busy neighbours", "threads", *MEASURES]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    ratios: list[tuple[int, list[float]]] = []
    for load in args.loads:
        runs: dict[str, list[list[float]]] = {c: [] for c in CONFIGS}
        with neighbours(load):
            for _ in range(args.repeats):
                for c in CONFIGS:
                    runs[c].append(measure(c, args.tokens, args.steps))
        med = {c: [statistics.median(r[i] for r in runs[c]) for i in range(3)] for c in CONFIGS}
        for c in CONFIGS:
            m = med[c]
            print(f"| {load} | {c} | {m[0]:.3f} | {m[1]:.1f} | {m[2]:.1f} |")
        fixed = [c for c in CONFIGS if c != "adaptive"]
        best_prefill = min(med[c][0] for c in fixed)
        best = [max(med[c][i] for c in fixed) for i in (1, 2)]
        a = med["adaptive"]
        ratios.append((load, [best_prefill / a[0], a[1] / best[0], a[2] / best[1]]))
    print("\n| busy neighbours | " + " | ".join(f"adaptive / best: {m}" for m in MEASURES) + " |")
    print("|---|---|---|---|")
    for load, r in ratios:
        print(f"| {load} | " + " | ".join(f"{x:.2f}x" for x in r) + " |")


def load_change(args: argparse.Namespace) -> None:
    """Threads per decode while two neighbours come and go in the middle of a generation."""
    quiet, busy = args.quiet, args.busy
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=2048, n_seq_max=1) as ctx:
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize(PROMPT))
        trace: list[int] = []
        gen = b.generate_sync(quiet + busy + quiet)
        for _ in range(quiet):
            next(gen)
            trace.append(ctx.n_threads)
        with neighbours(2):
            for _ in range(busy):
                next(gen)
                trace.append(ctx.n_threads)
        for _ in gen:
            trace.append(ctx.n_threads)
    start, end = quiet, quiet + busy
    down = next((i - start + 1 for i in range(start, end) if trace[i] == 1), None)
    up = next((i - end + 1 for i in range(end, len(trace)) if trace[i] == trace[0]), None)
    print(
        f"\nLoad change in one generation (threads after each decode; two neighbours during "
        f"decodes {start + 1}-{end}):"
    )
    print("  " + "".join(str(t) for t in trace))
    print(f"  decodes to back off after the load came: {down}; to return after it left: {up}")


def child(config: str, args: argparse.Namespace) -> None:
    print(json.dumps(measure(config, args.tokens, args.steps)))


def two_processes(args: argparse.Namespace) -> None:
    """Two kvfork processes at once, each with the same configuration."""
    print("\nTwo kvfork processes at once (each one's N = 1 tok/s, median of the repeats):")
    print("| threads | N = 1 (tok/s) | N = 8 step (tok/s) |\n|---|---|---|")
    for c in CONFIGS:
        single, step = [], []
        for _ in range(args.repeats):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                c,
                "--tokens",
                str(args.tokens),
                "--steps",
                str(args.steps),
            ]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
            for p in procs:
                r = json.loads(p.communicate()[0])
                single.append(r[1])
                step.append(r[2])
        print(f"| {c} | {statistics.median(single):.1f} | {statistics.median(step):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quiet", type=int, default=24, help="decodes before and after the load")
    ap.add_argument("--busy", type=int, default=24, help="decodes beside two neighbours")
    ap.add_argument("--only", choices=["table", "change", "two"], default=None)
    ap.add_argument("--loads", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, args)
        return
    if args.only in (None, "table"):
        table(args)
    if args.only in (None, "change"):
        load_change(args)
    if args.only in (None, "two"):
        two_processes(args)


if __name__ == "__main__":
    main()
