"""Issue: sampling control — params, grammars, logit bias and steer (per branch, on fork)."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest

import kvfork

from .conftest import root


def run(b: kvfork.Branch, n: int) -> list[int]:
    return [t.token for t in b.generate_sync(n)]


def test_params_are_immutable_comparable_and_validated() -> None:
    p = kvfork.SamplingParams(temperature=0.5, seed=3)
    assert p == kvfork.SamplingParams(temperature=0.5, seed=3) and hash(p) == hash(p.replace())
    assert p.replace(top_k=5).top_k == 5 and p.top_k == 40
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]
    for bad, field in [({"top_k": -1}, "top_k"), ({"top_p": 1.5}, "top_p"), ({"nope": 1}, "nope")]:
        with pytest.raises(ValueError, match=field):
            kvfork.SamplingParams(**bad)


def test_seeded_chain_is_reproducible_and_seeds_diverge(ctx: kvfork.Context) -> None:
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 11}
    assert run(root(ctx, params=params), 20) == run(root(ctx, params=params), 20)
    assert run(root(ctx, params=params), 20) != run(root(ctx, params={**params, "seed": 12}), 20)


def test_top_k_one_is_greedy(ctx: kvfork.Context) -> None:
    greedy = run(root(ctx), 12)
    assert run(root(ctx, params={"temperature": 1.5, "top_k": 1, "seed": 9}), 12) == greedy


def test_repeat_penalty_lowers_repeated_tokens(ctx: kvfork.Context) -> None:
    plain = root(ctx)
    run(plain, 8)
    penal = root(ctx)
    run(penal, 8)
    penal.set_sampler_params({"temperature": 0.0, "repeat_penalty": 5.0, "penalty_last_n": 64})
    assert run(penal, 12) != run(plain, 12)


def test_gbnf_grammar(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0}, grammar='root ::= "{" ws "}" ws\nws ::= [ \\n]?')
    b.prefill_sync(ctx.tokenize("An empty JSON object:"))
    text = "".join(t.text for t in b.generate_sync(8))
    assert text.strip() == "{}" or text.replace(" ", "").replace("\n", "") == "{}"


def test_json_schema_forks_validate(ctx: kvfork.Context) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    }
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


def test_lazy_grammar(ctx: kvfork.Context) -> None:
    b = root(ctx, "Q: name a color.\nA:", params={"temperature": 0.0})
    b.set_grammar_lazy('root ::= "{" [a-z]+ "}"', [" The"])
    free = run(b, 1)
    assert free  # unconstrained before the trigger


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
