"""Persistence: `Branch.save` / `load` and `Context.save_state` / `load_state` restore
branches exactly (sampler state, grammar, tree, history), refuse bad files without crashing,
and have async twins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kvfork
import numpy as np
import pytest

from .conftest import PROMPT, assert_follows, record, root

SEEDED = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.0, "seed": 7}


def tokens(b: kvfork.Branch, n: int) -> list[int]:
    return [t.token for t in b.generate_sync(n)]


def metrics(b: kvfork.Branch) -> tuple[object, ...]:
    return (b.position, b.perplexity, b.sampling_perplexity, b.params)


@pytest.mark.parametrize(
    "params",
    [
        SEEDED,
        {**SEEDED, "repeat_penalty": 1.3, "dry_multiplier": 0.8, "xtc_probability": 0.5},
        {"temperature": 0.9, "mirostat": 2, "mirostat_tau": 4.0, "seed": 3},
        {"temperature": 0.9, "mirostat": 1, "mirostat_tau": 4.0, "seed": 3},
        {"temperature": 0.0},
    ],
    ids=["seeded", "penalties_dry_xtc", "mirostat2", "mirostat1", "greedy"],
)
def test_a_loaded_branch_continues_exactly_as_the_saved_one(
    ctx: kvfork.Context, model: kvfork.Model, tmp_path: Path, params: dict[str, object]
) -> None:
    b = root(ctx, PROMPT, params)
    tokens(b, 12)  # RNG, penalty window, Mirostat mu and perplexities all moved
    b.set_logit_bias({ctx.tokenize(" the", add_special=False)[0]: -2.0})
    b.steer({ctx.tokenize(" a", add_special=False)[0]: 1.5})
    b.save_sync(tmp_path / "b.kvfork")
    before, snapshot = metrics(b), b.logits()
    expected = record(b, 24)

    same = kvfork.Branch.load_sync(ctx, tmp_path / "b.kvfork")
    assert metrics(same) == before and same.parent is None and same.fork_head == 0
    assert np.array_equal(same.logits(), snapshot)  # the saved row itself
    # In other cells than b's (b is still there): its rows are b's up to noise, and drawing
    # from b's rows its sampler draws b's tokens (RNG, penalties, Mirostat, bias, steer).
    assert_follows(same, expected)

    # Into another context of the same model, with other sizes: as the first branch there it
    # has b's cells, and goes on with b's very decodes.
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2) as other:
        moved = kvfork.Branch.load_sync(other, str(tmp_path / "b.kvfork"))
        assert metrics(moved) == before
        assert tokens(moved, 24) == expected.tokens


def test_grammar_state_is_restored_mid_document(ctx: kvfork.Context, tmp_path: Path) -> None:
    b = root(ctx, "A JSON object describing a cat:", {**SEEDED, "seed": 11})
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    b.set_grammar(kvfork.json_schema_to_grammar(schema))
    tokens(b, 4)  # inside the object
    b.save_sync(tmp_path / "g.kvfork")
    expected = record(b, 20)
    loaded = kvfork.Branch.load_sync(ctx, tmp_path / "g.kvfork")
    assert_follows(loaded, expected)  # in other cells: b's draws from b's rows


def test_context_state_restores_the_branch_tree(model: kvfork.Model, tmp_path: Path) -> None:
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=4) as ctx:
        trunk = root(ctx, PROMPT, SEEDED)
        tokens(trunk, 5)
        kids = [trunk.fork_sync(seed=s) for s in (1, 2)]
        grandchild = kids[1].fork_sync(seed=9)
        ctx.save_state_sync(tmp_path / "ctx.kvfork")
        family = [trunk, *kids, grandchild]
        heads = [b.fork_head for b in family]
        expected = [(metrics(b), record(b, 10)) for b in family]
        with pytest.raises(kvfork.KvforkError, match="without live branches"):
            ctx.load_state_sync(tmp_path / "ctx.kvfork")
        trunk.prune_subtree_sync()

        restored = ctx.load_state_sync(tmp_path / "ctx.kvfork")
        assert len(restored) == 4 and kvfork.BranchStore(ctx).available == 0
        r_trunk, r_kid1, r_kid2, r_grand = restored
        assert r_trunk.parent is None and r_trunk.children == [r_kid1, r_kid2]
        assert r_grand.parent == r_kid2 and [b.fork_head for b in restored] == heads
        # Restored where the tree was (the cells it had), after other decodes since: b's draws
        # from b's rows, its own rows equal up to noise.
        for b, (before, reference) in zip(restored, expected, strict=True):
            assert metrics(b) == before
            assert_follows(b, reference)


def test_bad_files_raise_and_never_crash(
    ctx: kvfork.Context, chat_ctx: kvfork.Context, tmp_path: Path
) -> None:
    b = root(ctx)
    tokens(b, 3)
    good = tmp_path / "good.kvfork"
    b.save_sync(good)
    data = good.read_bytes()
    rng = np.random.default_rng(0)

    def load(blob: bytes, into: kvfork.Context = ctx) -> kvfork.Branch:
        p = tmp_path / "bad.kvfork"
        p.write_bytes(blob)
        return kvfork.Branch.load_sync(into, p)

    for cut in [0, 4, 8, 40, 41, 200, len(data) // 2, len(data) - 1]:
        with pytest.raises(kvfork.StateFileError):
            load(data[:cut])
    for i in rng.integers(0, len(data), 40):
        flipped = bytearray(data)
        flipped[i] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(kvfork.StateFileError):
            load(bytes(flipped))
    with pytest.raises(kvfork.StateFileError, match="not a kvfork state file"):
        load(kvfork.default_model_path().read_bytes()[:4096])
    with pytest.raises(kvfork.StateFileError, match="not a kvfork"):
        load(rng.bytes(5000))
    with pytest.raises(kvfork.StateFileError, match="different model"):
        load(data, into=chat_ctx)
    ctx.save_state_sync(tmp_path / "ctx.kvfork")
    with pytest.raises(kvfork.StateFileError, match="holds a context"):
        kvfork.Branch.load_sync(ctx, tmp_path / "ctx.kvfork")
    with pytest.raises(FileNotFoundError):
        kvfork.Branch.load_sync(ctx, tmp_path / "missing.kvfork")
    with pytest.raises(FileNotFoundError):
        b.save_sync(tmp_path / "no" / "such" / "dir.kvfork")
    assert kvfork.BranchStore(ctx).available == ctx.n_seq_max - 1  # failed loads took no lease
    assert tokens(b, 3)  # the context is fine

    whole = (tmp_path / "ctx.kvfork").read_bytes()
    b.prune_sync()
    for i in rng.integers(0, len(whole), 20):
        flipped = bytearray(whole)
        flipped[i] ^= 0xFF
        (tmp_path / "bad_ctx.kvfork").write_bytes(bytes(flipped))
        with pytest.raises(kvfork.StateFileError):
            ctx.load_state_sync(tmp_path / "bad_ctx.kvfork")
    (tmp_path / "bad_ctx.kvfork").write_bytes(whole[:-100])
    with pytest.raises(kvfork.StateFileError, match="truncated"):
        ctx.load_state_sync(tmp_path / "bad_ctx.kvfork")
    with pytest.raises(kvfork.StateFileError, match="holds a branch"):
        ctx.load_state_sync(good)
    assert len(ctx.load_state_sync(tmp_path / "ctx.kvfork")) == 1  # the good file still loads


def test_a_save_through_a_symbolic_link_writes_where_the_link_points(
    ctx: kvfork.Context, tmp_path: Path
) -> None:
    """The link stays a link: its target (made if missing, through a chain of links, relative
    to the link's directory) gets the file; a loop of links is an OSError."""
    b = root(ctx)
    (tmp_path / "dir").mkdir()
    dangling = tmp_path / "dangling.kvfork"
    dangling.symlink_to("dir/state.kvfork")  # relative, to a file not made yet
    chained = tmp_path / "chained.kvfork"
    chained.symlink_to(dangling)
    for link in (dangling, chained):
        b.save_sync(link)
        assert link.is_symlink() and (tmp_path / "dir" / "state.kvfork").is_file()
        loaded = kvfork.Branch.load_sync(ctx, link)
        assert loaded.position == b.position
        loaded.prune_sync()
    ctx.save_state_sync(chained)  # over the file there now
    assert chained.is_symlink() and dangling.is_symlink()
    looped = tmp_path / "looped.kvfork"
    looped.symlink_to(looped)
    with pytest.raises(OSError):
        b.save_sync(looped)
    b.prune_sync()


def test_a_context_state_needing_more_sequences_names_this_context_s_n_seq_max(
    model: kvfork.Model,
) -> None:
    """Sequences above the leases are the engine's own (padding): a file's branch on one of
    them is refused like any sequence past n_seq_max, and the message says the user's count."""
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=3) as source:
        for _ in range(3):
            kvfork.Branch.create(source, 0).prefill_sync([2, 5])
        state = source.snapshot_sync()
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1) as small:
        with pytest.raises(kvfork.StateFileError, match="needs sequence 1: .*n_seq_max = 1$"):
            small.restore_sync(state)
        assert kvfork.BranchStore(small).available == 1
    closed = kvfork.BranchStore(small)
    assert closed.available == 0  # a closed context has no lease to give


def test_a_load_that_llama_cpp_refuses_leaves_nothing_behind(
    ctx: kvfork.Context, model: kvfork.Model, tmp_path: Path
) -> None:
    b = root(ctx)
    tokens(b, 10)
    assert b.position > 16
    b.save_sync(tmp_path / "b.kvfork")
    with kvfork.create_context_sync(model, n_ctx=512, type_k="q8_0", n_seq_max=2) as q8:
        with pytest.raises(kvfork.StateFileError, match="refused"):
            kvfork.Branch.load_sync(q8, tmp_path / "b.kvfork")
        assert kvfork.BranchStore(q8).available == 2
        assert q8.kv_seq_pos_max_sync(0) == -1
    with kvfork.create_context_sync(model, n_ctx=16, n_seq_max=1) as tiny:
        long = kvfork.Branch.create(ctx)
        long.prefill_sync(ctx.tokenize(" word" * tiny.n_ctx))
        long.save_sync(tmp_path / "long.kvfork")
        with pytest.raises(kvfork.StateFileError, match="n_ctx"):
            kvfork.Branch.load_sync(tiny, tmp_path / "long.kvfork")


def test_async_twins(ctx: kvfork.Context, tmp_path: Path) -> None:
    async def main() -> list[int]:
        b = root(ctx, PROMPT, SEEDED)
        await b.save(tmp_path / "a.kvfork")
        loaded = await kvfork.Branch.load(ctx, tmp_path / "a.kvfork")
        await ctx.save_state(tmp_path / "c.kvfork")
        await b.reseed_context(ctx.tokenize("Hello"), 0)
        assert b.position == len(ctx.tokenize("Hello"))
        return [t.token async for t in loaded.generate(5)]

    assert len(asyncio.run(main())) == 5


def test_a_loaded_branch_keeps_its_history_for_prompt_lookup(
    ctx: kvfork.Context, tmp_path: Path
) -> None:
    b = root(ctx, PROMPT)
    tokens(b, 8)
    b.save_sync(tmp_path / "h.kvfork")
    loaded = kvfork.Branch.load_sync(ctx, tmp_path / "h.kvfork")
    assert loaded.history == b.history
    assert len(loaded.history) == loaded.position
    assert kvfork.PromptLookup().propose(loaded.history) == kvfork.PromptLookup().propose(b.history)
