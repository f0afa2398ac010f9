"""The raw context layer (lloyal.node's low level): lloyal.node's README example
and 1.0.7's best-of-N example ported line by line, giving the tokens kvfork's own idiom gives;
`ctx.decode`, `Branch.create` over a sequence's cells, `fork(seq_id=)`, `capture_logits`,
`decode_and_capture_one`, `destroy`, and the context-level metrics of the last output, with
every rule they refuse by."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import kvfork
import numpy as np
import pytest

from .conftest import GREEDY, PROMPT, Trace, assert_close_logits, assert_follows, record

# The README example's prompt and its four reasoning prefixes.
QUESTION = "Explain quantum entanglement"
PREFIXES = [
    "Think of it like two coins...",
    "In quantum mechanics, the...",
    "What happens when you measure...",
    "Imagine two particles...",
]
# The README's `{ temperature: 0.8 }`, seeded so that two runs can be compared.
PARAMS = kvfork.SamplingParams(temperature=0.8, seed=11)
STEPS = 12  # the README loops until every branch stops; a test stops after STEPS tokens


@pytest.fixture
def six(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=6) as c:
        yield c


async def readme_ported(ctx: kvfork.Context) -> tuple[list[list[int]], int, int]:
    """lloyal.node's README's first example, line by line (async calls awaited)."""
    store = kvfork.BranchStore(ctx)

    prompt = ctx.tokenize(QUESTION)
    await ctx.decode(prompt, 0, 0)

    root = kvfork.Branch.create(ctx, len(prompt), PARAMS)
    root.capture_logits()

    analogy = await root.fork()
    formal = await root.fork()
    socratic = await root.fork()
    visual = await root.fork()

    await store.prefill(
        [
            (analogy, ctx.tokenize(PREFIXES[0])),
            (formal, ctx.tokenize(PREFIXES[1])),
            (socratic, ctx.tokenize(PREFIXES[2])),
            (visual, ctx.tokenize(PREFIXES[3])),
        ]
    )

    branches = [analogy, formal, socratic, visual]
    committed: dict[kvfork.Branch, list[int]] = {b: [] for b in branches}
    for _ in range(STEPS):
        live = [b for b in branches if not b.disposed]
        if not live:
            break
        produced = [(b, await b.produce()) for b in live]

        for b, p in produced:
            if p.is_stop:
                await b.prune()

        items = [(b, p.token) for b, p in produced if not p.is_stop]
        for b, t in items:
            b.accept(t)
            committed[b].append(t)
        await store.commit(items)

    winner = min((b for b in branches if not b.disposed), key=lambda b: b.perplexity)
    await store.retain_only(winner)
    return [committed[b] for b in branches], branches.index(winner), store.available


async def readme_idiom(ctx: kvfork.Context) -> tuple[list[list[int]], int, int]:
    """The same program as kvfork writes it: the root prefills its prompt, steps are
    `store.step`."""
    store = kvfork.BranchStore(ctx)
    root = kvfork.Branch.create(ctx, 0, PARAMS)
    await root.prefill(ctx.tokenize(QUESTION))
    branches = [await root.fork() for _ in PREFIXES]
    await store.prefill([(b, ctx.tokenize(p)) for b, p in zip(branches, PREFIXES, strict=True)])
    committed: list[list[int]] = [[] for _ in branches]
    live = list(branches)
    for _ in range(STEPS):
        if not live:
            break
        tokens = await store.step(live)
        for b, tok in zip(live, tokens, strict=True):
            if tok.is_stop:
                await b.prune()
            else:
                committed[branches.index(b)].append(tok.token)
        live = [b for b in live if not b.disposed]
    winner = min(live, key=lambda b: b.perplexity)
    await store.retain_only(winner)
    return committed, branches.index(winner), store.available


async def test_the_readme_example_ported_gives_the_idiom_s_tokens(model: kvfork.Model) -> None:
    runs = []
    for program in (readme_ported, readme_idiom):
        async with await kvfork.create_context(model, n_ctx=1024, n_seq_max=6) as ctx:
            runs.append(await program(ctx))
    (ported, ported_winner, available), (idiom, idiom_winner, _) = runs
    # Both programs run the same decodes over the same cells (the prompt in sequence 0's
    # first cells, the forks' prefixes packed in one decode, one decode a step for the live
    # branches): the same logits bit for bit, so the seeded draws are compared exactly. Until
    # a branch stops: the port prunes it before that step's decode, the idiom after, so the
    # decodes after it run over other cells (their rows then differ by noise).
    stopped = min(len(t) for t in ported + idiom)  # the step a branch stopped at, or STEPS
    assert [t[: stopped + 1] for t in ported] == [t[: stopped + 1] for t in idiom]
    assert len({tuple(t) for t in ported}) > 1  # the prefixes made the branches diverge
    if stopped == STEPS:  # no branch stopped (as here)
        assert ported == idiom and ported_winner == idiom_winner
    assert available == 6 - 1  # store.available === nSeqMax - 1


BEST_OF_N_STEPS = 50


async def best_of_n_ported(ctx: kvfork.Context, tokens: list[int]) -> tuple[list[Trace], int]:
    """1.0.7's Branch best-of-N example, line by line, after the prefill it assumes
    (`ctx.decode(tokens, 0, 0)`). Its calls are sync there and awaited here. Observed on the
    way: each committed token and the row it was drawn from."""
    await ctx.decode(tokens, 0, 0)
    committed: dict[kvfork.Branch, Trace] = {}

    root = kvfork.Branch.create(ctx, len(tokens), {"temperature": 0.8}, seq_id=0)
    root.capture_logits()

    candidates = []
    for i, seq_id in enumerate([1, 2, 3, 4, 5]):
        branch = await root.fork(seq_id=seq_id)
        branch.reseed_sampler(1000 + i)
        candidates.append(branch)
        committed[branch] = Trace([], [])

    for _ in range(BEST_OF_N_STEPS):
        for branch in candidates:
            row = branch.logits()  # observed, not in the example
            token, _, is_stop = await branch.produce()
            if is_stop:
                continue
            await branch.commit(token)
            committed[branch].tokens.append(token)
            committed[branch].rows.append(row)

    best = min(candidates, key=lambda b: b.perplexity)
    for c in candidates:
        if c != best:
            await c.prune()
    assert [c.seq_id for c in candidates if not c.disposed] == [best.seq_id]
    return [committed[c] for c in candidates], candidates.index(best)


async def best_of_n_idiom(ctx: kvfork.Context, tokens: list[int]) -> tuple[list[Trace], int]:
    """The same as kvfork writes it: prefill the root, fork with `seed=`, generate. Observed on
    the way: each token and the row it was drawn from."""
    root = kvfork.Branch.create(ctx, 0, {"temperature": 0.8})
    await root.prefill(tokens)
    candidates = [await root.fork(seed=1000 + i) for i in range(5)]
    outputs: list[Trace] = []
    for c in candidates:
        rows, got = [c.logits()], []
        async for t in c.generate(max_tokens=BEST_OF_N_STEPS):
            got.append(t.token)
            rows.append(c.logits())  # commit-before-yield: the next token's row
        outputs.append(Trace(got, rows[: len(got)]))
    best = min(candidates, key=lambda b: b.perplexity)
    return outputs, candidates.index(best)


async def test_the_best_of_n_example_ported_gives_the_idiom_s_tokens(model: kvfork.Model) -> None:
    runs = []
    for program in (best_of_n_ported, best_of_n_idiom):
        async with await kvfork.create_context(model, n_ctx=1024, n_seq_max=6) as ctx:
            runs.append(await program(ctx, ctx.tokenize(PROMPT)))
    (ported, ported_best), (idiom, idiom_best) = runs
    # The port's candidates (forks reseeded with `reseed_sampler`) have the idiom's samplers
    # (forks with `seed=`): one set up as the port does draws the idiom's tokens from the
    # idiom's rows, exactly.
    async with await kvfork.create_context(model, n_ctx=1024, n_seq_max=6) as ctx:
        root = kvfork.Branch.create(ctx, 0, {"temperature": 0.8})
        await root.prefill(ctx.tokenize(PROMPT))
        for i, trace in enumerate(idiom):
            replay = await root.fork()
            replay.reseed_sampler(1000 + i)
            assert_follows(replay, trace)
            await replay.prune()
    # The two programs place their cells differently (the port interleaves the candidates'
    # one-token decodes, the idiom decodes one candidate after the other), so their rows
    # differ by noise (conftest.LOGIT_NOISE), and a seeded draw whose quantile sits within
    # that noise of a boundary between two tokens may differ: from there on the branch goes
    # its own way. Up to there (and there) the histories are the same and so are the rows,
    # up to noise. (The idiom's stream ends at a stop token; lloyal.node's loop draws again.)
    whole = 0
    for port, own in zip(ported, idiom, strict=True):
        agree = next(
            (k for k, (a, b) in enumerate(zip(port.tokens, own.tokens)) if a != b),
            min(len(port.tokens), len(own.tokens)),
        )
        for k in range(min(agree + 1, len(port.rows), len(own.rows))):
            assert_close_logits(port.rows[k], own.rows[k], f"step {k}")
        whole += agree == len(own.tokens)
    if whole == 5 and all(len(own.tokens) == BEST_OF_N_STEPS for own in idiom):
        assert ported_best == idiom_best
    assert len({tuple(port.tokens) for port in ported}) == 5  # the reseeds made them diverge


# ---- ctx.decode ----


def test_decode_keeps_the_last_output_and_refuses_a_branch_s_sequence(six: kvfork.Context) -> None:
    prompt = six.tokenize(PROMPT)
    six.decode_sync(prompt[:3], 0, 2)
    six.decode_sync(prompt[3:], 3, 2)  # continues the sequence's cells
    assert six.kv_seq_pos_max_sync(2) == len(prompt) - 1
    held = kvfork.Branch.create(six, 0, GREEDY)
    held.prefill_sync(prompt)
    assert six.model_entropy() == held.entropy()  # the branch's decode ran last
    with pytest.raises(ValueError, match="seq_id.*held by branch"):
        six.decode_sync(prompt, 0, held.seq_id)
    assert six.kv_seq_pos_max_sync(held.seq_id) == len(prompt) - 1  # untouched
    end = len(prompt) - 1
    with pytest.raises(ValueError, match=f"cells end at position {end}: the next token goes at"):
        six.decode_sync(prompt, 0, 2)
    with pytest.raises(ValueError, match="seq_id"):
        six.decode_sync(prompt, 0, 6)
    with pytest.raises(ValueError, match="seq_id"):
        six.decode_sync(prompt, 0, -1)
    with pytest.raises(ValueError, match="position"):
        six.decode_sync(prompt, -1, 3)
    with pytest.raises(ValueError, match="tokens"):
        six.decode_sync([], 0, 3)
    with pytest.raises(ValueError, match="token"):
        six.decode_sync([six.vocab_size], 0, 3)
    with pytest.raises(kvfork.KvCacheFullError):
        six.decode_sync(prompt, six.n_ctx - 2, 3)
    assert six.kv_seq_pos_max_sync(3) == -1  # nothing was written by the refused calls


def test_a_long_raw_decode_is_chunked_like_a_prefill(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=512, n_batch=8, n_seq_max=2) as c:
        toks = c.tokenize(PROMPT * 3)
        before = c.stats()["decode_calls"]
        c.decode_sync(toks, 0, 1)
        assert c.stats()["decode_calls"] - before == -(-len(toks) // 8)
        b = kvfork.Branch.create(c, 0, GREEDY)
        b.prefill_sync(toks)
        raw = kvfork.Branch.create(c, len(toks), GREEDY, seq_id=1)
        raw.capture_logits()
        # The same chunks, in other cells: equal up to noise (conftest.LOGIT_NOISE).
        assert_close_logits(raw.logits(), b.logits())
        assert_follows(raw, record(b, 6))


def test_model_entropy_and_surprisal_equal_the_branch_s_after_the_same_decode(
    six: kvfork.Context,
) -> None:
    with pytest.raises(kvfork.KvforkError, match="no output"):
        six.model_entropy()
    prompt = six.tokenize(PROMPT)
    six.decode_sync(prompt, 0, 0)
    raw = (six.model_entropy(), six.model_entropy("bits"), six.model_surprisal(prompt[1]))
    b = kvfork.Branch.create(six, len(prompt), GREEDY, seq_id=0)
    b.capture_logits()  # the raw decode's own output row
    assert raw == (b.entropy(), b.entropy("bits"), b.surprisal(prompt[1]))
    for _ in range(3):  # after a branch's commit, the last output is its snapshot
        b.commit_sync(b.produce_sync())
        assert six.model_entropy() == b.entropy()
        assert six.model_surprisal(7, "bits") == b.surprisal(7, "bits")
    with pytest.raises(ValueError, match="base"):
        six.model_entropy("decibans")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token"):
        six.model_surprisal(six.vocab_size)


# ---- Branch.create over a sequence's cells ----


def test_create_with_seq_id_takes_that_sequence_s_cells_over(six: kvfork.Context) -> None:
    prompt = six.tokenize(PROMPT)
    six.decode_sync(prompt, 0, 3)
    available = six.n_seq_max
    end = len(prompt) - 1
    with pytest.raises(
        ValueError, match=f"cells end at position {end}.*starts at {end + 1} .*not 5"
    ):
        kvfork.Branch.create(six, 5, GREEDY, seq_id=3)
    with pytest.raises(ValueError, match="cells end at position -1"):
        kvfork.Branch.create(six, 4, GREEDY, seq_id=4)  # an empty sequence: position 0 only
    with pytest.raises(ValueError, match="seq_id"):
        kvfork.Branch.create(six, 8, GREEDY, seq_id=6)
    assert kvfork.BranchStore(six).available == available  # the refusals leased nothing
    assert six.kv_seq_pos_max_sync(3) == len(prompt) - 1  # nor touched the cells
    b = kvfork.Branch.create(six, len(prompt), GREEDY, seq_id=3)
    assert (b.seq_id, b.position) == (3, len(prompt))
    with pytest.raises(kvfork.LeaseExhaustedError, match="sequence 3 is held"):
        kvfork.Branch.create(six, len(prompt), GREEDY, seq_id=3)
    empty = kvfork.Branch.create(six, 0, GREEDY, seq_id=5)
    assert empty.seq_id == 5
    b.capture_logits()
    plain = kvfork.Branch.create(six, 0, GREEDY)
    plain.prefill_sync(prompt)  # in other cells: rows equal up to noise
    assert_follows(b, record(plain, 6))


def test_create_past_zero_keeps_the_lowest_free_lease_s_cells_when_they_fit(
    six: kvfork.Context,
) -> None:
    prompt = six.tokenize(PROMPT)
    six.decode_sync(prompt, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept: no warning
        b = kvfork.Branch.create(six, len(prompt), GREEDY)
    assert b.seq_id == 0 and six.kv_seq_pos_max_sync(0) == len(prompt) - 1
    six.decode_sync(prompt, 0, 1)  # the next free lease's cells end elsewhere
    with pytest.warns(kvfork.KvforkWarning, match="position 3.*sequence is empty"):
        other = kvfork.Branch.create(six, 3, GREEDY)
    assert other.seq_id == 1 and six.kv_seq_pos_max_sync(1) == -1  # emptied
    rest = [kvfork.Branch.create(six, 0, GREEDY) for _ in range(six.n_seq_max - 2)]
    assert sorted(r.seq_id for r in rest) == [2, 3, 4, 5]
    with pytest.raises(kvfork.LeaseExhaustedError):
        kvfork.Branch.create(six, len(prompt), GREEDY)


def test_a_branch_over_raw_cells_refuses_a_shift_that_would_drop_their_tokens(
    six: kvfork.Context,
) -> None:
    """It knows only the tokens decoded since it took the cells over: a shift or reseed
    prefilled those alone from position 0, the prompt silently gone."""
    prompt = six.tokenize(PROMPT)
    six.decode_sync(prompt, 0, 2)
    b = kvfork.Branch.create(six, len(prompt), GREEDY, seq_id=2)
    b.capture_logits()
    b.commit_sync(b.sample())
    with pytest.raises(kvfork.KvforkError, match="raw layer decoded"):
        b.shift_context_sync(2)
    with pytest.raises(kvfork.KvforkError, match="raw layer decoded"):
        b.reseed_context_sync(prompt[:2], 4)
    assert b.position == len(prompt) + 1  # untouched
    b.prune_sync()


def test_fork_onto_a_given_sequence(six: kvfork.Context) -> None:
    prompt = six.tokenize(PROMPT)
    parent = kvfork.Branch.create(six, 0, GREEDY)
    parent.prefill_sync(prompt)
    six.decode_sync(six.tokenize("Some other text"), 0, 4)  # raw cells, replaced by the fork
    child = parent.fork_sync(seq_id=4)
    assert child.seq_id == 4 and child.parent == parent
    assert six.kv_seq_pos_max_sync(4) == len(prompt) - 1
    with pytest.raises(kvfork.LeaseExhaustedError, match="sequence 4 is held"):
        parent.fork_sync(seq_id=4)
    with pytest.raises(kvfork.LeaseExhaustedError):
        parent.fork_sync(seq_id=parent.seq_id)
    with pytest.raises(ValueError, match="seq_id"):
        parent.fork_sync(seq_id=99)
    assert_follows(child, record(parent, 5))


# ---- capture_logits, decode_and_capture_one, destroy ----


def test_capture_logits(six: kvfork.Context) -> None:
    prompt = six.tokenize(PROMPT)
    b = kvfork.Branch.create(six, 0, GREEDY, seq_id=2)
    with pytest.raises(kvfork.KvforkError, match="sequence 2 has no output"):
        b.capture_logits()
    b.prefill_sync(prompt)
    before = b.logits()
    b.capture_logits()  # its own decode is the sequence's last output: nothing changes
    assert np.array_equal(b.logits(), before)


def test_decode_and_capture_one_decodes_without_accepting(six: kvfork.Context) -> None:
    prompt = six.tokenize(PROMPT)
    committed = kvfork.Branch.create(six, 0, GREEDY)
    committed.prefill_sync(prompt)
    low = kvfork.Branch.create(six, 0, GREEDY)
    low.prefill_sync(prompt)
    t = committed.produce_sync().token
    committed.commit_sync(t)
    low.decode_and_capture_one_sync(t)
    assert low.position == committed.position and low.history == committed.history
    # The same decode, in other cells: equal up to noise (conftest.LOGIT_NOISE).
    assert_close_logits(low.logits(), committed.logits())
    assert low.perplexity == float("inf")  # not accepted
    split = kvfork.Branch.create(six, 0, GREEDY)
    split.prefill_sync(prompt)
    counted = split.surprisal(t)  # under its own row
    split.accept(t)  # lloyal.node's commit: accept, then decodeAndCaptureOne
    split.decode_and_capture_one_sync(t)
    assert split.perplexity == pytest.approx(math.exp(counted), rel=1e-6)
    assert split.history == committed.history
    with pytest.raises(ValueError, match="token"):
        low.decode_and_capture_one_sync(-1)


async def test_destroy_keeps_the_cells_for_raw_use_and_a_new_takeover(
    six: kvfork.Context,
) -> None:
    prompt = six.tokenize(PROMPT)
    twin = kvfork.Branch.create(six, 0, GREEDY)
    await twin.prefill(prompt)
    b = kvfork.Branch.create(six, 0, GREEDY)
    await b.prefill(prompt)
    child = await b.fork()
    with pytest.raises(kvfork.KvforkError, match="live children"):
        b.destroy()
    assert not b.disposed
    await child.prune()
    store = kvfork.BranchStore(six)
    available, seq, position = store.available, b.seq_id, b.position
    b.destroy()
    assert b.disposed and not b.is_active and store.available == available + 1
    b.destroy()  # a second call is a no-op
    with pytest.raises(kvfork.BranchDisposedError):
        b.sample()
    assert await six.kv_seq_pos_max(seq) == position - 1  # the cells stay
    # Carry on with raw ops on the sequence, then take it over again.
    t = twin.produce_sync().token
    await twin.commit(t)
    await six.decode([t], position, seq)
    again = kvfork.Branch.create(six, position + 1, GREEDY, seq_id=seq)
    again.capture_logits()
    # The same decodes as the twin's, in other cells: equal up to noise (conftest.LOGIT_NOISE).
    assert_close_logits(again.logits(), twin.logits())
    assert_follows(again, record(twin, 5))


def test_a_destroyed_branch_s_snapshot_is_captured_by_the_next_takeover(
    six: kvfork.Context,
) -> None:
    b = kvfork.Branch.create(six, 0, GREEDY)
    b.prefill_sync(six.tokenize(PROMPT))
    logits, seq, position = b.logits(), b.seq_id, b.position
    b.destroy()
    again = kvfork.Branch.create(six, position, GREEDY, seq_id=seq)
    again.capture_logits()
    assert np.array_equal(again.logits(), logits)


def test_the_last_output_outlives_the_destroy_of_the_branch_that_made_it(
    six: kvfork.Context,
) -> None:
    # `destroy` keeps the branch's row as its sequence's output: `model_entropy` (the last
    # output's) still reads it, as lloyal.node's does after a branch is destroyed.
    a = kvfork.Branch.create(six, 0, GREEDY)
    a.prefill_sync(six.tokenize(PROMPT))
    b = a.fork_sync()
    kvfork.BranchStore(six).step_sync([a, b])  # b's row is the decode's last output
    expected = b.entropy(), b.surprisal(3)
    b.destroy()
    assert (six.model_entropy(), six.model_surprisal(3)) == expected
