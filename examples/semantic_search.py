"""Semantic search over a few sentences with embeddings from the default model.

The corpus is embedded once with `embed_batch` (packed into as few decodes as fit); each
query is embedded and the sentences are ranked by cosine similarity (the rows are unit
vectors, so a dot product is the cosine).

usage: python examples/semantic_search.py [QUERY ...]
"""

from __future__ import annotations

import sys

import kvfork
import numpy as np

CORPUS = [
    "Preheat the oven and knead the dough before baking the bread.",
    "The central bank raised interest rates to fight inflation.",
    "The striker scored twice in the second half of the match.",
    "Regular watering keeps tomato plants healthy in summer.",
    "The new phone has a faster processor and a better camera.",
    "The cat curled up on the sofa and fell asleep.",
]
QUERIES = [
    "How do I make a loaf at home?",
    "What happened in the football game?",
    "Tips for growing vegetables in the garden",
]


def search(queries: list[str], top: int = 2) -> dict[str, list[tuple[float, str]]]:
    """The ``top`` corpus sentences for each query, best first, with their cosine."""
    path = kvfork.default_model_path()
    with kvfork.create_context_sync(path, embeddings=True, pooling="mean", n_seq_max=8) as ctx:
        corpus = ctx.embed_batch_sync(CORPUS)
        asked = ctx.embed_batch_sync(queries)
    results = {}
    for query, vector in zip(queries, asked):
        scores = corpus @ vector
        best = np.argsort(-scores)[:top]
        results[query] = [(float(scores[i]), CORPUS[i]) for i in best]
    return results


if __name__ == "__main__":
    for query, hits in search(sys.argv[1:] or QUERIES).items():
        print(query)
        for score, sentence in hits:
            print(f"  {score:.3f}  {sentence}")
