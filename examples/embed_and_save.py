"""Embeddings and persistence in one short tour.

1. Rank sentences by cosine similarity with `embed_batch` (one decode for all of them).
2. Save a conversation branch to a file and continue it later, in another context.

usage: python examples/embed_and_save.py [DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import kvfork
import numpy as np

SENTENCES = [
    "A cat was sitting on a mat.",
    "Stock markets fell sharply today.",
    "The kitten slept on the rug.",
]


def rank(query: str) -> list[tuple[float, str]]:
    model = kvfork.default_model_path()
    with kvfork.create_context_sync(model, embeddings=True, pooling="mean", n_seq_max=4) as ctx:
        vectors = ctx.embed_batch_sync([query, *SENTENCES])  # unit rows: dot = cosine
        scores = vectors[1:] @ vectors[0]
        order = np.argsort(-scores)
        return [(float(scores[i]), SENTENCES[i]) for i in order]


def save_and_resume(directory: Path) -> tuple[str, str]:
    model = kvfork.Model.load(kvfork.default_model_path())
    params = kvfork.SamplingParams(temperature=0.8, seed=42)
    path = directory / "story.kvfork"
    with kvfork.create_context_sync(model, n_ctx=1024) as ctx:
        branch = kvfork.Branch.create(ctx, 0, params)
        branch.prefill_sync(ctx.tokenize("Once upon a time, a lighthouse keeper"))
        "".join(t.text for t in branch.generate_sync(16))
        branch.save_sync(path)
        expected = "".join(t.text for t in branch.generate_sync(16))
    with kvfork.create_context_sync(model, n_ctx=512) as later:  # a new context, same model
        resumed = kvfork.Branch.load_sync(later, path)
        continued = "".join(t.text for t in resumed.generate_sync(16))
    return expected, continued


def main() -> None:
    for score, sentence in rank("The cat lay on the carpet."):
        print(f"{score:.3f}  {sentence}")
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    expected, continued = save_and_resume(directory)
    print("saved branch would say: ", repr(expected))
    print("loaded branch says:     ", repr(continued))


if __name__ == "__main__":
    main()
