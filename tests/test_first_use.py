"""Issue 15: what a first-time user tripped over — silent misuse, streams that end in an
error at the context limit, errors that hide the reason."""

from __future__ import annotations

import asyncio

import kvfork
import pytest

from .conftest import COUNTING, root


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


def test_max_tokens_reason(ctx: kvfork.Context) -> None:
    stream = root(ctx).generate_sync(3)
    assert len(list(stream)) == 3 and stream.stop_reason == "max_tokens"


def test_async_with_create_context_needs_no_await(model: kvfork.Model) -> None:
    async def main() -> tuple[int, bool]:
        async with kvfork.create_context(model, n_ctx=256, n_seq_max=1) as ctx:
            n = ctx.n_ctx
        return n, ctx.closed

    assert asyncio.run(main()) == (256, True)


def test_errors_say_why(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx)
    with pytest.raises(kvfork.GrammarError, match="undefined rule.*foo"):
        b.set_grammar("root ::= foo")
    with pytest.raises(kvfork.GrammarError, match="undefined rule.*root"):
        b.set_grammar('start ::= "x"')
    with pytest.raises(kvfork.GrammarError, match="line 1, column 23: unexpected end of input"):
        b.set_grammar('root ::= "unterminated')
    with pytest.raises(kvfork.GrammarError, match="not valid JSON"):
        kvfork.json_schema_to_grammar("{bad")
    with pytest.raises(kvfork.GrammarError, match='unknown type "strange"'):
        kvfork.json_schema_to_grammar({"type": "strange"})
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(kvfork.GrammarError, match="#/properties/a: \\$ref"):
        kvfork.json_schema_to_grammar(schema)


def test_thread_counts_adapt_unless_fixed(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=256, n_threads=1, n_threads_batch=2) as c:
        assert (c.n_threads, c.n_threads_batch) == (1, 2)
        assert len(list(root(c).generate_sync(40))) == 40  # fixed: no probe changes them
        assert (c.n_threads, c.n_threads_batch) == (1, 2)
    with kvfork.create_context_sync(model, n_ctx=256) as c:
        b = root(c)
        for _ in b.generate_sync(64):  # probes run; the settled counts stay in range
            assert 1 <= c.n_threads <= 8 and 1 <= c.n_threads_batch <= 8
    with pytest.raises(ValueError, match="n_threads_batch"):
        kvfork.create_context_sync(model, n_threads_batch=0)


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
