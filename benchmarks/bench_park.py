"""Parked branches: the cost of bringing back a branch with 64 own tokens against one
single-branch decode step, and host bytes per parked branch against its own cells' size.

    .venv/bin/python benchmarks/bench_park.py
"""

from __future__ import annotations

import statistics
import time

import kvfork

PROMPT = "The history of the printing press begins with"
GREEDY = kvfork.SamplingParams(temperature=0.0)


def own_cells_bytes(model: kvfork.Model, n_tokens: int) -> int:
    meta = model.metadata
    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
    width = int(meta[f"{arch}.attention.key_length"]) + int(meta[f"{arch}.attention.value_length"])
    return n_tokens * layers * kv_heads * width * 2


def main(rounds: int = 20) -> None:
    model = kvfork.Model.load(kvfork.default_model_path())
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2, park=True) as ctx:
        parent = kvfork.Branch.create(ctx, 0, GREEDY)
        parent.prefill_sync(ctx.tokenize(PROMPT * 20))
        child = parent.fork_sync()
        child.prefill_sync(list(range(1000, 1064)))
        other = kvfork.Branch.create(ctx, 0, GREEDY)
        other.prefill_sync([5, 6])
        unpark, step, ratios = [], [], []
        for _ in range(rounds):
            # The child (64 own tokens past its active parent) is parked: bring it back by
            # forking it (no decode), which parks `other`.
            parent.commit_sync(parent.sample())
            other.commit_sync(other.sample())  # the child is parked now
            assert not child.is_active
            ratios.append(ctx.stats()["parked_bytes"] / own_cells_bytes(model, 64))
            before = ctx.stats()["unparks"]
            t0 = time.perf_counter()
            probe = child.fork_sync()  # admits the child: one unpark, nothing decoded
            unpark.append(time.perf_counter() - t0)
            assert ctx.stats()["unparks"] == before + 1
            probe.prune_sync()
            t0 = time.perf_counter()
            parent.commit_sync(parent.sample())
            step.append(time.perf_counter() - t0)
    u, s = statistics.median(unpark) * 1e3, statistics.median(step) * 1e3
    print("| measure | median |")
    print("|---|---|")
    print(f"| unpark of a branch with 64 own tokens (fork of it, no decode) | {u:.2f} ms |")
    print(f"| one single-branch decode step (commit) | {s:.2f} ms |")
    print(f"| unpark / step | {u / s:.2f} |")
    print(
        f"| host bytes per parked branch / its own cells' K+V bytes | {statistics.median(ratios):.3f} |"
    )


if __name__ == "__main__":
    main()
