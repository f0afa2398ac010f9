"""The installed release wheel against the `make` build: `store.step` tokens/s at N branches.

Each cell runs in a fresh interpreter of the venv named (`--make-python`, `--wheel-python`):
the same benchmark (`bench_store.run_step`, greedy, 2 threads, the default model), the two
builds interleaved cell by cell (their order alternating between rounds), so both see the same
machine; the table has each build's median over the rounds and the ratio wheel / make.
Tokens per CPU second are printed too: on a machine shared with other work the wall-clock
rate swings with the neighbours' load, while the CPU time a token costs (with `--threads 1`,
no OpenMP spin-waiting in it) measures the two builds' code alone.
The wheel's venv: `make wheel` then `pip install dist/kvfork-*.whl[models]` into a fresh venv.

usage: python benchmarks/bench_wheel.py --wheel-python /tmp/venv/bin/python
                                        [--make-python .venv/bin/python] [--ns 1,8,16]
                                        [--rounds 3] [--steps 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs in the child: one cell, after a short warm-up run; prints tokens/s and the CPU code used.
CHILD = """
import json, sys, time
sys.path.insert(0, {here!r})
import kvfork
import bench_store
from bench_store import GREEDY, run_step
bench_store.THREADS = {threads}
n, steps = {n}, {steps}
model = kvfork.Model.load(kvfork.default_model_path())
run_step(model, n, 4, GREEDY)
cpu0 = time.process_time()
wall, _decode, _tokens = run_step(model, n, steps, GREEDY)
cpu = time.process_time() - cpu0
info = kvfork.system_info()
print(json.dumps({{"tps": n * steps / wall, "cpu_tps": n * steps / cpu,
                  "variant": info["cpu_variant"]}}))
"""


def cell(python: str, n: int, steps: int, threads: int) -> dict[str, object]:
    """One measurement in a fresh interpreter: {"tps": tokens per wall second, "cpu_tps":
    tokens per CPU second of the process (the context's setup and warm-up not counted),
    "variant": the CPU code used}."""
    code = CHILD.format(here=str(HERE), n=n, steps=steps, threads=threads)
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-python", default=".venv/bin/python")
    parser.add_argument("--wheel-python", required=True)
    parser.add_argument("--ns", default="1,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="n_threads (bench_store's 2)")
    args = parser.parse_args()
    ns = [int(n) for n in args.ns.split(",")]
    builds = {"make": args.make_python, "wheel": args.wheel_python}
    tps: dict[tuple[str, int], list[float]] = {(b, n): [] for b in builds for n in ns}
    cpu_tps: dict[tuple[str, int], list[float]] = {(b, n): [] for b in builds for n in ns}
    variants: dict[str, str] = {}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for n in ns:
            for b in order:
                res = cell(builds[b], n, args.steps, args.threads)
                tps[(b, n)].append(float(str(res["tps"])))
                cpu_tps[(b, n)].append(float(str(res["cpu_tps"])))
                variants[b] = str(res["variant"])
                print(
                    f"round {r + 1} N={n:>2} {b:>5}: {res['tps']:.1f} tok/s, "
                    f"{res['cpu_tps']:.1f} tok per CPU s",
                    flush=True,
                )
    print(
        f"\nstore.step, greedy, {args.threads} thread(s), {args.steps} steps, "
        f"median of {args.rounds}"
    )
    print(f"CPU code: make = {variants['make']}, wheel = {variants['wheel']}\n")
    print(
        "| N | make tok/s | wheel tok/s | wheel / make | make tok/CPU s | wheel tok/CPU s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in ns:
        m = statistics.median(tps[("make", n)])
        w = statistics.median(tps[("wheel", n)])
        mc = statistics.median(cpu_tps[("make", n)])
        wc = statistics.median(cpu_tps[("wheel", n)])
        print(f"| {n} | {m:.1f} | {w:.1f} | {w / m:.3f} | {mc:.1f} | {wc:.1f} | {wc / mc:.3f} |")


if __name__ == "__main__":
    main()
