"""`kvfork serve --ray` as its users use it: a real server process on 127.0.0.1 over a local
Ray cluster (2 CPUs, 2 actors of 1 thread each) and the `openai` package as the client. The
same answers as one process, streaming, `n`, schemas and tools, prefix-affinity routing,
`/metrics` per actor and summed, and the faults: a killed actor fails only what it had
started, is replaced, and a request that had not started on it runs on the other actor."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import kvfork
import numpy as np
import openai
import pytest

from .serving import Server, servers

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

DOCUMENT = " ".join(
    f"Fact {i}: the {('red', 'blue', 'green', 'gold')[i % 4]} lamp in room {i} is switched "
    f"{('on', 'off')[i % 2]} at {i % 12 + 1} o'clock."
    for i in range(24)
)  # ~500 tokens: a system prompt worth sharing


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    """`kvfork serve` processes, stopped with SIGTERM at the end of the module."""
    yield from servers()


@pytest.fixture(scope="module")
def cluster(serve: Callable[..., Server]) -> Server:
    return serve(
        "chat", "--ray", "local", "--actors", "2", "--threads", "1",
        "--n-ctx", "4096", "--n-seq-max", "8",
    )  # fmt: skip


def per_actor(server: Server, name: str) -> dict[int, float]:
    """`name`'s sample of each actor in `/metrics`."""
    text = server.metrics_text()
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(rf'^{name}{{actor="(\d+)"}} (\S+)$', text, re.MULTILINE)
    }


def served(server: Server) -> dict[int, float]:
    return per_actor(server, "kvfork_actor_requests_total")


def messages(question: str, system: str = "You are a helpful assistant.") -> list[Any]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run `calls` at once; their results (or the exception each raised), in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001  (returned to the test, which checks it)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    return results


QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
]


def greedy_reference(question: str, max_tokens: int) -> tuple[str, str]:
    """One process's greedy reply (the library), and the part of it before the first
    near-tie (margin < 1 logit): past that, batched logits may pick the other token."""
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=1024) as ctx:
        chat = ctx.format_chat(messages(question))
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize(chat.prompt, add_special=True, parse_special=True))
        text, sure = "", None
        for _ in range(max_tokens):
            top2 = np.partition(b.logits(), -2)[-2:]
            if sure is None and top2[1] - top2[0] < 1.0:
                sure = text
            tok = b.produce_sync()
            if tok.is_stop:
                break
            b.commit_sync(tok)
            text += tok.text
    return text, text if sure is None else sure


def test_answers_equal_one_process_plain_and_streamed_on_both_actors(cluster: Server) -> None:
    client = cluster.client()
    before = served(cluster)

    def plain(q: str) -> str:
        reply = client.chat.completions.create(
            model="x", messages=messages(q), temperature=0, max_tokens=24
        )
        return reply.choices[0].message.content or ""

    def streamed(q: str) -> str:
        stream = client.chat.completions.create(
            model="x", messages=messages(q), temperature=0, max_tokens=24, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    got_plain = in_threads(*(lambda q=q: plain(q) for q in QUESTIONS))
    got_streamed = in_threads(*(lambda q=q: streamed(q) for q in QUESTIONS))
    for q, a, s in zip(QUESTIONS, got_plain, got_streamed):
        whole, sure = greedy_reference(q, 24)
        for got in (a, s):
            assert isinstance(got, str), got
            assert got.startswith(sure), (q, got, whole)
            if sure == whole:
                assert got == whole
    after = served(cluster)
    assert all(after[a] > before.get(a, 0) for a in (0, 1)), "both actors served"


def test_n_schema_and_tools_work_the_same(cluster: Server) -> None:
    client = cluster.client()
    reply = client.chat.completions.create(
        model="x", messages=messages("Name a fruit."), temperature=1.0, seed=3, max_tokens=8, n=4
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in reply.choices}) > 1, "seeded choices differ"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    person = client.chat.completions.create(
        model="x",
        messages=messages("Describe a person."),
        temperature=0.7,
        seed=1,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    jsonschema.validate(json.loads(person.choices[0].message.content or ""), schema)
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    kwargs: Any = {
        "model": "x",
        "messages": messages("What is the weather in Paris?"),
        "temperature": 0,
        "max_tokens": 48,
        "tools": tools,
        "tool_choice": "required",
    }
    with client.chat.completions.stream(**kwargs) as stream:  # deltas accumulated by openai
        calls = stream.get_final_completion().choices[0].message.tool_calls or []
    plain_calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    for got in (calls, plain_calls):
        assert len(got) == 1 and got[0].type == "function"
        assert got[0].function.name == "get_weather"
        jsonschema.validate(json.loads(got[0].function.arguments or ""), params)


def test_reasoning_plans_run_on_actors_and_control_is_refused(cluster: Server) -> None:
    """A chat request's reasoning plan crosses to its actor (here no block opens: shared
    choices fork after the first token); the control endpoint needs one process: a 400."""
    reply = cluster.client().chat.completions.create(
        model="x",
        messages=messages("Name a fruit."),
        max_tokens=8,
        n=2,
        seed=5,
        extra_body={"reasoning_shared": True, "reasoning_budget": 2},
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    body = {"messages": messages("Hi"), "max_tokens": 2, "reasoning_control": True}
    status, error = cluster.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and error["error"]["param"] == "reasoning_control"
    control = {"id": "chatcmpl-x", "action": "reasoning_end"}
    status, error = cluster.post("/v1/chat/completions/control", json.dumps(control).encode())
    assert status == 400 and error["error"]["param"] == "id"


def test_a_shared_prefix_follows_its_actor_and_a_burst_spills(cluster: Server) -> None:
    client = cluster.client()

    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model="x", messages=messages(question, DOCUMENT), temperature=0, max_tokens=4
        ).usage

    first = ask("Which lamp is in room 3?")
    assert first is not None and first.prompt_tokens > 400
    before = served(cluster)
    for i in range(3):  # one after another: each finds the document where the first left it
        usage = ask(f"Is the lamp in room {i} on?")
        assert usage.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 16
    after = served(cluster)
    assert sorted(after[a] - before.get(a, 0) for a in (0, 1)) == [0, 3]
    # Eight at once: the load bound sends some to the other actor (the hot prefix spills).
    burst = in_threads(*(lambda i=i: ask(f"What colour is lamp {i}?") for i in range(8)))
    failed = [u for u in burst if isinstance(u, Exception)]
    assert not failed, failed
    final = served(cluster)
    assert all(final[a] > after[a] for a in (0, 1))
    # /metrics: the unlabelled sample is the actors' sum.
    for name in ("kvfork_decode_calls_total", "kvfork_prefix_cache_entries"):
        assert cluster.metric(name) == sum(per_actor(cluster, name).values())


def _end_of_turn() -> int:
    with kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=256) as ctx:
        (token,) = ctx.tokenize("<|im_end|>", add_special=False, parse_special=True)
    return token


def test_a_killed_actor_fails_only_what_it_started_and_is_replaced(cluster: Server) -> None:
    client = cluster.client()
    endless = {str(_end_of_turn()): -100}  # no end of turn: runs to max_tokens
    long: Any = {
        "model": "x",
        # A document of its own: both requests go where the first is sent (longest prefix).
        "messages": messages("Tell me about the lamps.", "Log of the lamps. " + DOCUMENT),
        "max_tokens": 3000,
        "temperature": 0.8,
        "seed": 1,
        "logit_bias": endless,
    }
    chunks = 0

    def streamed() -> Any:
        nonlocal chunks
        for _ in client.chat.completions.create(stream=True, **long):
            chunks += 1
        return "finished"

    def plain() -> Any:
        return client.chat.completions.create(**long)

    def elsewhere() -> Any:  # a short request the other actor serves meanwhile
        time.sleep(0.5)
        return client.chat.completions.create(
            model="x", messages=messages("Name a colour."), temperature=0, max_tokens=48
        )

    replaced = per_actor(cluster, "kvfork_actor_replaced_total")
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(in_threads(streamed, plain)))
    runner.start()
    deadline = time.monotonic() + 60
    while chunks < 5 or 2 not in per_actor(cluster, "kvfork_sequences_requests").values():
        assert time.monotonic() < deadline and runner.is_alive(), (
            results,
            chunks,
            per_actor(cluster, "kvfork_sequences_requests"),
            per_actor(cluster, "kvfork_actor_in_flight"),
        )
        time.sleep(0.05)
    victim = next(a for a, n in per_actor(cluster, "kvfork_sequences_requests").items() if n == 2)
    other = in_threads(elsewhere, lambda: os.kill(pid_of(cluster, victim), signal.SIGKILL))
    runner.join(timeout=120)
    stream_error, plain_error = results
    # The stream had begun: it ends with an SSE error event (the client raises it).
    assert isinstance(stream_error, openai.APIError), stream_error
    assert "died" in str(stream_error)
    # The plain request gets OpenAI's error body with 503.
    assert isinstance(plain_error, openai.InternalServerError), plain_error
    assert plain_error.status_code == 503
    assert plain_error.code == "worker_died"
    assert not isinstance(other[0], Exception) and other[0].choices[0].message.content
    now = per_actor(cluster, "kvfork_actor_replaced_total")
    assert now[victim] == replaced[victim] + 1 and now[1 - victim] == replaced[1 - victim]
    # The replacement serves later requests.
    usage = client.chat.completions.create(
        model="x", messages=messages("Which lamp is on?", DOCUMENT), max_tokens=4, temperature=0
    )
    assert usage.choices[0].message.content is not None
    # The actor gives the sequence back just after the reply: polled (a loaded machine
    # read 1 at once).
    deadline = time.monotonic() + 30
    while cluster.metric("kvfork_sequences_requests") != 0:
        assert time.monotonic() < deadline, "a request's sequence was not given back"
        time.sleep(0.05)


def pid_of(server: Server, actor: int) -> int:
    return int(per_actor(server, "kvfork_actor_pid")[actor])


def test_a_request_that_had_not_started_on_a_dead_actor_runs_on_the_other(
    cluster: Server,
) -> None:
    client = cluster.client()
    before = served(cluster)
    question = messages("Which lamp is in room 5?", "Retried. " + DOCUMENT)
    client.chat.completions.create(model="x", messages=question, temperature=0, max_tokens=4)
    holder = next(a for a, n in served(cluster).items() if n > before.get(a, 0))
    retries = cluster.metric("kvfork_route_retries_total")
    os.kill(pid_of(cluster, holder), signal.SIGKILL)
    # Routed by affinity to the actor that died: it runs on the other one instead.
    reply = client.chat.completions.create(
        model="x", messages=question, temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.content
    assert cluster.metric("kvfork_route_retries_total") == retries + 1


def test_a_client_that_disconnects_gives_the_actors_lease_back(cluster: Server) -> None:
    stream = cluster.client().chat.completions.create(
        model="x",
        messages=messages("Write a very long story."),
        max_tokens=2000,
        temperature=0.8,
        stream=True,
    )
    next(iter(stream))
    assert cluster.metric("kvfork_sequences_requests") == 1
    stream.close()
    deadline = time.monotonic() + 20
    while cluster.metric("kvfork_sequences_requests") != 0:
        assert time.monotonic() < deadline, "the lease did not come back"
        time.sleep(0.1)


def test_health_sums_the_actors(cluster: Server) -> None:
    status, state = cluster.get("/health")
    assert status == 200 and state == {"status": "ok", "free_sequences": 16, "queue": 0}


def test_prompts_are_scored_and_listed_as_on_one_process(cluster: Server) -> None:
    """`/v1/completions` with a list of prompts, `echo` and `logprobs` over the actors: each
    prompt's tokens scored (the first without a logprob), its choices numbered as OpenAI
    numbers them; a prompt of the list that cannot fit is refused up front with its index,
    streamed or not (it was a 200 whose stream ended in an error, prompt 0 generated)."""
    body = {"model": "x", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    prompts = ["The capital of France is", "Two plus two is"]
    status, reply = cluster.post(
        "/v1/completions", json.dumps({**body, "prompt": prompts}).encode()
    )
    assert status == 200, reply
    for choice, prompt in zip(reply["choices"], prompts):
        assert choice["text"].startswith(prompt)
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"][1:])
    too_long = {**body, "prompt": ["Hello", "word " * 5000]}
    for stream in (False, True):
        status, reply = cluster.post(
            "/v1/completions", json.dumps({**too_long, "stream": stream}).encode()
        )
        assert status == 400 and reply["error"]["message"].startswith("prompt 1: "), reply
        assert reply["error"]["code"] == "context_length_exceeded"
