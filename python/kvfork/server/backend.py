"""What the HTTP layer needs from the model behind it: one `Service` in this process, or a
`ClusterService` over Ray actors (``kvfork serve --ray``). The endpoints see only this.

The layers: `app` (HTTP: bodies, errors, streams, disconnects) → `requests` (bodies into
typed requests) → a `Backend`: `prompts` (requests into tokens) and `generation` (tokens
into events, on a context)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from .generation import Event, Outcome
from .metrics import Metrics
from .prompts import Prompts
from .requests import Sampling


class Events(Protocol):
    """One request's generation: `async for` gives its events, then the `Outcome`. `close()`
    ends it and gives its sequences back; it never suspends (it runs in the clean-up of
    requests being cancelled), and it is safe to call twice."""

    def __aiter__(self) -> AsyncIterator[Event | Outcome]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """The endpoints' view of a server: requests' inputs from `prompts` (the model's tokenizer
    and chat template), generations from `generate`."""

    prompts: Prompts
    model_id: str
    created: int
    metrics: Metrics
    #: `GET /lora-adapters`: the adapters requests may choose (`Adapters.listing`).
    lora_adapters: list[dict[str, Any]]

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for."""
        ...

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> Events: ...

    def end_reasoning(self, request_id: str) -> bool:
        """End the reasoning of the running chat request `request_id` (armed with
        `reasoning_control`); False when it is over. 404 unknown, 409 not armed."""
        ...

    async def health(self, stall_seconds: float) -> dict[str, Any]:
        """`GET /health`'s body (see `Endpoints.health`)."""
        ...

    def stop_admitting(self) -> None:
        """A shutdown starts: later requests get 503."""

    def end_all(self) -> None:
        """A shutdown's grace is over: generations still under way end with a 503."""

    async def metrics_text(self) -> bytes:
        """The Prometheus text of `GET /metrics`."""
        ...


def answering_model(backend: Backend, asked: str | None) -> str:
    """The model a reply names: the adapter its request's `model` chose (an entry of
    `/v1/models`), else the base model's id."""
    if asked is not None and any(a["name"] == asked for a in backend.lora_adapters):
        return asked
    return backend.model_id
