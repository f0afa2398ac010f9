"""Prometheus metrics (`GET /metrics`), through `prometheus_client`, with the spec's names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .service import Outcome, Service

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Live(Collector):
    """What is read from the engine at scrape time: decodes, leases, queue, cache."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        s = self.service
        stats = s.ctx.stats()
        cache = s.cache.stats()
        yield CounterMetricFamily(
            "kvfork_decode_calls",
            "llama_decode calls of the generation context",
            value=stats["decode_calls"],
        )
        yield GaugeMetricFamily(
            "kvfork_leases_in_use",
            "KV sequences held by requests in progress",
            value=s.ctx.n_seq_max - s.admission.free,
        )
        yield GaugeMetricFamily(
            "kvfork_queue_length",
            "requests waiting for a free sequence",
            value=s.admission.waiting,
        )
        yield GaugeMetricFamily(
            "kvfork_prefix_cache_entries",
            "finished requests kept as prefix-cache entries",
            value=cache["entries"],
        )
        yield CounterMetricFamily(
            "kvfork_prefix_cache_evictions",
            "prefix-cache entries evicted",
            value=cache["evictions"],
        )


class Metrics:
    """The server's counters and the live view of its engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvfork_requests", "requests answered", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("kvfork_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvfork_prompt_tokens_cached",
            "prompt tokens that came from the prefix cache",
            registry=r,
        )
        self.completion_tokens = Counter("kvfork_completion_tokens", "generated tokens", registry=r)

    def watch(self, service: Service) -> None:
        """Read `service`'s engine at every scrape."""
        self.registry.register(_Live(service))

    def finished(self, outcome: Outcome) -> None:
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_tokens.inc(outcome.cached_tokens)
        self.completion_tokens.inc(outcome.completion_tokens)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
