"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on the
chat machinery: a request's `instructions` and `input` items become a `ChatRequest`'s messages,
so its prompt is the model's chat template with tools and constraints exactly as
`/v1/chat/completions` builds it, and a finished generation becomes a Response object, or the
stream of events that builds one.

`previous_response_id` continues a stored response: its conversation (every message it
prompted bar its instructions, then its output as assistant messages) comes first, then the new
input. No KV is kept here: the prefix cache already holds the previous turn's prompt and output
as an entry, and the new prompt, rendered from the same messages, starts with the same tokens,
so only the new input is prefilled. A conversation whose entry was evicted is prefilled whole.
The `ResponseStore` keeps finished responses, bounded in count and bytes, least recently used
going first.

The HTTP side (bodies, streams, disconnects) is `app.Endpoints`'; this module has none of it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._tools import text_before_calls
from .adapters import parse_lora
from .backend import Backend, answering_model
from .errors import APIError, bad_request
from .generation import Choice, Event, Outcome
from .reasoning import EFFORTS, Asked
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

#: `kvfork serve --max-stored-responses` and `--stored-responses-mb` defaults.
DEFAULT_MAX_STORED = 1000
DEFAULT_STORED_MB = 64

#: Fields the request may carry that change nothing here (hints for OpenAI's own service:
#: caching keys, tiers, extra output to include).
IGNORED = frozenset(
    {
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "truncation",
        "include",
        "stream_options",
        "top_logprobs",  # logprobs come only with an `include` entry, which is ignored
    }
)
#: Fields read here (`lora` is kvfork's, as in chat); any other is refused (OpenAI's own
#: "unknown parameter" 400).
KNOWN = frozenset(
    {
        "model",
        "instructions",
        "input",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "parallel_tool_calls",
        "background",
        "lora",
        "reasoning",
    }
)
_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
#: Characters of a function call's arguments per streamed delta.
ARGUMENT_FRAGMENT = 24
#: Chat's names for fields the errors of the shared layers name, and the Responses API's.
_PARAMS = {"response_format": "text.format", "messages": "input", "prompt": "input"}


@dataclass(frozen=True)
class Stored:
    """A finished response as `GET` returns it, and the conversation a later request that
    names it as `previous_response_id` continues (its instructions left out, as OpenAI does).
    `size`: what it is counted for against the store's bytes (its JSON's characters)."""

    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    conversation_size: int
    size: int


class ResponseStore:
    """Stored responses by id, at most `max_count` of them and `max_bytes` together; past
    either bound the least recently used (stored or continued) go first. A response larger
    than `max_bytes` alone is not kept. The conversations of a chain share their messages,
    so the count of bytes is an upper bound of what they hold."""

    def __init__(
        self, max_count: int = DEFAULT_MAX_STORED, max_bytes: int = DEFAULT_STORED_MB << 20
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def count(self) -> int:
        """Responses stored. (Not `__len__`: an empty store must not read as false.)"""
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        """The response `response_id`, now the most recently used, or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: Stored) -> None:
        """Keep `entry`, dropping the least recently used ones beyond the bounds."""
        self.delete(response_id)
        if entry.size > self.max_bytes or self.max_count < 1:
            return
        self._entries[response_id] = entry
        self.bytes += entry.size
        while self._entries and (
            len(self._entries) > self.max_count or self.bytes > self.max_bytes
        ):
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size

    def delete(self, response_id: str) -> bool:
        """Forget `response_id`; whether it was stored."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None


@dataclass
class ResponsesRequest:
    """A `/v1/responses` body, read and checked: the chat request it is prompted as, and what
    the Response object repeats and the store keeps."""

    chat: ChatRequest
    #: The new input items as chat messages (after the earlier conversation).
    new: list[dict[str, Any]]
    #: The stored response this one continues (`previous_response_id`), if any.
    previous: Stored | None
    store: bool
    #: The request's settings as the Response object echoes them.
    echo: dict[str, Any] = field(default_factory=dict)
    #: The size of `new` as JSON, measured with the prompt (off the event loop).
    new_size: int = 0

    @property
    def stream(self) -> bool:
        return self.chat.sampling.stream

    @property
    def uses_tools(self) -> bool:
        """Whether the reply may be function calls (only known whole, at its end)."""
        return bool(self.chat.tools) and self.chat.tool_choice != "none"


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(
        404,
        f"no response with id {response_id!r} is stored here (never stored, deleted, or "
        "dropped from the store: kvfork serve --max-stored-responses, --stored-responses-mb)",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


def _check_fields(body: dict[str, Any]) -> None:
    """OpenAI refuses fields it does not know; so does this server, and the features of
    OpenAI's service it does not have (background runs, server-side conversations and
    prompts), rather than answer as if it had honoured them."""
    for name, value in body.items():
        if name in ("conversation", "prompt") and value is not None:
            raise bad_request(f"{name} is not supported by this server", name)
        if name not in KNOWN | IGNORED | {"conversation", "prompt"}:
            raise bad_request(f"unknown parameter: {name!r}", name, "unknown_parameter")
    if bool_field(body, "background"):
        raise bad_request("background responses are not supported by this server", "background")


def _optional_str(body: dict[str, Any], name: str, where: str = "") -> str | None:
    """`body[name]`, a string or absent; `where` is the path of `body` in the request."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        param = f"{where}.{name}" if where else name
        raise bad_request(f"{param} must be a string", param)
    return value


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    """At most 16 string pairs, keys up to 64 characters and values up to 512 (OpenAI's)."""
    value = body.get("metadata")
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(isinstance(k, str) and len(k) <= 64 for k in value)
        or not all(isinstance(v, str) and len(v) <= 512 for v in value.values())
    ):
        raise bad_request(
            "metadata must be an object of at most 16 strings (keys up to 64 characters, "
            "values up to 512)",
            "metadata",
        )
    return dict(value)


def _text(parts: Any, where: str) -> str:
    """A content's text: a string, or a list of text parts (`input_text`, `output_text`,
    `refusal`); images, files and audio are refused."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            raise bad_request(
                f"{where}[{j}] must be a text part ({', '.join(sorted(_TEXT_PARTS))}); "
                "this server reads text only",
                f"{where}[{j}]",
            )
        texts.append(part[key])
    return "".join(texts)


def _flag(item: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """`item[key]`, a boolean or absent (`default`)."""
    value = item.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{where}.{key} must be a boolean", f"{where}.{key}")
    return default if value is None else value


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    """`item[key]`, a non-empty string (a function call's `arguments` may be empty)."""
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _with_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A function call joins the assistant message just before it (its turn's other calls),
    else opens an assistant turn: the shape a chat client sends them in. Messages are
    replaced, not changed: a stored conversation shares them."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _messages(items: list[Any], param: str) -> list[dict[str, Any]]:
    """Input items as chat messages: messages (a developer's as a system one), function calls
    as an assistant's `tool_calls`, their outputs as `tool` messages."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
            content = _text(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            function = {
                "name": _required_str(item, "name", where),
                "arguments": _required_str(item, "arguments", where),
            }
            call_id = _required_str(item, "call_id", where)
            _with_call(messages, {"id": call_id, "type": "function", "function": function})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # a reply's reasoning, passed back: not prompted again
            raise bad_request(
                f"{where}.type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                f"{where}.type",
            )
    return messages


def _input(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("input")
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string or list of items", "input")
    messages = _messages(value, "input")
    if not messages:  # only reasoning items
        raise bad_request("input must hold a message or a function call's output", "input")
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The function tools as the Response object repeats them, and in chat's shape."""
    value = body.get("tools")
    if value is None or value == []:
        return [], None
    if not isinstance(value, list):
        raise bad_request("tools must be a list of function tools", "tools")
    echoed: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where} must be a function tool (type 'function')", where)
        name = _required_str(tool, "name", where)
        if any(t["name"] == name for t in echoed):
            raise bad_request(f"{where}: a second function named {name!r}", where)
        description = _optional_str(tool, "description", where)
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema", f"{where}.parameters")
        function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object"}}
        if description is not None:
            function["description"] = description
        strict = _flag(tool, "strict", where, default=True)
        echoed.append({"type": "function", **function, "strict": strict})
        chat.append({"type": "function", "function": function})
    return echoed, chat


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, str]:
    """`tool_choice` as echoed, and as `ChatRequest.tool_choice` takes it (a function is its
    name)."""
    value = body.get("tool_choice")
    names = {t["name"] for t in tools}
    if value is None:
        return "auto", "auto" if tools else "none"
    if value in ("auto", "none"):
        return value, value if tools else "none"
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if value == "required":
        return value, value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if isinstance(name, str) and name in names:
            return {"type": "function", "name": name}, name
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': one "
        "of the tools}",
        "tool_choice",
    )


def _text_format(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`text.format` as echoed, and the JSON schema the output follows (None: free text), as
    chat's `response_format` gives it."""
    text = body.get("text")
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad_request("text.verbosity must be 'low', 'medium' or 'high'", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "object"}
    if kind != "json_schema":
        raise bad_request(
            "text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
            "text.format",
        )
    assert isinstance(fmt, dict)
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
    echoed = {
        "type": "json_schema",
        "name": _required_str(fmt, "name", "text.format"),
        "schema": schema,
        "strict": _flag(fmt, "strict", "text.format", default=False),
    }
    if (description := _optional_str(fmt, "description", "text.format")) is not None:
        echoed["description"] = description
    return echoed, schema


def _sampling(body: dict[str, Any], schema: dict[str, Any] | None) -> Sampling:
    """The sampling fields this API has (one choice, no stop strings or penalties)."""
    max_tokens = int_field(body, "max_output_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 20)
    assert max_tokens is not None
    return Sampling(
        max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        stream=bool_field(body, "stream"),
        json_schema=schema,
        lora=parse_lora(body),
        model=model_field(body),
    )


def _reasoning(body: dict[str, Any]) -> Asked:
    """`reasoning: {"effort"}`: the effort for the template (see `reasoning.EFFORTS`; "none"
    turns thinking off); its summary settings are accepted and change nothing."""
    value = body.get("reasoning")
    if value is None:
        return Asked()
    if not isinstance(value, dict):
        raise bad_request("reasoning must be an object", "reasoning")
    effort = value.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort"
        )
    return Asked(effort=effort)


def parse_responses(body: dict[str, Any], store: ResponseStore) -> ResponsesRequest:
    """A `/v1/responses` body: every bad field is a 400 naming it; a `previous_response_id`
    the store does not hold is a 404 naming it."""
    _check_fields(body)
    instructions = _optional_str(body, "instructions")
    previous_id = _optional_str(body, "previous_response_id")
    if previous_id == "":
        raise bad_request("previous_response_id must not be empty", "previous_response_id")
    new = _input(body)
    tools, chat_tools = _tools(body)
    choice, chat_choice = _tool_choice(body, tools)
    fmt, schema = _text_format(body)
    sampling = _sampling(body, schema)
    previous = None
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise _not_found(previous_id, "previous_response_id")
    system = [{"role": "system", "content": instructions}] if instructions else []
    earlier = list(previous.conversation) if previous else []
    reasoning = _reasoning(body)
    chat = ChatRequest(
        messages=[*system, *earlier, *new],
        sampling=sampling,
        tools=chat_tools,
        tool_choice=chat_choice,
        reasoning=reasoning,
        template_kwargs=parse_template_kwargs({}, reasoning.effort),
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body),
        "parallel_tool_calls": bool_field(body, "parallel_tool_calls", default=True),
        "previous_response_id": previous_id,
        "reasoning": {"effort": reasoning.effort, "summary": None},
        "temperature": sampling.temperature,
        "text": {"format": fmt},
        "tool_choice": choice,
        "tools": tools,
        "top_p": sampling.top_p,
    }
    store_it = bool_field(body, "store", default=True)
    return ResponsesRequest(chat=chat, new=new, previous=previous, store=store_it, echo=echo)


def renamed(exc: APIError) -> APIError:
    """`exc` with the field it names as the Responses API calls it (the prompt and the
    schema's errors come from layers that speak chat's names)."""
    exc.param = _PARAMS.get(exc.param or "", exc.param)
    return exc


@contextmanager
def responses_params() -> Iterator[None]:
    """Errors raised inside name the Responses API's fields (see `renamed`)."""
    try:
        yield
    except APIError as exc:
        raise renamed(exc) from None


def _size(value: Any) -> int:
    """What a value is counted for in the store: the characters of its JSON."""
    return len(json.dumps(value, ensure_ascii=False))


class Responses:
    """The Responses API on one backend: requests into chat prompts, generations into Response
    objects and events, and the store of finished responses."""

    def __init__(self, service: Backend, store: ResponseStore) -> None:
        self.service = service
        self.store = store

    def parse(self, body: dict[str, Any]) -> ResponsesRequest:
        """See `parse_responses`; a required or named function also constrains the output."""
        req = parse_responses(body, self.store)
        self.service.prompts.constrain_tools(req.chat)
        return req

    def prompt(self, req: ResponsesRequest) -> tuple[list[int], list[str], str]:
        """The prompt's tokens, stop strings and text (whose end may open a think block), and
        the new input's size for the store. Blocking (template, tokenizer, a large input's
        JSON): off the event loop."""
        with responses_params():
            prompt = self.service.prompts.rendered_chat(req.chat)
        req.new_size = _size(req.new)
        return prompt

    def reply(self, req: ResponsesRequest) -> Reply:
        return Reply(self, req)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`: the stored Response object (404 when not stored)."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, None)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        """`DELETE /v1/responses/{id}`: forgets it (404 when not stored)."""
        if not self.store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}


class Reply:
    """One response being made: its Response object in progress, then finished (and stored
    when the request says so)."""

    def __init__(self, api: Responses, req: ResponsesRequest) -> None:
        self.api = api
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The Response object: its state, output and usage, and the request's settings."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": answering_model(self.api.service, self.req.chat.sampling.model),
            "output": output,
            "store": self.req.store,
            "truncation": "disabled",
            "usage": usage,
            **self.req.echo,
        }

    def in_progress(self) -> dict[str, Any]:
        return self.body("in_progress", [], None)

    def output(self, outcome: Outcome) -> tuple[str, list[dict[str, Any]]]:
        """The response's status and output items: its reasoning (when it reasoned), then its
        function calls, or one message."""
        choice = outcome.choices[0]
        status, items = self._answer(choice)
        if choice.reasoning:
            items.insert(0, self.reasoning_item(choice.reasoning, "completed"))
        return status, items

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        """The reply's reasoning as a `reasoning` output item (its text as the content)."""
        content = [{"type": "reasoning_text", "text": text}] if text else []
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def _answer(self, choice: Choice) -> tuple[str, list[dict[str, Any]]]:
        """The status and the items of the reply's answer: its calls (after a message of what
        it said before them), or one message."""
        text = choice.content
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        req, prompts = self.req, self.api.service.prompts
        calls = prompts.tool_calls(req.chat, text) if req.uses_tools else []
        if not req.echo["parallel_tool_calls"]:
            calls = calls[:1]
        said = text_before_calls(text) if calls else text
        message = {
            "type": "message",
            "id": self.message_id,
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": said, "annotations": [], "logprobs": []}],
        }
        if calls:
            return status, ([message] if said else []) + [
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
                for call in calls
            ]
        return status, [message]

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The finished Response object, stored when the request says so."""
        status, output = self.output(outcome)
        cached = outcome.cached_tokens
        usage = {
            "input_tokens": outcome.prompt_tokens,
            # The tokens prefilled now: the prefix cache keeps them when the request ends.
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": outcome.prompt_tokens - cached,
            },
            "output_tokens": outcome.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        }
        response = self.body(status, output, usage)
        if status == "completed":
            response["completed_at"] = int(time.time())
        if self.req.store:
            self._store(response)
        return response

    def _store(self, response: dict[str, Any]) -> None:
        """Keep `response` with its conversation: the earlier one, the new input, and the
        output as messages, rendered as a client passing the output back would send it."""
        req = self.req
        reply = _messages(response["output"], "output")
        before = req.previous.conversation if req.previous else ()
        before_size = req.previous.conversation_size if req.previous else 0
        conversation_size = before_size + req.new_size + _size(reply)
        entry = Stored(
            response=response,
            conversation=(*before, *req.new, *reply),
            conversation_size=conversation_size,
            size=conversation_size + _size(response),
        )
        self.api.store.put(self.id, entry)


class ResponseEvents:
    """A response's server-sent events, numbered: `response.created` and `.in_progress` with
    the first event of the generation (so a request that fails at once gets its status), the
    message's text as it comes, and its end; or, when the reply may be function calls (known
    only whole), every item at the end. Then `response.completed` (or `.incomplete`), or an
    `error` event when the generation fails (`error_event`)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.sequence = 0
        #: The message's text streams as it comes (else it is only known at the end).
        self.streams_text = not reply.req.uses_tools
        self._items = 0  # output items opened
        self._thinking: str | None = None  # the reasoning so far, once its item is open
        self._thought = False  # its item is done
        self._message_at: int | None = None  # the message's output index, once open

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event, named as OpenAI names it (`event:` line and `type`)."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    async def chunks(
        self, generation: AsyncIterable[Event | Outcome]
    ) -> AsyncGenerator[bytes, None]:
        """The stream's chunks, one per generation event (the first one opens the response)."""
        opened = False
        with responses_params():
            async for item in generation:
                out = [] if opened else self._open()
                opened = True
                if isinstance(item, Outcome):
                    out += self._close(item)
                else:
                    out += self._deltas(item)
                if out:
                    yield b"".join(out)

    def error_event(self, error: APIError) -> bytes:
        """The `error` event that ends a stream whose generation failed (nothing follows
        `response.completed`: no `[DONE]` in this API)."""
        error = renamed(error)
        return self.event(
            "error", code=error.code or error.type, message=error.message, param=error.param
        )

    def _open(self) -> list[bytes]:
        """The response's start (its items open with their first delta)."""
        snapshot = self.reply.in_progress()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def _deltas(self, event: Event) -> list[bytes]:
        """An event's reasoning in the reasoning item, its text in the message (each opened
        with its first delta; the reasoning is over when the text begins)."""
        out: list[bytes] = []
        if event.reasoning:
            if self._thinking is None:
                self._thinking = ""
                out += self._open_reasoning(self._next_item())
            self._thinking += event.reasoning
            ref = self._reasoning_ref()
            out.append(self.event("response.reasoning_text.delta", **ref, delta=event.reasoning))
        if self.streams_text and event.text:
            out += self._end_reasoning()
            if self._message_at is None:
                self._message_at = self._next_item()
                out += self._open_message(self._message_at)
            out.append(self._delta(event.text, self._message_at))
        return out

    def _next_item(self) -> int:
        self._items += 1
        return self._items - 1

    def _reasoning_ref(self) -> dict[str, Any]:
        return {"item_id": self.reply.reasoning_id, "output_index": 0, "content_index": 0}

    def _open_reasoning(self, index: int) -> list[bytes]:
        item = self.reply.reasoning_item("", "in_progress")
        part = {"type": "reasoning_text", "text": ""}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **self._reasoning_ref(), part=part),
        ]

    def _end_reasoning(self) -> list[bytes]:
        """The reasoning item's end, once (nothing when there was none)."""
        if self._thinking is None or self._thought:
            return []
        self._thought = True
        text, ref = self._thinking, self._reasoning_ref()
        part = {"type": "reasoning_text", "text": text}
        item = self.reply.reasoning_item(text, "completed")
        return [
            self.event("response.reasoning_text.done", **ref, text=text),
            self.event("response.content_part.done", **ref, part=part),
            self.event("response.output_item.done", output_index=0, item=item),
        ]

    def _message_ref(self, index: int) -> dict[str, Any]:
        return {"item_id": self.reply.message_id, "output_index": index, "content_index": 0}

    def _open_message(self, index: int) -> list[bytes]:
        item = {
            "type": "message",
            "id": self.reply.message_id,
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **self._message_ref(index), part=part),
        ]

    def _delta(self, text: str, index: int = 0) -> bytes:
        ref = self._message_ref(index)
        return self.event("response.output_text.delta", **ref, delta=text, logprobs=[])

    def _close(self, outcome: Outcome) -> list[bytes]:
        response = self.reply.finish(outcome)
        out: list[bytes] = self._end_reasoning()
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":
                continue  # streamed, and ended above
            if item["type"] == "function_call":
                out += self._function_call(index, item)
                continue
            if self._message_at is None:  # the whole message now: opened, then its one delta
                out += self._open_message(index)
                if item["content"][0]["text"]:
                    out.append(self._delta(item["content"][0]["text"], index))
            out += self._close_message(index, item)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=response))
        return out

    def _close_message(self, index: int, item: dict[str, Any]) -> list[bytes]:
        part = item["content"][0]
        ref = self._message_ref(index)
        return [
            self.event("response.output_text.done", **ref, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **ref, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _function_call(self, index: int, item: dict[str, Any]) -> list[bytes]:
        """A finished call as OpenAI streams one: the item with empty arguments, the arguments
        in fragments, then the whole."""
        ref = {"item_id": item["id"], "output_index": index}
        args = item["arguments"]
        started = {**item, "arguments": "", "status": "in_progress"}
        out = [self.event("response.output_item.added", output_index=index, item=started)]
        for at in range(0, len(args), ARGUMENT_FRAGMENT):
            piece = args[at : at + ARGUMENT_FRAGMENT]
            out.append(self.event("response.function_call_arguments.delta", **ref, delta=piece))
        out.append(self.event("response.function_call_arguments.done", **ref, arguments=args))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
