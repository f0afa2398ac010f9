"""The tokenizer: `tokenize` / `detokenize` / `token_to_text` round trips, llama.cpp's ids,
special tokens, and which tokens stop generation."""

from __future__ import annotations

import kvfork
import pytest


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and   inner  spaces\n\ttabs",
        "héllo wörld — ünïcödé ✓ 日本語 🙂",
        "",
    ],
)
def test_tokenize_round_trip(ctx: kvfork.Context, text: str) -> None:
    toks = ctx.tokenize(text, add_special=False)
    assert all(isinstance(t, int) and 0 <= t < ctx.vocab_size for t in toks)
    assert ctx.detokenize(toks) == text
    assert "".join(ctx.token_to_text(t) for t in toks) == text


def test_tokenize_matches_llama_cpp(ctx: kvfork.Context) -> None:
    # Golden ids from llama.cpp's tokenizer for this GGUF.
    assert ctx.tokenize("Hello, world!") == [2, 9259, 236764, 1902, 236888]
    assert ctx.tokenize("Hello, world!", add_special=False) == [9259, 236764, 1902, 236888]
    assert ctx.bos_token == 2


def test_parse_special(ctx: kvfork.Context) -> None:
    text = "<start_of_turn>user"
    parsed = ctx.tokenize(text, add_special=False, parse_special=True)
    literal = ctx.tokenize(text, add_special=False, parse_special=False)
    assert len(parsed) == 2 and len(literal) > 2
    assert ctx.detokenize(parsed, unparse_special=True) == text
    assert ctx.detokenize(literal) == text


def test_stop_tokens(ctx: kvfork.Context) -> None:
    eog = ctx.eog_token
    assert eog is not None and ctx.is_stop_token(eog)
    assert not ctx.is_stop_token(ctx.tokenize("Hello", add_special=False)[0])
