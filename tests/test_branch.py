"""One `Branch`: created at 0 (a warning past it), prefill (position, chunked decodes, numpy
tokens), the low-level steps (sample, accept, then commit or prefill), refused tokens and
positions, and use after prune."""

from __future__ import annotations

import math
import warnings

import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PROMPT, assert_close_logits, root


def test_a_branch_created_past_zero_warns_what_to_do(ctx: kvfork.Context) -> None:
    with pytest.warns(kvfork.KvforkWarning, match=r"position 5.*create it at 0 and prefill"):
        b = kvfork.Branch.create(ctx, 5, GREEDY)
    assert issubclass(kvfork.KvforkWarning, UserWarning)
    b.prune_sync()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvfork.Branch.create(ctx, 0, GREEDY).prune_sync()  # the usual start is silent


def test_position_and_prefill_chunking(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=512, n_batch=8, n_seq_max=2) as c:
        toks = c.tokenize(PROMPT * 3)
        b = kvfork.Branch.create(c, 0, GREEDY)
        before = c.stats()["decode_calls"]
        b.prefill_sync(toks)
        assert b.position == len(toks)
        assert c.stats()["decode_calls"] - before == -(-len(toks) // 8)
        assert c.kv_seq_pos_max_sync(b.seq_id) == len(toks) - 1


def test_numpy_tokens(ctx: kvfork.Context) -> None:
    toks = ctx.tokenize(PROMPT)
    a = kvfork.Branch.create(ctx, 0, GREEDY)
    a.prefill_sync(np.array(toks, dtype=np.int64))
    expected = a.logits()
    a.prune_sync()  # b's prefill lands in a's cells: the same decode, bit for bit
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(np.array(toks, dtype=np.int32))
    assert b.history == toks
    assert np.array_equal(b.logits(), expected)


def test_numpy_tokens_of_the_other_byte_order_are_read_as_their_values(
    ctx: kvfork.Context,
) -> None:
    """A big-endian array's values are its tokens (not its bytes read natively): in-range ids
    prefill, out-of-range ones are refused naming the id."""
    toks = ctx.tokenize(PROMPT)
    for dtype in (">i4", ">i8", "<i4", ">u2"):
        b = kvfork.Branch.create(ctx, 0, GREEDY)
        b.prefill_sync(np.array(toks, dtype=dtype))
        assert b.history == toks
        assert ctx.detokenize(np.array(toks, dtype=dtype)) == ctx.detokenize(toks)
        b.prune_sync()
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(ValueError, match="33554432 is out of range"):
        b.prefill_sync(np.array([2, 33554432], dtype=">i4"))
    assert b.position == 0
    b.prune_sync()


def test_a_token_is_its_tuple() -> None:
    """As a NamedTuple: indexes, slices, compares and hashes as `(token, text, is_stop)`."""
    t = kvfork.Token(5, "a", False)
    reverse = (5, "a", False).__eq__(t)  # the tuple defers: NotImplemented, then Token's
    assert t == (5, "a", False) and reverse is NotImplemented and t != (5, "a", True)
    assert (5, "a", False) in [t, t]  # membership asks the tuple first, then the Token
    assert t == kvfork.Token(5, "a", False) and t < (6, "", False) and t >= (5, "a", False)
    assert t[0:2] == (5, "a") and t[::-1] == (False, "a", 5) and t[-1] is False
    assert hash(t) == hash((5, "a", False)) and {t} == {(5, "a", False)}
    assert t != 5 and t != [5, "a", False]
    with pytest.raises(IndexError):
        t[3]
    with pytest.raises(TypeError):
        t["x"]  # type: ignore[call-overload]


def test_sample_accept_low_level(ctx: kvfork.Context) -> None:
    b = root(ctx)
    t = b.sample()
    b.accept(t)  # accept alone writes no KV
    assert b.position == len(ctx.tokenize(PROMPT))


def test_accept_then_commit_counts_the_token_once(ctx: kvfork.Context) -> None:
    plain = root(ctx)
    split = plain.fork_sync()  # the same logits row
    t = plain.produce_sync().token
    first = plain.surprisal(t)
    plain.commit_sync(t)
    split.accept(t)
    split.commit_sync(t)  # absorbed: decoded, not accepted a second time
    assert split.perplexity == plain.perplexity == pytest.approx(math.exp(first), rel=1e-6)
    assert split.position == plain.position
    assert split.sampling_perplexity == plain.sampling_perplexity
    # Each decoded t in its own cells: their rows now differ by noise (conftest.LOGIT_NOISE),
    # so each counts u under its own row.
    u = split.produce_sync().token
    second = split.surprisal(u)
    split.accept(u)
    with pytest.raises(kvfork.KvforkError, match=f"{u} was accept"):
        split.commit_sync(u + 1)
    assert split.position == plain.position  # refused: nothing changed
    split.commit_sync(u)
    assert split.perplexity == pytest.approx(math.exp((first + second) / 2), rel=1e-6)
    plain_second = plain.surprisal(u)
    plain.commit_sync(u)
    assert plain.perplexity == pytest.approx(math.exp((first + plain_second) / 2), rel=1e-6)


def test_accept_then_prefill_is_a_manual_commit(ctx: kvfork.Context) -> None:
    manual = root(ctx)
    plain = manual.fork_sync()  # the same logits row
    t = manual.produce_sync().token
    first = manual.surprisal(t)
    manual.accept(t)
    manual.prefill_sync([t])  # decodes the accepted token itself
    plain.commit_sync(t)
    assert manual.history == plain.history
    # Both decoded t, each in its own cells: rows equal up to noise (conftest.LOGIT_NOISE).
    assert_close_logits(manual.logits(), plain.logits())
    u = manual.produce_sync().token
    second = manual.surprisal(u)
    manual.commit_sync(u)  # not refused: nothing is waiting any more
    plain.commit_sync(u)
    assert manual.position == plain.position
    # t and u counted once each, as two commits count them, each under its own row.
    assert manual.perplexity == pytest.approx(math.exp((first + second) / 2), rel=1e-6)


def test_bad_tokens_and_positions(ctx: kvfork.Context) -> None:
    b = root(ctx)
    with pytest.raises(ValueError, match="token"):
        b.commit_sync(ctx.vocab_size)
    with pytest.raises(ValueError, match="token"):
        b.commit_sync(-1)
    with pytest.raises(ValueError, match="token"):
        b.prefill_sync([1, 2, 10**9])
    with pytest.raises(ValueError, match="token"):
        ctx.detokenize([ctx.vocab_size + 5])
    with pytest.raises(ValueError, match="position"):
        kvfork.Branch.create(ctx, -1)
    with pytest.raises(ValueError, match="seq"):
        ctx.kv_seq_copy(0, 999)
    with pytest.raises(ValueError, match=r"p0 \(5\) is after p1 \(2\)"):
        ctx.kv_seq_copy(0, 1, 5, 2)
    with pytest.raises(ValueError, match="after p1"):
        ctx.kv_seq_remove(0, 5, 2)
    with pytest.raises(TypeError):
        b.prefill_sync("not tokens")  # type: ignore[arg-type]  # the refusal under test
    with pytest.raises(TypeError, match=r"\(token ids\), not bytes"):  # bytes are no ids
        b.prefill_sync(b"not tokens")
    # the branch still works after every refusal
    b.commit_sync(b.produce_sync().token)


def test_use_after_prune(ctx: kvfork.Context) -> None:
    b = root(ctx)
    b.prune_sync()
    assert b.disposed
    b.prune_sync()  # second prune is a no-op
    for call in (b.produce_sync, lambda: b.commit_sync(1), b.logits, lambda: b.prefill_sync([1])):
        with pytest.raises(kvfork.BranchDisposedError):
            call()
    assert issubclass(kvfork.BranchDisposedError, kvfork.KvforkError)
