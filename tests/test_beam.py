"""Issue 15: what a beam search needs — log-probabilities computed in Rust, and prune with
keep_children so a dropped beam gives its lease back while its forks live on."""

from __future__ import annotations

import math

import kvfork
import numpy as np
import numpy.typing as npt
import pytest

from .conftest import PROMPT, root


def log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    y = x.astype(np.float64)
    m = y.max()
    out: npt.NDArray[np.float64] = y - (m + np.log(np.exp(y - m).sum()))
    return out


def test_logprob_and_top_logprobs_match_a_log_softmax(ctx: kvfork.Context) -> None:
    b = root(ctx)
    expected = log_softmax(b.logits())
    top = b.top_logprobs(5)
    assert [t for t, _ in top] == list(np.argsort(-expected, kind="stable")[:5])
    for t, lp in top:
        assert lp == pytest.approx(expected[t], abs=1e-6)
        assert b.logprob(t) == pytest.approx(lp, abs=1e-9)
    assert b.logprob(7) == pytest.approx(expected[7], abs=1e-6)
    assert b.logprob(top[0][0]) == pytest.approx(-b.surprisal(top[0][0]))
    assert b.top_logprobs(0) == []
    b.set_logits(np.where(np.arange(ctx.vocab_size) < 3, 0.0, -np.inf).astype(np.float32))
    assert len(b.top_logprobs(10)) == 3 and b.logprob(5) == -math.inf
    with pytest.raises(ValueError, match="k"):
        b.top_logprobs(-1)
    with pytest.raises(kvfork.KvforkError, match="no logits"):
        kvfork.Branch.create(ctx).top_logprobs(3)


def test_prune_keep_children_frees_the_lease_and_keeps_the_children_exact(
    ctx: kvfork.Context,
) -> None:
    trunk = root(ctx)
    middle = trunk.fork_sync()
    middle.commit_sync(middle.produce_sync())
    kids = [middle.fork_sync() for _ in range(2)]
    expected = [k.top_logprobs(3) for k in kids]
    token = kids[1].produce_sync().token
    # A spare fork decodes the next token while `middle` still holds its lease: the reference.
    spare = kids[1].fork_sync()
    spare.commit_sync(token)
    reference = spare.logits()
    spare.prune_sync()
    store = kvfork.BranchStore(ctx)
    free = store.available
    with pytest.raises(kvfork.KvforkError, match="children"):
        middle.prune_sync()
    middle.prune_sync(keep_children=True)
    assert middle.disposed and store.available == free + 1
    assert trunk.children == [*kids] and all(k.parent == trunk for k in kids)
    assert [k.top_logprobs(3) for k in kids] == expected
    # The children's KV survived the prune: the same token decodes to the same logits.
    for k in kids:
        k.commit_sync(token)
        assert np.allclose(k.logits(), reference, atol=1e-3)
    trunk.prune_sync(keep_children=True)
    assert all(k.parent is None for k in kids)
    middle.prune_sync(keep_children=True)  # a second prune is a no-op


def test_width_4_beam_search_over_32_steps_fits_in_5_leases(model: kvfork.Model) -> None:
    width, steps = 4, 32
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=width + 1) as ctx:
        store = kvfork.BranchStore(ctx)
        first = root(ctx, PROMPT)
        beams: list[tuple[float, kvfork.Branch]] = [(0.0, first)]
        for _ in range(steps):
            candidates = [
                (score + lp, beam, token)
                for score, beam in beams
                for token, lp in beam.top_logprobs(width)
            ]
            chosen = sorted(candidates, key=lambda c: -c[0])[:width]
            keep = {id(beam) for _, beam, _ in chosen}
            for _, beam in beams:
                if id(beam) not in keep:
                    beam.prune_sync(keep_children=True)  # its forks may still be beams
            used: set[int] = set()
            moves = []
            for score, beam, token in chosen:
                target = beam if id(beam) not in used else beam.fork_sync()
                used.add(id(beam))
                moves.append((score, target, token))
            store.commit_sync([(b, t) for _, b, t in moves])  # all beams, one decode
            beams = [(s, b) for s, b, _ in moves]
            assert store.available >= 1
        assert len(beams) == width
        scores = [s for s, _ in beams]
        assert all(math.isfinite(s) for s in scores)
        best = max(beams, key=lambda sb: sb[0])[1]
        assert best.position == len(ctx.tokenize(PROMPT)) + steps
