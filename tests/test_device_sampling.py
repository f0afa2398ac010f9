"""`create_context(device_sampling=True)`: each row's best 64 logits found inside llama.cpp's
graph, the branch's chain drawing from them on the host. On a CPU build the graph runs on
llama.cpp's CPU backend, the same path a GPU runs, so these tests check its semantics
anywhere: the draws (greedy and seeded, forks, reseeds, hot swaps) and perplexities of host
rows, one decode a step, parking and speculation as before; whole rows, per sequence, for
the branches whose chains need them; clear errors where a row stayed on the device."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import kvfork
import numpy as np
import numpy.typing as npt
import pytest

from .conftest import (
    GREEDY,
    LOGIT_NOISE,
    NEAR_TIE,
    ON_CPU,
    PERPLEXITY_NOISE,
    PROMPT,
    assert_close_logits,
    assert_same_greedy,
    greedy_tokens,
    greedy_with_margins,
    margin,
    root,
)
from .family_models import FAMILIES, RECURRENT

#: Log-probabilities of one token under the device's f32 log-partition and the host's f64
#: one, over the same or a re-batched row (measured: 2e-6 apart on the same history).
LOGPROB_ROUNDING = 1e-3


@pytest.fixture
def dev_ctx(model: kvfork.Model) -> Iterator[kvfork.Context]:
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=8, device_sampling=True) as c:
        yield c


def test_greedy_tokens_and_perplexity_equal_those_of_host_rows(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    host, dev = root(ctx), root(dev_ctx)
    drawn = dev.sample()
    assert drawn == host.sample()
    assert dev.logprob(drawn) == pytest.approx(host.logprob(drawn), abs=LOGPROB_ROUNDING)
    expected, margins = greedy_with_margins(host, 24)
    got = greedy_tokens(dev, 24)
    assert_same_greedy(got, expected, margins)
    if got == expected:
        assert dev.perplexity == pytest.approx(host.perplexity, rel=1e-4)
        assert dev.sampling_perplexity == pytest.approx(host.sampling_perplexity, rel=1e-4)
        assert dev.perplexity > 1.0


def test_the_chat_models_greedy_tokens_equal_those_of_host_rows(
    chat_ctx: kvfork.Context, chat_model: kvfork.Model
) -> None:
    """The same on the chat model, whose vocabulary (49,152) is no power of two, unlike the
    default model's (262,144): the device's best 64 must be found over all of it. (On an
    H100, `kvfork serve --device-sampling` on this model answered other than host rows.)"""
    with kvfork.create_context_sync(
        chat_model, n_ctx=2048, n_seq_max=4, device_sampling=True
    ) as dev_ctx:
        for text in (PROMPT, "What is the capital of France? The capital of France is"):
            host, dev = root(chat_ctx, text), root(dev_ctx, text)
            expected, margins = greedy_with_margins(host, 16)
            assert_same_greedy(greedy_tokens(dev, 16), expected, margins)
            dev.prune_sync()
            host.prune_sync()


def test_a_store_step_of_forks_is_one_decode_and_draws_what_the_host_draws(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    expected, margins = greedy_with_margins(root(ctx), 12)
    parent = root(dev_ctx)
    branches = [parent, *(parent.fork_sync() for _ in range(3))]
    store = kvfork.BranchStore(dev_ctx)
    got: list[list[int]] = [[] for _ in branches]
    for _ in range(12):
        before = dev_ctx.stats()["decode_calls"]
        for row, t in zip(got, store.step_sync(branches)):
            row.append(t.token)
        assert dev_ctx.stats()["decode_calls"] - before == 1
    for tokens in got:
        assert_same_greedy(tokens, expected, margins)
    # A fork takes its parent's draw with it.
    child = branches[1].fork_sync()
    assert child.sample() == branches[1].sample()


def test_seeded_chains_draw_what_they_draw_from_host_rows(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """The chain draws from the device's candidates with its own RNG, so a seeded chain, a
    fork reseeded, a reseed and a hot swap to another chain draw what they draw from the
    host's rows. Both contexts run the same decodes over the same cells, so the rows, and
    with them the candidates, are the same: the draws are equal, not only near."""

    def run(c: kvfork.Context) -> tuple[list[int], ...]:
        b = root(c, PROMPT, kvfork.SamplingParams(seed=7))
        child = b.fork_sync(seed=99)
        first = [t.token for t in b.generate_sync(12)]
        b.reseed_sampler(5)
        second = [t.token for t in b.generate_sync(6)]
        b.set_sampler_params(kvfork.SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=3))
        third = [t.token for t in b.generate_sync(6)]
        kid = [t.token for t in child.generate_sync(8)]
        return first, second, third, kid

    host, dev = run(ctx), run(dev_ctx)
    assert dev == host
    h, d = root(ctx), root(dev_ctx)
    got, expected = d.top_logprobs(64), h.top_logprobs(64)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=LOGPROB_ROUNDING)


def decodes_to_read(c: kvfork.Context, b: kvfork.Branch) -> int:
    """Read `b`'s row; how many decodes that took: 1 when the device kept it (the branch's
    last token decoded again), 0 when the branch had it."""
    before = c.stats()["decode_calls"]
    row = b.logits()
    assert row is not None and len(row) == c.vocab_size
    return int(c.stats()["decode_calls"] - before)


def test_reading_a_row_the_device_kept_decodes_it_again_and_rows_follow(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """A greedy branch's rows stay on the device. Reading one decodes its last token again
    (one decode) and gives the row of the same history over the same cells, and the branch
    gets rows from then on (reading costs nothing after the next decode); its forks too.
    What the device kept answers without a decode."""
    host, b = root(ctx), root(dev_ctx)
    drawn = b.sample()
    before = dev_ctx.stats()["decode_calls"]
    top, expected_top = b.top_logprobs(5), host.top_logprobs(5)
    assert [t for t, _ in top] == [t for t, _ in expected_top]
    assert [lp for _, lp in top] == pytest.approx(
        [lp for _, lp in expected_top], abs=LOGPROB_ROUNDING
    )
    assert dev_ctx.stats()["decode_calls"] == before  # the device's candidates answered
    assert decodes_to_read(dev_ctx, b) == 1
    row = b.logits()
    assert_close_logits(row, host.logits())  # a one-token decode against the prefill's row
    if margin(row) >= NEAR_TIE:
        assert int(np.argmax(row)) == drawn
    assert b.entropy() == pytest.approx(row_entropy(row), rel=1e-4)  # of that very row
    expected_tokens, margins = greedy_with_margins(host, 6)
    assert_same_greedy(greedy_tokens(b, 6), expected_tokens, margins)
    assert decodes_to_read(dev_ctx, b) == 0
    child = b.fork_sync()
    child.commit_sync(child.sample())
    assert decodes_to_read(dev_ctx, child) == 0


def row_entropy(row: npt.NDArray[np.float32]) -> float:
    """Entropy in nats of the softmax of `row`."""
    logp = row_logprobs(row)
    return float(-(np.exp(logp) * logp).sum())


def row_logprobs(row: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Log-softmax of `row`."""
    x = row.astype(np.float64)
    top = float(x.max())
    log_sum_exp = top + float(np.log(np.exp(x - top).sum()))
    return x - log_sum_exp


@pytest.mark.parametrize("read", ["top_logprobs", "logprob", "entropy", "model_entropy"])
def test_every_reader_of_the_row_gets_it(
    ctx: kvfork.Context, dev_ctx: kvfork.Context, read: str
) -> None:
    """Each reader that needs more than the device's 64 candidates gets the row decoded
    again (one decode), and reads that row, close to a context's without device sampling."""
    host = root(ctx)
    unlikely = int(host.logits().argmin())  # far outside the best 64
    b = root(dev_ctx)
    before = dev_ctx.stats()["decode_calls"]
    reads: dict[str, Callable[[], object]] = {
        "top_logprobs": lambda: [lp for _, lp in b.top_logprobs(65)],
        "logprob": lambda: b.logprob(unlikely),
        "entropy": b.entropy,
        "model_entropy": dev_ctx.model_entropy,
    }
    got = reads[read]()
    assert dev_ctx.stats()["decode_calls"] - before == 1
    row = b.logits()  # the row that answered: no decode more
    assert dev_ctx.stats()["decode_calls"] - before == 1
    assert_close_logits(row, host.logits())
    logp = row_logprobs(row)
    from_row: dict[str, Callable[[], object]] = {
        "top_logprobs": lambda: sorted(logp.tolist(), reverse=True)[:65],
        "logprob": lambda: float(logp[unlikely]),
        "entropy": lambda: row_entropy(row),
        "model_entropy": lambda: row_entropy(row),
    }
    expected = from_row[read]()
    # The decode aside left the context's last output where it was: the branch's.
    assert dev_ctx.model_entropy() == pytest.approx(b.entropy(), rel=1e-9)
    assert got == pytest.approx(expected, rel=1e-4, abs=LOGPROB_ROUNDING)


def test_committing_a_token_the_device_did_not_keep_decodes_its_row_first(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """A token outside the device's candidates has no probability to count until the row is
    decoded again: `commit` and `accept` of it take one decode more, and count what host
    rows count."""
    host = root(ctx)
    unlikely = int(host.logits().argmin())
    host.commit_sync(unlikely)
    committed = root(dev_ctx)
    before = dev_ctx.stats()["decode_calls"]
    committed.commit_sync(unlikely)
    assert dev_ctx.stats()["decode_calls"] - before == 2
    accepted = root(dev_ctx)
    accepted.accept(unlikely)
    accepted.commit_sync(unlikely)
    for b in (committed, accepted):
        # The token's surprisal, from another decode's row than the host's (far down the
        # ranking, where rows differ most).
        assert math.log(b.perplexity) == pytest.approx(math.log(host.perplexity), abs=LOGIT_NOISE)
        assert b.position == host.position
        assert_same_greedy([b.sample()], [host.sample()], [margin(host.logits())])
    # Any candidate commits without a row; prefill takes any tokens.
    b = root(dev_ctx)
    before = dev_ctx.stats()["decode_calls"]
    b.commit_sync(b.top_logprobs(64)[-1][0])
    b.prefill_sync(dev_ctx.tokenize(" and then"))
    assert dev_ctx.stats()["decode_calls"] - before == 2


ROW_CHAINS: dict[str, Callable[[kvfork.Branch], None]] = {
    "whole-vocabulary": lambda b: b.set_sampler_params(kvfork.SamplingParams(top_k=0, seed=1)),
    "top-k-over-64": lambda b: b.set_sampler_params(kvfork.SamplingParams(top_k=100, seed=2)),
    "penalties": lambda b: b.set_sampler_params(
        kvfork.SamplingParams(temperature=0.0, repeat_penalty=1.3)
    ),
    "grammar": lambda b: b.set_grammar('root ::= (" yes" | " no" | " maybe")+'),
    "bias": lambda b: b.set_logit_bias({int(b.sample()): -100.0}),
    "steer": lambda b: b.steer({int(b.sample()): -100.0}),
}


def row_branch(c: kvfork.Context, setup: Callable[[kvfork.Branch], None]) -> kvfork.Branch:
    """A branch whose chain needs whole rows, set up before the decode it samples from."""
    b = root(c, "Is the sky blue?")
    setup(b)
    b.prefill_sync(c.tokenize(" Answer:"))
    return b


@pytest.mark.parametrize("chain", ROW_CHAINS.values(), ids=ROW_CHAINS.keys())
def test_chains_that_need_the_whole_row_get_it(
    ctx: kvfork.Context, dev_ctx: kvfork.Context, chain: Callable[[kvfork.Branch], None]
) -> None:
    """A grammar, a bias, a steer or a draw from more than the device's candidates: the
    branch's sequence gives its whole row from the next decode on, and the branch draws
    what it draws in a context without device sampling (the same decodes over the same
    cells: equal tokens), beside a greedy branch of the same store step that keeps drawing
    from the device's candidates, in one decode."""

    def run(c: kvfork.Context) -> tuple[list[int], list[int]]:
        needs, plain = row_branch(c, chain), root(c)
        store = kvfork.BranchStore(c)
        steps = [store.step_sync([needs, plain]) for _ in range(6)]
        return [a.token for a, _ in steps], [b.token for _, b in steps]

    before = dev_ctx.stats()["decode_calls"]
    assert run(dev_ctx) == run(ctx)
    assert dev_ctx.stats()["decode_calls"] - before == 3 + 6  # three prefills, one a step
    needs, plain = row_branch(dev_ctx, chain), root(dev_ctx)
    assert decodes_to_read(dev_ctx, needs) == 0  # a row came back
    assert decodes_to_read(dev_ctx, plain) == 1  # the greedy branch's stayed on the device


def biased_margin(b: kvfork.Branch, banned: int) -> float:
    """The greedy margin of `b`'s row with `banned` pushed down by 100 (its logit bias)."""
    row = b.logits()
    assert row is not None
    row = row.copy()
    row[banned] -= 100.0
    return margin(row)


def test_a_chain_that_comes_to_need_the_row_gets_it_decoded_again(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """A grammar or a bias set after the decode whose output the device drew: `sample()`,
    `produce` and store steps decode the last token again, row asked for (one decode), and
    draw what a context without device sampling draws (another decode than the reference's:
    the margin rule). A sequence goes back to the device's candidates when a branch that
    needs none takes it over."""
    lates: tuple[Callable[[kvfork.Branch], int], ...] = (
        lambda b: b.produce_sync().token,
        lambda b: b.sample(),
    )
    for late in lates:
        b = root(dev_ctx)
        b.set_grammar('root ::= " yes" | " no"')
        decodes = dev_ctx.stats()["decode_calls"]
        text = dev_ctx.detokenize([late(b)])
        assert dev_ctx.stats()["decode_calls"] - decodes == 1  # the last token, again
        assert text and (" yes".startswith(text) or " no".startswith(text))
        assert b.sample() == b.produce_sync().token  # the row is the branch's output now
        assert dev_ctx.stats()["decode_calls"] - decodes == 1
        b.commit_sync(b.sample())  # a decode of its own sequence, row asked for
        assert decodes_to_read(dev_ctx, b) == 0

    def biased_fork_steps(c: kvfork.Context) -> tuple[list[list[int]], list[list[float]]]:
        """A fork given a bias against its parent's next token, stepped beside it: each
        branch's tokens, and on host rows their margins (the fork's under its bias)."""
        parent = root(c)
        child = parent.fork_sync()
        banned = parent.sample()
        child.set_logit_bias({banned: -100.0})
        store = kvfork.BranchStore(c)
        tokens: list[list[int]] = [[], []]
        margins: list[list[float]] = [[], []]
        for _ in range(4):
            if not c.device_sampling:
                margins[0].append(margin(parent.logits()))
                margins[1].append(biased_margin(child, banned))
            for got, t in zip(tokens, store.step_sync([parent, child])):
                got.append(t.token)
        return tokens, margins

    expected, margins = biased_fork_steps(ctx)
    got, _ = biased_fork_steps(dev_ctx)  # after a decode more: other cells, the margin rule
    for g, e, m in zip(got, expected, margins):
        assert_same_greedy(g, e, m)
    seq = b.seq_id
    b.prune_sync()
    after = kvfork.Branch.create(dev_ctx, 0, GREEDY, seq_id=seq)
    after.prefill_sync(dev_ctx.tokenize(PROMPT))
    assert after.sample() == root(ctx).sample()
    assert decodes_to_read(dev_ctx, after) == 1  # the device drew its output


class Rebuilt(NamedTuple):
    """What `test_a_recurrent_state_is_rebuilt_to_decode_a_token_again` sees in a context."""

    tokens: list[int]
    row: npt.NDArray[np.float32]
    replayed: int
    late: int
    late_margin: float
    late_replayed: int


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_a_recurrent_state_is_rebuilt_to_decode_a_token_again(
    family_models: Callable[[str], kvfork.Model], family: str
) -> None:
    """On a recurrent state (pure or hybrid) the spare sequence is rebuilt from the branch's
    last checkpoint (the prompt's end) with the tokens after it decoded again: a reader, and
    a chain that came to need the row after the device drew, get the row of the same
    history as host rows, and draw what host rows draw (the margin rule: other batches)."""
    model = family_models(family)
    generated = 4

    def run(device_sampling: bool) -> Rebuilt:
        with kvfork.create_context_sync(
            model, n_ctx=512, n_seq_max=2, device_sampling=device_sampling
        ) as c:
            reader = root(c)
            tokens = greedy_tokens(reader, generated)
            before = c.stats()["replayed_tokens"]
            row = reader.logits()
            assert row is not None
            replayed = int(c.stats()["replayed_tokens"] - before)
            late = root(c)
            greedy_tokens(late, generated)
            banned = late.sample()  # the device's draw: no row read
            late.set_logit_bias({banned: -100.0})
            late_margin = 0.0 if device_sampling else biased_margin(late, banned)
            before = c.stats()["replayed_tokens"]
            produced = late.produce_sync().token
            late_replayed = int(c.stats()["replayed_tokens"] - before)
            return Rebuilt(tokens, row, replayed, produced, late_margin, late_replayed)

    host, dev = run(False), run(True)
    assert dev.tokens == host.tokens  # the same decodes over the same cells
    since_the_prompt = generated - 1
    assert (host.replayed, dev.replayed) == (0, since_the_prompt)
    assert (host.late_replayed, dev.late_replayed) == (0, since_the_prompt)
    assert_close_logits(dev.row, host.row)
    assert_same_greedy([dev.late], [host.late], [host.late_margin])


def test_the_scratch_prefill_gives_rows_to_the_branches_that_need_them(
    model: kvfork.Model,
) -> None:
    """New prompts prefilled together beside a busy cache go through the scratch context on
    the CPU (which samples on the device too): the branch whose chain needs its row gets
    it there, the greedy one the device's candidates."""
    with kvfork.create_context_sync(
        model, n_ctx=1024, n_batch=32, n_seq_max=4, device_sampling=True
    ) as c:
        busy = root(c, " ".join([PROMPT] * 12))  # over 2 x n_batch cells
        needs, plain = kvfork.Branch.create(c, 0, GREEDY), kvfork.Branch.create(c, 0, GREEDY)
        banned = busy.sample()
        needs.set_logit_bias({banned: -100.0})
        prompts = [c.tokenize(f"{i} and {i + 1} make") for i in (1, 2)]
        kvfork.BranchStore(c).prefill_sync([(needs, prompts[0]), (plain, prompts[1])])
        if ON_CPU:
            assert int(c.stats()["scratch_tokens"]) == sum(map(len, prompts))
        assert decodes_to_read(c, needs) == 0
        assert decodes_to_read(c, plain) == 1
        row = needs.logits()
        assert row is not None
        biased = row.copy()
        biased[banned] -= 100.0
        assert needs.produce_sync().token == int(np.argmax(biased))  # from that very row


async def test_a_prompt_riding_steps_gets_its_row(model: kvfork.Model) -> None:
    """A long prompt prefilled while another branch steps rides the steps' decodes in
    chunks (continuous batching): its last chunk's output is a row for a branch that needs
    one, beside the stepping branch's device draws."""
    async with kvfork.create_context(
        model, n_ctx=2048, n_batch=64, n_seq_max=4, device_sampling=True
    ) as c:
        stepping = root(c)
        needs = kvfork.Branch.create(c, 0, GREEDY)
        needs.set_logit_bias({stepping.sample(): -100.0})
        before = int(c.stats()["mixed_decodes"])
        task = asyncio.create_task(needs.prefill(c.tokenize(" ".join([PROMPT] * 16))))
        for _ in range(64):
            if task.done():
                break
            await stepping.commit(await stepping.produce())
        await task
        assert int(c.stats()["mixed_decodes"]) > before
        assert decodes_to_read(c, needs) == 0
        assert decodes_to_read(c, stepping) == 1


def test_speculation_under_a_grammar_gets_rows(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """A speculative round's verification outputs are whole rows for a branch that needs
    them: the grammar-constrained stream yields its one legal text, as without device
    sampling (guess lengths follow timings, so the batches may differ: the text is compared,
    not the tokenization)."""
    text = " apple, banana, cherry, date"

    def run(c: kvfork.Context) -> str:
        b = kvfork.Branch.create(c, 0, GREEDY, grammar=f'root ::= "{text}"')
        b.prefill_sync(c.tokenize("List: apple, banana, cherry, date\nCopy:"))
        stream = b.generate_sync(16, draft=kvfork.PromptLookup())
        out = "".join(t.text for t in stream)
        assert stream.stop_reason == "stop_token"
        return out

    assert run(dev_ctx) == run(ctx) == text


def test_a_long_prompt_through_the_scratch_and_parked_branches(
    ctx: kvfork.Context, model: kvfork.Model
) -> None:
    """A prompt long enough for the scratch prefill context (which gets the draws too), and
    branches that outnumber their leases (`park`): each draws what the host draws."""
    long_prompt = " ".join([PROMPT] * 40)
    expected, margins = greedy_with_margins(root(ctx, long_prompt), 6)
    with kvfork.create_context_sync(
        model, n_ctx=4096, n_seq_max=2, park=True, device_sampling=True
    ) as dev:
        parent = root(dev, long_prompt)
        branches = [parent, *(parent.fork_sync() for _ in range(3))]
        assert not all(b.is_active for b in branches)
        got: list[list[int]] = [[] for _ in branches]
        for _ in range(6):
            for tokens, b in zip(got, branches):
                t = b.produce_sync().token
                b.commit_sync(t)
                tokens.append(t)
        for tokens in got:
            assert_same_greedy(tokens, expected, margins)


def test_speculation_draws_what_plain_generation_draws(dev_ctx: kvfork.Context) -> None:
    text = (
        "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango, nectarine, orange, papaya\nCopy: apple, banana,"
    )
    plain, spec = root(dev_ctx, text), root(dev_ctx, text)
    expected = [t.token for t in plain.generate_sync(16)]
    before = dev_ctx.stats()["decode_calls"]
    stream = spec.generate_sync(16, draft=kvfork.PromptLookup())
    got = [t.token for t in stream]
    # Same context, same cells' history: a difference can only be a near-tie of rows that
    # a verification batch computed; none on this prompt.
    assert got == expected
    assert (
        stream.accepted > 0
        and stream.rounds < 16
        and dev_ctx.stats()["decode_calls"] - before == stream.rounds
    )
    assert spec.perplexity == pytest.approx(plain.perplexity, rel=PERPLEXITY_NOISE)


def test_a_speculative_stream_takes_a_chain_that_needs_rows_mid_stream(
    model: kvfork.Model,
) -> None:
    """A hot swap to a chain that needs its whole row (a repeat penalty) after the device drew
    the last output: the round decodes the last token again for the row, as plain generation
    does (it raised KvforkError), and draws what a context of rows draws."""
    text = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6,"
    runs = []
    for device in (True, False):
        with kvfork.create_context_sync(
            model, n_ctx=512, n_seq_max=4, device_sampling=device
        ) as ctx:
            b = root(ctx, text)
            got = []
            for i, t in enumerate(b.generate_sync(16, draft=kvfork.PromptLookup())):
                got.append(t.token)
                if i == 3:
                    b.set_sampler_params({"temperature": 0.0, "repeat_penalty": 1.5})
            runs.append(got)
    assert runs[0] == runs[1]


def test_the_raw_layer_gives_rows_and_takes_a_device_draw_over(
    ctx: kvfork.Context, dev_ctx: kvfork.Context
) -> None:
    """A raw `decode`'s output is a whole row (the raw layer knows no tokens to decode again
    for a read), which a branch created over the sequence captures; a destroyed branch's
    device draw is captured as it is, and capturing again after the branch's own decode
    changes nothing."""
    tokens = dev_ctx.tokenize(PROMPT)
    dev_ctx.decode_sync(tokens, 0, 3)
    before = dev_ctx.stats()["decode_calls"]
    ctx.decode_sync(tokens, 0, 3)
    assert dev_ctx.model_entropy() == pytest.approx(ctx.model_entropy(), rel=1e-4)
    b = kvfork.Branch.create(dev_ctx, len(tokens), GREEDY, seq_id=3)
    b.capture_logits()
    assert decodes_to_read(dev_ctx, b) == 0
    assert dev_ctx.stats()["decode_calls"] == before
    reference = root(dev_ctx)
    assert b.sample() == reference.sample()
    b.commit_sync(b.sample())
    drawn, top, seq, position = b.sample(), b.top_logprobs(5), b.seq_id, b.position
    b.capture_logits()  # its own decode's output already
    assert b.sample() == drawn
    b.destroy()
    again = kvfork.Branch.create(dev_ctx, position, GREEDY, seq_id=seq)
    again.capture_logits()
    assert (again.sample(), again.top_logprobs(5)) == (drawn, top)
    with pytest.raises(kvfork.KvforkError, match="destroyed branch"):
        again.logits()  # no token of its own to decode again
    again.commit_sync(again.sample())
    assert decodes_to_read(dev_ctx, again) == 0  # the read asked for rows: this decode's


@pytest.mark.parametrize("family", ["mamba", "lfm2"])
def test_a_recurrent_branch_over_raw_cells_gets_its_rows(
    family_models: Callable[[str], kvfork.Model], family: str
) -> None:
    """A branch taking a recurrent sequence the raw layer decoded over knows none of its
    tokens: the state it took over is its first checkpoint, so a row the device kept after
    its own decodes is still decoded again for a read (those tokens replayed), and close to
    host rows' (the same history, other batches)."""
    model = family_models(family)

    def run(device_sampling: bool) -> tuple[list[int], npt.NDArray[np.float32]]:
        with kvfork.create_context_sync(
            model, n_ctx=512, n_seq_max=2, device_sampling=device_sampling
        ) as c:
            tokens = c.tokenize(PROMPT)
            c.decode_sync(tokens, 0, 1)
            b = kvfork.Branch.create(c, len(tokens), GREEDY, seq_id=1)
            b.capture_logits()
            generated = greedy_tokens(b, 3)
            row = b.logits()
            assert row is not None
            return generated, row

    (host_tokens, host_row), (dev_tokens, dev_row) = run(False), run(True)
    assert dev_tokens == host_tokens
    assert_close_logits(dev_row, host_row)


def test_device_sampling_is_refused_for_embeddings(model: kvfork.Model) -> None:
    with pytest.raises(ValueError, match="device_sampling"):
        kvfork.create_context_sync(model, embeddings=True, device_sampling=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_draws_on_the_device_what_it_draws_from_rows(
    family_models: Callable[[str], kvfork.Model], family: str
) -> None:
    """Recurrent, hybrid, mixture-of-experts and sliding-window models (the tiny ones of
    `family_models.py`): a root and a fork of it (on sequence 1) draw what host rows draw.
    Both contexts run the same decodes over the same cells, so the tokens are equal."""
    model = family_models(family)

    def run(device_sampling: bool) -> tuple[list[int], list[int]]:
        with kvfork.create_context_sync(
            model, n_ctx=1024, n_seq_max=4, device_sampling=device_sampling
        ) as c:
            b = root(c, PROMPT, kvfork.SamplingParams(seed=11))
            first = greedy_tokens(b, 6)
            child = b.fork_sync()
            return first + greedy_tokens(b, 4), greedy_tokens(child, 4)

    assert run(True) == run(False)


def test_a_saved_branch_keeps_what_the_device_kept(
    dev_ctx: kvfork.Context, model: kvfork.Model, tmp_path: Path
) -> None:
    """`Branch.save` writes the device's candidates in place of a row: the loaded branch
    draws, scores and goes on as the saved one (its own RNG too), here and in another
    device-sampling context."""
    b = root(dev_ctx, PROMPT, kvfork.SamplingParams(seed=3))
    greedy_tokens(b, 5)
    b.save_sync(tmp_path / "b.kvfork")
    before = (b.top_logprobs(10), b.perplexity, b.sampling_perplexity)
    expected = [t.token for t in b.generate_sync(8)]
    same = kvfork.Branch.load_sync(dev_ctx, tmp_path / "b.kvfork")
    assert (same.top_logprobs(10), same.perplexity, same.sampling_perplexity) == before
    assert decodes_to_read(dev_ctx, same) == 1  # the row stayed where it was drawn
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2, device_sampling=True) as c:
        moved = kvfork.Branch.load_sync(c, tmp_path / "b.kvfork")
        assert [t.token for t in moved.generate_sync(8)] == expected


def test_one_candidate_keeps_greedy_on_the_device_and_gives_rows_to_the_rest(
    model: kvfork.Model, ctx: kvfork.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVFORK_DEVICE_CANDIDATES=1`: the stage keeps each row's best alone (an argmax, cheaper
    on a GPU than the top-k's sort). Greedy draws on the device what it draws from host rows,
    in one decode a step; the device's best and log-partition give the host's log-probability;
    a chain that cuts to a larger top-k gets its rows and draws what it draws from them; asking
    for more than the best decodes the row again, as for any row kept on the device."""
    monkeypatch.setenv("KVFORK_DEVICE_CANDIDATES", "1")
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=4, device_sampling=True) as one:
        host, dev = root(ctx), root(one)
        drawn = dev.sample()
        assert drawn == host.sample()
        assert dev.logprob(drawn) == pytest.approx(host.logprob(drawn), abs=LOGPROB_ROUNDING)
        expected, margins = greedy_with_margins(host, 16)
        before = one.stats()["decode_calls"]
        got = greedy_tokens(dev, 16)
        assert_same_greedy(got, expected, margins)
        assert one.stats()["decode_calls"] - before == 16  # no decode again for a row
        before = one.stats()["decode_calls"]
        best_two = dev.top_logprobs(2)
        assert one.stats()["decode_calls"] - before == 1 and len(best_two) == 2
        seeded = kvfork.SamplingParams(temperature=1.2, top_k=20, seed=3)
        draws = [[t.token for t in root(c, PROMPT, seeded).generate_sync(8)] for c in (ctx, one)]
        assert draws[1] == draws[0]


@pytest.mark.parametrize("value", ["0", "65", "-1", "junk", ""])
def test_a_candidate_count_out_of_range_is_refused_naming_the_variable(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """`KVFORK_DEVICE_CANDIDATES` outside [1, 64], or not a count, is an error when a
    device-sampling context is made (0 and junk quietly chose the argmax mode or the
    default); a context without device sampling does not read it."""
    monkeypatch.setenv("KVFORK_DEVICE_CANDIDATES", value)
    with pytest.raises(ValueError, match="KVFORK_DEVICE_CANDIDATES"):
        kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2, device_sampling=True)
    kvfork.create_context_sync(model, n_ctx=512, n_seq_max=2).close()


def test_the_stage_is_made_once_a_decode_not_once_a_row(
    model: kvfork.Model, caplog: pytest.LogCaptureFixture
) -> None:
    """The stage's nodes are made once over all of a decode's output rows; each row gets two
    views of them. llama.cpp reports the nodes of the graph it reserves for one token of
    every sequence: with 64 sequences the stage adds a few nodes a sequence, not the ten or
    so a row that were ~640 small kernels a step on a GPU (BENCHMARKS §29)."""
    n_seq = 64

    def token_graph_nodes(device_sampling: bool) -> int:
        caplog.clear()
        with kvfork.create_context_sync(
            model, n_ctx=2048, n_seq_max=n_seq, device_sampling=device_sampling
        ) as c:
            b = root(c, "Hello")
            kvfork.BranchStore(c).step_sync([b] + [b.fork_sync() for _ in range(n_seq - 1)])
        found = [
            int(m.group(1))
            for r in caplog.records
            # "graph: nodes = N, ..." or, when they differ, "graph (pp bs=.., tg bs=..): nodes
            # = PROMPT / TOKEN, ..."
            if (m := re.search(r"graph[^:]*: nodes = (?:\d+ / )?(\d+)", r.getMessage()))
        ]
        assert found, "llama.cpp reported no graph reserve"
        return found[-1]

    caplog.set_level(logging.INFO, logger="kvfork")
    kvfork.set_log_level(logging.INFO)
    try:
        rows, device = token_graph_nodes(False), token_graph_nodes(True)
    finally:
        kvfork.set_log_level(logging.WARNING)
    assert 0 < device - rows <= 3 * n_seq, (rows, device)


def test_a_branch_saved_where_the_device_drew_loads_into_a_context_of_rows(
    dev_ctx: kvfork.Context, ctx: kvfork.Context, tmp_path: Path
) -> None:
    """A branch saved from a device-sampling context, loaded into one without (`Branch.load`
    and `Context.restore`), gets its row decoded again there: it reads, scores any token,
    takes a grammar and commits as the same branch saved from host rows does (once, at the
    load: no decode after it for a read)."""
    b = root(dev_ctx)
    b.save_sync(tmp_path / "dev.kvfork")
    dev_ctx.save_state_sync(tmp_path / "dev.ctx")
    host = root(ctx)
    host_row = host.logits()

    def check(loaded: kvfork.Branch) -> None:
        before = ctx.stats()["decode_calls"]
        row = loaded.logits()
        assert ctx.stats()["decode_calls"] == before
        assert_close_logits(row, host_row)
        exact = row.astype(np.float64)
        assert loaded.logprob(5) == pytest.approx(exact[5] - np.logaddexp.reduce(exact), abs=1e-6)
        assert loaded.entropy() > 0.0
        fork = loaded.fork_sync()
        fork.set_grammar('root ::= " yes"')
        piece = ctx.detokenize([fork.produce_sync().token])
        assert piece and " yes".startswith(piece)
        fork.prune_sync()
        loaded.fork_sync().commit_sync(5)

    loaded = kvfork.Branch.load_sync(ctx, tmp_path / "dev.kvfork")
    check(loaded)
    for branch in (loaded, host):
        branch.prune_subtree_sync()
    (restored,) = ctx.load_state_sync(tmp_path / "dev.ctx")
    check(restored)


def test_the_scratch_context_keeps_the_candidates_its_context_was_made_with(
    model: kvfork.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVFORK_DEVICE_CANDIDATES` is read when a context is created; the scratch context that
    prefills a batch of prompts, created later, keeps its context's count whatever the
    variable says by then: a top-k 40 branch prefilled there draws without a decode more."""
    monkeypatch.delenv("KVFORK_DEVICE_CANDIDATES", raising=False)
    seeded = kvfork.SamplingParams(temperature=1.5, top_k=40, seed=1)
    with kvfork.create_context_sync(
        model, n_ctx=1024, n_batch=32, n_seq_max=4, device_sampling=True
    ) as c:
        monkeypatch.setenv("KVFORK_DEVICE_CANDIDATES", "1")
        # Prompts go through the scratch beside a branch that holds cells.
        root(c, " ".join([PROMPT] * 12))
        a, b = kvfork.Branch.create(c, 0, seeded), kvfork.Branch.create(c, 0, seeded)
        store = kvfork.BranchStore(c)
        store.prefill_sync([(a, c.tokenize("My favourite colour is")), (b, c.tokenize("I eat"))])
        assert c.stats()["scratch_tokens"] > 0
        before = c.stats()["decode_calls"]
        a.sample()
        assert c.stats()["decode_calls"] == before
