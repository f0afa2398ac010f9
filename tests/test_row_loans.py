"""Snapshots that read their rows in llama.cpp's output buffer (no copy after a commit).

A commit's decode lends each branch its row of llama.cpp's output buffer until the next
decode. These tests check that every reader still sees its own row: a branch left out of
the next decode, a fork sharing its parent's row, a commit that fails, a decode that makes
llama.cpp move its buffer, and readers on other threads while decodes run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
import time
from collections.abc import Iterator

import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PROMPT, assert_close_logits, root

CHAIN = kvfork.SamplingParams(seed=7)  # the default chain: top-k, top-p, min-p, temperature


def reading(b: kvfork.Branch) -> tuple[float, list[tuple[int, float]], float]:
    """What a branch's snapshot answers, without taking a copy of its row."""
    return b.entropy(), b.top_logprobs(5), b.logprob(int(b.top_logprobs(1)[0][0]))


def test_a_branch_left_out_of_a_decode_keeps_its_row(ctx: kvfork.Context) -> None:
    a = root(ctx, params=CHAIN)
    b = a.fork_sync(seed=1)
    store = kvfork.BranchStore(ctx)
    store.step_sync([a, b])  # both rows lent
    before = reading(a)
    for _ in range(3):
        store.step_sync([b])  # overwrites llama.cpp's output buffer
    assert reading(a) == before
    fresh = a.fork_sync()  # a fork now shares a's (own) row
    assert reading(fresh) == before


def test_a_fork_shares_its_parents_lent_row(ctx: kvfork.Context) -> None:
    parent = root(ctx, params=CHAIN)
    store = kvfork.BranchStore(ctx)
    store.step_sync([parent])
    child = parent.fork_sync()
    expected = reading(parent)
    assert reading(child) == expected
    store.step_sync([parent])  # the child was left out: it keeps the shared row
    assert reading(child) == expected
    assert reading(parent) != expected


def test_a_numpy_copy_outlives_later_decodes(ctx: kvfork.Context) -> None:
    b = root(ctx, params=GREEDY)
    store = kvfork.BranchStore(ctx)
    store.step_sync([b])
    logits = b.logits()
    kept = logits.copy()
    assert b.entropy() == pytest.approx(_entropy(kept), rel=1e-4)
    for _ in range(3):
        store.step_sync([b])
    assert np.array_equal(logits, kept)
    assert not np.array_equal(b.logits(), kept)


def _entropy(x: np.ndarray) -> float:
    z = x.astype(np.float64) - x.max()
    p = np.exp(z) / np.exp(z).sum()
    return float(-(p * np.log(np.where(p > 0, p, 1))).sum())


@contextlib.contextmanager
def full_cache(model: kvfork.Model) -> Iterator[tuple[kvfork.Branch, kvfork.Branch]]:
    """Two branches of 127 prompt tokens and one step each in a context of 256 cells: the
    cache is full, both rows lent."""
    with kvfork.create_context_sync(model, n_ctx=256, n_batch=256, n_seq_max=4) as tiny:
        words = tiny.tokenize(PROMPT * 30)
        a = kvfork.Branch.create(tiny, 0, GREEDY)
        b = kvfork.Branch.create(tiny, 0, GREEDY)
        a.prefill_sync(words[:127])
        b.prefill_sync(words[:127])
        kvfork.BranchStore(tiny).step_sync([a, b])
        yield a, b


def test_a_failed_commit_keeps_the_lent_row(model: kvfork.Model) -> None:
    with full_cache(model) as (a, b):
        before = (reading(a), a.position, a.perplexity)
        tok = a.produce_sync().token
        with pytest.raises(kvfork.KvCacheFullError):
            a.commit_sync(tok)  # llama_decode finds no slot
        assert (reading(a), a.position, a.perplexity) == before
        b.prune_sync()
        a.commit_sync(tok)  # room again: the same commit now succeeds
        assert a.position == 129 and math.isfinite(a.perplexity)


def test_a_one_token_speculate_keeps_its_loan_and_its_forks_rows(ctx: kvfork.Context) -> None:
    # A speculative round with no guess decodes its branch as a commit does: the branch's
    # lent row is in flight through the decode (not copied), a fork sharing it keeps it.
    a = root(ctx, params=CHAIN)
    kvfork.BranchStore(ctx).step_sync([a])  # a's row lent
    fork, twin = a.fork_sync(), a.fork_sync()  # both share a's row
    before = reading(a)
    pending = a.produce_sync()
    assert twin.produce_sync() == pending
    accepted, nxt = a.speculate_sync(pending, [])
    assert accepted == [] and reading(fork) == before
    twin.commit_sync(pending.token)  # the same decode, as a commit (in the twin's own cells)
    assert reading(a) != before
    assert_close_logits(a.logits(), twin.logits())  # other cells: equal up to noise
    twin.set_logits(a.logits())  # the twin's sampler (a's RNG, cloned) on a's very row
    assert twin.produce_sync() == nxt


def test_a_failed_one_token_speculate_keeps_the_lent_row(model: kvfork.Model) -> None:
    with full_cache(model) as (a, b):
        before = (reading(a), a.position, a.perplexity)
        pending = a.produce_sync()
        with pytest.raises(kvfork.KvCacheFullError):
            a.speculate_sync(pending, [])  # llama_decode finds no slot
        assert (reading(a), a.position, a.perplexity) == before
        b.prune_sync()
        accepted, nxt = a.speculate_sync(pending, [])  # room again
        assert accepted == [] and a.position == 129 and not nxt.is_stop


def test_a_decode_that_moves_the_output_buffer(model: kvfork.Model) -> None:
    # Outputs beyond n_seq_max (a speculative check of 9 positions here) make llama.cpp
    # allocate a larger output buffer: every lent row is copied out before that decode.
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2) as c:
        a = root(c, params=CHAIN)
        b = a.fork_sync(seed=3)
        kvfork.BranchStore(c).step_sync([a, b])
        before = reading(a)
        pending = b.sample()
        b.speculate_sync(pending, [int(t) for t in c.tokenize(" and then the", False)] * 2)
        assert reading(a) == before
        kvfork.BranchStore(c).step_sync([a, b])  # and loans work in the new buffer
        assert math.isfinite(a.entropy())


def test_readers_on_other_threads_see_whole_rows(ctx: kvfork.Context) -> None:
    idle = root(ctx, params=CHAIN)
    busy = [idle.fork_sync(seed=s) for s in range(1, 4)]
    store = kvfork.BranchStore(ctx)
    store.step_sync([idle, *busy])
    idle_reading = reading(idle)
    seen: dict[int, set[float]] = {i: {busy[i].entropy()} for i in range(len(busy))}
    read: dict[int, list[float]] = {i: [] for i in range(len(busy))}
    failures: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            if reading(idle) != idle_reading:
                failures.append("the idle branch's row changed")
            for i, b in enumerate(busy):
                read[i].append(b.entropy())

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(24):
        store.step_sync(busy)
        for i, b in enumerate(busy):
            seen[i].add(b.entropy())
    done.set()
    for t in threads:
        t.join()
    assert failures == []
    assert sum(len(r) for r in read.values()) > 24
    for i in seen:
        # Each read is the entropy of a row the branch really had, never of a torn one.
        assert set(read[i]) <= seen[i]


def test_only_row_reads_wait_for_a_decode_of_their_branch(model: kvfork.Model) -> None:
    # While a commit decodes, the branch's lent row is in flight: `entropy` and the like wait
    # for the new row, but `position` or `perplexity` answer at once (an event loop that
    # reads them never stalls for a decode).
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=16) as c:
        first = root(c, params=CHAIN)
        busy = [first, *(first.fork_sync(seed=s) for s in range(1, 16))]
        store = kvfork.BranchStore(c)
        store.step_sync(busy)
        slow_reads: list[float] = []  # over 0.1 ms; every step takes more than 1 ms
        done = threading.Event()

        def reader() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                _ = busy[0].position, busy[0].perplexity, busy[0].sampling_perplexity
                took = time.perf_counter() - t0
                if took > 1e-4:
                    slow_reads.append(took)

        # Nor may the reader wait for the GIL: Python hands it over every 5 ms by default,
        # half a step on a GPU (9 ms on an H100 at N = 16).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0002)
        thread = threading.Thread(target=reader)
        steps = []
        try:
            thread.start()
            for _ in range(12):
                t0 = time.perf_counter()
                store.step_sync(busy)
                steps.append(time.perf_counter() - t0)
        finally:
            done.set()
            thread.join()
            sys.setswitchinterval(interval)
        # The reader reads without pause, so a read that waited for the decode would show in
        # nearly every step; one or two slow reads are the machine's hiccups (an H200 step is
        # 4 ms, and a thread switch or a page fault can take most of one).
        half_a_step = 0.5 * sorted(steps)[len(steps) // 2]
        waited = [t for t in slow_reads if t >= half_a_step]
        assert len(waited) <= 2, (waited, steps)


def _steps_and_readings(model: kvfork.Model, device_sampling: bool) -> list[tuple[object, ...]]:
    """Six steps of a root and two forks (which share its row, owned by none of them at
    first), each branch read right after every step: tokens, position, perplexity, its row's
    entropy, top logprobs and the logprob of its best token, and its whole row."""
    got: list[tuple[object, ...]] = []
    with kvfork.create_context_sync(
        model, n_ctx=1024, n_seq_max=4, device_sampling=device_sampling
    ) as c:
        first = root(c, params=CHAIN)
        store = kvfork.BranchStore(c)
        store.step_sync([first])
        branches = [first, first.fork_sync(seed=1), first.fork_sync(seed=2)]
        for _ in range(6):
            tokens = [p.token for p in store.step_sync(branches)]
            for b in branches:
                got.append((tokens, b.position, b.perplexity, *reading(b), b.logits().tobytes()))
    return got


@pytest.mark.parametrize("device_sampling", [False, True])
def test_a_step_answers_before_its_rows_land_and_row_reads_wait_for_them(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch, device_sampling: bool
) -> None:
    # A step replies once its decode is queued, and the engine reads the decode's rows after
    # the reply (engine/landing.rs): a row read right after the step must wait for the new
    # row, also where the branch held a row of its own or a fork's shared one (no loan in
    # flight). The same steps with the landing before the reply read the same, to the bit.
    monkeypatch.delenv("KVFORK_LAND_BEFORE_REPLY", raising=False)
    early = _steps_and_readings(model, device_sampling)
    monkeypatch.setenv("KVFORK_LAND_BEFORE_REPLY", "1")
    late = _steps_and_readings(model, device_sampling)
    assert early == late
    # Every step gave the root a new row: a read that did not wait would have seen its last.
    rows = [r[-1] for r in early[::3]]
    assert all(a != b for a, b in itertools.pairwise(rows))
