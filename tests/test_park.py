"""Parked branches (`park=True`): more branches than leases, results equal up to cell-order
noise (a parked branch comes back into other cells: conftest's rules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvfork
import numpy as np
import pytest

from .conftest import (
    GREEDY,
    NEAR_TIE,
    PROMPT,
    assert_close_logits,
    assert_follows,
    assert_same_greedy,
    greedy_tokens,
    greedy_with_margins,
    margin,
    record,
)

# Every decode takes at most 4 tokens in both contexts compared, so the two run the same
# batch shapes and only the placement of cells differs.
N_BATCH = 4

# Generated tokens of the 64-branch tree search before their branch's first near-tie
# (margin < 1) on the 64-lease run: the tokens its comparison checks at the least.
COMPARED_TOKENS = 64


def open_ctx(model: kvfork.Model, n_seq_max: int, park: bool) -> kvfork.Context:
    return kvfork.create_context_sync(
        model, n_ctx=4096, n_batch=N_BATCH, n_seq_max=n_seq_max, park=park
    )


def gaps(b: kvfork.Branch, n: int) -> float:
    """The smallest gap between consecutive logits among the branch's `n + 1` best: how far
    the choice of its top `n` tokens is from a near-tie."""
    top = np.sort(b.logits())[-(n + 1) :]
    return float(np.diff(top).min())


def tree_search(
    ctx: kvfork.Context, live: int = 64, steps: int = 4
) -> tuple[list[list[int]], list[list[float]]]:
    """Breadth-first expansion: each frontier branch forks two children that commit its
    best and second-best tokens, until `live` branches exist; then every leaf steps
    greedily `steps` times, one store step each. Every branch's token history, and for
    each of its tokens the logit gap that chose it (`inf` for the prompt's)."""
    root = kvfork.Branch.create(ctx, 0, GREEDY)
    root.prefill_sync(ctx.tokenize(PROMPT))
    branches, frontier = [root], [root]
    margins = {root.handle: [float("inf")] * len(root.history)}
    while len(branches) < live:
        grown = []
        for b in frontier:
            for rank, (token, _) in enumerate(b.top_logprobs(2)):
                if len(branches) == live:
                    break
                child = b.fork_sync()
                # The best token is clear of the second; the second of both neighbours.
                margins[child.handle] = [*margins[b.handle], gaps(b, rank + 1)]
                child.commit_sync(token)
                branches.append(child)
                grown.append(child)
        frontier = grown
    leaves = [b for b in branches if b.is_leaf]
    store = kvfork.BranchStore(ctx)
    for _ in range(steps):
        for b in leaves:
            margins[b.handle].append(gaps(b, 1))
        store.step_sync(leaves)
    return [b.history for b in branches], [margins[b.handle] for b in branches]


def compared_tokens(margins: list[list[float]]) -> tuple[int, int]:
    """How many generated tokens come before their branch's first near-tie (those
    `assert_same_greedy` compares whatever happens), and how many were generated."""
    n_prompt = len(margins[0])
    compared = sum(
        next((i for i, x in enumerate(m) if x < NEAR_TIE), len(m)) - n_prompt for m in margins
    )
    return compared, sum(len(m) - n_prompt for m in margins)


# Parking moves cells: a branch brought back, or a new cell, may land in a hole below the
# branch's older cells, and llama.cpp's attention sums in cell order (f16 on this model), so
# logits move by up to ~1 (test_a_hole_below_a_branchs_cells_moves_logits_within_a_bound
# shows it without parking). Tokens are therefore compared the way every batching test of
# kvfork compares them (conftest.assert_same_greedy): equal up to their first difference,
# which must come at a near-tie of the 64-lease run.
def test_tree_search_with_4_leases_equals_64_leases(model: kvfork.Model) -> None:
    with open_ctx(model, 64, park=False) as wide:
        expected, margins = tree_search(wide)
    with open_ctx(model, 4, park=True) as narrow:
        got, _ = tree_search(narrow)
        stats = narrow.stats()
        assert stats["parks"] > 60 and stats["unparks"] > 60
        assert stats["parked_branches"] == 60
        assert stats["parked_bytes"] > 0
    assert len(got) == len(expected) == 64
    for g, e, m in zip(got, expected, margins, strict=True):
        assert_same_greedy(g, e, m)
    # The comparison is not vacuous: most generated tokens come before any near-tie.
    compared, generated = compared_tokens(margins)
    print(f"tokens compared: {compared} of {generated}")
    assert compared >= COMPARED_TOKENS, (compared, generated)


@pytest.mark.parametrize("live", [5, 7])
def test_small_tree_search_on_4_leases_equals_the_wide_one(model: kvfork.Model, live: int) -> None:
    """A few branches, parked and brought back into other cells: the margin rule, as for 64
    (this CPU happens to give the same tokens throughout, near-ties included)."""
    with open_ctx(model, 64, park=False) as wide:
        expected, margins = tree_search(wide, live=live)
    with open_ctx(model, 4, park=True) as narrow:
        got, _ = tree_search(narrow, live=live)
        assert narrow.stats()["parks"] > 0
    assert [len(g) for g in got] == [len(e) for e in expected]
    for g, e, m in zip(got, expected, margins, strict=True):
        assert_same_greedy(g, e, m)


def test_fork_and_create_without_a_lease_park_instead_of_raising(model: kvfork.Model) -> None:
    with open_ctx(model, 1, park=True) as ctx:
        a = kvfork.Branch.create(ctx, 0, GREEDY)
        a.prefill_sync(ctx.tokenize(PROMPT))
        b = a.fork_sync()
        c = kvfork.Branch.create(ctx, 0, GREEDY)
        assert a.is_active and not b.is_active and not c.is_active
        assert ctx.stats()["parked_branches"] == 2
        # A child parked on its active parent holds no cell of its own.
        assert ctx.stats()["parked_bytes"] == 0
        expected = record(a.fork_sync(), 5)  # a third branch, parked then back
        assert_follows(b, expected)  # b comes back, a is parked
        assert b.is_active and not a.is_active
        assert ctx.stats()["unparks"] >= 1 and ctx.stats()["parks"] >= 1
        assert_follows(a, expected)
        assert a.history == b.history
    with open_ctx(model, 1, park=False) as strict:
        kvfork.Branch.create(strict, 0, GREEDY)
        with pytest.raises(kvfork.LeaseExhaustedError):
            kvfork.Branch.create(strict, 0, GREEDY)


def own_cells_bytes(model: kvfork.Model, n_tokens: int) -> int:
    """The K and V rows of `n_tokens` cells (f16), from the model's metadata."""
    meta = model.metadata
    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
    k_len = int(meta[f"{arch}.attention.key_length"])
    v_len = int(meta[f"{arch}.attention.value_length"])
    return n_tokens * layers * kv_heads * (k_len + v_len) * 2


def test_host_memory_of_a_parked_branch_is_its_own_cells(model: kvfork.Model) -> None:
    with open_ctx(model, 2, park=True) as ctx:
        parent = kvfork.Branch.create(ctx, 0, GREEDY)
        parent.prefill_sync(ctx.tokenize(PROMPT * 8))
        child = parent.fork_sync()
        child.prefill_sync(list(range(1000, 1064)))  # 64 own tokens
        parent.commit_sync(parent.sample())  # the child is now the least recently used
        other = kvfork.Branch.create(ctx, 0, GREEDY)
        other.prefill_sync([5, 6])  # needs a lease: the child is parked, its parent active
        own = own_cells_bytes(model, 64)
        parked = ctx.stats()["parked_bytes"]
        assert not child.is_active and parent.is_active
        assert own <= parked <= 1.2 * own, (parked, own)


def test_prune_keep_children_and_reseed_of_an_anchor_keep_parked_children_exact(
    model: kvfork.Model,
) -> None:
    def run(ctx: kvfork.Context) -> list[tuple[list[int], list[float]]]:
        root = kvfork.Branch.create(ctx, 0, GREEDY)
        root.prefill_sync(ctx.tokenize(PROMPT))
        mid = root.fork_sync()
        mid.prefill_sync(ctx.tokenize(" and the", add_special=False))
        kids = [mid.fork_sync() for _ in range(3)]
        # Each kid takes one of the three best tokens: its margin, how clear that token is of
        # its neighbours (as tree_search counts it).
        firsts = []
        for k, kid in enumerate(kids):
            token = kid.top_logprobs(3)[k][0]
            firsts.append(([token], [gaps(kid, k + 1)]))
            kid.commit_sync(token)
        mid.prune_sync(keep_children=True)
        root.reseed_context_sync(ctx.tokenize("Hello"), 0)
        greedy_tokens(root, 3)
        out = []
        for (first, gap), kid in zip(firsts, kids, strict=True):
            tokens, margins = greedy_with_margins(kid, 6)
            out.append((first + tokens, gap + margins))
        return out

    with open_ctx(model, 8, park=False) as wide:
        expected = run(wide)
    with open_ctx(model, 1, park=True) as narrow:
        got = run(narrow)
    for (tokens, _), (want, margins) in zip(got, expected, strict=True):
        assert_same_greedy(tokens, want, margins)


def test_retain_only_a_parked_winner(model: kvfork.Model) -> None:
    with open_ctx(model, 2, park=True) as ctx:
        root = kvfork.Branch.create(ctx, 0, GREEDY)
        root.prefill_sync(ctx.tokenize(PROMPT))
        kids = [root.fork_sync() for _ in range(4)]
        for k, kid in enumerate(kids):
            kid.commit_sync(kid.top_logprobs(4)[k][0])
        winner = kids[0]
        assert not winner.is_active
        reference = winner.fork_sync()
        expected = record(reference, 4)
        reference.prune_sync()
        kvfork.BranchStore(ctx).retain_only_sync(winner)
        assert winner.is_active and all(b.disposed for b in [*kids[1:], root])
        assert ctx.stats()["parked_branches"] == 0
        assert_follows(winner, expected)


def test_save_and_load_a_parked_branch(model: kvfork.Model, tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "b.kvb"
    with open_ctx(model, 1, park=True) as ctx:
        a = kvfork.Branch.create(ctx, 0, GREEDY)
        a.prefill_sync(ctx.tokenize(PROMPT))
        b = a.fork_sync()
        b.commit_sync(b.top_logprobs(2)[1][0])
        a.commit_sync(a.sample())
        assert not b.is_active
        b.save_sync(path)
        expected = record(b, 4)
        loaded = kvfork.Branch.load_sync(ctx, path)
        assert_follows(loaded, expected)
        with pytest.raises(kvfork.KvforkError, match="park=True"):
            ctx.save_state_sync(Path(str(tmp_path)) / "ctx.kvs")


def assert_exact_when_parked(
    model: kvfork.Model,
    scenario: Callable[[kvfork.Context], kvfork.Branch],
    steps: int,
    wide: int,
) -> dict[str, Any]:
    """The branch `scenario` leaves goes on, on a park context of 2 leases, as it does on one
    of `wide` (no parking), in lock step for `steps` tokens (`assert_follows`: cells
    overwritten would move its rows far beyond noise). The park context's stats."""
    with open_ctx(model, wide, park=False) as ctx:
        expected = record(scenario(ctx), steps)
    with open_ctx(model, 2, park=True) as ctx:
        assert_follows(scenario(ctx), expected)
        return ctx.stats()


def test_a_window_past_a_parked_childs_prefix_keeps_it_exact(model: kvfork.Model) -> None:
    """Gemma 3 has sliding-window layers (512 positions): once the parent runs a window past
    the prefix it shares with a parked child, llama.cpp may reuse those cells (held by the
    parent alone) for new ones, unless the child's copy was taken first."""

    def scenario(ctx: kvfork.Context) -> kvfork.Branch:
        first = kvfork.Branch.create(ctx, 0, GREEDY)
        first.prefill_sync(list(range(3000, 3010)))  # the lowest cells
        parent = kvfork.Branch.create(ctx, 0, GREEDY)
        parent.prefill_sync(ctx.tokenize(PROMPT * 10))
        child = parent.fork_sync()  # parked on the parent with a 1-lease budget
        parent.prefill_sync(list(range(2000, 2700)))  # a window past the shared prefix
        first.prune_sync()  # llama.cpp's next search for cells starts at the bottom
        parent.prefill_sync(list(range(2700, 2720)))
        return child

    assert_exact_when_parked(model, scenario, 8, wide=3)


def test_a_branch_parked_after_its_anchor_ran_a_window_ahead_keeps_its_prefix(
    model: kvfork.Model,
) -> None:
    """The anchor chosen when a branch is parked (or re-anchored) may already be a window
    past the prefix it shares with the branch: in the sliding-window layers llama.cpp may
    have reused those cells, so the branch keeps its own copy of what it still reads there.
    (Its anchor's later moves are `guard_window`'s, the test above.) Here `f1` forks from
    `late` before `late` runs 600 tokens ahead; `f2` forks from `f1`; bringing `f2` back
    parks `f1`, which re-anchors `f2` on `late`: `f2`'s rows were 6.5 off, its token
    another."""

    def scenario(ctx: kvfork.Context) -> kvfork.Branch:
        prompt = ctx.tokenize("The history of the city begins in the twelfth century, when")
        other = kvfork.Branch.create(ctx, 0, GREEDY)  # takes the second lease
        other.prefill_sync(prompt)
        late = kvfork.Branch.create(ctx, 0, GREEDY)
        late.prefill_sync(prompt)
        f1 = late.fork_sync()  # parked, anchored on late
        late.prefill_sync([1000 + k % 700 for k in range(600)])  # a window past the prompt
        f2 = f1.fork_sync()  # f1 comes back, f2 born parked on it
        late.commit_sync(506)
        f2.commit_sync(506)  # f2 comes back, f1 parked: f2 re-anchored on late
        return f2

    stats = assert_exact_when_parked(model, scenario, 4, wide=4)
    assert stats["parks"] > 0


def test_bad_park_options(model: kvfork.Model) -> None:
    with pytest.raises(ValueError, match="park"):
        kvfork.create_context_sync(model, embeddings=True, park=True)
    for n_seq_max in (256, 300):  # one sequence is the scratch's
        with pytest.raises(ValueError, match=r"n_seq_max.*\[1, 255\]"):
            kvfork.create_context_sync(model, n_seq_max=n_seq_max, park=True)
    with pytest.raises(TypeError):
        kvfork.create_context_sync(model, park="yes")  # type: ignore[arg-type]


def test_logits_of_a_branch_unparked_equal_those_it_had(model: kvfork.Model) -> None:
    with open_ctx(model, 1, park=True) as ctx:
        a = kvfork.Branch.create(ctx, 0, GREEDY)
        a.prefill_sync(ctx.tokenize(PROMPT))
        b = a.fork_sync()
        b.prefill_sync(ctx.tokenize(" in the", add_special=False))
        a.commit_sync(a.sample())  # b parked with 3 own cells
        probe = b.fork_sync()  # b comes back: the probe shares its cells
        probe.commit_sync(17)
        with open_ctx(model, 4, park=False) as ref_ctx:
            r = kvfork.Branch.create(ref_ctx, 0, GREEDY)
            r.prefill_sync(ref_ctx.tokenize(PROMPT))
            r.prefill_sync(ref_ctx.tokenize(" in the", add_special=False))
            r.commit_sync(17)
            # The same decodes, in other cells: equal up to noise (conftest.LOGIT_NOISE).
            assert_close_logits(probe.logits(), r.logits())


def test_a_hole_below_a_branchs_cells_moves_logits_within_a_bound(model: kvfork.Model) -> None:
    """Why parked results are compared margin-aware. No parking at all: the same branch, the
    same cells and contents, only a hole at the bottom of the cache (a pruned branch's 30
    cells) where its next token's cell lands. llama.cpp's attention sums in cell order, so
    the logits move (by up to ~1 on this model), but within conftest.LOGIT_NOISE, and the
    greedy token stays when the reference's margin is clear."""

    def run(hole: bool) -> np.ndarray:
        with open_ctx(model, 4, park=False) as ctx:
            low = kvfork.Branch.create(ctx, 0, GREEDY)
            low.prefill_sync(list(range(1000, 1030)))  # the lowest cells
            b = kvfork.Branch.create(ctx, 0, GREEDY)
            b.prefill_sync(ctx.tokenize(PROMPT))
            if hole:
                low.prune_sync()  # llama.cpp's next search for a cell starts at the bottom
            b.commit_sync(506)
            return b.logits().copy()

    moved, ref = run(True), run(False)
    noise = float(np.abs(moved - ref).max())
    print(f"cell-order noise: max |logit difference| = {noise:.3f}")
    assert margin(ref) >= NEAR_TIE  # a clear argmax, which cell-order noise cannot move
    assert_close_logits(moved, ref)


def test_raw_layer_calls_that_name_sequences_are_refused(model: kvfork.Model) -> None:
    """The parking ledger owns a park=True context's sequences; snapshots and prefills of a
    parked branch bring it back first."""
    with open_ctx(model, 1, park=True) as ctx:
        a = kvfork.Branch.create(ctx, 0, GREEDY)
        a.prefill_sync(ctx.tokenize(PROMPT))
        b = a.fork_sync()
        assert not b.is_active
        with pytest.raises(Exception, match="park=True"):
            ctx.decode_sync(ctx.tokenize(PROMPT), 0, 0)
        with pytest.raises(Exception, match="park=True"):
            b.fork_sync(seq_id=0)
        with pytest.raises(Exception, match="park=True"):
            b.destroy()
        refused = "Branch.create with a position > 0 or a seq_id"  # as Python spells it
        with pytest.raises(Exception, match=refused):
            kvfork.Branch.create(ctx, 0, GREEDY, seq_id=0)
        with pytest.raises(Exception, match=refused):
            kvfork.Branch.create(ctx, 3, GREEDY)
        data = b.snapshot_sync()
        assert b.is_active and not a.is_active
        c = kvfork.Branch.restore_sync(ctx, data)
        assert c.position == b.position
        b.decode_and_capture_one_sync(17)
        assert b.is_active and b.position == c.position + 1  # a one-token prefill
