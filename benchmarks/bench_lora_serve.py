"""Many LoRA adapters in one `kvfork serve`: CLIENTS concurrent requests spread over 4 adapters
against the same requests all on one adapter, and on none, in one run on one server.

llama.cpp applies adapters to the whole context, so a step decodes one group per adapter set
in use (`group_by_adapters`): 4 sets cost 4 decodes of 4 rows where one set costs one decode
of 16. This measures what that costs in tokens per second.

    .venv/bin/python benchmarks/bench_lora_serve.py [--clients 16] [--rounds 3] [--tokens 64]

Default model (Gemma 3 270M), 2 threads, greedy `/v1/completions`, each request its own
~60-token prompt and exactly `--tokens` out (end-of-generation tokens banned); the adapters
are rank-16 LoRAs on every layer's attn_q and ffn_up, written here with the `gguf` package
(random weights: only their cost matters). Configurations are interleaved round by round;
medians over ROUNDS. The server binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvfork
import openai
from bench_serve import ServerSpec, start

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' LoRA writer
from tests.adapter_files import write_lora  # noqa: E402

ADAPTERS = ["a", "b", "c", "d"]
#: The default model's layer count: the adapters touch every layer.
LAYERS = tuple(range(18))


def prompts(n: int) -> list[str]:
    topics = ["rivers", "bridges", "violins", "glaciers", "markets", "comets", "forests", "ports"]
    return [
        f"Request {i}. Write a careful, detailed paragraph about the history of "
        f"{topics[i % len(topics)]} in the region numbered {i * 7 + 3}, citing three facts:"
        for i in range(n)
    ]


def stop_bias() -> dict[str, int]:
    """A logit bias that bans the model's end-of-generation tokens: every request generates
    all its tokens, so each configuration does the same work."""
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=64) as ctx:
        return {str(t): -100 for t in range(ctx.vocab_size) if ctx.is_stop_token(t)}


async def burst(
    url: str, texts: list[str], sets: list[str | None], tokens: int, bias: dict[str, int]
) -> float:
    """All requests at once; generated tokens per second of wall time."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    async def one(prompt: str, adapter: str | None) -> int:
        reply = await client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            logit_bias=bias,
            extra_body={"lora": [adapter] if adapter else []},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == tokens
        return reply.usage.completion_tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p, a) for p, a in zip(texts, sets, strict=True)))
    wall = time.perf_counter() - t0
    await client.close()
    return sum(counts) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as d:
        lora_args: list[str] = []
        for i, name in enumerate(ADAPTERS):
            path = write_lora(
                Path(d) / f"{name}.gguf", seed=i, rank=16, layers=LAYERS, magnitude=0.02
            )
            lora_args += ["--lora", f"{name}={path}"]
        spec = ServerSpec(
            "kvfork",
            lambda port: [
                sys.executable,
                "-m",
                "kvfork",
                "serve",
                "default",
                "--port",
                str(port),
                "--n-ctx",
                "8192",
                "--n-seq-max",
                str(args.clients),
                "--threads",
                "2",
                *lora_args,
            ],
        )
        proc, url, log = start(spec)
        n = args.clients
        configs: dict[str, list[str | None]] = {
            "no adapter": [None] * n,
            "one adapter": ["a"] * n,
            "4 adapters": [ADAPTERS[i % 4] for i in range(n)],
        }
        results: dict[str, list[float]] = {name: [] for name in configs}
        try:
            bias = stop_bias()
            asyncio.run(burst(url, prompts(n), configs["no adapter"], 4, bias))  # warm up
            for r in range(args.rounds):
                for name, sets in configs.items():
                    # Fresh prompts each round and configuration: nothing comes from the cache.
                    texts = [f"[{r}:{name}] {p}" for p in prompts(n)]
                    results[name].append(asyncio.run(burst(url, texts, sets, args.tokens, bias)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    one = statistics.median(results["one adapter"])
    print(f"{n} concurrent requests, {args.tokens} tokens each, median of {args.rounds} rounds")
    print("| configuration | tokens/s | vs one adapter |")
    print("|---|---|---|")
    for name, values in results.items():
        tps = statistics.median(values)
        print(f"| {name} | {tps:.1f} | {tps / one:.2f}x |")


if __name__ == "__main__":
    main()
