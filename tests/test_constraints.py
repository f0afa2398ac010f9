"""llguidance constraints: `set_json_schema`, `set_regex`, `set_lark`. Valid output under
sampling, exact greedy (no better legal token skipped), fork, save/load, rollback, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kvfork
import pytest

from .conftest import GREEDY, PROMPT, assert_follows, record, root
from .conftest import PERSON_SCHEMA as SCHEMA


def run(b: kvfork.Branch, max_tokens: int = 80) -> str:
    return "".join(t.text for t in b.generate_sync(max_tokens))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates_under_sampling(ctx: kvfork.Context, seed: int) -> None:
    b = root(ctx, "A person as JSON:", {"temperature": 1.0, "seed": seed})
    b.set_json_schema(SCHEMA)
    jsonschema.validate(json.loads(run(b)), SCHEMA)


def test_json_schema_as_text_and_greedy(ctx: kvfork.Context) -> None:
    b = root(ctx, "A person as JSON:", GREEDY)
    b.set_json_schema(json.dumps(SCHEMA))
    jsonschema.validate(json.loads(run(b)), SCHEMA)


def test_greedy_never_skips_a_better_legal_token(ctx: kvfork.Context) -> None:
    # Greedy under a constraint must pick the best raw token the constraint allows: every
    # token the model ranks higher must be refused (tried by accepting it on a fork).
    b = root(ctx, "A person as JSON:", GREEDY)
    b.set_json_schema(SCHEMA)
    for _ in range(12):
        chosen = b.produce_sync().token
        for token, _ in b.top_logprobs(8):
            if token == chosen:
                break
            probe = b.fork_sync()
            with pytest.raises(kvfork.GrammarError):
                probe.accept(token)
            probe.prune_sync()
        b.commit_sync(chosen)


def test_walk_of_the_best_tokens_equals_the_whole_allowed_set(ctx: kvfork.Context) -> None:
    # A top_k chain tries the best tokens one by one; a huge top_n_sigma keeps every token and
    # so samples from the constraint's whole allowed set. The draws must be the same.
    # (Each branch pruned before the next prefills in its cells: the same rows, bit for bit.)
    outs = []
    for extra in ({}, {"top_n_sigma": 1e6}):
        b = root(ctx, "A person as JSON:", {"temperature": 0.9, "top_k": 40, "seed": 3, **extra})
        b.set_json_schema(SCHEMA)
        outs.append(([t.token for t in b.generate_sync(30)], b.sampling_perplexity))
        b.prune_sync()
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == pytest.approx(outs[1][1], rel=1e-4)


def test_json_whitespace_is_bounded_unless_the_schema_says(ctx: kvfork.Context) -> None:
    for seed in (1, 2):
        b = root(ctx, "A person as JSON:", {"temperature": 1.2, "seed": seed})
        b.set_json_schema(SCHEMA)
        text = run(b, 120)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not re.search(r"\n\n\n| {21}", text)  # a space, or 1-2 newlines and an indent
    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    b = root(ctx, "A person as JSON:", {"temperature": 1.0, "seed": 3})
    b.set_json_schema(compact)
    text = run(b, 120)
    assert text == json.dumps(json.loads(text), separators=(",", ":"))


def test_regex_and_lark(ctx: kvfork.Context) -> None:
    b = root(ctx, "A phone number:", {"temperature": 0.8, "seed": 5})
    b.set_regex(r" [0-9]{3}-[0-9]{4}")
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", run(b, 20))
    b = root(ctx, "Is the sky blue? Answer:", GREEDY)
    b.set_lark('start: " yes" | " no"')
    assert run(b, 8) in (" yes", " no")


def test_forks_carry_the_parse_state(ctx: kvfork.Context) -> None:
    base = root(ctx, "A person as JSON:", {"temperature": 0.9, "seed": 1})
    base.set_json_schema(SCHEMA)
    head = "".join(t.text for t in base.generate_sync(4))
    for seed in (1, 2, 3):
        kid = base.fork_sync(seed=seed)
        jsonschema.validate(json.loads(head + run(kid)), SCHEMA)
    jsonschema.validate(json.loads(head + run(base)), SCHEMA)


def test_refused_token_raises_and_the_branch_goes_on(ctx: kvfork.Context) -> None:
    b = root(ctx, "A digit:", GREEDY)
    b.set_regex(" [0-9]")
    with pytest.raises(kvfork.GrammarError, match="not allowed"):
        b.commit_sync(ctx.tokenize(" cat", add_special=False)[0])
    assert re.fullmatch(" [0-9]", run(b, 4))
    b.set_grammar(None)
    b.commit_sync(b.sample())  # unconstrained again


def test_failed_decode_rolls_the_parser_back(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=256, n_batch=256, n_seq_max=2) as tiny:
        words = tiny.tokenize(PROMPT * 30)
        a = kvfork.Branch.create(tiny, 0, GREEDY)
        b = kvfork.Branch.create(tiny, 0, GREEDY)
        a.prefill_sync(words[:128])
        b.prefill_sync(words[:128])  # the cache is full
        a.set_regex("7")  # exactly one token, once
        seven = tiny.tokenize("7", add_special=False)[0]
        with pytest.raises(kvfork.KvCacheFullError):
            a.commit_sync(seven)
        b.prune_sync()
        a.commit_sync(seven)  # the parser was rolled back: "7" is legal again
        with pytest.raises(kvfork.GrammarError):
            a.accept(seven)  # and now it is not


def test_save_and_load_mid_document(ctx: kvfork.Context, tmp_path: Path) -> None:
    b = root(ctx, "A person as JSON:", {"temperature": 0.9, "seed": 11})
    b.set_json_schema(SCHEMA)
    for _ in b.generate_sync(5):
        pass
    b.save_sync(tmp_path / "j.kvfork")
    expected = record(b, 30)
    loaded = kvfork.Branch.load_sync(ctx, tmp_path / "j.kvfork")
    # In other cells than b's: b's draws from b's rows (the parser's state restored), its own
    # rows equal up to noise.
    assert_follows(loaded, expected)


def test_bad_constraints_raise(ctx: kvfork.Context) -> None:
    b = root(ctx)
    with pytest.raises(kvfork.GrammarError, match="not valid JSON"):
        b.set_json_schema("{not json")
    with pytest.raises(kvfork.GrammarError, match="JSON schema"):
        b.set_json_schema({"type": "no-such-type"})
    with pytest.raises(kvfork.GrammarError, match="regex"):
        b.set_regex("(unclosed")
    with pytest.raises(kvfork.GrammarError, match="Lark"):
        b.set_lark("start: undefined_rule")
    with pytest.raises(TypeError):
        b.set_json_schema(object())  # type: ignore[arg-type]  # the refusal under test
    b.commit_sync(b.sample())  # none of them took the slot
