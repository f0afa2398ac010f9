"""Per-token cost of sampling under a JSON schema vs without, at N = 1 and N = 8.

The schema is applied two ways: `set_json_schema` (llguidance) and the GBNF of
`json_schema_to_grammar` through `set_grammar` (llama.cpp's grammar sampler).

Every variant runs in the same process on the same prompt, with the default sampler chain
(top_k 40, top_p 0.95, min_p 0.05, temperature 0.8) and with greedy:
- `sample()`: the time of one `Branch.sample()` on the first snapshot (N = 1, no decode);
- `step`: `BranchStore.step` over N branches; host time = wall time minus the time inside
  `llama_decode`, per generated token.

usage: python benchmarks/bench_sampling.py [--steps 16] [--repeat 3] [--n 1 8] [--no-sample]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import kvfork

PROMPT = "A list of people as JSON:"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# At least 8 people: no branch finishes within the steps, so every step decodes N tokens in
# every variant (a finished branch would leave the batch and change the cost per token).
SCHEMA = {"type": "array", "items": PERSON, "minItems": 8}
CHAINS = {
    "default chain": kvfork.SamplingParams(seed=7),
    "greedy": kvfork.SamplingParams(temperature=0.0),
}


Constrain = Callable[[kvfork.Branch], None] | None


def branches(
    ctx: kvfork.Context, n: int, constrain: Constrain, params: kvfork.SamplingParams
) -> list[kvfork.Branch]:
    root = kvfork.Branch.create(ctx, 0, params)
    root.prefill_sync(ctx.tokenize(PROMPT))
    if constrain is not None:
        constrain(root)
    kids = [root.fork_sync() for _ in range(n - 1)]
    for i, kid in enumerate(kids):
        kid.reseed_sampler(100 + i)
    return [root, *kids]


def sample_us(
    model: kvfork.Model, grammar: Constrain, params: kvfork.SamplingParams, calls: int = 50
) -> float:
    """Median time of one `sample()` on a fixed snapshot."""
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1, n_threads=2) as ctx:
        (b,) = branches(ctx, 1, grammar, params)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            b.sample()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


def step_host(
    model: kvfork.Model, n: int, grammar: Constrain, params: kvfork.SamplingParams, steps: int
) -> tuple[float, float]:
    """(tokens/s, host µs per generated token) of `steps` store steps over n branches."""
    with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=n, n_threads=2) as ctx:
        live = branches(ctx, n, grammar, params)
        store = kvfork.BranchStore(ctx)
        s0 = ctx.stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            store.step_sync(live)
        wall = time.perf_counter() - t0
        s1 = ctx.stats()
        tokens = int(s1["decoded_tokens"]) - int(s0["decoded_tokens"])
        decode = float(s1["decode_seconds"]) - float(s0["decode_seconds"])
        return tokens / wall, (wall - decode) / max(tokens, 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the best is kept")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 8], help="branch counts")
    parser.add_argument("--no-sample", action="store_true", help="skip the sample() table")
    args = parser.parse_args()
    kvfork.set_log_level(40)
    model = kvfork.Model.load(kvfork.default_model_path())
    gbnf = kvfork.json_schema_to_grammar(SCHEMA)
    variants: dict[str, Constrain] = {
        "none": None,
        "JSON schema (llguidance)": lambda b: b.set_json_schema(SCHEMA),
        "JSON schema as GBNF (llama.cpp)": lambda b: b.set_grammar(gbnf),
    }
    print(f"# Sampling cost, {model.name}, steps={args.steps}, best of {args.repeat}")
    if not args.no_sample:
        print("\n| chain | constraint | sample() on the first snapshot (N = 1) |")
        print("|---|---|---|")
        for chain, params in CHAINS.items():
            for name, g in variants.items():
                best = min(sample_us(model, g, params) for _ in range(args.repeat))
                print(f"| {chain} | {name} | {best:.1f} µs |", flush=True)
    print(
        "\n| N | chain | constraint | tokens/s | ms per token | × unconstrained "
        "| host time per token (wall − llama_decode) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.n:
        for chain, params in CHAINS.items():
            # Variants interleaved run by run, so a slow spell of the machine hits all of them.
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            for _ in range(args.repeat):
                for name, g in variants.items():
                    runs[name].append(step_host(model, n, g, params, args.steps))
            free = max(r[0] for r in runs["none"])
            for name, results in runs.items():
                rate = max(r[0] for r in results)
                host = min(r[1] for r in results)
                print(
                    f"| {n} | {chain} | {name} | {rate:.1f} | {1000 / rate:.2f} "
                    f"| {free / rate:.2f}× | {host:.0f} µs |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
