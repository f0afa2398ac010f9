"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
chat machinery.

A request becomes the `ChatRequest` that `/v1/chat/completions` would build — the system
prompt a system message, `tool_use` blocks the assistant's `tool_calls`, `tool_result`
blocks `tool` messages, tools function tools — so the model's template, the built-in tool
prompt, constrained calls and the prefix cache all serve both APIs alike. Only the shapes
differ: the reply is a Message, or its stream of named server-sent events; an error is
`{"type": "error", "error": {"type", "message"}}`. The HTTP side (reading the body, the
stream's life, disconnects) stays in `app`, which registers the routes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from .._tools import text_before_calls
from .adapters import parse_lora
from .auth import bearer_token, matches
from .backend import Events
from .errors import APIError, bad_request
from .generation import Choice, Event, Outcome
from .prompts import Prompts
from .reasoning import Asked
from .requests import (
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    Sampling,
    bool_field,
    int_field,
    model_field,
    number_field,
    parse_template_kwargs,
)

#: The most stop sequences a request may give (each is searched for after every token).
MAX_STOP_SEQUENCES = 64
#: Characters of a tool call's input JSON per streamed `input_json_delta`.
INPUT_FRAGMENT = 24
#: What a failed tool's result is prefixed with: the chat template has no `is_error`, and the
#: model must not read an error message as the tool's answer.
TOOL_ERROR_PREFIX = "Error: "

# ---- the request ----


def parse_messages(body: dict[str, Any], *, counting: bool = False) -> ChatRequest:
    """A `/v1/messages` body as the chat request it amounts to; `counting` (for
    `/v1/messages/count_tokens`) does not require `max_tokens`. Every bad field is a 400 that
    names it."""
    tools, choice = _tools(body)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata must be an object", "metadata")
    thinking = _thinking(body)
    turns = _turns(body)
    prefill = _prefill(turns, len(body["messages"]) - 1)
    return ChatRequest(
        messages=[*_system(body), *turns],
        sampling=_sampling(body, counting),
        tools=tools,
        tool_choice=choice,
        reasoning=thinking,
        template_kwargs=parse_template_kwargs({}, thinking.effort),
        prefill=prefill,
    )


def _prefill(turns: list[dict[str, Any]], last: int) -> str:
    """A final assistant turn of text is the reply's start, which the reply continues (taken
    out of `turns`); as Anthropic's API, it may not end with whitespace (a 400)."""
    final = turns[-1]
    if final["role"] != "assistant" or final.get("tool_calls"):
        return ""
    turns.pop()
    text: str = final["content"]
    if text != text.rstrip():
        where = f"messages[{last}].content"
        raise bad_request("the final assistant content cannot end with whitespace", where)
    return text


def _thinking(body: dict[str, Any]) -> Asked:
    """Anthropic's extended thinking: `{"type": "enabled", "budget_tokens": N}` is a reasoning
    budget of N tokens, `{"type": "disabled"}` thinking turned off (the template's
    `enable_thinking`, and a budget of 0); without it, the server's settings."""
    value = body.get("thinking")
    if value is None:
        return Asked()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return Asked(effort="none")
    if kind != "enabled":
        raise bad_request(
            "thinking must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}",
            "thinking",
        )
    budget = value.get("budget_tokens")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 0
    ):
        raise bad_request(
            "thinking.budget_tokens must be an integer at least 0", "thinking.budget_tokens"
        )
    return Asked(budget=budget)


def _sampling(body: dict[str, Any], counting: bool) -> Sampling:
    """Anthropic's sampling fields (temperature in [0, 1], as its API bounds it)."""
    if body.get("max_tokens") is None and not counting:
        raise bad_request("max_tokens is required", "max_tokens")
    max_tokens = int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 20)
    assert max_tokens is not None
    return Sampling(
        max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 1.0, 0.0, 1.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int_field(body, "top_k", 0, 0, 1 << 20) or 0,
        stop=_stop_sequences(body),
        stream=bool_field(body, "stream"),
        lora=parse_lora(body),
        # As for chat: a LoRA adapter's name as the model selects it, any other the base.
        model=model_field(body),
    )


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    value = body.get("stop_sequences")
    if value is None:
        return []
    if (
        not isinstance(value, list)
        or not all(isinstance(s, str) for s in value)
        or len(value) > MAX_STOP_SEQUENCES
    ):
        raise bad_request(
            f"stop_sequences must be a list of at most {MAX_STOP_SEQUENCES} strings",
            "stop_sequences",
        )
    return [s for s in value if s]


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (paragraphs apart)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    return "\n\n".join(_text_block(block, f"{where}[{i}]") for i, block in enumerate(blocks))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise bad_request(f"{where} must be a text block {{'type': 'text', 'text': ...}}", where)
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return text


def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The system prompt (a string or text blocks) as the chat's system message."""
    value = body.get("system")
    if value is None:
        return []
    text = _text_of(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as chat messages: a user turn can become several (its tool results,
    then its text), an assistant turn is one (its text and its calls)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for its result
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with a role and content", where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise bad_request(
                f"{where}.content must be a string or a non-empty list of blocks",
                f"{where}.content",
            )
        if role == "user":
            out.extend(_user_turn(content, f"{where}.content", names))
        else:
            out.append(_assistant_turn(content, f"{where}.content", names))
    return out


def _block_kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where} must be a content block with a type", where)
    kind: str = block["type"]
    return kind


def _unsupported(kind: str, role: str, where: str) -> APIError:
    return bad_request(f"{where}: {kind!r} blocks are not supported in {role} messages", where)


def _user_turn(blocks: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn's tool results as `tool` messages, then its text as a user message."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at, names))
        else:
            raise _unsupported(kind, "user", at)
    if texts:
        results.append({"role": "user", "content": "\n\n".join(texts)})
    return results


def _tool_result(block: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    text = _text_of(content, f"{where}.content")
    if bool_field(block, "is_error"):
        text = TOOL_ERROR_PREFIX + text
    message = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in names:  # some templates show the function a result comes from
        message["name"] = names[call_id]
    return message


def _assistant_turn(blocks: list[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    """An assistant turn: its text blocks as content, its tool_use blocks as `tool_calls`
    (arguments as an object, as Hugging Face templates expect them); its thinking left out."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at, names))
        elif kind not in ("thinking", "redacted_thinking"):
            # A reply's thinking, passed back as Anthropic's clients do (a tool loop with
            # thinking must): accepted and not prompted again, as /v1/responses' reasoning
            # items and as chat templates drop an earlier turn's think block.
            raise _unsupported(kind, "assistant", at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    """A tool_use block as a chat tool call (its name noted for the result that answers it)."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and isinstance(name, str) and name):
        raise bad_request(f"{where} must have a string id and name", where)
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input must be an object", f"{where}.input")
    names[call_id] = name
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """Custom tools as chat's function tools, and the tool choice as chat names it."""
    tools = body.get("tools")
    if tools is None or tools == []:
        choice = body.get("tool_choice")
        if choice is not None and _choice_kind(choice) not in ("auto", "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, "none"
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    functions = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct names", "tools")
    return functions, _tool_choice(body.get("tool_choice"), names)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", where)
    if tool.get("type", "custom") not in ("custom", None):
        raise bad_request(
            f"{where}: {tool['type']!r} tools are not supported (only custom tools)", where
        )
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.input_schema must be a JSON schema", f"{where}.input_schema")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{where}.description must be a string", f"{where}.description")
        function["description"] = description
    return {"type": "function", "function": function}


def _choice_kind(choice: Any) -> str:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice"
        )
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise bad_request(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            "tool_choice.disable_parallel_tool_use",
        )
    kind: str = choice["type"]
    return kind


def _tool_choice(choice: Any, names: list[str]) -> str:
    """Chat's tool choice: "auto", "required" (Anthropic's any), "none", or a tool's name."""
    if choice is None:
        return "auto"
    kind = _choice_kind(choice)
    if kind != "tool":
        return {"any": "required"}.get(kind, kind)
    name = choice.get("name")
    if name not in names:
        raise bad_request(
            f"tool_choice.name must name one of the tools ({', '.join(names)})", "tool_choice.name"
        )
    assert isinstance(name, str)
    return name


# ---- the reply ----


class Reply:
    """One request's answer in Anthropic's shapes: the whole Message, or its stream. A reply
    with tools is a call or text, known only at its end (as for chat): it is streamed then."""

    def __init__(self, req: ChatRequest, prompts: Prompts, model: str, prompt_tokens: int) -> None:
        self.req = req
        self.prompts = prompts
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.tools = bool(req.tools) and req.tool_choice != "none"
        self._block: str | None = None  # the type of the block being streamed
        self._blocks = 0  # blocks started

    def message(self, outcome: Outcome) -> dict[str, Any]:
        """The finished Message: its thinking block (when it reasoned), then its text or
        calls (no empty text block after thinking: Anthropic refuses one sent back)."""
        choice = outcome.choices[0]
        content, reason, sequence = self._ending(choice)
        return self._head(_thinking_block(choice) + content, reason, sequence, _usage(outcome))

    async def events(self, generation: Events) -> AsyncGenerator[bytes, None]:
        """The Message's stream: `message_start` once the generation has begun (so a request
        refused at once gets its status), thinking and text deltas as they come (no text with
        tools), each in its block, the blocks' ends and `message_delta` with the stop reason
        at the Outcome."""
        started = False
        async for item in generation:
            if not started:
                started = True
                yield self._start(item.cached_tokens if isinstance(item, Event) else None)
            if isinstance(item, Event):
                for chunk in self._deltas(item):
                    yield chunk
                continue
            for chunk in self._end(item):
                yield chunk

    def _deltas(self, event: Event) -> list[bytes]:
        """An event's reasoning as a thinking block's delta, its text as a text block's."""
        chunks = []
        if event.reasoning:
            chunks += self._switch("thinking")
            delta = {"type": "thinking_delta", "thinking": event.reasoning}
            chunks.append(
                _event("content_block_delta", {"index": self._blocks - 1, "delta": delta})
            )
        if event.text and not self.tools:
            chunks += self._switch("text")
            delta = {"type": "text_delta", "text": event.text}
            chunks.append(
                _event("content_block_delta", {"index": self._blocks - 1, "delta": delta})
            )
        return chunks

    def _switch(self, kind: str) -> list[bytes]:
        """Unless a `kind` block is being streamed: the one that is stops, and one starts."""
        if self._block == kind:
            return []
        chunks = self._stop_block()
        block = {"type": "text", "text": ""}
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        chunks.append(
            _event("content_block_start", {"index": self._blocks, "content_block": block})
        )
        self._block, self._blocks = kind, self._blocks + 1
        return chunks

    def _stop_block(self) -> list[bytes]:
        """The end of the block being streamed, if one is."""
        if self._block is None:
            return []
        self._block = None
        return [_event("content_block_stop", {"index": self._blocks - 1})]

    def _head(
        self, content: list[Any], reason: str | None, sequence: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def _start(self, cached: int | None) -> bytes:
        """`message_start`, after the prompt's prefill: its usage splits the prompt into input
        and cache reads as the end's does; the blocks start with their first delta."""
        cached = cached or 0
        usage = {
            "input_tokens": self.prompt_tokens - cached,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        return _event("message_start", {"message": self._head([], None, None, usage)})

    def _end(self, outcome: Outcome) -> list[bytes]:
        """The last blocks (a reply with tools: its calls or text, whole), the stop reason."""
        content, reason, sequence = self._ending(outcome.choices[0])
        if self.tools:
            chunks = self._stop_block()
            first = self._blocks
            chunks += [c for i, b in enumerate(content) for c in _block_events(first + i, b)]
        elif self._blocks and self._block != "text":
            chunks = self._stop_block()  # all thinking: no empty text block after it
        else:
            chunks = self._switch("text") + self._stop_block()  # a text block, even empty
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        chunks.append(_event("message_delta", {"delta": delta, "usage": _usage(outcome)}))
        chunks.append(_event("message_stop", {}))
        return chunks

    def _ending(self, choice: Choice) -> tuple[list[dict[str, Any]], str, str | None]:
        """A finished choice's content blocks, stop reason and the stop sequence it met."""
        text = choice.content
        calls = self.prompts.tool_calls(self.req, text) if self.tools else []
        if calls:
            said = text_before_calls(text)
            text_block = [{"type": "text", "text": said}] if said else []
            return [*text_block, *(_tool_use(call) for call in calls)], "tool_use", None
        sequence = matched_stop_sequence(choice, self.req.sampling.stop)
        if sequence is not None:
            reason = "stop_sequence"
        elif choice.finish_reason == "length":
            # Cut by the context before max_tokens: Anthropic has a reason of its own.
            full = choice.tokens < self.req.sampling.max_tokens
            reason = "model_context_window_exceeded" if full else "max_tokens"
        else:
            reason = "end_turn"
        if not text and choice.reasoning:
            return [], reason, sequence  # all thinking: no empty text block after it
        return [{"type": "text", "text": text}], reason, sequence


def matched_stop_sequence(choice: Choice, sequences: list[str]) -> str | None:
    """Which of the request's stop sequences ended `choice`, if one did. The generation
    stops at the first stop string, and `StopStrings` keeps the text past the content it cut:
    that tail begins with the stop string met (a template's own stop, such as an end-of-turn
    marker, is no stop sequence: the turn simply ended)."""
    stops = choice.text
    if choice.finish_reason != "stop" or not stops.stopped:
        return None
    tail = stops.text[len(stops.content) :]
    return next((s for s in sequences if tail.startswith(s)), None)


def _usage(outcome: Outcome) -> dict[str, Any]:
    """Anthropic's usage: its input_tokens leave out the tokens read from the cache (the
    prompt is the sum of the input and cache fields)."""
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": outcome.cached_tokens,
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed chat tool call as a `tool_use` block."""
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": fn["name"],
        "input": json.loads(fn["arguments"]),
    }


def _thinking_block(choice: Choice) -> list[dict[str, Any]]:
    """A reply's reasoning as Anthropic's thinking block (unsigned: there is nothing to
    verify), or none."""
    if not choice.reasoning:
        return []
    return [{"type": "thinking", "thinking": choice.reasoning, "signature": ""}]


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """A finished block as Anthropic streams one: its start (empty), its content as deltas
    (a call's input JSON in fragments), its stop."""
    if block["type"] == "tool_use":
        opened = {**block, "input": {}}
        raw = json.dumps(block["input"], ensure_ascii=False)
        deltas = [
            {"type": "input_json_delta", "partial_json": raw[at : at + INPUT_FRAGMENT]}
            for at in range(0, len(raw), INPUT_FRAGMENT)
        ]
    else:
        opened = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": block["text"]}] if block["text"] else []
    return [
        _event("content_block_start", {"index": index, "content_block": opened}),
        *(_event("content_block_delta", {"index": index, "delta": d}) for d in deltas),
        _event("content_block_stop", {"index": index}),
    ]


def _event(name: str, data: dict[str, Any]) -> bytes:
    """A named server-sent event; its data repeats the name as `type`, as Anthropic's do."""
    body = json.dumps({"type": name, **data}, ensure_ascii=False)
    return f"event: {name}\ndata: {body}\n\n".encode()


# ---- errors and keys ----

#: Anthropic's error type for each status (others: by class, 4xx or 5xx).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(exc: APIError) -> dict[str, Any]:
    """Anthropic's error body. It has no `param`: the message names the field at fault."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_event(exc: APIError) -> bytes:
    """The `error` event that ends a stream failing after its start."""
    return _event("error", {"error": error_body(exc)["error"]})


def authorized(headers: Mapping[str, str], key: str) -> bool:
    """Anthropic's clients send the key as `x-api-key` (older) or as a bearer token."""
    return matches(headers.get("x-api-key"), key) or matches(bearer_token(headers), key)
