"""What `kvfork serve`'s replies hold, as OpenAI's and Anthropic's clients read them.

Logprobs: the entries of a reply are the tokens its text is made of (a stop string drops
those it cut whole), the same whether streamed or not, each with its own bytes (a piece of a
UTF-8 character too) and, on `/v1/completions`, where it starts in the text. Checked as
invariants of each reply: two requests for the same greedy reply may part at a near-tie
(cells placed otherwise). Text a model says before a tool call stays beside the call on
every API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from kvfork.server.logprobs import ScoreCache, char_offsets

from .serving import Server, assert_used_servers_at_rest, servers

#: Greedy, SmolLM2 goes on with another emoji, whose first tokens are pieces of it.
EMOJI = "Emoji list: \U0001f431\U0001f436"


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    yield from servers()


@pytest.fixture(scope="module")
def chat_server(serve: Any) -> Server:
    server: Server = serve("chat", "--n-ctx", "4096", "--n-seq-max", "4")
    return server


@pytest.fixture(scope="module")
def small_server(serve: Any) -> Server:
    """A 256-cell context: prompts that fill it."""
    server: Server = serve("chat", "--n-ctx", "256", "--n-seq-max", "2")
    return server


@pytest.fixture(scope="module")
def one_waiter_server(serve: Any) -> Server:
    """Two sequences, and a queue of one request."""
    server: Server = serve("chat", "--n-ctx", "1024", "--n-seq-max", "2", "--max-queue", "1")
    return server


@pytest.fixture(autouse=True)
def _every_sequence_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test, the servers it used are at rest."""
    yield
    assert_used_servers_at_rest(request, "chat_server", "small_server", "one_waiter_server")


def _completion(server: Server, stream: bool, **body: Any) -> tuple[str, dict[str, Any], str]:
    """A `/v1/completions` reply's text, logprobs (a stream's chunks' put together) and
    finish reason."""
    request = {"model": "x", "temperature": 0, **body}
    if not stream:
        status, reply = server.post("/v1/completions", json.dumps(request).encode())
        assert status == 200, reply
        choice = reply["choices"][0]
        return choice["text"], choice["logprobs"], choice["finish_reason"]
    text, finish = "", None
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    whole: dict[str, list[Any]] = {key: [] for key in keys}
    for chunk in server.client().completions.create(**request, stream=True):
        choice = chunk.choices[0]
        text += choice.text
        finish = choice.finish_reason or finish
        assert choice.logprobs is not None
        for key in keys:
            whole[key] += getattr(choice.logprobs, key) or []
    assert finish is not None
    return text, whole, finish


def _token_bytes(token: str) -> bytes:
    """The bytes a logprobs token string stands for (`bytes:\\xNN...` for a piece of a
    character, as OpenAI writes one)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


def _assert_made_of(text: str, tokens: list[str], cut: bool) -> None:
    """`tokens` are those `text` is made of: all of it (less the bytes of a character the
    last ones began but did not finish), or (`cut` by a stop string) the tokens that begin
    before the cut."""
    pieces = [_token_bytes(t) for t in tokens]
    whole = b"".join(pieces)
    if not cut:
        assert whole.decode("utf-8", "ignore") == text, (text, tokens)
        return
    assert whole.startswith(text.encode()), (text, tokens)
    assert len(whole) - len(pieces[-1] if pieces else b"") < max(len(text.encode()), 1)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_stop_string_keeps_the_logprobs_of_the_tokens_it_returns(
    chat_server: Server, stream: bool
) -> None:
    """The stop string's token (cut whole) has no entry, streamed or not; a token it cut
    inside keeps its own."""
    prompt = "The capital of France is"
    for stop in (".", "aris"):
        text, logprobs, finish = _completion(
            chat_server, stream, prompt=prompt, max_tokens=8, stop=stop, logprobs=2
        )
        assert finish == "stop" and stop not in text, text
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"])
        _assert_made_of(text, logprobs["tokens"], cut=True)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_piece_of_a_character_has_its_own_bytes_and_offsets_point_into_the_text(
    chat_server: Server, stream: bool
) -> None:
    """Tokens holding part of an emoji: their token strings say `bytes:`, the tokens' bytes
    add up to the text's, the five alternatives asked for are five keys, and each offset is
    where its token starts in the text (the prompt's tokens first, with `echo`)."""
    text, logprobs, _ = _completion(
        chat_server, stream, prompt=EMOJI, max_tokens=4, logprobs=5, echo=True
    )
    assert text.startswith(EMOJI)
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    in_prompt = sum(offset < len(EMOJI) for offset in offsets)
    _assert_made_of(EMOJI, tokens[:in_prompt], cut=False)
    _assert_made_of(text.removeprefix(EMOJI), tokens[in_prompt:], cut=False)
    assert any(t.startswith("bytes:") for t in tokens[in_prompt:]), tokens
    assert logprobs["top_logprobs"][0] is None
    assert all(len(alternatives) == 5 for alternatives in logprobs["top_logprobs"][1:])
    assert offsets[0] == 0 and offsets[in_prompt] == len(EMOJI), offsets
    assert offsets == sorted(offsets), offsets
    for offset, token in zip(offsets, tokens):
        assert token.startswith("bytes:") or text[offset:].startswith(token), (offset, token)


def test_chat_logprobs_give_each_token_its_own_bytes(chat_server: Server) -> None:
    reply = chat_server.client().chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Repeat exactly: \U0001f431\U0001f436\U0001f98a"}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content
    text = reply.choices[0].message.content or ""
    assert any(e.token.startswith("bytes:") for e in content)
    _assert_made_of(text, [e.token for e in content], cut=False)
    for entry in content:
        assert _token_bytes(entry.token) == bytes(entry.bytes or [])
        for alternative in entry.top_logprobs:
            assert _token_bytes(alternative.token) == bytes(alternative.bytes or [])


def test_a_streamed_reply_with_tools_keeps_its_logprobs(chat_server: Server) -> None:
    """With tools the reply is held back to its end (it may be a call), its logprobs too:
    one entry per completion token, as without tools."""
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    stream = chat_server.client().chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Say hello in five words."}],
        tools=tools,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries: list[Any] = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            entries += choice.logprobs.content or [] if choice.logprobs else []
    assert usage is not None and usage.completion_tokens > 0
    assert len(entries) == usage.completion_tokens


def test_a_listed_model_is_retrieved_and_another_is_a_404(chat_server: Server) -> None:
    client = chat_server.client()
    listed = client.models.list().data[0]
    assert client.models.retrieve(listed.id).id == listed.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_responses_take_top_logprobs_as_openai_s_api_does(chat_server: Server) -> None:
    """Logprobs come with an `include` entry, which the server ignores: `top_logprobs` is
    accepted beside it, not refused as unknown."""
    reply = chat_server.client().responses.create(
        model="x", input="Hi", max_output_tokens=2, top_logprobs=2, temperature=0
    )
    assert reply.status == "incomplete" and reply.output_text


#: A few-shot conversation in which SmolLM2 says something, then calls (greedy).
_WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _says_then_calls() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for city in ("London", "Berlin", "Rome", "Madrid"):
        call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        messages += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": f"Checking now. <tool_call>{call}</tool_call>"},
        ]
    return [*messages, {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_what_a_reply_says_before_its_tool_call_stays_beside_the_call(
    chat_server: Server, stream: bool
) -> None:
    tools: Any = [{"type": "function", "function": _WEATHER}]
    client = chat_server.client()
    request: Any = {"model": "x", "messages": _says_then_calls(), "tools": tools}
    request |= {"temperature": 0, "max_tokens": 40}
    if stream:
        content, names = "", []
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                names += [c.function.name for c in choice.delta.tool_calls or [] if c.function]
    else:
        message = client.chat.completions.create(**request).choices[0].message
        content, names = message.content or "", [c.function.name for c in message.tool_calls or []]
    assert content == "Checking now." and "get_weather" in names, (content, names)

    status, reply = chat_server.post(
        "/v1/messages",
        json.dumps(
            {
                "model": "x",
                "messages": _says_then_calls(),
                "max_tokens": 40,
                "temperature": 0,
                "tools": [{"name": "get_weather", "input_schema": _WEATHER["parameters"]}],
            }
        ).encode(),
    )
    assert status == 200, reply
    assert [b["type"] for b in reply["content"]] == ["text", "tool_use"], reply
    assert reply["content"][0]["text"] == "Checking now." and reply["stop_reason"] == "tool_use"

    response = client.responses.create(
        model="x",
        input=_says_then_calls(),  # type: ignore[arg-type]
        tools=[{"type": "function", **_WEATHER}],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=40,
    )
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Checking now."
    call = response.output[1]
    assert call.type == "function_call"
    result: Any = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": "Sunny, 21 C",
    }
    again = client.responses.create(
        model="x", previous_response_id=response.id, input=[result], max_output_tokens=8
    )
    assert again.status in ("completed", "incomplete")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_echo_with_logprobs_scores_the_prompt_as_generation_would(
    chat_server: Server, stream: bool
) -> None:
    """`echo` + `logprobs` with `max_tokens: 0` (an evaluation harness's log-likelihood
    request): the prompt's tokens, the first without a logprob, each other's logprob the one
    generation gives that token after the same text, and the best alternative at least as
    likely. Generating past the prompt appends the reply's entries."""
    prompt = "The capital of France is Paris"
    text, logprobs, finish = _completion(
        chat_server, stream, prompt=prompt, max_tokens=0, logprobs=1, echo=True
    )
    assert (text, finish) == (prompt, "length")
    tokens, scores = logprobs["tokens"], logprobs["token_logprobs"]
    _assert_made_of(prompt, tokens, cut=False)
    assert scores[0] is None and logprobs["top_logprobs"][0] is None
    assert all(s <= 0 for s in scores[1:]), scores
    for score, best in zip(scores[1:], logprobs["top_logprobs"][1:]):
        assert len(best) == 1 and max(best.values()) >= score - 1e-6, (score, best)
    assert logprobs["text_offset"] == [prompt.index(t.strip()) - t.startswith(" ") for t in tokens]

    # " Paris" generated after the same text: the same logprob, up to batch rounding (0.06
    # here once the text comes from the prefix cache, computed in other batch shapes).
    head = prompt.removesuffix(tokens[-1])
    _, generated, _ = _completion(chat_server, stream, prompt=head, max_tokens=1, logprobs=1)
    assert generated["tokens"] == [tokens[-1]]
    assert generated["token_logprobs"][0] == pytest.approx(scores[-1], abs=0.15)

    text, longer, _ = _completion(
        chat_server, stream, prompt=prompt, max_tokens=3, logprobs=1, echo=True
    )
    n = len(tokens)
    assert longer["tokens"][:n] == tokens and len(longer["tokens"]) == n + 3
    assert longer["token_logprobs"][:n] == pytest.approx(scores, abs=0.05, nan_ok=True)
    assert longer["text_offset"][n] == len(prompt)


def test_max_tokens_zero_needs_echo_and_the_usage_counts_the_prompt(chat_server: Server) -> None:
    """Without `echo`, `max_tokens: 0` is a 400 that says what it is for; with it (and no
    logprobs) the reply is the prompt, every token billed as prompt."""
    body = {"model": "x", "prompt": "Hello there", "max_tokens": 0}
    status, reply = chat_server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    assert "echo" in reply["error"]["message"]
    reply = chat_server.client().completions.create(**body, echo=True)  # type: ignore[call-overload]
    assert reply.choices[0].text == "Hello there" and reply.choices[0].logprobs is None
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    assert reply.usage.prompt_tokens > 0


def _tokens(server: Server, text: str) -> list[int]:
    status, reply = server.post("/tokenize", json.dumps({"content": text}).encode())
    assert status == 200, reply
    tokens: list[int] = reply["tokens"]
    return tokens


def test_an_evaluation_harness_s_log_likelihood_request_is_answered(chat_server: Server) -> None:
    """lm-eval's `local-completions` asks for a batch of token-id prompts, one token more
    each, `echo` and `logprobs: 1`, and reads the continuation's logprobs from the prompt's
    and whether each was the model's first choice (its logprob equal to the best one's)."""
    context = _tokens(chat_server, "The capital of France is")
    whole = _tokens(chat_server, "The capital of France is Paris. The capital of Italy is Rome")
    body = {
        "model": "x",
        "prompt": [whole],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, reply = chat_server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    (choice,) = reply["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(whole) + 1
    continuation = logprobs["token_logprobs"][len(context) : -1]
    best = logprobs["top_logprobs"][len(context) : -1]
    assert all(lp <= 0 for lp in continuation)
    greedy = [lp == max(top.values()) for lp, top in zip(continuation, best)]
    assert greedy[0], "Paris is the model's first choice"


def test_a_list_of_prompts_gets_n_choices_each_in_order(chat_server: Server) -> None:
    """Ten prompts (more than the server's four sequences) with n = 2: choice `i * 2 + j` is
    prompt i's j-th, its text the echoed prompt and what followed; streamed, the same choices
    and the usage of all ten; a 400 for a list that is not prompts."""
    prompts = [f"Item {i}: the" for i in range(10)]
    body = {"model": "x", "prompt": prompts, "n": 2, "max_tokens": 3, "echo": True}
    reply = chat_server.client().completions.create(**body, temperature=0)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == list(range(20))
    for c in reply.choices:
        assert c.text.startswith(prompts[c.index // 2]) and c.text != prompts[c.index // 2]
    assert reply.usage is not None and reply.usage.completion_tokens == 20 * 3
    prompt_tokens = reply.usage.prompt_tokens
    assert prompt_tokens == sum(len(_tokens(chat_server, p)) for p in prompts)

    texts: dict[int, str] = {}
    usage = None
    stream = chat_server.client().completions.create(  # type: ignore[call-overload]
        **body, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == list(range(20))
    assert all(texts[i].startswith(prompts[i // 2]) for i in texts)
    assert usage is not None and usage.prompt_tokens == prompt_tokens

    for bad in ([], [""], ["a", 5], [[1, 2], []], [[1, 2], ["a"]], ["x"] * 1025):
        status, error = chat_server.post(
            "/v1/completions", json.dumps({"model": "x", "prompt": bad}).encode()
        )
        assert status == 400 and error["error"]["param"] == "prompt", (bad, error)


def test_a_prompt_that_fills_the_context_is_scored_but_not_continued(
    small_server: Server,
) -> None:
    """`max_tokens: 0` generates nothing: a prompt of all 256 cells is scored; asked for a
    token more, the same prompt is a 400, as is one past the context."""
    prompt = (_tokens(small_server, "The printing press spread across Europe. ") * 40)[:256]
    body = {"model": "x", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    status, reply = small_server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    assert len(reply["choices"][0]["logprobs"]["token_logprobs"]) == 256
    for changed in ({"max_tokens": 1}, {"prompt": prompt + prompt[:1]}):
        status, reply = small_server.post(
            "/v1/completions", json.dumps({**body, **changed}).encode()
        )
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply


def test_a_list_of_prompts_takes_one_place_in_the_queue(one_waiter_server: Server) -> None:
    """While a request holds both sequences, a three-prompt list waits in the one place the
    queue has, as one prompt would (it was refused 503 queue_full: its prompts queued
    apart); another request meanwhile finds the queue full."""
    server = one_waiter_server
    body = {"model": "x", "max_tokens": 40, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(
            server.post, "/v1/completions", json.dumps({**body, "prompt": "Tale:", "n": 2}).encode()
        )
        _wait_for(lambda: server.sequences()["admitted"] == 2)
        listed = pool.submit(
            server.post,
            "/v1/completions",
            json.dumps({**body, "max_tokens": 3, "prompt": ["a", "b", "c"]}).encode(),
        )
        _wait_for(lambda: server.sequences()["queue"] == 1)
        status, reply = server.post("/v1/completions", json.dumps({**body, "prompt": "x"}).encode())
        assert status == 503 and reply["error"]["code"] == "queue_full", reply
        status, reply = listed.result(timeout=120)
        assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2], reply
        assert holder.result(timeout=120)[0] == 200


def test_scored_prompts_of_a_list_are_scored_one_at_a_time(small_server: Server) -> None:
    """Two prompts of 150 tokens in a 256-cell context: each fits alone, not both at once
    (a scored prompt holds cells the prefix cache cannot share). They are scored one after
    the other (both at once was a 503 no_free_cell every time); an error about one prompt of
    a list names it."""
    first = (_tokens(small_server, "The printing press spread across Europe. ") * 20)[:150]
    second = (_tokens(small_server, "Ships crossed the wide ocean at night. ") * 20)[:150]
    body = {"model": "x", "echo": True, "logprobs": 1, "max_tokens": 0}
    status, reply = small_server.post(
        "/v1/completions", json.dumps({**body, "prompt": [first, second]}).encode()
    )
    assert status == 200, reply
    assert [len(c["logprobs"]["tokens"]) for c in reply["choices"]] == [150, 150]
    status, reply = small_server.post(
        "/v1/completions", json.dumps({**body, "prompt": [first, first * 2]}).encode()
    )
    assert status == 400 and reply["error"]["message"].startswith("prompt 1: "), reply


def _wait_for(condition: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_offsets_count_characters_across_split_and_invalid_bytes() -> None:
    """Where each piece starts in the text its bytes make (U+FFFD for an invalid sequence):
    a piece continuing a character starts where the character does; one after bytes that
    no piece completes starts after their U+FFFD."""
    assert char_offsets([b"Hello", b" \xf0\x9f", b"\x90", b"\xb1", b" world"]) == [0, 5, 6, 6, 7]
    assert char_offsets([b"\xe2\x80", b"="]) == [0, 1]
    assert char_offsets([b"a\xff", b"\xf0\x9f", b"\x90\xb1", b"x"]) == [0, 2, 2, 3]
    assert char_offsets([b"", b"ab", b"\xe2", b"c"]) == [0, 0, 2, 3]
    assert char_offsets([b"x\xe2\x80", b"\x80y"]) == [0, 1]


def test_a_score_cache_gives_the_scores_of_the_longest_shared_beginning() -> None:
    """Scores of a kept prompt's tokens before the first difference (each depends only on
    what comes before it), cut to the alternatives asked for, never from a prompt scored
    with fewer (until kept again with more); the least recently used prompts go first past
    the budget, which counts a token's own entry and its alternatives'."""
    cache = ScoreCache(max_entries=20)
    a = [
        (-1.0, [(7, -0.5), (8, -1.0)]),
        (-2.0, [(9, -0.1), (7, -2.0)]),
        (-3.0, [(1, -1.0), (2, -3.0)]),
    ]
    cache.keep([5, 6, 7, 8], 2, a)  # 12 entries
    assert cache.known([5, 6, 7, 9, 9], 1) == [(-1.0, [(7, -0.5)]), (-2.0, [(9, -0.1)])]
    assert cache.known([5, 6, 7, 8], 2, under="adapter") == []  # scored by another model
    assert cache.known([5, 6, 7, 8, 1], 2) == a
    assert cache.known([5, 6], 2) == a[:1]
    assert cache.known([4, 6, 7], 0) == [] and cache.known([5, 6, 7], 3) == []
    cache.keep([1, 2, 3], 0, [(-1.0, []), (-1.0, [])])  # 15
    cache.keep([1, 2, 3], 1, [(-1.0, [(1, -1.0)]), (-1.0, [(1, -1.0)])])  # kept again: 18
    assert cache.known([1, 2, 3], 1) == [(-1.0, [(1, -1.0)])] * 2
    cache.keep([2, 3, 4], 0, [(-1.0, []), (-1.0, [])])  # 21: the oldest goes
    assert cache.known([5, 6, 7], 0) == [] and cache.known([1, 2, 3], 0) == [(-1.0, [])] * 2
    cache.keep([9] * 11, 1, [(-1.0, [(1, -1.0)])] * 10)  # 22 entries alone: not kept
    assert cache.known([9] * 11, 0) == [] and cache.known([2, 3, 4], 0) == [(-1.0, [])] * 2


def test_a_score_cache_is_read_and_written_from_threads_at_once() -> None:
    """Lookups off the event loop while requests keep scores on it (an OrderedDict mutated
    during a lookup's iteration was a 500 for concurrent scoring requests)."""
    cache = ScoreCache(max_entries=2000)
    stop = threading.Event()

    def keep() -> None:
        for i in range(20000):
            if stop.is_set():
                return
            cache.keep([i % 97, i], 0, [(-1.0, [])])

    writer = threading.Thread(target=keep)
    writer.start()
    try:
        for i in range(3000):
            cache.known([i % 97, 5, 6], 0)
    finally:
        stop.set()
        writer.join()


def test_questions_sharing_a_context_score_it_once(chat_server: Server) -> None:
    """Four answers after one few-shot context, each its own scoring request: the later
    ones take the context's scores from the first (the same numbers) and its cells from the
    prefix cache (`cached_tokens`), and score only their answer, which scores as it does
    after the same context scored cold."""
    context = "".join(f"Q: What is {i} plus {i}? A: {2 * i}.\n" for i in range(1, 12))
    answers = [" 24.", " 25.", " twenty-four.", " 42."]
    body = {"model": "x", "echo": True, "logprobs": 1, "max_tokens": 0}
    replies = []
    for answer in answers:
        prompt = context + "Q: What is 12 plus 12? A:" + answer
        status, reply = chat_server.post(
            "/v1/completions", json.dumps({**body, "prompt": prompt}).encode()
        )
        assert status == 200, reply
        replies.append(reply)
    n_context = len(_tokens(chat_server, context))
    first = replies[0]["choices"][0]["logprobs"]["token_logprobs"]
    for reply in replies[1:]:
        scores = reply["choices"][0]["logprobs"]["token_logprobs"]
        assert scores[:n_context] == first[:n_context]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_context
    # Cold: the last answer's prompt with a different first token, so nothing is shared.
    cold_prompt = "\n" + context + "Q: What is 12 plus 12? A:" + answers[-1]
    status, cold = chat_server.post(
        "/v1/completions", json.dumps({**body, "prompt": cold_prompt}).encode()
    )
    assert status == 200, cold
    tail = len(_tokens(chat_server, answers[-1]))
    warm = replies[-1]["choices"][0]["logprobs"]["token_logprobs"][-tail:]
    assert warm == pytest.approx(cold["choices"][0]["logprobs"]["token_logprobs"][-tail:], abs=0.5)
