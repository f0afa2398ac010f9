"""Errors that say why: every badly typed argument is named in the TypeError's message, GBNF
syntax errors give line, column and what was expected, blocking helpers refuse a running event
loop up front, and a branch created with nothing behind it warns."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import kvfork
import pytest
from kvfork.patterns import beam_search_sync

from .conftest import GREEDY, root


def argument_calls(ctx: kvfork.Context, b: kvfork.Branch) -> list[tuple[str, Callable[[], Any]]]:
    """(argument name, a call passing that argument a value of the wrong type)."""
    model = ctx.model
    path = kvfork.default_model_path()
    store = kvfork.BranchStore(ctx)
    return [
        ("n_ctx", lambda: kvfork.create_context_sync(path, n_ctx="big")),  # type: ignore[arg-type]
        ("n_batch", lambda: kvfork.create_context_sync(path, n_batch=1.5)),  # type: ignore[arg-type]
        ("n_threads", lambda: kvfork.create_context_sync(path, n_threads="2")),  # type: ignore[arg-type]
        ("type_k", lambda: kvfork.create_context_sync(path, type_k=16)),  # type: ignore[arg-type]
        ("embeddings", lambda: kvfork.create_context_sync(path, embeddings="yes")),  # type: ignore[arg-type]
        ("pooling", lambda: kvfork.create_context_sync(path, pooling=1)),  # type: ignore[arg-type]
        ("path_or_model", lambda: kvfork.create_context_sync(3)),  # type: ignore[arg-type]
        ("path", lambda: kvfork.Model.load(3)),  # type: ignore[arg-type]
        ("use_mmap", lambda: kvfork.Model.load(path, use_mmap="no")),  # type: ignore[arg-type]
        ("n_gpu_layers", lambda: kvfork.Model.load(path, n_gpu_layers="all")),  # type: ignore[arg-type]
        ("text", lambda: ctx.tokenize(5)),  # type: ignore[arg-type]
        ("add_special", lambda: ctx.tokenize("a", add_special=1)),  # type: ignore[arg-type]
        ("tokens", lambda: ctx.detokenize("abc")),  # type: ignore[arg-type]
        ("remove_special", lambda: ctx.detokenize([1], remove_special=None)),  # type: ignore[arg-type]
        ("token", lambda: ctx.token_to_text("x")),  # type: ignore[arg-type]
        ("token", lambda: ctx.is_stop_token(1.0)),  # type: ignore[arg-type]
        ("src", lambda: ctx.kv_seq_copy("0", 1)),  # type: ignore[arg-type]
        ("path", lambda: ctx.save_state_sync(None)),  # type: ignore[arg-type]
        ("normalize", lambda: ctx.embed_sync("a", normalize="no")),  # type: ignore[arg-type]
        ("add_generation_prompt", lambda: ctx.format_chat([], add_generation_prompt=2)),  # type: ignore[arg-type]
        ("template", lambda: ctx.format_chat([], template=5)),  # type: ignore[arg-type]
        ("position", lambda: kvfork.Branch.create(ctx, "0")),  # type: ignore[arg-type]
        ("params", lambda: kvfork.Branch.create(ctx, 0, 5)),  # type: ignore[arg-type]
        ("grammar", lambda: kvfork.Branch.create(ctx, 0, grammar=5)),  # type: ignore[arg-type]
        ("tokens", lambda: b.prefill_sync("hello")),  # type: ignore[arg-type]
        ("token", lambda: b.commit_sync("a")),  # type: ignore[arg-type]
        ("max_tokens", lambda: b.generate_sync(max_tokens="3")),  # type: ignore[call-overload]
        ("seed", lambda: b.fork_sync(seed="1")),  # type: ignore[arg-type]
        ("keep_children", lambda: b.prune_sync(keep_children="yes")),  # type: ignore[arg-type]
        ("gbnf", lambda: b.set_grammar(5)),  # type: ignore[arg-type]
        ("pattern", lambda: b.set_regex(5)),  # type: ignore[arg-type]
        ("grammar", lambda: b.set_lark(5)),  # type: ignore[arg-type]
        ("patterns", lambda: b.set_grammar_lazy('root ::= "a"', [], patterns=5)),  # type: ignore[arg-type]
        ("base", lambda: b.entropy(2)),  # type: ignore[arg-type]
        ("token", lambda: b.surprisal("x")),  # type: ignore[arg-type]
        ("token", lambda: b.logprob(None)),  # type: ignore[arg-type]
        ("k", lambda: b.top_logprobs("3")),  # type: ignore[arg-type]
        ("path", lambda: b.save_sync(1.5)),  # type: ignore[arg-type]
        ("path", lambda: kvfork.Branch.load_sync(ctx, 1.5)),  # type: ignore[arg-type]
        ("draft", lambda: b.speculate_sync(1, "ab")),  # type: ignore[arg-type]
        ("ctx", lambda: kvfork.BranchStore(5)),  # type: ignore[arg-type]
        ("text", lambda: kvfork.Token(1, 2, False)),  # type: ignore[arg-type]
        ("is_stop", lambda: kvfork.Token(1, "a", "no")),  # type: ignore[arg-type]
        ("schema", lambda: kvfork._native.json_schema_to_grammar(5)),  # type: ignore[arg-type]
        ("entries", lambda: store.commit_sync(5)),  # type: ignore[arg-type]
        ("temperature", lambda: kvfork.SamplingParams(temperature="hot")),  # type: ignore[arg-type]
        ("top_k", lambda: kvfork.SamplingParams(top_k=1.5)),  # type: ignore[arg-type]
        ("path", lambda: model.load(object())),  # type: ignore[arg-type]
    ]


def test_every_badly_typed_argument_is_named_in_the_message(ctx: kvfork.Context) -> None:
    b = root(ctx)
    unnamed = []
    for name, call in argument_calls(ctx, b):
        with pytest.raises(TypeError) as info:
            call()
        if name not in str(info.value):
            unnamed.append(f"{name}: {info.value}")
    assert not unnamed, "\n".join(unnamed)


def test_the_readme_example_names_n_ctx() -> None:
    with pytest.raises(TypeError, match="argument 'n_ctx': expected an int, got str"):
        kvfork.create_context_sync(kvfork.default_model_path(), n_ctx="big")  # type: ignore[arg-type]


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


async def test_beam_search_sync_inside_a_running_loop_names_the_async_form(
    ctx: kvfork.Context,
) -> None:
    b = root(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no never-awaited coroutine left behind
        with pytest.raises(RuntimeError, match=r"running event loop.*await beam_search"):
            beam_search_sync(b, 2, 4)
    assert b.position == len(ctx.tokenize("The history of the printing press begins with"))
    # The engine-waiting twins stay allowed inside a loop (they block it, as documented).
    b.commit_sync(b.produce_sync().token)
    await asyncio.sleep(0)


def test_a_branch_created_past_zero_warns_what_to_do(ctx: kvfork.Context) -> None:
    with pytest.warns(kvfork.KvforkWarning, match=r"position 5.*create it at 0 and prefill"):
        b = kvfork.Branch.create(ctx, 5, GREEDY)
    assert issubclass(kvfork.KvforkWarning, UserWarning)
    b.prune_sync()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvfork.Branch.create(ctx, 0, GREEDY).prune_sync()  # the usual start is silent
