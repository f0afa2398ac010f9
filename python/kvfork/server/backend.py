"""What the HTTP layer needs from the model behind it: one `Service` in this process, or a
`ClusterService` over Ray actors (``kvfork serve --ray``). The endpoints see only this."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from .._native import Context
from .metrics import Metrics
from .requests import ChatRequest, CompletionRequest, EmbeddingRequest, Sampling
from .service import Event, Outcome


class Backend(Protocol):
    """The endpoints' view of a server: prompts are built on `ctx` (the model's tokenizer and
    chat template), generations come from `generate`."""

    ctx: Context
    embed_ctx: Context | None
    model_id: str
    created: int
    metrics: Metrics

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for."""
        ...

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], list[str]]: ...

    def completion_prompt(self, req: CompletionRequest) -> list[int]: ...

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> AsyncGenerator[Event | Outcome, None]: ...

    async def embed(self, req: EmbeddingRequest) -> tuple[list[Any], int]: ...

    def tool_calls(self, req: ChatRequest, text: str) -> list[dict[str, Any]]: ...

    def constrain_tools(self, req: ChatRequest) -> None: ...

    async def metrics_text(self) -> bytes:
        """The Prometheus text of `GET /metrics`."""
        ...
