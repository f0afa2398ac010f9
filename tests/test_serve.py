"""`kvfork serve` as its users use it: a real server process on 127.0.0.1 and the `openai`
package as the client (chat model and default model). Every request loop here is bounded."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kvfork
import openai
import pytest

SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body: bytes, key: str | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def metric(self, name: str) -> float:
        text = self.metrics_text()
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def serve() -> Iterator[Any]:
    """Start `kvfork serve` processes on loopback; stopped at the end of the module."""
    started: list[Server] = []
    logs: list[Any] = []

    def start(*args: str) -> Server:
        port = _free_port()
        cmd = [sys.executable, "-m", "kvfork", "serve", *args, "--port", str(port)]
        # The log goes to a file (a pipe nobody reads could fill and stall the server).
        log = tempfile.NamedTemporaryFile("w+", prefix="kvfork-serve-", suffix=".log")  # noqa: SIM115
        logs.append(log)
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        server = Server(f"http://127.0.0.1:{port}", process)
        started.append(server)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, Path(log.name).read_text()
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2):
                    return server
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    yield start
    for server in started:
        server.process.terminate()
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
    for log in logs:
        text = Path(log.name).read_text()
        log.close()
        assert "Traceback" not in text, text  # no request may reach an unexpected failure


@pytest.fixture(scope="module")
def chat_server(serve: Any) -> Server:
    server: Server = serve("chat", "--n-ctx", "8192", "--n-seq-max", "8", "--embeddings")
    return server


@pytest.fixture(scope="module")
def base_server(serve: Any) -> Server:
    server: Server = serve("default", "--n-ctx", "4096", "--n-seq-max", "6")
    return server


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
        }
        if stream:
            calls: list[Any] = []
            finish = None
            for chunk in chat_server.client().chat.completions.create(stream=True, **kwargs):
                delta = chunk.choices[0].delta
                calls += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        else:
            reply = chat_server.client().chat.completions.create(**kwargs)
            calls = list(reply.choices[0].message.tool_calls or [])
            finish = reply.choices[0].finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), params)


def test_embeddings(chat_server: Server) -> None:
    reply = chat_server.client().embeddings.create(model="x", input=["A cat.", "A kitten."])
    assert len(reply.data) == 2
    a, b = (d.embedding for d in reply.data)
    assert len(a) == len(b) > 10
    assert abs(sum(x * x for x in a) - 1.0) < 1e-3  # normalized


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


BAD = [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b"[1, 2]", None),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
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
    ("/v1/embeddings", b'{"input": 5}', "input"),
]


def test_bad_requests_get_400_naming_the_field_and_leak_nothing(chat_server: Server) -> None:
    for path, body, param in BAD:
        status, reply = chat_server.post(path, body)
        assert status == 400, (body[:80], status, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body[:80], error)
    assert chat_server.metric("kvfork_leases_in_use") == 0
    answer = chat_server.client().chat.completions.create(
        model="x", messages=_messages(), temperature=0, max_tokens=4
    )
    assert answer.choices[0].message.content


def test_chat_on_a_model_without_a_template_is_a_400(base_server: Server) -> None:
    status, reply = base_server.post(
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'
    )
    assert status == 400 and "template" in reply["error"]["message"]


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
        assert chat_server.metric("kvfork_leases_in_use") == 1
    deadline = time.monotonic() + 20
    while chat_server.metric("kvfork_leases_in_use") != 0:
        assert time.monotonic() < deadline, "the lease did not come back"
        time.sleep(0.1)


def test_api_key_and_a_full_queue(serve: Any) -> None:
    server: Server = serve(
        "chat", "--n-ctx", "2048", "--n-seq-max", "1", "--max-queue", "1", "--api-key", "secret"
    )
    status, reply = server.post("/v1/chat/completions", b"{}")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    body = json.dumps({"messages": _messages(), "max_tokens": 64, "temperature": 0}).encode()
    results: list[int] = []

    def call() -> None:
        results.append(server.post("/v1/chat/completions", body, key="secret")[0])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    # One runs, one waits in the queue, the others are refused with 503.
    assert sorted(results).count(200) >= 2 and 503 in results
    assert server.metric("kvfork_leases_in_use") == 0
