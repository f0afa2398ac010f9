"""Which actor serves a request, by its prompt's tokens: pure routing logic (no Ray, no model).

Three policies:

- ``affinity``: the router keeps an index of the prompts each actor was sent (chained hashes
  of their whole blocks of `BLOCK` tokens, least recently used dropped past the actor's KV
  size) and picks the actor holding the longest prefix of the new prompt, the least busy
  among equals.
- ``hash``: a consistent hash of the prompt's leading block (its first `LEAD` tokens) on a
  ring of virtual nodes: no state, the same leading block always lands on the same actor.
- ``random``: a uniformly random actor (the baseline the others are measured against).

``affinity`` and ``hash`` obey a load bound: an actor takes a request only while its
requests in flight stay within `load_factor` × the average (and at least `slack`), so one hot
prefix spills to the next actor instead of pinning every request to one.
"""

from __future__ import annotations

import bisect
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

Policy = Literal["affinity", "hash", "random"]
POLICIES: tuple[Policy, ...] = ("affinity", "hash", "random")

#: Tokens per block of the affinity index: a prefix is known to this granularity.
BLOCK = 16
#: The leading tokens whose hash places a prompt under the ``hash`` policy.
LEAD = 64
#: Virtual nodes per actor on the hash ring (an even spread over few actors).
VNODES = 64


def block_keys(tokens: Sequence[int], block: int = BLOCK) -> list[int]:
    """Chained hashes of the prompt's whole blocks: key ``i`` stands for ``tokens[:(i+1)*block]``
    (equal keys mean equal prefixes, up to hash collisions)."""
    keys: list[int] = []
    h = 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, *tokens[start : start + block]))  # ints hash the same in every process
        keys.append(h)
    return keys


class PrefixIndex:
    """The prefixes one actor was sent, as block keys, the least recently used dropped past
    `capacity` blocks (the actor's own cache evicts in the same order)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `keys`) this actor holds."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        """Record a prompt sent to this actor. The shortest prefix is touched last, so that
        eviction drops a prompt's tail before its head (a head shared by many survives)."""
        for k in reversed(keys):
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the actor was replaced)."""
        self._keys.clear()


@dataclass(frozen=True)
class Route:
    """Where a request goes: the actor, and how many of its prompt's tokens the router expects
    that actor to hold already."""

    actor: int
    expected_cached: int


class Router:
    """Routes prompts to `actors` actors under `policy`. The caller reports each request's end
    (`done`) so the router knows every actor's load, and a replaced actor (`forget`) so it
    stops counting on that actor's cache."""

    def __init__(
        self,
        actors: int,
        policy: Policy = "affinity",
        *,
        capacity_tokens: int = 16384,
        load_factor: float = 1.5,
        slack: int = 2,
        min_match: int = 4 * BLOCK,
        seed: int | None = None,
    ) -> None:
        if actors < 1:
            raise ValueError(f"actors must be >= 1, got {actors}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.policy = policy
        self.load_factor = load_factor
        self.slack = max(1, slack)
        self.min_match = min_match
        self.loads = [0] * actors
        self.indexes = [PrefixIndex(capacity_tokens // BLOCK) for _ in range(actors)]
        self._rng = random.Random(seed)
        self._turn = 0  # rotates ties, so that idle actors take turns
        self._ring = sorted(
            (zlib.crc32(f"{actor}/{v}".encode()), actor)
            for actor in range(actors)
            for v in range(VNODES)
        )

    @property
    def actors(self) -> int:
        """How many actors the router spreads over."""
        return len(self.loads)

    def bound(self, exclude: Collection[int] = ()) -> int:
        """The most requests an actor may hold once the next one is placed."""
        live = self.actors - len(set(exclude))
        total = sum(load for a, load in enumerate(self.loads) if a not in exclude)
        return max(self.slack, math.ceil(self.load_factor * (total + 1) / max(1, live)))

    def pick(self, tokens: Sequence[int], exclude: Collection[int] = ()) -> Route:
        """The actor for a prompt (not one in `exclude`, unless every actor is), counted as
        busy with it until `done`."""
        candidates = [a for a in range(self.actors) if a not in exclude] or list(range(self.actors))
        keys = block_keys(tokens)
        if self.policy == "random":
            actor = self._rng.choice(candidates)
        elif self.policy == "hash":
            actor = self._by_hash(tokens, candidates, exclude)
        else:
            actor = self._by_affinity(keys, candidates, exclude)
        expected = self.indexes[actor].match(keys) * BLOCK
        self.indexes[actor].add(keys)
        self.loads[actor] += 1
        return Route(actor, expected)

    def done(self, actor: int) -> None:
        """A request on `actor` ended (finished, failed or cancelled)."""
        self.loads[actor] = max(0, self.loads[actor] - 1)

    def forget(self, actor: int) -> None:
        """`actor` was replaced by a fresh one: nothing is cached there any more."""
        self.indexes[actor].clear()

    def _rotated(self, candidates: list[int]) -> list[int]:
        self._turn += 1
        k = self._turn % len(candidates)
        return candidates[k:] + candidates[:k]

    def _by_affinity(self, keys: list[int], candidates: list[int], exclude: Collection[int]) -> int:
        bound = self.bound(exclude)

        def held(actor: int) -> int:
            tokens = self.indexes[actor].match(keys) * BLOCK
            return tokens if tokens >= self.min_match else 0  # a short match is not worth a queue

        # Longest held prefix first, the least busy among equals, idle ties in turn.
        ranked = sorted(self._rotated(candidates), key=lambda a: (-held(a), self.loads[a]))
        for actor in ranked:
            if self.loads[actor] < bound:
                return actor
        return min(ranked, key=lambda a: self.loads[a])

    def _by_hash(
        self, tokens: Sequence[int], candidates: list[int], exclude: Collection[int]
    ) -> int:
        lead = tokens[:LEAD]
        point = zlib.crc32(b"".join(t.to_bytes(4, "little", signed=True) for t in lead))
        start = bisect.bisect_left(self._ring, (point, -1))
        bound = self.bound(exclude)
        allowed = set(candidates)
        # Walk the ring from the prompt's point: the first actor under the bound takes it.
        seen: list[int] = []
        for i in range(len(self._ring)):
            actor = self._ring[(start + i) % len(self._ring)][1]
            if actor not in allowed or actor in seen:
                continue
            if self.loads[actor] < bound:
                return actor
            seen.append(actor)
            if len(seen) == len(allowed):
                break
        return min(candidates, key=lambda a: self.loads[a])
