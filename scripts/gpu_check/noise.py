"""The noise behind the suite's tolerances (tests/conftest.py: LOGIT_NOISE, LOGPROB_NOISE,
MIN_CORRELATION), measured on the backend at hand, so that a GPU run shows whether the GPU
constants still hold: how far two computations of the same history are apart when they differ
only in batch shape or cell placement.

1. packed: prompts of several lengths prefilled together in one packed prefill (small
   decodes) against each prompt alone;
2. forks: FORKS forks of a root stepped together in one decode against a branch stepped alone
   on the same tokens (the alone branch's greedy ones), STEPS steps a prompt.

For each: the largest |logit difference| (and its 99th percentile), the largest difference
among the reference's ten best logits and log-probabilities, and the least correlation of two
rows. One Markdown table row per measure.

usage (PYTHONPATH=site:scripts):
  python -m gpu_check.noise --model PATH [--steps 32] [--forks 8] [--gpu-layers 99]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the river runs to the sea.",
    "Once upon a time in a land far away, there lived",
    "def fibonacci(n):",
    "The capital of France is",
    "Water boils at",
]
#: Prompt lengths of the packed prefill (tokens of a long text), as test_store's.
PACKED = [[5, 9, 3], [40, 2, 17, 30], [100], [8, 8], [64, 33, 7], [120, 90]]


@dataclass
class Noise:
    """Differences between pairs of rows of the same history."""

    name: str
    max_diff: list[float] = field(default_factory=list)
    top_diff: list[float] = field(default_factory=list)
    top_logprob: list[float] = field(default_factory=list)
    correlation: list[float] = field(default_factory=list)

    def add(self, got: npt.NDArray[Any], expected: npt.NDArray[Any]) -> None:
        a = np.asarray(got, dtype=np.float64)
        b = np.asarray(expected, dtype=np.float64)
        diff = np.abs(a - b)
        best = np.argsort(b)[-10:]
        la, lb = a - np.logaddexp.reduce(a), b - np.logaddexp.reduce(b)
        self.max_diff.append(float(diff.max()))
        self.top_diff.append(float(diff[best].max()))
        self.top_logprob.append(float(np.abs(la - lb)[best].max()))
        self.correlation.append(float(np.corrcoef(a, b)[0, 1]))

    def row(self) -> str:
        if not self.max_diff:
            return f"| {self.name} | 0 | - | - | - | - | - |"
        return (
            f"| {self.name} | {len(self.max_diff)} | {max(self.max_diff):.3f} "
            f"| {np.percentile(self.max_diff, 99):.3f} | {max(self.top_diff):.3f} "
            f"| {max(self.top_logprob):.3f} | {min(self.correlation):.5f} |"
        )


HEADER = (
    "| measure | row pairs | max abs logit diff | 99th pct | ten best: logit | "
    "ten best: logprob | least correlation |\n|---|---|---|---|---|---|---|"
)


def packed(kvfork: Any, model: Any) -> Noise:
    noise = Noise("packed prefill / alone")
    with kvfork.create_context_sync(model, n_ctx=2048, n_batch=16, n_seq_max=8) as ctx:
        text = ctx.tokenize(PROMPTS[0] * 30, add_special=False)
        for lens in PACKED:
            branches = [kvfork.Branch.create(ctx, 0) for _ in lens]
            kvfork.BranchStore(ctx).prefill_sync([(b, text[:n]) for b, n in zip(branches, lens)])
            for b, n in zip(branches, lens):
                alone = kvfork.Branch.create(ctx, 0)
                alone.prefill_sync(text[:n])
                noise.add(b.logits(), alone.logits())
                alone.prune_sync()
            for b in branches:
                b.prune_sync()
    return noise


def forks(kvfork: Any, model: Any, n_forks: int, steps: int) -> Noise:
    noise = Noise(f"{n_forks} forks stepped together / alone")
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=n_forks + 2) as ctx:
        store = kvfork.BranchStore(ctx)
        for prompt in PROMPTS:
            alone = kvfork.Branch.create(ctx, 0)
            alone.prefill_sync(ctx.tokenize(prompt))
            root = kvfork.Branch.create(ctx, 0)
            root.prefill_sync(ctx.tokenize(prompt))
            family = [root, *(root.fork_sync() for _ in range(n_forks - 1))]
            for _ in range(steps):
                row = alone.logits()
                for f in family:
                    noise.add(f.logits(), row)
                token = int(np.argmax(row))
                alone.commit_sync(token)
                store.commit_sync([(f, token) for f in family])
            for b in [*reversed(family), alone]:  # the forks before their root
                b.prune_sync()
    return noise


def measure(model_path: str | Path, steps: int, n_forks: int, gpu_layers: int | None) -> str:
    import kvfork

    model = kvfork.Model.load(model_path, n_gpu_layers=gpu_layers)
    backend = kvfork.system_info()["backend"]
    lines = [f"{Path(model_path).name} on {backend}:", "", HEADER]
    lines.append(packed(kvfork, model).row())
    lines.append(forks(kvfork, model, n_forks, steps).row())
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--gpu-layers", type=int, default=99)
    args = parser.parse_args(argv)
    print(measure(args.model, args.steps, args.forks, args.gpu_layers), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
