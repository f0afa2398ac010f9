"""Exact speculative decoding: `generate(draft=...)` yields the tokens plain generation
draws, greedy and seeded, with good drafts, bad drafts and a grammar; the KV keeps only
what was accepted."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import kvfork
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .conftest import GREEDY, root

COPY = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine, orange, papaya\nCopy: apple, banana,"
)
SEEDED = {"temperature": 0.8, "seed": 5}


class Wrong:
    """A drafter that is always wrong: every guess is rejected."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        return [7, 7, 7]


def pair(
    ctx: kvfork.Context, params: kvfork.SamplingParams | dict[str, Any] | None
) -> tuple[kvfork.Branch, kvfork.Branch]:
    a = root(ctx, COPY, params)
    return a, a.fork_sync()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prompt_lookup_draws_what_plain_generation_draws(
    ctx: kvfork.Context, params: kvfork.SamplingParams | dict[str, Any] | None
) -> None:
    plain, spec = pair(ctx, params)
    expected = [t.token for t in plain.generate_sync(40)]
    before = ctx.stats()["decode_calls"]
    stream = spec.generate_sync(40, draft=kvfork.PromptLookup())
    got = [t.token for t in stream]
    assert got == expected and stream.stop_reason == "max_tokens"
    assert stream.acceptance > 0.5 and stream.rounds < 20  # the list is copied
    assert ctx.stats()["decode_calls"] - before == stream.rounds
    # Same state after: position, history, perplexity, and what comes next.
    assert spec.position == plain.position and spec.history == plain.history
    # A batched decode rounds logits a little differently: perplexity agrees to ~0.5 %.
    assert spec.perplexity == pytest.approx(plain.perplexity, rel=1e-2)
    if params is GREEDY:
        assert [t.token for t in spec.generate_sync(8)] == [t.token for t in plain.generate_sync(8)]


async def test_rejected_drafts_leave_no_trace(ctx: kvfork.Context) -> None:
    plain, spec = pair(ctx, SEEDED)
    expected = [t.token async for t in plain.generate(24)]
    stream = spec.generate(24, draft=Wrong())
    assert [t.token async for t in stream] == expected
    assert stream.accepted == 0 and stream.drafted > 0
    assert spec.position == plain.position
    assert ctx.kv_seq_pos_max_sync(spec.seq_id) == spec.position - 1  # the guesses are gone


def test_a_grammar_constrains_the_drafts(ctx: kvfork.Context) -> None:
    plain, spec = pair(ctx, SEEDED)
    for b in (plain, spec):
        b.set_regex(" [0-9]{6}")
    expected = "".join(t.text for t in plain.generate_sync(12))
    stream = spec.generate_sync(12, draft=Wrong())
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
    expected = [t.token for t in plain.generate_sync(24)]
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2) as draft_ctx:
        drafter = kvfork.DraftModel(draft_ctx, max_draft=4)
        stream = spec.generate_sync(24, draft=drafter)
        assert [t.token for t in stream] == expected
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
