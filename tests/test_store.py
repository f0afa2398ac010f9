"""`BranchStore`: one decode for N branches, packed prefill, rollback, coalescing."""

from __future__ import annotations

import asyncio
import math

import kvfork
import numpy as np
import pytest

from .conftest import (
    COUNTING,
    GPU_LAYERS,
    GREEDY,
    NEAR_TIE,
    ON_CPU,
    PROMPT,
    assert_close_logits,
    assert_same_greedy,
    greedy_with_margins,
    margin,
    root,
)


def test_commit_of_n_is_one_decode_and_equals_single_commits(ctx: kvfork.Context) -> None:
    """Three branches committed in one decode go on as three committed one by one: the same
    tokens, rows equal up to the noise of the other batch shape (conftest.LOGIT_NOISE), and
    each one's perplexity counting its tokens under its own rows."""
    base = root(ctx, COUNTING)
    batched = [base.fork_sync() for _ in range(3)]
    single = [base.fork_sync() for _ in range(3)]
    banned = int(base.logits().argmax())
    for i, b in enumerate(batched + single):
        b.steer({banned: -math.inf} if i % 3 == 1 else {})
    store = kvfork.BranchStore(ctx)
    surprisals: dict[kvfork.Branch, list[float]] = {b: [] for b in batched + single}
    for _ in range(4):
        toks = [b.sample() for b in batched]
        for b, t in zip(batched, toks):
            surprisals[b].append(b.surprisal(t))
        before = ctx.stats()["decode_calls"]
        store.commit_sync(list(zip(batched, toks)))
        assert ctx.stats()["decode_calls"] - before == 1
        for i, (b, t) in enumerate(zip(single, toks)):
            # Its own draw is the batched branch's wherever the margin it draws at is clear;
            # it commits the batched branch's token either way (the same history).
            row = b.logits()
            if i == 1:
                row[banned] = -math.inf
            if margin(row) >= NEAR_TIE:
                assert b.sample() == t
            surprisals[b].append(b.surprisal(t))
            b.commit_sync(t)
    for b, s in zip(batched, single):
        assert b.position == s.position and b.history == s.history
        for x in (b, s):
            assert x.perplexity == pytest.approx(math.exp(np.mean(surprisals[x])), rel=1e-5)
        assert_close_logits(s.logits(), b.logits())


@pytest.mark.parametrize("lens", [[5, 9, 3], [40, 2, 17, 30], [100], [8, 8]])
def test_prefill_is_packed(model: kvfork.Model, lens: list[int]) -> None:
    with kvfork.create_context_sync(model, n_ctx=1024, n_batch=16, n_seq_max=8) as c:
        text = c.tokenize(PROMPT * 30, add_special=False)
        branches = [kvfork.Branch.create(c, 0, GREEDY) for _ in lens]
        store = kvfork.BranchStore(c)
        before = c.stats()["decode_calls"]
        store.prefill_sync([(b, text[:n]) for b, n in zip(branches, lens)])
        assert c.stats()["decode_calls"] - before == -(-sum(lens) // 16)
        for b, n in zip(branches, lens):
            assert b.position == n
            alone = kvfork.Branch.create(c, 0, GREEDY) if c.n_seq_max > len(lens) else None
            if alone is not None:
                alone.prefill_sync(text[:n])  # one branch's decodes: rows equal up to noise
                assert_close_logits(b.logits(), alone.logits())
                alone.prune_sync()


def test_new_prompts_beside_a_busy_cache_prefill_in_a_scratch_context_alike(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New prompts prefilled together while the cache holds another sequence's cells go
    through a scratch context that holds only them (`scratch_tokens`), then into the cache,
    where their branches go on decoding: the same greedy tokens as prefilled in the cache
    itself. Logits move with the cells a prompt lands in (attention adds them up in another
    order: conftest.LOGIT_NOISE), so the exact check is against a context holding nothing
    else, where the first prompt lands in the same cells as in the scratch: bit for bit. The
    scratch serves models on the CPU only: elsewhere the prompts prefill in the cache."""

    def run(
        scratch: bool, busy: int
    ) -> tuple[list[list[int]], list[list[float]], np.ndarray, int, int]:
        if scratch:
            monkeypatch.delenv("KVFORK_NO_SCRATCH_PREFILL", raising=False)
        else:
            monkeypatch.setenv("KVFORK_NO_SCRATCH_PREFILL", "1")
        with kvfork.create_context_sync(model, n_ctx=4096, n_batch=256, n_seq_max=8) as c:
            text = c.tokenize(PROMPT * 120, add_special=False)
            other = kvfork.Branch.create(c, 0, GREEDY)
            if busy:
                other.prefill_sync(text[:busy])
            # Each prompt ends counting from its own number (greedy margins of 3+ logits).
            prompts = [
                text[40 * i : 40 * i + 60 + 25 * i]
                + c.tokenize(", ".join(str(10 * i + k) for k in range(1, 7)) + ",")
                for i in range(6)
            ]
            branches = [kvfork.Branch.create(c, 0, GREEDY) for _ in prompts]
            kvfork.BranchStore(c).prefill_sync(list(zip(branches, prompts)))
            logits = np.stack([b.logits() for b in branches])
            traced = [greedy_with_margins(b, 6) for b in branches]
            assert other.position == busy
            tokens = [t for t, _ in traced]
            margins = [m for _, m in traced]
            return tokens, margins, logits, int(c.stats()["scratch_tokens"]), sum(map(len, prompts))

    scratch = run(True, busy=700)
    cache = run(False, busy=700)
    alone = run(False, busy=0)
    assert scratch[3] == (scratch[4] if ON_CPU else 0) and cache[3] == alone[3] == 0
    if ON_CPU:
        assert np.array_equal(scratch[2][0], alone[2][0])
    for got, expected in zip(scratch[2], cache[2]):
        assert_close_logits(got, expected)
    for run_ in (scratch, cache):
        for got, expected, margins in zip(run_[0], alone[0], alone[1]):
            assert_same_greedy(got, expected, margins)
    assert len({tuple(t) for t in scratch[0]}) == len(scratch[0]), "each its own"


def test_a_long_prompt_goes_through_the_scratch_alone_and_forks_inside_it_read_it_whole(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a busy cache, a prompt longer than the sliding window (Gemma 3: 512 tokens) is
    prefilled alone in the scratch context. Its cells must all reach the cache, those of the
    sliding-window layers too: a prefix-cache branch sharing its first 700 tokens (a fork
    inside it, whose sliding-window layers read cells from position 188 on) and the long
    branch itself continue exactly as without the scratch (up to near-ties). On the CPU
    only: elsewhere nothing goes through a scratch."""

    def run(scratch: bool) -> tuple[list[tuple[list[int], list[float]]], int]:
        if scratch:
            monkeypatch.delenv("KVFORK_NO_SCRATCH_PREFILL", raising=False)
        else:
            monkeypatch.setenv("KVFORK_NO_SCRATCH_PREFILL", "1")
        with kvfork.create_context_sync(model, n_ctx=8192, n_seq_max=8) as c:
            text = c.tokenize(PROMPT * 400, add_special=False)  # ~3,200 tokens
            other = kvfork.Branch.create(c, 0, GREEDY)
            other.prefill_sync(text[:1500])  # a busy cache
            cache = kvfork.PrefixCache(c)
            count = c.tokenize(", ".join(str(k) for k in range(1, 9)) + ",", add_special=False)
            long_prompt = c.tokenize("Notes:") + text[2000:3200] + count
            assert len(long_prompt) > 1200
            inside = long_prompt[:700] + count
            got = []
            for prompt in (long_prompt, inside):
                b = cache.branch_sync(prompt, GREEDY)
                got.append(greedy_with_margins(b, 8))
            return got, int(c.stats()["scratch_tokens"])

    scratch, moved = run(True)
    reference, none = run(False)
    assert none == 0 and (moved >= 1200 if ON_CPU else moved == 0), moved
    for (tokens, _), (expected, margins) in zip(scratch, reference, strict=True):
        assert_same_greedy(tokens, expected, margins)


async def _prefilled(
    prompts: list[tuple[kvfork.Branch, list[int], str]], together: bool
) -> list[str]:
    """Each `(branch, tokens, name)` prefilled, all at once or one after the other: the names
    in the order their prefills returned."""
    done: list[str] = []

    async def prefill(b: kvfork.Branch, tokens: list[int], name: str) -> None:
        await b.prefill(tokens)
        done.append(name)

    if together:
        await asyncio.gather(*(prefill(*p) for p in prompts))
    else:
        for p in prompts:
            await prefill(*p)
    return done


@pytest.mark.parametrize("turn_kind", ["continuation", "new"])
async def test_a_short_prompt_goes_ahead_of_a_long_prompt_in_the_scratch(
    model: kvfork.Model, turn_kind: str
) -> None:
    """A short prompt that comes while a long new prompt decodes in the scratch context,
    chunk after chunk, is decoded between two of those chunks: a branch's continuation (a
    conversation's next turn) in the cache, a short new request in the shared scratch. It is
    answered first, not after the whole long prompt (a short job behind a long one). Both
    continue exactly as when each runs alone (up to near-ties). Where there is no scratch
    (a GPU), the long prompt decodes in the main context chunk after chunk, and the short
    one goes ahead there (as in the test below)."""

    async def run(together: bool) -> tuple[list[str], list[tuple[list[int], list[float]]]]:
        async with await kvfork.create_context(model, n_ctx=8192, n_seq_max=8) as c:
            text = c.tokenize(PROMPT * 400, add_special=False)  # ~3,200 tokens
            busy = kvfork.Branch.create(c, 0, GREEDY)
            busy.prefill_sync(text[:1500])  # a busy cache, and a conversation on it
            long = kvfork.Branch.create(c, 0, GREEDY)
            long_prompt = c.tokenize("Notes:") + text[1600:2900]
            if turn_kind == "continuation":
                talk = busy
                turn = c.tokenize(" And then? Count: 1, 2, 3,", add_special=False)
            else:
                talk = kvfork.Branch.create(c, 0, GREEDY)
                turn = c.tokenize("Count: 1, 2, 3,")
            prompts = [(long, long_prompt, "long"), (talk, turn, "turn")]
            done = await _prefilled(prompts, together)
            return done, [greedy_with_margins(b, 6) for b in (talk, long)]

    order, got = await run(together=True)
    _, reference = await run(together=False)
    assert order == ["turn", "long"], order
    for (tokens, _), (expected, margins) in zip(got, reference, strict=True):
        assert_same_greedy(tokens, expected, margins)


async def test_a_short_prompt_goes_ahead_of_a_long_prompt_in_the_main_context(
    model: kvfork.Model,
) -> None:
    """Beside an idle cache a long new prompt decodes in the main context, chunk after chunk;
    a short new request that comes meanwhile is decoded between two of those chunks and
    answered first (it waited for all of them: 26 s behind a 3,000-token prompt on this
    CPU). Both continue exactly as when each runs alone (up to near-ties)."""

    async def run(together: bool) -> tuple[list[str], list[tuple[list[int], list[float]]]]:
        async with await kvfork.create_context(model, n_ctx=4096, n_seq_max=4) as c:
            text = c.tokenize(PROMPT * 300, add_special=False)
            long = kvfork.Branch.create(c, 0, GREEDY)
            long_prompt = c.tokenize("Notes:") + text[:2000]
            short = kvfork.Branch.create(c, 0, GREEDY)
            turn = c.tokenize("Count: 1, 2, 3,")
            done = await _prefilled([(long, long_prompt, "long"), (short, turn, "short")], together)
            # Together, the main context's decodes (after the long one, the scratch's).
            assert (c.stats()["scratch_tokens"] == 0) == together or not ON_CPU
            return done, [greedy_with_margins(b, 6) for b in (short, long)]

    order, got = await run(together=True)
    _, reference = await run(together=False)
    assert order == ["short", "long"], order
    for (tokens, _), (expected, margins) in zip(got, reference, strict=True):
        assert_same_greedy(tokens, expected, margins)


def test_new_prompts_that_do_not_fit_beside_a_busy_cache_roll_back_from_the_scratch(
    model: kvfork.Model,
) -> None:
    """Prompts prefilled apart that find no room in the cache fail as a decode would
    (KvCacheFullError), all or nothing: the cells already moved in are removed again (on the
    CPU; elsewhere the packed prefill in the cache fails the same way)."""
    with kvfork.create_context_sync(model, n_ctx=1024, n_batch=256, n_seq_max=8) as c:
        text = c.tokenize(PROMPT * 120, add_special=False)
        busy = kvfork.Branch.create(c, 0, GREEDY)
        busy.prefill_sync(text[:700])
        store = kvfork.BranchStore(c)
        branches = [kvfork.Branch.create(c, 0, GREEDY) for _ in range(4)]
        with pytest.raises(kvfork.KvCacheFullError):
            store.prefill_sync([(b, text[100 * i : 100 * i + 120]) for i, b in enumerate(branches)])
        assert (c.stats()["scratch_tokens"] > 0) == ON_CPU
        assert [b.position for b in branches] == [0, 0, 0, 0]
        # The room is back: two of them fit.
        store.prefill_sync([(b, text[:120]) for b in branches[:2]])
        assert [b.position for b in branches] == [120, 120, 0, 0] and busy.position == 700


def test_rollback_when_kv_is_full(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=64, n_seq_max=2) as c:
        a = root(c, PROMPT)
        b = a.fork_sync()
        store = kvfork.BranchStore(c)
        with pytest.raises(kvfork.KvCacheFullError):
            while True:
                ppl = (a.perplexity, b.perplexity, a.position)
                store.commit_sync([(a, a.sample()), (b, b.sample())])
        assert (a.perplexity, b.perplexity, a.position) == ppl  # rolled back
        b.prune_sync()
        a.commit_sync(a.sample()) if a.position < c.n_ctx else None


def test_step_stops_one_branch_while_others_continue(ctx: kvfork.Context) -> None:
    base = root(ctx)
    a, b = base.fork_sync(), base.fork_sync()
    eog = ctx.eog_token
    assert eog is not None
    b.set_logit_bias({eog: 100.0})  # b must stop now
    store = kvfork.BranchStore(ctx)
    before = (a.position, b.position)
    toks = store.step_sync([a, b])
    assert not toks[0].is_stop and toks[1].is_stop and toks[1].token == eog
    assert (a.position, b.position) == (before[0] + 1, before[1])  # stop token not committed


def test_a_failed_step_leaves_its_seeded_branches_drawing_as_without_it(
    ctx: kvfork.Context,
) -> None:
    # A step fails whole when one branch cannot be sampled (here every token is banned). Its
    # other branches drew already: the draws are undone, so a seeded branch's stream is the
    # one it has without the failed steps (it drew on before).
    seeded = {"temperature": 1.0, "seed": 42, "top_k": 0, "min_p": 0.0}
    store = kvfork.BranchStore(ctx)
    alone = root(ctx, "Once upon a time", seeded)
    expected = [store.step_sync([alone])[0].token for _ in range(12)]
    alone.prune_sync()
    b = root(ctx, "Once upon a time", seeded)
    stuck = root(ctx)
    stuck.set_logit_bias(dict.fromkeys(range(ctx.vocab_size), -math.inf))
    for _ in range(3):
        # The error names the branch that could not be sampled (the step has two).
        with pytest.raises(kvfork.KvforkError, match=r"branch handle=\d+: every candidate"):
            store.step_sync([b, stuck])
    stuck.prune_sync()
    got = [store.step_sync([b])[0].token for _ in range(12)]
    b.prune_sync()
    assert got == expected, (ctx.detokenize(expected), ctx.detokenize(got))


def test_retain_only(ctx: kvfork.Context) -> None:
    base = root(ctx)
    kids = [base.fork_sync() for _ in range(3)]
    store = kvfork.BranchStore(ctx)
    store.retain_only_sync(kids[1])
    assert store.available == ctx.n_seq_max - 1
    assert all(b.disposed for b in [base, kids[0], kids[2]])
    assert kids[1].parent is None and kids[1].is_leaf
    kids[1].commit_sync(kids[1].sample())


async def test_work_requested_before_a_retain_only_runs_on_the_branches_it_disposes(
    ctx: kvfork.Context,
) -> None:
    """Operations run in the order they were requested: a step, a fork and a commit asked
    for before `retain_only` complete, on the loser too, though `retain_only` marks it
    disposed at once for the calls made after it (the step failed as a whole before)."""
    a = root(ctx)
    b = await a.fork()
    store = kvfork.BranchStore(ctx)
    start = (a.position, b.position)
    step = store.step([a, b])
    fork = a.fork()
    commit = b.commit(a.sample())
    retain = store.retain_only(a)
    assert b.disposed  # at once
    with pytest.raises(kvfork.BranchDisposedError):
        await b.commit(1)  # asked after: refused
    await step
    await commit
    child = await fork  # made before retain_only, which then disposed it
    await retain
    assert child.disposed
    assert a.position == start[0] + 1 and not a.disposed
    assert store.available == ctx.n_seq_max - 1


def test_store_refuses_bad_entries(ctx: kvfork.Context, model: kvfork.Model) -> None:
    a = root(ctx)
    store = kvfork.BranchStore(ctx)
    store.commit_sync([])  # no-op
    dead = a.fork_sync()
    dead.prune_sync()
    before = ctx.stats()["decode_calls"]
    with pytest.raises(kvfork.BranchDisposedError):
        store.commit_sync([(a, 1), (dead, 1)])
    with pytest.raises(ValueError, match="twice"):
        store.commit_sync([(a, 1), (a, 2)])
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as other:
        stranger = root(other, "Hi")
        with pytest.raises(ValueError, match="another context"):
            store.commit_sync([(a, 1), (stranger, 1)])
    assert ctx.stats()["decode_calls"] == before


def test_stats_split_a_steps_time_into_the_decode_and_the_engines_own(
    ctx: kvfork.Context,
) -> None:
    """`commit_seconds` times the engine's commit groups, decodes included: it grows with
    steps by at least their decode time and at most the caller's wall time, and not with a
    prefill (decodes that are no commit). A step answers before its rows are read; a row
    read waits for them, and they are counted by then."""
    import time

    a = root(ctx)
    b = a.fork_sync()
    store = kvfork.BranchStore(ctx)
    s0 = ctx.stats()
    t0 = time.perf_counter()
    for _ in range(4):
        store.step_sync([a, b])
    b.entropy()  # waits for the last step's rows
    wall = time.perf_counter() - t0
    s1 = ctx.stats()
    decode = float(s1["decode_seconds"]) - float(s0["decode_seconds"])
    engine = float(s1["commit_seconds"]) - float(s0["commit_seconds"])
    assert s1["decode_calls"] - s0["decode_calls"] == 4
    assert decode <= engine <= wall
    a.prefill_sync(ctx.tokenize(" and then"))
    s2 = ctx.stats()
    assert s2["decode_seconds"] > s1["decode_seconds"]
    assert s2["commit_seconds"] == s1["commit_seconds"]


async def test_concurrent_tasks_are_coalesced(ctx: kvfork.Context) -> None:
    base = root(ctx)
    kids = [await base.fork() for _ in range(6)]
    before = ctx.stats()["decode_calls"]

    async def run(b: kvfork.Branch) -> int:
        n = 0
        async for _ in b.generate(max_tokens=12):
            n += 1
        return n

    counts = await asyncio.gather(*(run(k) for k in kids))
    decodes = ctx.stats()["decode_calls"] - before
    assert sum(counts) == 6 * 12
    assert decodes <= 12 * 3  # about one decode per step, not one per branch (72)


def _pads_output_rows() -> bool:
    """Whether decodes' outputs are padded to tiles of 4 here: llama.cpp's x86 AVX-512
    tinyBLAS kernel on the CPU, for the default model's Q8_0 output weights."""
    info = kvfork.system_info()
    return info["backend"] == "cpu" and "AVX512" in info["host_cpu_features"]


@pytest.mark.parametrize("n", [7, 15])
def test_a_step_of_a_partial_tile_pads_its_outputs_and_decodes_the_same(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """`n` rows: padded to a multiple of 4 with rows of the padding sequence (cheaper, see
    BENCHMARKS §1-2). Every branch keeps its own row: its logits are those of an unpadded
    decode of as many rows, the padding's rows being real branches there (the same batch
    shape); its counts continue alike without padding. A snapshot's lent row reads right
    across a padded decode."""
    pad = -n % 4 if _pads_output_rows() and GPU_LAYERS is None else 0

    def run(padding: bool, rows: int) -> tuple[list[list[int]], list[list[float]], np.ndarray, int]:
        if padding:
            monkeypatch.delenv("KVFORK_NO_OUTPUT_PADDING", raising=False)
        else:
            monkeypatch.setenv("KVFORK_NO_OUTPUT_PADDING", "1")
        with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=16) as c:
            # Each branch counts from its own number: its next tokens are its own.
            counts = [", ".join(str(10 * i + k) for k in range(1, 7)) + "," for i in range(rows)]
            branches = [root(c, text) for text in counts]
            store = kvfork.BranchStore(c)
            tokens, margins = [], []
            for _ in range(4):
                margins.append([margin(b.logits()) for b in branches[:n]])
                tokens.append([int(t.token) for t in store.step_sync(branches)][:n])
            logits = np.stack([b.logits() for b in branches[:n]])
            lent, copy = branches[2].logits(), branches[2].logits().copy()
            store.commit_sync([(b, b.sample()) for b in branches])
            assert np.array_equal(lent, copy), "a lent row survives the next decode"
            assert not np.array_equal(branches[2].logits(), copy)
            # Per branch: its tokens and their margins, step by step.
            return (
                [list(t) for t in zip(*tokens)],
                [list(m) for m in zip(*margins)],
                logits,
                int(c.stats()["padded_rows"]),
            )

    padded = run(True, n)
    same_shape = run(False, n + pad)
    unpadded = run(False, n)
    assert padded[3] == 5 * pad and same_shape[3] == unpadded[3] == 0
    # The same batch shape, padding rows in place of the extra branches: the same rows to the
    # last bits (padding is the CPU's alone: elsewhere the three runs are the same run).
    # Without the padding the batch has another shape: its tokens by the margin rule.
    np.testing.assert_allclose(padded[2], same_shape[2], rtol=0, atol=1e-4)
    assert padded[0] == same_shape[0]
    for got, expected, margins in zip(unpadded[0], padded[0], padded[1]):
        assert_same_greedy(got, expected, margins)
    assert len({tuple(t) for t in padded[0]}) == n, "each branch its own"
