"""`kvfork serve` as its users use it: a real server process on 127.0.0.1 and the `openai`
package as the client (chat model and default model). Every request loop here is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import kvfork
import openai
import pytest

from .conftest import ON_CPU, SLOW_PREFILL_BATCH, assert_same_text, greedy_with_margins, margin
from .serving import (
    Server,
    assert_used_servers_at_rest,
    bench_serve_module,
    logprob_margin,
    servers,
)

SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    """Start `kvfork serve` processes on loopback; each stops with SIGTERM at the end of the
    module and must exit cleanly (status 0, no traceback)."""
    yield from servers()


@pytest.fixture(autouse=True)
def _every_sequence_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test, each server it used is at rest."""
    yield
    assert_used_servers_at_rest(request, "chat_server", "base_server", "small_server")


@pytest.fixture(scope="module")
def chat_server(serve: Any) -> Server:
    server: Server = serve("chat", "--n-ctx", "8192", "--n-seq-max", "8", "--embeddings")
    return server


@pytest.fixture(scope="module")
def base_server(serve: Any) -> Server:
    server: Server = serve("default", "--n-ctx", "4096", "--n-seq-max", "6")
    return server


def _no_stop(ctx: kvfork.Context) -> dict[str, int]:
    """A request's `logit_bias` that bans every end-of-generation token (the reply runs to
    `max_tokens`)."""
    return {str(t): -100 for t in range(ctx.vocab_size) if ctx.is_stop_token(t)}


def _messages(question: str = QUESTION) -> list[Any]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_plain_and_streamed_chat_equal_each_other_and_the_library(chat_server: Server) -> None:
    client = chat_server.client()
    plain = client.chat.completions.create(
        model="anything", messages=_messages(), temperature=0, max_tokens=24
    )
    text = plain.choices[0].message.content
    assert text and "Paris" in text and plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None and plain.usage.completion_tokens > 0
    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model="anything",
        messages=_messages(),
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == text
    # The second request found the whole prompt but its last token in the prefix cache.
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=2048) as ctx:
        chat = kvfork.Chat(ctx, params={"temperature": 0.0}, system=SYSTEM)
        assert chat.send_sync(QUESTION, max_tokens=24) == text


def test_n_choices_share_one_prefill_and_their_decodes(chat_server: Server) -> None:
    client = chat_server.client()
    before_prompt = chat_server.metric("kvfork_prompt_tokens_total")
    before_decodes = chat_server.metric("kvfork_decode_calls_total")
    reply = client.chat.completions.create(
        model="x", messages=_messages("Name a fruit."), temperature=1.0, seed=3, max_tokens=8, n=4
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage is not None
    prompt = reply.usage.prompt_tokens
    assert chat_server.metric("kvfork_prompt_tokens_total") - before_prompt == prompt
    decodes = chat_server.metric("kvfork_decode_calls_total") - before_decodes
    assert decodes <= 1 + 8 + 2, f"{decodes} decodes for 4 choices of 8 tokens"


def test_a_json_schema_response_validates(chat_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = chat_server.client().chat.completions.create(
        model="x",
        messages=_messages("Describe a person."),
        temperature=0.7,
        seed=1,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
    )
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), schema)


def test_a_required_tool_call_parses_and_its_arguments_validate(chat_server: Server) -> None:
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": params,
            },
        }
    ]
    for stream in (False, True):
        kwargs: Any = {
            "model": "x",
            "messages": _messages("What is the weather in Paris?"),
            "temperature": 0,
            "max_tokens": 48,
            "tools": tools,
            "tool_choice": "required",
            # In every call's JSON: a constrained reply is not cut (it came back as "{" text).
            "stop": ['"', "\n"],
        }
        if stream:  # the id and name first, then the arguments in fragments
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in chat_server.client().chat.completions.create(stream=True, **kwargs):
                for part in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                    assert part.function is not None
                    if part.id is not None:
                        assert not call["name"] and part.function.name
                        call["name"] = part.function.name
                    call["arguments"] += part.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert list(calls) == [0]
            name, arguments = calls[0]["name"], calls[0]["arguments"]
        else:
            reply = chat_server.client().chat.completions.create(**kwargs)
            whole = list(reply.choices[0].message.tool_calls or [])
            finish = reply.choices[0].finish_reason
            assert len(whole) == 1
            name, arguments = whole[0].function.name, whole[0].function.arguments
        assert finish == "tool_calls" and name == "get_weather"
        jsonschema.validate(json.loads(arguments), params)


def _posted(server: Server, path: str, body: bytes, *, length: int | None = None) -> socket.socket:
    """A connection that sent `POST path` with `body` (announced as `length` bytes: more than
    it sends, for a body still arriving), the reply not read yet."""
    sock = socket.create_connection(server.address, timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body) if length is None else length}\r\n".encode()
        + b"Connection: close\r\n\r\n"
        + body
    )
    return sock


def _reply_to_close(sock: socket.socket) -> tuple[bytes, bytes]:
    """The reply's head and body, read until the server closes the connection."""
    with sock:
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_embeddings(chat_server: Server) -> None:
    reply = chat_server.client().embeddings.create(model="x", input=["A cat.", "A kitten."])
    assert len(reply.data) == 2
    a, b = (d.embedding for d in reply.data)
    assert len(a) == len(b) > 10
    assert abs(sum(x * x for x in a) - 1.0) < 1e-3  # normalized


def test_an_embeddings_batch_whose_client_left_stops(chat_server: Server) -> None:
    """Many texts take minutes on a CPU: a batch whose client hung up stops (its decode is
    aborted; counted as 499, not answered to nobody) and the next request is served at once.
    More texts than OpenAI's 2,048 are a 400."""
    texts = ["Words of a long document go on and on. " * 25] * 2048
    body = json.dumps({"model": "x", "input": texts}).encode()
    status, reply = chat_server.post(
        "/v1/embeddings", json.dumps({"input": [*texts, "x"]}).encode()
    )
    assert status == 400 and reply["error"]["param"] == "input", reply

    def gone() -> float:  # embeddings requests whose client left
        pattern = r'^kvfork_requests_total\{endpoint="embeddings",status="499"\} (\S+)$'
        match = re.search(pattern, chat_server.metrics_text(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    before = gone()
    with _posted(chat_server, "/v1/embeddings", body):
        time.sleep(1.0)
    deadline = time.monotonic() + 30
    while gone() == before:
        assert time.monotonic() < deadline, chat_server.metrics_text()
        time.sleep(0.05)
    embedded = chat_server.client().embeddings.create(model="x", input=["A cat."])
    assert len(embedded.data) == 1


def test_a_small_embeddings_request_is_not_held_behind_a_large_one(chat_server: Server) -> None:
    """A large batch runs a slice of inputs at a time: a one-text request sent after it
    starts is answered before it ends (it waited for the whole batch)."""
    texts = ["Words of a long document go on and on. " * 20] * 24  # 3 slices of 8
    big = _posted(chat_server, "/v1/embeddings", json.dumps({"input": texts}).encode())
    time.sleep(0.5)
    small = chat_server.client().embeddings.create(model="x", input=["A cat."])
    assert len(small.data) == 1
    big.settimeout(0.05)  # the large one still runs: no reply yet
    with pytest.raises(TimeoutError):
        big.recv(1)
    big.settimeout(300)
    head, body = _reply_to_close(big)
    assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["data"]) == 24


def test_embeddings_take_the_model_s_own_dimensions_only(chat_server: Server) -> None:
    client = chat_server.client()
    width = len(client.embeddings.create(model="x", input="A cat.").data[0].embedding)
    same = client.embeddings.create(model="x", input="A cat.", dimensions=width)
    assert len(same.data[0].embedding) == width
    for dimensions in (16, 0, "a"):
        status, reply = chat_server.post(
            "/v1/embeddings", json.dumps({"input": "A cat.", "dimensions": dimensions}).encode()
        )
        assert status == 400 and reply["error"]["param"] == "dimensions", reply


def test_embeddings_inputs_may_be_as_long_as_n_batch(serve: Any) -> None:
    """`--n-batch` (and `--threads`) reach the embedding context too."""
    server = serve("chat", "--n-ctx", "2048", "--n-seq-max", "2", "--embeddings")
    wide = serve("chat", "--n-ctx", "2048", "--n-seq-max", "2", "--embeddings", "--n-batch", "1024")
    text = "word " * 700
    status, reply = server.post("/v1/embeddings", json.dumps({"input": text}).encode())
    assert status == 400 and "longer than 512" in reply["error"]["message"], reply
    assert len(wide.client().embeddings.create(model="x", input=text).data) == 1
    server.stop()
    wide.stop()


def test_models_lists_the_file_stem(chat_server: Server) -> None:
    models = chat_server.client().models.list()
    assert [m.id for m in models.data] == [kvfork.default_chat_model_path().stem]


def test_completions_on_the_base_model_equal_the_library(base_server: Server) -> None:
    reply = base_server.client().completions.create(
        model="x", prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0
    )
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=512) as ctx:
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize("1, 2, 3, 4, 5,"))
        expected = "".join(t.text for t in b.generate_sync(8))
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "length"
    logprobs = (
        base_server.client()
        .completions.create(model="x", prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    assert logprobs is not None and len(logprobs.tokens or []) == 3
    assert all(len(t) == 2 for t in logprobs.top_logprobs or [])


@pytest.mark.parametrize("scratch", [True, False], ids=["scratch", "mixed"])
def test_requests_arriving_while_others_stream_get_their_tokens_alone(
    serve: Any, base_server: Server, scratch: bool
) -> None:
    """Continuous batching as a server sees it: requests of every length arrive one by one
    while the earlier ones stream; each completion equals the library's greedy text alone,
    up to its first near-tie. Beside a busy cache new prompts decode in the scratch context
    (the streams step apart); without it, prompt chunks and the streams' steps share decodes
    (`kvfork_mixed_decodes_total`), here with a 256-token `--n-batch`."""
    server = (
        base_server
        if scratch
        else serve(
            "default",
            "--n-ctx",
            "4096",
            "--n-seq-max",
            "6",
            "--n-batch",
            "256",
            env={"KVFORK_NO_SCRATCH_PREFILL": "1"},
        )
    )
    words = " ".join(f"item {i}," for i in range(400))
    prompts = [f"{k}, {k + 1}, {k + 2}," + words[:n] for k, n in enumerate([3000, 60, 1800, 300])]
    n_tokens = 16 if ON_CPU else 48  # a GPU steps ~100 times faster: longer streams
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=2048) as ctx:
        expected = []
        for prompt in prompts:
            b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
            b.prefill_sync(ctx.tokenize(prompt))
            tokens, margins = greedy_with_margins(b, n_tokens)
            clear = next((i for i, m in enumerate(margins) if m < 1.0), n_tokens)
            expected.append("".join(ctx.token_to_text(t) for t in tokens[:clear]))
            b.prune_sync()

    streaming = [asyncio.Event() for _ in prompts]

    async def request(client: openai.AsyncOpenAI, k: int) -> str:
        if k:  # sent once the one before has its first token: while it streams
            await streaming[k - 1].wait()
        pieces = []
        try:
            stream = await client.completions.create(
                model="x", prompt=prompts[k], max_tokens=n_tokens, temperature=0, stream=True
            )
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].text)
                    streaming[k].set()
        finally:
            streaming[k].set()
        return "".join(pieces)

    async def all_requests() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(request(client, k) for k in range(len(prompts))))

    mixed = server.metric("kvfork_mixed_decodes_total")
    texts = asyncio.run(all_requests())
    if not scratch:
        assert server.metric("kvfork_mixed_decodes_total") > mixed
    for text, prefix in zip(texts, expected, strict=True):
        assert text.startswith(prefix), (text, prefix)
    server.assert_at_rest()


BAD = [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b"[1, 2]", None),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    (
        "/v1/chat/completions",
        b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}',
        "model",
    ),
    ("/v1/embeddings", b'{"model": ["x"], "input": "x"}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        "temperature",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        "max_tokens",
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', "n"),
    # Integers too large for a float (valid JSON): compared, never converted first.
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}",
        "temperature",
    ),
    ("/v1/completions", b'{"prompt": "x", "min_p": -1' + b"0" * 400 + b"}", "min_p"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "lora": [{"id": 0, "scale": 1'
        + b"0" * 400
        + b"}]}",
        "lora",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}',
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        (
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": '
            b'{"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}'
        ),
        "response_format",
    ),
    (
        "/v1/chat/completions",
        (
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": '
            b'{"type": "function", "function": {"name": "g"}}}'
        ),
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "' + b"word " * 9000 + b'"}]}',
        "messages",
    ),
    ("/v1/completions", b'{"prompt": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": [1, -3]}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": [1]}', "stop"),
    ("/v1/completions", b'{"prompt": "x", "suffix": "y"}', "suffix"),
    ("/v1/completions", b'{"prompt": "x", "best_of": 3}', "best_of"),
    ("/v1/completions", b'{"prompt": "x", "n": 2, "best_of": 1}', "best_of"),
    ("/v1/embeddings", b'{"input": 5}', "input"),
    # Valid JSON that is not text: a lone UTF-16 surrogate, in a value or a key, anywhere.
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages",
    ),
    ("/v1/completions", b'{"prompt": "x\\udfff"}', "prompt"),
    ("/tokenize", b'{"content": "\\udc00"}', "content"),
    ("/v1/responses", b'{"input": "hi", "metadata": {"k": "\\ud83d"}}', "metadata"),
    (
        "/v1/responses",
        b'{"input": "hi", "text": {"format": {"type": "text", "n\\ud800": 1}}}',
        "text",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": ['
            b'{"type": "function", "function": {"name": "f"}}, '
            b'{"type": "function", "function": {"name": "f"}}]}'
        ),
        "tools",
    ),
    # Numbers JSON has not: a reply echoing one (a tool's schema) could not be written.
    (
        "/v1/responses",
        (
            b'{"input": "hi", "tools": [{"type": "function", "name": "f", '
            b'"parameters": {"type": "object", "maximum": NaN}}]}'
        ),
        None,
    ),
    ("/v1/chat/completions", b'{"messages": [], "temperature": -Infinity}', None),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', None),
    (
        "/v1/chat/completions",
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream": true, '
            b'"stream_options": {"include_usage": "yes"}}'
        ),
        "stream_options.include_usage",
    ),
    # A required call's schema that cannot be compiled: the tools are at fault.
    (
        "/v1/chat/completions",
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
            b'"tools": [{"type": "function", "function": {"name": "f", '
            b'"parameters": {"type": "strin"}}}]}'
        ),
        "tools",
    ),
    # Only an assistant turn may leave its content out.
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "messages[0]"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "system", "content": null}, {"role": "user", "content": "x"}]}',
        "messages[0]",
    ),
    # An assistant's tool calls that are not OpenAI's shape.
    *(
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}, '
            b'{"role": "assistant", "tool_calls": ' + calls + b"}]}",
            "messages[1]",
        )
        for calls in (b'"abc"', b"[1]", b'[{"function": "f"}]', b'{"a": 1}', b'[{"function": {}}]')
    ),
]


def test_bad_requests_get_400_naming_the_field_and_leak_nothing(chat_server: Server) -> None:
    for path, body, param in BAD:
        status, reply = chat_server.post(path, body)
        assert status == 400, (body[:80], status, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body[:80], error)
    assert chat_server.metric("kvfork_sequences_requests") == 0
    answer = chat_server.client().chat.completions.create(
        model="x", messages=_messages(), temperature=0, max_tokens=4
    )
    assert answer.choices[0].message.content


def test_chat_on_a_model_without_a_template_is_a_400(base_server: Server) -> None:
    status, reply = base_server.post(
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'
    )
    assert status == 400 and "--chat-template" in reply["error"]["message"], reply


def test_a_client_that_disconnects_gives_its_lease_back(chat_server: Server) -> None:
    body = json.dumps(
        {
            "model": "x",
            "messages": _messages("Write a very long story."),
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0.8,
        }
    ).encode()
    host, port = chat_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data:" not in received:  # the stream began
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream"
            received += chunk
        assert chat_server.metric("kvfork_sequences_requests") == 1
    deadline = time.monotonic() + 20
    while chat_server.metric("kvfork_sequences_requests") != 0:
        assert time.monotonic() < deadline, "the lease did not come back"
        time.sleep(0.1)


def test_the_event_loop_is_uvloop_where_installed(serve: Any) -> None:
    """`--loop auto` (the default) runs uvloop, which the server extra installs (less time
    on each streamed token); `--loop asyncio` asyncio's own. Both stream, and stop cleanly."""
    pytest.importorskip("uvloop")
    for loop, name in (("auto", "uvloop"), ("asyncio", "asyncio")):
        server: Server = serve("chat", "--n-ctx", "512", "--n-seq-max", "2", "--loop", loop)
        stream = server.client().completions.create(
            model="x", prompt="Hello", max_tokens=4, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices)
        assert f"; loop {name})" in server.stop()


def test_a_warmup_runs_each_shape_once_and_gives_everything_back(serve: Any) -> None:
    """`--warmup on` prefills a batch, steps forks together and one branch alone before the
    first request (on a GPU the first use of each shape loads its kernels); afterwards every
    sequence is free and replies are as without it. `auto` (the default) warms only when layers
    are on a GPU, so not on the CPU."""
    replies = []
    for choice in ("on", "auto"):
        server: Server = serve(
            "chat", "--n-ctx", "512", "--n-seq-max", "4", "--n-batch", "32", "--warmup", choice
        )
        decodes = server.metric("kvfork_decode_calls_total")
        assert server.metric("kvfork_leases_in_use") == 0
        assert server.get("/health")[1]["free_sequences"] == 4
        reply = server.client().completions.create(
            model="x", prompt="Hello", max_tokens=6, temperature=0
        )
        replies.append(reply.choices[0].text)
        log = server.stop()
        if choice == "on" or kvfork.system_info()["gpu_offload"]:
            assert decodes == 3 and ", warm-up " in log
        else:
            assert decodes == 0 and "warm-up" not in log
    assert replies[0] == replies[1]


def test_the_benchmarks_bare_client_reads_what_the_openai_client_reads(serve: Any) -> None:
    """bench_serve.py's bursts through the openai client and through bare connections (`--client
    raw`, chunked transfer decoded by hand) against a real server: both read every stream to
    its [DONE] and time a first token; the raw one fails loudly on an error status."""
    bench = bench_serve_module()
    server: Server = serve("chat", "--n-ctx", "2048", "--n-seq-max", "8")
    prompts = [
        f"The history of {topic} begins with" for topic in ("rivers", "salt", "trains", "music")
    ]
    for raw in (False, True):
        wall, ttft, cpu = asyncio.run(bench.burst(server.url, prompts, raw))
        assert 0 < ttft <= wall and cpu > 0
    locked: Server = serve("chat", "--n-ctx", "512", "--n-seq-max", "1", "--api-key", "k")
    with pytest.raises(RuntimeError, match="401"):
        asyncio.run(bench.burst(locked.url, prompts[:1], True))


def test_api_key_and_a_full_queue(serve: Any, chat_ctx: kvfork.Context) -> None:
    server: Server = serve(
        "chat", "--n-ctx", "2048", "--n-seq-max", "1", "--max-queue", "1", "--api-key", "secret"
    )
    status, reply = server.post("/v1/chat/completions", b"{}")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, headers, _ = server.post_raw("/v1/chat/completions", b"{}")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    # The scheme in any case (RFC 7235); the probes' routes need no key.
    lower = urllib.request.Request(
        server.url + "/v1/models", headers={"Authorization": "bearer secret"}
    )
    with urllib.request.urlopen(lower, timeout=10) as resp:
        assert resp.status == 200
    assert server.get("/health")[0] == 200
    # A stream holds the one sequence until the test drops it (its stop tokens banned, more
    # tokens than the rest takes on any machine: on a GPU 64 would be done in 0.1 s).
    holder = server.client("secret").chat.completions.create(
        model="x",
        messages=_messages(),
        max_tokens=1500,
        temperature=0,
        stream=True,
        logit_bias=_no_stop(chat_ctx),
    )
    next(iter(holder))
    body = json.dumps({"messages": _messages(), "max_tokens": 16, "temperature": 0}).encode()
    results: list[int] = []
    together = threading.Barrier(3)

    def call() -> None:
        together.wait()
        results.append(server.post("/v1/chat/completions", body, key="secret")[0])

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    # One waits in the queue, the two others are refused at once with 503.
    deadline = time.monotonic() + 60
    while len(results) < 2:
        assert time.monotonic() < deadline, results
        time.sleep(0.02)
    assert results == [503, 503]
    holder.close()  # the dropped stream gives its sequence back: the queued request runs
    for t in threads:
        t.join(timeout=120)
    assert results == [503, 503, 200]
    server.assert_at_rest()


# ---- a server that never wedges: every sequence comes back, pressure gets 200/4xx/503 ----


@pytest.fixture(scope="module")
def small_server(serve: Any) -> Server:
    """Few sequences, so that leaks and pressure show at once."""
    server: Server = serve(
        "chat", "--n-ctx", "4096", "--n-seq-max", "4", "--max-queue", "4", "--stall-seconds", "2"
    )
    return server


STORY: Any = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
#: The chat model's stop tokens banned: a stream that must outlast the test's checks.
NO_STOP = {"0": -100, "2": -100, "4": -100}


def _answers_at_once(server: Server) -> None:
    """A plain request gets its answer (every earlier request gave its sequences back)."""
    reply = server.client(timeout=30).chat.completions.create(
        model="x", messages=_messages(), temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.content


@pytest.mark.parametrize("k", [0, 1, 3])
def test_streams_closed_after_k_chunks_give_every_sequence_back(
    small_server: Server, k: int
) -> None:
    client = small_server.client()
    for i in range(2 * 4):  # twice the server's sequences
        stream = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}],
            max_tokens=500,
            temperature=0.8,
            stream=True,
        )
        for received, _ in enumerate(stream, start=1):
            if received >= k:
                break
        stream.close()
        small_server.assert_at_rest()
    _answers_at_once(small_server)
    assert small_server.metric('kvfork_client_disconnects_total{endpoint="chat"}') > 0


def test_async_streams_closed_mid_way_give_every_sequence_back(small_server: Server) -> None:
    async def drop(i: int) -> None:
        client = small_server.async_client()
        stream = await client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": f"Write a long poem, number {i}."}],
            max_tokens=500,
            stream=True,
        )
        async for _ in stream:
            break
        await stream.close()
        await client.close()

    async def main() -> None:
        await asyncio.gather(*(drop(i) for i in range(6)))  # more than the sequences

    asyncio.run(main())
    small_server.assert_at_rest()
    _answers_at_once(small_server)


def test_a_tcp_reset_mid_stream_gives_the_sequences_back(small_server: Server) -> None:
    body = json.dumps(
        {"messages": STORY, "max_tokens": 500, "stream": True, "n": 2, "temperature": 1.0}
    ).encode()
    for _ in range(3):
        with socket.create_connection(small_server.address, timeout=30) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while received.count(b"data:") < 3:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the stream"
                received += chunk
            # SO_LINGER 0: close() sends a reset, not a FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    small_server.assert_at_rest()
    _answers_at_once(small_server)


def test_a_tool_call_stream_closed_mid_call_gives_the_sequence_back(
    small_server: Server,
) -> None:
    stream = small_server.client().chat.completions.create(**WEATHER_CALL, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            break  # the call's id and name arrived; its arguments did not
    stream.close()
    small_server.assert_at_rest()
    _answers_at_once(small_server)


def test_n_choices_on_a_full_prefix_cache_evict_entries_instead_of_failing(
    small_server: Server,
) -> None:
    client = small_server.client()
    for i in range(6):  # distinct prompts: the cache fills every sequence with entries
        client.completions.create(model="x", prompt=f"Fact number {i}:", max_tokens=2)
    assert small_server.sequences()["cache"] == 4
    for n in (2, 3, 4):
        chat = client.chat.completions.create(
            model="x", messages=_messages(f"Name {n} colours."), max_tokens=6, n=n, seed=n
        )
        assert len(chat.choices) == n
        completion = client.completions.create(
            model="x", prompt=f"A list of {n} animals:", max_tokens=6, n=n, seed=n
        )
        assert len(completion.choices) == n
    assert small_server.metric("kvfork_prefix_cache_evictions_total") > 0


def test_replies_outgrowing_the_cells_left_by_entries_evict_them_as_they_go(
    serve: Any, chat_model: kvfork.Model
) -> None:
    """A reply needs a KV cell a token: when the prefix cache's entries hold the rest, it
    evicts them as it goes; with none left (its own `n` choices hold every cell) its choices
    end with "length". Never a 500, and every sequence comes back."""
    server: Server = serve("chat", "--n-ctx", "1024", "--n-seq-max", "4")
    client = server.client()
    with kvfork.create_context_sync(chat_model, n_ctx=256, n_seq_max=1) as ctx:
        no_stop = _no_stop(ctx)
    words = [1000 + (i * 7919) % 30000 for i in range(1200)]  # prompts sharing nothing
    first = client.completions.create(model="x", prompt=words[:400], max_tokens=4)
    assert first.usage is not None and first.usage.completion_tokens == 4
    # 404 + 400 + 300 cells > 1,024: its last ~80 tokens need the first request's entry gone.
    reply = client.completions.create(
        model="x", prompt=words[400:800], max_tokens=300, logit_bias=no_stop
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 300
    assert reply.choices[0].finish_reason == "length"
    assert server.metric("kvfork_prefix_cache_evictions_total") >= 1
    # Three choices of 300 after a 400-token prompt cannot all fit: they end at the cells left.
    crowded = client.completions.create(
        model="x", prompt=words[800:1200], max_tokens=300, n=3, logit_bias=no_stop
    )
    assert crowded.usage is not None
    assert 3 <= crowded.usage.completion_tokens <= 1024 - 400
    assert [c.finish_reason for c in crowded.choices] == ["length"] * 3
    server.assert_at_rest()


def test_a_crowd_gets_answers_or_503_with_retry_after_never_500(small_server: Server) -> None:
    def call(i: int) -> tuple[int, dict[str, str]]:
        body = json.dumps(
            {"messages": _messages(f"Count to {i}."), "max_tokens": 12, "n": 1 + i % 3}
        ).encode()
        status, headers, _ = small_server.post_raw("/v1/chat/completions", body)
        return status, headers

    results: list[tuple[int, dict[str, str]]] = []
    threads = [threading.Thread(target=lambda i=i: results.append(call(i))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 16
    statuses = sorted(status for status, _ in results)
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4, statuses
    for status, headers in results:
        if status == 503:
            assert headers.get("retry-after") == "1"
    small_server.assert_at_rest()


def test_health_says_busy_then_degraded_while_requests_wait(serve: Any) -> None:
    server: Server = serve(
        "chat", "--n-ctx", "4096", "--n-seq-max", "1", "--max-queue", "2", "--stall-seconds", "1"
    )
    assert server.get("/health") == (200, {"status": "ok", "free_sequences": 1, "queue": 0})
    long = server.client().chat.completions.create(
        model="x",
        messages=STORY,
        max_tokens=2000,
        temperature=0.8,
        stream=True,
        logit_bias=NO_STOP,  # it cannot end before the test ends it
    )
    next(iter(long))  # it holds the only sequence
    queued = threading.Thread(
        target=lambda: server.post("/v1/chat/completions", json.dumps(
            {"messages": _messages(), "max_tokens": 2}).encode())
    )  # fmt: skip
    queued.start()
    deadline = time.monotonic() + 10
    while server.get("/health")[1]["queue"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, state = server.get("/health")
    assert (status, state["status"], state["free_sequences"]) == (200, "busy", 0)
    time.sleep(1.2)
    status, state = server.get("/health")
    assert (status, state) == (503, {"status": "degraded", "free_sequences": 0, "queue": 1})
    long.close()
    queued.join(timeout=60)
    assert server.get("/health") == (200, {"status": "ok", "free_sequences": 1, "queue": 0})
    server.assert_at_rest()


# ---- streams as OpenAI sends them ----

WEATHER_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
#: A chat request that must call `get_weather` (its arguments constrained to the schema).
WEATHER_CALL: Any = {
    "model": "x",
    "messages": _messages("What is the weather in Paris?"),
    "max_tokens": 48,
    "temperature": 0,
    "tools": WEATHER_TOOLS,
    "tool_choice": "required",
}


def test_every_stream_opens_with_the_role_of_each_choice(chat_server: Server) -> None:
    firsts: dict[int, Any] = {}
    for chunk in chat_server.client().chat.completions.create(
        model="x", messages=_messages(), max_tokens=6, n=2, seed=1, stream=True
    ):
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.delta)
    assert sorted(firsts) == [0, 1]
    assert all(delta.role == "assistant" for delta in firsts.values())


def test_a_streamed_tool_call_accumulates_as_openai_s_own_client_reads_it(
    chat_server: Server,
) -> None:
    # The `openai` package's stream helper accumulates deltas (tool calls included) into the
    # final completion. Limits: it parses arguments into objects only for strict tools.
    with chat_server.client().chat.completions.stream(**WEATHER_CALL) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert kinds[0] == "chunk" and "tool_calls.function.arguments.delta" in kinds
    assert kinds.count("tool_calls.function.arguments.done") == 1
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.role == "assistant"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    call = calls[0].function
    assert call.name == "get_weather" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOLS[0]["function"]["parameters"])


def test_plain_text_accumulates_as_openai_s_own_client_reads_it(chat_server: Server) -> None:
    plain = chat_server.client().chat.completions.create(
        model="x", messages=_messages(), temperature=0, max_tokens=16, logprobs=True, top_logprobs=2
    )
    with chat_server.client().chat.completions.stream(
        model="x", messages=_messages(), temperature=0, max_tokens=16
    ) as stream:
        # What the client accumulated (its get_final_completion refuses a reply that ends at
        # max_tokens, as one may that parts from the plain reply at a near-tie).
        final = stream.until_done().current_completion_snapshot
    message = final.choices[0].message
    assert message.role == "assistant"
    # The second request finds the prompt in the prefix cache: the plain reply's text up to a
    # near-tie of its rows (bit for bit on this CPU, not on a GPU).
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    entries = plain.choices[0].logprobs.content
    margins = [logprob_margin(t.logprob for t in entry.top_logprobs) for entry in entries]
    expected = plain.choices[0].message.content or ""
    assert_same_text(message.content or "", expected, [e.token for e in entries], margins)


# ---- no request can stall the others ----


def _timed_chat(server: Server) -> float:
    start = time.monotonic()
    _answers_at_once(server)
    return time.monotonic() - start


def test_a_client_gone_before_its_body_is_read_counts_as_gone_not_as_an_error(
    small_server: Server,
) -> None:
    """A body announced longer than what the client sends before it closes: a 499 in the
    metrics, as any client that went away, not a 500."""

    def disconnects() -> float:
        found = re.findall(
            r"^kvfork_client_disconnects_total\{.*\} (\S+)$",
            small_server.metrics_text(),
            re.MULTILINE,
        )
        return sum(map(float, found))

    gone = disconnects()
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        with socket.create_connection(small_server.address, timeout=30) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n".encode()
                + b'{"messages": ['
            )
            time.sleep(0.2)  # its handler is reading the body
    deadline = time.monotonic() + 10
    while disconnects() < gone + 3:
        assert time.monotonic() < deadline, small_server.metrics_text()
        time.sleep(0.1)
    assert 'status="500"' not in small_server.metrics_text()


def test_a_client_gone_during_a_long_prefill_aborts_it_and_frees_its_sequences_at_once(
    small_server: Server,
) -> None:
    """A prompt of thousands of tokens takes seconds to prefill here: its client closing
    aborts the prefill (rolled back) and its sequences come back at once, so the request
    after it does not wait for the abandoned work."""
    alone = min(_timed_chat(small_server) for _ in range(2))
    body = json.dumps(
        {"prompt": "word " * 3000, "max_tokens": 8, "n": 3, "temperature": 0.8}
    ).encode()
    with socket.create_connection(small_server.address, timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 20
        while small_server.metric("kvfork_sequences_admitted") != 3:  # prefilling
            assert time.monotonic() < deadline, small_server.metrics_text()
            time.sleep(0.05)
        time.sleep(0.3)
    left = time.monotonic()
    while small_server.metric("kvfork_sequences_admitted") != 0:
        assert time.monotonic() - left < 2.0, "the sequences stayed with the abandoned prefill"
        time.sleep(0.05)
    after = _timed_chat(small_server)
    assert after < alone + 2.0, (alone, after)


def test_sigterm_during_a_prefill_answers_503_in_json(serve: Any) -> None:
    """A shutdown's grace ending while requests still prefill: they are aborted and answered
    with the documented 503 (JSON, `shutting_down`), not uvicorn's plain 500. (Prompts in small
    decodes, SLOW_PREFILL_BATCH, still prefill after the grace on a GPU too.)"""
    server: Server = serve(
        "chat",
        "--n-ctx",
        "4096",
        "--n-seq-max",
        "2",
        "--shutdown-seconds",
        "1",
        "--n-batch",
        str(SLOW_PREFILL_BATCH),
    )
    socks = []
    for stream in (True, False):
        body = json.dumps({"prompt": "word " * 3000, "max_tokens": 8, "stream": stream}).encode()
        socks.append(_posted(server, "/v1/completions", body))
    deadline = time.monotonic() + 20
    while server.metric("kvfork_sequences_admitted") != 2:  # both prefilling
        assert time.monotonic() < deadline, server.metrics_text()
        time.sleep(0.05)
    server.process.terminate()
    for sock in socks:
        head, body = _reply_to_close(sock)
        assert head.startswith(b"HTTP/1.1 503"), (head, body[:300])
        assert json.loads(body)["error"]["code"] == "shutting_down", body[:300]
    assert server.process.wait(timeout=30) == 0
    assert "Exception in ASGI application" not in server.stop()


def test_a_body_over_the_limit_is_a_413_before_it_is_read(small_server: Server) -> None:
    with socket.create_connection(small_server.address, timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 52428800\r\n\r\n"
            b'{"messages": [{"role": "user", "content": "'
        )  # 50 MB announced, none of it sent
        reply = b""
        while not reply.endswith(b"}"):  # the status, the headers, then the JSON error
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert sock.recv(65536) == b""  # closed: the rest of the body is never read
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"connection: close" in reply.lower()
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_too_large" and "16 MiB" in error["message"]
    # Chunked, with no Content-Length: refused once what was read passes the limit.
    conn = http.client.HTTPConnection(*small_server.address, timeout=30)
    parts = [b'{"messages": "', *([b"x" * (1 << 20)] * 17), b'"}']
    # Refused before the client sent it all: the answer is still there to read.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn.request("POST", "/v1/chat/completions", body=iter(parts), encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()


def test_deeply_nested_json_is_a_400(small_server: Server) -> None:
    for depth in (100, 100_000):
        body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
        status, reply = small_server.post("/v1/chat/completions", body, timeout=30)
        assert status == 400 and "nested" in reply["error"]["message"], (depth, reply)


def test_a_small_request_beside_a_huge_one_answers_in_its_usual_time(
    small_server: Server,
) -> None:
    alone = min(_timed_chat(small_server) for _ in range(3))
    huge = json.dumps(
        {"messages": [{"role": "user", "content": "word " * (3 << 20)}]}  # 15 MB
    ).encode()
    outcome: list[int] = []
    heavy = threading.Thread(
        target=lambda: outcome.append(small_server.post("/v1/chat/completions", huge)[0])
    )
    heavy.start()
    time.sleep(0.3)  # it is being parsed and tokenized
    beside = _timed_chat(small_server)
    heavy.join(timeout=120)
    assert outcome == [400]  # longer than the context
    assert beside < alone + 2.0, (alone, beside)


def test_sigterm_while_bodies_still_arrive_answers_503_in_each_dialect(serve: Any) -> None:
    """Handlers still running at the shutdown's deadline that hold no generation (a body
    still arriving, slowly or never) answer the documented 503 in their API's shape, not
    uvicorn's plain-text 500 with a traceback in the log."""
    server: Server = serve("chat", "--n-ctx", "1024", "--n-seq-max", "2", "--shutdown-seconds", "1")
    socks = []
    dialects: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("/v1/chat/completions", lambda e: e["error"]["code"]),
        ("/v1/messages", lambda e: e["error"]["type"]),
    ]
    for path, code_of in dialects:
        payload = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        whole = payload.encode()
        # The rest of the body never comes.
        socks.append((_posted(server, path, whole[:-5], length=len(whole)), code_of))
    time.sleep(0.3)
    server.process.terminate()
    codes = []
    for sock, code_of in socks:
        head, body = _reply_to_close(sock)
        assert head.startswith(b"HTTP/1.1 503"), (head, body[:300])
        codes.append(code_of(json.loads(body)))
    assert codes == ["shutting_down", "overloaded_error"]
    assert server.process.wait(timeout=30) == 0
    log = server.stop()
    assert "Exception in ASGI application" not in log and "Traceback" not in log


def test_sigterm_with_a_stream_in_flight_ends_it_and_exits_cleanly(serve: Any) -> None:
    server: Server = serve("chat", "--n-ctx", "4096", "--n-seq-max", "2", "--shutdown-seconds", "1")
    stream = server.client().chat.completions.create(
        model="x", messages=STORY, max_tokens=3000, temperature=0.8, stream=True, logit_bias=NO_STOP
    )
    chunks = iter(stream)
    next(chunks)
    start = time.monotonic()
    server.process.terminate()
    # The stream ends, cut at the end of the grace period (the client's error, whatever its
    # HTTP library calls an incomplete body, is not what this test checks).
    with contextlib.suppress(Exception):
        for _ in chunks:
            assert time.monotonic() - start < 30
    assert server.process.wait(timeout=30) == 0
    assert time.monotonic() - start < 15  # the grace period (1 s) and the close, not 3,000 tokens
    assert "shutting down" in server.stop()


def test_tokenize_detokenize_and_apply_template_answer_as_llama_server_does(
    chat_server: Server,
) -> None:
    """llama-server's utility endpoints on the model's own tokenizer and template: tokens
    (with their pieces, a piece that is not whole UTF-8 as a list of bytes) equal the
    library's, detokenize inverts them, `/apply-template` returns the text a chat request
    prefills; bad input is a 400 naming the field."""
    text = "Héllo <|im_start|> wörld"
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=512) as ctx:
        plain = ctx.tokenize(text, add_special=False, parse_special=True)
        literal = ctx.tokenize(text, add_special=False, parse_special=False)
        chat = ctx.format_chat(_messages())
    status, body = chat_server.post("/tokenize", json.dumps({"content": text}).encode())
    assert status == 200 and body["tokens"] == plain
    status, body = chat_server.post(
        "/tokenize",
        json.dumps({"content": text, "parse_special": False, "with_pieces": True}).encode(),
    )
    assert status == 200 and [t["id"] for t in body["tokens"]] == literal
    pieces = [
        bytes(p) if isinstance(p, list) else p.encode()
        for p in (t["piece"] for t in body["tokens"])
    ]
    assert b"".join(pieces).decode() == text
    status, body = chat_server.post("/detokenize", json.dumps({"tokens": plain}).encode())
    assert status == 200 and body["content"] == text
    status, body = chat_server.post(
        "/apply-template", json.dumps({"messages": _messages()}).encode()
    )
    assert status == 200 and body["prompt"] == chat.prompt
    for path, bad, field in [
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
        ("/detokenize", {"tokens": [1, -3]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/apply-template", {"messages": "hi"}, "messages"),
    ]:
        status, body = chat_server.post(path, json.dumps(bad).encode())
        assert status == 400 and body["error"]["param"] == field, (path, body)


def test_earlier_tool_calls_and_results_reach_a_template_that_ignores_them(
    chat_server: Server,
) -> None:
    """SmolLM2's ChatML drops `tool_calls`: the server writes an agent's earlier calls into the
    assistant turn as the `<tool_call>` blocks its tool prompt asks for, and the results as
    `<tool_response>` blocks, so the model sees what it called and what came back."""
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    status, body = chat_server.post("/apply-template", json.dumps({"messages": messages}).encode())
    assert status == 200
    prompt = body["prompt"]
    shown = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert f"<|im_start|>assistant\n{shown}<|im_end|>" in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    # A plain conversation is rendered exactly as the template renders it.
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=512) as ctx:
        plain = ctx.format_chat(_messages()).prompt
    status, body = chat_server.post(
        "/apply-template", json.dumps({"messages": _messages()}).encode()
    )
    assert body["prompt"] == plain


def _library_greedy_reply(max_tokens: int) -> tuple[list[str], list[float]]:
    """The chat model's greedy reply to `_messages()` from the library (host rows), as token
    texts up to its end of turn, and each token's row margin."""
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=512) as ctx:
        prompt = ctx.format_chat(_messages()).prompt
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize(prompt, add_special=True, parse_special=True))
        pieces, margins = [], []
        for _ in range(max_tokens):
            row_margin = margin(b.logits())
            t = b.produce_sync()
            if t.is_stop:
                break
            b.commit_sync(t)
            pieces.append(t.text)
            margins.append(row_margin)
        b.prune_sync()
    return pieces, margins


def test_a_device_sampling_server_gives_rows_to_requests_that_need_them(serve: Any) -> None:
    """`--device-sampling`: greedy and default requests draw from the device's candidates;
    a schema, a logit bias or a whole-vocabulary chain gets its rows from the decode whose
    output it samples (set before the prompt's last token), cache hit or not."""
    server: Server = serve("chat", "--n-ctx", "4096", "--n-seq-max", "6", "--device-sampling")
    client = server.client()
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    status, body = server.post("/tokenize", json.dumps({"content": "Yes"}).encode())
    assert status == 200
    yes = body["tokens"][-1]
    pieces, margins = _library_greedy_reply(8)
    for _ in range(2):  # a cold prompt, then a prefix-cache hit of all of it
        greedy = client.chat.completions.create(
            model="x", messages=_messages(), max_tokens=8, temperature=0
        )
        # The host's greedy reply (the library's), up to a near-tie of its rows.
        got = greedy.choices[0].message.content or ""
        assert_same_text(got, "".join(pieces), pieces, margins)
        shaped = client.chat.completions.create(
            model="x", messages=_messages(), max_tokens=48, temperature=0, response_format=fmt
        )
        text = shaped.choices[0].message.content or ""
        assert json.loads(text) == {"capital": "Paris"}, text
        forced = client.chat.completions.create(
            model="x",
            messages=_messages(),
            max_tokens=3,
            temperature=0,
            logit_bias={str(yes): 100},
        )
        assert (forced.choices[0].message.content or "").startswith("Yes")
        wide = client.chat.completions.create(
            model="x", messages=_messages(), max_tokens=4, n=2, seed=5, top_p=1.0
        )
        assert all(c.message.content for c in wide.choices)
    server.assert_at_rest()


def test_a_tokens_logprob_agrees_with_its_entry_among_the_top_logprobs(serve: Any) -> None:
    """With one candidate kept on the device (`KVFORK_DEVICE_CANDIDATES=1`), the top list
    needs the row decoded again; the chosen token's logprob is read after it, from the same
    row, so the two agree (read before, it came from the device's row: 0.015 apart once)."""
    server: Server = serve(
        "chat",
        "--n-ctx",
        "2048",
        "--n-seq-max",
        "4",
        "--device-sampling",
        env={"KVFORK_DEVICE_CANDIDATES": "1"},
    )
    reply = server.client().chat.completions.create(
        model="x",
        messages=_messages(),
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content
    for entry in content:
        listed = {t.token: t.logprob for t in entry.top_logprobs}
        assert entry.token in listed  # greedy: the chosen token is the best
        assert entry.logprob == listed[entry.token]
    server.assert_at_rest()


async def asgi_call(app: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to the ASGI `app` in this process: its status and JSON body."""
    payload = b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.sleep(60)  # the client stays (bounded)
        return {"type": "http.disconnect"}

    status, chunks = 0, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await asyncio.wait_for(app(scope, receive, send), 60)
    return status, json.loads(b"".join(chunks))


async def test_a_context_closed_under_the_server_reports_failed_and_503s(
    chat_model: kvfork.Model,
) -> None:
    """No client can close the model's context; an internal failure in kvfork can (an engine
    thread's panic did). Then `/health` says "failed" with a 503 (it said "ok" to a server that
    could no longer generate), and requests get 503 `engine_failed`, not a 400 blaming their
    messages or a 500. The app in this process, its context closed as such a failure closes
    it."""
    from kvfork.server.app import create_app
    from kvfork.server.generation import Generator
    from kvfork.server.metrics import Metrics
    from kvfork.server.prompts import Prompts
    from kvfork.server.service import Service

    ctx = await kvfork.create_context(chat_model, n_ctx=1024, n_seq_max=2)
    generator = Generator(ctx, max_queue=8)
    service = Service(Prompts(ctx), generator, model_id="chat", metrics=Metrics())
    app = create_app(service)
    assert (await asgi_call(app, "GET", "/health"))[1]["status"] == "ok"
    ctx.close()
    status, health = await asgi_call(app, "GET", "/health")
    assert status == 503 and health["status"] == "failed"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/tokenize", {"content": "hi"}),
    ]:
        status, reply = await asgi_call(app, "POST", path, body)
        assert status == 503 and reply["error"]["code"] == "engine_failed", (path, reply)
