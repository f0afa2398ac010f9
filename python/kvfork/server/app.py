"""The HTTP layer: OpenAI's endpoints (and Anthropic's Messages API) on Starlette, each a thin
adapter over a `Backend`.

Errors come back in OpenAI's shape (`errors.APIError`), or Anthropic's on its Messages
routes (a `Dialect` each); a streamed request that fails after its first chunk ends with an
SSE event holding the error. A client that goes away (the ASGI server's ``http.disconnect``,
awaited, not polled) ends its generation, and every sequence it held comes back at once:
`Generation.close` never suspends, so no cancellation can cut the clean-up short.

Nothing a client sends may stall the others: bodies are read up to a limit (413 past it,
before more is read), large ones are parsed off the event loop, nesting is bounded, and the
prompt (template, tokenizer) is built off the event loop too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._tools import text_before_calls
from .auth import bearer_token, matches
from .backend import Backend, Events, answering_model
from .completions import Several, usage
from .errors import APIError, shutting_down
from .generation import Event, Outcome
from .logprobs import PromptLogprobs
from .messages import Reply, authorized, error_body, error_event, parse_messages
from .metrics import CONTENT_TYPE, Metrics
from .reasoning import Defaults, plan
from .requests import (
    Sampling,
    parse_apply_template,
    parse_chat,
    parse_completion,
    parse_control,
    parse_detokenize,
    parse_embeddings,
    parse_json,
    parse_tokenize,
)
from .responses import (
    DEFAULT_MAX_STORED,
    DEFAULT_STORED_MB,
    ResponseEvents,
    Responses,
    ResponseStore,
    responses_params,
)

log = logging.getLogger("kvfork.server")

Handler = Callable[[Request], Awaitable[Response]]

#: The default largest request body (`kvfork serve --max-body-mb`).
DEFAULT_MAX_BODY_MB = 16
#: Bodies at least this large are parsed off the event loop.
PARSE_IN_THREAD = 1 << 20
#: HTTP's "client closed request" (nginx's code), counted for clients that went away.
CLIENT_GONE = 499


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


@dataclass(frozen=True)
class Dialect:
    """What differs between the API families served here: how an error's body is written
    (in a response, and as the event that ends a failing stream), what ends a stream, and
    which headers carry the API key."""

    error_body: Callable[[APIError], dict[str, Any]]
    error_event: Callable[[APIError], bytes]
    stream_end: bytes
    authorized: Callable[[Mapping[str, str], str], bool]


#: OpenAI's: `{"error": {...}}`, streams ending with `data: [DONE]`, `Authorization: Bearer`.
OPENAI = Dialect(
    error_body=APIError.body,
    error_event=lambda exc: _sse(exc.body()),
    stream_end=b"data: [DONE]\n\n",
    authorized=lambda headers, key: matches(bearer_token(headers), key),
)
#: Anthropic's (`messages`): typed errors, streams ending with `message_stop`, `x-api-key`.
ANTHROPIC = Dialect(error_body, error_event, b"", authorized)


def _error_response(exc: APIError, dialect: Dialect = OPENAI) -> JSONResponse:
    return JSONResponse(dialect.error_body(exc), status_code=exc.status, headers=exc.headers)


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone away (after the body: the server's next message for
    this request is ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`, cancelled if the client goes away first (its sequences come back)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_GONE)
    return task.result()


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit` bytes: from
    its Content-Length before any of it is read, else while it is read."""
    too_large = APIError(
        413,
        f"the request body is larger than this server's {limit >> 20} MiB "
        "(kvfork serve --max-body-mb)",
        param=None,
        code="request_too_large",
        # The rest of the body is not read: the connection cannot carry another request.
        headers={"Connection": "close"},
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


class EventStream(Response):
    """A server-sent event stream over a generation. Its first chunk was produced before the
    headers (so a request that fails at once gets its status); it closes the generation when
    the stream ends, fails, or the client goes away, and counts the request's final status
    (200, an error's, or 499 for a client that went away)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        first: bytes,
        chunks: AsyncIterator[bytes],
        generation: Events,
        dialect: Dialect = OPENAI,
    ) -> None:
        # Not Response.__init__: it would declare an empty body's Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self.first = first
        self.chunks = chunks
        self.generation = generation
        self.dialect = dialect
        #: Told the final status when the stream ends (`Endpoints.guarded` sets it).
        self.count: Callable[[int], None] = lambda status: None
        self.final_status = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait([sending, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.generation.close()  # first: it never suspends, nothing can cut it short
            if not sending.done():
                self.final_status = CLIENT_GONE
            sending.cancel()
            gone.cancel()
            self.count(self.final_status)
            await asyncio.gather(sending, gone, return_exceptions=True)

    async def _send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tail = self.dialect.stream_end
        except APIError as exc:
            tail, self.final_status = self.dialect.error_event(exc), exc.status
        except Exception:
            log.exception("stream failed")
            error = APIError(500, "internal error", type="server_error")
            tail, self.final_status = self.dialect.error_event(error), 500
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class Endpoints:
    """The routes over one backend (a `Service`, or a `ClusterService` of Ray actors)."""

    def __init__(
        self,
        service: Backend,
        api_key: str | None,
        max_body: int,
        stall_seconds: float,
        store: ResponseStore | None = None,
        reasoning: Defaults | None = None,
    ) -> None:
        self.service = service
        #: The server's reasoning settings (`--reasoning-budget` …): chat, Responses, Messages.
        self.reasoning = reasoning or Defaults()
        self.api_key = api_key
        self.max_body = max_body
        self.stall_seconds = stall_seconds
        #: `/v1/responses` and its store of finished responses.
        self.responses_api = Responses(service, ResponseStore() if store is None else store)

    @property
    def metrics(self) -> Metrics:
        return self.service.metrics

    def guarded(self, name: str, handler: Handler, dialect: Dialect = OPENAI) -> Handler:
        """`handler` behind the API key, with every failure in `dialect`'s shape and counted."""

        async def endpoint(request: Request) -> Response:
            try:
                self.authorize(request, dialect)
                response = await handler(request)
            except APIError as exc:
                response = _error_response(exc, dialect)
            except ClientDisconnect:  # gone before its body was read: nobody to answer
                response = Response(status_code=CLIENT_GONE)
            except asyncio.CancelledError:
                # The only cancellation an endpoint's own task gets: uvicorn's, of handlers
                # still running at its shutdown deadline (a body still arriving, an embeddings
                # batch). They answer as a refused request does, not with uvicorn's
                # plain-text 500 and a traceback in the log; the task ends right after.
                response = _error_response(shutting_down(), dialect)
            except Exception:  # nothing a client sends may stop the server
                log.exception("%s failed", name)
                response = _error_response(self.internal_error(), dialect)
            if isinstance(response, EventStream):
                response.count = lambda status: self.answered(name, status)
            else:
                self.answered(name, response.status_code)
            return response

        return endpoint

    def internal_error(self) -> APIError:
        """A failure not the request's: 500, or 503 once the model's context has closed
        under the server (an internal failure; `/health` says "failed": restart it)."""
        if self.service.prompts.ctx.closed:
            message = "the server's model context failed: the server must be restarted"
            return APIError(503, message, type="server_error", code="engine_failed")
        return APIError(500, "internal error", type="server_error")

    def _answer_at_once(self, tokens: list[int], sampling: Sampling) -> list[int]:
        """A constrained reply (`response_format`, a required tool call) whose prompt opens a
        think block gets the block closed in its prompt: the constraint then shapes the answer
        from its first token. (It shaped the thinking instead, and the JSON came out split
        between the reasoning and the content.) The reply does not think."""
        opened = None if sampling.reasoning is None else sampling.reasoning.opened
        if sampling.json_schema is None or opened is None:
            return tokens
        assert sampling.reasoning is not None
        sampling.reasoning = replace(sampling.reasoning, opened=None, budget=None, shared=False)
        ctx = self.service.prompts.ctx
        return tokens + ctx.tokenize(
            opened.end + opened.lead, add_special=False, parse_special=True
        )

    def answered(self, name: str, status: int) -> None:
        self.metrics.answered(name, status)
        if status == CLIENT_GONE:
            self.metrics.disconnected(name)

    def authorize(self, request: Request, dialect: Dialect = OPENAI) -> None:
        if self.api_key is None:
            return
        if not dialect.authorized(request.headers, self.api_key):
            raise APIError(
                401,
                "invalid or missing API key",
                type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object: bounded in size, parsed off the event loop when large."""
        raw = await _body(request, self.max_body)
        if len(raw) >= PARSE_IN_THREAD:
            return await asyncio.to_thread(parse_json, raw)
        return parse_json(raw)

    # ---- endpoints ----

    async def models(self, request: Request) -> Response:
        """The model, and each LoRA adapter as a model of its own (a request naming it as its
        `model` decodes under it, as vLLM serves LoRA modules)."""
        return JSONResponse({"object": "list", "data": self._models()})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: one of `/v1/models`' list, or a 404."""
        wanted = request.path_params["model_id"]
        for model in self._models():
            if model["id"] == wanted:
                return JSONResponse(model)
        raise APIError(404, f"no model {wanted!r} here", param="model", code="model_not_found")

    def _models(self) -> list[dict[str, Any]]:
        s = self.service
        model = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "kvfork"}
        adapters = [
            {**model, "id": a["name"], "parent": s.model_id, "root": a["path"]}
            for a in s.lora_adapters
        ]
        return [model, *adapters]

    async def lora_adapters(self, request: Request) -> Response:
        """llama-server's `GET /lora-adapters`: `[{"id", "name", "path", "scale"}]`."""
        return JSONResponse(self.service.lora_adapters)

    async def health(self, request: Request) -> Response:
        """`{"status": "ok" | "busy" | "degraded" | "failed", "free_sequences", "queue"}`:
        busy when every sequence is taken by requests or some wait; degraded (503) when
        requests wait and none was admitted for `--stall-seconds`; failed (503) when the
        model's context closed under the server (restart it)."""
        state = await self.service.health(self.stall_seconds)
        unwell = state["status"] in ("degraded", "failed")
        return JSONResponse(state, status_code=503 if unwell else 200)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(await self.service.metrics_text(), media_type=CONTENT_TYPE)

    async def embeddings(self, request: Request) -> Response:
        s = self.service
        vocab = s.prompts.embed_ctx.vocab_size if s.prompts.embed_ctx else s.prompts.ctx.vocab_size
        req = parse_embeddings(await self.read_json(request), vocab)

        async def whole() -> Response:
            data, tokens = await s.prompts.embed(req)
            return JSONResponse(
                {
                    "object": "list",
                    "data": data,
                    "model": s.model_id,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        # A batch of many texts takes seconds: one whose client left stops (its decode is
        # aborted) instead of holding the embedding context up for the next request.
        return await _unless_disconnected(request, whole())

    # llama-server's utility endpoints: the model's tokenizer and template, no generation.

    async def tokenize(self, request: Request) -> Response:
        """`{"content", "add_special"?, "parse_special"?, "with_pieces"?}` -> `{"tokens"}`."""
        req = parse_tokenize(await self.read_json(request))
        tokens = await asyncio.to_thread(self.service.prompts.tokenize, req)
        return JSONResponse({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        """`{"tokens"}` -> `{"content"}`."""
        prompts = self.service.prompts
        tokens = parse_detokenize(await self.read_json(request), prompts.ctx.vocab_size)
        return JSONResponse({"content": await asyncio.to_thread(prompts.detokenize, tokens)})

    async def apply_template(self, request: Request) -> Response:
        """`{"messages", "tools"?}` -> `{"prompt"}`: the text a chat request would prefill."""
        req = parse_apply_template(await self.read_json(request))
        text, _ = await asyncio.to_thread(self.service.prompts.chat_text, req)
        return JSONResponse({"prompt": text})

    async def completions(self, request: Request) -> Response:
        """`/v1/completions`: one prompt or several (`completions.py`), each with `n` choices;
        with `echo`, each choice's text and logprobs begin with its prompt's."""
        s = self.service
        req = parse_completion(
            await self.read_json(request), s.prompts.ctx.vocab_size, s.max_choices
        )
        token_lists = await asyncio.to_thread(s.prompts.completion_prompts, req)
        n = req.sampling.n
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": answering_model(s, req.sampling.model),
        }
        echoes = [""] * len(token_lists)
        if req.echo:  # token ids as text: off the loop (millions of ids take a while)
            echoes = await asyncio.to_thread(
                lambda: [
                    p if isinstance(p, str) else s.prompts.ctx.detokenize(p) for p in req.prompts
                ]
            )
        generations: list[Events] = []
        try:
            for tokens in token_lists:
                generations.append(s.generate(tokens, req.sampling, [], "prompt"))
        except APIError as exc:  # a prompt that cannot fit: the others made so far go too
            for made in generations:
                made.close()
            if len(token_lists) > 1:
                exc.message = f"prompt {len(generations)}: {exc.message}"
            raise
        # Scored prompts one at a time (see `completions.py`).
        at_once = 1 if req.sampling.score_prompt else s.max_choices // n
        generation: Events = (
            generations[0] if len(generations) == 1 else Several(generations, n, at_once)
        )

        def choice(
            index: int,
            text: str,
            finish: str | None,
            lps: list[dict[str, Any]],
            at: list[int],
            prompt: PromptLogprobs | None = None,
        ) -> dict[str, Any]:
            at = [len(echoes[index // n]) + o for o in at]
            if prompt is not None:  # the echoed prompt's own, ahead of the choice's
                lps, at = prompt.entries + lps, prompt.offsets + at
            logprobs = _completion_logprobs(lps, at)
            return {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": logprobs if req.sampling.logprobs else None,
            }

        if req.sampling.stream:

            async def chunks() -> AsyncGenerator[bytes, None]:
                started: set[int] = set()
                scored: dict[int, PromptLogprobs] = {}  # by prompt
                outcomes: list[Outcome] = []
                async for item in generation:
                    if isinstance(item, Outcome):
                        outcomes.append(item)
                        continue
                    prompt = item.index // n
                    if item.prompt_logprobs is not None:
                        scored[prompt] = item.prompt_logprobs
                    opening = item.index not in started
                    started.add(item.index)
                    text = echoes[prompt] + item.text if opening else item.text
                    lps = scored.get(prompt) if opening else None
                    yield _sse(
                        {
                            **head,
                            "choices": [
                                choice(
                                    item.index,
                                    text,
                                    item.finish_reason,
                                    item.logprobs,
                                    item.logprob_offsets,
                                    lps,
                                )
                            ],
                        }
                    )
                if req.sampling.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(outcomes)})

            return await _stream(request, chunks(), generation)

        async def whole() -> Response:
            outcomes = await _outcomes(generation, len(generations))
            choices = [c for o in outcomes for c in o.choices]
            scored = {c.index: o.prompt_logprobs for o in outcomes for c in o.choices}
            return JSONResponse(
                {
                    **head,
                    "choices": [
                        choice(
                            c.index,
                            echoes[c.index // n] + c.content,
                            c.finish_reason,
                            c.logprobs,
                            c.logprob_offsets,
                            scored[c.index],
                        )
                        for c in sorted(choices, key=lambda c: c.index)
                    ],
                    "usage": usage(outcomes),
                }
            )

        try:
            return await _unless_disconnected(request, whole())
        finally:
            generation.close()

    async def chat(self, request: Request) -> Response:
        s = self.service
        req = parse_chat(await self.read_json(request), s.prompts.ctx.vocab_size, s.max_choices)
        s.prompts.constrain_tools(req)
        tokens, stop, text = await asyncio.to_thread(s.prompts.rendered_chat, req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": answering_model(s, req.sampling.model),
        }
        req.sampling.reasoning = plan(req.reasoning, self.reasoning, text, request_id)
        tokens = self._answer_at_once(tokens, req.sampling)
        generation = s.generate(tokens, req.sampling, stop, "messages")
        tools = bool(req.tools) and req.tool_choice != "none"

        def finished(text: str, finish: str) -> tuple[dict[str, Any], str]:
            """The message of a finished choice, and its finish reason."""
            calls = s.prompts.tool_calls(req, text) if tools else []
            if calls:
                said = text_before_calls(text) or None
                return {"role": "assistant", "content": said, "tool_calls": calls}, "tool_calls"
            return {"role": "assistant", "content": text}, finish

        if req.sampling.stream:
            # A reply with tools is a call or text, known at its end: no content yet.
            role: dict[str, Any] = (
                {"role": "assistant"}
                if tools
                else {
                    "role": "assistant",
                    "content": "",
                }
            )

            def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any) -> bytes:
                body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                return _sse({**head, "choices": [body]})

            async def chunks() -> AsyncGenerator[bytes, None]:
                texts: dict[int, str] = {}
                held: dict[int, list[dict[str, Any]]] = {}  # a tools reply's, until its end
                async for item in generation:
                    if isinstance(item, Outcome):
                        if req.sampling.include_usage:
                            yield _sse({**head, "choices": [], "usage": item.usage()})
                        continue
                    if item.index not in texts:  # every choice's first delta names the role
                        texts[item.index] = ""
                        yield chunk(item.index, role, None, None)
                    texts[item.index] += item.text
                    lp = {"content": item.logprobs} if req.sampling.logprobs else None
                    if not tools:
                        delta = _reasoning_delta(item)
                        if item.text:
                            delta["content"] = item.text
                        if delta or item.finish_reason or lp:
                            yield chunk(item.index, delta, item.finish_reason, lp)
                        continue
                    held.setdefault(item.index, []).extend(item.logprobs)
                    if item.reasoning:  # the reasoning streams; a call is only known whole
                        yield chunk(item.index, _reasoning_delta(item), None, None)
                    if item.finish_reason is None:
                        continue
                    message, finish = finished(texts[item.index], item.finish_reason)
                    for delta in _message_deltas(message):
                        yield chunk(item.index, delta, None, None)
                    lp = {"content": held.pop(item.index)} if req.sampling.logprobs else None
                    yield chunk(item.index, {}, finish, lp)

            return await _stream(request, chunks(), generation)

        async def whole() -> Response:
            outcome = await _outcome(generation)
            choices = []
            for c in outcome.choices:
                message, finish = finished(c.content, c.finish_reason or "stop")
                if c.reasoning:
                    message["reasoning_content"] = c.reasoning
                lp = {"content": c.logprobs} if req.sampling.logprobs else None
                choices.append(
                    {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}
                )
            return JSONResponse(
                {**head, "object": "chat.completion", "choices": choices, "usage": outcome.usage()}
            )

        try:
            return await _unless_disconnected(request, whole())
        finally:
            generation.close()

    async def chat_control(self, request: Request) -> Response:
        """llama-server's `POST /v1/chat/completions/control`: `{"id", "action":
        "reasoning_end"}` ends the reasoning of a running chat request that was armed with
        `reasoning_control: true` (its next token is the forced end of its block); `{"success":
        false, "message"}` when its reasoning is over already."""
        request_id = parse_control(await self.read_json(request))
        if self.service.end_reasoning(request_id):
            return JSONResponse({"success": True})
        return JSONResponse({"success": False, "message": "its reasoning is over already"})

    # OpenAI's Responses API: the chat machinery, its shapes and store (see `responses`).

    async def responses(self, request: Request) -> Response:
        api = self.responses_api
        req = api.parse(await self.read_json(request))
        tokens, stop, text = await asyncio.to_thread(api.prompt, req)
        req.chat.sampling.reasoning = plan(req.chat.reasoning, self.reasoning, text, None)
        tokens = self._answer_at_once(tokens, req.chat.sampling)
        reply = api.reply(req)
        generation = self.service.generate(tokens, req.chat.sampling, stop, "input")
        if req.stream:
            events = ResponseEvents(reply)
            dialect = replace(OPENAI, error_event=events.error_event, stream_end=b"")
            return await _stream(request, events.chunks(generation), generation, dialect)

        async def whole() -> Response:
            with responses_params():
                return JSONResponse(reply.finish(await _outcome(generation)))

        try:
            return await _unless_disconnected(request, whole())
        finally:
            generation.close()

    async def get_response(self, request: Request) -> Response:
        return JSONResponse(self.responses_api.retrieve(request.path_params["response_id"]))

    async def delete_response(self, request: Request) -> Response:
        return JSONResponse(self.responses_api.delete(request.path_params["response_id"]))

    # Anthropic's Messages API: the chat machinery, Anthropic's shapes (see `messages`).

    async def messages(self, request: Request) -> Response:
        """`/v1/messages`: as `chat` (the same prompt, tools, cache and reasoning: its thinking
        blocks), Anthropic's shapes."""
        s = self.service
        req = parse_messages(await self.read_json(request))
        s.prompts.constrain_tools(req)
        tokens, stop, text = await asyncio.to_thread(s.prompts.rendered_chat, req)
        req.sampling.reasoning = plan(req.reasoning, self.reasoning, text, None)
        tokens = self._answer_at_once(tokens, req.sampling)
        reply = Reply(req, s.prompts, answering_model(s, req.sampling.model), len(tokens))
        generation = s.generate(tokens, req.sampling, stop, "messages")
        if req.sampling.stream:
            return await _stream(request, reply.events(generation), generation, ANTHROPIC)

        async def whole() -> Response:
            return JSONResponse(reply.message(await _outcome(generation)))

        try:
            return await _unless_disconnected(request, whole())
        finally:
            generation.close()

    async def count_tokens(self, request: Request) -> Response:
        """The tokens a `/v1/messages` body would prefill (its tools' prompt included)."""
        req = parse_messages(await self.read_json(request), counting=True)
        tokens, _ = await asyncio.to_thread(self.service.prompts.chat_prompt, req)
        return JSONResponse({"input_tokens": len(tokens)})


#: Characters of a tool call's arguments per streamed fragment.
ARGUMENT_FRAGMENT = 24


def _reasoning_delta(event: Event) -> dict[str, Any]:
    """A streamed delta's reasoning (llama-server's and DeepSeek's `reasoning_content`)."""
    return {"reasoning_content": event.reasoning} if event.reasoning else {}


def _message_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished message as OpenAI streams it: its content, then each tool call's id, type
    and name first and its arguments in fragments."""
    deltas: list[dict[str, Any]] = [{"content": message["content"]}] if message["content"] else []
    calls = message.get("tool_calls") or []
    for i, call in enumerate(calls):
        fn = call["function"]
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        args = fn["arguments"]
        for at in range(0, len(args), ARGUMENT_FRAGMENT):
            piece = args[at : at + ARGUMENT_FRAGMENT]
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    return deltas


async def _outcome(generation: Events) -> Outcome:
    """The end of a generation (the caller closes it)."""
    async for item in generation:
        if isinstance(item, Outcome):
            return item
    raise APIError(500, "the generation ended without a result", type="server_error")


async def _outcomes(generation: Events, count: int) -> list[Outcome]:
    """The `count` Outcomes of a request's generations, one per prompt (the caller closes
    it)."""
    outcomes = [item async for item in generation if isinstance(item, Outcome)]
    if len(outcomes) != count:
        raise APIError(500, "a generation ended without a result", type="server_error")
    return outcomes


async def _stream(
    request: Request,
    chunks: AsyncGenerator[bytes, None],
    generation: Events,
    dialect: Dialect = OPENAI,
) -> Response:
    """An SSE response. The first chunk is produced before the headers go out (a client that
    goes away meanwhile cancels it), so a request that fails at once (a bad schema, a full
    queue) gets its error status; a later failure ends the stream with an error event."""

    async def first() -> Response:
        try:
            head = await chunks.__anext__()
        except StopAsyncIteration:
            head = b""
        return EventStream(head, chunks, generation, dialect)

    try:
        response = await _unless_disconnected(request, first())
    except BaseException:
        generation.close()
        raise
    if not isinstance(response, EventStream):
        generation.close()  # the client went away before the first chunk
    return response


def _completion_logprobs(entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
    """The legacy completions shape of per-token logprobs (`offsets`: where each token's
    text starts in the choice's text)."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None
            if e["top_logprobs"] is None
            else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def create_app(
    service: Backend,
    *,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    stall_seconds: float = 30.0,
    max_stored_responses: int = DEFAULT_MAX_STORED,
    stored_responses_mb: float = DEFAULT_STORED_MB,
    reasoning: Defaults | None = None,
) -> Starlette:
    """The ASGI app serving `service` (a `Service`, or a `ClusterService`). Bodies over
    `max_body_mb` MiB get 413; `/health` reports `degraded` (503) once requests have waited
    `stall_seconds` with none admitted; `/v1/responses` keeps at most `max_stored_responses`
    responses in `stored_responses_mb` MiB; `reasoning` holds the server's reasoning settings
    (`--reasoning-format`, `--reasoning-budget`, `--reasoning-budget-message`)."""
    store = ResponseStore(max_stored_responses, int(stored_responses_mb * (1 << 20)))
    max_body = int(max_body_mb * (1 << 20))
    e = Endpoints(service, api_key, max_body, stall_seconds, store, reasoning)
    response_path = "/v1/responses/{response_id}"
    routes = [
        Route("/v1/chat/completions", e.guarded("chat", e.chat), methods=["POST"]),
        Route(
            "/v1/chat/completions/control",
            e.guarded("chat_control", e.chat_control),
            methods=["POST"],
        ),
        Route("/v1/completions", e.guarded("completions", e.completions), methods=["POST"]),
        Route("/v1/embeddings", e.guarded("embeddings", e.embeddings), methods=["POST"]),
        Route("/v1/responses", e.guarded("responses", e.responses), methods=["POST"]),
        Route(response_path, e.guarded("responses", e.get_response), methods=["GET"]),
        Route(response_path, e.guarded("responses", e.delete_response), methods=["DELETE"]),
        Route("/v1/messages", e.guarded("messages", e.messages, ANTHROPIC), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens",
            e.guarded("count_tokens", e.count_tokens, ANTHROPIC),
            methods=["POST"],
        ),
        Route("/v1/models", e.guarded("models", e.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", e.guarded("models", e.model), methods=["GET"]),
        Route("/tokenize", e.guarded("tokenize", e.tokenize), methods=["POST"]),
        Route("/detokenize", e.guarded("detokenize", e.detokenize), methods=["POST"]),
        Route("/apply-template", e.guarded("apply_template", e.apply_template), methods=["POST"]),
        Route("/lora-adapters", e.guarded("lora_adapters", e.lora_adapters), methods=["GET"]),
        Route("/health", e.health, methods=["GET"]),
        Route("/metrics", e.metrics_endpoint, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (no such route, a method the route does not take), in the
        shape of the API the path belongs to."""
        assert isinstance(exc, HTTPException)
        anthropic = request.url.path.startswith("/v1/messages")
        return _error_response(
            APIError(exc.status_code, str(exc.detail)), ANTHROPIC if anthropic else OPENAI
        )

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
