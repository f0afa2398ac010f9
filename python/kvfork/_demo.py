"""`kvfork demo`: what kvfork is, in a few seconds on the default model.

One prompt is prefilled once; N forks share its KV cells (a fork copies no tensor) and
are advanced together, one token each in ONE `llama_decode` per step, shown live side by
side. The winner is the fork with the lowest perplexity. Then the same N generations run
one after another, as a library without forks and batching would run them, and the two
are compared: decodes and speed.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from os import PathLike
from typing import TextIO

from ._native import Branch, BranchStore, Context, SamplingParams
from ._open import create_context
from ._progress import Progress

DEFAULT_PROMPT = "The history of the printing press begins with"


@dataclass
class DemoResult:
    """What the demo measured. ``batched_*`` is the forked run, ``sequential_*`` the same
    generations one after another; decodes are `llama_decode` calls, from ``ctx.stats()``."""

    prompt_tokens: int
    texts: list[str]
    perplexities: list[float]
    winner: int
    batched_tokens: int
    batched_decodes: int
    batched_seconds: float
    sequential_tokens: int
    sequential_decodes: int
    sequential_seconds: float

    @property
    def speedup(self) -> float:
        """Sequential time over batched time, per generated token."""
        batched = self.batched_seconds / max(self.batched_tokens, 1)
        sequential = self.sequential_seconds / max(self.sequential_tokens, 1)
        return sequential / batched


class Lanes:
    """The forks' texts, one lane each, redrawn in place on a terminal every step."""

    def __init__(self, out: TextIO, n: int, live: bool) -> None:
        self.out = out
        self.n = n
        self.live = live
        self.drawn = False
        self.width = max(40, shutil.get_terminal_size((100, 24)).columns - 1)

    def draw(self, texts: list[str], status: str) -> None:
        """Redraw every lane (the tail of its text that fits) and a status line."""
        if not self.live:
            return
        if self.drawn:
            self.out.write(f"\x1b[{self.n + 1}F")  # back to the first lane
        room = self.width - 9
        for i, text in enumerate(texts):
            flat = " ".join(text.split())
            shown = flat if len(flat) <= room else "…" + flat[-(room - 1) :]
            self.out.write(f"\x1b[2K fork {i} │ {shown}\n")
        self.out.write(f"\x1b[2K {status}\n")
        self.out.flush()
        self.drawn = True


async def run(
    model: str | PathLike[str],
    *,
    n: int = 8,
    max_tokens: int = 32,
    prompt: str = DEFAULT_PROMPT,
    seed: int = 1,
    out: TextIO | None = None,
    live: bool | None = None,
) -> DemoResult:
    """Run the demo on ``model``, writing to ``out`` (stdout). ``live`` None: redraw the
    lanes every step when ``out`` is a terminal, else print them once at the end."""
    if n < 1 or max_tokens < 1:
        raise ValueError("the demo needs n >= 1 and max_tokens >= 1")
    out = out if out is not None else sys.stdout
    live = out.isatty() if live is None else live
    with Progress("loading the model"):
        # Room for every fork's tokens beside the prompt's (the prompt takes well under 256).
        ctx = await create_context(
            model, n_ctx=max(1024, 256 + n * (max_tokens + 1)), n_seq_max=n + 1
        )
    with ctx:
        params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        root = Branch.create(ctx, 0, params)
        tokens = ctx.tokenize(prompt)
        await root.prefill(tokens)
        out.write(f"kvfork demo: {n} forks of one prompt, one llama_decode per step\n\n")
        out.write(f"prompt ({len(tokens)} tokens, prefilled once): {prompt}\n\n")
        result = await _batched(ctx, root, n, max_tokens, seed, Lanes(out, n, live))
        with Progress(f"running the same {n} generations one after another"):
            seq_tokens, seq_decodes, seq_seconds = await _sequential(ctx, root, n, max_tokens, seed)
    texts, perplexities, batched_tokens, decodes, seconds = result
    winner = min(range(n), key=lambda i: perplexities[i])
    demo = DemoResult(
        prompt_tokens=len(tokens),
        texts=texts,
        perplexities=perplexities,
        winner=winner,
        batched_tokens=batched_tokens,
        batched_decodes=decodes,
        batched_seconds=seconds,
        sequential_tokens=seq_tokens,
        sequential_decodes=seq_decodes,
        sequential_seconds=seq_seconds,
    )
    _report(out, demo, live, prompt)
    return demo


async def _batched(
    ctx: Context, root: Branch, n: int, max_tokens: int, seed: int, lanes: Lanes
) -> tuple[list[str], list[float], int, int, float]:
    """Fork ``n`` times and step all forks together; (texts, perplexities, tokens, decodes,
    seconds). The forks are pruned before returning."""
    store = BranchStore(ctx)
    decodes_before = ctx.stats()["decode_calls"]
    start = time.perf_counter()
    forks = [await root.fork(seed=seed * 1000 + i) for i in range(n)]
    texts = [""] * n
    running = list(range(n))
    produced = 0
    for step in range(max_tokens):
        if not running:
            break
        drawn = await store.step([forks[i] for i in running])
        produced += len(drawn)
        for i, token in zip(list(running), drawn):
            if token.is_stop:
                running.remove(i)
            else:
                texts[i] += token.text
        elapsed = time.perf_counter() - start
        lanes.draw(texts, f"step {step + 1}/{max_tokens} · {produced / elapsed:.0f} tok/s")
    seconds = time.perf_counter() - start
    decodes = int(ctx.stats()["decode_calls"] - decodes_before)
    perplexities = [fork.perplexity for fork in forks]
    for fork in forks:
        await fork.prune()
    return texts, perplexities, produced, decodes, seconds


async def _sequential(
    ctx: Context, root: Branch, n: int, max_tokens: int, seed: int
) -> tuple[int, int, float]:
    """The same ``n`` generations, one at a time; (tokens, decodes, seconds)."""
    decodes_before = ctx.stats()["decode_calls"]
    start = time.perf_counter()
    produced = 0
    for i in range(n):
        fork = await root.fork(seed=seed * 1000 + i)
        async for _ in fork.generate(max_tokens):
            produced += 1
        await fork.prune()
    seconds = time.perf_counter() - start
    return produced, int(ctx.stats()["decode_calls"] - decodes_before), seconds


def _report(out: TextIO, demo: DemoResult, live: bool, prompt: str) -> None:
    n = len(demo.texts)
    if not live:  # the lanes were not drawn: show every text once
        out.writelines(f" fork {i} │ {' '.join(t.split())}\n" for i, t in enumerate(demo.texts))
    out.write("\nperplexity: ")
    out.write("  ".join(f"fork {i} {p:.2f}" for i, p in enumerate(demo.perplexities)))
    out.write(f"\n\nwinner (lowest perplexity): fork {demo.winner}\n")
    out.write(f"  {prompt}{demo.texts[demo.winner]}\n\n")
    batched_rate = demo.batched_tokens / demo.batched_seconds
    sequential_rate = demo.sequential_tokens / demo.sequential_seconds
    out.write(
        f"forked, one decode per step: {demo.batched_tokens:4d} tokens in "
        f"{demo.batched_decodes:4d} decodes, {demo.batched_seconds:5.2f}s ({batched_rate:.0f} tok/s)\n"
        f"{n} sequential generations:   {demo.sequential_tokens:4d} tokens in "
        f"{demo.sequential_decodes:4d} decodes, {demo.sequential_seconds:5.2f}s "
        f"({sequential_rate:.0f} tok/s)\n"
        f"→ {demo.speedup:.1f}× the speed; the {demo.prompt_tokens}-token prompt was prefilled "
        f"once and shared by every fork (a fork copies no KV tensor)\n"
    )
    out.flush()
