"""A prefix cache larger than the KV: entries evicted from the KV kept as snapshots in host
memory and on disk, copied back when a prompt matches one (exactly: the tokens of a fresh
prefill), found again by a cache opened later on the same directory; files a crash or
another model left there are skipped. The library on the default model, then `kvfork serve`
restarted on its `--cache-dir`.

An entry copied back sits in other cells than where it was computed, and the prompt's last
token is decoded alone: the rows differ from a whole prefill's by noise (conftest's
LOGIT_NOISE), so tokens are compared by the margin rule (`assert_same_greedy`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import kvfork
import pytest

from .conftest import GREEDY, assert_same_greedy, assert_same_text, greedy_with_margins
from .serving import Server, servers

DOC = "The history of the printing press begins with movable type in Mainz. "


def docs(ctx: kvfork.Context, n: int) -> list[list[int]]:
    """`n` long prompts (~450 tokens) that share only their first few tokens."""
    return [
        ctx.tokenize(f"Document {i} of the archive. " + DOC * 30 + f"Summary of document {i}:")
        for i in range(n)
    ]


def alone(model: kvfork.Model, tokens: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens (and margins) of `tokens` prefilled in a context of its own."""
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=1) as ctx:
        b = kvfork.Branch.create(ctx, 0, GREEDY)
        b.prefill_sync(tokens)
        return greedy_with_margins(b, n)


def serve_each(
    cache: kvfork.PrefixCache, prompts: list[list[int]], n: int = 8
) -> list[tuple[list[int], list[float]]]:
    """Each prompt through the cache, `n` greedy tokens (and their margins), handed back."""
    out = []
    for prompt in prompts:
        b = cache.branch_sync(prompt, GREEDY)
        out.append(greedy_with_margins(b, n))
        cache.release(b)
    return out


def test_evicted_entries_spill_to_host_then_disk_and_come_back_exactly(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """Two sequences and five long prompts: three entries are evicted, two kept in host
    memory (its budget), one on disk. Asking for the oldest again copies it back from disk
    (all but the last token shared, none prefilled) and continues as a fresh prefill does;
    every level stays within its budget."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        prompts = docs(ctx, 5)
        cache = kvfork.PrefixCache(
            ctx, host_bytes=20_000_000, disk_dir=tmp_path, disk_bytes=100_000_000
        )
        first = serve_each(cache, prompts)
        s = cache.stats()
        assert s["evictions"] == 3 and s["entries"] == 2
        assert s["host"]["entries"] == 2 and s["host"]["bytes"] <= 20_000_000
        assert s["disk"]["entries"] == 1 and len(list(tmp_path.glob("*.kvfe"))) == 1
        b = cache.branch_sync(prompts[0], GREEDY)
        assert cache.shared_tokens(b) == len(prompts[0]) - 1
        again = [t.token for t in b.generate_sync(8)]
        assert_same_greedy(again, *first[0])
        s = cache.stats()
        assert s["disk"]["hits"] == 1 and s["disk"]["restored_tokens"] >= len(prompts[0]) - 1
        assert s["disk"]["bytes"] <= 100_000_000 and s["host"]["bytes"] <= 20_000_000
        cache.release(b)
    assert_same_greedy(again, *alone(model, prompts[0]))


def test_with_one_sequence_a_spilled_entry_comes_back_into_the_new_branch(
    model: kvfork.Model,
) -> None:
    """A context of one sequence (every lease taken by the request being made, as on a busy
    server): the spilled entry is copied into the new branch's own sequence, no second lease
    needed, and a prompt that extends it prefills only the extension."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=1) as ctx:
        prompts = docs(ctx, 2)
        cache = kvfork.PrefixCache(ctx, host_bytes=50_000_000)
        first = serve_each(cache, prompts)
        longer = prompts[0] + ctx.tokenize(" More of it, please.", add_special=False)
        b = cache.branch_sync(longer, GREEDY)
        # The entry held the prompt and its 8 tokens; the new prompt shares only the prompt.
        assert cache.shared_tokens(b) == len(prompts[0])
        assert cache.stats()["host"]["hits"] == 1
        cache.release(b)
        again = serve_each(cache, [prompts[1]])
        assert_same_greedy(again[0][0], *first[1])


def assert_as_fresh(model: kvfork.Model, tokens: list[int], got: list[int]) -> None:
    """`got` are the greedy tokens of `tokens` prefilled alone, up to its first near-tie."""
    expected, margins = alone(model, tokens, len(got))
    for i, (g, want) in enumerate(zip(got, expected, strict=True)):
        if margins[i] < 1.0:
            break
        assert g == want, i


@pytest.mark.parametrize("anchor_stays", [True, False])
def test_an_entry_that_shared_a_preamble_spills_only_its_own_cells(
    model: kvfork.Model, anchor_stays: bool
) -> None:
    """Two prompts on one long preamble: the second shares it from the first. Evicted while
    the first still holds the preamble, the second is spilled with its own cells only (under
    half a whole snapshot's bytes); asked for again, it comes back with the preamble's cells
    taken from the branch that holds them. When nobody holds them any more, the spilled entry
    that does (the first, spilled too) comes back instead and the rest is prefilled. Either
    way the continuation is a fresh prefill's."""
    question = " Question {}: what came next in the story, and who wrote it down, and why?"
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        preamble = ctx.tokenize("Shared instructions for every question. " + DOC * 24)
        qa, qb = (preamble + ctx.tokenize(question.format(x), add_special=False) for x in "AB")
        common = next(i for i, (x, y) in enumerate(zip(qa, qb)) if x != y)
        assert len(qb) - common > 16  # its own part is worth restoring
        whole = kvfork.Branch.create(ctx, 0, GREEDY)
        whole.prefill_sync(qb)
        whole_bytes = len(whole.snapshot_sync())
        whole.prune_sync()
        cache = kvfork.PrefixCache(ctx, host_bytes=400_000_000)
        serve_each(cache, [qa, qb])
        # A's prompt again: its new branch needs a lease, and B (least recently used) goes.
        serve_each(cache, [qa])
        s = cache.stats()
        assert s["host"]["entries"] == 1
        assert s["host"]["bytes"] < 0.5 * whole_bytes, (s["host"]["bytes"], whole_bytes)
        if not anchor_stays:  # two other long prompts push A's entries out of the KV too
            serve_each(cache, docs(ctx, 2), 2)
        b = cache.branch_sync(qb, GREEDY)
        assert cache.shared_tokens(b) == (len(qb) - 1 if anchor_stays else common)
        got = [t.token for t in b.generate_sync(8)]
        cache.release(b)
        assert cache.stats()["host"]["hits"] == 1
    assert_as_fresh(model, qb, got)


@pytest.mark.parametrize("family", ["mamba", "lfm2", "granitehybrid"])
def test_a_recurrent_entry_comes_back_up_to_its_checkpoint_where_a_prompt_parts_from_it(
    family_models: Callable[[str], kvfork.Model], family: str
) -> None:
    """On recurrent and hybrid models a spilled entry carries its recurrent-state
    checkpoints: a prompt that parts from it inside (where the snapshot's final state is of
    no use) gets it back up to the last checkpoint before that point, prefills the rest, and
    continues as a fresh prefill does. Prefill decodes of 64 tokens leave a checkpoint every
    64 tokens."""
    model = family_models(family)
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=1, n_batch=64) as ctx:
        cache = kvfork.PrefixCache(ctx, host_bytes=64 << 20)
        first = ctx.tokenize(DOC * 12)
        assert len(first) > 130
        serve_each(cache, [first], 4)
        parting = first[:100] + ctx.tokenize(" A different ending.", add_special=False)
        b = cache.branch_sync(parting, GREEDY)  # the one sequence: the entry spills first
        assert cache.shared_tokens(b) == 64  # its last checkpoint before token 100
        got = [t.token for t in b.generate_sync(8)]
        cache.release(b)
        s = cache.stats()
        assert s["host"]["hits"] == 1 and s["host"]["restored_tokens"] == 64
        assert ctx.stats()["checkpoint_restores"] >= 1
    assert_same_greedy(got, *alone(model, parting))


def test_entries_over_max_cached_tokens_spill_too(model: kvfork.Model) -> None:
    """`max_cached_tokens` evicts when an entry is released (never waiting: its snapshot is
    kept by a thread of its own), and the spilled entry comes back like any other."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=4) as ctx:
        prompts = docs(ctx, 2)
        cache = kvfork.PrefixCache(ctx, max_cached_tokens=600, host_bytes=50_000_000)
        first = serve_each(cache, prompts)
        deadline = time.monotonic() + 30
        while cache.stats()["host"]["entries"] < 1:
            assert time.monotonic() < deadline, cache.stats()
            time.sleep(0.05)
        assert cache.stats()["entries"] == 1
        b = cache.branch_sync(prompts[0], GREEDY)
        assert cache.shared_tokens(b) == len(prompts[0]) - 1
        assert_same_greedy([t.token for t in b.generate_sync(8)], *first[0])
        cache.release(b)


def test_a_request_right_after_a_release_waits_for_the_lease_its_eviction_frees(
    model: kvfork.Model,
) -> None:
    """`release` over `max_cached_tokens` queues the entry's snapshot and prune without waiting;
    on a context of one lease, the next request finds no lease and no entry while they run,
    and waits for that lease instead of raising LeaseExhaustedError (7 of 8 did)."""
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=1) as ctx:
        cache = kvfork.PrefixCache(ctx, max_cached_tokens=1, host_bytes=64 << 20)
        for word in ("rivers", "mountains", "printing", "engines", "castles", "forests"):
            prompt = ctx.tokenize(f"A long text about {word}. " * 8)
            cache.release(cache.branch_sync(prompt, GREEDY))
        assert cache.stats()["live"] == 0
        # The last release's eviction may still run: making room waits for it (none to evict).
        assert cache.make_room_sync(1) == 0
        kvfork.Branch.create(ctx, 0, GREEDY).prune_sync()


def test_without_room_on_any_level_an_evicted_entry_is_dropped(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """A host budget smaller than one snapshot and a disk budget of zero keep nothing: the
    evicted entry is prefilled again when asked for."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=1) as ctx:
        prompts = docs(ctx, 2)
        cache = kvfork.PrefixCache(ctx, host_bytes=1000, disk_dir=tmp_path, disk_bytes=0)
        serve_each(cache, prompts)
        s = cache.stats()
        assert s["evictions"] == 1 and s["host"]["entries"] == s["disk"]["entries"] == 0
        b = cache.branch_sync(prompts[0], GREEDY)
        assert cache.shared_tokens(b) == 0
        cache.release(b)


def test_a_disk_budget_without_a_directory_is_refused(ctx: kvfork.Context) -> None:
    with pytest.raises(ValueError, match="disk_dir"):
        kvfork.PrefixCache(ctx, host_bytes=1000, disk_bytes=10_000)


def test_a_directory_the_cache_cannot_write_to_is_refused_when_it_opens(
    ctx: kvfork.Context,
) -> None:
    """Not found out at the first spill: `/proc/1` exists, and nobody, root included, may
    create a file there."""
    with pytest.raises(OSError, match="/proc/1"):
        kvfork.PrefixCache(ctx, host_bytes=1000, disk_dir="/proc/1", disk_bytes=10_000)


def test_a_cache_opened_later_finds_the_entries_and_skips_what_a_crash_left(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """`spill_all` writes every entry to disk; a cache opened later on the directory serves
    each prompt from it exactly. A half-written file (`.tmp`) a crash left long ago, a
    truncated entry, a file that is not one are skipped or refused, never loaded: their
    prompts are prefilled. A recent `.tmp` may be another cache's write under way: kept."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        prompts = docs(ctx, 3)
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=200_000_000)
        first = serve_each(cache, prompts)
        assert cache.spill_all() == 3
        assert cache.stats()["entries"] == 0
    files = sorted(tmp_path.glob("*.kvfe"))
    assert len(files) == 3
    # What a crash could leave: a write cut short, a truncated entry, garbage.
    (tmp_path / "00000000000000ff.tmp").write_bytes(files[0].read_bytes()[:1000])
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / "00000000000000ff.tmp", (an_hour_ago, an_hour_ago))
    (tmp_path / "0000000000000101.tmp").write_bytes(b"being written")
    truncated = files[2].read_bytes()
    files[2].write_bytes(truncated[: len(truncated) // 2])
    (tmp_path / "0000000000000100.kvfe").write_bytes(b"not an entry")
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path)  # disk_bytes None: no bound
        assert not (tmp_path / "00000000000000ff.tmp").exists()
        assert (tmp_path / "0000000000000101.tmp").exists()
        assert not (tmp_path / "0000000000000100.kvfe").exists()
        again = []
        for prompt in prompts:
            b = cache.branch_sync(prompt, GREEDY)
            again.append((cache.shared_tokens(b) or 0, [t.token for t in b.generate_sync(8)]))
            cache.release(b)
        for (_, tokens), (expected, margins) in zip(again, first, strict=True):
            assert_same_greedy(tokens, expected, margins)
        # The two whole files are restored; the truncated one is refused and prefilled.
        assert [shared > 0 for shared, _ in again] == [True, True, False]
        assert cache.stats()["disk"]["hits"] == 2
        # Restored entries keep their files (a crash now loses nothing that was on disk);
        # the truncated one is gone.
        assert len(list(tmp_path.glob("*.kvfe"))) == 2
        assert not files[2].exists()


def header_len(entry: bytes) -> int:
    """The length of a `.kvfe` file's header: magic, version, layout, anchor, then the count
    of its tokens (`prefix_spill.rs::header`) and the tokens."""
    n: int = struct.unpack_from("<I", entry, 20)[0]
    return 24 + 4 * n


def test_a_file_whose_snapshot_is_another_prompts_is_refused_not_restored(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """The header (the tokens a file is indexed under) is outside the snapshot's checksum: a
    file with one prompt's header and another's whole snapshot must not serve the first
    prompt with the second's cells. The snapshot's own tokens are checked."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        a, b = docs(ctx, 2)
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=200_000_000)
        (expected, margins), _ = serve_each(cache, [a, b])
        assert cache.spill_all() == 2
    files = {f.read_bytes()[24 : 24 + 4 * len(a)]: f for f in tmp_path.glob("*.kvfe")}
    file_a = files.pop(struct.pack(f"<{len(a)}i", *a))
    (file_b,) = files.values()
    header_a, entry_b = file_a.read_bytes(), file_b.read_bytes()
    file_a.write_bytes(header_a[: header_len(header_a)] + entry_b[header_len(entry_b) :])
    file_b.unlink()
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path)
        branch = cache.branch_sync(a, GREEDY)
        assert cache.shared_tokens(branch) == 0
        assert_same_greedy([t.token for t in branch.generate_sync(8)], expected, margins)
        assert cache.stats()["disk"]["entries"] == 0 and not list(tmp_path.glob("*.kvfe"))


def test_two_caches_on_one_directory_keep_their_own_files(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """Each numbers its files in a range of its own (both numbered from 0, and each overwrote
    the other's: every prompt came back cold); each restores its own prompts, and their
    counts add up to the files there."""
    contexts = [kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=2) for _ in range(2)]
    caches = [kvfork.PrefixCache(c, disk_dir=tmp_path, disk_bytes=200_000_000) for c in contexts]
    prompts = docs(contexts[0], 4)
    mine = {0: prompts[:2], 1: prompts[2:]}
    for i, cache in enumerate(caches):
        serve_each(cache, mine[i], n=1)
        assert cache.spill_all() == 2
    assert len(list(tmp_path.glob("*.kvfe"))) == 4
    for i, cache in enumerate(caches):
        for prompt in mine[i]:
            b = cache.branch_sync(prompt, GREEDY)
            assert cache.shared_tokens(b) == len(prompt) - 1
            cache.release(b)
    on_disk = sum(c.stats()["disk"]["entries"] for c in caches)
    assert on_disk == len(list(tmp_path.glob("*.kvfe")))
    for c in contexts:
        c.close()


def test_an_entry_a_prompt_cannot_use_stays_for_the_prompts_that_can(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """A prompt that parts from a spilled entry past the sliding window (Gemma 3: 512) cannot
    restore it (the window's older cells are not in the snapshot) and is prefilled; the entry
    stays on disk for its own prompt, which it serves whole."""
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=1) as ctx:
        long = ctx.tokenize("Document 1. " + DOC * 70)
        assert len(long) > model.n_swa + 300
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=200_000_000)
        for prompt in (long, docs(ctx, 1)[0]):  # `long` to disk, freeing the lease
            cache.release(cache.branch_sync(prompt, GREEDY))
        assert cache.stats()["disk"]["entries"] == 1
        parting = long[:700] + ctx.tokenize(" A different ending.", add_special=False)
        b = cache.branch_sync(parting, GREEDY)
        assert cache.shared_tokens(b) == 0
        cache.release(b)
        b = cache.branch_sync(long, GREEDY)
        assert cache.shared_tokens(b) == len(long) - 1
        assert cache.stats()["disk"]["hits"] == 1


def test_a_request_cancelled_after_restoring_an_entry_gives_it_back(
    model: kvfork.Model, tmp_path: Path
) -> None:
    """Cancelled while it prefills its own suffix, after the entry it shares came back from
    disk: the rollback drops the restored cells, and the entry stays on disk (the next
    request for it restores it)."""

    async def scenario() -> None:
        async with kvfork.create_context(model, n_ctx=4096, n_seq_max=1) as ctx:
            a, b = docs(ctx, 2)
            cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=200_000_000)
            for prompt in (a, b):  # a to disk
                cache.release(await cache.branch(prompt, GREEDY))
            suffix = ctx.tokenize(" Why did it matter?" * 600, add_special=False)
            task = asyncio.ensure_future(cache.branch(a + suffix, GREEDY))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until a's entry is back in the KV
                if cache.stats()["disk"]["hits"] or task.done():
                    break
                await asyncio.sleep(0)  # at once: the suffix's prefill is short on a GPU
            assert cache.stats()["disk"]["hits"] == 1 and not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert cache.stats()["disk"]["entries"] >= 1
            again = await cache.branch(a, GREEDY)
            assert cache.shared_tokens(again) == len(a) - 1
            assert cache.stats()["disk"]["hits"] == 2
            cache.release(again)

    asyncio.run(scenario())


def test_requests_cancelled_at_random_never_lose_the_entry_they_share(
    model: kvfork.Model,
) -> None:
    """Four requests at once for a spilled prompt (two of them for the prompt and a word),
    each under a random timeout, round after round with `max_cached_tokens=0`: each round
    restores the entry and then hands back (or releases) branches holding the prompt, so the
    spill holds it after every round. A request whose source entry was evicted between its
    lookup and its fork restored the entry itself and took it as spent at once: cancelled
    during its prefill, it dropped the entry (about one round in ten, then the next request
    prefilled cold)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]

    async def scenario() -> None:
        async with kvfork.create_context(model, n_ctx=2048, n_seq_max=6) as ctx:
            prompt = ctx.tokenize("Doc: " + " ".join(rng.choice(words) for _ in range(80)))
            more = ctx.tokenize(" more", add_special=False)
            # Room in host memory for one entry of this prompt (~2.6 MB), no disk.
            cache = kvfork.PrefixCache(ctx, max_cached_tokens=0, host_bytes=3_000_000)

            async def spilled() -> int:
                """The spill's entries once it has one (the evictions run in the background),
                or after 10 s."""
                for _ in range(1000):
                    if cache.stats()["host"]["entries"]:
                        break
                    await asyncio.sleep(0.01)
                return int(cache.stats()["host"]["entries"])

            async def request(k: int) -> None:
                tokens = prompt + ([] if k % 2 else more)
                timeout = rng.choice([0.01, 0.05, 0.2, 5.0])
                try:
                    branch = await asyncio.wait_for(cache.branch(tokens, GREEDY), timeout)
                except asyncio.TimeoutError:
                    return
                cache.release(branch)

            cache.release(await cache.branch(prompt, GREEDY))
            assert await spilled() == 1
            for round_ in range(24):
                await asyncio.gather(*(request(k) for k in range(4)))
                assert await spilled() == 1, f"round {round_}: the entry was lost"
            assert cache.stats()["live"] == 0

    asyncio.run(scenario())


def test_entries_of_another_model_are_left_alone(
    chat_model: kvfork.Model, family_models: Callable[[str], kvfork.Model], tmp_path: Path
) -> None:
    """Entries written by one model, on a directory a cache of another model opens (with the
    same tokenizer and cache types: the tiny MoE copies SmolLM2's): not its own, so not
    indexed, counted against its budget, restored or removed (a server of another model on
    a shared `--cache-dir` deleted them); the prompt is prefilled, and the first model's
    cache finds its entry again."""
    with kvfork.create_context_sync(chat_model, n_ctx=2048, n_seq_max=1) as ctx:
        prompt = docs(ctx, 1)[0]
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=100_000_000)
        serve_each(cache, [prompt])
        assert cache.spill_all() == 1
    with kvfork.create_context_sync(family_models("qwen3moe"), n_ctx=1024, n_seq_max=1) as ctx:
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=1)  # room for nothing
        assert cache.stats()["disk"]["entries"] == 0
        b = cache.branch_sync(prompt, GREEDY)
        assert cache.shared_tokens(b) == 0
        cache.release(b)  # spilled nowhere: its budget holds nothing
    assert len(list(tmp_path.glob("*.kvfe"))) == 1
    with kvfork.create_context_sync(chat_model, n_ctx=2048, n_seq_max=1) as ctx:
        cache = kvfork.PrefixCache(ctx, disk_dir=tmp_path, disk_bytes=100_000_000)
        assert cache.stats()["disk"]["entries"] == 1
        b = cache.branch_sync(prompt, GREEDY)
        assert cache.shared_tokens(b) == len(prompt) - 1
        cache.release(b)


def complete(server: Server, prompt: str) -> tuple[str, int]:
    """A greedy 8-token completion of `prompt` from `server`: its text and how many prompt
    tokens came from the cache."""
    reply = server.client().completions.create(
        model="x", prompt=prompt, max_tokens=8, temperature=0
    )
    usage = reply.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return reply.choices[0].text, (details.cached_tokens or 0) if details else 0


def same_text(got: str, expected: str, model: kvfork.Model, prompt: str) -> None:
    """Two servers' greedy 8-token texts for `prompt` (one prefilled it whole, the other had
    it from its cache directory) are equal up to the first near-tie of a reference prefilled
    here (`conftest.assert_same_text`)."""
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=1) as ctx:
        b = kvfork.Branch.create(ctx, 0, GREEDY)
        b.prefill_sync(ctx.tokenize(prompt))
        tokens, margins = greedy_with_margins(b, 8)
        pieces = [ctx.token_to_text(t) for t in tokens]
    assert_same_text(got, expected, pieces, margins)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-cache")


def start(cache_dir: Path) -> Iterator[Server]:
    for begin in servers():
        yield begin(
            "default",
            "--n-ctx",
            "4096",
            "--n-seq-max",
            "2",
            "--cache-ram",
            "64",
            "--cache-dir",
            str(cache_dir),
        )


def test_a_restarted_server_serves_a_repeated_long_prompt_from_its_cache_dir(
    cache_dir: Path, model: kvfork.Model
) -> None:
    """`kvfork serve --cache-dir`: a long prompt served, the server stopped (SIGTERM writes
    its entries to the directory), a new server on the same directory serves the same
    prompt with all but its last token cached, and the same text."""
    prompt = "Document 7 of the archive. " + DOC * 30 + "Summary of document 7:"

    first_server = start(cache_dir)
    server = next(first_server)
    text, cached = complete(server, prompt)
    assert cached == 0
    log = server.stop()
    assert "1 cache entries in" in log, log[-2000:]
    second_server = start(cache_dir)
    server = next(second_server)
    again, cached = complete(server, prompt)
    same_text(again, text, model, prompt)
    assert cached > 400
    server.assert_at_rest()
    for gen in (first_server, second_server):
        with pytest.raises(StopIteration):
            next(gen)


def test_a_server_killed_while_it_spills_restarts_on_what_it_left(
    tmp_path_factory: pytest.TempPathFactory, model: kvfork.Model
) -> None:
    """`kvfork serve --cache-dir` with no host memory writes each evicted entry to disk at
    once. Killed (SIGKILL) right after a request that evicts one, perhaps mid-write, it leaves
    a directory the next server starts on: entries written whole are served from there, with
    the same text; whatever the kill cut short is skipped."""
    directory = tmp_path_factory.mktemp("killed-cache")
    # Greedy continues these with clear margins (1.4 and over for 8 tokens).
    prompts = [
        f"Document {i} of the archive. " + DOC * 30 + f"Summary of document {i}:" for i in range(3)
    ]

    args = ("default", "--n-ctx", "4096", "--n-seq-max", "1", "--cache-dir", str(directory))
    for begin in servers():
        first = begin(*args)
        text0, _ = complete(first, prompts[0])
        complete(first, prompts[1])  # evicts prompt 0's entry: written to the directory

        def ask_quietly(server: Server, prompt: str) -> None:
            with contextlib.suppress(Exception):  # the server is killed under it
                complete(server, prompt)

        threading.Thread(target=ask_quietly, args=(first, prompts[2]), daemon=True).start()
        time.sleep(0.3)  # the third request evicts prompt 1's entry meanwhile
        first.process.kill()
        first.process.wait(timeout=30)
        first.stopped = "killed"  # not a clean stop: nothing to check in its log
        second = begin(*args)
        again, cached = complete(second, prompts[0])
        same_text(again, text0, model, prompts[0])
        assert cached > 400
        second.assert_at_rest()
