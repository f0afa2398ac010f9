"""The Ray side of ``kvfork serve --ray``: actors that each run a `Generator` (a context, its
`PrefixCache` and its admission), and the set of them the front keeps, replacing one that
dies.

An actor's `ServeActor.generate` is an async generator method: the front reads it as a Ray
stream (an ``ObjectRefGenerator``), a list of events per item. Events are coalesced (the first
at once, then at most one item per `COALESCE` seconds) because each streamed item costs the
front about 0.3 ms of Ray work, more than a token's event is worth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from .._native import Context, create_context
from .backend import Events
from .errors import APIError
from .generation import Event, Generator, Outcome
from .requests import Sampling

log = logging.getLogger("kvfork.server")

#: The longest an actor holds a request's events before streaming them to the front.
COALESCE = 0.04


@dataclass
class Failure:
    """An `APIError` crossing from an actor to the front (it does not pickle itself: its
    constructor takes more than its message)."""

    status: int
    message: str
    type: str
    param: str | None
    code: str | None
    headers: dict[str, str]

    @classmethod
    def of(cls, exc: APIError) -> Failure:
        """The crossing form of `exc`."""
        return cls(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    def error(self) -> APIError:
        """The `APIError` again, on the front."""
        return APIError(
            self.status,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )


Item = list[Event | Outcome] | Failure


class ServeActor:
    """One Ray actor: a context on the model, a `Generator` over it, and its tallies."""

    def __init__(self, model_path: str, context_options: dict[str, Any], max_queue: int) -> None:
        self._model_path = model_path
        self._context_options = context_options
        self._max_queue = max_queue
        self._opening: asyncio.Future[Generator] | None = None
        self._tally = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion": 0}

    async def _service(self) -> Generator:
        # Opened on first use, on the actor's loop; concurrent first calls share the opening.
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        return await self._opening

    async def _open(self) -> Generator:
        ctx: Context = await create_context(self._model_path, **self._context_options)
        return Generator(ctx, max_queue=self._max_queue)

    async def ready(self) -> int:
        """Load the model now; the actor's process id."""
        await self._service()
        return os.getpid()

    async def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> AsyncGenerator[Item, None]:
        """`Generator.generate`'s events in lists, then its `Outcome`; an error as a `Failure`
        (the last item). Cancelling the call (``ray.cancel``) ends the generation."""
        service = await self._service()
        events: Events | None = None
        try:
            events = service.generate(tokens, sampling, stop, prompt_param)
            async for batch in _coalesced(events, COALESCE):
                for item in batch:
                    if isinstance(item, Outcome):
                        self._count(item)
                yield batch
        except APIError as exc:
            yield Failure.of(exc)
        except Exception:  # a request must not end the actor: the front answers 500
            log.exception("generation failed")
            yield Failure.of(APIError(500, "internal error", type="server_error"))
        finally:
            if events is not None:
                events.close()

    def _count(self, outcome: Outcome) -> None:
        self._tally["requests"] += 1
        self._tally["prompt_tokens"] += outcome.prompt_tokens
        self._tally["cached_tokens"] += outcome.cached_tokens
        self._tally["completion"] += outcome.completion_tokens

    async def snapshot(self) -> dict[str, float]:
        """The actor's numbers for the front's ``/metrics``."""
        s = await self._service()
        admitted_ago = time.monotonic() - s.admission.last_admitted
        return {"pid": os.getpid(), **s.live_stats(), **self._tally, "admitted_ago": admitted_ago}


async def _coalesced(source: AsyncIterable[Any], interval: float) -> AsyncIterator[list[Any]]:
    """The items of `source` in lists: the first at once, later ones gathered until `interval`
    has passed since the last list (an `Outcome` goes at once: it is the end)."""
    batch: list[Any] = []
    last = -interval
    async for item in source:
        batch.append(item)
        now = time.monotonic()
        if isinstance(item, Outcome) or now - last >= interval:
            yield batch
            batch, last = [], now
    if batch:
        yield batch


_RemoteServeActor: Any = ray.remote(ServeActor)


class ActorSet:
    """The front's actors, each slot replaced by a fresh actor when its actor dies."""

    def __init__(
        self,
        model_path: str,
        context_options: dict[str, Any],
        *,
        actors: int,
        num_cpus: float,
        max_queue: int,
    ) -> None:
        self._args = (model_path, context_options, max_queue)
        self._options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 10_000}
        self.handles = [self._spawn() for _ in range(actors)]
        self.replaced = [0] * actors

    def _spawn(self) -> Any:
        handle: Any = _RemoteServeActor.options(**self._options).remote(*self._args)
        handle.ready.remote()  # start loading the model now; calls wait for the same opening
        return handle

    def __len__(self) -> int:
        return len(self.handles)

    async def ready(self) -> list[int]:
        """Wait until every actor has loaded the model; their process ids."""
        pids: list[int] = await asyncio.gather(*(h.ready.remote() for h in self.handles))
        return pids

    def replace(self, index: int, handle: Any) -> bool:
        """Replace the actor `handle` of slot `index`, which died; False when another request
        saw the same death first (the slot already holds a new actor)."""
        if self.handles[index] is not handle:
            return False
        ray.kill(handle, no_restart=True)
        self.handles[index] = self._spawn()
        self.replaced[index] += 1
        return True

    async def snapshots(self, timeout: float = 5.0) -> list[dict[str, float] | None]:
        """Every actor's `ServeActor.snapshot`; None for one that is dead or does not answer
        in time (one that is still loading the model)."""

        async def one(handle: Any) -> dict[str, float] | None:
            try:
                row: dict[str, float] = await asyncio.wait_for(handle.snapshot.remote(), timeout)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                return None
            return row

        return list(await asyncio.gather(*(one(h) for h in self.handles)))

    def shutdown(self) -> None:
        """Kill every actor (their contexts go with their processes)."""
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
