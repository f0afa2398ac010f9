"""`create_context`: the awaitable that also works directly in `async with`."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from os import PathLike
from types import TracebackType
from typing import Any, Literal

from . import _native
from ._native import Context, Model


class ContextOpening(Awaitable[Context]):
    """What `create_context` returns. `await` it for the Context, or enter it directly:
    `async with kvfork.create_context(path) as ctx:` builds the context (off the event loop)
    and closes it on exit."""

    def __init__(self, pending: Awaitable[Context]) -> None:
        """Wrap the awaitable of a context being built; made by `create_context`, not by
        hand. Await it or enter it once."""
        self._pending = pending
        self._ctx: Context | None = None

    def __await__(self) -> Generator[Any, None, Context]:
        return self._pending.__await__()

    async def __aenter__(self) -> Context:
        self._ctx = await self._pending
        return self._ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if self._ctx is not None:
            self._ctx.close()
        return False


def create_context(
    path_or_model: str | PathLike[str] | Model,
    *,
    n_ctx: int = 4096,
    n_batch: int = 512,
    n_seq_max: int = 8,
    n_threads: int | None = None,
    n_threads_batch: int | None = None,
    type_k: str = "f16",
    type_v: str = "f16",
    embeddings: bool = False,
    pooling: str | None = None,
    n_gpu_layers: int | None = None,
) -> ContextOpening:
    """Create a context (a unified KV cache and its engine thread) on a model or a GGUF path,
    without blocking the event loop: `ctx = await create_context(...)`, or
    `async with create_context(...) as ctx:`. Options as `create_context_sync`; a bad one
    raises ValueError naming it, a model that cannot be loaded ModelLoadError."""
    return ContextOpening(
        _native.create_context(
            path_or_model,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            n_threads=n_threads,
            n_threads_batch=n_threads_batch,
            type_k=type_k,
            type_v=type_v,
            embeddings=embeddings,
            pooling=pooling,
            n_gpu_layers=n_gpu_layers,
        )
    )
