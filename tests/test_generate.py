"""Generation: greedy is the argmax of the logits and the same in any context; `generate`,
`async for` and `generate_sync` equal the manual produce/commit loop; a stream ends with
its reason (max_tokens, context_full); `reseed_context` streams on past n_ctx."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator

import kvfork
import numpy as np
import pytest

from .conftest import COUNTING, root


def greedy_continuation(ctx: kvfork.Context, n: int) -> list[int]:
    b = root(ctx)
    out = []
    for _ in range(n):
        tok = b.produce_sync()
        if tok.is_stop:
            break
        b.commit_sync(tok.token)
        out.append(tok.token)
    return out


def test_greedy_is_deterministic_across_contexts(model: kvfork.Model) -> None:
    # The first branch of each context takes its first cells, and both contexts' caches are
    # read as far (256 cells at the least): the same decodes, bit for bit, whatever the sizes.
    with (
        kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2) as a,
        kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=4) as b,
    ):
        ta, tb = greedy_continuation(a, 24), greedy_continuation(b, 24)
    assert ta == tb and len(ta) == 24


def test_greedy_equals_argmax_of_logits(ctx: kvfork.Context) -> None:
    b = root(ctx)
    for _ in range(12):
        logits = b.logits()
        assert logits.dtype == np.float32 and logits.shape == (ctx.vocab_size,)
        tok = b.produce_sync()
        assert tok.token == int(np.argmax(logits))
        b.commit_sync(tok.token)


async def test_async_for_equals_manual_loop(ctx: kvfork.Context) -> None:
    b1 = root(ctx)
    streamed = [t async for t in b1.generate(max_tokens=16)]
    position = b1.position
    await b1.prune()  # b2 prefills in its cells: the same decodes, bit for bit
    b2 = root(ctx)
    manual = []
    for _ in range(16):
        tok = await b2.produce()
        if tok.is_stop:
            break
        await b2.commit(tok.token)
        manual.append(tok)
    assert [t.token for t in streamed] == [t.token for t in manual]
    assert "".join(t.text for t in streamed) == ctx.detokenize([t.token for t in manual])
    assert position == b2.position


async def test_async_iter_protocol_and_sync_twin(ctx: kvfork.Context) -> None:
    b = root(ctx)
    seen = []
    async for tok in b:
        token, text, is_stop = tok  # unpacks like a NamedTuple
        assert not is_stop and isinstance(text, str)
        seen.append(token)
        if len(seen) == 5:
            break
    await b.prune()  # c prefills in its cells: the same decodes, bit for bit
    c = root(ctx)
    assert [t.token for t in c.generate_sync(5)] == seen


def test_max_tokens_reason(ctx: kvfork.Context) -> None:
    stream = root(ctx).generate_sync(3)
    assert len(list(stream)) == 3 and stream.stop_reason == "max_tokens"


async def drain(stream: AsyncIterator[kvfork.Token], into: list[int]) -> None:
    async for tok in stream:
        into.append(tok.token)


async def test_two_consumers_of_one_stream_share_its_max_tokens(ctx: kvfork.Context) -> None:
    """Steps asked for at once each take one of the stream's tokens: together the consumers
    get `max_tokens`, in the branch's order, and no more are committed."""
    for max_tokens in (1, 7):
        b = root(ctx)
        start = b.position
        stream = b.generate(max_tokens)
        got: list[int] = []
        await asyncio.gather(*(drain(stream, got) for _ in range(3)))
        assert len(got) == max_tokens and b.position == start + max_tokens
        assert stream.stop_reason == "max_tokens"
        assert sorted(got) == sorted(b.history[start:])
        await b.prune()
    # A speculative stream's consumers take its tokens in turn: the one stream's tokens.
    alone = root(ctx)
    expected = [t.token for t in alone.generate_sync(9, draft=kvfork.PromptLookup())]
    await alone.prune()
    b = root(ctx)
    shared = b.generate(9, draft=kvfork.PromptLookup())
    got = []
    await asyncio.gather(*(drain(shared, got) for _ in range(3)))
    assert got == expected == b.history[-9:] and shared.stop_reason == "max_tokens"
    await b.prune()
    b = root(ctx)
    start = b.position
    sync_stream = b.generate_sync(6)
    threads = [threading.Thread(target=lambda: list(sync_stream)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert b.position == start + 6 and sync_stream.stop_reason == "max_tokens"


def test_generate_ends_cleanly_at_the_context_limit(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=64, n_seq_max=1) as small:
        b = kvfork.Branch.create(small, 0, {"temperature": 0.0})
        b.prefill_sync(small.tokenize(COUNTING))  # greedy counts on, never a stop token
        stream = b.generate_sync()
        assert stream.stop_reason is None
        tokens = list(stream)
        assert stream.stop_reason == "context_full" and b.position == small.n_ctx
        assert len(tokens) == small.n_ctx - len(small.tokenize(COUNTING))
        short = b.generate_sync(0)
        assert list(short) == [] and short.stop_reason in ("max_tokens", "context_full")

    async def run() -> str | None:
        with kvfork.create_context_sync(model, n_ctx=64, n_seq_max=1) as c:
            r = kvfork.Branch.create(c, 0, {"temperature": 0.0})
            await r.prefill(c.tokenize(COUNTING))
            stream = r.generate()
            async for _ in stream:
                pass
            return stream.stop_reason

    assert asyncio.run(run()) == "context_full"


def test_reseed_context_streams_past_n_ctx(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=128, n_seq_max=1) as small:
        n_ctx = small.n_ctx  # llama.cpp may round it up
        b = kvfork.Branch.create(small, 0, {"temperature": 0.7, "seed": 2, "repeat_penalty": 1.1})
        sinks = small.tokenize("Chapter one. It was a cold morning in the village, and")
        b.prefill_sync(sinks)
        text, n, reseeds = [], 0, 0
        while n < 3 * n_ctx:
            room = n_ctx - 1 - b.position
            for t in b.generate_sync(min(room, 3 * n_ctx - n)):
                text.append(t.text)
                n += 1
                if t.is_stop:
                    break
            if n < 3 * n_ctx:
                b.reseed_context_sync(sinks, 48)
                reseeds += 1
                assert b.position == len(sinks) + 48
        assert n == 3 * n_ctx and reseeds >= 3
        assert math.isfinite(b.perplexity) and b.perplexity < 50
        joined = "".join(text)
        assert sum(c.isalpha() or c.isspace() for c in joined) > 0.8 * len(joined)
        with pytest.raises(ValueError, match="no room"):
            b.reseed_context_sync(list(range(1, n_ctx + 1)), 0)
        with pytest.raises(ValueError, match="nothing to re-prefill"):
            b.reseed_context_sync([], 0)
