"""Exact speculative decoding: `branch.generate(max_tokens, draft=...)`.

Each round decodes the token the sampler drew last plus a guess of the next tokens in ONE
`llama_decode` (`Branch.speculate`), then the branch's own chain samples position by position
and keeps the guess while it agrees. The tokens are those plain generation draws (same chain,
same order of random draws, penalties, grammar and perplexity fed the same way), up to the
rounding of a batched decode; good guesses just need fewer decodes. A round that guesses
nothing still asks a cheap drafter, and checks its guess against the tokens drawn next
(`SpeculativeSchedule.shadowing`): guesses are decoded only once they would be kept.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Literal, Protocol

from ._native import (
    Branch,
    Context,
    KvforkError,
    SpeculativeSchedule,
    Token,
    _use_speculative_streams,
)

__all__ = ["DraftModel", "Drafter", "PromptLookup", "SpeculativeStream", "SpeculativeStreamSync"]


class Drafter(Protocol):
    """Anything that guesses the tokens after `tokens` (the branch's history, ending with the
    token about to be decoded). An empty list means no guess this round."""

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Guessed tokens to follow `tokens` (any length; the stream cuts what does not fit)."""
        ...


class PromptLookup:
    """Guesses by n-gram lookup in the branch's own history (prompt included): the tokens
    that followed the latest earlier occurrence of the history's last `ngram` tokens, falling
    back to shorter n-grams down to `min_ngram` (no guess below it: on a CPU a rejected
    guess costs about as much as a token). No second model; strong when the output repeats
    its input (copying, editing, extraction, code)."""

    def __init__(
        self, ngram: int = 3, max_draft: int = 8, *, min_ngram: int = 2, window: int = 4096
    ) -> None:
        """Match `ngram` down to `min_ngram` tokens, guess up to `max_draft`, search the
        last `window` tokens of the history."""
        if not 1 <= min_ngram <= ngram or max_draft < 1 or window < 2:
            raise ValueError("need 1 <= min_ngram <= ngram, max_draft >= 1 and window >= 2")
        self.ngram = ngram
        self.min_ngram = min_ngram
        self.max_draft = max_draft
        self.window = window

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Up to `max_draft` tokens that followed the last match of the history's tail."""
        seq = array("i", tokens[-self.window :])
        data = seq.tobytes()  # bytes.rfind searches in C: a round costs microseconds
        width = seq.itemsize
        for n in range(min(self.ngram, len(seq) - 1), self.min_ngram - 1, -1):
            needle = seq[-n:].tobytes()
            # The latest earlier occurrence, ending before the last token (not the tail itself)
            # and starting on a token boundary.
            end = len(data) - width
            at = data.rfind(needle, 0, end)
            while at > 0 and at % width:
                at = data.rfind(needle, 0, at + len(needle) - 1)
            if at >= 0:
                start = at // width + n
                return seq[start : start + self.max_draft].tolist()
        return []

    def __repr__(self) -> str:
        return f"PromptLookup(ngram={self.ngram}, max_draft={self.max_draft})"


class DraftModel:
    """Guesses with a second model (smaller, same vocabulary) in a context of its own: a
    branch there follows the main branch's history (only new tokens are prefilled), and
    each round a fork of it writes up to `max_draft` greedy tokens, then is pruned. Needs 2
    sequences of `ctx`. In `async for`, the guesses are awaited (`apropose`), so the event
    loop never waits on the draft model."""

    def __init__(self, ctx: Context, max_draft: int = 8) -> None:
        """Guess with `ctx`'s model, up to `max_draft` tokens a round."""
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, not {max_draft}")
        self.ctx = ctx
        self.max_draft = max_draft
        self._follower: Branch | None = None

    def _behind(self, tokens: Sequence[int]) -> list[int] | None:
        """The tokens the follower still lacks, or None when it must start over."""
        if self._follower is None:
            return None
        seen = self._follower.history
        if len(seen) > len(tokens) or list(tokens[: len(seen)]) != seen:
            return None
        return list(tokens[len(seen) :])

    def _restart(self) -> None:
        if self._follower is not None:
            self._follower.prune_subtree_sync()
        self._follower = Branch.create(self.ctx, 0, {"temperature": 0.0})

    def _catch_up(self, tokens: Sequence[int]) -> list[int]:
        """The tokens the follower lacks (all of them after a restart, when the history is
        not an extension of what it saw)."""
        if any(t >= self.ctx.vocab_size for t in tokens):
            raise ValueError("the draft model's vocabulary is smaller than the main model's")
        new = self._behind(tokens)
        if new is None:
            self._restart()
            new = list(tokens)
        return new

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Greedy guesses of the draft model after `tokens`."""
        new = self._catch_up(tokens)
        assert self._follower is not None
        if new:
            self._follower.prefill_sync(new)
        guesser = self._follower.fork_sync()
        try:
            return [t.token for t in guesser.generate_sync(self.max_draft)]
        finally:
            guesser.prune_sync()

    async def apropose(self, tokens: Sequence[int]) -> list[int]:
        """`propose` without blocking the event loop."""
        new = self._catch_up(tokens)
        assert self._follower is not None
        if new:
            await self._follower.prefill(new)
        guesser = await self._follower.fork()
        try:
            return [t.token async for t in guesser.generate(self.max_draft)]
        finally:
            await guesser.prune()

    def close(self) -> None:
        """Give the follower's lease back (the context stays open)."""
        if self._follower is not None:
            self._follower.prune_subtree_sync()
            self._follower = None


class _Rounds:
    """What the two streams share: the queue of tokens to yield, and the engine's schedule
    (budget, guess length, stop reason, counts: `kvfork._native.SpeculativeSchedule`). The
    streams only await the drafter and the engine."""

    def __init__(
        self,
        branch: Branch,
        max_tokens: int | None,
        draft: Drafter,
        *,
        on_context_full: Literal["stop", "shift"] = "stop",
        keep: int = 4,
    ) -> None:
        if not callable(getattr(draft, "propose", None)):
            raise TypeError("draft must have a propose(tokens) -> list[int] method")
        self.branch = branch
        self.draft = draft
        self.schedule = SpeculativeSchedule(max_tokens, on_context_full=on_context_full, keep=keep)
        self.queue: deque[Token] = deque()
        self.pending: Token | None = None
        self._at = -1  # the branch's position when `pending` was drawn
        # Consumers of one stream (tasks, or threads for the sync twin) take its tokens in
        # turn: a round reads and moves the pending token, so two at once would share it.
        self._task_turn = asyncio.Lock()
        self._thread_turn = threading.Lock()

    def pop(self) -> Token:
        self.schedule.yielded_one()
        return self.queue.popleft()

    def took(
        self, at: int, pending: Token, draft: list[int], accepted: list[Token], nxt: Token
    ) -> None:
        self.schedule.took(len(draft), len(accepted), nxt)
        self.queue.append(pending)
        self.queue.extend(accepted)
        self.pending, self._at = nxt, at + 1 + len(accepted)

    def current(self) -> Token | None:
        """The pending token, unless the branch moved since it was drawn (a `store.step` or
        commit by someone else, another stream, a round that was interrupted): it is stale
        then, and the round samples afresh from the branch, as plain generation does."""
        if self.pending is not None and self.branch.position != self._at:
            self.pending = None
        return self.pending

    def drew(self, pending: Token) -> None:
        self.pending, self._at = pending, self.branch.position

    def interrupted(self, at: int, pending: Token, draft: list[int]) -> None:
        """The round from position `at` raised (cancelled, Ctrl-C, a failed decode). If it ran
        all the same (the engine finishes a started round), `pending` and the kept guesses are
        committed: they count against `max_tokens` but are not yielded, as a cancelled step
        of plain generation. The token it drew after them is lost: `current` sees the branch
        moved, and the next round samples again."""
        try:
            moved = self.branch.position - at
            ran = moved > 0 and self.branch.history[-moved:] == [pending.token, *draft][:moved]
        except KvforkError:  # pruned or closed: the next round says so
            return
        for _ in range(moved if ran else 0):
            self.schedule.yielded_one()

    def history(self, pending: Token) -> list[int]:
        return [*self.branch.history, pending.token]

    @property
    def stop_reason(self) -> str | None:
        """Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it
        runs."""
        return self.schedule.stop_reason

    @property
    def shifts(self) -> int:
        """Context shifts so far (`on_context_full="shift"`)."""
        return self.schedule.shifts

    @property
    def rounds(self) -> int:
        """Rounds run (decodes of a pending token plus its guess)."""
        return self.schedule.rounds

    @property
    def drafted(self) -> int:
        """Guessed tokens decoded over all rounds."""
        return self.schedule.drafted

    @property
    def accepted(self) -> int:
        """Guessed tokens the chain drew too."""
        return self.schedule.accepted

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the chain drew too (0 before any draft)."""
        return self.schedule.acceptance


class SpeculativeStream(_Rounds):
    """`async for tok in branch.generate(max_tokens, draft=...)`: commit-before-yield like
    plain generation, ending at a stop token (not committed), `max_tokens` or a full context
    (`stop_reason`; with `on_context_full="shift"` the context shifts instead, counted in
    `shifts`). Each round guesses as many tokens as pay, from the measured acceptance and
    the measured cost of a wider decode, or none (see `kvfork_core::GuessPolicy`). A cheap
    drafter (microseconds, as `PromptLookup`) is asked in rounds that guess nothing too: its
    guess is not decoded but checked against the tokens drawn next, so the acceptance is
    measured without a decode and a stream whose guesses would be refused decodes one token
    a round, as plain generation does (the same decodes: seeded draws included, the same
    tokens). `rounds`, `drafted` (guessed tokens decoded; checked ones are not counted),
    `accepted` and `acceptance` tell how the draft did. At the end the sampler has drawn the
    one token after the last yielded (not committed) — one random draw past plain
    generation. A drafter with `async apropose(tokens)` is awaited (the event loop never
    waits on it). A round cancelled (or interrupted by Ctrl-C) once it runs completes: its
    tokens are committed, not yielded, and count against `max_tokens`, as a cancelled step
    of plain generation. When the branch moved between two tokens (a `store.step`, a commit,
    another stream), the stream samples afresh from where it is, as plain generation does.
    With `on_context_full="shift"` the token drawn before a shift is drawn again from the
    shifted context's logits: a greedy stream equals plain generation through shifts, a
    seeded one has drawn one number more at each shift (its draws part from plain's there)."""

    def __aiter__(self) -> SpeculativeStream:
        return self

    async def __anext__(self) -> Token:
        async with self._task_turn:
            return await self._next()

    async def _next(self) -> Token:
        if self.queue:
            return self.pop()
        if self.schedule.ended():
            raise StopAsyncIteration
        keep = self.schedule.shift_due(self.branch)
        if keep is not None:  # a token drawn before it is stale after it (`current`)
            await self.branch.shift_context(keep)
        if self.current() is None:
            self.drew(await self.branch.produce())
        pending, at = self.pending, self._at
        assert pending is not None
        n = self.schedule.guess_len(self.branch, pending)
        if n is None:
            raise StopAsyncIteration
        draft: list[int] = []
        if n > 0 or self.schedule.shadowing:
            apropose = getattr(self.draft, "apropose", None)
            history = self.history(pending)
            guess = await apropose(history) if apropose else self.draft.propose(history)
            draft = self.schedule.proposed(guess, n)
        try:
            accepted, nxt = await self.branch.speculate(pending, draft)
        except BaseException:
            self.interrupted(at, pending, draft)
            raise
        self.took(at, pending, draft, accepted, nxt)
        return self.pop()


class SpeculativeStreamSync(_Rounds):
    """Blocking twin of `SpeculativeStream`: `for tok in branch.generate_sync(n, draft=...)`."""

    def __iter__(self) -> SpeculativeStreamSync:
        return self

    def __next__(self) -> Token:
        with self._thread_turn:
            return self._next()

    def _next(self) -> Token:
        if self.queue:
            return self.pop()
        if self.schedule.ended():
            raise StopIteration
        keep = self.schedule.shift_due(self.branch)
        if keep is not None:  # a token drawn before it is stale after it (`current`)
            self.branch.shift_context_sync(keep)
        if self.current() is None:
            self.drew(self.branch.produce_sync())
        pending, at = self.pending, self._at
        assert pending is not None
        n = self.schedule.guess_len(self.branch, pending)
        if n is None:
            raise StopIteration
        draft: list[int] = []
        if n > 0 or self.schedule.shadowing:
            draft = self.schedule.proposed(self.draft.propose(self.history(pending)), n)
        try:
            accepted, nxt = self.branch.speculate_sync(pending, draft)
        except BaseException:
            self.interrupted(at, pending, draft)
            raise
        self.took(at, pending, draft, accepted, nxt)
        return self.pop()


# The native `Branch.generate(draft=...)` builds these streams: hand them over (the native
# module never imports this package).
_use_speculative_streams(SpeculativeStream, SpeculativeStreamSync)
