"""kvfork.patterns: beam search against greedy and a brute-force search, diverse groups,
leases given back, bad arguments, and the sync form refusing a running event loop; `rank`
against each candidate scored alone, over more candidates than leases, cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Coroutine
from typing import Any

import kvfork
import numpy as np
import pytest
from kvfork.patterns import beam_search, beam_search_sync, rank, rank_sync

from .conftest import (
    COUNTING,
    GREEDY,
    LOGPROB_NOISE,
    assert_same_greedy,
    greedy_with_margins,
    root,
)


def test_width_1_is_greedy(ctx: kvfork.Context) -> None:
    expected, margins = greedy_with_margins(root(ctx, COUNTING), 8)
    (beam,) = beam_search_sync(root(ctx, COUNTING), 1, 8)  # in other cells: the margin rule
    assert_same_greedy(beam.tokens, expected, margins)
    assert not beam.finished and beam.text == ctx.detokenize(beam.tokens)


def test_two_steps_match_a_brute_force_search(ctx: kvfork.Context) -> None:
    """Width 3 over 2 tokens must return the best pairs among the top-3 first tokens, each
    followed by its top-3 second tokens: scored here one fork at a time. The search decodes
    its beams together, in other cells: its second log-probabilities are those of the forks
    here up to noise (conftest.LOGPROB_NOISE), which may swap pairs closer than that."""
    width = 3
    start = root(ctx)
    scored: dict[tuple[int, int], float] = {}
    candidates: list[float] = []  # the pairs of the top-3 tokens: what the search ranks
    for t1, lp1 in start.top_logprobs(width):
        one = start.fork_sync()
        one.commit_sync(t1)
        # One more second token: noise may bring the fourth into the search's top three.
        seconds = one.top_logprobs(width + 1)
        scored |= {(t1, t2): lp1 + lp2 for t2, lp2 in seconds}
        candidates += [lp1 + lp2 for _, lp2 in seconds[:width]]
        one.prune_sync()
    best = sorted(candidates, reverse=True)
    store = kvfork.BranchStore(ctx)
    free, position = store.available, start.position
    beams = beam_search_sync(start, width, 2)
    assert len(beams) == width and len({tuple(b.tokens) for b in beams}) == width
    assert [b.logprob for b in beams] == sorted((b.logprob for b in beams), reverse=True)
    for place, beam in enumerate(beams):
        logprob = scored[(beam.tokens[0], beam.tokens[1])]
        assert beam.logprob == pytest.approx(logprob, abs=LOGPROB_NOISE)
        # Among the best: as good as the pair of its rank, but for noise on both.
        assert logprob >= best[place] - 2 * LOGPROB_NOISE, (beam.tokens, logprob, best)
    assert store.available == free and start.position == position  # nothing left behind


async def test_diverse_groups_spread_and_plain_groups_do_not(ctx: kvfork.Context) -> None:
    start = root(ctx)
    plain = await beam_search(start, 2, 3, groups=2)
    # Two groups, no penalty: the same beam. Both take their first token from the start's
    # row; later tokens from rows of copies in other cells, equal up to noise.
    assert plain[0].tokens[0] == plain[1].tokens[0]
    assert plain[1].logprob == pytest.approx(plain[0].logprob, abs=LOGPROB_NOISE)
    diverse = await beam_search(start, 2, 3, groups=2, diversity=50.0)
    assert diverse[0].tokens[0] != diverse[1].tokens[0]
    assert max(b.logprob for b in diverse) == pytest.approx(plain[0].logprob, abs=LOGPROB_NOISE)


async def test_a_search_cancelled_at_any_point_gives_every_branch_back(
    ctx: kvfork.Context,
) -> None:
    """Cancelled after 0, 1, 2... turns of the event loop, the loop then held up long enough
    for the engine to finish what the search asked (a fork done but its await not resumed:
    the cancel wins, and `Branch.fork` prunes the child nobody holds): every fork it made
    is pruned, and the start branch is as it was."""
    start = root(ctx)
    store = kvfork.BranchStore(ctx)
    free, position = store.available, start.position
    for turns in range(16):
        await _cancel_after(turns, beam_search(start, 2, 50))
        assert start.children == [], turns
        await _leases_back(store, free, turns)
    assert start.position == position


async def _cancel_after(turns: int, work: Coroutine[Any, Any, Any]) -> None:
    """Run `work`, let the event loop turn `turns` times, hold the loop up long enough for
    the engine to finish what was asked, then cancel it."""
    task = asyncio.ensure_future(work)
    for _ in range(turns):
        await asyncio.sleep(0)
    time.sleep(0.05)  # noqa: ASYNC251 (on purpose: the loop held up, the engine finishes)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _leases_back(store: kvfork.BranchStore, free: int, turns: int) -> None:
    """`free` leases again soon: a fork made as its await was cancelled is pruned by a
    queued call."""
    deadline = time.monotonic() + 10
    while store.available != free:
        assert time.monotonic() < deadline, turns
        await asyncio.sleep(0.01)


def test_length_penalty_and_finished_beams(chat_ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(chat_ctx, 0, GREEDY)
    prompt = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    b.prefill_sync(chat_ctx.tokenize(prompt, parse_special=True))
    beams = beam_search_sync(b, 3, 12, length_penalty=1.0)
    assert any(beam.finished for beam in beams)
    for beam in beams:
        assert beam.score == pytest.approx(beam.logprob / len(beam.tokens))
        assert beam.finished == chat_ctx.is_stop_token(beam.tokens[-1])
    assert [beam.score for beam in beams] == sorted((b.score for b in beams), reverse=True)


def test_the_search_stops_unfinished_at_the_end_of_the_context(model: kvfork.Model) -> None:
    """As `generate` stops there (it raised KvCacheFullError and returned no beam)."""
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=5) as small:
        b = kvfork.Branch.create(small, 0, GREEDY)
        b.prefill_sync(small.tokenize("one two three " * 120)[:250])
        beams = beam_search_sync(b, 2, 10)
        # 6 cells left for 2 beams: the search ends where the next step finds none.
        assert len(beams) == 2 and all(1 <= len(beam.tokens) <= 6 for beam in beams)
        assert any(not beam.finished for beam in beams)
        assert kvfork.BranchStore(small).available == small.n_seq_max - 1  # all given back


def test_bad_arguments_raise(ctx: kvfork.Context) -> None:
    b = root(ctx)
    bad: list[dict[str, Any]] = [
        {"width": 0},
        {"max_tokens": 0},
        {"groups": 3},
        {"diversity": -1.0},
        {"length_penalty": float("nan")},
        {"length_penalty": float("inf")},
    ]
    for kwargs in bad:
        args: dict[str, Any] = {"width": 2, "max_tokens": 2, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            beam_search_sync(b, args.pop("width"), args.pop("max_tokens"), **args)
    for kwargs in ({"width": 2.5}, {"max_tokens": True}, {"groups": "1"}):
        args = {"width": 2, "max_tokens": 2, **kwargs}
        with pytest.raises(TypeError, match=f"{next(iter(kwargs))} must be an int"):
            beam_search_sync(b, args.pop("width"), args.pop("max_tokens"), **args)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        beam_search_sync(kvfork.Branch.create(ctx), 2, 2)
    assert kvfork.BranchStore(ctx).available == ctx.n_seq_max - 2  # the searches gave back


async def test_beam_search_sync_inside_a_running_loop_names_the_async_form(
    ctx: kvfork.Context,
) -> None:
    b = root(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no never-awaited coroutine left behind
        with pytest.raises(RuntimeError, match=r"running event loop.*await beam_search"):
            beam_search_sync(b, 2, 4)
    assert b.position == len(ctx.tokenize("The history of the printing press begins with"))
    # The engine-waiting twins stay allowed inside a loop (they block it, as documented).
    b.commit_sync(b.produce_sync().token)
    await asyncio.sleep(0)


QUESTION = "Q: What is the capital of France?\nA:"
ANSWERS = [" Lyon, a city in France.", " Paris.", " Rome, in Italy.", " Berlin.", " Madrid."]


def test_rank_scores_each_candidate_as_it_scores_alone(model: kvfork.Model) -> None:
    """Five answers over two free leases: three rounds of one decode each, each answer's
    logprob the sum of its scores on a fork of its own, " Paris." first; the question's
    branch as it was, every fork pruned; a mean per token with length_penalty=1."""
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=3) as ctx:
        question = root(ctx, QUESTION)
        store = kvfork.BranchStore(ctx)
        free, history = store.available, question.history
        calls = ctx.stats()["decode_calls"]
        ranked = rank_sync(question, ANSWERS)
        assert ctx.stats()["decode_calls"] - calls == 3
        assert (store.available, question.history, question.children) == (free, history, [])
        assert ranked[0].text == " Paris." and sorted(r.index for r in ranked) == list(range(5))
        for r in ranked:
            fork = question.fork_sync()
            alone = fork.score_sync(ctx.tokenize(ANSWERS[r.index], add_special=False))
            fork.prune_sync()
            assert r.logprob == pytest.approx(sum(alone), abs=1.0)  # rounding of another batch
            assert r.score == r.logprob and r.tokens == ctx.tokenize(r.text, add_special=False)
        assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
        by_mean = rank_sync(
            question, [ctx.tokenize(a, add_special=False) for a in ANSWERS], length_penalty=1.0
        )
        for r in by_mean:
            assert r.score == pytest.approx(r.logprob / len(r.tokens))


async def test_rank_refuses_what_it_cannot_score_and_cancelled_gives_every_fork_back(
    ctx: kvfork.Context,
) -> None:
    start = root(ctx, QUESTION)
    store = kvfork.BranchStore(ctx)
    free = store.available
    with pytest.raises(ValueError, match="candidate 1 has no tokens"):
        await rank(start, [" Paris", ""])
    with pytest.raises(ValueError, match="length_penalty"):
        await rank(start, [" Paris"], length_penalty=float("nan"))
    fresh = kvfork.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        await rank(fresh, [" Paris"])
    await fresh.prune()
    assert await rank(start, []) == []
    for turns in range(8):
        await _cancel_after(turns, rank(start, ANSWERS))
        await _leases_back(store, free, turns)
        assert start.children == [], turns
    with pytest.raises(RuntimeError, match="await rank"):
        rank_sync(start, [" Paris"])


async def test_concurrent_ranks_share_the_free_leases(model: kvfork.Model) -> None:
    """Two ranks at once over four free leases: each goes on with the forks it could make
    (both read four free and asked for four: one got LeaseExhaustedError)."""
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=6) as ctx:
        questions = [root(ctx, QUESTION), root(ctx, "Q: Which city is the capital of Italy?\nA:")]
        together = await asyncio.gather(*(rank(q, ANSWERS) for q in questions))
        assert kvfork.BranchStore(ctx).available == 4
        for question, ranked in zip(questions, together):
            alone = {r.index: r.logprob for r in await rank(question, ANSWERS)}
            assert [r.logprob for r in ranked] == pytest.approx(
                [alone[r.index] for r in ranked], abs=1.0
            )


def test_rank_scores_candidates_alone_when_they_do_not_fit_together(model: kvfork.Model) -> None:
    """Two 300-token candidates in a 512-cell context: each fits beside the question, not
    both at once (a KvCacheFullError before): scored one after the other."""
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=4) as ctx:
        question = root(ctx, QUESTION)
        long_answers = [(ctx.tokenize(a, add_special=False) * 80)[:300] for a in ANSWERS[:2]]
        ranked = rank_sync(question, long_answers)
        assert sorted(r.index for r in ranked) == [0, 1]
        assert kvfork.BranchStore(ctx).available == 3 and question.children == []


def test_rank_refuses_what_is_not_a_candidate(ctx: kvfork.Context) -> None:
    """A text where a list is wanted, bytes, a mapping, bools: TypeErrors naming the
    candidate (bytes were ranked as their byte values, a text as one candidate a letter);
    NumPy integers are token ids."""
    start = root(ctx, QUESTION)
    free = kvfork.BranchStore(ctx).available
    for bad in (" Paris", b" Paris", 5):
        with pytest.raises(TypeError, match="candidates must be a list"):
            rank_sync(start, bad)  # type: ignore[arg-type]
    for candidate in (b" Paris", {1: 2}, [1, True], [1.0], 7):
        with pytest.raises(TypeError, match="candidate 1 must"):
            rank_sync(start, [" Paris", candidate])  # type: ignore[list-item]
    paris = ctx.tokenize(" Paris", add_special=False)
    ranked = rank_sync(start, [np.array(paris, dtype=np.int32), (t for t in paris)])
    assert [r.tokens for r in ranked] == [paris, paris]
    assert kvfork.BranchStore(ctx).available == free  # every fork pruned
