"""The logits snapshot and what is computed from it: a copy on read, `set_logits`, `logprob`
and `top_logprobs` (against a log-softmax), entropy, surprisal and both perplexities."""

from __future__ import annotations

import math

import kvfork
import numpy as np
import numpy.typing as npt
import pytest

from .conftest import greedy_tokens, root


def test_no_logits_yet(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx, 0)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        b.produce_sync()


def test_logits_is_a_copy(ctx: kvfork.Context) -> None:
    b = root(ctx)
    a = b.logits()
    a[:] = 0
    assert np.any(b.logits() != 0)


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


def log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    y = x.astype(np.float64)
    m = y.max()
    out: npt.NDArray[np.float64] = y - (m + np.log(np.exp(y - m).sum()))
    return out


def test_logprob_and_top_logprobs_match_a_log_softmax(ctx: kvfork.Context) -> None:
    b = root(ctx)
    expected = log_softmax(b.logits())
    top = b.top_logprobs(5)
    assert [t for t, _ in top] == list(np.argsort(-expected, kind="stable")[:5])
    for t, lp in top:
        assert lp == pytest.approx(expected[t], abs=1e-6)
        assert b.logprob(t) == pytest.approx(lp, abs=1e-9)
    assert b.logprob(7) == pytest.approx(expected[7], abs=1e-6)
    assert b.logprob(top[0][0]) == pytest.approx(-b.surprisal(top[0][0]))
    assert b.top_logprobs(0) == []
    b.set_logits(np.where(np.arange(ctx.vocab_size) < 3, 0.0, -np.inf).astype(np.float32))
    assert len(b.top_logprobs(10)) == 3 and b.logprob(5) == -math.inf
    with pytest.raises(ValueError, match="k"):
        b.top_logprobs(-1)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        kvfork.Branch.create(ctx).top_logprobs(3)


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
