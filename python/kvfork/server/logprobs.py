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
    """The entries of a prompt whose tokens after the first were scored as `scores`, and
    where each token starts in the prompt's text (`char_offsets`; a special token such as BOS
    is not in the text: its piece counts for nothing there)."""
    entries: list[dict[str, Any]] = []
    in_text: list[bytes] = []
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
        in_text.append(piece if ctx.detokenize([token]) else b"")
    return PromptLogprobs(entries, char_offsets(in_text))


def char_offsets(pieces: list[bytes]) -> list[int]:
    """Where each piece starts in the text of their bytes decoded with U+FFFD for invalid
    sequences (as llama.cpp detokenizes): the index of the character its first byte belongs
    to, so a piece that continues a character split across pieces starts where it does."""
    data = b"".join(pieces)
    offsets: list[int] = []
    try:
        data.decode()
    except UnicodeDecodeError:
        pass
    else:  # valid text (the usual case): one pass, a held character starting where it began
        decoder = codecs.getincrementaldecoder("utf-8")()
        length = 0
        for piece in pieces:
            offsets.append(length)
            length += len(decoder.decode(piece))
        return offsets
    # Invalid bytes turn into U+FFFD at the first byte that cannot continue them: count the
    # characters before the one each piece begins in (quadratic, on such prompts only).
    start = 0
    for piece in pieces:
        offsets.append(len(data[: _char_start(data, start)].decode("utf-8", "replace")))
        start += len(piece)
    return offsets


def _char_start(data: bytes, at: int) -> int:
    """The first byte of the valid character that byte `at` continues, else `at`."""
    for lead in range(at, max(at - 4, -1), -1):
        if lead >= len(data):
            return at
        byte = data[lead]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: the lead is further back
        width = 1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        try:
            data[lead : lead + width].decode()
        except UnicodeDecodeError:
            return at
        return lead if lead + width > at else at
    return at


def token_entry(piece: bytes, logprob: float) -> dict[str, Any]:
    """A token as OpenAI's logprobs give it: its text, or for a piece that is part of a
    UTF-8 character, `bytes:` and its bytes escaped (as OpenAI's API writes them); the raw
    bytes beside it."""
    try:
        token = piece.decode()
    except UnicodeDecodeError:
        token = "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
    return {"token": token, "logprob": logprob, "bytes": list(piece)}
