"""Sampler chains: SamplingParams (immutable, validated, picklable), seeds, what each field
does, logit bias and steer (per branch, on fork), and one random stream through
`set_sampler_params`."""

from __future__ import annotations

import math
from typing import Any

import kvfork
import numpy as np
import pytest

from .conftest import PROMPT, root


def run(b: kvfork.Branch, n: int) -> list[int]:
    return [t.token for t in b.generate_sync(n)]


def test_params_are_immutable_comparable_and_validated() -> None:
    p = kvfork.SamplingParams(temperature=0.5, seed=3)
    assert p == kvfork.SamplingParams(temperature=0.5, seed=3) and hash(p) == hash(p.replace())
    assert p.replace(top_k=5).top_k == 5 and p.top_k == 40
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"nope": 1}, "nope"),
    ]
    for bad, field in cases:
        with pytest.raises(ValueError, match=field):
            kvfork.SamplingParams(**bad)


def test_seeded_chain_is_reproducible_and_seeds_diverge(ctx: kvfork.Context) -> None:
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 11}
    # Each run pruned before the next prefills where it was: the same decodes, bit for bit.
    assert generate(ctx, params, 20) == generate(ctx, params, 20)
    assert generate(ctx, params, 20) != generate(ctx, {**params, "seed": 12}, 20)


# A chain hot enough to wander off the greedy path, and one cold enough to stay on it.
HOT: dict[str, Any] = {"temperature": 3.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
COLD = {"temperature": 0.05, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
REPETITIVE = "one two three four one two three four one two three four one two three"


def generate(
    ctx: kvfork.Context, params: dict[str, Any], n: int = 16, prompt: str = PROMPT
) -> list[int]:
    """`n` tokens of a new branch, pruned after: alone in the context, the next one's prefill
    lands in its cells, so runs compare bit for bit (the same decodes over the same cells)."""
    b = root(ctx, prompt, params=params)
    out = run(b, n)
    b.prune_sync()
    return out


@pytest.mark.parametrize(
    "field",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"top_n_sigma": 1e-4},
        {"mirostat": 1, "mirostat_tau": 1e-3},
        {"mirostat": 2, "mirostat_tau": 1e-3},
    ],
    ids=lambda f: next(iter(f)) + (str(f["mirostat"]) if "mirostat" in f else ""),
)
def test_truncating_field_collapses_a_hot_chain_to_greedy(
    ctx: kvfork.Context, field: dict[str, object]
) -> None:
    greedy = generate(ctx, {"temperature": 0.0})
    assert generate(ctx, HOT) != greedy
    assert generate(ctx, {**HOT, **field}) == greedy


@pytest.mark.parametrize(
    "field",
    [{"xtc_probability": 1.0, "xtc_threshold": 0.05}, {"typical_p": 0.05}],
    ids=["xtc", "typical_p"],
)
def test_field_moves_a_cold_chain_off_the_greedy_path(
    ctx: kvfork.Context, field: dict[str, object]
) -> None:
    greedy = generate(ctx, {"temperature": 0.0})
    assert generate(ctx, COLD) == greedy
    assert generate(ctx, {**COLD, **field}) != greedy


@pytest.mark.parametrize(
    ("field", "prompt"),
    [
        ({"repeat_penalty": 5.0}, PROMPT),
        ({"presence_penalty": 2.0}, PROMPT),
        ({"frequency_penalty": 2.0}, PROMPT),
        ({"dry_multiplier": 2.0}, REPETITIVE),
        ({"dry_multiplier": 2.0, "dry_penalty_last_n": 64}, REPETITIVE),
    ],
    ids=["repeat", "presence", "frequency", "dry_whole_context", "dry_last_64"],
)
def test_penalty_field_changes_greedy_output(
    ctx: kvfork.Context, field: dict[str, object], prompt: str
) -> None:
    greedy = generate(ctx, {"temperature": 0.0}, 24, prompt)
    assert generate(ctx, {"temperature": 0.0, **field}, 24, prompt) != greedy
    disabled = {**field, "penalty_last_n": 0, "dry_penalty_last_n": 0}
    assert generate(ctx, {"temperature": 0.0, **disabled}, 24, prompt) == greedy


@pytest.mark.parametrize(
    "field",
    [
        {"temperature": 1e-38, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 1e-40},
        {"temperature": 0.8, "top_k": 0, "repeat_penalty": 1e-38},
        {"temperature": 0.8, "top_k": 0, "presence_penalty": -3e38},
    ],
    ids=["tiny_temperature_untruncated", "tiny_temperature", "repeat", "presence"],
)
def test_values_that_overflow_the_logits_still_draw_a_likely_token(
    ctx: kvfork.Context, field: dict[str, object]
) -> None:
    """A temperature so small, or a penalty so large, that the logits overflow `f32`: the
    draw takes the best (or the pushed-up) tokens, as the limit would, not a token of
    probability 0 (the stop token here) or an error that every token is masked."""
    greedy = generate(ctx, {"temperature": 0.0}, 4)
    got = generate(ctx, {**field, "seed": 3}, 4)
    if "temperature" in field and float(field["temperature"]) < 1e-30:  # type: ignore[arg-type]
        assert got == greedy
    else:
        assert len(got) == 4  # no stop token of probability 0, no error


def test_steer_and_bias(ctx: kvfork.Context) -> None:
    b = root(ctx)
    top = int(np.argmax(b.logits()))
    b.steer({top: -math.inf})
    assert b.produce_sync().token != top
    kid = b.fork_sync()
    assert kid.produce_sync().token == top  # steer is not inherited
    b.clear_steer()
    assert b.produce_sync().token == top
    b.set_logit_bias({top: -math.inf})
    assert b.fork_sync().produce_sync().token != top  # logit bias is inherited
    b.clear_logit_bias()
    fresh = root(ctx)  # in other cells: its own argmax (its row is b's up to noise)
    assert fresh.produce_sync().token == int(np.argmax(fresh.logits()))  # it has neither


def test_params_and_tokens_pickle() -> None:
    """Ray jobs take SamplingParams and return Tokens: both survive a pickle round trip."""
    import pickle

    params = kvfork.SamplingParams(temperature=0.3, top_p=0.9, seed=5, dry_multiplier=0.8)
    again = pickle.loads(pickle.dumps(params))
    assert again == params and again.seed == 5
    token = kvfork.Token(7, "x", True)
    assert pickle.loads(pickle.dumps(token)) == token


# A seeded stochastic chain: set_sampler_params must carry its random stream on.
SEEDED = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.0, "seed": 7}


def test_set_sampler_params_carries_the_rng_stream_on(ctx: kvfork.Context) -> None:
    """Rebuilding the chain every step (here: toggling a field that changes nothing) draws
    like one unbroken stream; a new seed in the params starts a new one. (Each branch pruned
    before the next prefills in its cells: the same rows bit for bit.)"""
    expected = generate(ctx, SEEDED, 20)
    toggled = root(ctx, PROMPT, SEEDED)
    got = []
    for i in range(20):
        toggled.set_sampler_params({**SEEDED, "penalty_last_n": 64 + i % 2})
        t = toggled.produce_sync()
        toggled.commit_sync(t)
        got.append(t.token)
    assert got == expected
    toggled.prune_sync()
    reseeded = root(ctx, PROMPT, SEEDED)
    reseeded.set_sampler_params({**SEEDED, "seed": 8})
    assert run(reseeded, 20) != expected


def test_equal_params_each_step_draw_like_never_resetting(ctx: kvfork.Context) -> None:
    params = {**SEEDED, "repeat_penalty": 1.3, "penalty_last_n": -1, "dry_multiplier": 0.5}
    expected = generate(ctx, params, 30)  # pruned: b prefills in its cells, bit for bit
    b = root(ctx, PROMPT, params)
    got = []
    for i in range(30):
        b.set_sampler_params(params)
        # A whole-context window (-1) and a window longer than the history are the same
        # filter: rebuilding between them each step must replay the penalty and DRY history.
        b.set_sampler_params({**params, "penalty_last_n": -1 if i % 2 else 10_000})
        t = b.produce_sync()
        b.commit_sync(t)
        got.append(t.token)
    assert got == expected


def test_tiny_temperature_changes_keep_the_random_stream(ctx: kvfork.Context) -> None:
    """Entropy-driven temperature sets new params every step: the draws must go on along
    one random stream, not restart it (a restarted stream repeats the same quantile)."""
    draws = 300
    constant = root(ctx, "My favourite word is", {**SEEDED, "temperature": 1.5})
    steady = [constant.sample() for _ in range(draws)]
    constant.prune_sync()  # wobbly prefills in its cells: the same row, bit for bit
    wobbly = root(ctx, "My favourite word is", {**SEEDED, "temperature": 1.5})
    moved = []
    for i in range(draws):
        wobbly.set_sampler_params({**SEEDED, "temperature": 1.5 + 1e-4 * (i % 7)})
        moved.append(wobbly.sample())
    assert len(set(steady)) > 10  # the snapshot spreads its mass: draws differ
    # The same stream: the draws agree almost everywhere (a 1e-4 temperature change moves a
    # draw only when its quantile sits on a boundary between two tokens).
    same = sum(a == b for a, b in zip(steady, moved))
    assert same >= 0.95 * draws, same


def test_a_row_replaced_between_produce_and_commit_keeps_one_xtc_roll_a_step(
    ctx: kvfork.Context,
) -> None:
    """XTC rolls once a step: a commit whose row was replaced after `produce` (the same row
    written back with `set_logits`) filters the candidates again without a second roll, so
    the random stream goes on as without the replacement, and the committed token keeps a
    finite sampling perplexity. (Each branch pruned before the next: the same rows.)"""
    params = {**SEEDED, "xtc_probability": 0.5, "xtc_threshold": 0.05}
    expected = root(ctx, PROMPT, params)
    reference = []
    for _ in range(24):
        t = expected.produce_sync()
        expected.commit_sync(t)
        reference.append(t.token)
    want = expected.sampling_perplexity
    expected.prune_sync()
    b = root(ctx, PROMPT, params)
    got = []
    for _ in range(24):
        t = b.produce_sync()
        b.set_logits(b.logits())  # a new row version: the candidates are filtered again
        b.commit_sync(t)
        got.append(t.token)
    assert got == reference
    assert math.isfinite(b.sampling_perplexity)
    assert b.sampling_perplexity == pytest.approx(want)
