"""What the endpoints run: every request is an asyncio task on one context, its branch made by
the `PrefixCache` (concurrent requests share their common prefix and their decodes), `n`
choices forked from one prefill. Leases are admitted through a bounded queue."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._native import (
    Branch,
    BranchStore,
    Context,
    KvforkError,
    LeaseExhaustedError,
    PrefixCache,
)
from .._stops import StopStrings
from .._tools import call_schema, parse_tool_calls, template_renders_tools, with_tool_prompt
from .errors import APIError, bad_request
from .metrics import Metrics
from .requests import ChatRequest, CompletionRequest, EmbeddingRequest, Sampling

#: The longest a prefilled request waits for the prefills of requests that arrived with it.
PREFILL_BURST_WAIT = 2.0


class Admission:
    """Leases for live requests: a request needs `n` (one per choice); past the free ones it
    waits in a queue of at most `max_queue` requests, beyond which it is refused (503)."""

    def __init__(self, leases: int, max_queue: int) -> None:
        self.free = leases
        self.max_queue = max_queue
        self.waiting = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def leases(self, n: int) -> AsyncIterator[None]:
        async with self._changed:
            if self.free < n:
                if self.waiting >= self.max_queue:
                    raise APIError(
                        503,
                        "the server is busy: every sequence is in use and the queue is full",
                        type="server_error",
                        code="queue_full",
                        headers={"Retry-After": "1"},
                    )
                self.waiting += 1
                try:
                    await self._changed.wait_for(lambda: self.free >= n)
                finally:
                    self.waiting -= 1
            self.free -= n
        try:
            yield
        finally:
            async with self._changed:
                self.free += n
                self._changed.notify_all()


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


class Service:
    """The model behind the endpoints."""

    def __init__(
        self,
        ctx: Context,
        *,
        model_id: str,
        max_queue: int,
        chat_template: str | None = None,
        embed_ctx: Context | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.ctx = ctx
        self.model_id = model_id
        self.chat_template = chat_template
        self.embed_ctx = embed_ctx
        # Leases: one per live choice; the cache keeps what is left as entries and evicts them
        # when a live request needs the lease.
        self.cache = PrefixCache(ctx)
        self.admission = Admission(ctx.n_seq_max, max_queue)
        self.metrics = metrics or Metrics()
        self.metrics.watch(self)
        self.created = int(time.time())
        self.prefilling = 0  # requests between admission and a prefilled branch
        self.prefills_done = asyncio.Event()

    @property
    def max_choices(self) -> int:
        """The largest `n` a request may ask for: one lease per choice."""
        return self.ctx.n_seq_max

    async def metrics_text(self) -> bytes:
        """The Prometheus text of `GET /metrics`."""
        return self.metrics.text()

    # ---- prompts ----

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], list[str]]:
        """The prompt tokens of a chat request and the template's stop strings."""
        messages, tools = req.messages, req.tools if req.tool_choice != "none" else None
        kwargs: dict[str, Any] = {}
        if self.chat_template is not None:
            kwargs["template"] = self.chat_template
        try:
            if tools and not template_renders_tools(self.ctx, messages, **kwargs):
                messages, tools = with_tool_prompt(messages, tools), None
            chat = self.ctx.format_chat(messages, tools=tools, **kwargs)
        except KvforkError as exc:
            raise bad_request(str(exc), "messages", "chat_template") from None
        tokens = self.ctx.tokenize(chat.prompt, add_special=True, parse_special=True)
        return tokens, list(chat.stop)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            return list(req.prompt)
        return self.ctx.tokenize(req.prompt, add_special=True, parse_special=False)

    def check_room(self, tokens: list[int], param: str) -> None:
        """A 400 naming `param` (the request's prompt field) when the prompt cannot fit."""
        if len(tokens) >= self.ctx.n_ctx:
            raise bad_request(
                f"the prompt has {len(tokens)} tokens; this server's context holds "
                f"{self.ctx.n_ctx} (start it with a larger --n-ctx)",
                param,
                "context_length_exceeded",
            )

    # ---- generation ----

    async def _choices(self, tokens: list[int], sampling: Sampling) -> tuple[list[Branch], int]:
        """One branch per choice: the first from the prefix cache, the others forked from it
        (one prefill for all)."""
        try:
            first = await self.cache.branch(tokens, sampling.params(0))
        except LeaseExhaustedError:
            raise APIError(
                503, "no free sequence", type="server_error", headers={"Retry-After": "1"}
            ) from None
        except ValueError as exc:
            raise bad_request(str(exc), "prompt", "context_length_exceeded") from None  # raced
        cached = self.cache.shared_tokens(first) or 0
        branches = [first]
        try:
            if sampling.logit_bias:
                first.set_logit_bias(sampling.logit_bias)
            if sampling.json_schema is not None:
                try:
                    first.set_json_schema(sampling.json_schema)
                except KvforkError as exc:
                    raise bad_request(
                        f"the JSON schema is not usable: {exc}", "response_format"
                    ) from None
            for i in range(1, sampling.n):
                seed = sampling.params(i).get("seed", int.from_bytes(np.random.bytes(4), "little"))
                branches.append(await first.fork(seed=seed))
        except BaseException:
            await self._finish(branches)
            raise
        return branches, cached

    async def _finish(self, branches: list[Branch]) -> None:
        """Forks pruned; the first branch handed back to the cache as an entry."""
        for b in reversed(branches[1:]):
            await b.prune()
        if branches:
            try:
                self.cache.release(branches[0])
            except ValueError:
                await branches[0].prune_subtree()

    @staticmethod
    async def _reporting(work: Awaitable[None], out: asyncio.Queue[Event | BaseException]) -> None:
        """Run `work`; the error that ends it goes on `out` for the request's task to raise."""
        try:
            await work
        except Exception as exc:  # noqa: BLE001 - handed to the request's task, which raises it
            await out.put(exc)

    async def _run_together(
        self,
        branches: list[Branch],
        choices: list[Choice],
        sampling: Sampling,
        out: asyncio.Queue[Event | BaseException],
    ) -> None:
        """Every choice advanced by `BranchStore.step`: one decode per step for all."""
        store = BranchStore(self.ctx)
        limit = min(sampling.max_tokens, self.ctx.n_ctx - branches[0].position)
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
                        await out.put(Event(choice.index, piece, []))
                if finish is None:
                    still.append((branch, choice))
                else:
                    choice.finish_reason = finish
                    await out.put(Event(choice.index, choice.text.take(final=True), [], finish))
            active = still
        for _, choice in active:
            choice.finish_reason = "length"
            await out.put(Event(choice.index, choice.text.take(final=True), [], "length"))

    async def _generate_choice(
        self,
        branch: Branch,
        choice: Choice,
        sampling: Sampling,
        out: asyncio.Queue[Event | BaseException],
    ) -> None:
        room = self.ctx.n_ctx - branch.position
        limit = min(sampling.max_tokens, room)
        stream: AsyncIterator[tuple[str, dict[str, Any] | None]] = (
            _with_logprobs(branch, limit, sampling.top_logprobs)
            if sampling.logprobs
            else _plain(branch, limit)
        )
        finish = "length"
        async for text, lp in stream:
            choice.tokens += 1
            stopped = choice.text.add(text)
            if lp is not None:
                choice.logprobs.append(lp)
            piece = choice.text.take()
            if piece or lp is not None:
                await out.put(Event(choice.index, piece, [lp] if lp else []))
            if stopped:
                finish = "stop"
                break
        else:
            if choice.tokens < limit:
                finish = "stop"  # a stop token
        rest = choice.text.take(final=True)
        choice.finish_reason = finish
        await out.put(Event(choice.index, rest, [], finish))

    async def generate(
        self, tokens: list[int], sampling: Sampling, stop: list[str], prompt_param: str
    ) -> AsyncGenerator[Event | Outcome, None]:
        """Events of every choice as they come, then the Outcome. Cancelling the consumer
        cancels the generation; the leases come back either way. `prompt_param` names the
        request's prompt field in errors."""
        self.check_room(tokens, prompt_param)
        async with self.admission.leases(sampling.n):
            self.prefilling += 1
            try:
                branches, cached = await self._choices(tokens, sampling)
            finally:
                self.prefilling -= 1
                if self.prefilling == 0:
                    self.prefills_done.set()
            # Requests that arrived together prefill together: a prefill decode packs up to
            # n_batch tokens of all of them, where a generation step between them would be a
            # decode of its own. Generation starts once the burst's prefills are done.
            if self.prefilling:
                self.prefills_done.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.prefills_done.wait(), PREFILL_BURST_WAIT)
            choices = [
                Choice(i, StopStrings([*stop, *sampling.stop])) for i in range(len(branches))
            ]
            out: asyncio.Queue[Event | BaseException] = asyncio.Queue()
            if len(branches) > 1 and not sampling.logprobs:
                # n choices of one request: one decode per step for all of them.
                together = self._run_together(branches, choices, sampling, out)
                tasks = [asyncio.create_task(self._reporting(together, out))]
            else:
                tasks = [
                    asyncio.create_task(
                        self._reporting(self._generate_choice(b, c, sampling, out), out)
                    )
                    for b, c in zip(branches, choices)
                ]
            try:
                done = 0
                while done < len(choices):
                    event = await out.get()
                    if isinstance(event, BaseException):
                        raise event
                    done += event.finish_reason is not None
                    yield event
                outcome = Outcome(choices, len(tokens), cached)
                self.metrics.finished(outcome)
                yield outcome
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._finish(branches)

    # ---- embeddings ----

    async def embed(self, req: EmbeddingRequest) -> tuple[list[Any], int]:
        """(data items, prompt tokens) of an embeddings request."""
        if self.embed_ctx is None:
            raise APIError(
                404,
                "this server has no embedding model: start it with --embeddings",
                param="input",
                code="embeddings_disabled",
            )
        ctx = self.embed_ctx
        token_lists = [
            item if isinstance(item, list) else ctx.tokenize(item, add_special=True)
            for item in req.inputs
        ]
        if any(len(t) > ctx.n_batch for t in token_lists):
            raise bad_request(f"an input is longer than {ctx.n_batch} tokens", "input")
        rows = await ctx.embed_batch(token_lists)
        data = []
        for i, row in enumerate(rows):
            vector = np.asarray(row, dtype=np.float32)
            value: Any = (
                base64.b64encode(vector.tobytes()).decode()
                if req.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        return data, sum(len(t) for t in token_lists)

    def tool_calls(self, req: ChatRequest, text: str) -> list[dict[str, Any]]:
        if not req.tools or req.tool_choice == "none":
            return []
        return parse_tool_calls(text, req.tools)

    def constrain_tools(self, req: ChatRequest) -> None:
        """A required or named tool call: the output is that call's JSON."""
        if req.tools and req.tool_choice not in ("none", "auto"):
            name = None if req.tool_choice == "required" else req.tool_choice
            req.sampling.json_schema = call_schema(req.tools, name)


async def _plain(branch: Branch, limit: int) -> AsyncIterator[tuple[str, None]]:
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
    yield first.text, None
    await committed
    if limit > 1:
        async for tok in branch.generate(max_tokens=limit - 1):
            yield tok.text, None


async def _with_logprobs(
    branch: Branch, limit: int, top: int
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
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
        yield tok.text, entry
        await committed
