"""kvfork.ray on a local Ray cluster (2 CPUs, no network): the same branch programs give the
same results in a pool and in-process, concurrent jobs on one actor share decodes, affinity
holds, and faults (a killed actor, a raising job, an unpicklable result) come back as errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kvfork
import pytest

ray = pytest.importorskip("ray")
import kvfork.ray as kray  # noqa: E402  (after the skip: needs ray)
from ray import cloudpickle  # noqa: E402

from . import ray_jobs as jobs  # noqa: E402
from .conftest import example  # noqa: E402

# The best-of-N program of examples/ray_best_of_n.py: every fork's text, ranked.
ranked = example("ray_best_of_n").ranked

CONTEXT: dict[str, Any] = {"n_ctx": 1024, "n_seq_max": 8, "n_threads": 1}
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # Workers cannot import the tests package or the examples: ship them by value.
    for module in (jobs, example("ray_best_of_n")):
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    for module in (jobs, example("ray_best_of_n")):
        cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def path() -> str:
    return str(kvfork.default_model_path())


@pytest.fixture
async def pool2(cluster: None, path: str) -> AsyncIterator[kray.ContextPool]:
    async with kray.ContextPool(path, num_actors=2, **CONTEXT) as pool:
        await pool.ready()
        yield pool


@pytest.fixture
async def pool1(cluster: None, path: str) -> AsyncIterator[kray.ContextPool]:
    async with kray.ContextPool(path, num_actors=1, **CONTEXT) as pool:
        await pool.ready()
        yield pool


async def test_pool_gives_the_in_process_results_and_uses_both_actors(
    pool2: kray.ContextPool, path: str
) -> None:
    question = "What is the capital of France?"
    async with kvfork.create_context(path, **CONTEXT) as ctx:
        want_best = await ranked(ctx, jobs.PROMPT, 3, 16)
        want_chat = await jobs.chat_turn(ctx, question)
    assert len({text for text, _ in want_best}) > 1, "seeded forks should differ"

    # Sequential jobs alternate between the idle actors: each actor runs each program once.
    for _ in range(2):
        assert await pool2.run(ranked, jobs.PROMPT, 3, 16) == want_best
        assert await pool2.run(jobs.chat_turn, question) == want_chat
    stats = await pool2.stats()
    assert pool2.num_actors == 2
    assert [s["jobs_done"] for s in stats] == [2, 2]
    assert len({s["pid"] for s in stats}) == 2
    assert all(s["decode_calls"] > 0 and s["running"] == 0 for s in stats)


async def test_concurrent_jobs_on_one_actor_share_decodes(pool1: kray.ContextPool) -> None:
    steps = 32
    before = (await pool1.stats())[0]["decode_calls"]
    prompts = [", ".join(str(i) for i in range(k, k + 8)) + "," for k in range(8)]
    got = await asyncio.gather(*(pool1.run(jobs.greedy, p, steps) for p in prompts))
    decodes = (await pool1.stats())[0]["decode_calls"] - before
    assert all(len(tokens) == steps for tokens in got)
    # 8 jobs x (1 prefill + 32 steps) alone would be 264 decodes; shared, about 1 per step.
    assert decodes / steps <= 1.2, f"{decodes} decodes for {steps} steps of 8 jobs"


async def test_affinity_sends_a_key_to_one_actor_and_its_warm_branch(
    pool2: kray.ContextPool,
) -> None:
    system = "You are a terse assistant. Answer in one word."
    # Started at once, behind jobs that keep both actors busy unevenly.
    busy = [asyncio.ensure_future(pool2.run(jobs.sleep_then, 0.5)) for _ in range(3)]
    keyed = [
        asyncio.ensure_future(
            pool2.run(jobs.fork_from_system, system, f"Question {i}?", affinity="sys")
        )
        for i in range(6)
    ]
    await asyncio.gather(*busy)
    answers = await asyncio.gather(*keyed)
    assert len({pid for pid, _ in answers}) == 1
    assert len({handle for _, handle in answers}) == 1, "the warm branch was built once"
    later = await pool2.run(jobs.fork_from_system, system, "Again?", affinity="sys")
    assert later == answers[0]
    other = await pool2.run(jobs.pid, affinity="other")
    assert other in {s["pid"] for s in await pool2.stats()}


async def test_a_job_error_keeps_its_type(pool1: kray.ContextPool) -> None:
    with pytest.raises(ValueError, match="boom"):
        await pool1.run(jobs.raise_value_error, "boom")
    with pytest.raises(kvfork.GrammarError):
        await pool1.run(jobs.bad_grammar)
    with pytest.raises(kvfork.KvforkError, match="NeedsTwoArgs: 1/2"):
        await pool1.run(jobs.raise_unpicklable_error)
    # The actor is unharmed.
    assert await pool1.run(jobs.greedy, jobs.PROMPT, 2)


async def test_a_job_raising_what_is_no_exception_leaves_the_actor_serving(
    pool1: kray.ContextPool,
) -> None:
    """A job's KeyboardInterrupt or SystemExit comes back as a KvforkError naming it (it
    stopped the actor's event loop: every later call hung), and the actor goes on."""
    for kind, name in (("interrupt", "KeyboardInterrupt"), ("exit", "SystemExit")):
        with pytest.raises(kvfork.KvforkError, match=f"the job raised {name}"):
            await pool1.run(jobs.raise_base, kind)
        assert await asyncio.wait_for(pool1.run(jobs.greedy, jobs.PROMPT, 2), 60)


async def test_a_cancelled_job_stops_on_its_actor(pool1: kray.ContextPool) -> None:
    """A call cancelled (a timeout) cancels its job at its next await in the actor: it ran
    on, holding its lease, until it ended by itself. A job that prunes in `finally` gives
    its lease back."""
    free = (await pool1.stats())[0]["free_leases"]
    for _ in range(3):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool1.run(jobs.hold_a_lease, 3600), 2)
    for _ in range(100):
        stats = (await pool1.stats())[0]
        if stats["running"] == 0 and stats["free_leases"] == free:
            break
        await asyncio.sleep(0.1)
    assert (stats["running"], stats["free_leases"]) == (0, free)


async def test_an_unpicklable_result_is_a_clear_error(pool1: kray.ContextPool) -> None:
    with pytest.raises(kvfork.KvforkError, match="cannot be pickled"):
        await pool1.run(jobs.unpicklable)


async def test_a_killed_actor_fails_its_job_and_is_replaced(pool2: kray.ContextPool) -> None:
    job = asyncio.ensure_future(pool2.run(jobs.sleep_then, 60))
    # Polls the actors' own counters: no event crosses the process boundary.
    while not (running := [s["actor"] for s in await pool2.stats() if s["running"]]):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    ray.kill(pool2.actors[running[0]])
    with pytest.raises(kvfork.KvforkError, match="died"):
        await job
    assert sum(s["replaced"] for s in await pool2.stats()) == 1
    # Later jobs succeed, on both actors (the replacement included).
    pids = await asyncio.gather(*(pool2.run(jobs.sleep_then, 0.2) for _ in range(4)))
    assert len(set(pids)) == 2
    assert await pool2.run(jobs.greedy, jobs.PROMPT, 2)


async def test_bad_model_and_shutdown(cluster: None, path: str, tmp_path: Any) -> None:
    missing = tmp_path / "missing.gguf"
    with kray.ContextPool(missing, num_actors=1) as pool, pytest.raises(kvfork.ModelLoadError):
        await pool.ready()
    with pytest.raises(kvfork.KvforkError, match="shut down"):
        await pool.run(jobs.pid)
    with kray.ContextPool(path, n_ctx=-5) as pool, pytest.raises(ValueError, match="n_ctx") as bad:
        await pool.ready()
    assert type(bad.value) is ValueError  # the option's own error, not Ray's wrapper
    with pytest.raises(ValueError, match="num_actors"):
        kray.ContextPool(path, num_actors=0)
    # A job in flight when the pool shuts down says so (not that its actor was replaced).
    pool = kray.ContextPool(path, num_actors=1, **CONTEXT)
    await pool.ready()
    job = asyncio.ensure_future(pool.run(jobs.sleep_then, 60))
    while not (await pool.stats())[0]["running"]:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    pool.shutdown()
    with pytest.raises(kvfork.KvforkError, match="the pool was shut down while this job ran"):
        await job


def test_run_sync(cluster: None, path: str) -> None:
    with kray.ContextPool(path, num_actors=1, **CONTEXT) as pool:
        with pytest.raises(ValueError, match="sync boom"):
            pool.run_sync(jobs.raise_value_error, "sync boom")
        assert len(pool.run_sync(jobs.greedy, jobs.PROMPT, 3)) == 3


async def test_shared_runs_its_factory_once_per_context_and_retries_failures(
    model: kvfork.Model,
) -> None:
    calls = 0

    async def factory() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        if calls == 1:
            raise RuntimeError("first try fails")
        return calls

    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as a:
        with pytest.raises(RuntimeError):
            await kray.shared(a, "k", factory)
        got = await asyncio.gather(*(kray.shared(a, "k", factory) for _ in range(5)))
        assert got == [2] * 5
        with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as b:
            assert await kray.shared(b, "k", factory) == 3
