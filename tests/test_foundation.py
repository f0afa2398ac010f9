"""Issue: foundation — tokenizer, single-branch generation, errors, lifecycle."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PROMPT, root


def test_module_surface() -> None:
    assert isinstance(kvfork.__version__, str)
    info = kvfork.system_info()
    assert info["backend"] == "cpu"
    assert "AVX2" in info["cpu_features"]
    assert "AMX_INT8" not in info["cpu_features"]  # AMX crashes on these machines
    assert set(info["cpu_features"]) <= set(info["host_cpu_features"])
    assert kvfork.default_model_path().name.endswith(".gguf")


def test_model_properties(model: kvfork.Model) -> None:
    assert model.vocab_size == 262144
    assert model.n_ctx_train > 0
    assert model.metadata["general.architecture"] == "gemma3"
    assert model.chat_template is None  # base model: no template


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and   inner  spaces\n\ttabs",
        "héllo wörld — ünïcödé ✓ 日本語 🙂",
        "",
    ],
)
def test_tokenize_round_trip(ctx: kvfork.Context, text: str) -> None:
    toks = ctx.tokenize(text, add_special=False)
    assert all(isinstance(t, int) and 0 <= t < ctx.vocab_size for t in toks)
    assert ctx.detokenize(toks) == text
    assert "".join(ctx.token_to_text(t) for t in toks) == text


def test_tokenize_matches_llama_cpp(ctx: kvfork.Context) -> None:
    # Golden ids from llama.cpp's tokenizer for this GGUF.
    assert ctx.tokenize("Hello, world!") == [2, 9259, 236764, 1902, 236888]
    assert ctx.tokenize("Hello, world!", add_special=False) == [9259, 236764, 1902, 236888]
    assert ctx.bos_token == 2


def test_parse_special(ctx: kvfork.Context) -> None:
    text = "<start_of_turn>user"
    parsed = ctx.tokenize(text, add_special=False, parse_special=True)
    literal = ctx.tokenize(text, add_special=False, parse_special=False)
    assert len(parsed) == 2 and len(literal) > 2
    assert ctx.detokenize(parsed, unparse_special=True) == text
    assert ctx.detokenize(literal) == text


def test_stop_tokens(ctx: kvfork.Context) -> None:
    eog = ctx.eog_token
    assert eog is not None and ctx.is_stop_token(eog)
    assert not ctx.is_stop_token(ctx.tokenize("Hello", add_special=False)[0])


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


def test_logits_is_a_copy(ctx: kvfork.Context) -> None:
    b = root(ctx)
    a = b.logits()
    a[:] = 0
    assert np.any(b.logits() != 0)


def test_position_and_prefill_chunking(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=512, n_batch=8, n_seq_max=2) as c:
        toks = c.tokenize(PROMPT * 3)
        b = kvfork.Branch.create(c, 0, GREEDY)
        before = c.stats()["decode_calls"]
        b.prefill_sync(toks)
        assert b.position == len(toks)
        assert c.stats()["decode_calls"] - before == -(-len(toks) // 8)
        assert c.kv_seq_pos_max_sync(b.seq_id) == len(toks) - 1


async def test_async_for_equals_manual_loop(ctx: kvfork.Context) -> None:
    b1 = root(ctx)
    streamed = [t async for t in b1.generate(max_tokens=16)]
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
    assert b1.position == b2.position


async def test_async_iter_protocol_and_sync_twin(ctx: kvfork.Context) -> None:
    b = root(ctx)
    seen = []
    async for tok in b:
        token, text, is_stop = tok  # unpacks like a NamedTuple
        assert not is_stop and isinstance(text, str)
        seen.append(token)
        if len(seen) == 5:
            break
    c = root(ctx)
    assert [t.token for t in c.generate_sync(5)] == seen


async def test_event_loop_not_blocked(ctx: kvfork.Context) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    await b.prefill(ctx.tokenize(PROMPT * 20))
    task.cancel()
    assert ticks > 1  # the loop kept running while llama.cpp decoded


async def test_async_context(model: kvfork.Model) -> None:
    async with await kvfork.create_context(model, n_ctx=256, n_seq_max=1) as c:
        b = kvfork.Branch.create(c, 0, GREEDY)
        await b.prefill(c.tokenize("Hi"))
        assert b.position == 2
    assert c.closed


def test_sample_accept_low_level(ctx: kvfork.Context) -> None:
    b = root(ctx)
    t = b.sample()
    b.accept(t)  # accept alone writes no KV
    assert b.position == len(ctx.tokenize(PROMPT))


# ---- errors: documented exceptions, never a crash ----


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(kvfork.ModelLoadError, match="nope.gguf"):
        kvfork.Model.load(missing)


def test_not_a_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    with pytest.raises(kvfork.ModelLoadError, match="junk.gguf"):
        kvfork.Model.load(junk)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(kvfork.default_model_path().read_bytes()[:4096])
    with pytest.raises(kvfork.ModelLoadError):
        kvfork.create_context_sync(trunc)


@pytest.mark.parametrize("n_seq_max", [0, 257, 100000])
def test_n_seq_max_out_of_range(model: kvfork.Model, n_seq_max: int) -> None:
    with pytest.raises(ValueError, match="n_seq_max"):
        kvfork.create_context_sync(model, n_seq_max=n_seq_max)


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


def test_numpy_tokens(ctx: kvfork.Context) -> None:
    toks = ctx.tokenize(PROMPT)
    a = kvfork.Branch.create(ctx, 0, GREEDY)
    a.prefill_sync(np.array(toks, dtype=np.int64))
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(np.array(toks, dtype=np.int32))
    assert a.produce_sync().token == b.produce_sync().token


def test_use_after_close(model: kvfork.Model) -> None:
    c = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2)
    b = root(c, "Hello")
    c.close()
    c.close()  # idempotent
    with pytest.raises(kvfork.KvforkError):
        c.tokenize("x")
    with pytest.raises(kvfork.KvforkError):
        b.commit_sync(1)
    with pytest.raises(kvfork.KvforkError):
        kvfork.Branch.create(c, 0)


def test_use_after_prune(ctx: kvfork.Context) -> None:
    b = root(ctx)
    b.prune_sync()
    assert b.disposed
    b.prune_sync()  # second prune is a no-op
    for call in (b.produce_sync, lambda: b.commit_sync(1), b.logits, lambda: b.prefill_sync([1])):
        with pytest.raises(kvfork.BranchDisposedError):
            call()
    assert issubclass(kvfork.BranchDisposedError, kvfork.KvforkError)


def test_no_logits_yet(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx, 0)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        b.produce_sync()


def test_context_dropped_without_close(model: kvfork.Model) -> None:
    c = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1)
    root(c, "Hi")
    del c
    gc.collect()


def test_exception_hierarchy() -> None:
    assert issubclass(kvfork.KvCacheFullError, kvfork.DecodeError)
    for e in (
        kvfork.ModelLoadError,
        kvfork.DecodeError,
        kvfork.LeaseExhaustedError,
        kvfork.BranchDisposedError,
        kvfork.GrammarError,
        kvfork.ChatTemplateError,
    ):
        assert issubclass(e, kvfork.KvforkError)
