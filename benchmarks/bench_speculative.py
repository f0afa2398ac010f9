"""Exact speculative decoding (`generate(draft=PromptLookup())`) against plain generation.

Two prompts: repetitive (a list the model copies from the prompt) and ordinary prose. For
each, greedy and seeded sampling; plain and speculative runs interleaved, each on its own
fork of the same prompt, median of `--repeat`. Reports whether the tokens are identical,
the acceptance rate, decodes, whether the guess policy ended up resting (guessing did not
pay), and the speed-up in tokens/s.

usage: python benchmarks/bench_speculative.py [--tokens 64] [--repeat 3] [--max-draft 8]
                                             [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvfork

PROMPTS = {
    "repetitive": (
        "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, "
        "strawberry, tangerine\nCopy: apple, banana,"
    ),
    "prose": "The history of the printing press begins with",
}
CHAINS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 5}}


def run(
    ctx: kvfork.Context, root: kvfork.Branch, n: int, draft: kvfork.PromptLookup | None
) -> tuple[list[int], float, int, float, bool]:
    """(tokens, seconds, decodes, acceptance, resting) of one generation on a fork of
    `root`."""
    b = root.fork_sync()
    before = ctx.stats()["decode_calls"]
    t0 = time.perf_counter()
    if draft is None:
        tokens = [t.token for t in b.generate_sync(n)]
        acceptance, resting = 0.0, False
    else:
        stream = b.generate_sync(n, draft=draft)
        tokens = [t.token for t in stream]
        acceptance, resting = stream.acceptance, stream.schedule.resting
    seconds = time.perf_counter() - t0
    decodes = int(ctx.stats()["decode_calls"] - before)
    b.prune_sync()
    return tokens, seconds, decodes, acceptance, resting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kvfork.set_log_level(40)
    model = kvfork.Model.load(kvfork.default_model_path())
    draft = kvfork.PromptLookup(ngram=3, max_draft=args.max_draft)
    print(f"# Speculative decoding, {model.name}, {args.tokens} tokens, {draft!r}")
    print("| text | chain | same tokens | acceptance | decodes plain / spec | resting | speed-up |")
    print("|---|---|---|---|---|---|---|")
    with kvfork.create_context_sync(model, n_ctx=1024, n_seq_max=3, n_threads=args.threads) as ctx:
        for text, prompt in PROMPTS.items():
            for chain, params in CHAINS.items():
                root = kvfork.Branch.create(ctx, 0, params)
                root.prefill_sync(ctx.tokenize(prompt))
                plain_s, spec_s = [], []
                for _ in range(args.repeat):
                    plain = run(ctx, root, args.tokens, None)
                    spec = run(ctx, root, args.tokens, draft)
                    plain_s.append(plain[1])
                    spec_s.append(spec[1])
                same = "yes" if plain[0] == spec[0] else "NO"
                speedup = statistics.median(plain_s) / statistics.median(spec_s)
                print(
                    f"| {text} | {chain} | {same} | {spec[3]:.0%} | {plain[2]} / {spec[2]} "
                    f"| {'yes' if spec[4] else 'no'} | {speedup:.2f}× |",
                    flush=True,
                )
                root.prune_sync()


if __name__ == "__main__":
    main()
