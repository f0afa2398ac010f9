"""Generation: every request is a `Generation` on one context — admitted through a bounded
queue (`Admission`), its branch made by the `PrefixCache` (concurrent requests share their
common prefix and their decodes), `n` choices forked from one prefill — that gives every
sequence back when it ends, however it ends. A `Generator` holds the context's side of it:
the cache, the admission, the generations under way.

When requests that arrive together start generating is the engine's business alone: its
gathering (`kvfork_core::gather`) lets their prefills pack together and their first steps
wait for one another. This layer adds no wait of its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._native import (
    Branch,
    BranchStore,
    Context,
    KvforkError,
    LeaseExhaustedError,
    LoraAdapter,
    PrefixCache,
)
from .._stops import StopStrings
from .adapters import Adapters
from .errors import APIError, bad_request, shutting_down
from .requests import Sampling


class Admission:
    """Sequences for live requests: a request needs `n` (one per choice). Past the free ones it
    waits in a first-come queue of at most `max_queue` requests, beyond which it is refused
    (503). Giving sequences back never suspends, so a cancelled request's clean-up cannot be
    cut short."""

    def __init__(self, leases: int, max_queue: int) -> None:
        self.leases = leases
        self.free = leases
        self.max_queue = max_queue
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()
        #: When a request was last admitted (`stalled` compares it with the clock).
        self.last_admitted = time.monotonic()
        #: Set when the server shuts down: the error every later request gets.
        self.closed: APIError | None = None

    @property
    def waiting(self) -> int:
        """Requests in the queue."""
        return len(self._queue)

    def stalled(self, seconds: float) -> bool:
        """Requests wait and none was admitted for `seconds`."""
        return bool(self._queue) and time.monotonic() - self.last_admitted > seconds

    async def acquire(self, n: int) -> None:
        """Take `n` sequences, waiting in the queue for them; a cancelled wait takes none."""
        if self.closed is not None:
            raise self.closed
        if not self._queue and self.free >= n:
            self._take(n)
            return
        if len(self._queue) >= self.max_queue:
            raise APIError(
                503,
                "the server is busy: every sequence is in use and the queue is full",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        admitted = asyncio.get_running_loop().create_future()
        entry = (n, admitted)
        self._queue.append(entry)
        try:
            await admitted
        except BaseException:
            if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
                self.release(n)  # admitted while being cancelled: the sequences go back
            else:
                with contextlib.suppress(ValueError):  # not popped by `_admit_waiting`
                    self._queue.remove(entry)
                self._admit_waiting()  # the head may have been this request
            raise

    def close(self, error: APIError) -> None:
        """Admit no one any more: later requests and those waiting get `error`."""
        self.closed = error
        while self._queue:
            _, admitted = self._queue.popleft()
            if not admitted.done():
                admitted.set_exception(error)

    def release(self, n: int) -> None:
        """Give `n` sequences back and admit who waits for them."""
        self.free += n
        self._admit_waiting()

    def _take(self, n: int) -> None:
        self.free -= n
        self.last_admitted = time.monotonic()

    def _admit_waiting(self) -> None:
        while self._queue and self._queue[0][0] <= self.free:
            n, admitted = self._queue.popleft()
            if not admitted.done():
                self._take(n)
                admitted.set_result(None)


@dataclass
class Choice:
    """One generated choice as it grows."""

    index: int
    text: StopStrings
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Event:
    """A piece of a choice for a stream: new text (and its logprobs), or its end."""

    index: int
    text: str
    logprobs: list[dict[str, Any]]
    finish_reason: str | None = None


@dataclass
class Outcome:
    """A finished generation: its choices and token counts."""

    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Spill:
    """Where the prefix cache keeps entries evicted from the KV (`kvfork serve --cache-ram`,
    `--cache-dir`, `--cache-disk`): bytes of host memory, a directory and its bytes."""

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0


class Generator:
    """The generation side of a server: one context, its `PrefixCache` and its admission, and
    the generations under way. `finished` hears of every completed generation's Outcome (the
    server's counters)."""

    def __init__(
        self,
        ctx: Context,
        *,
        max_queue: int,
        finished: Callable[[Outcome], None] = lambda o: None,
        spill: Spill | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        self.ctx = ctx
        #: The LoRA adapters requests may choose by name (`kvfork serve --lora`).
        self.adapters = adapters or Adapters([])
        # Leases: one per live choice; the cache keeps what is left as entries and evicts them
        # when a live request needs the lease (to host memory and disk with `spill`).
        spill = spill or Spill()
        self.cache = PrefixCache(
            ctx,
            host_bytes=spill.host_bytes,
            disk_dir=spill.disk_dir,
            disk_bytes=spill.disk_bytes,
        )
        self.spill = spill
        self.store = BranchStore(ctx)  # holds no lease: the free count
        self.admission = Admission(ctx.n_seq_max, max_queue)
        self.finished = finished
        #: Generations under way (a shutdown ends those still running when its grace ends).
        self.generations: set[Generation] = set()

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for: one lease per choice."""
        return self.ctx.n_seq_max

    def check_room(self, tokens: list[int], param: str) -> None:
        """A 400 naming `param` (the request's prompt field) when the prompt cannot fit."""
        if len(tokens) >= self.ctx.n_ctx:
            raise bad_request(
                f"the prompt has {len(tokens)} tokens; this server's context holds "
                f"{self.ctx.n_ctx} (start it with a larger --n-ctx)",
                param,
                "context_length_exceeded",
            )

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> Generation:
        """A request's generation: iterate it for the events of every choice as they come,
        then the Outcome; `close()` it when done or gone (see `Generation`). `prompt_param`
        names the request's prompt field in errors."""
        self.check_room(tokens, prompt_param)
        adapters = self.adapters.resolve(sampling.lora, sampling.model)
        return Generation(self, tokens, sampling, [*stop, *sampling.stop], adapters)

    def live_stats(self) -> dict[str, float]:
        """What `/metrics` reads at each scrape (`metrics.LIVE` names the keys): one account
        of the context's sequences — held by requests (the cache's live branches), by the
        prefix cache's entries, free — with the queue and the cache's numbers."""
        stats, cache = self.ctx.stats(), self.cache.stats()
        return {
            "decode_calls": stats["decode_calls"],
            "mixed_decodes": stats["mixed_decodes"],
            "checkpoint_restores": stats["checkpoint_restores"],
            "checkpoint_bytes": stats["checkpoint_bytes"],
            "leases_in_use": self.ctx.n_seq_max - self.store.available,
            "sequences_admitted": self.admission.leases - self.admission.free,
            "queue_length": self.admission.waiting,
            "sequences_max": self.ctx.n_seq_max,
            "sequences_requests": cache["live"],
            "sequences_cache": cache["entries"],
            "sequences_free": self.store.available,
            "parked_branches": stats["parked_branches"],
            "prefix_cache_entries": cache["entries"],
            "prefix_cache_evictions": cache["evictions"],
            "prefix_cache_spilled": cache["host"]["entries"] + cache["disk"]["entries"],
            "prefix_cache_spilled_bytes": cache["host"]["bytes"] + cache["disk"]["bytes"],
            "prefix_cache_restored": cache["host"]["hits"] + cache["disk"]["hits"],
        }

    def health(self, stall_seconds: float) -> dict[str, Any]:
        """`GET /health`: "degraded" when requests wait and none was admitted for
        `stall_seconds`, "busy" when requests hold every sequence or some wait, else "ok"."""
        a = self.admission
        return health_body(a.stalled(stall_seconds), a.free, a.waiting)

    def stop_admitting(self) -> None:
        """Shutting down: new requests and those in the queue get 503; those admitted go on."""
        self.admission.close(shutting_down())

    def end_all(self) -> None:
        """The shutdown's grace is over: every generation still under way ends with a 503
        (a stream with an error event), and gives its sequences back."""
        for generation in list(self.generations):
            generation.end(shutting_down())

    def persist(self) -> int:
        """At shutdown, with a cache directory: every prefix-cache entry written there, for
        the next start (`PrefixCache.spill_all`); how many entries it holds. Blocking."""
        if self.spill.disk_dir is None:
            return 0
        return self.cache.spill_all()


def health_body(degraded: bool, free: int, queue: int) -> dict[str, Any]:
    """`GET /health`'s body: "degraded" when `degraded`, else "busy" when requests wait or
    hold every sequence, else "ok"; with the free sequences and the queue."""
    status = "degraded" if degraded else "busy" if queue or not free else "ok"
    return {"status": status, "free_sequences": free, "queue": queue}


class Generation:
    """One request's generation, from admission to its last event: `async for` gives the
    events of every choice as they come, then the `Outcome`.

    `close()` ends it at once and gives every sequence back (its branches to the prefix cache
    as entries, its admission), whatever state it is in. It never suspends: the clean-up of a
    request whose client went away runs in a task being cancelled, where any `await` could be
    cut short and leak the sequences. Call it in a `finally`; iterating calls it at the end.

    `end(error)` ends it from outside (a shutdown): the iteration raises `error` at its next
    step, so a stream ends with an error event instead of being cut.
    """

    def __init__(
        self,
        generator: Generator,
        tokens: list[int],
        sampling: Sampling,
        stop: list[str],
        adapters: dict[LoraAdapter, float] | None = None,
    ) -> None:
        self.generator = generator
        self.tokens = tokens
        self.sampling = sampling
        self.stop = stop
        #: The LoRA set its branches decode under (forks inherit it).
        self.adapters = adapters or {}
        self.branches: list[Branch] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._admitted = 0
        self._closed = False
        self._ended: APIError | None = None
        self._out: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        generator.generations.add(self)

    def __aiter__(self) -> AsyncIterator[Event | Outcome]:
        return self._events()

    def end(self, error: APIError) -> None:
        """Make the iteration raise `error` at its next step (after a prefill in progress)."""
        self._ended = error
        self._out.put_nowait(error)

    def _check_ended(self) -> None:
        if self._ended is not None:
            raise self._ended

    def close(self) -> None:
        """End the generation now and give every sequence back (idempotent, never suspends)."""
        if self._closed:
            return
        self._closed = True
        self.generator.generations.discard(self)
        for task in self._tasks:
            task.cancel()  # a step in flight completes or rolls back on the engine thread
        cache = self.generator.cache
        for branch in reversed(self.branches):
            with contextlib.suppress(ValueError):  # pruned already: nothing to give back
                cache.release(branch)
        self.branches = []
        if self._admitted:
            self.generator.admission.release(self._admitted)
            self._admitted = 0

    async def _events(self) -> AsyncIterator[Event | Outcome]:
        g, sampling = self.generator, self.sampling
        try:
            self._check_ended()
            await g.admission.acquire(sampling.n)
            self._admitted = sampling.n
            cached = await self._choices()
            self._check_ended()
            choices = [Choice(i, StopStrings(self.stop)) for i in range(len(self.branches))]
            out = self._out
            if len(self.branches) > 1 and not sampling.logprobs:
                # n choices of one request: one decode per step for all of them.
                together = _run_together(g.ctx, self.branches, choices, sampling, out)
                self._tasks = [asyncio.create_task(_reporting(together, out))]
            else:
                self._tasks = [
                    asyncio.create_task(
                        _reporting(_generate_choice(g.ctx, b, c, sampling, out), out)
                    )
                    for b, c in zip(self.branches, choices)
                ]
            done = 0
            while done < len(choices):
                event = await out.get()
                if isinstance(event, BaseException):
                    raise event
                done += event.finish_reason is not None
                yield event
            outcome = Outcome(choices, len(self.tokens), cached)
            g.finished(outcome)
            yield outcome
        finally:
            self.close()

    async def _choices(self) -> int:
        """One branch per choice (`self.branches`): the first from the prefix cache, the
        others forked from it (one prefill for all; entries evicted for their sequences).
        The prompt tokens that came from the cache."""
        g, sampling = self.generator, self.sampling
        try:
            first = await g.cache.branch(
                self.tokens, sampling.params(0), adapters=self.adapters or None
            )
        except LeaseExhaustedError:
            raise _no_free_sequence() from None
        except ValueError as exc:  # raced
            raise bad_request(str(exc), "prompt", "context_length_exceeded") from None
        self.branches.append(first)
        cached = g.cache.shared_tokens(first) or 0
        if sampling.logit_bias:
            first.set_logit_bias(sampling.logit_bias)
        if sampling.json_schema is not None:
            try:
                # Compiling a schema can take a while: off the event loop.
                await asyncio.to_thread(first.set_json_schema, sampling.json_schema)
            except KvforkError as exc:
                raise bad_request(
                    f"the JSON schema is not usable: {exc}", "response_format"
                ) from None
        for i in range(1, sampling.n):
            seed = sampling.params(i).get("seed", int.from_bytes(np.random.bytes(4), "little"))
            try:
                self.branches.append(await g.cache.fork(first, seed=seed))
            except LeaseExhaustedError:
                raise _no_free_sequence() from None
        return cached


def _no_free_sequence() -> APIError:
    """Admission counts live requests' sequences, so this is a race lost to another request:
    try again."""
    return APIError(503, "no free sequence", type="server_error", headers={"Retry-After": "1"})


async def _reporting(work: Awaitable[None], out: asyncio.Queue[Event | BaseException]) -> None:
    """Run `work`; the error that ends it goes on `out` for the request's task to raise."""
    try:
        await work
    except Exception as exc:  # noqa: BLE001 - handed to the request's task, which raises it
        out.put_nowait(exc)


async def _run_together(
    ctx: Context,
    branches: list[Branch],
    choices: list[Choice],
    sampling: Sampling,
    out: asyncio.Queue[Event | BaseException],
) -> None:
    """Every choice advanced by `BranchStore.step`: one decode per step for all."""
    store = BranchStore(ctx)
    limit = min(sampling.max_tokens, ctx.n_ctx - branches[0].position)
    active = list(zip(branches, choices))
    for _ in range(limit):
        if not active:
            break
        tokens = await store.step([b for b, _ in active])
        still = []
        for (branch, choice), tok in zip(active, tokens):
            finish = None
            if tok.is_stop:
                finish = "stop"
            else:
                choice.tokens += 1
                if choice.text.add(tok.text):
                    finish = "stop"
                elif piece := choice.text.take():
                    out.put_nowait(Event(choice.index, piece, []))
            if finish is None:
                still.append((branch, choice))
            else:
                choice.finish_reason = finish
                out.put_nowait(Event(choice.index, choice.text.take(final=True), [], finish))
        active = still
    for _, choice in active:
        choice.finish_reason = "length"
        out.put_nowait(Event(choice.index, choice.text.take(final=True), [], "length"))


async def _generate_choice(
    ctx: Context,
    branch: Branch,
    choice: Choice,
    sampling: Sampling,
    out: asyncio.Queue[Event | BaseException],
) -> None:
    """One choice on its own branch (its tokens' decodes gather with the other requests')."""
    limit = min(sampling.max_tokens, ctx.n_ctx - branch.position)
    stream: AsyncGenerator[tuple[str, dict[str, Any] | None], None] = (
        _with_logprobs(branch, limit, sampling.top_logprobs)
        if sampling.logprobs
        else _plain(branch, limit)
    )
    finish = "length"
    async with contextlib.aclosing(stream):
        async for text, lp in stream:
            choice.tokens += 1
            stopped = choice.text.add(text)
            if lp is not None:
                choice.logprobs.append(lp)
            piece = choice.text.take()
            if piece or lp is not None:
                out.put_nowait(Event(choice.index, piece, [lp] if lp else []))
            if stopped:
                finish = "stop"
                break
        else:
            if choice.tokens < limit:
                finish = "stop"  # a stop token
    rest = choice.text.take(final=True)
    choice.finish_reason = finish
    out.put_nowait(Event(choice.index, rest, [], finish))


async def _plain(branch: Branch, limit: int) -> AsyncGenerator[tuple[str, None], None]:
    """The branch's tokens. The first goes out as soon as it is drawn from the prompt's
    logits, before its own decode: the time to first token is the prefill's alone."""
    if limit < 1:
        return
    first = await branch.produce()
    if first.is_stop:
        return
    # Queued before the chunk goes out: streaming it first would delay this commit past the
    # window in which the engine gathers the other choices' first commits into one decode.
    committed = branch.commit(first)
    try:
        yield first.text, None
    except BaseException:
        committed.close()  # closed early: the generation is over, the commit not awaited
        raise
    await committed
    if limit > 1:
        async for tok in branch.generate(max_tokens=limit - 1):
            yield tok.text, None


async def _with_logprobs(
    branch: Branch, limit: int, top: int
) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    """Tokens with the logprob of each and the `top` best alternatives (before sampling);
    each goes out before its own decode, as in `_plain`."""
    ctx = branch.context
    for _ in range(limit):
        tok = await branch.produce()
        if tok.is_stop:
            return
        entry = {
            "token": tok.text,
            "logprob": branch.logprob(tok.token),
            "bytes": list(tok.text.encode()),
            "top_logprobs": [
                {"token": (t := ctx.token_to_text(i)), "logprob": lp, "bytes": list(t.encode())}
                for i, lp in (branch.top_logprobs(top) if top else [])
            ],
        }
        committed = branch.commit(tok)  # queued first: see `_plain`
        try:
            yield tok.text, entry
        except BaseException:
            committed.close()  # as in `_plain`
            raise
        await committed
