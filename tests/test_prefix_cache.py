"""PrefixCache: branches that share the longest prefix already in the KV (a released entry or a
branch still generating) and prefill only the rest; exact against a branch prefilled from
scratch; eviction when leases run out."""

from __future__ import annotations

import asyncio
import contextlib
import time

import kvfork
import pytest

from .conftest import (
    COUNTING,
    GREEDY,
    PROMPT,
    SLOW_PREFILL_BATCH,
    assert_same_greedy,
    greedy_with_margins,
    root,
)

DOC = " ".join(f"Line {i}: the printing press spread across Europe." for i in range(12))


def scratch(ctx: kvfork.Context, tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(tokens)
    out = greedy_with_margins(b, n)
    b.prune_sync()
    return out


def test_a_released_entry_is_shared_and_the_tokens_equal_a_fresh_prefill(
    ctx: kvfork.Context,
) -> None:
    cache = kvfork.PrefixCache(ctx)
    first_prompt = ctx.tokenize(DOC + " Question one:")
    second_prompt = ctx.tokenize(DOC + " Question two:")
    a = cache.branch_sync(first_prompt, GREEDY)
    assert a.position == len(first_prompt) and cache.shared_tokens(a) == 0
    cache.release(a)
    assert cache.shared_tokens(a) is None  # no longer held: an entry
    b = cache.branch_sync(second_prompt, GREEDY)
    common = next(i for i, (x, y) in enumerate(zip(first_prompt, second_prompt)) if x != y)
    assert cache.shared_tokens(b) == common > 0
    # Another context's branch with the same handle number is not the cache's.
    with kvfork.create_context_sync(ctx.model, n_ctx=256, n_seq_max=b.handle + 1) as other:
        twins = [kvfork.Branch.create(other, 0, GREEDY) for _ in range(b.handle + 1)]
        assert twins[-1].handle == b.handle and cache.shared_tokens(twins[-1]) is None
    assert b.position == len(second_prompt) and b.parent is None  # a root
    got = [b.produce_sync().token]
    b.commit_sync(got[0])
    got += [t.token for t in b.generate_sync(11)]
    expected, margins = scratch(ctx, second_prompt, 12)
    assert_same_greedy(got, expected, margins)
    stats = cache.stats()
    assert stats["hit_tokens"] == common and stats["entries"] == 1 and stats["live"] == 1
    assert stats["prefilled_tokens"] == len(first_prompt) + len(second_prompt) - common


async def test_evict_oldest_gives_back_the_least_recently_used_entry_s_cells(
    ctx: kvfork.Context,
) -> None:
    cache = kvfork.PrefixCache(ctx)
    first, second = ctx.tokenize(COUNTING), ctx.tokenize("The printing press came first.")
    cache.release(cache.branch_sync(first, GREEDY))
    cache.release(cache.branch_sync(second, GREEDY))
    assert await cache.evict_oldest() is True
    assert cache.stats()["entries"] == 1 and cache.stats()["evictions"] == 1
    again = cache.branch_sync(second, GREEDY)  # the newer entry stayed
    assert cache.shared_tokens(again) == len(second) - 1  # all but the last, prefilled
    cache.release(again)
    left = cache.stats()["entries"]  # the older entry and the one released after it
    assert [cache.evict_oldest_sync() for _ in range(left + 1)] == [True] * left + [False]
    assert cache.stats()["entries"] == 0


async def test_evicting_on_a_closed_context_says_it_is_closed(model: kvfork.Model) -> None:
    """Not False or 0, which would read as a cache with nothing left to evict."""
    ctx = kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2)
    cache = kvfork.PrefixCache(ctx)
    cache.release(cache.branch_sync(ctx.tokenize(COUNTING), GREEDY))
    ctx.close()
    with pytest.raises(kvfork.KvforkError, match="closed"):
        await cache.evict_oldest()
    with pytest.raises(kvfork.KvforkError, match="closed"):
        cache.evict_oldest_sync()
    with pytest.raises(kvfork.KvforkError, match="closed"):
        cache.make_room_sync(1)


def test_releasing_a_pruned_branch_is_a_value_error_and_forgets_it(ctx: kvfork.Context) -> None:
    cache = kvfork.PrefixCache(ctx)
    tokens = ctx.tokenize(COUNTING)
    b = cache.branch_sync(tokens, GREEDY)
    b.prune_sync()
    with pytest.raises(ValueError, match="pruned already"):
        cache.release(b)
    with pytest.raises(ValueError, match="not a live branch"):
        cache.release(b)
    assert cache.stats()["live"] == 0 and cache.stats()["entries"] == 0


def test_a_handle_handed_back_is_spent_and_the_entry_stays_as_it_was(
    ctx: kvfork.Context,
) -> None:
    """A use after `release` would write into an entry later requests share (their tokens
    would change): the handle raises as a pruned one, and its prune does nothing. The tree
    the caller sees has the entry no more (it is the cache's): the fork made before the
    release has no parent, and the released handle no children."""
    cache = kvfork.PrefixCache(ctx)
    tokens = ctx.tokenize(COUNTING)
    b = cache.branch_sync(tokens, GREEDY)
    token = b.produce_sync().token
    mine = b.fork_sync()  # a fork of the user's own, made before the release
    cache.release(b)
    assert b.disposed and not b.is_active
    assert mine.parent is None and b.parent is None
    assert b.children == [] and b.is_leaf
    spent = kvfork.BranchDisposedError
    for use in (
        lambda: b.commit_sync(token),
        lambda: b.prefill_sync([token]),
        lambda: b.sample(),
        lambda: b.fork_sync(),
        lambda: cache.fork_sync(b),
        lambda: kvfork.BranchStore(ctx).step_sync([b]),
    ):
        with pytest.raises(spent, match="handed back to its prefix cache"):
            use()
    b.prune_sync()  # a no-op, as on a pruned branch: the entry stays
    mine.prune_sync()
    assert cache.stats()["entries"] == 1
    again = cache.branch_sync(tokens, GREEDY)
    assert cache.shared_tokens(again) == len(tokens) - 1 and again != b
    expected, margins = scratch(ctx, tokens, 4)
    assert_same_greedy([t.token for t in again.generate_sync(4)], expected, margins)


def test_a_fork_handed_back_leaves_its_parent_a_leaf_that_prunes(ctx: kvfork.Context) -> None:
    """A fork given back to the cache is the cache's entry, not a live child of the branch
    it was forked from: that branch is a leaf again and its RESTRICT prune goes through,
    leaving the entry (its cells kept, as `prune(keep_children=True)` leaves children) for
    the next request with its prompt."""
    cache = kvfork.PrefixCache(ctx)
    tokens = ctx.tokenize(COUNTING)
    b = cache.branch_sync(tokens, GREEDY)
    f = cache.fork_sync(b)
    assert b.children == [f] and not b.is_leaf
    cache.release(f)
    assert b.children == [] and b.is_leaf
    b.prune_sync()
    assert b.disposed and cache.stats()["entries"] == 1
    again = cache.branch_sync(tokens, GREEDY)
    assert cache.shared_tokens(again) == len(tokens) - 1
    expected, margins = scratch(ctx, tokens, 4)
    assert_same_greedy([t.token for t in again.generate_sync(4)], expected, margins)


def test_the_same_prompt_twice_prefills_only_its_last_token(ctx: kvfork.Context) -> None:
    cache = kvfork.PrefixCache(ctx)
    tokens = ctx.tokenize(COUNTING)
    cache.release(cache.branch_sync(tokens, GREEDY))
    again = cache.branch_sync(tokens, GREEDY)
    assert cache.shared_tokens(again) == len(tokens) - 1
    expected, margins = scratch(ctx, tokens, 8)
    assert_same_greedy([t.token for t in again.generate_sync(8)], expected, margins)


async def test_a_branch_still_generating_is_shared_at_a_position_inside_it(
    ctx: kvfork.Context,
) -> None:
    cache = kvfork.PrefixCache(ctx)
    prompt = ctx.tokenize(PROMPT)
    live = await cache.branch(prompt, GREEDY)
    generated = [t.token async for t in live.generate(6)]
    # A request whose prompt is the live branch's prompt plus part of what it generated.
    follow = prompt + generated[:3] + ctx.tokenize(" and then", add_special=False)
    other = await cache.branch(follow, GREEDY)
    assert cache.shared_tokens(other) == len(prompt) + 3
    assert other.position == len(follow) and live.position == len(prompt) + 6
    got = [t.token async for t in other.generate(8)]
    expected, margins = scratch(ctx, follow, 8)
    assert_same_greedy(got, expected, margins)
    # The live branch is untouched by the fork inside it.
    more = [t.token async for t in live.generate(4)]
    exp_live, m_live = scratch(ctx, prompt, 10)
    assert_same_greedy(generated + more, exp_live, m_live)


async def test_concurrent_requests_prefill_a_shared_preamble_once(
    model: kvfork.Model,
) -> None:
    async with await kvfork.create_context(model, n_ctx=4096, n_seq_max=9) as ctx:
        cache = kvfork.PrefixCache(ctx)
        preamble = ctx.tokenize(DOC)
        questions = [preamble + ctx.tokenize(f" Q{i}:", add_special=False) for i in range(8)]
        # All at once, none cached yet: one prefills the preamble, the others wait and fork.
        before = ctx.stats()["decode_calls"]
        branches = await asyncio.gather(*(cache.branch(q, GREEDY) for q in questions))
        # One decode for the preamble, ONE for the 7 questions that waited for it: their
        # forks (run in passing) do not split the gathering of their prefills.
        assert ctx.stats()["decode_calls"] - before == 2
        shared = sorted(cache.shared_tokens(b) or 0 for b in branches)
        assert shared[0] == 0 and all(s >= len(preamble) - 1 for s in shared[1:])
        stats = cache.stats()
        assert stats["prefilled_tokens"] < len(preamble) + 8 * 8
        for b, q in zip(branches, questions, strict=True):
            assert b.position == len(q)
        expected, margins = scratch(ctx, questions[5], 6)
        assert_same_greedy([t.token async for t in branches[5].generate(6)], expected, margins)
        for b in branches:
            cache.release(b)
        assert cache.stats()["entries"] == 8


async def test_a_short_prompt_does_not_wait_for_a_long_prefill_it_shares_a_few_tokens_with(
    model: kvfork.Model,
) -> None:
    """A request waits for another's prefill only to share at least half of what that
    prefill decodes: a chat template's first tokens are not worth a long document's prefill
    (the short request after it waited for all of it). It is answered first. (The long
    prefill in small decodes, SLOW_PREFILL_BATCH, lasts on a GPU too.)"""
    async with await kvfork.create_context(
        model, n_ctx=4096, n_seq_max=4, n_batch=SLOW_PREFILL_BATCH
    ) as ctx:
        cache = kvfork.PrefixCache(ctx)
        template = ctx.tokenize("<start_of_turn>user\nYou are a careful assistant. " * 4)
        long = template + ctx.tokenize(DOC * 16, add_special=False)[:2000]
        short = template + ctx.tokenize(" What is 2 + 2?", add_special=False)
        done: list[str] = []

        async def branch(tokens: list[int], name: str) -> kvfork.Branch:
            b = await cache.branch(tokens, GREEDY)
            done.append(name)
            return b

        first = asyncio.ensure_future(branch(long, "long"))
        await asyncio.sleep(0.05)  # its prefill is announced, its decodes under way
        b = await branch(short, "short")
        assert done == ["short"] and not first.done()
        assert len(template) >= 40  # a prefix that was worth waiting for, by length alone
        cache.release(b)
        cache.release(await first)


def test_entries_are_evicted_least_recently_used_when_leases_run_out(
    model: kvfork.Model,
) -> None:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=3) as ctx:
        cache = kvfork.PrefixCache(ctx)
        prompts = [ctx.tokenize(f"Story number {i}: once upon a time") for i in range(5)]
        for p in prompts:
            cache.release(cache.branch_sync(p, GREEDY))
        stats = cache.stats()
        assert stats["entries"] == 3 and stats["evictions"] == 2
        # Every lease held by a live branch: nothing to evict.
        live = [cache.branch_sync(ctx.tokenize(f"Fresh {i}"), GREEDY) for i in range(3)]
        with pytest.raises(kvfork.LeaseExhaustedError):
            cache.branch_sync(ctx.tokenize("One more"), GREEDY)
        for b in live:
            b.prune_sync()  # pruned behind the cache's back: forgotten, leases free
        assert cache.stats()["live"] == 0
        cache.branch_sync(ctx.tokenize("One more"), GREEDY)


async def test_requests_racing_for_the_last_free_lease_evict_entries_instead_of_failing(
    model: kvfork.Model,
) -> None:
    # Three entries hold three of five leases. Five requests at once (never more live branches
    # than leases) share a new preamble: one prefills it while the others wait, then they
    # wake together to one free lease and three entries to evict. None may fail.
    async with await kvfork.create_context(model, n_ctx=4096, n_seq_max=5) as ctx:
        cache = kvfork.PrefixCache(ctx)
        for attempt in range(4):
            for i in range(3):
                entry = await cache.branch(ctx.tokenize(f"Entry {attempt}.{i}: a story"), GREEDY)
                cache.release(entry)
            assert kvfork.BranchStore(ctx).available == 2
            preamble = ctx.tokenize(f"{attempt}. {DOC}")
            asked = [preamble + ctx.tokenize(f" Q{i}:", add_special=False) for i in range(5)]
            live = await asyncio.gather(*(cache.branch(q, GREEDY) for q in asked))
            assert [b.position for b in live] == [len(q) for q in asked]
            for b in live:
                await b.prune()
            cache.clear()


def test_max_cached_tokens_bounds_the_entries(ctx: kvfork.Context) -> None:
    cache = kvfork.PrefixCache(ctx, max_cached_tokens=40)
    for i in range(4):
        cache.release(cache.branch_sync(ctx.tokenize(f"Entry {i}: " + "word " * 20), GREEDY))
    assert cache.stats()["cached_tokens"] <= 40
    cache.clear()
    assert cache.stats()["entries"] == 0


def test_bad_calls_raise(ctx: kvfork.Context) -> None:
    cache = kvfork.PrefixCache(ctx)
    with pytest.raises(ValueError, match="tokens"):
        cache.branch_sync([], GREEDY)
    with pytest.raises(ValueError, match="no room"):
        cache.branch_sync([1] * ctx.n_ctx, GREEDY)
    with pytest.raises(ValueError, match="token"):
        cache.branch_sync([ctx.vocab_size], GREEDY)
    with pytest.raises(TypeError, match="ctx"):
        kvfork.PrefixCache(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="branch"):
        cache.release(None)  # type: ignore[arg-type]
    stranger = kvfork.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(ValueError, match="not a live branch of this cache"):
        cache.release(stranger)
    b = cache.branch_sync(ctx.tokenize(PROMPT), GREEDY)
    cache.release(b)
    with pytest.raises(ValueError, match="already released"):
        cache.release(b)
    with kvfork.create_context_sync(ctx.model, n_ctx=512, n_seq_max=2) as other:
        theirs = kvfork.PrefixCache(other).branch_sync(other.tokenize(PROMPT), GREEDY)
        for call in (cache.fork_sync, cache.release):
            with pytest.raises(ValueError, match="another context"):
                call(theirs)  # its handle may equal one of this cache's


def test_forks_evict_entries_for_their_leases_and_are_handed_back_as_entries(
    model: kvfork.Model,
) -> None:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=4) as ctx:
        cache = kvfork.PrefixCache(ctx)
        for i in range(4):  # every lease an entry
            cache.release(cache.branch_sync(ctx.tokenize(f"Entry {i}: a story"), GREEDY))
        tokens = ctx.tokenize(COUNTING)
        first = cache.branch_sync(tokens, GREEDY)
        forks = [cache.fork_sync(first) for _ in range(3)]  # an n = 4 request
        stats = cache.stats()
        assert stats["live"] == 4 and stats["entries"] == 0 and stats["evictions"] == 4
        assert all(f.parent == first and f.position == first.position for f in forks)
        expected, margins = scratch_in(model, tokens, 6)
        for f in forks:  # a fork continues exactly as the branch it came from
            assert_same_greedy([t.token for t in f.generate_sync(6)], expected, margins)
        with pytest.raises(kvfork.LeaseExhaustedError):
            cache.fork_sync(first)  # live branches hold every lease
        for b in [*forks, first]:
            cache.release(b)
        assert cache.stats()["entries"] == 4 and cache.stats()["live"] == 0
        # An entry's forks outlive its eviction: each eviction frees exactly one lease.
        assert cache.make_room_sync(1) == 1
        assert kvfork.BranchStore(ctx).available == 1 and cache.stats()["entries"] == 3


def scratch_in(model: kvfork.Model, tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1) as ctx:
        return scratch(ctx, tokens, n)


def test_make_room_evicts_least_recently_used_entries_until_n_leases_are_free(
    model: kvfork.Model,
) -> None:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=4) as ctx:
        cache = kvfork.PrefixCache(ctx)
        for i in range(3):
            cache.release(cache.branch_sync(ctx.tokenize(f"Entry {i}: a story"), GREEDY))
        store = kvfork.BranchStore(ctx)
        assert store.available == 1
        assert cache.make_room_sync(1) == 0
        assert cache.make_room_sync(3) == 2 and store.available == 3
        live = cache.branch_sync(ctx.tokenize("Live"), GREEDY)
        with pytest.raises(kvfork.LeaseExhaustedError):
            cache.make_room_sync(4)  # the live branch keeps its lease
        with pytest.raises(ValueError, match="sequences"):
            cache.make_room_sync(5)
        cache.release(live)


async def test_a_cancelled_branch_aborts_its_prefill_and_a_finished_one_becomes_an_entry(
    model: kvfork.Model,
) -> None:
    async with await kvfork.create_context(
        model, n_ctx=4096, n_seq_max=4, n_batch=SLOW_PREFILL_BATCH
    ) as ctx:
        cache = kvfork.PrefixCache(ctx)
        tokens = ctx.tokenize(DOC * 4)  # a prefill long enough to be cancelled during it
        task = asyncio.ensure_future(cache.branch(tokens, GREEDY))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The prefill was aborted and rolled back (a client gone frees the engine at once):
        # nobody holds a branch, nothing was kept, every lease is free.
        aborted_in = time.monotonic() - started
        assert cache.stats()["live"] == 0 and cache.stats()["entries"] == 0
        assert kvfork.BranchStore(ctx).available == 4
        started = time.monotonic()
        first = await cache.branch(tokens, GREEDY)
        assert aborted_in < (time.monotonic() - started) / 2  # not a whole prefill's wait
        assert cache.shared_tokens(first) == 0
        task = asyncio.ensure_future(cache.fork(first))
        await asyncio.sleep(0)
        task.cancel()
        # Cancelled, nobody holds the fork: the cache took it back. Finished before the
        # cancel, it is ours to give back.
        with contextlib.suppress(asyncio.CancelledError):
            cache.release(await task)
        stats = cache.stats()
        assert stats["live"] == 1 and stats["entries"] == 1
        cache.release(first)


def test_an_operation_never_awaited_warns_naming_the_call(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    b.prefill_sync(ctx.tokenize(PROMPT))
    child = b.fork_sync()
    with pytest.warns(RuntimeWarning, match=r"Branch\.prune\(\) was never awaited"):
        b.prune()  # refused (a live child): without the warning this failure would be silent
    assert not b.disposed
    with pytest.warns(RuntimeWarning, match=r"Branch\.prune\(\) was never awaited"):
        child.prune()
    # It happens all the same, and every view of the tree says so at once.
    assert child.disposed and not child.is_active
    assert b.children == [] and b.is_leaf
    b.prune_sync()  # the parent has no live child left
    with pytest.warns(RuntimeWarning, match=r"PrefixCache\.make_room\(\) was never awaited"):
        kvfork.PrefixCache(ctx).make_room(1)


def test_on_a_park_context_the_cache_parks_to_make_room(model: kvfork.Model) -> None:
    """Branches of your own hold every lease: the cache's `branch` and `fork` park the least
    recently used branches, as `Branch.create` does (they raised LeaseExhaustedError: the
    cache only evicted its own entries, and it had none)."""
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=2, park=True) as ctx:
        cache = kvfork.PrefixCache(ctx)
        mine = [root(ctx, f"Branch {i}: the cat sat on the mat") for i in range(3)]
        reference = root(ctx)
        expected, margins = greedy_with_margins(reference, 4)
        reference.prune_sync()
        assert ctx.stats()["parked_branches"] > 0
        b = cache.branch_sync(ctx.tokenize(PROMPT), GREEDY)
        fork = cache.fork_sync(b)
        assert cache.make_room_sync(1) == 0  # room is made by parking
        for got in (b, fork):
            assert_same_greedy([t.token for t in got.generate_sync(4)], expected, margins)
            cache.release(got)
        for branch in mine:
            branch.prune_sync()


def test_clear_forgets_entries_whose_branch_was_pruned_elsewhere(ctx: kvfork.Context) -> None:
    # An entry forked from a branch of yours goes with it (`prune_subtree`); `clear` then
    # found an entry to evict, evicted nothing, and raised "all N leases are in use".
    cache = kvfork.PrefixCache(ctx)
    mine = root(ctx)
    cache.release(cache.fork_sync(mine))
    mine.prune_subtree_sync()
    cache.clear()
    assert cache.stats()["entries"] == 0
