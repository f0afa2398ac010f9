"""Branch trees: fork (position, topology, the RNG cloned or reseeded), leases exhausted and
recycled, prune (RESTRICT, CASCADE, keep_children), and a beam search that fits its leases."""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import time

import kvfork
import numpy as np
import pytest

from .conftest import PROMPT, assert_close_logits, assert_follows, greedy_tokens, record, root


def test_fork_position_and_topology(ctx: kvfork.Context) -> None:
    parent = root(ctx)
    p = parent.position
    child = parent.fork_sync()
    assert child.position == p == child.fork_head
    assert parent.fork_head == 0 and parent.parent is None
    assert child.parent == parent and parent.children == [child]
    assert not parent.is_leaf and child.is_leaf and child.is_active
    assert child.handle != parent.handle and child.seq_id != parent.seq_id
    grandchild = child.fork_sync()
    assert grandchild.parent == child and grandchild.parent.parent == parent


def test_forked_greedy_children_continue_like_parent(ctx: kvfork.Context) -> None:
    parent = root(ctx)
    kids = [parent.fork_sync() for _ in range(3)]
    expected = record(parent, 10)
    for k in kids:  # in their own cells: rows equal up to noise, the same draws
        assert_follows(k, expected)
        assert k.history == parent.history


def test_children_decode_independently_and_survive_parent_prune(ctx: kvfork.Context) -> None:
    parent = root(ctx)
    a, b = parent.fork_sync(), parent.fork_sync()
    b.set_logit_bias({int(np.argmax(b.logits())): -math.inf})  # b diverges at once
    assert greedy_tokens(a, 3) != greedy_tokens(b, 3)
    twin = a.fork_sync()  # reference continuation of a, on its own lease
    expected = record(twin, 8)
    twin.prune_sync()
    with pytest.raises(kvfork.KvforkError, match="children"):
        parent.prune_sync()  # RESTRICT: live children
    assert not parent.disposed
    b.prune_sync()
    # drop the parent's own KV tags: the prefix cells a shares must survive
    ctx.kv_seq_remove(parent.seq_id)
    assert_follows(a, expected)
    seqs = [parent.seq_id, a.seq_id]
    parent.prune_subtree_sync()  # CASCADE
    assert a.disposed and parent.disposed
    assert [ctx.kv_seq_pos_max_sync(s) for s in seqs] == [-1, -1]


def test_prune_subtree_empties_sequences(ctx: kvfork.Context) -> None:
    parent = root(ctx)
    child = parent.fork_sync()
    seqs = [parent.seq_id, child.seq_id]
    parent.prune_subtree_sync()
    assert parent.disposed and child.disposed
    assert [ctx.kv_seq_pos_max_sync(s) for s in seqs] == [-1, -1]
    with pytest.raises(kvfork.BranchDisposedError):
        child.fork_sync()


def test_stochastic_forks_identical_until_reseeded(ctx: kvfork.Context) -> None:
    parent = root(
        ctx, params=kvfork.SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    )
    a, b = parent.fork_sync(), parent.fork_sync()
    # Same RNG state cloned: b draws what a drew, from a's rows (its own are a's up to noise).
    assert_follows(b, record(a, 12))
    c, d = parent.fork_sync(), parent.fork_sync()
    c.reseed_sampler(1)
    d.reseed_sampler(2)
    assert greedy_tokens(c, 20) != greedy_tokens(d, 20)


def test_lease_exhaustion_and_recycling(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=4) as c:
        first = root(c)
        branches = [first] + [first.fork_sync() for _ in range(3)]
        with pytest.raises(kvfork.LeaseExhaustedError):
            first.fork_sync()
        with pytest.raises(kvfork.LeaseExhaustedError):
            kvfork.Branch.create(c, 0)
        branches[2].prune_sync()
        branches[3].prune_sync()
        assert kvfork.BranchStore(c).available == 2
        # recycled sequences start empty: fresh branches behave like fresh contexts
        fresh = root(c, "Hello there")
        recycled = root(c, "Hello there")
        assert fresh.seq_id in (2, 3) and recycled.seq_id in (2, 3)
        # Other cells than fresh's: the same rows up to noise, the same tokens.
        assert_follows(recycled, record(fresh, 6))
        with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=1) as clean:
            assert_follows(root_after(c, branches), record(root(clean, "Hello there"), 6))


def root_after(c: kvfork.Context, branches: list[kvfork.Branch]) -> kvfork.Branch:
    branches[1].prune_sync()
    return root(c, "Hello there")


def test_thousand_cycles_leak_nothing(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=4) as c:
        base = root(c, "A")
        store = kvfork.BranchStore(c)

        def cycle() -> None:
            k = base.fork_sync()
            g = k.fork_sync()
            if g.handle % 2:
                k.prune_subtree_sync()
            else:
                g.prune_sync()
                k.prune_sync()

        for _ in range(100):
            cycle()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(1000):
            cycle()
        assert store.available == 3
        assert base.children == []
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 * 1024  # KiB


def test_fork_seed_diverges_and_no_seed_copies_the_rng(ctx: kvfork.Context) -> None:
    parent = root(ctx, params=kvfork.SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=7))
    same = [parent.fork_sync(), parent.fork_sync()]
    assert_follows(same[1], record(same[0], 12))  # cloned RNG state: the same draws
    seeded = [parent.fork_sync(seed=s) for s in (1, 2)]
    assert greedy_tokens(seeded[0], 12) != greedy_tokens(seeded[1], 12)


def test_prune_keep_children_frees_the_lease_and_keeps_the_children_exact(
    ctx: kvfork.Context,
) -> None:
    trunk = root(ctx)
    middle = trunk.fork_sync()
    middle.commit_sync(middle.produce_sync())
    kids = [middle.fork_sync() for _ in range(2)]
    expected = [k.top_logprobs(3) for k in kids]
    token = kids[1].produce_sync().token
    # A spare fork decodes the next token while `middle` still holds its lease: the reference.
    spare = kids[1].fork_sync()
    spare.commit_sync(token)
    reference = spare.logits()
    spare.prune_sync()
    store = kvfork.BranchStore(ctx)
    free = store.available
    with pytest.raises(kvfork.KvforkError, match="children"):
        middle.prune_sync()
    middle.prune_sync(keep_children=True)
    assert middle.disposed and store.available == free + 1
    assert trunk.children == [*kids] and all(k.parent == trunk for k in kids)
    assert [k.top_logprobs(3) for k in kids] == expected
    # The children's KV survived the prune: the same token decodes to the same logits.
    for k in kids:  # in other cells than the spare's: equal up to noise
        k.commit_sync(token)
        assert_close_logits(k.logits(), reference)
    trunk.prune_sync(keep_children=True)
    assert all(k.parent is None for k in kids)
    middle.prune_sync(keep_children=True)  # a second prune is a no-op


async def test_a_fork_whose_await_is_cancelled_leaves_no_child(ctx: kvfork.Context) -> None:
    """Cancelled before it ran, nothing happens; cancelled once the engine made the child
    (the loop held up, the await not resumed), the child nobody holds is pruned and its
    lease comes back."""
    parent = root(ctx)
    store = kvfork.BranchStore(ctx)
    free = store.available
    for turns in (0, 1, 2):
        fork = asyncio.ensure_future(parent.fork())
        for _ in range(turns):
            await asyncio.sleep(0)
        time.sleep(0.05)  # noqa: ASYNC251 (on purpose: the loop held up, the engine forks)
        fork.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await (await fork).prune()  # it had come back: the caller holds it
        deadline = time.monotonic() + 10
        while parent.children or store.available != free:  # a prune queued, not awaited
            assert time.monotonic() < deadline, turns
            await asyncio.sleep(0.01)
    child = await parent.fork()  # forks still work
    assert parent.children == [child]
    await child.prune()


async def test_a_fork_asked_for_before_a_prune_survives_it(ctx: kvfork.Context) -> None:
    """Operations run in the order asked: a fork queued before its parent's prune is made
    (the parent was live then), and the prune, which saw no child when it was called, keeps
    it as `keep_children` does (it failed on the engine, the parent left disposed and holding
    its lease)."""
    busy = root(ctx)
    parent = root(ctx)
    leases, at = kvfork.BranchStore(ctx).available, parent.position
    work = busy.prefill(ctx.tokenize(PROMPT * 8))  # the engine busy: both calls queue behind
    fork = parent.fork()
    gone = parent.prune()
    await work
    child = await fork
    await gone
    assert parent.disposed and not child.disposed and child.parent is None
    assert child.position == at
    assert kvfork.BranchStore(ctx).available == leases  # the parent's lease back, the child's taken
    await child.commit(child.sample())
    await child.prune()
    await busy.prune()


def test_width_4_beam_search_over_32_steps_fits_in_5_leases(model: kvfork.Model) -> None:
    width, steps = 4, 32
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=width + 1) as ctx:
        store = kvfork.BranchStore(ctx)
        first = root(ctx, PROMPT)
        beams: list[tuple[float, kvfork.Branch]] = [(0.0, first)]
        for _ in range(steps):
            candidates = [
                (score + lp, beam, token)
                for score, beam in beams
                for token, lp in beam.top_logprobs(width)
            ]
            chosen = sorted(candidates, key=lambda c: -c[0])[:width]
            keep = {id(beam) for _, beam, _ in chosen}
            for _, beam in beams:
                if id(beam) not in keep:
                    beam.prune_sync(keep_children=True)  # its forks may still be beams
            used: set[int] = set()
            moves = []
            for score, beam, token in chosen:
                target = beam if id(beam) not in used else beam.fork_sync()
                used.add(id(beam))
                moves.append((score, target, token))
            store.commit_sync([(b, t) for _, b, t in moves])  # all beams, one decode
            beams = [(s, b) for s, b, _ in moves]
            assert store.available >= 1
        assert len(beams) == width
        scores = [s for s, _ in beams]
        assert all(math.isfinite(s) for s in scores)
        best = max(beams, key=lambda sb: sb[0])[1]
        assert best.position == len(ctx.tokenize(PROMPT)) + steps
