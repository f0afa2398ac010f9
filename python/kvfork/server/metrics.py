"""Prometheus metrics (`GET /metrics`), through `prometheus_client` (`docs/serve.md` lists them).

Counters the server keeps itself (requests by endpoint and final status, tokens, client
disconnects), and a live view read at scrape time from a stats callable (`LIVE` names what
it returns): where the context's sequences are, the queue, the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .generation import Outcome

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The live view: each key of a stats callable's mapping, its kind and its help. Exposed as
#: ``kvfork_<key>`` (counters with prometheus' ``_total``).
LIVE: dict[str, tuple[str, str]] = {
    "decode_calls": ("counter", "llama_decode calls of the generation context"),
    "mixed_decodes": (
        "counter",
        "decodes that held prompt chunks and running streams' steps together",
    ),
    "checkpoint_restores": (
        "counter",
        "recurrent-state checkpoints put back (forks inside a sequence, rollbacks)",
    ),
    "checkpoint_bytes": ("gauge", "bytes of recurrent-state checkpoints held in host memory"),
    "leases_in_use": ("gauge", "KV sequences held: by requests and by prefix-cache entries"),
    "sequences_admitted": ("gauge", "KV sequences admitted to requests in progress"),
    "queue_length": ("gauge", "requests waiting for a free sequence"),
    "sequences_max": ("gauge", "KV sequences of the context"),
    "sequences_requests": ("gauge", "KV sequences held by requests in progress"),
    "sequences_cache": ("gauge", "KV sequences held by prefix-cache entries"),
    "sequences_free": ("gauge", "KV sequences nobody holds"),
    "parked_branches": ("gauge", "branches parked in host memory"),
    "prefix_cache_entries": ("gauge", "finished requests kept as prefix-cache entries"),
    "prefix_cache_evictions": ("counter", "prefix-cache entries evicted"),
    "prefix_cache_spilled": (
        "gauge",
        "evicted prefix-cache entries kept in host memory and on disk (--cache-ram, --cache-dir)",
    ),
    "prefix_cache_spilled_bytes": ("gauge", "bytes of those entries"),
    "prefix_cache_restored": (
        "counter",
        "evicted entries copied back into the KV instead of prefilled",
    ),
}

Stats = Callable[[], Mapping[str, float]]


class _Live(Collector):
    """`LIVE`, read from `read` at every scrape."""

    def __init__(self, read: Stats) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        values = self.read()
        for key, (kind, doc) in LIVE.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"kvfork_{key}", doc, value=values[key])


class Metrics:
    """The server's counters and the live view of its engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvfork_requests",
            "requests answered, by final status (499: the client went away)",
            ["endpoint", "status"],
            registry=r,
        )
        self.disconnects = Counter(
            "kvfork_client_disconnects",
            "requests whose client went away before the answer ended",
            ["endpoint"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvfork_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvfork_prompt_tokens_cached",
            "prompt tokens that came from the prefix cache",
            registry=r,
        )
        self.completion_tokens = Counter("kvfork_completion_tokens", "generated tokens", registry=r)

    def watch(self, read: Stats) -> None:
        """Report `read()` (a mapping with `LIVE`'s keys) at every scrape."""
        self.registry.register(_Live(read))

    def finished(self, outcome: Outcome) -> None:
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_tokens.inc(outcome.cached_tokens)
        self.completion_tokens.inc(outcome.completion_tokens)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def disconnected(self, endpoint: str) -> None:
        self.disconnects.labels(endpoint=endpoint).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
