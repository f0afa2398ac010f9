"""Independent asyncio tasks share decodes: tokens as if alone, one decode per step, packed
prefills, and a failure (or a cancel) in shared work stays with the task it belongs to."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import kvfork
import pytest

from .conftest import (
    GREEDY,
    SLOW_PREFILL_BATCH,
    Trace,
    assert_close_logits,
    assert_follows,
    assert_same_greedy,
    greedy_with_margins,
)

N_TASKS = 16
STEPS = 16


def counting(k: int) -> str:
    """A prompt greedy continues with clear margins, different for each task."""
    return ", ".join(str(i) for i in range(k, k + 10)) + ","


async def produce_commit(
    b: kvfork.Branch, steps: int, first: asyncio.Event | None = None
) -> list[int]:
    """`steps` greedy tokens produced and committed; `first` is set once the first is in."""
    out = []
    for _ in range(steps):
        t = await b.produce()
        await b.commit(t)
        out.append(t.token)
        if first is not None:
            first.set()
    return out


@pytest.fixture
def wide(model: kvfork.Model) -> Iterator[kvfork.Context]:
    ctx = kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=N_TASKS)
    yield ctx
    ctx.close()


@pytest.fixture
def slow(model: kvfork.Model) -> Iterator[kvfork.Context]:
    """`wide` with prompts that decode for a while on any backend (SLOW_PREFILL_BATCH)."""
    ctx = kvfork.create_context_sync(
        model, n_ctx=2048, n_seq_max=N_TASKS, n_batch=SLOW_PREFILL_BATCH
    )
    yield ctx
    ctx.close()


async def test_tasks_get_their_own_tokens_in_one_decode_per_step(wide: kvfork.Context) -> None:
    alone = []
    for k in range(N_TASKS):
        b = kvfork.Branch.create(wide, 0, GREEDY)
        b.prefill_sync(wide.tokenize(counting(k)))
        alone.append(greedy_with_margins(b, STEPS))
        b.prune_sync()

    async def task(k: int) -> list[int]:
        b = kvfork.Branch.create(wide, 0, GREEDY)
        await b.prefill(wide.tokenize(counting(k)))
        tokens = await produce_commit(b, STEPS)
        await b.prune()
        return tokens

    before = wide.stats()["decode_calls"]
    got = await asyncio.gather(*(task(k) for k in range(N_TASKS)))
    decodes = wide.stats()["decode_calls"] - before
    for k, (tokens, margins) in enumerate(alone):
        assert_same_greedy(got[k], tokens, margins)
    # One packed prefill and one decode per step; a little slack for a starved CI machine
    # (16 tasks alone would take 16 * 17 = 272).
    assert decodes <= (STEPS + 1) * 1.25, decodes


async def test_seeded_tasks_sample_as_they_would_alone(wide: kvfork.Context) -> None:
    """The RNG stream of each task's sampler is its own: what it draws does not depend on
    which other tasks shared its decodes. Each task's tokens and the rows it drew them from
    are observed; then a branch alone, with the task's seed, follows it
    (`conftest.assert_follows`): its own rows are the task's up to the noise of the other
    batch shapes, and drawing from the task's rows it draws the task's tokens, exactly."""
    params = [kvfork.SamplingParams(temperature=0.8, top_k=3, seed=100 + k) for k in range(8)]

    async def task(k: int) -> Trace:
        b = kvfork.Branch.create(wide, 0, params[k])
        await b.prefill(wide.tokenize(counting(k)))
        trace = Trace([], [b.logits()])
        async for t in b.generate(max_tokens=STEPS):
            trace.tokens.append(t.token)
            trace.rows.append(b.logits())  # commit-before-yield: the next token's row
        await b.prune()
        return Trace(trace.tokens, trace.rows[: len(trace.tokens)])

    traces = await asyncio.gather(*(task(k) for k in range(8)))
    assert all(len(t.tokens) == STEPS for t in traces)
    for k, trace in enumerate(traces):
        b = kvfork.Branch.create(wide, 0, params[k])
        b.prefill_sync(wide.tokenize(counting(k)))
        assert_follows(b, trace)
        b.prune_sync()


async def test_prefills_of_tasks_are_packed(wide: kvfork.Context) -> None:
    prompts = [wide.tokenize(counting(k)) for k in range(N_TASKS)]
    alone = []
    for p in prompts:
        b = kvfork.Branch.create(wide, 0, GREEDY)
        b.prefill_sync(p)
        alone.append(b.logits())
        b.prune_sync()
    branches = [kvfork.Branch.create(wide, 0, GREEDY) for _ in prompts]
    before = wide.stats()["decode_calls"]
    await asyncio.gather(*(b.prefill(p) for b, p in zip(branches, prompts, strict=True)))
    assert wide.stats()["decode_calls"] - before <= 2  # 1 unless the machine stalls
    for b, p, ref in zip(branches, prompts, alone, strict=True):
        assert b.position == len(p)
        assert_close_logits(b.logits(), ref)  # packed: equal up to noise


async def test_steps_of_running_streams_ride_the_decode_of_new_prompts(
    wide: kvfork.Context,
) -> None:
    """Queued interleaved (a server: streams stepping while new requests prefill), the
    streams' commits and the new prompts of other branches share ONE decode (continuous
    prefill): the prompt tokens and one token of each stream."""
    prompts = [wide.tokenize(counting(k)) for k in range(4)]
    stepping = [kvfork.Branch.create(wide, 0, GREEDY) for _ in prompts]
    await asyncio.gather(*(b.prefill(p) for b, p in zip(stepping, prompts, strict=True)))
    tokens = [b.produce_sync() for b in stepping]
    rows = [b.logits() for b in stepping]
    fresh = [kvfork.Branch.create(wide, 0, GREEDY) for _ in prompts]
    before = wide.stats()
    jobs = []
    for b, t, f, p in zip(stepping, tokens, fresh, prompts, strict=True):
        jobs += [f.prefill(p), b.commit(t)]  # queued now, in this order
    await asyncio.gather(*jobs)
    after = wide.stats()
    assert after["decode_calls"] - before["decode_calls"] == 1
    assert after["mixed_decodes"] - before["mixed_decodes"] == 1
    for b, f, p, row in zip(stepping, fresh, prompts, rows, strict=True):
        assert (b.position, f.position) == (len(p) + 1, len(p))
        # The fresh branch decoded the same prompt the stepping one did (in another batch):
        # the same row up to noise, the same first token where its margin is clear.
        assert_close_logits(f.logits(), row)


LONG = " ".join(f"item {i}," for i in range(400))


async def test_a_prompt_is_answered_when_its_own_tokens_are_in_and_steps_meanwhile(
    wide: kvfork.Context,
) -> None:
    """A short prompt queued before a long one is answered after the first decode, not the
    long one's last; its stream then steps in the long prompt's later decodes (its tokens
    riding them), and both get what they get alone."""
    long_prompt = wide.tokenize(LONG)[:1500]
    short = wide.tokenize(counting(3))
    ref = kvfork.Branch.create(wide, 0, GREEDY)
    ref.prefill_sync(short)
    expected, margins = greedy_with_margins(ref, 8)
    ref.prune_sync()
    ref = kvfork.Branch.create(wide, 0, GREEDY)
    ref.prefill_sync(long_prompt)
    long_row = ref.logits()
    ref.prune_sync()

    a = kvfork.Branch.create(wide, 0, GREEDY)
    b = kvfork.Branch.create(wide, 0, GREEDY)
    before = wide.stats()
    short_task = asyncio.ensure_future(a.prefill(short))  # queued first: finished first
    long_task = asyncio.ensure_future(b.prefill(long_prompt))
    await short_task
    assert not long_task.done(), "the short prompt waited for the long one"
    got: list[int] = []
    while not long_task.done() and len(got) < 8:
        t = await a.produce()
        await a.commit(t)
        got.append(t.token)
    stepped_meanwhile = len(got)
    await long_task
    got += await produce_commit(a, 8 - len(got))
    after = wide.stats()
    assert stepped_meanwhile >= 1
    assert after["mixed_decodes"] - before["mixed_decodes"] >= 1
    # ceil(1,530 / 512) decodes for the prompts (the riders' tokens fit beside them), one
    # per step after the long prompt is in, and one of slack (a stream that came back late).
    prompt_decodes = -(-(len(long_prompt) + len(short) + stepped_meanwhile) // wide.n_batch)
    assert after["decode_calls"] - before["decode_calls"] <= (
        prompt_decodes + (8 - stepped_meanwhile) + 1
    )
    assert_same_greedy(got, expected, margins)
    assert_close_logits(b.logits(), long_row)  # other decodes than alone: up to noise
    assert b.position == len(long_prompt)


async def test_an_eviction_does_not_hold_up_a_running_prefill(slow: kvfork.Context) -> None:
    """While prompts decode (a server under steady arrivals), a prefix cache evicts an entry
    (`prune(keep_children=True)`): the prune runs in passing, and a prompt queued after it
    still joins the prompts in flight: short, it goes ahead of the long one cut between two
    decodes, in one decode of its own. (As any other work the prune stopped the run from
    pulling the queue: the prompt then waited for all of theirs, and decoded alone after.)"""
    long_prompt = slow.tokenize(LONG)[:1500]
    # A conversation's next turn: it continues its sequence, so it shares the long prompt's
    # decodes (a new prompt could go to a scratch context after them instead).
    short = slow.tokenize(" 15, 16, 17,", add_special=False)
    entry = kvfork.Branch.create(slow, 0, GREEDY)
    entry.prefill_sync(slow.tokenize(counting(7)))
    child = entry.fork_sync()
    a = kvfork.Branch.create(slow, 0, GREEDY)
    a.prefill_sync(slow.tokenize(counting(5)))
    b = kvfork.Branch.create(slow, 0, GREEDY)
    before = slow.stats()
    long_task = asyncio.ensure_future(b.prefill(long_prompt))
    await asyncio.sleep(0.2)  # its decodes are under way
    evicted = asyncio.ensure_future(entry.prune(keep_children=True))
    await asyncio.gather(a.prefill(short), evicted)
    assert not long_task.done()  # answered while the long prompt's decodes go on
    await long_task
    after = slow.stats()
    # The prompts' ceil(tokens / n_batch) decodes and the short one's own between two (on
    # a GPU, SLOW_PREFILL_BATCH = 2: the short prompt's tokens take decodes of their own).
    assert after["decode_calls"] - before["decode_calls"] <= 1 + -(
        -(len(long_prompt) + len(short)) // slow.n_batch
    )
    assert entry.disposed and not child.disposed
    assert child.position == len(slow.tokenize(counting(7)))


async def test_streams_stepping_while_prompts_arrive_get_their_tokens_alone(
    wide: kvfork.Context,
) -> None:
    """Streams step while new prompts of every length arrive one by one and start stepping
    too: every stream's tokens equal its tokens alone (up to near-ties)."""
    lens = [800, 10, 450, 60, 250, 0]  # beside each counting prompt's ~30 tokens
    words = wide.tokenize(LONG, add_special=False)
    prompts = [wide.tokenize(counting(k)) + words[:n] for k, n in enumerate(lens)]
    alone = []
    for p in prompts:
        b = kvfork.Branch.create(wide, 0, GREEDY)
        b.prefill_sync(p)
        alone.append(greedy_with_margins(b, 12))
        b.prune_sync()
    before = wide.stats()

    streaming = [asyncio.Event() for _ in prompts]

    async def request(k: int) -> list[int]:
        if k:  # arrives once the one before has its first token: while it steps
            await streaming[k - 1].wait()
        b = kvfork.Branch.create(wide, 0, GREEDY)
        try:
            await b.prefill(prompts[k])
            return await produce_commit(b, 12, streaming[k])
        finally:
            await b.prune()

    got = await asyncio.gather(*(request(k) for k in range(len(prompts))))
    for k, (tokens, margins) in enumerate(alone):
        assert_same_greedy(got[k], tokens, margins)
    assert wide.stats()["mixed_decodes"] > before["mixed_decodes"]


async def test_a_failed_commit_fails_only_its_task(wide: kvfork.Context) -> None:
    """A branch whose KV was cut behind its back makes llama.cpp reject the whole shared
    batch; the engine narrows it down: only that task fails (rolled back), the others get
    their tokens."""
    branches = []
    for k in range(8):
        b = kvfork.Branch.create(wide, 0, GREEDY)
        b.prefill_sync(wide.tokenize(counting(k)))
        branches.append(b)
    bad = branches[3]
    wide.kv_seq_remove(bad.seq_id, bad.position - 3, -1)
    position = bad.position

    results = await asyncio.gather(
        *(produce_commit(b, 4) for b in branches), return_exceptions=True
    )
    assert isinstance(results[3], kvfork.DecodeError), results[3]
    assert bad.position == position
    for k, r in enumerate(results):
        if k != 3:
            assert isinstance(r, list) and len(r) == 4
            assert branches[k].position == len(wide.tokenize(counting(k))) + 4


async def test_a_failed_prefill_fails_only_its_task(wide: kvfork.Context) -> None:
    with pytest.warns(kvfork.KvforkWarning):  # near the end on purpose, nothing behind it
        near_end = kvfork.Branch.create(wide, wide.n_ctx - 4, GREEDY)
    others = [kvfork.Branch.create(wide, 0, GREEDY) for _ in range(4)]
    prompts = [wide.tokenize(counting(k)) for k in range(5)]
    results = await asyncio.gather(
        near_end.prefill(prompts[0]),
        *(b.prefill(p) for b, p in zip(others, prompts[1:], strict=True)),
        return_exceptions=True,
    )
    assert isinstance(results[0], kvfork.KvCacheFullError)
    assert near_end.position == wide.n_ctx - 4
    assert results[1:] == [None] * 4
    assert [b.position for b in others] == [len(p) for p in prompts[1:]]


async def test_cancelling_one_prefill_of_a_packed_group(slow: kvfork.Context) -> None:
    """Cancelled while its packed decode runs: the decode is aborted, the cancelled prefill
    is rolled back, and the others run again and complete."""
    long_prompt = slow.tokenize(" ".join(f"item {i}," for i in range(400)))[:1500]
    prompts = [slow.tokenize(counting(k)) for k in range(3)]
    alone = []
    for p in prompts:
        b = kvfork.Branch.create(slow, 0, GREEDY)
        b.prefill_sync(p)
        alone.append(b.logits())
        b.prune_sync()
    victim = kvfork.Branch.create(slow, 0, GREEDY)
    others = [kvfork.Branch.create(slow, 0, GREEDY) for _ in range(3)]
    victim_task = asyncio.ensure_future(victim.prefill(long_prompt))
    other_tasks = [
        asyncio.ensure_future(b.prefill(p)) for b, p in zip(others, prompts, strict=True)
    ]
    await asyncio.sleep(0.15)
    victim_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim_task
    await asyncio.gather(*other_tasks)
    assert victim.position == 0
    assert slow.kv_seq_pos_max_sync(victim.seq_id) == -1
    assert [b.position for b in others] == [len(p) for p in prompts]
    for b, row in zip(others, alone, strict=True):
        assert_close_logits(b.logits(), row)  # packed, run again: equal up to noise


async def test_a_full_cache_under_riding_prompts_fails_requests_not_the_context(
    chat_model: kvfork.Model,
) -> None:
    """Prompts continuing a cached prefix decode in the main context, their chunks riding the
    streams' commits. When such a decode finds the cache full, the commit path narrows the
    failure down to its requests, decoding the halves again: the chunk, already answered,
    must stay with the prefill (it was lost, and the engine thread panicked: every later
    call failed, the context closed). Now the requests that find no room fail alone."""
    async with kvfork.create_context(chat_model, n_ctx=1024, n_seq_max=8, n_batch=128) as ctx:
        base = kvfork.Branch.create(ctx, 0, GREEDY)
        await base.prefill(ctx.tokenize("You are a careful assistant. " * 20))
        streams = []
        for i in range(4):
            stream = await base.fork()
            await stream.prefill(ctx.tokenize(f" Stream {i} says:", add_special=False))
            streams.append(stream)
        suffix = ctx.tokenize(" alpha beta gamma delta" * 60, add_special=False)

        async def step_streams() -> None:
            for _ in range(40):
                tokens = await asyncio.gather(*(s.produce() for s in streams))
                done = await asyncio.gather(
                    *(s.commit(t.token) for s, t in zip(streams, tokens, strict=True)),
                    return_exceptions=True,
                )
                if all(isinstance(d, kvfork.KvCacheFullError) for d in done):
                    return

        failures = []
        for _ in range(6):  # until the cache is full
            kids = [await base.fork() for _ in range(2)]
            results = await asyncio.gather(
                step_streams(), *(k.prefill(suffix) for k in kids), return_exceptions=True
            )
            failures += [r for r in results if isinstance(r, BaseException)]
            assert not ctx.closed
            for kid in kids:
                await kid.prune()
        assert failures and all(isinstance(f, kvfork.KvCacheFullError) for f in failures)
        for stream in streams:  # room again: the streams step on
            await stream.prune()
        kid = await base.fork()
        await kid.prefill(suffix[:50])
        assert (await kid.produce()).token >= 0
