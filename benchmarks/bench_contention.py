"""Generation speed when the CPU is shared: kvfork's adaptive thread count against fixed
counts and the peer (llama-cpp-python), quiet and beside busy processes, in one run.

One greedy branch of the default model generates TOKENS tokens after a warm-up (so an
adapting context has met the load); tokens/s is the median of REPEATS runs. Situations:
quiet; one busy neighbour (a process spinning on one core); two kvfork processes at once.

usage: python benchmarks/bench_contention.py [--peer-python .venv-peer/bin/python]
                                             [--tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import kvfork
from _peer import run_peer
from peer_batched import DEFAULT_PEER_PYTHON

PROMPT = "The history of the printing press begins with"
SPIN = "while True: pass"

PEER_CODE = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_ctx=1024, verbose=False)
n_vocab = llm.n_vocab()
def argmax():
    p = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(p, shape=(n_vocab,))))
rates = []
for _ in range(job["repeats"]):
    llm.reset()
    llm.eval(job["prompt"])
    for _ in range(job["warmup"]):
        llm.eval([argmax()])
    t0 = time.perf_counter()
    for _ in range(job["tokens"]):
        llm.eval([argmax()])
    rates.append(job["tokens"] / (time.perf_counter() - t0))
json.dump(rates, sys.stdout)
"""


def kvfork_rates(n_threads: int | None, tokens: int, repeats: int, warmup: int) -> list[float]:
    model = kvfork.default_model_path()
    rates = []
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=1, n_threads=n_threads) as ctx:
        prompt = ctx.tokenize(PROMPT)
        for _ in range(repeats):
            b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
            b.prefill_sync(prompt)
            for _ in b.generate_sync(warmup):
                pass
            t0 = time.perf_counter()
            n = sum(1 for _ in b.generate_sync(tokens))
            rates.append(n / (time.perf_counter() - t0))
            b.prune_sync()
    return rates


def child(args: argparse.Namespace) -> None:
    """Run one kvfork measurement and print its rates (used for the two-process case)."""
    threads = None if args.child == "adaptive" else int(args.child)
    print(json.dumps(kvfork_rates(threads, args.tokens, args.repeats, args.warmup)))


def spawn_self(config: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--child", config, "--tokens", str(args.tokens)]
    cmd += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def measure_all(configs: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Median tokens/s per config, the configs interleaved run by run (drift hits all alike)."""
    rates: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            threads = None if c == "adaptive" else int(c)
            rates[c] += kvfork_rates(threads, args.tokens, 1, args.warmup)
    return {c: statistics.median(r) for c, r in rates.items()}


def peer(args: argparse.Namespace) -> float | None:
    if not args.peer_python or not Path(args.peer_python).exists():
        return None
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=256) as c:
        prompt = c.tokenize(PROMPT)
    job = {
        "model": str(kvfork.default_model_path()),
        "prompt": prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    return statistics.median(run_peer(args.peer_python, PEER_CODE, job))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    configs = ["adaptive", "1", "2"]
    rows: dict[str, dict[str, float | None]] = {c: {} for c in [*configs, "peer"]}
    for c, rate in measure_all(configs, args).items():
        rows[c]["quiet"] = rate
    rows["peer"]["quiet"] = peer(args)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.5)
        for c, rate in measure_all(configs, args).items():
            rows[c]["busy"] = rate
        rows["peer"]["busy"] = peer(args)
    finally:
        spinner.kill()
    for c in configs:
        a, b = spawn_self(c, args), spawn_self(c, args)
        ra = statistics.median(json.loads(a.communicate()[0]))
        rb = statistics.median(json.loads(b.communicate()[0]))
        rows[c]["two"] = (ra + rb) / 2
    print(f"{len(os.sched_getaffinity(0))} cores; tokens/s, median of {args.repeats}")
    print("| threads | quiet | one busy neighbour | each of two kvfork processes |")
    print("|---|---|---|---|")
    for c, r in rows.items():
        cells = [f"{r[k]:.1f}" if r.get(k) is not None else "–" for k in ("quiet", "busy", "two")]
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
