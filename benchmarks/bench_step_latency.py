"""What a small step costs beside its `llama_decode`, three measures side by side in one run
(recorded in BENCHMARKS.md §23):

1. Between decodes: `store.step` of N = 1, 2, 4 greedy branches, the milliseconds a step
   spends outside `llama_decode` (sampling, accepting, the rows' summaries, the calls
   between Python and the engine), with the team of one thread (each row summarized by one
   core) and of two (a few rows' segments spread over the team, `engine/summaries.rs`).
2. The first step after an idle stretch: one-token steps back to back and after a 0.7 s
   pause, with kvfork's adaptive thread count (its load meter reads the machine before the
   first decode of a burst) and with both counts fixed (no meter: the floor).
3. Rows copied aside: N branches under two LoRA adapters (one decode for each, so every row
   is copied out of llama.cpp's output buffer and summarized), teams of one and two threads.

usage: python benchmarks/bench_step_latency.py [--steps 100] [--rounds 16] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvfork
from kvfork._models import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' LoRA writer
from tests.adapter_files import write_lora

PROMPT = "The history of the printing press begins with"
GREEDY = kvfork.SamplingParams(temperature=0.0)
IDLE_S = 0.7


def outside_decode_ms(
    model: kvfork.Model,
    n: int,
    threads: int,
    steps: int,
    adapters: tuple[kvfork.LoraAdapter, ...] = (),
) -> tuple[float, float]:
    """(ms a step, ms a step outside llama_decode) for N greedy branches of one prompt, taking
    `adapters` in turn when given."""
    with kvfork.create_context_sync(
        model,
        n_ctx=max(4096, n * (steps + 8) + 256),
        n_seq_max=n,
        n_threads=threads,
        n_threads_batch=threads,
    ) as ctx:
        root = kvfork.Branch.create(ctx, 0, GREEDY)
        root.prefill_sync(ctx.tokenize(PROMPT))
        branches = [root] + [root.fork_sync() for _ in range(n - 1)]
        for i, branch in enumerate(branches if adapters else []):
            branch.set_adapters({adapters[i % len(adapters)]: 1.0})
        store = kvfork.BranchStore(ctx)
        for _ in range(4):
            store.step_sync(branches)
        before = float(ctx.stats()["decode_seconds"])
        t0 = time.perf_counter()
        for _ in range(steps):
            store.step_sync(branches)
        wall = time.perf_counter() - t0
        decode = float(ctx.stats()["decode_seconds"]) - before
    return 1e3 * wall / steps, 1e3 * (wall - decode) / steps


def first_step_ms(model: kvfork.Model, adaptive: bool, rounds: int) -> tuple[float, float]:
    """Median ms of a one-token step (back to back, after an idle stretch)."""
    threads = None if adaptive else 2
    with kvfork.create_context_sync(
        model, n_ctx=4096, n_seq_max=2, n_threads=threads, n_threads_batch=threads
    ) as ctx:
        branch = kvfork.Branch.create(ctx, 0, GREEDY)
        branch.prefill_sync(ctx.tokenize(PROMPT))
        busy: list[float] = []
        idle: list[float] = []
        for _ in range(rounds):
            for out, pause in ((busy, 0.0), (idle, IDLE_S)):
                time.sleep(pause)
                t0 = time.perf_counter()
                list(branch.generate_sync(1))
                out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(busy), statistics.median(idle)


def print_outside_table(
    title: str,
    model: kvfork.Model,
    ns: tuple[int, ...],
    steps: int,
    adapters: tuple[kvfork.LoraAdapter, ...] = (),
) -> None:
    """`outside_decode_ms` for each N with teams of one and two threads, best of 3."""
    print(f"\n{title} (best of 3)")
    print("| N | team of 1: step | team of 1: outside | team of 2: step | team of 2: outside |")
    print("|---|---|---|---|---|")
    for n in ns:
        cells = []
        for threads in (1, 2):
            runs = [outside_decode_ms(model, n, threads, steps, adapters) for _ in range(3)]
            step, outside = min(runs, key=lambda r: r[1])
            cells += [f"{step:.2f}", f"{outside:.3f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--model", default=str(default_model_path()))
    args = parser.parse_args()
    model = kvfork.Model.load(args.model)
    print(f"model {args.model} (vocabulary {model.vocab_size})")

    print_outside_table("1. ms a step outside llama_decode", model, (1, 2, 4), args.steps)

    print(f"\n2. median ms of a one-token step, back to back and after {IDLE_S} s idle")
    print("| threads | back to back | after idle | idle - back to back |")
    print("|---|---|---|---|")
    for adaptive in (True, False):
        busy, idle = first_step_ms(model, adaptive, args.rounds)
        name = "adaptive (load meter)" if adaptive else "fixed at 2 (no meter)"
        print(f"| {name} | {busy:.2f} | {idle:.2f} | {idle - busy:+.2f} |")

    with tempfile.TemporaryDirectory() as folder:
        pair = tuple(
            model.load_lora(str(write_lora(Path(folder) / f"{i}.gguf", seed=i))) for i in (1, 2)
        )
        title = "3. ms a step outside llama_decode, branches under two LoRA adapters"
        print_outside_table(title, model, (2, 8), args.steps // 2, pair)


if __name__ == "__main__":
    main()
