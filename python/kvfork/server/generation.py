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
import copy
import functools
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from .._native import (
    Branch,
    BranchStore,
    Context,
    KvCacheFullError,
    KvforkError,
    LeaseExhaustedError,
    LoraAdapter,
    PrefixCache,
    Token,
)
from .._stops import StopStrings
from .adapters import Adapters
from .errors import APIError, bad_request, shutting_down
from .logprobs import (
    PromptLogprobs,
    Score,
    ScoreCache,
    logprob_entry,
    prompt_logprobs,
    score_prompt,
)
from .reasoning import Plan, Splitter, Thought
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
    """One generated choice as it grows: its text (cut at stop strings), split into reasoning
    and content as it is handed out, and its thinking followed token by token."""

    index: int
    text: StopStrings
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    #: The tokens it may still generate, forced ones included (`max_tokens`, the context).
    limit: int = 0
    #: Its thinking, for a chat request (None: no reasoning is followed).
    thought: Thought | None = None
    #: What takes the reasoning out of its text (None: the text is all content).
    split: Splitter | None = None
    #: "deepseek-legacy": the content keeps the whole text, the reasoning is split out too.
    keeps_markup: bool = False
    #: The text handed out: its reasoning, and the rest (the reply's content).
    reasoning: str = ""
    content: str = ""
    #: Completion tokens that were reasoning (counted once, for the choice that thought).
    reasoning_tokens: int = 0
    #: Logprobs entries not handed out yet, each with where its token's text starts: an
    #: entry goes out with the first of its token's text, and a stop string drops those of
    #: the tokens it cut whole (so a stream's entries add up to the reply's, and to its text).
    held_logprobs: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    #: Where each token of `logprobs` starts in the text (`/v1/completions`' text_offset).
    logprob_offsets: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, index: int, stop: list[str], plan: Plan | None, limit: int) -> Choice:
        """A choice about to be generated under a request's reasoning `plan`."""
        choice = cls(index, StopStrings(stop), limit=limit)
        if plan is not None:
            choice.thought = Thought(plan)
            choice.split = Splitter(plan.opened) if plan.splits else None
            choice.keeps_markup = plan.keeps_markup
        return choice

    def add(self, text: str, tokens: int = 1, logprobs: dict[str, Any] | None = None) -> bool:
        """A sampled token's text (and its logprobs entry): True once a stop string has
        appeared."""
        if logprobs is not None:
            self.held_logprobs.append((len(self.text.text), logprobs))
        self.tokens += tokens
        if self.thought is not None:
            self.reasoning_tokens += self.thought.saw(text, tokens)
        return self.text.add(text)

    def add_forced(self, text: str, tokens: int) -> bool:
        """The forced end of a block, committed as `tokens` tokens: True at a stop string."""
        assert self.thought is not None
        self.tokens += tokens
        self.reasoning_tokens += tokens
        self.thought.forced(text, tokens)
        return self.text.add(text)

    def event(self, finish: str | None = None) -> Event | None:
        """The text not handed out yet as an event (its reasoning and content apart), with
        its tokens' logprobs; with `finish`, the choice's end. None when there is nothing to
        tell."""
        piece = self.text.take(final=finish is not None)
        released = self._release_logprobs(final=finish is not None)
        logprobs = [entry for _, entry in released]
        reasoning, content = "", piece
        if self.split is not None:
            reasoning, content = self.split.feed(piece)
            if finish is not None:
                rest = self.split.finish()
                reasoning, content = reasoning + rest[0], content + rest[1]
            if self.keeps_markup:
                content = piece
        self.reasoning += reasoning
        self.content += content
        if finish is not None:
            self.finish_reason = finish
        if not (reasoning or content or logprobs or finish):
            return None
        offsets = [start for start, _ in released]
        return Event(self.index, content, logprobs, finish, reasoning, offsets)

    def _release_logprobs(self, final: bool) -> list[tuple[int, dict[str, Any]]]:
        """The held entries whose token's text has begun to go out (at the end: all, but
        those of tokens a stop string cut whole)."""
        if not final:
            out = self.text.given  # the text handed out so far
        elif self.text.stopped:
            out = len(self.text.content)  # up to the stop string's cut
        else:
            out = len(self.text.text) + 1  # all of it
        n = 0
        while n < len(self.held_logprobs) and self.held_logprobs[n][0] < out:
            n += 1
        released = self.held_logprobs[:n]
        self.held_logprobs = [] if final else self.held_logprobs[n:]
        self.logprobs += [entry for _, entry in released]
        self.logprob_offsets += [start for start, _ in released]
        return released

    def fork(self, index: int) -> Choice:
        """A copy for a choice forked from this one's branch now (shared reasoning): the same
        text so far, none of its tokens (they are billed once, to this one), the same room."""
        other = copy.deepcopy(self)
        other.index, other.tokens, other.reasoning_tokens = index, 0, 0
        other.limit = self.limit - self.tokens
        return other


@dataclass
class Event:
    """A piece of a choice for a stream: new content and reasoning (and their logprobs), or
    its end."""

    index: int
    text: str
    logprobs: list[dict[str, Any]]
    finish_reason: str | None = None
    reasoning: str = ""
    #: Where each of `logprobs`' tokens starts in the choice's text.
    logprob_offsets: list[int] = field(default_factory=list)
    #: On a generation's first event: the prompt's tokens its prefill found in the prefix
    #: cache (known from then on; a stream's start can say so).
    cached_tokens: int | None = None
    #: On a generation's first event, when it scored its prompt: the prompt's logprobs.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class Outcome:
    """A finished generation: its choices and token counts."""

    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int
    #: The prompt's logprobs, when it was scored (`Sampling.score_prompt`).
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def reasoning_tokens(self) -> int:
        return sum(c.reasoning_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
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
        #: The scores of prompts scored last (`echo` + `logprobs`), for prompts that share
        #: their beginning.
        self.scores = ScoreCache()
        self.store = BranchStore(ctx)  # holds no lease: the free count
        self.admission = Admission(ctx.n_seq_max, max_queue)
        self.finished = finished
        #: Generations under way (a shutdown ends those still running when its grace ends).
        self.generations: set[Generation] = set()
        #: Those with an id (chat requests), by it: the control endpoint finds them here.
        self.running: dict[str, Generation] = {}

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for: one lease per choice."""
        return self.ctx.n_seq_max

    def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> Generation:
        """A request's generation: iterate it for the events of every choice as they come,
        then the Outcome; `close()` it when done or gone (see `Generation`). `prompt_param`
        names the request's prompt field in errors."""
        check_room(tokens, self.ctx.n_ctx, sampling, prompt_param)
        adapters = self.adapters.resolve(sampling.lora, sampling.model)
        # A reply the schema constrains (`response_format`, a required tool call) ends where
        # the schema does: a stop string would cut it into text that is neither.
        stops = [] if sampling.json_schema is not None else [*stop, *sampling.stop]
        return Generation(self, tokens, sampling, stops, adapters)

    def end_reasoning(self, request_id: str) -> bool:
        """`POST /v1/chat/completions/control`'s `reasoning_end`: the running request
        `request_id` ends its reasoning at its next token; False when it is over already. A 404
        for an id not running here, a 409 for a request not armed with `reasoning_control`."""
        generation = self.running.get(request_id)
        if generation is None:
            raise APIError(
                404, f"no request {request_id!r} is running", param="id", code="not_found"
            )
        plan = generation.sampling.reasoning
        if plan is None or not plan.control:
            raise APIError(
                409,
                f"request {request_id!r} was not started with reasoning_control: true",
                param="id",
                code="reasoning_control_not_armed",
            )
        return generation.end_reasoning()

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
        """`GET /health`: "failed" when the context closed under the server (an internal
        failure: nothing more can be generated), "degraded" when requests wait and none was
        admitted for `stall_seconds`, "busy" when requests hold every sequence or some wait,
        else "ok"."""
        a = self.admission
        if self.ctx.closed:
            return {"status": "failed", "free_sequences": 0, "queue": a.waiting}
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


def check_room(tokens: list[int], n_ctx: int, sampling: Sampling, param: str) -> None:
    """A 400 naming `param` (the request's prompt field) when the prompt cannot fit `n_ctx`
    cells, with room for a token after it if it generates one (`max_tokens: 0` scores a
    prompt alone)."""
    if len(tokens) + (sampling.max_tokens > 0) > n_ctx:
        raise bad_request(
            f"the prompt has {len(tokens)} tokens; this server's context holds "
            f"{n_ctx} (start it with a larger --n-ctx)",
            param,
            "context_length_exceeded",
        )


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
    step, so a stream ends with an error event instead of being cut; a prefill in progress is
    aborted.

    A request that reasons (`sampling.reasoning`) is followed through its thinking: a budget
    or `end_reasoning` forces the end of a block; with shared reasoning its first choice
    thinks alone and the others are forked from it at the end of its thinking.
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
        self.choices: list[Choice] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._admitted = 0
        self._closed = False
        self._ended: APIError | None = None
        self._end_reasoning = False  # asked before its choices began
        #: The prompt's prefill while it runs (`_prefilled`).
        self._prefill: asyncio.Future[int] | None = None
        #: The prompt's logprobs, once it is scored (`Sampling.score_prompt`).
        self.prompt_logprobs: PromptLogprobs | None = None
        self._out: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        generator.generations.add(self)
        plan = sampling.reasoning
        self.request_id = plan.request_id if plan is not None else None
        if self.request_id is not None:
            generator.running[self.request_id] = self

    def __aiter__(self) -> AsyncIterator[Event | Outcome]:
        return self._events()

    def end(self, error: APIError) -> None:
        """Make the iteration raise `error` at its next step (a prefill in progress is aborted
        first)."""
        self._ended = error
        self._out.put_nowait(error)
        if self._prefill is not None:
            self._prefill.cancel()

    def end_reasoning(self) -> bool:
        """End the reasoning of every choice still thinking, at its next token (or at once
        when a block opens, for one not yet in it); False when every choice is answering."""
        if not self.choices:
            self._end_reasoning = True  # its choices start with it asked
            return not self._closed
        asked = [c.thought.ask_end() for c in self.choices if c.thought is not None]
        return any(asked)

    def _check_ended(self) -> None:
        if self._ended is not None:
            raise self._ended

    def close(self) -> None:
        """End the generation now and give every sequence back (idempotent, never suspends)."""
        if self._closed:
            return
        self._closed = True
        self.generator.generations.discard(self)
        if self.request_id is not None and self.generator.running.get(self.request_id) is self:
            del self.generator.running[self.request_id]
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
            cached = await self._prefilled()
            self._check_ended()
            self.choices = choices = self._start_choices()
            self._tasks = [asyncio.create_task(_reporting(w, self._out)) for w in self._work()]
            done, first = 0, True
            while done < len(choices):
                event = await self._out.get()
                if isinstance(event, BaseException):
                    raise event
                if first:
                    event.cached_tokens, first = cached, False
                    event.prompt_logprobs = self.prompt_logprobs
                done += event.finish_reason is not None
                yield event
            outcome = Outcome(choices, len(self.tokens), cached, self.prompt_logprobs)
            g.finished(outcome)
            yield outcome
        finally:
            self.close()

    async def _prefilled(self) -> int:
        """`_choices` in a task of its own, which `end` cancels: a shutdown's end of grace
        aborts a prefill in progress (rolled back) instead of waiting for it."""
        self._prefill = prefill = asyncio.ensure_future(self._choices())
        try:
            return await prefill
        except asyncio.CancelledError:
            if self._ended is not None and prefill.cancelled():
                raise self._ended from None
            raise
        finally:
            self._prefill = None

    def _start_choices(self) -> list[Choice]:
        """Every choice, about to start (a control request that came first applies)."""
        plan, first = self.sampling.reasoning, self.branches[0]
        limit = min(self.sampling.max_tokens, self.generator.ctx.n_ctx - first.position)
        choices = [Choice.start(i, self.stop, plan, limit) for i in range(self.sampling.n)]
        for choice in choices:
            if self._end_reasoning and choice.thought is not None:
                choice.thought.ask_end()
        return choices

    def _work(self) -> list[Awaitable[None]]:
        """What generates the choices: n choices of one request advance together, one decode
        per step; a choice with logprobs, or whose thinking may be ended, a token at a time;
        one with nothing to look at between its tokens, in the engine's own loop."""
        ctx, sampling, out = self.generator.ctx, self.sampling, self._out
        cache = self.generator.cache
        plan, choices, branches = sampling.reasoning, self.choices, self.branches
        if plan is not None and plan.shared and len(choices) > 1:
            return [self._share_reasoning()]
        if len(branches) > 1 and not sampling.logprobs:
            return [_run_together(ctx, cache, branches, choices, out)]
        if sampling.logprobs or (plan is not None and plan.steered):
            together = zip(branches, choices)
            return [_steered(ctx, cache, b, c, sampling, out) for b, c in together]
        return [_generate_choice(cache, b, c, out) for b, c in zip(branches, choices)]

    async def _share_reasoning(self) -> None:
        """`reasoning_shared`: the first choice thinks alone, its events going to every
        choice; at the end of its thinking the others are forked from its branch (seeded
        apart) and all of them answer. Its reasoning tokens are billed once."""
        g, sampling, out = self.generator, self.sampling, self._out
        first, branch = self.choices[0], self.branches[0]
        fanout = _Fanout(out, len(self.choices))
        await _steered(g.ctx, g.cache, branch, first, sampling, fanout, until_answer=True)
        if first.finish_reason is not None:  # it ended thinking: so did every choice
            self.choices[1:] = [_ended_copy(first, i) for i in range(1, len(self.choices))]
            return
        self.choices[1:] = [first.fork(i) for i in range(1, len(self.choices))]
        await self._fork(branch, len(self.choices))
        if sampling.logprobs:
            together = zip(self.branches, self.choices)
            await asyncio.gather(
                *(_steered(g.ctx, g.cache, b, c, sampling, out) for b, c in together)
            )
        else:
            await _run_together(g.ctx, g.cache, self.branches, self.choices, out)

    async def _fork(self, first: Branch, n: int) -> None:
        """Forks of `first` until there are `n` branches, each seeded as its choice asks."""
        for i in range(len(self.branches), n):
            params = self.sampling.params(i)
            seed = params.get("seed", int.from_bytes(np.random.bytes(4), "little"))
            try:
                self.branches.append(await self.generator.cache.fork(first, seed=seed))
            except LeaseExhaustedError:
                raise _no_free_sequence() from None

    async def _choices(self) -> int:
        """One branch per choice (`self.branches`): the first from the prefix cache, the
        others forked from it (one prefill for all; entries evicted for their sequences) —
        unless they share its reasoning, when they are forked at its end. A scored prompt
        (`score_prompt`) comes from the cache only as far as its kept scores go, the rest
        scored on the branch. The prompt tokens that came from the cache."""
        g, sampling = self.generator, self.sampling
        # With device sampling, a bias or a schema wants a row from the decode whose output
        # it samples: the prompt's last token is prefilled after them. Otherwise the first
        # step decodes it again (`engine/refresh.rs`), on a recurrent state with every token
        # since the branch's last checkpoint.
        constrained = sampling.logit_bias or sampling.json_schema is not None
        last = g.ctx.device_sampling and constrained and len(self.tokens) > 1
        prompt = self.tokens[:-1] if last else self.tokens
        known: list[Score] = []
        if sampling.score_prompt:  # the rest is scored below (whole rows: no `last`)
            known = await asyncio.to_thread(
                g.scores.known, self.tokens, sampling.top_logprobs, self._adapters_key
            )
            prompt, last = self.tokens[: len(known) + 1], False
        try:
            first = await g.cache.branch(prompt, sampling.params(0), adapters=self.adapters or None)
        except LeaseExhaustedError:
            raise _no_free_sequence() from None
        except KvCacheFullError:  # every entry evicted: requests in progress hold the cells
            raise _no_free_cell() from None
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
                    f"the JSON schema is not usable: {exc}", sampling.json_schema_param
                ) from None
        if last:
            try:
                await _with_room(g.cache, lambda: first.prefill(self.tokens[-1:]))
            except _NoRoom:
                raise _no_free_cell() from None
        if sampling.score_prompt:
            self.prompt_logprobs = await self._scored(first, known)
        plan = sampling.reasoning
        if plan is None or not plan.shared:
            await self._fork(first, sampling.n)
        return cached

    @property
    def _adapters_key(self) -> frozenset[tuple[LoraAdapter, float]]:
        """The adapters it decodes under, as a key (scores differ with them)."""
        return frozenset(self.adapters.items())

    async def _scored(self, first: Branch, known: list[Score]) -> PromptLogprobs:
        """Score the prompt into `first`, which holds its tokens whose scores are `known`
        and one more (see `logprobs.py`); kept for later prompts."""
        g, top = self.generator, self.sampling.top_logprobs
        rest = self.tokens[first.position :]
        try:
            scores = known + await score_prompt(
                first, rest, top, lambda call: _with_room(g.cache, call)
            )
        except _NoRoom:
            raise _no_free_cell() from None
        g.scores.keep(self.tokens, top, scores, self._adapters_key)
        return await asyncio.to_thread(prompt_logprobs, g.ctx, self.tokens, scores)


def _ended_copy(first: Choice, index: int) -> Choice:
    """Choice `index` of a shared reasoning that ended before its answer: the first one's."""
    other = first.fork(index)
    other.limit = 0
    return other


class _Fanout:
    """A queue's front that repeats each event for every choice (shared reasoning: until the
    fork, every choice's text is the first one's)."""

    def __init__(self, out: asyncio.Queue[Event | BaseException], n: int) -> None:
        self.out = out
        self.n = n

    def put_nowait(self, event: Event) -> None:
        for index in range(self.n):
            self.out.put_nowait(replace(event, index=index))


class Sink(Protocol):
    """Where a choice's events go: the request's queue, or a `_Fanout` over it."""

    def put_nowait(self, event: Event, /) -> None: ...


def _no_free_sequence() -> APIError:
    """Admission counts live requests' sequences, so this is a race lost to another request:
    try again."""
    return APIError(
        503,
        "no free sequence",
        type="server_error",
        code="no_free_sequence",
        headers={"Retry-After": "1"},
    )


def _no_free_cell() -> APIError:
    """Requests in progress hold every KV cell the prompt needs (the cache evicted all its
    entries): try again."""
    return APIError(
        503,
        "no free KV cell",
        type="server_error",
        code="no_free_cell",
        headers={"Retry-After": "1"},
    )


async def _reporting(work: Awaitable[None], out: asyncio.Queue[Event | BaseException]) -> None:
    """Run `work`; the error that ends it goes on `out` for the request's task to raise."""
    try:
        await work
    except Exception as exc:  # noqa: BLE001 - handed to the request's task, which raises it
        out.put_nowait(exc)


T = TypeVar("T")


class _NoRoom(Exception):
    """The KV has no cell left for a choice's next tokens, and no prefix-cache entry is left
    to evict: the choices that asked end there ("length")."""


async def _with_room(
    cache: PrefixCache, decode: Callable[[], Awaitable[T]], started: Awaitable[T] | None = None
) -> T:
    """`decode()` (or the attempt already `started`), again after each eviction while the KV
    is full: the cache's entries give their cells to live requests (docs/serve.md). A failed
    decode changes nothing (commits and prefills are all or nothing), so it is simply tried
    again. _NoRoom when no entry is left: live requests hold every cell."""
    attempt = started if started is not None else decode()
    while True:
        try:
            return await attempt
        except KvCacheFullError:
            await _evict_one(cache)
        attempt = decode()


async def _evict_one(cache: PrefixCache) -> None:
    """Give a decode that found the KV full the cells of the oldest entry; _NoRoom when
    none is left."""
    if not await cache.evict_oldest():
        raise _NoRoom from None


def _tell(out: Sink, event: Event | None) -> None:
    if event is not None:
        out.put_nowait(event)


def _finish(out: Sink, choice: Choice, reason: str) -> None:
    """End `choice` with `reason`: the rest of its text and its finish."""
    _tell(out, choice.event(finish=reason))


async def _end_thinking(
    ctx: Context, cache: PrefixCache, active: list[tuple[Branch, Choice]], out: Sink
) -> list[tuple[Branch, Choice]]:
    """Force the end of the block of every choice whose budget is spent or whose end was asked:
    the budget message, the end marker and the answer's lead, committed as tokens of its
    branch (one prefill for all) instead of sampled. A choice they would take past its
    limit ends there ("length"); one whose forced text holds a stop string ends ("stop").
    The choices still going."""
    due = [(b, c) for b, c in active if c.thought is not None and c.thought.due()]
    if not due:
        return active
    ended: set[int] = set()
    runs: list[tuple[Branch, Choice, str, list[int]]] = []
    for branch, choice in due:
        assert choice.thought is not None
        text = choice.thought.closing()
        tokens = ctx.tokenize(text, add_special=False, parse_special=True)
        if choice.tokens + len(tokens) > choice.limit:
            _finish(out, choice, "length")
            ended.add(choice.index)
        else:
            runs.append((branch, choice, text, tokens))
    if runs:
        forced = [(b, tokens) for b, _, _, tokens in runs]
        try:
            await _with_room(cache, lambda: BranchStore(ctx).prefill(forced))
        except _NoRoom:
            for _, choice, _, _ in runs:
                _finish(out, choice, "length")
                ended.add(choice.index)
            runs = []
    for _, choice, text, tokens in runs:
        if choice.add_forced(text, len(tokens)):
            _finish(out, choice, "stop")
            ended.add(choice.index)
        else:
            _tell(out, choice.event())
    return [(b, c) for b, c in active if c.index not in ended]


def _within_limit(active: list[tuple[Branch, Choice]], out: Sink) -> list[tuple[Branch, Choice]]:
    """The choices with room for another token; the others end ("length")."""
    still = []
    for branch, choice in active:
        if choice.tokens < choice.limit:
            still.append((branch, choice))
        else:
            _finish(out, choice, "length")
    return still


async def _run_together(
    ctx: Context, cache: PrefixCache, branches: list[Branch], choices: list[Choice], out: Sink
) -> None:
    """Every choice advanced by `BranchStore.step`: one decode per step for all (a forced end
    of thinking in between)."""
    store = BranchStore(ctx)
    active = list(zip(branches, choices))
    while active:
        active = _within_limit(await _end_thinking(ctx, cache, active, out), out)
        if not active:
            break
        stepped = [b for b, _ in active]
        try:
            tokens = await _with_room(cache, functools.partial(store.step, stepped))
        except _NoRoom:
            for _, choice in active:
                _finish(out, choice, "length")
            return
        still = []
        for (branch, choice), tok in zip(active, tokens):
            if tok.is_stop or choice.add(tok.text):
                _finish(out, choice, "stop")
            else:
                _tell(out, choice.event())
                still.append((branch, choice))
        active = still


async def _steered(
    ctx: Context,
    cache: PrefixCache,
    branch: Branch,
    choice: Choice,
    sampling: Sampling,
    out: Sink,
    *,
    until_answer: bool = False,
) -> None:
    """One choice a token at a time (its decodes gather with the other requests'), with its
    logprobs when asked, its thinking looked at between tokens (its end forced when due); with
    `until_answer`, only until its thinking is over (its last token decoded: the branch can be
    forked). Once it answers, with nothing more to look at, the engine's own loop takes over.
    Each token goes out before its own decode: the time to first token is the prefill's
    alone."""
    while await _end_thinking(ctx, cache, [(branch, choice)], out):
        if choice.thought is not None and choice.thought.answering:
            if until_answer:
                return
            if not sampling.logprobs:  # nothing more to look at: the engine's own loop
                await _generate_choice(cache, branch, choice, out)
                return
        if not await _next_token(cache, branch, choice, sampling, out):
            return


async def _next_token(
    cache: PrefixCache, branch: Branch, choice: Choice, sampling: Sampling, out: Sink
) -> bool:
    """Draw `choice`'s next token (with its logprobs when asked), hand it out, decode it;
    False when the choice has ended (a stop token or string, its limit)."""
    if choice.tokens >= choice.limit:
        _finish(out, choice, "length")
        return False
    tok = await branch.produce()
    if tok.is_stop:
        _finish(out, choice, "stop")
        return False
    entry = _logprobs(branch, tok, sampling.top_logprobs) if sampling.logprobs else None
    # Queued before the event goes out: see `_plain`.
    committed = branch.commit(tok)
    if choice.add(tok.text, logprobs=entry):
        _finish(out, choice, "stop")
        committed.close()  # the generation is over, the commit not awaited
        return False
    _tell(out, choice.event())
    try:
        await _with_room(cache, lambda: branch.commit(tok), committed)
    except _NoRoom:
        _finish(out, choice, "length")  # its token went out; the branch ends without it
        return False
    return True


def _logprobs(branch: Branch, tok: Token, top: int) -> dict[str, Any]:
    """A drawn token's logprob and the `top` best alternatives (before sampling). The list
    first: where the device kept fewer candidates, it has the row decoded again, and the
    token's logprob then comes from that same row."""
    best = branch.top_logprobs(top) if top else []
    return logprob_entry(branch.context, tok.token, branch.logprob(tok.token), best)


async def _generate_choice(cache: PrefixCache, branch: Branch, choice: Choice, out: Sink) -> None:
    """One choice on its own branch (the rest of it, up to its limit), in the engine's
    generation loop (its tokens' decodes gather with the other requests')."""
    finish = "length"
    stream = _plain(cache, branch, choice.limit - choice.tokens)
    async with contextlib.aclosing(stream):
        try:
            async for text in stream:
                if choice.add(text):
                    finish = "stop"
                    break
                _tell(out, choice.event())
            else:
                if choice.tokens < choice.limit:
                    finish = "stop"  # a stop token
        except _NoRoom:
            pass  # out of cells: "length"
    _finish(out, choice, finish)


async def _plain(cache: PrefixCache, branch: Branch, limit: int) -> AsyncGenerator[str, None]:
    """The branch's tokens. The first goes out as soon as it is drawn from the prompt's
    logits, before its own decode: the time to first token is the prefill's alone. A decode
    that finds the KV full evicts cache entries and goes on (_NoRoom when none is left)."""
    if limit < 1:
        return
    first = await branch.produce()
    if first.is_stop:
        return
    # Queued before the chunk goes out: streaming it first would delay this commit past the
    # window in which the engine gathers the other choices' first commits into one decode.
    committed = branch.commit(first)
    try:
        yield first.text
    except BaseException:
        committed.close()  # closed early: the generation is over, the commit not awaited
        raise
    await _with_room(cache, lambda: branch.commit(first), committed)
    left = limit - 1
    while left > 0:
        try:
            async for tok in branch.generate(max_tokens=left):
                left -= 1
                yield tok.text
            return
        except KvCacheFullError:  # its step changed nothing: a new stream takes over
            await _evict_one(cache)
