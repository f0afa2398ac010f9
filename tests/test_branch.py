"""One `Branch`: created at 0 (a warning past it), prefill (position, chunked decodes, numpy
tokens), the low-level steps (sample, accept, then commit or prefill), refused tokens and
positions, and use after prune."""

from __future__ import annotations

import warnings

import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PROMPT, root


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
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(np.array(toks, dtype=np.int32))
    assert a.produce_sync().token == b.produce_sync().token


def test_sample_accept_low_level(ctx: kvfork.Context) -> None:
    b = root(ctx)
    t = b.sample()
    b.accept(t)  # accept alone writes no KV
    assert b.position == len(ctx.tokenize(PROMPT))


def test_accept_then_commit_counts_the_token_once(ctx: kvfork.Context) -> None:
    plain, split = root(ctx), root(ctx)
    t = plain.produce_sync().token
    plain.commit_sync(t)
    split.accept(t)
    split.commit_sync(t)  # absorbed: decoded, not accepted a second time
    assert split.perplexity == plain.perplexity and split.position == plain.position
    assert split.sampling_perplexity == plain.sampling_perplexity
    u = split.produce_sync().token
    split.accept(u)
    with pytest.raises(kvfork.KvforkError, match=f"{u} was accept"):
        split.commit_sync(u + 1)
    assert split.position == plain.position  # refused: nothing changed
    split.commit_sync(u)
    plain.commit_sync(u)
    assert split.perplexity == plain.perplexity


def test_accept_then_prefill_is_a_manual_commit(ctx: kvfork.Context) -> None:
    manual, plain = root(ctx), root(ctx)
    t = manual.produce_sync().token
    manual.accept(t)
    manual.prefill_sync([t])  # decodes the accepted token itself
    plain.commit_sync(t)
    u = manual.produce_sync().token
    manual.commit_sync(u)  # not refused: nothing is waiting any more
    plain.commit_sync(u)
    assert manual.position == plain.position
    assert manual.perplexity == pytest.approx(plain.perplexity, rel=1e-6)


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
    with pytest.raises(TypeError):
        b.prefill_sync("not tokens")  # type: ignore[arg-type]  # the refusal under test
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
