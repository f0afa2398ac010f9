"""Chaos against a real `kvfork serve`: a seeded random mix of chat, completions, Responses
(some continuing an earlier response) and Anthropic Messages, `n` 1–4, streams dropped at
random chunks, JSON schemas, required tools, token counting, malformed bodies sent to every
endpoint and oversized prompts, up to the server's sequences in flight at once (more requests
than sequences: some wait, some are refused). Every answer is a 200, a 4xx in its API's shape,
or a 503 with Retry-After — never a 500 — and afterwards the server is at rest (every sequence
back) and answers a plain request at once.

`make test` runs a short round (`KVFORK_CHAOS_REQUESTS`, default 150, about 20 s);
`make soak` runs 5,000 requests and checks that the server's resident memory stays flat."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from ..serving import Server, servers
from .test_soak import growth_kib_per_cycle

REQUESTS = int(os.environ.get("KVFORK_CHAOS_REQUESTS", "150"))
SEED = int(os.environ.get("KVFORK_CHAOS_SEED", "7"))
N_SEQ = 4
IN_FLIGHT = N_SEQ + 2  # a little more than the sequences: the queue and 503s take part

pytestmark = pytest.mark.timeout(max(300, REQUESTS))

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "maxLength": 10}},
                "required": ["word"],
            },
        },
    }
]
GARBAGE = [
    b"",
    b"{",
    b"[]",
    b"null",
    b'{"messages": 5}',
    b'{"messages": [{"role": "user"}], "n": "two"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    b'{"prompt": [1, 2, 99999999]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "nope"}]}',
    b"\xff\xfe\x00garbage",
    b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A chat server whose evicted prefix-cache entries spill to small host and disk levels
    (a few entries each), so that spills, restores and disk overflow take part too."""
    start = servers()
    cache_dir = tmp_path_factory.mktemp("chaos-cache")
    started = next(start)(
        "chat", "--n-ctx", "4096", "--n-seq-max", str(N_SEQ), "--max-queue", "4",
        "--cache-ram", "8", "--cache-dir", str(cache_dir), "--cache-disk", "24",
    )  # fmt: skip
    yield started
    next(start, None)  # stops it: a clean exit (status 0, no traceback)


def _chat_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Say something about {rng.randrange(50)}."}],
        "max_tokens": rng.randint(1, 12),
        "n": rng.randint(1, 4),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(1000),
    }
    kind = rng.random()
    if kind < 0.15:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
        body["max_tokens"] = 40
    elif kind < 0.3:
        body.update(tools=TOOLS, tool_choice="required", max_tokens=32)
    return body


#: Where garbage goes: every endpoint that reads a body.
BODY_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/apply-template",
]
#: A stand-in in a planned Responses body for the id of a response stored earlier in the run.
EARLIER = "<an earlier response>"


def _responses_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": f"Name a colour and the number {rng.randrange(50)}.",
        "max_output_tokens": rng.randint(1, 12),
        "temperature": rng.choice([0.0, 0.7]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["previous_response_id"] = EARLIER
    if rng.random() < 0.15:
        body["instructions"] = "Answer in one word."
    return body


def _messages_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 12),
        "system": "Be brief.",
        "messages": [{"role": "user", "content": f"Count to {rng.randrange(9)}."}],
        "stream": rng.random() < 0.5,
        "stop_sequences": rng.choice([[], ["3"]]),
    }
    if rng.random() < 0.2:
        body["tools"] = [
            {"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}
        ]  # fmt: skip
        body.update(tool_choice={"type": "any"}, max_tokens=32)
    return body


def _request(rng: random.Random) -> tuple[str, str, bytes, int | None]:
    """(label, path, body, chunks to read before dropping the stream: None reads it all)."""
    roll = rng.random()
    if roll < 0.1:
        return "garbage", rng.choice(BODY_PATHS), rng.choice(GARBAGE), None
    if roll < 0.15:
        long = {"messages": [{"role": "user", "content": "word " * 6000}]}
        return "oversized", "/v1/chat/completions", json.dumps(long).encode(), None
    if roll < 0.25:
        body = _responses_body(rng)
        drop = rng.choice([None, 0, 2, 4]) if body["stream"] else None
        return "responses", "/v1/responses", json.dumps(body).encode(), drop
    if roll < 0.35:
        body = _messages_body(rng)
        drop = rng.choice([None, 0, 2, 4]) if body["stream"] else None
        path = "/v1/messages/count_tokens" if rng.random() < 0.1 else "/v1/messages"
        if path.endswith("count_tokens"):
            body.pop("stream")
            drop = None
        return "messages", path, json.dumps(body).encode(), drop
    if roll < 0.5:
        body = {
            "prompt": f"{rng.randrange(100)}, {rng.randrange(100)},",
            "max_tokens": rng.randint(1, 12),
            "n": rng.randint(1, 4),
            "stream": rng.random() < 0.5,
        }
        drop = rng.choice([None, 0, 1, 3]) if body["stream"] else None
        return "completion", "/v1/completions", json.dumps(body).encode(), drop
    chat = _chat_body(rng)
    chat["stream"] = rng.random() < 0.5
    drop = rng.choice([None, 0, 1, 2, 5]) if chat["stream"] else None
    return "chat", "/v1/chat/completions", json.dumps(chat).encode(), drop


def _send(
    server: Server, path: str, body: bytes, drop: int | None, stored: list[str] | None = None
) -> tuple[int, str]:
    """The status (and Retry-After) of one request over a raw socket; a stream is dropped after
    `drop` SSE events, half the time with a reset instead of a close. The id of a whole
    Responses reply goes to `stored`."""
    with socket.create_connection(server.address, timeout=120) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"closed before the headers: {received[:200]!r}")
            received += chunk
        head = received.split(b"\r\n\r\n", 1)[0].decode()
        status = int(head.split()[1])
        retry = next(
            (line.split(":", 1)[1].strip() for line in head.split("\r\n")
             if line.lower().startswith("retry-after:")),
            "",
        )  # fmt: skip
        if drop is not None and status == 200:
            while received.count(b"data:") < drop:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
            if drop % 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return status, retry
        while chunk := sock.recv(65536):  # read to the end (Connection: close)
            received += chunk
        if stored is not None and status == 200 and path == "/v1/responses" and drop is None:
            with contextlib.suppress(ValueError, KeyError):  # a stream: no single object
                stored.append(json.loads(received.split(b"\r\n\r\n", 1)[1])["id"])
        return status, retry


def test_a_random_rude_crowd_never_gets_a_500_and_leaks_nothing(server: Server) -> None:
    rng = random.Random(SEED)
    plan = [_request(rng) for _ in range(REQUESTS)]
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    rss: list[float] = []
    cursor = iter(range(REQUESTS))
    stored: list[str] = []  # the ids of whole Responses replies, for later ones to continue
    rng_ids = random.Random(SEED + 1)

    def worker() -> None:
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            label, path, body, drop = plan[i]
            if EARLIER.encode() in body:
                with lock:
                    earlier = rng_ids.choice(stored) if stored else None
                body = body.replace(
                    json.dumps(EARLIER).encode(), json.dumps(earlier).encode()
                )  # fmt: skip
            try:
                status, retry = _send(server, path, body, drop, stored)
            except (OSError, AssertionError) as exc:
                with lock:
                    failures.append(f"{label} #{i}: {exc!r}")
                continue
            with lock:
                statuses[(label, status)] += 1
                if status >= 500 and (status != 503 or retry != "1"):
                    failures.append(f"{label} #{i}: {status} (Retry-After {retry!r})")
                if i % 50 == 0:
                    rss.append(server.rss_kib() / 1024)
            if status == 503:
                time.sleep(0.25)  # as a polite client would (Retry-After), but sooner

    threads = [threading.Thread(target=worker) for _ in range(IN_FLIGHT)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    print(f"\n{REQUESTS} requests in {elapsed:.1f} s: {dict(sorted(statuses.items()))}")
    assert not failures, failures[:10]
    assert {status for _, status in statuses} <= {200, 400, 413, 503}
    assert statuses[("chat", 200)] > 0 and statuses[("garbage", 400)] > 0
    assert statuses[("responses", 200)] > 0 and statuses[("messages", 200)] > 0
    server.assert_at_rest()
    evicted = server.metric("kvfork_prefix_cache_evictions_total")
    spilled = server.metric("kvfork_prefix_cache_spilled")
    restored = server.metric("kvfork_prefix_cache_restored_total")
    print(
        f"prefix cache: {evicted:.0f} evicted, {spilled:.0f} spilled now, {restored:.0f} restored"
    )
    assert spilled > 0  # the spill levels took part
    _plain_at_once(server)
    if len(rss) >= 30:  # the soak: memory flat (a leak of a few KiB per request shows)
        base, end, per_request = growth_kib_per_cycle(rss, 50)
        print(f"server RSS {base:.1f} -> {end:.1f} MiB, {per_request:.2f} KiB per request")
        assert per_request < 4.0


def _plain_at_once(server: Server) -> None:
    start = time.monotonic()
    reply = server.client(timeout=30).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content
    assert time.monotonic() - start < 10
