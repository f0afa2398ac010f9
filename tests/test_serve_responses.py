"""`kvfork serve`'s `/v1/responses` (OpenAI's Responses API) as its users use it: a real server
process on 127.0.0.1 and the `openai` package's `client.responses` as the client, so every
object and event must parse as OpenAI's own types. Generations are kept short (the CPU is
slow); a tool call needs ~30 tokens of JSON, so those get 48."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import kvfork
import openai
import pytest
from kvfork.server.responses import ResponseStore, Stored

from .serving import Server, assert_used_servers_at_rest, servers

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": PARAMS,
}


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    """`kvfork serve` processes on loopback; each stops with SIGTERM at the end of the module
    and must exit cleanly (status 0, no traceback)."""
    yield from servers()


@pytest.fixture(scope="module")
def chat_server(serve: Any) -> Server:
    server: Server = serve("chat", "--n-ctx", "4096", "--n-seq-max", "4")
    return server


@pytest.fixture(autouse=True)
def _every_sequence_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the server, it is at rest."""
    yield
    assert_used_servers_at_rest(request, "chat_server")


def _create(server: Server, **kwargs: Any) -> Any:
    """`client.responses.create` at temperature 0 with at most 24 output tokens."""
    args: Any = {"model": "x", "temperature": 0, "max_output_tokens": 24, **kwargs}
    return server.client().responses.create(**args)


def _chat(server: Server, messages: list[dict[str, Any]], max_tokens: int = 24) -> Any:
    """The same prompt through `/v1/chat/completions`, to compare with."""
    args: Any = {"model": "x", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    return server.client().chat.completions.create(**args)


def _sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each server-sent event of a raw stream."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_plain_text_is_the_chat_reply_in_a_response_object(chat_server: Server) -> None:
    chat = _chat(chat_server, [{"role": "system", "content": SYSTEM}, _user(QUESTION)])
    r = _create(chat_server, instructions=SYSTEM, input=QUESTION)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert abs(r.created_at - time.time()) < 120 and r.incomplete_details is None
    assert r.model == kvfork.default_chat_model_path().stem
    assert r.instructions == SYSTEM and r.temperature == 0 and r.max_output_tokens == 24
    assert r.tools == [] and r.tool_choice == "auto" and r.text.format.type == "text"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert r.output_text == part.text == chat.choices[0].message.content
    assert "Paris" in r.output_text
    u = r.usage
    assert u.input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # The chat request before it left this prompt in the prefix cache: all but its last token.
    assert u.input_tokens_details.cached_tokens == u.input_tokens - 1


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_message_items_are_the_chat_messages(chat_server: Server) -> None:
    """A developer message is a system one; content parts are joined; an assistant turn given
    as `output_text` parts is prompted as the assistant's."""
    items: Any = [
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Paris.", "annotations": []}],
        },
        {"role": "user", "content": "And of Italy?"},
    ]
    r = _create(chat_server, input=items)
    messages = [
        {"role": "system", "content": SYSTEM},
        _user(QUESTION),
        {"role": "assistant", "content": "Paris."},
        _user("And of Italy?"),
    ]
    chat = _chat(chat_server, messages)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content and r.output_text


def test_max_output_tokens_makes_an_incomplete_response(chat_server: Server) -> None:
    r = _create(chat_server, instructions=SYSTEM, input="Write a long story.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text


def test_a_json_schema_format_constrains_the_output(chat_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt: Any = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    r = _create(
        chat_server,
        instructions=SYSTEM,
        input="Describe the weather in Paris.",
        text={"format": fmt},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"
    assert r.text.format.schema_ == schema


def test_a_required_function_call_and_its_output_in_a_second_turn(chat_server: Server) -> None:
    tools: Any = [TOOL]
    first = _create(
        chat_server,
        instructions=SYSTEM,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=48,
    )
    assert first.status == "completed" and first.tool_choice == "required"
    assert first.tools[0].name == "get_weather" and first.tools[0].parameters == PARAMS
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    # The client passing the output back, and the server continuing from its store, prompt
    # the same conversation; both start with the first turn's prompt, found in the cache.
    passed: Any = [
        _user("What is the weather in Paris?"),
        *(item.model_dump(exclude_none=True) for item in first.output),
        result,
    ]
    by_hand = _create(chat_server, instructions=SYSTEM, input=passed, tools=tools)
    stored = _create(
        chat_server, instructions=SYSTEM, input=[result], tools=tools, previous_response_id=first.id
    )
    for second in (by_hand, stored):
        assert second.status in ("completed", "incomplete")
        assert second.output[0].type in ("message", "function_call")
        assert second.usage.input_tokens > first.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert stored.usage.input_tokens == by_hand.usage.input_tokens


def test_a_named_function_choice_is_echoed_and_called(chat_server: Server) -> None:
    choice: Any = {"type": "function", "name": "get_weather"}
    tools: Any = [TOOL]
    r = _create(
        chat_server,
        input="What is the weather in Rome?",
        tools=tools,
        tool_choice=choice,
        max_output_tokens=48,
    )
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    assert [item.type for item in r.output] == ["function_call"]


def test_a_stream_builds_the_same_response_event_by_event(chat_server: Server) -> None:
    plain = _create(chat_server, instructions=SYSTEM, input=QUESTION)
    args: Any = {"model": "x", "instructions": SYSTEM, "input": QUESTION}
    with chat_server.client().responses.stream(**args, temperature=0, max_output_tokens=24) as s:
        events: list[Any] = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[:4] == [*head, "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == [*tail, "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text == plain.output_text
    ids = {events[0].response.id, final.id}
    assert (
        len(ids) == 1 and final.status == "completed" and final.usage and final.usage.output_tokens
    )
    assert chat_server.client().responses.retrieve(final.id).output_text == deltas


def test_the_raw_stream_names_each_event_and_ends_without_done(chat_server: Server) -> None:
    # Greedy: a sampled answer may end within 4 tokens ("Paris." and the end of turn; it did
    # once in a CI run), and then the stream rightly ends `response.completed`.
    body = {
        "input": QUESTION,
        "instructions": SYSTEM,
        "stream": True,
        "max_output_tokens": 4,
        "temperature": 0,
    }
    status, headers, raw = chat_server.post_raw("/v1/responses", json.dumps(body).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = _sse(raw)
    assert all(name == data["type"] for name, data in events)
    assert events[-1][0] == "response.incomplete" and b"[DONE]" not in raw


def test_a_streamed_function_call_comes_whole_with_its_arguments(chat_server: Server) -> None:
    tools: Any = [TOOL]
    args: Any = {"model": "x", "input": "What is the weather in Oslo?", "tools": tools}
    with chat_server.client().responses.stream(
        **args, tool_choice="required", temperature=0, max_output_tokens=48
    ) as s:
        events: list[Any] = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    [call] = final.output
    assert call.type == "function_call" and events[2].item.arguments == ""
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments == events[-3].arguments
    jsonschema.validate(json.loads(call.arguments), PARAMS)


def test_previous_response_id_continues_on_the_cached_prefix(chat_server: Server) -> None:
    """Turn 2's prompt starts with turn 1's prompt and output as the prefix cache holds them:
    only the new input is prefilled. A third turn does the same on the second."""
    turns = [_create(chat_server, instructions=SYSTEM, input=QUESTION)]
    for question in ("And of Italy?", "And of Spain?"):
        turns.append(
            _create(
                chat_server,
                instructions=SYSTEM,
                input=question,
                previous_response_id=turns[-1].id,
            )
        )
    for before, after in itertools.pairwise(turns):
        held = before.usage.input_tokens + before.usage.output_tokens
        cached = after.usage.input_tokens_details.cached_tokens
        numbers = (before.usage.input_tokens, before.usage.output_tokens, cached)
        assert cached >= before.usage.input_tokens, numbers
        assert cached >= held - 1, numbers  # the output re-tokenizes as it was generated
        assert after.usage.input_tokens > held and after.previous_response_id == before.id
    assert "Rome" in turns[1].output_text and "Madrid" in turns[2].output_text


def test_instructions_are_not_carried_over(chat_server: Server) -> None:
    first = _create(chat_server, instructions=SYSTEM, input=QUESTION)
    second = _create(chat_server, input="And of Italy?", previous_response_id=first.id)
    assert second.instructions is None
    conversation = [
        _user(QUESTION),
        {"role": "assistant", "content": first.output_text},
        _user("And of Italy?"),
    ]
    assert second.usage.input_tokens == _chat(chat_server, conversation, 1).usage.prompt_tokens


def test_a_conversation_whose_cache_entry_was_evicted_is_prefilled_whole(
    chat_server: Server,
) -> None:
    first = _create(chat_server, instructions=SYSTEM, input=QUESTION)
    warm = _create(
        chat_server, instructions=SYSTEM, input="And of Italy?", previous_response_id=first.id
    )
    for i in range(5):  # more distinct prompts than the server's 4 sequences
        _create(
            chat_server,
            instructions=f"Variant {i}.",
            input=f"Colour {i}?",
            store=False,
            max_output_tokens=1,
        )
    cold = _create(
        chat_server, instructions=SYSTEM, input="And of Italy?", previous_response_id=first.id
    )
    assert cold.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert cold.usage.input_tokens == warm.usage.input_tokens
    assert cold.status == "completed" and cold.output_text


def test_get_and_delete_a_stored_response(chat_server: Server) -> None:
    client = chat_server.client()
    r = _create(chat_server, instructions=SYSTEM, input=QUESTION, metadata={"run": "7"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"run": "7"}
    assert _delete(chat_server, r.id) == (200, {"id": r.id, "object": "response", "deleted": True})
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: _create(chat_server, input="Go on.", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.status_code == 404 and caught.value.type == "invalid_request_error"
    assert caught.value.param == "previous_response_id"
    assert caught.value.code == "previous_response_not_found"


def _delete(server: Server, response_id: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{server.url}/v1/responses/{response_id}", method="DELETE")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_store_false_keeps_nothing(chat_server: Server) -> None:
    r = _create(chat_server, input=QUESTION, store=False, max_output_tokens=2)
    assert r.output_text
    with pytest.raises(openai.NotFoundError):
        chat_server.client().responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as caught:
        _create(chat_server, input="Go on.", previous_response_id=r.id)
    assert caught.value.param == "previous_response_id"


def test_an_unknown_id_is_a_404_in_openai_s_shape(chat_server: Server) -> None:
    status, body = chat_server.get("/v1/responses/resp_nothing")
    assert status == 404
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        chat_server.client().responses.retrieve("resp_nothing")


FUNCTION: Any = TOOL
BAD: list[tuple[dict[str, Any], str]] = [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "model": 5}, "model"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # reasoning alone asks nothing
    ({"input": [_user("x"), {"role": "user", "content": 3}]}, "input[1].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{**FUNCTION, "parameters": "no"}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [{**FUNCTION, "description": 1}]}, "tools[0].description"),
    ({"input": "x", "tools": [{**FUNCTION, "strict": "yes"}]}, "tools[0].strict"),
    ({"input": "x", "tools": [FUNCTION, FUNCTION]}, "tools[1]"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [FUNCTION], "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"input": "x", "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "f"}},
        "tool_choice",
    ),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
        "text.format.schema",
    ),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        "text.format.name",
    ),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "store": 1}, "store"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
]


def test_bad_fields_are_400s_naming_them(chat_server: Server) -> None:
    for body, param in BAD:
        status, reply = chat_server.post("/v1/responses", json.dumps(body).encode())
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == param, (body, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        _create(chat_server, input="x", temperature=5)
    assert caught.value.param == "temperature"


def test_a_stream_dropped_mid_way_gives_its_sequence_back(chat_server: Server) -> None:
    client = chat_server.client()
    before = _disconnects(chat_server)
    for i in range(3):
        stream = client.responses.create(
            model="x", input=f"Write a long story, number {i}.", max_output_tokens=400, stream=True
        )
        for received, event in enumerate(stream, start=1):
            if received >= 5:
                assert event.type == "response.output_text.delta"
                break
        stream.close()
        chat_server.assert_at_rest()
    assert _disconnects(chat_server) > before
    assert _create(chat_server, input=QUESTION, max_output_tokens=2).output_text


def _disconnects(server: Server) -> float:
    match = [
        line
        for line in server.metrics_text().splitlines()
        if line.startswith('kvfork_client_disconnects_total{endpoint="responses"}')
    ]
    return float(match[0].split()[-1]) if match else 0.0


def test_the_store_flags_bound_it(serve: Any) -> None:
    server: Server = serve(
        "chat", "--n-ctx", "2048", "--n-seq-max", "2", "--max-stored-responses", "2"
    )
    ids = [_create(server, input=f"Say {i}.", max_output_tokens=1).id for i in range(3)]
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used went first
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    server.assert_at_rest()


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(serve: Any) -> None:
    server: Server = serve("chat", "--n-ctx", "2048", "--n-seq-max", "2", "--shutdown-seconds", "1")
    stream = server.client().responses.create(
        model="x",
        input="Count from 1 to 1000, separated by commas.",
        temperature=0,
        max_output_tokens=3000,
        stream=True,
    )
    events = iter(stream)
    kinds: list[str] = [next(events).type for _ in range(5)]
    assert kinds[-1] == "response.output_text.delta"
    server.process.terminate()
    with contextlib.suppress(openai.APIConnectionError):
        kinds += [e.type for e in events]
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert server.process.wait(timeout=30) == 0
    assert "shutting down" in server.stop()


def _stored(size: int) -> Stored:
    return Stored(response={}, conversation=(), conversation_size=size, size=size)


def test_the_store_drops_the_least_recently_used_past_its_count_or_bytes() -> None:
    store = ResponseStore(max_count=3, max_bytes=100)
    for i in range(3):
        store.put(f"r{i}", _stored(30))
    assert store.get("r0") is not None  # now the most recently used
    store.put("r3", _stored(30))
    assert [store.get(f"r{i}") is not None for i in range(4)] == [True, False, True, True]
    store.put("r4", _stored(50))  # 140 bytes: the two least recently used go
    assert store.count == 2 and store.bytes == 80 and store.get("r0") is store.get("r2") is None
    store.put("big", _stored(101))  # larger than the whole store: not kept, nothing dropped
    assert store.get("big") is None and store.count == 2 and store.bytes == 80
    assert store.delete("r4") and not store.delete("r4") and store.bytes == 30
