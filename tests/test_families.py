"""Every operation across every family: the tiny random-weight models of `family_models.py`
(recurrent, hybrid, hybrid with a sliding window, mixture-of-experts, sliding window) run each
of the library's operations, and what they generate is checked against a fresh prefill of
the same tokens in a fresh context (`fresh`): the first logits row close, the tokens equal up
to their first difference, which must come at a near-tie of the reference (`assert_matches`,
conftest's `assert_same_greedy` with a tighter tie: batch shapes, thread counts and cell
placement move logits a little).

On recurrent and hybrid models (`RECURRENT`) a fork inside a sequence, a rejected guess and a
rolled-back decode go through recurrent-state checkpoints: they restart from the last
checkpoint at or before the position wanted and decode the rest again (`ctx.stats()`'s
`checkpoint_restores`), so a prefix cache shares at most the common prefix there."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import kvfork
import numpy as np
import numpy.typing as npt
import pytest
from kvfork.patterns import beam_search_sync

from .conftest import ON_CPU, PROMPT, assert_same_greedy, greedy_tokens, greedy_with_margins, root
from .family_models import FAMILIES, KIND, N_EMBD, N_EXPERT, RECURRENT, SLIDING, SLIDING_WINDOW

GREEDY = kvfork.SamplingParams(temperature=0.0)
#: ~44 tokens: a prompt longer than the sliding window (16) of the `SLIDING` families.
DOC = " ".join(f"Line {i}: the printing press spread across Europe." for i in range(4))
#: Tokens generated and compared by each check.
N = 14
#: A margin under this is a near-tie: tokens are compared up to the reference's first one.
#: These tiny f32 models' logits move by under 0.2 between batch shapes and thread counts
#: (0.18 at most measured here, against ~0.5 on the default model, which conftest's 1.0
#: allows for), and most of their greedy margins are under 1: with 1.0 most comparisons
#: would check nothing.
NEAR_TIE = 0.5
#: How far a branch's first logits row may be from the reference's (the same noise).
LOGIT_ATOL = 0.5


class Greedy(NamedTuple):
    """Greedy tokens, the margin of each (best minus second-best logit), and the logits row
    the first was drawn from."""

    tokens: list[int]
    margins: list[float]
    logits: npt.NDArray[np.float32]


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """Each family of `family_models.FAMILIES` (the test ids are their names)."""
    name: str = request.param
    return name


@pytest.fixture
def tiny(family_models: Callable[[str], kvfork.Model], family: str) -> kvfork.Model:
    """The family's tiny model (written and loaded once per session)."""
    return family_models(family)


def open_ctx(
    model: kvfork.Model, *, n_ctx: int = 1024, n_seq_max: int = 4, **options: int | bool
) -> kvfork.Context:
    """A context of `model` (1,024 cells and 4 leases unless told otherwise)."""
    return kvfork.create_context_sync(
        model,
        n_ctx=n_ctx,
        n_seq_max=n_seq_max,
        **options,  # type: ignore[arg-type]
    )


def greedy(b: kvfork.Branch, n: int = N) -> Greedy:
    """Generate and commit `n` greedy tokens on `b`, with their margins and first logits."""
    logits = b.logits()
    tokens, margins = greedy_with_margins(b, n)
    return Greedy(tokens, margins, logits)


def fresh(model: kvfork.Model, tokens: Sequence[int], n: int = N) -> Greedy:
    """The reference: `tokens` prefilled at once on a new branch of a new context, then `n`
    greedy tokens."""
    with open_ctx(model) as c:
        b = kvfork.Branch.create(c, 0, GREEDY)
        b.prefill_sync(list(tokens))
        return greedy(b, n)


def assert_matches(
    tokens: list[int], reference: Greedy, logits: npt.NDArray[np.float32] | None = None
) -> None:
    """`tokens` (as many) equal the reference's up to their first difference, which must come
    at a near-tie of the reference, and `logits`, the row the first was drawn from, are within
    LOGIT_ATOL of the reference's."""
    assert len(tokens) == len(reference.tokens), (tokens, reference.tokens)
    if logits is not None:
        np.testing.assert_allclose(logits, reference.logits, rtol=0, atol=LOGIT_ATOL)
    assert_same_greedy(tokens, reference.tokens, reference.margins, NEAR_TIE)


def assert_shared(
    cache: kvfork.PrefixCache, b: kvfork.Branch, common: int, recurrent: bool, restored: int
) -> None:
    """`b`, made by `cache` for a prompt sharing `common` tokens with a branch inside whose
    sequence it forks, shares all of them, or on a recurrent state some, from a checkpoint
    put back (`restored` of them since the fork)."""
    shared = cache.shared_tokens(b)
    assert shared is not None
    if recurrent:
        assert 0 < shared <= common
        assert restored > 0
    else:
        assert shared == common


def assert_continues(b: kvfork.Branch, reference: Greedy) -> None:
    """`b` generates what `reference` did (`assert_matches`), as many tokens."""
    got = greedy(b, len(reference.tokens))
    assert_matches(got.tokens, reference, got.logits)


def assert_continues_as_fresh(model: kvfork.Model, b: kvfork.Branch, n: int = N) -> None:
    """`b` generates what a fresh prefill of its history does."""
    assert_continues(b, fresh(model, b.history, n))


def prefilled(ctx: kvfork.Context, tokens: Sequence[int]) -> kvfork.Branch:
    """A greedy root branch with `tokens` prefilled."""
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(list(tokens))
    return b


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def restores(ctx: kvfork.Context) -> int:
    """Checkpoints put back so far in `ctx` (a fork inside a recurrent sequence, a rejected
    guess, a rolled-back decode)."""
    return int(ctx.stats()["checkpoint_restores"])


# ---- 1. load, prefill, generate; what the model reports of itself


def test_a_family_model_loads_reports_its_family_and_generates_repeatably(
    tiny: kvfork.Model, family: str
) -> None:
    """The model loads with SmolLM2's vocabulary; `family`, `is_recurrent`, `n_swa` and
    `n_expert` say what `family_models.KIND` built; two fresh branches (the second in other
    cells, the first still there) generate the same varied greedy tokens, and the same as a
    fresh context; recurrent models take checkpoints while prefilling, the others none."""
    model = tiny
    assert model.vocab_size == 49152 and model.n_embd == N_EMBD
    kind = KIND[family]
    name = model.family
    assert model.is_recurrent == (family in RECURRENT)
    assert model.n_swa == (SLIDING_WINDOW if family in SLIDING else 0)
    assert model.n_expert == (N_EXPERT if kind == "moe" else 0)
    assert ("+sliding-window" in name) == (family in SLIDING)
    assert ("+moe" in name) == (kind == "moe")
    if kind == "recurrent":
        assert name == "recurrent"
    elif kind.startswith("hybrid"):
        assert name.startswith("hybrid")
    else:
        assert name.startswith("transformer")
    with open_ctx(model) as ctx:
        first = greedy(root(ctx, PROMPT), 16)
        second = greedy(root(ctx, PROMPT), 16)
        taken = ctx.stats()["checkpoints_taken"]
        prompt = ctx.tokenize(PROMPT)
    assert len(set(first.tokens)) > 2, f"{family}: degenerate greedy output {first.tokens}"
    assert_matches(second.tokens, first, second.logits)
    assert_matches(first.tokens, fresh(model, prompt, 16), first.logits)
    assert (taken > 0) == (family in RECURRENT)


# ---- 2. forks


def test_forks_at_the_head_and_mid_generation_continue_exactly(
    tiny: kvfork.Model,
) -> None:
    """A fork at the head of a prefilled branch, and one after 5 generated tokens: child and
    parent (going on after the child) each generate what a fresh prefill of the tokens
    behind them generates."""
    with open_ctx(tiny) as ctx:
        prompt = ctx.tokenize(DOC)
        parent = prefilled(ctx, prompt)
        child = parent.fork_sync()
        reference = fresh(tiny, prompt)
        assert_continues(child, reference)
        assert_continues(parent, reference)

        mid = prefilled(ctx, prompt)
        head = greedy_tokens(mid, 5)
        kid = mid.fork_sync()
        assert kid.history == prompt + head
        reference = fresh(tiny, prompt + head)
        assert_continues(kid, reference)
        assert_continues(mid, reference)


# ---- 3. BranchStore


def test_store_steps_in_lock_step_and_prefills_packed_exactly(tiny: kvfork.Model) -> None:
    """Three forks that took the root's 1st, 2nd and 3rd best tokens step together
    (`store.step`, one decode each), and three prompts are prefilled packed into shared
    decodes (`store.prefill`, n_batch 32): each branch generates what a fresh prefill of
    its tokens does."""
    with open_ctx(tiny) as ctx:
        prompt = ctx.tokenize(DOC)
        base = prefilled(ctx, prompt)
        firsts = [int(t) for t in np.argsort(base.logits())[::-1][:3]]
        kids = [base.fork_sync() for _ in firsts]
        for kid, first in zip(kids, firsts):
            kid.commit_sync(first)
        store = kvfork.BranchStore(ctx)
        logits = [kid.logits() for kid in kids]
        got: list[list[int]] = [[] for _ in kids]
        for _ in range(N):
            for out, tok in zip(got, store.step_sync(kids)):
                assert not tok.is_stop
                out.append(tok.token)
        for out, first, row in zip(got, firsts, logits):
            assert_matches(out, fresh(tiny, [*prompt, first]), row)

    with open_ctx(tiny, n_batch=32) as ctx:
        prompts = [
            ctx.tokenize(DOC),
            ctx.tokenize(PROMPT),
            ctx.tokenize(DOC[:60] + " and then the press"),
        ]
        branches = [kvfork.Branch.create(ctx, 0, GREEDY) for _ in prompts]
        before = ctx.stats()["decode_calls"]
        kvfork.BranchStore(ctx).prefill_sync(list(zip(branches, prompts)))
        assert ctx.stats()["decode_calls"] - before == -(-sum(map(len, prompts)) // 32)
        for b, p in zip(branches, prompts):
            assert b.position == len(p)
            assert_continues(b, fresh(tiny, p))


def test_a_store_prefill_or_commit_that_fails_rolls_back_exactly(
    tiny: kvfork.Model, family: str
) -> None:
    """In a 256-cell context: a store prefill with one member past n_ctx is refused
    (KvCacheFullError) with nothing changed; a store prefill whose members fit n_ctx but not
    the cache together fails after some of its decodes (families with a KV cache) and is
    rolled back, on hybrids through a checkpoint restore (pure recurrent models have no
    cells to run out of: there it succeeds, exactly); a store commit at a full cache fails
    and is rolled back. After each, the branches generate what fresh prefills of their
    tokens generate."""
    kind = KIND[family]
    with open_ctx(tiny, n_ctx=256, n_seq_max=2, n_batch=32) as ctx:
        text = ctx.tokenize(DOC * 8, add_special=False)
        a, b = prefilled(ctx, text[:128]), kvfork.Branch.create(ctx, 0, GREEDY)
        store = kvfork.BranchStore(ctx)

        # Past n_ctx for one member: refused before any decode.
        with pytest.raises(kvfork.KvCacheFullError):
            store.prefill_sync([(b, text[:100]), (a, text[128:300])])
        assert (a.position, b.position) == (128, 0)
        assert ctx.kv_seq_pos_max_sync(a.seq_id) == 127
        assert ctx.kv_seq_pos_max_sync(b.seq_id) == -1

        # Each fits n_ctx, together not the 256 cells: fails mid-way on a KV cache.
        before = restores(ctx)
        if kind == "recurrent":
            store.prefill_sync([(b, text[:100]), (a, text[128:200])])
            assert_continues(a, fresh(tiny, text[:200]))
            assert_continues(b, fresh(tiny, text[:100]))
            return
        with pytest.raises(kvfork.KvCacheFullError):
            store.prefill_sync([(b, text[:100]), (a, text[128:200])])
        assert (a.position, b.position) == (128, 0)
        assert a.history == text[:128] and b.history == []
        assert ctx.kv_seq_pos_max_sync(a.seq_id) == 127
        assert ctx.kv_seq_pos_max_sync(b.seq_id) == -1
        if family in RECURRENT:
            assert restores(ctx) > before, "a's decoded chunks were undone from a checkpoint"
        assert_continues(a, fresh(tiny, text[:128]))

        # A commit at a full cache: both rolled back.
        b.prefill_sync(text[: 256 - a.position])
        assert a.position + b.position == 256
        state = [(x.position, x.history, x.perplexity) for x in (a, b)]
        tokens = [a.produce_sync().token, b.produce_sync().token]
        with pytest.raises(kvfork.KvCacheFullError):
            store.commit_sync([(a, tokens[0]), (b, tokens[1])])
        assert [(x.position, x.history, x.perplexity) for x in (a, b)] == state
        b_tokens = b.history
        b.prune_sync()
        assert_continues_as_fresh(tiny, a)
        c = prefilled(ctx, b_tokens[:40])
        assert_continues(c, fresh(tiny, b_tokens[:40]))


# ---- 4. PrefixCache


def test_prefix_cache_forks_at_an_entrys_end_and_inside_entries_and_live_branches(
    tiny: kvfork.Model, family: str
) -> None:
    """A prefix cache's branch from a prompt extending a released entry (its end), from one
    diverging inside a released entry, and from one diverging inside a branch still
    generating: each generates what a fresh prefill of its prompt does. On a KV cache the
    whole common prefix is shared; on a recurrent state at most that (from the source's
    last checkpoint inside it, n_batch 16 putting one every 16 prompt tokens), a checkpoint
    being put back for a fork inside a sequence."""
    recurrent = family in RECURRENT
    with open_ctx(tiny, n_batch=16) as ctx:
        cache = kvfork.PrefixCache(ctx)

        # At an entry's end.
        first = ctx.tokenize(DOC)
        cache.release(cache.branch_sync(first, GREEDY))
        longer = first + ctx.tokenize(" Question one: what came first?", add_special=False)
        b = cache.branch_sync(longer, GREEDY)
        assert cache.shared_tokens(b) == len(first)
        assert_continues(b, fresh(tiny, longer))
        cache.release(b)
        cache.clear()

        # Inside a released entry.
        a_tokens = ctx.tokenize(DOC + " Question one: what came first?")
        b_tokens = ctx.tokenize(DOC + " Answer two:")
        common = common_prefix(a_tokens, b_tokens)
        assert 0 < common < len(a_tokens)
        cache.release(cache.branch_sync(a_tokens, GREEDY))
        before = restores(ctx)
        b = cache.branch_sync(b_tokens, GREEDY)
        assert_shared(cache, b, common, recurrent, restores(ctx) - before)
        assert_continues(b, fresh(tiny, b_tokens))
        cache.release(b)
        cache.clear()

        # Inside a live branch that generated past the fork point.
        a_tokens = ctx.tokenize(DOC)
        a = cache.branch_sync(a_tokens, GREEDY)
        generated = greedy_tokens(a, 8)
        b_tokens = a_tokens + generated[:3] + ctx.tokenize(" and then", add_special=False)
        common = len(a_tokens) + 3
        before = restores(ctx)
        b = cache.branch_sync(b_tokens, GREEDY)
        assert_shared(cache, b, common, recurrent, restores(ctx) - before)
        assert_continues(b, fresh(tiny, b_tokens))
        assert_continues(a, fresh(tiny, a_tokens + generated))


def test_prefix_cache_forks_far_inside_an_entry_decoded_in_small_batches(
    tiny: kvfork.Model,
) -> None:
    """An entry decoded in batches smaller than its length, a prompt parting from it ten
    tokens before its end: on a model with sliding-window layers llama.cpp has reused
    there the cells a window behind the entry's end, so the cells the new branch attends to
    may be gone: then it shares nothing rather than attend to missing cells. Every family
    generates what a fresh prefill of the prompt does."""
    with open_ctx(tiny, n_batch=16) as ctx:
        text = ctx.tokenize(DOC * 6, add_special=False)
        cache = kvfork.PrefixCache(ctx)
        cache.release(cache.branch_sync(text[:64], GREEDY))
        prompt = text[:54] + ctx.tokenize(" and then", add_special=False)
        b = cache.branch_sync(prompt, GREEDY)
        assert cache.shared_tokens(b) in range(55)
        assert_continues(b, fresh(tiny, prompt))
        cache.release(b)
    # The same entry evicted to host memory and restored for the prompt: cut at the prompt's
    # part, its window's cells must all be in the snapshot, or it is prefilled instead.
    with open_ctx(tiny, n_batch=16, n_seq_max=2) as ctx:
        cache = kvfork.PrefixCache(ctx, host_bytes=64 << 20)
        cache.release(cache.branch_sync(text[:64], GREEDY))
        cache.make_room_sync(2)
        assert cache.stats()["host"]["entries"] == 1
        b = cache.branch_sync(prompt, GREEDY)
        assert_continues(b, fresh(tiny, prompt))


def test_prefix_cache_reuses_a_preamble_shared_by_three_prompts(
    tiny: kvfork.Model, family: str
) -> None:
    """Three prompts with a common preamble, each released before the next (default n_batch:
    one prefill decode per prompt): the second shares what its source's checkpoints allow
    (the whole preamble on a KV cache), and the third reuses the preamble on every family —
    the second prompt's prefill started at the preamble's end, or went through it. Each
    generates what a fresh prefill of its prompt does."""
    with open_ctx(tiny) as ctx:
        cache = kvfork.PrefixCache(ctx)
        prompts = [
            ctx.tokenize(DOC + f" Question {q}: what came {w}?")
            for q, w in (("one", "first"), ("two", "next"), ("three", "last"))
        ]
        preamble = common_prefix(prompts[0], prompts[1])
        assert preamble == common_prefix(prompts[1], prompts[2]) > 16
        shared: list[int] = []
        for p in prompts:
            b = cache.branch_sync(p, GREEDY)
            s = cache.shared_tokens(b)
            assert s is not None and s <= preamble
            shared.append(s)
            assert_continues(b, fresh(tiny, p))
            cache.release(b)
        assert shared[0] == 0
        if family not in RECURRENT:
            assert shared[1:] == [preamble, preamble]
        assert shared[2] > 0, f"{family}: the third prompt reused none of the preamble"


# ---- 5. park/unpark, snapshot/restore, save/load


@pytest.mark.parametrize("parent_first", [False, True], ids=["fork-first", "parent-first"])
def test_parked_branches_come_back_exactly(tiny: kvfork.Model, parent_first: bool) -> None:
    """With one lease and `park=True`, a fork is parked at once. Generating on it parks its
    parent, and generating on the parent brings that back; or the parent goes on first,
    past the fork point, while the fork waits on the host (on a recurrent model it keeps the
    parent's state of that moment: the parent's cells bring its later state along). Both
    generate what a fresh prefill of the prompt does."""
    with open_ctx(tiny, n_seq_max=1, park=True) as ctx:
        prompt = ctx.tokenize(DOC)
        a = prefilled(ctx, prompt)
        b = a.fork_sync()
        assert not b.is_active
        reference = fresh(tiny, prompt)
        for branch in (a, b) if parent_first else (b, a):
            assert_continues(branch, reference)
        stats = ctx.stats()
        moves = 1 if parent_first else 2  # the fork comes back; or it, then the parent
        assert stats["parks"] >= moves and stats["unparks"] >= moves


def test_prefills_cancelled_on_a_park_context_roll_back_exactly(tiny: kvfork.Model) -> None:
    """Prefills cancelled at once (aborted and rolled back) on a `park=True` context: the
    branch then continues as a fresh prefill of its history does. There a recurrent state
    rolls back by decoding again from an earlier checkpoint, and that replay was aborted by
    the very cancel it rolled back: the state stayed where it stopped (rows 20-50 off)."""

    async def cancel_prefills(ctx: kvfork.Context) -> kvfork.Branch:
        b = prefilled(ctx, ctx.tokenize(PROMPT))
        cancelled = 0
        for i in range(12):
            before = b.position
            more = ctx.tokenize(" and then" * (5 + i), add_special=False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(b.prefill(more), (0, 1e-6, 1e-5, 1e-4)[i % 4])
            cancelled += b.position == before
            await b.commit(b.sample())
        assert cancelled > 0
        return b

    with open_ctx(tiny, n_seq_max=1, park=True) as ctx:
        assert_continues_as_fresh(tiny, asyncio.run(cancel_prefills(ctx)))


def test_snapshots_restore_exactly(tiny: kvfork.Model) -> None:
    """A branch's snapshot restored (same context) continues as the branch did; a context
    snapshot restored over its live branches brings back both of them, which continue as
    fresh prefills of their histories do."""
    with open_ctx(tiny) as ctx:
        prompt = ctx.tokenize(DOC)
        b = prefilled(ctx, prompt)
        greedy_tokens(b, 3)
        data = b.snapshot_sync()
        history = b.history
        expected = greedy(b)
        again = kvfork.Branch.restore_sync(ctx, data)
        assert again.history == history
        assert_continues(again, expected)

        ctx_data = ctx.snapshot_sync()
        histories = sorted([b.history, again.history])
        tree = ctx.restore_sync(ctx_data)
        assert b.disposed and again.disposed
        assert sorted(x.history for x in tree) == histories
        for x in tree:
            assert_continues_as_fresh(tiny, x)


def test_a_saved_branch_loads_exactly_here_and_in_another_context(
    tiny: kvfork.Model, tmp_path: Path
) -> None:
    """A branch saved after 3 generated tokens, loaded into the same context and into
    another one (other size and leases): both continue as the branch itself did."""
    path = tmp_path / "branch.kvf"
    with open_ctx(tiny) as ctx:
        b = prefilled(ctx, ctx.tokenize(DOC))
        greedy_tokens(b, 3)
        b.save_sync(path)
        expected = greedy(b)
        same = kvfork.Branch.load_sync(ctx, path)
        assert_continues(same, expected)
    with open_ctx(tiny, n_ctx=512, n_seq_max=2) as other:
        moved = kvfork.Branch.load_sync(other, path)
        assert_continues(moved, expected)


# ---- 6. speculative generation with rejected guesses


class Wrong:
    """Guesses a token greedy never picks here: every guess rejected."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        return [7, 7, 7]


class MostlyRight:
    """Right for 3 tokens (read from the reference), then wrong: partial acceptances."""

    def __init__(self, prompt_len: int, expected: list[int]) -> None:
        self.prompt_len = prompt_len
        self.expected = expected

    def propose(self, tokens: Sequence[int]) -> list[int]:
        i = len(tokens) - self.prompt_len
        return [*self.expected[i : i + 3], 7]


def drafter_for(guesses: str, prompt: list[int], reference: Greedy) -> Wrong | MostlyRight:
    """The drafter of a `guesses` case: every guess rejected, or 3 right then a wrong one."""
    if guesses == "all_rejected":
        return Wrong()
    return MostlyRight(len(prompt), reference.tokens)


#: Families whose architecture has llama.cpp's per-token recurrent snapshots (`n_rs_seq`):
#: with `recurrent_rollback`, a rejected guess is undone without a checkpoint.
ROLLBACK = {"lfm2", "lfm2_swa"}


@pytest.mark.parametrize("rollback", [0, 8], ids=["checkpoints", "rollback"])
@pytest.mark.parametrize("guesses", ["all_rejected", "partly_accepted"])
def test_speculation_with_rejected_guesses_is_exact(
    tiny: kvfork.Model, family: str, guesses: str, rollback: int
) -> None:
    """Speculative rounds (`speculate`, each decoding its guess) whose guesses are all
    rejected, or accepted for 3 tokens then rejected, draw the tokens plain greedy draws
    from a fresh prefill, and the branch goes on exactly after them; on recurrent models
    each rejection puts a checkpoint back and decodes the tokens kept before it again
    (unless `recurrent_rollback` lets llama.cpp drop them, on the architectures that can),
    on the others none. A speculative stream (`generate(draft=)`, which decides itself
    which guesses pay to decode) with the same drafter draws the same tokens too."""
    n = 24
    with open_ctx(tiny, recurrent_rollback=rollback) as ctx:
        prompt = ctx.tokenize(DOC)
        reference = fresh(tiny, prompt, n)
        drafter = drafter_for(guesses, prompt, reference)
        b = prefilled(ctx, prompt)
        logits = b.logits()
        before = restores(ctx), ctx.stats()["replayed_tokens"]
        got: list[int] = []
        rounds = rejections = 0
        pending = b.produce_sync()
        while len(got) < n:
            token = pending.token
            draft = drafter.propose([*b.history, token])
            accepted, pending = b.speculate_sync(token, draft)
            got += [token, *(t.token for t in accepted)]  # committed, the guess's kept part
            rounds += 1
            rejections += len(accepted) < len(draft)
        assert b.history == prompt + got
        if guesses == "all_rejected":
            assert len(got) == rounds == n
        else:
            assert rounds < n
        assert rejections > 0
        assert_matches(got[:n], reference, logits)
        replayed = ctx.stats()["replayed_tokens"] - before[1]
        if family in RECURRENT and not (rollback and family in ROLLBACK):
            assert restores(ctx) - before[0] == rejections
            assert replayed >= rejections  # at least the token before each guess
        else:
            assert restores(ctx) == 0 and replayed == 0
        assert_continues_as_fresh(tiny, b)

        streamed = prefilled(ctx, prompt)
        stream = streamed.generate_sync(n, draft=drafter_for(guesses, prompt, reference))
        assert_matches([t.token for t in stream], reference)
        assert stream.accepted <= stream.drafted
        if guesses == "all_rejected":
            assert stream.accepted == 0
        assert_continues_as_fresh(tiny, streamed)


class _NoGuess:
    """A drafter that never guesses: each round decodes the pending token alone, as a plain
    step does."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        return []


def test_a_speculative_stream_shifts_the_context_as_plain_generation_does(
    tiny: kvfork.Model,
) -> None:
    """With `on_context_full="shift"` and a drafter that never guesses, the speculative
    stream makes plain generation's decodes: the same tokens through the shifts (the token
    after a shift is drawn from the shifted context's logits, not from those before it)."""
    with open_ctx(tiny, n_ctx=128, n_seq_max=2) as ctx:
        prompt = ctx.tokenize(DOC)[:24]
        streams: list[list[int]] = []
        no_stop = {t: -math.inf for t in range(ctx.vocab_size) if ctx.is_stop_token(t)}
        for draft in (None, _NoGuess()):
            b = prefilled(ctx, prompt)
            b.set_logit_bias(no_stop)  # it runs past the context's end
            stream = (
                b.generate_sync(ctx.n_ctx, on_context_full="shift")
                if draft is None
                else b.generate_sync(ctx.n_ctx, draft=draft, on_context_full="shift")
            )
            streams.append([t.token for t in stream])
            assert stream.shifts >= 1 and stream.stop_reason == "max_tokens"
            b.prune_sync()
        plain, speculative = streams
        assert speculative == plain


# ---- 6b. scoring


def test_scores_match_fresh_prefills_and_a_failed_score_rolls_back(
    tiny: kvfork.Model, family: str
) -> None:
    """`score` in decodes of 32 rows: each score is the logprob a fresh prefill up to that
    token gives it, and the branch continues as a fresh prefill of its tokens. A score that
    runs out of cells after some decodes (families with a KV cache) is rolled back, on hybrids
    through a checkpoint, and the branch continues as before it."""
    with open_ctx(tiny, n_ctx=256, n_seq_max=2, n_batch=32) as ctx:
        text = ctx.tokenize(DOC * 8, add_special=False)
        b = prefilled(ctx, text[:1])
        scores = b.score_sync(text[1:100])
        for k in (1, 31, 32, 33, 64, 99):
            with open_ctx(tiny) as c:
                reference = prefilled(c, text[:k]).logprob(text[k])
            assert scores[k - 1] == pytest.approx(reference, abs=LOGIT_ATOL), k
        assert_continues_as_fresh(tiny, b)

        a = prefilled(ctx, text[:8])
        before = restores(ctx)
        if KIND[family] == "recurrent":  # no cells to run out of
            assert len(a.score_sync(text[8:150])) == 142
            assert_continues_as_fresh(tiny, a)
            return
        with pytest.raises(kvfork.KvCacheFullError):
            a.score_sync(text[8:150])
        assert (a.position, a.history) == (8, text[:8])
        assert ctx.kv_seq_pos_max_sync(a.seq_id) == 7
        if family in RECURRENT:
            assert restores(ctx) > before, "the decoded chunks were undone from a checkpoint"
        assert_continues_as_fresh(tiny, a)


def test_a_store_scores_two_branches_packed_as_each_scores_alone(tiny: kvfork.Model) -> None:
    """Two runs packed into decodes of 32 rows (each decode holding both): each run's
    scores are those it gets alone in a fresh context, and both branches continue as fresh
    prefills of their tokens."""
    with open_ctx(tiny, n_ctx=512, n_seq_max=3, n_batch=32) as ctx:
        text = ctx.tokenize(DOC * 3, add_special=False)
        x, y = prefilled(ctx, text[:3]), prefilled(ctx, text[:5])
        runs = [text[3:70], text[5:50]]
        together = kvfork.BranchStore(ctx).score_sync(list(zip((x, y), runs)))
        for start, run, scores in zip((3, 5), runs, together):
            with open_ctx(tiny) as c:
                alone = prefilled(c, text[:start]).score_sync(run)
            assert scores == pytest.approx(alone, abs=LOGIT_ATOL)
        assert_continues_as_fresh(tiny, x)
        assert_continues_as_fresh(tiny, y)


# ---- 7. beam search


def test_beam_search_scores_its_best_beam_as_a_fresh_prefill_does(tiny: kvfork.Model) -> None:
    """A 3-wide, 8-token beam search: its best beam's log-probability is within 1e-2 of
    its tokens re-scored one by one on a fresh prefill of the prompt."""
    with open_ctx(tiny, n_seq_max=8) as ctx:
        prompt = ctx.tokenize(DOC)
        beams = beam_search_sync(prefilled(ctx, prompt), 3, 8)
    assert len(beams) == 3
    best = beams[0]
    assert len(best.tokens) > 0
    with open_ctx(tiny) as ctx:
        r = prefilled(ctx, prompt)
        logprob = 0.0
        for t in best.tokens:
            logprob += r.logprob(t)
            r.commit_sync(t)
    assert abs(logprob - best.logprob) < 1e-2, (logprob, best.logprob)


# ---- 8. retain_only


def test_retain_only_keeps_one_branch_that_continues_exactly(tiny: kvfork.Model) -> None:
    """Three forks that took different first tokens step 4 times together; `retain_only`
    keeps the middle one (every other branch disposed, its lease alone held) and it goes
    on as a fresh prefill of its history does."""
    with open_ctx(tiny) as ctx:
        base = prefilled(ctx, ctx.tokenize(DOC))
        firsts = [int(t) for t in np.argsort(base.logits())[::-1][:3]]
        kids = [base.fork_sync() for _ in firsts]
        for kid, first in zip(kids, firsts):
            kid.commit_sync(first)
        store = kvfork.BranchStore(ctx)
        for _ in range(4):
            store.step_sync(kids)
        winner = kids[1]
        store.retain_only_sync(winner)
        assert all(b.disposed for b in [base, kids[0], kids[2]])
        assert winner.parent is None and store.available == ctx.n_seq_max - 1
        assert_continues_as_fresh(tiny, winner)


# ---- 9. reseed_context, shift_context, on_context_full="shift"


def test_reseed_and_shifts_continue_as_a_fresh_prefill_of_the_kept_tokens(
    tiny: kvfork.Model,
) -> None:
    """`reseed_context(sinks, tail)` and `shift_context(keep)` re-prefill the tokens they keep
    (the history says which) and go on as a fresh prefill of them; a stream with
    `on_context_full="shift"` at n_ctx 256 draws, from its shift on, what a fresh prefill of
    the tokens kept there draws."""
    with open_ctx(tiny) as ctx:
        prompt = ctx.tokenize(DOC)
        b = prefilled(ctx, prompt)
        out = greedy_tokens(b, 8)
        b.reseed_context_sync(prompt[:4], 20)
        assert b.history == prompt[:4] + (prompt + out)[-20:]
        assert b.position == 24
        assert_continues_as_fresh(tiny, b)

        c = prefilled(ctx, prompt)
        greedy_tokens(c, 8)
        before = c.history
        c.shift_context_sync(4)
        rest = len(before) - 4
        assert c.history == before[:4] + before[len(before) - (rest - rest // 2) :]
        assert_continues_as_fresh(tiny, c)

    with open_ctx(tiny, n_ctx=256, n_seq_max=1) as ctx:
        n_ctx = ctx.n_ctx
        b = prefilled(ctx, ctx.tokenize(DOC))
        stream = b.generate_sync(2 * n_ctx, on_context_full="shift")
        kept: list[int] | None = None
        got: list[int] = []
        for tok in stream:
            if kept is None and stream.shifts == 1:
                kept = b.history[:-1]  # the shift's tokens; `tok` was drawn after them
            if kept is not None:
                got.append(tok.token)
                if len(got) == N + 1:
                    break
        assert kept is not None, "no shift"
        assert len(got) == N + 1
        assert kept[:4] == ctx.tokenize(DOC)[:4] and len(kept) < n_ctx
        assert_matches(got, fresh(tiny, kept, N + 1))


# ---- 10. the raw layer


def test_raw_layer_partial_removal_is_refused_on_recurrent_states_and_exact_elsewhere(
    tiny: kvfork.Model, family: str
) -> None:
    """`ctx.kv_seq_remove(seq, k, -1)` on a sequence `ctx.decode` wrote: False on a recurrent
    state, which keeps every cell (pos_max unchanged) and continues exactly; True on a KV
    cache, where decoding the removed tokens again continues exactly. Removing a whole
    sequence works on every family; so does copying one in part, refused on a recurrent
    state. `fork(seq_id=)` puts an exact child on that sequence."""
    with open_ctx(tiny) as ctx:
        prompt = ctx.tokenize(DOC)
        k = len(prompt) // 2
        ctx.decode_sync(prompt, 0, 1)
        removed = ctx.kv_seq_remove(1, k, -1)
        pos_max = ctx.kv_seq_pos_max_sync(1)
        reference = fresh(tiny, prompt)
        if family in RECURRENT:
            assert removed is False
            assert pos_max == len(prompt) - 1
        else:
            assert removed is True
            assert pos_max == k - 1
            ctx.decode_sync(prompt[k:], k, 1)
        # A part copied: its state would be all of seq 1's beside k cells (silently wrong on
        # a hybrid, whose pos_max says k - 1). Refused; exact elsewhere (as removal).
        if family in RECURRENT:
            with pytest.raises(ValueError, match="copied in part"):
                ctx.kv_seq_copy(1, 2, 0, k)
        else:
            ctx.kv_seq_copy(1, 2, 0, k)
            ctx.decode_sync(prompt[k:], k, 2)
            copied = kvfork.Branch.create(ctx, len(prompt), GREEDY, seq_id=2)
            copied.capture_logits()
            assert_continues(copied, reference)
            copied.destroy()
            assert ctx.kv_seq_remove(2, 0, -1) is True
        raw = kvfork.Branch.create(ctx, len(prompt), GREEDY, seq_id=1)
        raw.capture_logits()
        assert_continues(raw, reference)

        ctx.decode_sync(prompt, 0, 2)
        assert ctx.kv_seq_remove(2, 0, -1) is True
        assert ctx.kv_seq_pos_max_sync(2) == -1

        parent = prefilled(ctx, prompt)
        child = parent.fork_sync(seq_id=3)
        assert child.seq_id == 3
        assert_continues(child, reference)
        assert_continues(parent, reference)


# ---- options


def test_checkpoint_options_are_checked_and_zero_keeps_none(
    family_models: Callable[[str], kvfork.Model],
) -> None:
    """Out-of-range `checkpoints`, `checkpoint_bytes` and `recurrent_rollback` are refused
    with ValueError naming them; `checkpoints=0` keeps none, and a fork inside a sequence
    then shares nothing and prefills it all, still exactly."""
    tiny = family_models("lfm2")
    for option, value in [
        ("checkpoints", -1),
        ("checkpoint_bytes", -1),
        ("recurrent_rollback", 65),
        ("recurrent_rollback", -1),
    ]:
        with pytest.raises(ValueError, match=option) as refused:
            open_ctx(tiny, **{option: value})
        if option == "recurrent_rollback":
            assert "[0, 64]" in str(refused.value)  # the range it takes, either side
    with open_ctx(tiny, checkpoints=0) as ctx:
        cache = kvfork.PrefixCache(ctx)
        prompt = ctx.tokenize(DOC)
        first = cache.branch_sync(prompt, GREEDY)
        cache.release(first)
        inside = prompt[:30] + ctx.tokenize(" A different ending.", add_special=False)
        b = cache.branch_sync(inside, GREEDY)
        assert cache.shared_tokens(b) == 0
        assert ctx.stats()["checkpoints"] == ctx.stats()["checkpoints_taken"] == 0
        assert_continues(b, fresh(tiny, inside))


# ---- the scratch prefill


def test_new_prompts_beside_a_busy_cache_prefill_exactly(tiny: kvfork.Model, family: str) -> None:
    """New prompts prefilled together while the cache holds another sequence go through the
    scratch context on attention-only models on the CPU (`scratch_tokens`; prompts shorter
    than a sliding window, the most it takes there) and through the packed prefill on
    recurrent ones (a recurrent state cannot move between contexts) and on a GPU; either way
    each branch goes on as a fresh prefill of its prompt does."""
    with open_ctx(tiny, n_ctx=1024, n_batch=32, n_seq_max=6) as ctx:
        text = ctx.tokenize(DOC * 4, add_special=False)
        prefilled(ctx, text[:120])  # a busy cache: 120 cells, over 2 x n_batch
        prompts = [ctx.tokenize(f"{i} and {i + 1} make") for i in range(1, 5)]
        branches = [kvfork.Branch.create(ctx, 0, GREEDY) for _ in prompts]
        kvfork.BranchStore(ctx).prefill_sync(list(zip(branches, prompts, strict=True)))
        scratch_tokens = int(ctx.stats()["scratch_tokens"])
        if family in RECURRENT or not ON_CPU:
            assert scratch_tokens == 0
        else:
            assert scratch_tokens == sum(map(len, prompts))
        for b, prompt in zip(branches, prompts, strict=True):
            reference = fresh(tiny, prompt)
            assert_matches(greedy(b, len(reference.tokens)).tokens, reference)
