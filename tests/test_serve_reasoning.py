"""Reasoning in `kvfork serve`: `reasoning_content` apart from `content`, the reasoning budget
(forced tokens that end the think block), `reasoning_effort` to the template, the control
endpoint, and `n` answers that share one reasoning trace.

No small thinking model is on the registries, so the server runs the chat model (SmolLM2-135M)
under a ChatML template whose generation prompt opens a think block: the model starts inside
it and never writes `</think>` itself (greedy, it ends its turn inside the block). That makes a
model whose output is constrained to think first: only the budget (or a control request) ends
the block, and then it answers. The splitter's marker handling (blocks the model opens, other
markers, markers cut across tokens) is tested on text, without a server.
"""

from __future__ import annotations

import http.client
import itertools
import json
from collections.abc import Callable, Generator, Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import TextBlock, ThinkingBlock
from kvfork.server.reasoning import (
    MARKERS,
    Asked,
    Defaults,
    Plan,
    Splitter,
    Thought,
    open_block,
    plan,
)
from openai.types.responses import ResponseReasoningItem

from .conftest import assert_same_greedy, assert_same_text
from .serving import Server, assert_used_servers_at_rest, logprob_margin, servers

SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
#: The server's own budget and message (`--reasoning-budget`, `--reasoning-budget-message`).
SERVER_BUDGET = 6
SERVER_MESSAGE = " Enough thinking."
#: SmolLM2's ends of turn: banned, a reply runs to its max_tokens (exact token counts).
NO_END = {"0": -100, "2": -100}

#: SmolLM2's ChatML, its generation prompt opening a think block (unless the request turns
#: thinking off), and showing the reasoning effort it was given.
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]
{% endif %}{% if enable_thinking is not defined or enable_thinking %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    """`kvfork serve` processes on loopback, stopped with SIGTERM at the end (a clean exit)."""
    yield from servers()


@pytest.fixture(scope="module")
def think_server(serve: Any, tmp_path_factory: pytest.TempPathFactory) -> Server:
    template = tmp_path_factory.mktemp("reasoning") / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    server: Server = serve(
        "chat",
        "--chat-template",
        str(template),
        "--n-ctx",
        "4096",
        "--n-seq-max",
        "6",
        "--reasoning-budget",
        str(SERVER_BUDGET),
        "--reasoning-budget-message",
        SERVER_MESSAGE,
    )
    return server


@pytest.fixture(autouse=True)
def _every_sequence_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every server test, the server is at rest."""
    yield
    assert_used_servers_at_rest(request, "think_server")


def _chat(server: Server, **fields: Any) -> dict[str, Any]:
    """A non-streamed chat reply (greedy, short, unless `fields` say otherwise)."""
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 32, **fields}
    status, reply = server.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


def _stream(server: Server, **fields: Any) -> Generator[dict[str, Any], None, None]:
    """The chunks of a streamed chat reply, as they come (a bounded read: 30 s a line)."""
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 32, "stream": True, **fields}
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[len("data: ") :])
    finally:
        conn.close()


def _streamed(chunks: Iterator[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], Any]:
    """Each choice's concatenated reasoning and content deltas and finish, and the usage."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            got = out.setdefault(
                c["index"], {"reasoning": "", "content": "", "finish": "", "tokens": []}
            )
            got["reasoning"] += c["delta"].get("reasoning_content") or ""
            got["content"] += c["delta"].get("content") or ""
            got["finish"] = c["finish_reason"] or got["finish"]
            got["tokens"] += [e["token"] for e in (c.get("logprobs") or {}).get("content") or []]
    return out, usage


#: What a reply is asked for, beside its fields, when it is compared with another: its
#: sampled tokens and each one's margin (`_sampled`).
MARGINS = {"logprobs": True, "top_logprobs": 2}


def _sampled(reply: dict[str, Any]) -> tuple[list[str], list[float]]:
    """A greedy chat reply's sampled tokens (asked with MARGINS; forced tokens are not
    sampled) and, for each, the margin of the row it was drawn from (best minus second-best
    log-probability, which is the logits' margin)."""
    tokens, margins = [], []
    for entry in reply["choices"][0]["logprobs"]["content"]:
        tokens.append(entry["token"])
        margins.append(logprob_margin(t["logprob"] for t in entry["top_logprobs"]))
    return tokens, margins


def _same_history(got: list[str], reference: dict[str, Any]) -> bool:
    """The suite's margin rule (`conftest.assert_same_greedy`) on two greedy replies to one
    prompt, by their sampled tokens: True when equal; False when they part at a near-tie of
    the reference, after which the histories differ and the replies are not compared. (A
    prompt found in the prefix cache is computed in other batch shapes than a fresh one:
    bit for bit the same on this CPU, not on a GPU.)"""
    tokens, margins = _sampled(reference)
    return assert_same_greedy(got, tokens, margins)


def _same_text(reasoning: str, answer: str, reference: dict[str, Any], budget: int) -> bool:
    """The margin rule on a reply known only as text (Anthropic's blocks, Responses' items)
    against a chat reply to the same prompt asked with MARGINS, whose first `budget` sampled
    tokens are its reasoning (then forced to end) and the rest its answer."""
    tokens, margins = _sampled(reference)
    message = reference["choices"][0]["message"]
    if not assert_same_text(
        reasoning, message["reasoning_content"], tokens[:budget], margins[:budget]
    ):
        return False
    return assert_same_text(answer, message["content"], tokens[budget:], margins[budget:])


def _forced_tokens(server: Server, message: str) -> int:
    """How many tokens the forced end of a block is: the message, `</think>` and a newline."""
    body = json.dumps({"content": message + "</think>\n"}).encode()
    status, reply = server.post("/tokenize", body)
    assert status == 200, reply
    return len(reply["tokens"])


def _reasoning_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["completion_tokens_details"]["reasoning_tokens"])


# ---- the budget ----


def test_a_request_budget_ends_the_block_after_exactly_n_tokens(think_server: Server) -> None:
    message = " Time to answer."
    reply = _chat(think_server, reasoning_budget=4, reasoning_budget_message=message)
    choice = reply["choices"][0]
    reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
    assert reasoning.startswith("The capital") and reasoning.endswith(message.strip())
    assert content.strip() and "</think>" not in content
    forced = _forced_tokens(think_server, message)
    assert _reasoning_tokens(reply) == 4 + forced  # 4 sampled, then the forced end
    assert reply["usage"]["completion_tokens"] > _reasoning_tokens(reply)


def test_the_server_budget_and_message_apply_unless_the_request_says(think_server: Server) -> None:
    reply = _chat(think_server)
    reasoning = reply["choices"][0]["message"]["reasoning_content"]
    assert reasoning.endswith(SERVER_MESSAGE.strip())
    assert _reasoning_tokens(reply) == SERVER_BUDGET + _forced_tokens(think_server, SERVER_MESSAGE)
    assert reply["choices"][0]["message"]["content"]
    # Unlimited: the model ends its turn inside the block, which is all reasoning.
    open_ended = _chat(think_server, reasoning_budget=-1)
    message = open_ended["choices"][0]["message"]
    assert "Paris" in message["reasoning_content"] and message["content"] == ""
    assert _reasoning_tokens(open_ended) == open_ended["usage"]["completion_tokens"]


def test_a_budget_of_zero_answers_at_once(think_server: Server) -> None:
    reply = _chat(think_server, reasoning_budget=0, reasoning_budget_message="")
    message = reply["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    assert _reasoning_tokens(reply) == _forced_tokens(think_server, "")


def test_streamed_deltas_add_up_to_the_reply(think_server: Server) -> None:
    plain = _chat(think_server, reasoning_budget=5, **MARGINS)
    fields = {"reasoning_budget": 5, "stream_options": {"include_usage": True}, **MARGINS}
    streamed, usage = _streamed(_stream(think_server, **fields))
    message = plain["choices"][0]["message"]
    assert usage["completion_tokens_details"] == plain["usage"]["completion_tokens_details"]
    if _same_history(streamed[0]["tokens"], plain):
        assert streamed[0]["reasoning"] == message["reasoning_content"]
        assert streamed[0]["content"] == message["content"]
        assert streamed[0]["finish"] == plain["choices"][0]["finish_reason"]


def test_each_of_n_choices_gets_the_budget(think_server: Server) -> None:
    reply = _chat(think_server, n=2, temperature=0.8, seed=7, reasoning_budget=3, max_tokens=16)
    forced = _forced_tokens(think_server, SERVER_MESSAGE)
    assert _reasoning_tokens(reply) == 2 * (3 + forced)
    for choice in reply["choices"]:
        assert choice["message"]["reasoning_content"].endswith(SERVER_MESSAGE.strip())


def test_logprobs_come_for_the_sampled_tokens(think_server: Server) -> None:
    reply = _chat(think_server, reasoning_budget=3, logprobs=True, max_tokens=16)
    forced = _forced_tokens(think_server, SERVER_MESSAGE)
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) == reply["usage"]["completion_tokens"] - forced


# ---- formats and the template ----


def test_reasoning_format_none_and_legacy_keep_the_markup(think_server: Server) -> None:
    split_reply = _chat(think_server, reasoning_budget=4, **MARGINS)
    raw_reply = _chat(think_server, reasoning_budget=4, reasoning_format="none", **MARGINS)
    split, raw = split_reply["choices"][0]["message"], raw_reply["choices"][0]["message"]
    assert "reasoning_content" not in raw
    before, after = raw["content"].split("</think>")
    if _same_history(_sampled(raw_reply)[0], split_reply):
        assert before.strip() == split["reasoning_content"]
        assert after.strip() == split["content"]
    legacy = _chat(think_server, reasoning_budget=4, reasoning_format="deepseek-legacy", **MARGINS)
    message = legacy["choices"][0]["message"]
    if _same_history(_sampled(legacy)[0], raw_reply):
        assert message["content"] == raw["content"]
    if _same_history(_sampled(legacy)[0], split_reply):
        assert message["reasoning_content"] == split["reasoning_content"]


def _prompt(server: Server, **fields: Any) -> str:
    body = json.dumps({"messages": MESSAGES, **fields}).encode()
    status, reply = server.post("/apply-template", body)
    assert status == 200, reply
    return str(reply["prompt"])


def test_reasoning_effort_reaches_the_template(think_server: Server) -> None:
    assert _prompt(think_server).endswith("<|im_start|>assistant\n<think>\n")
    assert _prompt(think_server, reasoning_effort="high").endswith("[effort: high]\n<think>\n")
    assert _prompt(think_server, reasoning_effort="default").endswith("assistant\n<think>\n")
    # "none" turns thinking off (the template's enable_thinking), as the kwargs can.
    assert _prompt(think_server, reasoning_effort="none").endswith("<|im_start|>assistant\n")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _prompt(think_server, **kwargs).endswith("<|im_start|>assistant\n")
    for fields in ({"reasoning_effort": "none"}, kwargs):
        message = _chat(think_server, **fields)["choices"][0]["message"]
        assert "reasoning_content" not in message and "Paris" in message["content"]


# ---- ending the reasoning from outside ----


def _control(server: Server, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return server.post("/v1/chat/completions/control", json.dumps(body).encode())


def test_the_control_endpoint_ends_a_running_reasoning(think_server: Server) -> None:
    """A stream that would think to its max_tokens (no budget, no end of turn): after three
    reasoning deltas a control request ends the block, and the answer follows."""
    fields = {
        "reasoning_control": True,
        "reasoning_budget": -1,
        "max_tokens": 48,
        "logit_bias": NO_END,
        "stream_options": {"include_usage": True},
    }
    kinds, answers, usage = [], [], None
    for chunk in _stream(think_server, **fields):
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            delta = c["delta"]
            if delta.get("reasoning_content"):
                kinds.append("reasoning")
            if delta.get("content"):
                kinds.append("content")
                answers.append(delta["content"])
        if kinds.count("reasoning") == 3 and "control" not in kinds:
            kinds.append("control")
            status, reply = _control(think_server, {"id": chunk["id"], "action": "reasoning_end"})
            assert (status, reply) == (200, {"success": True})
    assert "content" in kinds and "".join(answers).strip()
    assert kinds.index("control") < kinds.index("content")
    assert "reasoning" not in kinds[kinds.index("content") :]
    assert usage is not None and usage["completion_tokens"] == 48
    assert usage["completion_tokens_details"]["reasoning_tokens"] < 24


def test_a_request_not_armed_is_a_409_and_a_finished_one_a_404(think_server: Server) -> None:
    fields = {"reasoning_budget": -1, "max_tokens": 48, "logit_bias": NO_END}
    chunks = _stream(think_server, **fields)
    request_id = next(chunks)["id"]
    status, reply = _control(think_server, {"id": request_id, "action": "reasoning_end"})
    assert status == 409 and reply["error"]["param"] == "id", reply
    for _ in chunks:  # to its end: the request is over
        pass
    status, reply = _control(think_server, {"id": request_id, "action": "reasoning_end"})
    assert status == 404 and reply["error"]["param"] == "id", reply


# ---- one reasoning trace, n answers ----


def test_n_answers_share_one_reasoning_trace_billed_once(think_server: Server) -> None:
    """Greedy, with no end of turn: every answer runs to max_tokens, so the token counts are
    exact. Three answers after one trace cost the trace once."""
    fields = {"reasoning_budget": 5, "max_tokens": 24, "logit_bias": NO_END}
    one = _chat(think_server, **fields)
    three = _chat(think_server, n=3, reasoning_shared=True, **fields)
    trace = one["choices"][0]["message"]["reasoning_content"]
    assert [c["message"]["reasoning_content"] for c in three["choices"]] == [trace] * 3
    assert all(c["message"]["content"] for c in three["choices"])
    thought = _reasoning_tokens(one)
    assert _reasoning_tokens(three) == thought
    assert one["usage"]["completion_tokens"] == 24
    assert three["usage"]["completion_tokens"] == 24 + 2 * (24 - thought)
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]


def test_shared_reasoning_streams_the_trace_to_every_choice(think_server: Server) -> None:
    fields = {"reasoning_budget": 4, "max_tokens": 16, "temperature": 0.9, "seed": 3}
    streamed, _ = _streamed(_stream(think_server, n=3, reasoning_shared=True, **fields))
    traces = {streamed[i]["reasoning"] for i in range(3)}
    assert len(traces) == 1 and traces.pop().endswith(SERVER_MESSAGE.strip())
    assert all(streamed[i]["content"] and streamed[i]["finish"] for i in range(3))


@pytest.mark.parametrize("leave_at", ["reasoning_content", "content"])
def test_a_client_that_leaves_a_shared_reasoning_gives_every_sequence_back(
    think_server: Server, leave_at: str
) -> None:
    """Gone while the first choice thinks alone (the others not forked yet), or once all
    answer: the at-rest check after the test finds every sequence back."""
    fields = {"n": 3, "reasoning_shared": True, "reasoning_budget": 8, "max_tokens": 48}
    chunks = _stream(think_server, logit_bias=NO_END, **fields)
    for chunk in chunks:
        if any(c["delta"].get(leave_at) for c in chunk["choices"]):
            break
    else:
        pytest.fail(f"no {leave_at} delta came")
    chunks.close()  # the connection closes mid-stream


# ---- Anthropic's thinking blocks ----


def test_messages_reply_with_a_thinking_block_streamed_alike(think_server: Server) -> None:
    """`/v1/messages`: the budget is `thinking.budget_tokens`; the reasoning is a thinking
    block before the text, streamed in its own block, as the `anthropic` package reads it."""
    kwargs: Any = {
        "model": "x",
        "max_tokens": 32,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": {"temperature": 0},  # greedy (this client takes no temperature)
        "thinking": {"type": "enabled", "budget_tokens": 4},
    }
    reference = _chat(think_server, reasoning_budget=4, **MARGINS)  # the same prompt and budget
    with anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0) as client:
        plain = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        off = client.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    same = []
    for reply in (plain, final):
        thinking, text = reply.content
        assert isinstance(thinking, ThinkingBlock) and isinstance(text, TextBlock)
        assert thinking.thinking.endswith(SERVER_MESSAGE.strip()) and text.text
        same.append(_same_text(thinking.thinking, text.text, reference, 4))
    if all(same):  # both equal the reference: equal to each other, signatures too
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert kinds.index("thinking") < kinds.index("text")
    (answer,) = off.content
    assert isinstance(answer, TextBlock) and "Paris" in answer.text
    # The reply passed back as the assistant turn, as the package's users continue (and a tool
    # loop with thinking must): accepted, its thinking not prompted again.
    later = {"role": "user", "content": "And of Italy?"}
    with anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0) as client:
        whole = [kwargs["messages"][0], {"role": "assistant", "content": plain.content}, later]
        text_only = [*whole[:1], {"role": "assistant", "content": plain.content[1:]}, later]
        count: Any = {"model": "x", "system": SYSTEM}
        assert (
            client.messages.count_tokens(**count, messages=whole).input_tokens
            == client.messages.count_tokens(**count, messages=text_only).input_tokens
        )
        again = client.messages.create(**{**kwargs, "messages": whole})
    assert again.content


def test_a_message_that_only_thought_has_no_empty_text_block(think_server: Server) -> None:
    """Cut by `max_tokens` inside its thinking: the reply is its thinking block alone,
    streamed or not (Anthropic refuses an empty text block passed back)."""
    kwargs: Any = {
        "model": "x",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0) as client:
        plain = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
    for reply in (plain, final):
        assert reply.stop_reason == "max_tokens"
        assert [block.type for block in reply.content] == ["thinking"], reply.content


def test_a_constrained_reply_answers_without_thinking_in_every_api(think_server: Server) -> None:
    """The template opens a think block; a `response_format` or a required tool call would
    shape the thinking instead of the answer (the JSON came out split between the two). The
    block is closed in the prompt: the answer is the whole JSON, nothing is reasoning."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reply = _chat(think_server, response_format=fmt, max_tokens=40)
    message = reply["choices"][0]["message"]
    assert not message.get("reasoning_content") and _reasoning_tokens(reply) == 0
    assert set(json.loads(message["content"])) == {"capital"}
    asked: Any = {
        "model": "x",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": "answer", "description": "Answer.", "input_schema": schema}],
        "tool_choice": {"type": "any"},
        "thinking": {"type": "enabled", "budget_tokens": 8},
    }
    with anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0) as client:
        answer = client.messages.create(**asked)
    assert [block.type for block in answer.content] == ["tool_use"], answer.content
    assert set(answer.content[0].input) == {"capital"}


# ---- OpenAI's Responses: a reasoning item ----


def test_responses_reply_with_a_reasoning_item_streamed_alike(think_server: Server) -> None:
    """`/v1/responses`: the reasoning (cut by the server's budget) is a `reasoning` output
    item before the message, streamed as `response.reasoning_text.delta` events, as the
    `openai` package reads them; passed back as input, it is accepted (and not prompted)."""
    client = think_server.client()
    kwargs: Any = {"model": "x", "input": QUESTION, "instructions": SYSTEM}
    kwargs.update(max_output_tokens=32, temperature=0)
    reference = _chat(think_server, **MARGINS)  # the same prompt, the server's budget
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # Completed, or incomplete at max_output_tokens (a reply that parted from the plain one
    # at a near-tie may run longer): the response as it ended.
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    reasoning, message = plain.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text.endswith(SERVER_MESSAGE.strip())
    assert message.type == "message" and plain.output_text
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == (
        SERVER_BUDGET + _forced_tokens(think_server, SERVER_MESSAGE)
    )
    streamed_reasoning = final.output[0]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert isinstance(streamed_reasoning, ResponseReasoningItem)
    assert streamed_reasoning.content is not None
    same = [
        _same_text(reasoning.content[0].text, plain.output_text, reference, SERVER_BUDGET),
        _same_text(streamed_reasoning.content[0].text, final.output_text, reference, SERVER_BUDGET),
    ]
    if all(same):
        assert streamed_reasoning.content[0].text == reasoning.content[0].text
        assert final.output_text == plain.output_text
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    again = client.responses.create(
        **{**kwargs, "input": [*plain.output, {"role": "user", "content": "And of Italy?"}]}
    )
    assert again.output_text
    off = client.responses.create(**kwargs, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and "Paris" in off.output_text


# ---- bad input ----


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"reasoning_budget": "10"}, 400, "reasoning_budget"),
        ("/v1/chat/completions", {"reasoning_budget": -2}, 400, "reasoning_budget"),
        ("/v1/chat/completions", {"reasoning_budget": 1.5}, 400, "reasoning_budget"),
        ("/v1/chat/completions", {"reasoning_budget_message": 3}, 400, "reasoning_budget_message"),
        (
            "/v1/chat/completions",
            {"reasoning_budget_message": "x" * 5000},
            400,
            "reasoning_budget_message",
        ),
        ("/v1/chat/completions", {"reasoning_format": "xml"}, 400, "reasoning_format"),
        ("/v1/chat/completions", {"reasoning_effort": "huge"}, 400, "reasoning_effort"),
        ("/v1/chat/completions", {"reasoning_control": "yes"}, 400, "reasoning_control"),
        ("/v1/chat/completions", {"reasoning_shared": 1}, 400, "reasoning_shared"),
        ("/v1/chat/completions", {"chat_template_kwargs": []}, 400, "chat_template_kwargs"),
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"messages": []}},
            400,
            "chat_template_kwargs",
        ),
        ("/v1/messages", {"thinking": {"type": "on"}}, 400, "thinking"),
        ("/v1/responses", {"reasoning": {"effort": "huge"}}, 400, "reasoning.effort"),
        ("/v1/responses", {"reasoning": "high"}, 400, "reasoning"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": -1}}, 400, None),
        ("/v1/chat/completions/control", {"action": "reasoning_end"}, 400, "id"),
        ("/v1/chat/completions/control", {"id": 7, "action": "reasoning_end"}, 400, "id"),
        ("/v1/chat/completions/control", {"id": "chatcmpl-x", "action": "stop"}, 400, "action"),
        ("/v1/chat/completions/control", {"id": "chatcmpl-x"}, 400, "action"),
        (
            "/v1/chat/completions/control",
            {"id": "chatcmpl-none", "action": "reasoning_end"},
            404,
            "id",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    think_server: Server, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    if path in ("/v1/chat/completions", "/v1/messages"):
        body = {"messages": MESSAGES[1:], "max_tokens": 4, **body}
    elif path == "/v1/responses":
        body = {"input": QUESTION, "max_output_tokens": 4, **body}
    got, reply = think_server.post(path, json.dumps(body).encode())
    assert got == status, reply
    if path == "/v1/messages":  # Anthropic's error shape names no field: its message does
        assert reply["type"] == "error" and "thinking" in reply["error"]["message"], reply
    else:
        assert reply["error"]["param"] == param, reply
    assert think_server.get("/health")[0] == 200


# ---- the splitter and the budget's state, on text ----


def _split(text: str, opened: Any, cuts: tuple[int, ...]) -> tuple[str, str]:
    """`text` fed to a Splitter in pieces cut at `cuts`: the reasoning and the content."""
    splitter, reasoning, content = Splitter(opened), "", ""
    edges = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(edges):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


THINK = MARKERS[0]
GPT_OSS = next(m for m in MARKERS if m.end == "<|end|>")


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("\nThe capital.\n</think>\n\nParis.", THINK, ("The capital.", "Paris.")),
        ("  <think>\nhmm  hm\n</think>\nAnswer", None, ("hmm  hm", "Answer")),
        ("[THINK]a b[/THINK]c", None, ("a b", "c")),
        ("<seed:think>x</seed:think>y", None, ("x", "y")),
        (
            GPT_OSS.start + "why" + GPT_OSS.end + GPT_OSS.lead + "Because.",
            None,
            ("why", "Because."),
        ),
        ("Hello <think> x", None, ("", "Hello <think> x")),  # not at the start: text
        ("\nParis.", None, ("", "\nParis.")),  # no block: content as written
        ("<thin", None, ("", "<thin")),  # a marker never completed is text
        ("\nno end yet </thi", THINK, ("no end yet </thi", "")),
        ("", THINK, ("", "")),
    ],
)
def test_the_split_is_the_same_however_the_text_is_cut(
    text: str, opened: Any, expected: tuple[str, str]
) -> None:
    assert _split(text, opened, ()) == expected
    for n in (1, 2):
        for cuts in itertools.combinations(range(1, len(text)), n):
            assert _split(text, opened, cuts) == expected, cuts


def test_a_prompt_that_ends_inside_a_block_opens_it() -> None:
    assert open_block("<|im_start|>assistant\n<think>\n") == THINK
    assert open_block("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert open_block("<|im_start|>assistant\n") is None
    assert open_block("[THINK]") == next(m for m in MARKERS if m.start == "[THINK]")


def test_the_budget_counts_the_tokens_inside_the_block() -> None:
    thought = Thought(Plan(budget=2, message=" ok"))
    assert [thought.saw(t) for t in ("<", "think", ">")] == [0, 0, 3]  # the marker's tokens
    assert not thought.due()
    thought.saw("a")
    thought.saw("b")
    assert thought.spent == 2 and thought.due() and thought.closing() == " ok</think>\n"
    thought.forced(thought.closing(), 4)
    assert thought.answering and not thought.due() and thought.tokens == 3 + 2 + 4
    assert thought.saw("Paris") == 0
    # A natural end, and an answer that never opened a block: nothing is due.
    natural = Thought(Plan(opened=THINK, budget=5))
    natural.saw("x")
    natural.saw("</think>")
    assert natural.answering and natural.tokens == 2 and not natural.ask_end()
    plain = Thought(Plan(budget=0))
    assert plain.saw("Hi") == 0 and plain.answering and not plain.due()


def test_a_control_request_ends_a_block_now_or_as_it_opens() -> None:
    thought = Thought(Plan(control=True))
    assert thought.ask_end() and not thought.due()  # not inside a block yet
    thought.saw("<think>")
    assert thought.due()


def test_a_plan_takes_the_request_over_the_server() -> None:
    defaults = Defaults(format="auto", budget=10, message="!")
    prompt = "assistant\n<think>\n"
    assert plan(Asked(), defaults, prompt, "id").budget == 10
    assert plan(Asked(budget=-1), defaults, prompt, None).budget is None
    assert plan(Asked(effort="none"), defaults, prompt, None).budget == 0
    chosen = plan(Asked(format="none", message="?"), defaults, prompt, "id")
    assert not chosen.splits and chosen.message == "?" and chosen.opened == THINK
    assert plan(Asked(), Defaults(), "assistant\n", None).steered is False
