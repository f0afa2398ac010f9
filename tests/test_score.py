"""`Branch.score`: a prefill that returns each token's log-probability given everything before
it. Checked against the logprob a branch prefilled up to that token gives it (another batch
shape: equal up to rounding, which moves the default model's logprobs by up to ~0.25 nats on
unlikely tokens), against the perplexity of the same tokens committed one by one, and for
what it leaves behind: the branch as a prefill leaves it, or, when it fails, as it was."""

from __future__ import annotations

import asyncio
import math

import kvfork
import numpy as np
import pytest

from .conftest import COUNTING, GREEDY, greedy_tokens

#: 135 tokens: three scoring decodes (64 rows each).
TEXT = " ".join(f"Line {i}: the printing press spread across Europe." for i in range(12))
#: How far a score may be from the reference's logprob (rounding of other batch shapes; an
#: off-by-one position would be off by several nats).
ATOL = 0.5


def _prefilled(ctx: kvfork.Context, tokens: list[int]) -> kvfork.Branch:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(tokens)
    return b


def test_scores_are_the_logprobs_a_prefill_to_each_token_gives_it(ctx: kvfork.Context) -> None:
    tokens = ctx.tokenize(TEXT)
    b = _prefilled(ctx, tokens[:1])
    scores = b.score_sync(tokens[1:])
    assert len(scores) == len(tokens) - 1
    assert all(isinstance(s, float) and s <= 0 for s in scores)
    gaps = []
    for k in (1, 2, 17, 64, 65, 66, 129, len(tokens) - 1):
        reference = _prefilled(ctx, tokens[:k])
        gaps.append(abs(scores[k - 1] - reference.logprob(tokens[k])))
        reference.prune_sync()
    assert max(gaps) < ATOL and float(np.mean(gaps)) < 0.1, gaps

    # The same tokens committed one by one: their perplexity is the scores'.
    one_by_one = _prefilled(ctx, tokens[:1])
    for t in tokens[1:]:
        one_by_one.commit_sync(t)
    log_likelihood = -len(scores) * math.log(one_by_one.perplexity)
    assert sum(scores) == pytest.approx(log_likelihood, rel=0.03)


def test_top_logprobs_come_best_first_with_the_tokens_own(ctx: kvfork.Context) -> None:
    tokens = ctx.tokenize(COUNTING)
    b = _prefilled(ctx, tokens[:1])
    first = b.logprob(tokens[1]), b.top_logprobs(3)
    scored = asyncio.run(_score(b, tokens[1:], 3))
    assert scored[0][0] == pytest.approx(first[0], abs=1e-5)
    assert [t for t, _ in scored[0][1]] == [t for t, _ in first[1]]
    for token, (logprob, best) in zip(tokens[1:], scored):
        assert len(best) == 3
        assert [lp for _, lp in best] == sorted((lp for _, lp in best), reverse=True)
        assert best[0][1] >= logprob
        if token in dict(best):
            assert dict(best)[token] == pytest.approx(logprob, abs=1e-9)
    # Counting on: the next number is the model's first choice almost everywhere.
    assert sum(token == best[0][0] for token, (_, best) in zip(tokens[1:], scored)) > 12
    c = _prefilled(ctx, tokens[:1])
    assert [best for _, best in c.score_sync(tokens[1:], top_logprobs=0)] == [[]] * (
        len(tokens) - 1
    )


async def _score(
    b: kvfork.Branch, tokens: list[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    return await b.score(tokens, top_logprobs=top)


def test_a_scored_branch_is_a_prefilled_one(ctx: kvfork.Context) -> None:
    """Position, history and snapshot as a prefill leaves them; it generates the same, and
    forks share what was scored."""
    tokens = ctx.tokenize(COUNTING)
    b = _prefilled(ctx, tokens[:3])
    b.score_sync(tokens[3:])
    reference = _prefilled(ctx, tokens)
    assert (b.position, b.history) == (reference.position, reference.history)
    np.testing.assert_allclose(b.logits(), reference.logits(), atol=1.0)
    assert b.perplexity == math.inf  # nothing was accepted
    fork = b.fork_sync()
    assert greedy_tokens(b, 6) == greedy_tokens(reference, 6) == greedy_tokens(fork, 6)


def test_a_score_that_cannot_run_changes_nothing(ctx: kvfork.Context) -> None:
    tokens = ctx.tokenize(TEXT)
    fresh = kvfork.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        fresh.score_sync(tokens)  # the first token has nothing to be scored from
    assert (fresh.position, fresh.history) == (0, [])
    assert fresh.score_sync([]) == [] and fresh.score_sync([], top_logprobs=2) == []

    b = _prefilled(ctx, tokens)
    before = b.logits()
    with pytest.raises(kvfork.KvCacheFullError):
        b.score_sync(tokens * (ctx.n_ctx // len(tokens)))
    with pytest.raises(ValueError):
        b.score_sync([ctx.vocab_size])
    for top in (-1, 1025):  # the whole vocabulary at each position: tens of GB of tuples
        with pytest.raises(ValueError, match="top_logprobs"):
            b.score_sync(tokens[:2], top_logprobs=top)
    with pytest.raises(TypeError):
        b.score_sync(b"ab")
    assert (b.position, b.history) == (len(tokens), tokens)
    assert ctx.kv_seq_pos_max_sync(b.seq_id) == len(tokens) - 1
    np.testing.assert_array_equal(b.logits(), before)
    b.prune_sync()
    with pytest.raises(kvfork.BranchDisposedError):
        b.score_sync(tokens[:2])


def test_a_score_that_fails_mid_way_is_rolled_back(model: kvfork.Model) -> None:
    """Cells for its first decodes but not the rest: KvCacheFullError after some decodes,
    the cells they wrote removed, and the branch goes on as it was."""
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=3) as ctx:
        tokens = ctx.tokenize(TEXT)
        neighbour = _prefilled(ctx, tokens)  # over half the cells
        b = _prefilled(ctx, tokens[:8])
        room = ctx.n_ctx - neighbour.position - b.position
        assert 64 < room < len(tokens) - 8
        with pytest.raises(kvfork.KvCacheFullError):
            b.score_sync(tokens[8:])
        assert (b.position, b.history) == (8, tokens[:8])
        assert ctx.kv_seq_pos_max_sync(b.seq_id) == 7
        # Two branches' runs in a store: the same, for both.
        c = neighbour.fork_sync()
        with pytest.raises(kvfork.KvCacheFullError):
            kvfork.BranchStore(ctx).score_sync([(c, tokens[:40]), (b, tokens[8:])])
        assert (b.position, b.history, c.position) == (8, tokens[:8], len(tokens))
        assert ctx.kv_seq_pos_max_sync(b.seq_id) == 7
        assert ctx.kv_seq_pos_max_sync(c.seq_id) == len(tokens) - 1
        c.prune_sync()
        neighbour.prune_sync()
        assert len(b.score_sync(tokens[8:])) == len(tokens) - 8
        assert b.history == tokens


def test_scoring_on_a_device_sampling_context_reads_whole_rows(model: kvfork.Model) -> None:
    """The device keeps only a row's best candidates: scores still come from whole rows, as
    a plain context's (the first from the snapshot, decoded again)."""
    tokens = []
    results = []
    for device in (False, True):
        with kvfork.create_context_sync(model, n_ctx=512, device_sampling=device) as ctx:
            tokens = ctx.tokenize(TEXT)
            b = _prefilled(ctx, tokens[:20])
            results.append(b.score_sync(tokens[20:], top_logprobs=2))
    plain, device_scores = results
    assert len(device_scores) == len(tokens) - 20
    for (a, best_a), (d, best_d) in zip(plain, device_scores):
        assert d == pytest.approx(a, abs=ATOL)
        assert len(best_d) == 2
        near_tie = best_a[0][1] - best_a[1][1] < ATOL
        assert best_d[0][0] == best_a[0][0] or near_tie, (best_a, best_d)


def test_a_store_scores_many_branches_packed_into_one_decode(model: kvfork.Model) -> None:
    """Four answers to one question, each on its fork: one decode for all of them, each
    run's scores those its branch alone gives (up to the rounding of another batch), and
    the branches left as their own scores leave them."""
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=12) as ctx:
        store = kvfork.BranchStore(ctx)
        question = _prefilled(ctx, ctx.tokenize("Q: What is the capital of France?\nA:"))
        answers = [
            ctx.tokenize(a, add_special=False)
            for a in (" Paris", " Lyon", " Paris, of course", " Rome")
        ]
        forks = [question.fork_sync() for _ in answers]
        calls = ctx.stats()["decode_calls"]
        together = store.score_sync(list(zip(forks, answers)))
        assert ctx.stats()["decode_calls"] == calls + 1
        alone = [question.fork_sync() for _ in answers]
        for fork, answer, scores in zip(alone, answers, together):
            assert scores == pytest.approx(fork.score_sync(answer), abs=ATOL)
        for fork, other in zip(forks, alone):
            assert (fork.position, fork.history) == (other.position, other.history)
        likelihoods = [sum(s) for s in together]
        assert likelihoods[0] > max(likelihoods[1], likelihoods[3])  # Paris, not Lyon or Rome
        with_top = asyncio.run(_store_score(store, list(zip(alone, answers))))
        assert [len(run) for run in with_top] == [len(a) for a in answers]
        assert all(len(best) == 2 for run in with_top for _, best in run)


async def _store_score(
    store: kvfork.BranchStore, entries: list[tuple[kvfork.Branch, list[int]]]
) -> list[list[tuple[float, list[tuple[int, float]]]]]:
    return await store.score(entries, top_logprobs=2)


def test_a_store_score_is_all_or_nothing(ctx: kvfork.Context) -> None:
    store = kvfork.BranchStore(ctx)
    tokens = ctx.tokenize(TEXT)
    a, b = _prefilled(ctx, tokens[:5]), _prefilled(ctx, tokens[:9])
    fresh = kvfork.Branch.create(ctx, 0, GREEDY)
    calls = ctx.stats()["decode_calls"]
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        store.score_sync([(a, tokens[5:20]), (fresh, tokens[:3])])
    with pytest.raises(kvfork.KvCacheFullError):
        store.score_sync([(a, tokens[5:20]), (b, tokens * (ctx.n_ctx // len(tokens) + 1))])
    with pytest.raises(ValueError, match="twice"):
        store.score_sync([(a, tokens[5:8]), (a, tokens[8:9])])
    assert ctx.stats()["decode_calls"] == calls  # each refused before any decode
    assert [(x.position, x.history) for x in (a, b, fresh)] == [
        (5, tokens[:5]),
        (9, tokens[:9]),
        (0, []),
    ]
    assert store.score_sync([(a, []), (b, tokens[9:12])])[0] == []
    assert (a.position, b.position) == (5, 12)


def test_a_store_scores_more_branches_than_leases_on_a_park_context(
    model: kvfork.Model,
) -> None:
    """Six branches over two leases: scored two at a time, each as it scores alone."""
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2, park=True) as ctx:
        tokens = ctx.tokenize(COUNTING)
        branches = [_prefilled(ctx, tokens[: 2 + i]) for i in range(6)]
        runs = [tokens[2 + i : 12 + i] for i in range(6)]
        scores = kvfork.BranchStore(ctx).score_sync(list(zip(branches, runs)))
        for i, (b, run) in enumerate(zip(branches, runs)):
            assert b.history == tokens[: 12 + i]
            alone = _prefilled(ctx, tokens[: 2 + i]).score_sync(run)
            assert scores[i] == pytest.approx(alone, abs=ATOL)
