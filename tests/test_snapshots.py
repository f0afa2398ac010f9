"""In-memory snapshots (`branch.snapshot()` / `Branch.restore`, `ctx.snapshot()` /
`ctx.restore`): the bytes a state file holds, round trips that continue exactly, a whole
context restored over live branches (disposed), and corrupt, truncated or foreign bytes
refused with StateFileError, changing nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import kvfork
import pytest

from .conftest import GREEDY, PROMPT, assert_follows, greedy_tokens, record, root


@pytest.fixture
def small(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=4) as c:
        yield c


def test_a_branch_snapshot_is_its_state_file_and_continues_exactly(
    small: kvfork.Context, tmp_path: Path
) -> None:
    b = root(small, params={"temperature": 0.9, "seed": 3})
    b.set_logit_bias({7: -2.0})
    greedy_tokens(b, 3)
    data = b.snapshot_sync()
    assert isinstance(data, bytes)
    b.save_sync(tmp_path / "b.kvf")
    assert data == (tmp_path / "b.kvf").read_bytes()  # the same framing as the file
    expected = record(b, 6)
    again = kvfork.Branch.restore_sync(small, data)
    assert again.position == b.position - 6 and again.history == b.history[:-6]
    # In other cells than b's: b's draws from b's rows, its own rows equal up to noise.
    assert_follows(again, expected)
    from_file = kvfork.Branch.restore_sync(small, bytearray(data))  # any bytes-like
    assert_follows(from_file, expected)


async def test_a_branch_snapshot_restores_on_another_context(
    small: kvfork.Context, model: kvfork.Model
) -> None:
    b = root(small)
    data = await b.snapshot()
    expected = greedy_tokens(b, 5)
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2) as other:
        # The first branch there, in b's cells: b's very decodes, bit for bit.
        moved = await kvfork.Branch.restore(other, data)
        assert greedy_tokens(moved, 5) == expected


async def test_a_context_snapshot_returns_to_its_tree_over_live_branches(
    small: kvfork.Context,
) -> None:
    trunk = root(small)
    kids = [await trunk.fork(), await trunk.fork()]
    await kids[0].commit(kids[0].produce_sync())
    await kids[1].prefill(small.tokenize(" and", add_special=False))
    small.decode_sync(small.tokenize("Raw cells"), 0, 3)  # cells of no branch come back too
    data = await small.snapshot()
    seqs = [k.seq_id for k in kids]
    expected = [record(k, 4) for k in kids]
    extra = await kids[0].fork()  # the tree changes after the snapshot
    small.kv_seq_remove(3)

    restored = await small.restore(data)
    for b in [trunk, *kids, extra]:
        assert b.disposed
        with pytest.raises(kvfork.BranchDisposedError):
            b.sample()
    assert len(restored) == 3
    new_trunk, *new_kids = restored
    assert new_trunk.parent is None and new_kids[0].parent == new_trunk
    assert [k.seq_id for k in new_kids] == seqs
    assert await small.kv_seq_pos_max(3) == len(small.tokenize("Raw cells")) - 1
    for k, reference in zip(new_kids, expected, strict=True):
        assert_follows(k, reference)  # after other decodes since: rows equal up to noise
    assert kvfork.BranchStore(small).available == 1


def test_corrupt_truncated_or_foreign_snapshots_raise_and_change_nothing(
    small: kvfork.Context, chat_model: kvfork.Model
) -> None:
    b = root(small)
    branch_data = b.snapshot_sync()
    ctx_data = small.snapshot_sync()
    n = len(branch_data)
    cuts = [0, 1, 7, 8, 20, 47, 48, 100, n // 2, n - 1]
    bad: list[bytes] = [branch_data[:c] for c in cuts]
    for i in [9, 30, 60, 500, n // 3, n - 2]:  # header, payload and KV bytes
        flipped = bytearray(branch_data)
        flipped[i] ^= 0x10
        bad.append(bytes(flipped))
    bad += [b"", b"garbage" * 20, branch_data + b"\0", ctx_data]
    for data in bad:
        with pytest.raises(kvfork.StateFileError):
            kvfork.Branch.restore_sync(small, data)
    for data in [ctx_data[: len(ctx_data) // 2], ctx_data[:-1], branch_data, b"\0" * 64]:
        with pytest.raises(kvfork.StateFileError):
            small.restore_sync(data)
    assert not b.disposed  # a refused restore disposed nothing
    assert_follows(kvfork.Branch.restore_sync(small, branch_data), record(b, 3))
    with kvfork.create_context_sync(chat_model, n_ctx=256, n_seq_max=2) as chat:
        with pytest.raises(kvfork.StateFileError, match="different model"):
            kvfork.Branch.restore_sync(chat, branch_data)
        with pytest.raises(kvfork.StateFileError, match="different model"):
            chat.restore_sync(ctx_data)
    with pytest.raises(TypeError, match="data"):
        small.restore_sync("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data"):
        kvfork.Branch.restore_sync(small, 5)  # type: ignore[arg-type]


def test_snapshots_need_a_live_branch_and_an_open_context(small: kvfork.Context) -> None:
    b = kvfork.Branch.create(small, 0, GREEDY)
    b.prefill_sync(small.tokenize(PROMPT))
    data = small.snapshot_sync()
    b.prune_sync()
    with pytest.raises(kvfork.BranchDisposedError):
        b.snapshot_sync()
    full = [kvfork.Branch.create(small, 0, GREEDY) for _ in range(small.n_seq_max)]
    with pytest.raises(kvfork.LeaseExhaustedError):
        kvfork.Branch.restore_sync(small, full[0].snapshot_sync())
    assert len(small.restore_sync(data)) == 1  # a whole context needs no free lease
    small.close()
    with pytest.raises(kvfork.KvforkError, match="closed"):
        small.snapshot_sync()
    with pytest.raises(kvfork.KvforkError, match="closed"):
        small.restore_sync(data)


def test_a_snapshot_without_room_in_the_cache_is_kv_cache_full_not_a_bad_file(
    model: kvfork.Model,
) -> None:
    """Restoring into a cache whose free cells are too few is KvCacheFullError, as a prefill of
    as many tokens is (the bytes are fine: they restore once a branch is pruned); a state
    larger than the whole cache stays StateFileError."""
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=3) as ctx:
        b = root(ctx)
        b.prefill_sync([b.sample()] * (150 - b.position))
        snap = b.snapshot_sync()
        with pytest.raises(kvfork.KvCacheFullError, match="prune branches"):
            kvfork.Branch.restore_sync(ctx, snap)
        assert kvfork.BranchStore(ctx).available == 2  # the failed restore's lease came back
        b.prune_sync()
        again = kvfork.Branch.restore_sync(ctx, snap)
        assert again.position == 150
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1) as big:
        b = root(big)
        b.prefill_sync([b.sample()] * (300 - b.position))
        larger = b.snapshot_sync()
    with (
        kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as small,
        pytest.raises(kvfork.StateFileError, match="beyond this context"),
    ):
        kvfork.Branch.restore_sync(small, larger)


async def _cancelled_once_done(make: Callable[[], Awaitable[object]]) -> None:
    """Await `make()` in a task, block the loop while the engine completes it, then cancel
    the task before it takes the result: the await raises CancelledError. (A call the engine
    finished before the task first waited returns its branches: pruned, and tried again.)"""

    async def take() -> object:
        return await make()

    for _ in range(20):
        task = asyncio.ensure_future(take())
        await asyncio.sleep(0)  # the task starts: its call is queued, the task waits
        if task.done():
            made = task.result()
            for b in reversed(made if isinstance(made, list) else [made]):
                await b.prune()
            continue
        time.sleep(1.0)  # noqa: ASYNC251 (the loop blocked: the engine completes it meanwhile)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return
    pytest.fail("the call was done before its task ever waited, 20 times")


async def _leases_free(ctx: kvfork.Context) -> int:
    """Free leases once the work queued so far (a discard's prunes) has run."""
    await kvfork.Branch.create(ctx, 0, GREEDY).prune()  # queued after them
    return kvfork.BranchStore(ctx).available


async def test_branches_a_cancelled_restore_made_are_pruned(
    small: kvfork.Context, tmp_path: Path
) -> None:
    """A restore or load cancelled after the engine made its branches handed them to nobody
    and the context kept them: each held a lease for the context's life. They are pruned."""
    b = root(small)
    data = await b.snapshot()
    await b.save(tmp_path / "b.kvf")
    await b.prune()
    for make in (
        lambda: kvfork.Branch.restore(small, data),
        lambda: kvfork.Branch.load(small, tmp_path / "b.kvf"),
    ):
        await _cancelled_once_done(make)
        assert await _leases_free(small) == small.n_seq_max
    trunk = root(small)
    await trunk.fork()
    tree = await small.snapshot()
    await small.save_state(tmp_path / "tree.kvs")
    # Disposes both, restores both; cancelled: the restored two pruned.
    await _cancelled_once_done(lambda: small.restore(tree))
    assert await _leases_free(small) == small.n_seq_max
    await _cancelled_once_done(lambda: small.load_state(tmp_path / "tree.kvs"))
    assert await _leases_free(small) == small.n_seq_max
