"""LoRA adapters and control vectors per branch: what they do to the logits, that a step over
branches with different sets equals each branch decoded alone (one decode per distinct set),
inheritance on fork, and the files and arguments that are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kvfork
import numpy as np
import pytest

from .adapter_files import write_control_vector, write_lora
from .conftest import (
    GREEDY,
    assert_close_logits,
    assert_follows,
    assert_same_greedy,
    greedy_with_margins,
    record,
)

PROMPT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("lora")
    return write_lora(d / "a.gguf", seed=1), write_lora(d / "b.gguf", seed=2, layers=(3, 4))


def prefilled(ctx: kvfork.Context, setup: object = None) -> kvfork.Branch:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    if callable(setup):
        setup(b)
    b.prefill_sync(ctx.tokenize(PROMPT))
    return b


def logits_with(ctx: kvfork.Context, setup: object = None) -> np.ndarray:
    """The prompt's row under `setup`. The branch is pruned after: the next one prefills in
    its cells, so two calls run the same decode over the same cells (bit for bit, but for
    what the setup changes)."""
    b = prefilled(ctx, setup)
    row = np.array(b.logits())
    b.prune_sync()
    return row


def corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def test_an_adapter_changes_the_logits_more_with_a_larger_scale(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a = model.load_lora(lora_paths[0])
    base = logits_with(ctx)
    changes = []
    for scale in (0.0, 0.25, 0.5, 1.0):
        row = logits_with(ctx, lambda b, s=scale: b.set_adapters({a: s}))
        changes.append(float(np.abs(row - base).max()))
    # Scale 0 is exactly no adapter; the change grows with the scale.
    assert changes[0] == 0.0
    assert 0.0 < changes[1] < changes[2] < changes[3], changes
    # Back to the base model.
    b = prefilled(ctx, lambda b: b.set_adapters({a: 1.0}))
    b.clear_adapters()
    assert b.adapters == {}
    b.prune_sync()
    cleared = logits_with(ctx, lambda b: (b.set_adapters({a: 1.0}), b.clear_adapters()))
    assert np.array_equal(cleared, base)


def test_a_step_over_mixed_sets_equals_each_branch_alone(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a, b = (model.load_lora(p) for p in lora_paths)
    sets = [{}, {a: 1.0}, {b: 1.0}, {a: 0.5, b: 1.0}, {a: 1.0}]
    alone = []
    for s in sets:
        br = prefilled(ctx, lambda x, s=s: x.set_adapters(s))
        alone.append(greedy_with_margins(br, STEPS))
        br.prune_sync()
    # The reference runs differ: the adapters do something to the tokens.
    assert len({tuple(t) for t, _ in alone}) >= 3
    branches = [prefilled(ctx, lambda x, s=s: x.set_adapters(s)) for s in sets]
    store = kvfork.BranchStore(ctx)
    before = ctx.stats()["decode_calls"]
    got: list[list[int]] = [[] for _ in sets]
    for _ in range(STEPS):
        for i, tok in enumerate(store.step_sync(branches)):
            got[i].append(tok.token)
    # One decode per distinct set (4: the two {a: 1.0} branches share theirs).
    assert ctx.stats()["decode_calls"] - before == STEPS * 4
    for i, (tokens, margins) in enumerate(alone):
        assert_same_greedy(got[i], tokens, margins)


async def test_concurrent_prefills_with_different_adapters_equal_alone(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a = model.load_lora(lora_paths[0])
    alone = [logits_with(ctx), logits_with(ctx, lambda b: b.set_adapters({a: 1.0}))]
    plain = kvfork.Branch.create(ctx, 0, GREEDY)
    adapted = kvfork.Branch.create(ctx, 0, GREEDY)
    adapted.set_adapters({a: 1.0})
    store = kvfork.BranchStore(ctx)
    tokens = ctx.tokenize(PROMPT)
    await store.prefill([(plain, tokens), (adapted, tokens)])
    for b, ref, other in ((plain, alone[0], alone[1]), (adapted, alone[1], alone[0])):
        # Packed with another branch's tokens: equal up to batching noise (conftest's
        # LOGIT_NOISE), and nearer its own set's row than the other set's (the adapter moves
        # logits by up to ~5, to a correlation of 0.985; noise keeps it above 0.994).
        assert_close_logits(b.logits(), ref)
        assert corr(b.logits(), ref) > corr(b.logits(), other)


def test_a_fork_inherits_the_adapters_and_their_kv(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a = model.load_lora(lora_paths[0])
    parent = prefilled(ctx, lambda b: b.set_adapters({a: 1.0}))
    child = parent.fork_sync()
    assert child.adapters == {a: 1.0}
    assert_follows(child, record(parent, STEPS))  # in its own cells: rows up to noise


def test_a_control_vector_steers_and_zero_does_nothing(
    model: kvfork.Model, ctx: kvfork.Context, tmp_path: Path
) -> None:
    shape = (model.n_layer, model.n_embd)
    zero = model.load_control_vector(np.zeros(shape, dtype=np.float32))
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    cv = model.load_control_vector(rows)
    assert cv.shape == shape
    for wrong in (object(), ["a", "b"]):
        with pytest.raises(TypeError, match="path or an array of numbers, not"):
            model.load_control_vector(wrong)  # type: ignore[arg-type]
    base = logits_with(ctx)
    assert np.array_equal(logits_with(ctx, lambda b: b.set_control_vector(zero)), base)
    small = logits_with(ctx, lambda b: b.set_control_vector(cv, 0.5))
    large = logits_with(ctx, lambda b: b.set_control_vector(cv, 2.0))
    d_small, d_large = (float(np.abs(x - base).max()) for x in (small, large))
    assert 0.0 < d_small < d_large
    # Only some layers: a different, smaller change than all of them.
    some = logits_with(ctx, lambda b: b.set_control_vector(cv, 2.0, layers=(4, 8)))
    assert float(np.abs(some - base).max()) > 0.0
    assert not np.array_equal(some, large)
    # The same vector from llama.cpp's file format.
    loaded = model.load_control_vector(write_control_vector(tmp_path / "cv.gguf", rows))
    assert np.array_equal(loaded.to_numpy(), rows)
    assert np.array_equal(logits_with(ctx, lambda b: b.set_control_vector(loaded, 2.0)), large)
    # None removes it.
    b = prefilled(ctx, lambda b: b.set_control_vector(cv, 2.0))
    b.set_control_vector(None)
    b.prune_sync()
    removed = logits_with(
        ctx, lambda b: (b.set_control_vector(cv, 2.0), b.set_control_vector(None))
    )
    assert np.array_equal(removed, base)


def test_a_step_mixing_control_vectors_and_adapters_equals_alone(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a = model.load_lora(lora_paths[0])
    rows = (np.random.default_rng(4).standard_normal((model.n_layer, model.n_embd)) * 0.5).astype(
        np.float32
    )
    cv = model.load_control_vector(rows)

    def steer(b: kvfork.Branch) -> None:
        b.set_control_vector(cv, 1.5)

    def both(b: kvfork.Branch) -> None:
        b.set_adapters({a: 1.0})
        b.set_control_vector(cv, 1.5)

    setups = [None, steer, both]
    alone = []
    for s in setups:
        br = prefilled(ctx, s)
        alone.append(greedy_with_margins(br, STEPS))
        br.prune_sync()
    branches = [prefilled(ctx, s) for s in setups]
    store = kvfork.BranchStore(ctx)
    got: list[list[int]] = [[] for _ in setups]
    for _ in range(STEPS):
        for i, tok in enumerate(store.step_sync(branches)):
            got[i].append(tok.token)
    for i, (tokens, margins) in enumerate(alone):
        assert_same_greedy(got[i], tokens, margins)


def test_bad_adapter_files_raise_model_load_error(
    model: kvfork.Model, lora_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    wrong_arch = write_lora(tmp_path / "llama.gguf", arch="llama")
    wrong_shape = write_lora(tmp_path / "shape.gguf", shapes={"attn_q": (600, 1024)})
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(lora_paths[0].read_bytes()[:5000])
    cut_data = tmp_path / "cut_data.gguf"
    whole = lora_paths[0].read_bytes()
    cut_data.write_bytes(whole[: len(whole) - 1000])
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    for path, words in [
        (wrong_arch, "architecture"),
        (wrong_shape, "refused"),
        (truncated, "readable|truncated"),
        (cut_data, "truncated"),
        (not_gguf, "GGUF"),
        (kvfork.default_model_path(), "not a LoRA"),
        (tmp_path / "missing.gguf", "No such file"),
    ]:
        with pytest.raises(kvfork.ModelLoadError, match=words):
            model.load_lora(path)


def test_bad_arguments_are_refused(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    a = model.load_lora(lora_paths[0])
    with pytest.raises(TypeError):
        b.set_adapters([a])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        b.set_adapters({"a.gguf": 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="scale"):
        b.set_adapters({a: float("nan")})
    other = kvfork.Model.load(kvfork.default_model_path())
    with pytest.raises(ValueError, match="another model"):
        b.set_adapters({other.load_lora(lora_paths[0]): 1.0})
    shape = (model.n_layer, model.n_embd)
    with pytest.raises(ValueError, match="shape"):
        model.load_control_vector(np.zeros((3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="finite"):
        model.load_control_vector(np.full(shape, np.inf, dtype=np.float32))
    cv = model.load_control_vector(np.zeros(shape, dtype=np.float32))
    for layers in [(5, 5), (8, 2), (0, model.n_layer + 1), (-1, 3), (0, 2**33)]:
        with pytest.raises(ValueError, match="layers"):
            b.set_control_vector(cv, 1.0, layers=layers)
    with pytest.raises(kvfork.ModelLoadError):
        model.load_control_vector(lora_paths[0])  # a LoRA is not a control vector
    with pytest.raises(kvfork.ModelLoadError, match="No such file"):
        model.load_control_vector(tmp_path / "missing.gguf")
    b.prune_sync()


async def test_the_prefix_cache_shares_only_under_the_same_adapters(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    a = model.load_lora(lora_paths[0])
    cache = kvfork.PrefixCache(ctx)
    doc = ctx.tokenize("A long shared document about rivers and bridges. " * 8)
    q1 = ctx.tokenize(" First?", add_special=False)
    q2 = ctx.tokenize(" Second?", add_special=False)
    plain = await cache.branch(doc + q1, GREEDY)
    adapted = await cache.branch(doc + q2, GREEDY, adapters={a: 1.0})
    # The plain branch's KV is not what the adapted branch would compute: nothing shared.
    assert cache.shared_tokens(adapted) == 0
    assert adapted.adapters == {a: 1.0}
    again = await cache.branch(doc + q1, GREEDY, adapters={a: 1.0})
    assert cache.shared_tokens(again) == len(doc)
    # Its logits are those of a branch prefilled from scratch under the adapter (up to
    # batching noise, conftest.LOGIT_NOISE), nearer them than the plain branch's (the
    # adapter's own effect).
    fresh = kvfork.Branch.create(ctx, 0, GREEDY)
    fresh.set_adapters({a: 1.0})
    await fresh.prefill(doc + q1)
    ref = np.array(fresh.logits())
    assert_close_logits(again.logits(), ref)
    assert corr(again.logits(), ref) > corr(plain.logits(), ref)
    plain_again = await cache.branch(doc + q2, GREEDY)
    assert cache.shared_tokens(plain_again) == len(doc)
    # A branch whose adapters changed after it was made is not kept as an entry.
    plain.set_adapters({a: 1.0})
    entries = cache.stats()["entries"]
    cache.release(plain)
    assert cache.stats()["entries"] == entries
    for b in (adapted, again, plain_again):
        cache.release(b)
    await fresh.prune()
    with pytest.raises(TypeError):
        await cache.branch(q1, GREEDY, adapters=[a])  # type: ignore[arg-type]


async def test_the_prefix_cache_never_shares_kv_decoded_under_other_adapters(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path]
) -> None:
    """A plain branch of the cache that decoded under an adapter, or a control vector, since
    it was made holds KV a plain request must not read: not shared while it lives, and not
    kept when handed back, even with its set changed back (its KV stays mixed)."""
    a = model.load_lora(lora_paths[0])
    vector = model.load_control_vector(
        (np.random.default_rng(1).standard_normal((model.n_layer, model.n_embd)) * 2).astype(
            np.float32
        )
    )
    doc = ctx.tokenize("A long shared document about rivers and bridges. " * 8)
    question = ctx.tokenize(" Second?", add_special=False)
    changes: list[Callable[[kvfork.Branch], None]] = [
        lambda b: b.set_adapters({a: 2.0}),
        lambda b: b.set_control_vector(vector, 1.0),
    ]
    for change in changes:
        cache = kvfork.PrefixCache(ctx)
        live = await cache.branch(doc[:20], GREEDY)
        change(live)
        await live.prefill(doc[20:])  # under the change
        plain = await cache.branch(doc + question, GREEDY)
        assert cache.shared_tokens(plain) == 0  # none of it: the live branch's KV is mixed
        live.clear_adapters()  # back to plain: its KV is still mixed
        cache.release(live)
        again = await cache.branch(doc + question, GREEDY)
        assert cache.shared_tokens(again) == len(doc) + len(question) - 1  # plain's, not live's
        for b in (plain, again):
            cache.release(b)
        cache.clear()


def test_a_saved_branch_keeps_its_adapters(
    model: kvfork.Model, ctx: kvfork.Context, lora_paths: tuple[Path, Path], tmp_path: Path
) -> None:
    a = model.load_lora(lora_paths[0])
    assert model.load_lora(lora_paths[0]) == a  # the same file: the same adapter
    rows = (np.random.default_rng(5).standard_normal((model.n_layer, model.n_embd)) * 0.5).astype(
        np.float32
    )
    cv = model.load_control_vector(rows)

    def setup(b: kvfork.Branch) -> None:
        b.set_adapters({a: 0.75})
        b.set_control_vector(cv, 1.5, layers=(2, 10))

    b = prefilled(ctx, setup)
    b.save_sync(tmp_path / "b.kvfork")
    data = b.snapshot_sync()
    expected = record(b, STEPS)
    for restored in (
        kvfork.Branch.load_sync(ctx, tmp_path / "b.kvfork"),
        kvfork.Branch.restore_sync(ctx, data),
    ):
        assert restored.adapters == {a: 0.75}
        assert_follows(restored, expected)  # in other cells: rows up to noise
        restored.prune_sync()
    # The adapter file changed since: the load says so.
    write_lora(tmp_path / "changed.gguf", seed=9)
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(lora_paths[0].read_bytes())
    c = prefilled(ctx, lambda x: x.set_adapters({model.load_lora(moved): 1.0}))
    c.save_sync(tmp_path / "c.kvfork")
    moved.write_bytes((tmp_path / "changed.gguf").read_bytes())
    with pytest.raises(kvfork.StateFileError, match="changed"):
        kvfork.Branch.load_sync(ctx, tmp_path / "c.kvfork")
    moved.unlink()
    with pytest.raises(kvfork.StateFileError, match="cannot be loaded"):
        kvfork.Branch.load_sync(ctx, tmp_path / "c.kvfork")
