"""Soak: many fork/commit/prune cycles and context open/close cycles with flat memory.

CI runs a short version; `KVFORK_SOAK=1` runs the full one (10,000 and 1,000 cycles) and
prints the RSS numbers (`pytest tests/test_soak.py -s`)."""

from __future__ import annotations

import gc
import logging
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import kvfork

from .conftest import GREEDY, root

FULL = os.environ.get("KVFORK_SOAK") == "1"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextmanager
def quiet() -> Iterator[None]:
    """pytest keeps every captured log record: llama.cpp's per-context warning would grow
    the process by itself."""
    kvfork.set_log_level(logging.ERROR)
    try:
        yield
    finally:
        kvfork.set_log_level(logging.WARNING)


def test_fork_commit_prune_cycles_keep_memory_flat(model: kvfork.Model) -> None:
    cycles = 10_000 if FULL else 600
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=4) as ctx:
        parent = root(ctx)
        store = kvfork.BranchStore(ctx)
        token = parent.produce_sync().token
        warm = cycles // 10
        base = 0.0
        for i in range(cycles):
            child = parent.fork_sync()
            child.commit_sync(token)
            child.prune_sync()
            if i == warm:
                gc.collect()
                base = rss_mib()
        gc.collect()
        end = rss_mib()
        assert store.available == 3 and parent.children == []
        assert parent.position == len(ctx.tokenize("The history of the printing press begins with"))
    per_cycle_kib = (end - base) * 1024 / (cycles - warm)
    print(
        f"\nfork/commit/prune x{cycles}: RSS {base:.1f} -> {end:.1f} MiB ({per_cycle_kib:.2f} KiB/cycle)"
    )
    assert per_cycle_kib < 1.0, f"memory grows {per_cycle_kib:.2f} KiB per cycle"


def test_context_open_close_cycles_keep_memory_flat(model: kvfork.Model) -> None:
    cycles = 1_000 if FULL else 120
    warm = cycles // 10
    samples: list[float] = []
    with quiet():
        for i in range(cycles):
            ctx = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2)
            b = kvfork.Branch.create(ctx, 0, GREEDY)
            b.prefill_sync([2, 9259])
            ctx.close()
            if i >= warm:
                gc.collect()
                samples.append(rss_mib())
    # RSS moves by a megabyte either way as malloc arenas grow and shrink: compare the
    # medians of the first and last tenths of the samples, not two single readings.
    k = max(len(samples) // 10, 3)
    base, end = statistics.median(samples[:k]), statistics.median(samples[-k:])
    per_cycle_kib = (end - base) * 1024 / (len(samples) - k)
    print(
        f"\nopen/close x{cycles}: RSS {base:.1f} -> {end:.1f} MiB ({per_cycle_kib:.1f} KiB/cycle)"
    )
    # A leak shows as steady growth: 4 KiB a context over the full run; the short run allows
    # one arena step (~1 MiB) in total, which still catches the 20 KiB a context once lost.
    allowed = max(4.0, 1536 / (len(samples) - k))
    assert per_cycle_kib < allowed, f"memory grows {per_cycle_kib:.1f} KiB per context"
