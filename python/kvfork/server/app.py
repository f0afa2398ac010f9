"""The HTTP layer: OpenAI's endpoints on Starlette, each a thin adapter over `Service`.

Errors always come back in OpenAI's shape (`errors.APIError`); a streamed request that fails
after its first chunk ends with an SSE event holding the error. A client that disconnects
cancels its generation (its leases come back at once)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .backend import Backend
from .errors import APIError
from .metrics import CONTENT_TYPE
from .requests import parse_chat, parse_completion, parse_embeddings, parse_json
from .service import Event, Outcome

log = logging.getLogger("kvfork.server")

Handler = Callable[[Request], Awaitable[Response]]


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _until_disconnected(request: Request) -> None:
    # Starlette tells a handler of a disconnect only when asked (no event to wait on).
    while not await request.is_disconnected():  # noqa: ASYNC110
        await asyncio.sleep(0.1)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`, cancelled if the client goes away first (its leases come back)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    return task.result()


class Endpoints:
    """The routes over one backend (a `Service`, or a `ClusterService` of Ray actors)."""

    def __init__(self, service: Backend, api_key: str | None) -> None:
        self.service = service
        self.api_key = api_key

    def guarded(self, name: str, handler: Handler) -> Handler:
        """`handler` behind the API key, with every failure in OpenAI's shape and counted."""

        async def endpoint(request: Request) -> Response:
            try:
                self.authorize(request)
                response = await handler(request)
            except APIError as exc:
                response = _error_response(exc)
            except Exception:  # nothing a client sends may stop the server
                log.exception("%s failed", name)
                response = _error_response(APIError(500, "internal error", type="server_error"))
            self.service.metrics.answered(name, response.status_code)
            return response

        return endpoint

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise APIError(
                401,
                "invalid or missing API key",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    # ---- endpoints ----

    async def models(self, request: Request) -> Response:
        s = self.service
        model = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "kvfork"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(await self.service.metrics_text(), media_type=CONTENT_TYPE)

    async def embeddings(self, request: Request) -> Response:
        s = self.service
        vocab = s.embed_ctx.vocab_size if s.embed_ctx is not None else s.ctx.vocab_size
        req = parse_embeddings(parse_json(await request.body()), vocab)
        data, tokens = await s.embed(req)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": s.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def completions(self, request: Request) -> Response:
        s = self.service
        req = parse_completion(parse_json(await request.body()), s.ctx.vocab_size, s.max_choices)
        tokens = s.completion_prompt(req)
        prefix = req.prompt if isinstance(req.prompt, str) else s.ctx.detokenize(req.prompt)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": s.model_id,
        }
        events = s.generate(tokens, req.sampling, [], "prompt")
        echo = prefix if req.echo else ""

        def choice(
            index: int, text: str, lps: list[dict[str, Any]], finish: str | None
        ) -> dict[str, Any]:
            return {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": _completion_logprobs(lps) if req.sampling.logprobs else None,
            }

        if req.sampling.stream:

            async def chunks() -> AsyncGenerator[bytes, None]:
                started: set[int] = set()
                async for item in events:
                    if isinstance(item, Event):
                        text = item.text if item.index in started else echo + item.text
                        started.add(item.index)
                        yield _sse(
                            {
                                **head,
                                "choices": [
                                    choice(item.index, text, item.logprobs, item.finish_reason)
                                ],
                            }
                        )
                    elif req.sampling.include_usage:
                        yield _sse({**head, "choices": [], "usage": item.usage()})

            return await _stream(chunks(), events)

        async def whole() -> Response:
            outcome = await _outcome(events)
            return JSONResponse(
                {
                    **head,
                    "choices": [
                        choice(c.index, echo + c.text.content, c.logprobs, c.finish_reason)
                        for c in outcome.choices
                    ],
                    "usage": outcome.usage(),
                }
            )

        return await _unless_disconnected(request, whole())

    async def chat(self, request: Request) -> Response:
        s = self.service
        req = parse_chat(parse_json(await request.body()), s.ctx.vocab_size, s.max_choices)
        s.constrain_tools(req)
        tokens, stop = s.chat_prompt(req)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": s.model_id,
        }
        events = s.generate(tokens, req.sampling, stop, "messages")
        tools = bool(req.tools) and req.tool_choice != "none"

        def finished(text: str, finish: str) -> tuple[dict[str, Any], str]:
            """The message of a finished choice, and its finish reason."""
            calls = s.tool_calls(req, text) if tools else []
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            return {"role": "assistant", "content": text}, finish

        if req.sampling.stream:

            async def chunks() -> AsyncGenerator[bytes, None]:
                texts: dict[int, str] = {}
                async for item in events:
                    if isinstance(item, Outcome):
                        if req.sampling.include_usage:
                            yield _sse({**head, "choices": [], "usage": item.usage()})
                        continue
                    delta: dict[str, Any] = {}
                    if item.index not in texts:
                        delta["role"] = "assistant"
                    texts[item.index] = texts.get(item.index, "") + item.text
                    finish = item.finish_reason
                    if tools:  # a call is only known whole: the text comes at the end
                        if finish is None:
                            continue
                        message, finish = finished(texts[item.index], finish)
                        delta.update({k: v for k, v in message.items() if k != "role"})
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [
                                {"index": i, **c} for i, c in enumerate(delta["tool_calls"])
                            ]
                    elif item.text:
                        delta["content"] = item.text
                    lp = {"content": item.logprobs} if req.sampling.logprobs else None
                    yield _sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": item.index,
                                    "delta": delta,
                                    "logprobs": lp,
                                    "finish_reason": finish,
                                }
                            ],
                        }
                    )

            return await _stream(chunks(), events)

        async def whole() -> Response:
            outcome = await _outcome(events)
            choices = []
            for c in outcome.choices:
                message, finish = finished(c.text.content, c.finish_reason or "stop")
                lp = {"content": c.logprobs} if req.sampling.logprobs else None
                choices.append(
                    {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}
                )
            return JSONResponse(
                {**head, "object": "chat.completion", "choices": choices, "usage": outcome.usage()}
            )

        return await _unless_disconnected(request, whole())


async def _outcome(events: AsyncGenerator[Event | Outcome, None]) -> Outcome:
    """The end of a generation (closed early when the waiting task is cancelled, so its
    leases come back at once)."""
    try:
        async for item in events:
            if isinstance(item, Outcome):
                return item
    finally:
        await events.aclose()
    raise APIError(500, "the generation ended without a result", type="server_error")


async def _stream(
    chunks: AsyncGenerator[bytes, None], events: AsyncGenerator[Any, None]
) -> Response:
    """An SSE response. The first chunk is produced before the headers go out, so a request
    that fails at once (a bad schema, a full queue) gets its error status; a later failure
    ends the stream with an error event."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
            yield b"data: [DONE]\n\n"
        except APIError as exc:
            yield _sse(exc.body())
        except Exception:
            log.exception("stream failed")
            yield _sse(APIError(500, "internal error", type="server_error").body())
        finally:  # also when the client went away: the generation ends, its leases return
            await chunks.aclose()
            await events.aclose()

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The legacy completions shape of per-token logprobs."""
    offset, offsets = 0, []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def create_app(service: Backend, *, api_key: str | None = None) -> Starlette:
    """The ASGI app serving `service` (a `Service`, or a `ClusterService`)."""
    e = Endpoints(service, api_key)
    routes = [
        Route("/v1/chat/completions", e.guarded("chat", e.chat), methods=["POST"]),
        Route("/v1/completions", e.guarded("completions", e.completions), methods=["POST"]),
        Route("/v1/embeddings", e.guarded("embeddings", e.embeddings), methods=["POST"]),
        Route("/v1/models", e.guarded("models", e.models), methods=["GET"]),
        Route("/health", e.health, methods=["GET"]),
        Route("/metrics", e.metrics, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
