"""Issue: branch trees — fork, tenancy, topology, metrics."""

from __future__ import annotations

import math
import resource

import kvfork
import numpy as np
import pytest

from .conftest import greedy_tokens, root


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
    expected = greedy_tokens(parent, 10)
    for k in kids:
        assert greedy_tokens(k, 10) == expected


def test_children_decode_independently_and_survive_parent_prune(ctx: kvfork.Context) -> None:
    parent = root(ctx)
    a, b = parent.fork_sync(), parent.fork_sync()
    b.set_logit_bias({int(np.argmax(b.logits())): -math.inf})  # b diverges at once
    assert greedy_tokens(a, 3) != greedy_tokens(b, 3)
    twin = a.fork_sync()  # reference continuation of a, on its own lease
    expected = greedy_tokens(twin, 8)
    twin.prune_sync()
    with pytest.raises(kvfork.KvforkError, match="children"):
        parent.prune_sync()  # RESTRICT: live children
    assert not parent.disposed
    b.prune_sync()
    # drop the parent's own KV tags: the prefix cells a shares must survive
    ctx.kv_seq_remove(parent.seq_id)
    assert greedy_tokens(a, 8) == expected
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
    assert greedy_tokens(a, 12) == greedy_tokens(b, 12)  # same RNG state cloned
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
        assert greedy_tokens(fresh, 6) == greedy_tokens(recycled, 6)
        with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=1) as clean:
            assert greedy_tokens(root(clean, "Hello there"), 6) == greedy_tokens(
                root_after(c, branches), 6
            )


def root_after(c: kvfork.Context, branches: list[kvfork.Branch]) -> kvfork.Branch:
    branches[1].prune_sync()
    return root(c, "Hello there")


def test_perplexity_metrics(ctx: kvfork.Context) -> None:
    b = root(ctx)
    assert math.isinf(b.perplexity) and math.isinf(b.sampling_perplexity)
    greedy_tokens(b, 6)
    ppl = b.perplexity
    assert math.isfinite(ppl) and ppl >= 1.0
    assert b.sampling_perplexity == pytest.approx(1.0)  # greedy: one candidate each step
    child = b.fork_sync()
    assert child.perplexity == ppl
    b.prefill_sync(ctx.tokenize(" and more text", add_special=False))
    assert b.perplexity == ppl  # prefill never counts
    nats = b.entropy()
    assert b.entropy("bits") == pytest.approx(nats / math.log(2))
    tok = int(np.argmax(b.logits()))
    assert b.surprisal(tok, "bits") == pytest.approx(b.surprisal(tok) / math.log(2))
    with pytest.raises(ValueError, match="base"):
        b.entropy("decibels")  # type: ignore[arg-type]


def test_perplexity_matches_numpy(ctx: kvfork.Context) -> None:
    b = root(ctx)
    surprisals = []
    for _ in range(5):
        logits = b.logits().astype(np.float64)
        t = b.produce_sync().token
        lse = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
        surprisals.append(lse - logits[t])
        assert b.surprisal(t) == pytest.approx(surprisals[-1], rel=1e-4)
        b.commit_sync(t)
    assert b.perplexity == pytest.approx(math.exp(np.mean(surprisals)), rel=1e-4)


def test_stochastic_sampling_perplexity_differs(ctx: kvfork.Context) -> None:
    b = root(ctx, params=kvfork.SamplingParams(temperature=0.9, seed=3))
    greedy_tokens(b, 8)
    assert math.isfinite(b.sampling_perplexity) and b.sampling_perplexity >= 1.0
    assert b.sampling_perplexity != b.perplexity


def test_set_logits(ctx: kvfork.Context) -> None:
    b = root(ctx)
    fake = np.full(ctx.vocab_size, -10.0, dtype=np.float32)
    fake[1234] = 10.0
    b.set_logits(fake)
    assert b.produce_sync().token == 1234
    assert np.array_equal(b.logits(), fake)
    with pytest.raises(ValueError, match="logits"):
        b.set_logits(fake[:-1])
    with pytest.raises(ValueError, match="logits"):
        b.set_logits(fake.astype(np.float64))


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
    assert greedy_tokens(same[0], 12) == greedy_tokens(same[1], 12)  # cloned RNG state
    seeded = [parent.fork_sync(seed=s) for s in (1, 2)]
    assert greedy_tokens(seeded[0], 12) != greedy_tokens(seeded[1], 12)


def test_context_reports_its_threads(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1, n_threads=1) as c:
        assert c.n_threads == 1
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as c:
        assert c.n_threads >= 1
