"""Logprobs entries: a token's as OpenAI's APIs give them, and a prompt's.

Prompt scoring: `/v1/completions` with `echo` and `logprobs` gives the prompt's tokens
their logprobs too (the first has none: nothing comes before it), as OpenAI's legacy API and
evaluation harnesses (lm-eval's log-likelihood tasks, `max_tokens: 0`) read them.

The prompt is scored on the request's own branch (`Branch.score`: a prefill with every
position's logits read), not taken from the prefix cache, whose cells keep no logits: a
scored prompt costs a prefill plus the output layer at each position."""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._native import Branch, Context

#: Tokens a scoring call takes at a time: between calls other requests' steps decode (a
#: call is one engine job; 128 tokens take ~0.5 s on 2 CPU cores with Gemma's vocabulary).
PIECE = 128


@dataclass
class PromptLogprobs:
    """A prompt's logprobs entries (as a generated token's, the first with none) and where
    each token's text starts in the prompt's text."""

    entries: list[dict[str, Any]]
    offsets: list[int]


async def score_prompt(
    branch: Branch,
    tokens: list[int],
    top: int,
    decode: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Score `tokens` into `branch` (which holds the token before them) a piece at a time,
    each call through `decode` (which retries after an eviction when the KV is full)."""
    scores: list[tuple[float, list[tuple[int, float]]]] = []
    for start in range(0, len(tokens), PIECE):
        piece = tokens[start : start + PIECE]

        def call(piece: list[int] = piece) -> Awaitable[Any]:
            return branch.score(piece, top_logprobs=top)

        scores += await decode(call)
    return scores


def prompt_logprobs(
    ctx: Context, tokens: list[int], scores: list[tuple[float, list[tuple[int, float]]]]
) -> PromptLogprobs:
    """The entries of a prompt whose tokens after the first were scored as `scores`. Offsets
    count the characters of the prompt's text as llama.cpp detokenizes it (a special token
    such as BOS adds none; a character split across tokens starts at the first)."""
    entries: list[dict[str, Any]] = []
    offsets: list[int] = []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    length = 0
    for i, token in enumerate(tokens):
        piece = ctx.token_to_bytes(token)
        if i == 0:
            entry = {**token_entry(piece, 0.0), "logprob": None, "top_logprobs": None}
        else:
            logprob, best = scores[i - 1]
            entry = {
                **token_entry(piece, logprob),
                "top_logprobs": [token_entry(ctx.token_to_bytes(t), lp) for t, lp in best],
            }
        entries.append(entry)
        offsets.append(length)
        if ctx.detokenize([token]):  # a special token's piece is not in the text
            length += len(decoder.decode(piece))
    return PromptLogprobs(entries, offsets)


def token_entry(piece: bytes, logprob: float) -> dict[str, Any]:
    """A token as OpenAI's logprobs give it: its text, or for a piece that is part of a
    UTF-8 character, `bytes:` and its bytes escaped (as OpenAI's API writes them); the raw
    bytes beside it."""
    try:
        token = piece.decode()
    except UnicodeDecodeError:
        token = "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
    return {"token": token, "logprob": logprob, "bytes": list(piece)}
