"""The routing of ``kvfork serve --ray`` (pure logic, no Ray): prefix affinity, the consistent
hash, the load bound, and what a replaced actor forgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfork.server.router import BLOCK, LEAD, PrefixIndex, Router, block_keys


def prompt(seed: int, length: int) -> list[int]:
    """A prompt of `length` tokens, distinct for each seed from its first token."""
    return [seed * 100_000 + i for i in range(length)]


def test_block_keys_name_prefixes() -> None:
    a = prompt(1, 3 * BLOCK + 5)
    b = a[: 2 * BLOCK] + [7] * BLOCK
    assert len(block_keys(a)) == 3  # whole blocks only
    assert block_keys(a)[:2] == block_keys(b)[:2]
    assert block_keys(a)[2] != block_keys(b)[2]
    # A key stands for its whole prefix: the same block after another head differs.
    assert block_keys([9] * BLOCK + a[:BLOCK])[1] != block_keys(a)[0]


def test_the_index_evicts_a_prompts_tail_before_its_head() -> None:
    index = PrefixIndex(capacity=4)
    head = prompt(1, 3 * BLOCK)
    index.add(block_keys(head))
    index.add(block_keys(prompt(2, 2 * BLOCK)))  # over capacity: the oldest key goes
    assert index.match(block_keys(head)) == 2  # the head survives, the tail went first
    assert len(index) == 4


def test_a_prompt_follows_the_actor_that_holds_its_prefix() -> None:
    router = Router(2)
    preambles = [prompt(k, 20 * BLOCK) for k in range(4)]
    first = [router.pick(p).actor for p in preambles]
    for a in first:
        router.done(a)
    assert sorted(first) == [0, 0, 1, 1], "idle actors take turns"
    for k, p in enumerate(preambles):
        route = router.pick([*p, 1, 2, 3])
        assert route.actor == first[k] and route.expected_cached == len(p)
        router.done(route.actor)


def test_least_busy_among_equals_and_short_matches_do_not_bind() -> None:
    router = Router(3, min_match=4 * BLOCK)
    busy = router.pick(prompt(1, 40 * BLOCK)).actor
    # No actor holds this prompt: the idle ones are preferred to the busy one.
    assert router.pick(prompt(2, 40 * BLOCK)).actor != busy
    # Three blocks in common (below min_match) is not worth queueing behind `busy`.
    short = prompt(1, 3 * BLOCK) + prompt(3, 40 * BLOCK)
    assert router.pick(short).actor != busy


def test_a_hot_prefix_spills_past_the_load_bound() -> None:
    router = Router(2, load_factor=1.5, slack=2)
    hot = prompt(1, 50 * BLOCK)
    actors = [router.pick([*hot, i]).actor for i in range(12)]
    assert set(actors) == {0, 1}
    assert max(router.loads) <= router.bound() and max(router.loads) <= 8


def test_hash_routing_is_by_the_leading_block_and_bounded() -> None:
    router = Router(4, "hash")
    lead = prompt(5, LEAD)
    a = router.pick([*lead, 1]).actor
    router.done(a)
    assert router.pick([*lead, 2, 3, 4]).actor == a  # only the leading block counts
    router.done(a)
    spread = {router.pick(prompt(k, LEAD)).actor for k in range(40)}
    assert spread == {0, 1, 2, 3}
    assert max(router.loads) <= router.bound()


def test_random_routing_uses_every_actor() -> None:
    router = Router(3, "random", seed=1)
    assert {router.pick(prompt(1, 100)).actor for _ in range(30)} == {0, 1, 2}


def test_exclusion_and_forget() -> None:
    router = Router(2)
    p = prompt(1, 10 * BLOCK)
    a = router.pick(p).actor
    router.done(a)
    assert router.pick(p, exclude=[a]).actor != a  # a retry goes elsewhere
    router.done(1 - a)
    router.forget(a)
    router.forget(1 - a)
    assert router.pick(p).expected_cached == 0  # replaced actors hold nothing
    assert router.pick(p, exclude=[0, 1]).actor in (0, 1)  # all excluded: still an answer


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="actors"):
        Router(0)
    with pytest.raises(ValueError, match="policy"):
        Router(2, "nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_factor"):
        Router(2, load_factor=0.5)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("pick"), st.integers(0, 2), st.integers(0, 40)),
        st.tuples(st.just("done"), st.integers(0, 50), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    actors=st.integers(1, 4),
    policy=st.sampled_from(["affinity", "hash", "random"]),
    ops=operations,
)
def test_loads_stay_counted_and_bounded(
    actors: int, policy: str, ops: list[tuple[str, int, int]]
) -> None:
    """Against a plain model of the requests in flight: every pick lands on a real actor, the
    loads are exactly the requests not yet done, and under affinity or hash no pick puts an
    actor past the bound it had when the pick was made (unless every actor was at it)."""
    router = Router(actors, policy, seed=0)  # type: ignore[arg-type]
    in_flight: list[int] = []
    for op, a, b in ops:
        if op == "pick":
            bound, before = router.bound(), list(router.loads)
            actor = router.pick(prompt(a, b * 7)).actor
            assert 0 <= actor < actors
            if policy != "random" and min(before) < bound:
                assert before[actor] < bound
            in_flight.append(actor)
        elif in_flight:
            router.done(in_flight.pop(a % len(in_flight)))
        assert router.loads == [in_flight.count(i) for i in range(actors)]
