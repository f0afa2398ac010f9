"""Automatic context shift: `generate(on_context_full="shift")` streams on past n_ctx by
keeping the first `keep` tokens of the branch's sequence and the most recent half of the
rest (llama.cpp's --context-shift); `shift_context` does one shift; `reseed_context` takes
its tail from the whole sequence, prompt included; `Chat(on_context_full="shift")`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import kvfork
import pytest

from .conftest import COUNTING, assert_same_greedy, greedy_with_margins

PROMPT = "Chapter one. It was a cold morning in the village, and"


def no_stop(ctx: kvfork.Context) -> dict[int, float]:
    """A logit bias that bans every end-of-generation token (the stream cannot end early)."""
    return {t: float("-inf") for t in range(ctx.vocab_size) if ctx.is_stop_token(t)}


def shifted_positions(n_ctx: int, start: int, keep: int, n: int) -> tuple[int, int]:
    """(shifts, final position) of `n` steps from `start` under llama.cpp's rule."""
    position, shifts = start, 0
    for _ in range(n):
        if position == n_ctx:
            rest = position - keep
            position = keep + rest - rest // 2
            shifts += 1
        position += 1
    return shifts, position


@pytest.fixture
def small(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=128, n_seq_max=2) as c:
        yield c


def prompted(ctx: kvfork.Context, params: dict[str, object]) -> tuple[kvfork.Branch, list[int]]:
    b = kvfork.Branch.create(ctx, 0, params)
    b.set_logit_bias(no_stop(ctx))
    prompt = ctx.tokenize(PROMPT)
    b.prefill_sync(prompt)
    return b, prompt


def test_a_stream_shifts_through_three_contexts(small: kvfork.Context) -> None:
    n_ctx = small.n_ctx
    b, prompt = prompted(small, {"temperature": 0.7, "seed": 3, "repeat_penalty": 1.1})
    stream = b.generate_sync(3 * n_ctx, on_context_full="shift")
    tokens = [t.token for t in stream]
    assert len(tokens) == 3 * n_ctx and stream.stop_reason == "max_tokens"
    shifts, position = shifted_positions(n_ctx, len(prompt), 4, 3 * n_ctx)
    assert stream.shifts == shifts >= 4 and b.position == position
    history = b.history
    # The first 4 tokens of the prompt stay; the rest of the KV is the latest output.
    assert history[:4] == prompt[:4] and history[4:] == tokens[-(position - 4) :]
    text = small.detokenize(tokens)
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.7 * len(text)


def test_an_async_stream_shifts_keeping_the_whole_prompt(small: kvfork.Context) -> None:
    n_ctx = small.n_ctx

    async def run() -> tuple[list[int], int, kvfork.Branch, list[int]]:
        b, prompt = prompted(small, {"temperature": 0.0, "repeat_penalty": 1.3})
        stream = b.generate(2 * n_ctx, on_context_full="shift", keep=len(prompt))
        tokens = [t.token async for t in stream]
        return tokens, stream.shifts, b, prompt

    tokens, shifts, b, prompt = asyncio.run(run())
    assert len(tokens) == 2 * n_ctx
    assert shifts == shifted_positions(n_ctx, len(prompt), len(prompt), 2 * n_ctx)[0] > 0
    assert b.history[: len(prompt)] == prompt


def test_without_shift_the_stream_stops_at_n_ctx(small: kvfork.Context) -> None:
    b, prompt = prompted(small, {"temperature": 0.0})
    stream = b.generate_sync(3 * small.n_ctx)
    assert len(list(stream)) == small.n_ctx - len(prompt)
    assert stream.stop_reason == "context_full" and stream.shifts == 0


class Replay:
    """Guesses what a plain greedy run from `prompt` (stop tokens banned, shifting at
    n_ctx) drew after the same last 4 tokens: its next 4 tokens."""

    def __init__(self, ctx: kvfork.Context, prompt: list[int], n: int) -> None:
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.set_logit_bias(no_stop(ctx))
        b.prefill_sync(prompt)
        run = prompt + [t.token for t in b.generate_sync(n, on_context_full="shift", keep=2)]
        b.prune_sync()
        self.after = {tuple(run[i - 4 : i]): run[i] for i in range(4, len(run))}

    def propose(self, tokens: Sequence[int]) -> list[int]:
        tail, guess = list(tokens[-4:]), list[int]()
        while len(guess) < 4 and (nxt := self.after.get(tuple(tail))) is not None:
            guess.append(nxt)
            tail = [*tail[1:], nxt]
        return guess


@pytest.mark.parametrize("sync", [True, False])
def test_a_speculative_stream_shifts_too(small: kvfork.Context, sync: bool) -> None:
    n_ctx = small.n_ctx
    # Guesses good enough to be decoded (PromptLookup's on this count are refused too often
    # to pay: the shadow checks tell the stream so, and it decodes no guess).
    draft = Replay(small, small.tokenize(COUNTING), 2 * n_ctx)
    b = kvfork.Branch.create(small, 0, {"temperature": 0.0})
    b.set_logit_bias(no_stop(small))
    b.prefill_sync(small.tokenize(COUNTING))
    stream: kvfork.SpeculativeStream | kvfork.SpeculativeStreamSync
    if sync:
        stream = b.generate_sync(2 * n_ctx, draft=draft, on_context_full="shift", keep=2)
        tokens = [t.token for t in stream]
    else:
        s = b.generate(2 * n_ctx, draft=draft, on_context_full="shift", keep=2)

        async def run() -> list[int]:
            return [t.token async for t in s]

        stream = s
        tokens = asyncio.run(run())
    assert len(tokens) == 2 * n_ctx and stream.stop_reason == "max_tokens"
    assert stream.shifts >= 2 and stream.accepted > 0
    assert b.history[:2] == small.tokenize(COUNTING)[:2] and b.position < n_ctx


def test_shift_context_keeps_the_first_tokens_and_the_recent_half(
    small: kvfork.Context,
) -> None:
    b, prompt = prompted(small, {"temperature": 0.0})
    out = [t.token for t in b.generate_sync(20)]
    before = b.history
    assert before == prompt + out
    b.shift_context_sync(3)
    rest = len(before) - 3
    assert b.history == before[:3] + before[len(before) - (rest - rest // 2) :]
    assert b.position == len(b.history)
    nxt = b.produce_sync()  # generation goes on from the kept tokens
    assert not nxt.is_stop


def test_reseed_takes_its_tail_from_the_whole_sequence(small: kvfork.Context) -> None:
    b, prompt = prompted(small, {"temperature": 0.0})
    out = [t.token for t in b.generate_sync(3)]
    # A tail longer than the output reaches into the prompt.
    b.reseed_context_sync([], 8)
    assert b.history == (prompt + out)[-8:]
    # Sinks the sequence begins with are not repeated by a tail that reaches them.
    b.reseed_context_sync(b.history[:2], 100)
    assert b.history == (prompt + out)[-8:]


def test_bad_shift_arguments_raise(small: kvfork.Context) -> None:
    b, _ = prompted(small, {"temperature": 0.0})
    n_ctx = small.n_ctx
    with pytest.raises(ValueError, match='"stop" or "shift"'):
        b.generate_sync(4, on_context_full="wrap")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match='"stop" or "shift"'):
        b.generate(4, draft=kvfork.PromptLookup(), on_context_full="Shift")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="on_context_full"):
        b.generate_sync(4, on_context_full=1)  # type: ignore[call-overload]
    for keep in (n_ctx - 1, n_ctx, 2**40):
        with pytest.raises(ValueError, match="keep"):
            b.generate_sync(4, on_context_full="shift", keep=keep)
        with pytest.raises(ValueError, match="keep"):
            b.shift_context_sync(keep)
    with pytest.raises(ValueError, match="keep"):
        b.generate_sync(4, on_context_full="shift", keep=-1)
    with pytest.raises(ValueError, match="keep"):
        b.generate_sync(4, draft=kvfork.PromptLookup(), on_context_full="shift", keep=n_ctx)
    with pytest.raises(ValueError, match='"stop" or "shift"'):
        kvfork._native.SpeculativeSchedule(4, on_context_full="never")  # type: ignore[arg-type]
    assert b.generate_sync(4, on_context_full="shift", keep=n_ctx - 2).shifts == 0
    with pytest.raises(ValueError, match='"stop" or "shift"'):
        kvfork.Chat(small, on_context_full="always")  # type: ignore[arg-type]


def test_a_chat_shifts_and_keeps_its_system_message(chat_model: kvfork.Model) -> None:
    with kvfork.create_context_sync(chat_model, n_ctx=256, n_seq_max=1) as ctx:
        chat = kvfork.Chat(
            ctx,
            params={"temperature": 0.0},
            system="You are a helpful assistant.",
            on_context_full="shift",
        )
        chat.send_sync("Tell me about the sea.", max_tokens=40)
        assert chat.branch is not None
        system = chat.branch.history[:8]
        topics = ["rivers", "mountains", "forests", "deserts", "cities", "rain", "stars"]
        replies = [chat.send_sync(f"Tell me about {t}.", max_tokens=60) for t in topics]
        assert chat.shifts > 0 and all(replies)
        assert chat.branch.history[:8] == system
        assert chat.branch.position < ctx.n_ctx
        # The system message's tokens were kept, not 4 sink tokens.
        assert chat._keep > 4


def test_a_failed_reseed_puts_the_branch_back_from_a_host_copy(
    model: kvfork.Model,
) -> None:
    """Sinks of its own plus a long tail need more cells than emptying the branch frees (an
    unrelated branch holds the rest): the re-prefill fails and the branch's cells come back
    as they were — same tokens, same logits, the same next token."""
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2) as ctx:
        words = ctx.tokenize("The history of the printing press begins with " * 30)
        other = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        other.prefill_sync(words[:40])
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(words[:200])
        history, logits = b.history, b.logits()
        with pytest.raises(kvfork.KvCacheFullError, match="the branch is unchanged"):
            b.reseed_context_sync(words[-50:], 200)  # 250 tokens, 216 cells free
        assert b.history == history and b.position == 200
        assert ctx.kv_seq_pos_max_sync(b.seq_id) == 199
        assert (b.logits() == logits).all()
        went_on = [t.token for t in b.generate_sync(8)]
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as fresh:
        alone = kvfork.Branch.create(fresh, 0, {"temperature": 0.0})
        alone.prefill_sync(words[:200])
        assert_same_greedy(went_on, *greedy_with_margins(alone, 8))


def test_a_shift_whose_cells_are_shared_fails_to_an_empty_branch(
    model: kvfork.Model,
) -> None:
    """A fork holds the branch's prompt cells: at n_ctx, emptying the branch frees only what
    it generated, too few for the kept tokens, and its cells cannot come back as copies
    either. The stream raises; the branch is empty, without logits (never generating from
    logits its cache no longer holds), and takes a prefill again; the fork is untouched."""
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2) as ctx:
        assert ctx.n_ctx == 256
        b, prompt = prompted(ctx, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize(" It was a long winter." * 40)[: 200 - len(prompt)])
        fork = b.fork_sync()
        stream = b.generate_sync(80, on_context_full="shift")
        with pytest.raises(kvfork.KvCacheFullError, match="now empty"):
            for _ in stream:
                pass
        assert b.history == [] and b.position == 0 and ctx.kv_seq_pos_max_sync(b.seq_id) == -1
        with pytest.raises(kvfork.KvforkError, match="no logits"):
            b.produce_sync()
        assert fork.position == 200 and ctx.kv_seq_pos_max_sync(fork.seq_id) == 199
        b.prefill_sync(prompt)
        assert not b.produce_sync().is_stop
