"""The model behind the endpoints, in one process: the requests' inputs (`Prompts`) and their
generation on one context (`Generator`), with the server's metrics. `kvfork serve --ray`
puts a `ClusterService` in its place (`cluster.py`): the same `Prompts`, generations on
actors that each run a `Generator`."""

from __future__ import annotations

import time
from typing import Any

from .generation import Generation, Generator
from .metrics import Metrics
from .prompts import Prompts
from .requests import Sampling


class Service:
    """`Prompts` and a `Generator` on the same model, behind the endpoints (a `Backend`)."""

    def __init__(
        self, prompts: Prompts, generator: Generator, *, model_id: str, metrics: Metrics
    ) -> None:
        self.prompts = prompts
        self.generator = generator
        self.model_id = model_id
        self.metrics = metrics
        self.created = int(time.time())
        self.lora_adapters = generator.adapters.listing()
        generator.finished = metrics.finished
        metrics.watch(generator.live_stats)

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for: one lease per choice."""
        return self.generator.max_choices

    async def metrics_text(self) -> bytes:
        """The Prometheus text of `GET /metrics`."""
        return self.metrics.text()

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> Generation:
        """See `Generator.generate`."""
        return self.generator.generate(tokens, sampling, stop, prompt_param)

    def end_reasoning(self, request_id: str) -> bool:
        """See `Generator.end_reasoning`."""
        return self.generator.end_reasoning(request_id)

    async def health(self, stall_seconds: float) -> dict[str, Any]:
        """See `Generator.health`."""
        return self.generator.health(stall_seconds)

    def stop_admitting(self) -> None:
        """See `Generator.stop_admitting`."""
        self.generator.stop_admitting()

    def end_all(self) -> None:
        """See `Generator.end_all`."""
        self.generator.end_all()
