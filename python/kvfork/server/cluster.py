"""``kvfork serve --ray``: the same endpoints, each generation run on one of N Ray actors.

The front (this process) builds prompts (`Prompts`) on a small context of its own (the
tokenizer and the chat template; the embedding context too, with ``--embeddings``), picks an
actor with the `Router` from the prompt's tokens, and streams the actor's events back. Each
actor runs a `Generator` of its own: a context, its `PrefixCache`, its admission queue. An actor that dies
fails the requests it had started (503, or an SSE error event once a stream began); one that
had not started on it is retried on another actor, and the dead one is replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import ray
import ray.exceptions
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .actors import ActorSet, Failure
from .errors import APIError, shutting_down
from .generation import Event, Outcome, check_room, health_body
from .metrics import LIVE, Metrics
from .prompts import Prompts
from .requests import Sampling
from .router import Policy, Router

log = logging.getLogger("kvfork.server")


class ClusterService:
    """The endpoints' backend over `actors`: the requests' inputs from `prompts` (on the
    front's own context), generations on the routed actor."""

    def __init__(
        self,
        prompts: Prompts,
        actors: ActorSet,
        router: Router,
        *,
        model_id: str,
        n_ctx: int,
        n_seq_max: int,
        metrics: Metrics,
    ) -> None:
        self.prompts = prompts
        self.actors = actors
        self.router = router
        self.model_id = model_id
        self.lora_adapters: list[dict[str, Any]] = []  # --lora is a local server's
        self.created = int(time.time())
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.metrics = metrics
        self.retries = 0  # requests moved to another actor after theirs died
        self.generations: set[RemoteGeneration] = set()
        #: Set when the server shuts down: the error every later request gets.
        self.closed: APIError | None = None
        self.snapshots: list[dict[str, float] | None] = []
        metrics.registry.register(_ActorsLive(self))

    @property
    def max_choices(self) -> int:
        """The largest `n`: an actor's sequences."""
        return self.n_seq_max

    async def metrics_text(self) -> bytes:
        """The front's counters and every actor's numbers, read now."""
        self.snapshots = await self.actors.snapshots()
        return self.metrics.text()

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> RemoteGeneration:
        """The routed actor's events, then the Outcome (see `RemoteGeneration`). A prompt
        that cannot fit an actor's context is refused here, as a local server refuses it."""
        if sampling.reasoning is not None and sampling.reasoning.control:
            raise _no_control("reasoning_control")
        check_room(tokens, self.n_ctx, sampling, prompt_param)
        return RemoteGeneration(self, tokens, sampling, stop, prompt_param)

    def end_reasoning(self, request_id: str) -> bool:
        """The control endpoint: not with `--ray` (the request runs on an actor)."""
        raise _no_control("id")

    async def health(self, stall_seconds: float) -> dict[str, Any]:
        """`GET /health` over the actors, asked now: "degraded" when none answers or one has
        requests waiting with none admitted for `stall_seconds`, "busy" when one has requests
        waiting or every sequence taken, else "ok"; the free sequences and the queue summed."""
        self.snapshots = await self.actors.snapshots(timeout=2.0)
        up = [row for row in self.snapshots if row is not None]
        free = sum(row["sequences_max"] - row["sequences_admitted"] for row in up)
        queue = sum(row["queue_length"] for row in up)
        stalled = any(r["queue_length"] and r["admitted_ago"] > stall_seconds for r in up)
        return health_body(not up or stalled, int(free), int(queue))

    def stop_admitting(self) -> None:
        """Shutting down: new requests get 503; those under way go on."""
        self.closed = shutting_down()

    def end_all(self) -> None:
        """The shutdown's grace is over: generations still under way end with a 503."""
        for generation in list(self.generations):
            generation.end(shutting_down())

    def shutdown(self) -> None:
        """Kill the actors."""
        self.actors.shutdown()


def _no_control(param: str) -> APIError:
    """Reasoning control needs the request's generation in this process (a 400 naming
    `param`)."""
    return APIError(
        400,
        "reasoning control is not available with kvfork serve --ray",
        param=param,
        code="unsupported",
    )


class RemoteGeneration:
    """One request's generation on a routed actor: the actor's events, then the Outcome.
    `close()` (which never suspends) cancels the actor's work (its sequences come back there)
    and gives the router its load back."""

    def __init__(
        self,
        cluster: ClusterService,
        tokens: list[int],
        sampling: Sampling,
        stop: list[str],
        prompt_param: str,
    ) -> None:
        self.cluster = cluster
        self.args = (tokens, sampling, stop, prompt_param)
        self._index: int | None = None
        self._stream: Any = None
        self._ended = False
        self._error: APIError | None = None  # `end`'s
        cluster.generations.add(self)

    def __aiter__(self) -> AsyncIterator[Event | Outcome]:
        return self._events()

    def end(self, error: APIError) -> None:
        """End it from outside (a shutdown): the actor's work is cancelled, and the iteration
        raises `error`."""
        self._error = error
        if self._stream is not None and not self._ended:
            ray.cancel(self._stream)

    def close(self) -> None:
        """Let go of the actor now (idempotent, never suspends)."""
        self.cluster.generations.discard(self)
        if self._index is None:
            return
        self.cluster.router.done(self._index)
        if not self._ended and self._stream is not None:  # the client went away
            ray.cancel(self._stream)
        self._index = self._stream = None

    async def _events(self) -> AsyncIterator[Event | Outcome]:
        c, tokens = self.cluster, self.args[0]
        tried: list[int] = []
        if c.closed is not None:
            raise c.closed
        try:
            while True:
                index = c.router.pick(tokens, exclude=tried).actor
                self._index, self._ended = index, False
                handle = c.actors.handles[index]
                started = False
                try:  # from the pick on: `close` gives the router its load back
                    self._stream = handle.generate.remote(*self.args)
                    async for ref in self._stream:
                        item = await ref
                        if isinstance(item, Failure):
                            self._ended = True
                            raise item.error()
                        started = True
                        for event in item:
                            if isinstance(event, Outcome):
                                self._ended = True
                                c.metrics.finished(event)
                            yield event
                    return
                except ray.exceptions.TaskCancelledError:
                    if self._error is None:
                        raise
                    self._ended = True
                    raise self._error from None
                except ray.exceptions.RayActorError as exc:
                    self._ended = True
                    if c.actors.replace(index, handle):
                        c.router.forget(index)
                        log.warning("actor %d died (%s); replaced", index, type(exc).__name__)
                    tried.append(index)
                    if started or len(tried) >= len(c.actors):
                        raise APIError(
                            503,
                            "the worker serving this request died; it is being replaced, try again",
                            type="server_error",
                            code="worker_died",
                            headers={"Retry-After": "1"},
                        ) from None
                    c.retries += 1  # it had not started there: run it on another actor
                finally:
                    self.close()
        finally:
            self.close()


class _ActorsLive(Collector):
    """The actors' numbers at scrape time: each under its ``actor`` label, and their sum
    (without the label) for the engine's gauges and counters."""

    SUMMED: ClassVar[dict[str, tuple[str, str]]] = LIVE
    PER_ACTOR: ClassVar[dict[str, tuple[str, str]]] = {
        "requests": ("kvfork_actor_requests", "requests finished by the actor"),
        "prompt_tokens": ("kvfork_actor_prompt_tokens", "prompt tokens on the actor"),
        "cached_tokens": (
            "kvfork_actor_prompt_tokens_cached",
            "prompt tokens the actor's prefix cache served",
        ),
        "completion": ("kvfork_actor_completion_tokens", "tokens the actor generated"),
    }

    def __init__(self, cluster: ClusterService) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Any]:
        c = self.cluster
        rows = list(enumerate(c.snapshots))
        live = [(i, row) for i, row in rows if row is not None]
        for key, (kind, doc) in self.SUMMED.items():
            name = f"kvfork_{key}"
            family: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(name, doc, labels=["actor"])
                if kind == "counter"
                else GaugeMetricFamily(name, doc, labels=["actor"])
            )
            for i, row in live:
                family.add_metric([str(i)], row[key])
            family.add_metric([], sum(row[key] for _, row in live))
            yield family
        for key, (name, doc) in self.PER_ACTOR.items():
            counter = CounterMetricFamily(name, doc, labels=["actor"])
            for i, row in live:
                counter.add_metric([str(i)], row[key])
            yield counter
        up = GaugeMetricFamily("kvfork_actor_up", "1 if the actor answered", labels=["actor"])
        pid = GaugeMetricFamily("kvfork_actor_pid", "the actor's process id", labels=["actor"])
        for i, maybe in rows:
            up.add_metric([str(i)], 0 if maybe is None else 1)
            if maybe is not None:
                pid.add_metric([str(i)], maybe["pid"])
        yield up
        yield pid
        in_flight = GaugeMetricFamily(
            "kvfork_actor_in_flight", "requests the front has routed to the actor", labels=["actor"]
        )
        replaced = CounterMetricFamily(
            "kvfork_actor_replaced", "times the actor died and was replaced", labels=["actor"]
        )
        for i in range(len(c.actors)):
            in_flight.add_metric([str(i)], c.router.loads[i])
            replaced.add_metric([str(i)], c.actors.replaced[i])
        yield in_flight
        yield replaced
        yield CounterMetricFamily(
            "kvfork_route_retries",
            "requests run on another actor after theirs died before they started",
            value=c.retries,
        )


def connect(address: str, cpus: int) -> None:
    """Join the Ray cluster at `address` (``auto``: the one this machine runs), or with
    ``local`` start one in this process with `cpus` CPUs (it ends with the process)."""
    if ray.is_initialized():
        return
    if address == "local":
        ray.init(num_cpus=cpus, include_dashboard=False)
    else:
        ray.init(address=address)


async def open_cluster(
    model_path: str,
    prompts: Prompts,
    *,
    actors: int,
    threads: int | None,
    route: Policy,
    n_ctx: int,
    n_seq_max: int,
    max_queue: int,
    model_id: str,
    metrics: Metrics,
) -> ClusterService:
    """`actors` actors on `model_path` (each a context of `n_ctx` cells, `n_seq_max`
    sequences and `threads` threads, reserving as many CPUs), loaded, behind a router."""
    options: dict[str, Any] = {"n_ctx": n_ctx, "n_seq_max": n_seq_max}
    if threads is not None:  # both pinned: actors share the machine's cores
        options.update(n_threads=threads, n_threads_batch=threads)
    pool = ActorSet(model_path, options, actors=actors, num_cpus=threads or 1, max_queue=max_queue)
    await pool.ready()
    router = Router(actors, route, capacity_tokens=n_ctx)
    return ClusterService(
        prompts,
        pool,
        router,
        model_id=model_id,
        n_ctx=n_ctx,
        n_seq_max=n_seq_max,
        metrics=metrics,
    )
