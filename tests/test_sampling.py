"""Issue: sampling control — params, grammars, logit bias and steer (per branch, on fork)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import kvfork
import numpy as np
import pytest

from .conftest import PERSON_SCHEMA, PROMPT, root


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
    assert run(root(ctx, params=params), 20) == run(root(ctx, params=params), 20)
    assert run(root(ctx, params=params), 20) != run(root(ctx, params={**params, "seed": 12}), 20)


# A chain hot enough to wander off the greedy path, and one cold enough to stay on it.
HOT: dict[str, Any] = {"temperature": 3.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
COLD = {"temperature": 0.05, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
REPETITIVE = "one two three four one two three four one two three four one two three"


def generate(
    ctx: kvfork.Context, params: dict[str, Any], n: int = 16, prompt: str = PROMPT
) -> list[int]:
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


def test_gbnf_grammar(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(
        ctx, 0, {"temperature": 0.0}, grammar='root ::= "{" ws "}" ws\nws ::= [ \\n]?'
    )
    b.prefill_sync(ctx.tokenize("An empty JSON object:"))
    text = "".join(t.text for t in b.generate_sync(8))
    assert text.strip() == "{}" or text.replace(" ", "").replace("\n", "") == "{}"


def test_json_schema_forks_validate(ctx: kvfork.Context) -> None:
    schema = PERSON_SCHEMA
    gbnf = kvfork.json_schema_to_grammar(schema)
    base = kvfork.Branch.create(ctx, 0, {"temperature": 0.9, "seed": 1}, grammar=gbnf)
    base.prefill_sync(ctx.tokenize("A person as JSON:"))
    head = "".join(t.text for t in base.generate_sync(3))
    outs = []
    for seed in (1, 2, 3):
        kid = base.fork_sync()
        kid.reseed_sampler(seed)
        outs.append(head + "".join(t.text for t in kid.generate_sync(80)))
    for out in outs:
        jsonschema.validate(json.loads(out), schema)


def test_bad_grammars_raise(ctx: kvfork.Context) -> None:
    for bad in ["root ::= undefined_rule", "root ::= (", "not a grammar", ""]:
        with pytest.raises(kvfork.GrammarError):
            kvfork.Branch.create(ctx, 0, grammar=bad)
    with pytest.raises(kvfork.GrammarError):
        kvfork.json_schema_to_grammar("{not json")
    b = root(ctx)
    b.set_grammar('root ::= "a"')
    with pytest.raises(kvfork.GrammarError):
        b.commit_sync(ctx.tokenize("zzz", add_special=False)[0])
    b.set_grammar(None)
    b.commit_sync(b.sample())


def test_lazy_grammar_is_free_before_the_trigger_and_constrained_after(ctx: kvfork.Context) -> None:
    free = "".join(t.text for t in root(ctx).generate_sync(12))
    assert " invention" in free and not re.search(r" invention[0-9]", free)
    b = root(ctx)
    b.set_grammar_lazy('root ::= " invention" [0-9]+ "!"', [" invention"])
    text = "".join(t.text for t in b.generate_sync(12))
    head, trigger, tail = text.partition(" invention")
    assert trigger and free.startswith(head + trigger)  # unconstrained up to the trigger
    assert re.fullmatch(r"[0-9]+!?", tail), tail  # constrained after it


def test_grammar_without_a_legal_token_raises_on_sample(ctx: kvfork.Context) -> None:
    b = root(ctx)
    b.set_grammar('root ::= "{" [a-z]* "}"')
    b.steer(dict.fromkeys(range(ctx.vocab_size), -math.inf))
    with pytest.raises(kvfork.GrammarError):
        b.sample()
    b.clear_steer()
    assert ctx.token_to_text(b.sample()).startswith("{")


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
    assert root(ctx).produce_sync().token == top  # a fresh branch has neither


def test_grammar_window_equals_full_vocabulary_grammar(ctx: kvfork.Context) -> None:
    # top_k chains check the grammar on a widening window of the best tokens only; a huge
    # top_n_sigma keeps every token but forces the whole-vocabulary path. Same draws.
    gbnf = kvfork.json_schema_to_grammar(
        {"type": "object", "properties": {"name": {"type": "string"}}}
    )
    outs = []
    for extra in ({}, {"top_n_sigma": 1e6}):
        b = kvfork.Branch.create(
            ctx, 0, {"temperature": 0.9, "top_k": 40, "seed": 3, **extra}, grammar=gbnf
        )
        b.prefill_sync(ctx.tokenize("A person as JSON:"))
        outs.append(([t.token for t in b.generate_sync(30)], b.sampling_perplexity))
        b.prune_sync()
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == pytest.approx(outs[1][1], rel=1e-4)


def test_params_and_tokens_pickle() -> None:
    """Ray jobs take SamplingParams and return Tokens: both survive a pickle round trip."""
    import pickle

    params = kvfork.SamplingParams(temperature=0.3, top_p=0.9, seed=5, dry_multiplier=0.8)
    again = pickle.loads(pickle.dumps(params))
    assert again == params and again.seed == 5
    token = kvfork.Token(7, "x", True)
    assert pickle.loads(pickle.dumps(token)) == token
