"""Embeddings on a context created with embeddings=True (the default Gemma 3 270M;
no GGUF embedding model is packaged on PyPI)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from pathlib import Path

import kvfork
import numpy as np
import pytest

from .gguf_patch import read_layout

CAT = "The cat sat on the mat."
CAT_AGAIN = "A cat was sitting on a mat."
MARKETS = "Stock markets fell sharply after the central bank raised interest rates."


@pytest.fixture
def emb(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(
        model, n_ctx=1024, n_batch=256, n_seq_max=4, embeddings=True, pooling="mean"
    ) as c:
        yield c


def test_unit_vectors_that_rank_meaning(emb: kvfork.Context) -> None:
    v = emb.embed_sync(CAT)
    assert v.shape == (emb.embedding_dim,) and v.dtype == np.float32
    assert emb.embedding_dim == 640  # Gemma 3 270M
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    again = emb.embed_sync(emb.tokenize(CAT))  # tokens give the same vector as the text
    assert float(v @ again) > 0.99
    related = float(v @ emb.embed_sync(CAT_AGAIN))
    unrelated = float(v @ emb.embed_sync(MARKETS))
    assert related > unrelated + 0.1, (related, unrelated)
    raw = emb.embed_sync(CAT, normalize=False)
    assert float(np.linalg.norm(raw)) != pytest.approx(1.0)
    assert np.allclose(raw / np.linalg.norm(raw), v, atol=1e-5)


def test_embed_batch_packs_texts_into_few_decodes(emb: kvfork.Context) -> None:
    texts = [CAT, CAT_AGAIN, MARKETS, CAT, "x " * 100, "short"]
    before = emb.stats()["decode_calls"]
    m = emb.embed_batch_sync(texts)
    decodes = emb.stats()["decode_calls"] - before
    lengths = [len(emb.tokenize(t)) for t in texts]
    # n_seq_max = 4 texts per decode at most, and each decode within n_batch = 256 tokens.
    assert decodes == 2, (decodes, lengths)
    assert m.shape == (len(texts), emb.embedding_dim)
    assert np.allclose(np.linalg.norm(m, axis=1), 1.0, atol=1e-5)
    assert float(m[0] @ m[3]) > 0.99
    singles = np.stack([emb.embed_sync(t) for t in texts])
    # Batched vs alone: the same vectors up to the float noise of other batch shapes.
    assert np.all(np.sum(m * singles, axis=1) > 0.995)


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_other_poolings(model: kvfork.Model, pooling: str) -> None:
    with kvfork.create_context_sync(
        model, n_ctx=512, n_seq_max=2, embeddings=True, pooling=pooling
    ) as c:
        a, b = c.embed_batch_sync([CAT, CAT])
        assert float(a @ b) > 0.99 and abs(float(np.linalg.norm(a)) - 1) < 1e-5


def test_pooling_none_gives_one_row_per_token(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(
        model, n_ctx=512, n_seq_max=2, embeddings=True, pooling="none"
    ) as c:
        rows = c.embed_sync(CAT)
        assert rows.shape == (len(c.tokenize(CAT)), c.embedding_dim)
        with pytest.raises(ValueError, match="pooled"):
            c.embed_batch_sync([CAT, MARKETS])


def test_embedding_errors(emb: kvfork.Context, ctx: kvfork.Context) -> None:
    with pytest.raises(kvfork.KvforkError, match="embeddings=True"):
        ctx.embed_sync(CAT)
    with pytest.raises(kvfork.KvforkError, match="embeddings=True"):
        ctx.embed_batch_sync([CAT])  # not a word about its pooling
    for text in (CAT.encode(), bytearray(CAT.encode())):
        with pytest.raises(TypeError, match="token ids"):  # not the bytes as token ids
            emb.embed_sync(text)
        with pytest.raises(TypeError, match="token ids"):
            emb.embed_batch_sync([text])
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate named as such
        emb.embed_sync("a\ud800")
    with pytest.raises(ValueError, match="n_batch"):
        emb.embed_sync("word " * 400)
    with pytest.raises(ValueError, match="no tokens"):
        emb.embed_sync([])
    with pytest.raises(TypeError, match="one str"):
        emb.embed_batch_sync(CAT)
    with pytest.raises(ValueError, match="pooling"):
        kvfork.create_context_sync(ctx.model, embeddings=True, pooling="max")
    b = kvfork.Branch.create(emb, 0)
    with pytest.raises(kvfork.KvforkError, match="prune its branches"):
        emb.embed_sync(CAT)
    b.prune_sync()
    assert emb.embed_sync(CAT).shape == (emb.embedding_dim,)


def test_async_embed(emb: kvfork.Context) -> None:
    async def main() -> tuple[np.ndarray, np.ndarray]:
        return await emb.embed(CAT), await emb.embed_batch([CAT, MARKETS])

    one, many = asyncio.run(main())
    # Alone against in a batch: as above, up to the noise of other batch shapes (0.9987 on an
    # H100, where the batch shape moves more than on a CPU).
    assert float(one @ many[0]) > 0.995


def test_a_batch_cancelled_while_it_runs_stops_in_its_decode(emb: kvfork.Context) -> None:
    """A cancelled `embed_batch` does not run its other decodes (a server's abandoned
    request of many texts held the context up for the next one): all or nothing, and the
    context embeds on at once."""
    texts = ["word " * 200] * 200  # ~200 tokens each, n_batch 256: a decode each

    async def main() -> None:
        task = asyncio.ensure_future(emb.embed_batch(texts))
        while emb.stats()["decode_calls"] == before:  # noqa: ASYNC110 (the batch runs)
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = emb.stats()["decode_calls"]
    asyncio.run(main())
    assert emb.embed_sync(CAT).shape == (emb.embedding_dim,)  # after the batch's job ended
    decodes = emb.stats()["decode_calls"] - before
    assert decodes < 20, decodes  # of 200


@pytest.mark.parametrize(("n_seq_max", "pooling"), [(3, "mean"), (5, "cls"), (6, "last")])
def test_any_sequence_count_embeds_without_aborting(
    model: kvfork.Model, n_seq_max: int, pooling: str
) -> None:
    # llama.cpp's pooled graph aborted (GGML_ASSERT) unless n_batch was a multiple of
    # n_seq_max; kvfork rounds n_batch up for embedding contexts.
    with kvfork.create_context_sync(
        model, embeddings=True, pooling=pooling, n_seq_max=n_seq_max
    ) as ctx:
        assert ctx.n_batch % n_seq_max == 0 and ctx.n_batch >= 512
        vectors = ctx.embed_batch_sync(["A cat.", "Stock markets fell.", "x y z"])
        assert vectors.shape == (3, ctx.embedding_dim)


def test_a_small_context_that_would_abort_is_refused(model: kvfork.Model) -> None:
    with pytest.raises(ValueError, match="n_ctx.*multiple of n_seq_max"):
        kvfork.create_context_sync(model, embeddings=True, pooling="mean", n_seq_max=6, n_ctx=256)
    with kvfork.create_context_sync(
        model, embeddings=True, pooling="mean", n_seq_max=3, n_ctx=300
    ) as ctx:
        assert ctx.embed_batch_sync(["A cat."]).shape == (1, ctx.embedding_dim)


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_rows_are_as_wide_as_the_models_output(tmp_path: Path, pooling: str) -> None:
    # A GGUF may give its embeddings a width other than the hidden size
    # (`<arch>.embedding_length_out`); llama.cpp's rows then have that width, and reading
    # n_embd floats per row ran past them. The file gains the key by renaming one of the
    # same length (the EOS id, which embedding does not read), so no byte moves.
    real = Path(kvfork.default_model_path()).read_bytes()
    old, new = b"tokenizer.ggml.eos_token_id", b"gemma3.embedding_length_out"
    assert len(old) == len(new) and real.count(old) == 1
    value_at, _ = read_layout(real).values[old.decode()]
    narrow = bytearray(real.replace(old, new))
    struct.pack_into("<I", narrow, value_at, 64)
    path = tmp_path / "narrow.gguf"
    path.write_bytes(narrow)
    with kvfork.create_context_sync(
        str(path), n_ctx=256, n_seq_max=2, embeddings=True, pooling=pooling
    ) as ctx:
        assert ctx.embedding_dim == 64
        rows = np.asarray(ctx.embed_sync(CAT))
        assert rows.shape[-1] == 64 and np.isfinite(rows).all()
