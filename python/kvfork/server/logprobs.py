"""Logprobs entries: a token's as OpenAI's APIs give them, and a prompt's.

Prompt scoring: `/v1/completions` with `echo` and `logprobs` gives the prompt's tokens
their logprobs too (the first has none: nothing comes before it), as OpenAI's legacy API and
evaluation harnesses (lm-eval's log-likelihood tasks, `max_tokens: 0`) read them.

The prompt is scored on the request's own branch (`Branch.score`: a prefill with every
position's logits read): the prefix cache's cells keep no logits. What was scored is kept
(`ScoreCache`): a later prompt that begins the same (a multiple-choice question's few-shot
context, asked once per answer) has the scores of that part from there and its cells from
the prefix cache, and scores only the rest."""

from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from .._native import Branch, Context

#: Tokens a scoring call takes at a time: between calls other requests' steps decode (a
#: call is one engine job; 128 tokens take ~0.5 s on 2 CPU cores with Gemma's vocabulary).
PIECE = 128


#: A token's score: its logprob, and the best alternatives at its position.
Score = tuple[float, list[tuple[int, float]]]

#: Logprob entries a server keeps (`ScoreCache`): a scored token's own and each of its
#: alternatives', ~125 bytes each (measured: 265 bytes a token with one alternative), so
#: ~16 MB in all: 65,536 tokens' scores with one alternative, 21,845 with five.
SCORE_CACHE_ENTRIES = 1 << 17


class ScoreCache:
    """The scores of the prompts scored last, up to `max_entries` logprob entries in all (a
    token's own and each of its alternatives'; least recently used out first), each with the
    number of alternatives it was scored with and the model it was scored by (`under`: the
    LoRA adapters applied, a hashable key). Thread-safe: a lookup runs off the event loop
    while requests keep scores on it."""

    def __init__(self, max_entries: int = SCORE_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._prompts: OrderedDict[tuple[Hashable, tuple[int, ...]], tuple[int, list[Score]]]
        self._prompts = OrderedDict()
        self._entries = 0
        self._lock = threading.Lock()

    def known(self, tokens: list[int], top: int, under: Hashable = None) -> list[Score]:
        """The scores of the longest beginning of `tokens` some prompt kept `under` the same
        adapters shares (its tokens after the first: each depends only on the tokens before
        it), with at least `top` alternatives each (cut to `top`)."""
        asked = tuple(tokens)
        best: list[Score] = []
        found: tuple[Hashable, tuple[int, ...]] | None = None
        with self._lock:
            for key, (kept_top, scores) in self._prompts.items():
                if key[0] != under or kept_top < top:
                    continue
                shared = _shared(key[1], asked)
                if shared - 1 > len(best):
                    best, found = scores[: shared - 1], key
            if found is None:
                return []
            self._prompts.move_to_end(found)
        return [(lp, alternatives[:top]) for lp, alternatives in best]

    def keep(
        self, tokens: list[int], top: int, scores: list[Score], under: Hashable = None
    ) -> None:
        """Keep the scores of a prompt (`scores`: of its tokens after the first), in place of
        those kept with fewer alternatives. Each of its tokens counts `1 + top` entries."""
        key = (under, tuple(tokens))
        if len(tokens) * (1 + top) > self.max_entries:
            return
        with self._lock:
            kept = self._prompts.get(key)
            if kept is not None and kept[0] >= top:
                return
            if kept is not None:
                del self._prompts[key]
                self._entries -= len(tokens) * (1 + kept[0])
            self._prompts[key] = (top, scores)
            self._entries += len(tokens) * (1 + top)
            while self._entries > self.max_entries:
                (_, dropped), (dropped_top, _) = self._prompts.popitem(last=False)
                self._entries -= len(dropped) * (1 + dropped_top)


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many first tokens `a` and `b` have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
            entry = logprob_entry(ctx, token, *scores[i - 1])
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


def logprob_entry(
    ctx: Context, token: int, logprob: float, best: list[tuple[int, float]]
) -> dict[str, Any]:
    """A token's logprobs entry, with the `best` alternatives at its position."""
    return {
        **token_entry(ctx.token_to_bytes(token), logprob),
        "top_logprobs": [token_entry(ctx.token_to_bytes(t), lp) for t, lp in best],
    }


def token_entry(piece: bytes, logprob: float) -> dict[str, Any]:
    """A token as OpenAI's logprobs give it: its text, or for a piece that is part of a
    UTF-8 character, `bytes:` and its bytes escaped (as OpenAI's API writes them); the raw
    bytes beside it."""
    try:
        token = piece.decode()
    except UnicodeDecodeError:
        token = "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
    return {"token": token, "logprob": logprob, "bytes": list(piece)}
