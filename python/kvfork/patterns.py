"""Search patterns built on branches: beam search and diverse beam search, and ranking
candidate continuations by likelihood.

Every step of a search advances all of its live beams with ONE decode (`BranchStore.commit`):
a beam kept twice is forked (no tensor copy), a dropped beam is pruned with
`keep_children=True` so its lease comes back while forks of it live on. A search of width W
holds at most W + 1 leases. `rank` scores candidates on forks, as many at once as leases are
free, in the same decodes (`BranchStore.score`).
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._native import Branch, BranchStore, Context, KvCacheFullError, LeaseExhaustedError

__all__ = ["Beam", "Ranked", "beam_search", "beam_search_sync", "rank", "rank_sync"]


@dataclass(frozen=True)
class Beam:
    """One finished or surviving hypothesis of a beam search."""

    tokens: list[int]
    """The generated tokens (an end-of-generation token included when it ended the beam)."""
    text: str
    """The tokens' text (end-of-generation tokens render as nothing)."""
    logprob: float
    """Sum of the natural-log probabilities of the tokens under the raw logits."""
    score: float
    """`logprob / len(tokens) ** length_penalty`: what the search ranked beams by."""
    finished: bool
    """Whether the beam ended with an end-of-generation token."""


@dataclass
class _Live:
    branch: Branch
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    group: int = 0


def _score(logprob: float, length: int, length_penalty: float) -> float:
    return logprob / math.pow(max(length, 1), length_penalty)


def _check(
    width: int, max_tokens: int, groups: int, diversity: float, length_penalty: float
) -> None:
    for name, value in (("width", width), ("max_tokens", max_tokens), ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if width < 1:
        raise ValueError(f"width must be at least 1, not {width}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if groups < 1 or width % groups != 0:
        raise ValueError(f"groups must divide width ({width}), not {groups}")
    if diversity < 0 or not math.isfinite(diversity):
        raise ValueError(f"diversity must be finite and >= 0, not {diversity}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite, not {length_penalty}")


async def beam_search(
    branch: Branch,
    width: int,
    max_tokens: int,
    *,
    length_penalty: float = 0.0,
    groups: int = 1,
    diversity: float = 0.0,
) -> list[Beam]:
    """The `width` best continuations of `branch` by cumulative log-probability, best first.

    `branch` itself is left as it was: the search runs on forks of it and prunes them all
    before returning. Each step expands every live beam by its `width` most likely tokens
    (raw logits; the branch's sampler, biases and constraint are not applied) and keeps the
    best `width` expansions, all advanced with one decode. A beam that draws an
    end-of-generation token is finished. `length_penalty` ranks by
    `logprob / len ** length_penalty` (0: plain sum; 1: mean per token).

    Diverse beam search (Vijayakumar et al., 2016): `groups` splits the width into groups
    chosen one after the other at each step; a token already chosen by an earlier group
    from the same step costs `diversity` nats per choice, so the groups spread out.
    Needs `width + 1` free leases. At the end of the context (`n_ctx` positions, or no free
    cells for the next step) the search stops, its beams unfinished, as `generate` stops.
    """
    _check(width, max_tokens, groups, diversity, length_penalty)
    store = BranchStore(branch.context)
    per_group = width // groups
    root: Branch | None = None
    live: list[_Live] = []
    finished: list[Beam] = []
    try:
        root = await branch.fork()
        # Groups share the root until their first step forks it.
        live = [_Live(root, group=g) for g in range(groups)]
        n_ctx = branch.context.n_ctx
        for _ in range(max_tokens):
            # Every live beam is as long as the others: at the end of the context they stop
            # unfinished, as `generate` stops there.
            if not live or live[0].branch.position >= n_ctx:
                break
            chosen: list[tuple[float, _Live, int, float]] = []  # (logprob, parent, token, lp)
            picked: dict[int, int] = {}  # token -> times chosen by earlier groups this step
            for g in range(groups):
                members = [b for b in live if b.group == g]
                seen: set[int] = set()
                expansions = []
                for beam in members:
                    if id(beam.branch) in seen:
                        continue  # groups that still share the root expand it once each
                    seen.add(id(beam.branch))
                    # Enough tokens that penalised ones can be passed over.
                    for token, lp in beam.branch.top_logprobs(per_group + len(picked)):
                        total = beam.logprob + lp
                        rank = _score(total, len(beam.tokens) + 1, length_penalty)
                        rank -= diversity * picked.get(token, 0)
                        expansions.append((rank, total, beam, token, lp))
                expansions.sort(key=lambda e: -e[0])
                for _, total, beam, token, lp in expansions[:per_group]:
                    chosen.append((total, beam, token, lp))
                    picked[token] = picked.get(token, 0) + 1
            try:
                live = await _advance(store, live, chosen, finished, length_penalty)
            except KvCacheFullError:
                # No cells for another step: the beams as they stand stop unfinished, as
                # `generate` stops at a full context (`_advance` gave back every branch of
                # the step; a beam's tokens and log-probability are its own).
                break
        for beam in live:
            finished.append(_result(beam, False, length_penalty))
    finally:
        for beam in live:
            if not beam.branch.disposed:
                await beam.branch.prune(keep_children=True)
        if root is not None and not root.disposed:
            await root.prune(keep_children=True)
    finished.sort(key=lambda b: -b.score)
    return finished[:width]


async def _advance(
    store: BranchStore,
    live: list[_Live],
    chosen: list[tuple[float, _Live, int, float]],
    finished: list[Beam],
    length_penalty: float,
) -> list[_Live]:
    """Fork, prune and commit so the chosen expansions become the live beams (one decode).
    Forks made here are pruned again if anything fails."""
    if not chosen:
        return []
    ctx = chosen[0][1].branch.context
    keep = {id(parent.branch) for _, parent, token, _ in chosen if not ctx.is_stop_token(token)}
    for beam in live:
        if id(beam.branch) not in keep and not beam.branch.disposed:
            await beam.branch.prune(keep_children=True)  # forks of it may still be beams
    used: set[int] = set()
    moves: list[_Live] = []
    commits: list[tuple[Branch, int]] = []
    try:
        for total, parent, token, _ in chosen:
            tokens = [*parent.tokens, token]
            if ctx.is_stop_token(token):
                text = ctx.detokenize(tokens)
                score = _score(total, len(tokens), length_penalty)
                finished.append(Beam(tokens, text, total, score, True))
                continue
            fresh = id(parent.branch) not in used
            target = parent.branch if fresh else await parent.branch.fork()
            used.add(id(parent.branch))
            moves.append(_Live(target, tokens, total, parent.group))
            commits.append((target, token))
        if commits:
            await store.commit(commits)
    except BaseException:
        for move in moves:
            await move.branch.prune(keep_children=True)
        raise
    return moves


def _result(beam: _Live, finished: bool, length_penalty: float) -> Beam:
    text = beam.branch.context.detokenize(beam.tokens)
    score = _score(beam.logprob, len(beam.tokens), length_penalty)
    return Beam(list(beam.tokens), text, beam.logprob, score, finished)


def beam_search_sync(
    branch: Branch,
    width: int,
    max_tokens: int,
    *,
    length_penalty: float = 0.0,
    groups: int = 1,
    diversity: float = 0.0,
) -> list[Beam]:
    """`beam_search` for code without an event loop (runs one). Inside a running loop it
    raises RuntimeError before anything starts: ``await beam_search(...)`` there."""
    _refuse_inside_a_loop("beam_search_sync", "await beam_search(...)")
    return asyncio.run(
        beam_search(
            branch,
            width,
            max_tokens,
            length_penalty=length_penalty,
            groups=groups,
            diversity=diversity,
        )
    )


@dataclass(frozen=True)
class Ranked:
    """One candidate continuation, as `rank` scored it."""

    index: int
    """Its place in the candidates given."""
    tokens: list[int]
    """Its tokens."""
    text: str
    """The tokens' text."""
    logprob: float
    """Sum of the natural-log probabilities of its tokens, each given the branch and the
    tokens before it (raw logits)."""
    score: float
    """`logprob / len(tokens) ** length_penalty`: what the candidates are ranked by."""


async def rank(
    branch: Branch,
    candidates: Sequence[str | Iterable[int]],
    *,
    length_penalty: float = 0.0,
) -> list[Ranked]:
    """`candidates` (texts, tokenized without special tokens, or token lists) ranked as
    continuations of `branch` by the model's likelihood, best first (ties keep their order).

    Each candidate is scored on a fork of `branch`, so the branch's tokens are not decoded
    again, as many at once as leases are free, their tokens packed into the same decodes
    (`BranchStore.score`): a handful of short answers take one decode. `branch` is left as it
    was; every fork is pruned before this returns, or raises. `length_penalty` ranks by
    `logprob / len ** length_penalty` (0: the plain sum; 1: the mean per token). Candidates
    that do not fit the KV cache together are scored one at a time. Needs a branch with
    logits (after a prefill or commit) and a free lease: concurrent calls each go on with the
    forks they could make, and one that finds none waits up to `LEASE_WAIT` seconds for one
    (concurrent ranks give theirs back as they finish), then raises LeaseExhaustedError.
    """
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite, not {length_penalty}")
    ctx = branch.context
    runs = [_candidate_tokens(ctx, c, i) for i, c in enumerate(_candidate_list(candidates))]
    store = BranchStore(ctx)
    logprobs: list[float] = []
    forks: list[Branch] = []
    try:
        while len(logprobs) < len(runs):
            wanted = runs[len(logprobs) : len(logprobs) + max(1, store.available)]
            await _fork_into(forks, branch, len(wanted))
            group = list(zip(forks, wanted))
            try:
                scores = await store.score(group)
            except KvCacheFullError:
                if len(group) == 1:
                    raise
                # Together they need more cells than are free: one at a time (each alone
                # may fit; a failed score left every branch as it was).
                scores = [await fork.score(run) for fork, run in group]
            logprobs += [math.fsum(s) for s in scores]
            while forks:
                await forks.pop().prune()
    finally:
        for fork in forks:
            if not fork.disposed:
                await fork.prune()
    ranked = [
        Ranked(i, run, ctx.detokenize(run), lp, _score(lp, len(run), length_penalty))
        for i, (run, lp) in enumerate(zip(runs, logprobs))
    ]
    return sorted(ranked, key=lambda r: -r.score)


#: Seconds `rank` waits for a free lease when it has none (see `rank`).
LEASE_WAIT = 10.0


async def _fork_into(forks: list[Branch], branch: Branch, n: int) -> None:
    """Up to `n` forks of `branch` into `forks` (the caller's, so that it prunes them
    whatever happens): as many as leases allow, at least one, waiting for it."""
    deadline = asyncio.get_running_loop().time() + LEASE_WAIT
    start = len(forks)
    while len(forks) - start < n:
        try:
            forks.append(await branch.fork())
        except LeaseExhaustedError:
            if len(forks) > start:
                return  # others took the leases meanwhile: go on with the forks made
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.01)


def _candidate_list(candidates: object) -> list[object]:
    """`candidates` as a list: a sequence of them, not one text or bytes."""
    if isinstance(candidates, str | bytes | bytearray) or not isinstance(candidates, Sequence):
        raise TypeError(
            f"candidates must be a list of texts or token lists, not {type(candidates).__name__}"
        )
    return list(candidates)


def _candidate_tokens(ctx: Context, candidate: object, i: int) -> list[int]:
    """A candidate's tokens: a text tokenized without special tokens, or token ids."""
    if isinstance(candidate, str):
        tokens = ctx.tokenize(candidate, add_special=False)
    elif isinstance(candidate, Iterable) and not isinstance(candidate, bytes | bytearray | Mapping):
        items = list(candidate)
        try:  # ints, or anything with __index__ (NumPy integers); no bools
            tokens = [operator.index(t) for t in items if not isinstance(t, bool)]
        except TypeError:
            tokens = []
        if len(tokens) != len(items):
            raise TypeError(f"candidate {i} must hold token ids (ints)")
    else:
        raise TypeError(
            f"candidate {i} must be a text or a list of token ids, not {type(candidate).__name__}"
        )
    if not tokens:
        raise ValueError(f"candidate {i} has no tokens")
    return tokens


def rank_sync(
    branch: Branch,
    candidates: Sequence[str | Iterable[int]],
    *,
    length_penalty: float = 0.0,
) -> list[Ranked]:
    """`rank` for code without an event loop (runs one). Inside a running loop it raises
    RuntimeError before anything starts: ``await rank(...)`` there."""
    _refuse_inside_a_loop("rank_sync", "await rank(...)")
    return asyncio.run(rank(branch, candidates, length_penalty=length_penalty))


def _refuse_inside_a_loop(name: str, instead: str) -> None:
    """A blocking helper that runs an event loop of its own cannot run inside one (asyncio
    would refuse later, leaving a never-awaited coroutine behind): say so up front."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name} cannot run inside a running event loop; use {instead} there")
