"""GBNF grammars (`grammar=`, `set_grammar`, `set_grammar_lazy`, `json_schema_to_grammar`):
valid output, on forks too, the same draws through the grammar window as over the whole
vocabulary, and errors that give line, column and reason."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PERSON_SCHEMA, PROMPT, root


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


def test_lazy_grammar_is_free_before_the_trigger_and_constrained_after(ctx: kvfork.Context) -> None:
    unconstrained = root(ctx)
    free = "".join(t.text for t in unconstrained.generate_sync(12))
    assert " invention" in free and not re.search(r" invention[0-9]", free)
    unconstrained.prune_sync()  # b prefills in its cells: the same rows up to the trigger
    b = root(ctx)
    b.set_grammar_lazy('root ::= " invention" [0-9]+ "!"', [" invention"])
    text = "".join(t.text for t in b.generate_sync(12))
    head, trigger, tail = text.partition(" invention")
    assert trigger and free.startswith(head + trigger)  # unconstrained up to the trigger
    assert re.fullmatch(r"[0-9]+!?", tail), tail  # constrained after it


def test_a_lazy_pattern_starts_the_grammar_inside_a_token(ctx: kvfork.Context) -> None:
    # The group starts inside the " invention" token: the grammar reads its piece from there,
    # as llama.cpp's lazy grammars do (kvfork watches the patterns, llama.cpp takes over).
    unconstrained = root(ctx)
    free = "".join(t.text for t in unconstrained.generate_sync(12))
    unconstrained.prune_sync()  # b prefills in its cells: the same rows up to the trigger
    b = root(ctx)
    b.set_grammar_lazy('root ::= "ention" [0-9]+ "!"', [], patterns=[r"[\s\S]*? inv(ention)"])
    text = "".join(t.text for t in b.generate_sync(12))
    head, trigger, tail = text.partition(" invention")
    assert trigger and free.startswith(head + trigger)
    assert re.fullmatch(r"[0-9]+!?", tail), text
    b.prune_sync()


def test_a_token_firing_a_trigger_on_text_the_grammar_refuses_is_never_drawn(
    ctx: kvfork.Context,
) -> None:
    # The pattern fires inside " invention", and the grammar refuses the rest of that token
    # ("vention" where it wants a digit after "ven"). llama.cpp's lazy grammar drew that
    # token again and again, each commit failing: a wedged branch. It is masked instead, as
    # an active grammar masks what it refuses, and the draw goes to the next best token.
    unconstrained = root(ctx)
    free = "".join(t.text for t in unconstrained.generate_sync(12))
    unconstrained.prune_sync()
    head = free.partition(" invention")[0]
    assert head != free
    b = root(ctx)
    b.set_grammar_lazy('root ::= "ven" [0-9]+', [], patterns=[r" in(vention)"])
    text = "".join(t.text for t in b.generate_sync(12))
    b.prune_sync()
    assert text.startswith(head) and " invention" not in text, text


def test_a_lazy_grammar_awaiting_its_trigger_forks_and_restores(ctx: kvfork.Context) -> None:
    (trigger,) = ctx.tokenize(" invention", add_special=False)
    b = root(ctx)
    b.set_grammar_lazy('root ::= " invention" [0-9]+ "!"', [trigger])
    b.commit_sync(b.produce_sync().token)  # still waiting
    saved = b.snapshot_sync()
    kid = b.fork_sync()
    texts = ["".join(t.text for t in x.generate_sync(11)) for x in (b, kid)]
    b.prune_subtree_sync()
    again = kvfork.Branch.restore_sync(ctx, saved)
    texts.append("".join(t.text for t in again.generate_sync(11)))
    again.prune_sync()
    for text in texts:
        _, word, tail = text.partition(" invention")
        assert word and re.fullmatch(r"[0-9]+!?", tail), text


def test_a_lazy_pattern_matching_empty_text_at_the_end_starts_with_the_next_token(
    ctx: kvfork.Context,
) -> None:
    # As llama.cpp's lazy grammars: the first token is free, the rest constrained.
    unconstrained = root(ctx)
    first = unconstrained.produce_sync().text
    unconstrained.prune_sync()
    b = root(ctx)
    b.set_grammar_lazy('root ::= "zzz" [0-9]*', [], patterns=["$"])
    out = [t.text for t in b.generate_sync(4)]
    b.prune_sync()
    assert out[0] == first and "".join(out[1:]).startswith("zzz"), out


def test_a_bad_trigger_pattern_is_refused(ctx: kvfork.Context) -> None:
    # Look-around and back-references too: llama.cpp's matcher, which read them, searched the
    # whole output after every token and crashed (its recursion) past ~5,000 tokens.
    b = kvfork.Branch.create(ctx)
    for bad in ("(unclosed", "[z-a]", "(?=x)", r"(a)\1"):
        with pytest.raises(kvfork.GrammarError, match="bad trigger"):
            b.set_grammar_lazy('root ::= "a"', [], patterns=[bad])
    with pytest.raises(kvfork.GrammarError, match="undefined rule"):
        b.set_grammar_lazy("root ::= nowhere", ["x"])
    with pytest.raises(kvfork.GrammarError, match="an empty word"):
        b.set_grammar_lazy('root ::= "a"', [""])  # it would fire on any first token


def test_grammar_window_equals_full_vocabulary_grammar(ctx: kvfork.Context) -> None:
    # top_k chains check the grammar on a widening window of the best tokens only; a huge
    # top_n_sigma keeps every token but forces the whole-vocabulary path. Same draws.
    # (Each branch pruned before the next prefills in its cells: the same rows, bit for bit.)
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


def test_grammar_without_a_legal_token_raises_on_sample(ctx: kvfork.Context) -> None:
    b = root(ctx)
    b.set_grammar('root ::= "{" [a-z]* "}"')
    b.steer(dict.fromkeys(range(ctx.vocab_size), -math.inf))
    with pytest.raises(kvfork.GrammarError):
        b.sample()
    b.clear_steer()
    assert ctx.token_to_text(b.sample()).startswith("{")


def test_bad_grammars_raise(ctx: kvfork.Context) -> None:
    for bad in ["root ::= undefined_rule", "root ::= (", "not a grammar"]:
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


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_a_blank_grammar_removes_the_constraint(ctx: kvfork.Context, blank: str) -> None:
    b = root(ctx)
    expected = int(np.argmax(b.logits()))  # greedy, unconstrained
    b.set_grammar('root ::= "zzz"')
    assert b.produce_sync().token != expected  # constrained
    b.set_grammar(blank)  # as lloyal.node's setGrammar(""): no constraint
    assert b.produce_sync().token == expected
    b.commit_sync(expected)
    created = kvfork.Branch.create(ctx, 0, GREEDY, grammar=blank)
    created.prefill_sync(ctx.tokenize(PROMPT))  # in other cells: its own argmax
    assert created.produce_sync().token == int(np.argmax(created.logits()))


def test_errors_say_why(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx)
    with pytest.raises(kvfork.GrammarError, match="undefined rule.*foo"):
        b.set_grammar("root ::= foo")
    with pytest.raises(kvfork.GrammarError, match="undefined rule.*root"):
        b.set_grammar('start ::= "x"')
    with pytest.raises(kvfork.GrammarError, match="line 1, column 23: unexpected end of input"):
        b.set_grammar('root ::= "unterminated')
    with pytest.raises(kvfork.GrammarError, match="not valid JSON"):
        kvfork.json_schema_to_grammar("{bad")
    with pytest.raises(kvfork.GrammarError, match='unknown type "strange"'):
        kvfork.json_schema_to_grammar({"type": "strange"})
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(kvfork.GrammarError, match="#/properties/a: \\$ref"):
        kvfork.json_schema_to_grammar(schema)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ('root ::= "yes', r"line 1, column 14: unexpected end of input.*closing '\"'"),
        ("this is not a grammar ::= ::=", "line 1, column 6: expected '::=' after the rule name"),
        ("root ::= ((", "line 1, column 12"),
        ('root ::= "a"\n  bad line', "line 2"),
        ("root ::= [a-", "line 1, column 13: unexpected end of input"),
    ],
)
def test_gbnf_syntax_errors_give_line_column_and_what_was_expected(
    ctx: kvfork.Context, grammar: str, message: str
) -> None:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(kvfork.GrammarError, match=message):
        b.set_grammar(grammar)
    b.set_grammar('root ::= "yes" | "no"')  # the branch is unharmed
