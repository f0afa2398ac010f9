"""Anthropic's Messages API on `kvfork serve`: a real server process on 127.0.0.1 and the
`anthropic` package as the client. Sampling fields go in `extra_body` (the 2.x client no
longer has them as arguments; the server reads them as Anthropic's API defines them)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock
from kvfork.server.errors import APIError
from kvfork.server.messages import error_body

from .serving import Server, assert_used_servers_at_rest, servers

KEY = "k"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
GREEDY: Any = {"temperature": 0}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time in a timezone", "input_schema": TIME},
]
#: Enough for a constrained call's JSON (whitespace included) on the small chat model.
CALL_TOKENS = 48


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    """`kvfork serve` processes on loopback, stopped with SIGTERM at the module's end (each
    must exit cleanly)."""
    yield from servers()


@pytest.fixture(scope="module")
def server(serve: Any) -> Server:
    started: Server = serve("chat", "--n-ctx", "4096", "--n-seq-max", "4", "--api-key", KEY)
    return started


@pytest.fixture(autouse=True)
def _every_sequence_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test the shared server is at rest."""
    yield
    assert_used_servers_at_rest(request, "server")


def _client(server: Server, key: str = KEY) -> anthropic.Anthropic:
    """A client of `server` (close it: its connections are its own)."""
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with _client(server) as shared:
        yield shared


def _user(text: str = QUESTION) -> Any:
    return [{"role": "user", "content": text}]


def _text(message: Message) -> str:
    """The text of a reply that must be text only."""
    blocks = message.content
    assert blocks and all(isinstance(b, TextBlock) for b in blocks), blocks
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def _call(message: Message) -> ToolUseBlock:
    """The one tool_use block of a reply that must be a call."""
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert len(message.content) == 1 and isinstance(message.content[0], ToolUseBlock)
    return message.content[0]


def _prompt_tokens(message: Message) -> int:
    """The prompt's tokens: Anthropic's input_tokens leave out those read from the cache."""
    usage = message.usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _raw(
    server: Server, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a POST with exactly `headers` (any status)."""
    req = urllib.request.Request(
        server.url + path, data=body, headers={"content-type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_a_message_is_the_chat_reply_in_anthropic_s_shape(
    server: Server, client: anthropic.Anthropic
) -> None:
    reply = client.messages.create(
        model="anything", max_tokens=24, system=SYSTEM, messages=_user(), extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model and reply.stop_reason == "end_turn" and reply.stop_sequence is None
    text = _text(reply)
    assert "Paris" in text
    assert reply.usage.output_tokens > 0 and reply.usage.cache_creation_input_tokens == 0
    # The same conversation through /v1/chat/completions: the same prompt, the same text.
    with server.client(KEY) as openai_client:
        chat = openai_client.chat.completions.create(
            model="x",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION},
            ],
            max_tokens=24,
            temperature=0,
        )
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == _prompt_tokens(reply)
    assert chat.usage.completion_tokens == reply.usage.output_tokens


def test_system_blocks_read_as_the_system_string(client: anthropic.Anthropic) -> None:
    as_string = client.messages.create(
        model="x", max_tokens=24, system=SYSTEM, messages=_user(), extra_body=GREEDY
    )
    as_block = client.messages.create(
        model="x",
        max_tokens=24,
        system=[{"type": "text", "text": SYSTEM}],
        messages=_user(),
        extra_body=GREEDY,
    )
    assert _text(as_block) == _text(as_string)
    assert _prompt_tokens(as_block) == _prompt_tokens(as_string)
    # Several blocks are paragraphs of one system message.
    two = client.messages.count_tokens(
        model="x",
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": SYSTEM}],
        messages=_user(),
    )
    joined = client.messages.count_tokens(
        model="x", system=f"Be brief.\n\n{SYSTEM}", messages=_user()
    )
    without = client.messages.count_tokens(model="x", system=SYSTEM, messages=_user())
    assert two.input_tokens == joined.input_tokens > without.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client: anthropic.Anthropic) -> None:
    whole = _text(
        client.messages.create(
            model="x", max_tokens=24, system=SYSTEM, messages=_user(), extra_body=GREEDY
        )
    )
    assert "Paris" in whole
    kwargs: Any = {
        "model": "x",
        "max_tokens": 24,
        "system": SYSTEM,
        "messages": _user(),
        "stop_sequences": ["never said", "Paris"],
        "extra_body": GREEDY,
    }
    stopped = client.messages.create(**kwargs)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert _text(stopped) == whole.split("Paris")[0]
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(final) == _text(stopped)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"


def test_max_tokens_ends_the_message(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(
        model="x", max_tokens=3, messages=_user("Count from one to fifty."), extra_body=GREEDY
    )
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 3 and _text(reply)


def test_a_stream_s_events_come_in_anthropic_s_order(
    server: Server, client: anthropic.Anthropic
) -> None:
    kwargs: Any = {"model": "x", "max_tokens": 24, "system": SYSTEM, "messages": _user()}
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    body = [k for k in kinds if k not in ("content_block_delta", "text")]
    assert body == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert kinds.count("content_block_delta") == kinds.count("text") > 0
    plain = client.messages.create(**kwargs, extra_body=GREEDY)
    assert _text(final) == _text(plain) and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert _prompt_tokens(final) == _prompt_tokens(plain)
    # On the wire: each event named, its data's type the same name, no `data: [DONE]`.
    status, headers, raw = _raw(
        server,
        "/v1/messages",
        json.dumps({**kwargs, **GREEDY, "stream": True}).encode(),
        {"x-api-key": KEY},
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    names = []
    for event in events:
        name_line, data_line = event.split("\n")
        name = name_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert b"[DONE]" not in raw


def test_openai_streams_keep_their_done_tail(server: Server) -> None:
    body = {"messages": _user(), "max_tokens": 4, "stream": True, **GREEDY}
    status, _, raw = _raw(
        server,
        "/v1/chat/completions",
        json.dumps(body).encode(),
        {"authorization": f"Bearer {KEY}"},
    )
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b"event:" not in raw


def test_a_required_call_s_input_follows_its_schema(client: anthropic.Anthropic) -> None:
    question = _user("What is the weather in Paris?")
    kwargs: Any = {"model": "x", "max_tokens": CALL_TOKENS, "tools": TOOLS, "messages": question}
    any_call = _call(
        client.messages.create(**kwargs, tool_choice={"type": "any"}, extra_body=GREEDY)
    )
    assert any_call.id.startswith("toolu_") and any_call.name in ("get_weather", "get_time")
    jsonschema.validate(any_call.input, WEATHER if any_call.name == "get_weather" else TIME)
    named = _call(
        client.messages.create(
            **kwargs, tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY
        )
    )
    assert named.name == "get_time"
    jsonschema.validate(named.input, TIME)
    # Streamed: the block's input as JSON fragments, which the client reassembles.
    with client.messages.stream(
        **kwargs, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = _call(stream.get_final_message())
    assert "input_json" in kinds and "text" not in kinds
    assert streamed.name == "get_weather"
    jsonschema.validate(streamed.input, WEATHER)


def test_tool_results_are_the_chat_s_tool_messages(
    server: Server, client: anthropic.Anthropic
) -> None:
    question = "What is the weather in Paris?"
    call = _call(
        client.messages.create(
            model="x",
            max_tokens=CALL_TOKENS,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=_user(question),
            extra_body=GREEDY,
        )
    )
    turns: Any = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "Rain, 12 C"}],
                    "is_error": True,
                },
                {"type": "text", "text": "So?"},
            ],
        },
    ]
    reply = client.messages.create(
        model="x", max_tokens=16, tools=TOOLS, messages=turns, extra_body=GREEDY
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content
    # The prompt is the one /v1/chat/completions builds for the same conversation in its
    # own shape: the call an assistant message's tool_calls, the result a tool message
    # (an error says so), the text after it a user message.
    chat_messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.input},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "name": call.name,
            "content": "Error: Rain, 12 C",
        },
        {"role": "user", "content": "So?"},
    ]
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]
    status, templated = server.post(
        "/apply-template",
        json.dumps({"messages": chat_messages, "tools": chat_tools}).encode(),
        KEY,
    )
    assert status == 200 and "Error: Rain, 12 C" in templated["prompt"]
    body = {"content": templated["prompt"], "add_special": True, "parse_special": True}
    status, tokenized = server.post("/tokenize", json.dumps(body).encode(), KEY)
    assert status == 200
    counted = client.messages.count_tokens(model="x", tools=TOOLS, messages=turns)
    assert counted.input_tokens == len(tokenized["tokens"]) == _prompt_tokens(reply)


def test_count_tokens_is_what_a_message_prefills(client: anthropic.Anthropic) -> None:
    question = _user(f"Say hello to {uuid.uuid4().hex[:8]}.")
    counted = client.messages.count_tokens(model="x", system=SYSTEM, messages=question)
    reply = client.messages.create(
        model="x", max_tokens=4, system=SYSTEM, messages=question, extra_body=GREEDY
    )
    assert counted.input_tokens == _prompt_tokens(reply) > 10
    with_tools = client.messages.count_tokens(
        model="x", system=SYSTEM, messages=question, tools=TOOLS
    )
    assert with_tools.input_tokens > counted.input_tokens  # the tools' prompt counts
    refused = client.messages.count_tokens(
        model="x", system=SYSTEM, messages=question, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert refused.input_tokens == counted.input_tokens  # tool_choice none: no tools shown
    tool_reply = client.messages.create(
        model="x", max_tokens=4, system=SYSTEM, messages=question, tools=TOOLS, extra_body=GREEDY
    )
    assert _prompt_tokens(tool_reply) == with_tools.input_tokens


def test_a_final_assistant_turn_is_the_start_the_reply_continues(
    server: Server, client: anthropic.Anthropic
) -> None:
    # As Anthropic's API: the reply goes on from the prefill (it was rendered as a closed turn
    # and a new one opened, so the reply started over). The prompt is the chat prompt of the
    # turns before it, the prefill after it: the same tokens and text as a completion of that.
    prefill = "The capital of France is"
    turns: Any = [*_user(), {"role": "assistant", "content": prefill}]
    reply = client.messages.create(
        model="x", max_tokens=8, system=SYSTEM, messages=turns, extra_body=GREEDY
    )
    before = [{"role": "system", "content": SYSTEM}, *_user()]
    status, templated = server.post(
        "/apply-template", json.dumps({"messages": before}).encode(), KEY
    )
    assert status == 200
    body = {"content": templated["prompt"] + prefill, "add_special": True, "parse_special": True}
    status, tokenized = server.post("/tokenize", json.dumps(body).encode(), KEY)
    assert status == 200
    prompt = tokenized["tokens"]
    counted = client.messages.count_tokens(model="x", system=SYSTEM, messages=turns)
    assert counted.input_tokens == len(prompt) == _prompt_tokens(reply)
    with server.client(KEY) as openai_client:
        completion = openai_client.completions.create(
            model="x", prompt=prompt, max_tokens=8, temperature=0
        )
    assert _text(reply) == completion.choices[0].text
    assert "Paris" in _text(reply) and not _text(reply).startswith(prefill)


def test_a_repeated_prompt_is_read_from_the_cache(client: anthropic.Anthropic) -> None:
    question = _user(f"Spell the word {uuid.uuid4().hex[:8]}.")
    first = client.messages.create(
        model="x", max_tokens=4, system=SYSTEM, messages=question, extra_body=GREEDY
    )
    second = client.messages.create(
        model="x", max_tokens=4, system=SYSTEM, messages=question, extra_body=GREEDY
    )
    total = _prompt_tokens(first)
    assert _prompt_tokens(second) == total
    # All of it but its last token (whose logits the next token needs) came from the cache.
    assert second.usage.cache_read_input_tokens == total - 1 and second.usage.input_tokens == 1
    assert (first.usage.cache_read_input_tokens or 0) < total - 1
    # A stream's start says so too (clients take the input's usage from `message_start`).
    with client.messages.stream(
        model="x", max_tokens=4, system=SYSTEM, messages=question, extra_body=GREEDY
    ) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    assert start.message.usage.cache_read_input_tokens == total - 1
    assert start.message.usage.input_tokens == 1 == final.usage.input_tokens


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/messages", {"model": "x", "messages": _user()}, "max_tokens"),
    ("/v1/messages", {"model": 5, "max_tokens": 4, "messages": _user()}, "model"),
    (
        "/v1/messages",
        {"model": "x", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        "messages[0].role",
    ),
    (
        "/v1/messages",
        {"model": "x", "max_tokens": 4, "messages": _user(), "tools": TOOLS, "tool_choice": {}},
        "tool_choice",
    ),
    (
        "/v1/messages",
        {
            "model": "x",
            "max_tokens": 4,
            "messages": _user(),
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_stock"},
        },
        "tool_choice.name",
    ),
    ("/v1/messages", {"max_tokens": 4, "messages": _user(), "temperature": 1.5}, "temperature"),
    (
        "/v1/messages",
        {"max_tokens": 4, "messages": _user(), "stop_sequences": "x"},
        "stop_sequences",
    ),
    (
        "/v1/messages",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        "messages[0].content[0]",
    ),
    (
        "/v1/messages",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
        },
        "messages[0].content[0].tool_use_id",
    ),
    (
        "/v1/messages/count_tokens",
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
    ),
    ("/v1/messages/count_tokens", {"messages": _user(), "tools": [{"name": "f"}]}, "input_schema"),
    (
        "/v1/messages/count_tokens",
        {"messages": [*_user(), {"role": "assistant", "content": "It is "}]},
        "messages[1].content",
    ),
    ("/v1/messages", {"max_tokens": 4, "messages": _user(), "lora": ["x"]}, "lora"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD, ids=[b[2] for b in BAD])
def test_a_bad_request_is_a_400_in_anthropic_s_shape_naming_the_field(
    path: str, body: dict[str, Any], field: str, client: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post(path, cast_to=Message, body=body)
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"type", "error"}
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"], error


def test_a_body_that_is_not_json_is_a_400_in_anthropic_s_shape(server: Server) -> None:
    status, _, raw = _raw(server, "/v1/messages", b"{not json", {"x-api-key": KEY})
    assert status == 400
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_a_route_s_own_refusal_is_in_anthropic_s_shape(server: Server) -> None:
    """Starlette refuses a method the route does not take (405) or a path under it that does
    not exist (404): in the shape of the API the path belongs to."""
    for path in ("/v1/messages", "/v1/messages/nowhere"):
        status, body = server.get(path)
        assert status in (404, 405) and body["type"] == "error", (path, body)
        assert body["error"]["type"] in ("not_found_error", "invalid_request_error"), body
    status, body = server.get("/v1/chat/completions")
    assert status == 405 and "message" in body["error"] and "type" not in body  # OpenAI's


def test_a_lone_surrogate_is_a_400_in_anthropic_s_shape(server: Server) -> None:
    """Valid JSON, but not text: refused before it reaches the template or the tokenizer."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = b'{"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800"}]}'
        status, _, raw = _raw(server, path, body, {"x-api-key": KEY})
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "invalid_request_error"
        assert "surrogate" in error["message"], error


def test_the_key_comes_as_x_api_key_or_a_bearer_token(server: Server) -> None:
    with _client(server, "wrong") as wrong, pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="x", max_tokens=4, messages=_user())
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    body = json.dumps({"model": "x", "messages": _user()}).encode()
    path = "/v1/messages/count_tokens"
    for headers, expected in [
        ({"x-api-key": KEY}, 200),
        ({"authorization": f"Bearer {KEY}"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({}, 401),
    ]:
        status, _, raw = _raw(server, path, body, headers)
        assert status == expected, (headers, raw)
        assert ("input_tokens" in json.loads(raw)) == (expected == 200)
    # OpenAI's routes keep their own header and their own error shape.
    status, _, raw = _raw(server, "/v1/chat/completions", b"{}", {"x-api-key": KEY})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_a_stream_closed_mid_way_gives_its_sequence_back(
    server: Server, client: anthropic.Anthropic
) -> None:
    metric = 'kvfork_client_disconnects_total{endpoint="messages"}'
    before = server.metric(metric) if metric in server.metrics_text() else 0.0
    with client.messages.stream(
        model="x",
        max_tokens=400,  # far more than it reads before going away
        messages=_user("Write a very long story about a dragon."),
        extra_body=GREEDY,  # greedy: a story of hundreds of tokens
    ) as stream:
        for event in stream:
            if event.type == "text":
                break
    deadline = time.monotonic() + 20
    while not (metric in server.metrics_text() and server.metric(metric) > before):
        assert time.monotonic() < deadline, "the closed stream was not counted"
        time.sleep(0.05)
    server.assert_at_rest()


def test_a_stream_ended_by_shutdown_ends_with_an_error_event(serve: Any) -> None:
    ending: Server = serve("chat", "--n-ctx", "2048", "--n-seq-max", "1", "--shutdown-seconds", "0")
    with (
        _client(ending, "none") as client,
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(
            model="x",
            max_tokens=2000,  # cut by the shutdown right after its first text
            messages=_user("Write a very long story about a dragon."),
            extra_body=GREEDY,  # greedy: a story of hundreds of tokens
        ) as stream,
    ):
        for event in stream:
            if event.type == "text" and ending.process.poll() is None:
                ending.process.terminate()
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is shutting down"},
    }
    assert ending.process.wait(timeout=30) == 0
    assert "shutting down" in ending.stop()


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (422, "invalid_request_error"),
        (502, "api_error"),
    ],
)
def test_each_status_has_anthropic_s_error_type(status: int, kind: str) -> None:
    body = error_body(APIError(status, "went wrong", param="field"))
    assert body == {"type": "error", "error": {"type": kind, "message": "field: went wrong"}}
