"""Scoring (`Branch.score`, `BranchStore.score`) against what it replaces, one run per model.

Two tables, each variant measured in the same process, best of `--rounds`:
- a long text: `prefill` alone, `score` (the same tokens with every row read);
- ranking answers on forks of one question: each answer's tokens committed one at a time
  (`logprob`, then `commit`: the way before `score`), one `score` call per answer, and one
  `BranchStore.score` for all of them.

    python benchmarks/bench_score.py [--rounds 3] [--tokens 511] [--answers 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import kvfork
from kvfork._models import default_chat_model_path, default_model_path

TEXT = " ".join(f"Line {i}: the printing press spread across Europe." for i in range(64))
QUESTION = "Q: Which city is the capital of France?\nA:"
ANSWERS = [
    " Paris, of course.",
    " Lyon, on the Rhone.",
    " Marseille, by the sea.",
    " Rome, in Italy.",
    " Berlin, in Germany.",
    " Madrid, in Spain.",
    " Vienna, in Austria.",
    " Lisbon, in Portugal.",
]


def best_of(rounds: int, run: Callable[[], None]) -> float:
    """The fastest of `rounds` runs, in seconds."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def long_text(ctx: kvfork.Context, n: int, rounds: int) -> tuple[float, float]:
    """Seconds to prefill, then to score, `n` tokens after a first one."""
    tokens = ctx.tokenize(TEXT)[: n + 1]
    results = []
    for kind in ("prefill", "score"):

        def run(kind: str = kind) -> None:
            b = kvfork.Branch.create(ctx)
            b.prefill_sync(tokens[:1])
            if kind == "prefill":
                b.prefill_sync(tokens[1:])
            else:
                b.score_sync(tokens[1:])
            b.prune_sync()

        results.append(best_of(rounds, run))
    return results[0], results[1]


def ranking(ctx: kvfork.Context, k: int, rounds: int) -> tuple[float, float, float]:
    """Seconds to score `k` answers on forks of one question: token by token, one `score`
    each, one `BranchStore.score`."""
    question = kvfork.Branch.create(ctx)
    question.prefill_sync(ctx.tokenize(QUESTION))
    answers = [ctx.tokenize(a, add_special=False) for a in ANSWERS[:k]]
    store = kvfork.BranchStore(ctx)

    def token_by_token() -> None:
        for answer in answers:
            fork = question.fork_sync()
            for t in answer:
                fork.logprob(t)
                fork.commit_sync(t)
            fork.prune_sync()

    def each() -> None:
        for answer in answers:
            fork = question.fork_sync()
            fork.score_sync(answer)
            fork.prune_sync()

    def packed() -> None:
        forks = [question.fork_sync() for _ in answers]
        store.score_sync(list(zip(forks, answers)))
        for fork in forks:
            fork.prune_sync()

    times = (best_of(rounds, token_by_token), best_of(rounds, each), best_of(rounds, packed))
    question.prune_sync()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=511)
    parser.add_argument("--answers", type=int, default=8, choices=range(1, len(ANSWERS) + 1))
    args = parser.parse_args()
    print("| model | prefill, ms | score, ms | score / prefill |")
    print("|---|---|---|---|")
    rows = []
    for path in (default_model_path(), default_chat_model_path()):
        model = kvfork.Model.load(path)
        with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=args.answers + 2) as ctx:
            prefill, score = long_text(ctx, args.tokens, args.rounds)
            print(
                f"| {path.stem} | {prefill * 1e3:.0f} | {score * 1e3:.0f} | {score / prefill:.2f} |"
            )
            rows.append((path.stem, ranking(ctx, args.answers, args.rounds)))
    print()
    print(
        f"| model | {args.answers} answers: token by token, ms | one score each, ms | one store score, ms |"
    )
    print("|---|---|---|---|")
    for name, (by_token, each, packed) in rows:
        print(
            f"| {name} | {by_token * 1e3:.0f} (x{by_token / packed:.1f}) "
            f"| {each * 1e3:.0f} (x{each / packed:.1f}) | {packed * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
