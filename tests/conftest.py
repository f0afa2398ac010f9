"""Shared fixtures: the real default model (Gemma 3 270M), loaded once per session, and the
tiny random-weight models of other architecture families (`family_models.py`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kvfork
import numpy as np
import pytest

from .family_models import model_path

PROMPT = "The history of the printing press begins with"
# Greedy continues this with margins of 3+ logits: safe to compare across batch shapes.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


# `make test-vulkan` (or a GPU build) offloads the shared models' layers: KVFORK_TEST_GPU_LAYERS.
GPU_LAYERS = int(os.environ.get("KVFORK_TEST_GPU_LAYERS", "0")) or None


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as the module ``name`` (once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def model() -> kvfork.Model:
    return kvfork.Model.load(kvfork.default_model_path(), n_gpu_layers=GPU_LAYERS)


@pytest.fixture
def ctx(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=8) as c:
        yield c


@pytest.fixture(scope="session")
def chat_model() -> kvfork.Model:
    """The chat model (SmolLM2-135M-Instruct, ChatML template in its GGUF)."""
    return kvfork.Model.load(kvfork.default_chat_model_path(), n_gpu_layers=GPU_LAYERS)


@pytest.fixture
def chat_ctx(chat_model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(chat_model, n_ctx=2048, n_seq_max=4) as c:
        yield c


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's tiny family models are written (each on first use)."""
    return tmp_path_factory.mktemp("family_models")


@pytest.fixture(scope="session")
def family_models(family_model_dir: Path) -> Callable[[str], kvfork.Model]:
    """`family_models("lfm2")`: the tiny model of that family (`family_models.FAMILIES`),
    written and loaded once per session."""
    loaded: dict[str, kvfork.Model] = {}

    def load(family: str) -> kvfork.Model:
        if family not in loaded:
            path = model_path(family, family_model_dir)
            loaded[family] = kvfork.Model.load(path, n_gpu_layers=GPU_LAYERS)
        return loaded[family]

    return load


GREEDY = kvfork.SamplingParams(temperature=0.0)

# A small object schema the constraint tests share (GBNF and llguidance alike).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


def root(
    ctx: kvfork.Context,
    text: str = PROMPT,
    params: kvfork.SamplingParams | dict[str, Any] | None = GREEDY,
) -> kvfork.Branch:
    """A branch with `text` prefilled."""
    b = kvfork.Branch.create(ctx, 0, params)
    b.prefill_sync(ctx.tokenize(text))
    return b


def greedy_tokens(b: kvfork.Branch, n: int) -> list[int]:
    """Produce and commit `n` tokens (the branch's own sampler; greedy for GREEDY branches)."""
    out = []
    for _ in range(n):
        t = b.produce_sync().token
        b.commit_sync(t)
        out.append(t)
    return out


def greedy_with_margins(b: kvfork.Branch, n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, for each, the gap between the best and second-best logit."""
    tokens, margins = [], []
    for _ in range(n):
        top2 = np.partition(b.logits(), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        t = b.produce_sync().token
        b.commit_sync(t)
        tokens.append(t)
    return tokens, margins


def assert_same_greedy(got: list[int], expected: list[int], margins: list[float]) -> None:
    """Tokens decoded in other batches than the reference's are equal up to the first near-tie
    of the reference: batched logits differ from single-token ones by up to ~0.5 (DESIGN.md)."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if margins[i] < 1.0:
            return
        assert g == e, f"token {i} differs ({g} != {e}) at a clear margin of {margins[i]:.2f}"
