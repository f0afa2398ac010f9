"""`kvfork.Model`: the properties read from the GGUF, and ModelLoadError for a file that is
missing or not a model."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from pathlib import Path

import kvfork
import pytest


def test_model_properties(model: kvfork.Model) -> None:
    assert model.vocab_size == 262144
    assert model.n_ctx_train > 0
    assert model.metadata["general.architecture"] == "gemma3"
    assert model.chat_template is None  # base model: no template


async def open_and_close(path: Path) -> None:
    async with kvfork.create_context(path, n_ctx=64, n_seq_max=1, n_gpu_layers=99):
        pass


def test_gpu_layers_warn_only_without_a_gpu_backend() -> None:
    """Layers asked onto a GPU: without a GPU backend a warning says so and the model runs on
    the CPU; with one they go to the GPU, silently."""
    path = kvfork.default_model_path()
    loads: list[Callable[[], object]] = [
        lambda: kvfork.Model.load(path, n_gpu_layers=99).vocab_size,
        # A context given the path loads the model the same way (so does a Ray pool's actor).
        lambda: kvfork.create_context_sync(path, n_ctx=64, n_seq_max=1, n_gpu_layers=99).close(),
        lambda: asyncio.run(open_and_close(path)),
    ]
    for load in loads:
        if kvfork.system_info()["backend"] == "cpu":
            with pytest.warns(kvfork.KvforkWarning, match="no GPU backend"):
                load()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                load()


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
