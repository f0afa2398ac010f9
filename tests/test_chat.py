"""Chat templates (rendered as Hugging Face renders them) and warm multi-turn chat, on the real
chat model (SmolLM2-135M-Instruct, ChatML template in its GGUF)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.sandbox
import kvfork
import pytest
from kvfork._chat import HELPFUL_ASSISTANT

from .conftest import SLOW_PREFILL_BATCH, assert_same_text, margin

GREEDY = kvfork.SamplingParams(temperature=0.0)


def hf_render(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """What transformers' `apply_chat_template` renders (its jinja2 environment)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now(timezone.utc).strftime(f)
    return env.from_string(template).render(messages=messages, **variables)


CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hi!"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6."},
        {"role": "user", "content": "Thanks."},
    ],
    "unicode": [
        {"role": "user", "content": "héllo wörld — ünïcödé ✓ 日本語 🙂\n\ttabs and\nnewlines"}
    ],
    "empty": [{"role": "user", "content": ""}],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_model_template_renders_like_hugging_face(
    chat_ctx: kvfork.Context, name: str, gen: bool
) -> None:
    template = chat_ctx.model.chat_template
    assert template is not None and "<|im_start|>" in template
    messages = CONVERSATIONS[name]
    got = chat_ctx.format_chat(messages, add_generation_prompt=gen)
    want = hf_render(template, messages, add_generation_prompt=gen, bos_token="", eos_token="")
    assert got.prompt == want
    assert "<|im_end|>" in got.stop


# A template that uses what real ones use: whitespace control, loop controls, namespace,
# tojson on tool schemas (with characters an HTML-safe encoder would escape), Python string
# and dict methods, raise_exception, strftime_now, extra keyword variables.
RICH = """{%- set ns = namespace(sys='') -%}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% set ns.sys = m['content'].strip() %}{% continue %}{% endif %}
  {% if m['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
<{{ m['role'] }}>{{ m['content'] | trim }}
  {% if m.get('tool_calls') %}
    {% for call in m['tool_calls'] %}CALL {{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}
    {% endfor %}
  {% endif %}
  {% if loop.index >= limit %}{% break %}{% endif %}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson }}
{{ tools[0] | tojson(indent=2) }}
{% endif %}
SYSTEM={{ ns.sys.upper() }} {{ 'x' if ns.sys.startswith('You') else 'y' }}
{% for k, v in meta.items() %}{{ k }}={{ v }};{% endfor %}
DATE={{ strftime_now('%Y-%m-%d') }}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def test_rich_template_renders_like_hugging_face(chat_ctx: kvfork.Context) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "Find <b>pages</b> & 'quotes' — ünï",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "  You are kind.  "},
        {"role": "user", "content": " What's new? "},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "search", "arguments": {"q": "news <today>"}}}],
        },
        {"role": "tool", "content": "nothing", "tool_call_id": "1"},
        {"role": "user", "content": "ok"},
    ]
    meta = {"b": 2, "a": 1}
    got = chat_ctx.format_chat(messages, tools=tools, template=RICH, limit=3, meta=meta)
    want = hf_render(
        RICH,
        messages,
        tools=tools,
        add_generation_prompt=True,
        limit=3,
        meta=meta,
        bos_token="",
        eos_token="",
    )
    assert got.prompt == want


def test_builtin_templates_by_name(ctx: kvfork.Context) -> None:
    # The default model has no template of its own; llama.cpp's built-ins work by name.
    assert ctx.model.chat_template is None
    messages = [{"role": "user", "content": "Hi"}]
    chatml = ctx.format_chat(messages, template="chatml")
    assert chatml.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    gemma = ctx.format_chat(messages, template="gemma")
    assert gemma.prompt.startswith("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma.prompt.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize(
    ("messages", "template", "match"),
    [
        ([{"role": "user", "content": "x"}], None, "no chat template"),
        ([{"content": "x"}], "chatml", "role"),
        ([{"role": "user", "content": 5}], "chatml", "content"),
        ("not a list", "chatml", "list"),
        (["not a dict"], "chatml", "dict"),
        ([{"role": "user", "content": "x"}], "{% if %}", "syntax"),
        ([{"role": "user", "content": "x"}], "{{ raise_exception('no users here') }}", "no users"),
        ([{"role": "user", "content": "x"}], "{{ messages[5]['content'].foo() }}", "undefined"),
    ],
)
def test_chat_template_errors(
    ctx: kvfork.Context, messages: Any, template: str, match: str
) -> None:
    with pytest.raises(kvfork.ChatTemplateError, match=match):
        ctx.format_chat(messages, template=template)


def test_a_template_that_would_run_for_hours_is_stopped_and_a_long_chat_is_not(
    chat_ctx: kvfork.Context,
) -> None:
    """A template is code: one rendering runs a bounded number of instructions (nested
    `range` loops ran 10^10 and could not be interrupted), well above what a conversation of
    5,000 messages takes in the model's own template."""
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(kvfork.ChatTemplateError, match="fuel"):
        chat_ctx.format_chat([{"role": "user", "content": "x"}], template=endless)
    roles = ("user", "assistant")
    chat = [{"role": roles[i % 2], "content": f"message {i}"} for i in range(5000)]
    assert "message 4999" in chat_ctx.format_chat(chat).prompt


def test_unconvertible_message_values_are_type_errors(ctx: kvfork.Context) -> None:
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        ctx.format_chat([{"role": "user", "content": object()}], template="chatml")


# ---- warm multi-turn


# Replies the model gives with clear margins at most tokens (the second and third at 1.4 and
# over): greedy decoding is then the same whether history tokens were decoded one by one or
# prefilled in a batch (those rows differ by noise, conftest.LOGIT_NOISE), up to a near-tie
# (conftest's margin rule).
QUESTIONS = [
    "Repeat exactly: red green blue",
    "Repeat exactly: one two three",
    "Repeat exactly: cat dog bird",
]


class Reply(NamedTuple):
    """A reference reply: its text (cut at a stop string), and the text and margin of each
    token drawn (a stop token last, with no text)."""

    text: str
    pieces: list[str]
    margins: list[float]


def cold_replies(ctx: kvfork.Context) -> tuple[list[Reply], int]:
    """Each turn re-rendered and re-prefilled from nothing."""
    messages: list[dict[str, Any]] = []
    replies, prefilled = [], 0
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        chat = ctx.format_chat(messages)
        b = kvfork.Branch.create(ctx, 0, GREEDY)
        toks = ctx.tokenize(chat.prompt, parse_special=True)
        prefilled += len(toks)
        b.prefill_sync(toks)
        text, pieces, margins = "", [], []
        for _ in range(24):
            margins.append(margin(b.logits()))
            tok = b.produce_sync()
            pieces.append("" if tok.is_stop else tok.text)
            if tok.is_stop:
                break
            b.commit_sync(tok)
            text += tok.text
            if any(s in text for s in chat.stop):
                break
        cut = min([text.find(s) for s in chat.stop if s in text] or [len(text)])
        replies.append(Reply(text[:cut], pieces, margins))
        messages.append({"role": "assistant", "content": text[:cut]})
        b.prune_sync()
    return replies, prefilled


def test_warm_turns_equal_cold_turns_and_prefill_less(chat_ctx: kvfork.Context) -> None:
    cold, cold_prefilled = cold_replies(chat_ctx)
    chat = kvfork.Chat(chat_ctx, params=GREEDY)
    warm = [chat.send_sync(q, max_tokens=24) for q in QUESTIONS]
    for got, reference in zip(warm, cold, strict=True):
        if not assert_same_text(got, reference.text, reference.pieces, reference.margins):
            break  # the histories part: later turns are not comparable
    assert chat.cold_restarts == 0
    assert chat.prefilled_tokens < cold_prefilled / 2
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3


async def test_async_chat_equals_sync_chat(chat_ctx: kvfork.Context) -> None:
    # One chat after the other, the first pruned before the second starts: the second's turns
    # land in the first's cells, the same decodes over the same cells, bit for bit.
    a = kvfork.Chat(chat_ctx, params=GREEDY, system="Answer in one word.")
    replies = [await a.send(q, max_tokens=16) for q in QUESTIONS[:2]]
    assert a.branch is not None
    await a.branch.prune()
    b = kvfork.Chat(chat_ctx, params=GREEDY, system="Answer in one word.")
    assert [b.send_sync(q, max_tokens=16) for q in QUESTIONS[:2]] == replies
    assert a.messages == b.messages and a.messages[0]["role"] == "system"


async def test_a_forked_chat_continues_like_the_original(chat_ctx: kvfork.Context) -> None:
    chat = kvfork.Chat(chat_ctx, params=GREEDY, system="Answer briefly.")
    await chat.send(QUESTIONS[0], max_tokens=16)
    side = await chat.fork()
    assert side.branch is not None and side.branch.parent is not None
    assert side.messages == chat.messages and side.messages is not chat.messages
    forked = await side.send(QUESTIONS[1], max_tokens=16)
    assert side.prefilled_tokens < 40  # only the new turn: the history is shared KV
    assert len(chat.messages) == 3  # the original is untouched
    # The fork pruned first, the original's turn lands in the cells the fork's took: the
    # same decodes over the same cells, bit for bit.
    await side.branch.prune()
    straight = await chat.send(QUESTIONS[1], max_tokens=16)
    assert forked == straight
    unstarted = kvfork.Chat(chat_ctx, params=GREEDY).fork_sync()
    assert unstarted.branch is None and unstarted.messages == []


def test_a_forked_chat_can_still_start_over(chat_ctx: kvfork.Context) -> None:
    """A turn that must start over on a fresh branch (here the last exchange is dropped to
    ask again) frees the old branch, which a fork's branch is a child of: the fork keeps
    the cells it shares and goes on."""
    chat = kvfork.Chat(chat_ctx, params=GREEDY)
    chat.send_sync(QUESTIONS[0], max_tokens=6)
    side = chat.fork_sync()
    side.send_sync(QUESTIONS[1], max_tokens=6)
    del chat.messages[-2:]
    chat.send_sync(QUESTIONS[2], max_tokens=6)
    assert chat.cold_restarts == 1 and len(chat.messages) == 2
    side.send_sync(QUESTIONS[2], max_tokens=6)
    assert side.branch is not None and side.cold_restarts == 0
    held = chat_ctx.detokenize(side.branch.history, unparse_special=True)
    said = chat_ctx.format_chat(side.messages[:-1], add_generation_prompt=True).prompt
    assert held.startswith(said) and len(side.messages) == 6


async def test_a_stream_left_unfinished_ends_when_the_next_turn_starts(
    chat_ctx: kvfork.Context,
) -> None:
    """A ``break`` out of a reply's stream does not close it (an async generator is closed
    later by the event loop, a sync one when collected): the next turn ends it first, so
    its reply joins before the new turn, as far as it went, and the stream yields no more.
    A turn while a reply is generating is refused."""

    def check(chat: kvfork.Chat) -> None:
        assert chat.branch is not None and chat.cold_restarts == 0
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
        held = chat_ctx.detokenize(chat.branch.history, unparse_special=True)
        said = chat_ctx.format_chat(chat.messages[:-1], add_generation_prompt=True).prompt
        assert held.startswith(said), (held, said)

    chat = kvfork.Chat(chat_ctx, params=GREEDY)
    pieces = chat.stream_sync("Count from 1 to 30 with commas.", max_tokens=40)
    for i, _ in enumerate(pieces):
        if i == 4:
            break
    chat.send_sync("Thanks.", max_tokens=4)
    assert list(pieces) == []
    check(chat)
    assert chat.branch is not None
    chat.branch.prune_sync()

    chat = kvfork.Chat(chat_ctx, params=GREEDY)
    agen = chat.stream("Count from 1 to 30 with commas.", max_tokens=40)
    async for _ in agen:
        break
    await chat.send("Thanks.", max_tokens=4)
    assert [p async for p in agen] == []
    check(chat)
    task = asyncio.create_task(chat.send("Count to 50.", max_tokens=40))
    while chat.branch is None or len(chat.messages) < 5:  # noqa: ASYNC110 (until it generates)
        await asyncio.sleep(0.002)
    with pytest.raises(RuntimeError, match="one turn at a time"):
        await chat.send("And now?")
    await task
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3


def test_a_fork_ends_a_stream_left_unfinished_first(chat_ctx: kvfork.Context) -> None:
    """The branch holds the cut reply's tokens: the fork's messages must too (they lacked
    it, and the fork's next turn was prefilled after tokens its messages did not say)."""
    chat = kvfork.Chat(chat_ctx, params=GREEDY)
    pieces = chat.stream_sync("Count from 1 to 30 with commas.", max_tokens=40)
    for i, _ in enumerate(pieces):
        if i == 4:
            break
    side = chat.fork_sync()
    assert list(pieces) == []  # ended by the fork
    for c in (chat, side):
        assert [m["role"] for m in c.messages] == ["user", "assistant"]
        assert c.messages[-1]["content"]
    side.send_sync("Thanks.", max_tokens=4)
    assert side.branch is not None and side.cold_restarts == 0
    held = chat_ctx.detokenize(side.branch.history, unparse_special=True)
    said = chat_ctx.format_chat(side.messages[:-1], add_generation_prompt=True).prompt
    assert held.startswith(said), (held, said)
    side.branch.prune_sync()
    assert chat.branch is not None
    chat.branch.prune_sync()


async def test_a_turn_while_another_is_prefilled_is_refused(chat_ctx: kvfork.Context) -> None:
    """Two tasks sending on one chat at once: the second, sent while the first's prompt is
    still prefilled, was taken too (both prefilled the same branch); it is refused, and the
    conversation is the first turn's alone."""
    chat = kvfork.Chat(chat_ctx, params={"temperature": 0.0})
    first = asyncio.create_task(chat.send("Tell me a story. " * 40, max_tokens=4))
    while chat.branch is None:  # noqa: ASYNC110 (until its prefill starts)
        await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="prefilling a turn"):
        await chat.send("And another.")
    await first
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    await chat.send("Thanks.", max_tokens=4)  # the next turn is taken
    assert len(chat.messages) == 4


async def test_a_turn_that_fails_or_is_cancelled_leaves_the_conversation_as_it_was(
    chat_model: kvfork.Model,
) -> None:
    """A turn joins the conversation only once its prefill is in the branch: one too long
    for the context, or cancelled mid-way, leaves the messages and the branch as they were,
    and the next turn prefills only itself, as if the failed one had never been sent."""
    # Small decodes on a GPU, where 1,500 tokens in one would be done before the cancel.
    with kvfork.create_context_sync(
        chat_model, n_ctx=2048, n_seq_max=4, n_batch=SLOW_PREFILL_BATCH
    ) as chat_ctx:
        chat = kvfork.Chat(chat_ctx, params=GREEDY, system="Answer briefly.")
        await chat.send(QUESTIONS[0], max_tokens=12)

        def state() -> tuple[object, ...]:
            assert chat.branch is not None
            return [dict(m) for m in chat.messages], chat.branch.position, chat.prefilled_tokens

        before = state()
        with pytest.raises(kvfork.KvCacheFullError):
            chat.send_sync("word " * 2500, max_tokens=8)  # more tokens than n_ctx = 2048
        assert state() == before
        task = asyncio.create_task(chat.send("word " * 1500, max_tokens=8))
        await asyncio.sleep(0.3)  # in the middle of its ~1,500-token prefill
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert state() == before
        await chat.send(QUESTIONS[1], max_tokens=12)
        assert chat.branch is not None
        await chat.branch.prune()
        straight = kvfork.Chat(chat_ctx, params=GREEDY, system="Answer briefly.")
        for question in QUESTIONS[:2]:
            await straight.send(question, max_tokens=12)
        roles = ["system", "user", "assistant", "user", "assistant"]
        assert [m["role"] for m in chat.messages] == roles
        assert chat.cold_restarts == 0 and chat.prefilled_tokens == straight.prefilled_tokens
        assert chat.messages[:3] == straight.messages[:3]


async def test_a_reply_cancelled_while_generating_is_recorded_as_the_kv_holds_it(
    chat_ctx: kvfork.Context,
) -> None:
    """The step in flight when a reply is cancelled commits its token without yielding it:
    that token joins the reply, or every later turn would be prefilled after a token the
    conversation in ``messages`` does not have."""
    for wait in (2, 5, 9):
        chat = kvfork.Chat(chat_ctx, params=GREEDY, system="You are terse.")
        await chat.send("Say hi.", max_tokens=8)
        task = asyncio.create_task(chat.send("Count from 1 to 50 with commas.", max_tokens=60))
        while len(chat.messages) < 4:  # noqa: ASYNC110 (until the turn is prefilled)
            await asyncio.sleep(0.002)
        assert chat.branch is not None
        start = chat.branch.position
        while chat.branch.position < start + wait:  # noqa: ASYNC110 (a few tokens in)
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await chat.send("Thanks.", max_tokens=4)
        held = chat_ctx.detokenize(chat.branch.history, unparse_special=True)
        said = chat_ctx.format_chat(chat.messages[:-1], add_generation_prompt=True).prompt
        assert held.startswith(said), (held, said)
        await chat.branch.prune()


def test_warm_turn_is_faster_than_cold(chat_ctx: kvfork.Context) -> None:
    long_system = "You are a careful assistant. " * 60
    chat = kvfork.Chat(chat_ctx, params=GREEDY, system=long_system)
    chat.send_sync("Hello.", max_tokens=4)
    t0 = time.perf_counter()
    chat.send_sync("Name a fruit.", max_tokens=4)
    warm = time.perf_counter() - t0
    _, cold = cold_prefill_time(chat_ctx, chat.messages[:-1])
    assert warm < cold


def cold_prefill_time(ctx: kvfork.Context, messages: list[dict[str, Any]]) -> tuple[int, float]:
    toks = ctx.tokenize(ctx.format_chat(messages).prompt, parse_special=True)
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    t0 = time.perf_counter()
    b.prefill_sync(toks)
    for _ in b.generate_sync(max_tokens=4):
        pass
    elapsed = time.perf_counter() - t0
    b.prune_sync()
    return len(toks), elapsed


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What color is the sky on a clear day?", "blue"),
        ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ],
)
def test_the_documented_system_prompt_gets_answers(
    chat_ctx: kvfork.Context, question: str, expected: str
) -> None:
    """The system prompt of the README, examples/chat.py and `kvfork chat` is one the small chat
    model follows (without one, or with "Answer briefly.", it answers in French nonsense)."""
    chat = kvfork.Chat(chat_ctx, params=GREEDY, system=HELPFUL_ASSISTANT)
    reply = chat.send_sync(question, max_tokens=32)
    assert expected.lower() in reply.lower(), reply
    assert chat.branch is not None
    chat.branch.prune_sync()


def test_the_readme_uses_the_documented_system_prompt() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f'system="{HELPFUL_ASSISTANT}"' in readme


def test_a_turn_cut_inside_a_character_leaves_the_next_reply_whole(
    chat_ctx: kvfork.Context,
) -> None:
    """A reply cut by `max_tokens` inside an emoji (SmolLM2 writes them as byte tokens, greedy
    here) leaves the character's first bytes unfinished: the next turn's prefill comes
    between, so the next reply starts clean (its first character was U+FFFD)."""
    chat = kvfork.Chat(chat_ctx, params={"temperature": 0}, system="You are a helpful assistant.")
    chat.send_sync("Réponds en emoji \U0001f389\U0001f1eb\U0001f1f7 — 日本語?", max_tokens=30)
    for question in ("Count to five.", "And Germany?"):
        assert chat.branch is not None
        before = chat.branch.position
        reply = chat.send_sync(question, max_tokens=30)
        generated = chat_ctx.detokenize(chat.branch.history[before:], unparse_special=True)
        assert generated.endswith("\ufffd")  # cut inside a character: what this test is about
        assert reply and "\ufffd" not in reply and reply == chat.messages[-1]["content"], reply


@pytest.mark.parametrize("bad", [-1, "5", 2.5, True], ids=["negative", "str", "float", "bool"])
async def test_a_bad_max_tokens_is_refused_before_the_turn_starts(
    chat_ctx: kvfork.Context, bad: Any
) -> None:
    chat = kvfork.Chat(chat_ctx, params={"temperature": 0})
    chat.send_sync("Hi", max_tokens=4)
    assert chat.branch is not None
    branch = chat.branch
    before = (list(chat.messages), branch.position, chat.cold_restarts)
    error = TypeError if not isinstance(bad, int) or isinstance(bad, bool) else ValueError
    with pytest.raises(error, match="max_tokens"):
        chat.send_sync("What is 2+2?", max_tokens=bad)
    with pytest.raises(error, match="max_tokens"):
        await chat.send("What is 2+2?", max_tokens=bad)
    with pytest.raises(error, match="max_tokens"):
        async for _ in chat.stream("What is 2+2?", max_tokens=bad):
            pass
    with pytest.raises(error, match="max_tokens"):
        list(chat.stream_sync("What is 2+2?", max_tokens=bad))
    assert (chat.messages, branch.position, chat.cold_restarts) == before
    assert chat.send_sync("What is 3+3?", max_tokens=4)
    assert chat.cold_restarts == before[2]  # still warm
