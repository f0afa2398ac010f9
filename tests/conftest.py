"""Shared fixtures: the real default model (Gemma 3 270M), loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator

import kvfork
import pytest

PROMPT = "The history of the printing press begins with"


@pytest.fixture(scope="session")
def model() -> kvfork.Model:
    return kvfork.Model.load(kvfork.default_model_path())


@pytest.fixture
def ctx(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=8) as c:
        yield c


GREEDY = kvfork.SamplingParams(temperature=0.0)


def root(ctx: kvfork.Context, text: str = PROMPT, params: object = GREEDY) -> kvfork.Branch:
    """A branch with `text` prefilled."""
    b = kvfork.Branch.create(ctx, 0, params)
    b.prefill_sync(ctx.tokenize(text))
    return b
