"""Exact speculative decoding: `generate(draft=...)` yields the tokens plain generation
draws, greedy and seeded, with good drafts, bad drafts and a grammar; the KV keeps only
what was accepted.

A verification batch computes its rows in another batch shape than plain generation's
one-token decodes: they agree up to noise (conftest.LOGIT_NOISE), so the tokens are compared
by the margin rule (`assert_same_greedy`), for seeded draws with the margin that leaves one
candidate to draw from (`draw_near_tie`). Where speculation runs plain generation's very
decodes (guesses never decoded), in its cells, the comparison is exact."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

import kvfork
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .conftest import (
    GREEDY,
    NEAR_TIE,
    assert_follows,
    assert_same_greedy,
    draw_near_tie,
    margin,
    record,
    root,
)

COPY = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine, orange, papaya\nCopy: apple, banana,"
)
SEEDED = {"temperature": 0.8, "seed": 5}  # the default chain's truncations: min-p 0.05
SEEDED_NEAR_TIE = draw_near_tie(0.05)


class Wrong:
    """A drafter that is always wrong: every guess is rejected."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        return [7, 7, 7]


class SlowWrong(Wrong):
    """Always wrong, and too dear to be asked for shadow guesses: the policy guesses blind
    and probes, as it does for a draft model."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        time.sleep(0.05)
        return super().propose(tokens)


class MostlyRight:
    """Knows the tokens the chain draws (`expected`, after `prompt_len` prompt tokens):
    guesses the next 6 right and the one after them wrong."""

    def __init__(self, prompt_len: int, expected: list[int]) -> None:
        self.prompt_len = prompt_len
        self.expected = expected

    def propose(self, tokens: Sequence[int]) -> list[int]:
        i = len(tokens) - self.prompt_len
        return [*self.expected[i : i + 6], 7]


def pair(
    ctx: kvfork.Context, params: kvfork.SamplingParams | dict[str, Any] | None
) -> tuple[kvfork.Branch, kvfork.Branch]:
    a = root(ctx, COPY, params)
    return a, a.fork_sync()


def plain_generation(b: kvfork.Branch, n: int) -> tuple[list[int], list[float]]:
    """`n` tokens of `generate` and, for each, the greedy margin of the row it was drawn
    from (commit-before-yield: the branch holds the next token's row at each yield)."""
    tokens, margins = [], [margin(b.logits())]
    for t in b.generate_sync(n):
        tokens.append(t.token)
        margins.append(margin(b.logits()))
    return tokens, margins[: len(tokens)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prompt_lookup_draws_what_plain_generation_draws(
    ctx: kvfork.Context, params: kvfork.SamplingParams | dict[str, Any] | None
) -> None:
    plain, spec = pair(ctx, params)
    prompt = plain.history
    expected, margins = plain_generation(plain, 40)
    before = ctx.stats()["decode_calls"]
    stream = spec.generate_sync(40, draft=kvfork.PromptLookup())
    got = [t.token for t in stream]
    assert_same_greedy(got, expected, margins, NEAR_TIE if params is GREEDY else SEEDED_NEAR_TIE)
    assert stream.stop_reason == "max_tokens"
    # The list is copied. How many rounds depends on the measured cost of wide decodes (a
    # busy core inflates it); at least the first full guess of 8 is decoded and kept.
    assert stream.acceptance > 0.5 and stream.rounds <= 40 - 8
    assert ctx.stats()["decode_calls"] - before == stream.rounds
    # Same state after: position, history, perplexity, and what comes next.
    assert spec.position == plain.position and spec.history == prompt + got
    if got == expected:  # as here (every greedy margin on this prompt is 1.7 or more)
        # Rows of a verification batch differ from one-token decodes' by noise, but these
        # tokens are nearly certain and their log-probabilities barely move: the perplexities
        # agree to 0.07 % here, 1 % allows a noisier backend 15 times as much.
        assert spec.perplexity == pytest.approx(plain.perplexity, rel=1e-2)
        # What comes next: drawing from the plain branch's rows, the speculating one draws its
        # tokens (its RNG moved as plain generation's did, one draw a token).
        assert_follows(spec, record(plain, 8))


async def test_rejected_drafts_leave_no_trace(ctx: kvfork.Context) -> None:
    plain, spec = pair(ctx, SEEDED)
    prompt_len = plain.position
    expected, margins = plain_generation(plain, 24)
    stream = spec.generate(24, draft=MostlyRight(prompt_len, expected))
    assert_same_greedy([t.token async for t in stream], expected, margins, SEEDED_NEAR_TIE)
    # Its shadow guesses were kept (mostly), so it guessed, and the chain refused the wrong
    # tokens.
    assert 0 < stream.accepted < stream.drafted
    assert spec.position == plain.position
    assert ctx.kv_seq_pos_max_sync(spec.seq_id) == spec.position - 1  # the guesses are gone


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_stream_whose_guesses_would_be_refused_decodes_none(
    ctx: kvfork.Context, params: kvfork.SamplingParams | dict[str, Any] | None
) -> None:
    # The wrong guesses are checked against the drawn tokens (shadow checks), never decoded:
    # one one-token decode a token, as plain generation. The plain branch is pruned first and
    # the speculating one prefilled in its cells: the same decodes over the same cells, so
    # the same rows bit for bit, and the same draws (seeded too: the RNG moves alike).
    plain = root(ctx, COPY, params)
    expected = [t.token for t in plain.generate_sync(24)]
    state = (plain.position, plain.perplexity, plain.sampling_perplexity)
    plain.prune_sync()
    spec = root(ctx, COPY, params)
    before = ctx.stats()["decode_calls"]
    stream = spec.generate(24, draft=Wrong())
    assert [t.token async for t in stream] == expected
    assert (stream.drafted, stream.rounds) == (0, 24)
    assert ctx.stats()["decode_calls"] - before == 24
    assert stream.schedule.resting and stream.schedule.shadowing
    assert (spec.position, spec.perplexity, spec.sampling_perplexity) == state
    sync = spec.fork_sync().generate_sync(8, draft=Wrong())
    # The fork's stream decodes no guess either while it shadows, which it does while the
    # drafter costs under SHADOW_SHARE (2%) of a one-token round: about 30 us on a GPU,
    # which a Python drafter on a loaded machine can pass (the policy then probes).
    assert len(list(sync)) == 8 and (sync.drafted == 0 or not sync.schedule.shadowing)


def test_a_stream_goes_on_from_where_others_left_its_branch(ctx: kvfork.Context) -> None:
    # Between two tokens someone else advances the branch (a store step, a commit): the token
    # the stream drew before is stale, and it samples again from the branch, as plain
    # generation does. Their tokens are not the stream's: it still yields 12.
    plain, spec = pair(ctx, GREEDY)
    prompt = plain.history
    expected, margins = plain_generation(plain, 14)
    stream = spec.generate_sync(12, draft=kvfork.PromptLookup())
    got = []
    for t in stream:
        got.append(t.token)
        if len(got) == 3:
            kvfork.BranchStore(ctx).step_sync([spec])
        elif len(got) == 7:
            spec.commit_sync(spec.produce_sync())
    assert len(got) == 12 and stream.stop_reason == "max_tokens"
    assert_same_greedy(spec.history[len(prompt) :], expected, margins)


async def test_a_cancelled_round_commits_the_greedy_tokens_within_max_tokens(
    ctx: kvfork.Context,
) -> None:
    # A round cancelled once the engine runs it completes: its tokens are committed, not
    # yielded (as a cancelled step of plain generation), and count against max_tokens; the
    # next round must not decode the round's first token again.
    plain = root(ctx, COPY)
    prompt = plain.history
    expected, margins = plain_generation(plain, 20)
    plain.prune_sync()
    landed = 0
    for delay in (0.0005, 0.002, 0.005, 0.01, 0.0005, 0.002, 0.005, 0.01):
        spec = root(ctx, COPY)
        stream = spec.generate(10, draft=kvfork.PromptLookup())
        got = [(await stream.__anext__()).token]
        while stream.queue:  # the next call runs a round
            got.append((await stream.__anext__()).token)
        before = len(got)
        try:
            got.append((await asyncio.wait_for(stream.__anext__(), delay)).token)
        except asyncio.TimeoutError:
            landed += spec.position - len(prompt) > len(got)
        got += [t.token async for t in stream]
        committed = spec.history[len(prompt) :]
        assert len(committed) <= 10 and stream.stop_reason == "max_tokens"
        assert_same_greedy(committed, expected[: len(committed)], margins)
        assert committed[:before] == got[:before]
        await spec.prune()
    assert landed > 0  # at least one cancel landed while the round ran


def test_a_dear_drafter_is_not_asked_for_shadow_guesses(ctx: kvfork.Context) -> None:
    plain, spec = pair(ctx, SEEDED)
    expected, margins = plain_generation(plain, 12)
    stream = spec.generate_sync(12, draft=SlowWrong())  # its blind guesses are decoded
    assert_same_greedy([t.token for t in stream], expected, margins, SEEDED_NEAR_TIE)
    # Asked once in the first round (its cost unknown), then only to guess: it guesses blind.
    assert not stream.schedule.shadowing
    assert stream.accepted == 0 and stream.drafted > 0


def test_a_grammar_constrains_the_drafts(ctx: kvfork.Context) -> None:
    plain, spec = pair(ctx, SEEDED)
    for b in (plain, spec):
        b.set_regex(" [0-9]{6}")
    expected = "".join(t.text for t in plain.generate_sync(12))
    stream = spec.generate_sync(12, draft=SlowWrong())
    got = "".join(t.text for t in stream)
    # Wrong drafts are rejected and the constraint holds. (Equality with the plain branch is
    # not asserted: the six digits are near-uniform, and a verification batch's logits differ
    # from a single decode's in the last bits, which can flip a seeded draw between them.)
    assert re.fullmatch(" [0-9]{6}", got) and re.fullmatch(" [0-9]{6}", expected)
    assert stream.accepted == 0 and stream.drafted > 0


def test_bad_drafts_raise(ctx: kvfork.Context) -> None:
    b = root(ctx, COPY)
    with pytest.raises(TypeError, match="propose"):
        b.generate_sync(4, draft=object())  # type: ignore[call-overload]
    pending = b.produce_sync()
    with pytest.raises(ValueError, match="out of range"):
        b.speculate_sync(pending, [ctx.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        b.speculate_sync(pending, [2**40])
    position = b.position
    accepted, nxt = b.speculate_sync(pending, [])  # no guess: a plain step
    assert accepted == [] and b.position == position + 1 and not nxt.is_stop


def test_a_draft_model_in_its_own_context(
    model: kvfork.Model, ctx: kvfork.Context, chat_ctx: kvfork.Context
) -> None:
    plain, spec = pair(ctx, GREEDY)
    expected, margins = plain_generation(plain, 24)
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2) as draft_ctx:
        drafter = kvfork.DraftModel(draft_ctx, max_draft=4)
        stream = spec.generate_sync(24, draft=drafter)
        assert_same_greedy([t.token for t in stream], expected, margins)
        assert stream.acceptance > 0.8  # the same model agrees with itself
        drafter.close()
        assert kvfork.BranchStore(draft_ctx).available == 2
    small = kvfork.DraftModel(chat_ctx)  # SmolLM2: a smaller vocabulary than Gemma's
    with pytest.raises(ValueError, match="vocabulary"):
        list(root(ctx, COPY).generate_sync(4, draft=small))


def _lookup_reference(tokens: list[int], ngram: int, min_ngram: int, max_draft: int) -> list[int]:
    """PromptLookup's contract, written the slow way."""
    for n in range(min(ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + max_draft]
    return []


@given(
    tokens=st.lists(st.sampled_from([1, 2, 3, 256, 257, 65536, 65793]), max_size=40),
    ngram=st.integers(1, 4),
    max_draft=st.integers(1, 6),
)
def test_prompt_lookup_finds_the_latest_earlier_match(
    tokens: list[int], ngram: int, max_draft: int
) -> None:
    # Multi-byte token values make byte matches that straddle tokens: they must not count.
    lookup = kvfork.PromptLookup(ngram=ngram, max_draft=max_draft, min_ngram=1)
    assert lookup.propose(tokens) == _lookup_reference(tokens, ngram, 1, max_draft)
